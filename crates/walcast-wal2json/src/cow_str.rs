//! A string that borrows from the JSON input when it contains no escapes.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// `Cow<str>` that, unlike serde's own `Cow` impl, borrows from the input whenever
/// the JSON string has no escape sequences (also inside `Option`/`Vec`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CowStr<'a>(pub(crate) Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for CowStr<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct CowStrVisitor<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for CowStrVisitor<'a> {
            type Value = CowStr<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Borrowed(v)))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Owned(v.to_owned())))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Owned(v)))
            }
        }

        deserializer.deserialize_str(CowStrVisitor(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrows_unless_escaped() {
        let plain: CowStr<'_> = serde_json::from_str(r#""abc""#).unwrap();
        assert!(matches!(plain.0, Cow::Borrowed("abc")));
        let escaped: CowStr<'_> = serde_json::from_str(r#""a\nb""#).unwrap();
        assert!(matches!(escaped.0, Cow::Owned(ref s) if s == "a\nb"));
        let opt: Option<CowStr<'_>> = serde_json::from_str(r#""x""#).unwrap();
        assert!(matches!(opt, Some(CowStr(Cow::Borrowed("x")))));
        assert!(serde_json::from_str::<CowStr<'_>>("1").is_err());
    }
}
