//! The endpoints, managed through the library (the CLI's `outbox webhooks` runs these): every
//! change in a transaction of its own, audited with who made it. Secrets are shown once, when
//! made, and never logged, listed or audited.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_events::persistence::webhooks::{
    self, AttemptsOf, DeliveryAttempt, NewEndpoint, SecretText, WebhookEndpoint,
};
use outbox_events::{EventId, Handlers, OutboxRepository};

use crate::{Error, WebhookConfig, WebhookDelivery, WebhookFanOut, signature};

/// Checks that `url` can name an endpoint: `http` or `https`, a host, no credentials, no
/// fragment. Where it resolves is checked at every send, after DNS.
pub fn validate_url(url: &str) -> Result<(), Error> {
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e| Error::Url(format!("{url:?} does not parse: {e}")))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(Error::Url(format!("{url:?}: only http and https"))),
    }
    let authority = uri
        .authority()
        .ok_or_else(|| Error::Url(format!("{url:?} names no host")))?;
    if authority.as_str().contains('@') {
        return Err(Error::Url(format!(
            "{url:?} carries credentials; put them in no URL (receivers verify the signature)"
        )));
    }
    if url.contains('#') {
        return Err(Error::Url(format!("{url:?} has a fragment")));
    }
    Ok(())
}

/// The webhook endpoints of an outbox, and the handlers that deliver to them.
#[derive(Clone)]
pub struct Webhooks {
    repo: Arc<dyn OutboxRepository>,
    config: WebhookConfig,
    /// The side writers of the deliveries registered through it (see [`Webhooks::flush`]).
    registered: Arc<Mutex<Vec<crate::side::SideWriter>>>,
}

impl Webhooks {
    /// Endpoints in `repo`'s database, sent to with `config`.
    pub fn new(repo: Arc<dyn OutboxRepository>, config: WebhookConfig) -> Self {
        Self {
            repo,
            config,
            registered: Arc::default(),
        }
    }

    /// Waits until the records of every attempt that the deliveries registered through it
    /// made so far are written, or given up after their tries (logged): the attempt log,
    /// failures in a row, disables, written beside the attempts by a task of their own. Records
    /// dropped because that task's queue was full (logged) are not waited for. Call it after
    /// the dispatcher has stopped, before the process exits or the tables are read; with the
    /// database away it takes as long as the tries (about ten seconds per 256 records), so
    /// bound it with `tokio::time::timeout` where a stop must be quick. Deliveries whose
    /// handlers are gone are forgotten once flushed, and their task ends.
    pub async fn flush(&self) {
        let sides = self
            .registered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for side in &sides {
            side.flush().await;
        }
        drop(sides);
        self.registered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|side| !side.only_here());
    }

    /// Registers the fan-out for each of `source_types` and the delivery for every
    /// `webhook:*` row, with their consumer declarations (the delivery through the effect
    /// ledger, so the rollout gate sees it protected), for workers run with `worker` (its
    /// `MaxRetryAttempts` bounds a delivery's attempts). Refused when a source type already
    /// has a handler in `handlers` (one handler runs per type).
    pub fn register<S: AsRef<str>>(
        &self,
        handlers: Handlers,
        source_types: &[S],
        worker: &outbox_events::WorkerConfig,
    ) -> Result<Handlers, Error> {
        let config = self.config.clone().for_workers(worker);
        let fan_out = Arc::new(WebhookFanOut::new(self.repo.clone(), config.clone()));
        let mut handlers = handlers;
        for event_type in source_types {
            let event_type = event_type.as_ref();
            if handlers.get(event_type).is_some() {
                return Err(Error::Invalid(format!(
                    "{event_type:?} has a handler already: the fan-out takes types no other handler takes"
                )));
            }
            handlers = handlers.register_arc(WebhookFanOut::consumer(event_type), fan_out.clone());
        }
        let delivery = WebhookDelivery::new(self.repo.clone(), config);
        self.registered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(delivery.side());
        Ok(handlers.register_with_ledger(WebhookDelivery::consumer(), delivery))
    }

    /// Adds an endpoint with a new secret, which is returned (shown once: it is never listed).
    /// `event_types` empty: every source type. `false` in the pair when the name is taken.
    pub async fn add(
        &self,
        name: &str,
        url: &str,
        event_types: &[String],
        actor: &str,
    ) -> Result<(bool, String), Error> {
        let secret = signature::generate_secret()?;
        let added = self
            .add_with_secret(name, url, event_types, &secret, actor)
            .await?;
        Ok((added, secret))
    }

    /// Adds an endpoint with a secret of the caller's (`whsec_` + base64 of 24 to 64 bytes);
    /// `false` when the name is taken.
    pub async fn add_with_secret(
        &self,
        name: &str,
        url: &str,
        event_types: &[String],
        secret: &str,
        actor: &str,
    ) -> Result<bool, Error> {
        validate_url(url)?;
        signature::secret_key(secret)?;
        if let Some(bad) = event_types.iter().find(|t| t.trim().is_empty()) {
            return Err(Error::Invalid(format!("{bad:?} is no event type")));
        }
        let mut tx = self.repo.begin().await?;
        let added = webhooks::add_endpoint(
            &mut tx,
            &NewEndpoint {
                name: name.to_string(),
                url: url.to_string(),
                event_types: event_types.to_vec(),
                secret: SecretText(secret.to_string()),
            },
            actor,
        )
        .await?;
        tx.commit().await?;
        crate::cache::changed();
        Ok(added)
    }

    /// Every endpoint, by name.
    pub async fn list(&self) -> Result<Vec<WebhookEndpoint>, Error> {
        let mut tx = self.repo.begin().await?;
        let endpoints = webhooks::endpoints(&mut tx).await?;
        tx.rollback().await?;
        Ok(endpoints)
    }

    /// The endpoint `name`.
    pub async fn get(&self, name: &str) -> Result<WebhookEndpoint, Error> {
        let mut tx = self.repo.begin().await?;
        let endpoint = webhooks::endpoint(&mut tx, name).await?;
        tx.rollback().await?;
        endpoint.ok_or_else(|| Error::NoSuchEndpoint(name.to_string()))
    }

    /// Disables `name`: its deliveries wait, in order, until it is enabled. `false` when it
    /// already was.
    pub async fn disable(&self, name: &str, reason: &str, actor: &str) -> Result<bool, Error> {
        self.set_enabled(name, false, Some(reason), actor).await
    }

    /// Enables `name`: its waiting deliveries resume in order. `false` when it already was.
    pub async fn enable(&self, name: &str, actor: &str) -> Result<bool, Error> {
        self.set_enabled(name, true, None, actor).await
    }

    async fn set_enabled(
        &self,
        name: &str,
        enabled: bool,
        reason: Option<&str>,
        actor: &str,
    ) -> Result<bool, Error> {
        let mut tx = self.repo.begin().await?;
        if webhooks::endpoint(&mut tx, name).await?.is_none() {
            return Err(Error::NoSuchEndpoint(name.to_string()));
        }
        let changed = webhooks::set_endpoint_enabled(&mut tx, name, enabled, reason, actor).await?;
        tx.commit().await?;
        crate::cache::changed();
        Ok(changed)
    }

    /// Rotates `name`'s secret to a new one, returned (shown once); the old one still signs
    /// for the configured overlap (24 h by default), so receivers verify under both meanwhile.
    pub async fn rotate(&self, name: &str, actor: &str) -> Result<String, Error> {
        let secret = signature::generate_secret()?;
        self.rotate_with(name, &secret, self.config.rotation_overlap, actor)
            .await?;
        Ok(secret)
    }

    /// Rotates `name`'s secret to `secret`; the old one still signs for `overlap`.
    pub async fn rotate_with(
        &self,
        name: &str,
        secret: &str,
        overlap: Duration,
        actor: &str,
    ) -> Result<(), Error> {
        signature::secret_key(secret)?;
        let mut tx = self.repo.begin().await?;
        let rotated = webhooks::rotate_endpoint_secret(
            &mut tx,
            name,
            &SecretText(secret.to_string()),
            overlap,
            actor,
        )
        .await?;
        if !rotated {
            return Err(Error::NoSuchEndpoint(name.to_string()));
        }
        tx.commit().await?;
        crate::cache::changed();
        Ok(())
    }

    /// `name`'s newest attempts, newest first.
    pub async fn attempts(&self, name: &str, limit: u32) -> Result<Vec<DeliveryAttempt>, Error> {
        self.read_attempts(AttemptsOf::Endpoint(name.to_string()), limit)
            .await
    }

    /// The attempts of the deliveries of `source_events` to any endpoint, newest first.
    pub async fn attempts_of(
        &self,
        source_events: &[EventId],
        limit: u32,
    ) -> Result<Vec<DeliveryAttempt>, Error> {
        self.read_attempts(AttemptsOf::SourceEvents(source_events.to_vec()), limit)
            .await
    }

    async fn read_attempts(
        &self,
        of: AttemptsOf,
        limit: u32,
    ) -> Result<Vec<DeliveryAttempt>, Error> {
        let mut tx = self.repo.begin().await?;
        let attempts = webhooks::delivery_attempts(&mut tx, &of, limit).await?;
        tx.rollback().await?;
        Ok(attempts)
    }
}

#[cfg(test)]
mod tests {
    use super::validate_url;

    #[test]
    fn urls_are_http_or_https_with_a_host_and_no_credentials() {
        assert!(validate_url("https://hooks.example.com/outbox?x=1").is_ok());
        assert!(validate_url("http://127.0.0.1:8080/in").is_ok());
        assert!(validate_url("ftp://example.com/").is_err());
        assert!(validate_url("https://user:pw@example.com/").is_err());
        assert!(validate_url("/relative").is_err());
        assert!(validate_url("https://example.com/#frag").is_err());
    }
}
