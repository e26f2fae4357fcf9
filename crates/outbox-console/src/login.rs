//! Login sessions and the limits on logging in: the login form sets a session cookie for a
//! valid token; sessions end at logout, after [`SESSION_IDLE`] without a request of the
//! operator's own (the overview's refresh does not count) or after [`SESSION_TTL`], and a token
//! name holds at most [`MAX_SESSIONS_PER_TOKEN`] (its oldest is dropped first: logging in
//! again and again with one token never logs out another token's sessions). Failed logins
//! are logged at warn with the client's address and backed off per address, and across all
//! addresses for those that failed before.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::Extension;
use axum::extract::{ConnectInfo, Form, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use serde::Deserialize;

use crate::layout::{Base, shell_bare};
use crate::security::{Actor, constant_time_eq, random_secret};
use crate::{Console, Role};

/// How long a login session lasts at most.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);

/// How long a login session lasts without a request.
pub const SESSION_IDLE: Duration = Duration::from_secs(30 * 60);

/// The most sessions one token name holds (its oldest is dropped first).
pub const MAX_SESSIONS_PER_TOKEN: usize = 8;

/// The session cookie the login form sets.
pub const SESSION_COOKIE: &str = "outbox_console_session";

/// Failed logins an address may make before each further one waits.
pub const FREE_FAILURES: u32 = 5;

/// The longest an address waits after failed logins.
pub const MAX_BACKOFF: Duration = Duration::from_secs(15 * 60);

/// Failed logins per minute, from all addresses together, past which every address that
/// failed in the last quarter of an hour waits for the minute to pass (a guess spread over
/// many addresses). An address without a recent failure is still heard, as are tokens in an
/// `Authorization` header and open sessions: a flood of wrong logins never locks out a user
/// who has not mistyped.
pub const GLOBAL_FAILURES_PER_MINUTE: usize = 60;

/// The most addresses whose failures are remembered (beyond it, those whose wait is over are
/// forgotten first; an address without room counts against the global limit only).
const MAX_ADDRESSES: usize = 10_000;

/// One login session.
pub(crate) struct Session {
    id: String,
    pub(crate) name: String,
    pub(crate) role: Role,
    /// The CSRF token of this session's forms.
    pub(crate) csrf: String,
    began: Instant,
    seen: Instant,
}

/// The login sessions and the failed-login limits of a console.
#[derive(Default)]
pub(crate) struct Logins {
    sessions: Mutex<Vec<Session>>,
    failures: Mutex<Failures>,
}

#[derive(Default)]
struct Failures {
    by_address: HashMap<IpAddr, (u32, Instant)>,
    recent: std::collections::VecDeque<Instant>,
    /// When the global limit was last logged (once a minute at most).
    logged_global: Option<Instant>,
}

impl Failures {
    /// How long `address` must still wait before its next login is heard, if at all.
    fn wait(&mut self, address: Option<IpAddr>, now: Instant) -> Option<Duration> {
        while self
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) >= Duration::from_secs(60))
        {
            self.recent.pop_front();
        }
        // Failures a quarter of an hour old are forgotten.
        let (count, last) = address
            .and_then(|a| self.by_address.get(&a).copied())
            .filter(|(_, last)| now.duration_since(*last) <= MAX_BACKOFF)
            .unwrap_or((0, now));
        let failed_before = address.is_none() || count > 0;
        if failed_before && self.recent.len() >= GLOBAL_FAILURES_PER_MINUTE {
            if self
                .logged_global
                .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60))
            {
                self.logged_global = Some(now);
                tracing::warn!(
                    failures = self.recent.len(),
                    "console logins: more than {GLOBAL_FAILURES_PER_MINUTE} failed in the last minute; addresses that failed before wait"
                );
            }
            let oldest = *self.recent.front().expect("not empty");
            return Some(Duration::from_secs(60).saturating_sub(now.duration_since(oldest)));
        }
        let until = last + backoff(count);
        (until > now).then(|| until - now)
    }

    fn failed(&mut self, address: Option<IpAddr>, now: Instant) -> u32 {
        self.recent.push_back(now);
        let Some(address) = address else { return 0 };
        if self.by_address.len() >= MAX_ADDRESSES && !self.by_address.contains_key(&address) {
            self.by_address
                .retain(|_, (count, last)| *last + backoff(*count) > now);
            if self.by_address.len() >= MAX_ADDRESSES {
                return 0;
            }
        }
        let entry = self.by_address.entry(address).or_insert((0, now));
        // Failures a quarter of an hour apart start over.
        if now.duration_since(entry.1) > MAX_BACKOFF {
            entry.0 = 0;
        }
        *entry = (entry.0 + 1, now);
        entry.0
    }
}

/// The wait after `count` failed logins: none for the first [`FREE_FAILURES`], then doubling
/// from 1 s up to [`MAX_BACKOFF`].
fn backoff(count: u32) -> Duration {
    match count.checked_sub(FREE_FAILURES) {
        None => Duration::ZERO,
        Some(over) => Duration::from_secs(1u64 << over.min(20)).min(MAX_BACKOFF),
    }
}

impl Logins {
    /// The session whose cookie value is `id`, if it is open; `touch`: the request is the
    /// operator's own (not the overview's refresh), which keeps the session from idling out.
    pub(crate) fn session(&self, id: &str, touch: bool) -> Option<(String, Role, String)> {
        // A session id is 64 characters (`random_secret`): anything else is no session, and is
        // not hashed against every open session.
        if id.len() != 64 {
            return None;
        }
        let now = Instant::now();
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.retain(|s| open(s, now));
        let mut found = None;
        // Every session is compared, whichever matches.
        for session in sessions.iter_mut() {
            if constant_time_eq(&session.id, id) && found.is_none() {
                if touch {
                    session.seen = now;
                }
                found = Some((session.name.clone(), session.role, session.csrf.clone()));
            }
        }
        found
    }

    /// Opens a session for the token `name` with `role`; returns its cookie value.
    fn open(&self, name: &str, role: Role) -> String {
        let now = Instant::now();
        let id = random_secret();
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.retain(|s| open(s, now));
        let mine = sessions.iter().filter(|s| s.name == name).count();
        if mine >= MAX_SESSIONS_PER_TOKEN
            && let Some(oldest) = sessions.iter().position(|s| s.name == name)
        {
            sessions.remove(oldest);
        }
        sessions.push(Session {
            id: id.clone(),
            name: name.to_string(),
            role,
            csrf: random_secret(),
            began: now,
            seen: now,
        });
        id
    }

    /// Ends the session `id`; whether it was open.
    fn close(&self, id: &str) -> bool {
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        let before = sessions.len();
        sessions.retain(|s| !constant_time_eq(&s.id, id));
        sessions.len() < before
    }

    /// How many sessions are open (for the tests).
    #[cfg(test)]
    fn count(&self) -> usize {
        self.sessions.lock().unwrap().len()
    }
}

fn open(session: &Session, now: Instant) -> bool {
    now.duration_since(session.began) < SESSION_TTL
        && now.duration_since(session.seen) < SESSION_IDLE
}

/// The value of the cookie `name` in `headers`.
pub(crate) fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

/// The cookie that carries the login form's CSRF token (double submit: the form's hidden
/// field must equal it, and another site can neither read nor set it).
pub const LOGIN_COOKIE: &str = "outbox_console_login";

/// The login form with `message`, answered `status` to a request with `headers`: its CSRF token
/// in the hidden field and in the [`LOGIN_COOKIE`] it sets (HttpOnly, SameSite=Strict, an
/// hour). The token the browser holds already is kept: a login page loads other requests
/// (a favicon) that answer with the form too, and a new token for each would make the form's
/// own stale.
pub(crate) fn login_form(
    base: &Base,
    headers: &HeaderMap,
    status: StatusCode,
    message: &str,
) -> Response {
    let csrf = cookie(headers, LOGIN_COOKIE)
        .filter(|c| c.len() == 64 && c.chars().all(|ch| ch.is_ascii_hexdigit()))
        .unwrap_or_else(random_secret);
    let page = shell_bare(
        base,
        "Sign in",
        html! {
            p.notice data-testid="auth-required" { (message) }
            form method="post" action=(base.link("/login")) {
                input type="hidden" name="csrf" value=(csrf);
                label { "Token " input type="password" name="token" autocomplete="off"; }
                button type="submit" { "Sign in" }
            }
        },
    );
    let path = if base.0.is_empty() { "/" } else { &base.0 };
    let cookie =
        format!("{LOGIN_COOKIE}={csrf}; HttpOnly; SameSite=Strict; Path={path}; Max-Age=3600");
    let mut response = (status, page).into_response();
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().append(header::SET_COOKIE, value);
    }
    response
}

/// `GET /login`.
pub(crate) async fn login_page(base: Base, headers: HeaderMap) -> Response {
    login_form(
        &base,
        &headers,
        StatusCode::OK,
        "sign in with a console token",
    )
}

/// The login form's fields.
#[derive(Deserialize)]
pub(crate) struct LoginForm {
    token: String,
    #[serde(default)]
    csrf: String,
}

/// The client's address, when the server gave it (`serve` does; an embedding service's
/// server does with axum's `into_make_service_with_connect_info`).
fn client(request_peer: Option<&ConnectInfo<SocketAddr>>) -> Option<IpAddr> {
    request_peer.map(|ConnectInfo(peer)| peer.ip())
}

/// `POST /login`: a session cookie (HttpOnly, SameSite=Strict) for a valid token; a failure
/// is logged and counted against the client's address.
pub(crate) async fn login(
    State(console): State<Console>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    base: Base,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    // The form's CSRF token against its cookie: a page of another site cannot log the browser
    // in with a token of its choosing (login CSRF). Not counted as a failed login.
    let expected = cookie(&headers, LOGIN_COOKIE).unwrap_or_default();
    if expected.len() != 64 || !constant_time_eq(&form.csrf, &expected) {
        let message = "the login form expired or came from elsewhere; sign in again";
        return login_form(&base, &headers, StatusCode::FORBIDDEN, message);
    }
    let address = client(peer.as_ref().map(|Extension(p)| p));
    let shown = address.map_or_else(|| "unknown".to_string(), |a| a.to_string());
    let logins = &console.inner.logins;
    let wait = logins
        .failures
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .wait(address, Instant::now());
    if let Some(wait) = wait {
        tracing::debug!(client = %shown, wait_s = wait.as_secs(), "console login refused: too many failed logins");
        let message = format!(
            "too many failed logins; try again in {} s",
            wait.as_secs().max(1)
        );
        let mut response = login_form(&base, &headers, StatusCode::TOO_MANY_REQUESTS, &message);
        if let Ok(value) = HeaderValue::from_str(&wait.as_secs().max(1).to_string()) {
            response.headers_mut().insert(header::RETRY_AFTER, value);
        }
        return response;
    }
    let Some((name, role)) = console.token_of(&form.token) else {
        let count = logins
            .failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .failed(address, Instant::now());
        // Every failure up to the tenth, then every hundredth: a flood fills no log.
        if count <= 10 || count % 100 == 0 {
            tracing::warn!(client = %shown, failures = count, "console login failed: not a valid token");
        }
        return login_form(
            &base,
            &headers,
            StatusCode::UNAUTHORIZED,
            "that token is not valid",
        );
    };
    // A success clears its address' failures, except on loopback: behind a proxy every
    // client shares it, and one user's login must not clear another's guesses.
    if let Some(address) = address.filter(|a| !a.is_loopback()) {
        let mut failures = logins.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.by_address.remove(&address);
    }
    let session = logins.open(&name, role);
    tracing::info!(client = %shown, token = %name, %role, "console login");
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

/// The logout form's fields.
#[derive(Deserialize)]
pub(crate) struct LogoutForm {
    #[serde(default)]
    csrf: String,
}

/// `POST /logout`: ends the request's session (with its CSRF token) and clears the cookie.
pub(crate) async fn logout(
    State(console): State<Console>,
    Extension(actor): Extension<Actor>,
    base: Base,
    headers: HeaderMap,
    Form(form): Form<LogoutForm>,
) -> Response {
    if !constant_time_eq(&form.csrf, &actor.csrf) {
        let msg =
            "refused: the form's CSRF token is missing or wrong; reload the page and try again";
        return (StatusCode::FORBIDDEN, msg).into_response();
    }
    if let Some(session) = cookie(&headers, SESSION_COOKIE)
        && console.inner.logins.close(&session)
    {
        tracing::info!(token = %actor.name, "console logout");
    }
    let path = if base.0.is_empty() { "/" } else { &base.0 };
    let cookie = format!("{SESSION_COOKIE}=; HttpOnly; SameSite=Strict; Path={path}; Max-Age=0");
    let mut response = Redirect::to(&base.link("/login")).into_response();
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_name_holds_a_bounded_number_of_sessions() {
        let logins = Logins::default();
        let first = logins.open("ops", Role::Operator);
        let other = logins.open("viewer", Role::Viewer);
        for _ in 0..MAX_SESSIONS_PER_TOKEN {
            logins.open("ops", Role::Operator);
        }
        let dropped = logins.session(&first, true);
        assert!(dropped.is_none(), "ops' oldest session was dropped");
        assert!(
            logins.session(&other, true).is_some(),
            "another name's stays"
        );
        assert_eq!(logins.count(), MAX_SESSIONS_PER_TOKEN + 1);
        assert!(logins.close(&other));
        assert!(logins.session(&other, true).is_none());
        assert!(logins.session("short", true).is_none());
    }

    #[test]
    fn failed_logins_back_off_per_address_and_together() {
        let mut f = Failures::default();
        let now = Instant::now();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        for _ in 0..FREE_FAILURES {
            assert_eq!(f.wait(Some(a), now), None);
            f.failed(Some(a), now);
        }
        let one = Some(Duration::from_secs(1));
        assert_eq!(f.wait(Some(a), now), one, "five are free");
        f.failed(Some(a), now);
        assert_eq!(f.wait(Some(a), now), Some(Duration::from_secs(2)));
        assert_eq!(f.wait(Some(b), now), None, "another address does not wait");
        f.failed(Some(b), now);
        for _ in 0..GLOBAL_FAILURES_PER_MINUTE {
            f.failed(None, now);
        }
        let c: IpAddr = "10.0.0.3".parse().unwrap();
        let waits = f.wait(Some(b), now);
        assert!(
            waits.is_some(),
            "past the global limit, those that failed wait"
        );
        assert_eq!(f.wait(Some(c), now), None, "one that never failed is heard");
        let later = now + Duration::from_secs(61);
        assert_eq!(f.wait(Some(b), later), None);
        assert_eq!(backoff(FREE_FAILURES + 30), MAX_BACKOFF);
    }
}
