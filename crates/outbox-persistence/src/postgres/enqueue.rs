//! Enqueue on PostgreSQL: one statement inserts the batch with the database's clock, after
//! taking the records' transaction-scoped advisory locks, so one record's events are ordered as
//! their transactions commit (see `docs/state-machine.md`).

use std::collections::BTreeSet;

use super::sql::db_now;
use super::{ENQUEUE_BUCKET_NAMESPACE, ENQUEUE_LOCK_NAMESPACE, interval};
use crate::{ClockShift, Error, EventId, NewEvent, Result, new_event_id};

/// How many lock buckets the record keys hash into.
const ENQUEUE_BUCKETS: u32 = 64;

/// Up to this many distinct records, an enqueue locks each record; beyond, whole buckets.
const ENQUEUE_KEY_LOCKS_MAX: usize = 32;

/// The locks CTE is materialized and joined, so every lock is held before any row's
/// `CreatedDate` is drawn (each row reads the clock as it is inserted). Parameters: `$1` the
/// clock shift, `$2`..`$5` the rows (ids, types, payloads, keys), `$6`..`$8` the locks.
const INSERT_LOCKED: &str = concat!(
    "WITH locks AS MATERIALIZED (
           SELECT count((CASE WHEN l.shared THEN pg_advisory_xact_lock_shared(l.space, l.id)
                              ELSE pg_advisory_xact_lock(l.space, l.id) END)::text) AS taken
           FROM UNNEST($6::int4[], $7::int4[], $8::bool[]) AS l(space, id, shared)
         )
         INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT n.id, n.event_type, n.payload, 'pending', 0, n.record_key, n.created, n.created
         FROM locks,
              LATERAL (
                SELECT u.*, ",
    db_now!(),
    " AS created
                FROM UNNEST($2::uuid[], $3::text[], $4::text[], $5::text[])
                  WITH ORDINALITY AS u(id, event_type, payload, record_key, ord)
              ) n
         WHERE locks.taken >= 0
         ORDER BY n.ord"
);

/// Inserts `events` in the caller's transaction, deriving each `RecordKey`, with the
/// database's clock, in one statement. Before `CreatedDate` is drawn it takes the records'
/// enqueue locks (see `docs/state-machine.md`), held to the end of the caller's transaction, so one
/// record's events are ordered as their transactions commit: an enqueue that waits for another
/// transaction of the same record draws its `CreatedDate` after that one committed. Ids
/// increase in the order given, breaking ties. Behind a transaction pooler (a pool connected
/// with [`super::Pooler::Transaction`] in this process) the statement is sent unnamed.
pub async fn enqueue(conn: &mut sqlx::PgConnection, events: &[NewEvent]) -> Result<Vec<EventId>> {
    enqueue_shifted(
        conn,
        events,
        &ClockShift::default(),
        (super::caches_statements(), true),
    )
    .await
}

/// The transaction-scoped advisory locks an enqueue of `keys` takes, in the order to take
/// them: `(namespace, id, shared)`. A few records: each record's bucket in shared mode, then
/// each record exclusively (`ENQUEUE_LOCK_NAMESPACE`, a hash of the key), so enqueues of
/// different records never wait for each other. Many records (a bulk enqueue): each of their
/// buckets exclusively, so a transaction never holds more than [`ENQUEUE_BUCKETS`] locks (the
/// server's lock table is finite) and still excludes every other enqueue of its records. All in
/// ascending order, buckets first, so two enqueues never deadlock on these locks.
fn enqueue_locks<'a>(keys: impl Iterator<Item = &'a str>) -> Vec<(i32, i32, bool)> {
    let hashes: BTreeSet<i32> = keys.map(key_hash).collect();
    let buckets: BTreeSet<i32> = hashes
        .iter()
        .map(|h| (*h as u32 % ENQUEUE_BUCKETS) as i32)
        .collect();
    if hashes.len() > ENQUEUE_KEY_LOCKS_MAX {
        return buckets
            .into_iter()
            .map(|b| (ENQUEUE_BUCKET_NAMESPACE, b, false))
            .collect();
    }
    buckets
        .into_iter()
        .map(|b| (ENQUEUE_BUCKET_NAMESPACE, b, true))
        .chain(
            hashes
                .into_iter()
                .map(|h| (ENQUEUE_LOCK_NAMESPACE, h, false)),
        )
        .collect()
}

/// A stable 32-bit hash of a record key (FNV-1a): the same in every process and release.
fn key_hash(key: &str) -> i32 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in key.bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash as i32
}

/// Holds the heads of `events`' records, in key order (`_System_OutboxHeadHold`, migration
/// 0026): see `OutboxRepository::hold_owned_heads`.
pub(super) async fn hold_heads(
    conn: &mut sqlx::PgConnection,
    keys: &[record_key::RecordKey],
    cached: bool,
) -> Result<()> {
    let mut keys: Vec<&str> = keys.iter().map(record_key::RecordKey::as_str).collect();
    keys.sort_unstable();
    keys.dedup();
    if keys.is_empty() {
        return Ok(());
    }
    sqlx::query("SELECT _System_OutboxHeadHold($1)")
        .persistent(cached)
        .bind(&keys)
        .execute(conn)
        .await?;
    Ok(())
}

/// [`enqueue`] with the repository's clock shift; without the records' enqueue locks when
/// `locked` is false (`OutboxRepository::enqueue_owned`: keys only the calling attempt writes).
pub(super) async fn enqueue_shifted(
    conn: &mut sqlx::PgConnection,
    events: &[NewEvent],
    shift: &ClockShift,
    (cached, locked): (bool, bool),
) -> Result<Vec<EventId>> {
    let mut ids = Vec::with_capacity(events.len());
    let mut types = Vec::with_capacity(events.len());
    let mut payloads = Vec::with_capacity(events.len());
    let mut keys = Vec::with_capacity(events.len());
    for event in events {
        let key =
            record_key::record_key_from_payload(&event.payload).map_err(Error::InvalidPayload)?;
        ids.push(new_event_id());
        types.push(event.event_type.as_str());
        payloads.push(event.payload.as_str());
        keys.push(key.map(record_key::RecordKey::into_string));
    }
    if ids.is_empty() {
        return Ok(ids);
    }
    let locks = if locked {
        enqueue_locks(keys.iter().flatten().map(String::as_str))
    } else {
        Vec::new()
    };
    let mut lock_spaces = Vec::with_capacity(locks.len());
    let mut lock_ids = Vec::with_capacity(locks.len());
    let mut lock_shared = Vec::with_capacity(locks.len());
    for (space, id, shared) in locks {
        lock_spaces.push(space);
        lock_ids.push(id);
        lock_shared.push(shared);
    }
    sqlx::query(INSERT_LOCKED)
        .persistent(cached)
        .bind(interval(shift.micros()))
        .bind(&ids)
        .bind(&types)
        .bind(&payloads)
        .bind(&keys)
        .bind(&lock_spaces)
        .bind(&lock_ids)
        .bind(&lock_shared)
        .execute(conn)
        .await?;
    Ok(ids)
}
