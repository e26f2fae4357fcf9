//! Read-only queries of the operator console (`outbox-console`), on both backends: what the
//! console's pages show beyond the repository's operator reads. Every query uses an index and
//! takes no row lock a worker needs.
