//! The console reading from a hot standby (issue 40): every page reads the standby, actions and
//! their audit rows land on the primary, the overview says how far behind the standby is, and a
//! standby that stops answers with a clear error within seconds. Against a real standby made
//! by `cargo xtask test` with `pg_basebackup -R` (`OUTBOX_TEST_STANDBY_URL`); skipped without
//! one unless `OUTBOX_REQUIRE_STANDBY=1` (CI).

use std::time::{Duration, Instant};

use outbox_console::{Console, ConsoleConfig};
use outbox_persistence::{ConnectConfig, Database, EventStatus};
use outbox_tests::TestDb;
use tokio::net::{TcpListener, TcpStream};

use crate::net::*;
use crate::support::*;

/// The standby's URL for the test's database, once the standby has it; `None` without a
/// standby (and not required).
async fn standby_of(db: &TestDb) -> Option<String> {
    let Ok(base) = std::env::var("OUTBOX_TEST_STANDBY_URL") else {
        let required = std::env::var("OUTBOX_REQUIRE_STANDBY").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "OUTBOX_REQUIRE_STANDBY=1 without OUTBOX_TEST_STANDBY_URL"
        );
        eprintln!("no hot standby (OUTBOX_TEST_STANDBY_URL): skipping");
        return None;
    };
    let name = db.url.rsplit('/').next().expect("a database name");
    let name = name.split('?').next().unwrap_or(name);
    let root = base
        .rsplit_once('/')
        .map_or(base.as_str(), |(root, _)| root);
    Some(format!("{root}/{name}"))
}

/// The `host:port` of a URL.
fn authority(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
    rest.split('/').next().unwrap_or(rest)
}

/// Waits until the standby has replayed everything the primary has written so far.
async fn caught_up(db: &TestDb, standby: &Database) {
    let Database::Postgres(primary) = &db.db else {
        panic!("a PostgreSQL primary")
    };
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(primary)
        .await
        .unwrap();
    let started = Instant::now();
    loop {
        let Database::Postgres(pool) = standby else {
            panic!("a PostgreSQL standby")
        };
        let done: Option<bool> =
            sqlx::query_scalar("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
                .bind(&lsn)
                .fetch_one(pool)
                .await
                .ok();
        if done == Some(true) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the standby did not catch up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Connects to the standby's copy of the test's database (it arrives with the replay of its
/// `CREATE DATABASE`).
async fn connect(url: &str) -> Database {
    let config = ConnectConfig {
        acquire_timeout: Duration::from_secs(3),
        ..ConnectConfig::default()
    };
    let started = Instant::now();
    loop {
        match Database::connect(url, config.clone()).await {
            Ok(db) => return db,
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the standby's database: {e:#}"),
        }
    }
}

async fn the_console_reads_a_standby_and_acts_on_the_primary() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let Some(url) = standby_of(&db).await else {
        return;
    };
    let failed = failed_row(&db, "lead.updated", "boom", Some("lead:1")).await;
    let standby = connect(&url).await;
    caught_up(&db, &standby).await;
    let Database::Postgres(standby_pool) = &standby else {
        unreachable!()
    };
    // Replay paused: what the primary writes now, the standby does not show. Resumed however
    // the test ends (a panic included): the standby is shared with other tests.
    sqlx::query("SELECT pg_wal_replay_pause()")
        .execute(standby_pool)
        .await
        .unwrap();
    let paused = ReplayPaused(url.clone());
    let pending = outbox_tests::RawRow::pending(Some("lead:2"), chrono::Utc::now());
    db.insert_raw(&pending).await;
    let config = ConsoleConfig {
        allow_actions: true,
        ..ConsoleConfig::default()
    };
    let console = Console::new(db.db.clone(), Vec::new(), config)
        .unwrap()
        .reading_from(standby.clone());
    let page = get(&console, "/", None).await;
    assert!(page.body.contains("replica-lag"), "{}", page.body);
    let shown = page.body.contains(r#"data-testid="count-pending">0<"#);
    // The action goes to the primary, with its audit row.
    let csrf = csrf_of(&get(&console, "/failed", None).await.body);
    let retried = post(
        &console,
        "/actions/retry",
        None,
        &format!("csrf={csrf}&one={failed}"),
    )
    .await;
    let on_primary = db
        .repository()
        .get_event(failed)
        .await
        .unwrap()
        .unwrap()
        .status;
    let audit = db.repository().audit_log(5).await.unwrap();
    let on_standby = console_failed_count(&console).await;
    drop(paused);
    assert!(shown, "the overview read the primary: {}", page.body);
    assert!(
        page.body.contains("Read from a hot standby"),
        "{}",
        page.body
    );
    assert_eq!(
        retried.status,
        axum::http::StatusCode::OK,
        "{}",
        retried.body
    );
    assert_eq!(
        on_primary,
        EventStatus::Pending,
        "the retry landed on the primary"
    );
    assert_eq!(audit.len(), 1, "its audit row too");
    assert!(
        on_standby,
        "the standby (replay paused) still shows the row failed"
    );
    // Replay resumed: the standby catches up and the console shows the primary's rows.
    caught_up(&db, &standby).await;
    tokio::time::sleep(outbox_console::OVERVIEW_REFRESH).await;
    let page = get(&console, "/", None).await;
    assert!(
        page.body.contains(r#"data-testid="count-pending">2<"#),
        "{}",
        page.body
    );
}

/// The standby's replay, paused until this is dropped (by `psql`, so that a panicking test
/// resumes it too).
struct ReplayPaused(String);

impl Drop for ReplayPaused {
    fn drop(&mut self) {
        let _ = std::process::Command::new("psql")
            .args([self.0.as_str(), "-qAtc", "SELECT pg_wal_replay_resume()"])
            .output();
    }
}

/// Whether the console's failed page still lists a failed row (read from the standby).
async fn console_failed_count(console: &Console) -> bool {
    let page = get(console, "/failed", None).await;
    page.body.contains(r#"data-testid="failed-shown">1<"#)
}

/// A standby that stops: the console answers a clear error within seconds (the read pool
/// gives up on a connection after 3 s), not a hang. The standby is reached through a TCP relay
/// the test closes.
async fn a_stopped_standby_is_a_clear_error_not_a_hang() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let Some(url) = standby_of(&db).await else {
        return;
    };
    let target = authority(&url).to_string();
    let relay = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = relay.local_addr().unwrap().port();
    let relaying = tokio::spawn(async move {
        let mut open = tokio::task::JoinSet::new();
        while let Ok((mut client, _)) = relay.accept().await {
            let target = target.clone();
            open.spawn(async move {
                if let Ok(mut server) = TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    let relayed = url.replacen(authority(&url), &format!("127.0.0.1:{port}"), 1);
    let standby = connect(&relayed).await;
    // The database arrives with the replay of its creation, its tables with that of the
    // migrations: the first page must not race the replay.
    caught_up(&db, &standby).await;
    let console = Console::new(db.db.clone(), Vec::new(), ConsoleConfig::default())
        .unwrap()
        .reading_from(standby);
    let served = Served::start(console).await;
    assert_eq!(raw_get(served.addr, "/failed", &[]).await.status, 200);
    // The standby goes away: the relay and every connection through it close.
    relaying.abort();
    let _ = relaying.await;
    let started = Instant::now();
    let page = raw_get(served.addr, "/failed", &[]).await;
    let took = started.elapsed();
    assert_eq!(page.status, 500, "{}", page.text());
    assert!(
        page.text().contains("data-testid=\"standby-hint\""),
        "{}",
        page.text()
    );
    assert!(took < Duration::from_secs(10), "answered after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_console_reads_a_standby_and_acts_on_the_primary() {
    the_console_reads_a_standby_and_acts_on_the_primary().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_stopped_standby_is_a_clear_error_not_a_hang() {
    a_stopped_standby_is_a_clear_error_not_a_hang().await;
}
