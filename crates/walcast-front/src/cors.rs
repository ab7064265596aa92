//! Cross-origin requests on the routes a browser page calls: the SSE stream, the REST
//! broadcast and the realtime tables API (a WebSocket is not subject to CORS, and the
//! operator's routes — management, figures, health — are not for pages).
//!
//! Every one of these routes authenticates with a key or token the page sends itself
//! (a header or the query), never with a cookie, so letting any origin read the answers
//! gives a foreign page nothing it could not get with the same key from a server: the
//! default is any origin (`*`), as Supabase's API gateway answers. An operator may narrow
//! it to a list of origins, or turn it off (`none`: browsers then refuse cross-origin
//! reads). Credentials (cookies, HTTP authentication) are allowed only with a list, never
//! with `*`. Preflights (`OPTIONS`) are answered for any request header the page asks
//! for, and cached by the browser for an hour.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use axum::http::{header, HeaderValue, Method};
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

/// How long a browser may cache a preflight's answer.
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(3600);

/// Origins in a list, at most (a list is compared on every request).
pub const MAX_ORIGINS: usize = 64;

/// Which origins' pages may read the answers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CorsOrigins {
    /// Any origin (`*`).
    #[default]
    Any,
    /// These origins only (`scheme://host[:port]`, lower case).
    List(Vec<String>),
    /// No CORS headers at all.
    Off,
}

/// A value of `CORS_ALLOWED_ORIGINS` that is not `*`, `none` or a list of origins.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CorsError {
    #[error("{0:?} is not an origin: write scheme://host[:port] (http or https, no path), e.g. https://app.example.com")]
    NotAnOrigin(String),
    #[error("{0} origins listed: at most {MAX_ORIGINS}")]
    TooMany(usize),
    #[error(
        "credentials cannot be allowed for any origin (`*`): list the origins that may send them"
    )]
    CredentialsForAny,
}

impl FromStr for CorsOrigins {
    type Err = CorsError;

    /// `*`; `none` (or empty); else origins separated by commas.
    fn from_str(s: &str) -> Result<CorsOrigins, CorsError> {
        let s = s.trim();
        if s == "*" {
            return Ok(CorsOrigins::Any);
        }
        if s.is_empty() || s.eq_ignore_ascii_case("none") {
            return Ok(CorsOrigins::Off);
        }
        let origins: Vec<String> = s
            .split(',')
            .map(str::trim)
            .filter(|o| !o.is_empty())
            .map(origin)
            .collect::<Result<_, _>>()?;
        if origins.len() > MAX_ORIGINS {
            return Err(CorsError::TooMany(origins.len()));
        }
        Ok(CorsOrigins::List(origins))
    }
}

impl fmt::Display for CorsOrigins {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CorsOrigins::Any => f.write_str("*"),
            CorsOrigins::List(list) => f.write_str(&list.join(",")),
            CorsOrigins::Off => f.write_str("none"),
        }
    }
}

/// One origin as a browser sends it in `Origin`: `scheme://host[:port]`, lower case.
fn origin(text: &str) -> Result<String, CorsError> {
    let bad = || CorsError::NotAnOrigin(text.to_string());
    let lower = text.to_ascii_lowercase();
    let rest = lower
        .strip_prefix("https://")
        .or_else(|| lower.strip_prefix("http://"))
        .ok_or_else(bad)?;
    // An IPv6 host is bracketed: its colons are not the port's.
    let split = match rest.find(']') {
        Some(end) if rest.starts_with('[') => (&rest[..=end], &rest[end + 1..]),
        _ => rest.find(':').map_or((rest, ""), |i| rest.split_at(i)),
    };
    let (host, port) = match split.1 {
        "" => (split.0, None),
        p => (split.0, Some(p.strip_prefix(':').ok_or_else(bad)?)),
    };
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => !v6.is_empty() && v6.chars().all(|c| c.is_ascii_hexdigit() || c == ':'),
        None => {
            !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-'))
        }
    };
    let port_ok = port.is_none_or(|p| !p.is_empty() && p.parse::<u16>().is_ok());
    if !host_ok || !port_ok {
        return Err(bad());
    }
    Ok(lower)
}

/// What the browser routes answer cross-origin requests with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CorsConfig {
    origins: CorsOrigins,
    credentials: bool,
}

impl CorsConfig {
    /// `credentials`: let the listed origins send cookies and HTTP authentication
    /// (refused with `*`).
    pub fn new(origins: CorsOrigins, credentials: bool) -> Result<CorsConfig, CorsError> {
        if credentials && origins == CorsOrigins::Any {
            return Err(CorsError::CredentialsForAny);
        }
        Ok(CorsConfig {
            origins,
            credentials,
        })
    }

    pub fn origins(&self) -> &CorsOrigins {
        &self.origins
    }

    pub fn credentials(&self) -> bool {
        self.credentials
    }

    /// The layer of the browser routes; `None` when CORS is off.
    pub(crate) fn layer(&self) -> Option<CorsLayer> {
        let allow_origin = match &self.origins {
            CorsOrigins::Off => return None,
            CorsOrigins::Any => AllowOrigin::any(),
            CorsOrigins::List(list) => {
                AllowOrigin::list(list.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
            }
        };
        let methods = [
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::DELETE,
            Method::OPTIONS,
        ];
        Some(
            CorsLayer::new()
                .allow_origin(allow_origin)
                .allow_methods(methods)
                .allow_headers(AllowHeaders::mirror_request())
                .expose_headers([header::RETRY_AFTER])
                .allow_credentials(self.credentials)
                .max_age(PREFLIGHT_MAX_AGE),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn star_none_and_lists_parse() {
        assert_eq!("*".parse(), Ok(CorsOrigins::Any));
        assert_eq!(" none ".parse(), Ok(CorsOrigins::Off));
        assert_eq!("".parse(), Ok(CorsOrigins::Off));
        assert_eq!(
            "https://App.example.com, http://127.0.0.1:3000,".parse(),
            Ok(CorsOrigins::List(vec![
                "https://app.example.com".into(),
                "http://127.0.0.1:3000".into()
            ]))
        );
        assert_eq!(
            "http://[::1]:8080,http://[::1]".parse(),
            Ok(CorsOrigins::List(vec![
                "http://[::1]:8080".into(),
                "http://[::1]".into()
            ]))
        );
    }

    #[test]
    fn what_is_not_an_origin_is_refused_by_name() {
        for bad in [
            "app.example.com",
            "ftp://x",
            "https://x/path",
            "https://x:port",
            "https://x:70000",
            "https://",
            "https://a b",
            "https://x?q",
            "null",
            "http://[::1",
            "http://[zz]",
            "http://x:",
        ] {
            let err = bad.parse::<CorsOrigins>().unwrap_err();
            assert_eq!(err, CorsError::NotAnOrigin(bad.trim().to_string()), "{bad}");
        }
        let many = (0..=MAX_ORIGINS)
            .map(|i| format!("https://h{i}.example"))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(
            many.parse::<CorsOrigins>(),
            Err(CorsError::TooMany(MAX_ORIGINS + 1))
        );
    }

    #[test]
    fn credentials_need_a_list() {
        assert_eq!(
            CorsConfig::new(CorsOrigins::Any, true),
            Err(CorsError::CredentialsForAny)
        );
        let list = CorsOrigins::List(vec!["https://a.example".into()]);
        let cfg = CorsConfig::new(list, true).unwrap();
        assert!(cfg.layer().is_some(), "a list with credentials builds");
        assert!(CorsConfig::new(CorsOrigins::Off, true)
            .unwrap()
            .layer()
            .is_none());
        assert!(
            CorsConfig::default().layer().is_some(),
            "any origin by default"
        );
    }

    #[test]
    fn display_round_trips() {
        for text in ["*", "none", "https://a.example,http://b.example:81"] {
            let parsed: CorsOrigins = text.parse().unwrap();
            assert_eq!(parsed.to_string(), text);
        }
    }
}
