//! The rows of a table a subscriber may see (SSE `?snapshot=true`, see
//! [`walcast_bus::admin::AdminRequest::SnapshotRows`]), read as the subscriber.
//!
//! Hostile input throughout: the table, filter and select come from a client through a
//! front. The table must be a realtime-enabled table of the project's own schema (the
//! tables its subscriptions may join); the subscriber's token must be the project's
//! and its `role` one a token may act as ([`walcast_control::roles`]). Only the columns that role
//! may `SELECT` are read (identifiers quoted), the read runs with `role` and
//! `request.jwt.claims` set by `set_config(…, true)` from bound parameters, so the
//! table's row-level security policies decide which rows come back, in a `READ ONLY`
//! transaction under the admin session's `statement_timeout`, always rolled back.
//!
//! The read runs on the check login's connection ([`walcast_control::check_login`]): the
//! policies, and whatever else of the tenant's the read evaluates, run without
//! walcast's powers. A role that bypasses row-level security (which the check login may
//! not act as) is read on walcast's own connection instead, where nothing of the
//! tenant's can run: row security off, an empty `search_path`, each value by its type's
//! output function (never a cast a tenant may have created) and the records made here
//! from those texts, as a change's are.
//!
//! The `filter` is evaluated here on each row with the same evaluator as on changes
//! (`walcast_protocol::filter`), so the rows and the changes that follow agree on what
//! matches. Records take the form of a change's `record`: `row_to_json` of the
//! columns (numbers, booleans, json embedded, arrays and timestamps as `to_jsonb`
//! prints them), `bytea` as hex without `\x` as wal2json sends it.
//!
//! Position: in a `REPEATABLE READ` transaction, its first statement reads
//! `pg_current_snapshot()` (the transaction's snapshot) and then
//! `pg_current_wal_insert_lsn()`. The insert position rather than `pg_current_wal_lsn()`
//! (the write position): a transaction becomes visible only after its commit record is
//! inserted, but with `synchronous_commit = off` possibly before it is written, so only
//! the insert position is certain to be at or after every visible commit.

use futures_util::{pin_mut, TryStreamExt};
use serde_json::Value;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;
use walcast_bus::admin::{AdminError, AdminErrorKind, SnapshotRows};
use walcast_bus::ColumnInfo;
use walcast_core::sql::{qualified, quote_ident};
use walcast_protocol::filter::{CompiledFilter, Filter, SliceRecord};

use crate::authorize::channel::precheck;
use walcast_control::roles::RolePolicy;
use walcast_control::tables;

/// The hard bounds of one read, whatever a front asks (a front is trusted no more than
/// its clients).
pub const MAX_ROWS: u32 = 100_000;
pub const MAX_BYTES: u32 = 64 << 20;

/// What is asked: a table of the project's schema, a binding's filter and select.
pub struct RowsRequest<'a> {
    pub project: &'a str,
    pub project_schema: &'a str,
    pub claims: &'a Value,
    pub schema: &'a str,
    pub table: &'a str,
    pub filter: Option<&'a str>,
    pub select: Option<&'a [String]>,
    pub max_rows: u32,
    pub max_bytes: u32,
}

fn err(kind: AdminErrorKind, message: impl Into<String>) -> AdminError {
    AdminError::new(kind, message)
}

fn db(e: tokio_postgres::Error) -> AdminError {
    let refused = e.code().is_some_and(|c| {
        *c == SqlState::INSUFFICIENT_PRIVILEGE || *c == SqlState::INVALID_PARAMETER_VALUE
    });
    let message = walcast_pgtls::db_message(&e);
    if refused {
        err(AdminErrorKind::Refused, message)
    } else if e.code() == Some(&SqlState::QUERY_CANCELED) {
        err(
            AdminErrorKind::TooLarge,
            format!("the read took too long: {message}"),
        )
    } else {
        err(AdminErrorKind::Internal, format!("database: {message}"))
    }
}

/// One column to read: name, `typname`, in the key.
struct Col {
    name: String,
    typname: String,
    key: bool,
}

/// The columns of the table `role` may read, in table order.
async fn readable(
    client: &Client,
    schema: &str,
    table: &str,
    role: &str,
) -> Result<Vec<Col>, AdminError> {
    let rows = client
        .query(
            "SELECT a.attname::text, t.typname::text,
                    coalesce(a.attnum = ANY(i.indkey), false)
               FROM pg_attribute a
               JOIN pg_type t ON t.oid = a.atttypid
               LEFT JOIN pg_index i ON i.indrelid = a.attrelid AND i.indisprimary
              WHERE a.attrelid = format('%I.%I', $1::text, $2::text)::regclass
                AND a.attnum > 0 AND NOT a.attisdropped
                AND has_column_privilege((SELECT r.oid FROM pg_roles r WHERE r.rolname = $3),
                                         a.attrelid, a.attnum, 'SELECT')
              ORDER BY a.attnum",
            &[&schema, &table, &role],
        )
        .await
        .map_err(db)?;
    Ok(rows
        .iter()
        .map(|r| Col {
            name: r.get(0),
            typname: r.get(1),
            key: r.get(2),
        })
        .collect())
}

/// The statement: every readable column's text (for the filter), and the record of
/// the columns sent (`shown`).
fn select_sql(schema: &str, table: &str, cols: &[Col], shown: &[&Col]) -> String {
    let texts: Vec<String> = cols
        .iter()
        .map(|c| format!("t.{}::text", quote_ident(&c.name)))
        .collect();
    let record: Vec<String> = shown
        .iter()
        .map(|c| {
            let q = quote_ident(&c.name);
            match c.typname.as_str() {
                "bytea" => format!("encode(t.{q}, 'hex') AS {q}"),
                _ => format!("t.{q}"),
            }
        })
        .collect();
    format!(
        "SELECT ARRAY[{}]::text[], (SELECT row_to_json(s) FROM (SELECT {}) s)::text FROM {} t",
        texts.join(", "),
        record.join(", "),
        qualified(schema, table)
    )
}

/// [`select_sql`] for walcast's own connection: every readable column's output text,
/// no record (made by [`record_of`]).
fn own_select_sql(schema: &str, table: &str, cols: &[Col]) -> String {
    let texts: Vec<String> = cols
        .iter()
        .map(|c| {
            let q = quote_ident(&c.name);
            format!("CASE WHEN t.{q} IS NULL THEN NULL ELSE pg_catalog.format('%s', t.{q}) END")
        })
        .collect();
    format!(
        "SELECT ARRAY[{}]::text[], NULL::text FROM {} t",
        texts.join(", "),
        qualified(schema, table)
    )
}

/// A row's record from its texts, as a change's record is made (`bytea` as hex without
/// `\x`).
fn record_of(shown: &[&Col], cols: &[Col], texts: &[Option<String>]) -> String {
    let mut out = String::from("{");
    for (i, c) in shown.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&serde_json::Value::from(c.name.as_str()).to_string());
        out.push(':');
        let at = cols.iter().position(|k| k.name == c.name);
        match at.and_then(|j| texts.get(j)).and_then(Option::as_deref) {
            None => out.push_str("null"),
            Some(v) if c.typname == "bytea" => {
                let hex = v.strip_prefix("\\x").unwrap_or(v);
                out.push_str(&serde_json::Value::from(hex).to_string());
            }
            Some(v) => walcast_protocol::values::append_json(&c.typname, v, &mut out),
        }
    }
    out.push('}');
    out
}

/// What the read needs, checked before any row is read: the role, the readable
/// columns, the filter, and the columns sent.
struct Plan {
    role: String,
    /// The role bypasses row-level security: read on walcast's own connection.
    bypass: bool,
    cols: Vec<Col>,
    filter: Option<CompiledFilter>,
    shown: Vec<usize>,
}

/// The binding's filter, checked against the readable columns (a column the role may not
/// read is unknown), compiled as on changes.
fn compile(filter: Option<&str>, cols: &[Col]) -> Result<Option<CompiledFilter>, AdminError> {
    let Some(text) = filter.map(str::trim).filter(|f| !f.is_empty()) else {
        return Ok(None);
    };
    let bad = |e: String| err(AdminErrorKind::InvalidRequest, format!("filter: {e}"));
    let f = Filter::parse(text).map_err(|e| bad(e.to_string()))?;
    let lookup = |n: &str| {
        cols.iter()
            .find(|c| c.name == n)
            .map(|c| c.typname.as_str())
    };
    f.validate(lookup).map_err(|e| bad(e.to_string()))?;
    CompiledFilter::new(f)
        .map(Some)
        .map_err(|e| bad(e.to_string()))
}

async fn plan(
    client: &Client,
    roles: &RolePolicy,
    req: &RowsRequest<'_>,
) -> Result<Plan, AdminError> {
    let role = match precheck(client, roles, req.project, req.claims)
        .await
        .map_err(db)?
    {
        Ok(role) => role.to_string(),
        Err(refused) => return Err(err(AdminErrorKind::Refused, refused.to_string())),
    };
    if req.schema != req.project_schema {
        return Err(err(
            AdminErrorKind::InvalidRequest,
            format!(
                "a snapshot reads a table of schema {:?}",
                req.project_schema
            ),
        ));
    }
    let enabled = tables::list(client, Some(req.project))
        .await
        .map_err(|e| err(AdminErrorKind::Internal, e.to_string()))?;
    if !enabled
        .iter()
        .any(|t| t.schema == req.schema && t.table == req.table)
    {
        return Err(err(
            AdminErrorKind::UnknownTable,
            format!(
                "realtime is not enabled on {}",
                qualified(req.schema, req.table)
            ),
        ));
    }
    let bypass: bool = client
        .query_one(
            "SELECT coalesce((SELECT rolbypassrls FROM pg_roles WHERE rolname = $1), false)",
            &[&role],
        )
        .await
        .map_err(db)?
        .get(0);
    let cols = readable(client, req.schema, req.table, &role).await?;
    if cols.is_empty() {
        return Err(err(
            AdminErrorKind::Refused,
            format!("role {role:?} may not read the table"),
        ));
    }
    let filter = compile(req.filter, &cols)?;
    // As on changes: the selected columns and the key (a selected column the role may
    // not read is left out, as from changes; the registration refused unknown ones).
    let shown = (0..cols.len())
        .filter(|&i| {
            req.select
                .is_none_or(|s| cols[i].key || s.contains(&cols[i].name))
        })
        .collect();
    Ok(Plan {
        role,
        bypass,
        cols,
        filter,
        shown,
    })
}

/// Read the rows (see the module docs): planned on walcast's own connection `own`, read
/// on the check login's `check` (or on `own` for a role that bypasses row-level
/// security). Neither may be in a transaction; each is left outside one.
pub async fn read(
    own: &Client,
    check: &Client,
    roles: &RolePolicy,
    req: RowsRequest<'_>,
) -> Result<SnapshotRows, AdminError> {
    let plan = plan(own, roles, &req).await?;
    let client = if plan.bypass { own } else { check };
    client
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await
        .map_err(db)?;
    let result = read_in(client, &req, &plan).await;
    client.batch_execute("ROLLBACK").await.map_err(db)?;
    result
}

/// The settings of the read: the project, the claims and the role, and on walcast's own
/// connection row security off, an empty `search_path` and `bytea` as hex.
const READ_SETTINGS: &str = concat!(
    "SELECT set_config('walcast.project', $1, true), \
     set_config('request.jwt.claims', $2, true), set_config('role', $3, true)",
    claim_settings!()
);
const OWN_SETTINGS: &str = "SELECT set_config('row_security', 'off', true), \
     set_config('search_path', '', true), set_config('bytea_output', 'hex', true)";

async fn read_in(
    client: &Client,
    req: &RowsRequest<'_>,
    plan: &Plan,
) -> Result<SnapshotRows, AdminError> {
    let at = client
        .query_one(
            "SELECT pg_current_snapshot()::text, pg_current_wal_insert_lsn()::text",
            &[],
        )
        .await
        .map_err(db)?;
    let snapshot: String = at.get(0);
    let lsn: String = at.get(1);
    let lsn = lsn
        .parse()
        .map_err(|e| err(AdminErrorKind::Internal, format!("lsn {lsn:?}: {e}")))?;
    let claims = req.claims.to_string();
    client
        .execute(READ_SETTINGS, &[&req.project, &claims, &plan.role])
        .await
        .map_err(db)?;
    if plan.bypass {
        client.execute(OWN_SETTINGS, &[]).await.map_err(db)?;
    }
    let shown: Vec<&Col> = plan.shown.iter().map(|&i| &plan.cols[i]).collect();
    let sql = match plan.bypass {
        true => own_select_sql(req.schema, req.table, &plan.cols),
        false => select_sql(req.schema, req.table, &plan.cols, &shown),
    };
    let stream = client
        .query_raw(sql.as_str(), std::iter::empty::<&str>())
        .await
        .map_err(db)?;
    pin_mut!(stream);
    let (max_rows, max_bytes) = (
        req.max_rows.min(MAX_ROWS) as usize,
        req.max_bytes.min(MAX_BYTES) as usize,
    );
    let (mut rows, mut bytes) = (Vec::new(), 0usize);
    while let Some(row) = stream.try_next().await.map_err(db)? {
        let texts: Vec<Option<String>> = row.get(0);
        let triples: Vec<(&str, &str, Option<&str>)> = plan
            .cols
            .iter()
            .zip(&texts)
            .map(|(c, v)| (c.name.as_str(), c.typname.as_str(), v.as_deref()))
            .collect();
        if let Some(f) = &plan.filter {
            if !f.matches(&SliceRecord(&triples)).unwrap_or(false) {
                continue;
            }
        }
        let record: String = match plan.bypass {
            true => record_of(&shown, &plan.cols, &texts),
            false => row.get(1),
        };
        bytes += record.len();
        rows.push(record);
        if rows.len() > max_rows || bytes > max_bytes {
            return Err(err(
                AdminErrorKind::TooLarge,
                format!("more than {max_rows} rows or {max_bytes} bytes (SSE_SNAPSHOT_MAX_ROWS, SSE_SNAPSHOT_MAX_BYTES)"),
            ));
        }
    }
    let columns = shown
        .iter()
        .map(|c| ColumnInfo {
            name: c.name.clone(),
            type_name: c.typname.clone(),
        })
        .collect();
    Ok(SnapshotRows {
        snapshot,
        lsn,
        columns,
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_names_stay_quoted() {
        let cols = vec![
            Col {
                name: "id".into(),
                typname: "int4".into(),
                key: true,
            },
            Col {
                name: "x\"; DROP TABLE t; --".into(),
                typname: "bytea".into(),
                key: false,
            },
        ];
        let shown: Vec<&Col> = cols.iter().collect();
        let sql = select_sql("public", "we\"ird", &cols, &shown);
        assert_eq!(
            sql,
            "SELECT ARRAY[t.\"id\"::text, t.\"x\"\"; DROP TABLE t; --\"::text]::text[], \
             (SELECT row_to_json(s) FROM (SELECT t.\"id\", encode(t.\"x\"\"; DROP TABLE t; --\", 'hex') AS \"x\"\"; DROP TABLE t; --\") s)::text \
             FROM \"public\".\"we\"\"ird\" t"
        );
    }
}
