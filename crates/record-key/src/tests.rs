//! Table tests and a seeded property test of the `RecordKey` derivation.

use super::*;

fn key(payload: &str) -> Result<Option<String>, RecordKeyError> {
    record_key_from_payload(payload).map(|k| k.map(RecordKey::into_string))
}

/// `key`'s result with the error as its `Debug` text: `RecordKeyError` is not `PartialEq`
/// (it keeps the parser's error), but every variant except `InvalidJson` shows exactly.
fn shown(result: &Result<Option<String>, RecordKeyError>) -> Result<Option<String>, String> {
    match result {
        Ok(key) => Ok(key.clone()),
        Err(e) => Err(format!("{e:?}")),
    }
}

#[test]
fn object_case_is_folded_record_id_case_is_kept() {
    let upper = key(r#"{"object":"Lead","record_id":"00Qa"}"#).unwrap();
    let lower = key(r#"{"object":"lead","record_id":"00Qa"}"#).unwrap();
    let shout = key(r#"{"object":"LEAD","record_id":"00Qa"}"#).unwrap();
    assert_eq!(upper, Some("lead:00Qa".to_string()));
    assert_eq!(upper, lower, "one object, one key");
    assert_eq!(upper, shout);
    assert_ne!(
        key(r#"{"object":"Lead","record_id":"00QA"}"#).unwrap(),
        upper,
        "record ids are case-sensitive"
    );
    assert_eq!(
        RecordKey::new("Lead", "00Qa").unwrap().into_string(),
        "lead:00Qa"
    );
}

#[test]
fn derivation_table() {
    let ok = |s: &str| Ok(Some(s.to_string()));
    let cases: &[(&str, Result<Option<String>, RecordKeyError>)] = &[
        (
            r#"{"object":"Lead","record_id":"00Q1","snapshot":{"Name":"A"}}"#,
            ok("lead:00Q1"),
        ),
        (
            r#"{"object":"Account","record_id":"001x"}"#,
            ok("account:001x"),
        ),
        (
            r#"{"object":"Custom_Obj__c","record_id":"a01"}"#,
            ok("custom_obj__c:a01"),
        ),
        (r#"{"kind":"digest"}"#, Ok(None)),
        (r#"{}"#, Ok(None)),
        (r#"{"object":"Lead"}"#, Ok(None)),
        (r#"{"object":"Lead","record_id":null}"#, Ok(None)),
        (
            r#"{"record_id":"00Q1"}"#,
            Err(RecordKeyError::MissingObject),
        ),
        (
            r#"{"object":null,"record_id":"00Q1"}"#,
            Err(RecordKeyError::MissingObject),
        ),
        (r#"[1,2]"#, Err(RecordKeyError::NotAnObject)),
        (r#""Lead:1""#, Err(RecordKeyError::NotAnObject)),
        (
            r#"{"object":"Lead","record_id":""}"#,
            Err(RecordKeyError::InvalidRecordId("empty".into())),
        ),
        (
            r#"{"object":"Lead","record_id":" 00Q1"}"#,
            Err(RecordKeyError::InvalidRecordId(
                "leading or trailing white space".into(),
            )),
        ),
        (
            r#"{"object":"Lead","record_id":"00\u0000Q1"}"#,
            Err(RecordKeyError::InvalidRecordId(
                "contains a control character".into(),
            )),
        ),
        (
            r#"{"object":"Lead","record_id":42}"#,
            Err(RecordKeyError::InvalidRecordId(
                "expected a string, found a number".into(),
            )),
        ),
        (
            r#"{"object":"Le ad","record_id":"1"}"#,
            Err(RecordKeyError::InvalidObject("\"Le ad\"".into())),
        ),
        (
            r#"{"object":"1Lead","record_id":"1"}"#,
            Err(RecordKeyError::InvalidObject("\"1Lead\"".into())),
        ),
        (
            r#"{"object":"Lead:x","record_id":"1"}"#,
            Err(RecordKeyError::InvalidObject("\"Lead:x\"".into())),
        ),
        (
            r#"{"object":7,"record_id":"1"}"#,
            Err(RecordKeyError::InvalidObject(
                "expected a string, found a number".into(),
            )),
        ),
        (
            r#"{"object":"Lead","record_id":"1","snapshot":[1]}"#,
            Err(RecordKeyError::InvalidSnapshot),
        ),
    ];
    for (payload, expected) in cases {
        assert_eq!(shown(&key(payload)), shown(expected), "payload {payload}");
    }
}

#[test]
fn invalid_json_is_a_typed_error() {
    assert!(matches!(
        key("{not json"),
        Err(RecordKeyError::InvalidJson(_))
    ));
    assert!(matches!(key(""), Err(RecordKeyError::InvalidJson(_))));
}

#[test]
fn invalid_json_keeps_the_parser_error_as_its_source() {
    use std::error::Error as _;
    let err = record_key_from_payload("{\"object\": \"Lead\",\n  oops}").unwrap_err();
    let source = err.source().expect("InvalidJson has a source");
    let parser = source
        .downcast_ref::<serde_json::Error>()
        .expect("the source is the serde_json::Error itself");
    assert_eq!((parser.line(), parser.column()), (2, 3), "position kept");
    assert!(parser.is_syntax());
    assert_eq!(
        err.to_string(),
        format!("payload is not valid JSON: {parser}"),
        "the message still names the parser's error"
    );
    for err in [
        RecordKeyError::NotAnObject,
        RecordKeyError::MissingObject,
        RecordKeyError::InvalidObject("x".into()),
        RecordKeyError::InvalidRecordId("x".into()),
        RecordKeyError::InvalidSnapshot,
    ] {
        assert!(err.source().is_none(), "{err:?} holds no underlying error");
    }
}

#[test]
fn a_stored_key_is_taken_as_is() {
    // Text that `RecordKey::new` would refuse or fold, as foreign code may have stored it.
    for text in [
        "Lead:00Q1",
        " lead:00Q1 ",
        "no-colon-at-all",
        "",
        "lead:a\u{0}b",
        "LEAD:ünïcode",
    ] {
        let key = RecordKey::from_stored(text);
        assert_eq!(key.as_str(), text);
        assert_eq!(key.to_string(), text);
        assert_eq!(key.clone().into_string(), text);
        assert_eq!(
            serde_json::from_str::<RecordKey>(&serde_json::to_string(&key).unwrap()).unwrap(),
            key,
            "serialisation round-trips the stored text"
        );
    }
    assert_eq!(
        RecordKey::from_stored(String::from("lead:00Q1")),
        RecordKey::new("Lead", "00Q1").unwrap(),
        "a stored key equals the derived key with the same text"
    );
    assert_ne!(
        RecordKey::from_stored("Lead:00Q1"),
        RecordKey::new("Lead", "00Q1").unwrap(),
        "a stored key is not folded"
    );
}

#[test]
fn lengths_are_bounded() {
    let long_id = "x".repeat(MAX_RECORD_ID_LEN + 1);
    let payload = format!(r#"{{"object":"Lead","record_id":"{long_id}"}}"#);
    assert!(matches!(
        key(&payload),
        Err(RecordKeyError::InvalidRecordId(_))
    ));
    let max_id = "x".repeat(MAX_RECORD_ID_LEN);
    let payload = format!(r#"{{"object":"Lead","record_id":"{max_id}"}}"#);
    assert_eq!(key(&payload).unwrap(), Some(format!("lead:{max_id}")));
    let long_object = "L".repeat(MAX_OBJECT_LEN + 1);
    assert!(matches!(
        RecordKey::new(&long_object, "1"),
        Err(RecordKeyError::InvalidObject(_))
    ));
}

#[test]
fn record_key_new_matches_derivation() {
    let built = RecordKey::new("Opportunity", "006A").unwrap();
    let derived = record_key_from_payload(r#"{"object":"Opportunity","record_id":"006A"}"#)
        .unwrap()
        .unwrap();
    assert_eq!(built, derived);
    assert_eq!(built.to_string(), "opportunity:006A");
}

/// A small deterministic generator (SplitMix64), so the property test needs no extra crate and
/// every failure is reproducible from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn word(&mut self) -> String {
        let len = 1 + self.below(8);
        (0..len)
            .map(|_| (b'a' + self.below(26) as u8) as char)
            .collect()
    }
    fn space(&mut self) -> &'static str {
        [" ", "", "\n", "\t", "  ", "\r\n"][self.below(6)]
    }
}

/// Renders `members` as a JSON object with random white space between tokens.
fn render(members: &[(String, String)], rng: &mut Rng) -> String {
    let mut out = String::from("{");
    for (i, (name, value)) in members.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(rng.space());
        out.push_str(&serde_json::to_string(name).unwrap());
        out.push_str(rng.space());
        out.push(':');
        out.push_str(rng.space());
        out.push_str(value);
        out.push_str(rng.space());
    }
    out.push('}');
    out
}

#[test]
fn same_record_same_key_whatever_order_whitespace_or_unrelated_fields() {
    for seed in 0..2_000u64 {
        let mut rng = Rng(seed);
        let object = format!("O{}", rng.word());
        let record_id = format!("{}{}", rng.word(), rng.below(1000));
        let expected = format!("{}:{record_id}", object.to_ascii_lowercase());
        for _ in 0..4 {
            let mut members = vec![
                (
                    "object".to_string(),
                    serde_json::to_string(&object).unwrap(),
                ),
                (
                    "record_id".to_string(),
                    serde_json::to_string(&record_id).unwrap(),
                ),
                (
                    "snapshot".to_string(),
                    format!(r#"{{"{}":{}}}"#, rng.word(), rng.below(100)),
                ),
            ];
            for _ in 0..rng.below(4) {
                let name = format!("x_{}", rng.word());
                members.push((name, serde_json::to_string(&rng.word()).unwrap()));
            }
            // Fisher-Yates shuffle of member order.
            for i in (1..members.len()).rev() {
                let j = rng.below(i + 1);
                members.swap(i, j);
            }
            let payload = render(&members, &mut rng);
            assert_eq!(
                shown(&key(&payload)),
                Ok(Some(expected.clone())),
                "seed {seed}, payload {payload}"
            );
        }
    }
}

#[test]
fn different_records_get_different_keys() {
    let a = key(r#"{"object":"Lead","record_id":"1"}"#).unwrap();
    let b = key(r#"{"object":"Lead","record_id":"2"}"#).unwrap();
    let c = key(r#"{"object":"Contact","record_id":"1"}"#).unwrap();
    assert_ne!(a, b);
    assert_ne!(a, c);
}

#[test]
fn an_envelope_debug_shows_no_field_value() {
    let env = EventEnvelope::parse(
        r#"{"object":"Lead","record_id":"1","snapshot":{"Card":"4111 1111 1111 1111"},"note":"secret"}"#,
    )
    .unwrap();
    for shown in [format!("{env:?}"), format!("{env:#?}")] {
        assert!(
            !shown.contains("4111") && !shown.contains("secret"),
            "{shown}"
        );
        assert!(shown.contains("Card") && shown.contains("Lead"), "{shown}");
    }
}
