//! The `RecordKey` backfill's classification of scanned rows, and the rollout gate's count of
//! rows that lack the key their payload derives.

use crate::{BackfillPage, EventId};

/// Rows per page of [`crate::OutboxRepository::count_missing_record_keys`].
pub(crate) const UNKEYED_PAGE_ROWS: u32 = 1000;

/// How many of `payloads` (of rows without a key) derive a `RecordKey`.
pub(crate) fn derivable_keys<'a>(payloads: impl Iterator<Item = &'a str>) -> u64 {
    payloads
        .filter(|p| matches!(record_key::record_key_from_payload(p), Ok(Some(_))))
        .count() as u64
}

/// Classifies one scanned page of a backfill: `(Id, Payload, RecordKey)` rows in `Id` order.
/// Returns the page (with `updated` counting the keys to set) and the keys to set.
pub(crate) fn classify_backfill(
    scanned: &[(EventId, String, Option<String>)],
    batch: u32,
) -> (BackfillPage, Vec<(EventId, String)>) {
    let mut page = BackfillPage {
        scanned: scanned.len() as u64,
        ..BackfillPage::default()
    };
    let mut updates = Vec::new();
    for (id, payload, existing) in scanned {
        let derived = record_key::record_key_from_payload(payload);
        match existing {
            Some(existing) => {
                page.already_set += 1;
                let agrees = matches!(&derived, Ok(Some(k)) if k.as_str() == existing);
                if !agrees {
                    page.mismatched.push(*id);
                }
            }
            None => match derived {
                Ok(Some(key)) => updates.push((*id, key.into_string())),
                Ok(None) => page.no_record += 1,
                Err(e) => page.underivable.push((*id, e.to_string())),
            },
        }
    }
    page.updated = updates.len() as u64;
    page.next_after = if scanned.len() as u64 >= u64::from(batch) {
        scanned.last().map(|(id, _, _)| *id)
    } else {
        None
    };
    (page, updates)
}
