//! The bytes of a `bytea` value as wal2json writes it: the type's text output, which is
//! `\x` and two hex digits per byte (`bytea_output = hex`, the default) or, when the
//! decoding session has `bytea_output = escape`, printable ASCII with `\\` for a
//! backslash and `\ooo` (three octal digits) for any other byte. Both are read; anything
//! else is refused, never guessed.

/// Why a `bytea` text could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ByteaError {
    #[error("odd number of hex digits in a bytea value")]
    OddHex,
    #[error("a character that is not a hex digit in a bytea value")]
    NotHex,
    #[error("a bad escape sequence in a bytea value")]
    BadEscape,
}

/// The bytes of `text`, a `bytea` in its text form (see the module docs).
pub fn decode_bytea(text: &str) -> Result<Vec<u8>, ByteaError> {
    match text.strip_prefix("\\x") {
        Some(hex) => decode_hex(hex.as_bytes()),
        None => decode_escape(text.as_bytes()),
    }
}

fn hex_digit(c: u8) -> Result<u8, ByteaError> {
    match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        b'A'..=b'F' => Ok(c - b'A' + 10),
        _ => Err(ByteaError::NotHex),
    }
}

fn decode_hex(hex: &[u8]) -> Result<Vec<u8>, ByteaError> {
    if !hex.len().is_multiple_of(2) {
        return Err(ByteaError::OddHex);
    }
    hex.chunks_exact(2)
        .map(|p| Ok(hex_digit(p[0])? << 4 | hex_digit(p[1])?))
        .collect()
}

fn decode_escape(text: &[u8]) -> Result<Vec<u8>, ByteaError> {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if text[i] != b'\\' {
            out.push(text[i]);
            i += 1;
            continue;
        }
        match text.get(i + 1..i + 4) {
            _ if text.get(i + 1) == Some(&b'\\') => {
                out.push(b'\\');
                i += 2;
            }
            Some(&[a @ b'0'..=b'3', b @ b'0'..=b'7', c @ b'0'..=b'7']) => {
                out.push((a - b'0') << 6 | (b - b'0') << 3 | (c - b'0'));
                i += 4;
            }
            _ => return Err(ByteaError::BadEscape),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_escape_forms() {
        assert_eq!(decode_bytea("\\x").unwrap(), b"");
        assert_eq!(
            decode_bytea("\\xdeadbeef00ff").unwrap(),
            [0xde, 0xad, 0xbe, 0xef, 0, 0xff]
        );
        assert_eq!(decode_bytea("\\xDEAD").unwrap(), [0xde, 0xad]);
        // SELECT encode('\xdeadbeef00ff5c41'::bytea, 'escape') under bytea_output = escape.
        assert_eq!(
            decode_bytea("\\336\\255\\276\\357\\000\\377\\\\A").unwrap(),
            [0xde, 0xad, 0xbe, 0xef, 0, 0xff, b'\\', b'A']
        );
        assert_eq!(decode_bytea("").unwrap(), b"");
        assert_eq!(decode_bytea("\\xabc"), Err(ByteaError::OddHex));
        assert_eq!(decode_bytea("\\xzz"), Err(ByteaError::NotHex));
        assert_eq!(decode_bytea("\\"), Err(ByteaError::BadEscape));
        assert_eq!(decode_bytea("\\400"), Err(ByteaError::BadEscape));
        assert_eq!(decode_bytea("\\12"), Err(ByteaError::BadEscape));
        assert_eq!(decode_bytea("a\\q"), Err(ByteaError::BadEscape));
    }

    fn to_hex(b: &[u8]) -> String {
        let mut s = String::from("\\x");
        for x in b {
            s.push_str(&format!("{x:02x}"));
        }
        s
    }

    /// Postgres' escape output: printable ASCII as it is, `\\`, else `\ooo`.
    fn to_escape(b: &[u8]) -> String {
        let mut s = String::new();
        for &x in b {
            match x {
                b'\\' => s.push_str("\\\\"),
                0x20..=0x7e => s.push(x as char),
                _ => s.push_str(&format!("\\{x:03o}")),
            }
        }
        s
    }

    proptest::proptest! {
        #[test]
        fn both_forms_round_trip(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            proptest::prop_assert_eq!(decode_bytea(&to_hex(&bytes)).unwrap(), bytes.clone());
            let esc = to_escape(&bytes);
            // An escape text that starts with `\x` would be read as hex: Postgres writes
            // `\\x` for a leading backslash, so none does.
            proptest::prop_assert_eq!(decode_bytea(&esc).unwrap(), bytes);
        }

        #[test]
        fn any_text_is_read_or_refused(text in "\\PC{0,40}") {
            let _ = decode_bytea(&text);
        }
    }
}
