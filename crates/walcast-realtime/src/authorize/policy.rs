//! Which versions of a row a role may see, decided from the table's row-level-security
//! policies as the catalog describes them (pure: the facts are read in `authorize/rls.rs`).
//!
//! The rules are Postgres's own for a `SELECT`:
//! - RLS disabled on the table, a superuser or `BYPASSRLS` role, or a role with the
//!   privileges of the table's owner (unless `FORCE ROW LEVEL SECURITY`): every row;
//! - otherwise the policies for `SELECT` or `ALL` whose roles include `PUBLIC` or a role
//!   whose privileges the subscriber's role has: the permissive ones' `USING` expressions
//!   OR-ed, the restrictive ones' AND-ed on top; no permissive policy, no row. A policy
//!   without `USING` adds nothing (as in Postgres).
//!
//! The resulting condition is evaluated on each version's own values (see
//! `own_values_sql` in `authorize/sql.rs`), so it needs the columns its policies read: a
//! version that lacks one of them cannot be judged that way (see [`judged_by`]).

use std::collections::HashSet;
use std::sync::Arc;

use walcast_core::sql::quote_ident;

pub use crate::catalog::facts::ColumnFact;

/// One policy of the table that applies to the role for `SELECT`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyFact {
    pub name: String,
    pub permissive: bool,
    /// `pg_get_expr(polqual, polrelid)`, read with an empty `search_path`; `None` when
    /// the policy has no `USING` expression.
    pub using: Option<String>,
    /// The table's columns its expressions read (`pg_depend`), in table order.
    pub columns: Vec<ColumnFact>,
}

/// What a role's `SELECT` on a table is subject to, read at check time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoleTableFacts {
    /// `relrowsecurity`.
    pub enabled: bool,
    /// `relforcerowsecurity`.
    pub forced: bool,
    /// Superuser or `BYPASSRLS`.
    pub bypass: bool,
    /// Has the privileges of the table's owner.
    pub owner: bool,
    /// The applicable policies, by name.
    pub policies: Vec<PolicyFact>,
}

/// Which versions a role may see.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Every version (row-level security does not apply to this role).
    All,
    /// None (no permissive policy applies, or the role does not exist).
    Nothing,
    /// The versions for which the condition holds.
    Where(Arc<Predicate>),
}

/// A condition over one version of a row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Predicate {
    /// SQL over the table's columns, unqualified or qualified by the table's own name
    /// (as `pg_get_expr` prints them).
    pub condition: String,
    /// The columns it reads, bound in this order (never empty: with none read, the
    /// table's first column, so that there is something to bind).
    pub columns: Vec<ColumnFact>,
}

/// The rule for one role on one table. `all` is every column of the table, in order
/// (what a policy that reads the whole row needs).
pub fn rule(table: &str, all: &[ColumnFact], facts: &RoleTableFacts) -> Rule {
    if !facts.enabled || facts.bypass || (facts.owner && !facts.forced) {
        return Rule::All;
    }
    let with_using = |permissive: bool| {
        facts
            .policies
            .iter()
            .filter(move |p| p.permissive == permissive)
            .filter_map(|p| p.using.as_deref().map(|u| (p, u)))
    };
    let permissive: Vec<_> = with_using(true).collect();
    if permissive.is_empty() {
        return Rule::Nothing;
    }
    let restrictive: Vec<_> = with_using(false).collect();
    let any_of: Vec<String> = permissive.iter().map(|(_, u)| format!("({u})")).collect();
    let mut all_of: Vec<String> = restrictive.iter().map(|(_, u)| format!("({u})")).collect();
    all_of.push(format!("({})", any_of.join(" OR ")));

    let used = permissive.iter().chain(&restrictive);
    let whole_row = used.clone().any(|(_, u)| reads_whole_row(u, table));
    let mut columns: Vec<ColumnFact> = if whole_row {
        all.to_vec()
    } else {
        let read: Vec<&ColumnFact> = used.flat_map(|(p, _)| &p.columns).collect();
        in_table_order(all, read)
    };
    if columns.is_empty() {
        columns.extend(all.first().cloned());
    }
    Rule::Where(Arc::new(Predicate {
        condition: all_of.join(" AND "),
        columns,
    }))
}

/// The columns read, once each: those of the table in its order, then any the table
/// facts do not know yet (read after a column was added).
fn in_table_order(all: &[ColumnFact], read: Vec<&ColumnFact>) -> Vec<ColumnFact> {
    let names: HashSet<&str> = read.iter().map(|c| c.name.as_str()).collect();
    let mut out: Vec<ColumnFact> = all
        .iter()
        .filter(|c| names.contains(c.name.as_str()))
        .cloned()
        .collect();
    for c in read {
        if !out.iter().any(|o| o.name == c.name) {
            out.push(c.clone());
        }
    }
    out
}

/// Does an expression printed by `pg_get_expr` use the whole row? A whole-row
/// reference prints as `<table>.*` (quoted when the name needs it); `pg_depend` does
/// not list it. Erring on the side of "yes" only binds more columns.
pub fn reads_whole_row(expr: &str, table: &str) -> bool {
    expr.contains(&format!("{}.*", quote_ident(table))) || expr.contains(&format!("{table}.*"))
}

/// How a version is judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JudgedBy {
    /// The predicate evaluated on the version's own values.
    OwnValues,
    /// The row's current state (the version lacks a value the predicate reads).
    CurrentRow,
}

/// A version (its columns as Postgres text, `None` = NULL; a column not listed is not in
/// the change) can be judged by its own values when it carries every column the
/// predicate reads, none of them a NULL that may stand for NaN or ±Infinity. A column
/// is missing from a change when wal2json left out an unchanged TOASTed value (UPDATE,
/// `REPLICA IDENTITY` other than `FULL`) or when the column was added after the change.
pub fn judged_by(predicate: &Predicate, version: &[(String, Option<String>)]) -> JudgedBy {
    let complete =
        predicate
            .columns
            .iter()
            .all(|c| match version.iter().find(|(name, _)| *name == c.name) {
                None => false,
                Some((_, None)) => !c.nan_as_null,
                Some((_, Some(_))) => true,
            });
    if complete {
        JudgedBy::OwnValues
    } else {
        JudgedBy::CurrentRow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(name: &str, ty: &str) -> ColumnFact {
        ColumnFact {
            name: name.into(),
            ty: ty.into(),
            nan_as_null: ty == "numeric" || ty == "double precision",
        }
    }

    fn table() -> Vec<ColumnFact> {
        vec![
            col("id", "integer"),
            col("owner", "uuid"),
            col("status", "text"),
            col("score", "double precision"),
        ]
    }

    fn policy(name: &str, permissive: bool, using: &str, cols: &[&str]) -> PolicyFact {
        PolicyFact {
            name: name.into(),
            permissive,
            using: Some(using.into()),
            columns: table()
                .into_iter()
                .filter(|c| cols.contains(&c.name.as_str()))
                .collect(),
        }
    }

    fn facts(policies: Vec<PolicyFact>) -> RoleTableFacts {
        RoleTableFacts {
            enabled: true,
            policies,
            ..RoleTableFacts::default()
        }
    }

    fn predicate(r: Rule) -> Predicate {
        match r {
            Rule::Where(p) => (*p).clone(),
            other => panic!("expected a predicate, got {other:?}"),
        }
    }

    #[test]
    fn exempt_roles_see_every_version() {
        let base = facts(vec![policy("p", true, "false", &[])]);
        let cases = [
            RoleTableFacts {
                enabled: false,
                ..base.clone()
            },
            RoleTableFacts {
                bypass: true,
                ..base.clone()
            },
            RoleTableFacts {
                owner: true,
                ..base.clone()
            },
        ];
        for f in cases {
            assert_eq!(rule("t", &table(), &f), Rule::All, "{f:?}");
        }
        // FORCE ROW LEVEL SECURITY: the owner is subject to the policies too.
        let forced = RoleTableFacts {
            owner: true,
            forced: true,
            ..base
        };
        assert_eq!(
            predicate(rule("t", &table(), &forced)).condition,
            "((false))"
        );
    }

    #[test]
    fn no_permissive_policy_means_nothing() {
        assert_eq!(rule("t", &table(), &facts(vec![])), Rule::Nothing);
        let only_restrictive = facts(vec![policy("r", false, "true", &[])]);
        assert_eq!(rule("t", &table(), &only_restrictive), Rule::Nothing);
        // A policy without USING (only WITH CHECK) grants nothing for SELECT.
        let no_using = facts(vec![PolicyFact {
            name: "w".into(),
            permissive: true,
            using: None,
            columns: vec![],
        }]);
        assert_eq!(rule("t", &table(), &no_using), Rule::Nothing);
    }

    #[test]
    fn permissive_or_ed_restrictive_and_ed() {
        let f = facts(vec![
            policy("a", true, "owner = auth.uid()", &["owner"]),
            policy("b", false, "status <> 'hidden'::text", &["status"]),
            policy("c", true, "status = 'public'::text", &["status"]),
            policy("d", false, "id > 0", &["id"]),
        ]);
        let p = predicate(rule("t", &table(), &f));
        assert_eq!(
            p.condition,
            "(status <> 'hidden'::text) AND (id > 0) AND \
             ((owner = auth.uid()) OR (status = 'public'::text))"
        );
        let names: Vec<&str> = p.columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["id", "owner", "status"], "table order, once each");
    }

    #[test]
    fn a_policy_on_the_whole_row_needs_every_column() {
        let f = facts(vec![policy("w", true, "public.ok(t.*)", &[])]);
        assert_eq!(predicate(rule("t", &table(), &f)).columns, table());
        let quoted = facts(vec![policy("w", true, "public.ok(\"My T\".*)", &[])]);
        assert_eq!(predicate(rule("My T", &table(), &quoted)).columns, table());
        assert!(!reads_whole_row("t.owner = x", "t"));
    }

    #[test]
    fn a_condition_reading_no_column_still_binds_one() {
        let f = facts(vec![policy("p", true, "auth.role() = 'x'::text", &[])]);
        let p = predicate(rule("t", &table(), &f));
        assert_eq!(p.columns, vec![col("id", "integer")]);
    }

    #[test]
    fn a_column_unknown_to_the_table_facts_is_kept() {
        let mut p = policy("p", true, "added = 1", &[]);
        p.columns.push(col("added", "integer"));
        let got = predicate(rule("t", &table(), &facts(vec![p])));
        assert_eq!(got.columns, vec![col("added", "integer")]);
    }

    #[test]
    fn versions_lacking_a_read_column_are_judged_by_the_current_row() {
        let p = Predicate {
            condition: "x".into(),
            columns: vec![col("owner", "uuid"), col("score", "double precision")],
        };
        let v = |cols: &[(&str, Option<&str>)]| -> Vec<(String, Option<String>)> {
            cols.iter()
                .map(|(n, v)| (n.to_string(), v.map(str::to_string)))
                .collect()
        };
        let full = v(&[("owner", Some("u")), ("score", Some("1.5")), ("body", None)]);
        assert_eq!(judged_by(&p, &full), JudgedBy::OwnValues);
        // A NULL owner is a value; a NULL score may be NaN written as null.
        let null_owner = v(&[("owner", None), ("score", Some("1"))]);
        assert_eq!(judged_by(&p, &null_owner), JudgedBy::OwnValues);
        let null_score = v(&[("owner", Some("u")), ("score", None)]);
        assert_eq!(judged_by(&p, &null_score), JudgedBy::CurrentRow);
        // Unchanged TOAST left out of the change.
        let missing = v(&[("score", Some("2"))]);
        assert_eq!(judged_by(&p, &missing), JudgedBy::CurrentRow);
    }
}
