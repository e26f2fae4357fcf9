//! The consumer map with the rollout gate's verdict and reasons (`/consumers`, as `outbox
//! consumers` and `outbox gate` print them), and retention (`/retention`: the policy and the
//! rows it lets go now, as `outbox prune --dry-run` counts them).

use axum::Extension;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::html;
use outbox_events::{EffectKind, Safeguard, Verdict, evaluate_gate};

use crate::Console;
use crate::layout::{Base, PageError, shell};
use crate::security::Actor;

fn class_name(kind: &EffectKind) -> String {
    match kind {
        EffectKind::DeterministicFieldSet => "deterministic field set".into(),
        EffectKind::NonDeterministicFieldSet { reasons } => {
            format!("non-deterministic field set ({})", reasons.join("; "))
        }
        EffectKind::NaturalKeyCreate { natural_key } => {
            format!("natural-key create {natural_key}")
        }
        EffectKind::StateDependent => "state-dependent".into(),
        EffectKind::External { kind } => format!("external ({kind:?})").to_lowercase(),
    }
}

fn verdict_name(v: &Verdict) -> String {
    match v {
        Verdict::Safe => "safe".into(),
        Verdict::Protected => "protected".into(),
        Verdict::Excluded => "excluded".into(),
        Verdict::Blocked(why) => format!("BLOCKED: {why}"),
    }
}

fn safeguard_name(s: Option<&Safeguard>) -> String {
    s.map_or_else(|| "-".into(), Safeguard::describe)
}

/// `GET /consumers`.
pub(crate) async fn consumers_page(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
) -> Result<Response, PageError> {
    let consumers = console.consumers();
    if consumers.is_empty() {
        let body = html! {
            p data-testid="gate-verdict" {
                "Gate refused: this console was given no consumers, so it cannot judge whether \
                 OUTBOX_PULL_WORKER may flip. Mount the console in the service that registers \
                 the handlers, with its consumers."
            }
        };
        return Ok(
            shell(&console, &actor, &base, "Consumers and rollout gate", body).into_response(),
        );
    }
    let report = evaluate_gate(console.repo(), consumers).await?;
    let body = html! {
        @if report.passes() {
            p.ok data-testid="gate-verdict" {
                "Gate passed: OUTBOX_PULL_WORKER may flip (" (report.consumers.len())
                " consumers; excluded, kept on the legacy path: "
                (report.excluded_event_types().join(", ")) ")."
            }
        } @else {
            p.bad data-testid="gate-verdict" { "Gate refused:" }
            ul data-testid="gate-reasons" { @for r in &report.reasons { li { (r) } } }
        }
        p.note { "Rows missing the RecordKey their payload derives: " (report.rows_missing_record_key) }
        table data-testid="consumer-map" {
            thead { tr {
                th { "Event type" } th { "Consumer" } th { "Effect class" } th { "Effect" }
                th { "Contract or exclusion" } th { "Verdict" }
            } }
            tbody {
                @for (c, verdict) in &report.consumers {
                    @if c.effects.is_empty() {
                        tr { td.type { (c.event_type) } td { (c.name) } td { "undeclared" } td {} td {} td { (verdict_name(verdict)) } }
                    }
                    @for e in &c.effects {
                        tr {
                            td.type { (c.event_type) } td { (c.name) } td { (class_name(&e.kind)) }
                            td { (e.description) } td { (safeguard_name(e.safeguard.as_ref())) }
                            td { (verdict_name(verdict)) }
                        }
                    }
                }
            }
        }
    };
    Ok(shell(&console, &actor, &base, "Consumers and rollout gate", body).into_response())
}

fn age_name(age: Option<std::time::Duration>) -> String {
    match age {
        None => "kept forever".into(),
        Some(d) if d.as_secs() % 86_400 == 0 => format!("{} days", d.as_secs() / 86_400),
        Some(d) if d.as_secs() % 3600 == 0 => format!("{} h", d.as_secs() / 3600),
        Some(d) => format!("{} s", d.as_secs()),
    }
}

/// A prunable count as the retention page shows it: counted up to
/// [`outbox_persistence::console::PRUNABLE_COUNTED`], "more than" past it.
fn prunable(count: Option<u64>) -> String {
    use outbox_persistence::console::PRUNABLE_COUNTED;
    match count {
        None => "none (kept forever)".into(),
        Some(n) if n > PRUNABLE_COUNTED => format!("more than {PRUNABLE_COUNTED}"),
        Some(n) => n.to_string(),
    }
}

/// `GET /retention`.
pub(crate) async fn retention_page(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
) -> Result<Response, PageError> {
    let policy = console.config().prune_policy;
    let report = outbox_persistence::console::prunable_rows(console.db(), &policy).await?;
    let body = html! {
        table.detail {
            tr { th { "processed rows kept" } td { (age_name(policy.processed_older_than)) } }
            tr { th { "failed rows kept" } td { (age_name(policy.failed_older_than)) } }
            tr { th { "batch size" } td { (policy.batch_size) } }
            tr { th { "processed rows prunable now" } td data-testid="prunable-processed" { (prunable(report.processed)) } }
            tr { th { "failed rows prunable now" } td data-testid="prunable-failed" { (prunable(report.failed)) } }
        }
        p.note {
            "Pruning deletes only terminal rows older than their status' age, oldest first, in \
             small batches (outbox prune, or the dispatcher's pruner when configured). \
             See docs/retention.md."
        }
    };
    Ok(shell(&console, &actor, &base, "Retention", body).into_response())
}
