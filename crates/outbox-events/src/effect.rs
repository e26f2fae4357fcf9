//! External effects through the effect ledger (docs/state-machine.md, "The effect ledger"):
//! `ctx.effect("welcome-mail").once(|key| provider.send(key, …))`.

use std::future::Future;

use outbox_persistence::{EffectRecord, EventId, find_effect, idempotency_key, record_effect};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::handler::{AttemptContext, HandlerError};

/// Which event and handler an attempt context runs, for the ledger's keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EffectScope {
    /// The event.
    pub(crate) event_id: EventId,
    /// The handler: its consumer's name.
    pub(crate) handler_id: String,
}

/// One named external effect of a handler, for this event ([`AttemptContext::effect`]).
#[must_use = "an effect does nothing until `once` runs it"]
pub struct Effect<'c, 'a> {
    pub(crate) ctx: &'c mut AttemptContext<'a>,
    pub(crate) name: String,
}

impl Effect<'_, '_> {
    /// The effect's idempotency key: the same for every attempt of this event, different for
    /// every other event, handler or effect name. Pass it to the receiver (a provider's
    /// idempotency key, a webhook id) so that it can absorb the one repeat the ledger cannot
    /// prevent (an attempt that died between the send and its commit).
    pub fn key(&self) -> Result<String, HandlerError> {
        let scope = self.ctx.effect_scope()?;
        Ok(idempotency_key(
            &scope.handler_id,
            scope.event_id,
            &self.name,
        ))
    }

    /// Runs `send` with the effect's idempotency key, unless the ledger already records this
    /// effect for this event (a committed attempt ran it, or a failed attempt ran it before it
    /// failed): then `send` is not called, and what it returned then is returned again. When
    /// `send` succeeds, what it returned is recorded in the attempt's transaction (with the
    /// handler's own writes) and kept if the handler fails later (written again after the
    /// rollback, with the failure's bookkeeping), so a retry does not repeat it. When `send`
    /// fails, nothing is recorded and its error is the handler's to return.
    ///
    /// The value must serialize to JSON and read back as the same type: keep what the handler
    /// needs to write its own rows (a provider's message id, a status).
    pub async fn once<T, F, Fut>(self, send: F) -> Result<T, HandlerError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
    {
        let scope = self.ctx.effect_scope()?.clone();
        // A detached context (a transaction-free handler beside others of its batch) was
        // handed what the ledger held before the batch ran it; no other attempt can have
        // recorded this effect since (the claim is this worker's).
        let prior = self.ctx.prior_effect(&self.name);
        let recorded = match prior {
            Some(prior) => prior,
            None => {
                find_effect(
                    self.ctx.lock_free_tx(),
                    scope.event_id,
                    &scope.handler_id,
                    &self.name,
                )
                .await?
            }
        };
        if let Some(result) = recorded {
            tracing::info!(event_id = %scope.event_id, effect = %self.name, "effect recorded by an earlier attempt; not run again");
            counted(&scope, &self.name, "skipped");
            return decode(&self.name, result.as_deref());
        }
        let key = idempotency_key(&scope.handler_id, scope.event_id, &self.name);
        let value = send(key).await?;
        counted(&scope, &self.name, "run");
        let result = serde_json::to_string(&value);
        let record = EffectRecord::new(
            scope.event_id,
            scope.handler_id,
            self.name.clone(),
            result.as_ref().ok().cloned(),
        );
        // Kept before the write: if the write fails, the failure's bookkeeping records it (also
        // when the result does not serialize: the effect ran, and must not run again).
        self.ctx.sent.push(record.clone());
        if let Err(e) = result {
            return Err(HandlerError::permanent_from(
                format!("effect {:?}: its result does not serialize", self.name),
                e,
            ));
        }
        if self.ctx.has_tx() {
            record_effect(self.ctx.lock_free_tx(), &record).await?;
        }
        // Detached: recorded at the settle, with the event's outcome, from `sent`.
        Ok(value)
    }
}

/// Counts an effect `run` or `skipped` (`outbox_effects_total`).
fn counted(scope: &EffectScope, name: &str, outcome: &'static str) {
    metrics::counter!(
        crate::metrics::names::EFFECTS,
        "handler" => scope.handler_id.clone(),
        "effect" => name.to_owned(),
        "outcome" => outcome
    )
    .increment(1);
}

/// What an earlier attempt's effect returned, as the handler's type.
fn decode<T: DeserializeOwned>(name: &str, result: Option<&str>) -> Result<T, HandlerError> {
    serde_json::from_str(result.unwrap_or("null")).map_err(|e| {
        HandlerError::permanent_from(
            format!("effect {name:?}: the result an earlier attempt recorded no longer reads as this handler's type"),
            e,
        )
    })
}
