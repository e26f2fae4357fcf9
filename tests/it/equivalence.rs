//! The claim against the design's query, on random tables: every step, `claim_next` must take
//! exactly the first row of the design's eligible-event query as written (run on the same
//! database, with the in-flight guard the design added applied to its answer), and
//! `get_pending_events` must list exactly its rows in its order; the heads table the claim reads
//! its candidates from must agree with the rows (`Database::check_heads`). Between steps the
//! claimed row ends, is retried, fails or stays in flight, and new rows arrive through enqueue
//! and through other code (raw inserts, key changes, deletes), so the heads are maintained
//! along every path the triggers cover. Seeds are fixed, so a failure reproduces.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_persistence::{
    ClaimPolicy, Database, EventFilter, EventId, EventStatus, NewEvent, OutboxRepository, Scope,
    Terminal,
};
use outbox_tests::{RawRow, TestDb, backend_tests};

const STALE_AFTER: Duration = Duration::from_secs(30);
const RETRY_DELAY: Duration = Duration::from_secs(10);
const ROUNDS: u64 = 6;
const ROWS: usize = 40;
const STEPS: usize = 120;
const KEYS: [&str; 5] = ["lead:k0", "lead:k1", "lead:k2", "account:k3", "lead:k4"];

/// The design's eligible-event query as the design writes it (parameter markers aside).
const DESIGN: &str = "SELECT Id
FROM _System_OutboxEvent e
WHERE
  (e.Status = 'pending'
   OR (e.Status = 'processing' AND e.LastModifiedDate < :stale_cutoff))
  AND (e.Status <> 'pending'
       OR e.RetryCount = 0
       OR e.LastModifiedDate < :retry_cutoff)
  AND (
    e.RecordKey IS NULL
    OR NOT EXISTS (
      SELECT 1
      FROM _System_OutboxEvent older
      WHERE older.RecordKey = e.RecordKey
        AND (
          older.CreatedDate < e.CreatedDate
          OR (older.CreatedDate = e.CreatedDate AND older.Id < e.Id)
        )
        AND older.Status NOT IN ('processed', 'failed')
    )
  )
ORDER BY e.CreatedDate ASC, e.Id ASC
LIMIT :limit";

fn policy() -> ClaimPolicy {
    ClaimPolicy::new(STALE_AFTER, RETRY_DELAY, 1_000)
}

/// A small deterministic generator (xorshift64*), so that no dependency is needed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn key(&mut self) -> Option<&'static str> {
        let i = self.below(KEYS.len() as u64 + 1) as usize;
        KEYS.get(i).copied()
    }
}

/// The time the repository reads: the host's clock plus the test's shift.
fn shifted_now(db: &TestDb) -> DateTime<Utc> {
    Utc::now() + chrono::Duration::microseconds(db.clock.micros())
}

/// The design's answer: its query as written with cutoffs from the shifted clock, then the
/// in-flight guard (no keyed row while another row of its key is `processing` and live).
async fn design_answer(db: &TestDb, repo: &Arc<dyn OutboxRepository>) -> Vec<EventId> {
    let now = shifted_now(db);
    let stale = now - chrono::Duration::from_std(STALE_AFTER).unwrap();
    let retry = now - chrono::Duration::from_std(RETRY_DELAY).unwrap();
    let ids: Vec<EventId> = match &db.db {
        Database::Postgres(pool) => {
            let sql = DESIGN
                .replace(":stale_cutoff", "$1")
                .replace(":retry_cutoff", "$2")
                .replace(":limit", "$3");
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(stale)
                .bind(retry)
                .bind(10_000_i64)
                .fetch_all(pool)
                .await
                .unwrap()
        }
        Database::Sqlite(pool) => {
            use outbox_persistence::sqlite::format_ts;
            let sql = DESIGN
                .replace(":stale_cutoff", "?1")
                .replace(":retry_cutoff", "?2")
                .replace(":limit", "?3");
            let ids: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(format_ts(stale))
                .bind(format_ts(retry))
                .bind(10_000_i64)
                .fetch_all(pool)
                .await
                .unwrap();
            ids.iter().map(|s| s.parse().unwrap()).collect()
        }
    };
    let rows = repo.list_events(EventFilter::new()).await.unwrap();
    let live_key = |id: EventId| {
        let row = rows.iter().find(|r| r.id == id).unwrap();
        let key = row.record_key.as_ref().map(|k| k.as_str().to_string());
        key.is_some()
            && rows.iter().any(|f| {
                f.id != id
                    && f.status == EventStatus::Processing
                    && f.last_modified_date >= stale
                    && f.record_key.as_ref().map(|k| k.as_str().to_string()) == key
            })
    };
    ids.into_iter().filter(|id| !live_key(*id)).collect()
}

/// A random row of the rules' kinds: `pending` (due, or a retry not yet due), `processed`,
/// `failed`, or (when `stale`) a `processing` row whose worker is gone. Created times repeat,
/// so ties are broken by `Id`.
fn random_row(rng: &mut Rng, now: DateTime<Utc>, stale: bool) -> RawRow {
    let created = now - chrono::Duration::seconds(1_000 - rng.below(25) as i64);
    let mut row = RawRow::pending(rng.key(), created);
    match rng.below(10) {
        0 | 1 => row.status = "processed",
        2 => row.status = "failed",
        3 if stale => {
            row.status = "processing";
            row.last_modified = now - chrono::Duration::seconds(3_600);
        }
        4 => {
            row.retry_count = 1 + rng.below(3) as i32;
            // Due long ago, or not for a minute: never at the edge while the round runs.
            let offset = if rng.below(2) == 0 { -100 } else { 60 };
            row.last_modified = now + chrono::Duration::seconds(offset);
        }
        _ => {}
    }
    row
}

/// Rows that other code writes, changes or removes while the queue runs.
async fn foreign_write(db: &TestDb, rng: &mut Rng, now: DateTime<Utc>) {
    let rows = db
        .repository()
        .list_events(EventFilter::new())
        .await
        .unwrap();
    let Some(row) = rows.get(rng.below(rows.len().max(1) as u64) as usize) else {
        return;
    };
    match rng.below(3) {
        0 => db.insert_raw(&random_row(rng, now, false)).await,
        1 => {
            let key = rng.key().map_or("NULL".to_string(), |k| format!("'{k}'"));
            db.execute(&format!(
                "UPDATE _System_OutboxEvent SET RecordKey = {key} WHERE Id = '{}'",
                row.id
            ))
            .await;
        }
        _ if row.status != EventStatus::Processing => {
            db.execute(&format!(
                "DELETE FROM _System_OutboxEvent WHERE Id = '{}'",
                row.id
            ))
            .await;
        }
        _ => {}
    }
}

/// One step: the claim and the list against the design, then something happens to the claim.
async fn step(db: &TestDb, repo: &Arc<dyn OutboxRepository>, rng: &mut Rng, ctx: &str) -> bool {
    let expected = design_answer(db, repo).await;
    let listed: Vec<EventId> = repo
        .get_pending_events(policy(), &Scope::All, 10_000)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(listed, expected, "{ctx}: get_pending_events");
    let claim = repo.claim_next(policy(), &Scope::All).await.unwrap();
    assert_eq!(
        claim.as_ref().map(|c| c.event.id),
        expected.first().copied(),
        "{ctx}: claim_next"
    );
    assert_eq!(
        db.db.check_heads().await.unwrap(),
        Vec::<String>::new(),
        "{ctx}: heads"
    );
    let Some(claim) = claim else {
        return false;
    };
    match rng.below(8) {
        0..=3 => {
            repo.update_status(claim.fence, Terminal::Processed, None)
                .await
                .unwrap();
        }
        4 => {
            repo.update_status(claim.fence, Terminal::Failed, Some("no".into()))
                .await
                .unwrap();
        }
        5 => {
            // Not due again while the round runs.
            repo.increment_retry(claim.fence, Duration::from_secs(3_600), "again")
                .await
                .unwrap();
        }
        _ => {} // stays in flight: its key waits
    }
    if rng.below(4) == 0 {
        let payload = match rng.key() {
            Some(k) => {
                let (object, id) = k.split_once(':').unwrap();
                format!(r#"{{"object":"{object}","record_id":"{id}","snapshot":{{}}}}"#)
            }
            None => r#"{"snapshot":{}}"#.to_string(),
        };
        let mut tx = repo.begin().await.unwrap();
        repo.enqueue(&mut tx, &[NewEvent::new("test.event", payload)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    if rng.below(5) == 0 {
        foreign_write(db, rng, shifted_now(db)).await;
    }
    true
}

/// Random tables, each drained step by step against the design's query.
async fn claim_matches_the_design_query(db: TestDb) {
    let repo = db.repository();
    for round in 0..ROUNDS {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (round + 1).wrapping_mul(0x1234_5678_9abc));
        db.execute("DELETE FROM _System_OutboxEvent").await;
        let now = shifted_now(&db);
        for _ in 0..ROWS {
            db.insert_raw(&random_row(&mut rng, now, true)).await;
        }
        // Let the stale rows be stale on both backends (SQLite must have seen them first).
        repo.stats(policy()).await.unwrap();
        db.clock.advance(STALE_AFTER);
        for i in 0..STEPS {
            let ctx = format!("{} round {round} step {i}", db.db.backend_name());
            if !step(&db, &repo, &mut rng, &ctx).await {
                break;
            }
        }
        assert_eq!(db.db.check_heads().await.unwrap(), Vec::<String>::new());
        assert_eq!(
            db.db.rebuild_heads().await.unwrap() as usize,
            count_keys(&repo).await
        );
    }
}

/// Keys with a non-terminal row.
async fn count_keys(repo: &Arc<dyn OutboxRepository>) -> usize {
    let rows = repo.list_events(EventFilter::new()).await.unwrap();
    let mut keys: Vec<String> = rows
        .iter()
        .filter(|r| !r.status.is_terminal())
        .filter_map(|r| r.record_key.as_ref().map(|k| k.as_str().to_string()))
        .collect();
    keys.sort();
    keys.dedup();
    keys.len()
}

backend_tests!(claim_matches_the_design_query);
