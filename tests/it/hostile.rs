//! Hostile and broken input written straight into the outbox table, bypassing `enqueue`'s
//! checks: a malformed payload, an empty one, an unknown event type, an oversized payload and a
//! `RecordKey` that contradicts its payload. Each ends terminal with a clear error (or is
//! handled as documented in `docs/reliability.md`), and none blocks another record or stops a
//! worker. A missing payload cannot be written at all: the schema refuses it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{TimeDelta, Utc};
use outbox_events::{
    AttemptContext, Dispatcher, Handler, HandlerError, Handlers, OutboxEvent, WorkerConfig,
};
use outbox_tests::{RawRow, TestDb, backend_tests, drain};
use record_key::EventEnvelope;

/// Reads the envelope like every real handler does: an unreadable payload is permanent.
struct Reader {
    handled: Arc<AtomicU64>,
}

#[async_trait]
impl Handler for Reader {
    async fn handle(
        &self,
        event: &OutboxEvent,
        _: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        EventEnvelope::parse(&event.payload)
            .map_err(|e| HandlerError::Permanent(format!("unreadable payload: {e}")))?;
        self.handled.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn config() -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(outbox_events::DispatchMode::Pull)
        .dangerously_skip_rollout_gate("tests of hostile rows with undeclared handlers")
        .with_workers(4)
        .with_poll_interval(Duration::from_millis(50))
        .with_retry_delay(Duration::from_millis(5))
        .with_max_retry_delay(Duration::from_millis(40))
        .with_heartbeat_interval(Duration::from_millis(500))
        .with_stale_after(Duration::from_secs(30))
        .with_lock_timeout(Duration::from_millis(300))
}

fn envelope(record: &str, extra: &str) -> String {
    format!(r#"{{"object":"Account","record_id":"{record}","snapshot":{{"x":"{extra}"}}}}"#)
}

/// A raw row of `event_type` with `payload` and `key`, created `offset_ms` after `base`.
fn raw(
    event_type: &str,
    payload: String,
    key: Option<&str>,
    base: chrono::DateTime<Utc>,
    offset_ms: i64,
) -> RawRow {
    let at = base + TimeDelta::milliseconds(offset_ms);
    RawRow {
        event_type: event_type.into(),
        payload,
        ..RawRow::pending(key, at)
    }
}

async fn status_and_error(db: &TestDb, id: uuid::Uuid) -> (String, Option<String>) {
    let row = db.repository().get_event(id).await.unwrap().unwrap();
    (row.status.as_str().to_string(), row.last_error)
}

async fn hostile_rows_fail_clearly_and_block_nothing(db: TestDb) {
    let base = Utc::now() - TimeDelta::seconds(10);
    let malformed = raw(
        "account.changed",
        "{not json".into(),
        Some("Account:A1"),
        base,
        0,
    );
    let empty = raw(
        "account.changed",
        String::new(),
        Some("Account:A2"),
        base,
        1,
    );
    let unknown = raw(
        "no.such.type",
        envelope("A3", "x"),
        Some("Account:A3"),
        base,
        2,
    );
    let oversized = raw(
        "account.changed",
        envelope("A4", &"x".repeat(2 * 1024 * 1024)),
        Some("Account:A4"),
        base,
        3,
    );
    // The stored key says A5; the payload is about A6.
    let contradicting = raw(
        "account.changed",
        envelope("A6", "x"),
        Some("Account:A5"),
        base,
        4,
    );
    let bad = [&malformed, &empty, &unknown, &oversized, &contradicting];
    for row in bad {
        db.insert_raw(row).await;
    }
    // Good events behind every bad head, on the same keys and on others.
    let mut good = Vec::new();
    for (n, key) in ["A1", "A2", "A3", "A4", "A5", "A6", "A7"]
        .iter()
        .enumerate()
    {
        for seq in 0..3 {
            let row = raw(
                "account.changed",
                envelope(key, "ok"),
                Some(&format!("Account:{key}")),
                base,
                100 + (n * 10 + seq) as i64,
            );
            db.insert_raw(&row).await;
            good.push(row.id);
        }
    }
    let handled = Arc::new(AtomicU64::new(0));
    let handlers = Handlers::new().register(
        "account.changed",
        Reader {
            handled: handled.clone(),
        },
    );
    let repo = db.repository();
    // Backfill's dry run names, before they run, the rows whose stored key their payload does
    // not back: the contradicting one and the two unreadable ones.
    let page = repo.backfill_record_keys(None, 1_000, true).await.unwrap();
    let mut mismatched = page.mismatched.clone();
    mismatched.sort();
    let mut expected = vec![malformed.id, empty.id, contradicting.id];
    expected.sort();
    assert_eq!(mismatched, expected);
    let dispatcher = Dispatcher::new(repo.clone(), handlers, config())
        .start()
        .await
        .unwrap();
    drain(&repo, Duration::from_secs(60)).await;
    let report = dispatcher.shutdown().await;
    assert!(report.graceful, "every worker finished: {report:?}");

    let (s, e) = status_and_error(&db, malformed.id).await;
    assert_eq!(s, "failed");
    assert!(
        e.as_deref()
            .unwrap_or_default()
            .contains("unreadable payload"),
        "{e:?}"
    );
    let (s, e) = status_and_error(&db, empty.id).await;
    assert_eq!(s, "failed");
    assert!(
        e.as_deref()
            .unwrap_or_default()
            .contains("unreadable payload"),
        "{e:?}"
    );
    let (s, e) = status_and_error(&db, unknown.id).await;
    assert_eq!(s, "failed");
    assert!(
        e.as_deref()
            .unwrap_or_default()
            .contains(r#"no handler registered for event type "no.such.type""#),
        "{e:?}"
    );
    // Documented: the outbox sets no size limit; a 2 MB payload is stored and handled.
    assert_eq!(status_and_error(&db, oversized.id).await.0, "processed");
    // Documented: ordering trusts the stored RecordKey (backfill reports the contradiction);
    // the row is handled like any other and holds up nothing.
    assert_eq!(status_and_error(&db, contradicting.id).await.0, "processed");
    for id in &good {
        assert_eq!(status_and_error(&db, *id).await.0, "processed", "{id}");
    }
    assert_eq!(handled.load(Ordering::SeqCst), good.len() as u64 + 2);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'failed' AND RetryCount = 1"
        )
        .await,
        3,
        "each permanent failure is counted once"
    );
}

/// A missing payload is refused by the schema (`Payload TEXT NOT NULL`) on both backends.
async fn missing_payload_is_refused_by_the_schema(db: TestDb) {
    let id = uuid::Uuid::now_v7();
    let now = Utc::now();
    let result = match &db.db {
        outbox_persistence::Database::Postgres(pool) => sqlx::query(
            "INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount,
               CreatedDate, LastModifiedDate) VALUES ($1, 'x', NULL, 'pending', 0, $2, $2)",
        )
        .bind(id)
        .bind(now)
        .execute(pool)
        .await
        .map(|_| ()),
        outbox_persistence::Database::Sqlite(pool) => sqlx::query(
            "INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount,
               CreatedDate, LastModifiedDate) VALUES (?1, 'x', NULL, 'pending', 0, ?2, ?2)",
        )
        .bind(id.to_string())
        .bind(outbox_persistence::sqlite::format_ts(now))
        .execute(pool)
        .await
        .map(|_| ()),
    };
    let error = result.expect_err("a NULL payload is refused").to_string();
    assert!(error.to_lowercase().contains("null"), "{error}");
}

backend_tests!(
    hostile_rows_fail_clearly_and_block_nothing,
    missing_payload_is_refused_by_the_schema,
);
