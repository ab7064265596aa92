//! The CDC half of walcast: preflight checks, the replication slot, the realtime tables, and the path from the slot to the bus that never acknowledges a transaction
//! before all of its changes reached the bus.
//!
//! Structure of that path (one session, see [`run_fenced`]):
//! - a [`source::Source`] ([`poller::Poller`] or [`stream::Streamer`]) only reads wal2json
//!   lines and "caught up to LSN", and acknowledges what it is told;
//! - the [`driver::Driver`] frames lines into transactions ([`frame`]), hands them to the
//!   consumers, and owns the control logic: the table filter (the union of the consumers'
//!   tables), timers, `/health`, fence checks, and "every consumer's barrier, then
//!   acknowledge";
//! - each [`consumer::Consumer`] does something with the decoded transactions. Realtime
//!   delivery ([`realtime::RealtimeConsumer`]: registry edits, routing, matching, RLS, publishing,
//!   DDL notices) is one; [`run_with_consumers`] adds others next to it.

pub mod admin;
pub mod authorize;
pub mod catalog_change;
pub mod catalog_read;
pub mod channel_auth;
pub mod consumer;
pub mod db_broadcast;
pub mod driver;
pub mod event;
pub mod frame;
pub mod fronts;
pub mod health;
pub mod matcher;
pub mod migrate;
pub mod poller;
pub mod preflight;
pub mod projects;
pub mod realtime;
pub mod realtime_tables;
pub mod registrar;
pub mod rls;
pub mod rls_check;
pub mod rls_policy;
pub mod rls_sql;
pub mod roles;
pub mod signed;
pub mod slot;
pub mod source;
pub mod sql;
pub mod stream;
pub mod telemetry;
pub mod types;
pub mod visibility;

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use walcast_bus::Bus;
use walcast_lease::{Action, Fence};

pub use authorize::RlsMode;
pub use consumer::Consumer;
pub use health::{CdcHealth, CdcHealthReport};
pub use preflight::PreflightError;
pub use realtime::RlsOptions;
pub use source::ReadConfig;
pub use source::{Source, SourceKind};

/// Builds an extra consumer of decoded transactions for each session (see
/// [`run_with_consumers`]).
pub type ConsumerFactory = Arc<dyn Fn() -> Box<dyn Consumer> + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum CdcError {
    #[error(transparent)]
    Preflight(#[from] PreflightError),
    #[error("database: {}", db_message(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("realtime tables: {0}")]
    RealtimeTables(#[from] realtime_tables::RealtimeTablesError),
    #[error("migrations: {0}")]
    Migrate(#[from] migrate::MigrateError),
    #[error("cannot decode wal2json output ({error}): {line}")]
    Decode { error: String, line: String },
    #[error("building event: {0}")]
    Event(#[from] event::EventError),
    #[error("bus: {0}")]
    Bus(#[from] walcast_bus::BusError),
    #[error("replication slot {0:?} was lost (WAL removed past max_slot_wal_keep_size)")]
    SlotLost(String),
    #[error("replication slot {0:?} disappeared")]
    SlotMissing(String),
    /// The RLS checker has no connection to check with (a bug, not a configuration).
    #[error("no RLS connection: {0}")]
    RlsUnavailable(&'static str),
    #[error("replication stream: {0}")]
    Repl(#[from] walcast_pgrepl::ReplError),
    #[error("the server ended the replication stream")]
    StreamEnded,
    #[error("postgres TLS: {0}")]
    Tls(#[from] walcast_pgtls::PgTlsError),
    /// The catalog snapshot does not show the state at the position being judged (see
    /// [`catalog_change`]): what depends on it is withheld.
    #[error("catalog state does not match the WAL position (position {view}, snapshot epoch {snapshot:?}, {})", if *.ahead { "snapshot ahead" } else { "snapshot behind" })]
    CatalogMoved {
        view: String,
        snapshot: Option<i64>,
        ahead: bool,
    },
    /// A consumer other than realtime delivery failed (retried like any transient fault).
    #[error("{consumer}: {message}")]
    Consumer {
        consumer: &'static str,
        message: String,
    },
    /// Our leadership term's fence closed: stop, publish and acknowledge nothing more.
    #[error(transparent)]
    Fenced(#[from] walcast_lease::Fenced),
}

/// A database error with the server's message (tokio-postgres' own display says only
/// "db error").
pub fn db_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{}: {} ({})", d.severity(), d.message(), d.code().code()),
        None => e.to_string(),
    }
}

impl CdcError {
    /// Errors that retrying cannot fix: configuration the operator must change.
    pub fn is_fatal(&self) -> bool {
        matches!(self, CdcError::Preflight(e) if e.is_fatal())
    }
}

#[derive(Clone, Debug)]
pub struct CdcConfig {
    /// For the catalog (types, the realtime-table registry) and the RLS checks:
    /// `DATABASE_URL`.
    pub database_url: String,
    /// For the slot (preflight, slot management, polling or streaming): a role with
    /// `REPLICATION`; `POSTGRES_REPLICATION_URL`, else `DATABASE_URL`.
    pub replication_url: String,
    /// Which source reads the slot: SQL polling or the streaming protocol.
    pub source: SourceKind,
    /// How either source reads it (slot, batch sizes, idle wait, table-filter refresh).
    pub read: ReadConfig,
    /// Stream mode: how often progress is acknowledged.
    pub ack_interval: Duration,
    pub allow_unbounded_wal: bool,
    /// This instance's id, sent as `Walcast-Origin`.
    pub origin: String,
    /// We were elected: a session still reading the slot belongs to a worker that lost
    /// its leadership (typically one that was killed while Postgres still runs its last
    /// query), so terminate it instead of waiting for it.
    pub take_over_slot: bool,
    /// How row-level security is checked (batching, shards, timeout).
    pub rls: realtime::RlsOptions,
    /// A change whose values are larger is delivered without them (`Error 413`).
    pub max_record_bytes: usize,
}

/// Default of [`CdcConfig::max_record_bytes`]: 1 MiB, as Supabase's `max_record_bytes`.
pub const DEFAULT_MAX_RECORD_BYTES: usize = 1024 * 1024;
/// Default of [`realtime::RlsOptions::max_batch`]: changes authorized together.
pub const DEFAULT_RLS_BATCH: usize = 1000;
/// Default of [`realtime::RlsOptions::shards`]: projects hash onto this many pipelines.
pub const DEFAULT_SHARDS: u16 = 4;
/// Default of [`realtime::RlsOptions::timeout_ms`]: statement_timeout of an RLS check.
pub const DEFAULT_RLS_CHECK_TIMEOUT_MS: u64 = 5000;
/// Default of [`realtime::RlsOptions::connections`]: RLS connections per shard.
pub const DEFAULT_RLS_CONNECTIONS: u16 = 2;

/// Connect (TLS as the URL's `sslmode` and `sslrootcert` say, see [`walcast_pgtls`]),
/// logging (not panicking) when the connection ends.
pub async fn connect(url: &str) -> Result<Client, CdcError> {
    walcast_pgtls::connect(url).await.map_err(|e| match e {
        walcast_pgtls::ConnectError::Tls(e) => CdcError::Tls(e),
        walcast_pgtls::ConnectError::Postgres(e) => CdcError::Db(e),
    })
}

/// Run the pipeline, without leader election, until `cancel` fires: see [`run_fenced`].
pub async fn run(
    cfg: CdcConfig,
    bus: Bus,
    matcher: Arc<matcher::Matcher>,
    health: Arc<CdcHealth>,
    cancel: CancellationToken,
) -> Result<(), CdcError> {
    run_fenced(cfg, bus, matcher, health, Fence::unfenced(cancel)).await
}

/// Run the pipeline for one leadership term, until the fence's token is cancelled.
/// Every publish and every acknowledgement checks the fence first; once it is closed the
/// term ends with nothing more published or acknowledged. Transient failures (connection
/// loss, a slot still held by a dying session, a lost slot) are retried with backoff
/// while `/health` reports `cdc_active: false`; configuration errors are returned at once.
pub async fn run_fenced(
    cfg: CdcConfig,
    bus: Bus,
    matcher: Arc<matcher::Matcher>,
    health: Arc<CdcHealth>,
    fence: Fence,
) -> Result<(), CdcError> {
    run_with_consumers(cfg, bus, matcher, health, fence, Vec::new()).await
}

/// [`run_fenced`] with more consumers of the decoded transactions next to realtime
/// delivery: each session builds one of each, decodes the union of their tables, and
/// acknowledges a position only after every consumer's barrier.
pub async fn run_with_consumers(
    cfg: CdcConfig,
    bus: Bus,
    matcher: Arc<matcher::Matcher>,
    health: Arc<CdcHealth>,
    fence: Fence,
    consumers: Vec<ConsumerFactory>,
) -> Result<(), CdcError> {
    let cancel = fence.token().clone();
    let mut backoff = Duration::from_millis(100);
    loop {
        let result = tokio::select! {
            r = session(&cfg, &bus, &matcher, &health, &fence, &consumers) => r,
            _ = cancel.cancelled() => Ok(()),
        };
        health.set_active(false);
        match result {
            Ok(()) => return Ok(()),
            Err(CdcError::Fenced(e)) => {
                health.set_error(Some(e.to_string()));
                return Ok(());
            }
            Err(e) if e.is_fatal() => {
                health.set_error(Some(e.to_string()));
                return Err(e);
            }
            Err(e) => {
                metrics::counter!(crate::telemetry::SOURCE_ERRORS).increment(1);
                tracing::error!(error = %e, retry_in_ms = backoff.as_millis() as u64, "cdc pipeline failed; retrying");
                health.set_error(Some(e.to_string()));
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

async fn session(
    cfg: &CdcConfig,
    bus: &Bus,
    matcher: &Arc<matcher::Matcher>,
    health: &Arc<CdcHealth>,
    fence: &Fence,
    extra: &[ConsumerFactory],
) -> Result<(), CdcError> {
    let client = connect(&cfg.replication_url).await?;
    let catalog = connect(&cfg.database_url).await?;
    let report = match preflight::preflight(&client, &cfg.read.slot, cfg.allow_unbounded_wal).await
    {
        Err(PreflightError::SlotInUse { pid, .. }) if cfg.take_over_slot => {
            fence.check(Action::Slot)?;
            tracing::warn!(pid, slot = %cfg.read.slot, "slot still held by a former leader's session: terminating it");
            client
                .execute("SELECT pg_terminate_backend($1)", &[&pid])
                .await?;
            return Err(PreflightError::SlotInUse {
                slot: cfg.read.slot.clone(),
                pid,
            }
            .into());
        }
        other => other?,
    };
    // Creating, or dropping a lost slot to recreate it, only while we may lead.
    fence.check(Action::Slot)?;
    let slot = slot::ensure_slot(&client, &cfg.read.slot, report.major, health).await?;
    tracing::info!(
        slot = %cfg.read.slot,
        confirmed_flush = %slot.confirmed_flush,
        created = slot.created,
        server = %report.server_version,
        "replication slot ready"
    );
    let catalog_tracking = catalog_tracking(&client, cfg, &slot, health).await?;
    let message_key = signed::load_key(&catalog).await?;
    let realtime = realtime::RealtimeConsumer::new(
        bus.clone(),
        matcher.clone(),
        catalog,
        realtime::RealtimeOptions {
            origin: cfg.origin.clone(),
            database_url: cfg.database_url.clone(),
            rls: cfg.rls.clone(),
            max_record_bytes: cfg.max_record_bytes,
            health: health.clone(),
            fence: fence.clone(),
            slot: cfg.read.slot.clone(),
            catalog: catalog_tracking,
        },
    )
    .await?;
    let db_broadcast =
        db_broadcast::DbBroadcast::new(bus.clone(), health.clone(), cfg.max_record_bytes);
    let mut consumers: Vec<Box<dyn Consumer>> = vec![Box::new(realtime), Box::new(db_broadcast)];
    consumers.extend(extra.iter().map(|make| make()));
    let driver = driver::Driver::new(
        driver::DriverOptions {
            client: Some(&client),
            slot: cfg.read.slot.clone(),
            health,
            fence: fence.clone(),
            refresh: cfg.read.filter_refresh,
            confirmed: slot.confirmed_flush,
            message_key,
        },
        consumers,
    );
    read(cfg, &client, driver, slot.confirmed_flush, fence.token()).await
}

/// Run the driver on the configured source.
async fn read(
    cfg: &CdcConfig,
    client: &Client,
    driver: driver::Driver<'_>,
    confirmed: walcast_wal2json::Lsn,
    cancel: &CancellationToken,
) -> Result<(), CdcError> {
    match cfg.source {
        SourceKind::Poll => {
            let mut poller = poller::Poller::new(&cfg.read, client, confirmed);
            driver.run(&mut poller, cancel).await
        }
        SourceKind::Stream => {
            let stream_cfg = stream::StreamConfig {
                slot: cfg.read.slot.clone(),
                url: cfg.replication_url.clone(),
                ack_interval: cfg.ack_interval,
            };
            driver
                .run(&mut stream::Streamer::new(&stream_cfg), cancel)
                .await
        }
    }
}

/// Event triggers where possible (see [`catalog_change`]), and the epoch at the slot's
/// position; reported in `/health` and warned about once when missing.
async fn catalog_tracking(
    client: &Client,
    cfg: &CdcConfig,
    slot: &slot::SlotState,
    health: &CdcHealth,
) -> Result<realtime::CatalogTracking, CdcError> {
    let tracking = catalog_change::ensure_triggers(client).await?;
    let changed = health.set_ddl_tracking(tracking.name());
    metrics::gauge!(telemetry::DDL_EVENT_TRIGGER).set(match tracking {
        catalog_change::Tracking::EventTrigger => 1.0,
        catalog_change::Tracking::PerBatch(_) => 0.0,
    });
    let resume = match &tracking {
        catalog_change::Tracking::EventTrigger => {
            let resume = catalog_change::resume_at(
                client,
                &cfg.read.slot,
                slot.confirmed_flush,
                slot.created,
            )
            .await?;
            if resume.seen.is_none() {
                tracing::warn!("the DDL epoch at the slot's position is unknown (DDL committed before the event triggers existed): catalog facts are taken as read until the next DDL notice");
            }
            resume
        }
        catalog_change::Tracking::PerBatch(why) => {
            if changed {
                tracing::warn!(reason = %why, "DDL and GRANT/REVOKE are not tracked at their WAL position: every batch re-reads privileges and columns instead (see the README's guarantees)");
            }
            catalog_change::Resume::default()
        }
    };
    Ok(realtime::CatalogTracking::new(tracking, resume))
}
