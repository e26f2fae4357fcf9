//! The effect ledger (docs/state-machine.md, "The effect ledger") on real databases: a handler
//! sends through `ctx.effect(…).once(…)` to a receiver that logs every call. An effect runs once
//! per event, also when its handler failed after it and ran again, also on a redelivery, and its
//! result is handed back to the later run; a batch given back after its handler sent does not
//! send again; an attempt that dies between its send and its commit repeats the send with the
//! same key, and only then. Counts are read from the receiver's log and the database.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, Consumer, DispatchMode, Dispatcher, DispatcherHandle, EffectKind, ExternalKind,
    Handler, HandlerError, Handlers, OutboxEvent, Safeguard, WorkerConfig,
};
use outbox_persistence::{NewEvent, idempotency_key, statement, with_tx};
use outbox_tests::{TestDb, backend_tests, drain};
use record_key::EventEnvelope;

const EVENT_TYPE: &str = "account.welcome";
const HANDLER_ID: &str = "welcome-mail";
const EFFECT: &str = "welcome";

/// The receiver's log: every key it was sent, in order, and how often each handler ran.
#[derive(Default)]
struct Receiver {
    sends: Mutex<Vec<String>>,
    runs: Mutex<HashMap<uuid::Uuid, u32>>,
    /// Set once a `hold` event's send happened (its first run then waits to be cut).
    held: AtomicBool,
    /// Outside locks taken on `lock` events' rows: held until dropped.
    locks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Receiver {
    /// Receives `key`: the message id it answers (one per call, so a repeat is visible).
    fn send(&self, key: &str) -> String {
        let mut sends = self.sends.lock().unwrap();
        sends.push(key.to_owned());
        format!("msg-{}", sends.len())
    }

    fn sends(&self) -> Vec<String> {
        self.sends.lock().unwrap().clone()
    }
}

/// Sends the welcome email through the ledger, then writes the provider's message id into its
/// own row; as its snapshot's `do` says, it then fails once (`fail`), holds its first run until
/// shutdown cuts it (`hold`), or has its outbox row locked from outside past the settle's lock
/// timeout on its first run (`lock`, PostgreSQL).
struct Mail {
    receiver: Arc<Receiver>,
    db_url: Option<String>,
}

#[async_trait]
impl Handler for Mail {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let first_run = {
            let mut runs = self.receiver.runs.lock().unwrap();
            let n = runs.entry(event.id).or_default();
            *n += 1;
            *n == 1
        };
        let what = EventEnvelope::parse(&event.payload)
            .expect("a test payload")
            .snapshot["do"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        let receiver = self.receiver.clone();
        let message_id: String = ctx
            .effect(EFFECT)
            .once(|key| async move { Ok(receiver.send(&key)) })
            .await?;
        with_tx!(ctx.tx(), |conn| {
            statement::query(
                "INSERT INTO mail_log (event_id, message_id) VALUES ($1, $2)
                 ON CONFLICT (event_id) DO UPDATE SET message_id = excluded.message_id",
            )
            .bind(event.id.to_string())
            .bind(&message_id)
            .execute(conn)
            .await
            .map(|r| r.rows_affected())
        })?;
        match what.as_str() {
            "fail" if event.retry_count == 0 => Err(HandlerError::Retryable(
                "the provider answered, then our own step failed".into(),
            )),
            "hold" if first_run => {
                self.receiver.held.store(true, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(600)).await;
                Ok(())
            }
            "lock" if first_run => {
                self.lock_from_outside(event.id).await;
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

impl Mail {
    /// Locks `id`'s outbox row in another session for a second (an operator's transaction
    /// beside the worker): the settle's `processed` write meets it past the lock timeout.
    async fn lock_from_outside(&self, id: uuid::Uuid) {
        use sqlx::Connection as _;
        let url = self.db_url.clone().expect("PostgreSQL");
        let (locked_tx, locked) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            sqlx::query("SELECT 1 FROM _System_OutboxEvent WHERE Id = $1 FOR NO KEY UPDATE")
                .bind(id)
                .execute(&mut *tx)
                .await
                .unwrap();
            locked_tx.send(()).unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            tx.rollback().await.unwrap();
        });
        locked.await.unwrap();
        self.receiver.locks.lock().unwrap().push(task);
    }
}

fn consumer() -> Consumer {
    Consumer::new(HANDLER_ID, EVENT_TYPE).effect(
        EffectKind::External {
            kind: ExternalKind::Email,
        },
        "welcome email through the provider",
        Some(Safeguard::Ledger),
    )
}

fn config(workers: usize) -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .with_workers(workers)
        .with_poll_interval(Duration::from_millis(20))
        .with_retry_delay(Duration::from_millis(20))
        .with_max_retry_delay(Duration::from_millis(50))
        .with_heartbeat_interval(Duration::from_millis(200))
        .with_stale_after(Duration::from_secs(1))
        .with_lock_timeout(Duration::from_millis(300))
        .with_shutdown_timeout(Duration::from_millis(200))
}

/// Pull workers for the mail consumer, registered through the ledger: the rollout gate is
/// evaluated (not skipped) and must pass.
async fn start(db: &TestDb, receiver: &Arc<Receiver>) -> DispatcherHandle {
    start_with(db, receiver, config(2)).await
}

/// [`start`] with `config`.
async fn start_with(
    db: &TestDb,
    receiver: &Arc<Receiver>,
    config: WorkerConfig,
) -> DispatcherHandle {
    let mail = Mail {
        receiver: receiver.clone(),
        db_url: db.pg().map(|_| db.url.clone()),
    };
    let handlers = Handlers::new().register_with_ledger(consumer(), mail);
    Dispatcher::new(db.repository(), handlers, config)
        .start_pull()
        .await
        .expect("the gate passes for a consumer that sends through the ledger")
}

/// Sets up the application's table and enqueues one event per entry of `what`, each on a
/// record of its own; their ids.
async fn enqueue(db: &TestDb, what: &[&str]) -> Vec<uuid::Uuid> {
    db.execute("CREATE TABLE mail_log (event_id TEXT PRIMARY KEY, message_id TEXT NOT NULL)")
        .await;
    let repo = db.repository();
    let events: Vec<NewEvent> = what
        .iter()
        .enumerate()
        .map(|(i, what)| {
            let payload = format!(
                r#"{{"object":"Account","record_id":"a{i}","snapshot":{{"do":"{what}"}}}}"#
            );
            NewEvent::new(EVENT_TYPE, payload)
        })
        .collect();
    let mut tx = repo.begin().await.unwrap();
    let ids = repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

/// The ledger's rows: event id and idempotency key.
async fn ledger(db: &TestDb) -> Vec<(String, String)> {
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let mut rows: Vec<(String, String)> = with_tx!(&mut tx, |conn| {
        statement::query_as(
            "SELECT CAST(EventId AS TEXT), IdempotencyKey FROM _System_OutboxEffect
             WHERE HandlerId = 'welcome-mail' AND EffectKey = 'welcome'",
        )
        .fetch_all(conn)
        .await
    })
    .unwrap();
    tx.rollback().await.unwrap();
    rows.sort();
    rows
}

async fn message_id(db: &TestDb, id: uuid::Uuid) -> String {
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let found: String = with_tx!(&mut tx, |conn| {
        statement::query_scalar("SELECT message_id FROM mail_log WHERE event_id = $1")
            .bind(id.to_string())
            .fetch_one(conn)
            .await
    })
    .unwrap();
    tx.rollback().await.unwrap();
    found
}

/// Each event's effect ran once with its own key, and the key is the one the ledger derives.
fn assert_sent_once(sends: &[String], ids: &[uuid::Uuid]) {
    let mut expected: Vec<String> = ids
        .iter()
        .map(|id| idempotency_key(HANDLER_ID, *id, EFFECT))
        .collect();
    let mut got = sends.to_vec();
    expected.sort();
    got.sort();
    assert_eq!(got, expected, "one send per event, with the ledger's key");
}

/// Three events succeed, three fail once after their send and succeed on their retry: each
/// effect runs once, and the retry writes the message id the first run got. A redelivery of
/// every event (their rows set back to `pending`) runs each handler again and sends nothing.
async fn an_effect_runs_once_and_its_result_is_handed_back(db: TestDb) {
    runs_once_and_hands_back(db, config(2)).await;
}

/// The same with one event per attempt: a failed handler's effects are written after the
/// rollback to its savepoint, before its retry (`finish_failure`).
async fn an_effect_runs_once_with_one_event_per_attempt(db: TestDb) {
    runs_once_and_hands_back(db, config(2).without_batches()).await;
}

/// The same in batches (one worker, a long budget): a failed handler's effects are written at
/// the settle with its failure.
async fn an_effect_runs_once_in_batches(db: TestDb) {
    runs_once_and_hands_back(db, config(1).with_batches(32, Duration::from_secs(5))).await;
}

async fn runs_once_and_hands_back(db: TestDb, config: WorkerConfig) {
    let ids = enqueue(&db, &["ok", "ok", "ok", "fail", "fail", "fail"]).await;
    let receiver = Arc::new(Receiver::default());
    let handle = start_with(&db, &receiver, config.clone()).await;
    drain(&db.repository(), Duration::from_secs(30)).await;
    handle.shutdown().await;

    let sends = receiver.sends();
    assert_sent_once(&sends, &ids);
    for id in &ids {
        let event = db.repository().get_event(*id).await.unwrap().unwrap();
        let key = idempotency_key(HANDLER_ID, *id, EFFECT);
        let sent_as = sends.iter().position(|k| *k == key).unwrap() + 1;
        // The retry of a `fail` event got the first run's message id back from the ledger.
        assert_eq!(message_id(&db, *id).await, format!("msg-{sent_as}"));
        let runs = receiver.runs.lock().unwrap()[id];
        assert_eq!(runs, if ids[3..].contains(id) { 2 } else { 1 });
        assert_eq!(event.retry_count, i32::from(runs == 2));
    }
    let rows = ledger(&db).await;
    assert_eq!(rows.len(), 6);
    // Operators read them back by event: keys, results, handler and effect names.
    let recorded = db.repository().effects_of(&ids).await.unwrap();
    assert_eq!(recorded.len(), 6);
    for e in &recorded {
        assert_eq!(
            (e.handler_id.as_str(), e.effect_key.as_str()),
            (HANDLER_ID, EFFECT)
        );
        assert_eq!(
            e.idempotency_key,
            idempotency_key(HANDLER_ID, e.event_id, EFFECT)
        );
        let sent_as = sends.iter().position(|k| *k == e.idempotency_key).unwrap() + 1;
        assert_eq!(
            e.result.as_deref(),
            Some(format!("\"msg-{sent_as}\"").as_str())
        );
    }
    for (event_id, key) in &rows {
        let id = uuid::Uuid::parse_str(event_id).unwrap();
        assert_eq!(*key, idempotency_key(HANDLER_ID, id, EFFECT));
    }

    // A redelivery of events whose attempts committed: every handler runs, nothing is sent.
    db.execute("UPDATE _System_OutboxEvent SET Status = 'pending'")
        .await;
    let handle = start_with(&db, &receiver, config).await;
    drain(&db.repository(), Duration::from_secs(30)).await;
    handle.shutdown().await;
    assert_eq!(receiver.sends(), sends, "a redelivery sent again");
    for id in &ids {
        assert!(receiver.runs.lock().unwrap()[id] >= 2);
    }
    assert_eq!(ledger(&db).await, rows);
}

/// Waits for the `hold` event's send.
async fn until_held(receiver: &Receiver) {
    let waited = std::time::Instant::now();
    while !receiver.held.load(Ordering::SeqCst) {
        assert!(
            waited.elapsed() < Duration::from_secs(30),
            "the send never happened"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A hard shutdown (past its timeout) cuts an attempt after its send: its row is left to stale
/// reclaim, and the send it made gets one bounded try in the ledger. The reclaim's run skips
/// it and gets its result back.
async fn a_hard_shutdown_records_what_its_attempt_sent(db: TestDb) {
    hard_shutdown_after_a_send(db, config(2).without_batches(), &["hold"]).await;
}

/// The same in a batch: the held event runs in a batch's segment (after an event alone, which
/// a worker measures first, and one in the batch before it).
async fn a_hard_shutdown_records_what_its_batch_sent(db: TestDb) {
    let batches = config(1).with_batches(32, Duration::from_secs(5));
    hard_shutdown_after_a_send(db, batches, &["ok", "ok", "hold"]).await;
}

async fn hard_shutdown_after_a_send(db: TestDb, config: WorkerConfig, what: &[&str]) {
    let ids = enqueue(&db, what).await;
    let held = *ids.last().unwrap();
    let receiver = Arc::new(Receiver::default());
    let handle = start_with(&db, &receiver, config.clone()).await;
    until_held(&receiver).await;
    assert!(!handle.shutdown().await.graceful);
    let key = idempotency_key(HANDLER_ID, held, EFFECT);
    assert!(
        ledger(&db).await.contains(&(held.to_string(), key.clone())),
        "the cut attempt's send is in the ledger"
    );
    let event = db.repository().get_event(held).await.unwrap().unwrap();
    assert_eq!(event.status.as_str(), "processing", "left to stale reclaim");

    let handle = start_with(&db, &receiver, config).await;
    drain(&db.repository(), Duration::from_secs(30)).await;
    handle.shutdown().await;
    assert_sent_once(&receiver.sends(), &ids);
    assert_eq!(receiver.runs.lock().unwrap()[&held], 2);
    let event = db.repository().get_event(held).await.unwrap().unwrap();
    assert_eq!(
        event.retry_count, 1,
        "the cut attempt is counted by its reclaim"
    );
    // The reclaim's run got the cut run's message id back.
    let sent_as = receiver.sends().iter().position(|k| *k == key).unwrap() + 1;
    assert_eq!(message_id(&db, held).await, format!("msg-{sent_as}"));
}

/// The one repeat the ledger cannot prevent: the attempt dies (its process: here its runtime,
/// dropped with every task and connection, no code of the worker running after) between the
/// send and its commit. The stale reclaim runs the handler again, which sends again, with the
/// same key, so a receiver that honours the key absorbs it.
async fn an_attempt_that_died_after_its_send_repeats_it_with_the_same_key(db: TestDb) {
    let ids = enqueue(&db, &["hold"]).await;
    let receiver = Arc::new(Receiver::default());
    let process = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (url, receiver_there) = (db.url.clone(), receiver.clone());
    let db_url = db.pg().map(|_| db.url.clone());
    process.spawn(async move {
        let own = outbox_persistence::Database::connect(&url, Default::default())
            .await
            .unwrap();
        let mail = Mail {
            receiver: receiver_there,
            db_url,
        };
        let handlers = Handlers::new().register_with_ledger(consumer(), mail);
        let handle = Dispatcher::new(own.repository(), handlers, config(2))
            .start_pull()
            .await
            .unwrap();
        // Never shut down: the process dies with it.
        std::future::pending::<()>().await;
        drop(handle);
    });
    until_held(&receiver).await;
    process.shutdown_background();
    assert!(
        ledger(&db).await.is_empty(),
        "the dead attempt recorded nothing"
    );

    let handle = start(&db, &receiver).await;
    drain(&db.repository(), Duration::from_secs(30)).await;
    handle.shutdown().await;
    let key = idempotency_key(HANDLER_ID, ids[0], EFFECT);
    assert_eq!(receiver.sends(), vec![key.clone(), key.clone()]);
    assert_eq!(ledger(&db).await, vec![(ids[0].to_string(), key)]);
    let event = db.repository().get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(
        event.retry_count, 1,
        "the dead attempt is counted by its reclaim"
    );
    // The second run's message id is the one its own send returned.
    assert_eq!(message_id(&db, ids[0]).await, "msg-2");
}

backend_tests!(
    with_pgbouncer: an_effect_runs_once_and_its_result_is_handed_back,
    an_effect_runs_once_with_one_event_per_attempt,
    an_effect_runs_once_in_batches,
    a_hard_shutdown_records_what_its_attempt_sent,
    a_hard_shutdown_records_what_its_batch_sent,
    an_attempt_that_died_after_its_send_repeats_it_with_the_same_key,
);

/// A batch given back at its settle after its handler sent (an outside lock on the event's
/// row outlasts the settle's lock timeout: rolled back whole, every event given back
/// uncounted) keeps the send in the ledger: the event runs again and sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_batch_given_back_after_its_handler_sent_does_not_send_again() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let ids = enqueue(&db, &["ok", "lock", "ok", "ok", "ok"]).await;
    let receiver = Arc::new(Receiver::default());
    // One worker with a long batch budget: it runs the first event alone (it measures its
    // handler first) and the other four as one batch.
    let batches = config(1).with_batches(32, Duration::from_secs(5));
    let handle = start_with(&db, &receiver, batches).await;
    drain(&db.repository(), Duration::from_secs(30)).await;
    handle.shutdown().await;
    let locks = std::mem::take(&mut *receiver.locks.lock().unwrap());
    for task in locks {
        task.await.unwrap();
    }
    assert_sent_once(&receiver.sends(), &ids);
    assert_eq!(
        receiver.runs.lock().unwrap()[&ids[1]],
        2,
        "the locked event's batch was given back and ran again"
    );
    let event = db.repository().get_event(ids[1]).await.unwrap().unwrap();
    assert_eq!(event.retry_count, 0, "a give-back is not counted");
    assert_eq!(ledger(&db).await.len(), 5);
    assert_eq!(message_id(&db, ids[1]).await, "msg-2");
}

/// `outbox_effects_total` counts an effect run, then skipped when the ledger records it
/// (SQLite, on this thread's recorder).
#[tokio::test]
async fn the_metrics_count_effects_run_and_skipped() {
    let db = TestDb::sqlite().await;
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let ids = enqueue(&db, &["ok"]).await;
    let repo = db.repository();
    let event = repo.get_event(ids[0]).await.unwrap().unwrap();
    let mut tx = repo.begin().await.unwrap();
    for _ in 0..2 {
        let mut ctx = AttemptContext::for_event(&mut tx, HANDLER_ID, &event);
        let id: String = ctx
            .effect(EFFECT)
            .once(|key| async move { Ok(key) })
            .await
            .unwrap();
        assert_eq!(id, idempotency_key(HANDLER_ID, event.id, EFFECT));
    }
    tx.rollback().await.unwrap();
    let text = handle.render();
    for outcome in ["run", "skipped"] {
        let line = format!(
            r#"outbox_effects_total{{handler="{HANDLER_ID}",effect="{EFFECT}",outcome="{outcome}"}} 1"#
        );
        assert!(text.contains(&line), "{line} missing from\n{text}");
    }
}
