//! The console under attack (issue 41), over HTTP: bounded pages on a record with 200,000
//! rows (and the console process' memory under 16 concurrent requests for it), a flood of
//! connections that never finish a request, viewer and operator roles, logins that are
//! limited, logged and ended, errors that show an id and not the database's message, NUL and
//! oversized input refused before any query, and the reverse-proxy recipe of docs/console.md.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, StatusCode};
use outbox_console::{ConnectionLimits, ConsoleConfig};
use outbox_persistence::KEY_ROWS_SHOWN;
use outbox_tests::{RawRow, TestDb};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::instrument::WithSubscriber;

use crate::net::*;
use crate::support::*;

/// Everything the console logs while `work` runs (its handlers run inside it with `oneshot`).
async fn logged<T>(work: impl std::future::Future<Output = T>) -> (T, String) {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    let out = work.with_subscriber(subscriber).await;
    let text = String::from_utf8_lossy(&buf.0.lock().unwrap()).into_owned();
    (out, text)
}

/// A request from `peer` (as `serve` tags every request with its client's address).
fn from(peer: &str, request: axum::http::request::Builder, body: &str) -> Request<Body> {
    let mut request = request.body(Body::from(body.to_string())).unwrap();
    let peer: SocketAddr = peer.parse().unwrap();
    request.extensions_mut().insert(ConnectInfo(peer));
    request
}

fn login_request(peer: &str, token: &str, (cookie, csrf): &(String, String)) -> Request<Body> {
    let builder = Request::post("/login")
        .header("content-type", "application/x-www-form-urlencoded")
        .header("cookie", cookie);
    from(peer, builder, &format!("token={token}&csrf={csrf}"))
}
/// A record with more non-terminal rows than a page shows: the page lists the oldest
/// [`KEY_ROWS_SHOWN`] with the count of all, and the newest failure (read newest
/// first, not every failure's error text).
async fn a_record_page_shows_its_oldest_rows_a_count_and_its_newest_failure(db: TestDb) {
    let start = chrono::Utc::now() - chrono::Duration::hours(1);
    let mut ids = Vec::new();
    for i in 0..150 {
        let row = RawRow::pending(Some("lead:big"), start + chrono::Duration::seconds(i));
        ids.push(row.id);
        db.insert_raw(&row).await;
    }
    // Inserted oldest first: the last is the newest.
    for error in ["oldest failure", "middle failure", "newest failure"] {
        failed_row(&db, "t", error, Some("lead:big")).await;
    }
    let console = console(&db, ConsoleConfig::default());
    let page = get(&console, "/records?key=lead:big", None).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(
        page.body
            .contains("150 non-terminal row(s), oldest first (the oldest 100 shown)"),
        "{}",
        page.body
    );
    let listed = ids
        .iter()
        .filter(|id| page.body.contains(&id.to_string()))
        .count();
    assert_eq!(listed, KEY_ROWS_SHOWN as usize, "the oldest rows only");
    assert!(page.body.contains(&ids[0].to_string()));
    assert!(!page.body.contains(&ids[149].to_string()));
    assert!(page.body.contains("newest failure"), "{}", page.body);
    assert!(!page.body.contains("oldest failure"));
}

/// The reproduction: 200,000 rows on one key, half of them failed with 2 KB errors.
/// One request used to return 25.8 MB and take the console from 13 MB to 690 MB. The page is
/// now under 1 MB and the console process (a child, measured from /proc) stays under 100 MB
/// with 16 requests for it at once.
async fn a_blocked_key_of_200000_rows_keeps_the_page_small_and_the_console_lean() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    db.execute(
        "INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount, RecordKey,
                                          CreatedDate, LastModifiedDate, LastError)
         SELECT gen_random_uuid(), 'lead.updated', '{}',
                CASE WHEN g % 2 = 0 THEN 'failed' ELSE 'pending' END,
                CASE WHEN g % 2 = 0 THEN 5 ELSE 0 END,
                'lead:hot',
                now() - ((200000 - g) * interval '10 milliseconds'),
                now() - ((200000 - g) * interval '10 milliseconds'),
                CASE WHEN g % 2 = 0 THEN repeat('handler failed: ', 128) END
         FROM generate_series(1, 200000) AS g",
    )
    .await;
    db.execute("ANALYZE _System_OutboxEvent").await;
    let child = ConsoleChild::start(&db.url).await;
    let page = raw_get(child.addr, "/records?key=lead:hot", &[]).await;
    assert_eq!(page.status, 200, "{}", page.head);
    assert!(
        page.body.len() < 1_000_000,
        "the page is {} bytes",
        page.body.len()
    );
    assert!(page.text().contains("100000 non-terminal row(s)"));
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..16 {
        requests.spawn(raw_get(child.addr, "/records?key=lead:hot", &[]));
    }
    while let Some(answer) = requests.join_next().await {
        assert_eq!(answer.expect("a request").status, 200);
    }
    let peak_kb = child.peak_rss_kb();
    eprintln!(
        "console child: a {}-byte page; peak RSS {peak_kb} kB after 17 requests for a 200,000-row key",
        page.body.len()
    );
    assert!(
        peak_kb < 100 * 1024,
        "the console's peak RSS was {peak_kb} kB"
    );
    child.stop().await;
}

/// The console as a child process (this test binary, running [`console_child`]), so that its
/// memory is its own.
struct ConsoleChild {
    child: tokio::process::Child,
    addr: SocketAddr,
}

const CHILD_DB_ENV: &str = "OUTBOX_CONSOLE_CHILD_DATABASE_URL";

impl ConsoleChild {
    async fn start(url: &str) -> Self {
        use tokio::io::AsyncBufReadExt;
        let exe = std::env::current_exe().expect("the test binary");
        let mut child = tokio::process::Command::new(exe)
            .args([
                "hardening::console_child",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DB_ENV, url)
            .stdout(std::process::Stdio::piped())
            .stdin(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the console child");
        let stdout = child.stdout.take().expect("its stdout");
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let addr = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await.expect("a line") {
                // libtest may print "test … ... " ahead of it on the same line.
                if let Some((_, addr)) = line.split_once("CONSOLE_ADDR=") {
                    return addr.trim().parse().expect("an address");
                }
            }
            panic!("the console child ended without serving");
        })
        .await
        .expect("the console child serves within 60 s");
        Self { child, addr }
    }

    fn peak_rss_kb(&self) -> u64 {
        let pid = self.child.id().expect("running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM")
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// Not a test of its own: the entry point of the console process [`ConsoleChild`] starts (this
/// binary, filtered to this name). Without the parent's database URL it returns at once.
/// Serves until its stdin closes.
#[tokio::test]
async fn console_child() {
    let Ok(url) = std::env::var(CHILD_DB_ENV) else {
        return;
    };
    let db = outbox_persistence::Database::connect(&url, Default::default())
        .await
        .expect("the parent's database");
    let console =
        outbox_console::Console::new(db, Vec::new(), ConsoleConfig::default()).expect("a console");
    let served = Served::start(console).await;
    println!("CONSOLE_ADDR={}", served.addr);
    let _ = tokio::task::spawn_blocking(|| {
        let mut byte = [0u8; 1];
        let _ = std::io::Read::read(&mut std::io::stdin(), &mut byte);
    })
    .await;
}

fn limited(max: usize, per_address: usize, header_read_timeout: Duration) -> ConsoleConfig {
    ConsoleConfig {
        limits: ConnectionLimits {
            max_connections: max,
            max_connections_per_address: per_address,
            header_read_timeout,
            ..ConnectionLimits::default()
        },
        ..guarded()
    }
}

/// Opens `n` connections from `ip` that each send half a request line.
async fn half_requests(ip: &str, addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut flood = Vec::new();
    for _ in 0..n {
        let mut stream = connect_from(ip, addr).await;
        stream
            .write_all(b"GET / HTTP/1.1\r\nHo")
            .await
            .expect("write");
        flood.push(stream);
    }
    flood
}

/// How many of `streams` the server has closed (each given `within`).
async fn closed(streams: &mut [TcpStream], within: Duration) -> usize {
    let mut n = 0;
    for stream in streams {
        n += usize::from(closed_within(stream, within).await);
    }
    n
}

/// Floods of connections that never finish a request: half request lines from one address
/// (the server keeps that address' share open, closing its oldest at once, long before the
/// header-read timeout), the same flood running while another address makes requests, and
/// requests that send their headers but never their body (not busy: closed like the others).
/// `/login` keeps answering throughout.
async fn a_flood_of_half_requests_leaves_login_answering(db: TestDb) {
    let served = Served::start(console(&db, limited(64, 16, Duration::from_secs(30)))).await;
    let mut flood = half_requests("127.0.0.2", served.addr, 500).await;
    let login = raw_get(served.addr, "/login", &[]).await;
    assert_eq!(login.status, 200, "{}", login.head);
    let gone = closed(&mut flood[..484], Duration::from_millis(100)).await;
    assert_eq!(gone, 484, "the flooding address keeps its newest 16 only");
    drop(flood);
    // The same flood, running while another address asks for pages.
    let addr = served.addr;
    let flooding = tokio::spawn(async move {
        let until = std::time::Instant::now() + Duration::from_secs(2);
        let mut held = Vec::new();
        while std::time::Instant::now() < until {
            held.extend(half_requests("127.0.0.3", addr, 50).await);
        }
        held.len()
    });
    for _ in 0..20 {
        let page = raw_get(served.addr, "/login", &[]).await;
        assert_eq!(page.status, 200, "{}", page.head);
    }
    assert!(
        flooding.await.unwrap() >= 100,
        "the flood ran beside the requests"
    );
    // Headers whole, the body never sent: such a connection is not busy, and goes first.
    let mut trickle = Vec::new();
    for _ in 0..100 {
        let mut stream = TcpStream::connect(served.addr).await.expect("connect");
        let head = "POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\ntoken=";
        stream.write_all(head.as_bytes()).await.expect("write");
        trickle.push(stream);
    }
    let login = raw_get(served.addr, "/login", &[]).await;
    assert_eq!(login.status, 200, "{}", login.head);
    drop(served);
    // With a short header-read timeout: a half request, a trickled body and an idle keep-alive
    // connection are each closed once it passes.
    let served = Served::start(console(&db, limited(64, 64, Duration::from_secs(1)))).await;
    let mut half = half_requests("127.0.0.1", served.addr, 1).await;
    let mut body = TcpStream::connect(served.addr).await.expect("connect");
    let head = "POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\ntoken=";
    body.write_all(head.as_bytes()).await.expect("write");
    let mut idle = TcpStream::connect(served.addr).await.expect("connect");
    idle.write_all(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .expect("write");
    for (what, stream) in [
        ("a half request", &mut half[0]),
        ("a trickled body", &mut body),
        ("an idle keep-alive connection", &mut idle),
    ] {
        assert!(
            closed_within(stream, Duration::from_secs(4)).await,
            "{what} outlived the header-read timeout"
        );
    }
}

/// A viewer reads every page and acts on none; an operator acts; the audit names the token.
/// A console without tokens that allows actions says on every page that anyone on the host
/// can act.
async fn a_viewer_reads_and_an_operator_acts(db: TestDb) {
    let id = failed_row(&db, "t", "boom", Some("lead:1")).await;
    let console = console(&db, guarded());
    let viewer = get(&console, "/failed", Some(VIEWER_SECRET)).await;
    assert_eq!(viewer.status, StatusCode::OK);
    assert!(
        viewer.body.contains("read-only (viewer)"),
        "{}",
        viewer.body
    );
    assert!(
        !viewer.body.contains("/actions/retry"),
        "a viewer sees no action"
    );
    let operator = get(&console, "/failed", Some(SECRET)).await;
    assert!(operator.body.contains("/actions/retry"));
    // With the operator's CSRF token (a viewer's pages carry none), still refused.
    let form = format!("csrf={}&one={id}", csrf_of(&operator.body));
    let refused = post(&console, "/actions/retry", Some(VIEWER_SECRET), &form).await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert!(refused.body.contains("viewer"), "{}", refused.body);
    let paused = post(&console, "/actions/pause", Some(VIEWER_SECRET), &form).await;
    assert_eq!(paused.status, StatusCode::FORBIDDEN);
    assert!(paused.body.contains("viewer"), "{}", paused.body);
    for path in ["/".to_string(), format!("/events/{id}")] {
        let page = get(&console, &path, Some(VIEWER_SECRET)).await;
        assert!(
            !page.body.contains("/actions/"),
            "{path} shows a viewer an action"
        );
        let page = get(&console, &path, Some(SECRET)).await;
        assert!(
            page.body.contains("/actions/"),
            "{path} shows an operator none"
        );
    }
    // The operator acts.
    let retried = post(&console, "/actions/retry", Some(SECRET), &form).await;
    assert_eq!(retried.status, StatusCode::OK, "{}", retried.body);
    let audit = db.repository().audit_log(10).await.unwrap();
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].actor, "ops");
    // Without tokens: a warning on every page when actions are allowed, none when read-only.
    let open = console_open(&db, true);
    for path in [
        "/",
        "/failed",
        "/records",
        "/audit",
        "/consumers",
        "/retention",
    ] {
        let page = get(&open, path, None).await;
        assert!(page.body.contains("data-testid=\"open-console\""), "{path}");
    }
    let read_only = console_open(&db, false);
    assert!(
        !get(&read_only, "/", None)
            .await
            .body
            .contains("open-console")
    );
}

fn console_open(db: &TestDb, allow_actions: bool) -> outbox_console::Console {
    console(
        db,
        ConsoleConfig {
            allow_actions,
            ..ConsoleConfig::default()
        },
    )
}

/// Failed logins are logged at warn with the client's address and, past five, make that
/// address wait (even with the right token) while another address logs in; a session has its
/// own CSRF token, ends at logout, and a token name holds a bounded number of sessions.
async fn logins_are_limited_logged_and_ended(db: TestDb) {
    let console = console(&db, guarded());
    let app = || outbox_console::router(console.clone());
    use tower::ServiceExt;
    let form = login_csrf(&console).await;
    let (statuses, log) = logged(async {
        let mut statuses = Vec::new();
        for _ in 0..5 {
            let answer = app()
                .oneshot(login_request("10.0.0.1:5000", "wrong", &form))
                .await
                .unwrap();
            statuses.push(answer.status());
        }
        let answer = app()
            .oneshot(login_request("10.0.0.1:5001", SECRET, &form))
            .await
            .unwrap();
        statuses.push(answer.status());
        let retry_after = answer.headers().get("retry-after").cloned();
        let other = app()
            .oneshot(login_request("10.0.0.2:5000", SECRET, &form))
            .await
            .unwrap();
        statuses.push(other.status());
        (statuses, retry_after)
    })
    .await;
    let (statuses, retry_after) = statuses;
    assert_eq!(&statuses[..5], &[StatusCode::UNAUTHORIZED; 5]);
    assert_eq!(statuses[5], StatusCode::TOO_MANY_REQUESTS, "{statuses:?}");
    assert!(retry_after.is_some());
    assert_eq!(statuses[6], StatusCode::SEE_OTHER, "{statuses:?}");
    assert!(
        log.contains("WARN") && log.contains("console login failed") && log.contains("10.0.0.1"),
        "{log}"
    );
    // Two sessions of one token: each with its own CSRF token; logout ends one.
    let session = |answer: &Answer| {
        let cookie = answer.headers.get("set-cookie").unwrap().to_str().unwrap();
        cookie.split(';').next().unwrap().to_string()
    };
    let first = session(&login_post(&console, &format!("token={SECRET}")).await);
    let second = session(&login_post(&console, &format!("token={SECRET}")).await);
    let page_of = |cookie: String| {
        let console = console.clone();
        async move {
            let request = Request::get("/")
                .header("cookie", cookie)
                .body(Body::empty())
                .unwrap();
            send(&console, request).await
        }
    };
    let (a, b) = (page_of(first.clone()).await, page_of(second.clone()).await);
    assert_eq!((a.status, b.status), (StatusCode::OK, StatusCode::OK));
    assert_ne!(
        csrf_of(&a.body),
        csrf_of(&b.body),
        "one CSRF token per session"
    );
    let logout = |cookie: String, csrf: String| {
        let console = console.clone();
        async move {
            let request = Request::post("/logout")
                .header("cookie", cookie)
                .header("content-type", "application/x-www-form-urlencoded")
                .body(Body::from(format!("csrf={csrf}")))
                .unwrap();
            send(&console, request).await
        }
    };
    // The other session's CSRF token does not end this one.
    let refused = logout(first.clone(), csrf_of(&b.body)).await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    let out = logout(first.clone(), csrf_of(&a.body)).await;
    assert_eq!(out.status, StatusCode::SEE_OTHER);
    assert!(
        out.headers
            .get("set-cookie")
            .unwrap()
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
    assert_eq!(
        page_of(first).await.status,
        StatusCode::UNAUTHORIZED,
        "logged out"
    );
    assert_eq!(page_of(second.clone()).await.status, StatusCode::OK);
    // Another holder of the token logs in many times: only that name's oldest session goes.
    let viewer = session(&login_post(&console, &format!("token={VIEWER_SECRET}")).await);
    for _ in 0..outbox_console::login::MAX_SESSIONS_PER_TOKEN {
        login_post(&console, &format!("token={SECRET}")).await;
    }
    assert_eq!(page_of(second).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(page_of(viewer).await.status, StatusCode::OK);
}

/// NUL and oversized input get 400 before any query; a page that fails shows an id, not the
/// database's message, and the log line carries the id with the error.
async fn bad_input_is_refused_and_errors_show_an_id(db: TestDb) {
    let console = console(&db, guarded());
    for path in [
        "/records?key=%00".to_string(),
        "/failed?type=a%00b".to_string(),
        format!("/records?key={}", "k".repeat(2000)),
    ] {
        let answer = get(&console, &path, Some(SECRET)).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{path}: {}",
            answer.body
        );
        assert!(answer.body.starts_with("refused:"), "{}", answer.body);
    }
    let page = get(&console, "/failed", Some(SECRET)).await;
    let form = format!("csrf={}&event_type=a%00b", csrf_of(&page.body));
    let answer = post(&console, "/actions/pause", Some(SECRET), &form).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.body);
    db.execute("DROP TABLE _System_OutboxAudit").await;
    let (answer, log) = logged(get(&console, "/audit", Some(SECRET))).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        !answer.body.to_lowercase().contains("outboxaudit"),
        "{}",
        answer.body
    );
    let marker = "Error id <code>";
    let at = answer.body.find(marker).expect("an error id") + marker.len();
    let id = &answer.body[at..at + 12];
    assert!(
        log.contains(id) && log.to_lowercase().contains("outboxaudit"),
        "{log}"
    );
}

/// The overview stands when the paused types cannot be read (a database not migrated to the
/// pause table, a role that may not read it): a banner says so instead of a failed page.
async fn a_failed_read_of_the_paused_types_shows_a_banner(db: TestDb) {
    let console = console(&db, ConsoleConfig::default());
    db.execute("DROP TABLE _System_OutboxPausedType").await;
    let (page, log) = logged(get(&console, "/", None)).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(
        page.body.contains("data-testid=\"paused-unread\""),
        "{}",
        page.body
    );
    assert!(page.body.contains("data-testid=\"count-pending\""));
    assert!(
        log.contains("could not read the paused event types"),
        "{log}"
    );
}

/// The docs' proxy recipe: the proxy authenticates its users and names them in
/// `X-Forwarded-User`, the console listens on loopback without tokens and trusts that header,
/// `--public-origin` names the address the proxy serves it under. Pages and actions work
/// through it, the audit names the proxy's user, and the console refuses requests that did not
/// come through it.
async fn the_proxy_recipe_works_with_actions(db: TestDb) {
    let public = "https://ops.example.test";
    let config = ConsoleConfig {
        allow_actions: true,
        public_origins: vec![public.to_string()],
        proxy_user_header: Some("x-forwarded-user".to_string()),
        ..ConsoleConfig::default()
    };
    let served = Served::start(console(&db, config)).await;
    let proxy = proxy(served.addr).await;
    let login = "X-Test-Login: alice".to_string();
    let browser = [login.clone(), format!("Origin: {public}")];
    assert_eq!(raw_get(proxy, "/", &[]).await.status, 401, "the proxy asks");
    let page = raw_get(proxy, "/", std::slice::from_ref(&login)).await;
    assert_eq!(page.status, 200, "{}", page.text());
    assert!(page.text().contains("alice (operator)"), "{}", page.text());
    let form = format!("csrf={}&event_type=lead.updated", csrf_of(&page.text()));
    let paused = raw_post(proxy, "/actions/pause", &browser, &form).await;
    assert_eq!(paused.status, 200, "{}", paused.text());
    assert!(paused.text().contains("Paused lead.updated"));
    let audit = db.repository().audit_log(10).await.unwrap();
    assert_eq!(audit[0].actor, "alice");
    // Straight to the console: no user named, 401; two user headers (a proxy that appends
    // its own to the client's), 401. One named user is taken: a local process can reach the
    // loopback port around the proxy, the limit docs/console.md states.
    assert_eq!(raw_get(served.addr, "/", &[]).await.status, 401);
    let two = [
        "X-Forwarded-User: alice".to_string(),
        "X-Forwarded-User: mallory".to_string(),
    ];
    assert_eq!(raw_get(served.addr, "/", &two).await.status, 401);
    // The public origin's host is answered, another host is not (DNS rebinding).
    let request = |host: &str| {
        format!(
            "GET / HTTP/1.1\r\nHost: {host}\r\nX-Forwarded-User: alice\r\nConnection: close\r\n\r\n"
        )
    };
    assert_eq!(
        exchange(served.addr, &request("ops.example.test"))
            .await
            .status,
        200
    );
    assert_eq!(
        exchange(served.addr, &request("evil.example")).await.status,
        403
    );
    let foreign = [login, "Origin: https://evil.example".to_string()];
    let refused = raw_post(proxy, "/actions/resume", &foreign, &form).await;
    assert_eq!(refused.status, 403, "{}", refused.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_blocked_key_of_200000_rows_keeps_the_page_small_and_the_console_lean() {
    a_blocked_key_of_200000_rows_keeps_the_page_small_and_the_console_lean().await;
}

outbox_tests::backend_tests!(
    a_record_page_shows_its_oldest_rows_a_count_and_its_newest_failure,
    a_flood_of_half_requests_leaves_login_answering,
    a_viewer_reads_and_an_operator_acts,
    logins_are_limited_logged_and_ended,
    bad_input_is_refused_and_errors_show_an_id,
    a_failed_read_of_the_paused_types_shows_a_banner,
    the_proxy_recipe_works_with_actions,
);
