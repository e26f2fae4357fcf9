//! The `outbox` binary.
fn main() {}
