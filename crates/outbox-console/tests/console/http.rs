//! The console over HTTP (`oneshot`), on both backends: the security headers on every page,
//! hostile rows escaped, actions refused without a token, without the CSRF token and when
//! read-only, the login cookie, a retry that flips a failed row to pending and is audited, a
//! pause and resume, and the console mounted under a prefix.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use outbox_console::security::HEADERS;
use outbox_console::{Console, ConsoleConfig};
use outbox_persistence::EventStatus;
use outbox_tests::TestDb;

use crate::support::*;

const PAGES: &[&str] = &[
    "/",
    "/fragments/overview",
    "/records",
    "/records?key=lead:1",
    "/failed",
    "/failed?type=x&error=boom",
    "/consumers",
    "/retention",
    "/webhooks",
    "/audit",
    "/login",
    "/assets/console.css",
    "/assets/console.js",
    "/no/such/page",
];

async fn every_page_carries_the_security_headers(db: TestDb) {
    let id = failed_row(&db, "t", "boom", Some("lead:1")).await;
    for config in [ConsoleConfig::default(), guarded()] {
        let console = console(&db, config);
        let event = format!("/events/{id}");
        for path in PAGES.iter().copied().chain([event.as_str()]) {
            let answer = get(&console, path, Some(SECRET)).await;
            let expected = if path == "/no/such/page" {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::OK
            };
            assert_eq!(answer.status, expected, "{path}: {}", answer.body);
            for (name, value) in HEADERS {
                assert_eq!(
                    answer.headers.get(*name).and_then(|v| v.to_str().ok()),
                    Some(*value),
                    "{name} on {path}"
                );
            }
            assert!(
                !answer.body.contains("style=\""),
                "an inline style on {path}"
            );
            assert!(
                !answer.body.contains("<script>"),
                "an inline script on {path}"
            );
        }
        // A refusal carries them too.
        let refused = get(&console, "/", Some("wrong")).await;
        assert!(refused.headers.contains_key("content-security-policy"));
    }
}

async fn hostile_rows_render_as_text(db: TestDb) {
    let id = failed_row(&db, HOSTILE_TYPE, HOSTILE_ERROR, Some("lead:<b>x</b>")).await;
    let console = console(
        &db,
        ConsoleConfig {
            allow_actions: true,
            ..ConsoleConfig::default()
        },
    );
    for path in [
        "/failed".to_string(),
        format!("/events/{id}"),
        "/records?key=lead:%3Cb%3Ex%3C/b%3E".to_string(),
    ] {
        let answer = get(&console, &path, None).await;
        assert_eq!(answer.status, StatusCode::OK, "{path}");
        for raw in ["<script>window.__pwned", "<img src=x", "<b>x</b>"] {
            assert!(
                !answer.body.contains(raw),
                "{raw} unescaped on {path}:\n{}",
                answer.body
            );
        }
        assert!(
            answer
                .body
                .contains("&lt;script&gt;window.__pwned=1&lt;/script&gt;")
                || path.starts_with("/records"),
            "{path}"
        );
    }
    let failed = get(&console, "/failed", None).await;
    assert!(
        failed
            .body
            .contains("&quot;&gt;&lt;img src=x onerror=&quot;window.__pwned=2&quot;&gt;"),
        "{}",
        failed.body
    );
}

async fn actions_are_refused_without_token_csrf_or_permission(db: TestDb) {
    let id = failed_row(&db, "t", "boom", None).await;
    let guarded_console = console(&db, guarded());
    let page = get(&guarded_console, "/failed", Some(SECRET)).await;
    let csrf = csrf_of(&page.body);
    let form = format!("csrf={csrf}&one={id}");
    // No token: 401, and the row stays failed.
    let answer = post(&guarded_console, "/actions/retry", None, &form).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    let answer = post(&guarded_console, "/actions/retry", Some("not-it"), &form).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    // A token but no CSRF token, or a wrong one: 403 with a reason.
    let answer = post(
        &guarded_console,
        "/actions/retry",
        Some(SECRET),
        &format!("one={id}"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    assert!(answer.body.contains("CSRF"), "{}", answer.body);
    let wrong = format!("csrf={}&one={id}", "0".repeat(csrf.len()));
    let answer = post(&guarded_console, "/actions/retry", Some(SECRET), &wrong).await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    // Another console's CSRF token is not this one's.
    let other = console(&db, guarded());
    let answer = post(&other, "/actions/retry", Some(SECRET), &form).await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    // A read-only console refuses whatever the form holds.
    let read_only = console(&db, ConsoleConfig::default());
    let answer = post(
        &read_only,
        "/actions/retry",
        None,
        &format!("csrf={}&one={id}", read_only_csrf()),
    )
    .await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    assert!(answer.body.contains("read-only"), "{}", answer.body);
    let answer = post(&read_only, "/actions/pause", None, "event_type=t").await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    // Actions are POST only.
    let answer = get(&guarded_console, "/actions/retry", Some(SECRET)).await;
    assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED);
    let row = db.repository().get_event(id).await.unwrap().unwrap();
    assert_eq!(row.status, EventStatus::Failed);
    assert!(db.repository().audit_log(10).await.unwrap().is_empty());
}

fn read_only_csrf() -> String {
    "x".repeat(64)
}

async fn a_retry_flips_the_row_to_pending_and_is_audited(db: TestDb) {
    let id = failed_row(&db, "t", "boom", None).await;
    let other = failed_row(&db, "t", "boom", None).await;
    let console = console(&db, guarded());
    let page = get(&console, "/failed?error=BOO", Some(SECRET)).await;
    assert!(
        page.body.contains(&id.to_string()),
        "the error filter is case-insensitive"
    );
    let form = format!("csrf={}&id={id}", csrf_of(&page.body));
    let answer = post(&console, "/actions/retry", Some(SECRET), &form).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    assert!(
        answer.body.contains("Retried 1 failed row"),
        "{}",
        answer.body
    );
    let repo = db.repository();
    assert_eq!(
        repo.get_event(id).await.unwrap().unwrap().status,
        EventStatus::Pending
    );
    assert_eq!(
        repo.get_event(other).await.unwrap().unwrap().status,
        EventStatus::Failed
    );
    let audit = repo.audit_log(10).await.unwrap();
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(
        (audit[0].actor.as_str(), audit[0].action.as_str()),
        ("ops", "retry")
    );
    let shown = get(&console, "/audit", Some(SECRET)).await;
    assert!(shown.body.contains("ops") && shown.body.contains("retry"));
}

async fn pause_and_resume_are_audited_and_shown(db: TestDb) {
    let console = console(
        &db,
        ConsoleConfig {
            allow_actions: true,
            ..ConsoleConfig::default()
        },
    );
    let csrf = csrf_of(&get(&console, "/", None).await.body);
    let answer = post(
        &console,
        "/actions/pause",
        None,
        &format!("csrf={csrf}&event_type=lead.updated"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    let overview = get(&console, "/", None).await;
    assert!(
        overview.body.contains("data-testid=\"paused\""),
        "{}",
        overview.body
    );
    let repo = db.repository();
    assert_eq!(
        repo.paused_event_types().await.unwrap()[0].paused_by,
        "local"
    );
    let answer = post(
        &console,
        "/actions/resume",
        None,
        &format!("csrf={csrf}&event_type=lead.updated"),
    )
    .await;
    assert!(answer.body.contains("Resumed"), "{}", answer.body);
    assert!(repo.paused_event_types().await.unwrap().is_empty());
    let actions: Vec<String> = repo
        .audit_log(10)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.action)
        .collect();
    assert_eq!(actions.len(), 2, "{actions:?}");
}

async fn the_login_form_sets_a_strict_http_only_cookie(db: TestDb) {
    let console = console(&db, guarded());
    assert_eq!(
        get(&console, "/", None).await.status,
        StatusCode::UNAUTHORIZED
    );
    let bad = login_post(&console, "token=nope").await;
    assert_eq!(bad.status, StatusCode::UNAUTHORIZED);
    // The login form carries a CSRF token bound to its cookie (login CSRF): without either, or
    // with another form's, the right token is refused.
    let token = format!("token={SECRET}");
    let bare = post(&console, "/login", None, &token).await;
    assert_eq!(bare.status, StatusCode::FORBIDDEN, "{}", bare.body);
    let (cookie, _) = login_csrf(&console).await;
    let (_, other) = login_csrf(&console).await;
    let request = Request::post("/login")
        .header("content-type", "application/x-www-form-urlencoded")
        .header("cookie", cookie)
        .body(Body::from(format!("{token}&csrf={other}")))
        .unwrap();
    assert_eq!(send(&console, request).await.status, StatusCode::FORBIDDEN);
    let ok = login_post(&console, &token).await;
    assert_eq!(ok.status, StatusCode::SEE_OTHER);
    let cookie = ok
        .headers
        .get("set-cookie")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let session = cookie.split(';').next().unwrap().to_string();
    let request = Request::get("/")
        .header("cookie", session)
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&console, request).await.status, StatusCode::OK);
}

async fn a_prefix_mount_links_under_the_prefix(db: TestDb) {
    let console: Console = console(&db, ConsoleConfig::default());
    let app = axum::Router::new().nest("/ops/console", outbox_console::router(console));
    use tower::ServiceExt;
    let response = app
        .oneshot(Request::get("/ops/console").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    use http_body_util::BodyExt;
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert!(
        body.contains("href=\"/ops/console/assets/console.css\""),
        "{body}"
    );
    assert!(
        body.contains("data-fragment=\"/ops/console/fragments/overview\""),
        "{body}"
    );
}

/// A console without a token answers loopback host names only (a rebound DNS name of another
/// site is refused: DNS rebinding), and no console takes a `POST` from another origin.
async fn foreign_hosts_and_origins_are_refused(db: TestDb) {
    let open = console(
        &db,
        ConsoleConfig {
            allow_actions: true,
            ..ConsoleConfig::default()
        },
    );
    let with_host = |host: &str| {
        Request::get("/failed")
            .header("host", host)
            .body(Body::empty())
            .unwrap()
    };
    for host in [
        "127.0.0.1:8080",
        "localhost:8080",
        "[::1]:8080",
        "LOCALHOST",
    ] {
        let answer = send(&open, with_host(host)).await;
        assert_eq!(answer.status, StatusCode::OK, "{host}: {}", answer.body);
    }
    for host in [
        "evil.example:8080",
        "evil.example",
        "10.1.2.3:8080",
        "127.0.0.1.evil.example",
    ] {
        let answer = send(&open, with_host(host)).await;
        assert_eq!(answer.status, StatusCode::FORBIDDEN, "{host}");
        assert!(
            answer.body.contains("loopback host name"),
            "{}",
            answer.body
        );
        assert!(
            !answer.body.contains("csrf"),
            "no form, no CSRF token leaks"
        );
    }
    let csrf = csrf_of(&get(&open, "/", None).await.body);
    let foreign_post = Request::post("/actions/pause")
        .header("host", "127.0.0.1:8080")
        .header("origin", "http://evil.example")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from(format!("csrf={csrf}&event_type=t")))
        .unwrap();
    let answer = send(&open, foreign_post).await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    assert!(answer.body.contains("Origin"), "{}", answer.body);
    // An opaque origin (a sandboxed frame, a data: page) passes only when the browser says
    // the request is same-origin.
    for (site, status) in [
        ("cross-site", StatusCode::FORBIDDEN),
        ("same-origin", StatusCode::OK),
    ] {
        let null_origin = Request::post("/actions/pause")
            .header("host", "127.0.0.1:8080")
            .header("origin", "null")
            .header("sec-fetch-site", site)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Body::from(format!("csrf={csrf}&event_type=t")))
            .unwrap();
        assert_eq!(send(&open, null_origin).await.status, status, "{site}");
    }
    let own_post = Request::post("/actions/pause")
        .header("host", "127.0.0.1:8080")
        .header("origin", "http://127.0.0.1:8080")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from(format!("csrf={csrf}&event_type=t")))
        .unwrap();
    assert_eq!(send(&open, own_post).await.status, StatusCode::OK);
    let paused = db.repository().paused_event_types().await.unwrap();
    assert_eq!(paused.len(), 1, "only the same-origin pauses landed");
}

/// An event's page lists the external effects the ledger records for it (handler, effect,
/// key, when, result as text); one without says so.
async fn the_event_page_lists_the_effects_the_ledger_records(db: TestDb) {
    let sent = failed_row(&db, "t", "boom after the send", Some("lead:1")).await;
    let quiet = failed_row(&db, "t", "boom", Some("lead:2")).await;
    let effect = outbox_persistence::EffectRecord::new(
        sent,
        "welcome-mail",
        "send",
        Some(r#""<b>msg-1</b>""#.into()),
    );
    db.repository()
        .record_effects(std::slice::from_ref(&effect))
        .await
        .unwrap();
    let console = console(&db, ConsoleConfig::default());
    let page = get(&console, &format!("/events/{sent}"), None).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(
        page.body.contains(r#"data-testid="effects""#),
        "{}",
        page.body
    );
    assert!(page.body.contains(&effect.idempotency_key), "{}", page.body);
    assert!(page.body.contains("welcome-mail") && page.body.contains("send"));
    assert!(
        page.body.contains("&lt;b&gt;msg-1&lt;/b&gt;"),
        "{}",
        page.body
    );
    assert!(!page.body.contains("<b>msg-1</b>"));
    let page = get(&console, &format!("/events/{quiet}"), None).await;
    assert!(
        page.body.contains(r#"data-testid="no-effects""#),
        "{}",
        page.body
    );
}

async fn the_webhooks_page_shows_endpoints_and_attempts_never_a_secret(db: TestDb) {
    use outbox_persistence::webhooks::{
        DeliveryAttempt, NewEndpoint, SecretText, add_endpoint, record_delivery_attempt,
        set_endpoint_enabled,
    };
    let console = console(&db, ConsoleConfig::default());
    let empty = get(&console, "/webhooks", None).await;
    assert!(
        empty.body.contains("No webhook endpoints"),
        "{}",
        empty.body
    );
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    for (name, url) in [
        ("crm", "https://crm.example.com/in"),
        ("odd", HOSTILE_ERROR),
    ] {
        let endpoint = NewEndpoint {
            name: name.into(),
            url: url.into(),
            event_types: vec!["lead.updated".into()],
            secret: SecretText(secret.into()),
        };
        assert!(add_endpoint(&mut tx, &endpoint, "test").await.unwrap());
    }
    set_endpoint_enabled(&mut tx, "odd", false, Some("receiver gone"), "test")
        .await
        .unwrap();
    let delivery = repo
        .enqueue(
            &mut tx,
            &[outbox_persistence::NewEvent::new("webhook:crm", "{}")],
        )
        .await
        .unwrap()[0];
    let attempt = DeliveryAttempt {
        endpoint: "crm".into(),
        event_id: delivery,
        source_event_id: uuid::Uuid::now_v7(),
        attempt: 2,
        at: None,
        status_code: Some(503),
        latency_ms: 17,
        response_body: Some(HOSTILE_ERROR.into()),
        error: Some("HTTP 503".into()),
    };
    record_delivery_attempt(&mut tx, &attempt).await.unwrap();
    tx.commit().await.unwrap();
    let page = get(&console, "/webhooks", None).await;
    assert_eq!(page.status, StatusCode::OK);
    let body = &page.body;
    assert!(body.contains("https://crm.example.com/in") && body.contains("lead.updated"));
    assert!(
        body.contains("DISABLED") && body.contains("receiver gone"),
        "{body}"
    );
    assert!(
        body.contains("HTTP 503") && body.contains("17 ms"),
        "{body}"
    );
    assert!(body.contains(&attempt.event_id.to_string()));
    assert!(
        !body.contains(secret) && !body.contains("whsec_"),
        "a secret on the page"
    );
    assert!(
        !body.contains(HOSTILE_ERROR),
        "an unescaped value on the page"
    );
}

outbox_tests::backend_tests!(
    the_webhooks_page_shows_endpoints_and_attempts_never_a_secret,
    the_event_page_lists_the_effects_the_ledger_records,
    foreign_hosts_and_origins_are_refused,
    every_page_carries_the_security_headers,
    hostile_rows_render_as_text,
    actions_are_refused_without_token_csrf_or_permission,
    a_retry_flips_the_row_to_pending_and_is_audited,
    pause_and_resume_are_audited_and_shown,
    the_login_form_sets_a_strict_http_only_cookie,
    a_prefix_mount_links_under_the_prefix,
);
