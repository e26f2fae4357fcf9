//! Webhooks against a real receiver that checks every delivery with the official Standard
//! Webhooks verifier (`receiver.py`, PyPI's `standardwebhooks`), on SQLite and on PostgreSQL
//! (fresh database per test).

mod attempt_log;
mod chaos;
mod common;
mod delivery;
