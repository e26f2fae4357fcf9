//! The actions (`POST` only, when actions are allowed, with the console's CSRF token): retry
//! failed rows (one, the selected ones, or every failed row of a type), pause and resume an
//! event type. Each is made by the repository together with its audit row, naming the actor:
//! the token's name, or `local` on a console without tokens.

use axum::Extension;
use axum::extract::{Form, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::html;
use outbox_persistence::{EventId, RetryFilter};

use crate::Console;
use crate::layout::{Base, PageError, shell};
use crate::security::{Actor, refuse_action, refuse_bad_value};

/// A form's fields, in order (checkboxes repeat `id`).
type Fields = Vec<(String, String)>;

fn field<'a>(fields: &'a Fields, name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.trim())
        .filter(|v| !v.is_empty())
}

fn done(console: &Console, actor: &Actor, base: &Base, message: String, back: &str) -> Response {
    let body = html! {
        p.ok data-testid="action-result" { (message) }
        p { a href=(base.link(back)) data-testid="back" { "Back" } }
    };
    shell(console, actor, base, "Done", body).into_response()
}

/// Refuses the action (see [`refuse_action`]), or a form holding a value the console never
/// takes (a NUL, a control character, an oversized value), before any query.
fn refuse(console: &Console, actor: &Actor, fields: &Fields) -> Option<Response> {
    refuse_action(console, actor, field(fields, "csrf"))
        .or_else(|| fields.iter().find_map(|(_, v)| refuse_bad_value(v)))
}

fn bad_request(message: &str) -> Response {
    (StatusCode::BAD_REQUEST, message.to_string()).into_response()
}

/// Which rows a retry form names: `one` (a row's own button), else the checked `id`s, else
/// every failed row of `event_type`.
fn retry_filter(fields: &Fields) -> Result<RetryFilter, &'static str> {
    let parse = |s: &str| EventId::parse_str(s).map_err(|_| "not an event id");
    if let Some(one) = field(fields, "one") {
        return Ok(RetryFilter::Ids(vec![parse(one)?]));
    }
    let ids = fields
        .iter()
        .filter(|(k, v)| k == "id" && !v.trim().is_empty())
        .map(|(_, v)| parse(v.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    if !ids.is_empty() {
        return Ok(RetryFilter::Ids(ids));
    }
    match field(fields, "event_type") {
        Some(t) => Ok(RetryFilter::Failed {
            event_type: Some(t.to_string()),
        }),
        None => Err("nothing to retry: select rows or an event type"),
    }
}

/// `POST /actions/retry`.
pub(crate) async fn retry(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
    Form(fields): Form<Fields>,
) -> Result<Response, PageError> {
    if let Some(refusal) = refuse(&console, &actor, &fields) {
        return Ok(refusal);
    }
    let filter = match retry_filter(&fields) {
        Ok(filter) => filter,
        Err(why) => return Ok(bad_request(why)),
    };
    let n = console
        .writer()
        .retry_failed_by(filter, &actor.name)
        .await?;
    console.overview_cache().invalidate();
    tracing::info!(actor = %actor.name, rows = n, "console: retried failed rows");
    let message = format!("Retried {n} failed row(s): they are pending again.");
    Ok(done(&console, &actor, &base, message, "/failed"))
}

/// `POST /actions/pause`.
pub(crate) async fn pause(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
    Form(fields): Form<Fields>,
) -> Result<Response, PageError> {
    set_paused(console, actor, base, fields, true).await
}

/// `POST /actions/resume`.
pub(crate) async fn resume(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
    Form(fields): Form<Fields>,
) -> Result<Response, PageError> {
    set_paused(console, actor, base, fields, false).await
}

/// Pauses (`pause`) or resumes the form's event type, audited under `actor`.
async fn set_paused(
    console: Console,
    actor: Actor,
    base: Base,
    fields: Fields,
    pause: bool,
) -> Result<Response, PageError> {
    if let Some(refusal) = refuse(&console, &actor, &fields) {
        return Ok(refusal);
    }
    let verb = if pause { "pause" } else { "resume" };
    let Some(event_type) = field(&fields, "event_type") else {
        return Ok(bad_request(&format!("name the event type to {verb}")));
    };
    let repo = console.writer();
    let changed = if pause {
        repo.pause_event_type(event_type, &actor.name).await?
    } else {
        repo.resume_event_type(event_type, &actor.name).await?
    };
    console.overview_cache().invalidate();
    tracing::info!(actor = %actor.name, event_type, changed, "console: {verb}d an event type");
    let message = match (pause, changed) {
        (true, true) => format!(
            "Paused {event_type}: workers stop claiming it within {} s.",
            outbox_events::PAUSE_REFRESH.as_secs_f64()
        ),
        (true, false) => format!("{event_type} was paused already."),
        (false, true) => format!("Resumed {event_type}: its rows are claimable again."),
        (false, false) => format!("{event_type} was not paused."),
    };
    Ok(done(&console, &actor, &base, message, "/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(pairs: &[(&str, &str)]) -> Fields {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_retry_form_names_its_rows() {
        let a = uuid::Uuid::now_v7();
        let b = uuid::Uuid::now_v7();
        let (sa, sb) = (a.to_string(), b.to_string());
        let both = f(&[("id", &sa), ("id", &sb)]);
        assert_eq!(retry_filter(&both), Ok(RetryFilter::Ids(vec![a, b])));
        let one = f(&[("id", &sa), ("one", &sb)]);
        assert_eq!(retry_filter(&one), Ok(RetryFilter::Ids(vec![b])));
        let typed = f(&[("event_type", "t")]);
        assert_eq!(
            retry_filter(&typed),
            Ok(RetryFilter::Failed {
                event_type: Some("t".into())
            })
        );
        assert!(retry_filter(&f(&[])).is_err());
        assert!(retry_filter(&f(&[("id", "x")])).is_err());
    }
}
