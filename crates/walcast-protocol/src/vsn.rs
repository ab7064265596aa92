//! Serializer version negotiated through the `vsn` query parameter.

use std::fmt;
use std::str::FromStr;

/// Phoenix serializer version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Vsn {
    /// `1.0.0`: JSON object text frames only.
    V1,
    /// `2.0.0` (the realtime-js default): JSON array text frames plus binary broadcasts.
    #[default]
    V2,
}

/// The `vsn` query parameter named a version this crate does not speak.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported serializer vsn {0:?} (expected \"1.0.0\" or \"2.0.0\")")]
pub struct VsnError(pub String);

impl Vsn {
    /// Parse the optional `vsn` query parameter; absent means `2.0.0`.
    pub fn from_query(param: Option<&str>) -> Result<Vsn, VsnError> {
        match param {
            None => Ok(Vsn::V2),
            Some(s) => s.parse(),
        }
    }

    /// The wire spelling (`"1.0.0"` / `"2.0.0"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Vsn::V1 => "1.0.0",
            Vsn::V2 => "2.0.0",
        }
    }
}

impl FromStr for Vsn {
    type Err = VsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "1.0.0" => Ok(Vsn::V1),
            "2.0.0" => Ok(Vsn::V2),
            other => Err(VsnError(other.to_owned())),
        }
    }
}

impl fmt::Display for Vsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_query() {
        assert_eq!(Vsn::from_query(None), Ok(Vsn::V2));
        assert_eq!(Vsn::from_query(Some("1.0.0")), Ok(Vsn::V1));
        assert_eq!(Vsn::from_query(Some("2.0.0")), Ok(Vsn::V2));
        assert!(Vsn::from_query(Some("3.0.0")).is_err());
        assert!(Vsn::from_query(Some("")).is_err());
        assert_eq!(Vsn::V1.to_string(), "1.0.0");
    }
}
