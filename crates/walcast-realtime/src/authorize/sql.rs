//! The SQL of a batched row-level-security check, built from catalog facts only.
//!
//! Identifiers are quoted; type names are `format_type()` output and policy conditions
//! `pg_get_expr()` output, both read from the catalog (valid SQL written by the
//! database's owners, never a subscriber's input); every value is a bound parameter (one
//! `text[]` per column, rows side by side, numbered by `WITH ORDINALITY`). Each statement
//! returns the 1-based positions of the rows that pass.

use walcast_core::sql::{qualified, quote_ident};

/// A column as the catalog describes it: name and `format_type()`.
pub use crate::catalog::facts::CatalogColumn;

/// `unnest($1::text[], …) WITH ORDINALITY AS k(c1, …, i)` for `n` columns.
fn unnest(n: usize) -> String {
    let arrays: Vec<String> = (1..=n).map(|j| format!("${j}::text[]")).collect();
    let names: Vec<String> = (1..=n).map(|j| format!("c{j}")).collect();
    format!(
        "unnest({}) WITH ORDINALITY AS k({}, i)",
        arrays.join(", "),
        names.join(", ")
    )
}

/// `t."pk" = k.cN::type AND …` for the key columns, `key[j]` being the position (0-based)
/// of key column j among the bound arrays.
fn key_match(pk: &[CatalogColumn], key: &[usize]) -> String {
    pk.iter()
        .zip(key)
        .map(|((name, ty), j)| format!("t.{} = k.c{}::{}", quote_ident(name), j + 1, ty))
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// Which versions satisfy `condition` (policy expressions over the table's columns, see
/// [`crate::authorize::policy::Predicate`]) evaluated on their own values, as the current role
/// with the current claims. Arrays: `columns` in order, non-empty.
///
/// The condition is evaluated in a scope where only the version exists: a derived table
/// named like the table itself, whose columns are the bound values cast to the column
/// types. So a column name resolves to the version's value whether the condition writes
/// it bare or qualified by the table's name (as `pg_get_expr` does inside subqueries),
/// `<table>.*` is the version as a record, and the names of the bound arrays (`k.c1`…)
/// cannot collide with the table's. The derived table is flattened by the planner: a
/// version costs the evaluation of its condition, no table access. Anything else the
/// condition reads (other tables, functions) is read as it is when the check runs.
pub fn own_values_sql(table: &str, columns: &[CatalogColumn], condition: &str) -> String {
    let values: Vec<String> = columns
        .iter()
        .enumerate()
        .map(|(j, (name, ty))| format!("k.c{}::{} AS {}", j + 1, ty, quote_ident(name)))
        .collect();
    format!(
        "SELECT k.i FROM {} CROSS JOIN LATERAL (SELECT FROM (SELECT {}) AS {} WHERE {}) AS v",
        unnest(columns.len()),
        values.join(", "),
        quote_ident(table),
        condition
    )
}

/// Which rows exist by primary key for the current role and claims: row-level security
/// applies to `t`, so this is "would a `SELECT` of that row return it". Arrays: the key
/// columns in key order.
pub fn visible_sql(schema: &str, table: &str, pk: &[CatalogColumn]) -> String {
    let key: Vec<usize> = (0..pk.len()).collect();
    format!(
        "SELECT k.i FROM {} WHERE EXISTS (SELECT 1 FROM {} t WHERE {})",
        unnest(pk.len()),
        qualified(schema, table),
        key_match(pk, &key)
    )
}

/// Whether a type name (`format_type()` read with an empty `search_path`) is one of
/// Postgres's own (`pg_catalog`): every other type is written schema-qualified, so its
/// name has a `.` outside double quotes. Only Postgres's own types are cast to on
/// walcast's own connection: a cast to a tenant's type can run the tenant's SQL (a
/// domain's `CHECK`, or the domain inside an array, a range or a composite type).
pub fn is_builtin_type(ty: &str) -> bool {
    let mut quoted = false;
    for c in ty.chars() {
        match c {
            '"' => quoted = !quoted,
            '.' if !quoted => return false,
            _ => {}
        }
    }
    true
}

/// A column's value as text, without running any SQL a tenant wrote: a cast of
/// Postgres's own type (`::text`), and for a tenant's type its output function
/// (`format('%s', …)`; a `CREATE CAST … AS text` of the tenant's would be its SQL).
fn text_of(column: &str, ty: &str) -> String {
    match is_builtin_type(ty) {
        true => format!("{column}::text"),
        false => format!(
            "CASE WHEN {column} IS NULL THEN NULL ELSE pg_catalog.format('%s', {column}) END"
        ),
    }
}

/// Which rows still hold exactly the values of the change (compared through each type's
/// text form, so every type works, with or without an equality operator). Run as
/// walcast's own login (the check login may read no table), in the same snapshot as the
/// checks (imported from the check connection) and with `row_security = off`: a change
/// whose row has changed since is not judged by the newer row. Nothing a tenant wrote
/// runs here: no policy (row security off), no cast to a tenant's type (such a column
/// is compared by its output text, exactly what wal2json sent, key columns included),
/// and, with an empty `search_path`, no operator but Postgres's own. Arrays: `columns`
/// in order; every key column must be among them (`None` otherwise).
pub fn current_sql(
    schema: &str,
    table: &str,
    pk: &[CatalogColumn],
    columns: &[CatalogColumn],
) -> Option<String> {
    let key: Vec<usize> = pk
        .iter()
        .map(|(name, _)| columns.iter().position(|(c, _)| c == name))
        .collect::<Option<_>>()?;
    let mut conds = Vec::with_capacity(columns.len());
    for ((name, ty), j) in pk.iter().zip(&key) {
        let col = format!("t.{}", quote_ident(name));
        conds.push(match is_builtin_type(ty) {
            true => format!("{col} = k.c{}::{ty}", j + 1),
            false => format!("{} = k.c{}", text_of(&col, ty), j + 1),
        });
    }
    for (j, (name, ty)) in columns.iter().enumerate() {
        if pk.iter().any(|(p, _)| p == name) {
            continue;
        }
        let col = format!("t.{}", quote_ident(name));
        let value = match is_builtin_type(ty) {
            true => format!("k.c{}::{ty}::text", j + 1),
            false => format!("k.c{}", j + 1),
        };
        conds.push(format!(
            "{} IS NOT DISTINCT FROM {value}",
            text_of(&col, ty)
        ));
    }
    Some(format!(
        "SELECT k.i FROM {} WHERE EXISTS (SELECT 1 FROM {} t WHERE {})",
        unnest(columns.len()),
        qualified(schema, table),
        conds.join(" AND ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(n: &str, t: &str) -> CatalogColumn {
        (n.to_string(), t.to_string())
    }

    #[test]
    fn visible_binds_every_key_column() {
        let sql = visible_sql("public", "msgs", &[col("a", "integer"), col("b", "text")]);
        assert_eq!(
            sql,
            "SELECT k.i FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS k(c1, c2, i) \
             WHERE EXISTS (SELECT 1 FROM \"public\".\"msgs\" t WHERE t.\"a\" = k.c1::integer AND t.\"b\" = k.c2::text)"
        );
    }

    #[test]
    fn current_compares_non_key_columns_by_text() {
        let sql = current_sql(
            "s",
            "t",
            &[col("id", "bigint")],
            &[col("body", "jsonb"), col("id", "bigint")],
        )
        .unwrap_or_default();
        assert!(sql.contains("t.\"id\" = k.c2::bigint"), "{sql}");
        assert!(
            sql.contains("t.\"body\"::text IS NOT DISTINCT FROM k.c1::jsonb::text"),
            "{sql}"
        );
        assert!(!sql.contains("t.\"id\"::text"), "{sql}");
    }

    #[test]
    fn current_casts_to_no_tenant_type() {
        let sql = current_sql(
            "s",
            "t",
            &[col("id", "b.\"my.id\"")],
            &[
                col("id", "b.\"my.id\""),
                col("v", "b.pin"),
                col("n", "\"a.b\""),
            ],
        )
        .unwrap_or_default();
        assert!(!sql.contains("::b."), "{sql}");
        assert!(
            sql.contains("pg_catalog.format('%s', t.\"id\") END = k.c1"),
            "{sql}"
        );
        assert!(
            sql.contains("pg_catalog.format('%s', t.\"v\") END IS NOT DISTINCT FROM k.c2"),
            "{sql}"
        );
        assert!(is_builtin_type("\"a.b\""));
        assert!(is_builtin_type("character varying(10)[]"));
        assert!(!is_builtin_type("public.mood"));
    }

    #[test]
    fn current_needs_the_key() {
        assert_eq!(
            current_sql("s", "t", &[col("id", "int")], &[col("x", "int")]),
            None
        );
    }

    #[test]
    fn own_values_scope_the_condition_to_the_version() {
        let sql = own_values_sql(
            "msgs",
            &[col("owner", "uuid"), col("status", "text")],
            "((owner = auth.uid()) OR (msgs.status = 'public'::text))",
        );
        assert_eq!(
            sql,
            "SELECT k.i FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS k(c1, c2, i) \
             CROSS JOIN LATERAL (SELECT FROM (SELECT k.c1::uuid AS \"owner\", k.c2::text AS \"status\") \
             AS \"msgs\" WHERE ((owner = auth.uid()) OR (msgs.status = 'public'::text))) AS v"
        );
        let hostile = own_values_sql("t\"x", &[col("a\"b", "int")], "true");
        assert!(
            hostile.contains("k.c1::int AS \"a\"\"b\") AS \"t\"\"x\""),
            "{hostile}"
        );
    }

    #[test]
    fn hostile_names_stay_quoted() {
        let sql = visible_sql("a\"; drop table x; --", "t", &[col("i\"d", "integer")]);
        assert!(sql.contains("\"a\"\"; drop table x; --\".\"t\""), "{sql}");
        assert!(sql.contains("t.\"i\"\"d\""), "{sql}");
    }
}
