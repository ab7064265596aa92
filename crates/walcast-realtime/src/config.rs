//! What realtime delivery is configured with, each default defined once here (the
//! binaries' options use these constants).

/// Default of [`RealtimeConfig::max_record_bytes`]: 1 MiB, as Supabase's `max_record_bytes`.
pub use walcast_pipeline::change_event::DEFAULT_MAX_RECORD_BYTES;
/// Default of [`RlsOptions::max_batch`]: changes authorized together.
pub const DEFAULT_RLS_BATCH: usize = 1000;
/// Default of [`RlsOptions::shards`]: delivery lanes (each project its own, up to this
/// many; beyond, projects share them by hash).
pub const DEFAULT_SHARDS: u16 = 16;
/// Default of [`LaneLimits::max_lag`]: 10 s.
pub const DEFAULT_MAX_LAG_MS: u64 = 10_000;
/// Default of [`LaneLimits::max_bytes`]: 64 MiB per lane.
pub const DEFAULT_MAX_LAG_BYTES: usize = 64 * 1024 * 1024;
/// Default of [`RlsOptions::timeout_ms`]: statement_timeout of an RLS check.
pub const DEFAULT_RLS_CHECK_TIMEOUT_MS: u64 = 5000;
/// Default of [`RlsOptions::connections`]: RLS connections per shard.
pub const DEFAULT_RLS_CONNECTIONS: u16 = 2;

/// Default of [`LinkOptions::max_messages`]: messages kept per front for resending.
pub const DEFAULT_RESEND_MESSAGES: usize = 10_000;
/// Default of [`LinkOptions::max_bytes`]: bytes kept per front for resending (16 MiB).
pub const DEFAULT_RESEND_BYTES: usize = 16 * 1024 * 1024;
/// Default of [`LinkOptions::max_age`], in seconds.
pub const DEFAULT_RESEND_SECS: u64 = 30;

/// What the leader keeps of what it sent each front, to resend what a front missed (see
/// `delivery/links.rs`): the oldest goes first past any bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkOptions {
    pub max_messages: usize,
    pub max_bytes: usize,
    pub max_age: std::time::Duration,
}

impl Default for LinkOptions {
    fn default() -> Self {
        LinkOptions {
            max_messages: DEFAULT_RESEND_MESSAGES,
            max_bytes: DEFAULT_RESEND_BYTES,
            max_age: std::time::Duration::from_secs(DEFAULT_RESEND_SECS),
        }
    }
}

/// Realtime delivery's own settings (the slot and sources are the pipeline's).
#[derive(Clone, Debug)]
pub struct RealtimeConfig {
    /// For the catalog (types, the realtime tables): `DATABASE_URL`, walcast's own login.
    pub database_url: String,
    /// For the RLS checks, run as each subscriber: `CHECK_DATABASE_URL`, the check login
    /// (see [`walcast_control::check_login`]).
    pub check_url: String,
    /// How row-level security is checked (batching, shards, timeout).
    pub rls: RlsOptions,
    /// A change whose values are larger is delivered without them (`Error 413`).
    pub max_record_bytes: usize,
    /// How far a project's delivery may fall behind.
    pub lanes: LaneLimits,
    /// What is kept per front to resend.
    pub links: LinkOptions,
    /// The projects this pipeline's source holds (README "Sources"): anything read for
    /// another project is dropped. `None`: every project (a single-database tool).
    pub projects: Option<std::sync::Arc<walcast_control::source_projects::SourceProjects>>,
}

/// How far a project's delivery lane may fall behind (see `delivery/lanes.rs`).
#[derive(Clone, Copy, Debug)]
pub struct LaneLimits {
    /// A batch waiting longer is skipped (its subscribers told).
    pub max_lag: std::time::Duration,
    /// Past this many bytes waiting, new batches are skipped at once.
    pub max_bytes: usize,
}

impl Default for LaneLimits {
    fn default() -> Self {
        LaneLimits {
            max_lag: std::time::Duration::from_millis(DEFAULT_MAX_LAG_MS),
            max_bytes: DEFAULT_MAX_LAG_BYTES,
        }
    }
}

impl RealtimeConfig {
    /// The defaults, against `database_url`, checking on `check_url`.
    pub fn new(database_url: &str, check_url: &str) -> RealtimeConfig {
        RealtimeConfig {
            database_url: database_url.to_string(),
            check_url: check_url.to_string(),
            rls: RlsOptions::default(),
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            lanes: LaneLimits::default(),
            links: LinkOptions::default(),
            projects: None,
        }
    }
}

/// How row-level security is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RlsMode {
    /// One statement per (table, role, claims) per batch, all in one round trip.
    #[default]
    Batched,
    /// One check per subscriber per change, one statement per round trip: the cost of
    /// the straightforward approach, kept for benchmarks.
    Naive,
}

/// How changes are authorized (see the authorizer, `authorize/`).
#[derive(Clone, Debug)]
pub struct RlsOptions {
    pub mode: RlsMode,
    /// Changes held for one authorization round (and published after it), at most.
    pub max_batch: usize,
    /// Delivery lanes, each with its own RLS checker and connections: each project has
    /// its own (its changes leave in order while other projects' run beside it), up to
    /// this many; beyond, projects share them by hash.
    pub shards: usize,
    /// `statement_timeout` of each check, in milliseconds.
    pub timeout_ms: u64,
    /// Connections per lane that a batch with many groups is spread over (a project's
    /// checks then use more than one core of the database).
    pub connections: usize,
}

impl Default for RlsOptions {
    fn default() -> Self {
        RlsOptions {
            mode: RlsMode::Batched,
            max_batch: DEFAULT_RLS_BATCH,
            shards: usize::from(DEFAULT_SHARDS),
            timeout_ms: DEFAULT_RLS_CHECK_TIMEOUT_MS,
            connections: usize::from(DEFAULT_RLS_CONNECTIONS),
        }
    }
}
