//! Options of the realtime front, shared by `ws-front` and `walcast serve`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokio_util::sync::CancellationToken;
use walcast_bus::admin::AdminClient;
use walcast_bus::Bus;
use walcast_front::keys::ProjectKeys;
use walcast_front::{
    DirectoryConfig, FrontConfig, KvPresence, MemoryPresence, PresenceStore, Projects,
};

#[derive(Args, Clone, Debug)]
pub struct FrontArgs {
    /// HMAC secret of the default project's JWTs (apikey and access tokens; HS256, HS384
    /// or HS512).
    #[arg(long, env = "JWT_SECRET", hide_env_values = true)]
    pub jwt_secret: String,
    /// During a secret rotation: the previous secret, still accepted.
    #[arg(long, env = "JWT_SECRET_PREVIOUS", hide_env_values = true)]
    pub jwt_secret_previous: Option<String>,
    /// Public keys of the default project's tokens signed with RS/PS/ES/EdDSA (user
    /// sessions of projects using asymmetric keys), chosen by `kid`: a JWKS as JSON, or
    /// the path of a file holding one.
    #[arg(long, env = "JWT_JWKS", hide_env_values = true)]
    pub jwt_jwks: Option<String>,
    #[command(flatten)]
    pub token_rules: crate::token_rules::TokenRulesArgs,
    /// SSE: changes kept per channel for `Last-Event-ID` resumption.
    #[arg(long, env = "HISTORY_SIZE", default_value_t = walcast_front::config::DEFAULT_HISTORY_SIZE)]
    pub history_size: usize,
    /// SSE `?snapshot=true`: most rows one snapshot may send (more: 413).
    #[arg(long, env = "SSE_SNAPSHOT_MAX_ROWS", default_value_t = walcast_front::config::DEFAULT_SSE_SNAPSHOT_MAX_ROWS)]
    pub sse_snapshot_max_rows: u32,
    /// SSE `?snapshot=true`: most bytes of records one snapshot may send (more: 413;
    /// the front holds up to four such snapshots at once, received and not yet sent).
    #[arg(long, env = "SSE_SNAPSHOT_MAX_BYTES", default_value_t = walcast_front::config::DEFAULT_SSE_SNAPSHOT_MAX_BYTES)]
    pub sse_snapshot_max_bytes: u32,
    /// SSE `?snapshot=true`: how long to wait for all of the worker's rows (every part),
    /// in ms.
    #[arg(long, env = "SSE_SNAPSHOT_TIMEOUT_MS", default_value_t = walcast_front::config::DEFAULT_SSE_SNAPSHOT_TIMEOUT_MS)]
    pub sse_snapshot_timeout_ms: u64,
    /// Frames queued per connection before a slow client is disconnected.
    #[arg(long, env = "OUTBOUND_QUEUE", default_value_t = walcast_front::config::DEFAULT_OUTBOUND_QUEUE)]
    pub outbound_queue: usize,
    /// Largest client frame accepted, in bytes.
    #[arg(long, env = "MAX_FRAME_BYTES", default_value_t = walcast_front::config::DEFAULT_MAX_FRAME_BYTES)]
    pub max_frame_bytes: usize,
    /// Channels one socket may join.
    #[arg(long, env = "MAX_CHANNELS_PER_SOCKET", default_value_t = walcast_front::config::DEFAULT_MAX_CHANNELS_PER_SOCKET)]
    pub max_channels_per_socket: usize,
    /// postgres_changes bindings per channel.
    #[arg(long, env = "MAX_BINDINGS_PER_CHANNEL", default_value_t = walcast_front::config::DEFAULT_MAX_BINDINGS_PER_CHANNEL)]
    pub max_bindings_per_channel: usize,
    /// WebSocket connections and SSE streams accepted at once (together).
    #[arg(long, env = "MAX_CONNECTIONS", default_value_t = walcast_front::config::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Connected users per project (sockets with a joined channel, SSE streams), across
    /// the fronts: beyond it a join is refused (`ConnectionRateLimitReached: Too many
    /// connected users`), a stream answered 429.
    #[arg(long, env = "PROJECT_MAX_USERS", default_value_t = walcast_front::config::DEFAULT_PROJECT_MAX_USERS)]
    pub project_max_users: u64,
    #[command(flatten)]
    pub project_rates: ProjectRateArgs,
    /// Joins per second per socket, and new SSE streams per second per project (after a
    /// burst of twice that).
    #[arg(long, env = "JOINS_PER_SECOND", default_value_t = walcast_front::config::DEFAULT_JOINS_PER_SECOND)]
    pub joins_per_second: u32,
    /// How long a join waits for the cdc-worker to confirm its subscriptions, in ms.
    #[arg(long, env = "REGISTER_TIMEOUT_MS", default_value_t = walcast_front::config::DEFAULT_REGISTER_TIMEOUT_MS)]
    pub register_timeout_ms: u64,
    /// Presence over NATS: `max_age` of the `walcast_presence` KV bucket, and how long
    /// another replica's presence lasts without a refresh (its replica died), in seconds.
    #[arg(long, env = "PRESENCE_TTL_SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(3..))]
    pub presence_ttl_secs: u64,
    /// On SIGTERM: refuse new clients (`/readyz` 503) and close the open sockets spread
    /// over this many seconds, so they reconnect to other replicas gradually; then exit.
    #[arg(long, env = "DRAIN_SECS", default_value_t = walcast_front::config::DEFAULT_DRAIN_SECS)]
    pub drain_secs: u64,
    /// A gap in what the leader sent this front (NATS dropped messages while the link was
    /// down) is asked for again for at most this long; past it the affected channels get
    /// a `system` error and delivery goes on.
    #[arg(long, env = "GAP_RECOVERY_MS", default_value_t = walcast_front::config::DEFAULT_GAP_RECOVERY_MS)]
    pub gap_recovery_ms: u64,
    /// Messages held behind a gap while it is recovered, at most (past it, it is given
    /// up at once).
    #[arg(long, env = "GAP_MAX_HELD", default_value_t = walcast_front::config::DEFAULT_GAP_MAX_HELD)]
    pub gap_max_held: usize,
    /// Serve the inspector page at `/inspector` (and its health API). It is a client like
    /// any other: it shows only what the key pasted into it may see.
    #[arg(long, env = "INSPECTOR", default_value_t = walcast_front::config::DEFAULT_INSPECTOR, action = clap::ArgAction::Set)]
    pub inspector: bool,
    /// Origins whose pages may call the browser routes (SSE, the REST broadcast, the
    /// realtime tables API): `*` (any: every route authenticates by a key the page sends,
    /// never a cookie), a comma-separated list (`https://app.example.com`), or `none`.
    #[arg(long, env = "CORS_ALLOWED_ORIGINS", default_value_t = walcast_front::CorsOrigins::Any)]
    pub cors_allowed_origins: walcast_front::CorsOrigins,
    /// Let those pages send credentials (cookies, HTTP authentication): only with a list
    /// of origins.
    #[arg(long, env = "CORS_ALLOW_CREDENTIALS", default_value_t = false, action = clap::ArgAction::Set)]
    pub cors_allow_credentials: bool,
    #[command(flatten)]
    pub operator: crate::operator::OperatorArgs,
    /// After a secret rotation through the management API, how long the previous secret
    /// stays valid, in seconds (a rotation may say otherwise).
    #[arg(long, env = "SECRET_ROTATION_WINDOW_SECS", default_value_t = walcast_front::config::DEFAULT_ROTATION_WINDOW_SECS)]
    pub secret_rotation_window_secs: u64,
    #[command(flatten)]
    pub roles: crate::config::RolesArgs,
}

/// A project's default rate limits across the fronts (each project may have its own,
/// through the management API).
#[derive(Args, Clone, Debug)]
pub struct ProjectRateArgs {
    /// Channel joins per second per project; beyond it a join is refused
    /// (`ClientJoinRateLimitReached: Too many joins per second`).
    #[arg(long, env = "PROJECT_MAX_JOINS_PER_SECOND", default_value_t = walcast_front::config::DEFAULT_PROJECT_JOINS_PER_SECOND)]
    pub project_max_joins_per_second: u32,
    /// Broadcast and presence messages per second per project, received and sent; while
    /// a project is over it, a channel that sends is shut ("Too many messages per
    /// second") and a REST broadcast answered 429.
    #[arg(long, env = "PROJECT_MAX_EVENTS_PER_SECOND", default_value_t = walcast_front::config::DEFAULT_PROJECT_EVENTS_PER_SECOND)]
    pub project_max_events_per_second: u32,
    /// Bytes of those messages per second per project (as the messages limit).
    #[arg(long, env = "PROJECT_MAX_BYTES_PER_SECOND", default_value_t = walcast_front::config::DEFAULT_PROJECT_BYTES_PER_SECOND)]
    pub project_max_bytes_per_second: u32,
    /// Presence track/untrack events per second per project; beyond it the channel is
    /// shut ("Too many presence messages per second").
    #[arg(long, env = "PROJECT_MAX_PRESENCE_EVENTS_PER_SECOND", default_value_t = walcast_front::config::DEFAULT_PROJECT_PRESENCE_EVENTS_PER_SECOND)]
    pub project_max_presence_events_per_second: u32,
    /// The largest broadcast or presence payload, in KiB (a larger broadcast is refused,
    /// a larger presence shuts its channel, a larger REST message is answered 413).
    #[arg(long, env = "PROJECT_MAX_PAYLOAD_KB", default_value_t = walcast_front::config::DEFAULT_PROJECT_MAX_PAYLOAD_KB)]
    pub project_max_payload_kb: u32,
}

impl ProjectRateArgs {
    pub fn config(&self) -> walcast_front::config::ProjectRateDefaults {
        walcast_front::config::ProjectRateDefaults {
            joins_per_second: self.project_max_joins_per_second,
            events_per_second: self.project_max_events_per_second,
            bytes_per_second: self.project_max_bytes_per_second,
            presence_events_per_second: self.project_max_presence_events_per_second,
            max_payload_kb: self.project_max_payload_kb,
        }
    }

    fn effective(&self) -> serde_json::Value {
        serde_json::json!({
            "project_max_joins_per_second": self.project_max_joins_per_second,
            "project_max_events_per_second": self.project_max_events_per_second,
            "project_max_bytes_per_second": self.project_max_bytes_per_second,
            "project_max_presence_events_per_second": self.project_max_presence_events_per_second,
            "project_max_payload_kb": self.project_max_payload_kb,
        })
    }
}

impl FrontArgs {
    pub fn config(&self, front_id: &str) -> FrontConfig {
        FrontConfig {
            front_id: Some(front_id.to_string()),
            history_size: self.history_size,
            sse_snapshot_max_rows: self.sse_snapshot_max_rows,
            sse_snapshot_max_bytes: self.sse_snapshot_max_bytes,
            sse_snapshot_timeout: Duration::from_millis(self.sse_snapshot_timeout_ms),
            outbound_queue: self.outbound_queue,
            max_frame_bytes: self.max_frame_bytes,
            max_channels_per_socket: self.max_channels_per_socket,
            max_bindings_per_channel: self.max_bindings_per_channel,
            max_connections: self.max_connections,
            project_max_users: self.project_max_users,
            project_rates: self.project_rates.config(),
            joins_per_second: self.joins_per_second,
            join_burst: self.joins_per_second.saturating_mul(2),
            register_timeout: Duration::from_millis(self.register_timeout_ms),
            drain_window: Duration::from_secs(self.drain_secs),
            inspector: self.inspector,
            gap_recovery: Duration::from_millis(self.gap_recovery_ms),
            gap_max_held: self.gap_max_held,
            management_api_key: self.operator.management().map(String::from),
            metrics_api_key: self.operator.metrics().map(String::from),
            rotation_window: Duration::from_secs(self.secret_rotation_window_secs),
            // Refused at start when invalid (`validate`).
            cors: self.cors().unwrap_or_default(),
            ..FrontConfig::default()
        }
    }

    /// `CORS_ALLOWED_ORIGINS` with `CORS_ALLOW_CREDENTIALS`.
    fn cors(&self) -> anyhow::Result<walcast_front::CorsConfig> {
        let origins = self.cors_allowed_origins.clone();
        walcast_front::CorsConfig::new(origins, self.cors_allow_credentials)
            .context("CORS_ALLOW_CREDENTIALS")
    }

    /// Refuse at start what cannot be served safely (a short `JWT_SECRET`, a bad JWKS).
    pub fn validate(&self) -> anyhow::Result<()> {
        self.cors()?;
        self.default_keys().map(|_| ())
    }

    /// The default project's keys: `JWT_SECRET`, `JWT_SECRET_PREVIOUS`, `JWT_JWKS`,
    /// `JWT_JWKS_URL`, and the rules of `JWT_ISSUER` and `JWT_AUDIENCE`.
    pub fn default_keys(&self) -> anyhow::Result<ProjectKeys> {
        let jwks = match self.jwt_jwks.as_deref().map(str::trim) {
            None | Some("") => Vec::new(),
            Some(v) if v.starts_with(JSON_OBJECT) => {
                walcast_front::keys::parse_jwks(v).context("JWT_JWKS")?
            }
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading JWT_JWKS file {path}"))?;
                walcast_front::keys::parse_jwks(&text)
                    .with_context(|| format!("JWT_JWKS file {path}"))?
            }
        };
        check_secret("JWT_SECRET", &self.jwt_secret)?;
        self.operator.validate(Some(&self.jwt_secret))?;
        if let Some(previous) = self
            .jwt_secret_previous
            .as_deref()
            .filter(|p| !p.is_empty())
        {
            check_secret("JWT_SECRET_PREVIOUS", previous)?;
        }
        let previous = self.jwt_secret_previous.as_deref().map(str::as_bytes);
        let keys = ProjectKeys::secret(&self.jwt_secret).with(previous, jwks);
        self.token_rules.apply(keys)
    }

    /// The default project (its keys) plus the stored ones, learnt through `admin`;
    /// tokens may act only as `ALLOWED_ROLES`.
    pub fn projects(&self, admin: AdminClient) -> anyhow::Result<Projects> {
        let keys = self.default_keys()?;
        let projects = Projects::with_directory(keys, admin, DirectoryConfig::default());
        projects.set_allowed_roles(self.roles.allowed_roles.iter().cloned());
        Ok(projects)
    }

    /// The presence store for `bus`: shared through JetStream KV on NATS, per front in
    /// process.
    pub fn presence(
        &self,
        bus: &Bus,
        front_id: &str,
        cancel: &CancellationToken,
    ) -> Arc<dyn PresenceStore> {
        match bus {
            Bus::Nats(n) => Arc::new(KvPresence::start(
                n.client().clone(),
                front_id,
                Duration::from_secs(self.presence_ttl_secs),
                cancel.clone(),
            )),
            Bus::Local(_) => Arc::new(MemoryPresence::default()),
        }
    }

    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "jwt_secret": "***",
            "jwt_secret_previous": self.jwt_secret_previous.as_ref().map(|_| "***"),
            "jwt_jwks": self.jwt_jwks.as_ref().map(|_| "(set)"),
            "token_rules": self.token_rules.describe(),
            "history_size": self.history_size,
            "sse_snapshot_max_rows": self.sse_snapshot_max_rows,
            "sse_snapshot_max_bytes": self.sse_snapshot_max_bytes,
            "sse_snapshot_timeout_ms": self.sse_snapshot_timeout_ms,
            "outbound_queue": self.outbound_queue,
            "max_frame_bytes": self.max_frame_bytes,
            "max_channels_per_socket": self.max_channels_per_socket,
            "max_bindings_per_channel": self.max_bindings_per_channel,
            "max_connections": self.max_connections,
            "project_max_users": self.project_max_users,
            "project_rates": self.project_rates.effective(),
            "joins_per_second": self.joins_per_second,
            "register_timeout_ms": self.register_timeout_ms,
            "presence_ttl_secs": self.presence_ttl_secs,
            "drain_secs": self.drain_secs,
            "inspector": self.inspector,
            "cors_allowed_origins": self.cors_allowed_origins.to_string(),
            "cors_allow_credentials": self.cors_allow_credentials,
            "gap_recovery_ms": self.gap_recovery_ms,
            "gap_max_held": self.gap_max_held,
            "operator_keys": self.operator.describe(),
            "secret_rotation_window_secs": self.secret_rotation_window_secs,
            "allowed_roles": self.roles.allowed_roles,
        })
    }
}

/// How an inline `JWT_JWKS` starts (a file path does not). Written as an escape so that
/// brace-counting tools see the function's real length.
const JSON_OBJECT: char = '\u{7b}';

/// An HMAC secret shorter than this is refused at start: anyone could guess it and sign
/// any token (RFC 7518 asks for at least the hash's size, 32 bytes for HS256).
pub const MIN_SECRET_BYTES: usize = walcast_front::keys::MIN_SECRET_BYTES;

/// [`MIN_SECRET_BYTES`] or more, else a clear error naming the variable.
fn check_secret(name: &str, secret: &str) -> anyhow::Result<()> {
    if secret.len() < MIN_SECRET_BYTES {
        anyhow::bail!(
            "{name} is {} bytes long: it must be at least {MIN_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`)",
            secret.len()
        );
    }
    Ok(())
}
