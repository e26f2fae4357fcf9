//! Unit tests of the kit's diff and report, on captures built by hand (the database-backed
//! checks are in `tests/it/create_action.rs`).

use serde_json::{Value, json};

use super::capture::{Capture, TableCapture};
use super::diff::diff;
use super::report::{CapturedRow, Difference, Phase, Report};

fn row(value: Value) -> CapturedRow {
    serde_json::from_value(value).unwrap()
}

fn table(identity: &[&str], rows: Vec<Value>) -> TableCapture {
    TableCapture {
        identity: identity.iter().map(|s| s.to_string()).collect(),
        rows: rows.into_iter().map(row).collect(),
    }
}

fn capture(tables: Vec<(&str, TableCapture)>, counters: &[(&str, &str, i64)]) -> Capture {
    Capture {
        tables: tables
            .into_iter()
            .map(|(name, t)| (name.to_string(), t))
            .collect(),
        counters: counters
            .iter()
            .map(|(o, f, v)| ((o.to_string(), f.to_string()), *v))
            .collect(),
    }
}

#[test]
fn equal_captures_have_no_difference() {
    let c = capture(
        vec![(
            "lead",
            table(&["id"], vec![json!({"id": 1, "status": "Open"})]),
        )],
        &[("opportunity", "number", 2)],
    );
    assert!(diff(&c, &c.clone(), Phase::Redelivery).is_empty());
}

#[test]
fn changed_values_name_table_row_and_column() {
    let b = capture(
        vec![("lead", table(&["id"], vec![json!({"id": 1, "touches": 1})]))],
        &[],
    );
    let a = capture(
        vec![("lead", table(&["id"], vec![json!({"id": 1, "touches": 2})]))],
        &[],
    );
    let d = diff(&b, &a, Phase::Redelivery);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].column(), Some("touches"));
    assert_eq!(
        d[0].to_string(),
        "after the second delivery: lead [id=1] column touches: 1 -> 2"
    );
}

#[test]
fn inserted_duplicated_rows_and_counters_are_reported() {
    let b = capture(
        vec![
            (
                "opportunity",
                table(&["id"], vec![json!({"id": 1, "lead": "L1"})]),
            ),
            ("note", table(&["lead"], vec![json!({"lead": "L1"})])),
        ],
        &[("opportunity", "number", 2)],
    );
    let a = capture(
        vec![
            (
                "opportunity",
                table(
                    &["id"],
                    vec![
                        json!({"id": 1, "lead": "L1"}),
                        json!({"id": 2, "lead": "L1"}),
                    ],
                ),
            ),
            (
                "note",
                table(
                    &["lead"],
                    vec![json!({"lead": "L1"}), json!({"lead": "L1"})],
                ),
            ),
        ],
        &[("opportunity", "number", 3)],
    );
    let shown: Vec<String> = diff(&b, &a, Phase::ConcurrentRedelivery)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        shown,
        [
            r#"after two concurrent deliveries: note [lead="L1"]: duplicated row: 1 -> 2 rows with this identity"#,
            r#"after two concurrent deliveries: opportunity [id=2]: row inserted {"id":2,"lead":"L1"}"#,
            "after two concurrent deliveries: autonumber opportunity.number moved: next value 2 -> 3 (a value was drawn)",
        ]
    );
}

#[test]
fn a_report_with_differences_is_not_idempotent() {
    let report = Report {
        first_delivery: Vec::new(),
        differences: vec![Difference::DeliveryFailed {
            phase: Phase::Redelivery,
            error: "duplicate key".into(),
        }],
    };
    assert!(!report.is_idempotent());
    assert_eq!(
        report.to_string(),
        "redelivery changed the database (1 difference(s)):\n  after the second delivery: the delivery failed: duplicate key\n"
    );
    let clean = Report {
        first_delivery: Vec::new(),
        differences: Vec::new(),
    };
    assert!(clean.is_idempotent());
    clean.assert_idempotent();
}

#[tokio::test]
async fn kit_errors_keep_their_cause() {
    use std::error::Error as _;

    use super::{KitError, Pool, Redelivery};
    use crate::ActionConn;

    let err = Pool::connect("mysql://nowhere").await.unwrap_err();
    assert!(matches!(err, KitError::InvalidUrl(_)), "{err:?}");

    let pool = Pool::connect("sqlite::memory:").await.unwrap();
    let err = Redelivery::new(pool.clone())
        .capture("no table; --")
        .check(
            &async |_: &mut dyn ActionConn, _: &Value| Ok::<(), crate::Error>(()),
            &json!({}),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, KitError::InvalidIdentifier(_)), "{err:?}");

    let failing =
        async |_: &mut dyn ActionConn, _: &Value| Err::<(), _>(crate::Error::MissingRecordId);
    let err = Redelivery::new(pool)
        .check(&failing, &json!({}))
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "the handler failed on the first delivery");
    let source = err.source().expect("the handler's error is kept");
    assert!(matches!(
        source.downcast_ref::<crate::Error>(),
        Some(crate::Error::MissingRecordId)
    ));
}
