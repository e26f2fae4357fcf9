//! The create action on SQLite and PostgreSQL: the #3477 natural-key create under redelivery and
//! races, refused identifiers, and every field-set class under the redelivery kit.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use create_action::redelivery::{Difference, Phase, Pool, Redelivery};
use create_action::{
    ActionConn, ColumnType, CreateOutcome, Effect, EffectClass, Error, FieldSet, FindOrCreate,
    NonDeterminism, ObjectDef, Registry, Rhs, Source, autonumber,
};
use outbox_tests::{TestDb, backend_tests};
use serde_json::{Value, json};

const HOSTILE: &str = "Name\"; DROP TABLE x; --";

const POSTGRES_SCHEMA: &str = "
CREATE TABLE Opportunity (
    Id                BIGSERIAL PRIMARY KEY,
    SourceLeadId      TEXT   NOT NULL,
    RelationName      TEXT   NOT NULL,
    Name              TEXT   NOT NULL,
    OpportunityNumber BIGINT NOT NULL,
    CONSTRAINT opportunity_natural_key UNIQUE (SourceLeadId, RelationName)
);
CREATE TABLE Lead (
    Id          TEXT PRIMARY KEY,
    Status      TEXT,
    Notes       TEXT,
    Touches     BIGINT,
    ConvertedAt TIMESTAMPTZ,
    Ticket      BIGINT,
    Owner       TEXT
);
CREATE TABLE Unindexed (
    Id           BIGSERIAL PRIMARY KEY,
    SourceLeadId TEXT NOT NULL,
    Name         TEXT
);";

const SQLITE_SCHEMA: &str = "
CREATE TABLE Opportunity (
    Id                INTEGER PRIMARY KEY AUTOINCREMENT,
    SourceLeadId      TEXT    NOT NULL,
    RelationName      TEXT    NOT NULL,
    Name              TEXT    NOT NULL,
    OpportunityNumber INTEGER NOT NULL,
    CONSTRAINT opportunity_natural_key UNIQUE (SourceLeadId, RelationName)
);
CREATE TABLE Lead (
    Id          TEXT PRIMARY KEY NOT NULL,
    Status      TEXT,
    Notes       TEXT,
    Touches     INTEGER,
    ConvertedAt TEXT,
    Ticket      INTEGER,
    Owner       TEXT
);
CREATE TABLE Unindexed (
    Id           INTEGER PRIMARY KEY AUTOINCREMENT,
    SourceLeadId TEXT NOT NULL,
    Name         TEXT
);";

/// The test schema and its registered metadata.
async fn setup(db: &TestDb) -> Registry {
    match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => sqlx::raw_sql(POSTGRES_SCHEMA).execute(pg).await.map(drop),
        (_, Some(sqlite)) => sqlx::raw_sql(SQLITE_SCHEMA).execute(sqlite).await.map(drop),
        _ => unreachable!("a test database is on one backend"),
    }
    .expect("create the test schema");
    let mut registry = Registry::new();
    registry
        .register(
            ObjectDef::builder("Opportunity")
                .read_only("Id", ColumnType::Integer)
                .natural_key("SourceLeadId", ColumnType::Text)
                .natural_key("RelationName", ColumnType::Text)
                .field("Name", ColumnType::Text)
                .autonumber("OpportunityNumber")
                .build()
                .unwrap(),
        )
        .unwrap();
    registry
        .register(
            ObjectDef::builder("Lead")
                .read_only("Id", ColumnType::Text)
                .field("Status", ColumnType::Text)
                .field("Notes", ColumnType::Text)
                .field("Touches", ColumnType::Integer)
                .field("ConvertedAt", ColumnType::Timestamp)
                .field("Ticket", ColumnType::Integer)
                .field("Owner", ColumnType::Text)
                .build()
                .unwrap(),
        )
        .unwrap();
    registry
        .register(
            ObjectDef::builder("Unindexed")
                .read_only("Id", ColumnType::Integer)
                .natural_key("SourceLeadId", ColumnType::Text)
                .field("Name", ColumnType::Text)
                .build()
                .unwrap(),
        )
        .unwrap();
    registry
}

/// The #3477 create: the opportunity of a converted lead, keyed by the lead and the relation.
fn conversion(registry: &Registry) -> FindOrCreate {
    FindOrCreate::builder(registry.get("Opportunity").unwrap())
        .key("SourceLeadId", Source::RecordId)
        .key("RelationName", json!("converted_opportunity"))
        .field("Name", Source::snapshot("Company"))
        .build()
        .unwrap()
}

fn lead_converted(lead: &str) -> Value {
    json!({
        "object": "Lead",
        "record_id": lead,
        "snapshot": {"Company": format!("Acme {lead}"), "Status": "Converted", "Owner": "ana"}
    })
}

fn pool(db: &TestDb) -> Pool {
    match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => Pool::from(pg.clone()),
        (_, Some(sqlite)) => Pool::from(sqlite.clone()),
        _ => unreachable!("a test database is on one backend"),
    }
}

/// One delivery of `payload` to `action`, in a committed transaction opened as the outbox
/// attempt opens it.
async fn create(
    db: &TestDb,
    action: &FindOrCreate,
    payload: &Value,
) -> Result<CreateOutcome, Error> {
    let event = create_action::envelope(payload)?;
    match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => {
            let mut tx = pg.begin().await?;
            let outcome = action.run(&mut *tx, &event).await?;
            tx.commit().await?;
            Ok(outcome)
        }
        (_, Some(sqlite)) => {
            let mut tx = sqlite.begin_with("BEGIN IMMEDIATE").await?;
            let outcome = action.run(&mut *tx, &event).await?;
            tx.commit().await?;
            Ok(outcome)
        }
        _ => unreachable!("a test database is on one backend"),
    }
}

async fn scalar(db: &TestDb, sql: &'static str, arg: &str) -> i64 {
    match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => sqlx::query_scalar(sql).bind(arg).fetch_one(pg).await,
        (_, Some(sqlite)) => sqlx::query_scalar(sql).bind(arg).fetch_one(sqlite).await,
        _ => unreachable!("a test database is on one backend"),
    }
    .unwrap()
}

async fn execute(db: &TestDb, sql: &'static str, arg: &str) {
    match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => sqlx::query(sql).bind(arg).execute(pg).await.map(drop),
        (_, Some(sqlite)) => sqlx::query(sql).bind(arg).execute(sqlite).await.map(drop),
        _ => unreachable!("a test database is on one backend"),
    }
    .unwrap()
}

async fn opportunities_of(db: &TestDb, lead: &str) -> i64 {
    scalar(
        db,
        "SELECT count(*) FROM Opportunity WHERE SourceLeadId = $1",
        lead,
    )
    .await
}

async fn numbers(db: &TestDb) -> Vec<i64> {
    let sql = "SELECT OpportunityNumber FROM Opportunity ORDER BY OpportunityNumber";
    match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => sqlx::query_scalar(sql).fetch_all(pg).await,
        (_, Some(sqlite)) => sqlx::query_scalar(sql).fetch_all(sqlite).await,
        _ => unreachable!("a test database is on one backend"),
    }
    .unwrap()
}

async fn next_number(db: &TestDb) -> Option<i64> {
    match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => {
            let mut conn = pg.acquire().await.unwrap();
            autonumber::next_value(&mut *conn, "Opportunity", "OpportunityNumber").await
        }
        (_, Some(sqlite)) => {
            let mut conn = sqlite.acquire().await.unwrap();
            autonumber::next_value(&mut *conn, "Opportunity", "OpportunityNumber").await
        }
        _ => unreachable!("a test database is on one backend"),
    }
    .unwrap()
}

/// The #3477 case delivered 1, 2 and 5 times: one row per lead, numbers 1, 2, 3 without a gap.
async fn conversion_create_delivered_once_twice_and_five_times(db: TestDb) {
    let registry = setup(&db).await;
    let action = conversion(&registry);
    for (lead, deliveries) in [("00Q-once", 1), ("00Q-twice", 2), ("00Q-five", 5)] {
        let payload = lead_converted(lead);
        let first = create(&db, &action, &payload).await.unwrap();
        assert!(first.created, "the first delivery creates");
        assert_eq!(first.row["Name"], json!(format!("Acme {lead}")));
        for _ in 1..deliveries {
            let again = create(&db, &action, &payload).await.unwrap();
            assert!(!again.created, "a redelivery finds the row");
            assert_eq!(again.row, first.row, "a redelivery returns the same row");
        }
        assert_eq!(
            opportunities_of(&db, lead).await,
            1,
            "{lead}: exactly one row"
        );
    }
    assert_eq!(
        numbers(&db).await,
        [1, 2, 3],
        "one number per create, no gap"
    );
    assert_eq!(
        next_number(&db).await,
        Some(4),
        "the counter is one past the creates"
    );
}

/// Two concurrent deliveries of each of ten events: one row and one number per event.
async fn conversion_create_delivered_twice_concurrently(db: TestDb) {
    let registry = setup(&db).await;
    let action = conversion(&registry);
    for n in 0..10 {
        let payload = lead_converted(&format!("00Q-race-{n}"));
        let (a, b) = tokio::join!(
            create(&db, &action, &payload),
            create(&db, &action, &payload)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(
            a.created != b.created,
            "exactly one of the two deliveries creates"
        );
        assert_eq!(a.row, b.row, "both return the winner's row");
    }
    assert_eq!(
        numbers(&db).await,
        (1..=10).collect::<Vec<i64>>(),
        "no gap, no duplicate"
    );
    assert_eq!(next_number(&db).await, Some(11), "no value was burned");
}

/// The loser of a natural-key race hands its drawn value back. On PostgreSQL the loser waits on
/// the counter row, draws after the winner commits, loses the insert and rolls back to its
/// savepoint; on SQLite a transaction that read before the winner committed cannot write at all
/// and is retried.
async fn lost_race_burns_no_autonumber(db: TestDb) {
    let registry = setup(&db).await;
    let action = conversion(&registry);
    let payload = lead_converted("00Q-lost-race");
    let event = create_action::envelope(&payload).unwrap();
    if let Some(pg) = db.pg() {
        let mut winner = pg.begin().await.unwrap();
        let won = action.run(&mut *winner, &event).await.unwrap();
        assert!(won.created);
        let loser = {
            let (pg, action, event) = (pg.clone(), action.clone(), event.clone());
            tokio::spawn(async move {
                let mut tx = pg.begin().await.unwrap();
                let outcome = action.run(&mut *tx, &event).await.unwrap();
                tx.commit().await.unwrap();
                outcome
            })
        };
        // Wait (without sleeping) until the loser is blocked on the winner's counter row.
        tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(pg)
                .await
                .unwrap();
                if waiting > 0 {
                    break;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the second creator waits for the first");
        winner.commit().await.unwrap();
        let lost = loser.await.unwrap();
        assert!(!lost.created, "the loser returns the winner's row");
        assert_eq!(lost.row, won.row);
    } else if let Some(sqlite) = db.sqlite_pool() {
        let mut loser = sqlite.begin().await.unwrap();
        let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM Opportunity")
            .fetch_one(&mut *loser)
            .await
            .unwrap();
        assert_eq!(seen, 0, "the loser read before the winner committed");
        let won = create(&db, &action, &payload).await.unwrap();
        assert!(won.created);
        let err = action.run(&mut *loser, &event).await.unwrap_err();
        assert!(
            err.is_transient(),
            "a stale writer is told to retry: {err:?}"
        );
        loser.rollback().await.unwrap();
        let retried = create(&db, &action, &payload).await.unwrap();
        assert!(!retried.created, "the retry finds the winner's row");
        assert_eq!(retried.row, won.row);
    }
    assert_eq!(opportunities_of(&db, "00Q-lost-race").await, 1);
    assert_eq!(numbers(&db).await, [1]);
    assert_eq!(
        next_number(&db).await,
        Some(2),
        "the loser's draw was handed back"
    );
}

/// A find-or-create on a connection without an open transaction makes its own.
async fn conversion_create_outside_a_transaction(db: TestDb) {
    let registry = setup(&db).await;
    let action = conversion(&registry);
    let event = create_action::envelope(&lead_converted("00Q-autocommit")).unwrap();
    let outcomes = match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => {
            let mut conn = pg.acquire().await.unwrap();
            [
                action.run(&mut *conn, &event).await.unwrap(),
                action.run(&mut *conn, &event).await.unwrap(),
            ]
        }
        (_, Some(sqlite)) => {
            let mut conn = sqlite.acquire().await.unwrap();
            [
                action.run(&mut *conn, &event).await.unwrap(),
                action.run(&mut *conn, &event).await.unwrap(),
            ]
        }
        _ => unreachable!("a test database is on one backend"),
    };
    assert!(outcomes[0].created && !outcomes[1].created);
    assert_eq!(next_number(&db).await, Some(2));
}

/// The kit finds nothing to report for the #3477 create, and shows what the first delivery did.
async fn kit_proves_the_conversion_create_idempotent(db: TestDb) {
    let registry = setup(&db).await;
    let action = conversion(&registry);
    let handler = async |conn: &mut dyn ActionConn, payload: &Value| -> Result<(), Error> {
        action
            .run(conn, &create_action::envelope(payload)?)
            .await
            .map(drop)
    };
    let report = Redelivery::new(pool(&db))
        .capture_by("Opportunity", &["SourceLeadId", "RelationName"])
        .check(&handler, &lead_converted("00Q-kit"))
        .await
        .unwrap();
    report.assert_idempotent();
    let first = report.first_delivery();
    assert!(
        matches!(&first[0], Difference::RowInserted { table, .. } if table == "opportunity"),
        "{first:?}"
    );
    assert!(
        matches!(
            &first[1],
            Difference::CounterMoved {
                before: None,
                after: Some(2),
                ..
            }
        ),
        "{first:?}"
    );
    assert_eq!(first.len(), 2);
}

/// A create without a natural key: the kit reports the duplicated rows of every redelivery.
async fn kit_detects_a_create_without_natural_key(db: TestDb) {
    setup(&db).await;
    let handler = async |conn: &mut dyn ActionConn, payload: &Value| -> Result<(), Error> {
        let lead = payload["record_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let sql = "INSERT INTO Unindexed (SourceLeadId, Name) VALUES ($1, 'naive')";
        match conn.any() {
            create_action::AnyConn::Postgres(c) => {
                sqlx::query(sql).bind(lead).execute(c).await.map(drop)?
            }
            create_action::AnyConn::Sqlite(c) => {
                sqlx::query(sql).bind(lead).execute(c).await.map(drop)?
            }
        }
        Ok(())
    };
    let report = Redelivery::new(pool(&db))
        .capture_by("Unindexed", &["SourceLeadId"])
        .check(&handler, &lead_converted("00Q-naive"))
        .await
        .unwrap();
    assert!(!report.is_idempotent());
    let duplicates: Vec<(Phase, usize, usize)> = report
        .differences()
        .iter()
        .filter_map(|d| match d {
            Difference::RowDuplicated {
                phase,
                before,
                after,
                ..
            } => Some((*phase, *before, *after)),
            _ => None,
        })
        .collect();
    assert_eq!(
        duplicates,
        [
            (Phase::Redelivery, 1, 2),
            (Phase::ConcurrentRedelivery, 2, 4)
        ]
    );
    assert!(
        report
            .to_string()
            .contains(r#"unindexed [sourceleadid="00Q-naive"]: duplicated row: 1 -> 2"#)
    );
}

/// A hostile name never reaches the database; a hostile value is bound and stored verbatim.
async fn hostile_identifiers_are_refused(db: TestDb) {
    let registry = setup(&db).await;
    let expected = format!(
        "invalid identifier {HOSTILE:?}: only ASCII letters, digits and underscores are allowed"
    );
    let err = ObjectDef::builder(HOSTILE).build().unwrap_err();
    assert_eq!(err.to_string(), expected);
    let err = ObjectDef::builder("Opportunity")
        .natural_key(HOSTILE, ColumnType::Text)
        .build()
        .unwrap_err();
    assert_eq!(err.to_string(), expected);
    let err = FindOrCreate::builder(registry.get("Opportunity").unwrap())
        .key(HOSTILE, Source::RecordId)
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::UnknownColumn { .. }), "{err}");
    let err = Redelivery::new(pool(&db))
        .capture(HOSTILE)
        .check(
            &async |_: &mut dyn ActionConn, _: &Value| Ok::<(), Error>(()),
            &json!({}),
        )
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), expected);
    let err = match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => {
            autonumber::next_value(&mut *pg.acquire().await.unwrap(), HOSTILE, "N").await
        }
        (_, Some(sqlite)) => {
            autonumber::next_value(&mut *sqlite.acquire().await.unwrap(), HOSTILE, "N").await
        }
        _ => unreachable!("a test database is on one backend"),
    }
    .unwrap_err();
    assert_eq!(err.to_string(), expected);

    let hostile_value = "Acme'); DROP TABLE Opportunity; --";
    let payload = json!({"object": "Lead", "record_id": "00Q-hostile", "snapshot": {"Company": hostile_value}});
    let created = create(&db, &conversion(&registry), &payload).await.unwrap();
    assert_eq!(created.row["Name"], json!(hostile_value));
    assert_eq!(
        opportunities_of(&db, "00Q-hostile").await,
        1,
        "the table is still there"
    );
}

/// Find-or-create names the natural key as its conflict target, so a table without the
/// `UNIQUE` index is refused instead of silently allowing duplicates.
async fn a_missing_unique_index_is_refused(db: TestDb) {
    let registry = setup(&db).await;
    let action = FindOrCreate::builder(registry.get("Unindexed").unwrap())
        .key("SourceLeadId", Source::RecordId)
        .field("Name", json!("x"))
        .build()
        .unwrap();
    let err = create(&db, &action, &lead_converted("00Q-unindexed"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Database(_)), "{err:?}");
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM Unindexed WHERE Name = $1", "x").await,
        0
    );
}

async fn insert_lead(db: &TestDb, id: &str) {
    execute(
        db,
        "INSERT INTO Lead (Id, Status, Notes, Touches) VALUES ($1, 'Open', 'created;', 1)",
        id,
    )
    .await;
}

fn field_set(registry: &Registry, column: &str, rhs: Rhs) -> FieldSet {
    FieldSet::builder(registry.get("Lead").unwrap())
        .target("Id", Source::RecordId)
        .set(column, rhs)
        .build()
        .unwrap()
}

/// Runs the kit on `action` for a fresh lead `lead`; `Now` is the delivery's wall-clock time.
async fn kit_on(db: &TestDb, action: &FieldSet, lead: &str) -> create_action::redelivery::Report {
    insert_lead(db, lead).await;
    let handler = async |conn: &mut dyn ActionConn, payload: &Value| -> Result<(), Error> {
        let event = create_action::envelope(payload)?;
        let rows = action.run(conn, &event, SystemTime::now()).await?;
        assert_eq!(rows, 1, "the target row exists");
        Ok(())
    };
    Redelivery::new(pool(db))
        .capture("Lead")
        .check(&handler, &lead_converted(lead))
        .await
        .unwrap()
}

/// Snapshot and literal sets: classified deterministic, and the kit proves them safe.
async fn deterministic_sets_are_redelivery_safe(db: TestDb) {
    let registry = setup(&db).await;
    let action = FieldSet::builder(registry.get("Lead").unwrap())
        .target("Id", Source::RecordId)
        .set("Status", Rhs::snapshot("Status"))
        .set("Owner", Rhs::literal("sales-queue"))
        .build()
        .unwrap();
    assert_eq!(action.effect_class(), EffectClass::DeterministicSet);
    let report = kit_on(&db, &action, "00Q-deterministic").await;
    report.assert_idempotent();
    let changed: Vec<_> = report
        .first_delivery()
        .iter()
        .filter_map(Difference::column)
        .collect();
    assert_eq!(changed, ["owner", "status"], "the first delivery did write");
}

/// The values each phase saw in `column`: `(phase, before, after)`.
fn changes(report: &create_action::redelivery::Report, column: &str) -> Vec<(Phase, Value, Value)> {
    report
        .differences()
        .iter()
        .filter_map(|d| match d {
            Difference::ValueChanged {
                phase,
                column: c,
                before,
                after,
                ..
            } if c == column => Some((*phase, before.clone(), after.clone())),
            _ => None,
        })
        .collect()
}

/// `Now`, `Append` and `Increment` sets: classified non-deterministic, and the kit shows the
/// values every redelivery changed.
async fn now_append_and_increment_sets_are_detected(db: TestDb) {
    let registry = setup(&db).await;

    let now = field_set(&registry, "ConvertedAt", Rhs::Now);
    assert_eq!(now.effect_class().reasons()[0].kind, NonDeterminism::Now);
    let report = kit_on(&db, &now, "00Q-now").await;
    let seen = changes(&report, "convertedat");
    assert_eq!(seen.len(), 2, "{report}");
    assert_eq!(seen[0].0, Phase::Redelivery);
    assert_eq!(seen[1].0, Phase::ConcurrentRedelivery);
    assert!(seen.iter().all(|(_, before, after)| before != after));

    let append = field_set(
        &registry,
        "Notes",
        Rhs::Append(Source::literal("converted;")),
    );
    assert_eq!(
        append.effect_class().reasons()[0].kind,
        NonDeterminism::Append
    );
    let report = kit_on(&db, &append, "00Q-append").await;
    assert_eq!(
        changes(&report, "notes"),
        [
            (
                Phase::Redelivery,
                json!("created;converted;"),
                json!("created;converted;converted;")
            ),
            (
                Phase::ConcurrentRedelivery,
                json!("created;converted;converted;"),
                json!("created;converted;converted;converted;converted;")
            ),
        ]
    );

    let increment = field_set(&registry, "Touches", Rhs::Increment(Source::literal(1)));
    assert_eq!(
        increment.effect_class().reasons()[0].kind,
        NonDeterminism::Increment
    );
    let report = kit_on(&db, &increment, "00Q-increment").await;
    assert_eq!(
        changes(&report, "touches"),
        [
            (Phase::Redelivery, json!(2), json!(3)),
            (Phase::ConcurrentRedelivery, json!(3), json!(5)),
        ]
    );
    assert!(
        report
            .to_string()
            .contains(r#"lead [id="00Q-increment"] column touches: 2 -> 3"#),
        "{report}"
    );
}

/// A `Sequence` set draws on every delivery: the kit shows the counter moving. Without a target
/// row it draws nothing.
async fn sequence_set_is_detected(db: TestDb) {
    let registry = setup(&db).await;
    let action = field_set(&registry, "Ticket", Rhs::Sequence);
    assert_eq!(
        action.effect_class().reasons()[0].kind,
        NonDeterminism::Sequence
    );
    let report = kit_on(&db, &action, "00Q-sequence").await;
    assert_eq!(
        changes(&report, "ticket"),
        [
            (Phase::Redelivery, json!(1), json!(2)),
            (Phase::ConcurrentRedelivery, json!(2), json!(4)),
        ]
    );
    let moved: Vec<_> = report
        .differences()
        .iter()
        .filter_map(|d| match d {
            Difference::CounterMoved {
                object,
                field,
                before,
                after,
                ..
            } => Some((object.as_str(), field.as_str(), *before, *after)),
            _ => None,
        })
        .collect();
    assert_eq!(
        moved,
        [
            ("lead", "ticket", Some(2), Some(3)),
            ("lead", "ticket", Some(3), Some(5))
        ]
    );

    let event = create_action::envelope(&lead_converted("00Q-missing")).unwrap();
    let rows = match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => {
            action
                .run(&mut *pg.acquire().await.unwrap(), &event, SystemTime::now())
                .await
        }
        (_, Some(sqlite)) => {
            action
                .run(
                    &mut *sqlite.acquire().await.unwrap(),
                    &event,
                    SystemTime::now(),
                )
                .await
        }
        _ => unreachable!("a test database is on one backend"),
    }
    .unwrap();
    assert_eq!(rows, 0);
    let next = scalar(
        &db,
        "SELECT NextValue FROM _System_Autonumber WHERE FieldName = $1",
        "ticket",
    )
    .await;
    assert_eq!(next, 5, "no value drawn for a missing row");
}

/// `SetIfEmpty` survives a plain redelivery, which is why the kit cannot see it, but it is
/// state-dependent: redelivered after someone cleared the field, it sets the field again.
async fn set_if_empty_resurrects_a_cleared_field(db: TestDb) {
    let registry = setup(&db).await;
    let action = field_set(
        &registry,
        "Owner",
        Rhs::SetIfEmpty(Source::snapshot("Owner")),
    );
    let class = action.effect_class();
    assert!(!class.is_redelivery_safe());
    assert_eq!(class.reasons()[0].kind, NonDeterminism::SetIfEmpty);
    kit_on(&db, &action, "00Q-if-empty")
        .await
        .assert_idempotent();

    execute(
        &db,
        "UPDATE Lead SET Owner = NULL WHERE Id = $1",
        "00Q-if-empty",
    )
    .await;
    let event = create_action::envelope(&lead_converted("00Q-if-empty")).unwrap();
    match (db.pg(), db.sqlite_pool()) {
        (Some(pg), _) => {
            action
                .run(&mut *pg.acquire().await.unwrap(), &event, SystemTime::now())
                .await
        }
        (_, Some(sqlite)) => {
            action
                .run(
                    &mut *sqlite.acquire().await.unwrap(),
                    &event,
                    SystemTime::now(),
                )
                .await
        }
        _ => unreachable!("a test database is on one backend"),
    }
    .unwrap();
    let owners = scalar(
        &db,
        "SELECT count(*) FROM Lead WHERE Id = $1 AND Owner = 'ana'",
        "00Q-if-empty",
    )
    .await;
    assert_eq!(owners, 1, "the redelivery undid the later clear");
}

/// Registries are shared between handlers: an `Arc` of a definition outlives the registry.
async fn actions_outlive_their_registry(db: TestDb) {
    let action = {
        let registry = setup(&db).await;
        Arc::new(conversion(&registry))
    };
    let created = create(&db, &action, &lead_converted("00Q-arc"))
        .await
        .unwrap();
    assert!(created.created);
    assert_eq!(created.row["OpportunityNumber"], json!(1));
}

backend_tests!(
    conversion_create_delivered_once_twice_and_five_times,
    conversion_create_delivered_twice_concurrently,
    lost_race_burns_no_autonumber,
    conversion_create_outside_a_transaction,
    kit_proves_the_conversion_create_idempotent,
    kit_detects_a_create_without_natural_key,
    hostile_identifiers_are_refused,
    a_missing_unique_index_is_refused,
    deterministic_sets_are_redelivery_safe,
    now_append_and_increment_sets_are_detected,
    sequence_set_is_detected,
    set_if_empty_resurrects_a_cleared_field,
    actions_outlive_their_registry,
);
