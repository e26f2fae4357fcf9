//! Reading the stream back and auditing it against the outbox: every processed event in the
//! stream exactly once, each record's events in enqueue order, nothing else. Used by the tests,
//! the demo's verification and the bench.

use std::collections::{HashMap, HashSet};

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use async_nats::jetstream::context::Context;
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use serde::Serialize;

use crate::error::RelayError;
use crate::handler::headers;

/// One message of the stream, as the audit needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMessage {
    /// Its stream sequence.
    pub sequence: u64,
    /// Its subject.
    pub subject: String,
    /// `Nats-Msg-Id`.
    pub msg_id: Option<String>,
    /// `Outbox-Record-Key`.
    pub record_key: Option<String>,
    /// `Outbox-Event-Type`.
    pub event_type: Option<String>,
    /// `Outbox-Attempt`.
    pub attempt: Option<u32>,
    /// `Outbox-Created-Date`.
    pub created_date: Option<String>,
    /// When the server stored it.
    pub stored_at: DateTime<Utc>,
    /// Its body.
    pub payload: Vec<u8>,
}

/// Every message of `stream`, in stream order (an ordered consumer of its own).
pub async fn read_stream(js: &Context, stream: &str) -> Result<Vec<StreamMessage>, RelayError> {
    let mut handle = js
        .get_stream(stream)
        .await
        .map_err(|e| RelayError::js("reading the stream", e))?;
    let last = handle
        .info()
        .await
        .map_err(|e| RelayError::js("reading the stream", e))?
        .state
        .last_sequence;
    let mut out = Vec::new();
    if handle.cached_info().state.messages == 0 {
        return Ok(out);
    }
    let consumer = handle
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::All,
            ..OrderedConfig::default()
        })
        .await
        .map_err(|e| RelayError::js("creating a reader", e))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| RelayError::js("reading the stream", e))?;
    while let Some(message) = messages.next().await {
        let message = message.map_err(|e| RelayError::js("reading a message", e))?;
        let info = message.info().map_err(|e| RelayError::JetStream {
            what: "reading a message's metadata",
            source: e,
        })?;
        let (sequence, stored_at) = (info.stream_sequence, info.published);
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_string())
        };
        out.push(StreamMessage {
            sequence,
            subject: message.subject.to_string(),
            msg_id: header(headers::MSG_ID),
            record_key: header(headers::RECORD_KEY),
            event_type: header(headers::EVENT_TYPE),
            attempt: header(headers::ATTEMPT).and_then(|a| a.parse().ok()),
            created_date: header(headers::CREATED_DATE),
            stored_at,
            payload: message.payload.to_vec(),
        });
        if sequence >= last {
            break;
        }
    }
    Ok(out)
}

/// An event the stream should hold, in enqueue order (the outbox's `CreatedDate`, `Id` order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// The event's id (`Nats-Msg-Id`).
    pub id: String,
    /// Its record key.
    pub record_key: Option<String>,
}

/// What the audit found. [`StreamAudit::passed`] when every list is empty.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StreamAudit {
    /// Messages read.
    pub messages: usize,
    /// Expected events the stream lacks.
    pub missing: Vec<String>,
    /// Message ids the stream holds more than once.
    pub duplicated: Vec<String>,
    /// Messages of no expected event (or without a `Nats-Msg-Id`).
    pub unexpected: Vec<u64>,
    /// Records whose events are in the stream out of enqueue order (one line each).
    pub out_of_order: Vec<String>,
}

impl StreamAudit {
    /// Whether the stream holds every expected event once, in per-record order, and nothing
    /// else.
    pub fn passed(&self) -> bool {
        self.missing.is_empty()
            && self.duplicated.is_empty()
            && self.unexpected.is_empty()
            && self.out_of_order.is_empty()
    }
}

/// Audits `messages` (stream order) against `expected` (enqueue order).
pub fn audit(messages: &[StreamMessage], expected: &[Expected]) -> StreamAudit {
    let rank: HashMap<&str, usize> = expected
        .iter()
        .enumerate()
        .map(|(i, e)| (e.id.as_str(), i))
        .collect();
    let mut report = StreamAudit {
        messages: messages.len(),
        ..StreamAudit::default()
    };
    let mut seen = HashSet::new();
    let mut last_rank_of_key: HashMap<&str, (usize, &str)> = HashMap::new();
    for m in messages {
        let Some(id) = m.msg_id.as_deref() else {
            report.unexpected.push(m.sequence);
            continue;
        };
        let Some(&r) = rank.get(id) else {
            report.unexpected.push(m.sequence);
            continue;
        };
        if !seen.insert(id) {
            report.duplicated.push(id.to_string());
            continue;
        }
        if let Some(key) = expected[r].record_key.as_deref() {
            if let Some((previous, previous_id)) = last_rank_of_key.get(key)
                && *previous > r
            {
                report.out_of_order.push(format!(
                    "record {key}: {id} (enqueued earlier) came after {previous_id}"
                ));
            }
            last_rank_of_key.insert(key, (r, id));
        }
    }
    report.missing = expected
        .iter()
        .filter(|e| !seen.contains(e.id.as_str()))
        .map(|e| e.id.clone())
        .collect();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(sequence: u64, id: &str) -> StreamMessage {
        StreamMessage {
            sequence,
            subject: "s".into(),
            msg_id: Some(id.into()),
            record_key: None,
            event_type: None,
            attempt: Some(1),
            created_date: None,
            stored_at: Utc::now(),
            payload: Vec::new(),
        }
    }

    fn exp(id: &str, key: &str) -> Expected {
        Expected {
            id: id.into(),
            record_key: Some(key.into()),
        }
    }

    #[test]
    fn the_audit_finds_each_kind_of_defect() {
        let expected = [
            exp("a1", "a"),
            exp("b1", "b"),
            exp("a2", "a"),
            exp("c1", "c"),
        ];
        let good = [msg(1, "b1"), msg(2, "a1"), msg(3, "a2"), msg(4, "c1")];
        assert!(audit(&good, &expected).passed());
        let bad = [
            msg(1, "a2"),
            msg(2, "a1"),
            msg(3, "b1"),
            msg(4, "b1"),
            msg(5, "zz"),
        ];
        let report = audit(&bad, &expected);
        assert_eq!(report.missing, vec!["c1"]);
        assert_eq!(report.duplicated, vec!["b1"]);
        assert_eq!(report.unexpected, vec![5]);
        assert_eq!(report.out_of_order.len(), 1, "{:?}", report.out_of_order);
        assert!(report.out_of_order[0].contains("a1"));
        assert!(!report.passed());
    }
}
