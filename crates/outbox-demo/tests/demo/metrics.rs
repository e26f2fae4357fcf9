//! `outbox-demo work --metrics-addr`: a Prometheus scrape during a run, checked against the
//! database. The work process keeps running (no `--until-drained`) once the queue is drained,
//! so its figures can be compared with a table that no longer changes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use outbox_tests::{TestDb, backend_tests};
use serde_json::Value;

use super::{outbox, outbox_command, scratch_dir, stderr};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn scrape(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    Some(text)
}

/// The sum of every sample of `name` whose labels contain all of `labels`.
fn sample(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn status(url: &str) -> Value {
    let o = outbox(url, &["status", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("status JSON")
}

async fn a_scrape_during_a_run_matches_the_database(db: TestDb) {
    let o = outbox(&db.url, &["migrate"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = outbox(
        &db.url,
        &[
            "seed",
            "--events",
            "200",
            "--records",
            "20",
            "--fault-rate",
            "0.1",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let port = free_port();
    let dir = scratch_dir("metrics");
    let addr = format!("127.0.0.1:{port}");
    let mut child = outbox_command(
        &dir,
        &db.url,
        &[
            "work",
            "--workers",
            "4",
            "--retry-delay-ms",
            "10",
            "--pull-worker",
            "true",
            "--metrics-addr",
            &addr,
            "--gauges-every-ms",
            "200",
        ],
    )
    .spawn()
    .expect("start outbox-demo work");

    // Wait until the queue is drained and a gauge read has seen it (every 200 ms).
    let began = Instant::now();
    let total = 200.0;
    let text = loop {
        assert!(began.elapsed() < Duration::from_secs(90), "not drained");
        if status(&db.url)["processed"].as_f64() == Some(total)
            && let Some(text) = scrape(port)
            && sample(&text, "outbox_rows", &["status=\"processed\""]) == total
        {
            break text;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    let processed = total;
    // The failures the workers counted are the failures the rows carry.
    let o = outbox(&db.url, &["events", "--json", "--limit", "1000"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<Value> = serde_json::from_slice(&o.stdout).expect("events JSON");
    let counted: f64 = rows
        .iter()
        .map(|r| r["retry_count"].as_f64().unwrap())
        .sum();

    assert_eq!(
        sample(&text, "outbox_attempts_total", &["outcome=\"processed\""]),
        processed,
        "{text}"
    );
    // Every claim ended in an attempt: processed ones, the retried first attempts of the
    // events the seed marked to fail once, and the claims given back unrun.
    let retried = sample(&text, "outbox_attempts_total", &["outcome=\"retried\""]);
    assert!(retried > 0.0, "the marked events failed once\n{text}");
    assert_eq!(retried, counted, "{text}");
    // Claims a batched attempt gave back unrun (behind an older event of their record that
    // failed) are claimed again: each of those claims ended as `not_run`.
    let not_run = sample(&text, "outbox_attempts_total", &["outcome=\"not_run\""]);
    assert_eq!(
        sample(&text, "outbox_claims_total", &[]),
        total + retried + not_run,
        "{text}"
    );
    assert_eq!(
        sample(&text, "outbox_rows", &["status=\"processing\""]),
        0.0
    );
    assert_eq!(sample(&text, "outbox_rows", &["status=\"pending\""]), 0.0);
    assert_eq!(
        sample(&text, "outbox_enqueue_to_processed_seconds_count", &[]),
        processed,
        "{text}"
    );
    assert!(
        text.contains("outbox_attempt_duration_seconds_bucket{"),
        "{text}"
    );
    assert!(text.contains("# HELP outbox_attempts_total"), "{text}");
    for forbidden in ["record_key", "event_id", "lead:"] {
        assert!(!text.contains(forbidden), "{forbidden} in\n{text}");
    }
}

backend_tests!(a_scrape_during_a_run_matches_the_database);
