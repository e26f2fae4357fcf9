//! The failed rows (`/failed?type=&error=`): filtered by event type and error text, newest
//! first, with `LastError`, `RetryCount` and dates; retry one, the selected ones, or every
//! failed row of a type (when actions are allowed).

use axum::Extension;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use outbox_persistence::EventRow;
use outbox_persistence::console::{FailedFilter, failed_rows, failed_types};
use serde::Deserialize;

use crate::Console;
use crate::layout::{Base, ERROR_CHARS_SHOWN, PageError, clip, csrf_field, shell, ts};
use crate::security::{Actor, may_act};

/// How many failed rows the page lists.
const ROWS_SHOWN: u32 = 200;

/// The page's filter.
#[derive(Deserialize, Default)]
pub(crate) struct FailedQuery {
    #[serde(default, rename = "type")]
    event_type: String,
    #[serde(default)]
    error: String,
}

/// `GET /failed`.
pub(crate) async fn page(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
    Query(q): Query<FailedQuery>,
) -> Result<Response, PageError> {
    let filter = FailedFilter {
        event_type: Some(q.event_type.trim().to_string()).filter(|t| !t.is_empty()),
        error_contains: Some(q.error.trim().to_string()).filter(|e| !e.is_empty()),
        limit: ROWS_SHOWN,
    };
    let rows = failed_rows(console.db(), &filter).await?;
    let types = failed_types(console.db()).await?;
    let body = html! {
        form.inline method="get" action=(base.link("/failed")) {
            label { "Event type " input type="text" name="type" value=(q.event_type); }
            label { "Error contains " input type="text" name="error" value=(q.error); }
            button type="submit" { "Filter" }
        }
        h2 { "Failed rows by event type" }
        (types_table(&console, &actor, &base, &types))
        h2 { "Failed rows" }
        p.note {
            span data-testid="failed-shown" { (rows.len()) }
            " row(s) shown, newest first (at most " (ROWS_SHOWN) ")"
        }
        (rows_form(&console, &actor, &base, &rows))
    };
    Ok(shell(&console, &actor, &base, "Failed rows", body).into_response())
}

fn types_table(console: &Console, actor: &Actor, base: &Base, types: &[(String, u64)]) -> Markup {
    let actions = may_act(console, actor);
    html! {
        table data-testid="failed-types" {
            thead { tr { th { "Event type" } th { "Failed" } th {} } }
            tbody {
                @for (event_type, n) in types {
                    tr {
                        td.type { a href=(format!("{}?type={}", base.link("/failed"), crate::overview::encode(event_type))) { (event_type) } }
                        td { (n) }
                        td {
                            @if actions {
                                form method="post" action=(base.link("/actions/retry")) {
                                    (csrf_field(actor))
                                    input type="hidden" name="event_type" value=(event_type);
                                    button type="submit" { "Retry all " (n) }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn rows_form(console: &Console, actor: &Actor, base: &Base, rows: &[EventRow]) -> Markup {
    let actions = may_act(console, actor);
    let table = html! {
        table data-testid="failed-rows" {
            thead { tr {
                @if actions { th { input type="checkbox" #select-all title="select all"; } }
                th { "Id" } th { "Type" } th { "Record" } th { "Retries" } th { "Created" }
                th { "Failed at" } th { "Last error" }
                @if actions { th {} }
            } }
            tbody {
                @for r in rows {
                    tr data-id=(r.id) {
                        @if actions { td { input type="checkbox" name="id" value=(r.id); } }
                        td { a href=(base.link(&format!("/events/{}", r.id))) { (r.id) } }
                        td.type { (r.event_type) }
                        td { (r.record_key.as_ref().map_or("", |k| k.as_str())) }
                        td { (r.retry_count) }
                        td { (ts(r.created_date)) }
                        td { (ts(r.last_modified_date)) }
                        td.error { (clip(r.last_error.as_deref().unwrap_or(""), ERROR_CHARS_SHOWN)) }
                        @if actions {
                            td { button type="submit" name="one" value=(r.id) { "Retry" } }
                        }
                    }
                }
            }
        }
    };
    if !actions {
        return table;
    }
    html! {
        form #retry-form method="post" action=(base.link("/actions/retry")) {
            (csrf_field(actor))
            (table)
            button type="submit" #retry-selected { "Retry the selected rows" }
        }
    }
}
