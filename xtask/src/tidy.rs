//! `cargo xtask tidy`: the invariants of `ARCHITECTURE.md` and the house rules that can be read
//! off the source text, checked by a machine so that they hold by CI and not by habit. It walks
//! every `.rs` file of the workspace (not `target/`, not hidden directories; `migrations/` holds
//! SQL and is not read) and prints `path:line: message` for each violation of these rules:
//!
//! 1. The outbox table's name, `_System_OutboxEvent` (any case), appears only where the table's
//!    SQL may be known: `outbox-persistence`, test code under a `tests/` directory (the
//!    `outbox-tests` package and each crate's integration tests), and the exceptions of
//!    [`TABLE_KNOWERS`], each with its reason.
//! 2. A backend pool type (`PgPool`, `SqlitePool`, `Pool<Postgres>`, `Pool<Sqlite>`,
//!    `PgPoolOptions`, `SqlitePoolOptions`) appears only in the crates that hold a connection
//!    to a backend of their own ([`POOL_HOLDERS`]) and in test code under `tests/`.
//! 3. Every `.rs` file begins with a `//!` header (its first non-blank line), saying what it
//!    holds.
//! 4. No test is ignored (the `ignore` attribute): a test that does not run is a claim that
//!    nobody checks.
//! 5. Every library crate (a package under `crates/` or `examples/` with a `src/lib.rs`)
//!    carries `#![warn(missing_docs)]` or `#![deny(missing_docs)]`, so that CI's
//!    `clippy -D warnings` turns an undocumented public item into an error.
//! 6. Outside test code (a `tests/` directory, a `tests.rs` file, a `#[cfg(test)]` module), no
//!    file is longer than [`MAX_FILE_LINES`] lines and no function longer than
//!    [`MAX_FN_LINES`], unless [`LONG_ALLOWED`] names it with a reason. Functions are found by
//!    a scanner ([`scan`]) that skips comments and literals, not by a parser.
//! 7. In `outbox-persistence`'s PostgreSQL code ([`PREPARED_DIRS`]), every `sqlx::query`,
//!    `sqlx::query_as` and `sqlx::query_scalar` states `.persistent(…)` before the statement's
//!    first `.await`: behind a transaction pooler a statement sqlx names and caches
//!    collides with other clients' (docs/deployment.md), so each one says whether it may be
//!    cached. `sqlx::raw_sql` prepares nothing and needs no mark.
//! 8. The attempt machine of `outbox-events` is laid in floors with no circle: a module names
//!    only modules of lower floors and foundations ([`floors::FLOORS`]).

mod floors;
mod scan;

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::project_root;

/// Where rule 7 applies.
const PREPARED_DIRS: &[&str] = &["crates/outbox-persistence/src/postgres/"];

/// How many lines after `sqlx::query…(` rule 7 looks for the statement's `.await`.
const STATEMENT_LINES: usize = 40;

/// The outbox table, matched without regard to case.
const OUTBOX_TABLE: &str = "_System_OutboxEvent";

/// The types of a connection pool to one backend.
const POOL_TYPES: &[&str] = &[
    "PgPoolOptions",
    "SqlitePoolOptions",
    "PgPool",
    "SqlitePool",
    "Pool<Postgres>",
    "Pool<Sqlite>",
];

/// The longest non-test file, in lines.
const MAX_FILE_LINES: usize = 600;

/// The longest non-test function, in lines from its `fn` to its closing brace.
const MAX_FN_LINES: usize = 80;

/// The attribute that ignores a test, spelled in two pieces so that this file does not carry it.
const IGNORE_ATTRIBUTE: &str = concat!("#[", "ignore");

/// Where a name may appear, besides test code under a `tests/` directory.
struct Allowed {
    /// Directories (with their trailing `/`) whose files may name it.
    dirs: &'static [&'static str],
    /// Single files that may name it, each with the reason.
    exceptions: &'static [(&'static str, &'static str)],
}

/// Who may name the outbox table (rule 1): only `outbox-persistence` knows the table's SQL.
const TABLE_KNOWERS: Allowed = Allowed {
    dirs: &["crates/outbox-persistence/", "tests/"],
    exceptions: &[
        (
            "crates/create-action/src/ident.rs",
            "lists the reserved names that it refuses to register as an object",
        ),
        (
            "crates/create-action/src/registry.rs",
            "a unit test that registering the reserved name is refused",
        ),
        ("xtask/src/tidy.rs", "names the table to look for it"),
        (
            "xtask/src/faults/steps.rs",
            "a fault: an outside session locks claimed rows, as a DBA's query would",
        ),
    ],
};

/// Who may name a backend pool type (rule 2).
const POOL_HOLDERS: Allowed = Allowed {
    dirs: &[
        "crates/outbox-persistence/",
        // It runs on the handler's backend connection, and its redelivery test kit opens pools.
        "crates/create-action/",
        // It measures PostgreSQL ceilings on tables of its own.
        "crates/outbox-bench/",
        "tests/",
    ],
    exceptions: &[
        ("xtask/src/tidy.rs", "names the types to look for them"),
        (
            "crates/outbox-demo/src/sink.rs",
            "its side store begins READ COMMITTED on PostgreSQL and plainly on SQLite, a trait \
             implemented for both pool types",
        ),
        (
            "xtask/src/deps.rs",
            "names the types in the rule that keeps sqlx out of outbox-events",
        ),
    ],
};

/// A file, or one function of it, allowed past the length limits of rule 6.
struct Long {
    path: &'static str,
    /// The function's name; `None` for the file's length.
    function: Option<&'static str>,
    /// Why it is better long than split.
    #[allow(dead_code)]
    reason: &'static str,
}

/// The files and functions allowed past [`MAX_FILE_LINES`] and [`MAX_FN_LINES`], each with the
/// reason. Empty: every long piece is split.
const LONG_ALLOWED: &[Long] = &[];

/// A `.rs` file of the workspace.
struct SourceFile {
    /// Its path from the workspace root, with `/` between components.
    path: String,
    text: String,
}

/// One broken rule at one place.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Violation {
    path: String,
    line: usize,
    message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.path, self.line, self.message)
    }
}

/// `cargo xtask tidy`: checks every `.rs` file and prints each violation.
pub fn run() -> Result<()> {
    let root = project_root();
    let mut files = Vec::new();
    collect(&root, &root, &mut files)?;
    let mut violations = check(&files);
    check_allowlists(&files, &mut violations);
    if violations.is_empty() {
        println!("tidy: ok ({} files checked)", files.len());
        return Ok(());
    }
    for violation in &violations {
        println!("{violation}");
    }
    bail!(
        "tidy: {} violation(s) in {} files; the rules and their allowlists are in xtask/src/tidy.rs",
        violations.len(),
        files.len()
    )
}

/// Adds the `.rs` files under `dir` to `files`, in path order, skipping hidden directories,
/// `target/`, `migrations/` and any other directory that cargo marked as a build output
/// (`CACHEDIR.TAG`, as in a `CARGO_TARGET_DIR` inside the workspace).
fn collect(root: &Path, dir: &Path, files: &mut Vec<SourceFile>) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<Result<_, _>>()?;
    entries.sort_by_key(|entry| entry.file_name());
    for entry in entries {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.file_type()?.is_dir() {
            let skipped = name.starts_with('.')
                || name == "target"
                || name == "migrations"
                || path.join("CACHEDIR.TAG").exists();
            if !skipped {
                collect(root, &path, files)?;
            }
        } else if name.ends_with(".rs") {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let relative = path.strip_prefix(root).unwrap_or(&path);
            let components: Vec<_> = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            files.push(SourceFile {
                path: components.join("/"),
                text,
            });
        }
    }
    Ok(())
}

/// Every violation of the rules in `files`, sorted by place (the allowlists are checked apart,
/// by [`check_allowlists`]).
fn check(files: &[SourceFile]) -> Vec<Violation> {
    let mut violations = Vec::new();
    let test_files = test_files(files);
    for file in files {
        check_names(file, &mut violations);
        check_header(file, &mut violations);
        check_lengths(file, test_files.contains(&file.path), &mut violations);
        check_persistent(file, &mut violations);
        if is_library_root(&file.path) {
            check_missing_docs(file, &mut violations);
        }
    }
    floors::check(files, &mut violations);
    violations.sort();
    violations
}

/// Whether `path` lies under a `tests/` directory (a crate's integration tests, the
/// `outbox-tests` package).
fn in_tests_dir(path: &str) -> bool {
    let mut dirs = path.split('/').rev().skip(1);
    dirs.any(|dir| dir == "tests")
}

/// Whether `path` may name what `allowed` guards.
fn may_name(path: &str, allowed: &Allowed) -> bool {
    in_tests_dir(path)
        || allowed.dirs.iter().any(|dir| path.starts_with(dir))
        || allowed.exceptions.iter().any(|(file, _)| *file == path)
}

/// Rules 1, 2 and 4, line by line (comments included: a comment that names the table is as
/// much a claim about it as code).
fn check_names(file: &SourceFile, violations: &mut Vec<Violation>) {
    let table = OUTBOX_TABLE.to_ascii_lowercase();
    let may_name_table = may_name(&file.path, &TABLE_KNOWERS);
    let may_name_pools = may_name(&file.path, &POOL_HOLDERS);
    for (index, line) in file.text.lines().enumerate() {
        let mut report = |message: String| {
            violations.push(Violation {
                path: file.path.clone(),
                line: index + 1,
                message,
            })
        };
        if !may_name_table && line.to_ascii_lowercase().contains(&table) {
            report(format!(
                "names the outbox table `{OUTBOX_TABLE}`: only outbox-persistence knows its SQL; \
                 go through the repository (or outbox-persistence's test support)"
            ));
        }
        if !may_name_pools && let Some(pool) = POOL_TYPES.iter().find(|p| line.contains(*p)) {
            report(format!(
                "names the backend pool type `{pool}`: only outbox-persistence, create-action, \
                 outbox-bench and tests hold a pool"
            ));
        }
        if line.contains(IGNORE_ATTRIBUTE) {
            report("an ignored test: make it run, or delete it".to_string());
        }
    }
}

/// Rule 7: a statement of the persistence crate's PostgreSQL code says whether it may be
/// cached.
fn check_persistent(file: &SourceFile, violations: &mut Vec<Violation>) {
    if !PREPARED_DIRS.iter().any(|dir| file.path.starts_with(dir)) {
        return;
    }
    let lines: Vec<&str> = file.text.lines().collect();
    for (index, line) in lines.iter().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        let statement = ["sqlx::query(", "sqlx::query_as(", "sqlx::query_scalar("]
            .iter()
            .any(|s| code.contains(s));
        if !statement {
            continue;
        }
        let end = (index + STATEMENT_LINES).min(lines.len());
        let awaited = lines[index..end]
            .iter()
            .position(|l| l.contains(".await"))
            .map_or(end, |at| index + at + 1);
        if !lines[index..awaited]
            .iter()
            .any(|l| l.contains(".persistent("))
        {
            violations.push(Violation {
                path: file.path.clone(),
                line: index + 1,
                message: "a PostgreSQL statement without `.persistent(…)` before its `.await`: \
                          behind a transaction pooler it must be sent unnamed (`self.cached()`, \
                          `pool_caches_statements`)"
                    .to_string(),
            });
        }
    }
}

/// Rule 3: the first non-blank line is a `//!` header.
fn check_header(file: &SourceFile, violations: &mut Vec<Violation>) {
    let first = file
        .text
        .lines()
        .enumerate()
        .find(|(_, line)| !line.trim().is_empty());
    if first.is_none_or(|(_, line)| !line.trim_start().starts_with("//!")) {
        violations.push(Violation {
            path: file.path.clone(),
            line: first.map_or(1, |(index, _)| index + 1),
            message: "the file does not begin with a `//!` header saying what it holds".to_string(),
        });
    }
}

/// Whether `path` is a library crate's root: `crates/NAME/src/lib.rs` or
/// `examples/NAME/src/lib.rs`.
fn is_library_root(path: &str) -> bool {
    matches!(
        path.split('/').collect::<Vec<_>>().as_slice(),
        ["crates" | "examples", _, "src", "lib.rs"]
    )
}

/// Rule 5: a library crate's root warns (or denies) on missing docs.
fn check_missing_docs(file: &SourceFile, violations: &mut Vec<Violation>) {
    let lints = file.text.lines().any(|line| {
        let line = line.trim_start();
        (line.starts_with("#![warn(") || line.starts_with("#![deny("))
            && line.contains("missing_docs")
    });
    if !lints {
        violations.push(Violation {
            path: file.path.clone(),
            line: 1,
            message: "a library crate without `#![warn(missing_docs)]`: add it, so that CI's \
                      `clippy -D warnings` turns an undocumented public item into an error"
                .to_string(),
        });
    }
}

/// The files that are test code: under a `tests/` directory, named `tests.rs`, or declared
/// `#[cfg(test)] mod NAME;` (and every module below one of those).
fn test_files(files: &[SourceFile]) -> BTreeSet<String> {
    let paths: BTreeSet<&str> = files.iter().map(|f| f.path.as_str()).collect();
    let declared: Vec<(&str, Vec<(String, bool)>)> = files
        .iter()
        .map(|f| (f.path.as_str(), scan::scan(&f.text).modules))
        .collect();
    let mut tests: BTreeSet<String> = files
        .iter()
        .map(|f| f.path.clone())
        .filter(|path| in_tests_dir(path) || path == "tests.rs" || path.ends_with("/tests.rs"))
        .collect();
    loop {
        let before = tests.len();
        for (parent, modules) in &declared {
            let parent_is_test = tests.contains(*parent);
            for (name, test) in modules {
                if !(parent_is_test || *test) {
                    continue;
                }
                if let Some(child) = module_file(parent, name, &paths) {
                    tests.insert(child);
                }
            }
        }
        if tests.len() == before {
            return tests;
        }
    }
}

/// The file of module `name` declared out of line in `parent`: `NAME.rs` or `NAME/mod.rs` next
/// to a `lib.rs`, `main.rs` or `mod.rs`, and below `PARENT/` for any other file.
fn module_file(parent: &str, name: &str, paths: &BTreeSet<&str>) -> Option<String> {
    let (dir, file) = parent.rsplit_once('/').unwrap_or(("", parent));
    let stem = file.trim_end_matches(".rs");
    let base = match stem {
        "lib" | "main" | "mod" => dir.to_string(),
        _ if dir.is_empty() => stem.to_string(),
        _ => format!("{dir}/{stem}"),
    };
    [format!("{base}/{name}.rs"), format!("{base}/{name}/mod.rs")]
        .into_iter()
        .find(|candidate| paths.contains(candidate.as_str()))
}

/// Rule 6, for a file that is not test code.
fn check_lengths(file: &SourceFile, test: bool, violations: &mut Vec<Violation>) {
    if test {
        return;
    }
    let allowed = |function: Option<&str>| {
        LONG_ALLOWED
            .iter()
            .any(|long| long.path == file.path && long.function == function)
    };
    let lines = file.text.lines().count();
    if lines > MAX_FILE_LINES && !allowed(None) {
        violations.push(Violation {
            path: file.path.clone(),
            line: 1,
            message: format!(
                "{lines} lines, over the {MAX_FILE_LINES}-line limit for a non-test file: split \
                 it, or allow it in LONG_ALLOWED with the reason"
            ),
        });
    }
    for function in scan::scan(&file.text).functions {
        let length = function.lines();
        if !function.test && length > MAX_FN_LINES && !allowed(Some(&function.name)) {
            violations.push(Violation {
                path: file.path.clone(),
                line: function.start,
                message: format!(
                    "fn `{}` is {length} lines, over the {MAX_FN_LINES}-line limit for a \
                     non-test function: split it, or allow it in LONG_ALLOWED with the reason",
                    function.name
                ),
            });
        }
    }
}

/// Every file an allowlist names must exist, so that the lists do not outlive what they excuse.
fn check_allowlists(files: &[SourceFile], violations: &mut Vec<Violation>) {
    let exists = |path: &str| files.iter().any(|f| f.path == path);
    let listed = TABLE_KNOWERS
        .exceptions
        .iter()
        .chain(POOL_HOLDERS.exceptions)
        .map(|(path, _)| *path)
        .chain(LONG_ALLOWED.iter().map(|long| long.path));
    for path in listed {
        if !exists(path) {
            violations.push(Violation {
                path: "xtask/src/tidy.rs".to_string(),
                line: 1,
                message: format!("an allowlist names `{path}`, which is no longer a .rs file"),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, text: &str) -> SourceFile {
        SourceFile {
            path: path.to_string(),
            text: text.to_string(),
        }
    }

    fn messages(files: &[SourceFile]) -> Vec<String> {
        check(files).iter().map(Violation::to_string).collect()
    }

    #[test]
    fn a_file_must_begin_with_its_header() {
        let files = [
            file("crates/a/src/ok.rs", "\n//! Holds things.\nfn f() {}\n"),
            file("crates/a/src/bare.rs", "\n\nuse std::fmt;\n"),
            file("crates/a/src/plain_comment.rs", "// not a header\n"),
            file("crates/a/src/empty.rs", ""),
        ];
        let found = messages(&files);
        assert_eq!(found.len(), 3, "{found:#?}");
        assert!(found[0].starts_with("crates/a/src/bare.rs:3: the file does not begin"));
        assert!(found[1].starts_with("crates/a/src/empty.rs:1: "));
        assert!(found[2].starts_with("crates/a/src/plain_comment.rs:1: "));
    }

    #[test]
    fn names_are_allowed_only_where_they_may_be_known() {
        let table = format!(
            "//! x\nconst T: &str = \"{}\";\n",
            OUTBOX_TABLE.to_lowercase()
        );
        let pool = "//! x\nfn f(_: sqlx::PgPool) {}\n";
        let files = [
            file("crates/outbox-events/src/a.rs", &table),
            file("crates/outbox-persistence/src/a.rs", &table),
            file("crates/outbox-cli/tests/cli/a.rs", &table),
            file("crates/create-action/src/ident.rs", &table),
            file("crates/outbox-demo/src/a.rs", pool),
            file("crates/outbox-bench/src/a.rs", pool),
            file("tests/it/a.rs", pool),
        ];
        let found = messages(&files);
        assert_eq!(found.len(), 2, "{found:#?}");
        assert!(found[0].starts_with("crates/outbox-demo/src/a.rs:2: names the backend pool"));
        assert!(found[1].starts_with("crates/outbox-events/src/a.rs:2: names the outbox table"));
    }

    #[test]
    fn postgres_statements_must_say_whether_they_may_be_cached() {
        let marked = "//! x\nasync fn f() {\n    sqlx::query(\"SELECT 1\")\n        .persistent(false)\n        .execute(c)\n        .await;\n}\n";
        let unmarked = "//! x\nasync fn f() {\n    sqlx::query(\"SELECT 1\")\n        .execute(c)\n        .await;\n    x.persistent(true);\n}\n";
        let files = [
            file("crates/outbox-persistence/src/postgres/ok.rs", marked),
            file("crates/outbox-persistence/src/postgres/bad.rs", unmarked),
            file("crates/outbox-demo/src/elsewhere.rs", unmarked),
        ];
        let found: Vec<_> = check(&files)
            .into_iter()
            .map(|v| (v.path, v.line))
            .collect();
        assert_eq!(
            found,
            vec![(
                "crates/outbox-persistence/src/postgres/bad.rs".to_string(),
                3
            )]
        );
    }

    #[test]
    fn ignored_tests_and_undocumented_libraries_are_caught() {
        let ignored = format!("//! x\n{IGNORE_ATTRIBUTE}]\nfn t() {{}}\n");
        let files = [
            file("crates/a/src/lib.rs", &ignored),
            file("crates/b/src/lib.rs", "//! b\n#![warn(missing_docs)]\n"),
            file(
                "examples/c/src/lib.rs",
                "//! c\n#![deny(missing_docs, unsafe_code)]\n",
            ),
            file("crates/d/src/main.rs", "//! d\n"),
        ];
        let found = messages(&files);
        assert_eq!(found.len(), 2, "{found:#?}");
        assert!(found[0].starts_with("crates/a/src/lib.rs:1: a library crate without"));
        assert!(found[1].starts_with("crates/a/src/lib.rs:2: an ignored test"));
    }

    #[test]
    fn long_functions_and_files_outside_tests_are_reported() {
        let body = "    let _x = 1;\n".repeat(MAX_FN_LINES - 1);
        let long_fn = format!("fn long() {{\n{body}}}\n");
        let source = format!(
            "//! x\n{long_fn}#[cfg(test)]\nmod tests {{\n    {long_fn}}}\n#[cfg(test)]\nmod more;\n"
        );
        let long_file = format!("//! x\n{}", "\n".repeat(MAX_FILE_LINES));
        let files = [
            file(
                "crates/a/src/lib.rs",
                &format!("//! a\n#![warn(missing_docs)]\n{long_fn}"),
            ),
            file("crates/a/src/m.rs", &source),
            file("crates/a/src/m/more.rs", &long_file),
            file("crates/a/src/tests.rs", &long_file),
            file("crates/a/tests/it.rs", &source),
            file("crates/a/src/big.rs", &long_file),
        ];
        let found = messages(&files);
        assert_eq!(found.len(), 3, "{found:#?}");
        assert!(found[0].starts_with("crates/a/src/big.rs:1: 601 lines, over the 600-line"));
        assert!(found[1].starts_with("crates/a/src/lib.rs:3: fn `long` is 81 lines"));
        assert!(found[2].starts_with("crates/a/src/m.rs:2: fn `long` is 81 lines"));
    }

    #[test]
    fn library_roots_are_recognised() {
        assert!(is_library_root("crates/record-key/src/lib.rs"));
        assert!(is_library_root("examples/contact-service/src/lib.rs"));
        assert!(!is_library_root("tests/src/lib.rs"));
        assert!(!is_library_root("crates/outbox-cli/src/main.rs"));
    }
}
