//! The effect ledger (`_System_OutboxEffect`, docs/state-machine.md, "The effect ledger"): one
//! row per external effect a handler completed for an event, keyed by the event, the handler
//! (its consumer's name) and the effect's name, with the idempotency key it was given and what
//! it returned. Written in the attempt's transaction, so a row commits with the handler's own
//! writes; a later attempt finds it and hands the result back instead of running the effect.
//! Its statements are prepared unnamed behind a transaction pooler (`statement`).

use chrono::{DateTime, Utc};

use crate::{EventId, Result, Tx};

/// One completed effect, as the ledger keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectRecord {
    /// The event the effect was for.
    pub event_id: EventId,
    /// The handler that ran it: its consumer's name.
    pub handler_id: String,
    /// The effect's name in the handler (`ctx.effect("welcome-mail")`).
    pub effect_key: String,
    /// The key the effect was given ([`idempotency_key`] of the three above).
    pub idempotency_key: String,
    /// What the effect returned (JSON text), handed back to later attempts.
    pub result: Option<String>,
}

impl EffectRecord {
    /// The record of `effect_key` run by `handler_id` for `event_id`, with its derived key.
    pub fn new(
        event_id: EventId,
        handler_id: impl Into<String>,
        effect_key: impl Into<String>,
        result: Option<String>,
    ) -> Self {
        let (handler_id, effect_key) = (handler_id.into(), effect_key.into());
        Self {
            idempotency_key: idempotency_key(&handler_id, event_id, &effect_key),
            event_id,
            handler_id,
            effect_key,
            result,
        }
    }
}

/// The namespace of the ledger's idempotency keys (UUID version 5 names).
const KEY_NAMESPACE: uuid::Uuid = uuid::Uuid::from_u128(0x6f75_7462_6f78_4c65_8467_6572_3338_0001);

/// The idempotency key of an effect: the same for every attempt of the event, different for
/// every other event, handler or effect name: `outbox-` and a name-based UUID (version 5) of the
/// three, each length-prefixed so no two triples spell the same name.
pub fn idempotency_key(handler_id: &str, event_id: EventId, effect_key: &str) -> String {
    let name = format!(
        "{}:{handler_id}|{event_id}|{}:{effect_key}",
        handler_id.len(),
        effect_key.len()
    );
    format!(
        "outbox-{}",
        uuid::Uuid::new_v5(&KEY_NAMESPACE, name.as_bytes()).hyphenated()
    )
}

/// The result the ledger holds for the effect, if a committed attempt (or this transaction)
/// recorded it: `Some(result)`, `result` being `None` when the effect returned nothing.
pub async fn find_effect(
    tx: &mut Tx,
    event_id: EventId,
    handler_id: &str,
    effect_key: &str,
) -> Result<Option<Option<String>>> {
    const FIND: &str = "SELECT Result FROM _System_OutboxEffect
                        WHERE EventId = $1 AND HandlerId = $2 AND EffectKey = $3";
    let found: Option<Option<String>> = match tx {
        Tx::Postgres(tx) => {
            crate::statement::query_scalar(FIND)
                .bind(event_id)
                .bind(handler_id)
                .bind(effect_key)
                .fetch_optional(&mut **tx)
                .await?
        }
        Tx::Sqlite(tx) => {
            crate::statement::query_scalar(FIND)
                .bind(event_id.to_string())
                .bind(handler_id)
                .bind(effect_key)
                .fetch_optional(&mut **tx)
                .await?
        }
    };
    Ok(found)
}

/// Records `effect` in `tx`; `false` when the ledger already held it (a row written by
/// another attempt of the event, or earlier in this transaction), which is kept.
pub async fn record_effect(tx: &mut Tx, effect: &EffectRecord) -> Result<bool> {
    // PostgreSQL dates the row with its own clock (the column's default), as every queue time.
    const RECORD_PG: &str = "INSERT INTO _System_OutboxEffect
                               (EventId, HandlerId, EffectKey, IdempotencyKey, Result)
                             VALUES ($1, $2, $3, $4, $5)
                             ON CONFLICT (EventId, HandlerId, EffectKey) DO NOTHING";
    const RECORD: &str = "INSERT INTO _System_OutboxEffect
                            (EventId, HandlerId, EffectKey, IdempotencyKey, Result, RecordedDate)
                          VALUES ($1, $2, $3, $4, $5, $6)
                          ON CONFLICT (EventId, HandlerId, EffectKey) DO NOTHING";
    let inserted = match tx {
        Tx::Postgres(tx) => crate::statement::query(RECORD_PG)
            .bind(effect.event_id)
            .bind(&effect.handler_id)
            .bind(&effect.effect_key)
            .bind(&effect.idempotency_key)
            .bind(&effect.result)
            .execute(&mut **tx)
            .await?
            .rows_affected(),
        Tx::Sqlite(tx) => crate::statement::query(RECORD)
            .bind(effect.event_id.to_string())
            .bind(&effect.handler_id)
            .bind(&effect.effect_key)
            .bind(&effect.idempotency_key)
            .bind(&effect.result)
            .bind(crate::sqlite::format_ts(now_micros()))
            .execute(&mut **tx)
            .await?
            .rows_affected(),
    };
    Ok(inserted == 1)
}

fn now_micros() -> DateTime<Utc> {
    crate::truncate_micros(Utc::now())
}

/// Every effect the ledger records for `event_ids` (any handler), read in `tx` in one
/// statement through the ledger's primary key, which leads with the event (on PostgreSQL in
/// `_System_OutboxFindEffects`, whose planner settings leave no other plan): what a batch reads
/// before it runs its transaction-free handlers side by side (their contexts hand it back
/// instead of reading the ledger one effect at a time).
pub async fn find_effects(tx: &mut Tx, event_ids: &[EventId]) -> Result<Vec<EffectRecord>> {
    if event_ids.is_empty() {
        return Ok(Vec::new());
    }
    const COLUMNS: &str = "EventId, HandlerId, EffectKey, IdempotencyKey, Result";
    type Row<I> = (I, String, String, String, Option<String>);
    let record = |(event_id, handler_id, effect_key, idempotency_key, result)| EffectRecord {
        event_id,
        handler_id,
        effect_key,
        idempotency_key,
        result,
    };
    match tx {
        Tx::Postgres(tx) => {
            // A function with the claim's planner settings (migration 0024): a plan made while
            // the ledger was small would keep reading it whole as it grows.
            let rows: Vec<Row<EventId>> =
                crate::statement::query_as("SELECT * FROM _System_OutboxFindEffects($1)")
                    .bind(event_ids)
                    .fetch_all(&mut **tx)
                    .await?;
            Ok(rows.into_iter().map(record).collect())
        }
        Tx::Sqlite(tx) => {
            let marks = vec!["?"; event_ids.len()].join(", ");
            let sql =
                format!("SELECT {COLUMNS} FROM _System_OutboxEffect WHERE EventId IN ({marks})");
            // Built from constants and one `?` per id: the ids are bound.
            let mut query = crate::statement::query_as::<_, Row<String>>(sqlx::AssertSqlSafe(sql));
            for id in event_ids {
                query = query.bind(id.to_string());
            }
            let mut out = Vec::new();
            for (id, handler_id, effect_key, key, result) in query.fetch_all(&mut **tx).await? {
                let event_id = crate::sqlite::parse_id(&id)?;
                out.push(record((event_id, handler_id, effect_key, key, result)));
            }
            Ok(out)
        }
    }
}

/// Records `effects` in `tx` (each once: one already recorded stays as it is): on PostgreSQL
/// in one statement, on SQLite one statement each (in the one transaction that holds the
/// write lock).
pub async fn record_effects_in(tx: &mut Tx, effects: &[EffectRecord]) -> Result<()> {
    match (tx, effects) {
        (_, []) => Ok(()),
        (tx, [one]) => record_effect(tx, one).await.map(drop),
        (Tx::Postgres(tx), many) => {
            const RECORD_MANY: &str = "INSERT INTO _System_OutboxEffect
                                         (EventId, HandlerId, EffectKey, IdempotencyKey, Result)
                                       SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[],
                                                            $4::text[], $5::text[])
                                       ON CONFLICT (EventId, HandlerId, EffectKey) DO NOTHING";
            let column = |f: fn(&EffectRecord) -> Option<String>| -> Vec<Option<String>> {
                many.iter().map(f).collect()
            };
            crate::statement::query(RECORD_MANY)
                .bind(many.iter().map(|e| e.event_id).collect::<Vec<EventId>>())
                .bind(column(|e| Some(e.handler_id.clone())))
                .bind(column(|e| Some(e.effect_key.clone())))
                .bind(column(|e| Some(e.idempotency_key.clone())))
                .bind(column(|e| e.result.clone()))
                .execute(&mut **tx)
                .await?;
            Ok(())
        }
        (tx, many) => {
            for effect in many {
                record_effect(tx, effect).await?;
            }
            Ok(())
        }
    }
}

/// Whether the ledger's table is there (the outbox's migrations that carry it applied).
pub async fn ledger_table_exists(tx: &mut Tx) -> Result<bool> {
    crate::tx::table_exists(tx, "_system_outboxeffect").await
}

/// Records `effects` in `tx` and commits it (`OutboxRepository::record_effects`).
pub(crate) async fn record_on_own_tx(mut tx: Tx, effects: &[EffectRecord]) -> Result<()> {
    record_effects_in(&mut tx, effects).await?;
    tx.commit().await
}

/// One effect the ledger records, as operators read it (`outbox status --key`, the console's
/// event page).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RecordedEffect {
    /// The event the effect was for.
    pub event_id: EventId,
    /// The handler that ran it: its consumer's name.
    pub handler_id: String,
    /// The effect's name in the handler.
    pub effect_key: String,
    /// The key the effect was given.
    pub idempotency_key: String,
    /// What the effect returned (JSON text).
    pub result: Option<String>,
    /// When the ledger recorded it (the database's clock on PostgreSQL).
    pub recorded_date: DateTime<Utc>,
}

/// The most effects [`effects_of`] returns.
pub const EFFECTS_SHOWN: i64 = 100;

/// The most events [`effects_of`] looks up in one call (the first ones given).
pub const EFFECTS_EVENTS_LOOKED_UP: usize = 500;

/// The effects the ledger records for `event_ids` (the first [`EFFECTS_EVENTS_LOOKED_UP`]),
/// the newest [`EFFECTS_SHOWN`], oldest first (read through the ledger's primary key, which
/// leads with the event); none when the ledger's table is missing (not migrated yet).
pub async fn effects_of(tx: &mut Tx, event_ids: &[EventId]) -> Result<Vec<RecordedEffect>> {
    let event_ids = &event_ids[..event_ids.len().min(EFFECTS_EVENTS_LOOKED_UP)];
    if event_ids.is_empty() || !ledger_table_exists(tx).await? {
        return Ok(Vec::new());
    }
    const COLUMNS: &str = "EventId, HandlerId, EffectKey, IdempotencyKey, Result, RecordedDate";
    type Row<I, D> = (I, String, String, String, Option<String>, D);
    let effect = |(event_id, handler_id, effect_key, idempotency_key, result, recorded_date)| {
        RecordedEffect {
            event_id,
            handler_id,
            effect_key,
            idempotency_key,
            result,
            recorded_date,
        }
    };
    match tx {
        Tx::Postgres(tx) => {
            // Built from constants only: the ids are bound.
            let rows: Vec<Row<EventId, DateTime<Utc>>> =
                crate::statement::query_as(sqlx::AssertSqlSafe(format!(
                    "SELECT {COLUMNS} FROM _System_OutboxEffect WHERE EventId = ANY($1)
                     ORDER BY RecordedDate DESC, EventId, HandlerId, EffectKey LIMIT $2"
                )))
                .bind(event_ids)
                .bind(EFFECTS_SHOWN)
                .fetch_all(&mut **tx)
                .await?;
            Ok(rows.into_iter().rev().map(effect).collect())
        }
        Tx::Sqlite(tx) => {
            let marks = vec!["?"; event_ids.len()].join(", ");
            let sql = format!(
                "SELECT {COLUMNS} FROM _System_OutboxEffect WHERE EventId IN ({marks})
                 ORDER BY RecordedDate DESC, EventId, HandlerId, EffectKey LIMIT {EFFECTS_SHOWN}"
            );
            // Built from constants and one `?` per id: the ids are bound.
            let mut query =
                crate::statement::query_as::<_, Row<String, String>>(sqlx::AssertSqlSafe(sql));
            for id in event_ids {
                query = query.bind(id.to_string());
            }
            let mut out = Vec::new();
            for (id, handler_id, effect_key, key, result, date) in
                query.fetch_all(&mut **tx).await?
            {
                let event_id = crate::sqlite::parse_id(&id)?;
                let recorded = crate::sqlite::parse_ts(&date)?;
                out.push(effect((
                    event_id, handler_id, effect_key, key, result, recorded,
                )));
            }
            Ok(out)
        }
    }
}

/// Whether the ledger's table exists and, on PostgreSQL, the function a batch reads it through
/// (`_System_OutboxFindEffects`, migration 0024: without it every batch of transaction-free
/// handlers would die at its first statement), read in `tx`, rolled back after
/// (`OutboxRepository::effect_ledger_ready`).
pub(crate) async fn ledger_ready(mut tx: Tx) -> Result<bool> {
    let mut ready = ledger_table_exists(&mut tx).await?;
    if let (true, Tx::Postgres(pg)) = (ready, &mut tx) {
        ready = crate::statement::query_scalar(
            "SELECT to_regprocedure('_system_outboxfindeffects(uuid[])') IS NOT NULL",
        )
        .fetch_one(&mut **pg)
        .await?;
    }
    tx.rollback().await?;
    Ok(ready)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_stable_and_names_its_three_parts() {
        let event = uuid::Uuid::from_u128(7);
        let key = idempotency_key("welcome-mail", event, "send");
        assert_eq!(key, idempotency_key("welcome-mail", event, "send"));
        assert!(key.starts_with("outbox-") && key.len() == "outbox-".len() + 36);
        for other in [
            idempotency_key("welcome-mail", uuid::Uuid::from_u128(8), "send"),
            idempotency_key("welcome-mai", event, "lsend"),
            idempotency_key("welcome-mail", event, "send2"),
            idempotency_key("other", event, "send"),
        ] {
            assert_ne!(key, other);
        }
    }
}
