//! `outbox heads`: the claim's derived heads table checked against the outbox rows and rebuilt.
//! The table is damaged the way a bug or a hand edit would (a key's head deleted, a left-over
//! key), then checked (exit 1, the keys listed), rebuilt (exit 0) and checked again, on both
//! backends; the claims then follow the rebuilt heads: every row, each key's in enqueue order.

use outbox_persistence::{ClaimPolicy, NewEvent, Scope};
use outbox_tests::{TestDb, backend_tests};
use serde_json::Value;
use std::time::Duration;

use super::{outbox, stderr, stdout};

fn lead(id: &str, n: u32) -> String {
    format!(r#"{{"object":"Lead","record_id":"{id}","n":{n}}}"#)
}

fn heads_json(url: &str, args: &[&str]) -> (bool, Value) {
    let mut all = vec!["heads", "--json"];
    all.extend_from_slice(args);
    let o = outbox(url, &all);
    let v = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("JSON ({e}): {} {}", stdout(&o), stderr(&o)));
    (o.status.success(), v)
}

async fn heads_are_checked_and_rebuilt(db: TestDb) {
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let events: Vec<NewEvent> = ["a", "b", "c", "a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(n, id)| NewEvent::new("lead.updated", lead(id, n as u32)))
        .collect();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();

    let (ok, report) = heads_json(&db.url, &[]);
    assert!(ok, "a fresh queue's heads are consistent: {report}");
    assert_eq!(report["differing_keys"], serde_json::json!([]));

    db.execute("DELETE FROM _System_OutboxHead WHERE RecordKey = 'lead:a'")
        .await;
    db.execute(
        "INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id)
         SELECT 'lead:gone', CreatedDate, Id FROM _System_OutboxHead WHERE RecordKey = 'lead:b'",
    )
    .await;
    let (ok, report) = heads_json(&db.url, &[]);
    assert!(!ok, "damaged heads must fail the check: {report}");
    assert_eq!(
        report["differing_keys"],
        serde_json::json!(["lead:a", "lead:gone"])
    );
    let text = outbox(&db.url, &["heads"]);
    assert!(!text.status.success());
    assert!(stdout(&text).contains("2 keys differ"), "{}", stdout(&text));

    // The repair puts both right without holding anybody off.
    let (ok, report) = heads_json(&db.url, &["--repair"]);
    assert!(ok, "{report}");
    assert_eq!(report["repaired"]["missing"], serde_json::json!(["lead:a"]));
    assert_eq!(
        report["repaired"]["left_over"],
        serde_json::json!(["lead:gone"])
    );
    assert_eq!(report["differing_after_rebuild"], serde_json::json!([]));
    db.execute("DELETE FROM _System_OutboxHead WHERE RecordKey = 'lead:a'")
        .await;

    let (ok, report) = heads_json(&db.url, &["--rebuild"]);
    assert!(ok, "{report}");
    assert_eq!(report["rebuilt_heads"], 3);
    assert_eq!(report["differing_after_rebuild"], serde_json::json!([]));
    let (ok, _) = heads_json(&db.url, &[]);
    assert!(ok);

    // The rebuilt heads serve the claim: every row is claimed, one key at a time, in order.
    let policy = ClaimPolicy::new(Duration::from_secs(30), Duration::ZERO, 5);
    let mut claimed = Vec::new();
    while let Some(claim) = repo.claim_next(policy, &Scope::All).await.unwrap() {
        let mut attempt = repo
            .begin_attempt(Duration::from_secs(5), claim.fence)
            .await
            .unwrap()
            .expect("the claim's fence holds");
        attempt.mark_processed(claim.fence).await.unwrap();
        attempt.commit().await.unwrap();
        let payload: Value = serde_json::from_str(&claim.event.payload).unwrap();
        claimed.push((
            payload["record_id"].to_string(),
            payload["n"].as_u64().unwrap(),
        ));
    }
    assert_eq!(claimed.len(), 6, "{claimed:?}");
    for key in ["\"a\"", "\"b\"", "\"c\""] {
        let order: Vec<u64> = claimed
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, n)| *n)
            .collect();
        assert!(
            order.is_sorted(),
            "{key}: claimed out of enqueue order {order:?}"
        );
        assert_eq!(order.len(), 2);
    }
    let (ok, report) = heads_json(&db.url, &[]);
    assert!(ok, "a drained queue has no heads: {report}");
}

backend_tests!(heads_are_checked_and_rebuilt);
