//! The rollout gate on both backends: each verdict, legacy rows missing their key, and a
//! passing gate; and excluded consumers kept on the legacy path while pull workers run the rest.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use outbox_events::{
    AttemptContext, Consumer, DispatchMode, Dispatcher, EffectKind, ExternalKind, Handler,
    HandlerError, Handlers, OutboxEvent, Safeguard, StartError, Verdict, WorkerConfig,
    evaluate_gate,
};
use outbox_persistence::NewEvent;
use outbox_tests::{RawRow, TestDb, backend_tests, drain};

fn capture() -> Consumer {
    Consumer::new("capture", "account.updated").effect(
        EffectKind::DeterministicFieldSet,
        "Name from the snapshot",
        None,
    )
}

fn mail(safeguard: Option<Safeguard>) -> Consumer {
    Consumer::new("mail", "account.welcome").effect(
        EffectKind::External {
            kind: ExternalKind::Email,
        },
        "welcome email",
        safeguard,
    )
}

/// The mail consumer registered through the effect ledger, as the registry declares it.
fn ledger_mail() -> Consumer {
    struct Sends;
    #[async_trait]
    impl Handler for Sends {
        async fn handle(
            &self,
            _event: &OutboxEvent,
            ctx: &mut AttemptContext<'_>,
        ) -> Result<(), HandlerError> {
            ctx.effect("welcome")
                .once(|_key| async { Ok::<_, HandlerError>(()) })
                .await
        }
    }
    let handlers = Handlers::new().register_with_ledger(mail(Some(Safeguard::Ledger)), Sends);
    let consumers = handlers.consumers();
    assert!(consumers[0].through_ledger());
    consumers[0].clone()
}

fn lead(id: &str) -> String {
    format!(r#"{{"object":"Lead","record_id":"{id}","snapshot":{{}}}}"#)
}

async fn gate_verdicts(db: TestDb) {
    let repo = db.repository();

    // A passing gate: safe and protected consumers (an email sent through the effect ledger),
    // no legacy rows.
    let protected = [capture(), ledger_mail()];
    let report = evaluate_gate(&repo, &protected).await.unwrap();
    assert!(report.passes(), "{:?}", report.reasons);
    assert_eq!(report.consumers[1].1, Verdict::Protected);

    // A described contract is not a mechanism the gate can check: an email consumer that
    // only says it has a ledger is unverified, and one that declares the ledger without being
    // registered through it is refused too.
    for (said, why) in [
        (
            mail(Some(Safeguard::Contract("delivery ledger".into()))),
            "unverified contract for a live external consumer (Email)",
        ),
        (
            mail(Some(Safeguard::Ledger)),
            "declares the effect ledger but was registered without it",
        ),
    ] {
        let report = evaluate_gate(&repo, &[capture(), said]).await.unwrap();
        assert!(!report.passes());
        assert!(report.reasons[0].contains(why), "{:?}", report.reasons);
    }

    // A blocked consumer: an external effect without a contract.
    let blocked = [capture(), mail(None)];
    let report = evaluate_gate(&repo, &blocked).await.unwrap();
    assert!(!report.passes());
    assert_eq!(report.reasons.len(), 1);
    assert!(
        report.reasons[0]
            .contains("consumer mail of account.welcome: unprotected live external consumer"),
        "{:?}",
        report.reasons
    );

    // An excluded consumer passes, and its event type stays on the legacy path.
    let excluded = [
        capture(),
        mail(Some(Safeguard::Excluded("no ledger yet".into()))),
    ];
    let report = evaluate_gate(&repo, &excluded).await.unwrap();
    assert!(report.passes());
    assert_eq!(
        report.excluded_event_types(),
        vec!["account.welcome".to_string()]
    );

    // A handler registered without a declaration blocks the gate.
    let undeclared = [capture(), Consumer::undeclared("mystery.event")];
    let report = evaluate_gate(&repo, &undeclared).await.unwrap();
    assert!(
        report
            .reasons
            .iter()
            .any(|r| r.contains("effects not declared"))
    );

    // Legacy rows without RecordKey although their payload derives one block the gate until
    // they are backfilled; an underivable or terminal one does not.
    let now = Utc::now();
    for i in 0..3 {
        db.insert_raw(&RawRow {
            payload: lead(&format!("legacy{i}")),
            ..RawRow::pending(None, now)
        })
        .await;
    }
    db.insert_raw(&RawRow {
        payload: "{broken".into(),
        ..RawRow::pending(None, now)
    })
    .await;
    db.insert_raw(&RawRow {
        payload: lead("done"),
        status: "processed",
        ..RawRow::pending(None, now)
    })
    .await;
    let report = evaluate_gate(&repo, &protected).await.unwrap();
    assert_eq!(report.rows_missing_record_key, 3);
    assert_eq!(report.reasons.len(), 1);
    assert!(
        report.reasons[0].contains("3 non-terminal row(s) lack the RecordKey"),
        "{:?}",
        report.reasons
    );
    let page = repo.backfill_record_keys(None, 100, false).await.unwrap();
    assert_eq!(page.updated, 3);
    assert!(evaluate_gate(&repo, &protected).await.unwrap().passes());

    // On PostgreSQL, so is the function a batch reads the ledger through (migration 0024).
    if db.pg().is_some() {
        db.execute("DROP FUNCTION _System_OutboxFindEffects(uuid[])")
            .await;
        let report = evaluate_gate(&repo, &protected).await.unwrap();
        assert_eq!(report.reasons.len(), 1, "{:?}", report.reasons);
        assert!(report.reasons[0].contains("_System_OutboxFindEffects"));
    }

    // The ledger's table is checked on the database, not assumed.
    db.execute("DROP TABLE _System_OutboxEffect").await;
    let report = evaluate_gate(&repo, &protected).await.unwrap();
    assert_eq!(report.reasons.len(), 1, "{:?}", report.reasons);
    assert!(report.reasons[0].contains("the effect ledger's table (_System_OutboxEffect)"));
    assert!(evaluate_gate(&repo, &[capture()]).await.unwrap().passes());
}

/// Counts its events and logs, across every handler sharing the log, the order events ran in.
struct Count(Arc<AtomicU64>, OrderLog);

type OrderLog = Arc<std::sync::Mutex<Vec<(Option<String>, uuid::Uuid)>>>;

#[async_trait]
impl Handler for Count {
    async fn handle(
        &self,
        event: &OutboxEvent,
        _: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        self.1.lock().unwrap().push((
            event.record_key.as_ref().map(|k| k.as_str().to_owned()),
            event.id,
        ));
        // Hold the key a moment, so a younger event of it would overtake were that possible.
        tokio::time::sleep(Duration::from_millis(3)).await;
        Ok(())
    }
}

/// In pull mode, an excluded consumer's events run on the legacy loop, the others on the pull
/// workers, and a record's order holds across the two paths.
async fn excluded_consumers_run_on_the_legacy_path(db: TestDb) {
    let repo = db.repository();
    let mut events = Vec::new();
    for i in 0..40 {
        let t = if i % 3 == 0 {
            "account.welcome"
        } else {
            "account.updated"
        };
        events.push(NewEvent::new(t, lead(&format!("x{}", i % 5))));
    }
    let mut tx = repo.begin().await.unwrap();
    let ids = repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let (pulled, legacy) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let log = OrderLog::default();
    let handlers = Handlers::new()
        .register_consumer(capture(), Count(pulled.clone(), log.clone()))
        .register_consumer(
            mail(Some(Safeguard::Excluded("no ledger yet".into()))),
            Count(legacy.clone(), log.clone()),
        );
    let report = evaluate_gate(&repo, &handlers.consumers()).await.unwrap();
    assert!(report.passes());
    // The dispatcher evaluates the same gate itself and keeps the excluded consumer's event
    // type on the legacy path.
    let config = WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .with_workers(3)
        .with_poll_interval(Duration::from_millis(20));
    let dispatcher = Dispatcher::new(repo.clone(), handlers, config)
        .start()
        .await
        .unwrap();
    assert_eq!(dispatcher.decision().mode, DispatchMode::Pull);
    assert_eq!(
        dispatcher.decision().excluded_event_types,
        report.excluded_event_types()
    );
    drain(&repo, Duration::from_secs(60)).await;
    dispatcher.shutdown().await;
    assert_eq!(legacy.load(Ordering::SeqCst), 14);
    assert_eq!(pulled.load(Ordering::SeqCst), 26);
    // Each record's events ran in enqueue order, across the two paths.
    let log = log.lock().unwrap().clone();
    for record in 0..5 {
        let key = format!("lead:x{record}");
        let ran: Vec<_> = log
            .iter()
            .filter(|(k, _)| k.as_deref() == Some(key.as_str()))
            .map(|(_, id)| *id)
            .collect();
        let enqueued: Vec<_> = ids
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 5 == record)
            .map(|(_, id)| *id)
            .collect();
        assert_eq!(ran, enqueued, "{key} ran in enqueue order");
    }
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed'")
            .await,
        40
    );
}

/// The library decides the mode itself, fail closed: every verdict through `Dispatcher::decide`.
async fn dispatcher_enforces_the_gate(db: TestDb) {
    let repo = db.repository();
    let decide = |handlers: Handlers, config: WorkerConfig| {
        let repo = repo.clone();
        async move {
            Dispatcher::new(repo, handlers, config)
                .decide()
                .await
                .unwrap()
        }
    };
    let pull = || WorkerConfig::default().with_mode(DispatchMode::Pull);
    let counter = || Count(Arc::default(), OrderLog::default());
    // The flag is off: legacy, nothing refused.
    let d = decide(
        Handlers::new().register_consumer(capture(), counter()),
        WorkerConfig::default().with_mode(DispatchMode::Legacy),
    )
    .await;
    assert_eq!((d.mode, d.refused.len()), (DispatchMode::Legacy, 0));
    // On, with an undeclared consumer: refused, legacy, with the reason.
    let d = decide(
        Handlers::new().register("account.updated", counter()),
        pull(),
    )
    .await;
    assert_eq!(d.mode, DispatchMode::Legacy);
    assert!(
        d.refused.iter().any(|r| r.contains("account.updated")),
        "{:?}",
        d.refused
    );
    // On, with an external consumer without a safeguard: refused.
    let d = decide(
        Handlers::new().register_consumer(mail(None), counter()),
        pull(),
    )
    .await;
    assert_eq!(d.mode, DispatchMode::Legacy);
    assert!(!d.refused.is_empty());
    // On, with safe and excluded consumers: pull, the excluded type on the legacy path.
    let d = decide(
        Handlers::new()
            .register_consumer(capture(), counter())
            .register_consumer(
                mail(Some(Safeguard::Excluded("no ledger yet".into()))),
                counter(),
            ),
        pull(),
    )
    .await;
    assert_eq!(d.mode, DispatchMode::Pull);
    assert_eq!(d.excluded_event_types, vec!["account.welcome".to_string()]);
    // On, with the gate skipped by name: pull, and the decision says why.
    let d = decide(
        Handlers::new().register("account.updated", counter()),
        pull().dangerously_skip_rollout_gate("checked by hand"),
    )
    .await;
    assert_eq!(d.mode, DispatchMode::Pull);
    assert_eq!(d.gate_skipped.as_deref(), Some("checked by hand"));
    // On, with a row whose RecordKey is missing although its payload derives one: refused.
    let legacy_row = RawRow {
        payload: lead("nokey"),
        ..RawRow::pending(None, Utc::now())
    };
    db.insert_raw(&legacy_row).await;
    let d = decide(
        Handlers::new().register_consumer(capture(), counter()),
        pull(),
    )
    .await;
    assert_eq!(d.mode, DispatchMode::Legacy);
    assert!(
        d.refused.iter().any(|r| r.contains("RecordKey")),
        "{:?}",
        d.refused
    );
}

/// `start_pull`: pull workers or an error with the gate's reasons, never the legacy fallback;
/// it asks for pull mode whatever the configuration's mode says.
async fn start_pull_fails_when_the_gate_refuses(db: TestDb) {
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let events = [NewEvent::new("account.welcome", lead("w1"))];
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let ran = Arc::new(AtomicU64::new(0));
    let refused = Dispatcher::new(
        repo.clone(),
        Handlers::new().register_consumer(mail(None), Count(ran.clone(), OrderLog::default())),
        WorkerConfig::default().with_poll_interval(Duration::from_millis(20)),
    )
    .start_pull()
    .await;
    let Err(StartError::PullRefused(decision)) = refused else {
        panic!(
            "expected the gate's refusal, got {:?}",
            refused.map(|h| h.decision().clone())
        );
    };
    assert_eq!(decision.mode, DispatchMode::Legacy);
    assert!(
        decision.refused.iter().any(|r| r.contains("consumer mail")),
        "{:?}",
        decision.refused
    );
    // Nothing started: no legacy loop runs the row either.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'pending'")
            .await,
        1
    );
    // With a safeguard the gate passes: pull workers run, though the configuration said legacy.
    let protected = mail(Some(Safeguard::Excluded("no ledger yet".into())));
    let handle = Dispatcher::new(
        repo.clone(),
        Handlers::new()
            .register_consumer(capture(), Count(ran.clone(), OrderLog::default()))
            .register_consumer(protected, Count(ran.clone(), OrderLog::default())),
        WorkerConfig::default().with_poll_interval(Duration::from_millis(20)),
    )
    .start_pull()
    .await
    .unwrap();
    assert_eq!(handle.decision().mode, DispatchMode::Pull);
    assert!(handle.drained(Duration::from_millis(20)).await.unwrap());
    handle.shutdown().await;
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

/// A dispatcher with a consumer registered through the effect ledger does not start on a
/// database without the ledger's table, in any mode (the legacy path runs the same handlers,
/// which would fail every event): it says which table is missing and starts nothing.
async fn a_ledger_consumer_needs_the_ledger_table_in_every_mode(db: TestDb) {
    db.execute("DROP TABLE _System_OutboxEffect").await;
    for mode in [DispatchMode::Legacy, DispatchMode::Pull] {
        let ledger = ledger_mail();
        let handlers = Handlers::new().register_with_ledger(
            ledger,
            Count(Arc::new(AtomicU64::new(0)), OrderLog::default()),
        );
        let started = Dispatcher::new(
            db.repository(),
            handlers,
            WorkerConfig::default().with_mode(mode),
        )
        .start()
        .await;
        let Err(e) = started else {
            panic!("{mode:?}: started without the ledger's table");
        };
        assert!(
            e.to_string().contains("_System_OutboxEffect"),
            "{mode:?}: {e}"
        );
    }
}

backend_tests!(
    a_ledger_consumer_needs_the_ledger_table_in_every_mode,
    gate_verdicts,
    excluded_consumers_run_on_the_legacy_path,
    dispatcher_enforces_the_gate,
    start_pull_fails_when_the_gate_refuses
);
