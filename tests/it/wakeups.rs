//! The enqueue trigger's debounced wake-up (PostgreSQL, migration 0007): an enqueue into a queue
//! that nobody notified about for the window notifies; enqueues inside the window do not (their
//! transactions never take the notify lock at commit); a clock that stepped back notifies at
//! once; rows written by other code are covered, since the trigger does the work. The window is
//! set to a minute on the writing connection so that "inside the window" does not depend on how
//! fast this machine is; the default window's behavior is checked with pauses longer than it.

use std::time::Duration;

use outbox_tests::TestDb;
use sqlx::postgres::PgListener;
use sqlx::{Connection as _, PgConnection};

const CHANNEL: &str = "outbox_event";

async fn insert(conn: &mut PgConnection, n: u32) {
    sqlx::query(
        "INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         VALUES (gen_random_uuid(), 'foreign', '{}', 'pending', 0, 'lead:' || $1::text,
                 clock_timestamp(), clock_timestamp())",
    )
    .bind(n.to_string())
    .execute(conn)
    .await
    .unwrap();
}

/// Notifications received: the first within `wait`, each further one within 300 ms of the one
/// before.
async fn received(listener: &mut PgListener, wait: Duration) -> usize {
    let mut n = 0;
    let mut wait = wait;
    while let Ok(Ok(Some(_))) = tokio::time::timeout(wait, listener.try_recv()).await {
        n += 1;
        wait = Duration::from_millis(300);
    }
    n
}

async fn set_clock(conn: &mut PgConnection, sql: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT setval('_System_OutboxNotifyClock', {sql})"
    )))
    .execute(conn)
    .await
    .unwrap();
}

#[tokio::test]
async fn postgres_enqueue_wake_ups_are_debounced() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    listener.listen(CHANNEL).await.unwrap();
    let mut writer = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("SET outbox.notify_window_us = '60000000'")
        .execute(&mut writer)
        .await
        .unwrap();

    insert(&mut writer, 1).await;
    assert_eq!(
        received(&mut listener, Duration::from_secs(2)).await,
        1,
        "an enqueue into a quiet queue wakes the workers"
    );
    for n in 2..12 {
        insert(&mut writer, n).await;
    }
    assert_eq!(
        received(&mut listener, Duration::from_millis(300)).await,
        0,
        "enqueues within the window after a notification do not notify"
    );

    set_clock(&mut writer, "0").await;
    insert(&mut writer, 12).await;
    assert_eq!(
        received(&mut listener, Duration::from_secs(2)).await,
        1,
        "once the window passed, the next enqueue notifies"
    );

    // A clock that stepped back an hour: the last notification seems to lie in the future.
    set_clock(
        &mut writer,
        "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint + 3600000000",
    )
    .await;
    insert(&mut writer, 13).await;
    insert(&mut writer, 14).await;
    assert_eq!(
        received(&mut listener, Duration::from_secs(2)).await,
        1,
        "a clock that stepped back notifies at once and restarts the window"
    );

    // The default window (5 ms), on a connection without the setting: enqueues further apart
    // than the window each notify; a rolled-back one notifies nobody.
    let mut plain = PgConnection::connect(&db.url).await.unwrap();
    set_clock(&mut plain, "0").await;
    for n in 20..23 {
        insert(&mut plain, n).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(received(&mut listener, Duration::from_secs(2)).await, 3);
    let mut tx = plain.begin().await.unwrap();
    insert(&mut tx, 30).await;
    tx.rollback().await.unwrap();
    assert_eq!(received(&mut listener, Duration::from_millis(300)).await, 0);
    // The rolled-back window passed: the next committed enqueue notifies again.
    insert(&mut plain, 31).await;
    assert_eq!(received(&mut listener, Duration::from_secs(2)).await, 1);
}

struct Count(std::sync::Arc<std::sync::atomic::AtomicU64>);

#[outbox_events::async_trait]
impl outbox_events::Handler for Count {
    async fn handle(
        &self,
        _: &outbox_events::OutboxEvent,
        _: &mut outbox_events::AttemptContext<'_>,
    ) -> Result<(), outbox_events::HandlerError> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

/// Enqueues one event of type `t` for `Lead` `L1` through the library, committed.
async fn enqueue_one(repo: &dyn outbox_persistence::OutboxRepository) {
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(
        &mut tx,
        &[outbox_events::NewEvent::new(
            "t",
            r#"{"object":"Lead","record_id":"L1"}"#,
        )],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// The backends listening on the outbox's channel.
async fn listening(db: &TestDb) -> Vec<i32> {
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()
           AND query LIKE 'LISTEN \"outbox_event\"%' AND pid <> pg_backend_pid()",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap()
}

/// A pull dispatcher's listener whose backend the server ends (a DBA, an idle timeout, a
/// failover) listens again on a new one, and an enqueue then wakes the worker at once. The one
/// worker has been idle for 14 s first, so its own next poll is over ten seconds away (its
/// idle wait doubles from 10 ms up to the poll interval, a minute here): only the new
/// listener's notification hands it the event within 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_whose_backend_ends_listens_again() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let repo = db.repository();
    let handled = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let handlers = outbox_events::Handlers::new().register("t", Count(handled.clone()));
    let config = outbox_events::WorkerConfig::default()
        .with_mode(outbox_events::DispatchMode::Pull)
        .with_workers(1)
        .with_poll_interval(Duration::from_secs(60));
    let handle = outbox_events::Dispatcher::new(repo.clone(), handlers, config)
        .start()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(14)).await;
    let first = listening(&db).await;
    assert_eq!(first.len(), 1, "one listener: {first:?}");
    let mut admin = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(first[0])
        .execute(&mut admin)
        .await
        .unwrap();
    let mut again = Vec::new();
    for _ in 0..200 {
        again = listening(&db).await;
        if again.iter().any(|pid| !first.contains(pid)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        again.iter().any(|pid| !first.contains(pid)),
        "no new listener 10 s after the cut: {again:?}"
    );
    // At once: the new listener has just woken the worker (its claim finds nothing), and a
    // notification that arrives while that claim runs ends the worker's wait after it (the
    // repository's wake mark), where it was missed before.
    enqueue_one(repo.as_ref()).await;
    let start = std::time::Instant::now();
    while handled.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the enqueue after the cut was not handled within 5 s: no notification woke the worker"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    handle.shutdown().await;
}

outbox_tests::backend_tests!(a_wake_up_during_a_claim_is_not_lost);

/// A wake-up that comes while a worker does not wait (its claim runs, and that claim's
/// snapshot may predate the row) ends the wait after it: the worker reads the repository's
/// wake mark before its claim and waits since it. On PostgreSQL the wake-up is the committed
/// enqueue's notification, on SQLite the in-process enqueue. Before the mark, the wait began
/// after the wake-up and slept its whole timeout (up to the poll interval).
async fn a_wake_up_during_a_claim_is_not_lost(db: TestDb) {
    let repo = db.repository();
    if repo.backend_name() == "postgres" {
        listener_started(repo.as_ref()).await;
    }
    let before = repo.wake_mark();
    enqueue_one(repo.as_ref()).await;
    // The wake-up lands while nobody waits, as during a claim.
    let started = std::time::Instant::now();
    while repo.wake_mark() == before {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the enqueue's wake-up never came"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let waited = std::time::Instant::now();
    repo.wait_for_work_since(before, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        waited.elapsed() < Duration::from_secs(1),
        "a wait since a mark read before the wake-up slept {:?}",
        waited.elapsed()
    );
    // A mark read after it waits for the next one.
    let after = repo.wake_mark();
    let waited = std::time::Instant::now();
    repo.wait_for_work_since(after, Duration::from_millis(300))
        .await
        .unwrap();
    assert!(waited.elapsed() >= Duration::from_millis(300));
}

/// Waits (up to 10 s) for the wake-up a new listener gives as it starts listening, which the
/// first wait on a PostgreSQL repository starts; fails when it did not come within 5 s.
async fn listener_started(repo: &dyn outbox_persistence::OutboxRepository) {
    let mark = repo.wake_mark();
    let started = std::time::Instant::now();
    repo.wait_for_work_since(mark, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "no listener started: the wait slept {:?}",
        started.elapsed()
    );
}

/// Polls `listening` until no backend listens, for up to 5 s.
async fn no_listener_within_5s(db: &TestDb, what: &str) {
    let started = std::time::Instant::now();
    loop {
        let left = listening(db).await;
        if left.is_empty() {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{what}: a listener still holds its session 5 s later: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A repository's listener ends with it. Dropped while its pool stays open (a service that
/// builds a new repository for each dispatcher it starts over one pool), it gives its `LISTEN`
/// session up at once: before, it noticed only at the next notification, and each repository
/// kept a connection. With a direct `LISTEN` URL, a closed pool ends the listener too (before,
/// never).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_ends_with_its_repository_and_its_pool() {
    use outbox_persistence::postgres::{PgOutbox, PgSettings};
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let pool = db.pg().expect("a PostgreSQL pool").clone();
    let repo = PgOutbox::new(pool.clone());
    listener_started(&repo).await;
    let clone = repo.clone();
    assert_eq!(listening(&db).await.len(), 1);
    drop(repo);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(listening(&db).await.len(), 1, "a clone still listens");
    drop(clone);
    no_listener_within_5s(&db, "the repository dropped").await;
    assert!(!pool.is_closed());

    let own = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&db.url)
        .await
        .unwrap();
    let settings = PgSettings {
        listen_url: Some(db.url.clone()),
        ..PgSettings::default()
    };
    let repo = PgOutbox::new(own.clone()).with_settings(settings);
    listener_started(&repo).await;
    assert_eq!(listening(&db).await.len(), 1);
    own.close().await;
    no_listener_within_5s(&db, "the pool closed").await;
    drop(repo);
}

/// A repository whose listener ran in a runtime that has ended (built and first waited on in
/// one runtime, a setup step's or another test's, then used in this one) starts a new listener
/// in the runtime that waits: its start wakes the waiter, and it listens. Before, the ended
/// task was never replaced and the workers polled for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_whose_runtime_ended_listens_again() {
    use outbox_persistence::postgres::{PgOutbox, PgSettings};
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let url = db.url.clone();
    // The first runtime: a lazy pool (no connection of it outlives the runtime) and a direct
    // LISTEN URL, so that the listener's session is its own.
    let repo = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect_lazy(&url)
                .unwrap();
            let settings = PgSettings {
                listen_url: Some(url.clone()),
                ..PgSettings::default()
            };
            let repo = PgOutbox::new(pool).with_settings(settings);
            listener_started(&repo).await;
            repo
        })
    })
    .join()
    .unwrap();
    no_listener_within_5s(&db, "the first runtime ended").await;

    listener_started(&repo).await;
    assert_eq!(listening(&db).await.len(), 1, "the new listener listens");
}
