//! What keeps the console safe: the response headers every answer carries ([`HEADERS`]), the
//! token check (an `Authorization: Bearer` header or the login form's session cookie, secrets
//! compared in constant time), the roles and CSRF tokens of the actions, the refusal of NUL
//! and oversized input before any query, and the embedded assets.

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::layout::Base;
use crate::login::{SESSION_COOKIE, cookie, login_form};
use crate::{Console, ConsoleConfig, ConsoleError, MIN_SECRET_LEN, Role};

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

/// The actor recorded for actions on a console without tokens (loopback only).
pub const LOCAL_ACTOR: &str = "local";

/// The longest secret a request may present (longer is no token, refused unhashed).
pub const MAX_SECRET_LEN: usize = 512;

/// The longest query or form value the console takes (a record key, an event type, an error
/// filter); a longer one is refused with 400 before any query.
pub const MAX_INPUT_LEN: usize = 1024;

/// Who made a request: the name of the token it authenticated with (or the proxy's user
/// header, or [`LOCAL_ACTOR`]), its role, and the CSRF token its forms carry.
#[derive(Debug, Clone)]
pub struct Actor {
    /// Who acted, as the audit log records it.
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// The CSRF token of its forms: its login session's, its bearer token's, or the
    /// console's (without tokens).
    pub(crate) csrf: String,
    /// Whether it came through a login session (its pages offer a logout).
    pub(crate) session: bool,
}

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

/// Whether `a` equals `b`, in time that tells nothing about either: their SHA-256 digests
/// (always 32 bytes) are compared in constant time, so neither a length mismatch nor a
/// common prefix answers sooner.
pub fn constant_time_eq(a: &str, b: &str) -> bool {
    let a: [u8; 32] = Sha256::digest(a.as_bytes()).into();
    let b: [u8; 32] = Sha256::digest(b.as_bytes()).into();
    bool::from(a[..].ct_eq(&b[..]))
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

/// The host name of a `Host` header value (without its port).
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    host.rsplit_once(':').map_or(host, |(name, _)| name)
}

/// The `host[:port]` of an origin (`https://ops.example.com` → `ops.example.com`).
fn origin_authority(origin: &str) -> Option<&str> {
    origin
        .split_once("://")
        .map(|(_, rest)| rest.trim_end_matches('/'))
}

/// Whether a console without tokens may answer `headers`: their `Host` names loopback (a
/// browser always sends it) or one of the console's public origins (a proxy in front of it
/// that keeps the Host), so that a page of another site whose name was rebound to 127.0.0.1
/// (DNS rebinding) cannot read or act through the user's browser.
fn allowed_host(console: &Console, headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let host = host.trim();
    let name = host_name(host);
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
        || public_host(console, host)
}

/// Whether `host` (a `Host` header's `host[:port]`) is one of the console's public origins.
fn public_host(console: &Console, host: &str) -> bool {
    console
        .config()
        .public_origins
        .iter()
        .filter_map(|o| origin_authority(o))
        .any(|authority| authority.eq_ignore_ascii_case(host))
}

/// Whether a `POST` comes from the console's own pages: an `Origin` header, when the browser
/// sends one, names the request's own host or one of the console's public origins (the
/// address a proxy in front of it serves it under; an opaque `null` origin passes only when
/// the browser says the request is same-origin: `Sec-Fetch-Site`).
fn same_origin(console: &Console, headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    if origin == "null" {
        let site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
        return site == Some("same-origin");
    }
    let public = &console.config().public_origins;
    if public
        .iter()
        .any(|o| o.trim_end_matches('/').eq_ignore_ascii_case(origin))
    {
        return true;
    }
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    matches!((origin_authority(origin), host), (Some(o), Some(h)) if o.eq_ignore_ascii_case(h))
}

/// Who `headers` authenticate as, or `None`; `touch`: the request is the operator's own (a
/// login session's idle time starts over).
fn actor_of(console: &Console, headers: &HeaderMap, touch: bool) -> Option<Actor> {
    let config = console.config();
    if let Some(user_header) = &config.proxy_user_header {
        // Authenticated at the proxy, which names the user (the console listens on loopback
        // behind it): an operator when actions are allowed. Exactly one value: a proxy that
        // appends its header to the client's would otherwise leave the client's first.
        let mut values = headers.get_all(user_header.as_str()).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            return None;
        };
        let name = value.to_str().ok()?.trim();
        return (!name.is_empty() && name.len() <= 200).then(|| Actor {
            name: name.to_string(),
            role: Role::Operator,
            csrf: console.csrf().to_string(),
            session: false,
        });
    }
    if config.tokens.is_empty() {
        return Some(Actor {
            name: LOCAL_ACTOR.to_string(),
            role: Role::Operator,
            csrf: console.csrf().to_string(),
            session: false,
        });
    }
    // A secret longer than any token's is no token (and is not hashed against every one).
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|secret| secret.len() <= MAX_SECRET_LEN);
    if let Some(at) = bearer.and_then(|secret| console.token_index(secret.trim())) {
        let token = &config.tokens[at];
        return Some(Actor {
            name: token.name.clone(),
            role: token.role,
            csrf: console.token_csrf(at).to_string(),
            session: false,
        });
    }
    let (name, role, csrf) = console
        .inner
        .logins
        .session(&cookie(headers, SESSION_COOKIE)?, touch)?;
    Some(Actor {
        name,
        role,
        csrf,
        session: true,
    })
}

/// Lets a request through with its [`Actor`] when it is authenticated (or needs not be: the
/// login form and the assets); answers 401 with the login form otherwise.
pub(crate) async fn authenticate(
    State(console): State<Console>,
    mut request: Request,
    next: Next,
) -> Response {
    let open_console = console.config().tokens.is_empty();
    if open_console && !allowed_host(&console, request.headers()) {
        let msg = "refused: a console without a token answers requests for a loopback host name \
                   only (localhost, 127.0.0.1, [::1]) or its public origins (--public-origin); \
                   configure a token to serve other names";
        return (StatusCode::FORBIDDEN, msg).into_response();
    }
    if request.method() == axum::http::Method::POST && !same_origin(&console, request.headers()) {
        let msg = "refused: the request's Origin is not this console";
        return (StatusCode::FORBIDDEN, msg).into_response();
    }
    if let Some(refusal) = refuse_bad_query(request.uri().query()) {
        return refusal;
    }
    let path = request.uri().path();
    let open = path == "/login" || path.starts_with("/assets/");
    // The overview's refresh polls every 2 s: it keeps no session from idling out.
    let touch = !path.starts_with("/fragments/");
    match actor_of(&console, request.headers(), touch) {
        Some(actor) => {
            request.extensions_mut().insert(actor);
            let response = next.run(request).await;
            if console.reads_standby() && response.status() == StatusCode::INTERNAL_SERVER_ERROR {
                return with_standby_hint(response).await;
            }
            response
        }
        None if open => next.run(request).await,
        None => {
            let base = Base::of(&request);
            let status = StatusCode::UNAUTHORIZED;
            let message = if console.config().proxy_user_header.is_some() {
                "this console is served through a proxy that names its user; none was named"
            } else {
                "this console needs a token"
            };
            login_form(&base, request.headers(), status, message)
        }
    }
}

/// A failed page of a console that reads from a standby, saying so (the page's error id and
/// the rest of it kept).
async fn with_standby_hint(response: Response) -> Response {
    let (parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 16).await else {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the console could not read the queue",
        )
            .into_response();
    };
    let hint = "<p data-testid=\"standby-hint\">This console reads from a standby \
                (--read-database-url): the standby may be down or unreachable. Actions still go \
                to the primary.</p>";
    let page = String::from_utf8_lossy(&bytes).replacen("</h1>", &format!("</h1>{hint}"), 1);
    Response::from_parts(parts, axum::body::Body::from(page))
}

/// A 400 for a query string holding a value the console never takes: a NUL or another
/// control character, or one longer than [`MAX_INPUT_LEN`] (refused before any query, so
/// the database never sees it and the log gets no line per request).
fn refuse_bad_query(query: Option<&str>) -> Option<Response> {
    let query = query?;
    if query.len() > 8 * MAX_INPUT_LEN {
        return Some(bad_input("the query string is too long"));
    }
    form_urlencoded::parse(query.as_bytes()).find_map(|(_, value)| refuse_bad_value(&value))
}

/// A 400 for a query or form value the console never takes, or `None`.
pub(crate) fn refuse_bad_value(value: &str) -> Option<Response> {
    if value.len() > MAX_INPUT_LEN {
        return Some(bad_input(&format!(
            "a value is longer than {MAX_INPUT_LEN} bytes"
        )));
    }
    if value.chars().any(|c| c.is_control() && c != '\t') {
        return Some(bad_input(
            "a value holds a NUL or another control character",
        ));
    }
    None
}

fn bad_input(why: &str) -> Response {
    (StatusCode::BAD_REQUEST, format!("refused: {why}")).into_response()
}

/// Refuses an action unless actions are allowed, `actor` is an operator and `csrf` is its
/// forms' token: the refusal to send, or `None`.
pub(crate) fn refuse_action(
    console: &Console,
    actor: &Actor,
    csrf: Option<&str>,
) -> Option<Response> {
    if !console.config().allow_actions {
        let msg = "refused: this console is read-only (start it with --allow-actions)";
        return Some((StatusCode::FORBIDDEN, msg).into_response());
    }
    if actor.role != Role::Operator {
        let msg = format!(
            "refused: {} is a viewer; actions need an operator token (NAME:SECRET:operator)",
            actor.name
        );
        return Some((StatusCode::FORBIDDEN, msg).into_response());
    }
    let valid = csrf.is_some_and(|c| constant_time_eq(c, &actor.csrf));
    if !valid {
        let msg =
            "refused: the form's CSRF token is missing or wrong; reload the page and try again";
        return Some((StatusCode::FORBIDDEN, msg).into_response());
    }
    None
}

/// Whether `actor` may act on this console (its pages then show the action forms).
pub(crate) fn may_act(console: &Console, actor: &Actor) -> bool {
    console.config().allow_actions && actor.role == Role::Operator
}

/// Why `secret` is too weak for a console token, or `None`: shorter than [`MIN_SECRET_LEN`]
/// characters, or fewer than 6 distinct characters (`aaaaaaaaaaaaaaaa`, `abababab…`).
pub(crate) fn weak_secret(secret: &str) -> Option<&'static str> {
    if secret.chars().count() < MIN_SECRET_LEN {
        return Some("its secret is shorter than 16 characters");
    }
    let distinct: std::collections::HashSet<char> = secret.chars().collect();
    (distinct.len() < 6).then_some("its secret repeats fewer than 6 distinct characters")
}

/// Refuses tokens an attacker could guess or that would be ambiguous: an empty name, a secret
/// shorter than [`MIN_SECRET_LEN`] (an empty one from an unset variable would match an empty
/// form field), two tokens with one secret; and a proxy's user header beside tokens.
pub(crate) fn check_config(config: &ConsoleConfig) -> Result<(), ConsoleError> {
    for (i, token) in config.tokens.iter().enumerate() {
        let weak = |why| ConsoleError::WeakToken {
            name: token.name.clone(),
            why,
        };
        if token.name.trim().is_empty() {
            return Err(weak("its name is empty"));
        }
        if let Some(why) = weak_secret(&token.secret) {
            return Err(weak(why));
        }
        if token.secret.len() > MAX_SECRET_LEN {
            return Err(weak("its secret is longer than 512 bytes"));
        }
        if config.tokens[..i].iter().any(|t| t.secret == token.secret) {
            return Err(weak("its secret is another token's"));
        }
        // The audit and the sessions tell tokens apart by name.
        if config.tokens[..i].iter().any(|t| t.name == token.name) {
            return Err(weak("its name is another token's"));
        }
    }
    for origin in &config.public_origins {
        let authority = origin
            .strip_prefix("https://")
            .or_else(|| origin.strip_prefix("http://"));
        let valid = authority.is_some_and(|a| {
            let a = a.trim_end_matches('/');
            !a.is_empty() && !a.contains(['/', '?', '#', '@', ' '])
        });
        if !valid {
            return Err(ConsoleError::Config(
                "a public origin is scheme://host[:port] (for example https://ops.example.com), without a path",
            ));
        }
    }
    let open = config.tokens.is_empty() && config.proxy_user_header.is_none();
    if open && config.allow_actions && !config.public_origins.is_empty() {
        tracing::warn!(
            "the console has public origins but neither tokens nor a proxy's user header: whoever reaches it through the proxy can act; authenticate at the proxy and name the user (proxy_user_header), or configure tokens"
        );
    }
    if config.proxy_user_header.is_some() && !config.tokens.is_empty() {
        return Err(ConsoleError::Config(
            "a proxy's user header and tokens exclude each other: authenticate at the proxy or with tokens",
        ));
    }
    Ok(())
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
        assert!(!constant_time_eq("", "abc"));
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

    #[test]
    fn nul_control_and_long_values_are_refused() {
        assert!(refuse_bad_query(Some("key=lead%3A1&type=x")).is_none());
        assert!(refuse_bad_query(Some("key=%00")).is_some());
        assert!(refuse_bad_query(Some("key=a%0Ab")).is_some());
        let long = format!("key={}", "a".repeat(MAX_INPUT_LEN + 1));
        assert!(refuse_bad_query(Some(&long)).is_some());
        assert!(refuse_bad_value("lead:00Q5e00000AbCdE").is_none());
    }
}
