//! Filter string parser.

use super::{Condition, Filter, IsValue, Op, MAX_IN_VALUES, MAX_PATTERN_BYTES};

/// A filter string could not be parsed. Messages are meant to be shown to users after
/// "Error parsing `filter` params: ".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    /// Two commas in a row, or a leading/trailing comma.
    #[error("empty condition in filter")]
    EmptyCondition,
    /// A condition has no `=`.
    #[error("condition `{0}` must have the form column=operator.value")]
    MissingEquals(String),
    /// The column name is empty.
    #[error("condition `{0}` has an empty column name")]
    EmptyColumn(String),
    /// The operator is not followed by `.value`.
    #[error("condition `{0}` is missing `.value` after the operator")]
    MissingValue(String),
    /// Unknown operator name.
    #[error("unknown operator `{op}` in `{condition}` (expected eq, neq, lt, lte, gt, gte, in, like, ilike, match, imatch, is or isdistinct)")]
    UnknownOperator {
        /// Operator as written.
        op: String,
        /// Whole condition.
        condition: String,
    },
    /// A quoted value has no closing quote.
    #[error("unterminated quoted value in `{0}`")]
    UnterminatedQuote(String),
    /// Characters after a closing quote.
    #[error("unexpected characters after quoted value in `{0}`")]
    TrailingAfterQuote(String),
    /// `in` value is not a parenthesised list.
    #[error("`in` expects a list like in.(a,b,c) in `{0}`")]
    InNotAList(String),
    /// An `in` list item is empty.
    #[error("empty value in `in` list of `{0}`")]
    EmptyInValue(String),
    /// Too many `in` values.
    #[error("`in` accepts at most {MAX_IN_VALUES} values, got {0}")]
    TooManyInValues(usize),
    /// A `like`/`ilike`/`match`/`imatch` pattern is too long.
    #[error("a pattern may have at most {MAX_PATTERN_BYTES} bytes, got {0}")]
    PatternTooLong(usize),
    /// `is` operand other than null/true/false/unknown.
    #[error("`is` expects null, true, false or unknown, got `{0}`")]
    InvalidIsValue(String),
}

/// Split on commas outside parentheses and double quotes (backslash escapes inside quotes).
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth: usize = 0;
    let mut in_quote = false;
    let mut escaped = false;
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        if in_quote {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_quote = false;
            }
            continue;
        }
        match b {
            b'"' => in_quote = true,
            b'(' => depth += 1,
            b')' => depth = depth.saturating_sub(1),
            b',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

/// Read a value: `"quoted"` (unescaped) or verbatim text. `trim` trims unquoted text.
fn read_value(raw: &str, condition: &str, trim: bool) -> Result<(String, bool), FilterError> {
    let t = if trim { raw.trim() } else { raw };
    let Some(rest) = t.strip_prefix('"') else {
        return Ok((t.to_owned(), false));
    };
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.char_indices();
    while let Some((i, ch)) = chars.next() {
        match ch {
            '\\' => match chars.next() {
                Some((_, c)) => out.push(c),
                None => return Err(FilterError::UnterminatedQuote(condition.to_owned())),
            },
            '"' => {
                let after = &rest[i + 1..];
                let after = if trim { after.trim() } else { after };
                if !after.is_empty() {
                    return Err(FilterError::TrailingAfterQuote(condition.to_owned()));
                }
                return Ok((out, true));
            }
            c => out.push(c),
        }
    }
    Err(FilterError::UnterminatedQuote(condition.to_owned()))
}

fn parse_in(value: &str, condition: &str) -> Result<Vec<String>, FilterError> {
    let inner = value
        .trim()
        .strip_prefix('(')
        .and_then(|v| v.strip_suffix(')'))
        .ok_or_else(|| FilterError::InNotAList(condition.to_owned()))?;
    if inner.trim().is_empty() {
        return Ok(Vec::new());
    }
    let items = split_top_level(inner);
    if items.len() > MAX_IN_VALUES {
        return Err(FilterError::TooManyInValues(items.len()));
    }
    items
        .into_iter()
        .map(|item| {
            let (v, quoted) = read_value(item, condition, true)?;
            if v.is_empty() && !quoted {
                return Err(FilterError::EmptyInValue(condition.to_owned()));
            }
            Ok(v)
        })
        .collect()
}

fn parse_condition(cond: &str) -> Result<Condition, FilterError> {
    let (column, rest) = cond
        .split_once('=')
        .ok_or_else(|| FilterError::MissingEquals(cond.to_owned()))?;
    let column = column.trim();
    if column.is_empty() {
        return Err(FilterError::EmptyColumn(cond.to_owned()));
    }
    let (negated, rest) = match rest.get(..4) {
        Some(p) if p.eq_ignore_ascii_case("not.") => (true, &rest[4..]),
        _ => (false, rest),
    };
    let (op_name, value) = rest
        .split_once('.')
        .ok_or_else(|| FilterError::MissingValue(cond.to_owned()))?;
    let one = |v: &str| read_value(v, cond, false).map(|(s, _)| s);
    let pattern = |v: &str| {
        let p = one(v)?;
        match p.len() {
            n if n > MAX_PATTERN_BYTES => Err(FilterError::PatternTooLong(n)),
            _ => Ok(p),
        }
    };
    let op = match op_name.to_ascii_lowercase().as_str() {
        "eq" => Op::Eq(one(value)?),
        "neq" => Op::Neq(one(value)?),
        "lt" => Op::Lt(one(value)?),
        "lte" => Op::Lte(one(value)?),
        "gt" => Op::Gt(one(value)?),
        "gte" => Op::Gte(one(value)?),
        "like" => Op::Like(pattern(value)?),
        "ilike" => Op::Ilike(pattern(value)?),
        "match" => Op::Match(pattern(value)?),
        "imatch" => Op::Imatch(pattern(value)?),
        "isdistinct" => Op::IsDistinct(one(value)?),
        "in" => Op::In(parse_in(value, cond)?),
        "is" => Op::Is(match value.trim().to_ascii_lowercase().as_str() {
            "null" => IsValue::Null,
            "true" => IsValue::True,
            "false" => IsValue::False,
            "unknown" => IsValue::Unknown,
            _ => return Err(FilterError::InvalidIsValue(value.to_owned())),
        }),
        _ => {
            return Err(FilterError::UnknownOperator {
                op: op_name.to_owned(),
                condition: cond.to_owned(),
            })
        }
    };
    Ok(Condition {
        column: column.to_owned(),
        negated,
        op,
    })
}

impl Filter {
    /// Parse a filter string. Empty (or blank) text is the empty filter.
    pub fn parse(text: &str) -> Result<Filter, FilterError> {
        if text.trim().is_empty() {
            return Ok(Filter::default());
        }
        let conditions = split_top_level(text)
            .into_iter()
            .map(|c| {
                if c.trim().is_empty() {
                    Err(FilterError::EmptyCondition)
                } else {
                    parse_condition(c)
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Filter { conditions })
    }
}

impl std::str::FromStr for Filter {
    type Err = FilterError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Filter::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(s: &str) -> Condition {
        let f = Filter::parse(s).unwrap();
        assert_eq!(f.conditions.len(), 1, "{s}");
        f.conditions.into_iter().next().unwrap()
    }

    #[test]
    fn classic_ops() {
        let c = one("user_id=eq.42");
        assert_eq!(c.column, "user_id");
        assert_eq!(c.op, Op::Eq("42".into()));
        assert!(!c.negated);
        assert_eq!(one("a=neq.x").op, Op::Neq("x".into()));
        assert_eq!(one("a=lt.1").op, Op::Lt("1".into()));
        assert_eq!(one("a=lte.1").op, Op::Lte("1".into()));
        assert_eq!(one("a=gt.1").op, Op::Gt("1".into()));
        assert_eq!(one("a=gte.1.5").op, Op::Gte("1.5".into()));
        assert_eq!(one("a=eq.x=y").op, Op::Eq("x=y".into()));
        assert_eq!(one("a=eq.").op, Op::Eq(String::new()));
    }

    #[test]
    fn in_lists() {
        assert_eq!(
            one("id=in.(1,2,3)").op,
            Op::In(vec!["1".into(), "2".into(), "3".into()])
        );
        assert_eq!(
            one(r#"name=in.("a,b", c ,"d\"e")"#).op,
            Op::In(vec!["a,b".into(), "c".into(), "d\"e".into()])
        );
        assert_eq!(one("id=in.()").op, Op::In(vec![]));
        let many = format!("id=in.({})", vec!["1"; 101].join(","));
        assert_eq!(Filter::parse(&many), Err(FilterError::TooManyInValues(101)));
        let ok = format!("id=in.({})", vec!["1"; 100].join(","));
        assert!(Filter::parse(&ok).is_ok());
        assert!(matches!(
            Filter::parse("id=in.1,2"),
            Err(FilterError::InNotAList(_))
        ));
        assert!(matches!(
            Filter::parse("id=in.(1,,2)"),
            Err(FilterError::EmptyInValue(_))
        ));
    }

    #[test]
    fn and_quotes_not_is() {
        let f = Filter::parse(r#"a=eq.1,b=not.ilike."%x,y%",c=is.NULL,d=not.is.true"#).unwrap();
        assert_eq!(f.conditions.len(), 4);
        assert_eq!(f.conditions[1].op, Op::Ilike("%x,y%".into()));
        assert!(f.conditions[1].negated);
        assert_eq!(f.conditions[2].op, Op::Is(IsValue::Null));
        assert_eq!(f.conditions[3].op, Op::Is(IsValue::True));
        assert!(f.conditions[3].negated);
        assert_eq!(one(r#"a=eq."x\\y""#).op, Op::Eq("x\\y".into()));
        assert_eq!(one("a=isdistinct.5").op, Op::IsDistinct("5".into()));
        assert_eq!(one("a=match.^ab+").op, Op::Match("^ab+".into()));
        assert_eq!(one("a=imatch.x").op, Op::Imatch("x".into()));
        assert_eq!(one("a=like.*x*").op, Op::Like("*x*".into()));
        let long = format!("a=like.{}", "%".repeat(MAX_PATTERN_BYTES + 1));
        assert_eq!(
            Filter::parse(&long),
            Err(FilterError::PatternTooLong(MAX_PATTERN_BYTES + 1))
        );
        assert!(Filter::parse(&format!("a=match.{}", "x".repeat(MAX_PATTERN_BYTES))).is_ok());
    }

    #[test]
    fn errors() {
        assert_eq!(Filter::parse(""), Ok(Filter::default()));
        assert_eq!(Filter::parse("a=eq.1,"), Err(FilterError::EmptyCondition));
        assert!(matches!(
            Filter::parse("abc"),
            Err(FilterError::MissingEquals(_))
        ));
        assert!(matches!(
            Filter::parse("=eq.1"),
            Err(FilterError::EmptyColumn(_))
        ));
        assert!(matches!(
            Filter::parse("a=eq"),
            Err(FilterError::MissingValue(_))
        ));
        assert!(matches!(
            Filter::parse("a=foo.1"),
            Err(FilterError::UnknownOperator { .. })
        ));
        assert!(matches!(
            Filter::parse(r#"a=eq."abc"#),
            Err(FilterError::UnterminatedQuote(_))
        ));
        assert!(matches!(
            Filter::parse(r#"a=eq."abc"d"#),
            Err(FilterError::TrailingAfterQuote(_))
        ));
        assert!(matches!(
            Filter::parse("a=is.maybe"),
            Err(FilterError::InvalidIsValue(_))
        ));
        let e = Filter::parse("a=foo.1").unwrap_err().to_string();
        assert!(e.starts_with("unknown operator `foo`"), "{e}");
    }

    #[test]
    fn display_round_trip() {
        for s in [
            "a=eq.1",
            r#"a=eq."x,y",b=not.in.(1,"2,3",""),c=is.null"#,
            r#"t=like."%\"q\"%""#,
        ] {
            let f = Filter::parse(s).unwrap();
            assert_eq!(Filter::parse(&f.to_string()).unwrap(), f, "{s}");
        }
    }
}
