//! The workspace's release binaries that xtask drives as separate processes: `outbox` (package
//! `outbox-cli`, the operator binary), `outbox-demo` (the demo workload) and `outbox-bench` (the
//! benchmark). They are built with `cargo build --release` and found in cargo's target
//! directory as `cargo metadata` reports it, so `CARGO_TARGET_DIR` and cargo configuration are
//! honoured.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

use crate::cmd::Cmd;

/// A binary of the workspace: its package and its file name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binary {
    /// The package that builds it (`cargo build -p PACKAGE`).
    pub package: &'static str,
    /// The executable's file name in the profile's directory.
    pub name: &'static str,
}

/// The operator binary: `migrate`, `status`, `events`, `retry`, `explain`, `consumers`, `gate`,
/// and `demo`, which runs the `outbox-demo` binary found next to it.
pub const OUTBOX: Binary = Binary {
    package: "outbox-cli",
    name: "outbox",
};

/// The demo workload: the demo itself and `seed`, `work`, `verify`, `consumers`, `gate`.
pub const DEMO: Binary = Binary {
    package: "outbox-demo",
    name: "outbox-demo",
};

/// The benchmark against PostgreSQL ceilings.
pub const BENCH: Binary = Binary {
    package: "outbox-bench",
    name: "outbox-bench",
};

/// Cargo's target directory, from `cargo metadata --format-version 1 --no-deps`.
pub fn target_dir() -> Result<PathBuf> {
    let stdout = Cmd::cargo(&["metadata", "--format-version", "1", "--no-deps"]).output()?;
    let metadata: Value =
        serde_json::from_slice(&stdout).context("`cargo metadata` printed invalid JSON")?;
    target_directory(&metadata)
}

fn target_directory(metadata: &Value) -> Result<PathBuf> {
    metadata["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .context("`cargo metadata` names no target_directory")
}

/// The release binaries of one `cargo build --release`.
#[derive(Debug)]
pub struct Release {
    /// Cargo's target directory.
    target: PathBuf,
}

impl Release {
    /// Builds `binaries` in release (one cargo invocation) and finds where they are.
    pub fn build(binaries: &[Binary]) -> Result<Self> {
        let mut args = vec!["build", "--release"];
        for binary in binaries {
            args.extend(["-p", binary.package]);
        }
        Cmd::cargo(&args).run()?;
        Ok(Self {
            target: target_dir()?,
        })
    }

    /// The path of `binary`'s executable.
    pub fn path(&self, binary: Binary) -> PathBuf {
        self.target.join("release").join(binary.name)
    }

    /// Cargo's target directory (where a run may keep its logs).
    pub fn target(&self) -> &Path {
        &self.target
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_directory_is_cargos() {
        let metadata = serde_json::json!({ "target_directory": "/elsewhere/target" });
        assert_eq!(
            target_directory(&metadata).unwrap(),
            PathBuf::from("/elsewhere/target")
        );
        assert!(target_directory(&serde_json::json!({})).is_err());
    }
}
