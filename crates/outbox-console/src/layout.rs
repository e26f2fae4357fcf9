//! The pages' frame: the prefix the console is mounted under ([`Base`]), the page shell with
//! its navigation, the formatting of times and ages, and the error page. Every value is
//! spliced through `maud`, which escapes it.

use axum::extract::{FromRequestParts, OriginalUri, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat, Utc};
use maud::{DOCTYPE, Markup, html};
use outbox_persistence::EventRow;

use crate::Console;
use crate::security::Actor;

/// The path prefix the console is mounted under (empty at the root), from the request's
/// original URI: links and assets are written with it, so `Router::nest` needs nothing else.
#[derive(Debug, Clone)]
pub(crate) struct Base(pub(crate) String);

impl Base {
    fn from_paths(original: &str, inner: &str) -> Self {
        let prefix = if inner == "/" {
            original.strip_suffix('/').unwrap_or(original)
        } else {
            original.strip_suffix(inner).unwrap_or("")
        };
        Base(prefix.to_string())
    }

    /// The base of a request.
    pub(crate) fn of(request: &Request) -> Self {
        let inner = request.uri().path();
        match request.extensions().get::<OriginalUri>() {
            Some(OriginalUri(original)) => Self::from_paths(original.path(), inner),
            None => Base(String::new()),
        }
    }

    /// `path` (starting with `/`) under the prefix.
    pub(crate) fn link(&self, path: &str) -> String {
        format!("{}{path}", self.0)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Base {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let inner = parts.uri.path();
        Ok(match parts.extensions.get::<OriginalUri>() {
            Some(OriginalUri(original)) => Self::from_paths(original.path(), inner),
            None => Base(String::new()),
        })
    }
}

const NAV: &[(&str, &str)] = &[
    ("/", "Overview"),
    ("/failed", "Failed rows"),
    ("/records", "Record"),
    ("/consumers", "Consumers"),
    ("/webhooks", "Webhooks"),
    ("/retention", "Retention"),
    ("/audit", "Audit log"),
];

/// A page with the console's navigation, for `actor`: who it is and what it may do, its
/// logout when it signed in, and on a console without tokens that allows actions, a warning
/// that anyone on the host can act.
pub(crate) fn shell(
    console: &Console,
    actor: &Actor,
    base: &Base,
    title: &str,
    body: Markup,
) -> Markup {
    let config = console.config();
    let mode = match (
        config.allow_actions,
        crate::security::may_act(console, actor),
    ) {
        (false, _) => "read-only",
        (true, true) => "actions allowed",
        (true, false) => "read-only (viewer)",
    };
    let open = config.tokens.is_empty() && config.proxy_user_header.is_none();
    shell_bare(
        base,
        title,
        html! {
            nav {
                @for (path, name) in NAV {
                    a href=(base.link(path)) { (name) }
                }
                span.mode data-testid="mode" { (mode) }
                span.who data-testid="actor" { (actor.name) " (" (actor.role) ")" }
                @if actor.session {
                    form.inline method="post" action=(base.link("/logout")) {
                        (csrf_field(actor))
                        button type="submit" data-testid="logout" { "Sign out" }
                    }
                }
            }
            @if open && config.allow_actions {
                p.warning data-testid="open-console" {
                    "This console has no tokens and allows actions: anyone who can reach it on this host can retry, pause and resume. Configure tokens (--token-file) to say who may act."
                }
            }
            (body)
        },
    )
}

/// A page without navigation (the login form).
pub(crate) fn shell_bare(base: &Base, title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { "outbox console: " (title) }
                link rel="stylesheet" href=(base.link("/assets/console.css"));
                script src=(base.link("/assets/console.js")) defer {}
            }
            body {
                h1 { (title) }
                main { (body) }
            }
        }
    }
}

/// The CSRF field every action form carries (the actor's own token).
pub(crate) fn csrf_field(actor: &Actor) -> Markup {
    html! { input type="hidden" name="csrf" value=(actor.csrf); }
}

/// At most `chars` characters of `text`, for a table cell (the event page shows it whole).
pub(crate) fn clip(text: &str, chars: usize) -> String {
    match text.char_indices().nth(chars) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

/// How much of a `LastError` a table cell shows.
pub(crate) const ERROR_CHARS_SHOWN: usize = 300;

/// A time as the CLI prints it (RFC 3339, milliseconds, UTC).
pub(crate) fn ts(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// An age in seconds, readable.
pub(crate) fn age(seconds: f64) -> String {
    match seconds {
        s if s < 120.0 => format!("{s:.1} s"),
        s if s < 7200.0 => format!("{:.1} min", s / 60.0),
        s if s < 172_800.0 => format!("{:.1} h", s / 3600.0),
        s => format!("{:.1} days", s / 86_400.0),
    }
}

/// A table of rows (every column but the payload), each linked to its event page.
pub(crate) fn rows_table(base: &Base, rows: &[EventRow]) -> Markup {
    html! {
        table {
            thead { tr {
                th { "Id" } th { "Type" } th { "Status" } th { "Retries" }
                th { "Created" } th { "Modified" } th { "Last error" }
            } }
            tbody {
                @for r in rows {
                    tr {
                        td { a href=(base.link(&format!("/events/{}", r.id))) { (r.id) } }
                        td.type { (r.event_type) }
                        td { (r.status) }
                        td { (r.retry_count) }
                        td { (ts(r.created_date)) }
                        td { (ts(r.last_modified_date)) }
                        td.error { (clip(r.last_error.as_deref().unwrap_or(""), ERROR_CHARS_SHOWN)) }
                    }
                }
            }
        }
    }
}

/// A failure to read the database. The page shows a generic message and an id; the log line
/// carries the same id with the error (a database's own message can name tables, roles or
/// input, and must not reach a viewer).
pub(crate) struct PageError(pub(crate) String);

impl<E: std::fmt::Display> From<E> for PageError {
    fn from(e: E) -> Self {
        PageError(e.to_string())
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
        tracing::warn!(error_id = %id, error = %self.0, "a console page failed");
        let body = html! {
            (DOCTYPE)
            html { body {
                h1 { "The console could not read the queue" }
                p.error data-testid="error-id" { "Error id " code { (id) } ": the console's log has the details under this id." }
            } }
        };
        (StatusCode::INTERNAL_SERVER_ERROR, body).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_base_is_the_prefix_nest_stripped() {
        assert_eq!(Base::from_paths("/", "/").0, "");
        assert_eq!(Base::from_paths("/ops/console", "/").0, "/ops/console");
        assert_eq!(Base::from_paths("/ops/console/", "/").0, "/ops/console");
        assert_eq!(Base::from_paths("/ops/failed", "/failed").0, "/ops");
        assert_eq!(Base::from_paths("/failed", "/failed").0, "");
    }

    #[test]
    fn ages_read_well() {
        assert_eq!(age(3.21), "3.2 s");
        assert_eq!(age(600.0), "10.0 min");
        assert_eq!(age(3.0 * 86_400.0), "3.0 days");
    }
}
