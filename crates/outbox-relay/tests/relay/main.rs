//! The relay against a real `nats-server -js` that each test starts on a free port with a
//! temporary store, on SQLite and on PostgreSQL (fresh database per test): order and dedup in
//! the stream, a worker killed between publish and commit, a server restart mid-run, a publish
//! that is not acked, the stream checks, and authentication (user/password, token, TLS with a CA file, `.creds`).

mod common;
mod delivery;
mod faults;
mod production;
mod secure;
mod server;
