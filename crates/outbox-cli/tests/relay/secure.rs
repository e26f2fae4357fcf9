//! `outbox relay` on a server that requires TLS and authenticates users by `.creds` files
//! (operator mode): the test makes its CA and server certificate, and its operator, account and
//! user JWTs. With `--nats-tls-ca` and `--nats-creds` the relay drains a workload into a stream
//! that the test reads back; without the CA file, or without the `.creds` file, it fails with a
//! clear message; the user's seed never shows.

use std::path::Path;

use super::expected_in_stream;
use outbox_persistence::EventFilter;
use outbox_relay::test_support::NatsServer;
use outbox_relay::test_support::creds::{Operator, seed_of, write_creds};
use outbox_relay::test_support::tls::TestCa;
use outbox_relay::{NatsAuth, NatsConnect, audit, read_stream};
use outbox_tests::{TestDb, backend_tests};

use crate::drain::seed;
use crate::{open_env, run, stderr, stdout};

fn relay(db: &TestDb, nats: &NatsServer, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "relay",
        "--create-stream",
        "--until-drained",
        "--workers",
        "4",
    ];
    args.extend(extra);
    run(&db.url, &args, &open_env(nats))
}

async fn audit_stream(db: &TestDb, nats: &NatsServer, ca: &Path, creds: &Path) {
    let mut connect = NatsConnect::new(nats.url()).with_auth(NatsAuth::CredsFile(creds.into()));
    connect.tls_ca = Some(ca.into());
    let js = outbox_relay::async_nats::jetstream::new(connect.connect().await.unwrap());
    let messages = read_stream(&js, "CRM").await.unwrap();
    let rows = db
        .repository()
        .list_events(EventFilter::new())
        .await
        .unwrap();
    let expected = expected_in_stream(&rows);
    let report = audit(&messages, &expected);
    assert!(report.passed(), "{report:?}");
    assert_eq!(messages.len(), 300);
}

async fn outbox_relay_drains_over_tls_with_a_creds_file(db: TestDb) {
    let ca = TestCa::new();
    let operator = Operator::new();
    let nats = NatsServer::start_with_config(&format!(
        "{}{}",
        ca.server_config(),
        operator.server_config()
    ));
    let content = operator.user_creds("relay");
    let creds = write_creds(nats.dir(), "relay", &content);
    let seed_text = seed_of(&content).to_string();
    seed(&db).await;
    let ca_file = ca.ca_file();
    let ca_arg = ca_file.to_str().unwrap();
    let creds_arg = creds.to_str().unwrap();

    // Without the CA file: the server's certificate is not trusted.
    let out = relay(&db, &nats, &["--nats-creds", creds_arg]);
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("cannot connect to NATS at nats://127.0.0.1"),
        "{text}"
    );
    assert!(text.to_lowercase().contains("certificate"), "{text}");

    // Without the .creds file: the server refuses the connection.
    let out = relay(&db, &nats, &["--nats-tls-ca", ca_arg]);
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(text.to_lowercase().contains("authorization"), "{text}");

    // With both: the workload is drained into the stream.
    let out = relay(
        &db,
        &nats,
        &["--nats-tls-ca", ca_arg, "--nats-creds", creds_arg],
    );
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("300 processed"), "{text}");
    assert!(!text.contains(&seed_text), "the seed reached the output");
    audit_stream(&db, &nats, &ca_file, &creds).await;

    // The same settings from the environment, and no seed in --help either.
    let mut env = open_env(&nats);
    env.push(("NATS_TLS_CA", ca_arg.to_string()));
    env.push(("NATS_CREDS", creds_arg.to_string()));
    let help = run(&db.url, &["relay", "--help"], &env);
    assert!(help.status.success());
    assert!(!stdout(&help).contains(&seed_text));
    assert!(stdout(&help).contains("NATS_CREDS"), "{}", stdout(&help));
}

backend_tests!(outbox_relay_drains_over_tls_with_a_creds_file);
