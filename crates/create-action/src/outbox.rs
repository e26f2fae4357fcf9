//! The glue between the create action and the outbox workers (feature `outbox`): a
//! [`crate::Error`] becomes the [`HandlerError`] that keeps lock timeouts and lost connections
//! retryable, and an [`EffectClass`] becomes the consumer declaration the rollout gate reads.

use outbox_events::{Consumer, EffectKind, HandlerError};

use crate::{EffectClass, Error};

impl From<Error> for HandlerError {
    /// A database error keeps its classification (a lock timeout or a lost connection is
    /// retried); another transient error is retryable; the rest is permanent. The action's
    /// error is kept as the handler error's source (the database error, through the
    /// repository's error, for [`Error::Database`]).
    fn from(e: Error) -> Self {
        match e {
            Error::Database(e) => HandlerError::Database(e.into()),
            e if e.is_transient() => HandlerError::retryable_from("", e),
            e => HandlerError::permanent_from("", e),
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
        assert!(matches!(race, HandlerError::RetryableFrom { .. }));
        assert!(race.is_retryable());
    }

    #[test]
    fn handler_errors_keep_the_action_error_as_their_source() {
        use std::error::Error as _;
        let race: HandlerError = Error::ConflictWithoutRow("Opportunity".into()).into();
        assert_eq!(
            race.to_string(),
            "retryable: the natural-key insert into Opportunity conflicted but no row could be read back",
            "the recorded message is unchanged"
        );
        let source = race.source().expect("the action error is kept");
        assert!(matches!(
            source.downcast_ref::<Error>(),
            Some(Error::ConflictWithoutRow(_))
        ));

        let payload = record_key::record_key_from_payload("{oops").unwrap_err();
        let permanent: HandlerError = Error::InvalidPayload(payload).into();
        assert!(!permanent.is_retryable());
        let action = permanent.source().expect("the action error is kept");
        assert!(matches!(
            action.downcast_ref::<Error>(),
            Some(Error::InvalidPayload(_))
        ));
        let parser = action.source().and_then(|e| e.source());
        assert!(
            parser.is_some_and(|e| e.downcast_ref::<serde_json::Error>().is_some()),
            "the chain reaches the JSON parser's error"
        );

        let lock: HandlerError = Error::Database(sqlx::Error::PoolTimedOut).into();
        let db = lock.source().expect("the database error is kept");
        assert!(
            db.downcast_ref::<outbox_events::persistence::Error>()
                .is_some()
        );
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
