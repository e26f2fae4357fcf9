//! The redelivery test kit: proves that delivering an event again leaves the database as one
//! delivery did.
//!
//! It is a test kit, not production code: it exists only with the crate's `test-kit` feature
//! (off by default), so a service enables it for its tests alone:
//!
//! ```toml
//! [dev-dependencies]
//! create-action = { version = "…", features = ["test-kit"] }
//! ```
//!
//! Platform teams call it from their own tests with a handler, an event payload, a database and
//! the tables the handler touches:
//!
//! ```no_run
//! # async fn example(
//! #     pool: sqlx::PgPool,
//! #     action: create_action::FindOrCreate,
//! # ) -> Result<(), create_action::redelivery::KitError> {
//! use create_action::{ActionConn, redelivery::Redelivery};
//! use record_key::EventEnvelope;
//!
//! let handler = async |conn: &mut dyn ActionConn, payload: &serde_json::Value| {
//!     let event = EventEnvelope::from_value(payload.clone()).map_err(create_action::Error::InvalidPayload)?;
//!     action.run(conn, &event).await.map(drop)
//! };
//! let payload = serde_json::json!({"object": "Lead", "record_id": "00Q1", "snapshot": {}});
//! let report = Redelivery::new(pool)
//!     .capture("Opportunity")
//!     .check(&handler, &payload)
//!     .await?;
//! report.assert_idempotent();
//! # Ok(())
//! # }
//! ```
//!
//! [`Redelivery::check`] delivers the event once (a committed transaction, opened the way the
//! outbox attempt opens it), captures the tables and the autonumber counters, delivers it a
//! second time, captures again, then delivers it twice concurrently from two connections and
//! captures a third time. The [`Report`] lists every difference between consecutive captures:
//! a changed value (table, row, column: before -> after), an inserted, deleted or duplicated
//! row, a moved autonumber counter, or a redelivery that failed. What stops the check before it
//! can report (a refused name, a missing table, a failed first delivery) is a [`KitError`].
//!
//! The module's parts: [`Pool`] and [`EventHandler`] (`pool.rs`, with one delivery), the
//! captures (`capture.rs`), the differences between them (`diff.rs`), [`Report`] and
//! [`Difference`] (`report.rs`), [`KitError`] (`error.rs`).

mod capture;
mod diff;
mod error;
mod pool;
mod report;
#[cfg(test)]
mod tests;

use serde_json::Value;

pub use error::{BoxError, KitError};
pub use pool::{EventHandler, Pool};
pub use report::{CapturedRow, Difference, Phase, Report};

use crate::Ident;
use capture::{CaptureSpec, capture};
use diff::diff;
use pool::{deliver, join2};

/// The redelivery check of one handler against one database.
#[derive(Clone, Debug)]
#[must_use = "nothing is delivered until `check` is awaited"]
pub struct Redelivery {
    pool: Pool,
    tables: Vec<(String, Option<Vec<String>>)>,
}

impl Redelivery {
    /// A check against `pool`, capturing no table yet (the autonumber counters always are).
    pub fn new(pool: impl Into<Pool>) -> Self {
        Self {
            pool: pool.into(),
            tables: Vec::new(),
        }
    }

    /// Captures `table`, identifying rows by its primary key (by the whole row when it has
    /// none).
    pub fn capture(mut self, table: &str) -> Self {
        self.tables.push((table.to_string(), None));
        self
    }

    /// Captures `table`, identifying rows by `identity` (for example the natural key, so that a
    /// duplicate create shows as a duplicated row rather than an inserted one).
    pub fn capture_by(mut self, table: &str, identity: &[&str]) -> Self {
        self.tables.push((
            table.to_string(),
            Some(identity.iter().map(|c| c.to_string()).collect()),
        ));
        self
    }

    /// Delivers `payload` to `handler` once, then again, then twice concurrently, and reports
    /// every difference the redeliveries made. Fails when a name is not a valid identifier, a
    /// table does not exist, or the first delivery fails.
    pub async fn check<H: EventHandler + ?Sized>(
        &self,
        handler: &H,
        payload: &Value,
    ) -> Result<Report, KitError> {
        let specs = self.specs()?;
        let before = capture(&self.pool, &specs).await?;
        deliver(&self.pool, handler, payload)
            .await
            .map_err(KitError::FirstDelivery)?;
        let first = capture(&self.pool, &specs).await?;
        let mut differences = Vec::new();

        if let Err(e) = deliver(&self.pool, handler, payload).await {
            differences.push(Difference::failed(Phase::Redelivery, &e));
        }
        let second = capture(&self.pool, &specs).await?;
        differences.extend(diff(&first, &second, Phase::Redelivery));

        let (a, b) = join2(
            deliver(&self.pool, handler, payload),
            deliver(&self.pool, handler, payload),
        )
        .await;
        for e in [a.err(), b.err()].into_iter().flatten() {
            differences.push(Difference::failed(Phase::ConcurrentRedelivery, &e));
        }
        let third = capture(&self.pool, &specs).await?;
        differences.extend(diff(&second, &third, Phase::ConcurrentRedelivery));

        Ok(Report {
            first_delivery: diff(&before, &first, Phase::FirstDelivery),
            differences,
        })
    }

    /// The captured tables with validated names: a refused name never reaches the database.
    fn specs(&self) -> Result<Vec<CaptureSpec>, KitError> {
        let ident = |name: &str| Ident::new(name).map_err(KitError::InvalidIdentifier);
        self.tables
            .iter()
            .map(|(table, identity)| {
                let identity = identity
                    .as_ref()
                    .map(|cols| cols.iter().map(|c| ident(c)).collect::<Result<Vec<_>, _>>())
                    .transpose()?;
                Ok(CaptureSpec {
                    table: ident(table)?,
                    identity,
                })
            })
            .collect()
    }
}
