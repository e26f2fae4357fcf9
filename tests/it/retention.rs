//! Retention on both backends: `OutboxRepository::prune` deletes terminal rows older than the
//! age of their status, in batches, never a `pending` or `processing` row; a dry run changes
//! nothing; concurrent pruners delete every eligible row exactly once; the dispatcher's pruner
//! task runs beside workers without disturbing a record's order.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_events::{
    AttemptContext, DispatchMode, Dispatcher, Handler, HandlerError, Handlers, OutboxEvent,
    RetentionConfig, WorkerConfig,
};
use outbox_persistence::{
    ClaimPolicy, Database, EventFilter, EventRow, EventStatus, NewEvent, OutboxRepository,
    PrunePolicy, PruneReport, Scope, Terminal,
};
use outbox_tests::{RawRow, TestDb, backend_tests, drain};

const DAY: Duration = Duration::from_secs(86_400);

fn days_ago(n: i64) -> DateTime<Utc> {
    outbox_persistence::truncate_micros(Utc::now() - chrono::Duration::days(n))
}

/// A row in `status`, created `created` days ago and last modified `modified` days ago.
fn row(status: &'static str, key: Option<&str>, created: i64, modified: i64) -> RawRow {
    RawRow {
        status,
        last_modified: days_ago(modified),
        ..RawRow::pending(key, days_ago(created))
    }
}

fn policy(processed: Option<u64>, failed: Option<u64>, batch: u32) -> PrunePolicy {
    PrunePolicy::default()
        .processed_older_than(processed.map(|d| DAY * d as u32))
        .failed_older_than(failed.map(|d| DAY * d as u32))
        .batch_size(batch)
}

async fn all_rows(repo: &Arc<dyn OutboxRepository>) -> Vec<EventRow> {
    repo.list_events(EventFilter::new()).await.unwrap()
}

fn ids(rows: &[EventRow]) -> HashSet<uuid::Uuid> {
    rows.iter().map(|r| r.id).collect()
}

/// Prunes until a batch is not full; the sum of the batches.
async fn prune_all(repo: &Arc<dyn OutboxRepository>, policy: PrunePolicy) -> PruneReport {
    let mut total = PruneReport::default();
    loop {
        let batch = repo.prune(policy).await.unwrap();
        total.add(batch);
        if !batch.more {
            return total;
        }
    }
}

/// Each status has its own age; `None` keeps a status; the age is judged on
/// `LastModifiedDate` (when the row became terminal), not on `CreatedDate`.
async fn ages_per_status(db: TestDb) {
    let repo = db.repository();
    let old_processed = row("processed", Some("Lead:1"), 10, 10);
    let young_processed = row("processed", Some("Lead:2"), 3, 3);
    // Created long ago, terminal recently (a row retried for days): kept.
    let late_processed = row("processed", Some("Lead:3"), 20, 2);
    let old_failed = row("failed", Some("Lead:4"), 40, 40);
    let middle_failed = row("failed", None, 10, 10);
    for r in [
        &old_processed,
        &young_processed,
        &late_processed,
        &old_failed,
        &middle_failed,
    ] {
        db.insert_raw(r).await;
    }
    let report = repo.prune(policy(Some(7), Some(30), 100)).await.unwrap();
    assert_eq!(
        report,
        PruneReport {
            processed: 1,
            failed: 1,
            more: false
        }
    );
    let left = ids(&all_rows(&repo).await);
    let expected: HashSet<_> = [young_processed.id, late_processed.id, middle_failed.id].into();
    assert_eq!(left, expected);

    // `None` keeps every failed row, however old.
    let report = repo.prune(policy(Some(1), None, 100)).await.unwrap();
    assert_eq!((report.processed, report.failed), (2, 0));
    assert_eq!(ids(&all_rows(&repo).await), [middle_failed.id].into());
    let report = repo.prune(policy(None, Some(5), 100)).await.unwrap();
    assert_eq!((report.processed, report.failed), (0, 1));
    assert!(all_rows(&repo).await.is_empty());
}

/// "Older than" is measured on the queue's clock (PostgreSQL's `clock_timestamp()`, SQLite's
/// host clock), which the test moves with its `ClockShift`: rows finished through the state
/// machine now are pruned once the clock has moved past their age.
async fn age_follows_the_queue_clock(db: TestDb) {
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let events: Vec<_> = (0..3)
        .map(|i| {
            NewEvent::new(
                "test.event",
                format!(r#"{{"object":"Lead","record_id":"L{i}","snapshot":{{}}}}"#),
            )
        })
        .collect();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let claim_policy = ClaimPolicy::new(Duration::from_secs(30), Duration::ZERO, 5);
    for outcome in [Terminal::Processed, Terminal::Failed, Terminal::Processed] {
        let claim = repo
            .claim_next(claim_policy, &Scope::All)
            .await
            .unwrap()
            .expect("a row to claim");
        repo.update_status(claim.fence, outcome, None)
            .await
            .unwrap();
    }
    let hour = Duration::from_secs(3_600);
    let policy = PrunePolicy::default()
        .processed_older_than(Some(hour))
        .failed_older_than(Some(hour * 2));
    assert_eq!(repo.prune(policy).await.unwrap().total(), 0);
    db.clock.advance(hour + Duration::from_secs(60));
    let report = repo.prune(policy).await.unwrap();
    assert_eq!((report.processed, report.failed), (2, 0));
    db.clock.advance(hour);
    let report = repo.prune(policy).await.unwrap();
    assert_eq!((report.processed, report.failed), (0, 1));
    assert!(all_rows(&repo).await.is_empty());
}

/// A batch deletes at most `batch_size` rows of each status, oldest first, and says whether
/// more may be left.
async fn batches_are_bounded_and_oldest_first(db: TestDb) {
    let repo = db.repository();
    let mut processed = Vec::new();
    for i in 0..25 {
        let r = row("processed", Some(&format!("Lead:{i}")), 100 - i, 100 - i);
        db.insert_raw(&r).await;
        processed.push(r.id);
    }
    for i in 0..4 {
        db.insert_raw(&row("failed", None, 100, 90 - i)).await;
    }
    let p = policy(Some(7), Some(30), 10);
    let first = repo.prune(p).await.unwrap();
    assert_eq!(
        first,
        PruneReport {
            processed: 10,
            failed: 4,
            more: true
        }
    );
    // The ten oldest went first.
    let left = ids(&all_rows(&repo).await);
    assert!(processed[..10].iter().all(|id| !left.contains(id)));
    assert!(processed[10..].iter().all(|id| left.contains(id)));
    let second = repo.prune(p).await.unwrap();
    assert_eq!(
        (second.processed, second.failed, second.more),
        (10, 0, true)
    );
    let third = repo.prune(p).await.unwrap();
    assert_eq!((third.processed, third.failed, third.more), (5, 0, false));
    assert!(all_rows(&repo).await.is_empty());
    let empty = repo.prune(p).await.unwrap();
    assert_eq!(empty, PruneReport::default());
}

/// Every kind of non-terminal row, however old its timestamps, survives pruning with an age of
/// zero unchanged: pending (first delivery and retried), a stale and a live claim, a row
/// waiting behind its key. Only the terminal rows go.
async fn nothing_non_terminal_is_touched(db: TestDb) {
    let repo = db.repository();
    let non_terminal = [
        row("pending", Some("Lead:a"), 50, 50),
        RawRow {
            retry_count: 3,
            ..row("pending", Some("Lead:b"), 50, 40)
        },
        row("processing", Some("Lead:c"), 50, 45),
        row("processing", None, 1, 0),
        row("pending", Some("Lead:c"), 49, 49),
        row("pending", None, 60, 60),
    ];
    let terminal = [
        row("processed", Some("Lead:a"), 51, 51),
        row("failed", Some("Lead:c"), 51, 51),
        row("processed", None, 0, 0),
    ];
    for r in non_terminal.iter().chain(&terminal) {
        db.insert_raw(r).await;
    }
    // Let SQLite observe the claims (so a stale one is known stale), and the clock move on.
    repo.stats(ClaimPolicy::new(Duration::from_secs(30), Duration::ZERO, 5))
        .await
        .unwrap();
    db.clock.advance(Duration::from_secs(60));
    let before: Vec<EventRow> = all_rows(&repo)
        .await
        .into_iter()
        .filter(|r| !r.status.is_terminal())
        .collect();
    assert_eq!(before.len(), non_terminal.len());
    let zero = PrunePolicy::default()
        .processed_older_than(Some(Duration::ZERO))
        .failed_older_than(Some(Duration::ZERO))
        .batch_size(2);
    let dry = repo.count_prunable(zero).await.unwrap();
    assert_eq!((dry.processed, dry.failed), (2, 1));
    let total = prune_all(&repo, zero).await;
    assert_eq!((total.processed, total.failed), (2, 1));
    assert_eq!(all_rows(&repo).await, before, "non-terminal rows unchanged");
}

/// A dry run counts exactly what pruning then deletes, and changes nothing.
async fn dry_run_changes_nothing(db: TestDb) {
    let repo = db.repository();
    for i in 0..12 {
        db.insert_raw(&row("processed", Some(&format!("Lead:{i}")), 10, 10))
            .await;
    }
    for _ in 0..3 {
        db.insert_raw(&row("failed", None, 40, 40)).await;
    }
    db.insert_raw(&row("failed", None, 10, 10)).await;
    db.insert_raw(&row("pending", None, 90, 90)).await;
    let before = all_rows(&repo).await;
    let p = policy(Some(7), Some(30), 5);
    let dry = repo.count_prunable(p).await.unwrap();
    assert_eq!(
        dry,
        PruneReport {
            processed: 12,
            failed: 3,
            more: false
        }
    );
    // The console's count (capped, on the terminal index in order) agrees, and says nothing of
    // a status the policy keeps.
    let shown = outbox_persistence::console::prunable_rows(&db.db, &p)
        .await
        .unwrap();
    assert_eq!((shown.processed, shown.failed), (Some(12), Some(3)));
    let kept = policy(None, Some(30), 5);
    let shown = outbox_persistence::console::prunable_rows(&db.db, &kept)
        .await
        .unwrap();
    assert_eq!((shown.processed, shown.failed), (None, Some(3)));
    assert_eq!(all_rows(&repo).await, before, "a dry run changes nothing");
    let done = prune_all(&repo, p).await;
    assert_eq!((done.processed, done.failed), (dry.processed, dry.failed));
    assert_eq!(all_rows(&repo).await.len(), before.len() - 15);
}

/// Several pruners at once, each on its own pool (as separate processes would be): every
/// eligible row is deleted exactly once (the deleted counts add up to the eligible rows), none
/// is left behind, and nothing else is touched.
async fn concurrent_pruners_share_the_work(db: TestDb) {
    let repo = db.repository();
    seed_terminal(&db, 1_500, 300).await;
    for i in 0..20 {
        db.insert_raw(&row("pending", Some(&format!("Lead:{i}")), 30, 30))
            .await;
    }
    let p = policy(Some(7), Some(7), 50);
    let eligible = repo.count_prunable(p).await.unwrap();
    assert_eq!((eligible.processed, eligible.failed), (1_500, 300));
    let mut pruners = Vec::new();
    for _ in 0..4 {
        let pool = Database::connect(&db.url, Default::default())
            .await
            .unwrap();
        pruners.push(tokio::spawn(async move {
            let repo = pool.repository();
            let done = prune_all(&repo, p).await;
            pool.close().await;
            done
        }));
    }
    let mut total = PruneReport::default();
    for pruner in pruners {
        total.add(pruner.await.unwrap());
    }
    // A pruner stops at its first batch that is not full; one that was still running deleted
    // what the others skipped. Anything left (none expected) would be met by the next run.
    let left = repo.count_prunable(p).await.unwrap();
    assert_eq!(left.total(), 0, "no eligible row left behind");
    assert_eq!(
        (total.processed, total.failed),
        (1_500, 300),
        "each row deleted exactly once"
    );
    let rows = all_rows(&repo).await;
    assert_eq!(rows.len(), 20);
    assert!(rows.iter().all(|r| r.status == EventStatus::Pending));
}

/// Inserts `processed` and `failed` rows, ten days old, over 50 keys.
async fn seed_terminal(db: &TestDb, processed: usize, failed: usize) {
    for (status, n) in [("processed", processed), ("failed", failed)] {
        for i in 0..n {
            db.insert_raw(&row(status, Some(&format!("Lead:s{}", i % 50)), 10, 10))
                .await;
        }
    }
}

/// Records the order in which each key's events ran.
#[derive(Default, Clone)]
struct Journal(Arc<Mutex<HashMap<String, Vec<u64>>>>);

#[async_trait]
impl Handler for Journal {
    async fn handle(
        &self,
        event: &OutboxEvent,
        _ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let envelope: serde_json::Value = serde_json::from_str(&event.payload).unwrap();
        let seq = envelope["snapshot"]["seq"].as_u64().unwrap();
        let key = event.record_key.as_ref().unwrap().as_str().to_string();
        self.0.lock().unwrap().entry(key).or_default().push(seq);
        Ok(())
    }
}

/// The dispatcher's pruner task, with an age of zero and a short interval, deletes rows as
/// soon as they are processed while the workers drain: every event still runs exactly once, in
/// its record's order (a terminal row is never needed for eligibility), and nothing is left.
async fn pruner_task_beside_workers(db: TestDb) {
    let repo = db.repository();
    let (records, per_record) = (20_u64, 10_u64);
    let events: Vec<NewEvent> = (0..per_record)
        .flat_map(|seq| {
            (0..records).map(move |r| {
                NewEvent::new(
                    "test.event",
                    format!(r#"{{"object":"Lead","record_id":"L{r}","snapshot":{{"seq":{seq}}}}}"#),
                )
            })
        })
        .collect();
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let journal = Journal::default();
    let retention = RetentionConfig::new(
        PrunePolicy::default()
            .processed_older_than(Some(Duration::ZERO))
            .batch_size(7),
    )
    .with_interval(Duration::from_millis(5))
    .with_batch_pause(Duration::ZERO);
    let config = WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("tests of the pruner beside the workers")
        .with_workers(4)
        .with_poll_interval(Duration::from_millis(20))
        .with_retention(retention);
    let handlers = Handlers::new().register("test.event", journal.clone());
    let handle = Dispatcher::new(repo.clone(), handlers, config)
        .start()
        .await
        .unwrap();
    drain(&repo, Duration::from_secs(60)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !all_rows(&repo).await.is_empty() {
        assert!(std::time::Instant::now() < deadline, "rows left unpruned");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let report = handle.shutdown().await;
    assert!(report.graceful);
    assert_eq!(report.metrics.processed, records * per_record);
    let journal = journal.0.lock().unwrap();
    assert_eq!(journal.len(), records as usize);
    for (key, seqs) in journal.iter() {
        assert_eq!(
            seqs,
            &(0..per_record).collect::<Vec<_>>(),
            "{key} ran once each, in order"
        );
    }
}

/// The effect ledger's rows go with their event: pruning a processed row deletes what the
/// ledger recorded for it (the foreign key's cascade), and leaves a kept row's.
async fn the_ledger_rows_go_with_their_event(db: TestDb) {
    let repo = db.repository();
    let old = row("processed", Some("Lead:1"), 10, 10);
    let young = row("processed", Some("Lead:2"), 3, 3);
    db.insert_raw(&old).await;
    db.insert_raw(&young).await;
    let effects: Vec<_> = [old.id, young.id]
        .into_iter()
        .map(|id| outbox_persistence::EffectRecord::new(id, "mail", "send", None))
        .collect();
    repo.record_effects(&effects).await.unwrap();
    assert_eq!(repo.effects_of(&[old.id, young.id]).await.unwrap().len(), 2);
    let report = repo.prune(policy(Some(7), None, 100)).await.unwrap();
    assert_eq!(report.processed, 1);
    let left = repo.effects_of(&[old.id, young.id]).await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].event_id, young.id);
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEffect").await,
        1,
        "the pruned event's ledger row is gone"
    );
}

backend_tests!(
    with_pgbouncer: ages_per_status,
    the_ledger_rows_go_with_their_event,
    age_follows_the_queue_clock,
    batches_are_bounded_and_oldest_first,
    nothing_non_terminal_is_touched,
    dry_run_changes_nothing,
    concurrent_pruners_share_the_work,
    pruner_task_beside_workers,
);
