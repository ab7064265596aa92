//! Small helpers for writing JSON text by hand (used to splice pre-serialised parts).

use serde_json::value::RawValue;

/// Append `s` to `out` as a JSON string literal (with quotes).
pub(crate) fn write_str(out: &mut String, s: &str) {
    out.reserve(s.len() + 2);
    out.push('"');
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        let esc: Option<&str> = match b {
            b'"' => Some("\\\""),
            b'\\' => Some("\\\\"),
            b'\n' => Some("\\n"),
            b'\r' => Some("\\r"),
            b'\t' => Some("\\t"),
            0x08 => Some("\\b"),
            0x0c => Some("\\f"),
            0x00..=0x1f => None,
            _ => continue,
        };
        out.push_str(&s[start..i]);
        match esc {
            Some(e) => out.push_str(e),
            None => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.push_str("\\u00");
                out.push(HEX[(b >> 4) as usize] as char);
                out.push(HEX[(b & 0xf) as usize] as char);
            }
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

/// Append an optional string as a JSON string or `null`.
pub(crate) fn write_opt_str(out: &mut String, s: Option<&str>) {
    match s {
        Some(s) => write_str(out, s),
        None => out.push_str("null"),
    }
}

/// Wrap text that this crate itself produced as valid JSON into a [`RawValue`].
///
/// Falls back to `null` if the text were ever invalid (a bug, never input data).
pub(crate) fn raw(text: String) -> Box<RawValue> {
    match RawValue::from_string(text) {
        Ok(v) => v,
        Err(_) => null_raw(),
    }
}

/// A boxed JSON `null`.
pub(crate) fn null_raw() -> Box<RawValue> {
    // "null" is always valid JSON; `RawValue::NULL` is a static &RawValue.
    RawValue::NULL.to_owned()
}

/// An empty JSON object `{}` as a [`RawValue`].
pub(crate) fn empty_object() -> Box<RawValue> {
    raw("{}".to_owned())
}

/// Append `,"key":value` (or `"key":value` when `first`) to an object under construction.
pub(crate) fn write_field(out: &mut String, first: &mut bool, key: &str, value: &str) {
    if !*first {
        out.push(',');
    }
    *first = false;
    write_str(out, key);
    out.push(':');
    out.push_str(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_like_serde() {
        for s in [
            "",
            "plain",
            "q\"b\\s",
            "nl\n\t\r\u{1}\u{1f}é😀",
            "\u{7f}\u{8}\u{c}",
        ] {
            let mut out = String::new();
            write_str(&mut out, s);
            let back: String = serde_json::from_str(&out).unwrap();
            assert_eq!(back, s);
        }
    }
}
