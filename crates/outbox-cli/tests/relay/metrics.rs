//! `outbox relay --metrics-addr`: a Prometheus scrape during a relay run, checked against the
//! database. The relay keeps running (no `--until-drained`) once its share of the queue is
//! drained, so its figures are compared with a table that no longer changes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use outbox_persistence::{EventFilter, EventStatus};
use outbox_relay::test_support::NatsServer;
use outbox_tests::{TestDb, backend_tests};

use crate::drain::seed;
use crate::{borrowed, open_env, outbox_command};

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

async fn processed(db: &TestDb) -> f64 {
    let filter = EventFilter::new().statuses([EventStatus::Processed]);
    db.repository().list_events(filter).await.unwrap().len() as f64
}

async fn a_scrape_during_a_relay_run_matches_the_database(db: TestDb) {
    let nats = NatsServer::start();
    seed(&db).await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let env = open_env(&nats);
    let args = [
        "relay",
        "--create-stream",
        "--workers",
        "4",
        "--metrics-addr",
        &addr,
        "--gauges-every-ms",
        "200",
    ];
    let mut child = outbox_command(&db.url, &args, &borrowed(&env))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start outbox relay");

    // Wait until the relay's 300 events are processed and a gauge read has seen it.
    let began = Instant::now();
    let total = 300.0;
    let text = loop {
        assert!(began.elapsed() < Duration::from_secs(60), "not drained");
        if processed(&db).await == total
            && let Some(text) = scrape(port)
            && sample(&text, "outbox_rows", &["status=\"processed\""]) == total
        {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    let rows = db
        .repository()
        .list_events(EventFilter::new())
        .await
        .unwrap();
    let counted: f64 = rows.iter().map(|r| f64::from(r.retry_count)).sum();

    assert_eq!(
        sample(&text, "outbox_attempts_total", &["outcome=\"processed\""]),
        total,
        "{text}"
    );
    assert_eq!(
        sample(&text, "outbox_attempts_total", &["outcome=\"retried\""]),
        counted,
        "{text}"
    );
    // Claims a batched attempt gave back unrun (behind an older event of their record that
    // failed) are claimed again: each of those claims ended as `not_run`.
    let not_run = sample(&text, "outbox_attempts_total", &["outcome=\"not_run\""]);
    assert_eq!(
        sample(&text, "outbox_claims_total", &[]),
        total + counted + not_run,
        "{text}"
    );
    // The event type the relay does not own is still pending, and the gauges say so.
    assert_eq!(
        sample(&text, "outbox_rows", &["status=\"pending\""]),
        1.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "outbox_rows", &["status=\"processing\""]),
        0.0
    );
    assert_eq!(
        sample(&text, "outbox_enqueue_to_processed_seconds_count", &[]),
        total,
        "{text}"
    );
    for forbidden in ["record_key", "event_id", "R001"] {
        assert!(!text.contains(forbidden), "{forbidden} in\n{text}");
    }
}

backend_tests!(a_scrape_during_a_relay_run_matches_the_database);
