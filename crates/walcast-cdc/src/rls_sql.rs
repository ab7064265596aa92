//! The SQL of a batched row-level-security check, built from catalog facts only.
//!
//! Identifiers are quoted; type names are `format_type()` output read from the catalog
//! (valid SQL, never user input); every value is a bound parameter (one `text[]` per
//! column, rows side by side, numbered by `WITH ORDINALITY`). Each statement returns the
//! 1-based positions of the rows that pass.

use crate::sql::{qualified, quote_ident};

/// A column as the catalog describes it: name and `format_type()`.
pub type CatalogColumn = (String, String);

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

/// Which rows still hold exactly the values of the change (compared through each type's
/// text form, so every type works, with or without an equality operator). Run as the
/// worker in the same snapshot as the checks: a change whose row has changed since is
/// not judged by the newer row. Arrays: `columns` in order; every key column must be
/// among them (`None` otherwise).
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
    let mut cond = key_match(pk, &key);
    for (j, (name, ty)) in columns.iter().enumerate() {
        if pk.iter().any(|(p, _)| p == name) {
            continue;
        }
        cond.push_str(&format!(
            " AND t.{}::text IS NOT DISTINCT FROM k.c{}::{}::text",
            quote_ident(name),
            j + 1,
            ty
        ));
    }
    Some(format!(
        "SELECT k.i FROM {} WHERE EXISTS (SELECT 1 FROM {} t WHERE {})",
        unnest(columns.len()),
        qualified(schema, table),
        cond
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
    fn current_needs_the_key() {
        assert_eq!(
            current_sql("s", "t", &[col("id", "int")], &[col("x", "int")]),
            None
        );
    }

    #[test]
    fn hostile_names_stay_quoted() {
        let sql = visible_sql("a\"; drop table x; --", "t", &[col("i\"d", "integer")]);
        assert!(sql.contains("\"a\"\"; drop table x; --\".\"t\""), "{sql}");
        assert!(sql.contains("t.\"i\"\"d\""), "{sql}");
    }
}
