//! Registered object metadata: which tables actions may touch, and which columns of them.
//!
//! Every table and column name an action uses comes from an [`ObjectDef`], validated when it is
//! built; an event payload supplies values only, never names.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::{Error, Ident, Result};

/// The type of a registered column: how its values are checked, bound and read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ColumnType {
    /// Text (`TEXT`); JSON strings.
    Text,
    /// A 64-bit integer (`BIGINT` / `INTEGER`); JSON integers.
    Integer,
    /// A double (`DOUBLE PRECISION` / `REAL`); JSON numbers.
    Real,
    /// A boolean (`BOOLEAN` / `INTEGER` 0 or 1); JSON booleans.
    Boolean,
    /// Any JSON value (`JSONB` / `TEXT` holding JSON).
    Json,
    /// A point in time (`TIMESTAMPTZ` / `TEXT`), written and read as RFC 3339 UTC text
    /// (`YYYY-MM-DDTHH:MM:SS.ffffffZ`).
    Timestamp,
}

impl fmt::Display for ColumnType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ColumnType::Text => "text",
            ColumnType::Integer => "integer",
            ColumnType::Real => "real",
            ColumnType::Boolean => "boolean",
            ColumnType::Json => "json",
            ColumnType::Timestamp => "timestamp",
        })
    }
}

/// What a registered column is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ColumnRole {
    /// Part of the natural key, which a `UNIQUE` index must cover exactly.
    NaturalKey,
    /// A field that actions may write.
    Field,
    /// The autonumber field, drawn from `_System_Autonumber` when a row is created.
    Autonumber,
    /// A column that actions read (to return it, or to target a row) but never write, such as
    /// a database-generated `Id`.
    ReadOnly,
}

impl ColumnRole {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ColumnRole::NaturalKey => "natural-key",
            ColumnRole::Field => "field",
            ColumnRole::Autonumber => "autonumber",
            ColumnRole::ReadOnly => "read-only",
        }
    }
}

/// One registered column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Column {
    name: Ident,
    ty: ColumnType,
    role: ColumnRole,
}

impl Column {
    /// The column's name as registered.
    pub fn name(&self) -> &Ident {
        &self.name
    }

    /// The column's type.
    pub fn ty(&self) -> ColumnType {
        self.ty
    }

    /// The column's role.
    pub fn role(&self) -> ColumnRole {
        self.role
    }
}

/// A registered object: its table, natural key, autonumber field and the columns actions may
/// use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectDef {
    name: Ident,
    columns: Vec<Column>,
}

impl ObjectDef {
    /// Starts a definition of the object stored in table `name`.
    pub fn builder(name: &str) -> ObjectDefBuilder {
        ObjectDefBuilder {
            name: name.to_string(),
            columns: Vec::new(),
        }
    }

    /// The object's (and table's) name as registered.
    pub fn name(&self) -> &Ident {
        &self.name
    }

    /// Every registered column, in registration order.
    pub fn columns(&self) -> &[Column] {
        &self.columns
    }

    /// The natural-key columns, in registration order.
    pub fn natural_key(&self) -> impl Iterator<Item = &Column> {
        self.columns
            .iter()
            .filter(|c| c.role == ColumnRole::NaturalKey)
    }

    /// The autonumber field, if the object has one.
    pub fn autonumber(&self) -> Option<&Column> {
        self.columns
            .iter()
            .find(|c| c.role == ColumnRole::Autonumber)
    }

    /// The registered column named `name` (compared without case).
    pub fn column(&self, name: &str) -> Result<&Column> {
        self.column_index(name).map(|i| &self.columns[i])
    }

    pub(crate) fn column_index(&self, name: &str) -> Result<usize> {
        self.columns
            .iter()
            .position(|c| c.name.same_as(name))
            .ok_or_else(|| Error::UnknownColumn {
                object: self.name.to_string(),
                column: name.to_string(),
            })
    }
}

/// Builds an [`ObjectDef`]; every name is validated by [`ObjectDefBuilder::build`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct ObjectDefBuilder {
    name: String,
    columns: Vec<(String, ColumnType, ColumnRole)>,
}

impl ObjectDefBuilder {
    /// Adds a natural-key column. A `UNIQUE` index on exactly the natural-key columns must exist:
    /// find-or-create names it as its conflict target, and the database refuses the insert
    /// without it.
    pub fn natural_key(mut self, name: &str, ty: ColumnType) -> Self {
        self.columns
            .push((name.to_string(), ty, ColumnRole::NaturalKey));
        self
    }

    /// Adds a field that actions may write.
    pub fn field(mut self, name: &str, ty: ColumnType) -> Self {
        self.columns.push((name.to_string(), ty, ColumnRole::Field));
        self
    }

    /// Declares the autonumber field (an integer column), drawn when a row is created.
    pub fn autonumber(mut self, name: &str) -> Self {
        self.columns.push((
            name.to_string(),
            ColumnType::Integer,
            ColumnRole::Autonumber,
        ));
        self
    }

    /// Adds a column that actions read but never write (for example a generated `Id`).
    pub fn read_only(mut self, name: &str, ty: ColumnType) -> Self {
        self.columns
            .push((name.to_string(), ty, ColumnRole::ReadOnly));
        self
    }

    /// Validates every name and builds the definition.
    pub fn build(self) -> Result<ObjectDef> {
        let name = Ident::table(&self.name)?;
        let mut columns: Vec<Column> = Vec::with_capacity(self.columns.len());
        for (column, ty, role) in self.columns {
            let column = Ident::new(&column)?;
            if columns.iter().any(|c| c.name.same_as(column.as_str())) {
                return Err(Error::DuplicateColumn {
                    object: name.to_string(),
                    column: column.to_string(),
                });
            }
            if role == ColumnRole::Autonumber
                && columns.iter().any(|c| c.role == ColumnRole::Autonumber)
            {
                return Err(Error::SecondAutonumber(name.to_string()));
            }
            columns.push(Column {
                name: column,
                ty,
                role,
            });
        }
        Ok(ObjectDef { name, columns })
    }
}

/// The registered objects, by name (compared without case).
#[derive(Clone, Debug, Default)]
pub struct Registry {
    objects: BTreeMap<String, Arc<ObjectDef>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `def`; refuses a second object whose name differs only in case.
    pub fn register(&mut self, def: ObjectDef) -> Result<Arc<ObjectDef>> {
        let key = def.name.folded();
        if self.objects.contains_key(&key) {
            return Err(Error::DuplicateObject(def.name.to_string()));
        }
        let def = Arc::new(def);
        self.objects.insert(key, Arc::clone(&def));
        Ok(def)
    }

    /// The object named `name`.
    pub fn get(&self, name: &str) -> Result<Arc<ObjectDef>> {
        self.objects
            .get(&name.to_ascii_lowercase())
            .cloned()
            .ok_or_else(|| Error::UnknownObject(name.to_string()))
    }

    /// Every registered object, ordered by folded name.
    pub fn objects(&self) -> impl Iterator<Item = &Arc<ObjectDef>> {
        self.objects.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opportunity() -> ObjectDefBuilder {
        ObjectDef::builder("Opportunity")
            .read_only("Id", ColumnType::Integer)
            .natural_key("SourceLeadId", ColumnType::Text)
            .natural_key("RelationName", ColumnType::Text)
            .field("Name", ColumnType::Text)
            .autonumber("OpportunityNumber")
    }

    #[test]
    fn a_definition_keeps_its_roles() {
        let def = opportunity().build().unwrap();
        let key: Vec<_> = def.natural_key().map(|c| c.name().as_str()).collect();
        assert_eq!(key, ["SourceLeadId", "RelationName"]);
        assert_eq!(
            def.autonumber().unwrap().name().as_str(),
            "OpportunityNumber"
        );
        assert_eq!(def.column("name").unwrap().role(), ColumnRole::Field);
        assert!(matches!(
            def.column("Amount"),
            Err(Error::UnknownColumn { .. })
        ));
    }

    #[test]
    fn hostile_names_never_build() {
        let err = ObjectDef::builder("Name\"; DROP TABLE x; --")
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::InvalidIdentifier { .. }), "{err}");
        let err = opportunity()
            .field("Name\"; DROP TABLE x; --", ColumnType::Text)
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::InvalidIdentifier { .. }), "{err}");
        let err = ObjectDef::builder("_System_OutboxEvent")
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::InvalidIdentifier { .. }), "{err}");
    }

    #[test]
    fn duplicate_columns_and_autonumbers_are_refused() {
        let err = opportunity()
            .field("NAME", ColumnType::Text)
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::DuplicateColumn { .. }), "{err}");
        let err = opportunity().autonumber("Second").build().unwrap_err();
        assert!(matches!(err, Error::SecondAutonumber(_)), "{err}");
    }

    #[test]
    fn the_registry_refuses_names_that_differ_in_case_only() {
        let mut registry = Registry::new();
        registry.register(opportunity().build().unwrap()).unwrap();
        let again = ObjectDef::builder("OPPORTUNITY").build().unwrap();
        assert!(matches!(
            registry.register(again),
            Err(Error::DuplicateObject(_))
        ));
        assert_eq!(
            registry.get("opportunity").unwrap().name().as_str(),
            "Opportunity"
        );
        assert!(matches!(registry.get("Lead"), Err(Error::UnknownObject(_))));
    }
}
