//! Rule 8 of `cargo xtask tidy`: the attempt machine of `outbox-events` is laid in floors with
//! no circle (ARCHITECTURE.md, "Architecture invariants"). A module's non-test code names
//! (`crate::name`) only modules on a lower floor, or foundations (every module [`FLOORS`] does
//! not list: configuration, handlers, metrics, the claim queue, ...), which in turn name none of
//! the listed ones. So fences and beats sit at the bottom, the two drivers of one per-event state
//! machine (one event's attempt, the batch) above them, the dispatcher on top.

use super::{SourceFile, Violation};

/// Where the rule applies.
const SOURCE_DIR: &str = "crates/outbox-events/src/";

/// The floors, bottom first; a submodule (`batch/settle.rs`) stands on its parent's floor.
pub(super) const FLOORS: &[&[&str]] = &[
    // What every driver stands on: how an attempt ends, the failure it records, the worker's
    // environment.
    &["env"],
    // Fences and beats.
    &["heartbeat"],
    // Bookkeeping on the side: detached failures, releases, give-backs.
    &["detached"],
    // One event's attempt.
    &["attempt"],
    // The batched attempt, which runs single attempts for the rows that may not share.
    &["batch"],
    // How a worker waits for work and backs off.
    &["waits"],
    // What drives the attempts: the runner for services that claim themselves, the legacy loop.
    &["runner", "legacy"],
    // The dispatcher.
    &["dispatcher"],
];

/// The floor of `module` (1 and up), or 0 for a foundation.
fn floor(module: &str) -> usize {
    FLOORS
        .iter()
        .position(|floor| floor.contains(&module))
        .map_or(0, |i| i + 1)
}

/// The module a file of `outbox-events` belongs to (`batch/settle.rs` → `batch`), or `None`
/// for the crate root, its test files and files elsewhere.
fn module_of(path: &str) -> Option<&str> {
    let rest = path.strip_prefix(SOURCE_DIR)?;
    let first = rest.split('/').next()?;
    let module = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(module, "lib" | "tests")).then_some(module)
}

/// The modules `text` names as `crate::name` or in `crate::{a, b::c}`, with their lines.
fn named(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let inner = group.split('}').next().unwrap_or("");
                for item in inner.split(',') {
                    let name = item.trim().split("::").next().unwrap_or("").trim();
                    found.push((n + 1, name.to_string()));
                }
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                found.push((n + 1, name));
            }
        }
    }
    found
}

/// Checks every file of the crate: no module names one on its own floor or above.
pub(super) fn check(files: &[SourceFile], violations: &mut Vec<Violation>) {
    let modules: Vec<&str> = files.iter().filter_map(|f| module_of(&f.path)).collect();
    for file in files {
        let Some(module) = module_of(&file.path) else {
            continue;
        };
        // Test code (a `#[cfg(test)]` module at the end of the file) may name anything.
        let code = file.text.split("#[cfg(test)]").next().unwrap_or("");
        for (line, name) in named(code) {
            if name == module || !modules.contains(&name.as_str()) {
                continue;
            }
            let (own, theirs) = (floor(module), floor(&name));
            if theirs != 0 && theirs >= own {
                violations.push(Violation {
                    path: file.path.clone(),
                    line,
                    message: format!(
                        "`{module}` (floor {own}) names `{name}` (floor {theirs}): the attempt machine's modules name only lower floors (xtask/src/tidy/floors.rs)"
                    ),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, text: &str) -> SourceFile {
        SourceFile {
            path: path.into(),
            text: text.into(),
        }
    }

    #[test]
    fn a_module_may_name_only_lower_floors_and_foundations() {
        let dir = SOURCE_DIR;
        let files = [
            file(&format!("{dir}env.rs"), "//! e\nuse crate::config::X;\n"),
            file(&format!("{dir}config.rs"), "//! c\n"),
            file(
                &format!("{dir}heartbeat.rs"),
                "//! h\nuse crate::attempt::AttemptEnv;\n",
            ),
            file(
                &format!("{dir}attempt.rs"),
                "//! a\nuse crate::{env::A, heartbeat::Beat};\n#[cfg(test)]\nuse crate::dispatcher;\n",
            ),
            file(
                &format!("{dir}batch/settle.rs"),
                "//! s\nuse crate::dispatcher::x;\n",
            ),
            file(&format!("{dir}dispatcher.rs"), "//! d\nuse crate::batch;\n"),
            file(
                &format!("{dir}metrics.rs"),
                "//! m\nuse crate::env::AttemptOutcome;\n",
            ),
            file(
                &format!("{dir}lib.rs"),
                "//! l\npub use crate::dispatcher::D;\n",
            ),
        ];
        let mut found = Vec::new();
        check(&files, &mut found);
        let found: Vec<(String, usize)> = found.into_iter().map(|v| (v.path, v.line)).collect();
        assert_eq!(
            found,
            vec![
                (format!("{dir}heartbeat.rs"), 2),
                (format!("{dir}batch/settle.rs"), 2),
                (format!("{dir}metrics.rs"), 2),
            ]
        );
    }
}
