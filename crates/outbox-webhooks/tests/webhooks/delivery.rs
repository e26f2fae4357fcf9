//! Deliveries to a real receiver, checked with the official verifier: signatures, order per
//! (endpoint, record), a failing endpoint or record that holds back no one, rotation, 410,
//! the address check, on both backends.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outbox_events::EventStatus;
use outbox_tests::{TestDb, backend_tests};
use outbox_webhooks::{WebhookConfig, Webhooks, webhook_id};
use serde_json::Value;

use crate::common::{Receiver, config, dispatcher, dispatcher_with, enqueue, fast, rows, wait_for};

const LIMIT: Duration = Duration::from_secs(60);

/// Every delivery the receiver acknowledged (2xx) for `endpoint`, in the order it answered.
fn acknowledged<'a>(log: &'a [Value], endpoint: &str) -> Vec<&'a Value> {
    log.iter()
        .filter(|e| e["endpoint"] == endpoint && e["status"] == 200)
        .collect()
}

/// Per record, the sequences acknowledged in the order acknowledged must increase; returns the
/// violations.
fn order_violations(acks: &[&Value]) -> usize {
    let mut last: HashMap<String, (i64, String)> = HashMap::new();
    let mut violations = 0;
    for ack in acks {
        let record = ack["record"].as_str().unwrap_or_default().to_string();
        let (micros, id) = ack["sequence"]
            .as_str()
            .and_then(|s| s.split_once('.'))
            .expect("a sequence header");
        let at = (micros.parse::<i64>().unwrap(), id.to_string());
        if let Some(prev) = last.get(&record)
            && *prev >= at
        {
            violations += 1;
        }
        last.insert(record, at);
    }
    violations
}

async fn every_delivery_verifies_in_order_per_endpoint_and_record(db: TestDb) {
    let repo = db.repository();
    let mut receiver = Receiver::start();
    let hooks = Webhooks::new(repo.clone(), config());
    let (added, all_secret) = hooks
        .add("all", &receiver.url("all"), &[], "test")
        .await
        .unwrap();
    assert!(added);
    let (_, leads_secret) = hooks
        .add(
            "leads",
            &receiver.url("leads"),
            &["lead.updated".to_string()],
            "test",
        )
        .await
        .unwrap();
    receiver.secrets("all", &[&all_secret]);
    receiver.secrets("leads", &[&leads_secret]);
    let events = enqueue(&repo, 120, 10).await;
    let handle = dispatcher(&repo, &hooks, 4).await;
    outbox_tests::drain(&repo, LIMIT).await;
    handle.shutdown().await;

    let log = receiver.log();
    assert!(!log.is_empty());
    for entry in &log {
        assert_eq!(entry["verifies"], serde_json::json!([true]), "{entry}");
        assert_eq!(
            entry["tamper_refused"], true,
            "a changed body verified: {entry}"
        );
    }
    let all = acknowledged(&log, "all");
    let leads = acknowledged(&log, "leads");
    let ids = |acks: &[&Value]| -> HashSet<String> {
        acks.iter()
            .map(|a| a["body"]["data"]["snapshot"]["seq"].to_string())
            .collect()
    };
    assert_eq!(
        ids(&all).len(),
        120,
        "every event reached the endpoint for all types"
    );
    assert_eq!(ids(&leads).len(), 60, "every lead event, and only those");
    assert!(leads.iter().all(|a| a["body"]["type"] == "lead.updated"));
    assert_eq!(order_violations(&all), 0);
    assert_eq!(order_violations(&leads), 0);
    // The envelope and the headers of our own.
    let (first_id, first_key) = &events[0];
    let first = all
        .iter()
        .find(|a| a["sequence"].as_str().unwrap().ends_with(first_id.as_str()))
        .expect("the first event's delivery");
    assert_eq!(first["record"], first_key.as_str());
    assert_eq!(first["id"], webhook_id(first_id, "all"));
    assert_eq!(first["body"]["type"], "account.updated");
    assert!(first["body"]["timestamp"].as_str().unwrap().ends_with('Z'));
    // Each attempt is kept, by a task beside the attempts: once the dispatcher has stopped,
    // `flush` returns when all of them are written, with no waiting on our side.
    hooks.flush().await;
    let attempts = hooks.attempts("all", 1000).await.unwrap();
    assert_eq!(attempts.len(), 120, "every attempt kept when flush returns");
    assert!(attempts.iter().all(|a| a.status_code == Some(200)
        && a.error.is_none()
        && a.response_body.as_deref() == Some(r#"{"received": true}"#)));
    // Retention's prune of the delivery rows takes their attempts with them.
    let policy = outbox_events::PrunePolicy::default()
        .processed_older_than(Some(Duration::ZERO))
        .failed_older_than(None);
    while repo.prune(policy).await.unwrap().more {}
    assert!(hooks.attempts("all", 10).await.unwrap().is_empty());
}

async fn a_failing_endpoint_or_record_holds_back_no_one(db: TestDb) {
    let repo = db.repository();
    let mut receiver = Receiver::start();
    let hooks = Webhooks::new(repo.clone(), config().with_disable_after_failures(1_000));
    for name in ["dead", "healthy"] {
        let (_, secret) = hooks
            .add(name, &receiver.url(name), &[], "test")
            .await
            .unwrap();
        receiver.secrets(name, &[&secret]);
    }
    receiver.behave("dead", "fail");
    receiver.fail_records("healthy", &["account:A002"]);
    enqueue(&repo, 80, 8).await;
    let handle = dispatcher(&repo, &hooks, 4).await;
    // The healthy endpoint gets every record but the failing one, in time.
    wait_for(LIMIT, "the healthy endpoint's other records", async || {
        let log = receiver.log();
        let acks = acknowledged(&log, "healthy");
        acks.len() == 80 - 10
    })
    .await;
    let log = receiver.log();
    assert_eq!(order_violations(&acknowledged(&log, "healthy")), 0);
    assert!(
        log.iter().any(|e| e["endpoint"] == "dead"),
        "the dead endpoint was tried"
    );
    assert!(acknowledged(&log, "dead").is_empty());
    // The failing record's later deliveries wait behind its first: only it was tried.
    let tried: HashSet<String> = log
        .iter()
        .filter(|e| e["endpoint"] == "healthy" && e["record"] == "account:A002")
        .map(|e| e["id"].to_string())
        .collect();
    assert_eq!(
        tried.len(),
        1,
        "only the record's oldest delivery was tried"
    );
    // Healed, everything drains in order.
    receiver.behave("dead", "ok");
    receiver.fail_records("healthy", &[]);
    outbox_tests::drain(&repo, LIMIT).await;
    handle.shutdown().await;
    let log = receiver.log();
    for name in ["dead", "healthy"] {
        assert_eq!(order_violations(&acknowledged(&log, name)), 0, "{name}");
    }
    // The attempt log is written beside the attempts: read it once what was queued is written
    // (on SQLite, under four workers' writes, it may lag behind them).
    hooks.flush().await;
    let attempts = hooks.attempts("dead", 1000).await.unwrap();
    assert!(
        attempts
            .iter()
            .any(|a| a.status_code == Some(500) && a.error.as_deref() == Some("HTTP 500"))
    );
    let retried = attempts.iter().map(|a| a.attempt).max().unwrap();
    assert!(retried > 1, "the dead endpoint's deliveries were retried");
}

async fn a_rotated_secret_verifies_under_both_keys(db: TestDb) {
    let repo = db.repository();
    let mut receiver = Receiver::start();
    let hooks = Webhooks::new(repo.clone(), config());
    let (_, old) = hooks
        .add("crm", &receiver.url("crm"), &[], "test")
        .await
        .unwrap();
    let new = hooks.rotate("crm", "test").await.unwrap();
    assert_ne!(old, new);
    receiver.secrets("crm", &[&old, &new]);
    enqueue(&repo, 10, 5).await;
    let handle = dispatcher(&repo, &hooks, 2).await;
    outbox_tests::drain(&repo, LIMIT).await;
    // After the overlap only the new one signs.
    hooks
        .rotate_with("crm", &new, Duration::ZERO, "test")
        .await
        .unwrap();
    enqueue(&repo, 2, 2).await;
    outbox_tests::drain(&repo, LIMIT).await;
    handle.shutdown().await;
    let log = receiver.log();
    assert_eq!(log.len(), 12);
    for entry in &log[..10] {
        assert_eq!(entry["signatures"], 2, "{entry}");
        assert_eq!(
            entry["verifies"],
            serde_json::json!([true, true]),
            "{entry}"
        );
    }
    for entry in &log[10..] {
        assert_eq!(entry["signatures"], 1, "{entry}");
        assert_eq!(
            entry["verifies"],
            serde_json::json!([false, true]),
            "{entry}"
        );
    }
    let audit = repo.audit_log(20).await.unwrap();
    assert!(audit.iter().any(|a| a.action == "webhook-rotate"));
    let shown = format!("{audit:?} {:?}", hooks.list().await.unwrap());
    assert!(
        !shown.contains(&old) && !shown.contains(&new),
        "a secret leaked"
    );
}

async fn gone_disables_the_endpoint_and_enable_resumes_in_order(db: TestDb) {
    let repo = db.repository();
    let mut receiver = Receiver::start();
    let hooks = Webhooks::new(repo.clone(), config());
    let (_, secret) = hooks
        .add("old", &receiver.url("old"), &[], "test")
        .await
        .unwrap();
    receiver.secrets("old", &[&secret]);
    receiver.behave("old", "gone");
    enqueue(&repo, 20, 4).await;
    let handle = dispatcher(&repo, &hooks, 2).await;
    wait_for(LIMIT, "the endpoint disabled", async || {
        !hooks.get("old").await.unwrap().enabled
    })
    .await;
    let endpoint = hooks.get("old").await.unwrap();
    assert_eq!(
        endpoint.disabled_reason.as_deref(),
        Some("the receiver answered 410 Gone")
    );
    let paused = repo.paused_event_types().await.unwrap();
    assert!(paused.iter().any(|p| p.event_type == "webhook:old"));
    // Disabled, nothing more is sent.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let tried = receiver.log().len();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        receiver.log().len(),
        tried,
        "a disabled endpoint got requests"
    );
    receiver.behave("old", "ok");
    assert!(hooks.enable("old", "test").await.unwrap());
    outbox_tests::drain(&repo, LIMIT).await;
    handle.shutdown().await;
    let log = receiver.log();
    assert_eq!(acknowledged(&log, "old").len(), 20);
    assert_eq!(order_violations(&acknowledged(&log, "old")), 0);
    let actions: Vec<String> = repo
        .audit_log(20)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.action)
        .collect();
    assert!(actions.contains(&"webhook-disable".to_string()));
    assert!(actions.contains(&"webhook-enable".to_string()));
}

async fn loopback_is_refused_unless_allowed(db: TestDb) {
    let repo = db.repository();
    let receiver = Receiver::start();
    // The default policy: public addresses only.
    let hooks = Webhooks::new(repo.clone(), WebhookConfig::default());
    hooks
        .add("local", &receiver.url("local"), &[], "test")
        .await
        .unwrap();
    enqueue(&repo, 1, 1).await;
    let handle = dispatcher(&repo, &hooks, 1).await;
    wait_for(LIMIT, "an attempt kept", async || {
        !hooks.attempts("local", 10).await.unwrap().is_empty()
    })
    .await;
    handle.shutdown().await;
    let attempt = &hooks.attempts("local", 10).await.unwrap()[0];
    let error = attempt.error.as_deref().unwrap_or_default();
    assert!(error.starts_with("refused: 127.0.0.1 resolves"), "{error}");
    assert_eq!(attempt.status_code, None);
    assert!(receiver.log().is_empty(), "the request reached loopback");
    assert_eq!(rows(&repo, "webhook:", EventStatus::Processed).await, 0);
}

async fn a_dead_endpoint_is_disabled_before_its_deliveries_fail(db: TestDb) {
    let repo = db.repository();
    let mut receiver = Receiver::start();
    let hooks = Webhooks::new(repo.clone(), config());
    let (_, secret) = hooks
        .add("down", &receiver.url("down"), &[], "test")
        .await
        .unwrap();
    receiver.secrets("down", &[&secret]);
    receiver.behave("down", "fail");
    enqueue(&repo, 6, 3).await;
    // The workers' default MaxRetryAttempts (5): a delivery's fourth failure disables the
    // endpoint, its fifth attempt waits for the enable.
    let worker = fast(2).with_max_retry_attempts(outbox_events::DEFAULT_MAX_RETRY_ATTEMPTS);
    let handle = dispatcher_with(&repo, &hooks, worker).await;
    wait_for(LIMIT, "the endpoint disabled", async || {
        !hooks.get("down").await.unwrap().enabled
    })
    .await;
    let reason = hooks.get("down").await.unwrap().disabled_reason.unwrap();
    assert!(reason.contains("its last attempt waits"), "{reason}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(rows(&repo, "webhook:", EventStatus::Failed).await, 0);
    receiver.behave("down", "ok");
    assert!(hooks.enable("down", "test").await.unwrap());
    outbox_tests::drain(&repo, LIMIT).await;
    handle.shutdown().await;
    assert_eq!(rows(&repo, "", EventStatus::Failed).await, 0);
    let log = receiver.log();
    assert_eq!(acknowledged(&log, "down").len(), 6);
    assert_eq!(order_violations(&acknowledged(&log, "down")), 0);
}

async fn retry_after_is_honoured(db: TestDb) {
    let repo = db.repository();
    let mut receiver = Receiver::start();
    let hooks = Webhooks::new(repo.clone(), config());
    let (_, secret) = hooks
        .add("busy", &receiver.url("busy"), &[], "test")
        .await
        .unwrap();
    receiver.secrets("busy", &[&secret]);
    receiver.behave("busy", "retry-after:2");
    enqueue(&repo, 1, 1).await;
    let handle = dispatcher(&repo, &hooks, 1).await;
    wait_for(LIMIT, "two attempts", async || receiver.log().len() >= 2).await;
    receiver.behave("busy", "ok");
    outbox_tests::drain(&repo, LIMIT).await;
    handle.shutdown().await;
    let log = receiver.log();
    assert_eq!(log[0]["status"], 429);
    let gap = log[1]["at"].as_f64().unwrap() - log[0]["at"].as_f64().unwrap();
    // The schedule's wait is 100 ms: the 2 s are the receiver's.
    assert!(
        gap >= 1.9,
        "the second attempt came {gap:.2} s after a Retry-After of 2"
    );
    assert_eq!(log[0]["id"], log[1]["id"], "one webhook-id across attempts");
}

async fn a_host_name_is_checked_after_dns(db: TestDb) {
    let repo = db.repository();
    let receiver = Receiver::start();
    let hooks = Webhooks::new(repo.clone(), WebhookConfig::default());
    let url = format!("http://localhost:{}/named", receiver.port);
    hooks.add("named", &url, &[], "test").await.unwrap();
    enqueue(&repo, 1, 1).await;
    let handle = dispatcher(&repo, &hooks, 1).await;
    wait_for(LIMIT, "an attempt kept", async || {
        !hooks.attempts("named", 10).await.unwrap().is_empty()
    })
    .await;
    handle.shutdown().await;
    let attempt = &hooks.attempts("named", 10).await.unwrap()[0];
    let error = attempt.error.as_deref().unwrap_or_default();
    assert!(
        error.starts_with("refused: localhost resolves to"),
        "{error}"
    );
    assert!(receiver.log().is_empty(), "the request reached loopback");
}

/// Enqueues `per_record` events of each of `records` (accounts) in one transaction.
async fn enqueue_records(
    repo: &std::sync::Arc<dyn outbox_events::OutboxRepository>,
    records: &[String],
    per_record: usize,
) {
    let events: Vec<outbox_events::NewEvent> = (0..per_record)
        .flat_map(|seq| {
            records.iter().map(move |record| {
                outbox_events::NewEvent::new(
                    crate::common::TYPES[0],
                    format!(
                        r#"{{"object":"Account","record_id":"{record}","snapshot":{{"seq":{seq}}}}}"#
                    ),
                )
            })
        })
        .collect();
    let mut tx = repo.begin().await.expect("begin");
    repo.enqueue(&mut tx, &events).await.expect("enqueue");
    tx.commit().await.expect("commit");
}

/// A receiver that answers 429 with `Retry-After` is sent nothing more by this process until
/// that time: the deliveries of its other records that come due meanwhile are snoozed until
/// then (not sent, not counted), and the endpoint is not pushed towards its disable by one
/// refusal per record.
async fn a_throttling_endpoint_is_left_alone_until_its_retry_after(db: TestDb) {
    const WINDOW_S: f64 = 4.0;
    let repo = db.repository();
    let mut receiver = Receiver::start();
    let hooks = Webhooks::new(repo.clone(), config());
    let (_, secret) = hooks
        .add("thr", &receiver.url("thr"), &[], "test")
        .await
        .unwrap();
    receiver.secrets("thr", &[&secret]);
    receiver.behave("thr", &format!("throttle:{WINDOW_S}"));
    let handle = dispatcher(&repo, &hooks, 4).await;
    enqueue_records(&repo, &["T00".to_string()], 1).await;
    // The attempt log's row is queued after the sender took the 429 in (the receiver logs
    // before it answers).
    wait_for(LIMIT, "the first 429 taken in", async || {
        !hooks.attempts("thr", 1).await.unwrap().is_empty()
    })
    .await;
    let later: Vec<String> = (1..=20).map(|i| format!("T{i:02}")).collect();
    enqueue_records(&repo, &later, 2).await;
    outbox_tests::drain(&repo, LIMIT).await;
    handle.shutdown().await;
    hooks.flush().await;
    let log = receiver.log();
    let first = &log[0];
    let window_end = first["at"].as_f64().unwrap() + WINDOW_S;
    let sent_in_window: Vec<&Value> = log
        .iter()
        .filter(|e| e["record"] != first["record"] && e["at"].as_f64().unwrap() < window_end)
        .collect();
    assert!(
        sent_in_window.is_empty(),
        "{} deliveries of other records were sent while the endpoint asked to wait: {sent_in_window:?}",
        sent_in_window.len()
    );
    let acks = acknowledged(&log, "thr");
    assert_eq!(
        acks.len(),
        1 + 2 * later.len(),
        "every delivery acknowledged"
    );
    assert_eq!(order_violations(&acks), 0);
    assert!(log.iter().all(|e| e["verifies"][0] == true));
    let deliveries = repo
        .list_events(outbox_events::EventFilter::new())
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.event_type.starts_with("webhook:"))
        .collect::<Vec<_>>();
    // Not vacuous: the later records' deliveries came due inside the window.
    let due_inside = deliveries
        .iter()
        .filter(|r| (r.created_date.timestamp_micros() as f64) / 1e6 < window_end)
        .count();
    assert!(
        due_inside > later.len(),
        "only {due_inside} deliveries were created inside the window: it tested nothing"
    );
    let counted: Vec<_> = deliveries.iter().filter(|r| r.retry_count > 0).collect();
    assert_eq!(
        counted.len(),
        1,
        "only the delivery that got the 429 counts a failure: {counted:?}"
    );
    let endpoint = &hooks.list().await.unwrap()[0];
    assert!(endpoint.enabled);
    assert_eq!(endpoint.consecutive_failures, 0);
}

backend_tests!(
    a_throttling_endpoint_is_left_alone_until_its_retry_after,
    a_dead_endpoint_is_disabled_before_its_deliveries_fail,
    retry_after_is_honoured,
    a_host_name_is_checked_after_dns,
    every_delivery_verifies_in_order_per_endpoint_and_record,
    a_failing_endpoint_or_record_holds_back_no_one,
    a_rotated_secret_verifies_under_both_keys,
    gone_disables_the_endpoint_and_enable_resumes_in_order,
    loopback_is_refused_unless_allowed,
);
