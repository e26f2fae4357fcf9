//! Faults aimed at a step of an attempt, on PostgreSQL: a connection cut while a worker's
//! connection is at one step of a (batched) attempt, and an outside lock on claimed outbox rows
//! that the settle's writes meet past the workers' lock timeout.
//!
//! A cut at a step waits for it: one `DO` block polls `pg_stat_activity` (a fresh snapshot each
//! turn) for up to [`STEP_WAIT_MS`] until a work process's connection is at the step, and
//! terminates it. The steps are told by what the connection runs:
//!
//! | step | the connection |
//! |---|---|
//! | begin | runs the segment's fence check ([`BEGIN_PATTERN`]) |
//! | between handlers | is idle in its transaction (a handler runs, or the worker between statements) |
//! | settle | runs an outcome write ([`SETTLE_PATTERN`]) |
//! | commit | runs `COMMIT` |
//!
//! The patterns are copies of the library's statements (xtask depends on no workspace crate); a
//! unit test keeps them in its sources.

/// The fence check that begins a batched attempt's segment (`LOST_FENCES` in
/// `crates/outbox-persistence/src/postgres/fenced.rs`, a call of a function of migration 0012).
pub(super) const BEGIN_PATTERN: &str = "SELECT * FROM _System_OutboxLostFences(%";
/// The settle's outcome writes (`SETTLE`, one claim's, and `SETTLE_MANY`, a batch's `processed`
/// writes). `_` in a `LIKE` pattern matches any one character, the `_` too.
pub(super) const SETTLE_PATTERN: &str = "%_System_OutboxSettle%";
/// How long one cut waits for its step.
pub(super) const STEP_WAIT_MS: u64 = 700;

/// A step of an attempt that a cut aims at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    Begin,
    BetweenHandlers,
    Settle,
    Commit,
}

impl Step {
    pub(super) const ALL: [Step; 4] = [
        Step::Begin,
        Step::BetweenHandlers,
        Step::Settle,
        Step::Commit,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            Step::Begin => "begin",
            Step::BetweenHandlers => "between handlers",
            Step::Settle => "settle",
            Step::Commit => "commit",
        }
    }

    /// The `pg_stat_activity` condition of a connection at this step.
    fn condition(self) -> String {
        let quoted = |pattern: &str| pattern.replace('\'', "''");
        match self {
            Step::Begin => format!(
                "state = 'active' AND query LIKE '{}'",
                quoted(BEGIN_PATTERN)
            ),
            Step::BetweenHandlers => "state = 'idle in transaction'".to_string(),
            Step::Settle => format!(
                "state = 'active' AND query LIKE '{}'",
                quoted(SETTLE_PATTERN)
            ),
            Step::Commit => "state = 'active' AND upper(btrim(query, ' ;')) = 'COMMIT'".to_string(),
        }
    }
}

/// The statement that waits up to [`STEP_WAIT_MS`] for a work process's connection to the
/// database `database` to be at `step`, terminates it, and prints how many it cut (0 or 1).
pub(super) fn cut_at_step_sql(database: &str, step: Step) -> String {
    format!(
        "CREATE TEMP TABLE step_cut (n int);
DO $$
DECLARE
  deadline timestamptz := clock_timestamp() + interval '{STEP_WAIT_MS} milliseconds';
  victim int;
BEGIN
  LOOP
    PERFORM pg_stat_clear_snapshot();
    SELECT pid INTO victim FROM pg_stat_activity
    WHERE datname = '{database}' AND application_name LIKE 'outbox-work-%'
      AND pid <> pg_backend_pid() AND {condition}
    LIMIT 1;
    IF victim IS NOT NULL AND pg_terminate_backend(victim) THEN
      INSERT INTO step_cut VALUES (1);
      EXIT;
    END IF;
    EXIT WHEN clock_timestamp() > deadline;
  END LOOP;
END $$;
SELECT count(*) FROM step_cut;",
        condition = step.condition()
    )
}

/// The statement of an outside hold on claimed outbox rows: up to `rows` rows in `processing`
/// (none of the slow handler's, whose heartbeat must not be starved) locked for `seconds`, so
/// that the settles and beats of the workers holding them meet their lock timeout.
pub(super) fn claimed_rows_hold_sql(rows: usize, seconds: f64) -> String {
    format!(
        "BEGIN; SELECT count(*) FROM (SELECT Id FROM _System_OutboxEvent \
         WHERE Status = 'processing' AND EventType <> '{slow}' \
         ORDER BY LastModifiedDate DESC LIMIT {rows} FOR UPDATE SKIP LOCKED) held; \
         SELECT pg_sleep({seconds:.1}); ROLLBACK;",
        slow = super::profile::SLOW_EVENT_TYPE
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::project_root;

    /// A `LIKE` pattern's literal pieces.
    fn pieces(pattern: &str) -> Vec<&str> {
        pattern.split('%').filter(|p| !p.is_empty()).collect()
    }

    #[test]
    fn the_step_patterns_are_the_librarys_statements() {
        let fenced = std::fs::read_to_string(
            project_root().join("crates/outbox-persistence/src/postgres/fenced.rs"),
        )
        .unwrap();
        for pattern in [BEGIN_PATTERN, SETTLE_PATTERN] {
            for piece in pieces(pattern) {
                assert!(
                    fenced.contains(piece),
                    "fenced.rs no longer holds {piece:?} of the step pattern {pattern:?}"
                );
            }
        }
        let sql = cut_at_step_sql("db", Step::Settle);
        assert!(sql.contains("query LIKE '%_System_OutboxSettle%'"), "{sql}");
    }
}
