//! `outbox webhooks`: add prints a secret once and never again; list, disable, enable and
//! rotate change the endpoint, show in `status` and land in the audit log with who; the
//! secrets appear in no output but the one that made them.

use outbox_tests::{TestDb, backend_tests};
use serde_json::Value;

use super::{outbox, stderr, stdout};

fn ok(o: &std::process::Output) -> String {
    assert!(o.status.success(), "{}", stderr(o));
    stdout(o)
}

/// The secret a command printed (`whsec_…`).
fn secret_in(text: &str) -> String {
    let at = text.find("whsec_").expect("a secret printed");
    text[at..].split_whitespace().next().unwrap().to_string()
}

async fn endpoints_are_managed_audited_and_their_secrets_shown_once(db: TestDb) {
    let url = &db.url;
    let added = ok(&outbox(
        url,
        &[
            "webhooks",
            "add",
            "crm",
            "https://hooks.example.com/in",
            "--event-type",
            "lead.updated",
            "--actor",
            "alice",
        ],
    ));
    let first = secret_in(&added);
    let again = outbox(
        url,
        &["webhooks", "add", "crm", "https://other.example.com/"],
    );
    assert!(!again.status.success());
    assert!(stderr(&again).contains("exists"), "{}", stderr(&again));
    let refused = outbox(url, &["webhooks", "add", "bad", "ftp://example.com/"]);
    assert!(
        stderr(&refused).contains("only http and https"),
        "{}",
        stderr(&refused)
    );

    let list = ok(&outbox(url, &["webhooks", "list"]));
    assert!(
        list.contains("crm  https://hooks.example.com/in  [lead.updated]  enabled"),
        "{list}"
    );
    let doc: Value =
        serde_json::from_str(&ok(&outbox(url, &["webhooks", "list", "--json"]))).unwrap();
    assert_eq!(doc[0]["name"], "crm");
    assert_eq!(doc[0]["event_types"][0], "lead.updated");

    let disabled = ok(&outbox(
        url,
        &[
            "webhooks",
            "disable",
            "crm",
            "--reason",
            "receiver moved",
            "--actor",
            "bob",
        ],
    ));
    assert!(disabled.contains("disabled"), "{disabled}");
    let status = ok(&outbox(url, &["status"]));
    assert!(
        status.contains("DISABLED      crm (receiver moved)")
            && !status.contains("paused          webhook:crm"),
        "{status}"
    );
    let status: Value = serde_json::from_str(&ok(&outbox(url, &["status", "--json"]))).unwrap();
    assert_eq!(status["webhook_endpoints"][0]["enabled"], false);
    assert_eq!(status["paused_event_types"][0]["event_type"], "webhook:crm");
    // Its deliveries' type is resumed by enabling the endpoint, never alone.
    let resumed = outbox(url, &["resume", "webhook:crm"]);
    assert!(!resumed.status.success());
    assert!(
        stderr(&resumed).contains("outbox webhooks enable crm"),
        "{}",
        stderr(&resumed)
    );
    ok(&outbox(url, &["webhooks", "enable", "crm"]));
    let rotated = ok(&outbox(
        url,
        &["webhooks", "rotate", "crm", "--overlap-hours", "1"],
    ));
    let second = secret_in(&rotated);
    assert_ne!(first, second);
    let list = ok(&outbox(url, &["webhooks", "list"]));
    assert!(list.contains("rotating until"), "{list}");
    let attempts = ok(&outbox(url, &["webhooks", "attempts", "crm"]));
    assert!(attempts.contains("no attempts"), "{attempts}");
    assert!(
        !outbox(url, &["webhooks", "attempts", "nope"])
            .status
            .success()
    );

    let audit = ok(&outbox(url, &["audit"]));
    for (action, actor) in [
        ("webhook-add", "alice"),
        ("webhook-disable", "bob"),
        ("webhook-enable", "cli:"),
        ("webhook-rotate", "cli:"),
    ] {
        assert!(
            audit
                .lines()
                .any(|l| l.contains(action) && l.contains(actor)),
            "{action} by {actor}: {audit}"
        );
    }
    for out in [
        ok(&outbox(url, &["webhooks", "list", "--json"])),
        ok(&outbox(url, &["status", "--json"])),
        ok(&outbox(url, &["audit", "--json"])),
        audit,
    ] {
        assert!(!out.contains(&first) && !out.contains(&second) && !out.contains("whsec_"));
    }
}

backend_tests!(endpoints_are_managed_audited_and_their_secrets_shown_once);
