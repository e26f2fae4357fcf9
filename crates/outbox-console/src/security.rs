//! What keeps the console safe: the response headers every answer carries ([`HEADERS`]), the
//! token check (an `Authorization: Bearer` header or the login form's session cookie, secrets
//! compared in constant time), the CSRF token of the actions, and the embedded assets.

use axum::extract::{Form, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use serde::Deserialize;
use subtle::ConstantTimeEq;

use crate::Console;
use crate::layout::{Base, shell_bare};

/// The Content-Security-Policy of every response: no inline script or style, nothing from
/// another origin, no framing.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// The headers every response carries.
pub const HEADERS: &[(&str, &str)] = &[
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-frame-options", "DENY"),
    ("cache-control", "no-store"),
    ("x-content-type-options", "nosniff"),
    // Not `no-referrer`: under it a browser sends `Origin: null` with a form's POST, which the
    // same-origin check below cannot tell from a foreign page's. No referrer leaves the console
    // either way.
    ("referrer-policy", "same-origin"),
];

/// The most login sessions a console keeps (the oldest is dropped first).
pub const MAX_SESSIONS: usize = 256;

/// How long a login session lasts.
pub const SESSION_TTL: std::time::Duration = std::time::Duration::from_secs(12 * 3600);

/// The session cookie the login form sets.
pub const SESSION_COOKIE: &str = "outbox_console_session";

/// The actor recorded for actions on a console without tokens (loopback only).
pub const LOCAL_ACTOR: &str = "local";

/// Who made a request: the name of the token it authenticated with, or [`LOCAL_ACTOR`].
#[derive(Debug, Clone)]
pub struct Actor(pub String);

const CSS: &str = include_str!("assets/console.css");
const JS: &str = include_str!("assets/console.js");

/// A random secret: the hex of two UUID v4s (244 random bits).
pub(crate) fn random_secret() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Whether `a` equals `b`, in time that depends on their lengths only.
pub fn constant_time_eq(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// Adds [`HEADERS`] to every response.
pub(crate) async fn headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let map = response.headers_mut();
    for (name, value) in HEADERS {
        map.insert(*name, HeaderValue::from_static(value));
    }
    response
}

/// The token name a secret belongs to (every token is compared, whatever matches).
fn token_name(console: &Console, secret: &str) -> Option<String> {
    let mut found = None;
    for token in &console.config().tokens {
        if constant_time_eq(&token.secret, secret) && found.is_none() {
            found = Some(token.name.clone());
        }
    }
    found
}

/// The token name of a login session's cookie value.
fn session_name(console: &Console, session: &str) -> Option<String> {
    let sessions = console
        .inner
        .sessions
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let mut found = None;
    for (id, name, began) in sessions.iter() {
        if constant_time_eq(id, session) && found.is_none() && began.elapsed() < SESSION_TTL {
            found = Some(name.clone());
        }
    }
    found
}

/// The host name of a `Host` header value (without its port).
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    host.rsplit_once(':').map_or(host, |(name, _)| name)
}

/// Whether a console without tokens may answer `headers`: their `Host` names loopback (a
/// browser always sends it), so that a page of another site whose name was rebound to
/// 127.0.0.1 (DNS rebinding) cannot read or act through the user's browser.
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let name = host_name(host.trim());
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether a `POST` comes from the console's own pages: an `Origin` header, when the browser
/// sends one, names the request's own host (an opaque `null` origin passes only when the
/// browser says the request is same-origin: `Sec-Fetch-Site`).
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    if origin == "null" {
        let site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
        return site == Some("same-origin");
    }
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let origin_host = origin.split_once("://").map(|(_, rest)| rest);
    matches!((origin_host, host), (Some(o), Some(h)) if o.eq_ignore_ascii_case(h))
}

fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

/// Who `headers` authenticate as, or `None`.
fn actor_of(console: &Console, headers: &HeaderMap) -> Option<String> {
    if console.config().tokens.is_empty() {
        return Some(LOCAL_ACTOR.to_string());
    }
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if let Some(name) = bearer.and_then(|secret| token_name(console, secret.trim())) {
        return Some(name);
    }
    cookie(headers, SESSION_COOKIE).and_then(|s| session_name(console, &s))
}

/// Lets a request through with its [`Actor`] when it is authenticated (or needs not be: the
/// login form and the assets); answers 401 with the login form otherwise.
pub(crate) async fn authenticate(
    State(console): State<Console>,
    mut request: Request,
    next: Next,
) -> Response {
    if console.config().tokens.is_empty() && !loopback_host(request.headers()) {
        let msg = "refused: a console without a token answers requests for a loopback host name \
                   only (localhost, 127.0.0.1, [::1]); configure a token to serve other names";
        return (StatusCode::FORBIDDEN, msg).into_response();
    }
    if request.method() == axum::http::Method::POST && !same_origin(request.headers()) {
        let msg = "refused: the request's Origin is not this console";
        return (StatusCode::FORBIDDEN, msg).into_response();
    }
    let path = request.uri().path();
    let open = path == "/login" || path.starts_with("/assets/");
    match actor_of(&console, request.headers()) {
        Some(name) => {
            request.extensions_mut().insert(Actor(name));
            next.run(request).await
        }
        None if open => next.run(request).await,
        None => {
            let base = Base::of(&request);
            let status = StatusCode::UNAUTHORIZED;
            (status, login_form(&base, "this console needs a token")).into_response()
        }
    }
}

fn login_form(base: &Base, message: &str) -> maud::Markup {
    shell_bare(
        base,
        "Sign in",
        html! {
            p.notice data-testid="auth-required" { (message) }
            form method="post" action=(base.link("/login")) {
                label { "Token " input type="password" name="token" autocomplete="off"; }
                button type="submit" { "Sign in" }
            }
        },
    )
}

/// `GET /login`.
pub(crate) async fn login_page(base: Base) -> Response {
    login_form(&base, "sign in with a console token").into_response()
}

/// The login form's fields.
#[derive(Deserialize)]
pub(crate) struct LoginForm {
    token: String,
}

/// `POST /login`: a session cookie (HttpOnly, SameSite=Strict) for a valid token.
pub(crate) async fn login(
    State(console): State<Console>,
    base: Base,
    Form(form): Form<LoginForm>,
) -> Response {
    let Some(name) = token_name(&console, &form.token) else {
        let page = login_form(&base, "that token is not valid");
        return (StatusCode::UNAUTHORIZED, page).into_response();
    };
    let session = random_secret();
    {
        let mut sessions = console
            .inner
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        sessions.retain(|(_, _, began)| began.elapsed() < SESSION_TTL);
        if sessions.len() >= MAX_SESSIONS {
            sessions.remove(0);
        }
        sessions.push((session.clone(), name, std::time::Instant::now()));
    }
    let path = if base.0.is_empty() { "/" } else { &base.0 };
    let max_age = SESSION_TTL.as_secs();
    let cookie = format!(
        "{SESSION_COOKIE}={session}; HttpOnly; SameSite=Strict; Path={path}; Max-Age={max_age}"
    );
    let mut response = Redirect::to(&base.link("/")).into_response();
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// Refuses an action unless actions are allowed and `csrf` is this console's token: the
/// refusal to send, or `None`.
pub(crate) fn refuse_action(console: &Console, csrf: Option<&str>) -> Option<Response> {
    if !console.config().allow_actions {
        let msg = "refused: this console is read-only (start it with --allow-actions)";
        return Some((StatusCode::FORBIDDEN, msg).into_response());
    }
    let valid = csrf.is_some_and(|c| constant_time_eq(c, console.csrf()));
    if !valid {
        let msg =
            "refused: the form's CSRF token is missing or wrong; reload the page and try again";
        return Some((StatusCode::FORBIDDEN, msg).into_response());
    }
    None
}

/// `GET /assets/console.css`.
pub(crate) async fn css() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], CSS).into_response()
}

/// `GET /assets/console.js`.
pub(crate) async fn js() -> Response {
    let content_type = "text/javascript; charset=utf-8";
    ([(header::CONTENT_TYPE, content_type)], JS).into_response()
}

/// Any other path.
pub(crate) async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, "not found").into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_by_content() {
        assert!(constant_time_eq("abc", "abc"));
        assert!(!constant_time_eq("abc", "abd"));
        assert!(!constant_time_eq("abc", "abcd"));
        let (a, b) = (random_secret(), random_secret());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }

    #[test]
    fn cookies_are_found_by_name() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; outbox_console_session=xyz"),
        );
        assert_eq!(cookie(&h, SESSION_COOKIE).as_deref(), Some("xyz"));
        assert_eq!(cookie(&h, "b"), None);
    }
}
