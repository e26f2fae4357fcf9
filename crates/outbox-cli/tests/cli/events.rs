//! `outbox events`: rows listed without their payloads, filtered, oldest first, with timestamps
//! that compare equal when the stored values are equal (the fault suite watches rows this way).

use outbox_persistence::{ClaimPolicy, NewEvent, Scope};
use outbox_tests::{TestDb, backend_tests};
use serde_json::Value;
use std::time::Duration;

use super::{outbox, stderr, stdout};

fn lead(id: &str) -> String {
    format!(r#"{{"object":"Lead","record_id":"{id}","snapshot":{{"secret":"s3cr3t"}}}}"#)
}

fn rows(url: &str, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["events", "--json"];
    all.extend_from_slice(args);
    let o = outbox(url, &all);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("s3cr3t"), "a payload was printed");
    let v: Value = serde_json::from_slice(&o.stdout).expect("JSON");
    v.as_array().expect("an array").clone()
}

async fn events_lists_filters_and_hides_payloads(db: TestDb) {
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let events = [
        NewEvent::new("lead.updated", lead("a")),
        NewEvent::new("lead.updated", lead("a")),
        NewEvent::new("lead.converted", lead("b")),
    ];
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let policy = ClaimPolicy::new(Duration::from_secs(30), Duration::ZERO, 5);
    let claim = repo
        .claim_next(policy, &Scope::All)
        .await
        .unwrap()
        .expect("a claim");

    let all = rows(&db.url, &[]);
    assert_eq!(all.len(), 3);
    assert_eq!(all[0]["id"], claim.event.id.to_string());
    assert_eq!(all[0]["status"], "processing");
    assert_eq!(all[0]["record_key"], "lead:a");
    assert!(all.iter().all(|r| r.get("payload").is_none()));

    let processing = rows(&db.url, &["--status", "processing"]);
    assert_eq!(processing.len(), 1);
    // Listing twice prints the stored timestamp the same way.
    assert_eq!(
        processing[0]["last_modified_date"],
        rows(&db.url, &["--id", &claim.event.id.to_string()])[0]["last_modified_date"]
    );
    assert_eq!(rows(&db.url, &["--event-type", "lead.converted"]).len(), 1);
    assert_eq!(rows(&db.url, &["--key", "lead:a"]).len(), 2);
    assert_eq!(
        rows(&db.url, &["--status", "pending", "--limit", "1"]).len(),
        1
    );
    let text = stdout(&outbox(&db.url, &["events"]));
    assert_eq!(text.lines().count(), 3, "{text}");

    let bad = outbox(&db.url, &["events", "--status", "done"]);
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("--status done"), "{}", stderr(&bad));
}

backend_tests!(events_lists_filters_and_hides_payloads);
