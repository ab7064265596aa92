//! PostgreSQL log sequence numbers.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A PostgreSQL log sequence number (`pg_lsn`): a 64-bit byte position in the WAL.
///
/// Displays and parses in the Postgres text form `X/Y`, where `X` and `Y` are the
/// high and low 32 bits in hexadecimal (printed uppercase, without leading zeros,
/// exactly like `pg_lsn_out`). Serializes with serde as that string.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    /// `0/0`, the invalid LSN.
    pub const ZERO: Lsn = Lsn(0);

    /// The LSN as a plain 64-bit integer.
    pub const fn as_u64(self) -> u64 {
        self.0
    }
}

impl From<u64> for Lsn {
    fn from(v: u64) -> Self {
        Lsn(v)
    }
}

impl From<Lsn> for u64 {
    fn from(v: Lsn) -> Self {
        v.0
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// The string is not a valid Postgres LSN (`X/Y`, 1 to 8 hex digits on each side).
#[derive(thiserror::Error, Debug, Clone, Copy, PartialEq, Eq)]
#[error("invalid LSN: expected X/Y with 1 to 8 hexadecimal digits on each side")]
pub struct ParseLsnError;

/// Parses one `X` or `Y` half: 1 to 8 ASCII hex digits (either case), as `pg_lsn_in`.
fn parse_half(part: &str) -> Option<u64> {
    if part.is_empty() || part.len() > 8 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(part, 16).ok()
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    /// Accepts what Postgres' `pg_lsn_in` accepts: `X/Y` with 1 to 8 hex digits
    /// (either case, leading zeros allowed) on each side and nothing else.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (hi, lo) = s.split_once('/').ok_or(ParseLsnError)?;
        match (parse_half(hi), parse_half(lo)) {
            (Some(hi), Some(lo)) => Ok(Lsn(hi << 32 | lo)),
            _ => Err(ParseLsnError),
        }
    }
}

impl Serialize for Lsn {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Lsn {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct LsnVisitor;

        impl Visitor<'_> for LsnVisitor {
            type Value = Lsn;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Postgres LSN string like \"16/B374D848\"")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Lsn, E> {
                v.parse()
                    .map_err(|_| E::invalid_value(de::Unexpected::Str(v), &self))
            }
        }

        deserializer.deserialize_str(LsnVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn display_matches_postgres() {
        assert_eq!(Lsn(0).to_string(), "0/0");
        assert_eq!(Lsn(0x1530AA8).to_string(), "0/1530AA8");
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn(u64::MAX).to_string(), "FFFFFFFF/FFFFFFFF");
        assert_eq!(Lsn::ZERO, Lsn::default());
        assert_eq!(Lsn(7).as_u64(), 7);
    }

    #[test]
    fn parse_accepts_postgres_forms() {
        assert_eq!("0/1530AA8".parse(), Ok(Lsn(0x1530AA8)));
        assert_eq!("16/b374d848".parse(), Ok(Lsn(0x16_B374_D848)));
        assert_eq!("00000016/0000000A".parse(), Ok(Lsn(0x16_0000_000A)));
        assert_eq!("FFFFFFFF/FFFFFFFF".parse(), Ok(Lsn(u64::MAX)));
    }

    #[test]
    fn parse_rejects_garbage() {
        for bad in [
            "",
            "/",
            "0/",
            "/0",
            "0",
            "0/0/0",
            "123456789/0",
            "0/123456789",
            " 0/0",
            "0/0 ",
            "+1/0",
            "0/-1",
            "g/0",
            "0x1/0",
            "é/0",
        ] {
            let err = bad.parse::<Lsn>().unwrap_err();
            assert!(err.to_string().contains("invalid LSN"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn ordering_follows_wal_position() {
        let a: Lsn = "0/FFFFFFFF".parse().unwrap();
        let b: Lsn = "1/0".parse().unwrap();
        let c: Lsn = "1/1530AA8".parse().unwrap();
        assert!(a < b && b < c);
        assert!("0/9".parse::<Lsn>().unwrap() < "0/10".parse::<Lsn>().unwrap());
    }

    #[test]
    fn serde_as_string() {
        let json = serde_json::to_string(&Lsn(0x1_0000_00AB)).unwrap();
        assert_eq!(json, r#""1/AB""#);
        let back: Lsn = serde_json::from_str(&json).unwrap();
        assert_eq!(back, Lsn(0x1_0000_00AB));
        assert!(serde_json::from_str::<Lsn>("12").is_err());
        assert!(serde_json::from_str::<Lsn>(r#""nope""#).is_err());
        // Escaped (non-borrowed) strings work too.
        assert_eq!(serde_json::from_str::<Lsn>(r#""0\/1""#).unwrap(), Lsn(1));
    }

    proptest! {
        #[test]
        fn display_parse_round_trip(v in any::<u64>()) {
            let s = Lsn(v).to_string();
            prop_assert_eq!(s.parse::<Lsn>(), Ok(Lsn(v)));
            prop_assert_eq!(s.to_lowercase().parse::<Lsn>(), Ok(Lsn(v)));
            let padded = format!("{:08x}/{:08X}", v >> 32, v & 0xFFFF_FFFF);
            prop_assert_eq!(padded.parse::<Lsn>(), Ok(Lsn(v)));
        }

        #[test]
        fn order_matches_u64(a in any::<u64>(), b in any::<u64>()) {
            prop_assert_eq!(Lsn(a).cmp(&Lsn(b)), a.cmp(&b));
        }

        #[test]
        fn parse_never_panics(s in ".{0,24}") {
            let _ = s.parse::<Lsn>();
        }
    }
}
