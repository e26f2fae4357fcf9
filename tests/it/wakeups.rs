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
