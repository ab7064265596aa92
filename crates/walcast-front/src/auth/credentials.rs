//! Where a request's credentials come from: one rule for every transport and API.
//!
//! Two tokens matter, as with Supabase:
//! - the **project key** (anon or service_role; it names the project): the `apikey` query
//!   parameter, else the `apikey` header, else `Authorization: Bearer`;
//! - the **acting token** (whose role and claims RLS and authorisation use): an
//!   `access_token` (a join's payload, or the query parameter of SSE and REST), else
//!   `Authorization: Bearer`, else the project key.
//!
//! Empty values count as absent, and so does an `access_token` that is a publishable key
//! (`sb_…`, not a JWT: realtime-js sends it when no user is signed in). `Bearer` is
//! matched without regard to case.

use std::collections::HashMap;

use axum::http::{header, HeaderMap};

/// The credentials a request carries (see the module for the precedence).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Credentials {
    query_key: Option<String>,
    header_key: Option<String>,
    bearer: Option<String>,
    access_token: Option<String>,
}

fn present(v: &str) -> Option<String> {
    Some(v.trim()).filter(|v| !v.is_empty()).map(str::to_string)
}

fn user_token(v: &str) -> Option<String> {
    present(v).filter(|t| !t.starts_with("sb_"))
}

impl Credentials {
    /// Read a request's query parameters (`apikey`, `access_token`) and headers (`apikey`,
    /// `Authorization`).
    pub(crate) fn from_request(query: &HashMap<String, String>, headers: &HeaderMap) -> Self {
        let header = |name| headers.get(name).and_then(|v| v.to_str().ok());
        let bearer = header(header::AUTHORIZATION.as_str()).and_then(|v| {
            let (scheme, rest) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(rest)
        });
        Credentials {
            query_key: query.get("apikey").and_then(|v| present(v)),
            header_key: header("apikey").and_then(present),
            bearer: bearer.and_then(present),
            access_token: query.get("access_token").and_then(|v| user_token(v)),
        }
    }

    /// Read only a request's headers (an API whose routes take no credentials in the query).
    pub(crate) fn from_headers(headers: &HeaderMap) -> Self {
        Self::from_request(&HashMap::new(), headers)
    }

    /// The project key, if any.
    pub(crate) fn key(&self) -> Option<&str> {
        self.query_key
            .as_deref()
            .or(self.header_key.as_deref())
            .or(self.bearer.as_deref())
    }

    /// The acting token, if any.
    pub(crate) fn token(&self) -> Option<&str> {
        self.access_token
            .as_deref()
            .or(self.bearer.as_deref())
            .or(self.key())
    }

    /// The acting token of a join whose payload may carry its own `access_token`.
    pub(crate) fn token_for_join(&self, access_token: Option<&str>) -> Option<String> {
        access_token
            .and_then(user_token)
            .or_else(|| self.token().map(str::to_string))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(query: &[(&str, &str)], headers: &[(&'static str, &str)]) -> Credentials {
        let q = query
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.insert(*k, v.parse().unwrap());
        }
        Credentials::from_request(&q, &h)
    }

    #[test]
    fn key_is_query_then_header_then_bearer() {
        assert_eq!(creds(&[], &[]).key(), None);
        let bearer = [("authorization", "Bearer b")];
        assert_eq!(creds(&[], &bearer).key(), Some("b"));
        let both = [("authorization", "Bearer b"), ("apikey", "a")];
        assert_eq!(creds(&[], &both).key(), Some("a"));
        assert_eq!(creds(&[("apikey", "q")], &both).key(), Some("q"));
        let blank = [("authorization", "Bearer b"), ("apikey", " ")];
        assert_eq!(creds(&[], &blank).key(), Some("b"));
        assert_eq!(creds(&[], &[("authorization", "Basic x")]).key(), None);
        assert_eq!(
            creds(&[], &[("authorization", "bearer l")]).key(),
            Some("l")
        );
    }

    #[test]
    fn token_is_access_token_then_bearer_then_key() {
        let c = creds(&[("apikey", "k")], &[]);
        assert_eq!(c.token(), Some("k"));
        let c = creds(&[("apikey", "k")], &[("authorization", "Bearer u")]);
        assert_eq!(c.token(), Some("u"));
        let c = creds(
            &[("apikey", "k"), ("access_token", "t")],
            &[("authorization", "Bearer u")],
        );
        assert_eq!(c.token(), Some("t"));
        let c = creds(
            &[("apikey", "k"), ("access_token", "sb_publishable_x")],
            &[],
        );
        assert_eq!(c.token(), Some("k"));
    }

    #[test]
    fn a_join_token_overrides_unless_absent_or_publishable() {
        let c = creds(&[("apikey", "k")], &[]);
        assert_eq!(c.token_for_join(Some("j")).as_deref(), Some("j"));
        assert_eq!(c.token_for_join(Some("")).as_deref(), Some("k"));
        assert_eq!(
            c.token_for_join(Some("sb_publishable_x")).as_deref(),
            Some("k")
        );
        assert_eq!(c.token_for_join(None).as_deref(), Some("k"));
    }
}
