//! The suite's view of the queue, taken through the operator binary as an operator would:
//! counts from `outbox status --json`, rows from `outbox events --json`. The suite writes no SQL
//! against the outbox table (only `outbox-persistence` knows it); the one table it names is the
//! demo's own `DemoAccount`, whose rows the lock holds lock.

use std::collections::HashMap;

use anyhow::{Context, Result};
use serde_json::Value;

use super::Rng;
use super::profile::{Backend, SLOW_EVENT_TYPE};
use super::suite::Suite;

/// `--limit` for a listing that must not be cut short (the binary's default is a page).
const NO_LIMIT: &str = "1000000";

/// How many rows one lock hold picks (their accounts' rows are locked).
const LOCK_ROWS: usize = 3;

/// Rows by status, from `outbox status --json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Counts {
    pub(super) pending: u64,
    pub(super) processing: u64,
    pub(super) processed: u64,
    pub(super) failed: u64,
}

impl Counts {
    fn parse(json: &str) -> Result<Self> {
        let doc: Value = serde_json::from_str(json)
            .with_context(|| format!("`outbox status --json` printed no JSON: {json}"))?;
        let count = |key: &str| {
            doc[key]
                .as_u64()
                .with_context(|| format!("`outbox status --json` has no count `{key}`: {json}"))
        };
        Ok(Self {
            pending: count("pending")?,
            processing: count("processing")?,
            processed: count("processed")?,
            failed: count("failed")?,
        })
    }

    /// Rows still pending or processing.
    pub(super) fn unfinished(&self) -> i64 {
        (self.pending + self.processing) as i64
    }

    /// The statuses that have rows, in name order: `failed 3, pending 120, processed 900`.
    pub(super) fn line(&self) -> String {
        let by_name = [
            ("failed", self.failed),
            ("pending", self.pending),
            ("processed", self.processed),
            ("processing", self.processing),
        ];
        let shown: Vec<String> = by_name
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(name, n)| format!("{name} {n}"))
            .collect();
        shown.join(", ")
    }
}

/// One row of `outbox events --json` (never the payload).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Event {
    pub(super) id: String,
    pub(super) event_type: String,
    pub(super) status: String,
    pub(super) record_key: Option<String>,
    /// RFC 3339 with microseconds: equal stored values print equal strings.
    pub(super) last_modified: String,
    pub(super) retry_count: i64,
    pub(super) last_error: Option<String>,
}

impl Event {
    fn parse_all(json: &str) -> Result<Vec<Self>> {
        let doc: Value = serde_json::from_str(json)
            .with_context(|| format!("`outbox events --json` printed no JSON: {json}"))?;
        let rows = doc
            .as_array()
            .with_context(|| format!("`outbox events --json` printed no array: {json}"))?;
        rows.iter().map(Self::parse).collect()
    }

    fn parse(row: &Value) -> Result<Self> {
        let text = |key: &str| {
            row[key]
                .as_str()
                .map(str::to_string)
                .with_context(|| format!("an `outbox events --json` row has no `{key}`: {row}"))
        };
        let optional = |key: &str| row[key].as_str().map(str::to_string);
        Ok(Self {
            id: text("id")?,
            event_type: text("event_type")?,
            status: text("status")?,
            record_key: optional("record_key"),
            last_modified: text("last_modified_date")?,
            retry_count: row["retry_count"].as_i64().with_context(|| {
                format!("an `outbox events --json` row has no retry_count: {row}")
            })?,
            last_error: optional("last_error"),
        })
    }

    /// The row as the deadline's message shows it.
    fn line(&self) -> String {
        [
            self.id.as_str(),
            &self.event_type,
            &self.status,
            &self.retry_count.to_string(),
            &self.last_modified,
            self.last_error.as_deref().unwrap_or(""),
        ]
        .join(" | ")
    }

    /// The id of the demo account a key `Account:ID` names (the second `:`-separated part).
    fn account(&self) -> Option<&str> {
        self.record_key.as_deref()?.split(':').nth(1)
    }
}

impl Suite<'_> {
    /// `outbox status --json`.
    pub(super) fn counts(&self) -> Result<Counts> {
        Counts::parse(&self.outbox(&["status", "--json"])?)
    }

    /// `outbox events --json FILTER…`.
    fn events(&self, filter: &[&str]) -> Result<Vec<Event>> {
        let mut args = vec!["events", "--json"];
        args.extend_from_slice(filter);
        Event::parse_all(&self.outbox(&args)?)
    }

    /// Rows still pending or processing.
    pub(super) fn unfinished(&self) -> Result<i64> {
        Ok(self.counts()?.unfinished())
    }

    /// Rows in `processing`, with their `LastModifiedDate` (as text).
    pub(super) fn processing_rows(&self) -> Result<Vec<(String, String)>> {
        let rows = self.events(&["--status", "processing", "--limit", NO_LIMIT])?;
        Ok(rows
            .into_iter()
            // SQLite attempts hold the write lock and heartbeat only outside it: a slow
            // handler's row stays frozen while it is alive, so it cannot be told from an orphan.
            .filter(|r| self.backend != Backend::Sqlite || r.event_type != SLOW_EVENT_TYPE)
            .map(|r| (r.id, r.last_modified))
            .collect())
    }

    /// The `RetryCount` and `LastModifiedDate` (as text) of every row in `processing`, by id.
    pub(super) fn processing_state(&self) -> Result<HashMap<String, (i64, String)>> {
        let rows = self.events(&["--status", "processing", "--limit", NO_LIMIT])?;
        Ok(rows
            .into_iter()
            .map(|r| (r.id, (r.retry_count, r.last_modified)))
            .collect())
    }

    /// The status and `LastModifiedDate` of the rows with these ids.
    pub(super) fn rows_by_id(&self, ids: &[&str]) -> Result<HashMap<String, (String, String)>> {
        let limit = ids.len().to_string();
        let mut filter = vec!["--limit", &limit];
        for id in ids {
            filter.extend(["--id", id]);
        }
        Ok(self
            .events(&filter)?
            .into_iter()
            .map(|r| (r.id, (r.status, r.last_modified)))
            .collect())
    }

    /// The oldest 20 unfinished rows, one line each, for the message of a missed deadline.
    pub(super) fn stuck_rows(&self) -> Vec<String> {
        self.events(&[
            "--status",
            "pending",
            "--status",
            "processing",
            "--limit",
            "20",
        ])
        .map(|rows| rows.iter().map(Event::line).collect())
        .unwrap_or_default()
    }

    /// The demo accounts one lock hold locks: those of [`LOCK_ROWS`] pending `account.updated`
    /// rows picked at random among every pending one. Rows that failed twice are
    /// left alone: the holds exercise lock timeouts, they must not use up one event's attempts.
    pub(super) fn accounts_to_lock(&self, rng: &mut Rng) -> Result<Vec<String>> {
        let rows = self.events(&[
            "--status",
            "pending",
            "--event-type",
            "account.updated",
            "--limit",
            NO_LIMIT,
        ])?;
        let mut candidates: Vec<&Event> = rows.iter().filter(|r| r.retry_count < 2).collect();
        let mut picked = Vec::new();
        while picked.len() < LOCK_ROWS && !candidates.is_empty() {
            let row = candidates.swap_remove(rng.below(candidates.len()));
            picked.extend(row.account().map(str::to_string));
        }
        Ok(picked)
    }
}

/// The statement of one outside lock hold: lock the rows of `accounts` in `DemoAccount`, hold
/// them for `seconds`, roll back. The hold never waits (`SKIP LOCKED`: a row someone else holds
/// is left out), so it is never part of a lock cycle: a deadlock the application's writer
/// meets is one with the workers, never one with the suite's own hold (a hold that waited for
/// one account while holding another deadlocked with the application's upserts).
pub(super) fn lock_hold_sql(accounts: &[String], seconds: f64) -> String {
    let ids: Vec<String> = accounts
        .iter()
        .map(|id| format!("'{}'", id.replace('\'', "''")))
        .collect();
    let which = if ids.is_empty() {
        "false".to_string()
    } else {
        format!("Id IN ({})", ids.join(", "))
    };
    format!(
        "BEGIN; SELECT Id FROM DemoAccount WHERE {which} FOR UPDATE SKIP LOCKED; \
         SELECT pg_sleep({seconds:.1}); ROLLBACK;"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_counts_are_read() {
        let json = r#"{"pending": 5, "processing": 2, "processed": 90, "failed": 0,
                       "oldest_pending_age_seconds": 1.5, "stale_claims": 0}"#;
        let counts = Counts::parse(json).unwrap();
        assert_eq!(counts.unfinished(), 7);
        assert_eq!(counts.line(), "pending 5, processed 90, processing 2");
        assert!(Counts::parse(r#"{"pending": 1}"#).is_err());
    }

    #[test]
    fn event_rows_are_read() {
        let json = r#"[{"id": "0190-a", "event_type": "account.updated", "status": "pending",
            "record_key": "Account:A000007", "created_date": "2025-01-01T00:00:00.000001Z",
            "last_modified_date": "2025-01-01T00:00:01.123456Z", "retry_count": 1,
            "last_error": null},
           {"id": "0190-b", "event_type": "report.slow", "status": "processing",
            "record_key": null, "created_date": "2025-01-01T00:00:00.000002Z",
            "last_modified_date": "2025-01-01T00:00:02.000000Z", "retry_count": 0,
            "last_error": "injected"}]"#;
        let rows = Event::parse_all(json).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].account(), Some("A000007"));
        assert_eq!(rows[0].last_modified, "2025-01-01T00:00:01.123456Z");
        assert_eq!(rows[1].account(), None);
        assert_eq!(
            rows[1].line(),
            "0190-b | report.slow | processing | 0 | 2025-01-01T00:00:02.000000Z | injected"
        );
        assert!(Event::parse_all("{}").is_err());
    }

    #[test]
    fn a_lock_hold_locks_the_accounts_or_nothing() {
        assert_eq!(
            lock_hold_sql(&["A1".into(), "B'2".into()], 1.2),
            "BEGIN; SELECT Id FROM DemoAccount WHERE Id IN ('A1', 'B''2') FOR UPDATE SKIP LOCKED; \
             SELECT pg_sleep(1.2); ROLLBACK;"
        );
        assert!(lock_hold_sql(&[], 1.2).contains("WHERE false FOR UPDATE SKIP LOCKED"));
    }
}
