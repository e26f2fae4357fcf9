//! What a repair of the heads table reports. `_System_OutboxHead` is derived state: presence
//! (every key with a non-terminal row has a head row) is kept exactly by the triggers, the
//! head's position (the key's oldest non-terminal row) only orders the claim's walk and may be
//! out of place for a while when writers race (see `docs/queries.md`, "Why a head cannot hide
//! a row"). [`crate::OutboxRepository::repair_heads`] puts positions right and removes or
//! adds the rows the triggers could not, without waiting for any lock.

/// The most keys one [`crate::OutboxRepository::repair_heads`] call looks at by default.
pub const DEFAULT_HEADS_REPAIR_KEYS: u32 = 1000;

/// What one repair of the heads table changed, by key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeadsRepair {
    /// Keys whose head named another row than their oldest non-terminal one (moved to it).
    pub misplaced: Vec<String>,
    /// Heads of keys that had no non-terminal row left (deleted).
    pub left_over: Vec<String>,
    /// Keys with non-terminal rows and no head (added): rows written with the outbox's
    /// triggers disabled (`session_replication_role = replica`, a restore, a disabled
    /// trigger), or a head deleted by hand.
    pub missing: Vec<String>,
    /// The repair did not run because another caller was repairing at that moment
    /// (PostgreSQL: one repair at a time across processes).
    pub skipped: bool,
}

impl HeadsRepair {
    /// How many keys were put right.
    pub fn repaired(&self) -> usize {
        self.misplaced.len() + self.left_over.len() + self.missing.len()
    }

    /// Files one key under the repair `kind` names (`misplaced`, `left over`, `missing`).
    pub(crate) fn add(&mut self, key: String, kind: &str) {
        match kind {
            "misplaced" => self.misplaced.push(key),
            "left over" => self.left_over.push(key),
            _ => self.missing.push(key),
        }
    }
}
