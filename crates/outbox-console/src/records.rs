//! A record's page (`/records?key=…`, `outbox status --key` as a page: its non-terminal rows
//! in order, what its head waits for, its newest failure) and an event's page
//! (`/events/{id}`: every column; the payload only when the console shows payloads).

use axum::Extension;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::html;
use outbox_persistence::{EventStatus, key_report};
use serde::Deserialize;

use crate::Console;
use crate::layout::{Base, PageError, clip, csrf_field, rows_table, shell, ts};
use crate::overview::encode;
use crate::security::{Actor, may_act};

/// The record page's query.
#[derive(Deserialize)]
pub(crate) struct KeyQuery {
    #[serde(default)]
    key: String,
}

/// `GET /records?key=…`.
pub(crate) async fn record_page(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
    Query(q): Query<KeyQuery>,
) -> Result<Response, PageError> {
    let key = q.key.trim();
    let form = html! {
        form.inline method="get" action=(base.link("/records")) {
            label { "Record key " input type="text" name="key" value=(key) placeholder="lead:00Q5e00000AbCdE"; }
            button type="submit" { "Show" }
        }
    };
    if key.is_empty() {
        return Ok(shell(&console, &actor, &base, "Record", form).into_response());
    }
    let policy = console.config().claim_policy;
    let report = key_report(console.repo().as_ref(), key, policy).await?;
    let body = html! {
        (form)
        h2 { "Key " code { (report.record_key) } }
        p.note { "at " (ts(report.now)) }
        @match &report.head {
            None => p data-testid="head-state" { "No pending or processing row: nothing is blocked." },
            Some(state) => {
                p { "Head: " span data-testid="head-state" { (state.describe()) } }
                p data-testid="rows-total" {
                    @if !report.rows_total_exact { "more than " }
                    (report.rows_total) " non-terminal row(s), oldest first"
                    @if report.rows_total > report.rows.len() as u64 {
                        " (the oldest " (report.rows.len()) " shown)"
                    }
                    ":"
                }
                (rows_table(&base, &report.rows))
            }
        }
        @if let Some(f) = &report.last_failed {
            h2 { "Newest failed row (it released the rows behind it)" }
            (rows_table(&base, std::slice::from_ref(f)))
        }
    };
    Ok(shell(&console, &actor, &base, "Record", body).into_response())
}

/// How much of a payload the event page shows (`--show-payloads`).
pub(crate) const PAYLOAD_CHARS_SHOWN: usize = 64 * 1024;

/// `GET /events/{id}`.
pub(crate) async fn event_page(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    let Ok(id) = uuid::Uuid::parse_str(&id) else {
        return Ok((StatusCode::BAD_REQUEST, "not an event id").into_response());
    };
    let Some(event) = console.repo().get_event(id).await? else {
        let body = html! { p data-testid="missing" { "No event " (id) "." } };
        let page = shell(&console, &actor, &base, "Event", body);
        return Ok((StatusCode::NOT_FOUND, page).into_response());
    };
    let key = event.record_key.as_ref().map(|k| k.as_str().to_string());
    // The page stands without them (a role that may not read the ledger, say).
    let effects = console
        .repo()
        .effects_of(&[event.id])
        .await
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e.chain(), "could not read the effect ledger for an event");
            Vec::new()
        });
    let allow = may_act(&console, &actor) && event.status == EventStatus::Failed;
    let body = html! {
        table.detail {
            tr { th { "Id" } td data-testid="event-id" { (event.id) } }
            tr { th { "EventType" } td.type data-testid="event-type" { (event.event_type) } }
            tr { th { "Status" } td data-testid="event-status" { (event.status) } }
            tr { th { "RetryCount" } td { (event.retry_count) } }
            tr { th { "RecordKey" } td {
                @if let Some(k) = &key {
                    a href=(format!("{}?key={}", base.link("/records"), encode(k))) { (k) }
                } @else { "none (unordered)" }
            } }
            tr { th { "CreatedDate" } td { (ts(event.created_date)) } }
            tr { th { "LastModifiedDate" } td { (ts(event.last_modified_date)) } }
            tr { th { "LastError" } td.error data-testid="event-error" { (event.last_error.as_deref().unwrap_or("")) } }
            tr { th { "Payload" } td {
                @if console.config().show_payloads {
                    pre data-testid="payload" { (clip(&event.payload, PAYLOAD_CHARS_SHOWN)) }
                } @else {
                    span.note data-testid="payload-hidden" { (event.payload.len()) " bytes, hidden (start the console with --show-payloads to see payloads)" }
                }
            } }
        }
        h2 { "External effects" }
        @if effects.is_empty() {
            p.note data-testid="no-effects" { "The effect ledger records none for this event." }
        } @else {
            p.note { "Recorded in the effect ledger: a later attempt of this event skips them (docs/state-machine.md, \"The effect ledger\")." }
            table data-testid="effects" {
                tr { th { "Handler" } th { "Effect" } th { "Idempotency key" } th { "Recorded" } th { "Result" } }
                @for e in &effects {
                    tr {
                        td { (e.handler_id) }
                        td { (e.effect_key) }
                        td data-testid="effect-key" { (e.idempotency_key) }
                        td { (ts(e.recorded_date)) }
                        td { (clip(e.result.as_deref().unwrap_or(""), 200)) }
                    }
                }
            }
        }
        @if allow {
            form method="post" action=(base.link("/actions/retry")) {
                (csrf_field(&actor))
                input type="hidden" name="id" value=(event.id);
                button type="submit" data-testid="retry-one" { "Retry this row" }
            }
        }
    };
    Ok(shell(&console, &actor, &base, "Event", body).into_response())
}
