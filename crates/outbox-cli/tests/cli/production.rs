//! The operator commands on production PostgreSQL (docs/deployment.md): every one of them
//! through a transaction-pooling PgBouncer, and `outbox status` as the read-only role, which is
//! refused writes with the table named.

use outbox_tests::TestDb;

use super::{outbox, stderr, stdout};

/// Every operator command through the pooler (`?outbox_pooler=transaction` in the URL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operator_command_runs_through_pgbouncer() {
    let Some(db) = TestDb::pgbouncer().await else {
        return;
    };
    assert!(db.url.contains("outbox_pooler=transaction"), "{}", db.url);
    for args in [
        &["migrate"][..],
        &["status"],
        &["status", "--json"],
        &["status", "--key", "Lead:1"],
        &["events", "--json"],
        &["retry", "--failed"],
        &["backfill-record-keys", "--dry-run"],
        &["heads"],
        &["heads", "--repair"],
        &["prune", "--dry-run"],
        &["explain"],
        &["consumers"],
    ] {
        let o = outbox(&db.url, args);
        assert!(
            o.status.success(),
            "`outbox {}` through PgBouncer: {}{}",
            args.join(" "),
            stdout(&o),
            stderr(&o)
        );
    }
}

/// The read-only role of docs/deployment.md runs `outbox status`, and a write it may not make
/// fails with PostgreSQL's message, which names the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_only_role_reads_status_and_is_refused_writes() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let name = db.url.rsplit('/').next().unwrap().to_string();
    let reader = format!(
        "outbox_reader_{}",
        &uuid::Uuid::now_v7().simple().to_string()[24..]
    );
    for sql in [
        format!("CREATE ROLE {reader} LOGIN"),
        format!("GRANT CONNECT ON DATABASE {name} TO {reader}"),
        format!("GRANT USAGE ON SCHEMA public TO {reader}"),
        format!("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {reader}"),
    ] {
        db.execute(&sql).await;
    }
    let url = db.url_as(&reader);
    let status = outbox(&url, &["status"]);
    let events = outbox(&url, &["events"]);
    let retry = outbox(&url, &["retry", "--failed"]);
    db.execute(&format!("REASSIGN OWNED BY {reader} TO CURRENT_USER"))
        .await;
    db.execute(&format!("DROP OWNED BY {reader}")).await;
    db.execute(&format!("DROP ROLE {reader}")).await;
    assert!(status.status.success(), "{}", stderr(&status));
    assert!(stdout(&status).contains("pending"), "{}", stdout(&status));
    assert!(events.status.success(), "{}", stderr(&events));
    assert!(!retry.status.success());
    assert!(
        stderr(&retry).contains("permission denied for table _system_outboxevent"),
        "{}",
        stderr(&retry)
    );
}
