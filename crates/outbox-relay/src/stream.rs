//! The stream the relay publishes to: created on request, and checked at every start. The relay
//! refuses a stream that cannot keep its promise: a `duplicate_window` shorter than the
//! redelivery horizon of the worker settings, a relayed subject the stream does not capture,
//! publishes that are not acked (`no_ack`), a sealed stream.

use std::time::Duration;

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{Context, GetStreamErrorKind};
use async_nats::jetstream::stream::{Config, Info, StorageType};
use outbox_events::WorkerConfig;
use serde::Serialize;

use crate::config::{RelayConfig, human, subject_matches};
use crate::error::RelayError;

/// How to create the stream when it is missing (`--create-stream`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSpec {
    /// The subjects it captures; `<prefix>.>` and every overridden subject by default.
    pub subjects: Vec<String>,
    /// Its dedup window.
    pub duplicate_window: Duration,
    /// File storage (survives a server restart) unless memory is asked for.
    pub memory: bool,
    /// Replicas (1 on a single server).
    pub replicas: usize,
}

impl StreamSpec {
    /// The default for `config` under `worker`: the relay's subjects, file storage, one
    /// replica, and a window of the required one rounded up to a whole minute (two at least,
    /// the server's default).
    pub fn for_relay(config: &RelayConfig, worker: &WorkerConfig) -> Self {
        let mut subjects = Vec::new();
        if !config.subject_prefix.is_empty() {
            subjects.push(format!("{}.>", config.subject_prefix));
        }
        for (_, subject) in config.subjects() {
            if !subjects.iter().any(|f| subject_matches(f, &subject)) {
                subjects.push(subject);
            }
        }
        let required = config.required_duplicate_window(worker).as_secs();
        let minutes = required.div_ceil(60).max(2);
        Self {
            subjects,
            duplicate_window: Duration::from_secs(minutes * 60),
            memory: false,
            replicas: 1,
        }
    }
}

/// What the start-up check found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StreamCheck {
    /// The stream's name.
    pub stream: String,
    /// Whether the relay created it just now.
    pub created: bool,
    /// The stream's `duplicate_window`.
    pub duplicate_window: Duration,
    /// The shortest window the worker settings allow.
    pub required_window: Duration,
    /// The subjects the stream captures.
    pub subjects: Vec<String>,
    /// Messages in it now.
    pub messages: u64,
    /// What is allowed but weakens the promise (memory storage).
    pub warnings: Vec<String>,
}

fn not_found(e: &async_nats::jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), GetStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// Reads the stream's info, or `None` when it does not exist.
async fn stream_info(js: &Context, name: &str) -> Result<Option<Info>, RelayError> {
    match js.get_stream(name).await {
        Ok(stream) => Ok(Some(stream.cached_info().clone())),
        Err(e) if not_found(&e) => Ok(None),
        Err(e) => Err(RelayError::js("reading the stream", e)),
    }
}

/// Creates the relay's stream from `spec` unless it exists; `true` when it was created. An
/// existing stream is never changed (its window and subjects are the operator's): the check
/// that follows says whether it fits.
pub async fn create_stream(
    js: &Context,
    config: &RelayConfig,
    spec: &StreamSpec,
) -> Result<bool, RelayError> {
    if stream_info(js, &config.stream).await?.is_some() {
        return Ok(false);
    }
    let stream = Config {
        name: config.stream.clone(),
        subjects: spec.subjects.clone(),
        duplicate_window: spec.duplicate_window,
        storage: if spec.memory {
            StorageType::Memory
        } else {
            StorageType::File
        },
        num_replicas: spec.replicas.max(1),
        description: Some("outbox relay (created by outbox relay --create-stream)".into()),
        ..Config::default()
    };
    js.create_stream(stream)
        .await
        .map_err(|e| RelayError::js("creating the stream", e))?;
    tracing::info!(stream = %config.stream, window = %human(spec.duplicate_window), subjects = ?spec.subjects, "stream created");
    Ok(true)
}

/// Checks that the stream exists and can keep the relay's promise under `worker`'s settings;
/// the refusal lists every reason.
pub async fn check_stream(
    js: &Context,
    config: &RelayConfig,
    worker: &WorkerConfig,
) -> Result<StreamCheck, RelayError> {
    let Some(info) = stream_info(js, &config.stream).await? else {
        return Err(RelayError::StreamNotFound {
            stream: config.stream.clone(),
        });
    };
    let required = config.required_duplicate_window(worker);
    let c = &info.config;
    let mut reasons = Vec::new();
    if c.duplicate_window < required {
        reasons.push(format!(
            "its duplicate_window ({}) is shorter than the relay's redelivery horizon ({}: {} attempts, the longer of each retry delay and stale-after {} plus a heartbeat, the ack timeout {}): a redelivery after the window would land twice; raise the stream's window or lower --max-retry-attempts/--stale-after-ms/--max-retry-delay-ms",
            human(c.duplicate_window),
            human(required),
            worker.max_retry_attempts,
            human(worker.stale_after),
            human(config.ack_timeout),
        ));
    }
    for (event_type, subject) in config.subjects() {
        if !c.subjects.iter().any(|f| subject_matches(f, &subject)) {
            reasons.push(format!(
                "it does not capture subject {subject} (event type {event_type}); its subjects are {:?}",
                c.subjects
            ));
        }
    }
    if c.no_ack {
        reasons.push(
            "it does not ack publishes (no_ack), so a publish cannot be confirmed before processed"
                .into(),
        );
    }
    if c.sealed {
        reasons.push("it is sealed".into());
    }
    if !reasons.is_empty() {
        return Err(RelayError::StreamRefused {
            stream: config.stream.clone(),
            reasons,
        });
    }
    let mut warnings = Vec::new();
    if c.storage == StorageType::Memory {
        warnings.push("memory storage: a server restart loses what the stream held, although the outbox rows are processed".to_string());
    }
    Ok(StreamCheck {
        stream: config.stream.clone(),
        created: false,
        duplicate_window: c.duplicate_window,
        required_window: required,
        subjects: c.subjects.clone(),
        messages: info.state.messages,
        warnings,
    })
}
