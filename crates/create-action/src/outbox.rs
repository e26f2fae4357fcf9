//! The glue between the create action and the outbox workers (feature `outbox`): a
//! [`crate::Error`] becomes the [`HandlerError`] that keeps lock timeouts and lost connections
//! retryable, and an [`EffectClass`] becomes the consumer declaration the rollout gate reads.

use outbox_events::{Consumer, EffectKind, HandlerError};

use crate::{EffectClass, Error};

impl From<Error> for HandlerError {
    /// A database error keeps its classification (a lock timeout or a lost connection is
    /// retried); another transient error is retryable; the rest is permanent.
    fn from(e: Error) -> Self {
        match e {
            Error::Database(e) => HandlerError::Database(e.into()),
            e if e.is_transient() => HandlerError::Retryable(e.to_string()),
            e => HandlerError::Permanent(e.to_string()),
        }
    }
}

impl EffectClass {
    /// The kind of effect the rollout gate sees for this class.
    pub fn effect_kind(&self) -> EffectKind {
        match self {
            EffectClass::DeterministicSet => EffectKind::DeterministicFieldSet,
            EffectClass::NaturalKeyCreate {
                object,
                natural_key,
                ..
            } => EffectKind::NaturalKeyCreate {
                natural_key: format!("{object}({})", natural_key.join(", ")),
            },
            EffectClass::NonDeterministicSet { reasons } => EffectKind::NonDeterministicFieldSet {
                reasons: reasons.iter().map(ToString::to_string).collect(),
            },
        }
    }

    /// Declares this class on `consumer`, so that the declaration comes from the action itself
    /// (a non-deterministic field set then blocks the rollout gate until it gets a key or is
    /// excluded).
    pub fn declare(&self, consumer: Consumer, description: impl Into<String>) -> Consumer {
        consumer.effect(self.effect_kind(), description, None)
    }
}

#[cfg(test)]
mod tests {
    use outbox_events::Verdict;

    use super::*;

    #[test]
    fn errors_keep_their_retry_class() {
        let lock = Error::Database(sqlx::Error::PoolTimedOut);
        let handler: HandlerError = lock.into();
        assert!(handler.is_retryable());
        let permanent: HandlerError = Error::MissingRecordId.into();
        assert!(!permanent.is_retryable());
        let race: HandlerError = Error::ConflictWithoutRow("Opportunity".into()).into();
        assert!(matches!(race, HandlerError::Retryable(_)));
    }

    #[test]
    fn declarations_follow_the_class() {
        let safe = EffectClass::DeterministicSet.declare(Consumer::new("c", "t"), "fields");
        assert_eq!(safe.verdict(), Verdict::Safe);
        let create = EffectClass::NaturalKeyCreate {
            object: "Opportunity".into(),
            natural_key: vec!["LeadId".into()],
            autonumber: None,
        };
        assert_eq!(
            create.effect_kind(),
            EffectKind::NaturalKeyCreate {
                natural_key: "Opportunity(LeadId)".into()
            }
        );
        let unsafe_set = EffectClass::NonDeterministicSet { reasons: vec![] };
        assert!(matches!(
            unsafe_set.declare(Consumer::new("c", "t"), "x").verdict(),
            Verdict::Blocked(_)
        ));
    }
}
