//! The chunk query (pure): the row as JSON `… WHERE <filter> AND (pk…) > (last…) ORDER BY
//! pk… LIMIT n`. Identifiers are quoted, every value is bound as text and cast to its
//! column's type (the type's name as Postgres's `format_type` wrote it): the filter is a
//! parsed `postgres_changes` filter, never an SQL fragment.
//!
//! It runs on walcast's own login, over a tenant's table, so it runs nothing of the
//! tenant's (the session has row security off and an empty `search_path`): a bound value
//! is cast to a domain's base type, never to the domain (whose `CHECK` is the tenant's
//! SQL), and to no type whose input could run the tenant's SQL (a composite, a range or
//! an array over a domain: such a column cannot be filtered on nor be a key); a value
//! of a tenant's type is read by its output function, never through a cast the tenant
//! may have created (`::text`, or to `json` for `to_jsonb`).

use walcast_core::sql::{qualified, quote_ident};
use walcast_protocol::filter::{Condition, Filter, IsValue, Op};

/// A column of the snapshot's table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    /// `pg_type.typname` (the event's column type).
    pub typname: String,
    /// `format_type(atttypid, atttypmod)`.
    pub sql_type: String,
    /// Its type is Postgres's own once domains are looked through: `::text` and
    /// `to_jsonb` run nothing of a tenant's.
    pub plain: bool,
    /// What a bound value may be cast to on walcast's own login: the type (the domain's
    /// base type for a domain) when its input runs nothing of a tenant's; `None` when no
    /// such type stands for it.
    pub cast_type: Option<String>,
}

/// The table as the snapshot reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shape {
    pub schema: String,
    pub table: String,
    pub columns: Vec<Column>,
    /// Primary-key column names, in key order.
    pub pk: Vec<String>,
}

/// Why a chunk query cannot be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueryError {
    #[error("the filter names column {0:?}, which the table does not have")]
    UnknownColumn(String),
    #[error("the table has no primary key")]
    NoPrimaryKey,
    #[error("column {column:?} is of type {ty}, which a snapshot cannot filter on nor key by (a composite, range or array type over a domain)")]
    UnsafeType { column: String, ty: String },
}

/// The two chunk queries: from the start (`$1` the limit, the filter's values after)
/// and after a key (`$1` the limit, `$2` the last key as a JSON array's text, the
/// filter's after), and the filter's values to bind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkQuery {
    pub first: String,
    pub next: String,
    pub filter_params: Vec<String>,
}

impl Shape {
    fn column(&self, name: &str) -> Result<&Column, QueryError> {
        self.columns
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| QueryError::UnknownColumn(name.to_string()))
    }

    /// The row as JSON text, as `to_jsonb(t)` writes it, each value of a tenant's type as
    /// the string its output function writes.
    fn record_sql(&self) -> String {
        let names: Vec<String> = self
            .columns
            .iter()
            .map(|c| quote_literal(&c.name))
            .collect();
        let values: Vec<String> = self
            .columns
            .iter()
            .map(|c| {
                let q = format!("t.{}", quote_ident(&c.name));
                match c.plain {
                    true => format!("pg_catalog.to_jsonb({q})"),
                    false => format!("pg_catalog.to_jsonb({})", output_text(&q)),
                }
            })
            .collect();
        format!(
            "(SELECT pg_catalog.jsonb_object_agg(x.k, x.v) FROM unnest(ARRAY[{}]::text[], ARRAY[{}]::jsonb[]) AS x(k, v))::text",
            names.join(", "),
            values.join(", ")
        )
    }
}

impl Column {
    /// [`Column::cast_type`], or why there is none.
    fn cast(&self) -> Result<&str, QueryError> {
        self.cast_type
            .as_deref()
            .ok_or_else(|| QueryError::UnsafeType {
                column: self.name.clone(),
                ty: self.sql_type.clone(),
            })
    }

    /// The column's value as text (`t."c"`), by a cast of Postgres's own or the output
    /// function.
    fn text(&self, q: &str) -> String {
        match self.plain {
            true => format!("{q}::text"),
            false => output_text(q),
        }
    }
}

/// A value's text by its type's output function (`NULL` stays NULL).
fn output_text(q: &str) -> String {
    format!("CASE WHEN {q} IS NULL THEN NULL ELSE pg_catalog.format('%s', {q}) END")
}

fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The chunk queries of `shape` under `filter`.
pub fn chunk_query(shape: &Shape, filter: &Filter) -> Result<ChunkQuery, QueryError> {
    if shape.pk.is_empty() {
        return Err(QueryError::NoPrimaryKey);
    }
    let mut key_cols = Vec::new();
    let mut last = Vec::new();
    for (i, name) in shape.pk.iter().enumerate() {
        let c = shape.column(name)?;
        key_cols.push(format!("t.{}", quote_ident(name)));
        last.push(format!("(($2::text::jsonb)->>{i})::{}", c.cast()?));
    }
    let key = key_cols.join(", ");
    let build = |first_param: usize, after: Option<String>| {
        let mut params = Vec::new();
        let mut conds: Vec<String> = Vec::new();
        for c in &filter.conditions {
            conds.push(condition(shape, c, first_param, &mut params)?);
        }
        conds.extend(after);
        let filter_sql = match conds.is_empty() {
            true => "true".to_string(),
            false => conds.join(" AND "),
        };
        let sql = format!(
            "SELECT {} FROM {} AS t WHERE {filter_sql} ORDER BY {key} LIMIT $1",
            shape.record_sql(),
            qualified(&shape.schema, &shape.table)
        );
        Ok::<_, QueryError>((sql, params))
    };
    let (first, filter_params) = build(2, None)?;
    let after = format!("({key}) > ({})", last.join(", "));
    let (next, _) = build(3, Some(after))?;
    Ok(ChunkQuery {
        first,
        next,
        filter_params,
    })
}

/// One condition as SQL, its values pushed to `params` (numbered from `base`).
fn condition(
    shape: &Shape,
    c: &Condition,
    base: usize,
    params: &mut Vec<String>,
) -> Result<String, QueryError> {
    let col = shape.column(&c.column)?;
    let name = format!("t.{}", quote_ident(&col.name));
    let needs_cast = !matches!(
        &c.op,
        Op::Like(_) | Op::Ilike(_) | Op::Match(_) | Op::Imatch(_) | Op::Is(_)
    );
    let cast = match needs_cast {
        true => col.cast()?.to_string(),
        false => String::new(),
    };
    let mut bind = |v: &str| {
        params.push(v.to_string());
        format!("CAST(${}::text AS {cast})", base + params.len() - 1)
    };
    let sql = match &c.op {
        Op::Eq(v) => format!("{name} = {}", bind(v)),
        Op::Neq(v) => format!("{name} <> {}", bind(v)),
        Op::Lt(v) => format!("{name} < {}", bind(v)),
        Op::Lte(v) => format!("{name} <= {}", bind(v)),
        Op::Gt(v) => format!("{name} > {}", bind(v)),
        Op::Gte(v) => format!("{name} >= {}", bind(v)),
        Op::IsDistinct(v) => format!("{name} IS DISTINCT FROM {}", bind(v)),
        Op::In(vs) => {
            let list: Vec<String> = vs.iter().map(|v| bind(v)).collect();
            match list.is_empty() {
                true => "false".to_string(),
                false => format!("{name} IN ({})", list.join(", ")),
            }
        }
        Op::Like(p) | Op::Ilike(p) | Op::Match(p) | Op::Imatch(p) => {
            let op = match &c.op {
                Op::Like(_) => "LIKE",
                Op::Ilike(_) => "ILIKE",
                Op::Match(_) => "~",
                _ => "~*",
            };
            let p = match &c.op {
                Op::Like(_) | Op::Ilike(_) => p.replace('*', "%"),
                _ => p.clone(),
            };
            params.push(p);
            format!(
                "{} {op} ${}::text",
                col.text(&name),
                base + params.len() - 1
            )
        }
        Op::Is(v) => {
            let what = match v {
                IsValue::Null => "NULL",
                IsValue::True => "TRUE",
                IsValue::False => "FALSE",
                IsValue::Unknown => "UNKNOWN",
            };
            format!("{name} IS {what}")
        }
    };
    Ok(match c.negated {
        true => format!("NOT ({sql})"),
        false => format!("({sql})"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        let col = |n: &str, t: &str, s: &str| Column {
            name: n.into(),
            typname: t.into(),
            sql_type: s.into(),
            plain: true,
            cast_type: Some(s.into()),
        };
        Shape {
            schema: "public".into(),
            table: "My Items".into(),
            columns: vec![
                col("id", "int8", "bigint"),
                col("k", "text", "text"),
                col("v", "text", "text"),
            ],
            pk: vec!["id".into(), "k".into()],
        }
    }

    #[test]
    fn keys_and_names_are_quoted_and_values_bound() {
        let f = Filter::parse(r#"v=eq.'; DROP TABLE x; --,id=in.(1,2),k=not.like.a*"#);
        let f = f.unwrap();
        let q = chunk_query(&shape(), &f).unwrap();
        assert_eq!(
            q.first,
            r#"SELECT (SELECT pg_catalog.jsonb_object_agg(x.k, x.v) FROM unnest(ARRAY['id', 'k', 'v']::text[], ARRAY[pg_catalog.to_jsonb(t."id"), pg_catalog.to_jsonb(t."k"), pg_catalog.to_jsonb(t."v")]::jsonb[]) AS x(k, v))::text FROM "public"."My Items" AS t WHERE (t."v" = CAST($2::text AS text)) AND (t."id" IN (CAST($3::text AS bigint), CAST($4::text AS bigint))) AND NOT (t."k"::text LIKE $5::text) ORDER BY t."id", t."k" LIMIT $1"#
        );
        assert_eq!(q.filter_params, ["'; DROP TABLE x; --", "1", "2", "a%"]);
        assert!(q.next.contains(
            r#"(t."id", t."k") > ((($2::text::jsonb)->>0)::bigint, (($2::text::jsonb)->>1)::text) ORDER BY"#
        ));
        assert!(q.next.contains("CAST($3::text AS text)"), "{}", q.next);
        assert!(!q.first.contains("DROP"));
    }

    #[test]
    fn no_filter_no_key_unknown_columns() {
        let q = chunk_query(&shape(), &Filter::default()).unwrap();
        assert!(q.first.contains("WHERE true ORDER BY"));
        let f = Filter::parse("nope=eq.1").unwrap();
        assert_eq!(
            chunk_query(&shape(), &f),
            Err(QueryError::UnknownColumn("nope".into()))
        );
        let mut s = shape();
        s.pk.clear();
        assert_eq!(
            chunk_query(&s, &Filter::default()),
            Err(QueryError::NoPrimaryKey)
        );
        let f = Filter::parse("k=is.null").unwrap();
        assert!(chunk_query(&shape(), &f)
            .unwrap()
            .first
            .contains(r#"(t."k" IS NULL)"#));
    }

    #[test]
    fn a_tenants_type_is_never_cast_to() {
        let mut s = shape();
        // A domain over text: values cast to its base type, read by its output function.
        s.columns[2] = Column {
            name: "v".into(),
            typname: "tag".into(),
            sql_type: "b.tag".into(),
            plain: true,
            cast_type: Some("text".into()),
        };
        s.columns.push(Column {
            name: "c".into(),
            typname: "pair".into(),
            sql_type: "b.pair".into(),
            plain: false,
            cast_type: None,
        });
        let q = chunk_query(&s, &Filter::parse("v=eq.x,c=like.a*").unwrap()).unwrap();
        assert!(
            !q.first.contains("b.tag") && !q.first.contains("b.pair"),
            "{}",
            q.first
        );
        assert!(q.first.contains(r#"CAST($2::text AS text)"#), "{}", q.first);
        assert!(
            q.first.contains(r#"pg_catalog.to_jsonb(CASE WHEN t."c" IS NULL THEN NULL ELSE pg_catalog.format('%s', t."c") END)"#),
            "{}",
            q.first
        );
        assert!(
            q.first.contains(r#"(CASE WHEN t."c" IS NULL THEN NULL ELSE pg_catalog.format('%s', t."c") END LIKE $3::text)"#),
            "{}",
            q.first
        );
        let e = chunk_query(&s, &Filter::parse("c=eq.(1,2)").unwrap()).unwrap_err();
        assert!(matches!(e, QueryError::UnsafeType { .. }), "{e}");
        s.pk = vec!["c".into()];
        let e = chunk_query(&s, &Filter::default()).unwrap_err();
        assert!(matches!(e, QueryError::UnsafeType { .. }), "{e}");
    }
}
