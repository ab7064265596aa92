//! Planning a batch's checks: per table, the statements (prepared before any reply is
//! awaited) and the arrays they bind.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use tokio_postgres::{Client, Statement};

use super::{arrays, prepared, prepared_as, Array, Connections, GroupCheck, TableCheck};
use crate::authorize::sql::{current_sql, own_values_sql, visible_sql, CatalogColumn};

/// A statement with what it binds and which versions its positions refer to.
pub(super) struct Bound {
    pub(super) stmt: Result<Statement, String>,
    pub(super) arrays: Arc<Vec<Array>>,
    pub(super) pick: Vec<usize>,
}

/// A table's own-values statements and arrays, built once per batch for all the groups
/// that share them: groups of one role share the predicate (keyed by its address), and
/// usually the versions too.
#[derive(Default)]
struct OwnMemo {
    statements: HashMap<usize, Result<Statement, String>>,
    arrays: HashMap<(usize, Vec<usize>), Arc<Vec<Array>>>,
}

async fn plan_own(
    client: &Client,
    cache: &mut HashMap<String, Statement>,
    memo: &mut OwnMemo,
    t: &TableCheck,
    g: &GroupCheck,
) -> Option<Bound> {
    if g.own.is_empty() {
        return None;
    }
    let key = Arc::as_ptr(&g.predicate) as usize;
    let columns = &g.predicate.columns;
    let stmt = match memo.statements.get(&key) {
        Some(s) => s.clone(),
        None => {
            let typed: Vec<CatalogColumn> = columns
                .iter()
                .map(|c| (c.name.clone(), c.ty.clone()))
                .collect();
            let sql = own_values_sql(&t.table, &typed, &g.predicate.condition);
            let s = prepared_as(client, cache, &sql, Some(&g.role)).await;
            memo.statements.insert(key, s.clone());
            s
        }
    };
    let names = columns.iter().map(|c| c.name.as_str());
    let arrays = memo
        .arrays
        .entry((key, g.own.clone()))
        .or_insert_with(|| Arc::new(arrays(&t.versions, &g.own, names)))
        .clone();
    Some(Bound {
        stmt,
        arrays,
        pick: g.own.clone(),
    })
}

/// Statements and bound arrays of one table (built before any reply is awaited: a
/// statement that does not prepare fails only its table or group).
pub(super) struct TablePlan {
    /// The current-row comparison, when some group has current-row versions.
    pub(super) current: Option<Bound>,
    /// Per group: own-values check, current-row visibility check.
    pub(super) groups: Vec<(Option<Bound>, Option<Bound>)>,
}

pub(super) async fn plan_table(conns: &mut Connections<'_>, t: &TableCheck) -> TablePlan {
    let (client, cache) = (conns.check, &mut *conns.check_statements);
    let by_row: BTreeSet<usize> = t.groups.iter().flat_map(|g| g.by_row.clone()).collect();
    let by_row: Vec<usize> = by_row.into_iter().collect();
    let mut current = None;
    let mut visible = Err(String::new());
    if !by_row.is_empty() {
        // Compare every column all those versions carry.
        let compare: Vec<CatalogColumn> = t
            .columns
            .iter()
            .filter(|(name, _)| {
                by_row.iter().all(|&r| {
                    t.versions
                        .get(r)
                        .is_some_and(|v| v.iter().any(|(n, _)| n == name))
                })
            })
            .cloned()
            .collect();
        let stmt = match (
            current_sql(&t.schema, &t.table, &t.pk, &compare),
            &mut conns.own,
        ) {
            (None, _) => Err("the change does not carry its primary key".to_string()),
            (Some(_), None) => Err("no connection to compare rows on".to_string()),
            (Some(sql), Some((own, own_cache))) => prepared(own, own_cache, &sql).await,
        };
        let names = compare.iter().map(|(n, _)| n.as_str());
        current = Some(Bound {
            stmt,
            arrays: Arc::new(arrays(&t.versions, &by_row, names)),
            pick: by_row,
        });
        let role = t
            .groups
            .iter()
            .find(|g| !g.by_row.is_empty())
            .map(|g| g.role.as_str());
        let sql = visible_sql(&t.schema, &t.table, &t.pk);
        visible = prepared_as(client, cache, &sql, role).await;
    }
    let mut groups = Vec::with_capacity(t.groups.len());
    let mut memo = OwnMemo::default();
    for g in &t.groups {
        let own = plan_own(client, cache, &mut memo, t, g).await;
        let keys = t.pk.iter().map(|(n, _)| n.as_str());
        let by_row = (!g.by_row.is_empty()).then(|| Bound {
            stmt: visible.clone(),
            arrays: Arc::new(arrays(&t.versions, &g.by_row, keys)),
            pick: g.by_row.clone(),
        });
        groups.push((own, by_row));
    }
    TablePlan { current, groups }
}
