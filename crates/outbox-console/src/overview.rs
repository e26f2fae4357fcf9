//! The overview (`/`): rows by status, the oldest pending age, stale claims, retrying rows,
//! rows processed per minute over the last hour (an SVG chart drawn here), the longest-blocked
//! records with their reason, the paused event types, and the audit log. Its live part is also
//! served alone (`/fragments/overview`), which `console.js` polls to refresh the page.
//!
//! However many tabs poll it, the console reads the live part once per [`OVERVIEW_REFRESH`]:
//! the result is shared ([`OverviewCache`]), and requests that arrive while it is being read
//! wait for that read rather than starting their own. A page load (`/`) reads afresh (and
//! shares what it read): an operator who opens the overview sees the queue as it is now.

use axum::Extension;
use axum::extract::State;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use outbox_persistence::console::{
    QueueCounts, ReplicaLag, Throughput, queue_counts, replica_lag, throughput,
};
use outbox_persistence::{AuditEntry, BlockedKey, PausedType};

use crate::layout::{Base, PageError, age, csrf_field, shell, ts};
use crate::security::{Actor, may_act};
use crate::{AUDIT_ENTRIES_SHOWN, BLOCKED_KEYS_SHOWN, Console};

/// How long one read of the overview's live part serves every request (the pages poll every
/// 2 s: `console.js`).
pub const OVERVIEW_REFRESH: Duration = Duration::from_secs(2);

/// What the live part of the overview shows.
struct Live {
    counts: QueueCounts,
    throughput: Throughput,
    blocked: Vec<BlockedKey>,
    /// The paused types, or why they could not be read (shown as a banner: the rest of the
    /// overview stands without them).
    paused: Result<Vec<PausedType>, String>,
    /// How far behind the standby the console reads from is (`None`: it reads the primary).
    lag: Option<ReplicaLag>,
}

/// How long a failed read of the live part answers the polls that waited for it (they get the
/// same error rather than each trying again behind the lock).
const FAILURE_KEPT: Duration = Duration::from_secs(1);

/// The longest one read of the live part may take (a standby that stops answering without
/// refusing connections would otherwise hold every poll).
const READ_LIMIT: Duration = Duration::from_secs(10);

/// One read of the live part: what it read, or why it failed.
type LiveRead = Result<Arc<Live>, String>;

/// The live part last read (or why it failed) and when, shared by every request for
/// [`OVERVIEW_REFRESH`] ([`FAILURE_KEPT`] for a failure). One read runs at a time (`flight`):
/// requests that arrive meanwhile wait for it and take its result. Invalidating never waits
/// for a read.
#[derive(Default)]
pub(crate) struct OverviewCache {
    last: std::sync::Mutex<Option<(Instant, LiveRead)>>,
    flight: tokio::sync::Mutex<()>,
}

impl OverviewCache {
    /// Drops the shared read: an action changed what it shows (the operator who paused a type
    /// sees it paused at once, when the console reads the primary).
    pub(crate) fn invalidate(&self) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The shared read if it is recent enough: younger than `since` when it succeeded.
    fn recent(&self, since: Instant) -> Option<LiveRead> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let (at, read) = last.as_ref()?;
        let fresh = match read {
            Ok(_) => *at >= since && at.elapsed() < OVERVIEW_REFRESH,
            Err(_) => *at >= since && at.elapsed() < FAILURE_KEPT,
        };
        fresh.then(|| read.clone())
    }
}

/// The live part: the shared read when it is younger than [`OVERVIEW_REFRESH`] (and `fresh`
/// is not asked for), otherwise read now, once, whoever else asks meanwhile (they take this
/// read, or its failure).
async fn live(console: &Console, fresh: bool) -> Result<Arc<Live>, PageError> {
    let cache = console.overview_cache();
    let asked = Instant::now();
    // A fresh read must have begun after the request: anything older will not do.
    let since = |asked: Instant| {
        if fresh {
            asked
        } else {
            asked.checked_sub(OVERVIEW_REFRESH).unwrap_or(asked)
        }
    };
    if let Some(read) = cache.recent(since(asked)) {
        return read.map_err(PageError);
    }
    let _flight = cache.flight.lock().await;
    // Read by the flight this request waited for?
    if let Some(read) = cache.recent(since(asked)) {
        return read.map_err(PageError);
    }
    let began = Instant::now();
    let read = match tokio::time::timeout(READ_LIMIT, read_live(console)).await {
        Ok(Ok(live)) => Ok(Arc::new(live)),
        Ok(Err(PageError(e))) => Err(e),
        Err(_) => Err(format!(
            "reading the overview took longer than {} s",
            READ_LIMIT.as_secs()
        )),
    };
    *cache.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((began, read.clone()));
    read.map_err(PageError)
}

async fn read_live(console: &Console) -> Result<Live, PageError> {
    let policy = console.config().claim_policy;
    let repo = console.repo();
    let standby = console.reads_standby();
    // The blocked keys are read from the heads table; read them beside the counts.
    let (counts, throughput, blocked, paused, lag) = tokio::join!(
        queue_counts(console.db(), console.repo().as_ref(), policy),
        throughput(console.db()),
        repo.blocked_keys(policy, BLOCKED_KEYS_SHOWN),
        repo.paused_event_types(),
        async {
            match standby {
                true => replica_lag(console.db()).await,
                false => Ok(None),
            }
        },
    );
    let (counts, lag) = (counts?, lag?);
    let paused = paused.map_err(|e| {
        tracing::warn!(error = %e.chain(), "the console could not read the paused event types");
        console.note_read_failure("paused_types");
        e.to_string()
    });
    Ok(Live {
        counts,
        throughput: throughput?,
        blocked: blocked?,
        paused,
        lag,
    })
}

/// `GET /`.
pub(crate) async fn page(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
) -> Result<Response, PageError> {
    let live = live(&console, true).await?;
    let audit = console.repo().audit_log(AUDIT_ENTRIES_SHOWN).await?;
    let body = html! {
        section #live data-fragment=(base.link("/fragments/overview")) {
            (live_section(&console, &actor, &base, &live))
        }
        (pause_form(&console, &actor, &base))
        h2 { "Recent actions" }
        (audit_table(&audit))
    };
    Ok(shell(&console, &actor, &base, "Overview", body).into_response())
}

/// `GET /fragments/overview`: the live section alone.
pub(crate) async fn fragment(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
) -> Result<Response, PageError> {
    let live = live(&console, false).await?;
    Ok(live_section(&console, &actor, &base, &live).into_response())
}

/// `GET /audit`: the audit log.
pub(crate) async fn audit_page(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
) -> Result<Response, PageError> {
    let audit = console.repo().audit_log(200).await?;
    let body = html! { (audit_table(&audit)) };
    Ok(shell(&console, &actor, &base, "Audit log", body).into_response())
}

fn count(label: &str, testid: &str, value: impl std::fmt::Display) -> Markup {
    html! { div.count { span.label { (label) } span.value data-testid=(testid) { (value) } } }
}

fn live_section(console: &Console, actor: &Actor, base: &Base, live: &Live) -> Markup {
    let s = &live.counts.stats;
    let processed = if live.counts.processed_estimated {
        format!("≈{}", s.processed)
    } else {
        s.processed.to_string()
    };
    let oldest = s.oldest_pending_age_seconds.map_or("none".to_string(), age);
    html! {
        @if let Some(lag) = &live.lag {
            p.note data-testid="replica-lag" { (describe_lag(lag)) }
        }
        div.counts {
            (count("pending", "count-pending", s.pending))
            (count("processing", "count-processing", s.processing))
            (count("processed", "count-processed", processed))
            (count("failed", "count-failed", s.failed))
            (count("retrying", "count-retrying", s.retrying))
            (count("stale claims", "count-stale", s.stale_claims))
            (count("oldest pending", "oldest-pending", oldest))
        }
        @if live.counts.processed_estimated {
            p.note { "≈: the processed count is estimated on a table this large (counting it would scan it)." }
        }
        h2 { "Processed per minute, last hour" }
        (chart(&live.throughput))
        h2 { "Paused event types" }
        @match &live.paused {
            Ok(paused) => (paused_table(console, actor, base, paused)),
            Err(_) => p.warning data-testid="paused-unread" {
                "The paused event types could not be read (a database not migrated to this version, or a role that may not read _System_OutboxPausedType): this overview cannot say which types are paused. The console's log has the error; outbox_console_read_failures_total counts it."
            },
        }
        h2 { "Longest-blocked records" }
        (blocked_table(base, &live.blocked))
    }
}

/// What the page says of the standby it reads from.
fn describe_lag(lag: &ReplicaLag) -> String {
    let reads = "Read from a hot standby (actions go to the primary)";
    if !lag.streaming {
        let behind = lag.behind_seconds.map_or(String::new(), |s| {
            format!(" (its newest data is {s:.1} s old)")
        });
        return format!(
            "{reads}: it is NOT streaming from the primary (its WAL receiver is down){behind}; what this page shows may be old."
        );
    }
    match (lag.behind_seconds, lag.caught_up) {
        (None, _) => format!("{reads}: it has replayed no transaction yet."),
        (Some(s), false) => format!(
            "{reads}: data as of {s:.1} s ago; it is replaying what the primary wrote since."
        ),
        (Some(s), true) => format!(
            "{reads}: data as of {s:.1} s ago, caught up with everything the primary has sent (the primary has written nothing newer)."
        ),
    }
}

/// The chart: one bar per minute, the current minute on the right, with labelled axes (rows
/// per minute up the left, from 0 to the peak; minutes ago along the bottom).
fn chart(t: &Throughput) -> Markup {
    let max = t.per_minute.iter().copied().max().unwrap_or(0).max(1);
    // The plot sits right of the y labels (x 60..660) and above the x labels (y 10..110).
    html! {
        svg.chart viewBox="0 0 680 140" role="img" aria-label="rows processed per minute, last hour" {
            line x1="60" y1="110" x2="660" y2="110" class="axis" {}
            line x1="60" y1="10" x2="60" y2="110" class="axis" {}
            text.label x="54" y="14" text-anchor="end" data-testid="chart-y-max" { (max) }
            text.label x="54" y="112" text-anchor="end" { "0" }
            text.label x="12" y="60" text-anchor="middle" transform="rotate(-90 12 60)" { "rows / min" }
            @for (x, label) in [(60, "60 min ago"), (360, "30 min ago"), (660, "now")] {
                text.label x=(x) y="126" text-anchor="middle" { (label) }
            }
            text.label x="360" y="139" text-anchor="middle" data-testid="chart-x-axis" { "minutes ago (UTC, the database's clock)" }
            @for (i, n) in t.per_minute.iter().enumerate() {
                @let h = (*n as f64 / max as f64 * 100.0).round();
                rect x=(60 + i * 10) y=(110.0 - h) width="8" height=(h) class="bar" {
                    title { (59 - i) " min ago: " (n) }
                }
            }
        }
        p.note {
            span data-testid="processed-last-hour" { (t.total()) }
            " processed in the last hour (peak " (max) " per minute), at " (ts(t.now))
        }
    }
}

fn blocked_table(base: &Base, blocked: &[BlockedKey]) -> Markup {
    if blocked.is_empty() {
        return html! { p.note data-testid="no-blocked" { "No record is blocked." } };
    }
    html! {
        table data-testid="blocked" {
            thead { tr { th { "Record" } th { "Waiting" } th { "Since" } th { "Head" } th { "Why" } } }
            tbody {
                @for b in blocked {
                    @let key = b.head.record_key.as_ref().map_or("", |k| k.as_str());
                    tr {
                        td { a href=(format!("{}?key={}", base.link("/records"), encode(key))) { (key) } }
                        td { (b.waiting) }
                        td { (ts(b.waiting_since)) }
                        td { a href=(base.link(&format!("/events/{}", b.head.id))) { (b.head.event_type) } }
                        td { (b.state.describe()) }
                    }
                }
            }
        }
    }
}

fn paused_table(console: &Console, actor: &Actor, base: &Base, paused: &[PausedType]) -> Markup {
    if paused.is_empty() {
        return html! { p.note data-testid="no-paused" { "No event type is paused." } };
    }
    html! {
        table data-testid="paused" {
            thead { tr { th { "Event type" } th { "Paused at" } th { "By" } th {} } }
            tbody {
                @for p in paused {
                    tr {
                        td.type { (p.event_type) }
                        td { (ts(p.paused_at)) }
                        td { (p.paused_by) }
                        td {
                            @if may_act(console, actor) {
                                form method="post" action=(base.link("/actions/resume")) {
                                    (csrf_field(actor))
                                    input type="hidden" name="event_type" value=(p.event_type);
                                    button type="submit" { "Resume" }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn pause_form(console: &Console, actor: &Actor, base: &Base) -> Markup {
    if !may_act(console, actor) {
        return html! {};
    }
    html! {
        form.inline #pause-form method="post" action=(base.link("/actions/pause")) {
            (csrf_field(actor))
            label { "Pause event type " input type="text" name="event_type" required; }
            button type="submit" { "Pause" }
        }
    }
}

fn audit_table(audit: &[AuditEntry]) -> Markup {
    if audit.is_empty() {
        return html! { p.note { "No action was taken yet." } };
    }
    html! {
        table data-testid="audit" {
            thead { tr { th { "At" } th { "Who" } th { "Action" } th { "Detail" } } }
            tbody {
                @for a in audit {
                    tr { td { (ts(a.at)) } td { (a.actor) } td { (a.action) } td { (a.detail) } }
                }
            }
        }
    }
}

/// Percent-encodes a query value.
pub(crate) fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b':' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(encode("lead:1"), "lead:1");
        assert_eq!(encode("a b&c=<"), "a%20b%26c%3D%3C");
    }

    #[test]
    fn the_chart_has_a_bar_per_minute() {
        let t = Throughput {
            now: chrono::Utc::now(),
            per_minute: (0..60).collect(),
        };
        let svg = chart(&t).into_string();
        assert_eq!(svg.matches("<rect").count(), 60);
        assert!(!svg.contains("style="));
        // Labelled axes: the peak and zero up the left, minutes ago along the bottom.
        assert!(svg.contains(r#"data-testid="chart-y-max">59<"#), "{svg}");
        for label in [
            "rows / min",
            "60 min ago",
            "30 min ago",
            "now",
            "minutes ago",
        ] {
            assert!(svg.contains(label), "no {label:?} in {svg}");
        }
    }
}
