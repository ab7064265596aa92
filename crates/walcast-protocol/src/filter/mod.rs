//! `postgres_changes` `filter` strings: PostgREST-style grammar, AST, validation against a
//! table's column types, and evaluation on a record.
//!
//! Grammar: conditions separated by commas (AND); a comma inside `(…)` or `"…"` does not
//! split. Each condition is `column=[not.]op.value` with `op` one of `eq neq lt lte gt gte in
//! like ilike match imatch is isdistinct`. Values may be double-quoted with backslash escapes
//! (`"a,b"`, `"say \"hi\""`); `in` takes `(v1,v2,…)` (at most [`MAX_IN_VALUES`]); `is` takes
//! `null`/`true`/`false`/`unknown`. An empty filter matches everything. Patterns have at
//! most [`MAX_PATTERN_BYTES`] bytes; a [`CompiledFilter`] compiles them once, to automata
//! that match in time linear in the value (no backtracking).

mod cast;
mod eval;
mod like;
mod numeric;
mod parse;
mod pattern;

use std::fmt;

pub use eval::{ColumnText, CompiledFilter, EvalError, RecordView, SliceRecord};
pub use parse::FilterError;
pub use pattern::{Pattern, MAX_PATTERN_AUTOMATON, PATTERN_CACHE_BYTES};

/// Maximum number of values of an `in.(…)` list.
pub const MAX_IN_VALUES: usize = 100;

/// Longest `like`/`ilike`/`match`/`imatch` pattern, in bytes: with patterns compiled
/// once to linear-time automata ([`CompiledFilter`]), this bounds the work per row and
/// byte of value.
pub const MAX_PATTERN_BYTES: usize = 1024;

/// A parsed filter: a conjunction of conditions (empty = always true).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Filter {
    /// Conditions, all of which must hold.
    pub conditions: Vec<Condition>,
}

/// One `column=[not.]op.value` condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// Column name.
    pub column: String,
    /// `not.` prefix.
    pub negated: bool,
    /// Operator and operand(s), already unquoted.
    pub op: Op,
}

/// Operator with its operand(s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `=`
    Eq(String),
    /// `<>`
    Neq(String),
    /// `<`
    Lt(String),
    /// `<=`
    Lte(String),
    /// `>`
    Gt(String),
    /// `>=`
    Gte(String),
    /// `= ANY(…)`
    In(Vec<String>),
    /// `LIKE` (`%`, `_`, `\` escape; `*` is an alias of `%` as in PostgREST).
    Like(String),
    /// `ILIKE`
    Ilike(String),
    /// `~` (POSIX regex, unanchored)
    Match(String),
    /// `~*`
    Imatch(String),
    /// `IS NULL / TRUE / FALSE / UNKNOWN`
    Is(IsValue),
    /// `IS DISTINCT FROM`
    IsDistinct(String),
}

/// Operand of `is`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsValue {
    /// `null`
    Null,
    /// `true`
    True,
    /// `false`
    False,
    /// `unknown` (a NULL boolean)
    Unknown,
}

impl Op {
    /// The PostgREST operator name.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Eq(_) => "eq",
            Op::Neq(_) => "neq",
            Op::Lt(_) => "lt",
            Op::Lte(_) => "lte",
            Op::Gt(_) => "gt",
            Op::Gte(_) => "gte",
            Op::In(_) => "in",
            Op::Like(_) => "like",
            Op::Ilike(_) => "ilike",
            Op::Match(_) => "match",
            Op::Imatch(_) => "imatch",
            Op::Is(_) => "is",
            Op::IsDistinct(_) => "isdistinct",
        }
    }
}

impl IsValue {
    fn as_str(self) -> &'static str {
        match self {
            IsValue::Null => "null",
            IsValue::True => "true",
            IsValue::False => "false",
            IsValue::Unknown => "unknown",
        }
    }
}

/// Whether a value must be quoted to survive a parse.
fn needs_quotes(v: &str) -> bool {
    v.is_empty()
        || v.starts_with(char::is_whitespace)
        || v.ends_with(char::is_whitespace)
        || v.contains([',', '(', ')', '"', '\\'])
}

fn write_value(f: &mut fmt::Formatter<'_>, v: &str) -> fmt::Result {
    if !needs_quotes(v) {
        return f.write_str(v);
    }
    f.write_str("\"")?;
    for ch in v.chars() {
        if ch == '"' || ch == '\\' {
            f.write_str("\\")?;
        }
        write!(f, "{ch}")?;
    }
    f.write_str("\"")
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}=", self.column)?;
        if self.negated {
            f.write_str("not.")?;
        }
        write!(f, "{}.", self.op.name())?;
        match &self.op {
            Op::Eq(v)
            | Op::Neq(v)
            | Op::Lt(v)
            | Op::Lte(v)
            | Op::Gt(v)
            | Op::Gte(v)
            | Op::Like(v)
            | Op::Ilike(v)
            | Op::Match(v)
            | Op::Imatch(v)
            | Op::IsDistinct(v) => write_value(f, v),
            Op::In(vs) => {
                f.write_str("(")?;
                for (i, v) in vs.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write_value(f, v)?;
                }
                f.write_str(")")
            }
            Op::Is(v) => f.write_str(v.as_str()),
        }
    }
}

/// Canonical text form; parsing it yields an equal [`Filter`].
impl fmt::Display for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, c) in self.conditions.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{c}")?;
        }
        Ok(())
    }
}
