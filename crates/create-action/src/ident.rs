//! Validated SQL identifiers: the only names this crate ever splices into SQL text.
//!
//! A name is accepted when it matches `^[A-Za-z_][A-Za-z0-9_]{0,62}$` (PostgreSQL keeps 63
//! bytes of a name). Nothing else can reach SQL text: values are always bound.
//!
//! Accepted names are case-insensitive, like the unquoted names of the migrations: they are
//! written to SQL folded to lower case and in double quotes. Folding matches what PostgreSQL
//! does to an unquoted name (SQLite ignores case either way), and quoting makes a name that
//! happens to be a keyword (`order`, `group`) harmless, so no keyword list is needed.

use std::fmt;

use crate::Error;

/// The longest identifier accepted, in bytes (PostgreSQL's `NAMEDATALEN - 1`).
pub const MAX_IDENT_LEN: usize = 63;

/// Prefixes (compared without case) of tables that actions may not write: the databases' own
/// catalogs, the platform's system tables (the outbox, the autonumber counters) and the
/// migration ledger.
pub const RESERVED_TABLE_PREFIXES: &[&str] = &["pg_", "sqlite_", "_system_", "_sqlx_"];

/// A name that is safe to put into SQL text.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ident(String);

impl Ident {
    /// Validates `name`; refuses anything but ASCII letters, digits and underscores, a leading
    /// digit, the empty name and names longer than [`MAX_IDENT_LEN`].
    pub fn new(name: &str) -> Result<Self, Error> {
        let refuse = |reason| {
            Err(Error::InvalidIdentifier {
                name: name.to_string(),
                reason,
            })
        };
        let Some(first) = name.chars().next() else {
            return refuse("it is empty");
        };
        if name.len() > MAX_IDENT_LEN {
            return refuse("it is longer than 63 bytes");
        }
        if !(first.is_ascii_alphabetic() || first == '_') {
            return refuse("it must start with an ASCII letter or an underscore");
        }
        if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return refuse("only ASCII letters, digits and underscores are allowed");
        }
        Ok(Self(name.to_string()))
    }

    /// Validates `name` as a table that actions write: an identifier that does not start with
    /// one of the [`RESERVED_TABLE_PREFIXES`].
    pub fn table(name: &str) -> Result<Self, Error> {
        let ident = Self::new(name)?;
        let folded = ident.folded();
        if RESERVED_TABLE_PREFIXES
            .iter()
            .any(|p| folded.starts_with(p))
        {
            return Err(Error::InvalidIdentifier {
                name: name.to_string(),
                reason: "the name is reserved for the database or the platform",
            });
        }
        Ok(ident)
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name folded to lower case: the name the database stores for it.
    pub fn folded(&self) -> String {
        self.0.to_ascii_lowercase()
    }

    /// The name as written into SQL text: folded and double-quoted.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.folded())
    }

    /// Whether two names denote the same database object.
    pub fn same_as(&self, other: &str) -> bool {
        self.0.eq_ignore_ascii_case(other)
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(name: &str) -> &'static str {
        match Ident::new(name) {
            Err(Error::InvalidIdentifier { reason, .. }) => reason,
            other => panic!("{name:?} was not refused: {other:?}"),
        }
    }

    #[test]
    fn accepts_plain_names() {
        for name in [
            "Opportunity",
            "_x",
            "a",
            "SourceLeadId",
            "Field_2",
            &"a".repeat(63),
        ] {
            assert_eq!(Ident::new(name).unwrap().as_str(), name);
        }
    }

    #[test]
    fn refuses_hostile_and_malformed_names() {
        assert_eq!(
            reason("Name\"; DROP TABLE x; --"),
            "only ASCII letters, digits and underscores are allowed"
        );
        assert_eq!(
            reason("a b"),
            "only ASCII letters, digits and underscores are allowed"
        );
        assert_eq!(
            reason("a'b"),
            "only ASCII letters, digits and underscores are allowed"
        );
        assert_eq!(
            reason("a.b"),
            "only ASCII letters, digits and underscores are allowed"
        );
        assert_eq!(
            reason("naïve"),
            "only ASCII letters, digits and underscores are allowed"
        );
        assert_eq!(
            reason("1abc"),
            "it must start with an ASCII letter or an underscore"
        );
        assert_eq!(reason(""), "it is empty");
        assert_eq!(reason(&"a".repeat(64)), "it is longer than 63 bytes");
    }

    #[test]
    fn the_error_message_names_the_refused_identifier() {
        let err = Ident::new("Name\"; DROP TABLE x; --").unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"invalid identifier "Name\"; DROP TABLE x; --": only ASCII letters, digits and underscores are allowed"#
        );
    }

    #[test]
    fn reserved_tables_are_refused_for_writing_only() {
        for name in [
            "_System_Autonumber",
            "_system_outboxevent",
            "pg_class",
            "SQLITE_master",
            "_sqlx_migrations",
        ] {
            assert!(Ident::new(name).is_ok(), "{name} is a valid identifier");
            assert!(
                matches!(Ident::table(name), Err(Error::InvalidIdentifier { .. })),
                "{name} must not be a write target"
            );
        }
        assert!(Ident::table("Opportunity").is_ok());
    }

    #[test]
    fn names_are_folded_and_quoted() {
        let ident = Ident::new("SourceLeadId").unwrap();
        assert_eq!(ident.folded(), "sourceleadid");
        assert_eq!(ident.quoted(), "\"sourceleadid\"");
        assert_eq!(Ident::new("order").unwrap().quoted(), "\"order\"");
        assert!(ident.same_as("SOURCELEADID"));
        assert!(!ident.same_as("SourceLead"));
    }
}
