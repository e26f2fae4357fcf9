//! The console in a real browser: headless Chromium over WebDriver (`fantoccini`,
//! `/usr/bin/chromedriver`) against the console on a loopback port over a fresh PostgreSQL
//! database, with a pull dispatcher on it. Each check is verified in the database too: (1) the
//! overview's `count-*` equal the table's counts by status; (2) the live section (`console.js`
//! polls `/fragments/overview`) shows a new row without a reload; (3) a hostile event type and
//! error are text on the failed and event pages, and no script of theirs runs; (4) a retry
//! clicked on the failed page makes the row pending and the workers process it; (5) a pause
//! from the overview stops claims of its type, its resume restarts them; (6) an action without
//! the token, or without the CSRF token, is refused (raw HTTP) and changes nothing. Screenshots
//! go to `<target>/console-screenshots/<page>.png`. Skipped without Chromium, chromedriver or
//! PostgreSQL, unless `CI=true`. The forms are submitted as a user would, so the console's
//! same-origin check meets Chromium's real `Origin` header (a `Referrer-Policy: no-referrer`
//! once made Chromium send `Origin: null`, and every form was refused).

use std::collections::BTreeMap;
use std::fmt::Display;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fantoccini::elements::Element;
use fantoccini::error::CmdError;
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use outbox_console::login::SESSION_COOKIE;
use outbox_console::{Console, ConsoleConfig, NamedToken};
use outbox_events::prelude::*;
use outbox_tests::{RawRow, TestDb};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{HOSTILE_ERROR, HOSTILE_TYPE, failed_row};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const CHROMIUM_ARGS: &str = "--headless --no-sandbox --disable-gpu --disable-quic \
    --no-first-run --disable-background-networking --disable-component-update --disable-sync \
    --disable-dev-shm-usage --window-size=1280,1000";
// Event types: run by the workers; paused before they start (the live refresh); paused and
// resumed through the console; named by the refused actions only.
const WORK: &str = "browser.work";
const LIVE: &str = "browser.live";
const PAUSED: &str = "browser.paused";
const REFUSED: &str = "browser.refused";
/// The longest wait for anything (a slow 2-core machine).
const LIMIT: Duration = Duration::from_secs(30);
/// The console's answer to a form `POST` it takes for another site's.
const ORIGIN_REFUSED: &str = "refused: the request's Origin is not this console";

/// `result`'s value, or a panic naming `what`.
fn ok<T, E: Display>(result: Result<T, E>, what: &str) -> T {
    result.unwrap_or_else(|e| panic!("{what}: {e}"))
}

fn text_err(e: impl Display) -> String {
    e.to_string()
}

/// Retries `check` every 100 ms until it succeeds, or panics after `limit` with its last error.
async fn eventually(what: &str, mut check: impl AsyncFnMut() -> Result<(), String>) {
    let start = Instant::now();
    loop {
        match check().await {
            Ok(()) => return,
            Err(last) if start.elapsed() >= LIMIT => {
                panic!("{what}: not within {LIMIT:?}; last seen: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The events the handler ran.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<EventId>>>);

impl Recorder {
    fn ids(&self) -> MutexGuard<'_, Vec<EventId>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait]
impl Handler for Recorder {
    async fn handle(
        &self,
        e: &OutboxEvent,
        _: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.ids().push(e.id);
        Ok(())
    }
}

/// Whether Chromium and chromedriver are installed; panics without them under `CI=true`.
fn browser_available() -> bool {
    let missing: Vec<&str> = [CHROMIUM, CHROMEDRIVER]
        .into_iter()
        .filter(|p| !Path::new(p).exists())
        .collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("the browser test needs {missing:?} (CI=true): install chromium and its driver");
    }
    eprintln!("skipping the browser test: {missing:?} not installed");
    false
}

/// A WebDriver session in Chromium. Dropping it (after a failed check too) ends the session,
/// kills chromedriver and removes the browser's profile.
struct Browser {
    client: Option<Client>,
    driver: Child,
    profile: PathBuf,
}

impl Browser {
    async fn start() -> Self {
        let free = ok(std::net::TcpListener::bind("127.0.0.1:0"), "a free port");
        let port = ok(free.local_addr(), "its address").port();
        drop(free);
        let name = format!("outbox-console-chromium-{}", uuid::Uuid::new_v4().simple());
        let profile = std::env::temp_dir().join(name);
        ok(std::fs::create_dir_all(&profile), "a profile directory");
        let mut driver = Command::new(CHROMEDRIVER);
        driver.arg(format!("--port={port}"));
        let driver = driver.stdout(Stdio::null()).stderr(Stdio::null()).spawn();
        let driver = ok(driver, "start chromedriver");
        let client = None;
        let browser = Self {
            client,
            driver,
            profile,
        };
        eventually("chromedriver accepts connections", async || {
            let connected = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
            connected.map(drop).map_err(text_err)
        })
        .await;
        browser.connect(port).await
    }

    async fn connect(mut self, port: u16) -> Self {
        let mut args: Vec<String> = CHROMIUM_ARGS.split_whitespace().map(String::from).collect();
        args.push(format!("--user-data-dir={}", self.profile.display()));
        let caps = json!({ "goog:chromeOptions": { "binary": CHROMIUM, "args": args } });
        let Value::Object(caps) = caps else {
            unreachable!("an object")
        };
        let url = format!("http://127.0.0.1:{port}");
        let mut builder = ClientBuilder::new(HttpConnector::new());
        let client = builder.capabilities(caps).connect(&url).await;
        self.client = Some(ok(client, "a Chromium session"));
        self
    }

    /// Ends the session (the normal path; `Drop` does it after a failure).
    async fn close(mut self) {
        if let Some(client) = self.client.take() {
            ok(client.close().await, "close the browser session");
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            // A check failed: end the session so that Chromium exits before its driver does.
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let close = tokio::time::timeout(Duration::from_secs(10), client.close());
                tokio::task::block_in_place(|| drop(handle.block_on(close)));
            }
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// What the checks share.
struct Ctx<'a> {
    db: &'a TestDb,
    c: &'a Client,
    addr: SocketAddr,
    secret: String,
    shots: PathBuf,
    recorder: Recorder,
}

impl Ctx<'_> {
    async fn goto(&self, path: &str) {
        let url = format!("http://{}{path}", self.addr);
        ok(self.c.goto(&url).await, &url);
    }

    async fn find(&self, css: &str) -> Element {
        let found = self.c.wait().at_most(LIMIT).for_element(Locator::Css(css));
        ok(found.await, css)
    }

    async fn text(&self, css: &str) -> String {
        let text = self.find(css).await.text().await;
        ok(text, css)
    }

    async fn script(&self, js: &str) -> Value {
        ok(self.c.execute(js, Vec::new()).await, js)
    }

    /// Clicks a form's submit `button`.
    async fn submit(&self, button: &Element) -> Result<(), CmdError> {
        button.click().await
    }

    /// Clicks the submit button `css` and returns the action's result.
    async fn act(&self, css: &str) -> String {
        let clicked = self.submit(&self.find(css).await).await;
        ok(clicked, css);
        self.text("[data-testid=action-result]").await
    }

    /// Saves a PNG of the page as `<name>.png` and prints its path.
    async fn shot(&self, name: &str) {
        let png = ok(self.c.screenshot().await, "a screenshot");
        assert!(png.starts_with(b"\x89PNG"), "a PNG of {name}");
        let path = self.shots.join(format!("{name}.png"));
        ok(std::fs::write(&path, png), "write the screenshot");
        println!("screenshot of {name}: {}", path.display());
    }

    async fn status(&self, id: EventId) -> String {
        let pool = self.db.pg().expect("a PostgreSQL test");
        let sql = "SELECT Status FROM _System_OutboxEvent WHERE Id = $1";
        let status = sqlx::query_scalar(sql).bind(id).fetch_one(pool).await;
        ok(status, "a status")
    }

    /// Waits until the workers processed `id` (the table says so, and the handler ran it).
    async fn processed(&self, id: EventId) {
        eventually(&format!("row {id} processed"), async || {
            let (status, ran) = (self.status(id).await, self.recorder.ids().contains(&id));
            match status == "processed" && ran {
                true => Ok(()),
                false => Err(format!("status {status}, handler ran: {ran}")),
            }
        })
        .await;
    }

    /// The overview's counts, read in one script (the live section may be swapped meanwhile).
    async fn page_counts(&self) -> BTreeMap<String, String> {
        let js = "var out = {}; document.querySelectorAll('[data-testid^=\"count-\"]')
            .forEach(function (e) { out[e.getAttribute('data-testid')] = e.textContent.trim(); });
            return out;";
        ok(serde_json::from_value(self.script(js).await), "the counts")
    }

    /// Whether `event_type` is paused, and by whom.
    async fn paused_by(&self, event_type: &str) -> Option<String> {
        let paused = self.db.repository().paused_event_types().await;
        let mut paused = ok(paused, "the paused types").into_iter();
        paused
            .find(|p| p.event_type == event_type)
            .map(|p| p.paused_by)
    }

    /// The audit log's entries, as `actor action`.
    async fn audit(&self) -> Vec<String> {
        let audit = ok(self.db.repository().audit_log(100).await, "the audit log");
        audit
            .into_iter()
            .map(|a| format!("{} {}", a.actor, a.action))
            .collect()
    }
}

fn screenshot_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    let dir = target.join("console-screenshots");
    ok(std::fs::create_dir_all(&dir), "the screenshot directory");
    dir
}

/// The table's counts by status, as the overview's `data-testid`s name them.
async fn db_counts(db: &TestDb) -> BTreeMap<String, String> {
    let stale = "Status = 'processing' AND LastModifiedDate < now() - interval '30 s'";
    let queries = [
        ("count-pending", "Status = 'pending'"),
        ("count-processing", "Status = 'processing'"),
        ("count-processed", "Status = 'processed'"),
        ("count-failed", "Status = 'failed'"),
        ("count-retrying", "Status = 'pending' AND RetryCount > 0"),
        ("count-stale", stale),
    ];
    let mut counts = BTreeMap::new();
    for (name, filter) in queries {
        let sql = format!("SELECT count(*) FROM _System_OutboxEvent WHERE {filter}");
        counts.insert(name.to_string(), db.count(&sql).await.to_string());
    }
    counts
}

/// Three processed rows; three failed: the one to retry, another, the hostile one (their ids);
/// two pending (one retrying), which the workers run once they start (their ids).
async fn seed(db: &TestDb) -> ((EventId, EventId), Vec<EventId>) {
    let ago = chrono::Utc::now() - chrono::Duration::minutes(5);
    let mut pending = Vec::new();
    // `None`: processed; `Some(retries)`: pending after `retries` failed attempts.
    let rows = [None, None, None, Some(0), Some(2)];
    for (i, retries) in rows.into_iter().enumerate() {
        let mut row = RawRow::pending(Some(&format!("lead:seeded-{i}")), ago);
        let status = retries.map_or("processed", |_| "pending");
        (row.event_type, row.status) = (WORK.to_string(), status);
        row.retry_count = retries.unwrap_or(0);
        db.insert_raw(&row).await;
        if retries.is_some() {
            pending.push(row.id);
        }
    }
    let retried = failed_row(db, WORK, "handler failed: boom", Some("lead:browser-1")).await;
    failed_row(db, WORK, "handler failed: timeout", None).await;
    let hostile = failed_row(db, HOSTILE_TYPE, HOSTILE_ERROR, Some("lead:hostile")).await;
    ((retried, hostile), pending)
}

async fn enqueue(db: &TestDb, event_type: &str, record_id: &str) -> EventId {
    let repo = db.repository();
    let mut tx = ok(repo.begin().await, "a transaction");
    let snapshot = BTreeMap::from([("by", "the browser test")]);
    let event = NewEvent::for_record(event_type, "Lead", record_id, &snapshot);
    let ids = repo.enqueue(&mut tx, &[ok(event, "an event")]).await;
    let ids = ok(ids, "enqueue");
    ok(tx.commit().await, "commit the enqueue");
    ids[0]
}

async fn start_dispatcher(db: &TestDb, recorder: &Recorder) -> DispatcherHandle {
    let handlers = [WORK, LIVE, PAUSED]
        .into_iter()
        .fold(Handlers::new(), |h, t| h.register(t, recorder.clone()));
    let config = WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("the console's browser test")
        .with_workers(2)
        .with_poll_interval(Duration::from_millis(50));
    let dispatcher = Dispatcher::new(db.repository(), handlers, config);
    let handle = ok(dispatcher.start().await, "start the dispatcher");
    assert_eq!(handle.decision().mode, DispatchMode::Pull);
    handle
}

/// The login form, as a user fills it in, then the overview.
async fn log_in(ctx: &Ctx<'_>) {
    ctx.goto("/").await;
    let refused = ctx.text("[data-testid=auth-required]").await;
    assert!(refused.contains("needs a token"), "{refused}");
    ctx.goto("/login").await;
    ctx.shot("login").await;
    let token = ctx.find("input[name=token]").await;
    ok(token.send_keys(&ctx.secret).await, "type the token");
    ok(ctx.submit(&ctx.find("form button").await).await, "sign in");
    let mut body = String::new();
    eventually("the login's answer", async || {
        let signed_in = ctx.c.find(Locator::Css("[data-testid=count-pending]"));
        let signed_in = signed_in.await.is_ok();
        body = ctx.c.source().await.map_err(text_err)?;
        let answered = signed_in || body.contains("refused");
        answered.then_some(()).ok_or_else(|| body.clone())
    })
    .await;
    assert!(
        !body.contains(ORIGIN_REFUSED),
        "the browser's own login form was taken for another site's: {body}"
    );
    let cookie = ok(ctx.c.get_named_cookie(SESSION_COOKIE).await, "a cookie");
    assert_eq!(cookie.http_only(), Some(true), "{cookie:?}");
}

/// Check 1, before the workers start: the overview's counts are the table's.
async fn check_counts(ctx: &Ctx<'_>) {
    ctx.goto("/").await;
    ctx.find("[data-testid=count-pending]").await;
    let shown = ctx.page_counts().await;
    let table = db_counts(ctx.db).await;
    assert_eq!(shown, table, "the page's counts (left), the table's");
    let seeded = ["count-pending", "count-failed", "count-retrying"];
    assert_eq!(
        seeded.map(|n| shown[n].as_str()),
        ["2", "3", "1"],
        "{shown:?}"
    );
    ctx.shot("overview").await;
}

/// Check 2: a row enqueued while the overview is open appears without a reload ([`LIVE`] is
/// paused, so the row stays pending); then the record page says why it waits.
async fn check_live_refresh(ctx: &Ctx<'_>) {
    ctx.goto("/").await;
    ctx.find("[data-testid=count-pending]").await;
    let before = ctx.page_counts().await;
    assert_eq!(before["count-pending"], "0", "the queue is idle");
    let marked = ctx.script("window.__marker = 1; return window.__marker;");
    assert_eq!(marked.await, json!(1));
    let id = enqueue(ctx.db, LIVE, "browser-live").await;
    eventually("the new row on the page", async || {
        let (shown, table) = (ctx.page_counts().await, db_counts(ctx.db).await);
        let pending = [&shown, &table].map(|c| c["count-pending"].clone());
        let seen = pending == ["1", "1"];
        seen.then_some(())
            .ok_or(format!("page {shown:?}, table {table:?}"))
    })
    .await;
    let marker = ctx.script("return window.__marker;").await;
    assert_eq!(marker, json!(1), "the page was reloaded");
    assert_eq!(ctx.status(id).await, "pending");
    assert!(!ctx.recorder.ids().contains(&id));
    ctx.goto("/records?key=lead:browser-live").await;
    let head = ctx.text("[data-testid=head-state]").await;
    assert!(head.contains("its event type paused by"), "{head}");
    ctx.shot("record").await;
    let resumed = ctx.db.repository().resume_event_type(LIVE, "test").await;
    assert!(ok(resumed, "resume"));
    ctx.processed(id).await;
}

/// Check 3: the hostile row is text on the failed page and its event page; nothing ran.
async fn check_hostile(ctx: &Ctx<'_>, id: EventId) {
    let row = ok(ctx.db.repository().get_event(id).await, "read").expect("the row");
    assert_eq!(row.event_type, HOSTILE_TYPE);
    assert_eq!(row.last_error.as_deref(), Some(HOSTILE_ERROR));
    assert_eq!(row.status, EventStatus::Failed);
    let injected = "return [typeof window.__pwned,
        document.querySelectorAll('main img, main script, main [onerror]').length];";
    let harmless = json!(["undefined", 0]);
    ctx.goto("/failed").await;
    let css = format!("[data-testid=failed-rows] tr[data-id='{id}']");
    assert_eq!(ctx.text(&format!("{css} td.type")).await, HOSTILE_TYPE);
    assert_eq!(ctx.text(&format!("{css} td.error")).await, HOSTILE_ERROR);
    let types = ctx.text("[data-testid=failed-types]").await;
    assert!(types.contains(HOSTILE_TYPE), "{types}");
    assert_eq!(ctx.script(injected).await, harmless, "/failed");
    ctx.shot("failed").await;
    ctx.goto(&format!("/events/{id}")).await;
    assert_eq!(ctx.text("[data-testid=event-type]").await, HOSTILE_TYPE);
    assert_eq!(ctx.text("[data-testid=event-error]").await, HOSTILE_ERROR);
    assert_eq!(ctx.text("[data-testid=event-status]").await, "failed");
    assert_eq!(ctx.script(injected).await, harmless, "the event page");
    ctx.shot("event").await;
}

/// Check 4: the row's retry button on the failed page; the workers then process it.
async fn check_retry(ctx: &Ctx<'_>, id: EventId) {
    assert_eq!(ctx.status(id).await, "failed");
    ctx.goto("/failed").await;
    let result = ctx
        .act(&format!("tr[data-id='{id}'] button[name=one]"))
        .await;
    assert!(result.contains("Retried 1 failed row"), "{result}");
    ctx.processed(id).await;
    let audit = ctx.audit().await;
    assert!(audit.contains(&"ops retry".to_string()), "{audit:?}");
}

/// Check 5: the overview's pause form stops claims of [`PAUSED`]; its resume button in the
/// paused table restarts them.
async fn check_pause_and_resume(ctx: &Ctx<'_>) {
    ctx.goto("/").await;
    let input = ctx.find("#pause-form input[name=event_type]").await;
    ok(input.send_keys(PAUSED).await, "type the event type");
    let result = ctx.act("#pause-form button").await;
    assert!(result.contains(&format!("Paused {PAUSED}")), "{result}");
    assert_eq!(ctx.paused_by(PAUSED).await.as_deref(), Some("ops"));
    // The workers see a pause within PAUSE_REFRESH (plus a claim under way); nothing tells
    // when, so the row arrives after three refreshes.
    tokio::time::sleep(3 * outbox_events::PAUSE_REFRESH).await;
    let id = enqueue(ctx.db, PAUSED, "browser-paused").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(ctx.status(id).await, "pending", "a paused type was claimed");
    assert!(!ctx.recorder.ids().contains(&id));
    ctx.goto("/").await;
    let row = format!("//table[@data-testid='paused']//tr[td[@class='type' and .='{PAUSED}']]");
    let resume = format!("{row}//button");
    // The live section is swapped every 2 s, and a button found just before a swap is gone:
    // find and click until the action's page shows.
    eventually("the resume button submits", async || {
        let done = ctx.c.find(Locator::Css("[data-testid=action-result]"));
        if done.await.is_ok() {
            return Ok(());
        }
        let button = ctx.c.find(Locator::XPath(&resume)).await;
        ctx.submit(&button.map_err(text_err)?)
            .await
            .map_err(text_err)?;
        Err("clicked".to_string())
    })
    .await;
    let result = ctx.text("[data-testid=action-result]").await;
    assert!(result.contains(&format!("Resumed {PAUSED}")), "{result}");
    assert_eq!(ctx.paused_by(PAUSED).await, None);
    ctx.processed(id).await;
}

/// `POST path` over a raw HTTP/1.1 connection with one more `header` line (or none): the
/// status and the whole answer.
async fn raw_post(addr: SocketAddr, path: &str, header: &str, body: &str) -> (u16, String) {
    let stream = tokio::net::TcpStream::connect(addr).await;
    let mut stream = ok(stream, "connect to the console");
    let header = if header.is_empty() {
        String::new()
    } else {
        format!("{header}\r\n")
    };
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n{header}\r\n{body}",
        body.len()
    );
    ok(stream.write_all(request.as_bytes()).await, "send");
    let mut answer = String::new();
    ok(stream.read_to_string(&mut answer).await, "read the answer");
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok());
    (status.expect("a status line"), answer)
}

/// Check 6: actions without a token (401), or with one but without the CSRF token (403),
/// change nothing.
async fn check_refusals(ctx: &Ctx<'_>, hostile: EventId) {
    ctx.goto("/").await;
    let csrf = ctx.find("#pause-form input[name=csrf]").await;
    let csrf = ok(csrf.attr("value").await, "the CSRF field").expect("a CSRF token");
    let session = ok(ctx.c.get_named_cookie(SESSION_COOKIE).await, "a cookie");
    let cookie = format!("Cookie: {SESSION_COOKIE}={}", session.value());
    let bearer = format!("Authorization: Bearer {}", ctx.secret);
    let wrong = format!("Authorization: Bearer {}", "0".repeat(ctx.secret.len()));
    let (audit, status) = (ctx.audit().await, ctx.status(hostile).await);
    let (pause, retry) = (format!("event_type={REFUSED}"), format!("one={hostile}"));
    let (with_csrf, other) = (format!("csrf={csrf}&"), format!("csrf={}&", "0".repeat(64)));
    let cases: [(_, &str, &str, &str, _); 7] = [
        ("pause", "", &with_csrf, &pause, 401),
        ("retry", "", &with_csrf, &retry, 401),
        ("pause", &wrong, &with_csrf, &pause, 401),
        ("pause", &cookie, "", &pause, 403),
        ("retry", &cookie, "", &retry, 403),
        ("pause", &bearer, "", &pause, 403),
        ("retry", &bearer, &other, &retry, 403),
    ];
    for (action, header, csrf, form, expected) in cases {
        let (path, body) = (format!("/actions/{action}"), format!("{csrf}{form}"));
        let (status, answer) = raw_post(ctx.addr, &path, header, &body).await;
        let what = format!("POST {path} {body} with {header:?}");
        assert_eq!(status, expected, "{what}: {answer}");
        let csrf_refusal = answer.contains("CSRF token is missing or wrong");
        assert_eq!(csrf_refusal, expected == 403, "{what}: {answer}");
    }
    assert_eq!(ctx.paused_by(REFUSED).await, None);
    assert_eq!(ctx.audit().await, audit, "a refused action was audited");
    assert_eq!(
        (ctx.status(hostile).await, status.as_str()),
        ("failed".into(), "failed")
    );
}

/// The pages no check visits: loaded, then photographed.
async fn remaining_pages(ctx: &Ctx<'_>) {
    ctx.goto("/consumers").await;
    let verdict = ctx.text("[data-testid=gate-verdict]").await;
    assert!(verdict.contains("no consumers"), "{verdict}");
    ctx.shot("consumers").await;
    ctx.goto("/retention").await;
    ctx.find("[data-testid=prunable-processed]").await;
    ctx.shot("retention").await;
    ctx.goto("/audit").await;
    let audit = ctx.text("[data-testid=audit]").await;
    for action in ["retry", "pause", "resume"] {
        assert!(audit.contains(action), "no {action}: {audit}");
    }
    ctx.shot("audit").await;
}

/// The whole test, on a fresh database.
async fn run(db: &TestDb) {
    let ((retried, hostile), pending) = seed(db).await;
    let secret = uuid::Uuid::new_v4().simple().to_string();
    let stop = CancellationToken::new();
    let tokens = vec![NamedToken::operator("ops", &secret)];
    let config = ConsoleConfig {
        allow_actions: true,
        tokens,
        ..ConsoleConfig::default()
    };
    let console = ok(Console::new(db.db.clone(), Vec::new(), config), "a console");
    let listener = ok(tokio::net::TcpListener::bind("127.0.0.1:0").await, "a port");
    let addr = ok(listener.local_addr(), "its address");
    let server = tokio::spawn(outbox_console::serve(listener, console, stop.clone()));
    let browser = Browser::start().await;
    let c = browser.client.as_ref().expect("a session");
    let (shots, recorder) = (screenshot_dir(), Recorder::default());
    let ctx = Ctx {
        db,
        c,
        addr,
        secret,
        shots,
        recorder,
    };
    log_in(&ctx).await;
    check_counts(&ctx).await;
    // Paused before the workers' first read of the paused types, which precedes any claim.
    let paused = db.repository().pause_event_type(LIVE, "test").await;
    assert!(ok(paused, "pause"));
    let dispatcher = start_dispatcher(db, &ctx.recorder).await;
    for id in &pending {
        ctx.processed(*id).await;
    }
    check_live_refresh(&ctx).await;
    check_hostile(&ctx, hostile).await;
    check_retry(&ctx, retried).await;
    check_pause_and_resume(&ctx).await;
    check_refusals(&ctx, hostile).await;
    remaining_pages(&ctx).await;
    browser.close().await;
    let report = dispatcher.shutdown().await;
    assert!(report.graceful, "the dispatcher stopped gracefully");
    stop.cancel();
    ok(ok(server.await, "the server task"), "the console served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_a_browser() {
    if !browser_available() {
        return;
    }
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let started = Instant::now();
    // A WebDriver command that never answers would hang the test: bound the whole of it.
    let run = tokio::time::timeout(Duration::from_secs(300), run(&db));
    ok(run.await, "the browser test's run");
    println!("the browser test passed in {:?}", started.elapsed());
}
