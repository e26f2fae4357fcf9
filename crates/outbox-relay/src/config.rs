//! What the relay publishes where: the event types it owns, the subject of each, the stream,
//! the bounded wait for the ack; and what follows from it: the claim scope, the consumer
//! declarations the rollout gate judges, and the duplicate window the stream needs.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_events::persistence::Scope;
use outbox_events::{Consumer, EffectKind, ExternalKind, Safeguard, WorkerConfig};

use crate::error::RelayError;

/// The default subject prefix: event type `account.updated` goes to `outbox.account.updated`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "outbox";
/// The default bounded wait for a publish ack: past it the attempt fails and is retried.
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// The consumer name the relay registers for each of its event types.
pub const RELAY_CONSUMER: &str = "nats-relay";

/// The relay's configuration. Build with [`RelayConfig::new`] and the `with_*` methods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayConfig {
    /// The JetStream stream the subjects belong to (checked at start).
    pub stream: String,
    /// Subjects are `<prefix>.<EventType>` unless overridden.
    pub subject_prefix: String,
    /// The event types the relay owns, exactly (no pattern): it claims these and nothing else.
    pub event_types: Vec<String>,
    /// Per-type subjects that replace `<prefix>.<EventType>`.
    pub subject_overrides: BTreeMap<String, String>,
    /// The longest wait for a publish ack; a publish not acked by then is a retryable failure.
    pub ack_timeout: Duration,
}

impl RelayConfig {
    /// Relays `event_types` to `stream` under `subject_prefix`, with the default ack timeout.
    pub fn new(
        stream: impl Into<String>,
        subject_prefix: impl Into<String>,
        event_types: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        let mut event_types: Vec<String> = event_types.into_iter().map(Into::into).collect();
        event_types.sort();
        event_types.dedup();
        Self {
            stream: stream.into(),
            subject_prefix: subject_prefix.into(),
            event_types,
            subject_overrides: BTreeMap::new(),
            ack_timeout: DEFAULT_ACK_TIMEOUT,
        }
    }

    /// Publishes `event_type` to `subject` instead of `<prefix>.<EventType>`.
    pub fn with_subject(
        mut self,
        event_type: impl Into<String>,
        subject: impl Into<String>,
    ) -> Self {
        self.subject_overrides
            .insert(event_type.into(), subject.into());
        self
    }

    /// Sets the bounded wait for a publish ack.
    pub fn with_ack_timeout(mut self, ack_timeout: Duration) -> Self {
        self.ack_timeout = ack_timeout;
        self
    }

    /// The subject `event_type` is published to: its override, or `<prefix>.<EventType>`.
    pub fn subject_for(&self, event_type: &str) -> String {
        match self.subject_overrides.get(event_type) {
            Some(subject) => subject.clone(),
            None if self.subject_prefix.is_empty() => event_type.to_string(),
            None => format!("{}.{event_type}", self.subject_prefix),
        }
    }

    /// Every relayed event type with its subject, sorted by event type.
    pub fn subjects(&self) -> Vec<(String, String)> {
        self.event_types
            .iter()
            .map(|t| (t.clone(), self.subject_for(t)))
            .collect()
    }

    /// The claim scope of the relay's dispatcher: its event types and nothing else.
    pub fn scope(&self) -> Scope {
        Scope::Only(self.event_types.clone())
    }

    /// Checks the configuration on its own (no server needed): a stream name, at least one
    /// event type, a positive ack timeout, an override only for a relayed type, and a valid
    /// publish subject (no wildcard, no empty token, no whitespace) for every type.
    pub fn validate(&self) -> Result<(), RelayError> {
        let mut problems = Vec::new();
        if self.stream.is_empty() || self.stream.contains(['.', '*', '>', ' ', '\t']) {
            problems.push(format!(
                "stream name {:?} must be non-empty, without '.', '*', '>' or whitespace",
                self.stream
            ));
        }
        if self.event_types.is_empty() {
            problems.push("no event types to relay: name each one (--event-type)".to_string());
        }
        if self.ack_timeout.is_zero() {
            problems.push("the ack timeout must be positive".to_string());
        }
        for t in self.subject_overrides.keys() {
            if !self.event_types.contains(t) {
                problems.push(format!("subject override for {t:?}, which is not relayed"));
            }
        }
        for (event_type, subject) in self.subjects() {
            if let Err(why) = check_publish_subject(&subject) {
                problems.push(format!(
                    "event type {event_type:?} maps to subject {subject:?}, {why}: give it a subject of its own (--subject {event_type}=SUBJECT)"
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(RelayError::Config(problems.join("; ")))
        }
    }

    /// The longest time between the first copy of an event reaching the stream and the last
    /// redelivery that may publish it again, under `worker`'s settings: the stream's
    /// `duplicate_window` must be at least this long, or a redelivery could land twice.
    ///
    /// The window counts from the first stored copy (a duplicate does not extend it), so every
    /// gap between two attempts of one event adds up: `MaxRetryAttempts - 1` gaps, each the
    /// longer of the retry delay after that failure and the stale-after age plus a heartbeat
    /// (a worker that died after its publish), plus one ack wait and one poll interval.
    pub fn required_duplicate_window(&self, worker: &WorkerConfig) -> Duration {
        let reclaim = worker.stale_after + worker.heartbeat_interval;
        (1..worker.max_retry_attempts.max(1))
            .map(|failures| {
                let retry = worker.retry_delay + worker.extra_retry_delay(failures);
                retry.max(reclaim) + self.ack_timeout + worker.poll_interval
            })
            .sum()
    }

    /// The consumer declaration of each relayed event type: an external effect (a push to the
    /// broker) protected by the broker's dedup on `Nats-Msg-Id`, its limit (the window) named,
    /// as the relay registers it (`Handlers::register_with_broker_dedup`: the relay checks the
    /// stream's duplicate window before its handlers run, see [`crate::Relay::dispatcher`]).
    pub fn consumers(&self, worker: &WorkerConfig) -> Vec<Consumer> {
        let window = self.required_duplicate_window(worker);
        self.subjects()
            .into_iter()
            .map(|(event_type, subject)| {
                let declared = Consumer::new(RELAY_CONSUMER, event_type).effect(
                    EffectKind::External {
                        kind: ExternalKind::ConnectorPush,
                    },
                    format!(
                        "publish to NATS JetStream subject {subject} (stream {}), acked before processed",
                        self.stream
                    ),
                    Some(Safeguard::BrokerDedup(format!(
                        "broker dedup: Nats-Msg-Id = event id, dropped as a duplicate within the stream's duplicate_window, which the relay checks at every start to be at least {} (these retry and stale settings); a redelivery after the window would publish twice, so downstream consumers still dedupe on Nats-Msg-Id",
                        human(window)
                    ))),
                );
                outbox_events::Handlers::new()
                    .register_with_broker_dedup(declared, Unrun)
                    .consumers()
                    .remove(0)
            })
            .collect()
    }
}

/// The handler a declaration is registered with to be judged as the relay registers it;
/// never run (the relay's own handlers replace it).
struct Unrun;

#[async_trait::async_trait]
impl outbox_events::Handler for Unrun {
    async fn handle(
        &self,
        _event: &outbox_events::OutboxEvent,
        _ctx: &mut outbox_events::AttemptContext<'_>,
    ) -> Result<(), outbox_events::HandlerError> {
        Err(outbox_events::HandlerError::Permanent(
            "a relay declaration's placeholder ran: register the relay's handlers (Relay::handlers)".into(),
        ))
    }
}

/// Whether `subject` is a valid subject to publish to.
pub(crate) fn check_publish_subject(subject: &str) -> Result<(), &'static str> {
    if subject.is_empty() {
        return Err("which is empty");
    }
    if subject.chars().any(char::is_whitespace) {
        return Err("which holds whitespace");
    }
    if subject.split('.').any(str::is_empty) {
        return Err("which has an empty token");
    }
    if subject.split('.').any(|t| t == "*" || t == ">") {
        return Err("which is a wildcard");
    }
    Ok(())
}

/// `subject` matches the stream subject `filter` (`*` one token, `>` the rest).
pub(crate) fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// A duration for people: `2m28s`, `750ms`.
pub fn human(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    let secs = d.as_secs_f64().ceil() as u64;
    match (secs / 3_600, secs / 60 % 60, secs % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, 0) => format!("{m}m"),
        (0, m, s) => format!("{m}m{s}s"),
        (h, m, s) => format!("{h}h{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_come_from_the_prefix_unless_overridden() {
        let c = RelayConfig::new("CRM", "crm", ["lead.updated", "account.updated"])
            .with_subject("lead.updated", "sales.leads");
        assert_eq!(c.subject_for("account.updated"), "crm.account.updated");
        assert_eq!(c.subject_for("lead.updated"), "sales.leads");
        assert_eq!(c.event_types, vec!["account.updated", "lead.updated"]);
        assert!(c.validate().is_ok());
        assert_eq!(RelayConfig::new("S", "", ["a.b"]).subject_for("a.b"), "a.b");
    }

    #[test]
    fn invalid_subjects_and_settings_are_refused_with_their_reasons() {
        let bad = RelayConfig::new("CRM", "crm", ["has space", "ends.", "wild.*"])
            .with_subject("other", "x");
        let RelayError::Config(why) = bad.validate().unwrap_err() else {
            panic!("a config error")
        };
        assert!(
            why.contains("\"has space\" maps to subject \"crm.has space\", which holds whitespace"),
            "{why}"
        );
        assert!(why.contains("which has an empty token"), "{why}");
        assert!(why.contains("which is a wildcard"), "{why}");
        assert!(why.contains("override for \"other\""), "{why}");
        let none = RelayConfig::new("a.b", "p", Vec::<String>::new());
        let why = none.validate().unwrap_err().to_string();
        assert!(
            why.contains("no event types") && why.contains("stream name"),
            "{why}"
        );
    }

    #[test]
    fn stream_filters_match_like_nats() {
        assert!(subject_matches("outbox.>", "outbox.account.updated"));
        assert!(!subject_matches("outbox.>", "outbox"));
        assert!(subject_matches("outbox.*.updated", "outbox.lead.updated"));
        assert!(!subject_matches("outbox.*", "outbox.lead.updated"));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a.b.c"));
    }

    #[test]
    fn the_required_window_adds_every_gap_between_attempts() {
        let c = RelayConfig::new("S", "p", ["t"]).with_ack_timeout(Duration::from_secs(5));
        let w = WorkerConfig::default()
            .with_stale_after(Duration::from_secs(30))
            .with_heartbeat_interval(Duration::from_secs(2))
            .with_poll_interval(Duration::from_millis(500))
            .with_retry_delay(Duration::from_secs(1))
            .with_max_retry_delay(Duration::from_secs(60))
            .with_max_retry_attempts(5);
        // Four gaps, each max(retry delay <= 8 s, 32 s) + 5 s + 0.5 s.
        assert_eq!(
            c.required_duplicate_window(&w),
            Duration::from_millis(4 * 37_500)
        );
        // Long retry delays dominate: 1, 2, 4, 8, 16, 32, 60 s against 32 s of reclaim.
        let w = w.with_max_retry_attempts(9);
        let gaps = [32, 32, 32, 32, 32, 32, 60, 60];
        let want: u64 = gaps.iter().map(|g| g * 1000 + 5_500).sum();
        assert_eq!(c.required_duplicate_window(&w), Duration::from_millis(want));
        assert_eq!(
            c.required_duplicate_window(&w.with_max_retry_attempts(1)),
            Duration::ZERO
        );
    }

    #[test]
    fn the_declaration_is_protected_and_names_its_window() {
        let c = RelayConfig::new("CRM", "crm", ["a", "b"]);
        let consumers = c.consumers(&WorkerConfig::default());
        assert_eq!(consumers.len(), 2);
        for consumer in &consumers {
            assert!(consumer.through_broker());
            assert_eq!(consumer.verdict(), outbox_events::Verdict::Protected);
            let Some(Safeguard::BrokerDedup(text)) = &consumer.effects[0].safeguard else {
                panic!("broker dedup")
            };
            assert!(text.contains("at least 2m30s"), "{text}");
        }
        assert_eq!(human(Duration::from_millis(150_000)), "2m30s");
        assert_eq!(human(Duration::from_millis(250)), "250ms");
    }
}
