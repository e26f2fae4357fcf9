//! Shared set-up: the Python receiver (the official verifier), endpoints on it, a workload of
//! keyed events, and the dispatcher with the webhook handlers.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_events::persistence::EventFilter;
use outbox_events::{
    DispatchMode, Dispatcher, DispatcherHandle, EventStatus, Handlers, NewEvent, OutboxRepository,
    WorkerConfig,
};
use outbox_webhooks::{AddressPolicy, WebhookConfig, Webhooks};
use serde_json::Value;

/// The source event types.
pub const TYPES: [&str; 2] = ["account.updated", "lead.updated"];

/// The receiver: a `receiver.py` child process on a free port of its own.
pub struct Receiver {
    child: Option<Child>,
    dir: PathBuf,
    pub port: u16,
    control: Value,
}

impl Receiver {
    /// Starts one, answering 200 to every endpoint until told otherwise.
    pub fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "outbox-webhooks-{}-{}",
            std::process::id(),
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let control = serde_json::json!({"secrets": {}, "behaviour": {}, "fail_records": {}});
        std::fs::write(dir.join("control.json"), control.to_string()).expect("write the control");
        let (child, port) = Self::spawn(&dir, 0);
        Self {
            child: Some(child),
            dir,
            port,
            control,
        }
    }

    /// Stops it: connections to its port are refused until [`Receiver::restart`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on its port, appending to the same log.
    pub fn restart(&mut self) {
        self.stop();
        let (child, port) = Self::spawn(&self.dir, self.port);
        assert_eq!(port, self.port);
        self.child = Some(child);
    }

    fn spawn(dir: &std::path::Path, port: u16) -> (Child, u16) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/webhooks/receiver.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(dir.join("control.json"))
            .arg(dir.join("log.jsonl"))
            .arg(port.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 runs (the receiver needs `pip install standardwebhooks`)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("its stdout"))
            .read_line(&mut line)
            .expect("the receiver prints its port");
        let port = line.trim().parse().unwrap_or_else(|_| {
            panic!("the receiver did not start (is `standardwebhooks` installed?): {line:?}")
        });
        (child, port)
    }

    /// The URL of endpoint `name` on it.
    pub fn url(&self, name: &str) -> String {
        format!("http://127.0.0.1:{}/{name}", self.port)
    }

    fn write(&self) {
        let tmp = self.dir.join("control.tmp");
        std::fs::write(&tmp, self.control.to_string()).expect("write the control");
        std::fs::rename(tmp, self.dir.join("control.json")).expect("swap the control");
    }

    /// The secrets the receiver verifies `name`'s deliveries with, each on its own.
    pub fn secrets(&mut self, name: &str, secrets: &[&str]) {
        self.control["secrets"][name] = serde_json::json!(secrets);
        self.write();
    }

    /// How the receiver answers `name`: `ok`, `fail`, `gone`, `slow:<ms>`, `retry-after:<s>`.
    pub fn behave(&mut self, name: &str, behaviour: &str) {
        self.control["behaviour"][name] = serde_json::json!(behaviour);
        self.write();
    }

    /// Deliveries of `records` to `name` get 500.
    pub fn fail_records(&mut self, name: &str, records: &[&str]) {
        self.control["fail_records"][name] = serde_json::json!(records);
        self.write();
    }

    /// Every request received so far, in the order answered. A line the receiver is still
    /// writing (a long body goes out in several writes) is left for the next read.
    pub fn log(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(self.dir.join("log.jsonl")).unwrap_or_default();
        let complete = text.rfind('\n').map_or("", |end| &text[..=end]);
        complete
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends may reach loopback (the receiver), as an operator would allow a subnet.
pub fn config() -> WebhookConfig {
    WebhookConfig::default()
        .with_addresses(AddressPolicy::default().allow("127.0.0.0/8".parse().unwrap()))
        .with_retry_schedule(vec![Duration::from_millis(100), Duration::from_millis(300)])
        .with_timeouts(Duration::from_secs(2), Duration::from_secs(5))
}

/// Worker settings that make retries quick.
pub fn fast(workers: usize) -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .with_workers(workers)
        .with_poll_interval(Duration::from_millis(50))
        .with_heartbeat_interval(Duration::from_millis(200))
        .with_stale_after(Duration::from_millis(1_000))
        .with_retry_delay(Duration::from_millis(50))
        .with_max_retry_delay(Duration::from_millis(300))
        .with_max_retry_attempts(1_000)
        .with_shutdown_timeout(Duration::from_secs(5))
}

/// The dispatcher with the webhook handlers for [`TYPES`]; the rollout gate must pass (the
/// delivery runs through the ledger).
pub async fn dispatcher(
    repo: &Arc<dyn OutboxRepository>,
    hooks: &Webhooks,
    workers: usize,
) -> DispatcherHandle {
    dispatcher_with(repo, hooks, fast(workers)).await
}

/// [`dispatcher`] with `worker`.
pub async fn dispatcher_with(
    repo: &Arc<dyn OutboxRepository>,
    hooks: &Webhooks,
    worker: WorkerConfig,
) -> DispatcherHandle {
    let handlers = hooks
        .register(Handlers::new(), &TYPES, &worker)
        .expect("the source types have no handler");
    Dispatcher::new(repo.clone(), handlers, worker)
        .start_pull()
        .await
        .expect("the rollout gate passes the webhook consumers")
}

/// Enqueues `n` events over `records` accounts and leads (alternating types), 25 per
/// transaction; returns their ids in enqueue order with their record keys.
pub async fn enqueue(
    repo: &Arc<dyn OutboxRepository>,
    n: usize,
    records: usize,
) -> Vec<(String, String)> {
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            let (object, prefix) = if i % 2 == 0 {
                ("Account", "A")
            } else {
                ("Lead", "L")
            };
            let payload = format!(
                r#"{{"object":"{object}","record_id":"{prefix}{:03}","snapshot":{{"seq":{i}}}}}"#,
                i % records
            );
            NewEvent::new(TYPES[i % 2], payload)
        })
        .collect();
    let mut ids = Vec::new();
    for batch in events.chunks(25) {
        let mut tx = repo.begin().await.expect("begin");
        ids.extend(repo.enqueue(&mut tx, batch).await.expect("enqueue"));
        tx.commit().await.expect("commit");
    }
    let rows = repo.list_events(EventFilter::new()).await.expect("list");
    let keys: HashMap<String, String> = rows
        .into_iter()
        .map(|r| {
            (
                r.id.to_string(),
                r.record_key
                    .map(|k| k.as_str().to_string())
                    .unwrap_or_default(),
            )
        })
        .collect();
    ids.into_iter()
        .map(|id| (id.to_string(), keys[&id.to_string()].clone()))
        .collect()
}

/// Waits until `done` holds, or panics with `what` after `limit`.
pub async fn wait_for(limit: Duration, what: &str, mut done: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Rows of event types starting with `prefix` in `status`.
pub async fn rows(repo: &Arc<dyn OutboxRepository>, prefix: &str, status: EventStatus) -> usize {
    repo.list_events(EventFilter::new().statuses([status]))
        .await
        .expect("list the outbox")
        .iter()
        .filter(|r| r.event_type.starts_with(prefix))
        .count()
}
