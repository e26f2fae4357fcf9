//! The console's integration tests, one binary: HTTP-level tests through `oneshot` on real
//! SQLite and PostgreSQL (`http`), the page timings on a 1,000,000-row PostgreSQL table
//! (`timings`), and the browser test with headless Chromium over WebDriver (`browser`).

mod browser;
mod hardening;
mod http;
mod load;
mod net;
mod standby;
mod support;
mod timings;
