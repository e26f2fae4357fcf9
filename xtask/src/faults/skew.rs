//! A work process whose wall clock runs behind: the binary is started with Debian's
//! libfaketime preloaded (`LD_PRELOAD`, `FAKETIME=-40`), with the monotonic clock left alone
//! (`DONT_FAKE_MONOTONIC=1`, so its timers and heartbeats keep their pace). The library is
//! preloaded straight into the `outbox` process rather than through the `faketime` wrapper
//! command, which forks: the suite's signals must reach the worker itself.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

/// How far behind the skewed process's wall clock runs, in seconds.
pub const SKEW_SECONDS: i64 = 40;

/// Whether the suite can run a skewed process.
#[derive(Debug, Clone)]
pub enum Skew {
    /// The library was found and shown to move `date` back by [`SKEW_SECONDS`].
    Ready(PathBuf),
    /// It cannot (outside CI only): why.
    Unavailable(String),
}

/// Where Debian's `libfaketime` package puts the library on this machine's architecture.
fn library() -> PathBuf {
    PathBuf::from(format!(
        "/usr/lib/{}-linux-gnu/faketime/libfaketime.so.1",
        std::env::consts::ARCH
    ))
}

/// Sets the environment that runs `cmd` with its wall clock [`SKEW_SECONDS`] behind.
pub fn apply(cmd: &mut Command, library: &Path) {
    cmd.env("LD_PRELOAD", library)
        .env("FAKETIME", format!("-{SKEW_SECONDS}"))
        .env("DONT_FAKE_MONOTONIC", "1");
}

/// Finds the library and checks once that it skews a process's clock (`date +%s` under it
/// must read about [`SKEW_SECONDS`] behind). Under CI a missing or ineffective library is an
/// error (`.ci/run` installs Debian's `faketime`); otherwise the suite runs without the skewed
/// process and says so.
pub fn prepare(ci: bool) -> Result<Skew> {
    let library = library();
    let found = match check(&library) {
        Ok(()) => return Ok(Skew::Ready(library)),
        Err(e) => e,
    };
    if ci {
        return Err(found.context(
            "the fault suite needs libfaketime under CI (apt-get install faketime; .ci/run does it)",
        ));
    }
    Ok(Skew::Unavailable(format!("{found:#}")))
}

fn check(library: &Path) -> Result<()> {
    if !library.exists() {
        bail!(
            "{} is missing (Debian package libfaketime)",
            library.display()
        );
    }
    let mut date = Command::new("date");
    date.arg("+%s");
    apply(&mut date, library);
    let output = date.output().context("running date under libfaketime")?;
    let faked: i64 = String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .context("date +%s printed no number under libfaketime")?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let behind = now - faked;
    if (behind - SKEW_SECONDS).abs() > 5 {
        bail!(
            "date +%s under {} reads {behind} s behind, not about {SKEW_SECONDS}",
            library.display()
        );
    }
    Ok(())
}
