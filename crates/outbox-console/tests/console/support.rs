//! What the console's tests share: a console over a test database, requests through
//! `oneshot`, the CSRF token read from a page, and hostile rows.

use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use outbox_console::{Console, ConsoleConfig, NamedToken};
use outbox_tests::{RawRow, TestDb};
use tower::ServiceExt;

/// An event type that would run script if spliced unescaped.
pub const HOSTILE_TYPE: &str = "<script>window.__pwned=1</script>";
/// An error text that would run script if spliced unescaped into an attribute or element.
pub const HOSTILE_ERROR: &str = "\"><img src=x onerror=\"window.__pwned=2\">";

/// The operator token's secret of [`guarded`].
pub const SECRET: &str = "s3cret-operator-0123";

/// The viewer token's secret of [`guarded`].
pub const VIEWER_SECRET: &str = "s3cret-viewer-4567";

/// A console with actions allowed and two tokens: `ops` ([`SECRET`], an operator) and `ro`
/// ([`VIEWER_SECRET`], a viewer).
pub fn guarded() -> ConsoleConfig {
    ConsoleConfig {
        allow_actions: true,
        tokens: vec![
            NamedToken::operator("ops", SECRET),
            NamedToken::new("ro", VIEWER_SECRET),
        ],
        ..ConsoleConfig::default()
    }
}

/// A console over `db` with `config`.
pub fn console(db: &TestDb, config: ConsoleConfig) -> Console {
    Console::new(db.db.clone(), Vec::new(), config).expect("a valid console configuration")
}

/// A response with its body read.
pub struct Answer {
    pub status: StatusCode,
    pub headers: axum::http::HeaderMap,
    pub body: String,
}

async fn read(response: Response<Body>) -> Answer {
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("a body")
        .to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// Sends `request` to a fresh router of `console`.
pub async fn send(console: &Console, request: Request<Body>) -> Answer {
    let response = outbox_console::router(console.clone())
        .oneshot(request)
        .await
        .expect("the router answers");
    read(response).await
}

/// `GET path`, with the bearer token `token` when given.
pub async fn get(console: &Console, path: &str, token: Option<&str>) -> Answer {
    let mut request = Request::get(path);
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    send(console, request.body(Body::empty()).unwrap()).await
}

/// `POST path` with a form `body`, with the bearer token `token` when given.
pub async fn post(console: &Console, path: &str, token: Option<&str>, body: &str) -> Answer {
    let mut request =
        Request::post(path).header("content-type", "application/x-www-form-urlencoded");
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    send(console, request.body(Body::from(body.to_string())).unwrap()).await
}

/// A login form's CSRF token and the cookie that carries it (`name=value`), from `GET /login`.
pub async fn login_csrf(console: &Console) -> (String, String) {
    let page = get(console, "/login", None).await;
    let cookie = page
        .headers
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with("outbox_console_login="))
        .expect("the login form's cookie")
        .split(';')
        .next()
        .unwrap()
        .to_string();
    (cookie, csrf_of(&page.body))
}

/// `POST /login` with `body` (`token=…`), as a browser sends it from the login form: with the
/// form's CSRF token and its cookie.
pub async fn login_post(console: &Console, body: &str) -> Answer {
    let (cookie, csrf) = login_csrf(console).await;
    let request = Request::post("/login")
        .header("content-type", "application/x-www-form-urlencoded")
        .header("cookie", cookie)
        .body(Body::from(format!("{body}&csrf={csrf}")))
        .unwrap();
    send(console, request).await
}

/// The CSRF token of a page's forms.
pub fn csrf_of(html: &str) -> String {
    let marker = "name=\"csrf\" value=\"";
    let start = html.find(marker).expect("a form with a CSRF field") + marker.len();
    let end = start + html[start..].find('"').expect("the value's end");
    html[start..end].to_string()
}

/// Writes a `failed` row of `event_type` with `error` as its `LastError`; returns its id.
pub async fn failed_row(
    db: &TestDb,
    event_type: &str,
    error: &str,
    key: Option<&str>,
) -> uuid::Uuid {
    let mut row = RawRow::pending(key, chrono::Utc::now() - chrono::Duration::minutes(5));
    row.event_type = event_type.to_string();
    row.status = "failed";
    row.retry_count = 5;
    db.insert_raw(&row).await;
    let error = error.replace('\'', "''");
    let id = match db.backend() {
        outbox_tests::Backend::Postgres => format!("'{}'", row.id),
        outbox_tests::Backend::Sqlite => format!("'{}'", row.id),
    };
    db.execute(&format!(
        "UPDATE _System_OutboxEvent SET LastError = '{error}' WHERE Id = {id}"
    ))
    .await;
    row.id
}
