//! Rebuilds the service when a migration changes: `sqlx::migrate!` embeds `migrations/` at
//! compile time, and cargo does not watch that folder by itself.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
