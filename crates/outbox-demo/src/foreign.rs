//! `outbox-demo foreign`: rows written the way other code writes them, beside the workers. Each
//! writer loops until the time is up: a plain `INSERT` of a [`RECORD_TOUCHED`] row for one of
//! the demo's records, in a transaction of its own that sleeps before and after the insert, with
//! a `CreatedDate` up to 300 ms in the past (so it can commit behind younger rows of its
//! record), one in eight rolled back. The fault suite runs it during its chaos, so that kills,
//! cuts and the restart meet out-of-order writers; the verification then requires every row
//! terminal, these too. A write that fails (the database restarting, a cut) is counted and the
//! writer goes on.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use outbox_persistence::ConnectConfig;
use outbox_persistence::test_support::foreign::{ForeignWrite, foreign_write, record_keys};

use crate::args::ForeignArgs;
use crate::workload::RECORD_TOUCHED;

/// What the writers did.
#[derive(Debug, Default)]
struct Counts {
    committed: AtomicU64,
    rolled_back: AtomicU64,
    errors: AtomicU64,
}

/// A small deterministic generator per writer.
struct Draw(u64);

impl Draw {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// Runs the foreign writers for `args.secs` and prints what they wrote.
pub async fn foreign_command(url: Option<&str>, args: ForeignArgs) -> Result<ExitCode> {
    let db = outbox_cli::db::open(url, ConnectConfig::for_workers(args.writers)).await?;
    let keys = Arc::new(record_keys(&db, 1000).await?);
    anyhow::ensure!(
        !keys.is_empty(),
        "no keyed rows to write beside: seed the demo first"
    );
    let (before_ms, after_ms) = match &db {
        outbox_persistence::Database::Postgres(_) => (100, 200),
        // One writer at a time: a transaction that sleeps holding it stops every writer.
        outbox_persistence::Database::Sqlite(_) => (10, 25),
    };
    let counts = Arc::new(Counts::default());
    let deadline = Instant::now() + Duration::from_secs(args.secs);
    let mut tasks = Vec::new();
    for w in 0..args.writers {
        let (db, keys, counts) = (db.clone(), keys.clone(), counts.clone());
        tasks.push(tokio::spawn(async move {
            let mut draw = Draw(0x9E37_79B9_7F4A_7C15 ^ (w as u64 + 1).wrapping_mul(0x2545_F491));
            while Instant::now() < deadline {
                let key = &keys[draw.below(keys.len() as u64) as usize];
                let (object, record) = key.split_once(':').unwrap_or(("record", key));
                let payload = serde_json::json!({
                    "object": object, "record_id": record, "snapshot": {"foreign": true}
                })
                .to_string();
                let write = ForeignWrite {
                    event_type: RECORD_TOUCHED,
                    record_key: key,
                    payload: &payload,
                    created_back: Duration::from_millis(draw.below(300)),
                    before: Duration::from_millis(draw.below(before_ms)),
                    after: Duration::from_millis(draw.below(after_ms)),
                    rollback: draw.below(8) == 0,
                };
                match foreign_write(&db, &write).await {
                    Ok(true) => counts.committed.fetch_add(1, Ordering::Relaxed),
                    Ok(false) => counts.rolled_back.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        tracing::debug!(error = %e.chain(), "a foreign write failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        counts.errors.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    db.close().await;
    println!(
        "foreign: {} rows committed by {} writers in {} s ({} rolled back, {} failed writes)",
        counts.committed.load(Ordering::Relaxed),
        args.writers,
        args.secs,
        counts.rolled_back.load(Ordering::Relaxed),
        counts.errors.load(Ordering::Relaxed)
    );
    Ok(ExitCode::SUCCESS)
}
