//! The differences between two captures: rows inserted, deleted or duplicated per identity,
//! changed values, moved autonumber counters.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::capture::{Capture, TableCapture};
use super::report::{CapturedRow, Difference, Phase, show_row};

/// Every difference from `before` to `after`, in table, identity and column order, then the
/// counters.
pub(super) fn diff(before: &Capture, after: &Capture, phase: Phase) -> Vec<Difference> {
    let mut out = Vec::new();
    let empty = TableCapture::default();
    let tables: BTreeSet<&String> = before.tables.keys().chain(after.tables.keys()).collect();
    for table in tables {
        let b = before.tables.get(table).unwrap_or(&empty);
        let a = after.tables.get(table).unwrap_or(&empty);
        diff_table(table, b, a, phase, &mut out);
    }
    diff_counters(before, after, phase, &mut out);
    out
}

/// A row's identity: its identity columns' values as `column=value` pairs (the whole row when
/// the table has no identity columns).
fn identity_of(identity: &[String], row: &CapturedRow) -> String {
    if identity.is_empty() {
        return show_row(row);
    }
    identity
        .iter()
        .map(|c| format!("{c}={}", row.get(c).unwrap_or(&Value::Null)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The rows of a capture grouped by identity, each group in a stable order.
fn group(capture: &TableCapture, identity: &[String]) -> BTreeMap<String, Vec<CapturedRow>> {
    let mut groups: BTreeMap<String, Vec<CapturedRow>> = BTreeMap::new();
    for row in &capture.rows {
        groups
            .entry(identity_of(identity, row))
            .or_default()
            .push(row.clone());
    }
    for rows in groups.values_mut() {
        rows.sort_by_key(show_row);
    }
    groups
}

/// The differences of one table, identity by identity.
fn diff_table(
    table: &str,
    before: &TableCapture,
    after: &TableCapture,
    phase: Phase,
    out: &mut Vec<Difference>,
) {
    let identity = if after.identity.is_empty() {
        &before.identity
    } else {
        &after.identity
    };
    let (gb, ga) = (group(before, identity), group(after, identity));
    let keys: BTreeSet<&String> = gb.keys().chain(ga.keys()).collect();
    for key in keys {
        let rb = gb.get(key).map_or(&[][..], Vec::as_slice);
        let ra = ga.get(key).map_or(&[][..], Vec::as_slice);
        let (table, identity) = (table.to_string(), key.clone());
        match (rb.len(), ra.len()) {
            (0, _) => out.extend(ra.iter().map(|row| Difference::RowInserted {
                phase,
                table: table.clone(),
                identity: identity.clone(),
                row: row.clone(),
            })),
            (_, 0) => out.extend(rb.iter().map(|row| Difference::RowDeleted {
                phase,
                table: table.clone(),
                identity: identity.clone(),
                row: row.clone(),
            })),
            (nb, na) if nb != na => out.push(Difference::RowDuplicated {
                phase,
                table,
                identity,
                before: nb,
                after: na,
            }),
            _ => {
                for (row_b, row_a) in rb.iter().zip(ra) {
                    diff_row(&table, &identity, row_b, row_a, phase, out);
                }
            }
        }
    }
}

/// The changed values of one row that has the same identity before and after.
fn diff_row(
    table: &str,
    identity: &str,
    before: &CapturedRow,
    after: &CapturedRow,
    phase: Phase,
    out: &mut Vec<Difference>,
) {
    let columns: BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    for column in columns {
        let vb = before.get(column).unwrap_or(&Value::Null);
        let va = after.get(column).unwrap_or(&Value::Null);
        if vb != va {
            out.push(Difference::ValueChanged {
                phase,
                table: table.to_string(),
                identity: identity.to_string(),
                column: column.clone(),
                before: vb.clone(),
                after: va.clone(),
            });
        }
    }
}

/// The autonumber counters that moved (or appeared, or vanished).
fn diff_counters(before: &Capture, after: &Capture, phase: Phase, out: &mut Vec<Difference>) {
    let counters: BTreeSet<&(String, String)> = before
        .counters
        .keys()
        .chain(after.counters.keys())
        .collect();
    for key in counters {
        let (vb, va) = (
            before.counters.get(key).copied(),
            after.counters.get(key).copied(),
        );
        if vb != va {
            out.push(Difference::CounterMoved {
                phase,
                object: key.0.clone(),
                field: key.1.clone(),
                before: vb,
                after: va,
            });
        }
    }
}
