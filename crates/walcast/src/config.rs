//! Options shared by the binaries. Every option is a `--flag` and an environment variable.

use std::time::Duration;

use clap::{Args, ValueEnum};
use walcast_lease::LeaseMode;
use walcast_pipeline::config as pipeline;
use walcast_pipeline::{PipelineConfig, ReadConfig, SourceKind};
use walcast_realtime::secrets::SecretKeys;
use walcast_realtime::{RealtimeConfig, RlsMode, RlsOptions};

/// How to trust and authenticate to NATS beyond `NATS_URL` (which may carry a user and
/// password, and `tls://` to require TLS).
#[derive(Args, Clone, Debug, Default)]
pub struct NatsAuthArgs {
    /// PEM file of the CA that signed the NATS server's certificate (TLS is then required).
    #[arg(long, env = "NATS_CA_FILE")]
    pub nats_ca_file: Option<std::path::PathBuf>,
    /// NATS credentials file (user JWT and nkey seed, as `nsc` writes it).
    #[arg(long, env = "NATS_CREDS_FILE")]
    pub nats_creds_file: Option<std::path::PathBuf>,
    /// File holding a NATS user nkey seed (`SU…`).
    #[arg(long, env = "NATS_NKEY_FILE")]
    pub nats_nkey_file: Option<std::path::PathBuf>,
    /// NATS user (with `NATS_PASSWORD`; instead of a user in `NATS_URL`), e.g. one of
    /// docker/nats/walcast-permissions.conf.
    #[arg(long, env = "NATS_USER")]
    pub nats_user: Option<String>,
    /// That user's password.
    #[arg(long, env = "NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,
}

impl NatsAuthArgs {
    pub fn auth(&self) -> walcast_bus::NatsAuth {
        walcast_bus::NatsAuth {
            ca_file: self.nats_ca_file.clone(),
            creds_file: self.nats_creds_file.clone(),
            nkey_file: self.nats_nkey_file.clone(),
            user: self
                .nats_user
                .clone()
                .map(|u| (u, self.nats_password.clone().unwrap_or_default())),
            inbox_role: None,
        }
    }

    /// For the effective configuration (file paths, not their contents).
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "nats_ca_file": self.nats_ca_file,
            "nats_creds_file": self.nats_creds_file,
            "nats_nkey_file": self.nats_nkey_file,
            "nats_user": self.nats_user,
            "nats_password": self.nats_password.as_ref().map(|_| "***"),
        })
    }
}

/// The key the projects' secrets and the sources' URLs are stored encrypted with (see
/// `walcast_realtime::secrets`), and during a rotation the previous one.
#[derive(Args, Clone, Default)]
pub struct SecretsArgs {
    /// Key of the secrets stored in the database (the projects' JWT secrets, the sources'
    /// URLs): at least 32 bytes, e.g. `openssl rand -hex 32`. Required by the processes
    /// that read or write them (cdc-worker, `walcast serve`, `walcast project`,
    /// `walcast source`, `walcast secrets`); keep it apart from the database's backups.
    #[arg(long, env = "SECRETS_KEY", hide_env_values = true)]
    pub secrets_key: Option<String>,
    /// During a rotation of SECRETS_KEY, the previous key: still read, while every value
    /// is rewritten under SECRETS_KEY (at each start, or `walcast secrets rotate`).
    #[arg(long, env = "SECRETS_KEY_PREVIOUS", hide_env_values = true)]
    pub secrets_key_previous: Option<String>,
}

impl std::fmt::Debug for SecretsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretsArgs { .. }")
    }
}

impl SecretsArgs {
    /// The keys; an error naming the option when the key is missing or too short.
    pub fn keys(&self) -> anyhow::Result<std::sync::Arc<SecretKeys>> {
        let key = self
            .secrets_key
            .as_deref()
            .filter(|k| !k.is_empty())
            .ok_or(walcast_realtime::secrets::SecretError::NoKey)?;
        let keys = SecretKeys::new(key, self.secrets_key_previous.as_deref())?;
        Ok(std::sync::Arc::new(keys))
    }

    /// The keys if SECRETS_KEY is set.
    pub fn keys_if_set(&self) -> anyhow::Result<Option<std::sync::Arc<SecretKeys>>> {
        match self.secrets_key.as_deref() {
            None | Some("") => Ok(None),
            Some(_) => self.keys().map(Some),
        }
    }

    /// For the effective configuration: the keys' ids, never the keys.
    pub fn describe(keys: &SecretKeys) -> serde_json::Value {
        serde_json::json!({
            "secrets_key": "***",
            "secrets_key_id": keys.key_id(),
            "secrets_key_previous": keys.previous_key_id().map(|_| "***"),
            "secrets_key_previous_id": keys.previous_key_id(),
        })
    }
}

/// `ALLOWED_ROLES`: the roles a token may act as (its `role` claim). Checked by the
/// front (every token it verifies) and by the worker (every check that switches to a
/// token's role), which also refuses superusers and its own role whatever the list says.
#[derive(Args, Clone, Debug)]
pub struct RolesArgs {
    /// Roles a token may act as, comma-separated (`none`, superusers and walcast's own
    /// role are always refused by the worker).
    #[arg(
        long = "allowed-roles",
        env = "ALLOWED_ROLES",
        value_delimiter = ',',
        default_value = "anon,authenticated,service_role"
    )]
    pub allowed_roles: Vec<String>,
}

impl RolesArgs {
    /// The worker's policy.
    pub fn policy(&self) -> walcast_realtime::roles::RolePolicy {
        walcast_realtime::roles::RolePolicy::new(self.allowed_roles.iter().cloned())
    }
}

/// A database this worker may read (see [`walcast_bus::source`]): its name, its URLs and
/// its slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceSpec {
    pub name: String,
    pub database_url: String,
    pub replication_url: String,
    pub slot_name: String,
    /// The check login's URL on the source's database (`None`: not set, the source is
    /// refused until it is).
    pub check_url: Option<String>,
}

/// The logical replication slot's default name.
pub const DEFAULT_SLOT_NAME: &str = pipeline::DEFAULT_SLOT_NAME;

#[derive(Args, Clone, Debug)]
pub struct DbArgs {
    /// Postgres connection URL (tables, registry, RLS checks).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Connection URL for the replication slot; defaults to DATABASE_URL.
    #[arg(long, env = "POSTGRES_REPLICATION_URL", hide_env_values = true)]
    pub replication_url: Option<String>,
    /// Connection URL of the check login: the login, with no privileges of its own,
    /// that runs the SQL tenants write (row-level security and private-channel
    /// policies, SSE snapshots). Required by the processes that check (cdc-worker,
    /// `walcast serve`); refused at start if it is DATABASE_URL's login or may do more
    /// than act as the roles tokens act as (see docs/security.md).
    #[arg(long, env = "CHECK_DATABASE_URL", hide_env_values = true)]
    pub check_database_url: Option<String>,
}

impl DbArgs {
    pub fn replication_url(&self) -> &str {
        self.replication_url
            .as_deref()
            .unwrap_or(&self.database_url)
    }
}

#[derive(Args, Clone, Debug)]
pub struct CdcArgs {
    /// Where changes are read from: `stream` (replication protocol, START_REPLICATION) or
    /// `poll` (SQL peek/advance, the reference-compatible mode).
    #[arg(long = "cdc-source", env = "CDC_SOURCE", default_value = "stream")]
    pub source: SourceKind,
    /// Stream mode: how often progress is acknowledged to Postgres, in milliseconds.
    #[arg(long, env = "CDC_ACK_INTERVAL_MS", default_value_t = pipeline::DEFAULT_ACK_INTERVAL.as_millis() as u64)]
    pub ack_interval_ms: u64,
    /// The leader of each source writes a heartbeat (a transactional logical message,
    /// prefix `walcast.heartbeat`) on its database this often, in milliseconds, so its
    /// slot always has a recent commit to acknowledge even when the tables it reads are
    /// idle; 0: off. A failed beat is logged, counted and tried again at the next one.
    #[arg(long, env = "CDC_HEARTBEAT_INTERVAL_MS", default_value_t = pipeline::DEFAULT_HEARTBEAT_INTERVAL.as_millis() as u64)]
    pub heartbeat_interval_ms: u64,
    /// Name of the logical replication slot (created with wal2json when missing).
    #[arg(long, env = "CDC_SLOT_NAME", default_value = DEFAULT_SLOT_NAME)]
    pub slot_name: String,
    /// Delivery lanes: each project's changes are authorized and published by a lane of
    /// its own (its own RLS checker and connections, opened when first needed), in order
    /// within the project and independently of the others, up to this many lanes;
    /// beyond, projects share lanes by hash.
    #[arg(long, env = "CDC_NUM_SHARDS", default_value_t = walcast_realtime::DEFAULT_SHARDS, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub num_shards: u16,
    /// How long a project's changes may wait for delivery (its RLS checks too slow to keep
    /// up): older ones are not checked nor delivered; its subscribers get a `system`
    /// error saying so. Other projects are never held.
    #[arg(long, env = "REALTIME_MAX_LAG_MS", default_value_t = walcast_realtime::DEFAULT_MAX_LAG_MS)]
    pub max_lag_ms: u64,
    /// Bytes of changes a project may have waiting for delivery; past it, new ones are
    /// skipped the same way.
    #[arg(long, env = "REALTIME_MAX_LAG_BYTES", default_value_t = walcast_realtime::DEFAULT_MAX_LAG_BYTES)]
    pub max_lag_bytes: usize,
    /// A change whose values (new and old row, as JSON) are larger is delivered the way
    /// Supabase does: large values dropped, the primary key kept, `errors: ["Error 413:
    /// Payload Too Large"]`. The bus's own `max_payload` lowers it further.
    #[arg(long, env = "MAX_RECORD_BYTES", default_value_t = walcast_realtime::DEFAULT_MAX_RECORD_BYTES)]
    pub max_record_bytes: usize,
    /// Messages kept per front for resending what a front missed (NATS dropped them while
    /// its link was down); the oldest go first past this, CDC_RESEND_MAX_BYTES or
    /// CDC_RESEND_MAX_SECS.
    #[arg(long, env = "CDC_RESEND_MAX_MESSAGES", default_value_t = walcast_realtime::DEFAULT_RESEND_MESSAGES)]
    pub resend_max_messages: usize,
    /// Bytes kept per front for resending.
    #[arg(long, env = "CDC_RESEND_MAX_BYTES", default_value_t = walcast_realtime::DEFAULT_RESEND_BYTES)]
    pub resend_max_bytes: usize,
    /// Seconds a message is kept for resending.
    #[arg(long, env = "CDC_RESEND_MAX_SECS", default_value_t = walcast_realtime::DEFAULT_RESEND_SECS)]
    pub resend_max_secs: u64,
    /// Changes authorized together: one statement per (table, role, claims) covers them all.
    #[arg(long, env = "CDC_RLS_BATCH", default_value_t = walcast_realtime::DEFAULT_RLS_BATCH)]
    pub rls_batch: usize,
    /// `batched` (default) or `naive`: one check per subscriber per change, one statement
    /// per round trip. Naive exists to measure what batching saves; do not run it.
    #[arg(long, env = "CDC_RLS_MODE", default_value = "batched")]
    pub rls_mode: RlsModeArg,
    /// Connections per shard over which a batch with many (role, claims) groups is
    /// spread, so one project's checks can use more than one database core.
    #[arg(long, env = "CDC_RLS_CONNECTIONS", default_value_t = walcast_realtime::DEFAULT_RLS_CONNECTIONS, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub rls_connections: u16,
    /// statement_timeout of each RLS check, in milliseconds: a slow policy denies its
    /// subscribers instead of stalling the stream.
    #[arg(long, env = "CDC_RLS_CHECK_TIMEOUT_MS", default_value_t = walcast_realtime::DEFAULT_RLS_CHECK_TIMEOUT_MS)]
    pub rls_check_timeout_ms: u64,
    /// Rows per peek to start with; the poller grows it while polls come back full.
    #[arg(long, env = "CDC_POLL_BATCH", default_value_t = pipeline::DEFAULT_POLL_BATCH)]
    pub poll_batch: usize,
    /// Upper bound of the adaptive peek size (bounds server-side work per poll).
    #[arg(long, env = "CDC_POLL_MAX_BATCH", default_value_t = pipeline::DEFAULT_POLL_MAX_BATCH)]
    pub poll_max_batch: usize,
    /// Wait after an empty poll, in milliseconds.
    #[arg(long, env = "CDC_POLL_IDLE_MS", default_value_t = pipeline::DEFAULT_POLL_IDLE.as_millis() as u64)]
    pub poll_idle_ms: u64,
    /// Re-read the realtime table registry at least this often, in milliseconds
    /// (registry edits are also seen in WAL order, at once).
    #[arg(long, env = "TABLE_FILTER_REFRESH_MS", default_value_t = pipeline::DEFAULT_FILTER_REFRESH.as_millis() as u64)]
    pub table_filter_refresh_ms: u64,
    /// Distinct subscription classes (table, event, filter, columns and role) the worker
    /// keeps per project: a join that would add one more is refused with an error.
    #[arg(long, env = "CDC_MAX_CLASSES_PER_PROJECT", default_value_t = walcast_realtime::subscriptions::matcher::DEFAULT_MAX_CLASSES_PER_PROJECT)]
    pub max_classes_per_project: usize,
    /// Distinct subscription classes with a subscription of one front.
    #[arg(long, env = "CDC_MAX_CLASSES_PER_FRONT", default_value_t = walcast_realtime::subscriptions::matcher::DEFAULT_MAX_CLASSES_PER_FRONT)]
    pub max_classes_per_front: usize,
    /// Bytes of compiled filter patterns (`like`, `ilike`, `match`, `imatch`: each its
    /// automata and search cache) the worker keeps for one project's classes: a join
    /// that would add more is refused with an error.
    #[arg(long, env = "CDC_MAX_FILTER_BYTES_PER_PROJECT", default_value_t = walcast_realtime::subscriptions::matcher::DEFAULT_MAX_FILTER_BYTES_PER_PROJECT)]
    pub max_filter_bytes_per_project: usize,
    /// The same, for every project's classes together.
    #[arg(long, env = "CDC_MAX_FILTER_BYTES", default_value_t = walcast_realtime::subscriptions::matcher::DEFAULT_MAX_FILTER_BYTES)]
    pub max_filter_bytes: usize,
    /// Start even when max_slot_wal_keep_size is -1 (a stalled slot can then fill the disk).
    #[arg(long, env = "CDC_ALLOW_UNBOUNDED_WAL", default_value_t = false)]
    pub allow_unbounded_wal: bool,
    #[command(flatten)]
    pub lease: LeaseArgs,
    #[command(flatten)]
    pub outbox: OutboxArgs,
    #[command(flatten)]
    pub changes: crate::changes_args::ChangeStreamArgs,
}

/// The transactional outbox relay (docs/outbox.md).
#[derive(Args, Clone, Debug)]
pub struct OutboxArgs {
    /// Relay `walcast.emit` events and outbox-table rows to NATS JetStream, and maintain
    /// the outbox tables' partitions. The stream is created at the first event, so a
    /// deployment that never emits needs no JetStream.
    #[arg(long = "outbox-enabled", env = "OUTBOX_ENABLED", default_value_t = true, action = clap::ArgAction::Set)]
    pub enabled: bool,
    #[command(flatten)]
    pub stream: OutboxStreamArgs,
    /// How long to wait for one PubAck before retrying, in milliseconds.
    #[arg(long = "outbox-ack-timeout-ms", env = "OUTBOX_ACK_TIMEOUT_MS", default_value_t = walcast_outbox::config::DEFAULT_ACK_TIMEOUT.as_millis() as u64)]
    pub ack_timeout_ms: u64,
    /// Events sent and not yet acknowledged, at most (beyond, later events wait in the
    /// relay's queue, unsent, in order); at most 16384 is used.
    #[arg(long = "outbox-max-in-flight", env = "OUTBOX_MAX_IN_FLIGHT", default_value_t = walcast_outbox::config::DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,
    /// Events handed to the relay and not yet acknowledged (sent or queued), at most:
    /// beyond, the relay takes no more transactions until JetStream caught up (realtime
    /// carries on; the slot retains the WAL from the relay's position).
    #[arg(long = "outbox-max-queued", env = "OUTBOX_MAX_QUEUED", default_value_t = walcast_outbox::config::DEFAULT_MAX_QUEUED)]
    pub max_queued: usize,
    /// The same bound in bytes (payload, subject and headers of each event).
    #[arg(long = "outbox-max-queued-bytes", env = "OUTBOX_MAX_QUEUED_BYTES", default_value_t = walcast_outbox::config::DEFAULT_MAX_QUEUED_BYTES)]
    pub max_queued_bytes: u64,
    /// Longest wait between retries of a transient failure, in milliseconds (waits
    /// double from 100 ms up to it).
    #[arg(long = "outbox-retry-max-ms", env = "OUTBOX_RETRY_MAX_MS", default_value_t = walcast_outbox::config::DEFAULT_RETRY_MAX.as_millis() as u64)]
    pub retry_max_ms: u64,
    /// The leader runs `walcast.outbox_maintain()` at the start of its term and then this
    /// often, in seconds: partitions for the next three days, and partitions older than
    /// their outbox's retention dropped (with a 5 s lock_timeout, so writers never wait
    /// long behind it).
    #[arg(long = "outbox-maintain-interval-secs", env = "OUTBOX_MAINTAIN_INTERVAL_SECS", default_value_t = walcast_outbox::config::DEFAULT_MAINTAIN_INTERVAL.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    pub maintain_interval_secs: u64,
}

/// The outbox's JetStream stream: the relay creates it with these settings, or updates it
/// to them; `walcast outbox redrive` creates it with them when it is missing.
#[derive(Args, Clone, Debug)]
pub struct OutboxStreamArgs {
    /// The outbox's JetStream stream (the relay creates it, or updates it to these
    /// settings; `walcast outbox redrive` creates it with them only when it is missing).
    #[arg(long = "outbox-stream", env = "OUTBOX_STREAM", default_value = walcast_outbox::config::DEFAULT_STREAM)]
    pub stream: String,
    /// The stream's replicas (1 for a single NATS server, 3 for a cluster).
    #[arg(long = "outbox-stream-replicas", env = "OUTBOX_STREAM_REPLICAS", default_value_t = walcast_outbox::config::DEFAULT_REPLICAS)]
    pub replicas: usize,
    /// How long the stream keeps events, in seconds (how far `walcast outbox replay`
    /// reaches back).
    #[arg(long = "outbox-max-age-secs", env = "OUTBOX_MAX_AGE_SECS", default_value_t = walcast_outbox::config::DEFAULT_MAX_AGE.as_secs())]
    pub max_age_secs: u64,
    /// JetStream's duplicate window, in seconds: replays after a crash or failover within
    /// it are dropped by event id. Must exceed the worst replay (docs/outbox.md).
    #[arg(long = "outbox-duplicate-window-secs", env = "OUTBOX_DUPLICATE_WINDOW_SECS", default_value_t = walcast_outbox::config::DEFAULT_DUPLICATE_WINDOW.as_secs())]
    pub duplicate_window_secs: u64,
}

impl OutboxStreamArgs {
    /// The defaults with these stream settings.
    pub fn to_config(&self, database_url: &str) -> walcast_outbox::OutboxConfig {
        let mut c = walcast_outbox::OutboxConfig::new(database_url);
        c.stream = self.stream.clone();
        c.replicas = self.replicas;
        c.max_age = Duration::from_secs(self.max_age_secs);
        c.duplicate_window = Duration::from_secs(self.duplicate_window_secs);
        c
    }
}

impl OutboxArgs {
    /// The relay's settings (`None` when disabled).
    pub fn to_config(&self, database_url: &str) -> Option<walcast_outbox::OutboxConfig> {
        if !self.enabled {
            return None;
        }
        let mut c = self.stream.to_config(database_url);
        c.ack_timeout = Duration::from_millis(self.ack_timeout_ms);
        c.max_in_flight = self.max_in_flight.max(1);
        c.max_queued = self.max_queued.max(1);
        c.max_queued_bytes = self.max_queued_bytes.max(1);
        c.retry.cap = Duration::from_millis(self.retry_max_ms);
        c.maintain_interval = Duration::from_secs(self.maintain_interval_secs.max(1));
        Some(c)
    }

    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "enabled": self.enabled,
            "stream": self.stream.stream,
            "replicas": self.stream.replicas,
            "max_age_secs": self.stream.max_age_secs,
            "duplicate_window_secs": self.stream.duplicate_window_secs,
            "ack_timeout_ms": self.ack_timeout_ms,
            "max_in_flight": self.max_in_flight,
            "max_queued": self.max_queued,
            "max_queued_bytes": self.max_queued_bytes,
            "retry_max_ms": self.retry_max_ms,
            "maintain_interval_secs": self.maintain_interval_secs,
        })
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RlsModeArg {
    Batched,
    Naive,
}

#[derive(Args, Clone, Debug)]
pub struct LeaseArgs {
    /// Leader election: `auto` (Kubernetes in a cluster, else Postgres), `kubernetes`,
    /// `postgres` (a lease row in `walcast.leases`), or `none` (always leader:
    /// development only).
    #[arg(long, env = "LEASE_MODE", default_value = "auto")]
    pub lease_mode: LeaseMode,
    /// Name of the lease (workers with the same name compete); defaults to the slot name
    /// (in Kubernetes mode made a valid object name: `walcast_cdc_slot` → `walcast-cdc-slot`).
    #[arg(long, env = "LEASE_NAME")]
    pub lease_name: Option<String>,
    /// Kubernetes namespace of the Lease object.
    #[arg(long, env = "LEASE_NAMESPACE", default_value = "default")]
    pub lease_namespace: String,
    /// Lease duration in seconds (at least 3): the holder renews every third of it and
    /// stops acting (fenced) a fifth of it before the lease could expire; a holder that
    /// stops renewing is replaced about one duration after its last renewal.
    #[arg(long, env = "LEASE_DURATION_SECS", default_value_t = 15)]
    pub lease_duration_secs: u64,
    /// Kubernetes mode: the API server's URL, used without credentials (e.g.
    /// `http://127.0.0.1:8001` through `kubectl proxy`); unset, the kubeconfig, else the
    /// in-cluster configuration (service account).
    #[arg(long, env = "LEASE_KUBE_API_URL", hide_env_values = true)]
    pub lease_kube_api_url: Option<String>,
    /// Kubernetes mode: the kubeconfig files (`:`-separated, merged as kubectl does);
    /// unset, `~/.kube/config`. A kubeconfig that cannot be read is an error.
    #[arg(long = "kubeconfig", env = "KUBECONFIG")]
    pub lease_kubeconfig: Option<std::ffi::OsString>,
    /// Kubernetes mode: the kubeconfig context to use; unset, its current context.
    #[arg(long, env = "LEASE_KUBE_CONTEXT")]
    pub lease_kube_context: Option<String>,
}

impl LeaseArgs {
    pub fn duration(&self) -> Duration {
        Duration::from_secs(self.lease_duration_secs.max(3))
    }
}

impl CdcArgs {
    /// The matcher's class limits.
    pub fn class_limits(&self) -> walcast_realtime::subscriptions::matcher::ClassLimits {
        walcast_realtime::subscriptions::matcher::ClassLimits {
            per_project: self.max_classes_per_project,
            per_front: self.max_classes_per_front,
            filter_bytes_per_project: self.max_filter_bytes_per_project,
            filter_bytes: self.max_filter_bytes,
        }
    }

    /// The default source: `DATABASE_URL` and `CDC_SLOT_NAME`.
    pub fn default_source(&self, db: &DbArgs) -> SourceSpec {
        SourceSpec {
            name: walcast_bus::source::DEFAULT_SOURCE.to_string(),
            database_url: db.database_url.clone(),
            replication_url: db.replication_url().to_string(),
            slot_name: self.slot_name.clone(),
            check_url: db.check_database_url.clone(),
        }
    }

    /// The pipeline's settings (slot, source, reading) for the default source.
    pub fn to_config(&self, db: &DbArgs, origin: &str) -> PipelineConfig {
        self.source_config(&self.default_source(db), origin)
    }

    /// The pipeline's settings for `source`.
    pub fn source_config(&self, source: &SourceSpec, origin: &str) -> PipelineConfig {
        PipelineConfig {
            database_url: source.database_url.clone(),
            replication_url: source.replication_url.clone(),
            source_name: source.name.clone(),
            allow_unbounded_wal: self.allow_unbounded_wal,
            source: self.source,
            ack_interval: Duration::from_millis(self.ack_interval_ms),
            heartbeat: Duration::from_millis(self.heartbeat_interval_ms),
            origin: origin.to_string(),
            take_over_slot: self.lease.lease_mode != LeaseMode::None,
            read: ReadConfig {
                slot: source.slot_name.clone(),
                min_batch: self.poll_batch,
                max_batch: self.poll_max_batch,
                idle: Duration::from_millis(self.poll_idle_ms),
                filter_refresh: Duration::from_millis(self.table_filter_refresh_ms),
            },
        }
    }

    /// Realtime delivery's settings (row-level security, record size).
    pub fn realtime_config(&self, db: &DbArgs) -> RealtimeConfig {
        let check = db.check_database_url.as_deref().unwrap_or_default();
        self.realtime_config_for(&db.database_url, check)
    }

    /// Realtime delivery's settings: its catalog on `database_url`, its checks on
    /// `check_url` (the check login).
    pub fn realtime_config_for(&self, database_url: &str, check_url: &str) -> RealtimeConfig {
        RealtimeConfig {
            projects: None,
            database_url: database_url.to_string(),
            check_url: check_url.to_string(),
            max_record_bytes: self.max_record_bytes,
            lanes: walcast_realtime::LaneLimits {
                max_lag: Duration::from_millis(self.max_lag_ms),
                max_bytes: self.max_lag_bytes,
            },
            links: walcast_realtime::LinkOptions {
                max_messages: self.resend_max_messages,
                max_bytes: self.resend_max_bytes,
                max_age: Duration::from_secs(self.resend_max_secs),
            },
            rls: RlsOptions {
                mode: match self.rls_mode {
                    RlsModeArg::Batched => RlsMode::Batched,
                    RlsModeArg::Naive => RlsMode::Naive,
                },
                max_batch: self.rls_batch.max(1),
                shards: usize::from(self.num_shards),
                timeout_ms: self.rls_check_timeout_ms,
                connections: usize::from(self.rls_connections),
            },
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct HttpArgs {
    /// HTTP port (health, metrics; WebSocket in the front).
    #[arg(long, env = "PORT", default_value_t = 4000)]
    pub port: u16,
    /// Address to bind.
    #[arg(long, env = "HOST", default_value = "0.0.0.0")]
    pub host: String,
    /// A new connection must send its whole first request head within this, in ms
    /// (else it is closed).
    #[arg(long, env = "HTTP_HEADER_TIMEOUT_MS", default_value_t = server::DEFAULT_HEADER_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout_ms: u64,
    /// A kept-alive connection must send its whole next request head within this of its
    /// last response, in ms (else it is closed).
    #[arg(long, env = "HTTP_IDLE_TIMEOUT_MS", default_value_t = server::DEFAULT_IDLE_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_ms: u64,
    /// Largest request head (request line and headers), in bytes, at least 8192 (larger:
    /// 431 and closed).
    #[arg(long, env = "HTTP_MAX_HEADER_BYTES", default_value_t = server::DEFAULT_MAX_HEADER_BYTES, value_parser = max_header_bytes)]
    pub max_header_bytes: usize,
    /// Most headers in a request (more: 431 and closed).
    #[arg(long, env = "HTTP_MAX_HEADERS", default_value_t = server::DEFAULT_MAX_HEADERS)]
    pub max_headers: usize,
    /// Connections not yet upgraded to a WebSocket (nor streaming SSE) at once; past it
    /// the one waiting longest is closed.
    #[arg(long, env = "HTTP_MAX_PENDING", default_value_t = server::DEFAULT_MAX_PENDING)]
    pub max_pending: usize,
    /// Of those, from one address (IPv4, or IPv6 /64); past it that address's connection
    /// waiting longest is closed; 0: no per-address cap (behind a proxy every client has
    /// the proxy's address).
    #[arg(long, env = "HTTP_MAX_PENDING_PER_PEER", default_value_t = server::DEFAULT_MAX_PENDING_PER_PEER)]
    pub max_pending_per_peer: usize,
}

use crate::server;

fn max_header_bytes(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if n < server::MIN_MAX_HEADER_BYTES {
        return Err(format!("at least {}", server::MIN_MAX_HEADER_BYTES));
    }
    Ok(n)
}

impl HttpArgs {
    /// The limits of the connections served.
    pub fn limits(&self) -> server::Limits {
        server::Limits {
            header_timeout: Duration::from_millis(self.header_timeout_ms),
            idle_timeout: Duration::from_millis(self.idle_timeout_ms),
            max_header_bytes: self.max_header_bytes,
            max_headers: self.max_headers,
            max_pending: self.max_pending,
            max_pending_per_peer: self.max_pending_per_peer,
        }
    }

    /// Bind `HOST:PORT`, to serve with these limits.
    pub async fn bind(&self) -> anyhow::Result<server::Listening> {
        use anyhow::Context;
        server::Listening::bind(&self.host, self.port, self.limits())
            .await
            .with_context(|| format!("binding {}:{}", self.host, self.port))
    }

    /// For the effective configuration.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "listen": format!("{}:{}", self.host, self.port),
            "header_timeout_ms": self.header_timeout_ms,
            "idle_timeout_ms": self.idle_timeout_ms,
            "max_header_bytes": self.max_header_bytes,
            "max_headers": self.max_headers,
            "max_pending": self.max_pending,
            "max_pending_per_peer": self.max_pending_per_peer,
        })
    }
}

pub use crate::telemetry::{LogArgs, LogFormat};

/// Connection strings (URLs and `key=value`) with their secrets hidden, for logs and the
/// effective configuration.
pub use walcast_core::redact::redact_url;

/// Whether an option read from the environment variable `env` may carry a secret (a
/// password in a URL, a key, a token): `--help` must not show its value. One that names
/// a file (`…_FILE`) or a duration (`…_SECS`, `…_MS`) holds none.
pub fn is_secret_env(env: &str) -> bool {
    let words: Vec<&str> = env.split('_').collect();
    let secret = ["URL", "SECRET", "PASSWORD", "KEY", "TOKEN", "JWKS", "CREDS"];
    !matches!(words.last(), Some(&("FILE" | "SECS" | "MS")))
        && words.iter().any(|w| secret.contains(w))
}

/// The options of `cmd` and its subcommands whose secret-bearing environment value
/// `--help` would show (see [`is_secret_env`]): `command env` pairs; empty when none.
pub fn secret_envs_shown(cmd: &clap::Command) -> Vec<String> {
    let mut shown: Vec<String> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_env_values_set())
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .filter(|e| is_secret_env(e))
        .map(|e| format!("{} {e}", cmd.get_name()))
        .collect();
    for sub in cmd.get_subcommands() {
        shown.extend(secret_envs_shown(sub));
    }
    shown
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn secret_names_are_recognised() {
        for e in [
            "DATABASE_URL",
            "NATS_PASSWORD",
            "MANAGEMENT_API_KEY",
            "JWT_JWKS",
        ] {
            assert!(is_secret_env(e), "{e}");
        }
        for e in [
            "NATS_CREDS_FILE",
            "NATS_NKEY_FILE",
            "SECRET_ROTATION_WINDOW_SECS",
            "PORT",
            "NATS_USER",
        ] {
            assert!(!is_secret_env(e), "{e}");
        }
    }

    #[test]
    fn help_shows_no_secret_environment_value() {
        for cmd in [
            crate::cdc_worker::CdcWorkerConfig::command(),
            crate::ws_front::WsFrontConfig::command(),
        ] {
            assert_eq!(secret_envs_shown(&cmd), Vec::<String>::new());
        }
    }
}
