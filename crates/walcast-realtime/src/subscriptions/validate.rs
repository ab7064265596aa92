//! What a registration is checked against before it reaches the matcher: its table is a
//! realtime table (and was not dropped), its `select` and filter name columns its role
//! may read, with types the filter fits; and whether its changes can be delivered by
//! class (no row-level security for its role).

use std::collections::HashMap;

use tokio_postgres::Client;
use walcast_bus::subs::SubscriptionSpec;
use walcast_protocol::filter::{CompiledFilter, Filter};

use walcast_control::tables as realtime_tables;

/// Most entries a binding's `select` may have (Postgres' limit of columns per table).
pub const MAX_SELECT_COLUMNS: usize = 1600;
/// Longest `select` entry, in bytes (Postgres cuts names at 63).
pub const MAX_SELECT_NAME: usize = 63;

fn describe(spec: &SubscriptionSpec) -> String {
    format!(
        "[event: {}, schema: {}, table: {}, filters: {}]",
        spec.event,
        spec.schema,
        spec.table.as_deref().unwrap_or("*"),
        spec.filter.as_deref().unwrap_or("")
    )
}

/// (schema, table, role) → the table's columns: name, typname, readable by the role.
pub(super) type ColumnCache = HashMap<(String, String, String), Vec<(String, String, bool)>>;

/// (schema, table, role) → its changes are never row-checked for that role.
pub(super) type RowCheckCache = HashMap<(String, String, String), bool>;

/// Whether every change a spec matches is delivered by class (see
/// [`RegisterResult::by_class`]): one table without row-level security for the role —
/// the same rule the pipeline applies per change (`authorize`; a DELETE is judged per
/// subscriber like any other change).
pub(super) async fn by_class(
    client: &Client,
    spec: &SubscriptionSpec,
    memo: &mut RowCheckCache,
) -> Result<bool, tokio_postgres::Error> {
    let Some(table) = spec.table.as_deref().filter(|_| spec.schema != "*") else {
        return Ok(false);
    };
    let role = spec
        .claims
        .get("role")
        .and_then(|r| r.as_str())
        .unwrap_or_default();
    let key = (spec.schema.clone(), table.to_string(), role.to_string());
    if let Some(known) = memo.get(&key) {
        return Ok(*known);
    }
    let unchecked = client
        .query_opt(
            "SELECT NOT c.relrowsecurity OR coalesce(r.rolbypassrls, false)
               FROM pg_class c LEFT JOIN pg_roles r ON r.rolname = $2
              WHERE c.oid = to_regclass($1)",
            &[&walcast_core::sql::qualified(&spec.schema, table), &role],
        )
        .await?
        .is_some_and(|r| r.get::<_, bool>(0));
    memo.insert(key, unchecked);
    Ok(unchecked)
}

/// What a subscription is told when its table was dropped.
pub(crate) fn dropped_message(schema: &str, table: &str) -> String {
    format!("Table {schema}.{table} was dropped: this subscription has ended")
}

/// A subscription already in effect at its front (`from` set: registered again in the
/// background or for a new leader) whose table no longer exists was ended by a DROP: it
/// is told so, as the worker's notice of the drop would, whichever arrives first. A new
/// join of a missing table gets Supabase's generic refusal instead.
async fn dropped(
    client: &Client,
    spec: &SubscriptionSpec,
) -> Result<Option<String>, tokio_postgres::Error> {
    let (Some(_), Some(table)) = (spec.from, spec.table.as_deref()) else {
        return Ok(None);
    };
    if spec.schema == "*" {
        return Ok(None);
    }
    let name = walcast_core::sql::qualified(&spec.schema, table);
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&name])
        .await?
        .get(0);
    Ok((!exists).then(|| dropped_message(&spec.schema, table)))
}

/// Check a spec; `Ok(Err(message))` is a refusal to send to the client.
pub(super) async fn validate(
    client: &Client,
    spec: &SubscriptionSpec,
    enabled: &[realtime_tables::TableRef],
    columns: &mut ColumnCache,
) -> Result<Result<Option<CompiledFilter>, String>, tokio_postgres::Error> {
    let unable = || {
        format!(
            "Unable to subscribe to changes with given parameters. Please check Realtime is enabled for the given connect parameters: {}",
            describe(spec)
        )
    };
    if !matches!(spec.event.as_str(), "*" | "INSERT" | "UPDATE" | "DELETE") {
        return Ok(Err(unable()));
    }
    let covered = enabled.iter().any(|t| {
        (spec.schema == "*" || spec.schema == t.schema)
            && spec.table.as_deref().is_none_or(|name| name == t.table)
    });
    if !covered {
        return Ok(Err(dropped(client, spec).await?.unwrap_or_else(unable)));
    }
    let filter = match spec
        .filter
        .as_deref()
        .map(str::trim)
        .filter(|f| !f.is_empty())
    {
        None => None,
        Some(text) => match Filter::parse(text) {
            Ok(f) => Some(f),
            Err(e) => return Ok(Err(format!("Error parsing `filter` params: {e}"))),
        },
    };
    if let Some(f) = &filter {
        if let Err(message) = check_filter(client, spec, enabled, f, columns).await? {
            return Ok(Err(message));
        }
    }
    if let Err(message) = check_select(client, spec, enabled, columns).await? {
        return Ok(Err(message));
    }
    // Its patterns compiled once, here, for every change it is evaluated on.
    match filter.map(CompiledFilter::new).transpose() {
        Ok(compiled) => Ok(Ok(compiled)),
        Err(e) => Ok(Err(format!("Error parsing `filter` params: {e}"))),
    }
}

/// A `select` of at most [`MAX_SELECT_COLUMNS`] names of at most [`MAX_SELECT_NAME`] bytes.
pub fn select_bounds(select: &[String]) -> Result<(), String> {
    if select.len() > MAX_SELECT_COLUMNS {
        return Err(format!(
            "Error parsing `select` params: {} columns (at most {MAX_SELECT_COLUMNS})",
            select.len()
        ));
    }
    match select.iter().find(|c| c.trim().len() > MAX_SELECT_NAME) {
        Some(_) => Err(format!(
            "Error parsing `select` params: a column name is longer than {MAX_SELECT_NAME} bytes"
        )),
        None => Ok(()),
    }
}

/// Every `select` name must be a column of the table (of at least one table a wildcard
/// covers), as Postgres would refuse `SELECT x FROM t`. `Ok(Err(message))`: refused.
async fn check_select(
    client: &Client,
    spec: &SubscriptionSpec,
    enabled: &[realtime_tables::TableRef],
    columns: &mut ColumnCache,
) -> Result<Result<(), String>, tokio_postgres::Error> {
    let Some(select) = spec.select.as_deref() else {
        return Ok(Ok(()));
    };
    if let Err(message) = select_bounds(select) {
        return Ok(Err(message));
    }
    let role = spec
        .claims
        .get("role")
        .and_then(|r| r.as_str())
        .unwrap_or_default();
    let mut unknown = walcast_bus::subs::selected(spec).unwrap_or_default();
    let tables = enabled.iter().filter(|t| {
        (spec.schema == "*" || spec.schema == t.schema)
            && spec.table.as_deref().is_none_or(|name| name == t.table)
    });
    for t in tables {
        if unknown.is_empty() {
            break;
        }
        let cols = table_columns(client, t, role, columns).await?;
        unknown.retain(|c| !cols.iter().any(|(n, _, _)| n == c));
    }
    Ok(match unknown.first() {
        Some(c) => Err(format!(
            "Error parsing `select` params: column \"{c}\" does not exist"
        )),
        None => Ok(()),
    })
}

/// A filter is evaluated on every change of the tables it covers: its columns must exist
/// there with a type it fits, and the subscriber's role must be allowed to read them (or
/// matching would reveal values the role cannot SELECT). `Ok(Err(message))`: refused.
async fn check_filter(
    client: &Client,
    spec: &SubscriptionSpec,
    enabled: &[realtime_tables::TableRef],
    f: &Filter,
    columns: &mut ColumnCache,
) -> Result<Result<(), String>, tokio_postgres::Error> {
    let role = spec
        .claims
        .get("role")
        .and_then(|r| r.as_str())
        .unwrap_or_default();
    let tables = enabled.iter().filter(|t| {
        (spec.schema == "*" || spec.schema == t.schema)
            && spec.table.as_deref().is_none_or(|name| name == t.table)
    });
    for t in tables {
        let cols = table_columns(client, t, role, columns).await?;
        for c in &f.conditions {
            if cols
                .iter()
                .any(|(n, _, readable)| *n == c.column && !readable)
            {
                return Ok(Err(format!(
                    "Error parsing `filter` params: permission denied for column {:?} of {} (role {:?} may not read it)",
                    c.column, t, role
                )));
            }
        }
        if spec.table.is_none() || spec.schema == "*" {
            // A wildcard: tables without the column simply never match.
            continue;
        }
        let lookup = |name: &str| {
            cols.iter()
                .find(|(n, _, _)| n == name)
                .map(|(_, t, _)| t.as_str())
        };
        if let Err(e) = f.validate(lookup) {
            return Ok(Err(format!("Error parsing `filter` params: {e}")));
        }
    }
    Ok(Ok(()))
}

/// A table's columns (name, type, readable by `role`), read once per request.
async fn table_columns<'a>(
    client: &Client,
    t: &realtime_tables::TableRef,
    role: &str,
    columns: &'a mut ColumnCache,
) -> Result<&'a [(String, String, bool)], tokio_postgres::Error> {
    let key = (t.schema.clone(), t.table.clone(), role.to_string());
    if !columns.contains_key(&key) {
        let rows = client
            .query(
                "SELECT a.attname::text, t.typname::text,
                        coalesce((SELECT has_column_privilege(r.oid, a.attrelid, a.attnum, 'SELECT')
                                    FROM pg_roles r WHERE r.rolname = $3), false)
                   FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
                  WHERE a.attrelid = format('%I.%I', $1::text, $2::text)::regclass
                    AND a.attnum > 0 AND NOT a.attisdropped",
                &[&t.schema, &t.table, &role],
            )
            .await?;
        let read = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        columns.insert(key.clone(), read);
    }
    Ok(columns.get(&key).map(Vec::as_slice).unwrap_or_default())
}
