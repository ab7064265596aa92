//! The operator's keys, on every process: `MANAGEMENT_API_KEY` (reads every figure; on a
//! front, also the management API) and `METRICS_API_KEY` (reads the figures only, for
//! Prometheus). A process's `/metrics` and full `/health` name projects, tables and
//! errors: they go to these keys only (see `walcast_front::operator`).

use clap::Args;
use walcast_front::operator::OperatorKey;

/// Shortest key accepted (`openssl rand -hex 32` makes 64 bytes).
pub const MIN_KEY_BYTES: usize = walcast_front::config::MIN_MANAGEMENT_KEY_BYTES;

#[derive(Args, Clone, Debug, Default)]
pub struct OperatorArgs {
    /// The operator key, at least 32 bytes: reads `/metrics` and the full `/health` (on
    /// a front also `/metrics/projects`) and, on a front, serves the management API
    /// (`/management/v1/projects`, README "Running a platform"; unset: not served).
    /// Distinct from every project key: no JWT is ever accepted in its place.
    #[arg(long, env = "MANAGEMENT_API_KEY", hide_env_values = true)]
    pub management_api_key: Option<String>,
    /// The figures key, at least 32 bytes: reads `/metrics`, the full `/health` and
    /// `/metrics/projects`, never manages. Give this one to Prometheus.
    #[arg(long, env = "METRICS_API_KEY", hide_env_values = true)]
    pub metrics_api_key: Option<String>,
}

impl OperatorArgs {
    /// `MANAGEMENT_API_KEY`, unless unset or empty.
    pub fn management(&self) -> Option<&str> {
        self.management_api_key.as_deref().filter(|k| !k.is_empty())
    }

    /// `METRICS_API_KEY`, unless unset or empty.
    pub fn metrics(&self) -> Option<&str> {
        self.metrics_api_key.as_deref().filter(|k| !k.is_empty())
    }

    /// Both keys, for the process's own routes.
    pub fn key(&self) -> OperatorKey {
        OperatorKey::new(self.management()).with_reader(self.metrics())
    }

    /// Refuse at start a key that is short, a JWT (a project key must never be an
    /// operator key), equal to `jwt_secret` or to the other key (a figures key that
    /// manages would not be one).
    pub fn validate(&self, jwt_secret: Option<&str>) -> anyhow::Result<()> {
        for (name, key) in [
            ("MANAGEMENT_API_KEY", self.management()),
            ("METRICS_API_KEY", self.metrics()),
        ] {
            let Some(key) = key else { continue };
            anyhow::ensure!(
                key.len() >= MIN_KEY_BYTES,
                "{name} is {} bytes long: it must be at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`)",
                key.len()
            );
            anyhow::ensure!(
                walcast_front::auth::peek_claims(key).is_err(),
                "{name} looks like a JWT: an operator key must not be a project key"
            );
            anyhow::ensure!(
                Some(key) != jwt_secret,
                "{name} must differ from JWT_SECRET"
            );
        }
        anyhow::ensure!(
            self.metrics().is_none() || self.metrics() != self.management(),
            "METRICS_API_KEY must differ from MANAGEMENT_API_KEY (it reads figures only)"
        );
        Ok(())
    }

    /// Without any key nobody reads the figures: say so once, at start.
    pub fn warn_if_none(&self) {
        if self.management().is_none() && self.metrics().is_none() {
            tracing::warn!(
                "neither MANAGEMENT_API_KEY nor METRICS_API_KEY is set: /metrics and the full /health are refused to everyone (the public /health, /livez and /readyz answer)"
            );
        }
    }

    /// For the effective configuration: whether each is set, never its value.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "management_api_key": self.management().map(|_| "***"),
            "metrics_api_key": self.metrics().map(|_| "***"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(management: Option<&str>, metrics: Option<&str>) -> OperatorArgs {
        OperatorArgs {
            management_api_key: management.map(String::from),
            metrics_api_key: metrics.map(String::from),
        }
    }

    #[test]
    fn short_jwt_shaped_and_shared_keys_are_refused() {
        let a = "a".repeat(MIN_KEY_BYTES);
        let b = "b".repeat(MIN_KEY_BYTES);
        assert!(args(None, None).validate(None).is_ok());
        assert!(args(Some(""), Some("")).validate(None).is_ok());
        assert!(args(Some(&a), Some(&b)).validate(Some("secret")).is_ok());
        let short = "k".repeat(MIN_KEY_BYTES - 1);
        let err = |m: Option<&str>, r: Option<&str>, jwt: Option<&str>| {
            args(m, r).validate(jwt).unwrap_err().to_string()
        };
        assert!(err(None, Some(&short), None).contains("METRICS_API_KEY is 31 bytes"));
        assert!(err(Some(&short), None, None).contains("MANAGEMENT_API_KEY is 31 bytes"));
        assert!(err(Some(&a), Some(&a), None).contains("must differ from MANAGEMENT_API_KEY"));
        assert!(err(None, Some(&a), Some(&a)).contains("must differ from JWT_SECRET"));
        let jwt = walcast_testkit::tokens::sign(&b, &serde_json::json!({"role": "anon"}));
        assert!(err(None, Some(&jwt), None).contains("looks like a JWT"));
    }
}
