//! Consumer declarations: every handler says what its effects are when it is registered, so
//! the consumer map is always the current tree, and the rollout gate can refuse what is not
//! safe under redelivery.

use serde::Serialize;

/// The kind of an external effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExternalKind {
    /// Sends email.
    Email,
    /// Calls a webhook.
    Webhook,
    /// Pushes to a connector.
    ConnectorPush,
    /// Calls a host-registered provider.
    ProviderCall,
}

/// What one effect of a consumer does, in the design's classes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "class", rename_all = "snake_case")]
pub enum EffectKind {
    /// Fields set from the frozen snapshot or literals: a second delivery leaves the same
    /// values.
    DeterministicFieldSet,
    /// Fields set from `now()`, a sequence, append, increment or "set if empty": not safe
    /// under redelivery without a key.
    NonDeterministicFieldSet {
        /// Why it is not deterministic.
        reasons: Vec<String>,
    },
    /// A natural-key find-or-create backed by a `UNIQUE` index.
    NaturalKeyCreate {
        /// The natural key, for the map.
        natural_key: String,
    },
    /// Depends on state that a redelivery may see changed.
    StateDependent,
    /// Leaves the database: email, webhook, connector push, provider call.
    External {
        /// Which kind.
        kind: ExternalKind,
    },
}

/// How an effect that redelivery could repeat is kept safe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "safeguard", content = "detail", rename_all = "snake_case")]
pub enum Safeguard {
    /// The effect runs through the library's effect ledger (`ctx.effect(name).once(…)`, see
    /// docs/state-machine.md, "The effect ledger"). Protects the effect only when the consumer
    /// is registered with [`crate::Handlers::register_with_ledger`]; the gate then also checks
    /// that the ledger's table is migrated.
    Ledger,
    /// The receiver deduplicates by a key the outbox derives from the event, in a window the
    /// sender checks against the broker before it runs: the NATS relay's `Nats-Msg-Id` and
    /// the stream's duplicate window, which the relay verifies at every start (built by
    /// `outbox-relay`), described. Protects a push to a broker
    /// ([`ExternalKind::ConnectorPush`]) only when the consumer is registered with
    /// [`crate::Handlers::register_with_broker_dedup`] by the code that checked the broker;
    /// any other effect, or another registration, is blocked.
    BrokerDedup(String),
    /// A durable idempotency contract the consumer describes but the gate cannot check. Enough
    /// for a database effect (a state-dependent or non-deterministic field set); for an
    /// external effect it is shown as unverified and blocks the gate: run the effect through
    /// the ledger instead, or exclude the consumer.
    Contract(String),
    /// Kept off the pull-worker path: the consumer's events run on the legacy path.
    Excluded(String),
}

impl Safeguard {
    /// How the consumer map and the console show it.
    pub fn describe(&self) -> String {
        match self {
            Safeguard::Ledger => "ledger: the library's effect ledger (ctx.effect)".into(),
            Safeguard::BrokerDedup(how) => format!("broker dedup (checked at start): {how}"),
            Safeguard::Contract(c) => format!("contract (unverified): {c}"),
            Safeguard::Excluded(why) => format!("excluded: {why}"),
        }
    }
}

/// One declared effect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeclaredEffect {
    /// The class.
    pub kind: EffectKind,
    /// What it does, for the map.
    pub description: String,
    /// Its safeguard, where it needs one.
    pub safeguard: Option<Safeguard>,
}

/// A consumer: a handler of one event type and its declared effects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Consumer {
    /// The consumer's name.
    pub name: String,
    /// The event type it handles.
    pub event_type: String,
    /// Its effects; empty with `declared == false` for a handler registered without a
    /// declaration.
    pub effects: Vec<DeclaredEffect>,
    /// Whether the effects were declared at all.
    pub declared: bool,
    /// Whether it was registered with [`crate::Handlers::register_with_ledger`]: its effects
    /// declared [`Safeguard::Ledger`] then count as protected.
    through_ledger: bool,
    /// Whether it was registered with [`crate::Handlers::register_with_broker_dedup`]: its
    /// pushes declared [`Safeguard::BrokerDedup`] then count as protected.
    through_broker: bool,
}

/// Whether a consumer lets `OUTBOX_PULL_WORKER` flip.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", content = "reason", rename_all = "snake_case")]
pub enum Verdict {
    /// Only deterministic sets and natural-key creates: safe under redelivery.
    Safe,
    /// Its state-dependent or external effects have a durable contract.
    Protected,
    /// Kept off the pull workers; its events run on the legacy path.
    Excluded,
    /// Blocks the flag, with the reason.
    Blocked(String),
}

impl Consumer {
    /// A consumer of `event_type` named `name`, with no effects yet.
    pub fn new(name: impl Into<String>, event_type: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            event_type: event_type.into(),
            effects: Vec::new(),
            declared: true,
            through_ledger: false,
            through_broker: false,
        }
    }

    /// A consumer registered without a declaration: it blocks the gate.
    pub fn undeclared(event_type: impl Into<String>) -> Self {
        let event_type = event_type.into();
        Self {
            name: event_type.clone(),
            event_type,
            effects: Vec::new(),
            declared: false,
            through_ledger: false,
            through_broker: false,
        }
    }

    /// Whether it was registered with [`crate::Handlers::register_with_ledger`].
    pub fn through_ledger(&self) -> bool {
        self.through_ledger
    }

    /// Marks it registered through the ledger (by `Handlers::register_with_ledger` only).
    pub(crate) fn through_the_ledger(mut self) -> Self {
        self.through_ledger = true;
        self
    }

    /// Whether it was registered with [`crate::Handlers::register_with_broker_dedup`].
    pub fn through_broker(&self) -> bool {
        self.through_broker
    }

    /// Marks it registered as a checked broker push (by
    /// `Handlers::register_with_broker_dedup` only).
    pub(crate) fn through_the_broker(mut self) -> Self {
        self.through_broker = true;
        self
    }

    /// Whether one of its effects is declared through the ledger.
    pub fn uses_ledger(&self) -> bool {
        self.effects
            .iter()
            .any(|e| e.safeguard == Some(Safeguard::Ledger))
    }

    /// Adds an effect.
    pub fn effect(
        mut self,
        kind: EffectKind,
        description: impl Into<String>,
        safeguard: Option<Safeguard>,
    ) -> Self {
        self.effects.push(DeclaredEffect {
            kind,
            description: description.into(),
            safeguard,
        });
        self
    }

    /// This consumer's verdict.
    pub fn verdict(&self) -> Verdict {
        if !self.declared {
            return Verdict::Blocked("effects not declared".into());
        }
        if self
            .effects
            .iter()
            .any(|e| matches!(e.safeguard, Some(Safeguard::Excluded(_))))
        {
            return Verdict::Excluded;
        }
        let mut protected = false;
        for effect in &self.effects {
            if effect.safeguard == Some(Safeguard::Ledger) && !self.through_ledger {
                return Verdict::Blocked(format!(
                    "declares the effect ledger but was registered without it (Handlers::register_with_ledger): {}",
                    effect.description
                ));
            }
            if matches!(effect.safeguard, Some(Safeguard::BrokerDedup(_))) {
                if !self.through_broker {
                    return Verdict::Blocked(format!(
                        "declares broker dedup but was registered without a broker check (Handlers::register_with_broker_dedup, as outbox-relay registers): {}",
                        effect.description
                    ));
                }
                if !matches!(
                    effect.kind,
                    EffectKind::External {
                        kind: ExternalKind::ConnectorPush
                    }
                ) {
                    return Verdict::Blocked(format!(
                        "broker dedup protects a push to a broker, not this effect ({:?}): {}",
                        effect.kind, effect.description
                    ));
                }
            }
            let verified = matches!(
                effect.safeguard,
                Some(Safeguard::Ledger | Safeguard::BrokerDedup(_))
            );
            let contract = verified || matches!(effect.safeguard, Some(Safeguard::Contract(_)));
            match &effect.kind {
                EffectKind::DeterministicFieldSet | EffectKind::NaturalKeyCreate { .. } => {}
                EffectKind::NonDeterministicFieldSet { reasons } if !contract => {
                    return Verdict::Blocked(format!(
                        "non-deterministic field set without a key ({}): {}",
                        reasons.join(", "),
                        effect.description
                    ));
                }
                EffectKind::StateDependent if !contract => {
                    return Verdict::Blocked(format!(
                        "unprotected state-dependent effect: {}",
                        effect.description
                    ));
                }
                EffectKind::External { kind } if !contract => {
                    return Verdict::Blocked(format!(
                        "unprotected live external consumer ({kind:?}): {}",
                        effect.description
                    ));
                }
                EffectKind::External { kind } if !verified => {
                    return Verdict::Blocked(format!(
                        "unverified contract for a live external consumer ({kind:?}): {}: the gate cannot check a described contract; run the effect through the effect ledger (ctx.effect, Handlers::register_with_ledger) or exclude the consumer",
                        effect.description
                    ));
                }
                _ => protected = true,
            }
        }
        if protected {
            Verdict::Protected
        } else {
            Verdict::Safe
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let safe = Consumer::new("capture", "a")
            .effect(
                EffectKind::DeterministicFieldSet,
                "Name from snapshot",
                None,
            )
            .effect(
                EffectKind::NaturalKeyCreate {
                    natural_key: "(SourceLeadId, Relation)".into(),
                },
                "opportunity",
                None,
            );
        assert_eq!(safe.verdict(), Verdict::Safe);
        let mail = |safeguard| {
            Consumer::new("mail", "b").effect(
                EffectKind::External {
                    kind: ExternalKind::Email,
                },
                "welcome email",
                safeguard,
            )
        };
        assert!(
            matches!(mail(None).verdict(), Verdict::Blocked(r) if r.contains("unprotected live external consumer"))
        );
        assert!(
            matches!(mail(Some(Safeguard::Contract("ledger".into()))).verdict(), Verdict::Blocked(r) if r.starts_with("unverified contract"))
        );
        assert!(
            matches!(mail(Some(Safeguard::Ledger)).verdict(), Verdict::Blocked(r) if r.contains("registered without it"))
        );
        assert_eq!(
            mail(Some(Safeguard::Ledger)).through_the_ledger().verdict(),
            Verdict::Protected
        );
        // Broker dedup protects a checked push to a broker, never an email, and only when
        // registered by the code that checked the broker.
        let dedup = || Some(Safeguard::BrokerDedup("Nats-Msg-Id".into()));
        assert!(
            matches!(mail(dedup()).verdict(), Verdict::Blocked(r) if r.contains("registered without a broker check"))
        );
        assert!(
            matches!(mail(dedup()).through_the_broker().verdict(), Verdict::Blocked(r) if r.contains("not this effect"))
        );
        let push = || {
            Consumer::new("relay", "d").effect(
                EffectKind::External {
                    kind: ExternalKind::ConnectorPush,
                },
                "publish to a stream",
                dedup(),
            )
        };
        assert!(matches!(push().verdict(), Verdict::Blocked(_)));
        assert_eq!(push().through_the_broker().verdict(), Verdict::Protected);
        assert_eq!(
            mail(Some(Safeguard::Excluded("later".into()))).verdict(),
            Verdict::Excluded
        );
        let stamp = Consumer::new("stamp", "c").effect(
            EffectKind::NonDeterministicFieldSet {
                reasons: vec!["now()".into()],
            },
            "LastTouched = now()",
            None,
        );
        assert!(
            matches!(stamp.verdict(), Verdict::Blocked(r) if r.contains("non-deterministic field set without a key"))
        );
        assert!(
            matches!(Consumer::undeclared("d").verdict(), Verdict::Blocked(r) if r == "effects not declared")
        );
    }
}
