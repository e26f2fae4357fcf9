//! The registered handlers, by `EventType` (an exact type or a prefix ending in `*`), with
//! their consumer declarations.

use std::collections::HashMap;
use std::sync::Arc;

use crate::consumer::Consumer;
#[cfg(doc)]
use crate::handler::AttemptContext;
use crate::handler::Handler;

/// The registered handlers, by `EventType`, with their consumer declarations.
#[derive(Clone, Default)]
pub struct Handlers {
    by_type: HashMap<String, (Consumer, Arc<dyn Handler>)>,
}

impl Handlers {
    /// No handlers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `handler` for `event_type` without declaring its effects. It runs, but the
    /// rollout gate refuses to flip `OUTBOX_PULL_WORKER` while it is registered.
    pub fn register(self, event_type: impl Into<String>, handler: impl Handler) -> Self {
        self.register_consumer(Consumer::undeclared(event_type), handler)
    }

    /// Registers `handler` for its consumer's event type, with its declared effects, replacing
    /// an earlier registration of that event type.
    pub fn register_consumer(self, consumer: Consumer, handler: impl Handler) -> Self {
        self.register_arc(consumer, Arc::new(handler))
    }

    /// Registers a shared handler with its consumer declaration.
    pub fn register_arc(mut self, consumer: Consumer, handler: Arc<dyn Handler>) -> Self {
        self.by_type
            .insert(consumer.event_type.clone(), (consumer, handler));
        self
    }

    /// Registers `handler` for its consumer's event type as running its external effects
    /// through the effect ledger ([`AttemptContext::effect`]): its effects declared with
    /// [`crate::Safeguard::Ledger`] then count as protected for the rollout gate, which also
    /// checks that the ledger's table is migrated on the database.
    pub fn register_with_ledger(self, consumer: Consumer, handler: impl Handler) -> Self {
        self.register_arc(consumer.through_the_ledger(), Arc::new(handler))
    }

    /// Registers `handler` for its consumer's event type as a push to a broker that
    /// deduplicates by a key the outbox derives, in a window the caller checked against the
    /// broker before registering (outbox-relay checks the stream's duplicate window at every
    /// start, then registers its handlers so): its pushes declared
    /// [`crate::Safeguard::BrokerDedup`] then count as protected for the rollout gate. Calling
    /// it without such a check is the caller's claim, as a described contract is.
    pub fn register_with_broker_dedup(self, consumer: Consumer, handler: impl Handler) -> Self {
        self.register_arc(consumer.through_the_broker(), Arc::new(handler))
    }

    /// The handler of `event_type`: the one registered for the type itself, else the one whose
    /// prefix (a registered type ending in `*`) is the longest that starts it.
    pub fn get(&self, event_type: &str) -> Option<&Arc<dyn Handler>> {
        self.get_named(event_type).map(|(_, h)| h)
    }

    /// The handler of `event_type` with its consumer's name (the ledger's handler id): the
    /// one registered for the type itself, else the one whose prefix (a registered type
    /// ending in `*`, such as `webhook:*`) is the longest that starts it.
    pub(crate) fn get_named(&self, event_type: &str) -> Option<(&str, &Arc<dyn Handler>)> {
        let found = self.by_type.get(event_type).or_else(|| {
            self.by_type
                .iter()
                .filter_map(|(registered, entry)| {
                    let prefix = registered.strip_suffix('*')?;
                    event_type
                        .starts_with(prefix)
                        .then_some((prefix.len(), entry))
                })
                .max_by_key(|(len, _)| *len)
                .map(|(_, entry)| entry)
        });
        found.map(|(c, h)| (c.name.as_str(), h))
    }

    /// The consumer declarations, sorted by event type.
    pub fn consumers(&self) -> Vec<Consumer> {
        let mut consumers: Vec<Consumer> = self.by_type.values().map(|(c, _)| c.clone()).collect();
        consumers.sort_by(|a, b| a.event_type.cmp(&b.event_type));
        consumers
    }

    /// The registered event types, sorted.
    pub fn event_types(&self) -> Vec<&str> {
        let mut types: Vec<&str> = self.by_type.keys().map(String::as_str).collect();
        types.sort_unstable();
        types
    }
}
