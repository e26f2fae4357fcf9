//! The relay on production PostgreSQL (docs/deployment.md): through a transaction-pooling
//! PgBouncer, and as the workers' least-privilege role.

use std::time::Duration;

use outbox_events::DispatchMode;
use outbox_events::persistence::{ConnectConfig, Database, OutboxRepository};
use outbox_relay::test_support::NatsServer;
use outbox_relay::{audit, read_stream};
use outbox_tests::TestDb;

use crate::common::{enqueue, expected, fast, relay, wait_drained};

/// Relays 200 events over `repo`'s database and audits the stream.
async fn relay_all(db: &TestDb, repo: std::sync::Arc<dyn OutboxRepository>) {
    let nats = NatsServer::start();
    let worker = fast(4);
    let relay = relay(&nats, &worker).await;
    enqueue(&repo, 200, 20).await;
    let (dispatcher, _) = relay.dispatcher(repo.clone(), worker).await.unwrap();
    let handle = dispatcher.start().await.unwrap();
    assert_eq!(handle.decision().mode, DispatchMode::Pull);
    wait_drained(db, Duration::from_secs(60)).await;
    let report = handle.shutdown().await;
    assert_eq!(report.metrics.processed, 200, "{:?}", report.metrics);
    let messages = read_stream(relay.jetstream(), "OUTBOX").await.unwrap();
    let audit = audit(&messages, &expected(&repo).await);
    assert!(audit.passed(), "{audit:?}");
    assert_eq!(audit.messages, 200);
}

/// The relay with its statements through PgBouncer in transaction mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_relay_delivers_everything_once_in_order() {
    let Some(db) = TestDb::pgbouncer().await else {
        return;
    };
    relay_all(&db, db.repository()).await;
}

/// The relay as the workers' role: DML on the outbox's tables and the wake-up sequence, no
/// `CREATE`, no ownership (docs/deployment.md, "Roles"; granted here on the existing objects,
/// as the default privileges there grant them on the migrations' objects).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_relay_runs_as_the_worker_role() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let name = db.url.rsplit('/').next().unwrap().to_string();
    let worker = format!(
        "outbox_worker_{}",
        &uuid::Uuid::now_v7().simple().to_string()[24..]
    );
    for sql in [
        // As PostgreSQL 15 has it; older releases grant CREATE on `public` to everyone.
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC".to_string(),
        format!("CREATE ROLE {worker} LOGIN"),
        format!("GRANT CONNECT ON DATABASE {name} TO {worker}"),
        format!("GRANT USAGE ON SCHEMA public TO {worker}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {worker}"),
        format!("GRANT USAGE, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {worker}"),
    ] {
        db.execute(&sql).await;
    }
    let as_worker = Database::connect(&db.url_as(&worker), ConnectConfig::default())
        .await
        .unwrap();
    as_worker.check_schema().await.unwrap();
    relay_all(&db, as_worker.repository()).await;
    as_worker.close().await;
    db.execute(&format!("DROP OWNED BY {worker}")).await;
    db.execute(&format!("DROP ROLE {worker}")).await;
}
