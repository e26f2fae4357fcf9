//! The webhook endpoints (`/webhooks`): each endpoint's URL, event types, state (and why it is
//! disabled), failures in a row and rotation, with its newest delivery attempts (status,
//! latency, error, the answer's start). Never a secret. Managed with `outbox webhooks`
//! (docs/webhooks.md).

use axum::Extension;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::html;
use outbox_persistence::webhooks::console_view;

use crate::Console;
use crate::layout::{Base, ERROR_CHARS_SHOWN, PageError, clip, shell, ts};
use crate::security::Actor;

/// How many of each endpoint's newest attempts the page lists.
const ATTEMPTS_SHOWN: u32 = 10;

/// `GET /webhooks`.
pub(crate) async fn page(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
) -> Result<Response, PageError> {
    let views = console_view(console.db(), ATTEMPTS_SHOWN).await?;
    let now = chrono::Utc::now();
    let body = html! {
        @if views.is_empty() {
            p data-testid="webhooks-none" {
                "No webhook endpoints. Add one with `outbox webhooks add NAME URL` (docs/webhooks.md)."
            }
        }
        @for view in &views {
            @let e = &view.endpoint;
            section data-testid="webhook-endpoint" {
                h2 { (e.name) }
                table.detail {
                    tr { th { "URL" } td { (e.url) } }
                    tr { th { "event types" } td {
                        @if e.event_types.is_empty() { "every type the fan-out takes" }
                        @else { (e.event_types.join(", ")) }
                    } }
                    tr { th { "state" } td data-testid="webhook-state" {
                        @if e.enabled { span.ok { "enabled" } }
                        @else {
                            span.bad { "DISABLED" } " (" (e.disabled_reason.as_deref().unwrap_or("no reason given"))
                            "); its deliveries wait in order until `outbox webhooks enable " (e.name) "`"
                        }
                    } }
                    tr { th { "failed attempts in a row" } td { (e.consecutive_failures) } }
                    @if let Some(until) = e.previous_secret_until.filter(|u| *u > now) {
                        tr { th { "rotation" } td { "the previous secret signs too until " (ts(until)) } }
                    }
                    tr { th { "added" } td { (ts(e.created_date)) } }
                }
                @if view.attempts.is_empty() {
                    p.note { "No attempts yet." }
                } @else {
                    table data-testid="webhook-attempts" {
                        thead { tr {
                            th { "at" } th { "delivery" } th { "attempt" } th { "answer" }
                            th { "latency" } th { "error" } th { "answer's start" }
                        } }
                        tbody { @for a in &view.attempts { tr {
                            td { (a.at.map(ts).unwrap_or_default()) }
                            td { a href=(base.link(&format!("/events/{}", a.event_id))) { (a.event_id) } }
                            td { (a.attempt) }
                            td { @if let Some(s) = a.status_code { "HTTP " (s) } @else { "none" } }
                            td { (a.latency_ms) " ms" }
                            td { (clip(a.error.as_deref().unwrap_or(""), ERROR_CHARS_SHOWN)) }
                            td { (clip(a.response_body.as_deref().unwrap_or(""), 120)) }
                        } } }
                    }
                }
            }
        }
    };
    Ok(shell(&console, &actor, &base, "Webhooks", body).into_response())
}
