//! A decoded row as the filter evaluator sees it.

use walcast_protocol::filter::{ColumnText, RecordView};
use walcast_wal2json::Column;

use walcast_pipeline::change_event::TypeCache;

/// A row as the filter evaluator sees it: column name, typname, Postgres text value.
pub struct RowView<'a> {
    cols: Vec<(&'a str, &'a str, Option<std::borrow::Cow<'a, str>>)>,
}

impl<'a> RowView<'a> {
    pub fn new(columns: impl Iterator<Item = &'a Column<'a>>, types: &'a TypeCache) -> RowView<'a> {
        RowView {
            cols: columns
                .map(|c| {
                    let typname = c
                        .type_oid
                        .and_then(|o| types.get(o))
                        .unwrap_or(c.type_name.as_ref());
                    (c.name.as_ref(), typname, c.text())
                })
                .collect(),
        }
    }
}

impl RecordView for RowView<'_> {
    fn column(&self, name: &str) -> Option<ColumnText<'_>> {
        self.cols
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, t, v)| ColumnText {
                typname: t,
                value: v.as_deref(),
            })
    }
}

/// A row as the filter evaluator sees it, owning its texts: handed from the decoding task
/// to a project's delivery lane, where its filters are evaluated.
#[derive(Debug, Clone, Default)]
pub struct OwnedRow {
    cols: Vec<(String, String, Option<String>)>,
}

impl OwnedRow {
    pub fn new<'a>(columns: impl Iterator<Item = &'a Column<'a>>, types: &TypeCache) -> OwnedRow {
        OwnedRow {
            cols: columns
                .map(|c| {
                    let typname = c
                        .type_oid
                        .and_then(|o| types.get(o))
                        .unwrap_or(c.type_name.as_ref());
                    (
                        c.name.to_string(),
                        typname.to_string(),
                        c.text().map(|t| t.into_owned()),
                    )
                })
                .collect(),
        }
    }
}

impl RecordView for OwnedRow {
    fn column(&self, name: &str) -> Option<ColumnText<'_>> {
        self.cols
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, t, v)| ColumnText {
                typname: t,
                value: v.as_deref(),
            })
    }
}
