//! `outbox-demo --webhooks`: the demo runs its workload with the webhooks as a second consumer,
//! delivering its change feed to a receiver in the demo's process that verifies every signature;
//! its report carries the receiver's checks, and the test reads the outbox itself (every change
//! and every delivery processed, one delivery row per change).

use outbox_persistence::{EventFilter, EventStatus};
use outbox_tests::{TestDb, backend_tests};
use serde_json::Value;

use super::{outbox, stderr, stdout};

async fn the_demo_delivers_its_change_feed_as_verified_webhooks(db: TestDb) {
    let args = [
        "--events",
        "300",
        "--records",
        "30",
        "--workers",
        "4",
        "--webhooks",
        "--json",
    ];
    let out = outbox(&db.url, &args);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).expect("the report as JSON");
    let hooks = &report["webhooks"];
    assert_eq!(hooks["events"], 300, "{hooks}");
    assert_eq!(hooks["delivered"], 300, "{hooks}");
    assert_eq!(hooks["unverified"], 0, "{hooks}");
    assert_eq!(hooks["out_of_order"], 0, "{hooks}");
    let checks = report["verification"]["checks"].as_array().unwrap();
    let hook_checks = checks
        .iter()
        .filter(|c| c["name"].as_str().unwrap().starts_with("webhooks:"))
        .count();
    assert_eq!(hook_checks, 2, "{checks:?}");
    assert!(checks.iter().all(|c| c["ok"] == true), "{checks:?}");

    let rows = db
        .repository()
        .list_events(EventFilter::new())
        .await
        .unwrap();
    let changes = rows
        .iter()
        .filter(|r| r.event_type.ends_with(".changed"))
        .count();
    let deliveries: Vec<_> = rows
        .iter()
        .filter(|r| r.event_type == "webhook:demo-receiver")
        .collect();
    assert_eq!(changes, 300);
    assert_eq!(deliveries.len(), 300, "one delivery row per change");
    assert!(rows.iter().all(|r| r.status == EventStatus::Processed));

    let text = outbox(
        &TestDb::sqlite().await.url,
        &["--events", "20", "--records", "4", "--webhooks"],
    );
    let text = stdout(&text);
    assert!(
        text.contains("webhooks    20 of 20 changes delivered"),
        "{text}"
    );
    assert!(text.contains("PASSED"), "{text}");
}

backend_tests!(the_demo_delivers_its_change_feed_as_verified_webhooks);
