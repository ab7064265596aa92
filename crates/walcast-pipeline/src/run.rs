//! The retry loop of a leadership term and the assembly of one session: connect,
//! preflight, slot, consumers (each from its factory, each with its publisher), driver,
//! source.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use walcast_bus::Bus;
use walcast_core::Backoff;
use walcast_lease::{Action, Fence};
use walcast_wal2json::Lsn;

use crate::config::PipelineConfig;
use crate::consumer::Consumer;
use crate::driver::{Driver, DriverOptions};
use crate::error::{ConsumerError, PipelineError, Retry};
use crate::health::PipelineHealth;
use crate::preflight::{self, PreflightError};
use crate::publisher::Publisher;
use crate::slot::{self, SlotState};
use crate::source::{self, SourceKind};
use crate::{heartbeat, signed, telemetry};

/// Waits between failed sessions: 100 ms, doubling up to 5 s.
const SESSION_BACKOFF: Backoff = Backoff {
    base: Duration::from_millis(100),
    cap: Duration::from_secs(5),
};

/// What a session offers the consumers it builds.
pub struct Session<'a> {
    /// The slot's SQL connection (`POSTGRES_REPLICATION_URL`), for reads that must see
    /// the slot (its position, the catalog at it).
    pub replication: &'a Client,
    /// The slot as this session found or made it.
    pub slot: &'a SlotState,
    pub config: &'a PipelineConfig,
    pub health: &'a Arc<PipelineHealth>,
    publisher: Publisher,
}

impl Session<'_> {
    /// The publisher a consumer named `consumer` sends through (see [`Publisher`]).
    pub fn publisher(&self, consumer: &'static str) -> Publisher {
        self.publisher.for_consumer(consumer)
    }
}

/// Makes a consumer for each session (after a failure the next session starts from the
/// last acknowledged position with fresh consumers).
pub trait ConsumerFactory: Send + Sync {
    fn build<'a>(
        &'a self,
        session: &'a Session<'a>,
    ) -> BoxFuture<'a, Result<Box<dyn Consumer>, ConsumerError>>;
}

struct FnFactory<F>(F);

impl<F> ConsumerFactory for FnFactory<F>
where
    F: Fn(&Session<'_>) -> Box<dyn Consumer> + Send + Sync,
{
    fn build<'a>(
        &'a self,
        session: &'a Session<'a>,
    ) -> BoxFuture<'a, Result<Box<dyn Consumer>, ConsumerError>> {
        let consumer = (self.0)(session);
        Box::pin(async move { Ok(consumer) })
    }
}

/// A factory from a closure that builds a consumer without waiting.
pub fn factory(
    make: impl Fn(&Session<'_>) -> Box<dyn Consumer> + Send + Sync + 'static,
) -> Arc<dyn ConsumerFactory> {
    Arc::new(FnFactory(make))
}

/// Connect (TLS as the URL's `sslmode` and `sslrootcert` say, see [`walcast_pgtls`]),
/// logging (not panicking) when the connection ends.
pub async fn connect(url: &str) -> Result<Client, PipelineError> {
    Ok(walcast_pgtls::connect(url).await?)
}

/// Run the pipeline for one leadership term, until the fence's token is cancelled.
/// Every publish and every acknowledgement (and every heartbeat, when on) checks the
/// fence first; once it is closed the term ends with nothing more published or
/// acknowledged. Transient failures (connection
/// loss, a slot still held by a dying session, a lost slot, a consumer's transient
/// fault) are retried with backoff while `/health` reports `cdc_active: false`;
/// configuration errors are returned at once.
pub async fn run(
    cfg: PipelineConfig,
    bus: Bus,
    health: Arc<PipelineHealth>,
    fence: Fence,
    consumers: Vec<Arc<dyn ConsumerFactory>>,
) -> Result<(), PipelineError> {
    let cancel = fence.token().clone();
    let publisher = Publisher::for_source(bus, fence.clone(), cfg.origin.clone(), &cfg.source_name);
    // Beside the sessions, for this term only (stopped when `run` returns).
    let _heartbeat = heartbeat::start(&cfg.database_url, cfg.heartbeat, &fence, &health);
    let mut failures = 0u32;
    loop {
        let result = tokio::select! {
            r = session(&cfg, &publisher, &health, &fence, &consumers) => r,
            _ = cancel.cancelled() => Ok(()),
        };
        health.set_active(false);
        let Err(e) = result else { return Ok(()) };
        let term_over = e.retry() == Retry::Fenced || cancel.is_cancelled();
        if term_over || fence.check(Action::Read).is_err() {
            // The term is over: another worker leads, or soon will. Neither the fence
            // nor what losing the term caused (our walsender ended by the new leader)
            // is a failure of the source: `/health` and the beacon, which tell the
            // fronts whether to warn its subscribers, keep no error for it.
            tracing::info!(error = %e, "leadership term over: the pipeline stops");
            return Ok(());
        }
        health.set_error(Some(e.to_string()));
        if e.retry() == Retry::Never {
            return Err(e);
        }
        let wait = SESSION_BACKOFF.delay(failures);
        failures = failures.saturating_add(1);
        metrics::counter!(telemetry::SOURCE_ERRORS).increment(1);
        tracing::error!(error = %e, retry_in_ms = wait.as_millis() as u64, "cdc pipeline failed; retrying");
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

async fn session(
    cfg: &PipelineConfig,
    publisher: &Publisher,
    health: &Arc<PipelineHealth>,
    fence: &Fence,
    factories: &[Arc<dyn ConsumerFactory>],
) -> Result<(), PipelineError> {
    let client = connect(&cfg.replication_url).await?;
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
    let message_key = signed::load_key(&connect(&cfg.database_url).await?).await?;
    let consumers = build_consumers(&client, &slot, cfg, health, publisher, factories).await?;
    let driver = Driver::new(
        DriverOptions {
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

/// One consumer from each factory, in order.
async fn build_consumers(
    client: &Client,
    slot: &SlotState,
    config: &PipelineConfig,
    health: &Arc<PipelineHealth>,
    publisher: &Publisher,
    factories: &[Arc<dyn ConsumerFactory>],
) -> Result<Vec<Box<dyn Consumer>>, PipelineError> {
    let session = Session {
        replication: client,
        slot,
        config,
        health,
        publisher: publisher.clone(),
    };
    let mut consumers = Vec::with_capacity(factories.len());
    for f in factories {
        let consumer = f
            .build(&session)
            .await
            .map_err(|source| PipelineError::Consumer {
                consumer: "factory",
                source,
            })?;
        consumers.push(consumer);
    }
    Ok(consumers)
}

/// Run the driver on the configured source.
async fn read(
    cfg: &PipelineConfig,
    client: &Client,
    driver: Driver<'_>,
    confirmed: Lsn,
    cancel: &CancellationToken,
) -> Result<(), PipelineError> {
    match cfg.source {
        SourceKind::Poll => {
            // As the stream's sessions (walcast_pgrepl::BYTEA_HEX): wal2json cuts the
            // `\x` of a bytea's hex output, whatever the output is.
            client.batch_execute("SET bytea_output = hex").await?;
            let mut poller = source::Poller::new(&cfg.read, client, confirmed);
            driver.run(&mut poller, cancel).await
        }
        SourceKind::Stream => {
            let stream_cfg = source::StreamConfig {
                slot: cfg.read.slot.clone(),
                url: cfg.replication_url.clone(),
                ack_interval: cfg.ack_interval,
            };
            driver
                .run(&mut source::Streamer::new(&stream_cfg), cancel)
                .await
        }
    }
}
