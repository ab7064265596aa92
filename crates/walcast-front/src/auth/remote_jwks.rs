//! A JWKS fetched from a URL (an identity provider's `/.well-known/jwks.json`): fetched
//! at start, again every [`RemoteJwksConfig::refresh_every`], and when a token names a
//! `kid` it does not have — at most once per [`RemoteJwksConfig::min_refresh`], so tokens
//! with made-up `kid`s cannot make walcast hammer the provider; concurrent misses share
//! one fetch.
//!
//! A fetch that fails (unreachable, not 200, too large, not a usable JWKS) keeps the keys
//! of the last good one; a good one replaces them all, so a key the provider removed stops
//! verifying. Plain `http` is refused unless the host is a loopback address or the
//! operator allows it ([`RemoteJwksConfig::allow_http`]): whoever can alter the document
//! can sign any token. Redirects are not followed.

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::keys::{parse_jwks, PublicKey};
use crate::telemetry;

/// Default of [`RemoteJwksConfig::refresh_every`], in seconds.
pub const DEFAULT_REFRESH_SECS: u64 = 300;
/// Default of [`RemoteJwksConfig::min_refresh`], in seconds.
pub const DEFAULT_MIN_REFRESH_SECS: u64 = 10;
/// The largest JWKS document accepted.
pub const MAX_JWKS_BYTES: usize = 1 << 20;
/// How long one fetch may take.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Where and how often to fetch.
#[derive(Clone, Debug)]
pub struct RemoteJwksConfig {
    pub url: String,
    pub refresh_every: Duration,
    /// The least time between two fetches made because of an unknown `kid`.
    pub min_refresh: Duration,
    /// Accept `http://` for a host that is not a loopback address.
    pub allow_http: bool,
}

/// Why a JWKS URL is not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwksUrlError {
    #[error("not a URL: {0}")]
    Parse(String),
    #[error("the scheme must be https (or http to a loopback address), not {0:?}")]
    Scheme(String),
    #[error(
        "plain http to {0:?} lets anyone on the path sign tokens: use https, or allow it \
         explicitly (JWT_JWKS_ALLOW_HTTP)"
    )]
    PlainHttp(String),
}

/// Why a fetch failed (the keys of the last good one stay). A retry may help for every
/// kind but [`FetchError::Jwks`], which needs the provider's document fixed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("no system CA certificates to verify https with: {0}")]
    Roots(#[source] std::io::Error),
    #[error("request failed: {0}")]
    Request(#[source] hyper_util::client::legacy::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("answered {0}")]
    Status(http::StatusCode),
    #[error("reading the answer (at most {MAX_JWKS_BYTES} bytes): {0}")]
    Body(String),
    #[error("not a usable JWKS: {0}")]
    Jwks(#[from] super::keys::JwksError),
}

/// What [`RemoteJwks::refresh_after_miss`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterMiss {
    /// It fetched and the keys changed (tell the sessions; verify again).
    Changed,
    /// A fetch that started after the miss ran meanwhile (verify again; whoever
    /// fetched told the sessions).
    Shared,
    /// Nothing new: no fetch (too soon), a failed one, or the same keys.
    Unchanged,
}

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Empty<Bytes>>;

/// The keys last fetched, shared by everything that verifies the project's tokens.
pub struct RemoteJwks {
    cfg: RemoteJwksConfig,
    uri: http::Uri,
    client: Mutex<Option<HttpsClient>>,
    keys: RwLock<Arc<[PublicKey]>>,
    /// Digest of the document the keys came from (a change makes sessions check again).
    digest: Mutex<[u8; 32]>,
    /// One fetch at a time; when the last one started.
    fetching: tokio::sync::Mutex<Option<Instant>>,
}

/// Check a JWKS URL without fetching it.
pub fn check_url(url: &str, allow_http: bool) -> Result<http::Uri, JwksUrlError> {
    let url = url.trim();
    match url.split_once("://") {
        Some((scheme, _))
            if !scheme.eq_ignore_ascii_case("https") && !scheme.eq_ignore_ascii_case("http") =>
        {
            return Err(JwksUrlError::Scheme(scheme.to_string()))
        }
        None => return Err(JwksUrlError::Parse("no scheme (https://…)".into())),
        _ => {}
    }
    let uri: http::Uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| JwksUrlError::Parse(e.to_string()))?;
    let host = uri
        .host()
        .ok_or_else(|| JwksUrlError::Parse("no host".into()))?;
    match uri.scheme_str() {
        Some("https") => Ok(uri),
        Some("http") if allow_http || is_loopback(host) => Ok(uri),
        Some("http") => Err(JwksUrlError::PlainHttp(host.to_string())),
        other => Err(JwksUrlError::Scheme(other.unwrap_or("").to_string())),
    }
}

fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The URL as it may be printed: without user information or query (either may hold a
/// credential).
pub fn redacted(url: &str) -> String {
    match url.parse::<http::Uri>() {
        Ok(u) => {
            format!(
                "{}://{}{}",
                u.scheme_str().unwrap_or(""),
                u.host().unwrap_or(""),
                u.port().map(|p| format!(":{p}")).unwrap_or_default()
            ) + u.path()
        }
        Err(_) => "(not a URL)".into(),
    }
}

impl RemoteJwks {
    /// No keys until the first fetch ([`RemoteJwks::refresh`]).
    pub fn new(cfg: RemoteJwksConfig) -> Result<Arc<RemoteJwks>, JwksUrlError> {
        let uri = check_url(&cfg.url, cfg.allow_http)?;
        Ok(Arc::new(RemoteJwks {
            cfg,
            uri,
            client: Mutex::new(None),
            keys: RwLock::new(Arc::from(Vec::new())),
            digest: Mutex::new([0; 32]),
            fetching: tokio::sync::Mutex::new(None),
        }))
    }

    pub fn config(&self) -> &RemoteJwksConfig {
        &self.cfg
    }

    /// The keys of the last good fetch.
    pub fn keys(&self) -> Arc<[PublicKey]> {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Fetch now (after a fetch already running); whether the keys changed.
    pub async fn refresh(&self) -> Result<bool, FetchError> {
        let mut last = self.fetching.lock().await;
        *last = Some(Instant::now());
        self.fetch_and_apply().await
    }

    /// After a token named a `kid` not among the keys: fetch unless one started less
    /// than `min_refresh` ago (waiting for one that is running).
    pub async fn refresh_after_miss(&self) -> AfterMiss {
        let asked = Instant::now();
        let mut last = self.fetching.lock().await;
        match *last {
            // A fetch started after this miss was seen: it is as good as a new one.
            Some(t) if t >= asked => return AfterMiss::Shared,
            Some(t) if t.elapsed() < self.cfg.min_refresh => {
                metrics::counter!(telemetry::JWKS_FETCHES, "result" => "skipped").increment(1);
                return AfterMiss::Unchanged;
            }
            _ => {}
        }
        *last = Some(Instant::now());
        match self.fetch_and_apply().await {
            Ok(true) => AfterMiss::Changed,
            _ => AfterMiss::Unchanged,
        }
    }

    async fn fetch_and_apply(&self) -> Result<bool, FetchError> {
        let result = self.fetch().await.and_then(|body| {
            let keys = parse_jwks(&body)?;
            Ok((keys, Sha256::digest(body.as_bytes()).into()))
        });
        let (keys, digest): (Vec<PublicKey>, [u8; 32]) = match result {
            Ok(v) => v,
            Err(e) => {
                metrics::counter!(telemetry::JWKS_FETCHES, "result" => "error").increment(1);
                tracing::warn!(url = %redacted(&self.cfg.url), error = %e,
                    "could not fetch the JWKS; the keys of the last good fetch stay");
                return Err(e);
            }
        };
        metrics::counter!(telemetry::JWKS_FETCHES, "result" => "ok").increment(1);
        metrics::gauge!(telemetry::JWKS_KEYS).set(keys.len() as f64);
        let mut current = self.digest.lock().unwrap_or_else(|p| p.into_inner());
        if *current == digest {
            return Ok(false);
        }
        tracing::info!(url = %redacted(&self.cfg.url), keys = keys.len(), "JWKS fetched");
        *current = digest;
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::from(keys);
        Ok(true)
    }

    fn client(&self) -> Result<HttpsClient, FetchError> {
        let mut slot = self.client.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_native_roots(provider)
            .map_err(FetchError::Roots)?
            .https_or_http()
            .enable_http1()
            .build();
        let client = Client::builder(TokioExecutor::new()).build(https);
        *slot = Some(client.clone());
        Ok(client)
    }

    async fn fetch(&self) -> Result<String, FetchError> {
        let client = self.client()?;
        let request = http::Request::get(self.uri.clone())
            .header(http::header::ACCEPT, "application/json")
            .header(
                http::header::USER_AGENT,
                concat!("walcast/", env!("CARGO_PKG_VERSION")),
            )
            .body(Empty::new())
            .map_err(|e| FetchError::Body(e.to_string()))?;
        let answer = async {
            let response = client.request(request).await.map_err(FetchError::Request)?;
            if response.status() != http::StatusCode::OK {
                return Err(FetchError::Status(response.status()));
            }
            let body = Limited::new(response.into_body(), MAX_JWKS_BYTES)
                .collect()
                .await
                .map_err(|e| FetchError::Body(e.to_string()))?
                .to_bytes();
            String::from_utf8(body.to_vec()).map_err(|e| FetchError::Body(e.to_string()))
        };
        tokio::time::timeout(FETCH_TIMEOUT, answer)
            .await
            .map_err(|_| FetchError::Timeout(FETCH_TIMEOUT))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_https_or_loopback_http_unless_allowed() {
        assert!(check_url("https://auth.example.com/.well-known/jwks.json", false).is_ok());
        assert!(check_url("http://127.0.0.1:9999/jwks", false).is_ok());
        assert!(check_url("http://localhost/jwks", false).is_ok());
        assert!(check_url("http://[::1]:80/jwks", false).is_ok());
        assert!(matches!(
            check_url("http://auth:9999/jwks", false),
            Err(JwksUrlError::PlainHttp(h)) if h == "auth"
        ));
        assert!(check_url("http://auth:9999/jwks", true).is_ok());
        for other in ["ftp://x/jwks", "file:///etc/jwks.json"] {
            assert!(matches!(
                check_url(other, true),
                Err(JwksUrlError::Scheme(_))
            ));
        }
        assert!(matches!(
            check_url("/jwks", true),
            Err(JwksUrlError::Parse(_))
        ));
        assert!(matches!(
            check_url("not a url", true),
            Err(JwksUrlError::Parse(_))
        ));
    }

    #[test]
    fn printed_urls_lose_credentials() {
        assert_eq!(
            redacted("https://user:pw@auth.example.com:8443/jwks.json?token=s"),
            "https://auth.example.com:8443/jwks.json"
        );
        assert_eq!(redacted("::"), "(not a URL)");
    }
}
