//! `outbox relay` drains a CRM workload into a stream it creates on a NATS server with
//! user/password authentication; the test reads the stream back (every event once, per-record
//! order, the other event type untouched), no secret reaches the output, and
//! `outbox consumers`/`outbox gate` judge the relay the `OUTBOX_RELAY_*` variables configure.

use super::expected_in_stream;
use outbox_persistence::{EventFilter, NewEvent};
use outbox_relay::test_support::NatsServer;
use outbox_relay::{NatsAuth, NatsConnect, Secret, audit, read_stream};
use outbox_tests::{TestDb, backend_tests};

use crate::{PASSWORD, relay_env, run, stderr, stdout};

/// 300 events of the relayed types over 30 records, and one `invoice.sent` the relay does not own.
pub async fn seed(db: &TestDb) {
    let repo = db.repository();
    let mut events = Vec::new();
    for i in 0..300 {
        let (object, event_type) = if i % 3 == 0 {
            ("Lead", "lead.updated")
        } else {
            ("Account", "account.updated")
        };
        let payload = format!(
            r#"{{"object":"{object}","record_id":"R{:03}","n":{i}}}"#,
            i % 30
        );
        events.push(NewEvent::new(event_type, payload));
    }
    events.push(NewEvent::new(
        "invoice.sent",
        r#"{"object":"Invoice","record_id":"I1"}"#,
    ));
    for batch in events.chunks(40) {
        let mut tx = repo.begin().await.unwrap();
        repo.enqueue(&mut tx, batch).await.unwrap();
        tx.commit().await.unwrap();
    }
}

async fn outbox_relay_drains_a_workload_into_a_stream(db: TestDb) {
    let nats = NatsServer::start_with_config(&format!(
        "authorization {{ users = [ {{ user: relay, password: \"{PASSWORD}\" }} ] }}"
    ));
    seed(&db).await;
    let env = relay_env(&nats);
    let url = db.url.clone();
    let out = tokio::task::spawn_blocking({
        let env = env.clone();
        move || {
            run(
                &url,
                &[
                    "relay",
                    "--create-stream",
                    "--until-drained",
                    "--workers",
                    "4",
                ],
                &env,
            )
        }
    })
    .await
    .unwrap();
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{text}");
    assert!(
        !text.contains(PASSWORD),
        "a secret reached the output: {text}"
    );
    assert!(text.contains("300 processed"), "{text}");
    assert!(text.contains("created stream CRM"), "{text}");

    // Read the stream back and audit it against the outbox.
    let client = NatsConnect::new(nats.url())
        .with_auth(NatsAuth::UserPassword {
            user: "relay".into(),
            password: Secret::new(PASSWORD),
        })
        .connect()
        .await
        .unwrap();
    let js = outbox_relay::async_nats::jetstream::new(client);
    let messages = read_stream(&js, "CRM").await.unwrap();
    let rows = db
        .repository()
        .list_events(EventFilter::new())
        .await
        .unwrap();
    let expected = expected_in_stream(&rows);
    let report = audit(&messages, &expected);
    assert!(report.passed(), "{report:?}");
    assert_eq!(messages.len(), 300);
    let other = rows
        .iter()
        .find(|r| r.event_type == "invoice.sent")
        .unwrap();
    assert_eq!(
        other.status.as_str(),
        "pending",
        "not the relay's event type"
    );
    assert_eq!(other.retry_count, 0);
}

async fn the_relay_reports_a_wrong_password_without_showing_it(db: TestDb) {
    let nats = NatsServer::start_with_config(&format!(
        "authorization {{ users = [ {{ user: relay, password: \"{PASSWORD}\" }} ] }}"
    ));
    let mut env = relay_env(&nats);
    env.retain(|(k, _)| *k != "NATS_PASSWORD");
    env.push(("NATS_PASSWORD", "wrong-pw-77".into()));
    let url = db.url.clone();
    let out = tokio::task::spawn_blocking(move || run(&url, &["relay", "--create-stream"], &env))
        .await
        .unwrap();
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("cannot connect to NATS at nats://127.0.0.1"),
        "{text}"
    );
    assert!(!text.contains("wrong-pw-77"), "{text}");
}

async fn consumers_and_gate_judge_the_configured_relay(db: TestDb) {
    let nats = NatsServer::start();
    let env = relay_env(&nats);
    let map = run(&db.url, &["consumers"], &env);
    let text = stdout(&map);
    assert!(map.status.success(), "{}", stderr(&map));
    assert!(
        text.contains("| `account.updated` | nats-relay | external (connectorpush)"),
        "{text}"
    );
    assert!(
        text.contains("broker dedup: Nats-Msg-Id = event id"),
        "{text}"
    );
    assert!(text.contains("at least 2m30s"), "{text}");
    assert!(text.contains("| protected |"), "{text}");

    let gate = run(&db.url, &["gate"], &env);
    assert!(gate.status.success(), "{}{}", stdout(&gate), stderr(&gate));
    assert!(stdout(&gate).contains("2 consumers"), "{}", stdout(&gate));

    // Retry settings the relay's declaration reads from the same variables.
    let mut longer = env.clone();
    longer.push(("OUTBOX_RELAY_STALE_AFTER_MS", "60000".into()));
    let text = stdout(&run(&db.url, &["consumers"], &longer));
    assert!(text.contains("at least 4m30s"), "{text}");

    // A relay configuration that cannot be right fails the command instead of judging less.
    let mut broken = env.clone();
    broken.push(("OUTBOX_RELAY_SUBJECTS", "invoice.sent=x".into()));
    let out = run(&db.url, &["gate"], &broken);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("override for \"invoice.sent\""),
        "{}",
        stderr(&out)
    );

    let help = run(&db.url, &["relay", "--help"], &env);
    assert!(!stdout(&help).contains(PASSWORD) && stdout(&help).contains("NATS_PASSWORD"));
}

backend_tests!(
    outbox_relay_drains_a_workload_into_a_stream,
    the_relay_reports_a_wrong_password_without_showing_it,
    consumers_and_gate_judge_the_configured_relay,
);
