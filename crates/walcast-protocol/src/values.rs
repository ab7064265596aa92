//! Postgres text values → the JSON the reference server sends (`to_jsonb` of the value),
//! for the types wal2json writes as strings but clients expect in JSON form:
//!
//! * `timestamptz`: `2026-01-02 03:04:05.123+00` → `"2026-01-02T03:04:05.123+00:00"`;
//!   `timestamp`: the space becomes `T`.
//! * arrays (`_int4`, `_text`, …): the `{…}` literal → a JSON array, nested for several
//!   dimensions, `NULL` → `null`, elements typed by the element type (numbers, booleans,
//!   json embedded, timestamps as above, everything else strings).
//!
//! Anything that does not parse is sent as the original string, never dropped.

/// Append the JSON for `text` (a value of Postgres type `typname`) to `out`.
pub fn append_json(typname: &str, text: &str, out: &mut String) {
    if let Some(elem) = typname.strip_prefix('_') {
        if let Some(items) = parse_array(text) {
            write_array(elem, &items, out);
            return;
        }
    }
    write_scalar(typname, text, out);
}

/// A parsed array literal.
#[derive(Debug, Clone, PartialEq)]
enum Item {
    Null,
    Value(String),
    Array(Vec<Item>),
}

fn write_array(elem: &str, items: &[Item], out: &mut String) {
    out.push('[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        match item {
            Item::Null => out.push_str("null"),
            Item::Value(v) => write_scalar(elem, v, out),
            Item::Array(inner) => write_array(elem, inner, out),
        }
    }
    out.push(']');
}

fn write_scalar(typname: &str, text: &str, out: &mut String) {
    match typname {
        "int2" | "int4" | "int8" | "oid" | "float4" | "float8" | "numeric"
            if is_json_number(text) =>
        {
            out.push_str(text)
        }
        "bool" => match text {
            "t" | "true" => out.push_str("true"),
            "f" | "false" => out.push_str("false"),
            other => push_string(other, out),
        },
        "json" | "jsonb" if serde_json::from_str::<&serde_json::value::RawValue>(text).is_ok() => {
            out.push_str(text)
        }
        "timestamptz" => push_string(&timestamptz(text), out),
        "timestamp" => push_string(&text.replacen(' ', "T", 1), out),
        _ => push_string(text, out),
    }
}

fn push_string(s: &str, out: &mut String) {
    match serde_json::to_string(s) {
        Ok(q) => out.push_str(&q),
        Err(_) => out.push_str("null"),
    }
}

fn is_json_number(s: &str) -> bool {
    serde_json::from_str::<serde_json::Number>(s).is_ok()
}

/// `2026-01-02 03:04:05.123+00` → `2026-01-02T03:04:05.123+00:00`. Values outside the
/// ISO form (`infinity`, BC dates) are returned unchanged.
fn timestamptz(text: &str) -> String {
    let Some((date, time)) = text.split_once(' ') else {
        return text.to_string();
    };
    if time.contains(' ') || date.len() < 10 {
        return text.to_string();
    }
    // The offset starts at the last sign after the hour.
    let Some(pos) = time.rfind(['+', '-']) else {
        return text.to_string();
    };
    let (clock, offset) = time.split_at(pos);
    let offset = if offset.len() == 3 {
        format!("{offset}:00")
    } else {
        offset.to_string()
    };
    format!("{date}T{clock}{offset}")
}

/// Parse a Postgres array literal (optionally with `[lo:hi]=` dimension decoration).
fn parse_array(text: &str) -> Option<Vec<Item>> {
    let s = text.trim();
    let s = if s.starts_with('[') {
        s.split_once('=')?.1
    } else {
        s
    };
    let bytes: Vec<char> = s.chars().collect();
    let mut pos = 0;
    let items = parse_level(&bytes, &mut pos, 0)?;
    skip_ws(&bytes, &mut pos);
    (pos == bytes.len()).then_some(items)
}

const MAX_DEPTH: usize = 6;

fn skip_ws(s: &[char], pos: &mut usize) {
    while s.get(*pos).is_some_and(|c| c.is_whitespace()) {
        *pos += 1;
    }
}

fn parse_level(s: &[char], pos: &mut usize, depth: usize) -> Option<Vec<Item>> {
    if depth > MAX_DEPTH {
        return None;
    }
    skip_ws(s, pos);
    if s.get(*pos) != Some(&'{') {
        return None;
    }
    *pos += 1;
    let mut items = Vec::new();
    skip_ws(s, pos);
    if s.get(*pos) == Some(&'}') {
        *pos += 1;
        return Some(items);
    }
    loop {
        skip_ws(s, pos);
        let item = match s.get(*pos)? {
            '{' => Item::Array(parse_level(s, pos, depth + 1)?),
            '"' => {
                *pos += 1;
                let mut v = String::new();
                loop {
                    match s.get(*pos)? {
                        '\\' => {
                            v.push(*s.get(*pos + 1)?);
                            *pos += 2;
                        }
                        '"' => {
                            *pos += 1;
                            break;
                        }
                        c => {
                            v.push(*c);
                            *pos += 1;
                        }
                    }
                }
                Item::Value(v)
            }
            _ => {
                let mut v = String::new();
                while let Some(&c) = s.get(*pos) {
                    if c == ',' || c == '}' {
                        break;
                    }
                    if c == '\\' {
                        v.push(*s.get(*pos + 1)?);
                        *pos += 2;
                        continue;
                    }
                    if c == '{' || c == '"' {
                        return None;
                    }
                    v.push(c);
                    *pos += 1;
                }
                let v = v.trim().to_string();
                if v.is_empty() {
                    return None;
                }
                if v.eq_ignore_ascii_case("NULL") {
                    Item::Null
                } else {
                    Item::Value(v)
                }
            }
        };
        items.push(item);
        skip_ws(s, pos);
        match s.get(*pos)? {
            ',' => *pos += 1,
            '}' => {
                *pos += 1;
                return Some(items);
            }
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn json(typname: &str, text: &str) -> String {
        let mut s = String::new();
        append_json(typname, text, &mut s);
        s
    }

    #[test]
    fn timestamps_take_the_iso_form() {
        assert_eq!(
            json("timestamptz", "2026-01-02 03:04:05.123+00"),
            r#""2026-01-02T03:04:05.123+00:00""#
        );
        assert_eq!(
            json("timestamptz", "1999-12-31 23:59:59+00"),
            r#""1999-12-31T23:59:59+00:00""#
        );
        assert_eq!(
            json("timestamptz", "2026-06-30 10:00:00.5+05:30"),
            r#""2026-06-30T10:00:00.5+05:30""#
        );
        assert_eq!(
            json("timestamptz", "2026-06-30 10:00:00-08"),
            r#""2026-06-30T10:00:00-08:00""#
        );
        assert_eq!(json("timestamptz", "infinity"), r#""infinity""#);
        assert_eq!(
            json("timestamp", "2026-01-02 03:04:05"),
            r#""2026-01-02T03:04:05""#
        );
    }

    #[test]
    fn arrays_become_typed_json_arrays() {
        assert_eq!(json("_int4", "{1,NULL,-3}"), "[1,null,-3]");
        assert_eq!(
            json("_text", r#"{a,"b c","d,e","q\"uote",NULL,"NULL"}"#),
            r#"["a","b c","d,e","q\"uote",null,"NULL"]"#
        );
        assert_eq!(json("_int4", "{{1,2},{3,4}}"), "[[1,2],[3,4]]");
        assert_eq!(json("_int4", "[0:1]={7,8}"), "[7,8]");
        assert_eq!(json("_bool", "{t,f}"), "[true,false]");
        assert_eq!(
            json("_jsonb", r#"{"{\"a\": 1}",null}"#),
            r#"[{"a": 1},null]"#
        );
        assert_eq!(json("_float8", "{NaN,1.5}"), r#"["NaN",1.5]"#);
        assert_eq!(json("_text", "{}"), "[]");
        assert_eq!(
            json("_timestamptz", r#"{"2026-01-02 03:04:05+00"}"#),
            r#"["2026-01-02T03:04:05+00:00"]"#
        );
        // Unparseable literals stay strings.
        assert_eq!(json("_int4", "{1,2"), r#""{1,2""#);
    }

    fn literal(items: &[Option<String>]) -> String {
        let parts: Vec<String> = items
            .iter()
            .map(|i| match i {
                None => "NULL".to_string(),
                Some(s) => format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\"")),
            })
            .collect();
        format!("{{{}}}", parts.join(","))
    }

    proptest! {
        #[test]
        fn text_arrays_round_trip(items in prop::collection::vec(prop::option::of("\\PC{0,12}"), 0..8)) {
            let out = json("_text", &literal(&items));
            let back: Vec<Option<String>> = serde_json::from_str(&out).unwrap();
            prop_assert_eq!(back, items);
        }

        #[test]
        fn int_arrays_round_trip(items in prop::collection::vec(prop::option::of(any::<i64>()), 0..8)) {
            let text = format!("{{{}}}", items.iter().map(|i| i.map_or("NULL".to_string(), |v| v.to_string())).collect::<Vec<_>>().join(","));
            let back: Vec<Option<i64>> = serde_json::from_str(&json("_int8", &text)).unwrap();
            prop_assert_eq!(back, items);
        }

        #[test]
        fn any_text_gives_valid_json(t in "\\PC*", ty in prop::sample::select(vec!["_int4", "_text", "timestamptz", "timestamp", "bool", "jsonb", "_jsonb", "numeric"])) {
            let out = json(ty, &t);
            prop_assert!(serde_json::from_str::<serde_json::Value>(&out).is_ok(), "{}", out);
        }
    }
}
