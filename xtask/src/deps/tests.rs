//! Tests of the dependency-direction check on small workspaces in `cargo metadata`'s format.

use serde_json::json;

use super::*;

/// A small workspace in cargo's own metadata format, with the real crates' names and the
/// direction the rules allow.
const SMALL_WORKSPACE: &str = r#"{
  "packages": [
    { "id": "path+file:///ws/crates/record-key#0.1.0", "name": "record-key",
      "dependencies": [
        { "name": "serde_json", "kind": null, "optional": false },
        { "name": "tokio", "kind": "dev", "optional": false }
      ] },
    { "id": "path+file:///ws/crates/outbox-persistence#0.1.0", "name": "outbox-persistence",
      "dependencies": [
        { "name": "record-key", "kind": null, "optional": false },
        { "name": "sqlx", "kind": null, "optional": false }
      ] },
    { "id": "path+file:///ws/crates/outbox-events#0.1.0", "name": "outbox-events",
      "dependencies": [
        { "name": "outbox-persistence", "kind": null, "optional": false },
        { "name": "tokio", "kind": null, "optional": false }
      ] },
    { "id": "path+file:///ws/xtask#0.1.0", "name": "xtask",
      "dependencies": [ { "name": "serde_json", "kind": null, "optional": false } ] },
    { "id": "registry+https://github.com/rust-lang/crates.io-index#serde_json@1.0.140",
      "name": "serde_json", "dependencies": [] },
    { "id": "registry+https://github.com/rust-lang/crates.io-index#sqlx@0.9.0",
      "name": "sqlx", "dependencies": [ { "name": "tokio", "kind": null, "optional": false } ] },
    { "id": "registry+https://github.com/rust-lang/crates.io-index#tokio@1.45.0",
      "name": "tokio", "dependencies": [] }
  ],
  "workspace_members": [
    "path+file:///ws/crates/record-key#0.1.0",
    "path+file:///ws/crates/outbox-persistence#0.1.0",
    "path+file:///ws/crates/outbox-events#0.1.0",
    "path+file:///ws/xtask#0.1.0"
  ],
  "resolve": { "root": null, "nodes": [
    { "id": "path+file:///ws/crates/record-key#0.1.0", "deps": [
      { "name": "serde_json",
        "pkg": "registry+https://github.com/rust-lang/crates.io-index#serde_json@1.0.140",
        "dep_kinds": [ { "kind": null, "target": null } ] },
      { "name": "tokio",
        "pkg": "registry+https://github.com/rust-lang/crates.io-index#tokio@1.45.0",
        "dep_kinds": [ { "kind": "dev", "target": null } ] } ] },
    { "id": "path+file:///ws/crates/outbox-persistence#0.1.0", "deps": [
      { "name": "record_key", "pkg": "path+file:///ws/crates/record-key#0.1.0",
        "dep_kinds": [ { "kind": null, "target": null } ] },
      { "name": "sqlx",
        "pkg": "registry+https://github.com/rust-lang/crates.io-index#sqlx@0.9.0",
        "dep_kinds": [ { "kind": null, "target": null } ] } ] },
    { "id": "path+file:///ws/crates/outbox-events#0.1.0", "deps": [
      { "name": "outbox_persistence", "pkg": "path+file:///ws/crates/outbox-persistence#0.1.0",
        "dep_kinds": [ { "kind": null, "target": null } ] },
      { "name": "tokio",
        "pkg": "registry+https://github.com/rust-lang/crates.io-index#tokio@1.45.0",
        "dep_kinds": [ { "kind": null, "target": null } ] } ] },
    { "id": "path+file:///ws/xtask#0.1.0", "deps": [
      { "name": "serde_json",
        "pkg": "registry+https://github.com/rust-lang/crates.io-index#serde_json@1.0.140",
        "dep_kinds": [ { "kind": null, "target": null } ] } ] },
    { "id": "registry+https://github.com/rust-lang/crates.io-index#serde_json@1.0.140",
      "deps": [] },
    { "id": "registry+https://github.com/rust-lang/crates.io-index#sqlx@0.9.0", "deps": [
      { "name": "tokio",
        "pkg": "registry+https://github.com/rust-lang/crates.io-index#tokio@1.45.0",
        "dep_kinds": [ { "kind": null, "target": null } ] } ] },
    { "id": "registry+https://github.com/rust-lang/crates.io-index#tokio@1.45.0", "deps": [] }
  ] }
}"#;

fn small_workspace() -> Value {
    serde_json::from_str(SMALL_WORKSPACE).expect("the fixture is valid JSON")
}

/// The package named `name` in `metadata`.
fn package<'a>(metadata: &'a mut Value, name: &str) -> &'a mut Value {
    metadata["packages"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|package| package["name"] == name)
        .unwrap()
}

/// The resolve node of the package whose id contains `id_part`.
fn node<'a>(metadata: &'a mut Value, id_part: &str) -> &'a mut Value {
    metadata["resolve"]["nodes"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|node| node["id"].as_str().unwrap().contains(id_part))
        .unwrap()
}

/// Adds the edge `from -> to` (package names, `to` already present) as kind `kind`, both to
/// `from`'s manifest and to the resolve graph.
fn add_edge(metadata: &mut Value, from: &str, to: &str, kind: Option<&str>) {
    package(metadata, from)["dependencies"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "name": to, "kind": kind, "optional": false }));
    let to_id = package(metadata, to)["id"].clone();
    let from_id = package(metadata, from)["id"].as_str().unwrap().to_string();
    node(metadata, &from_id)["deps"]
        .as_array_mut()
        .unwrap()
        .push(json!({
            "name": to.replace('-', "_"),
            "pkg": to_id,
            "dep_kinds": [ { "kind": kind, "target": null } ],
        }));
}

/// Adds an external package `name` with no dependencies.
fn add_external(metadata: &mut Value, name: &str) {
    let id = format!("registry+https://github.com/rust-lang/crates.io-index#{name}@1.0.0");
    metadata["packages"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "id": id, "name": name, "dependencies": [] }));
    metadata["resolve"]["nodes"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "id": id, "deps": [] }));
}

#[test]
fn the_allowed_direction_passes_and_every_edge_is_counted() {
    let report = check(&small_workspace()).unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    // Declared non-dev edges: record-key 1, outbox-persistence 2, outbox-events 2, xtask 1;
    // plus record-key's transitive walk: record-key -> serde_json.
    assert_eq!(report.edges_checked, 7);
}

#[test]
fn a_forbidden_workspace_edge_is_caught() {
    let mut metadata = small_workspace();
    add_edge(&mut metadata, "record-key", "outbox-persistence", None);
    let report = check(&metadata).unwrap();
    assert_eq!(
        report.violations,
        [
            "`record-key -> outbox-persistence`: record-key may depend on no workspace crate",
            "`record-key -> outbox-persistence -> sqlx`: record-key must not depend on sqlx, \
             even through other crates",
        ]
    );
}

#[test]
fn an_edge_outside_the_allowed_list_names_what_is_allowed() {
    let mut metadata = small_workspace();
    add_edge(&mut metadata, "outbox-events", "record-key", None);
    let report = check(&metadata).unwrap();
    assert_eq!(
        report.violations,
        ["`outbox-events -> record-key`: outbox-events may depend only on outbox-persistence"]
    );
}

#[test]
fn outbox_events_naming_sqlx_directly_is_caught_even_as_a_family_member() {
    let mut metadata = small_workspace();
    add_external(&mut metadata, "sqlx-core");
    add_edge(&mut metadata, "outbox-events", "sqlx-core", None);
    let report = check(&metadata).unwrap();
    assert_eq!(
        report.violations,
        ["`outbox-events -> sqlx-core`: outbox-events must not depend on sqlx"]
    );
}

#[test]
fn record_key_reaching_an_async_runtime_through_another_crate_is_caught() {
    let mut metadata = small_workspace();
    add_edge(&mut metadata, "serde_json", "tokio", None);
    let report = check(&metadata).unwrap();
    assert_eq!(
        report.violations,
        [
            "`record-key -> serde_json -> tokio`: record-key must not depend on tokio, even \
             through other crates"
        ]
    );
}

#[test]
fn a_direct_forbidden_dependency_is_reported_once() {
    let mut metadata = small_workspace();
    add_edge(&mut metadata, "record-key", "sqlx", None);
    let report = check(&metadata).unwrap();
    assert_eq!(
        report.violations,
        ["`record-key -> sqlx`: record-key must not depend on sqlx"]
    );
}

#[test]
fn dev_dependencies_are_not_edges() {
    let mut metadata = small_workspace();
    add_edge(&mut metadata, "xtask", "record-key", Some("dev"));
    add_edge(&mut metadata, "outbox-events", "sqlx", Some("dev"));
    let report = check(&metadata).unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
}

#[test]
fn build_dependencies_are_edges() {
    let mut metadata = small_workspace();
    add_edge(&mut metadata, "xtask", "record-key", Some("build"));
    let report = check(&metadata).unwrap();
    assert_eq!(
        report.violations,
        ["`xtask -> record-key`: xtask may depend on no workspace crate"]
    );
}

#[test]
fn a_workspace_crate_without_a_rule_is_caught() {
    let mut metadata = small_workspace();
    let id = "path+file:///ws/crates/outbox-extra#0.1.0";
    metadata["packages"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "id": id, "name": "outbox-extra", "dependencies": [] }));
    metadata["workspace_members"]
        .as_array_mut()
        .unwrap()
        .push(json!(id));
    let report = check(&metadata).unwrap();
    assert_eq!(
        report.violations,
        ["workspace crate `outbox-extra` has no rule; add its allowed dependencies to RULES"]
    );
}

#[test]
fn metadata_without_a_resolve_graph_is_an_error() {
    let mut metadata = small_workspace();
    metadata["resolve"] = Value::Null;
    let error = check(&metadata).unwrap_err();
    assert!(error.to_string().contains("--no-deps"), "{error}");
}

#[test]
fn families_match_whole_name_segments() {
    assert!(in_family("sqlx", "sqlx"));
    assert!(in_family("sqlx-postgres", "sqlx"));
    assert!(!in_family("sqlxmq", "sqlx"));
    assert!(!in_family("tokio", "tokio-util"));
}

#[test]
fn every_rule_names_a_distinct_crate() {
    let names: BTreeSet<&str> = RULES.iter().map(|rule| rule.krate).collect();
    assert_eq!(names.len(), RULES.len());
}
