//! W3C trace context in the event envelope: the payload's top-level `traceparent` member ties an
//! attempt to the trace that enqueued its event (see `docs/observability.md`).
//!
//! - [`TraceParent`] parses a `traceparent` strictly (version `00`, a 32-hex-digit trace id and
//!   a 16-hex-digit parent id, neither all zeros, two hex digits of flags, lower case only).
//! - [`enqueue`] (and [`with_traceparent`] for callers that enqueue on a raw connection) writes
//!   the caller's span context into each payload as `traceparent`, never replacing a member the
//!   caller set. The current span's context is an OpenTelemetry notion, so this needs the
//!   `otel` feature; without it [`TraceParent::current`] is `None` and payloads pass unchanged.
//! - The attempt span records a valid `traceparent` as its field `traceparent` (with or without
//!   the feature, so logs correlate); with `otel` it also gets an OpenTelemetry *link* to the
//!   enqueueing span. An invalid one is ignored with a debug log: it never fails the event.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use outbox_persistence::{EventId, NewEvent, OutboxRepository, Tx};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// The name of the envelope member that carries the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";

/// A W3C `traceparent` (version `00`): the trace, the span that enqueued the event (the
/// `parent-id`), and the trace flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: [u8; 16],
    parent_id: [u8; 8],
    flags: u8,
}

/// Why a `traceparent` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceParentError {
    /// Not `00-<32 hex>-<16 hex>-<2 hex>` (55 characters, lower-case hex, dashes between).
    #[error("not a version-00 traceparent (00-<32 hex>-<16 hex>-<2 hex>, lower case)")]
    Malformed,
    /// A version other than `00` (this reader knows version 00 only).
    #[error("unsupported traceparent version {0:?}")]
    Version(String),
    /// The trace id is all zeros.
    #[error("the trace id is all zeros")]
    ZeroTraceId,
    /// The parent id is all zeros.
    #[error("the parent id is all zeros")]
    ZeroParentId,
    /// The envelope's `traceparent` member is not a string.
    #[error("the envelope's traceparent is not a string")]
    NotAString,
}

impl TraceParent {
    /// A trace context from its parts; `None` when the trace id or the parent id is all zeros.
    pub fn new(trace_id: [u8; 16], parent_id: [u8; 8], flags: u8) -> Option<Self> {
        (trace_id != [0; 16] && parent_id != [0; 8]).then_some(Self {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// Parses `00-<trace-id>-<parent-id>-<flags>` strictly.
    pub fn parse(text: &str) -> Result<Self, TraceParentError> {
        let b = text.as_bytes();
        let version = text.get(..2).filter(|v| is_lower_hex(v.as_bytes()));
        match version {
            Some("00") => {}
            Some(v) if v != "ff" && b.len() >= 55 => {
                return Err(TraceParentError::Version(v.to_owned()));
            }
            _ => return Err(TraceParentError::Malformed),
        }
        if b.len() != 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return Err(TraceParentError::Malformed);
        }
        let (trace, parent, flags) = (&b[3..35], &b[36..52], &b[53..55]);
        if !is_lower_hex(trace) || !is_lower_hex(parent) || !is_lower_hex(flags) {
            return Err(TraceParentError::Malformed);
        }
        let mut trace_id = [0u8; 16];
        let mut parent_id = [0u8; 8];
        decode_hex(trace, &mut trace_id);
        decode_hex(parent, &mut parent_id);
        let mut flag = [0u8; 1];
        decode_hex(flags, &mut flag);
        if trace_id == [0; 16] {
            return Err(TraceParentError::ZeroTraceId);
        }
        if parent_id == [0; 8] {
            return Err(TraceParentError::ZeroParentId);
        }
        Ok(Self {
            trace_id,
            parent_id,
            flags: flag[0],
        })
    }

    /// The trace id.
    pub fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }

    /// The trace id as 32 lower-case hex digits.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// The id of the span that enqueued the event.
    pub fn parent_id(&self) -> [u8; 8] {
        self.parent_id
    }

    /// The trace flags.
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// Whether the enqueueing trace was sampled (flag `01`).
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The context of the current `tracing` span, when an OpenTelemetry layer
    /// (`tracing-opentelemetry`) gives it a valid one. Always `None` without the `otel`
    /// feature: plain `tracing` spans have no W3C identity.
    pub fn current() -> Option<Self> {
        #[cfg(feature = "otel")]
        {
            otel::current()
        }
        #[cfg(not(feature = "otel"))]
        {
            None
        }
    }

    /// The `traceparent` of a payload: `None` when it has none (or is not a JSON object: the
    /// handler deals with that), an error when the member is there but invalid.
    pub fn from_payload(payload: &str) -> Option<Result<Self, TraceParentError>> {
        if !payload.contains(TRACEPARENT) {
            // The cheap test first: most payloads carry none, and parsing costs.
            return None;
        }
        match Carrier::read(payload)?.traceparent {
            Slot::Absent | Slot::Present(Value::Null) => None,
            Slot::Present(Value::String(text)) => Some(Self::parse(&text)),
            Slot::Present(_) => Some(Err(TraceParentError::NotAString)),
        }
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.parent_id),
            self.flags
        )
    }
}

impl FromStr for TraceParent {
    type Err = TraceParentError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

fn is_lower_hex(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
}

/// Decodes lower-case hex digits (already checked) into `out`.
fn decode_hex(digits: &[u8], out: &mut [u8]) {
    let nibble = |d: u8| {
        if d.is_ascii_digit() {
            d - b'0'
        } else {
            d - b'a' + 10
        }
    };
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = (nibble(pair[0]) << 4) | nibble(pair[1]);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The top-level `traceparent` member of a payload, whatever its type; every other member is
/// skipped unread.
#[derive(Deserialize)]
struct Carrier {
    #[serde(default)]
    traceparent: Slot,
}

/// Whether the member is there (a `null` member is there too: it is never replaced).
#[derive(Default)]
enum Slot {
    #[default]
    Absent,
    Present(Value),
}

impl<'de> Deserialize<'de> for Slot {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Value::deserialize(d).map(Slot::Present)
    }
}

impl Carrier {
    /// `None` unless `payload` is a JSON object.
    fn read(payload: &str) -> Option<Self> {
        if !payload.trim_start().starts_with('{') {
            return None;
        }
        serde_json::from_str(payload).ok()
    }
}

/// `payload` with `"traceparent":"<tp>"` as its first member, the rest of the text unchanged;
/// `None` when the payload already has a `traceparent` member (the caller's wins) or is not a
/// JSON object (enqueue refuses it as it is).
pub fn payload_with_traceparent(payload: &str, tp: &TraceParent) -> Option<String> {
    let carrier = Carrier::read(payload)?;
    if !matches!(carrier.traceparent, Slot::Absent) {
        return None;
    }
    let open = payload.find('{')?;
    let rest = &payload[open + 1..];
    let separator = if rest.trim_start().starts_with('}') {
        ""
    } else {
        ","
    };
    Some(format!(
        "{}{{\"{TRACEPARENT}\":\"{tp}\"{separator}{rest}",
        &payload[..open]
    ))
}

/// `events` with `tp` written into every payload that has no `traceparent` yet (borrowed as
/// they are when none changes).
pub fn with_traceparent<'a>(events: &'a [NewEvent], tp: &TraceParent) -> Cow<'a, [NewEvent]> {
    let mut changed: Option<Vec<NewEvent>> = None;
    for (i, event) in events.iter().enumerate() {
        if let Some(payload) = payload_with_traceparent(&event.payload, tp) {
            let all = changed.get_or_insert_with(|| events.to_vec());
            all[i].payload = payload;
        }
    }
    match changed {
        Some(all) => Cow::Owned(all),
        None => Cow::Borrowed(events),
    }
}

/// `events` with the current span's context ([`TraceParent::current`]) as their
/// `traceparent`: what [`enqueue`] writes, for a caller that enqueues on a connection of its
/// own (`persistence::postgres::enqueue(&mut conn, &traced(&events))`).
pub fn traced(events: &[NewEvent]) -> Cow<'_, [NewEvent]> {
    match TraceParent::current() {
        Some(tp) => with_traceparent(events, &tp),
        None => Cow::Borrowed(events),
    }
}

/// [`OutboxRepository::enqueue`] with the caller's trace context: with the `otel` feature each
/// payload without a `traceparent` gets the current span's (when it has a valid OpenTelemetry
/// context), so that the attempts link back to this trace. Without the feature, or outside a
/// traced span, the events are enqueued as given.
pub async fn enqueue(
    repo: &dyn OutboxRepository,
    tx: &mut Tx,
    events: &[NewEvent],
) -> outbox_persistence::Result<Vec<EventId>> {
    repo.enqueue(tx, &traced(events)).await
}

/// Records a claimed event's `traceparent` on its attempt span (and, with `otel`, links the
/// span to it). An invalid one is logged at debug level and otherwise ignored.
pub(crate) fn note_on_span(span: &tracing::Span, payload: &str) {
    if span.is_disabled() {
        return;
    }
    match TraceParent::from_payload(payload) {
        None => {}
        Some(Ok(tp)) => {
            span.record(TRACEPARENT, tracing::field::display(&tp));
            #[cfg(feature = "otel")]
            otel::link(span, &tp);
        }
        Some(Err(e)) => {
            tracing::debug!(parent: span, error = %e, "ignoring the envelope's invalid traceparent");
        }
    }
}

#[cfg(feature = "otel")]
mod otel {
    //! The OpenTelemetry side: the current span's context, and the attempt's link.

    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::TraceParent;

    pub(super) fn current() -> Option<TraceParent> {
        let cx = tracing::Span::current().context();
        let span = cx.span();
        let sc = span.span_context();
        if !sc.is_valid() {
            return None;
        }
        TraceParent::new(
            sc.trace_id().to_bytes(),
            sc.span_id().to_bytes(),
            sc.trace_flags().to_u8(),
        )
    }

    /// A link, not a parent: see `docs/observability.md` ("Traces").
    pub(super) fn link(span: &tracing::Span, tp: &TraceParent) {
        span.add_link(SpanContext::new(
            TraceId::from_bytes(tp.trace_id),
            SpanId::from_bytes(tp.parent_id),
            TraceFlags::new(tp.flags),
            true,
            TraceState::default(),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_parses_and_prints_back() {
        let tp = TraceParent::parse(VALID).unwrap();
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(
            tp.parent_id(),
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert_eq!(tp.flags(), 1);
        assert!(tp.sampled());
        assert_eq!(tp.to_string(), VALID);
        let unsampled: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
            .parse()
            .unwrap();
        assert!(!unsampled.sampled());
    }

    #[test]
    fn invalid_traceparents_are_refused_with_their_reason() {
        use TraceParentError as E;
        let cases: &[(&str, E)] = &[
            ("", E::Malformed),
            ("00", E::Malformed),
            (&VALID[..54], E::Malformed),
            (&format!("{VALID}0"), E::Malformed),
            (&VALID.replace("4bf9", "4BF9"), E::Malformed),
            (&VALID.replace("-00f0", "_00f0"), E::Malformed),
            (&VALID.replace("4bf9", "4bg9"), E::Malformed),
            (&VALID.replacen("-01", "-0x", 1), E::Malformed),
            (&format!("ff{}", &VALID[2..]), E::Malformed),
            (&format!("01{}", &VALID[2..]), E::Version("01".into())),
            (&format!("0A{}", &VALID[2..]), E::Malformed),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                E::ZeroTraceId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                E::ZeroParentId,
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(TraceParent::parse(text).as_ref(), Err(expected), "{text:?}");
        }
    }

    #[test]
    fn the_payload_member_is_read_at_the_top_level_only() {
        let with = format!(r#"{{"object":"Lead","record_id":"1","traceparent":"{VALID}"}}"#);
        assert_eq!(
            TraceParent::from_payload(&with),
            Some(Ok(VALID.parse().unwrap()))
        );
        let nested = format!(r#"{{"snapshot":{{"traceparent":"{VALID}"}}}}"#);
        assert_eq!(TraceParent::from_payload(&nested), None);
        assert_eq!(TraceParent::from_payload(r#"{"snapshot":{}}"#), None);
        assert_eq!(TraceParent::from_payload(r#"{"traceparent":null}"#), None);
        assert_eq!(
            TraceParent::from_payload(r#"{"traceparent":7}"#),
            Some(Err(TraceParentError::NotAString))
        );
        assert_eq!(
            TraceParent::from_payload(r#"{"traceparent":"00-zz"}"#),
            Some(Err(TraceParentError::Malformed))
        );
        assert_eq!(TraceParent::from_payload(r#"["traceparent"]"#), None);
        assert_eq!(TraceParent::from_payload(r#"{"traceparent": broken"#), None);
    }

    #[test]
    fn injection_adds_the_member_and_keeps_the_rest_of_the_text() {
        let tp: TraceParent = VALID.parse().unwrap();
        let payload = r#"  {"object":"Lead", "record_id":"1","snapshot":{"b":1,"a":2}}"#;
        let injected = payload_with_traceparent(payload, &tp).unwrap();
        assert_eq!(
            injected,
            format!(
                r#"  {{"traceparent":"{VALID}","object":"Lead", "record_id":"1","snapshot":{{"b":1,"a":2}}}}"#
            )
        );
        assert_eq!(TraceParent::from_payload(&injected), Some(Ok(tp)));
        assert_eq!(
            record_key_of(&injected),
            record_key_of(payload),
            "the key is unchanged"
        );
        let empty = payload_with_traceparent("{ }", &tp).unwrap();
        assert_eq!(empty, format!(r#"{{"traceparent":"{VALID}" }}"#));
        assert!(serde_json::from_str::<Value>(&empty).is_ok());
    }

    fn record_key_of(payload: &str) -> Option<String> {
        outbox_persistence::OutboxEvent::for_test("t", payload)
            .record_key
            .map(|k| k.into_string())
    }

    #[test]
    fn injection_never_replaces_the_callers_member_nor_touches_non_objects() {
        let tp: TraceParent = VALID.parse().unwrap();
        let other = "00-11111111111111111111111111111111-2222222222222222-00";
        for payload in [
            format!(r#"{{"traceparent":"{other}"}}"#),
            r#"{"traceparent":null}"#.to_string(),
            r#"{"traceparent":"garbage"}"#.to_string(),
            "[1,2]".to_string(),
            "not json".to_string(),
        ] {
            assert_eq!(payload_with_traceparent(&payload, &tp), None, "{payload}");
        }
        let events = vec![
            NewEvent::new("a", format!(r#"{{"traceparent":"{other}"}}"#)),
            NewEvent::new("b", r#"{"kind":"digest"}"#),
        ];
        let traced = with_traceparent(&events, &tp);
        assert_eq!(traced[0], events[0]);
        assert_eq!(
            traced[1].payload,
            format!(r#"{{"traceparent":"{VALID}","kind":"digest"}}"#)
        );
        let untouched = [events[0].clone()];
        assert!(matches!(
            with_traceparent(&untouched, &tp),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn without_an_opentelemetry_layer_there_is_no_current_context() {
        let span = tracing::info_span!("caller");
        let _entered = span.enter();
        assert_eq!(TraceParent::current(), None);
        let events = [NewEvent::new("a", "{}")];
        assert!(matches!(traced(&events), Cow::Borrowed(_)));
    }
}
