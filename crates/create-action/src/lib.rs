//! Idempotent record effects for outbox handlers: natural-key find-or-create, classified field
//! sets, and (feature `test-kit`, for tests only) a redelivery test kit.
//!
//! The #3477 duplicate was a conversion-time related-record create that ran twice when its event
//! was delivered again. This crate makes such effects safe to redeliver, and says which ones are
//! not:
//!
//! - [`FindOrCreate`] returns the row of a natural key or creates exactly one, backed by the
//!   key's `UNIQUE` index; a redelivery draws no autonumber, and a lost insert race hands its
//!   drawn value back (see `docs/create-action.md`).
//! - [`FieldSet`] updates a target row's fields; each assignment's right-hand side ([`Rhs`])
//!   decides whether the set is deterministic, and [`Effect::effect_class`] reports it.
//! - `redelivery` (feature `test-kit`, off by default: a test kit, not production code) delivers
//!   an event again, and concurrently, and reports every difference.
//!
//! Every table and column name comes from registered metadata ([`Registry`], [`ObjectDef`]) and
//! is validated ([`Ident`]); values from events are always bound, never spliced into SQL.
//! Actions run on `sqlx::PgConnection` or `sqlx::SqliteConnection` ([`ActionConn`]) inside the
//! caller's transaction: `action.run(&mut *tx, &event)`.

#![warn(missing_docs)]

pub mod autonumber;
mod class;
mod conn;
mod create;
mod error;
mod field_set;
mod ident;
#[cfg(feature = "outbox")]
mod outbox;
mod postgres;
#[cfg(feature = "test-kit")]
pub mod redelivery;
mod registry;
mod sqlite;
mod value;

pub use class::{Effect, EffectClass, NonDeterminism, Reason};
pub use conn::{ActionConn, AnyConn, Backend};
pub use create::{CreateOutcome, FindOrCreate, FindOrCreateBuilder, MAX_RACE_ROUNDS};
pub use error::Error;
pub use field_set::{FieldSet, FieldSetBuilder, Rhs};
pub use ident::{Ident, MAX_IDENT_LEN, RESERVED_TABLE_PREFIXES};
pub use record_key::EventEnvelope;
pub use registry::{Column, ColumnRole, ColumnType, ObjectDef, ObjectDefBuilder, Registry};
pub use value::{Source, format_timestamp};

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Parses an event payload into its envelope (the frozen snapshot and the record it is about),
/// the input of every action.
pub fn envelope(payload: &serde_json::Value) -> Result<EventEnvelope> {
    EventEnvelope::from_value(payload.clone()).map_err(Error::InvalidPayload)
}

/// Compile-time check: the actions' futures are `Send` on both backends, so outbox handlers
/// (which run in spawned tasks) can await them.
const _: () = {
    fn assert_send<T: Send>(_: T) {}
    let _: fn(&mut sqlx::PgConnection, &FindOrCreate, &FieldSet, &EventEnvelope) =
        |conn, create, set, event| {
            assert_send(create.run(&mut *conn, event));
            assert_send(set.run(conn, event, std::time::UNIX_EPOCH));
        };
    let _: fn(&mut sqlx::SqliteConnection, &FindOrCreate, &FieldSet, &EventEnvelope) =
        |conn, create, set, event| {
            assert_send(create.run(&mut *conn, event));
            assert_send(set.run(conn, event, std::time::UNIX_EPOCH));
        };
};
