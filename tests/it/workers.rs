//! The pull workers on real databases: ordering under failures, lock timeouts, slow handlers
//! with live heartbeats, and killed connections. Every invariant is read back from the
//! database.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, DispatchMode, Dispatcher, Handler, HandlerError, Handlers, OutboxEvent,
    WorkerConfig,
};
use outbox_persistence::{NewEvent, OutboxRepository, with_tx};
use outbox_tests::{Backend, TestDb, backend_tests, drain};
use record_key::EventEnvelope;

/// Creates the effect log the test handlers write into, inside the attempt transaction.
async fn create_effect_log(db: &TestDb) {
    match db.backend() {
        Backend::Postgres => {
            db.execute(
                "CREATE TABLE test_effect (n BIGSERIAL PRIMARY KEY, event_id TEXT NOT NULL,
                   record_key TEXT NOT NULL, seq BIGINT NOT NULL)",
            )
            .await
        }
        Backend::Sqlite => {
            db.execute(
                "CREATE TABLE test_effect (n INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL,
                   record_key TEXT NOT NULL, seq BIGINT NOT NULL)",
            )
            .await
        }
    }
}

fn payload(record: usize, seq: usize) -> String {
    format!(r#"{{"object":"Account","record_id":"A{record}","snapshot":{{"seq":{seq}}}}}"#)
}

/// A stable pseudo-random draw in [0, 1) for an event's attempt.
fn draw(event: &OutboxEvent, salt: u64) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ salt;
    for b in event
        .id
        .as_bytes()
        .iter()
        .chain(&event.retry_count.to_le_bytes())
    {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// Writes one effect row per event, checks in the attempt that the key's events arrive in
/// order, and fails a share of attempts on purpose (half of them after writing, so the
/// savepoint rollback is exercised). Each attempt marks its key in flight from its start to its
/// end (whatever way it ends), so two attempts of one key that overlap in time are caught even
/// when both roll back.
struct OrderedEffect {
    fail_rate: f64,
    injected: Arc<AtomicU64>,
    out_of_order: Arc<AtomicU64>,
    in_flight: Arc<Mutex<HashMap<String, u32>>>,
    overlaps: Arc<AtomicU64>,
}

/// The key of one running attempt, released when the attempt ends.
struct InFlight<'a> {
    keys: &'a Mutex<HashMap<String, u32>>,
    key: String,
}

impl<'a> InFlight<'a> {
    fn enter(keys: &'a Mutex<HashMap<String, u32>>, key: &str, overlaps: &AtomicU64) -> Self {
        let mut map = keys.lock().unwrap();
        let n = map.entry(key.to_string()).or_default();
        *n += 1;
        if *n > 1 {
            overlaps.fetch_add(1, Ordering::SeqCst);
        }
        Self {
            keys,
            key: key.to_string(),
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(n) = self.keys.lock().unwrap().get_mut(&self.key) {
            *n -= 1;
        }
    }
}

#[async_trait]
impl Handler for OrderedEffect {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let envelope = EventEnvelope::parse(&event.payload)
            .map_err(|e| HandlerError::Permanent(e.to_string()))?;
        let seq = envelope
            .snapshot
            .get("seq")
            .and_then(|v| v.as_i64())
            .ok_or_else(|| HandlerError::Permanent("no seq".into()))?;
        let key = event
            .record_key
            .clone()
            .map(outbox_persistence::RecordKey::into_string)
            .unwrap_or_default();
        let _in_flight = InFlight::enter(&self.in_flight, &key, &self.overlaps);
        // Long enough for another worker to take the key meanwhile, were it eligible.
        tokio::time::sleep(Duration::from_millis(2)).await;
        let roll = draw(event, 7);
        if roll < self.fail_rate / 2.0 {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(HandlerError::Retryable(
                "injected failure before the effect".into(),
            ));
        }
        let last: Option<i64> = with_tx!(ctx.tx(), |conn| {
            sqlx::query_scalar("SELECT max(seq) FROM test_effect WHERE record_key = $1")
                .persistent(outbox_tests::persistent())
                .bind(&key)
                .fetch_one(conn)
                .await
        })
        .map_err(HandlerError::db)?;
        if last.is_some_and(|last| last >= seq) {
            self.out_of_order.fetch_add(1, Ordering::SeqCst);
        }
        with_tx!(ctx.tx(), |conn| {
            sqlx::query("INSERT INTO test_effect (event_id, record_key, seq) VALUES ($1, $2, $3)")
                .persistent(outbox_tests::persistent())
                .bind(event.id.to_string())
                .bind(&key)
                .bind(seq)
                .execute(conn)
                .await
                .map(|r| r.rows_affected())
        })
        .map_err(HandlerError::db)?;
        if roll < self.fail_rate {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(HandlerError::Retryable(
                "injected failure after the effect".into(),
            ));
        }
        Ok(())
    }
}

fn fast_config(workers: usize) -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("tests of the worker mechanics with undeclared handlers")
        .with_workers(workers)
        .with_poll_interval(Duration::from_millis(50))
        .with_retry_delay(Duration::from_millis(5))
        .with_max_retry_delay(Duration::from_millis(40))
        .with_max_retry_attempts(25)
        .with_heartbeat_interval(Duration::from_millis(500))
        .with_stale_after(Duration::from_secs(30))
        .with_lock_timeout(Duration::from_millis(300))
}

async fn enqueue_all(repo: &Arc<dyn OutboxRepository>, events: Vec<NewEvent>) {
    for chunk in events.chunks(500) {
        let mut tx = repo.begin().await.unwrap();
        repo.enqueue(&mut tx, chunk).await.unwrap();
        tx.commit().await.unwrap();
    }
}

async fn ordered_drain(db: TestDb, mode: DispatchMode) {
    create_effect_log(&db).await;
    let repo = db.repository();
    let (records, per_record) = (100, 20);
    let mut events = Vec::new();
    for seq in 0..per_record {
        for record in 0..records {
            events.push(NewEvent::new("account.changed", payload(record, seq)));
        }
    }
    enqueue_all(&repo, events).await;
    let injected = Arc::new(AtomicU64::new(0));
    let out_of_order = Arc::new(AtomicU64::new(0));
    let overlaps = Arc::new(AtomicU64::new(0));
    let handlers = Handlers::new().register(
        "account.changed",
        OrderedEffect {
            fail_rate: 0.15,
            injected: injected.clone(),
            out_of_order: out_of_order.clone(),
            in_flight: Arc::default(),
            overlaps: overlaps.clone(),
        },
    );
    let dispatcher = Dispatcher::new(repo.clone(), handlers, fast_config(8).with_mode(mode))
        .start()
        .await
        .unwrap();
    drain(&repo, Duration::from_secs(240)).await;
    let report = dispatcher.shutdown().await;
    assert!(report.graceful);

    let total = (records * per_record) as i64;
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed'")
            .await,
        total
    );
    assert_eq!(
        db.count("SELECT count(*) FROM test_effect").await,
        total,
        "one effect per event"
    );
    assert_eq!(
        db.count("SELECT count(DISTINCT event_id) FROM test_effect")
            .await,
        total
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM test_effect a JOIN test_effect b
               ON a.record_key = b.record_key AND a.n < b.n AND a.seq > b.seq"
        )
        .await,
        0,
        "per-record order in the effect log"
    );
    assert_eq!(
        out_of_order.load(Ordering::SeqCst),
        0,
        "handlers saw their key's events in order"
    );
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "never two attempts of one key at once"
    );
    let retries = db
        .count("SELECT coalesce(sum(RetryCount), 0) FROM _System_OutboxEvent")
        .await;
    let injected = injected.load(Ordering::SeqCst) as i64;
    assert!(injected > 100, "failures were injected ({injected})");
    assert_eq!(
        retries, injected,
        "every injected failure is counted once in RetryCount"
    );
    assert_eq!(report.metrics.retried as i64, injected);
}

/// 8 pull workers, 2,000 events over 100 keys, 15% of attempts failing.
async fn pull_workers_keep_order_under_failures(db: TestDb) {
    ordered_drain(db, DispatchMode::Pull).await;
}

/// The legacy dispatcher keeps the same invariants (it is the flag-off path).
async fn legacy_dispatcher_keeps_order_under_failures(db: TestDb) {
    ordered_drain(db, DispatchMode::Legacy).await;
}

/// Counts how often each event's handler ran, taking longer than stale-after.
struct Slow {
    runs: Arc<Mutex<HashMap<uuid::Uuid, u32>>>,
    duration: Duration,
}

#[async_trait]
impl Handler for Slow {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        *self.runs.lock().unwrap().entry(event.id).or_default() += 1;
        tokio::time::sleep(self.duration).await;
        with_tx!(ctx.tx(), |conn| {
            sqlx::query(
                "INSERT INTO test_effect (event_id, record_key, seq) VALUES ($1, 'slow', 0)",
            )
            .persistent(outbox_tests::persistent())
            .bind(event.id.to_string())
            .execute(conn)
            .await
            .map(|r| r.rows_affected())
        })
        .map_err(HandlerError::db)?;
        Ok(())
    }
}

/// A handler slower than stale-after, with a live heartbeat, is never run twice.
async fn slow_handler_with_live_heartbeat_runs_once(db: TestDb) {
    create_effect_log(&db).await;
    let repo = db.repository();
    let events = (0..6)
        .map(|i| NewEvent::new("slow", payload(i, 0)))
        .collect();
    enqueue_all(&repo, events).await;
    let runs = Arc::new(Mutex::new(HashMap::new()));
    let handlers = Handlers::new().register(
        "slow",
        Slow {
            runs: runs.clone(),
            duration: Duration::from_millis(1500),
        },
    );
    let config = fast_config(4)
        .with_heartbeat_interval(Duration::from_millis(150))
        .with_stale_after(Duration::from_millis(600));
    let dispatcher = Dispatcher::new(repo.clone(), handlers, config)
        .start()
        .await
        .unwrap();
    drain(&repo, Duration::from_secs(60)).await;
    let report = dispatcher.shutdown().await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 6);
    assert!(
        runs.values().all(|n| *n == 1),
        "each handler ran once: {runs:?}"
    );
    assert_eq!(db.count("SELECT count(*) FROM test_effect").await, 6);
    // Exact on both backends. On SQLite a claim waits for the write lock behind the other
    // attempts (one at a time, each longer than stale-after): its heartbeat keeps it alive.
    assert_eq!(report.metrics.stale_reclaims, 0);
    assert_eq!(report.metrics.lost_claims, 0);
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE RetryCount > 0")
            .await,
        0
    );
}

/// Malformed, unknown and unreadable events end `failed` with a clear error and do not hold up
/// the other records.
async fn bad_events_fail_without_blocking_others(db: TestDb) {
    create_effect_log(&db).await;
    let repo = db.repository();
    let mut events = vec![
        NewEvent::new("no.such.handler", payload(1, 0)),
        NewEvent::new(
            "account.changed",
            r#"{"object":"Account","record_id":"A2","snapshot":{}}"#,
        ),
    ];
    for seq in 1..5 {
        events.push(NewEvent::new("account.changed", payload(1, seq)));
        events.push(NewEvent::new("account.changed", payload(2, seq)));
    }
    enqueue_all(&repo, events).await;
    let handlers = Handlers::new().register(
        "account.changed",
        OrderedEffect {
            fail_rate: 0.0,
            injected: Arc::default(),
            out_of_order: Arc::default(),
            in_flight: Arc::default(),
            overlaps: Arc::default(),
        },
    );
    let dispatcher = Dispatcher::new(repo.clone(), handlers, fast_config(4))
        .start()
        .await
        .unwrap();
    drain(&repo, Duration::from_secs(60)).await;
    dispatcher.shutdown().await;
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'failed'")
            .await,
        2
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'failed'
               AND (LastError LIKE '%no handler registered for event type \"no.such.handler\"%'
                    OR LastError LIKE '%no seq%')"
        )
        .await,
        2
    );
    // The failed heads released their successors.
    assert_eq!(db.count("SELECT count(*) FROM test_effect").await, 8);
}

backend_tests!(
    with_pgbouncer: pull_workers_keep_order_under_failures,
    legacy_dispatcher_keeps_order_under_failures,
    slow_handler_with_live_heartbeat_runs_once,
    bad_events_fail_without_blocking_others,
);

/// Touches a row that a test holds locked.
struct TouchLocked {
    attempts: Arc<AtomicU64>,
}

#[async_trait]
impl Handler for TouchLocked {
    async fn handle(
        &self,
        _: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        with_tx!(ctx.tx(), |conn| {
            sqlx::query("UPDATE locked_row SET v = v + 1 WHERE id = 1")
                .execute(conn)
                .await
                .map(|r| r.rows_affected())
        })
        .map_err(HandlerError::db)?;
        Ok(())
    }
}

/// PostgreSQL: a handler blocked on a row lock beyond the lock timeout is retried while other
/// keys keep flowing. (SQLite has no row locks: one writer blocks all, so "other keys keep
/// flowing" cannot hold there; its busy errors are classified as lock timeouts the same way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lock_timeout_retries_while_other_keys_flow() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    create_effect_log(&db).await;
    db.execute("CREATE TABLE locked_row (id INT PRIMARY KEY, v INT NOT NULL)")
        .await;
    db.execute("INSERT INTO locked_row VALUES (1, 0)").await;
    let pool = db.pg().unwrap().clone();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT v FROM locked_row WHERE id = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();

    let repo = db.repository();
    let mut events = vec![NewEvent::new("touch", payload(999, 0))];
    events.extend((0..200).map(|i| NewEvent::new("account.changed", payload(i % 50, i / 50))));
    enqueue_all(&repo, events).await;
    let attempts = Arc::new(AtomicU64::new(0));
    let handlers = Handlers::new()
        .register(
            "touch",
            TouchLocked {
                attempts: attempts.clone(),
            },
        )
        .register(
            "account.changed",
            OrderedEffect {
                fail_rate: 0.0,
                injected: Arc::default(),
                out_of_order: Arc::default(),
                in_flight: Arc::default(),
                overlaps: Arc::default(),
            },
        );
    let dispatcher = Dispatcher::new(repo.clone(), handlers, fast_config(4))
        .start()
        .await
        .unwrap();
    let start = Instant::now();
    while db.count("SELECT count(*) FROM test_effect").await < 200 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "other keys did not flow"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The lock is still held: the touching event keeps failing with lock timeouts.
    while attempts.load(Ordering::SeqCst) < 2 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let blocked = db.count("SELECT count(*) FROM _System_OutboxEvent WHERE EventType = 'touch' AND Status <> 'processed' AND RetryCount >= 1 AND LastError LIKE '%lock timeout%'").await;
    assert_eq!(blocked, 1);
    holder.rollback().await.unwrap();
    drain(&repo, Duration::from_secs(60)).await;
    let report = dispatcher.shutdown().await;
    assert!(report.metrics.lock_timeouts >= 1);
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed'")
            .await,
        201
    );
    let touched: i32 = sqlx::query_scalar("SELECT v FROM locked_row WHERE id = 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(touched, 1, "the touching effect committed once");
}

/// Parks in the handler until told to go on, after publishing its backend pid.
struct Parked {
    pid: Arc<Mutex<Option<i32>>>,
    release: Arc<tokio::sync::Notify>,
    runs: Arc<AtomicU64>,
}

#[async_trait]
impl Handler for Parked {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let run = self.runs.fetch_add(1, Ordering::SeqCst);
        with_tx!(ctx.tx(), |conn| {
            sqlx::query(
                "INSERT INTO test_effect (event_id, record_key, seq) VALUES ($1, 'parked', 0)",
            )
            .bind(event.id.to_string())
            .execute(conn)
            .await
            .map(|r| r.rows_affected())
        })
        .map_err(HandlerError::db)?;
        if run == 0 {
            let pid: i32 = with_tx!(ctx.tx(), |conn| {
                sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(conn)
                    .await
            })
            .map_err(HandlerError::db)?;
            *self.pid.lock().unwrap() = Some(pid);
            self.release.notified().await;
        }
        Ok(())
    }
}

/// PostgreSQL: the attempt's connection is killed mid-attempt (`pg_terminate_backend`); the
/// event is not lost, its effect commits once, and its retry is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_connection_loses_nothing() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    create_effect_log(&db).await;
    let repo = db.repository();
    enqueue_all(&repo, vec![NewEvent::new("parked", payload(1, 0))]).await;
    let pid = Arc::new(Mutex::new(None));
    let release = Arc::new(tokio::sync::Notify::new());
    let runs = Arc::new(AtomicU64::new(0));
    let handlers = Handlers::new().register(
        "parked",
        Parked {
            pid: pid.clone(),
            release: release.clone(),
            runs: runs.clone(),
        },
    );
    let dispatcher = Dispatcher::new(repo.clone(), handlers, fast_config(2))
        .start()
        .await
        .unwrap();
    let start = Instant::now();
    let victim = loop {
        if let Some(pid) = *pid.lock().unwrap() {
            break pid;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the handler never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(victim)
        .fetch_one(db.pg().unwrap())
        .await
        .unwrap();
    assert!(killed);
    release.notify_one();
    drain(&repo, Duration::from_secs(60)).await;
    let report = dispatcher.shutdown().await;
    assert_eq!(runs.load(Ordering::SeqCst), 2, "ran again after the kill");
    assert_eq!(
        db.count("SELECT count(*) FROM test_effect").await,
        1,
        "the killed attempt's effect rolled back"
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed' AND RetryCount = 1"
        )
        .await,
        1
    );
    assert_eq!(report.metrics.detached_bookkeeping, 1);
}

/// Sleeps, writes its effect in the attempt, fails about a fourth of first attempts, and
/// counts the attempts in flight at once (across every handler sharing `in_flight`).
#[derive(Clone)]
struct Pooled {
    in_flight: Arc<AtomicU64>,
    most: Arc<AtomicU64>,
}

#[async_trait]
impl Handler for Pooled {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(15)).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        with_tx!(ctx.tx(), |conn| {
            sqlx::query("INSERT INTO test_effect (event_id, record_key, seq) VALUES ($1, 'k', 0)")
                .bind(event.id.to_string())
                .execute(conn)
                .await
                .map(|r| r.rows_affected())
        })
        .map_err(HandlerError::db)?;
        if event.retry_count == 0 && draw(event, 7) < 0.25 {
            return Err(HandlerError::Retryable("fails once".into()));
        }
        Ok(())
    }
}

/// PostgreSQL: a process of 8 pull workers on `ConnectConfig::for_workers(8)` (a pool capped at
/// `8 + 3`) drains with heartbeats beating through every attempt (every 5 ms), retries, the
/// queue gauges, the pruner, and an event type excluded from the pull rollout running on the
/// legacy dispatcher beside the pull workers: no claim goes stale or is lost for want of a
/// connection, at most 8 attempts run at once across both paths (the legacy dispatcher's slots
/// share the workers' permits), and `pg_stat_activity` never shows more sessions of the process
/// than the pool's 11 (nothing opens a connection outside the pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_workers_hold_at_most_workers_plus_three_connections() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    create_effect_log(&db).await;
    let workers = 8;
    const APP: &str = "outbox_pool_under_test";
    let url = format!(
        "{}{}application_name={APP}",
        db.url,
        if db.url.contains('?') { '&' } else { '?' }
    );
    let pool = outbox_persistence::Database::connect(
        &url,
        outbox_persistence::ConnectConfig::for_workers(workers),
    )
    .await
    .unwrap();
    let repo = pool.repository();
    let events = (0..600)
        .map(|i| {
            let event_type = if i % 3 == 0 {
                "pooled.legacy"
            } else {
                "pooled"
            };
            NewEvent::new(event_type, payload(i % 60, i / 60))
        })
        .collect();
    enqueue_all(&repo, events).await;
    let config = fast_config(workers)
        .with_excluded_event_types(vec!["pooled.legacy".into()])
        .with_heartbeat_interval(Duration::from_millis(5))
        .with_stale_after(Duration::from_secs(10))
        .with_queue_gauges(Duration::from_millis(20))
        .with_retention(
            outbox_events::RetentionConfig::new(
                outbox_persistence::PrunePolicy::default()
                    .processed_older_than(Some(Duration::from_secs(3600))),
            )
            .with_interval(Duration::from_millis(20)),
        );
    let handler = Pooled {
        in_flight: Arc::default(),
        most: Arc::default(),
    };
    let handlers = Handlers::new()
        .register("pooled", handler.clone())
        .register("pooled.legacy", handler.clone());
    let dispatcher = Dispatcher::new(repo.clone(), handlers, config)
        .start()
        .await
        .unwrap();
    let watcher = db.pg().unwrap().clone();
    let sessions = move || {
        let watcher = watcher.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND application_name = $1",
            )
            .bind(APP)
            .fetch_one(&watcher)
            .await
            .unwrap()
        }
    };
    let mut peak = 0;
    let start = Instant::now();
    loop {
        peak = peak.max(sessions().await);
        let left = db
            .count("SELECT count(*) FROM _System_OutboxEvent WHERE Status IN ('pending', 'processing')")
            .await;
        if left == 0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "not drained: {left} left"
        );
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let report = dispatcher.shutdown().await;
    assert!(report.graceful);
    assert_eq!(db.count("SELECT count(*) FROM test_effect").await, 600);
    assert!(report.metrics.retried > 50, "{:?}", report.metrics);
    assert_eq!(report.metrics.lost_claims, 0);
    assert_eq!(report.metrics.stale_reclaims, 0);
    let most = handler.most.load(Ordering::SeqCst);
    assert!(
        most <= workers as u64,
        "{most} attempts at once, more than {workers} workers"
    );
    assert!(
        most >= 4,
        "only {most} attempts at once: the workers did not run side by side"
    );
    let limit = workers as i64 + 3;
    assert!(
        peak <= limit,
        "{peak} sessions, more than workers + 3 = {limit}"
    );
    pool.close().await;
}
