//! The operator's keys: what only the platform's operator may read or do.
//!
//! Two keys, each taken from `Authorization: Bearer` only and compared in constant time
//! (SHA-256 digests, no early exit): the operator key (`MANAGEMENT_API_KEY`) reads and
//! manages; the figures key (`METRICS_API_KEY`, for Prometheus) reads the figures only —
//! a scraper's credential must not be able to create, rotate or delete projects. No
//! project key (anon, `service_role`, a user's JWT, the default project's keys) is ever
//! accepted in their place: one would let a tenant read the others' figures. They guard
//! the management API (the operator key) and the figures: `GET /metrics/projects`, every
//! project's counters on this front (who the other tenants are, how busy, what they were
//! refused; `http::figures`), and each process's `/metrics` and full `/health`
//! ([`OperatorKey::refuse_figures`]).
//!
//! A key rather than a second listener on loopback: the figures are scraped by Prometheus
//! and read by operators from outside the pod, through the one port every deployment
//! already exposes to them; a loopback listener would be out of their reach, and one open
//! wider would need a credential anyway.

use axum::http::{header, HeaderMap};
use axum::response::Response;
use sha2::{Digest, Sha256};

use crate::reply::ApiError;

/// The operator's keys, as digests; `None`: not configured.
#[derive(Clone, Default)]
pub struct OperatorKey {
    /// `MANAGEMENT_API_KEY`: reads and manages.
    digest: Option<[u8; 32]>,
    /// `METRICS_API_KEY`: reads the figures only.
    reader: Option<[u8; 32]>,
}

fn digest_of(key: Option<&str>) -> Option<[u8; 32]> {
    key.filter(|k| !k.is_empty())
        .map(|k| Sha256::digest(k.as_bytes()).into())
}

/// Whether two digests are equal, in constant time.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a
        .iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

impl OperatorKey {
    /// The operator key alone (`None` or empty: nobody is the operator).
    pub fn new(key: Option<&str>) -> OperatorKey {
        OperatorKey {
            digest: digest_of(key),
            reader: None,
        }
    }

    /// And the figures key (`None` or empty: none).
    pub fn with_reader(self, key: Option<&str>) -> OperatorKey {
        OperatorKey {
            reader: digest_of(key),
            ..self
        }
    }

    /// Whether any key is configured (else nobody reads the figures).
    pub fn is_configured(&self) -> bool {
        self.digest.is_some() || self.reader.is_some()
    }

    /// Whether `headers` carry the operator key (`Authorization: Bearer <key>`), to
    /// manage: the figures key and a project's key (a JWT) are refused with 403,
    /// anything else with 401.
    pub(crate) fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(want) = self.digest.as_ref() else {
            return Err(ApiError::forbidden(
                "no operator key is configured on this front (MANAGEMENT_API_KEY)",
            ));
        };
        let presented = presented(headers, "MANAGEMENT_API_KEY")?;
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let (operator, reader) = (same(&digest, want), self.is_reader(&digest));
        if operator {
            return Ok(());
        }
        if reader {
            return Err(ApiError::forbidden(
                "METRICS_API_KEY reads figures only: managing needs MANAGEMENT_API_KEY",
            ));
        }
        Err(not_the_key(presented))
    }

    /// Whether `headers` carry a key that reads the figures: the operator key or the
    /// figures key. Refusals as [`check`](Self::check)'s.
    pub(crate) fn check_figures(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        if !self.is_configured() {
            return Err(ApiError::forbidden(
                "no operator key is configured (MANAGEMENT_API_KEY or METRICS_API_KEY): nobody reads these figures",
            ));
        }
        let presented = presented(headers, "MANAGEMENT_API_KEY or METRICS_API_KEY")?;
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        // Both compared, whichever matches: no early exit tells which key it was.
        let operator = self.digest.as_ref().is_some_and(|w| same(&digest, w));
        let reader = self.is_reader(&digest);
        if operator | reader {
            return Ok(());
        }
        Err(not_the_key(presented))
    }

    /// Whether `headers` carry a key that reads the figures (nothing logged: for
    /// answers that only add detail for the operator, as `/readyz`'s reason).
    pub fn reads_figures(&self, headers: &HeaderMap) -> bool {
        headers.contains_key(header::AUTHORIZATION) && self.check_figures(headers).is_ok()
    }

    fn is_reader(&self, digest: &[u8; 32]) -> bool {
        self.reader.as_ref().is_some_and(|w| same(digest, w))
    }

    /// `check_figures` for a process's own routes (`route`:
    /// `health`, `metrics`): the refusal to send, logged (the caller counts it), or `None`
    /// to answer.
    pub fn refuse_figures(&self, headers: &HeaderMap, route: &str) -> Option<Response> {
        let e = self.check_figures(headers).err()?;
        e.log("operator", route, None);
        Some(e.into_response())
    }
}

/// The bearer token of `headers`, else 401 naming the keys `wanted`.
fn presented<'a>(headers: &'a HeaderMap, wanted: &str) -> Result<&'a str, ApiError> {
    bearer(headers).ok_or_else(|| {
        ApiError::unauthorized(format!(
            "the operator key is required (Authorization: Bearer <{wanted}>)"
        ))
    })
}

/// The refusal of a token that is no key of ours: 403 for a project's key or token, 401
/// for anything else.
fn not_the_key(presented: &str) -> ApiError {
    if crate::auth::peek_claims(presented).is_ok() {
        return ApiError::forbidden("a project's key or token is not the operator key");
    }
    ApiError::unauthorized("wrong operator key")
}

/// The token of `Authorization: Bearer <token>`, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .filter(|k| !k.is_empty())
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    const OPERATOR: &str = "operator-key-0123456789abcdef0123456789abcdef";
    const READER: &str = "figures-key-0123456789abcdef0123456789abcdef";

    fn with(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    fn status(r: Result<(), ApiError>) -> u16 {
        r.map_or_else(|e| e.status.as_u16(), |()| 200)
    }

    #[test]
    fn the_figures_key_reads_and_never_manages() {
        let key = OperatorKey::new(Some(OPERATOR)).with_reader(Some(READER));
        let jwt = walcast_testkit::tokens::sign(READER, &serde_json::json!({"role": "anon"}));
        let cases = [
            (Some(format!("Bearer {OPERATOR}")), 200, 200),
            (Some(format!("bearer {READER}")), 200, 403),
            (Some(format!("Bearer {jwt}")), 403, 403),
            (Some(format!("Bearer {}", &READER[1..])), 401, 401),
            (Some(READER.to_string()), 401, 401),
            (None, 401, 401),
        ];
        for (auth, figures, manage) in cases {
            let h = with(auth.as_deref());
            assert_eq!(status(key.check_figures(&h)), figures, "{auth:?}");
            assert_eq!(status(key.check(&h)), manage, "{auth:?}");
            assert_eq!(key.reads_figures(&h), figures == 200, "{auth:?}");
        }
        // No key at all: nobody reads the figures, whatever is presented.
        let none = OperatorKey::new(Some("")).with_reader(None);
        assert!(!none.is_configured());
        let h = with(Some(&format!("Bearer {OPERATOR}")));
        assert_eq!(status(none.check_figures(&h)), 403);
        assert!(none.refuse_figures(&h, "metrics").is_some());
    }
}
