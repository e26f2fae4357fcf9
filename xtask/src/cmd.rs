//! Running a child command from the workspace root, echoing it first and its duration after.

use std::fmt;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::project_root;

/// A command to run in the workspace root, with the environment variables it adds.
pub struct Cmd {
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Cmd {
    /// A `cargo` command with `args`.
    pub fn cargo<S: AsRef<str>>(args: &[S]) -> Self {
        Self {
            program: "cargo".to_string(),
            args: args.iter().map(|arg| arg.as_ref().to_string()).collect(),
            env: Vec::new(),
        }
    }

    /// A command running `program` with `args`.
    pub fn program<S: AsRef<str>>(program: &str, args: &[S]) -> Self {
        Self {
            program: program.to_string(),
            args: args.iter().map(|arg| arg.as_ref().to_string()).collect(),
            env: Vec::new(),
        }
    }

    /// Appends `args` to the command's arguments.
    pub fn args<S: AsRef<str>>(mut self, args: &[S]) -> Self {
        self.args
            .extend(args.iter().map(|arg| arg.as_ref().to_string()));
        self
    }

    /// Adds an environment variable to the command's environment.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// Runs the command with inherited stdout and stderr, echoing it before and its duration
    /// after; fails when it cannot start or exits unsuccessfully.
    pub fn run(&self) -> Result<()> {
        println!("$ {self}");
        let started = Instant::now();
        let status = self
            .command()
            .status()
            .with_context(|| format!("could not start `{self}`"))?;
        let took = format_duration(started.elapsed());
        if !status.success() {
            println!("  `{self}` failed after {took}");
            bail!("`{self}` exited with {status}");
        }
        println!("  `{self}` finished in {took}");
        Ok(())
    }

    /// Runs the command quietly and returns its stdout; stderr is passed through so that cargo's
    /// own errors stay visible.
    pub fn output(&self) -> Result<Vec<u8>> {
        let output = self
            .command()
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("could not start `{self}`"))?;
        if !output.status.success() {
            bail!("`{self}` exited with {}", output.status);
        }
        Ok(output.stdout)
    }

    fn command(&self) -> Command {
        // The cargo that started xtask (`$CARGO`), so that every step uses the same toolchain.
        let program = match self.program.as_str() {
            "cargo" => std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()),
            other => other.into(),
        };
        let mut command = Command::new(program);
        command
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(project_root());
        command
    }
}

impl fmt::Display for Cmd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (key, value) in &self.env {
            write!(f, "{key}={} ", shell_quote(value))?;
        }
        f.write_str(&self.program)?;
        for arg in &self.args {
            write!(f, " {}", shell_quote(arg))?;
        }
        Ok(())
    }
}

/// Quotes `word` for display when a shell would split it.
fn shell_quote(word: &str) -> String {
    if !word.is_empty() && !word.contains(|c: char| c.is_whitespace() || "'\"$\\".contains(c)) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A duration as a person reads it: `850ms`, `12.3s`, `2m 05s`.
pub fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis < 1_000 {
        format!("{millis}ms")
    } else if millis < 60_000 {
        format!("{:.1}s", duration.as_secs_f64())
    } else {
        let secs = duration.as_secs();
        format!("{}m {:02}s", secs / 60, secs % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_display_as_a_shell_line_with_their_environment() {
        let cmd =
            Cmd::cargo(&["doc", "--workspace", "--no-deps"]).env("RUSTDOCFLAGS", "-D warnings");
        assert_eq!(
            cmd.to_string(),
            "RUSTDOCFLAGS='-D warnings' cargo doc --workspace --no-deps"
        );
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(format_duration(Duration::from_millis(850)), "850ms");
        assert_eq!(format_duration(Duration::from_millis(12_340)), "12.3s");
        assert_eq!(format_duration(Duration::from_secs(125)), "2m 05s");
    }
}
