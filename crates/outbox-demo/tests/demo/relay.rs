//! `outbox-demo --relay nats://…` against a `nats-server -js` of the test's own: the demo runs
//! its workload with the relay as a second consumer of the same outbox, verifies the stream it
//! reads back from NATS and prints it in its report; the test reads the stream back itself and
//! audits it against the database (every processed change once, per-record order).

use outbox_persistence::{EventFilter, EventStatus};
use outbox_relay::test_support::NatsServer;
use outbox_relay::{Expected, NatsConnect, audit, read_stream};
use outbox_tests::{TestDb, backend_tests};
use serde_json::Value;

use super::{outbox, stderr, stdout};

const FEED: [&str; 2] = ["account.changed", "lead.changed"];

async fn the_demo_relays_its_change_feed_and_verifies_the_stream(db: TestDb) {
    let nats = NatsServer::start();
    let url = nats.url();
    let args = [
        "--events",
        "400",
        "--records",
        "40",
        "--workers",
        "4",
        "--relay",
        &url,
        "--json",
    ];
    let out = outbox(&db.url, &args);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).expect("the report as JSON");
    let relay = &report["relay"];
    assert_eq!(relay["events"], 400, "{relay}");
    assert_eq!(relay["processed"], 400, "{relay}");
    assert_eq!(relay["messages"], 400, "{relay}");
    assert_eq!(relay["stream"], "OUTBOX_DEMO");
    let checks = report["verification"]["checks"].as_array().unwrap();
    let relay_checks: Vec<&Value> = checks
        .iter()
        .filter(|c| c["name"].as_str().unwrap().starts_with("relay:"))
        .collect();
    assert_eq!(relay_checks.len(), 2, "{checks:?}");
    assert!(checks.iter().all(|c| c["ok"] == true), "{checks:?}");
    // The demo's own events ran alongside: 400 handled by its handlers.
    assert_eq!(report["events"], 800, "{report}");

    // The test's own reading of the stream, against the database.
    let repo = db.repository();
    let rows = repo.list_events(EventFilter::new()).await.unwrap();
    let feed: Vec<_> = rows
        .iter()
        .filter(|r| FEED.contains(&r.event_type.as_str()))
        .collect();
    assert_eq!(feed.len(), 400);
    assert!(feed.iter().all(|r| r.status == EventStatus::Processed));
    let expected: Vec<Expected> = feed
        .iter()
        .map(|r| Expected {
            id: r.id.to_string(),
            record_key: r.record_key.as_ref().map(|k| k.as_str().to_string()),
        })
        .collect();
    let client = NatsConnect::new(nats.url()).connect().await.unwrap();
    let js = outbox_relay::async_nats::jetstream::new(client);
    let messages = read_stream(&js, "OUTBOX_DEMO").await.unwrap();
    let report = audit(&messages, &expected);
    assert!(report.passed(), "{report:?}");
    assert!(
        messages
            .iter()
            .all(|m| m.subject.starts_with("demo.") && m.subject.ends_with(".changed"))
    );

    // The text report shows the stream's verification (a fresh SQLite database of its own).
    let fresh = TestDb::sqlite().await;
    let text = outbox(
        &fresh.url,
        &["--events", "20", "--records", "4", "--relay", &url],
    );
    let shown = stdout(&text);
    assert!(text.status.success(), "{shown}{}", stderr(&text));
    assert!(
        shown.contains("relay       20 of 20 changes processed into stream OUTBOX_DEMO"),
        "{shown}"
    );
    assert!(
        shown.contains("[ ok ] relay: every processed change in the stream exactly once"),
        "{shown}"
    );
}

backend_tests!(the_demo_relays_its_change_feed_and_verifies_the_stream);
