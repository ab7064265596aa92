//! Casting filter operands and record values (Postgres text) to a column's type, and
//! comparing the results with Postgres semantics.

use std::borrow::Cow;
use std::cmp::Ordering;

use serde_json::Value;

use super::numeric::Decimal;
use crate::timestamp::parse_pg_datetime;

/// How values of a column type are compared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TypeClass {
    Int {
        min: i64,
        max: i64,
    },
    Numeric,
    Float4,
    Float8,
    Bool,
    /// Byte-wise (collation "C").
    Text,
    /// `char(n)`: trailing spaces are insignificant.
    Bpchar,
    /// Case-insensitive text.
    Citext,
    Uuid,
    Timestamptz,
    Timestamp,
    Date,
    Time,
    Json,
    Array(Box<TypeClass>),
}

impl TypeClass {
    pub(crate) fn of(typname: &str) -> TypeClass {
        if let Some(elem) = typname.strip_prefix('_') {
            return TypeClass::Array(Box::new(TypeClass::of(elem)));
        }
        match typname {
            "int2" | "smallint" => TypeClass::Int {
                min: i16::MIN.into(),
                max: i16::MAX.into(),
            },
            "int4" | "integer" | "int" => TypeClass::Int {
                min: i32::MIN.into(),
                max: i32::MAX.into(),
            },
            "int8" | "bigint" => TypeClass::Int {
                min: i64::MIN,
                max: i64::MAX,
            },
            "oid" | "xid" | "cid" => TypeClass::Int {
                min: 0,
                max: u32::MAX.into(),
            },
            "numeric" | "decimal" => TypeClass::Numeric,
            "float4" | "real" => TypeClass::Float4,
            "float8" | "double precision" => TypeClass::Float8,
            "bool" | "boolean" => TypeClass::Bool,
            "bpchar" | "char" => TypeClass::Bpchar,
            "citext" => TypeClass::Citext,
            "uuid" => TypeClass::Uuid,
            "timestamptz" => TypeClass::Timestamptz,
            "timestamp" => TypeClass::Timestamp,
            "date" => TypeClass::Date,
            "time" => TypeClass::Time,
            "json" | "jsonb" => TypeClass::Json,
            _ => TypeClass::Text,
        }
    }

    /// Whether `<`, `>` … are supported for this class.
    pub(crate) fn ordered(&self) -> bool {
        match self {
            TypeClass::Json => false,
            TypeClass::Array(e) => e.ordered(),
            _ => true,
        }
    }
}

/// A value cast to its column type.
#[derive(Debug, Clone)]
pub(crate) enum Typed<'a> {
    Int(i64),
    Numeric(Decimal),
    Float(f64),
    Bool(bool),
    Text(Cow<'a, str>),
    Uuid([u8; 16]),
    /// Timestamps (µs), dates (days), times (µs); ±infinity as i64::MIN/MAX.
    Instant(i64),
    Json(Value),
    Array(Vec<Option<Typed<'static>>>),
}

/// Why a text did not cast (Postgres-like wording).
pub(crate) type CastError = String;

fn special_instant(t: &str) -> Option<i64> {
    match t.trim().to_ascii_lowercase().as_str() {
        "infinity" | "+infinity" => Some(i64::MAX),
        "-infinity" => Some(i64::MIN),
        "epoch" => Some(0),
        _ => None,
    }
}

fn parse_bool(t: &str) -> Option<bool> {
    let l = t.trim().to_ascii_lowercase();
    let is_prefix = |word: &str, min: usize| l.len() >= min && word.starts_with(l.as_str());
    if is_prefix("true", 1) || is_prefix("yes", 1) || l == "on" || l == "1" {
        Some(true)
    } else if is_prefix("false", 1) || is_prefix("no", 1) || is_prefix("off", 2) || l == "0" {
        Some(false)
    } else {
        None
    }
}

fn parse_uuid(t: &str) -> Option<[u8; 16]> {
    let t = t.trim();
    let t = t
        .strip_prefix('{')
        .and_then(|s| s.strip_suffix('}'))
        .unwrap_or(t);
    let mut out = [0u8; 16];
    let mut n = 0usize;
    let mut prev_dash = true; // no leading dash
    for c in t.chars() {
        if c == '-' {
            if prev_dash || !n.is_multiple_of(4) {
                return None;
            }
            prev_dash = true;
            continue;
        }
        let v = c.to_digit(16)? as u8;
        let slot = out.get_mut(n / 2)?;
        *slot = if n.is_multiple_of(2) {
            v << 4
        } else {
            *slot | v
        };
        n += 1;
        prev_dash = false;
    }
    (n == 32 && !prev_dash).then_some(out)
}

/// Parse a one-dimensional Postgres array literal `{a,"b c",NULL}`; `None` if not of that
/// shape (nested arrays, dimension decorations, bad quoting).
fn parse_array_literal(t: &str) -> Option<Vec<Option<String>>> {
    let inner = t.trim().strip_prefix('{')?.strip_suffix('}')?;
    if inner.trim().is_empty() {
        return Some(Vec::new());
    }
    let mut out = Vec::new();
    let mut chars = inner.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let item = if chars.next_if_eq(&'"').is_some() {
            let mut s = String::new();
            loop {
                match chars.next()? {
                    '\\' => s.push(chars.next()?),
                    '"' => break,
                    c => s.push(c),
                }
            }
            while chars.next_if(|c| c.is_whitespace()).is_some() {}
            Some(s)
        } else {
            let mut s = String::new();
            while let Some(c) = chars.next_if(|c| *c != ',') {
                if c == '{' || c == '}' || c == '"' {
                    return None;
                }
                if c == '\\' {
                    s.push(chars.next()?);
                } else {
                    s.push(c);
                }
            }
            let s = s.trim().to_owned();
            if s.is_empty() {
                return None;
            }
            (!s.eq_ignore_ascii_case("null")).then_some(s)
        };
        out.push(item);
        match chars.next() {
            None => return Some(out),
            Some(',') => {}
            Some(_) => return None,
        }
    }
}

fn syntax(type_label: &str, t: &str) -> CastError {
    format!("invalid input syntax for type {type_label}: \"{t}\"")
}

/// Cast Postgres text to `class`.
pub(crate) fn cast<'a>(class: &TypeClass, t: &'a str) -> Result<Typed<'a>, CastError> {
    Ok(match class {
        TypeClass::Int { min, max } => {
            let v: i64 = t.trim().parse().map_err(|_| syntax("integer", t))?;
            if v < *min || v > *max {
                return Err(format!(
                    "value \"{t}\" is out of range for its integer type"
                ));
            }
            Typed::Int(v)
        }
        TypeClass::Numeric => {
            Typed::Numeric(Decimal::parse(t).ok_or_else(|| syntax("numeric", t))?)
        }
        TypeClass::Float4 => {
            let v: f32 = t.trim().parse().map_err(|_| syntax("real", t))?;
            Typed::Float(f64::from(v))
        }
        TypeClass::Float8 => Typed::Float(
            t.trim()
                .parse()
                .map_err(|_| syntax("double precision", t))?,
        ),
        TypeClass::Bool => Typed::Bool(parse_bool(t).ok_or_else(|| syntax("boolean", t))?),
        TypeClass::Text => Typed::Text(Cow::Borrowed(t)),
        TypeClass::Bpchar => Typed::Text(Cow::Borrowed(t.trim_end_matches(' '))),
        TypeClass::Citext => Typed::Text(Cow::Owned(t.to_lowercase())),
        TypeClass::Uuid => Typed::Uuid(parse_uuid(t).ok_or_else(|| syntax("uuid", t))?),
        TypeClass::Timestamptz | TypeClass::Timestamp | TypeClass::Date => {
            let v = match special_instant(t) {
                Some(v) => v,
                None => {
                    let dt = parse_pg_datetime(t).map_err(|e| e.to_string())?;
                    match class {
                        TypeClass::Timestamptz => dt.unix_micros(),
                        TypeClass::Timestamp => dt.local_micros(),
                        _ => dt.days,
                    }
                }
            };
            Typed::Instant(v)
        }
        TypeClass::Time => {
            let dt = parse_pg_datetime(&format!("2000-01-01 {}", t.trim()))
                .map_err(|_| syntax("time", t))?;
            Typed::Instant(dt.micros_of_day)
        }
        TypeClass::Json => Typed::Json(serde_json::from_str(t).map_err(|_| syntax("json", t))?),
        TypeClass::Array(elem) => match parse_array_literal(t) {
            Some(items) => Typed::Array(
                items
                    .into_iter()
                    .map(|item| match item {
                        None => Ok(None),
                        Some(s) => cast(elem, &s).map(|v| Some(into_owned(v))),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            None => return Err(format!("malformed array literal: \"{t}\"")),
        },
    })
}

fn into_owned(v: Typed<'_>) -> Typed<'static> {
    match v {
        Typed::Text(c) => Typed::Text(Cow::Owned(c.into_owned())),
        Typed::Int(i) => Typed::Int(i),
        Typed::Numeric(d) => Typed::Numeric(d),
        Typed::Float(f) => Typed::Float(f),
        Typed::Bool(b) => Typed::Bool(b),
        Typed::Uuid(u) => Typed::Uuid(u),
        Typed::Instant(i) => Typed::Instant(i),
        Typed::Json(j) => Typed::Json(j),
        Typed::Array(a) => Typed::Array(a),
    }
}

/// Postgres float ordering: NaN equals NaN and sorts above everything; -0 = 0.
fn float_cmp(a: f64, b: f64) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        _ => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    }
}

fn json_number_eq(a: &serde_json::Number, b: &serde_json::Number) -> bool {
    match (
        Decimal::parse(&a.to_string()),
        Decimal::parse(&b.to_string()),
    ) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// `jsonb` equality: structural, numbers compared numerically, object key order ignored.
fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => json_number_eq(x, y),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| json_eq(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

/// Compare two values of the same class. `None` when the class has no ordering (json) or
/// the values are of different kinds.
pub(crate) fn compare(a: &Typed<'_>, b: &Typed<'_>) -> Option<Ordering> {
    Some(match (a, b) {
        (Typed::Int(x), Typed::Int(y)) => x.cmp(y),
        (Typed::Numeric(x), Typed::Numeric(y)) => x.cmp(y),
        (Typed::Float(x), Typed::Float(y)) => float_cmp(*x, *y),
        (Typed::Bool(x), Typed::Bool(y)) => x.cmp(y),
        (Typed::Text(x), Typed::Text(y)) => x.as_bytes().cmp(y.as_bytes()),
        (Typed::Uuid(x), Typed::Uuid(y)) => x.cmp(y),
        (Typed::Instant(x), Typed::Instant(y)) => x.cmp(y),
        (Typed::Array(x), Typed::Array(y)) => {
            for (p, q) in x.iter().zip(y) {
                let o = match (p, q) {
                    (None, None) => Ordering::Equal,
                    (None, Some(_)) => Ordering::Greater,
                    (Some(_), None) => Ordering::Less,
                    (Some(p), Some(q)) => compare(p, q)?,
                };
                if o != Ordering::Equal {
                    return Some(o);
                }
            }
            x.len().cmp(&y.len())
        }
        _ => return None,
    })
}

/// Equality with Postgres semantics (json structurally).
pub(crate) fn equal(a: &Typed<'_>, b: &Typed<'_>) -> bool {
    match (a, b) {
        (Typed::Json(x), Typed::Json(y)) => json_eq(x, y),
        (Typed::Array(x), Typed::Array(y)) => {
            x.len() == y.len()
                && x.iter().zip(y).all(|(p, q)| match (p, q) {
                    (None, None) => true,
                    (Some(p), Some(q)) => equal(p, q),
                    _ => false,
                })
        }
        _ => compare(a, b) == Some(Ordering::Equal),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(typ: &str, t: &str) -> Typed<'static> {
        into_owned(cast(&TypeClass::of(typ), t).unwrap())
    }

    #[test]
    fn casts() {
        assert!(cast(&TypeClass::of("int2"), "40000").is_err());
        assert!(cast(&TypeClass::of("int4"), "1.5").is_err());
        assert!(equal(&c("int4", " 42 "), &c("int4", "+42")));
        assert!(equal(&c("bool", "t"), &c("bool", "TRUE")));
        assert!(equal(&c("bool", "off"), &c("bool", "f")));
        assert!(cast(&TypeClass::of("bool"), "o").is_err());
        assert!(equal(
            &c("uuid", "639F86B1-738B-43ED-BB09-C8D3F3BAFA30"),
            &c("uuid", "{639f86b1738b43edbb09c8d3f3bafa30}")
        ));
        assert!(cast(&TypeClass::of("uuid"), "639f86b1-738b").is_err());
        assert!(equal(&c("bpchar", "ab  "), &c("bpchar", "ab")));
        assert!(equal(&c("citext", "AB"), &c("citext", "ab")));
        assert!(equal(
            &c("timestamptz", "2024-01-01 05:30:00+05:30"),
            &c("timestamptz", "2024-01-01T00:00:00Z")
        ));
        assert!(equal(
            &c("date", "2024-01-01"),
            &c("date", "2024-01-01 10:00")
        ));
        assert!(equal(
            &c("jsonb", r#"{"a":1,"b":[1.0]}"#),
            &c("jsonb", r#"{"b":[1],"a":1.00}"#)
        ));
        assert!(equal(&c("_int4", "{1, 2,NULL}"), &c("_int4", "{1,2,null}")));
        assert!(equal(
            &c("_text", r#"{"a,b",c}"#),
            &c("_text", r#"{"a,b","c"}"#)
        ));
        assert!(cast(&TypeClass::of("_int4"), "{1,x}").is_err());
        assert!(equal(&c("time", "10:00"), &c("time", "10:00:00.000")));
    }

    #[test]
    fn orderings() {
        assert_eq!(
            compare(&c("float8", "NaN"), &c("float8", "Infinity")),
            Some(Ordering::Greater)
        );
        assert_eq!(
            compare(&c("float8", "NaN"), &c("float8", "nan")),
            Some(Ordering::Equal)
        );
        assert_eq!(
            compare(&c("float8", "-0"), &c("float8", "0")),
            Some(Ordering::Equal)
        );
        assert_eq!(
            compare(&c("text", "B"), &c("text", "a")),
            Some(Ordering::Less)
        );
        assert_eq!(
            compare(
                &c("timestamptz", "infinity"),
                &c("timestamptz", "2999-01-01")
            ),
            Some(Ordering::Greater)
        );
        assert_eq!(compare(&c("jsonb", "1"), &c("jsonb", "2")), None);
        assert_eq!(
            compare(&c("_int4", "{1,2}"), &c("_int4", "{1,2,0}")),
            Some(Ordering::Less)
        );
    }
}
