//! Validation against column types and evaluation on records.
//!
//! Semantics (documented choices):
//! - Operands are cast to the column's type; comparisons follow Postgres: integers and
//!   `numeric` exactly, floats with NaN above everything, text byte-wise (collation "C"),
//!   `bpchar` ignoring trailing spaces, `citext` case-insensitively, `uuid` by value,
//!   `timestamptz` by instant (an operand without offset is UTC), `timestamp`/`date`/`time`
//!   by value, `jsonb`/`json` structurally (equality only), 1-D arrays element-wise. Other
//!   types (enums, `inet`, `interval`, …) compare as text.
//! - SQL NULL makes `eq`/`neq`/`lt`/…/`in`/`like`/`match` unknown, so neither they nor their
//!   `not.` form match; `is.null` and `isdistinct` handle NULL.
//! - `like`/`ilike`/`match`/`imatch` apply to the value's text whatever the column type.
//! - A column missing from the record (e.g. not in a DELETE's replica identity) does not match.

use super::cast::{cast, compare, equal, TypeClass, Typed};
use super::like;
use super::pattern::{self, Pattern};
use super::{Condition, Filter, IsValue, Op};

/// One column of a record: type name and Postgres text value (`None` = SQL NULL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColumnText<'a> {
    /// Postgres `typname` (`int4`, `text`, `_int4`, …).
    pub typname: &'a str,
    /// Value as Postgres text; `None` is SQL NULL.
    pub value: Option<&'a str>,
}

/// A record that filters can be evaluated on.
pub trait RecordView {
    /// The column named `name`, if the record has it.
    fn column(&self, name: &str) -> Option<ColumnText<'_>>;
}

/// A [`RecordView`] over `(name, typname, value)` triples.
#[derive(Debug, Clone, Copy)]
pub struct SliceRecord<'a>(pub &'a [(&'a str, &'a str, Option<&'a str>)]);

impl RecordView for SliceRecord<'_> {
    fn column(&self, name: &str) -> Option<ColumnText<'_>> {
        self.0
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, typname, value)| ColumnText {
                typname,
                value: *value,
            })
    }
}

/// A filter cannot be applied to a table or record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    /// The column does not exist (or the role cannot read it).
    #[error("column `{0}` does not exist")]
    UnknownColumn(String),
    /// An operand (or a record value) does not cast to the column type.
    #[error("{reason} (column `{column}` of type {typname})")]
    InvalidValue {
        /// Column name.
        column: String,
        /// Column type.
        typname: String,
        /// Postgres-like message.
        reason: String,
    },
    /// The operator does not apply to the column type.
    #[error("operator `{op}` is not supported for column `{column}` of type {typname}")]
    UnsupportedOperator {
        /// Operator name.
        op: &'static str,
        /// Column name.
        column: String,
        /// Column type.
        typname: String,
    },
    /// Bad `like` or `match` pattern.
    #[error("invalid pattern for column `{column}`: {reason}")]
    InvalidPattern {
        /// Column name.
        column: String,
        /// What is wrong.
        reason: String,
    },
}

fn invalid(c: &Condition, typname: &str, reason: String) -> EvalError {
    EvalError::InvalidValue {
        column: c.column.clone(),
        typname: typname.to_owned(),
        reason,
    }
}

fn operand<'a>(
    c: &Condition,
    typname: &str,
    class: &TypeClass,
    v: &'a str,
) -> Result<Typed<'a>, EvalError> {
    cast(class, v).map_err(|r| invalid(c, typname, r))
}

fn unsupported(c: &Condition, typname: &str) -> EvalError {
    EvalError::UnsupportedOperator {
        op: c.op.name(),
        column: c.column.clone(),
        typname: typname.to_owned(),
    }
}

/// The automaton of a condition's `like`/`ilike`/`match`/`imatch` pattern (`None` for
/// other operators). The regex crate's automata match in time linear in the text.
fn compile_pattern(c: &Condition) -> Result<Option<Pattern>, EvalError> {
    let compiled = match &c.op {
        Op::Like(p) => like::compile(p, false),
        Op::Ilike(p) => like::compile(p, true),
        Op::Match(p) => pattern::compile(p, false),
        Op::Imatch(p) => pattern::compile(p, true),
        _ => return Ok(None),
    };
    compiled
        .map(Some)
        .map_err(|reason| EvalError::InvalidPattern {
            column: c.column.clone(),
            reason,
        })
}

/// Check one condition against the column type without a record.
fn validate_condition(c: &Condition, typname: &str) -> Result<(), EvalError> {
    let class = TypeClass::of(typname);
    match &c.op {
        Op::Eq(v) | Op::Neq(v) | Op::IsDistinct(v) => operand(c, typname, &class, v).map(|_| ()),
        Op::Lt(v) | Op::Lte(v) | Op::Gt(v) | Op::Gte(v) => {
            if !class.ordered() {
                return Err(unsupported(c, typname));
            }
            operand(c, typname, &class, v).map(|_| ())
        }
        Op::In(vs) => vs
            .iter()
            .try_for_each(|v| operand(c, typname, &class, v).map(|_| ())),
        Op::Like(_) | Op::Ilike(_) | Op::Match(_) | Op::Imatch(_) => compile_pattern(c).map(|_| ()),
        Op::Is(IsValue::Null) => Ok(()),
        Op::Is(_) => {
            if class == TypeClass::Bool {
                Ok(())
            } else {
                Err(unsupported(c, typname))
            }
        }
    }
}

/// Three-valued evaluation: `None` = SQL unknown. `pattern`: the condition's compiled
/// pattern ([`compile_pattern`]).
fn eval_condition(
    c: &Condition,
    pattern: Option<&Pattern>,
    col: ColumnText<'_>,
) -> Result<Option<bool>, EvalError> {
    let typname = col.typname;
    let class = TypeClass::of(typname);
    let value = match (&c.op, col.value) {
        (Op::Is(is), v) => {
            let r = match is {
                IsValue::Null | IsValue::Unknown => v.is_none(),
                IsValue::True | IsValue::False => match v {
                    None => false,
                    Some(t) => match operand(c, typname, &class, t)? {
                        Typed::Bool(b) => b == (*is == IsValue::True),
                        _ => return Err(unsupported(c, typname)),
                    },
                },
            };
            return Ok(Some(r));
        }
        (Op::IsDistinct(_), None) => return Ok(Some(true)),
        (_, None) => return Ok(None),
        (_, Some(v)) => v,
    };
    if let Some(re) = pattern {
        return Ok(Some(re.is_match(value)));
    }
    let lhs = operand(c, typname, &class, value)?;
    let ord = |v: &str| -> Result<std::cmp::Ordering, EvalError> {
        let rhs = operand(c, typname, &class, v)?;
        compare(&lhs, &rhs).ok_or_else(|| unsupported(c, typname))
    };
    let eq =
        |v: &str| -> Result<bool, EvalError> { Ok(equal(&lhs, &operand(c, typname, &class, v)?)) };
    let r = match &c.op {
        Op::Eq(v) => eq(v)?,
        Op::Neq(v) | Op::IsDistinct(v) => !eq(v)?,
        Op::Lt(v) => ord(v)?.is_lt(),
        Op::Lte(v) => ord(v)?.is_le(),
        Op::Gt(v) => ord(v)?.is_gt(),
        Op::Gte(v) => ord(v)?.is_ge(),
        Op::In(vs) => {
            let mut any = false;
            for v in vs {
                if eq(v)? {
                    any = true;
                    break;
                }
            }
            any
        }
        // Patterns were matched above (always compiled), `is` before.
        Op::Like(_) | Op::Ilike(_) | Op::Match(_) | Op::Imatch(_) | Op::Is(_) => false,
    };
    Ok(Some(r))
}

impl Filter {
    /// Check at join time that every column exists (`columns` maps a column name to its
    /// `typname`, `None` = unknown or unreadable) and every operand casts to its type.
    pub fn validate<'c, F>(&self, columns: F) -> Result<(), EvalError>
    where
        F: Fn(&str) -> Option<&'c str>,
    {
        for c in &self.conditions {
            let typname =
                columns(&c.column).ok_or_else(|| EvalError::UnknownColumn(c.column.clone()))?;
            validate_condition(c, typname)?;
        }
        Ok(())
    }

    /// Evaluate on a record (all conditions must hold; SQL NULL semantics). Compiles its
    /// patterns on every call: anything evaluating one filter often uses a
    /// [`CompiledFilter`].
    pub fn matches(&self, record: &impl RecordView) -> Result<bool, EvalError> {
        CompiledFilter::new(self.clone())?.matches(record)
    }

    /// Whether the filter has no condition (matches every record).
    pub fn is_empty(&self) -> bool {
        self.conditions.is_empty()
    }

    /// Names of the columns the filter reads.
    pub fn columns(&self) -> impl Iterator<Item = &str> {
        self.conditions.iter().map(|c| c.column.as_str())
    }
}

/// A filter with its patterns compiled once (at registration), for evaluation on every
/// change: no evaluation compiles anything, and every condition runs in time linear in
/// the value.
#[derive(Debug, Clone)]
pub struct CompiledFilter {
    filter: Filter,
    /// One per condition: its compiled pattern, if it has one.
    patterns: Vec<Option<Pattern>>,
}

impl CompiledFilter {
    /// Compile a filter's patterns; `Err`: a pattern is not valid.
    pub fn new(filter: Filter) -> Result<CompiledFilter, EvalError> {
        let patterns = filter
            .conditions
            .iter()
            .map(compile_pattern)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CompiledFilter { filter, patterns })
    }

    /// The filter it was compiled from.
    pub fn filter(&self) -> &Filter {
        &self.filter
    }

    /// What its compiled patterns hold in memory (see [`Pattern::heap_bytes`]).
    pub fn heap_bytes(&self) -> usize {
        self.patterns
            .iter()
            .flatten()
            .map(Pattern::heap_bytes)
            .sum()
    }

    /// Evaluate on a record, as [`Filter::matches`].
    pub fn matches(&self, record: &impl RecordView) -> Result<bool, EvalError> {
        for (c, pattern) in self.filter.conditions.iter().zip(&self.patterns) {
            let Some(col) = record.column(&c.column) else {
                return Ok(false);
            };
            let r = eval_condition(c, pattern.as_ref(), col)?;
            let r = if c.negated { r.map(|b| !b) } else { r };
            if r != Some(true) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROW: &[(&str, &str, Option<&str>)] = &[
        ("id", "int8", Some("42")),
        ("price", "numeric", Some("19.990")),
        ("score", "float8", Some("NaN")),
        ("name", "text", Some("Alice")),
        ("done", "bool", Some("f")),
        (
            "owner",
            "uuid",
            Some("639f86b1-738b-43ed-bb09-c8d3f3bafa30"),
        ),
        ("at", "timestamptz", Some("2026-11-30 05:26:07.323193+00")),
        ("note", "text", None),
        ("flag", "bool", None),
        ("tags", "_text", Some("{a,b}")),
        ("meta", "jsonb", Some(r#"{"k":1}"#)),
    ];

    fn m(f: &str) -> bool {
        Filter::parse(f)
            .unwrap()
            .matches(&SliceRecord(ROW))
            .unwrap()
    }

    #[test]
    fn comparisons() {
        assert!(m("id=eq.42"));
        assert!(!m("id=eq.41"));
        assert!(m("id=neq.41"));
        assert!(m("id=gt.9"), "numeric, not text, comparison");
        assert!(m("id=lte.42"));
        assert!(m("price=eq.19.99"));
        assert!(m("price=lt.20"));
        assert!(m("score=gt.Infinity"));
        assert!(m("name=eq.Alice"));
        assert!(m("name=lt.a"), "C collation: uppercase before lowercase");
        assert!(m("done=eq.false"));
        assert!(m("owner=eq.639F86B1-738B-43ED-BB09-C8D3F3BAFA30"));
        assert!(m("at=gt.2026-11-30T05:26:07Z"));
        assert!(m("at=eq.2026-11-30 10:56:07.323193+05:30"));
        assert!(m("id=in.(1,42,3)"));
        assert!(!m("id=in.(1,2)"));
        assert!(m("id=not.in.(1,2)"));
        assert!(m(r#"tags=eq."{a,b}""#), "literals with commas are quoted");
        assert!(m("tags=neq.{a}"));
        assert!(m(r#"meta=eq."{\"k\":1.0}""#));
        assert!(m(r#"meta=eq.{"k":1.0}"#));
        assert!(m("id=eq.42,name=like.Al%"));
        assert!(!m("id=eq.42,name=like.al%"));
        assert!(m("name=ilike.al*"));
        assert!(m("name=match.^A.i"));
        assert!(m("name=imatch.ALICE"));
        assert!(m("id=isdistinct.1"));
        assert!(!m("id=isdistinct.42"));
        assert!(!m("missing=eq.1"));
    }

    #[test]
    fn null_semantics() {
        assert!(!m("note=eq.x"));
        assert!(!m("note=neq.x"));
        assert!(!m("note=not.eq.x"));
        assert!(!m("note=in.(x)"));
        assert!(!m("note=not.in.(x)"));
        assert!(!m("note=like.%"));
        assert!(m("note=is.null"));
        assert!(!m("name=is.null"));
        assert!(m("name=not.is.null"));
        assert!(m("note=isdistinct.x"));
        assert!(m("flag=is.unknown"));
        assert!(!m("flag=is.true"));
        assert!(m("flag=not.is.true"));
        assert!(m("done=is.false"));
    }

    #[test]
    fn validation() {
        let cols = |c: &str| ROW.iter().find(|r| r.0 == c).map(|r| r.1);
        let v = |f: &str| Filter::parse(f).unwrap().validate(cols);
        assert_eq!(v("id=eq.1,name=eq.x,at=gte.2020-01-01"), Ok(()));
        assert_eq!(v("nope=eq.1"), Err(EvalError::UnknownColumn("nope".into())));
        let e = v("id=eq.abc").unwrap_err();
        assert!(matches!(e, EvalError::InvalidValue { .. }));
        assert_eq!(
            e.to_string(),
            "invalid input syntax for type integer: \"abc\" (column `id` of type int8)"
        );
        assert!(v("id=in.(1,x)").is_err());
        assert!(v("meta=lt.1").is_err());
        assert!(v("name=is.true").is_err());
        assert!(v("name=like.x\\").is_err());
        assert!(v("name=match.(").is_err());
        assert!(v("owner=eq.not-a-uuid").is_err());
        assert!(v("at=eq.yesterday").is_err());
    }
}
