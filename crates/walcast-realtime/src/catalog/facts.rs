//! The facts the catalog gives about a table and a role, as plain types: read in
//! `catalog/read.rs`, carried by DDL notices (`catalog/change.rs`) and
//! judged by the authorizer. Kept apart so that those modules
//! share them without importing each other.

use std::collections::HashSet;

/// A column's name and SQL type (`format_type`).
pub type CatalogColumn = (String, String);

/// A column as a policy reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColumnFact {
    pub name: String,
    /// `format_type()`, read with an empty `search_path` (so schema-qualified).
    pub ty: String,
    /// `numeric`, `real` or `double precision`: wal2json writes NaN and ±Infinity as
    /// `null`, so a NULL in a change may stand for one of them.
    pub nan_as_null: bool,
}

/// What the catalog says about a streamed table.
#[derive(Clone, Debug, Default)]
pub struct TableInfo {
    /// Row-level security is enabled.
    pub rls: bool,
    /// Primary-key columns with their SQL type (`format_type`), in key order.
    pub pk: Vec<CatalogColumn>,
    /// Every column with its SQL type, in table order.
    pub columns: Vec<CatalogColumn>,
    /// The columns whose NULL in a change may stand for NaN or ±Infinity (see
    /// [`ColumnFact::nan_as_null`]).
    pub nan_as_null: HashSet<String>,
}

impl TableInfo {
    /// Every column, in table order, as policies read them.
    pub fn column_facts(&self) -> Vec<ColumnFact> {
        self.columns
            .iter()
            .map(|(name, ty)| ColumnFact {
                name: name.clone(),
                ty: ty.clone(),
                nan_as_null: self.nan_as_null.contains(name),
            })
            .collect()
    }
}

/// What a role may see of a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    pub columns: HashSet<String>,
    pub bypass_rls: bool,
}
