//! The identity of a subscription class.
//!
//! Subscriptions with the same [`ClassFields`] see the same changes of tables they can
//! read without row-level security, so the worker matches them, and names them in a
//! change's audience, once per class. The name is [`ClassFields::key`]: `c` and 32 hex
//! digits, the first 128 bits of a SHA-256 over an unambiguous (length-prefixed)
//! encoding of the fields. Every field but the role is chosen by the subscriber (its
//! `filter` and `select` are free text), so a name must not be forgeable: finding other
//! fields with the same key is a second preimage of SHA-256 (about 2^128 tries), and on
//! top of that both the worker and the fronts compare the full fields whenever a
//! subscription joins a class by key, and refuse it on a mismatch (never merged).

use sha2::{Digest, Sha256};

use crate::spec::{selected, SubscriptionSpec};

/// Prefix of the hashed encoding (a new encoding gets a new prefix, so keys of two
/// encodings never meet).
const DOMAIN: &[u8] = b"walcast.class.v2\0";

/// Hex digits of a class key after its `c` (128 bits).
pub const KEY_HEX_DIGITS: usize = 32;

/// What the subscriptions of one class have in common, canonical: two specs are in one
/// class exactly when their fields are equal.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClassFields {
    pub project: String,
    /// Schema name, or `*`.
    pub schema: String,
    /// `None`: every table of the schema.
    pub table: Option<String>,
    /// Upper case: `*`, `INSERT`, `UPDATE` or `DELETE`.
    pub event: String,
    /// The filter, trimmed; `None` when absent or blank.
    pub filter: Option<String>,
    /// The JWT `role` claim; empty when there is none (or it is not a string).
    pub role: String,
    /// The selected columns, trimmed, sorted and once each; `None`: every column.
    pub select: Option<Vec<String>>,
}

impl ClassFields {
    /// The class fields of a subscription (its id, front, other claims and position do
    /// not count).
    pub fn of(spec: &SubscriptionSpec) -> ClassFields {
        ClassFields {
            project: spec.project.clone(),
            schema: spec.schema.clone(),
            table: spec.table.clone(),
            event: spec.event.to_ascii_uppercase(),
            filter: spec
                .filter
                .as_deref()
                .map(str::trim)
                .filter(|f| !f.is_empty())
                .map(str::to_string),
            role: spec
                .claims
                .get("role")
                .and_then(|r| r.as_str())
                .unwrap_or_default()
                .to_string(),
            select: selected(spec),
        }
    }

    /// The fields as bytes, injectively: every string is preceded by its length, every
    /// optional field by a presence byte, the column list by its count.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.project.len() + self.schema.len());
        out.extend_from_slice(DOMAIN);
        put_str(&mut out, &self.project);
        put_str(&mut out, &self.schema);
        put_opt(&mut out, self.table.as_deref());
        put_str(&mut out, &self.event);
        put_opt(&mut out, self.filter.as_deref());
        put_str(&mut out, &self.role);
        match &self.select {
            None => out.push(0),
            Some(cols) => {
                out.push(1);
                out.extend_from_slice(&(cols.len() as u64).to_be_bytes());
                for c in cols {
                    put_str(&mut out, c);
                }
            }
        }
        out
    }

    /// The class's name: `c` and the first [`KEY_HEX_DIGITS`] hex digits of the SHA-256 of
    /// [`ClassFields::encode`]. Fronts and worker compute it alike.
    pub fn key(&self) -> String {
        let digest = Sha256::digest(self.encode());
        let mut key = String::with_capacity(1 + KEY_HEX_DIGITS);
        key.push('c');
        for b in &digest[..KEY_HEX_DIGITS / 2] {
            key.push(char::from(HEX[usize::from(b >> 4)]));
            key.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        key
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_opt(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        None => out.push(0),
        Some(s) => {
            out.push(1);
            put_str(out, s);
        }
    }
}

/// True for a class key (as opposed to a subscription id, which always has a `:`): `c`
/// and exactly [`KEY_HEX_DIGITS`] lower-case hex digits.
pub fn is_class_key(s: &str) -> bool {
    s.len() == 1 + KEY_HEX_DIGITS && s.starts_with('c') && s[1..].bytes().all(|b| HEX.contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reads [`ClassFields::encode`] back: an encoding that decodes to its input is
    /// injective.
    struct Reader<'a>(&'a [u8]);

    impl Reader<'_> {
        fn take(&mut self, n: usize) -> Option<&[u8]> {
            if self.0.len() < n {
                return None;
            }
            let (a, b) = self.0.split_at(n);
            self.0 = b;
            Some(a)
        }
        fn len(&mut self) -> Option<usize> {
            let b: [u8; 8] = self.take(8)?.try_into().ok()?;
            usize::try_from(u64::from_be_bytes(b)).ok()
        }
        fn str(&mut self) -> Option<String> {
            let n = self.len()?;
            String::from_utf8(self.take(n)?.to_vec()).ok()
        }
        fn present(&mut self) -> Option<bool> {
            match self.take(1)? {
                [0] => Some(false),
                [1] => Some(true),
                _ => None,
            }
        }
        fn opt(&mut self) -> Option<Option<String>> {
            if self.present()? {
                Some(Some(self.str()?))
            } else {
                Some(None)
            }
        }
    }

    fn decode(bytes: &[u8]) -> Option<ClassFields> {
        let mut r = Reader(bytes.strip_prefix(DOMAIN)?);
        let f = ClassFields {
            project: r.str()?,
            schema: r.str()?,
            table: r.opt()?,
            event: r.str()?,
            filter: r.opt()?,
            role: r.str()?,
            select: if r.present()? {
                let n = r.len()?;
                Some((0..n).map(|_| r.str()).collect::<Option<Vec<_>>>()?)
            } else {
                None
            },
        };
        r.0.is_empty().then_some(f)
    }

    /// Short strings over an alphabet that includes separators an ambiguous encoding
    /// would confuse (NUL, `\u{1}`, commas, length-like digits).
    fn text() -> impl Strategy<Value = String> {
        proptest::string::string_regex("[a-c0-9\u{0}\u{1},.:* ]{0,6}").unwrap()
    }

    fn fields() -> impl Strategy<Value = ClassFields> {
        (
            (text(), text(), proptest::option::of(text()), text()),
            (
                proptest::option::of(text()),
                text(),
                proptest::option::of(proptest::collection::vec(text(), 0..4)),
            ),
        )
            .prop_map(
                |((project, schema, table, event), (filter, role, select))| ClassFields {
                    project,
                    schema,
                    table,
                    event,
                    filter,
                    role,
                    select,
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn the_encoding_is_injective(f in fields()) {
            prop_assert_eq!(decode(&f.encode()), Some(f));
        }

        #[test]
        fn different_fields_give_different_keys(a in fields(), b in fields()) {
            prop_assert_eq!(a == b, a.key() == b.key(), "{:?} / {:?}", a, b);
            prop_assert!(is_class_key(&a.key()));
        }

        #[test]
        fn a_moved_boundary_changes_the_key(a in text(), b in text(), c in text()) {
            // The same bytes cut differently between two neighbouring fields.
            let base = ClassFields {
                project: "p".into(),
                schema: "public".into(),
                table: Some("t".into()),
                event: "*".into(),
                filter: Some(format!("{a}{b}")),
                role: c.clone(),
                select: None,
            };
            let moved = ClassFields {
                filter: Some(a.clone()),
                role: format!("{b}{c}"),
                ..base.clone()
            };
            prop_assert_eq!(b.is_empty(), base.key() == moved.key());
        }
    }

    #[test]
    fn keys_are_recognised_and_ids_are_not() {
        let f = ClassFields {
            project: "default".into(),
            schema: "public".into(),
            table: None,
            event: "*".into(),
            filter: None,
            role: "anon".into(),
            select: Some(Vec::new()),
        };
        let k = f.key();
        assert_eq!(k.len(), 33, "{k}");
        assert!(is_class_key(&k));
        assert!(!is_class_key("f1:7"));
        assert!(!is_class_key("c0123456789abcdef"), "the old 64-bit form");
        assert!(!is_class_key(&k.to_uppercase()));
        assert!(!is_class_key(&format!("{}:", &k[..32])));
        assert_ne!(
            k,
            ClassFields {
                select: None,
                ..f.clone()
            }
            .key(),
            "an empty select is not no select"
        );
    }
}
