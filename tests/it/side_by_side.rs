//! Transaction-free handlers run side by side in a batch (docs/state-machine.md, "Batched
//! attempts", rule 10): a handler that declares `runs_without_tx` and sends through the ledger
//! is run beside the others of its batch on PostgreSQL, one event per record at a time, and one
//! after another on SQLite. Checked from the handler's own log (how many ran at once, whether
//! two of one record ever did, the order each record's events started in), the receiver's
//! sends and the database: every event `processed`, each effect sent once with the ledger's
//! key, recorded in the ledger, and not sent again on a redelivery.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, Consumer, DispatchMode, Dispatcher, EffectKind, EventStatus, ExternalKind,
    Handler, HandlerError, Handlers, OutboxEvent, Safeguard, WorkerConfig,
};
use outbox_persistence::{NewEvent, idempotency_key, statement, with_tx};
use outbox_tests::{TestDb, backend_tests, drain};
use record_key::EventEnvelope;

const EVENT_TYPE: &str = "account.notified";
const HANDLER_ID: &str = "notify";
const EFFECT: &str = "notify";

/// What the handler saw: the records running now, the most events that ran at once, whether
/// two of one record ever ran at once, each record's events in the order they started
/// (their `seq`), every key the receiver was sent and how often each event ran.
#[derive(Default)]
struct Log {
    running: Vec<String>,
    most_at_once: usize,
    record_overlap: bool,
    started: HashMap<String, Vec<i64>>,
    sends: Vec<String>,
    runs: HashMap<uuid::Uuid, u32>,
}

/// Notifies a receiver through the ledger after a 50 ms wait (a slow send), twice under one
/// effect name (the second must hand the first's result back), and never touches the
/// transaction, unless `asks_for_tx`: then it asks for it when its context has none. As its
/// snapshot's `do` says, it fails once after its send (`fail`).
struct Notify {
    log: Arc<Mutex<Log>>,
    asks_for_tx: bool,
}

/// Takes the event's record off the running list when its run ends, however it ends.
struct Running<'a>(&'a Mutex<Log>, String);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut log = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let at = log.running.iter().position(|r| *r == self.1).unwrap();
        log.running.remove(at);
    }
}

#[async_trait]
impl Handler for Notify {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let envelope = EventEnvelope::parse(&event.payload).expect("a test payload");
        let record = envelope.record_id.clone().unwrap();
        let seq = envelope.snapshot["seq"].as_i64().unwrap();
        let fail = envelope.snapshot["do"] == "fail";
        let _running = {
            let mut log = self.log.lock().unwrap();
            log.record_overlap |= log.running.contains(&record);
            log.running.push(record.clone());
            log.most_at_once = log.most_at_once.max(log.running.len());
            log.started.entry(record.clone()).or_default().push(seq);
            *log.runs.entry(event.id).or_default() += 1;
            Running(&self.log, record)
        };
        if self.asks_for_tx && !ctx.has_tx() {
            ctx.lock_free_tx();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let log = self.log.clone();
        let first: String = ctx
            .effect(EFFECT)
            .once(|key| async move {
                let mut log = log.lock().unwrap();
                log.sends.push(key);
                Ok(format!("msg-{}", log.sends.len()))
            })
            .await?;
        let again: String = ctx
            .effect(EFFECT)
            .once(|_| async { Err(HandlerError::Permanent("sent twice".into())) })
            .await?;
        assert_eq!(
            first, again,
            "the second call hands the first's result back"
        );
        if fail && event.retry_count == 0 {
            return Err(HandlerError::Retryable("failed after its send".into()));
        }
        Ok(())
    }

    fn runs_without_tx(&self) -> bool {
        true
    }
}

fn consumer() -> Consumer {
    Consumer::new(HANDLER_ID, EVENT_TYPE).effect(
        EffectKind::External {
            kind: ExternalKind::Webhook,
        },
        "a notification to a receiver",
        Some(Safeguard::Ledger),
    )
}

/// One worker with batches of 32 and a long budget: what it claims together runs as one batch.
fn config() -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .with_workers(1)
        .with_poll_interval(Duration::from_millis(20))
        .with_retry_delay(Duration::from_millis(20))
        .with_max_retry_delay(Duration::from_millis(50))
        .with_heartbeat_interval(Duration::from_millis(200))
        .with_stale_after(Duration::from_secs(5))
        .with_batches(32, Duration::from_secs(5))
}

/// Enqueues `per_record` events on each of `records` records (interleaved, `seq` in order),
/// the first event of record 1 set to fail once after its send; their ids. (The worker runs
/// its first claim, the oldest row, alone to measure its handler: record 1's first row is in
/// the batch after it.)
async fn enqueue(db: &TestDb, records: usize, per_record: usize) -> Vec<uuid::Uuid> {
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..per_record)
        .flat_map(|seq| (0..records).map(move |r| (r, seq)))
        .map(|(r, seq)| {
            let what = if (r, seq) == (1, 0) { "fail" } else { "ok" };
            let payload = format!(
                r#"{{"object":"Account","record_id":"r{r}","snapshot":{{"seq":{seq},"do":"{what}"}}}}"#
            );
            NewEvent::new(EVENT_TYPE, payload)
        })
        .collect();
    let mut tx = repo.begin().await.unwrap();
    let ids = repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

async fn run(db: &TestDb, log: &Arc<Mutex<Log>>, asks_for_tx: bool) {
    let notify = Notify {
        log: log.clone(),
        asks_for_tx,
    };
    let handlers = Handlers::new().register_with_ledger(consumer(), notify);
    let handle = Dispatcher::new(db.repository(), handlers, config())
        .start_pull()
        .await
        .expect("the gate passes for a consumer that sends through the ledger");
    drain(&db.repository(), Duration::from_secs(30)).await;
    handle.shutdown().await;
}

/// The ledger's keys, by event.
async fn ledger(db: &TestDb) -> Vec<(String, String)> {
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let mut rows: Vec<(String, String)> = with_tx!(&mut tx, |conn| {
        statement::query_as(
            "SELECT CAST(EventId AS TEXT), IdempotencyKey FROM _System_OutboxEffect
             WHERE HandlerId = 'notify' AND EffectKey = 'notify'",
        )
        .fetch_all(conn)
        .await
    })
    .unwrap();
    tx.rollback().await.unwrap();
    for row in &mut rows {
        row.0 = row.0.to_lowercase();
    }
    rows.sort();
    rows
}

/// Six records of three events each: on PostgreSQL the batch runs several at once, never two
/// of one record, each record's events in order (the failing first event of record 1, run in
/// a group, holds its later ones back until its retry succeeds); on SQLite one at a time. Each effect is
/// sent once, with the ledger's key, and recorded; a redelivery sends nothing.
async fn transaction_free_handlers_run_side_by_side_one_per_record(db: TestDb) {
    let ids = enqueue(&db, 6, 3).await;
    let log = Arc::new(Mutex::new(Log::default()));
    run(&db, &log, false).await;
    let sends = {
        let log = log.lock().unwrap();
        assert!(!log.record_overlap, "two events of one record ran at once");
        if db.pg().is_some() {
            assert!(
                log.most_at_once >= 2,
                "the batch ran its handlers one after another"
            );
        } else {
            assert_eq!(log.most_at_once, 1, "SQLite runs them one after another");
        }
        for (record, seqs) in &log.started {
            assert!(
                seqs.windows(2).all(|w| w[0] <= w[1]),
                "record {record}'s events started out of order: {seqs:?}"
            );
        }
        assert_eq!(log.started["r1"], vec![0, 0, 1, 2]);
        log.sends.clone()
    };
    let mut expected: Vec<(String, String)> = ids
        .iter()
        .map(|id| (id.to_string(), idempotency_key(HANDLER_ID, *id, EFFECT)))
        .collect();
    expected.sort();
    let mut sent = sends.clone();
    sent.sort();
    let mut keys: Vec<String> = expected.iter().map(|(_, k)| k.clone()).collect();
    keys.sort();
    assert_eq!(sent, keys, "one send per event, with the ledger's key");
    assert_eq!(ledger(&db).await, expected);
    for id in &ids {
        let event = db.repository().get_event(*id).await.unwrap().unwrap();
        assert_eq!(event.status, EventStatus::Processed);
        assert_eq!(event.retry_count, i32::from(*id == ids[1]));
    }

    // A redelivery of every event: each handler runs again, nothing is sent.
    db.execute("UPDATE _System_OutboxEvent SET Status = 'pending', RetryCount = 0")
        .await;
    run(&db, &log, false).await;
    let log = log.lock().unwrap();
    assert_eq!(log.sends, sends, "a redelivery sent again");
    assert!(log.runs.values().all(|&n| n >= 2));
}

backend_tests!(transaction_free_handlers_run_side_by_side_one_per_record);

/// A handler that declares it runs without the transaction but asks for it anyway fails that
/// attempt (retryable) and succeeds on its retry, run alone with its transaction: nothing is
/// lost, nothing is sent twice. (The worker runs its first claim alone, with its transaction,
/// to measure its handler: that one succeeds at once; record 1's first row fails once after
/// its send, on its first attempt or its retry.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_handler_that_asks_for_the_transaction_it_declared_it_does_not_need_runs_alone()
{
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let ids = enqueue(&db, 6, 1).await;
    let log = Arc::new(Mutex::new(Log::default()));
    run(&db, &log, true).await;
    let (sends, runs) = {
        let log = log.lock().unwrap();
        (log.sends.clone(), log.runs.clone())
    };
    let mut keys: Vec<String> = ids
        .iter()
        .map(|id| idempotency_key(HANDLER_ID, *id, EFFECT))
        .collect();
    keys.sort();
    let mut sent = sends;
    sent.sort();
    assert_eq!(sent, keys, "one send per event");
    let mut retried = 0;
    for id in &ids {
        let event = db.repository().get_event(*id).await.unwrap().unwrap();
        assert_eq!(event.status, EventStatus::Processed);
        assert_eq!(runs[id], 1 + event.retry_count as u32);
        retried += event.retry_count;
    }
    assert!(retried >= 2, "the batch's handlers did not fail: {retried}");
}
