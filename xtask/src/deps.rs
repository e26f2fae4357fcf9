//! `cargo xtask deps`: checks, over `cargo metadata`, that dependencies between workspace crates
//! point only in the directions [`RULES`] allows, and that no crate depends on an external crate
//! its rule forbids.
//!
//! Dev-dependencies are not edges: a test may use anything. Build-dependencies are, since they are
//! code the crate cannot build without.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::cmd::Cmd;

/// Which workspace crates a workspace crate may depend on.
enum WorkspaceDeps {
    /// Only these (an empty list: none).
    Only(&'static [&'static str]),
    /// Any workspace crate: the binary and the integration tests put the pieces together.
    Any,
}

/// The dependency rule for one workspace crate.
struct Rule {
    /// The crate the rule is for.
    krate: &'static str,
    /// The workspace crates it may depend on.
    workspace: WorkspaceDeps,
    /// External crates it must not name in its own manifest.
    forbidden_direct: &'static [&'static str],
    /// External crates it must not reach through normal dependencies at any depth.
    forbidden_transitive: &'static [&'static str],
}

/// Async runtimes, and sqlx (which brings one): what a crate with no I/O and no async must not
/// reach. A name also stands for its family, so `sqlx` covers `sqlx-core` and `tokio` covers
/// `tokio-util`.
const ASYNC_AND_IO: &[&str] = &[
    "sqlx",
    "tokio",
    "async-std",
    "smol",
    "async-executor",
    "async-global-executor",
    "futures-executor",
    "glommio",
    "monoio",
];

/// The direction of dependencies in this workspace, one row per workspace crate; ARCHITECTURE.md
/// states the same rules in prose. A workspace crate without a row is itself a violation, so that
/// a new crate's place in the direction is decided when it is added.
const RULES: &[Rule] = &[
    Rule {
        krate: "record-key",
        workspace: WorkspaceDeps::Only(&[]),
        forbidden_direct: &[],
        forbidden_transitive: ASYNC_AND_IO,
    },
    Rule {
        krate: "outbox-persistence",
        workspace: WorkspaceDeps::Only(&["record-key"]),
        forbidden_direct: &[],
        forbidden_transitive: &[],
    },
    Rule {
        krate: "create-action",
        // outbox-persistence for the one database-error classifier; outbox-events (optional,
        // feature `outbox`) for the glue to the workers.
        workspace: WorkspaceDeps::Only(&["record-key", "outbox-persistence", "outbox-events"]),
        forbidden_direct: &[],
        forbidden_transitive: &[],
    },
    Rule {
        krate: "outbox-events",
        workspace: WorkspaceDeps::Only(&["outbox-persistence"]),
        // The workers see the repository trait only and never name `PgPool` or `SqlitePool`.
        forbidden_direct: &["sqlx"],
        forbidden_transitive: &[],
    },
    Rule {
        // The embedding example: the library crates only, like a platform team's service
        // (sqlx is its own dependency for `sqlx::migrate!` only; the rest comes re-exported).
        krate: "contact-service",
        workspace: WorkspaceDeps::Only(&["outbox-events", "create-action"]),
        forbidden_direct: &[
            "async-trait",
            "tokio-util",
            "metrics-exporter-prometheus",
            "mockall",
        ],
        forbidden_transitive: &[],
    },
    Rule {
        // The relay to NATS JetStream: a consumer built on the workers, like any embedding
        // service's handlers; it never names a pool (sqlx) and knows no operator command.
        krate: "outbox-relay",
        workspace: WorkspaceDeps::Only(&["outbox-events"]),
        forbidden_direct: &["sqlx"],
        forbidden_transitive: &[],
    },
    Rule {
        // Webhooks: a consumer built on the workers like the relay; its tables' SQL lives in
        // outbox-persistence (`webhooks`), reached through outbox-events' re-export.
        krate: "outbox-webhooks",
        workspace: WorkspaceDeps::Only(&["outbox-events"]),
        forbidden_direct: &["sqlx"],
        forbidden_transitive: &[],
    },
    Rule {
        // The operator console: the repository and its `console` reads, the consumers and the
        // gate; its SQL lives in outbox-persistence.
        krate: "outbox-console",
        workspace: WorkspaceDeps::Only(&["outbox-persistence", "outbox-events"]),
        forbidden_direct: &["sqlx"],
        forbidden_transitive: &[],
    },
    Rule {
        // The operator binary stays lean: the queue's library crates, the shipped relay
        // consumer (`outbox relay`) and the console (`outbox console`) only, no demo workload,
        // no benchmark, no create-action.
        krate: "outbox-cli",
        workspace: WorkspaceDeps::Only(&[
            "record-key",
            "outbox-persistence",
            "outbox-events",
            "outbox-relay",
            "outbox-console",
            "outbox-webhooks",
        ]),
        forbidden_direct: &[],
        forbidden_transitive: &[],
    },
    Rule {
        // The demo workload, built on the library crates like an embedding service (and on
        // outbox-cli's operator commands, which it offers too).
        krate: "outbox-demo",
        workspace: WorkspaceDeps::Only(&[
            "record-key",
            "outbox-persistence",
            "outbox-events",
            "create-action",
            "outbox-cli",
            "outbox-relay",
            "outbox-webhooks",
        ]),
        forbidden_direct: &[],
        forbidden_transitive: &[],
    },
    Rule {
        // The benchmark measures the workers against ceilings on tables of its own; its writing
        // drains run a create action.
        krate: "outbox-bench",
        workspace: WorkspaceDeps::Only(&[
            "record-key",
            "outbox-persistence",
            "outbox-events",
            "outbox-cli",
            "outbox-relay",
            "outbox-webhooks",
            "create-action",
        ]),
        forbidden_direct: &[],
        forbidden_transitive: &[],
    },
    Rule {
        krate: "outbox-tests",
        workspace: WorkspaceDeps::Any,
        forbidden_direct: &[],
        forbidden_transitive: &[],
    },
    Rule {
        krate: "xtask",
        workspace: WorkspaceDeps::Only(&[]),
        forbidden_direct: &[],
        forbidden_transitive: &[],
    },
];

/// Runs `cargo metadata`, checks it against [`RULES`], and prints each violation or the number of
/// edges checked.
pub fn run() -> Result<()> {
    let stdout = Cmd::cargo(&["metadata", "--format-version", "1"]).output()?;
    let metadata: Value =
        serde_json::from_slice(&stdout).context("`cargo metadata` printed invalid JSON")?;
    let report = check(&metadata)?;
    if report.violations.is_empty() {
        println!(
            "dependency direction: ok ({} edges checked)",
            report.edges_checked
        );
        return Ok(());
    }
    for violation in &report.violations {
        println!("dependency direction violation: {violation}");
    }
    bail!(
        "{} dependency direction violation(s); the rules are the RULES table in xtask/src/deps.rs",
        report.violations.len()
    )
}

/// What [`check`] found.
#[derive(Debug)]
pub struct Report {
    /// One sentence per broken rule.
    pub violations: Vec<String>,
    /// How many dependency edges were compared with the rules: every non-dev edge out of a
    /// workspace crate, and every edge walked for a transitive rule.
    pub edges_checked: usize,
}

/// A package as far as the check needs it.
struct Package {
    name: String,
    /// The names of the packages it declares as normal or build dependencies (optional ones too).
    declared: BTreeSet<String>,
}

/// Checks `cargo metadata --format-version 1` output against [`RULES`]. Fails only when the JSON
/// is not shaped like cargo's; broken rules are reported in the [`Report`].
///
/// The transitive walk uses cargo's resolve graph, which unifies features across the workspace, so
/// it can report a dependency that only another crate's features switch on. That errs on the side
/// of a false alarm, never of a missed edge.
pub fn check(metadata: &Value) -> Result<Report> {
    let packages = packages(metadata)?;
    let members = string_array(&metadata["workspace_members"], "workspace_members")?;
    let workspace: BTreeMap<&str, &str> = members
        .iter()
        .map(|id| {
            let package = packages
                .get(*id)
                .with_context(|| format!("workspace member `{id}` is not among the packages"))?;
            Ok((package.name.as_str(), *id))
        })
        .collect::<Result<_>>()?;
    let resolve = resolve_graph(metadata)?;

    let mut report = Report {
        violations: Vec::new(),
        edges_checked: 0,
    };
    for (&name, &id) in &workspace {
        let Some(rule) = RULES.iter().find(|rule| rule.krate == name) else {
            report.violations.push(format!(
                "workspace crate `{name}` has no rule; add its allowed dependencies to RULES"
            ));
            continue;
        };
        for dependency in &packages[id].declared {
            report.edges_checked += 1;
            let in_workspace = workspace.contains_key(dependency.as_str());
            report
                .violations
                .extend(check_direct_edge(rule, dependency, in_workspace));
        }
        if !rule.forbidden_transitive.is_empty() {
            check_transitive(rule, id, &packages, &resolve, &mut report);
        }
    }
    Ok(report)
}

/// The violation, if any, of the edge `rule.krate -> dependency`.
fn check_direct_edge(rule: &Rule, dependency: &str, in_workspace: bool) -> Option<String> {
    let krate = rule.krate;
    if in_workspace {
        return match rule.workspace {
            WorkspaceDeps::Any => None,
            WorkspaceDeps::Only(allowed) if allowed.contains(&dependency) => None,
            WorkspaceDeps::Only([]) => Some(format!(
                "`{krate} -> {dependency}`: {krate} may depend on no workspace crate"
            )),
            WorkspaceDeps::Only(allowed) => Some(format!(
                "`{krate} -> {dependency}`: {krate} may depend only on {}",
                allowed.join(", ")
            )),
        };
    }
    let forbidden = rule
        .forbidden_direct
        .iter()
        .chain(rule.forbidden_transitive)
        .find(|family| in_family(dependency, family))?;
    Some(format!(
        "`{krate} -> {dependency}`: {krate} must not depend on {forbidden}"
    ))
}

/// Walks the normal dependencies of workspace member `id` breadth-first and reports each
/// forbidden crate it reaches, with the path that reaches it.
fn check_transitive(
    rule: &Rule,
    id: &str,
    packages: &BTreeMap<String, Package>,
    resolve: &BTreeMap<String, Vec<String>>,
    report: &mut Report,
) {
    let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = VecDeque::from([id]);
    while let Some(current) = queue.pop_front() {
        for next in resolve.get(current).into_iter().flatten() {
            report.edges_checked += 1;
            if next == id || parent.contains_key(next.as_str()) {
                continue;
            }
            parent.insert(next, current);
            let name = packages
                .get(next)
                .map_or(next.as_str(), |p| p.name.as_str());
            if let Some(family) = rule
                .forbidden_transitive
                .iter()
                .find(|family| in_family(name, family))
            {
                // The forbidden crate's own dependencies would only repeat the finding, and a
                // direct one is already reported from the manifest.
                if current == id {
                    continue;
                }
                let mut path = vec![name];
                let mut step = current;
                while step != id {
                    path.push(packages.get(step).map_or(step, |p| p.name.as_str()));
                    step = parent[step];
                }
                path.push(rule.krate);
                path.reverse();
                report.violations.push(format!(
                    "`{}`: {} must not depend on {family}, even through other crates",
                    path.join(" -> "),
                    rule.krate
                ));
                continue;
            }
            queue.push_back(next);
        }
    }
}

/// Whether `name` is `family` or one of its crates (`family-*`).
fn in_family(name: &str, family: &str) -> bool {
    name.strip_prefix(family)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
}

/// Every package in the metadata, by package id.
fn packages(metadata: &Value) -> Result<BTreeMap<String, Package>> {
    let list = metadata["packages"]
        .as_array()
        .context("cargo metadata has no `packages` array")?;
    list.iter()
        .map(|package| {
            let id = str_field(package, "id")?;
            let name = str_field(package, "name")?;
            let dependencies = package["dependencies"]
                .as_array()
                .with_context(|| format!("package `{name}` has no `dependencies` array"))?;
            let declared = dependencies
                .iter()
                .filter(|dependency| dependency["kind"].as_str() != Some("dev"))
                .map(|dependency| str_field(dependency, "name").map(str::to_string))
                .collect::<Result<_>>()?;
            Ok((
                id.to_string(),
                Package {
                    name: name.to_string(),
                    declared,
                },
            ))
        })
        .collect()
}

/// The resolve graph restricted to normal dependencies: package id to the ids it depends on.
fn resolve_graph(metadata: &Value) -> Result<BTreeMap<String, Vec<String>>> {
    let nodes = metadata["resolve"]["nodes"]
        .as_array()
        .context("cargo metadata has no resolve graph (was it run with --no-deps?)")?;
    nodes
        .iter()
        .map(|node| {
            let id = str_field(node, "id")?;
            let deps = node["deps"]
                .as_array()
                .with_context(|| format!("resolve node `{id}` has no `deps` array"))?;
            let normal = deps
                .iter()
                .filter(|dep| {
                    dep["dep_kinds"]
                        .as_array()
                        .is_some_and(|kinds| kinds.iter().any(|kind| kind["kind"].is_null()))
                })
                .map(|dep| str_field(dep, "pkg").map(str::to_string))
                .collect::<Result<_>>()?;
            Ok((id.to_string(), normal))
        })
        .collect()
}

fn str_field<'a>(value: &'a Value, field: &str) -> Result<&'a str> {
    value[field]
        .as_str()
        .with_context(|| format!("expected a string `{field}` in cargo metadata, in {value}"))
}

fn string_array<'a>(value: &'a Value, what: &str) -> Result<Vec<&'a str>> {
    value
        .as_array()
        .with_context(|| format!("cargo metadata has no `{what}` array"))?
        .iter()
        .map(|item| {
            item.as_str()
                .with_context(|| format!("a non-string in `{what}`"))
        })
        .collect()
}

#[cfg(test)]
mod tests;
