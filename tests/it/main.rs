//! Cross-crate integration tests, one binary: every database test runs on SQLite and on
//! PostgreSQL (see `outbox_tests::backend_tests!`).

mod adopter;
mod batch;
mod batch_safety;
mod batched;
mod create_action;
mod embedding;
mod equivalence;
mod gate;
mod heads;
mod hostile;
mod ledger;
mod lock_free;
mod migrations;
mod owned_heads;
mod pause;
mod plans;
mod production;
mod repository;
mod retention;
mod rollup;
mod side_by_side;
mod snooze;
mod stale_statistics;
mod status;
mod wakeups;
mod workers;
