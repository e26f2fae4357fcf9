//! Against the server alone (no outbox database): the stream checks that make the relay refuse
//! to start, stream creation, and authentication without leaking secrets.

use std::time::Duration;

use async_nats::jetstream::stream::Config;
use outbox_events::WorkerConfig;
use outbox_relay::test_support::NatsServer;
use outbox_relay::{
    NatsAuth, NatsConnect, Relay, RelayConfig, RelayError, Secret, StreamSpec, async_nats,
};

use crate::common::relay_config;

async fn relay_on(nats: &NatsServer, config: RelayConfig) -> Relay {
    let client = NatsConnect::new(nats.url()).connect().await.unwrap();
    Relay::new(client, config).unwrap()
}

async fn stream_with_window(relay: &Relay, subjects: &[&str], window: Duration) {
    relay
        .jetstream()
        .create_stream(Config {
            name: "OUTBOX".into(),
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            duplicate_window: window,
            ..Config::default()
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn the_relay_refuses_a_window_shorter_than_its_redelivery_horizon() {
    let nats = NatsServer::start();
    let relay = relay_on(
        &nats,
        relay_config().with_ack_timeout(Duration::from_secs(5)),
    )
    .await;
    let worker = WorkerConfig::default();
    let missing = relay.check_stream(&worker).await.unwrap_err();
    assert!(
        matches!(missing, RelayError::StreamNotFound { .. }),
        "{missing}"
    );

    // Retry delays of 1..8 s and a stale-after of 30 s: the window must cover 2m30s.
    stream_with_window(&relay, &["crm.>"], Duration::from_secs(38)).await;
    let refused = relay.check_stream(&worker).await.unwrap_err();
    let text = refused.to_string();
    assert!(
        matches!(refused, RelayError::StreamRefused { .. }),
        "{text}"
    );
    assert!(
        text.contains(
            "its duplicate_window (38s) is shorter than the relay's redelivery horizon (2m30s"
        ),
        "{text}"
    );
    // The relay will not build a dispatcher on it either.
    let db = outbox_tests::TestDb::sqlite().await;
    assert!(
        relay
            .dispatcher(db.repository(), worker.clone())
            .await
            .is_err()
    );

    // One second short is refused; exactly the horizon is accepted.
    let horizon = relay.config().required_duplicate_window(&worker);
    let mut info = relay.jetstream().get_stream("OUTBOX").await.unwrap();
    let mut config = info.info().await.unwrap().config.clone();
    config.duplicate_window = horizon - Duration::from_secs(1);
    relay
        .jetstream()
        .update_stream(config.clone())
        .await
        .unwrap();
    assert!(relay.check_stream(&worker).await.is_err());
    config.duplicate_window = horizon;
    relay.jetstream().update_stream(config).await.unwrap();
    let check = relay.check_stream(&worker).await.unwrap();
    assert_eq!(check.duplicate_window, horizon);
    assert_eq!(check.required_window, horizon);

    // Shorter retry settings need a shorter window.
    let quick = worker.with_max_retry_attempts(2);
    assert!(relay.config().required_duplicate_window(&quick) < horizon);
}

#[tokio::test]
async fn the_relay_refuses_a_stream_that_does_not_capture_its_subjects() {
    let nats = NatsServer::start();
    let relay = relay_on(
        &nats,
        relay_config().with_subject("lead.updated", "sales.leads"),
    )
    .await;
    stream_with_window(&relay, &["crm.>"], Duration::from_secs(3_600)).await;
    let text = relay
        .check_stream(&WorkerConfig::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("does not capture subject sales.leads (event type lead.updated)"),
        "{text}"
    );
    assert!(!text.contains("crm.account.updated"), "{text}");
}

#[tokio::test]
async fn create_stream_makes_a_stream_the_check_accepts_and_leaves_an_existing_one_alone() {
    let nats = NatsServer::start();
    let relay = relay_on(
        &nats,
        relay_config().with_subject("lead.updated", "sales.leads"),
    )
    .await;
    let worker = WorkerConfig::default();
    let spec = StreamSpec::for_relay(relay.config(), &worker);
    assert_eq!(spec.subjects, vec!["crm.>", "sales.leads"]);
    assert_eq!(
        spec.duplicate_window,
        Duration::from_secs(180),
        "2m30s rounded up to minutes"
    );
    assert!(relay.create_stream(&spec).await.unwrap());
    assert!(!relay.create_stream(&spec).await.unwrap(), "created once");
    let check = relay.check_stream(&worker).await.unwrap();
    assert_eq!(check.duplicate_window, Duration::from_secs(180));
    assert!(check.warnings.is_empty());
}

#[tokio::test]
async fn the_relay_authenticates_and_never_shows_a_secret() {
    let nats = NatsServer::start_with_config(
        "authorization { users = [ { user: relay, password: \"s3cret-pw\" } ] }",
    );
    let good = NatsConnect::new(nats.url()).with_auth(NatsAuth::UserPassword {
        user: "relay".into(),
        password: Secret::new("s3cret-pw"),
    });
    let client = good.connect().await.expect("the right password connects");
    let relay = Relay::new(client, relay_config()).unwrap();
    let spec = StreamSpec::for_relay(relay.config(), &WorkerConfig::default());
    assert!(relay.create_stream(&spec).await.unwrap());

    let wrong = NatsConnect::new(nats.url()).with_auth(NatsAuth::UserPassword {
        user: "relay".into(),
        password: Secret::new("not-the-pw"),
    });
    let error = wrong.connect().await.unwrap_err();
    let text = format!("{error} {error:?} {wrong:?}");
    assert!(matches!(error, RelayError::Connect { .. }), "{text}");
    assert!(!text.contains("not-the-pw"), "{text}");

    let in_url = NatsConnect::new(nats.url().replace("nats://", "nats://relay:wrong-in-url@"));
    let error = in_url.connect().await.unwrap_err().to_string();
    assert!(
        !error.contains("wrong-in-url") && error.contains("nats://***@127.0.0.1"),
        "{error}"
    );
}

#[tokio::test]
async fn the_relay_authenticates_with_a_token() {
    let nats = NatsServer::start_with_config("authorization { token: \"t0ken-value\" }");
    let client = NatsConnect::new(nats.url())
        .with_auth(NatsAuth::Token(Secret::new("t0ken-value")))
        .connect()
        .await
        .expect("the token connects");
    assert!(matches!(
        client.connection_state(),
        async_nats::connection::State::Connected
    ));
    let denied = NatsConnect::new(nats.url())
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        denied.contains("cannot connect to NATS at nats://127.0.0.1"),
        "{denied}"
    );
}
