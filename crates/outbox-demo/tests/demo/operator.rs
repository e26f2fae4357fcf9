//! The operator commands end to end: migrate, seed, work, verify, status, retry, backfill,
//! explain, consumers and the gate, against a real database.

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use chrono::Utc;
use outbox_tests::{Backend, RawRow, TestDb, backend_tests};
use serde_json::Value;

use super::{outbox, outbox_command, outbox_with_env, scratch_dir, stderr, stdout};

/// What a process writes to stderr before a poison event aborts it (`demo::POISON_LOG`).
const POISON_LOG: &str = "poison event: aborting the process";
/// The signal of `std::process::abort`.
const SIGABRT: i32 = 6;

fn json(o: &std::process::Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(o)))
}

fn lead(id: &str) -> String {
    format!(r#"{{"object":"Lead","record_id":"{id}","snapshot":{{}}}}"#)
}

/// `migrate` twice, `seed`, `status`, `work --until-drained` and `verify` on one database.
async fn seed_work_verify(db: TestDb) {
    for _ in 0..2 {
        let o = outbox(&db.url, &["migrate"]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let o = outbox(
        &db.url,
        &[
            "seed",
            "--events",
            "300",
            "--records",
            "30",
            "--fault-rate",
            "0.1",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("seeded 300 events over 30 records"),
        "{}",
        stdout(&o)
    );
    let status = json(&outbox(&db.url, &["status", "--json"]));
    assert_eq!(status["pending"], 300);
    let o = outbox(
        &db.url,
        &[
            "work",
            "--workers",
            "4",
            "--until-drained",
            "--retry-delay-ms",
            "10",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let status = json(&outbox(&db.url, &["status", "--json"]));
    assert_eq!(status["processed"], 300, "{status}");
    let v = outbox(&db.url, &["verify", "--json"]);
    assert!(v.status.success(), "{}", stdout(&v));
    let v = json(&v);
    assert!(
        v["retries"].as_i64().unwrap() > 0,
        "marked events failed their first attempt"
    );
    let text = outbox(&db.url, &["status"]);
    assert!(
        stdout(&text).contains("processed    300"),
        "{}",
        stdout(&text)
    );
}

/// `retry` returns failed rows to pending, by id or by event type, and says when nothing
/// matched.
async fn retry_failed_rows(db: TestDb) {
    let now = Utc::now();
    let a = RawRow {
        status: "failed",
        event_type: "a".into(),
        ..RawRow::pending(None, now)
    };
    let b = RawRow {
        status: "failed",
        event_type: "b".into(),
        ..RawRow::pending(None, now)
    };
    let c = RawRow {
        status: "failed",
        event_type: "b".into(),
        ..RawRow::pending(None, now)
    };
    for r in [&a, &b, &c] {
        db.insert_raw(r).await;
    }
    let o = outbox(&db.url, &["retry", "--id", &a.id.to_string()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("1 failed row(s) returned to pending"));
    let o = outbox(&db.url, &["retry", "--id", &a.id.to_string()]);
    assert!(
        !o.status.success(),
        "retrying a row that is not failed is an error"
    );
    let o = outbox(&db.url, &["retry", "--failed", "--event-type", "b"]);
    assert!(
        stdout(&o).contains("2 failed row(s) returned to pending"),
        "{}",
        stdout(&o)
    );
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'pending'")
            .await,
        3
    );
    let o = outbox(&db.url, &["retry"]);
    assert!(!o.status.success(), "retry needs --id or --failed");
}

/// `backfill-record-keys` sets missing keys, reports what it cannot derive, is idempotent, and a
/// dry run changes nothing; the gate fails while keys are missing and passes after.
async fn backfill_and_gate(db: TestDb) {
    let now = Utc::now();
    let legacy = RawRow {
        payload: lead("L1"),
        ..RawRow::pending(None, now)
    };
    let broken = RawRow {
        payload: "{oops".into(),
        ..RawRow::pending(None, now)
    };
    db.insert_raw(&legacy).await;
    db.insert_raw(&broken).await;

    let gate = outbox(&db.url, &["gate"]);
    assert_eq!(gate.status.code(), Some(1));
    assert!(
        stdout(&gate).contains("1 non-terminal row(s) lack the RecordKey their payload derives"),
        "{}",
        stdout(&gate)
    );

    // With OUTBOX_PULL_WORKER=true and a failing gate, `work` fails closed to the legacy path.
    let o = outbox_with_env(
        &db.url,
        &["work", "--until-drained", "--max-retry-attempts", "1"],
        &[("OUTBOX_PULL_WORKER", "true")],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the rollout gate refuses"),
        "{}",
        stderr(&o)
    );
    assert!(stdout(&o).contains("Legacy mode"), "{}", stdout(&o));

    let o = outbox(&db.url, &["retry", "--failed"]);
    assert!(o.status.success());
    let dry = outbox(&db.url, &["backfill-record-keys", "--dry-run"]);
    assert!(stdout(&dry).contains("1 keys missing"), "{}", stdout(&dry));
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE RecordKey IS NOT NULL")
            .await,
        0
    );
    let o = outbox(&db.url, &["backfill-record-keys", "--batch", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("1 keys set") && out.contains("1 underivable"),
        "{out}"
    );
    assert!(out.contains(&format!("underivable {}", broken.id)), "{out}");
    assert!(stderr(&o).contains("resume with --after"), "{}", stderr(&o));
    let again = outbox(&db.url, &["backfill-record-keys"]);
    assert!(
        stdout(&again).contains("0 keys set, 1 already set"),
        "{}",
        stdout(&again)
    );

    let gate = outbox(&db.url, &["gate"]);
    assert!(gate.status.success(), "{}", stdout(&gate));
    assert!(stdout(&gate).contains("gate passed"));
    let o = outbox_with_env(
        &db.url,
        &["work", "--until-drained"],
        &[("OUTBOX_PULL_WORKER", "true")],
    );
    assert!(stdout(&o).contains("Pull mode"), "{}", stdout(&o));
}

/// `explain` prints the PostgreSQL plans, and refuses SQLite with a clear message.
async fn explain_plans(db: TestDb) {
    let o = outbox(&db.url, &["explain"]);
    match db.backend() {
        Backend::Postgres => {
            assert!(o.status.success(), "{}", stderr(&o));
            let out = stdout(&o);
            assert!(
                out.contains("eligible-event query") && out.contains("LockRows"),
                "{out}"
            );
        }
        Backend::Sqlite => {
            assert!(!o.status.success());
            assert!(
                stderr(&o).contains("prints PostgreSQL plans"),
                "{}",
                stderr(&o)
            );
        }
    }
}

/// `consumers` prints the map of every registered consumer with its verdict.
async fn consumer_map(db: TestDb) {
    let o = outbox(&db.url, &["consumers", "--json"]);
    assert!(o.status.success());
    let rows = json(&o);
    let rows = rows.as_array().unwrap();
    let mail = rows
        .iter()
        .find(|r| r["consumer"] == "welcome-mail")
        .unwrap();
    assert_eq!(mail["verdict"], "protected");
    assert!(
        mail["contract_or_exclusion"]
            .as_str()
            .unwrap()
            .contains("effect ledger")
    );
    assert!(rows.iter().any(|r| {
        r["effect_class"]
            .as_str()
            .unwrap()
            .starts_with("natural-key create")
    }));
    let text = stdout(&outbox(&db.url, &["consumers"]));
    assert!(text.starts_with("| event type | consumer |"), "{text}");
}

/// A poison event aborts every `outbox-demo work` process that runs it. Each stale reclaim counts
/// the dead attempt, so after `MaxRetryAttempts` (3) deaths the next claim writes it `failed`
/// ("worker died: …"), its record's younger event runs, and `verify` passes.
async fn poison_event_ends_failed(db: TestDb) {
    let dir = scratch_dir("poison");
    let o = outbox(
        &db.url,
        &[
            "seed",
            "--events",
            "40",
            "--records",
            "8",
            "--poison-events",
            "1",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("1 poison"), "{}", stdout(&o));
    let work = [
        "work",
        "--pull-worker",
        "true",
        "--until-drained",
        "--workers",
        "2",
        "--heartbeat-ms",
        "100",
        "--stale-after-ms",
        "600",
        "--retry-delay-ms",
        "10",
        "--max-retry-attempts",
        "3",
    ];
    let (mut aborts, mut drained) = (0, false);
    // The supervisor: start another process until one drains the outbox.
    for _ in 0..10 {
        let o = outbox_command(&dir, &db.url, &work)
            .output()
            .expect("run outbox work");
        if o.status.success() {
            drained = true;
            break;
        }
        assert_eq!(o.status.signal(), Some(SIGABRT), "{}", stderr(&o));
        assert!(stderr(&o).contains(POISON_LOG), "{}", stderr(&o));
        aborts += 1;
    }
    assert!(drained, "no process drained the outbox in 10 runs");
    assert_eq!(aborts, 3, "one death per allowed attempt");
    let poison = db
        .count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE RecordKey = 'account:P000000'
               AND Status = 'failed' AND RetryCount = 3 AND LastError LIKE 'worker died:%'",
        )
        .await;
    assert_eq!(
        poison, 1,
        "the poison event is failed with its deaths counted"
    );
    let successor = db
        .count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE RecordKey = 'account:P000000'
               AND Status = 'processed'",
        )
        .await;
    assert_eq!(successor, 1, "the record's younger event ran");
    let v = outbox(&db.url, &["verify", "--json"]);
    assert!(v.status.success(), "{}", stdout(&v));
    let v = json(&v);
    assert_eq!(
        (v["poison"].as_i64(), v["poison_failed"].as_i64()),
        (Some(1), Some(1))
    );
    assert_eq!(v["poison_deaths"], 3);
    assert_eq!(v["worker_deaths"], 3);
    std::fs::remove_dir_all(&dir).ok();
}

/// `verify` fails when a process that lived lost a claim. On PostgreSQL the claim is really
/// taken over: the slow event's `LastModifiedDate` is moved an hour back while its handler
/// sleeps, so it is reclaimed as stale and the first worker's fenced writes find it lost.
/// SQLite cannot be made to lose a claim from outside (the attempt holds the only write lock
/// while its handler runs), so there the run's record in the side store says it lost one.
async fn verify_fails_on_a_lost_claim(db: TestDb) {
    let dir = scratch_dir("lost-claim");
    let o = outbox(
        &db.url,
        &[
            "seed",
            "--events",
            "4",
            "--records",
            "2",
            "--slow-events",
            "1",
            "--slow-ms",
            "3000",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let work = [
        "work",
        "--pull-worker",
        "true",
        "--until-drained",
        "--workers",
        "2",
        "--heartbeat-ms",
        "200",
        "--stale-after-ms",
        "1000",
        "--retry-delay-ms",
        "10",
    ];
    match db.backend() {
        Backend::Postgres => {
            let child = outbox_command(&dir, &db.url, &work)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start outbox work");
            let running = "SELECT count(*) FROM _System_OutboxEvent
                WHERE EventType = 'report.slow' AND Status = 'processing'";
            let start = Instant::now();
            while db.count(running).await == 0 {
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "the slow event never ran"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            db.execute(
                "UPDATE _System_OutboxEvent SET LastModifiedDate = LastModifiedDate - interval '1 hour'
                 WHERE EventType = 'report.slow' AND Status = 'processing'",
            )
            .await;
            let o = child.wait_with_output().expect("wait for outbox work");
            assert!(o.status.success(), "{}", stderr(&o));
            assert!(!stdout(&o).contains(" 0 lost claims"), "{}", stdout(&o));
        }
        Backend::Sqlite => {
            let o = outbox_command(&dir, &db.url, &work)
                .output()
                .expect("run outbox work");
            assert!(o.status.success(), "{}", stderr(&o));
            let side = sqlx::SqlitePool::connect(&format!("{}-mailbox.db", db.url))
                .await
                .expect("open the side store");
            sqlx::query("UPDATE DemoWorkRun SET LostClaims = 1")
                .execute(&side)
                .await
                .expect("record a lost claim");
            side.close().await;
        }
    }
    let v = outbox(&db.url, &["verify", "--json"]);
    assert!(!v.status.success(), "verify must fail: {}", stdout(&v));
    let v = json(&v);
    assert!(v["lost_claims"].as_i64().unwrap() >= 1, "{v}");
    let lost = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "no claim lost by a live process")
        .unwrap();
    assert_eq!(lost["ok"], false, "{lost}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `outbox demo` on a database that already holds outbox events, all of them processed,
/// refuses before it seeds anything: its verification reads every row of its database, and a
/// second run on one database counted the first run's rows as its own (2026-12-07: twice the
/// processed rows, its retry audit failed with nothing wrong).
async fn demo_refuses_a_database_with_events(db: TestDb) {
    let o = outbox(&db.url, &["migrate"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = outbox(&db.url, &["seed", "--events", "20", "--records", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    db.execute("UPDATE _System_OutboxEvent SET Status = 'processed'")
        .await;
    let o = outbox(&db.url, &[]);
    assert!(!o.status.success(), "the demo ran: {}", stdout(&o));
    assert!(
        stderr(&o).contains("already holds 20 outbox events (0 unfinished)"),
        "{}",
        stderr(&o)
    );
    let rows = db.count("SELECT count(*) FROM _System_OutboxEvent").await;
    assert_eq!(rows, 20, "the demo seeded nothing");
}

backend_tests!(
    demo_refuses_a_database_with_events,
    poison_event_ends_failed,
    verify_fails_on_a_lost_claim,
    seed_work_verify,
    retry_failed_rows,
    backfill_and_gate,
    explain_plans,
    consumer_map
);
