//! The benchmark's results: rows of figures, the ceilings they are compared with, the targets
//! and their gaps, and the machine they were measured on; printed as a table or as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::Result;
use serde::Serialize;
use serde_json::{Value, json};

use super::BenchDb;

/// One measured figure set.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Row {
    /// The scenario, for example `drain keyed`.
    pub scenario: String,
    /// `pull`, `legacy`, or the ceiling's name.
    pub dispatcher: String,
    /// Workers, slots or connections.
    pub workers: Option<usize>,
    /// Events (or transactions) measured.
    pub events: Option<usize>,
    /// Events (or transactions) per second.
    pub per_second: Option<f64>,
    /// `per_second` as a fraction of ceiling (b) at the same connection count.
    pub of_ceiling_b: Option<f64>,
    /// Median latency in milliseconds.
    pub p50_ms: Option<f64>,
    /// 99th percentile latency in milliseconds.
    pub p99_ms: Option<f64>,
    /// Anything else worth a reader's eye.
    pub note: String,
}

/// A target of issue 8 or issue 3 and how far the measurement is from it.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// What the target asks.
    pub target: String,
    /// What was measured.
    pub measured: String,
    /// Whether it was met.
    pub met: bool,
}

/// Everything one run measured.
pub struct Report {
    quick: bool,
    machine: BTreeMap<&'static str, String>,
    /// Ceiling (b), events per second by connection count.
    pub ceiling_b: BTreeMap<usize, f64>,
    rows: Vec<Row>,
    targets: Vec<Target>,
    started: std::time::Instant,
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

impl Report {
    /// An empty report, with the machine described.
    pub async fn new(quick: bool, db: &BenchDb) -> Result<Self> {
        let mut machine = BTreeMap::new();
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        machine.insert("cores", cores.to_string());
        machine.insert("cpu", cpu_model());
        machine.insert("load_at_start", load_average());
        let pool = db.connect(1).await?;
        if let outbox_persistence::Database::Postgres(pg) = &pool {
            let version: String = sqlx::query_scalar("SELECT version()").fetch_one(pg).await?;
            machine.insert("postgres", version);
            for setting in ["shared_buffers", "synchronous_commit", "max_connections"] {
                let v: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}")))
                    .fetch_one(pg)
                    .await?;
                machine.insert(setting, v);
            }
        }
        pool.close().await;
        Ok(Self {
            quick,
            machine,
            ceiling_b: BTreeMap::new(),
            rows: Vec::new(),
            targets: Vec::new(),
            started: std::time::Instant::now(),
        })
    }

    /// Adds a row, computing its fraction of ceiling (b).
    pub fn push(&mut self, mut row: Row) {
        if let (Some(rate), Some(w)) = (row.per_second, row.workers)
            && let Some(b) = self.ceiling_b.get(&w)
            && row.dispatcher != "ceiling (b)"
        {
            row.of_ceiling_b = Some(rate / b);
        }
        eprintln!(
            "  {:<34} {:<12} {:>4} {:>10} {:>8} {:>9} {:>9}  {}",
            row.scenario,
            row.dispatcher,
            opt_usize(row.workers),
            opt_f(row.per_second, 0),
            opt_f(row.of_ceiling_b, 2),
            opt_f(row.p50_ms, 1),
            opt_f(row.p99_ms, 1),
            row.note
        );
        self.rows.push(row);
    }

    /// Records a target and its measurement.
    pub fn target(&mut self, target: impl Into<String>, measured: impl Into<String>, met: bool) {
        self.targets.push(Target {
            target: target.into(),
            measured: measured.into(),
            met,
        });
    }

    /// Notes the end of the run.
    pub async fn finish(&mut self) {
        self.machine.insert("load_at_end", load_average());
        self.machine.insert(
            "duration",
            format!("{:.0}s", self.started.elapsed().as_secs_f64()),
        );
    }

    /// The table a person reads.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "outbox-bench ({}): {}",
            if self.quick { "quick" } else { "full" },
            self.machine
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join("; ")
        );
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| scenario | dispatcher | workers | events | per s | of (b) | p50 ms | p99 ms | note |"
        );
        let _ = writeln!(out, "|---|---|--:|--:|--:|--:|--:|--:|---|");
        for r in &self.rows {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.scenario,
                r.dispatcher,
                opt_usize(r.workers),
                opt_usize(r.events),
                opt_f(r.per_second, 0),
                opt_f(r.of_ceiling_b, 2),
                opt_f(r.p50_ms, 2),
                opt_f(r.p99_ms, 2),
                r.note
            );
        }
        self.side_by_side(&mut out);
        if !self.targets.is_empty() {
            let _ = writeln!(out);
            let _ = writeln!(out, "| target | measured | met |");
            let _ = writeln!(out, "|---|---|---|");
            for t in &self.targets {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} |",
                    t.target,
                    t.measured,
                    if t.met { "yes" } else { "**no**" }
                );
            }
        }
        out
    }

    /// Ceiling (b) and the shipped pull workers' no-op drains, keyed and unkeyed, at each
    /// connection count, in one table: the figures a comparison with another queue on the same
    /// server needs (issue 37: run the peer's drain at the same worker counts beside it).
    fn side_by_side(&self, out: &mut String) {
        if self.ceiling_b.is_empty() {
            return;
        }
        let drain = |workers: usize, keyed: bool| {
            self.rows.iter().find(|r| {
                r.dispatcher == "pull"
                    && r.workers == Some(workers)
                    && r.scenario.starts_with("drain ")
                    && r.scenario.contains(" no-op, ")
                    && r.scenario.contains("no RecordKey") != keyed
            })
        };
        let cell = |row: Option<&Row>| match row.and_then(|r| r.per_second.zip(r.of_ceiling_b)) {
            Some((rate, of_b)) => format!("{rate:.0}/s = {of_b:.2}x"),
            None => "-".into(),
        };
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| workers | ceiling (b) | keyed drain (pull) | unkeyed drain (pull) |"
        );
        let _ = writeln!(out, "|--:|--:|--:|--:|");
        for (&workers, &b) in &self.ceiling_b {
            let _ = writeln!(
                out,
                "| {workers} | {b:.0}/s | {} | {} |",
                cell(drain(workers, true)),
                cell(drain(workers, false))
            );
        }
    }

    /// The JSON document.
    pub fn json(&self) -> Value {
        json!({
            "quick": self.quick,
            "machine": self.machine,
            "ceiling_b": self.ceiling_b,
            "rows": self.rows,
            "targets": self.targets,
        })
    }
}

fn opt_usize(v: Option<usize>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn opt_f(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}
