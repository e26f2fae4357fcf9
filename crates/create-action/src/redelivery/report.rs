//! What a redelivery check found: the phases, the differences between captures, the report.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

use super::error::BoxError;

/// Which deliveries a difference lies between.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Before and after the first delivery (what the event is meant to do; not a finding).
    FirstDelivery,
    /// After the first and after the second delivery.
    Redelivery,
    /// After the second delivery and after two concurrent deliveries.
    ConcurrentRedelivery,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::FirstDelivery => "the first delivery",
            Phase::Redelivery => "the second delivery",
            Phase::ConcurrentRedelivery => "two concurrent deliveries",
        })
    }
}

/// A captured row: column (lower case) to value.
pub type CapturedRow = BTreeMap<String, Value>;

/// One way the database differs between two captures.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Difference {
    /// A row appeared.
    RowInserted {
        /// When.
        phase: Phase,
        /// The table (lower case).
        table: String,
        /// The row's identity, as `column=value` pairs.
        identity: String,
        /// The new row.
        row: CapturedRow,
    },
    /// A row disappeared.
    RowDeleted {
        /// When.
        phase: Phase,
        /// The table (lower case).
        table: String,
        /// The row's identity, as `column=value` pairs.
        identity: String,
        /// The old row.
        row: CapturedRow,
    },
    /// More (or fewer) rows share one identity than before: a duplicate create when the
    /// identity is the natural key.
    RowDuplicated {
        /// When.
        phase: Phase,
        /// The table (lower case).
        table: String,
        /// The shared identity, as `column=value` pairs.
        identity: String,
        /// Rows with this identity before.
        before: usize,
        /// Rows with this identity after.
        after: usize,
    },
    /// A column of one row changed.
    ValueChanged {
        /// When.
        phase: Phase,
        /// The table (lower case).
        table: String,
        /// The row's identity, as `column=value` pairs.
        identity: String,
        /// The column (lower case).
        column: String,
        /// The value before.
        before: Value,
        /// The value after.
        after: Value,
    },
    /// An autonumber counter moved: a value was drawn.
    CounterMoved {
        /// When.
        phase: Phase,
        /// The counter's object (folded).
        object: String,
        /// The counter's field (folded).
        field: String,
        /// `NextValue` before (`None`: no counter row yet).
        before: Option<i64>,
        /// `NextValue` after (`None`: the counter row is gone).
        after: Option<i64>,
    },
    /// A redelivery failed (its transaction was rolled back).
    DeliveryFailed {
        /// When.
        phase: Phase,
        /// The error and its causes.
        error: String,
    },
}

impl Difference {
    /// The deliveries this difference lies between.
    pub fn phase(&self) -> Phase {
        match self {
            Difference::RowInserted { phase, .. }
            | Difference::RowDeleted { phase, .. }
            | Difference::RowDuplicated { phase, .. }
            | Difference::ValueChanged { phase, .. }
            | Difference::CounterMoved { phase, .. }
            | Difference::DeliveryFailed { phase, .. } => *phase,
        }
    }

    /// The table (lower case), for row differences; `_system_autonumber` for counters.
    pub fn table(&self) -> Option<&str> {
        match self {
            Difference::RowInserted { table, .. }
            | Difference::RowDeleted { table, .. }
            | Difference::RowDuplicated { table, .. }
            | Difference::ValueChanged { table, .. } => Some(table),
            Difference::CounterMoved { .. } => Some("_system_autonumber"),
            Difference::DeliveryFailed { .. } => None,
        }
    }

    /// The changed column (lower case), for [`Difference::ValueChanged`].
    pub fn column(&self) -> Option<&str> {
        match self {
            Difference::ValueChanged { column, .. } => Some(column),
            _ => None,
        }
    }
}

/// A row as one line of JSON.
pub(super) fn show_row(row: &CapturedRow) -> String {
    serde_json::to_string(row).unwrap_or_default()
}

fn show_counter(value: Option<i64>) -> String {
    value.map_or_else(|| "none".to_string(), |v| v.to_string())
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "after {}: ", self.phase())?;
        match self {
            Difference::RowInserted {
                table,
                identity,
                row,
                ..
            } => write!(f, "{table} [{identity}]: row inserted {}", show_row(row)),
            Difference::RowDeleted {
                table,
                identity,
                row,
                ..
            } => write!(f, "{table} [{identity}]: row deleted {}", show_row(row)),
            Difference::RowDuplicated {
                table,
                identity,
                before,
                after,
                ..
            } => write!(
                f,
                "{table} [{identity}]: duplicated row: {before} -> {after} rows with this identity"
            ),
            Difference::ValueChanged {
                table,
                identity,
                column,
                before,
                after,
                ..
            } => write!(
                f,
                "{table} [{identity}] column {column}: {before} -> {after}"
            ),
            Difference::CounterMoved {
                object,
                field,
                before,
                after,
                ..
            } => write!(
                f,
                "autonumber {object}.{field} moved: next value {} -> {} (a value was drawn)",
                show_counter(*before),
                show_counter(*after)
            ),
            Difference::DeliveryFailed { error, .. } => write!(f, "the delivery failed: {error}"),
        }
    }
}

impl Difference {
    /// A redelivery in `phase` failed with `error`: the error and its causes, as one line.
    pub(super) fn failed(phase: Phase, error: &BoxError) -> Self {
        let mut text = error.to_string();
        let mut source = error.source();
        while let Some(s) = source {
            text.push_str(": ");
            text.push_str(&s.to_string());
            source = s.source();
        }
        Difference::DeliveryFailed { phase, error: text }
    }
}

/// What [`Redelivery::check`](super::Redelivery::check) found.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// What the first delivery changed.
    pub(super) first_delivery: Vec<Difference>,
    /// What the redeliveries changed.
    pub(super) differences: Vec<Difference>,
}

impl Report {
    /// Every difference a redelivery made: empty when the handler is idempotent.
    pub fn differences(&self) -> &[Difference] {
        &self.differences
    }

    /// What the first delivery changed (for information: that is the event's intended effect).
    pub fn first_delivery(&self) -> &[Difference] {
        &self.first_delivery
    }

    /// Whether the redeliveries left the database as the first delivery did.
    pub fn is_idempotent(&self) -> bool {
        self.differences.is_empty()
    }

    /// Panics with the readable diff unless the handler is idempotent.
    #[track_caller]
    pub fn assert_idempotent(&self) {
        if !self.is_idempotent() {
            panic!("{self}");
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.differences.is_empty() {
            return f.write_str("redelivery left the database unchanged");
        }
        writeln!(
            f,
            "redelivery changed the database ({} difference(s)):",
            self.differences.len()
        )?;
        for difference in &self.differences {
            writeln!(f, "  {difference}")?;
        }
        Ok(())
    }
}
