//! TLS with a CA file, and decentralised authentication with a `.creds` file, against a live
//! `nats-server`: the test makes its own CA and server certificate (`openssl`), and its own
//! operator, account and user keys and JWTs (the server in operator mode, the account
//! preloaded in a memory resolver). The connection succeeds with the CA file or the `.creds`
//! file, fails with a clear error without them, and no seed shows in any message.

use std::time::Duration;

use outbox_events::WorkerConfig;
use outbox_relay::test_support::NatsServer;
use outbox_relay::test_support::creds::{Operator, seed_of, write_creds};
use outbox_relay::test_support::tls::TestCa;
use outbox_relay::{NatsAuth, NatsConnect, Relay, RelayError, StreamSpec};

use crate::common::relay_config;

/// The relay makes its stream and passes its check: a JetStream round trip on `client`.
async fn stream_round_trip(client: outbox_relay::async_nats::Client) {
    let relay = Relay::new(client, relay_config()).unwrap();
    let worker = WorkerConfig::default();
    assert!(
        relay
            .create_stream(&StreamSpec::for_relay(relay.config(), &worker))
            .await
            .unwrap()
    );
    let check = relay.check_stream(&worker).await.unwrap();
    assert_eq!(check.stream, "OUTBOX");
}

fn quick(connect: NatsConnect) -> NatsConnect {
    NatsConnect {
        connect_timeout: Duration::from_secs(3),
        ..connect
    }
}

#[tokio::test]
async fn the_relay_connects_over_tls_with_the_ca_file_and_not_without_it() {
    let ca = TestCa::new();
    let nats = NatsServer::start_with_config(&ca.server_config());

    let mut with_ca = quick(NatsConnect::new(nats.url()));
    with_ca.tls_ca = Some(ca.ca_file());
    let client = with_ca
        .connect()
        .await
        .expect("the CA file verifies the server");
    assert!(client.server_info().tls_required, "the server requires TLS");
    stream_round_trip(client).await;

    // The same URL without the CA file: the server's certificate is not trusted.
    let error = quick(NatsConnect::new(nats.url()))
        .connect()
        .await
        .unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, RelayError::Connect { .. }), "{text}");
    assert!(
        text.contains("cannot connect to NATS at nats://127.0.0.1"),
        "{text}"
    );
    assert!(text.to_lowercase().contains("certificate"), "{text}");

    // A CA file that does not exist is named as such, before any connection.
    let mut missing = quick(NatsConnect::new(nats.url()));
    missing.tls_ca = Some(ca.ca_file().with_file_name("absent.pem"));
    let text = missing.connect().await.unwrap_err().to_string();
    assert!(text.contains("TLS CA file"), "{text}");

    // Requiring TLS of a server that offers none fails too.
    let plain = NatsServer::start();
    let mut required = quick(NatsConnect::new(plain.url()));
    required.tls_ca = Some(ca.ca_file());
    let text = required.connect().await.unwrap_err().to_string();
    assert!(text.contains("cannot connect to NATS"), "{text}");
}

#[tokio::test]
async fn the_relay_authenticates_with_a_creds_file_and_never_shows_its_seed() {
    let operator = Operator::new();
    let nats = NatsServer::start_with_config(&operator.server_config());
    let creds = operator.user_creds("relay");
    let path = write_creds(nats.dir(), "relay", &creds);

    let good = quick(NatsConnect::new(nats.url())).with_auth(NatsAuth::CredsFile(path.clone()));
    let client = good.connect().await.expect("the .creds file authenticates");
    stream_round_trip(client).await;
    assert!(!format!("{good:?}").contains(seed_of(&creds)));

    // A user of an account the server does not know (another operator's).
    let stranger = Operator::new().user_creds("stranger");
    let other = write_creds(nats.dir(), "stranger", &stranger);
    let wrong = quick(NatsConnect::new(nats.url())).with_auth(NatsAuth::CredsFile(other));
    let error = wrong.connect().await.unwrap_err();
    let text = format!("{error} {error:?} {wrong:?}");
    assert!(matches!(error, RelayError::Connect { .. }), "{text}");
    assert!(!text.contains(seed_of(&stranger)), "{text}");
    assert!(text.to_lowercase().contains("authorization"), "{text}");

    // No credentials at all.
    let text = quick(NatsConnect::new(nats.url()))
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(text.contains("cannot connect to NATS"), "{text}");

    // A .creds file that cannot be read is named as such.
    let absent = quick(NatsConnect::new(nats.url()))
        .with_auth(NatsAuth::CredsFile(path.with_file_name("absent.creds")));
    let text = absent.connect().await.unwrap_err().to_string();
    assert!(text.contains("credentials file"), "{text}");
}
