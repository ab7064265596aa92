//! Options of where the default project's public keys come from besides `JWT_JWKS` (a URL
//! kept current) and which `iss` / `aud` its tokens must carry.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use walcast_front::keys::{ClaimRules, ProjectKeys};
use walcast_front::remote_jwks::{self, RemoteJwks, RemoteJwksConfig};

#[derive(Args, Clone, Debug)]
pub struct TokenRulesArgs {
    /// A URL serving the JWKS of the default project's RS/PS/ES/EdDSA tokens (an identity
    /// provider's `/.well-known/jwks.json`), besides `JWT_JWKS`: fetched at start, every
    /// `JWT_JWKS_REFRESH_SECS` and when a token names an unknown `kid`. https, or http to
    /// a loopback address.
    #[arg(long, env = "JWT_JWKS_URL", hide_env_values = true)]
    pub jwt_jwks_url: Option<String>,
    /// Seconds between two fetches of `JWT_JWKS_URL`.
    #[arg(long, env = "JWT_JWKS_REFRESH_SECS", default_value_t = remote_jwks::DEFAULT_REFRESH_SECS)]
    pub jwt_jwks_refresh_secs: u64,
    /// Least seconds between two fetches caused by tokens with an unknown `kid` (and
    /// between retries after a failed fetch).
    #[arg(long, env = "JWT_JWKS_MIN_REFRESH_SECS", default_value_t = remote_jwks::DEFAULT_MIN_REFRESH_SECS)]
    pub jwt_jwks_min_refresh_secs: u64,
    /// Accept an `http://` `JWT_JWKS_URL` to a host that is not a loopback address (anyone
    /// on the path could then sign tokens).
    #[arg(long, env = "JWT_JWKS_ALLOW_HTTP", default_value_t = false, action = clap::ArgAction::Set, hide_env_values = true)]
    pub jwt_jwks_allow_http: bool,
    /// The `iss` values the default project's tokens may have, comma-separated (empty:
    /// not checked). When set, a token without `iss` is refused.
    #[arg(long, env = "JWT_ISSUER", default_value = "")]
    pub jwt_issuer: String,
    /// The `aud` values the default project's tokens must name one of, comma-separated
    /// (empty: not checked). When set, a token without `aud` is refused (API keys too).
    #[arg(long, env = "JWT_AUDIENCE", default_value = "")]
    pub jwt_audience: String,
}

impl TokenRulesArgs {
    /// `keys` with the URL's keys (none until the first fetch) and the claim rules.
    pub fn apply(&self, keys: ProjectKeys) -> anyhow::Result<ProjectKeys> {
        let keys = keys.with_rules(ClaimRules::from_lists(&self.jwt_issuer, &self.jwt_audience));
        let Some(url) = self
            .jwt_jwks_url
            .as_deref()
            .filter(|u| !u.trim().is_empty())
        else {
            return Ok(keys);
        };
        anyhow::ensure!(
            self.jwt_jwks_refresh_secs > 0 && self.jwt_jwks_min_refresh_secs > 0,
            "JWT_JWKS_REFRESH_SECS and JWT_JWKS_MIN_REFRESH_SECS must be at least 1"
        );
        let remote = RemoteJwks::new(RemoteJwksConfig {
            url: url.trim().to_string(),
            refresh_every: Duration::from_secs(self.jwt_jwks_refresh_secs),
            min_refresh: Duration::from_secs(self.jwt_jwks_min_refresh_secs),
            allow_http: self.jwt_jwks_allow_http,
        })
        .context("JWT_JWKS_URL")?;
        Ok(keys.with_remote(remote))
    }

    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "jwt_jwks_url": self.jwt_jwks_url.as_deref().map(remote_jwks::redacted),
            "jwt_jwks_refresh_secs": self.jwt_jwks_refresh_secs,
            "jwt_jwks_min_refresh_secs": self.jwt_jwks_min_refresh_secs,
            "jwt_jwks_allow_http": self.jwt_jwks_allow_http,
            "jwt_issuer": self.jwt_issuer,
            "jwt_audience": self.jwt_audience,
        })
    }
}
