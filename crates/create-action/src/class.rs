//! The redelivery class of an action, as the #3477 audit defines it: what a consumer map shows
//! and what a rollout gate decides on.

use std::fmt;

/// Why a field assignment is not a pure function of the frozen event snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NonDeterminism {
    /// `now()`: each delivery writes a later time.
    Now,
    /// A sequence value: each delivery draws (and burns) a new number.
    Sequence,
    /// Append: each delivery appends again.
    Append,
    /// Increment: each delivery adds again.
    Increment,
    /// Set-if-empty: the result depends on the row's state when the event is delivered, so a
    /// redelivery after the field was cleared sets it again.
    SetIfEmpty,
}

impl NonDeterminism {
    /// A one-line explanation for a consumer map.
    pub fn explain(self) -> &'static str {
        match self {
            NonDeterminism::Now => "writes the delivery time, which differs on every delivery",
            NonDeterminism::Sequence => "draws a new sequence value on every delivery",
            NonDeterminism::Append => "appends again on every delivery",
            NonDeterminism::Increment => "adds again on every delivery",
            NonDeterminism::SetIfEmpty => {
                "depends on the row's state at delivery: a redelivery after the field was cleared sets it again"
            }
        }
    }

    /// The right-hand side's name, as in `Rhs`.
    pub fn name(self) -> &'static str {
        match self {
            NonDeterminism::Now => "Now",
            NonDeterminism::Sequence => "Sequence",
            NonDeterminism::Append => "Append",
            NonDeterminism::Increment => "Increment",
            NonDeterminism::SetIfEmpty => "SetIfEmpty",
        }
    }
}

/// One non-deterministic assignment: the column and why.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reason {
    /// The assigned column, as registered.
    pub column: String,
    /// Why its right-hand side is not deterministic.
    pub kind: NonDeterminism,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} = {}: {}",
            self.column,
            self.kind.name(),
            self.kind.explain()
        )
    }
}

/// How an action behaves under redelivery.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EffectClass {
    /// A field set whose every right-hand side is a pure function of the frozen event
    /// snapshot: a redelivery writes the same values again.
    DeterministicSet,
    /// A create backed by a natural key and its `UNIQUE` index: a redelivery finds the row,
    /// creates nothing and draws no autonumber.
    NaturalKeyCreate {
        /// The created object.
        object: String,
        /// The natural-key columns.
        natural_key: Vec<String>,
        /// The autonumber field, drawn only when the row is created.
        autonumber: Option<String>,
    },
    /// A field set with at least one right-hand side that is not a pure function of the event:
    /// not safe under redelivery without an idempotency key.
    NonDeterministicSet {
        /// Every non-deterministic assignment, in assignment order.
        reasons: Vec<Reason>,
    },
}

impl EffectClass {
    /// Whether a redelivery leaves the database as one delivery would.
    pub fn is_redelivery_safe(&self) -> bool {
        !matches!(self, EffectClass::NonDeterministicSet { .. })
    }

    /// The non-deterministic assignments (empty for a safe class).
    pub fn reasons(&self) -> &[Reason] {
        match self {
            EffectClass::NonDeterministicSet { reasons } => reasons,
            _ => &[],
        }
    }
}

impl fmt::Display for EffectClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EffectClass::DeterministicSet => f.write_str("deterministic field set"),
            EffectClass::NaturalKeyCreate {
                object,
                natural_key,
                autonumber,
            } => {
                write!(
                    f,
                    "natural-key create of {object} by ({})",
                    natural_key.join(", ")
                )?;
                if let Some(field) = autonumber {
                    write!(f, ", autonumber {field} drawn only on create")?;
                }
                Ok(())
            }
            EffectClass::NonDeterministicSet { reasons } => {
                f.write_str("non-deterministic field set: ")?;
                for (i, reason) in reasons.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{reason}")?;
                }
                Ok(())
            }
        }
    }
}

/// An action that can say how it behaves under redelivery.
pub trait Effect {
    /// The action's class.
    fn effect_class(&self) -> EffectClass;
}
