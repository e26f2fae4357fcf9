//! Natural-key find-or-create: the fix for the proven #3477 duplicate.
//!
//! [`FindOrCreate::run`] returns the row whose natural key matches, or creates exactly one, in
//! the caller's transaction:
//!
//! 1. Read the row by its natural key. A redelivery stops here: no insert, no autonumber draw,
//!    no counter lock.
//! 2. Otherwise draw the autonumber (if the object has one) and insert with
//!    `ON CONFLICT (natural key) DO NOTHING RETURNING …`, inside a savepoint when a value was
//!    drawn.
//! 3. When the insert returns no row, a concurrent creator won the race: roll back to the
//!    savepoint (which hands the drawn value back) and read the winner's row.
//!
//! Naming the natural key as the conflict target means the database refuses the insert when no
//! `UNIQUE` index covers exactly those columns, so a missing index is an error, not a silent
//! duplicate. A unique violation on any other constraint is still an error.

use std::sync::Arc;

use record_key::EventEnvelope;
use serde_json::{Map, Value};

use crate::class::{Effect, EffectClass};
use crate::conn::{ActionConn, AnyConn, Statement};
use crate::registry::{Column, ColumnRole, ObjectDef};
use crate::value::{BindValue, Source, to_bind};
use crate::{Error, Result, autonumber};

/// How many times a lost race is re-read before giving up with
/// [`Error::ConflictWithoutRow`] (the winner's row was deleted each time).
pub const MAX_RACE_ROUNDS: usize = 3;

/// What [`FindOrCreate::run`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct CreateOutcome {
    /// Whether this call created the row (`false`: it existed, or a concurrent creator won).
    pub created: bool,
    /// The row's registered columns, by registered name.
    pub row: Map<String, Value>,
}

/// A find-or-create of one object by its natural key. Built once from metadata, run per event.
#[derive(Clone, Debug)]
pub struct FindOrCreate {
    object: Arc<ObjectDef>,
    /// Natural-key column indices with their sources, in registration order.
    keys: Vec<(usize, Source)>,
    /// Field column indices with their sources.
    fields: Vec<(usize, Source)>,
}

/// Builds a [`FindOrCreate`]; validated by [`FindOrCreateBuilder::build`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct FindOrCreateBuilder {
    object: Arc<ObjectDef>,
    keys: Vec<(String, Source)>,
    fields: Vec<(String, Source)>,
}

impl FindOrCreate {
    /// Starts a find-or-create of `object`.
    pub fn builder(object: Arc<ObjectDef>) -> FindOrCreateBuilder {
        FindOrCreateBuilder {
            object,
            keys: Vec::new(),
            fields: Vec::new(),
        }
    }

    /// The object this action finds or creates.
    pub fn object(&self) -> &Arc<ObjectDef> {
        &self.object
    }

    /// Finds the row of `event`'s natural key or creates it, in `conn`'s open transaction (or
    /// in a transaction of its own when none is open).
    pub async fn run<C: ActionConn + ?Sized>(
        &self,
        conn: &mut C,
        event: &EventEnvelope,
    ) -> Result<CreateOutcome> {
        let keys = self.key_values(event)?;
        let fields = self
            .fields
            .iter()
            .map(|(i, source)| to_bind(&self.object.columns()[*i], &source.resolve(event)?))
            .collect::<Result<Vec<_>>>()?;
        let mut conn = conn.any();
        for _ in 0..MAX_RACE_ROUNDS {
            if let Some(row) = self.find(&mut conn, &keys).await? {
                return Ok(CreateOutcome {
                    created: false,
                    row,
                });
            }
            if let Some(row) = self.insert(&mut conn, &keys, &fields).await? {
                return Ok(CreateOutcome { created: true, row });
            }
            tracing::debug!(object = %self.object.name(), "lost the natural-key insert race; reading the winner");
        }
        Err(Error::ConflictWithoutRow(self.object.name().to_string()))
    }

    fn key_values(&self, event: &EventEnvelope) -> Result<Vec<BindValue>> {
        self.keys
            .iter()
            .map(|(i, source)| {
                let column = &self.object.columns()[*i];
                let value = to_bind(column, &source.resolve(event)?)?;
                if value.is_null() {
                    return Err(Error::NullKey {
                        object: self.object.name().to_string(),
                        column: column.name().to_string(),
                    });
                }
                Ok(value)
            })
            .collect()
    }

    fn returned(&self) -> Vec<&Column> {
        self.object.columns().iter().collect()
    }

    async fn find(
        &self,
        conn: &mut AnyConn<'_>,
        keys: &[BindValue],
    ) -> Result<Option<Map<String, Value>>> {
        let columns = self.returned();
        let mut stmt = Statement::new(conn.backend());
        stmt.push("SELECT ")
            .push_select_list(&columns)
            .push(" FROM ");
        stmt.push(&self.object.name().quoted()).push(" WHERE ");
        for (n, ((i, _), value)) in self.keys.iter().zip(keys).enumerate() {
            if n > 0 {
                stmt.push(" AND ");
            }
            stmt.push(&self.object.columns()[*i].name().quoted())
                .push(" = ");
            stmt.bind(value.clone());
        }
        conn.fetch_optional_row(&stmt, &columns).await
    }

    /// Inserts the row; `None` when the natural key already exists (a lost race).
    async fn insert(
        &self,
        conn: &mut AnyConn<'_>,
        keys: &[BindValue],
        fields: &[BindValue],
    ) -> Result<Option<Map<String, Value>>> {
        let Some(autonumber) = self.object.autonumber() else {
            // Without a draw there is nothing to hand back: one statement, no savepoint.
            return self.insert_statement(conn, keys, fields, None).await;
        };
        // The savepoint makes the draw and the insert one unit: when the insert loses the race,
        // rolling back to it undoes the counter increment, so the value is not burned.
        let mut savepoint = conn.begin_nested().await?;
        let inserted = async {
            let mut conn = savepoint.conn();
            let value = autonumber::draw(&mut conn, self.object.name(), autonumber.name()).await?;
            self.insert_statement(&mut conn, keys, fields, Some((autonumber, value)))
                .await
        }
        .await;
        match inserted {
            Ok(Some(row)) => {
                savepoint.commit().await?;
                Ok(Some(row))
            }
            Ok(None) => {
                savepoint.rollback().await?;
                Ok(None)
            }
            Err(e) => {
                // The original error matters more than a failed rollback (on PostgreSQL the
                // transaction is aborted then anyway, and the caller rolls it back).
                if let Err(rollback) = savepoint.rollback().await {
                    tracing::warn!(error = %rollback, "rollback to the create savepoint failed");
                }
                Err(e)
            }
        }
    }

    async fn insert_statement(
        &self,
        conn: &mut AnyConn<'_>,
        keys: &[BindValue],
        fields: &[BindValue],
        autonumber: Option<(&Column, i64)>,
    ) -> Result<Option<Map<String, Value>>> {
        let columns = self.object.columns();
        let mut names: Vec<String> = Vec::new();
        let mut values: Vec<BindValue> = Vec::new();
        for ((i, _), value) in self
            .keys
            .iter()
            .zip(keys)
            .chain(self.fields.iter().zip(fields))
        {
            names.push(columns[*i].name().quoted());
            values.push(value.clone());
        }
        if let Some((column, value)) = autonumber {
            names.push(column.name().quoted());
            values.push(BindValue::Integer(value));
        }
        let key_names: Vec<String> = self
            .keys
            .iter()
            .map(|(i, _)| columns[*i].name().quoted())
            .collect();
        let returned = self.returned();
        let mut stmt = Statement::new(conn.backend());
        stmt.push("INSERT INTO ")
            .push(&self.object.name().quoted())
            .push(" (")
            .push(&names.join(", "))
            .push(") VALUES (");
        for (n, value) in values.into_iter().enumerate() {
            if n > 0 {
                stmt.push(", ");
            }
            stmt.bind(value);
        }
        stmt.push(") ON CONFLICT (")
            .push(&key_names.join(", "))
            .push(") DO NOTHING RETURNING ")
            .push_select_list(&returned);
        conn.fetch_optional_row(&stmt, &returned).await
    }
}

impl Effect for FindOrCreate {
    fn effect_class(&self) -> EffectClass {
        EffectClass::NaturalKeyCreate {
            object: self.object.name().to_string(),
            natural_key: self
                .keys
                .iter()
                .map(|(i, _)| self.object.columns()[*i].name().to_string())
                .collect(),
            autonumber: self.object.autonumber().map(|c| c.name().to_string()),
        }
    }
}

impl FindOrCreateBuilder {
    /// Gives the value of natural-key column `column`.
    pub fn key(mut self, column: &str, source: impl Into<Source>) -> Self {
        self.keys.push((column.to_string(), source.into()));
        self
    }

    /// Gives the value of field `column`, written only when the row is created.
    pub fn field(mut self, column: &str, source: impl Into<Source>) -> Self {
        self.fields.push((column.to_string(), source.into()));
        self
    }

    /// Checks every column against the object's metadata: each natural-key column given once,
    /// fields writable, literal values of the right type.
    pub fn build(self) -> Result<FindOrCreate> {
        let object = self.object;
        let object_name = || object.name().to_string();
        if object.natural_key().next().is_none() {
            return Err(Error::NoNaturalKey(object_name()));
        }
        let mut seen: Vec<usize> = Vec::new();
        let mut resolve = |name: &str, source: &Source, want: ColumnRole| -> Result<usize> {
            let i = object.column_index(name)?;
            let column = &object.columns()[i];
            if column.role() != want {
                return Err(Error::NotWritable {
                    object: object_name(),
                    column: column.name().to_string(),
                    role: column.role().name(),
                    action: if want == ColumnRole::NaturalKey {
                        "find-or-create as a natural-key value"
                    } else {
                        "find-or-create"
                    },
                });
            }
            if seen.contains(&i) {
                return Err(Error::RepeatedColumn {
                    object: object_name(),
                    column: column.name().to_string(),
                });
            }
            seen.push(i);
            if let Source::Literal(value) = source {
                to_bind(column, value)?;
            }
            Ok(i)
        };
        let mut keys = Vec::new();
        for (name, source) in &self.keys {
            keys.push((
                resolve(name, source, ColumnRole::NaturalKey)?,
                source.clone(),
            ));
        }
        let mut fields = Vec::new();
        for (name, source) in &self.fields {
            fields.push((resolve(name, source, ColumnRole::Field)?, source.clone()));
        }
        if let Some(missing) = object
            .natural_key()
            .find(|c| !keys.iter().any(|(i, _)| object.columns()[*i] == **c))
        {
            return Err(Error::MissingKey {
                object: object_name(),
                column: missing.name().to_string(),
            });
        }
        keys.sort_by_key(|(i, _)| *i);
        Ok(FindOrCreate {
            object,
            keys,
            fields,
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::registry::ColumnType;

    fn opportunity() -> Arc<ObjectDef> {
        Arc::new(
            ObjectDef::builder("Opportunity")
                .read_only("Id", ColumnType::Integer)
                .natural_key("SourceLeadId", ColumnType::Text)
                .natural_key("RelationName", ColumnType::Text)
                .field("Name", ColumnType::Text)
                .autonumber("OpportunityNumber")
                .build()
                .unwrap(),
        )
    }

    #[test]
    fn every_natural_key_column_must_be_given() {
        let err = FindOrCreate::builder(opportunity())
            .key("SourceLeadId", Source::RecordId)
            .build()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "find-or-create on Opportunity gives no value for natural-key column RelationName"
        );
    }

    #[test]
    fn keys_fields_and_autonumbers_keep_their_roles() {
        let base = || {
            FindOrCreate::builder(opportunity())
                .key("SourceLeadId", Source::RecordId)
                .key("RelationName", json!("converted"))
        };
        assert!(
            base()
                .field("Name", Source::snapshot("Company"))
                .build()
                .is_ok()
        );
        let err = base()
            .field("OpportunityNumber", json!(7))
            .build()
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::NotWritable {
                    role: "autonumber",
                    ..
                }
            ),
            "{err}"
        );
        let err = base().field("Id", json!(7)).build().unwrap_err();
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
        let err = base().key("Name", json!("x")).build().unwrap_err();
        assert!(
            matches!(err, Error::NotWritable { role: "field", .. }),
            "{err}"
        );
        let err = base().key("SourceLeadId", json!("x")).build().unwrap_err();
        assert!(matches!(err, Error::RepeatedColumn { .. }), "{err}");
        let err = base().field("Name", json!(5)).build().unwrap_err();
        assert!(matches!(err, Error::TypeMismatch { .. }), "{err}");
        let err = base().field("Amount", json!(5)).build().unwrap_err();
        assert!(matches!(err, Error::UnknownColumn { .. }), "{err}");
    }

    #[test]
    fn an_object_without_natural_key_cannot_be_created_idempotently() {
        let def = Arc::new(
            ObjectDef::builder("Note")
                .field("Body", ColumnType::Text)
                .build()
                .unwrap(),
        );
        let err = FindOrCreate::builder(def).build().unwrap_err();
        assert!(matches!(err, Error::NoNaturalKey(_)), "{err}");
    }

    #[test]
    fn a_find_or_create_is_classified_as_a_natural_key_create() {
        let action = FindOrCreate::builder(opportunity())
            .key("RelationName", json!("converted"))
            .key("SourceLeadId", Source::RecordId)
            .build()
            .unwrap();
        let class = action.effect_class();
        assert_eq!(
            class,
            EffectClass::NaturalKeyCreate {
                object: "Opportunity".into(),
                natural_key: vec!["SourceLeadId".into(), "RelationName".into()],
                autonumber: Some("OpportunityNumber".into()),
            }
        );
        assert!(class.is_redelivery_safe());
    }
}
