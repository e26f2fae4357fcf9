//! `outbox status --read-database-url`: read from a hot standby made by `cargo xtask test`
//! (`OUTBOX_TEST_STANDBY_URL`; skipped without one unless `OUTBOX_REQUIRE_STANDBY=1`), saying
//! how far behind it is; a standby that is not there is a clear error within seconds.

use std::time::{Duration, Instant};

use outbox_persistence::NewEvent;
use outbox_tests::TestDb;

use super::{outbox, stderr, stdout};

async fn status_reads_a_standby() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let Ok(base) = std::env::var("OUTBOX_TEST_STANDBY_URL") else {
        let required = std::env::var("OUTBOX_REQUIRE_STANDBY").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "OUTBOX_REQUIRE_STANDBY=1 without OUTBOX_TEST_STANDBY_URL"
        );
        return;
    };
    let name = db
        .url
        .rsplit('/')
        .next()
        .unwrap()
        .split('?')
        .next()
        .unwrap();
    let standby = format!("{}/{name}", base.rsplit_once('/').unwrap().0);
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let lead = r#"{"object":"Lead","record_id":"s1","snapshot":{}}"#;
    repo.enqueue(&mut tx, &[NewEvent::new("lead.updated", lead)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The standby replays the new database and its row within moments.
    let started = Instant::now();
    let doc = loop {
        let out = outbox(
            &db.url,
            &["status", "--json", "--read-database-url", &standby],
        );
        if out.status.success() {
            let doc: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
            if doc["pending"] == 1 {
                assert!(
                    stderr(&out).contains("read from a hot standby"),
                    "{}",
                    stderr(&out)
                );
                break doc;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{}",
            stderr(&out)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(doc["pending"], 1);
    // Replay paused, a row more on the primary: the standby's status does not have it.
    let psql = |sql: &str| {
        let out = std::process::Command::new("psql")
            .args([standby.as_str(), "-qAtc", sql])
            .output()
            .expect("psql");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    psql("SELECT pg_wal_replay_pause()");
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &[NewEvent::new("lead.updated", lead)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let out = outbox(
        &db.url,
        &["status", "--json", "--read-database-url", &standby],
    );
    let primary = outbox(&db.url, &["status", "--json"]);
    psql("SELECT pg_wal_replay_resume()");
    let doc: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let on_primary: serde_json::Value = serde_json::from_str(&stdout(&primary)).unwrap();
    assert_eq!(
        (doc["pending"].clone(), on_primary["pending"].clone()),
        (1.into(), 2.into())
    );
    // No standby there: a clear error, soon.
    let authority = {
        let rest = base.split_once("://").map_or(base.as_str(), |(_, r)| r);
        let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
        rest.split('/').next().unwrap_or(rest).to_string()
    };
    let gone = standby.replacen(&authority, "127.0.0.1:1", 1);
    let started = Instant::now();
    let out = outbox(&db.url, &["status", "--read-database-url", &gone]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("cannot read from the standby"),
        "{}",
        stderr(&out)
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_status_reads_a_standby() {
    status_reads_a_standby().await;
}
