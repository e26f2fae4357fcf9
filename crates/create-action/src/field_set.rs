//! After-save field capture: update fields of one target row, each assignment saying where its
//! value comes from.
//!
//! The right-hand side ([`Rhs`]) decides the action's class (see [`crate::class`]): `Snapshot`
//! and `Literal` are pure functions of the frozen event, so a redelivery writes the same values
//! again; `Now`, `Sequence`, `Append`, `Increment` and `SetIfEmpty` are the audit's traps, and a
//! field set using one of them reports itself as non-deterministic with the reasons.

use std::sync::Arc;
use std::time::SystemTime;

use record_key::EventEnvelope;
use serde_json::Value;

use crate::class::{Effect, EffectClass, NonDeterminism, Reason};
use crate::conn::{ActionConn, AnyConn, Statement};
use crate::registry::{Column, ColumnRole, ColumnType, ObjectDef};
use crate::value::{BindValue, Source, format_timestamp, to_bind, to_bind_as};
use crate::{Error, Result, autonumber};

/// Where an assigned value comes from.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Rhs {
    /// The named field of the frozen event snapshot (deterministic).
    Snapshot(String),
    /// A constant (deterministic).
    Literal(Value),
    /// The time passed to [`FieldSet::run`] (a timestamp or text column).
    Now,
    /// The next value of the field's counter in `_System_Autonumber` (an integer column).
    Sequence,
    /// The column's text with the value appended (a text column).
    Append(Source),
    /// The column's number plus the value (an integer or real column).
    Increment(Source),
    /// The value, only when the column is null (or, for text, empty).
    SetIfEmpty(Source),
}

impl Rhs {
    /// The named snapshot field.
    pub fn snapshot(field: impl Into<String>) -> Self {
        Rhs::Snapshot(field.into())
    }

    /// A constant.
    pub fn literal(value: impl Into<Value>) -> Self {
        Rhs::Literal(value.into())
    }

    /// Why this right-hand side is not deterministic, or `None` when it is.
    pub fn non_determinism(&self) -> Option<NonDeterminism> {
        match self {
            Rhs::Snapshot(_) | Rhs::Literal(_) => None,
            Rhs::Now => Some(NonDeterminism::Now),
            Rhs::Sequence => Some(NonDeterminism::Sequence),
            Rhs::Append(_) => Some(NonDeterminism::Append),
            Rhs::Increment(_) => Some(NonDeterminism::Increment),
            Rhs::SetIfEmpty(_) => Some(NonDeterminism::SetIfEmpty),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Rhs::Snapshot(_) => "Snapshot",
            Rhs::Literal(_) => "Literal",
            other => other.non_determinism().map_or("", NonDeterminism::name),
        }
    }

    /// Whether this right-hand side can write a column of type `ty` with role `role`.
    fn fits(&self, ty: ColumnType, role: ColumnRole) -> bool {
        let writable = role == ColumnRole::Field
            || (role == ColumnRole::Autonumber && matches!(self, Rhs::Sequence));
        writable
            && match self {
                Rhs::Snapshot(_) | Rhs::Literal(_) | Rhs::SetIfEmpty(_) => true,
                Rhs::Now => matches!(ty, ColumnType::Timestamp | ColumnType::Text),
                Rhs::Sequence => ty == ColumnType::Integer,
                Rhs::Append(_) => ty == ColumnType::Text,
                Rhs::Increment(_) => matches!(ty, ColumnType::Integer | ColumnType::Real),
            }
    }
}

/// An update of one target row's fields. Built once from metadata, run per event.
#[derive(Clone, Debug)]
pub struct FieldSet {
    object: Arc<ObjectDef>,
    target: Vec<(usize, Source)>,
    assignments: Vec<(usize, Rhs)>,
}

/// Builds a [`FieldSet`]; validated by [`FieldSetBuilder::build`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct FieldSetBuilder {
    object: Arc<ObjectDef>,
    target: Vec<(String, Source)>,
    assignments: Vec<(String, Rhs)>,
}

impl FieldSet {
    /// Starts a field set on `object`.
    pub fn builder(object: Arc<ObjectDef>) -> FieldSetBuilder {
        FieldSetBuilder {
            object,
            target: Vec::new(),
            assignments: Vec::new(),
        }
    }

    /// The object this action updates.
    pub fn object(&self) -> &Arc<ObjectDef> {
        &self.object
    }

    /// Applies the assignments to the target row of `event` in `conn`'s open transaction;
    /// `now` is the value of [`Rhs::Now`]. Returns the number of rows updated (0 when the target
    /// row does not exist; then no sequence value is drawn either).
    pub async fn run<C: ActionConn + ?Sized>(
        &self,
        conn: &mut C,
        event: &EventEnvelope,
        now: SystemTime,
    ) -> Result<u64> {
        let columns = self.object.columns();
        let mut target = Vec::with_capacity(self.target.len());
        for (i, source) in &self.target {
            let value = to_bind(&columns[*i], &source.resolve(event)?)?;
            if value.is_null() {
                return Err(Error::NullKey {
                    object: self.object.name().to_string(),
                    column: columns[*i].name().to_string(),
                });
            }
            target.push(value);
        }
        let mut conn = conn.any();
        if !self
            .assignments
            .iter()
            .any(|(_, rhs)| *rhs == Rhs::Sequence)
        {
            return self.update(&mut conn, event, now, &target).await;
        }
        // Sequence values are drawn before the update; a savepoint hands them back when there
        // is no row to update.
        let mut savepoint = conn.begin_nested().await?;
        let updated = self
            .update(&mut savepoint.conn(), event, now, &target)
            .await;
        match updated {
            Ok(rows) if rows > 0 => {
                savepoint.commit().await?;
                Ok(rows)
            }
            Ok(rows) => {
                savepoint.rollback().await?;
                Ok(rows)
            }
            Err(e) => {
                if let Err(rollback) = savepoint.rollback().await {
                    tracing::warn!(error = %rollback, "rollback to the field-set savepoint failed");
                }
                Err(e)
            }
        }
    }

    async fn update(
        &self,
        conn: &mut AnyConn<'_>,
        event: &EventEnvelope,
        now: SystemTime,
        target: &[BindValue],
    ) -> Result<u64> {
        let columns = self.object.columns();
        let mut stmt = Statement::new(conn.backend());
        stmt.push("UPDATE ")
            .push(&self.object.name().quoted())
            .push(" SET ");
        for (n, (i, rhs)) in self.assignments.iter().enumerate() {
            let column = &columns[*i];
            let name = column.name().quoted();
            if n > 0 {
                stmt.push(", ");
            }
            stmt.push(&name).push(" = ");
            match rhs {
                Rhs::Snapshot(field) => {
                    let value = Source::Snapshot(field.clone()).resolve(event)?;
                    stmt.bind(to_bind(column, &value)?);
                }
                Rhs::Literal(value) => {
                    stmt.bind(to_bind(column, value)?);
                }
                Rhs::Now => {
                    let text = format_timestamp(now);
                    stmt.bind(match column.ty() {
                        ColumnType::Timestamp => BindValue::Timestamp(text),
                        _ => BindValue::Text(text),
                    });
                }
                Rhs::Sequence => {
                    let value = autonumber::draw(conn, self.object.name(), column.name()).await?;
                    stmt.bind(BindValue::Integer(value));
                }
                Rhs::Append(source) => {
                    let value = to_bind(column, &source.resolve(event)?)?;
                    stmt.push("COALESCE(")
                        .push(&name)
                        .push(", '') || ")
                        .bind(value);
                }
                Rhs::Increment(source) => {
                    let value = to_bind(column, &source.resolve(event)?)?;
                    stmt.push("COALESCE(")
                        .push(&name)
                        .push(", 0) + ")
                        .bind(value);
                }
                Rhs::SetIfEmpty(source) => {
                    let value = to_bind(column, &source.resolve(event)?)?;
                    stmt.push("CASE WHEN ").push(&name).push(" IS NULL");
                    if column.ty() == ColumnType::Text {
                        stmt.push(" OR ").push(&name).push(" = ''");
                    }
                    stmt.push(" THEN ")
                        .bind(value)
                        .push(" ELSE ")
                        .push(&name)
                        .push(" END");
                }
            }
        }
        stmt.push(" WHERE ");
        for (n, ((i, _), value)) in self.target.iter().zip(target).enumerate() {
            if n > 0 {
                stmt.push(" AND ");
            }
            stmt.push(&columns[*i].name().quoted()).push(" = ");
            stmt.bind(value.clone());
        }
        conn.execute(&stmt).await
    }
}

impl Effect for FieldSet {
    fn effect_class(&self) -> EffectClass {
        let reasons: Vec<Reason> = self
            .assignments
            .iter()
            .filter_map(|(i, rhs)| {
                rhs.non_determinism().map(|kind| Reason {
                    column: self.object.columns()[*i].name().to_string(),
                    kind,
                })
            })
            .collect();
        if reasons.is_empty() {
            EffectClass::DeterministicSet
        } else {
            EffectClass::NonDeterministicSet { reasons }
        }
    }
}

impl FieldSetBuilder {
    /// Selects the target row by `column` (any registered column, typically the `Id`); several
    /// calls select by all of them.
    pub fn target(mut self, column: &str, source: impl Into<Source>) -> Self {
        self.target.push((column.to_string(), source.into()));
        self
    }

    /// Assigns `rhs` to field `column`.
    pub fn set(mut self, column: &str, rhs: Rhs) -> Self {
        self.assignments.push((column.to_string(), rhs));
        self
    }

    /// Checks the target and every assignment against the object's metadata.
    pub fn build(self) -> Result<FieldSet> {
        let object = self.object;
        let repeated = |column: &Column| Error::RepeatedColumn {
            object: object.name().to_string(),
            column: column.name().to_string(),
        };
        let mut target: Vec<(usize, Source)> = Vec::new();
        for (name, source) in self.target {
            let i = object.column_index(&name)?;
            let column = &object.columns()[i];
            if target.iter().any(|(j, _)| *j == i) {
                return Err(repeated(column));
            }
            if let Source::Literal(value) = &source {
                to_bind(column, value)?;
            }
            target.push((i, source));
        }
        if target.is_empty() {
            return Err(Error::NoTarget(object.name().to_string()));
        }
        let mut assignments: Vec<(usize, Rhs)> = Vec::new();
        for (name, rhs) in self.assignments {
            let i = object.column_index(&name)?;
            let column = &object.columns()[i];
            if !matches!(column.role(), ColumnRole::Field | ColumnRole::Autonumber)
                || (column.role() == ColumnRole::Autonumber && rhs != Rhs::Sequence)
            {
                return Err(Error::NotWritable {
                    object: object.name().to_string(),
                    column: column.name().to_string(),
                    role: column.role().name(),
                    action: "a field set",
                });
            }
            if !rhs.fits(column.ty(), column.role()) {
                return Err(Error::UnsupportedRhs {
                    column: column.name().to_string(),
                    rhs: rhs.name(),
                    ty: column.ty(),
                });
            }
            if assignments.iter().any(|(j, _)| *j == i) {
                return Err(repeated(column));
            }
            let literal = match &rhs {
                Rhs::Literal(value) => Some(value),
                Rhs::Append(Source::Literal(value))
                | Rhs::Increment(Source::Literal(value))
                | Rhs::SetIfEmpty(Source::Literal(value)) => Some(value),
                _ => None,
            };
            if let Some(value) = literal {
                to_bind_as(column.name().as_str(), column.ty(), value)?;
            }
            assignments.push((i, rhs));
        }
        if assignments.is_empty() {
            return Err(Error::EmptyFieldSet(object.name().to_string()));
        }
        Ok(FieldSet {
            object,
            target,
            assignments,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lead() -> Arc<ObjectDef> {
        Arc::new(
            ObjectDef::builder("Lead")
                .read_only("Id", ColumnType::Text)
                .field("Status", ColumnType::Text)
                .field("Notes", ColumnType::Text)
                .field("Touches", ColumnType::Integer)
                .field("Score", ColumnType::Real)
                .field("ConvertedAt", ColumnType::Timestamp)
                .field("Ticket", ColumnType::Integer)
                .field("Owner", ColumnType::Text)
                .build()
                .unwrap(),
        )
    }

    fn set(column: &str, rhs: Rhs) -> Result<FieldSet> {
        FieldSet::builder(lead())
            .target("Id", Source::RecordId)
            .set(column, rhs)
            .build()
    }

    #[test]
    fn snapshot_and_literal_sets_are_deterministic() {
        let action = FieldSet::builder(lead())
            .target("Id", Source::RecordId)
            .set("Status", Rhs::snapshot("Status"))
            .set("Owner", Rhs::literal("queue"))
            .build()
            .unwrap();
        assert_eq!(action.effect_class(), EffectClass::DeterministicSet);
        assert!(action.effect_class().is_redelivery_safe());
    }

    #[test]
    fn every_trap_is_classified_with_its_reason() {
        let cases = [
            ("ConvertedAt", Rhs::Now, NonDeterminism::Now),
            ("Ticket", Rhs::Sequence, NonDeterminism::Sequence),
            (
                "Notes",
                Rhs::Append(Source::literal(";x")),
                NonDeterminism::Append,
            ),
            (
                "Touches",
                Rhs::Increment(Source::literal(1)),
                NonDeterminism::Increment,
            ),
            (
                "Owner",
                Rhs::SetIfEmpty(Source::snapshot("Owner")),
                NonDeterminism::SetIfEmpty,
            ),
        ];
        for (column, rhs, kind) in cases {
            let class = set(column, rhs).unwrap().effect_class();
            assert!(!class.is_redelivery_safe(), "{class}");
            assert_eq!(
                class.reasons(),
                [Reason {
                    column: column.to_string(),
                    kind
                }]
            );
        }
    }

    #[test]
    fn one_trap_makes_the_whole_set_non_deterministic() {
        let action = FieldSet::builder(lead())
            .target("Id", Source::RecordId)
            .set("Status", Rhs::snapshot("Status"))
            .set("ConvertedAt", Rhs::Now)
            .set("Touches", Rhs::Increment(Source::literal(1)))
            .build()
            .unwrap();
        let class = action.effect_class();
        let kinds: Vec<_> = class.reasons().iter().map(|r| r.kind).collect();
        assert_eq!(kinds, [NonDeterminism::Now, NonDeterminism::Increment]);
        assert_eq!(
            class.to_string(),
            "non-deterministic field set: ConvertedAt = Now: writes the delivery time, which \
             differs on every delivery; Touches = Increment: adds again on every delivery"
        );
    }

    #[test]
    fn right_hand_sides_must_fit_their_column() {
        let err = set("Touches", Rhs::Append(Source::literal("x"))).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Append cannot write column Touches of type integer"
        );
        assert!(matches!(
            set("Status", Rhs::Increment(Source::literal(1))),
            Err(Error::UnsupportedRhs { .. })
        ));
        assert!(matches!(
            set("Touches", Rhs::Now),
            Err(Error::UnsupportedRhs { .. })
        ));
        assert!(matches!(
            set("Notes", Rhs::Sequence),
            Err(Error::UnsupportedRhs { .. })
        ));
        assert!(matches!(
            set("Touches", Rhs::Increment(Source::literal("1"))),
            Err(Error::TypeMismatch { .. })
        ));
        assert!(set("Score", Rhs::Increment(Source::literal(0.5))).is_ok());
        assert!(set("Status", Rhs::Now).is_ok());
    }

    #[test]
    fn targets_and_read_only_columns_are_checked() {
        let err = FieldSet::builder(lead())
            .set("Status", Rhs::literal("x"))
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::NoTarget(_)), "{err}");
        let err = FieldSet::builder(lead())
            .target("Id", Source::RecordId)
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::EmptyFieldSet(_)), "{err}");
        let err = set("Id", Rhs::literal("x")).unwrap_err();
        assert!(
            matches!(
                err,
                Error::NotWritable {
                    role: "read-only",
                    ..
                }
            ),
            "{err}"
        );
        let err = FieldSet::builder(lead())
            .target("Id", Source::RecordId)
            .set("Status", Rhs::literal("a"))
            .set("status", Rhs::literal("b"))
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::RepeatedColumn { .. }), "{err}");
    }
}
