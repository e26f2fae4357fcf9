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
