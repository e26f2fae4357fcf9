//! `outbox pause`, `resume` and `audit`: a pause shows in `status` (and `status --key` says the
//! record's head is paused), and every pause, resume and retry is in the audit log with who.

use outbox_persistence::NewEvent;
use outbox_tests::{TestDb, backend_tests};
use serde_json::Value;

use super::{outbox, outbox_with_env, stderr, stdout};

fn ok(o: &std::process::Output) -> String {
    assert!(o.status.success(), "{}", stderr(o));
    stdout(o)
}

async fn pause_resume_show_in_status_and_the_audit_log(db: TestDb) {
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let lead = r#"{"object":"Lead","record_id":"p1","snapshot":{}}"#;
    let ids = repo
        .enqueue(
            &mut tx,
            &[
                NewEvent::new("lead.updated", lead),
                NewEvent::new("lead.updated", lead),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let paused = ok(&outbox(
        &db.url,
        &["pause", "lead.updated", "--actor", "alice"],
    ));
    assert!(paused.contains("paused"), "{paused}");
    let again = ok(&outbox(&db.url, &["pause", "lead.updated"]));
    assert!(again.contains("was paused already"), "{again}");

    let status = ok(&outbox(&db.url, &["status"]));
    assert!(
        status.contains("paused          lead.updated (by alice"),
        "{status}"
    );
    let doc: Value = serde_json::from_str(&ok(&outbox(&db.url, &["status", "--json"]))).unwrap();
    assert_eq!(doc["paused_event_types"][0]["event_type"], "lead.updated");
    let key = ok(&outbox(&db.url, &["status", "--key", "lead:p1"]));
    assert!(key.contains("its event type paused by alice"), "{key}");
    assert!(
        ok(&outbox(&db.url, &["status"])).contains("its event type paused by alice"),
        "the blocked key's head says why"
    );

    ok(&outbox_with_env(
        &db.url,
        &["resume", "lead.updated"],
        &[("OUTBOX_ACTOR", "bob")],
    ));
    db.execute(&format!(
        "UPDATE _System_OutboxEvent SET Status = 'failed' WHERE Id = '{}'",
        ids[0]
    ))
    .await;
    let retried = ok(&outbox(
        &db.url,
        &["retry", "--id", &ids[0].to_string(), "--actor", "carol"],
    ));
    assert!(retried.contains("1 failed row(s)"), "{retried}");

    let log: Value = serde_json::from_str(&ok(&outbox(&db.url, &["audit", "--json"]))).unwrap();
    let seen: Vec<(String, String)> = log
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["actor"].as_str().unwrap().into(),
                e["action"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("carol".to_string(), "retry".to_string()),
            ("bob".into(), "resume".into()),
            ("alice".into(), "pause".into()),
        ]
    );
    let text = ok(&outbox(&db.url, &["audit"]));
    assert!(
        text.contains("carol") && text.contains(&ids[0].to_string()),
        "{text}"
    );
}

backend_tests!(pause_resume_show_in_status_and_the_audit_log);
