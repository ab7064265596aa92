//! A source's leader: everything only the leader of a source does, one term at a time
//! (answer the fronts' registrations and admin requests on the source's subjects, send
//! each front its numbered stream, read the slot), and what it is built from.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::admin::AdminHandler;
use walcast_bus::subs::{KnownFronts, FRONT_ALIVE};
use walcast_bus::Bus;
use walcast_lease::Fence;
use walcast_pipeline::PipelineHealth;
use walcast_realtime::subscriptions::matcher::Matcher;
use walcast_realtime::subscriptions::registrar::Registrar;

use crate::config::{CdcArgs, SourceSpec};
use walcast_control::source_projects::{SourceProjects, REFRESH};

/// What a source's leader is made of, besides the source itself.
pub(crate) struct Parts<'a> {
    pub cdc: &'a CdcArgs,
    pub origin: &'a str,
    pub bus: &'a Bus,
    pub registrar: Registrar,
    pub admin: Arc<dyn AdminHandler>,
    pub known_fronts: KnownFronts,
    /// The projects the control database puts on the source.
    pub projects: Arc<SourceProjects>,
    /// What its pipeline reports to (the source's, kept across terms and rebuilds).
    pub health: Arc<PipelineHealth>,
    /// Cancelled when the pipeline fails for good (the process stops); `None`: a failure
    /// ends the term only (another source's failure must not stop this process).
    pub root: Option<CancellationToken>,
}

/// Drop subscriptions of fronts that stopped syncing (died).
pub(crate) fn spawn_front_expiry(
    tracker: &TaskTracker,
    source: &str,
    matcher: Arc<Matcher>,
    cancel: CancellationToken,
) {
    tracker.spawn(walcast_core::source_scope::within(source, async move {
        let mut tick = tokio::time::interval(walcast_bus::subs::SYNC_INTERVAL);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => { matcher.expire_dead_fronts(); }
            }
        }
    }));
}

/// The outbox relay relays only the events of the source's projects.
struct OutboxGate(Arc<SourceProjects>);

impl walcast_outbox::config::ProjectGate for OutboxGate {
    fn admits<'a>(
        &'a self,
        project: &'a str,
    ) -> futures_util::future::BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move {
            self.0
                .admits(project, "outbox")
                .await
                .map_err(|e| e.to_string())
        })
    }
}

pub(crate) struct Leader {
    /// The source this leader reads.
    source: String,
    cfg: walcast_pipeline::PipelineConfig,
    bus: Bus,
    registrar: Registrar,
    admin: Arc<dyn AdminHandler>,
    health: Arc<PipelineHealth>,
    known_fronts: KnownFronts,
    /// Each front's numbered stream: heartbeats and resends while leading.
    links: Arc<walcast_realtime::FrontLinks>,
    /// The consumers of the WAL: realtime delivery, then the outbox relay when on.
    consumers: Vec<std::sync::Arc<dyn walcast_pipeline::ConsumerFactory>>,
    /// The snapshotter run by each term, and the board it shares with the change-stream
    /// consumer (when change streams are on).
    snapshots: Option<(
        walcast_changes::snapshot::SnapshotConfig,
        Arc<walcast_changes::snapshot::Board>,
    )>,
    /// The outbox tables' partition maintenance, run by each term.
    maintenance: Option<walcast_outbox::maintain::Maintenance>,
    /// The source's projects (read again while leading).
    projects: Arc<SourceProjects>,
    failure: std::sync::Mutex<Option<walcast_pipeline::PipelineError>>,
    /// Cancelled when the pipeline fails for good: the process stops (`None`: only the
    /// term ends).
    root: Option<CancellationToken>,
}

impl Leader {
    /// The leader of `spec`, and its outbox relay's health (when the relay is on).
    pub(crate) fn build(
        spec: &SourceSpec,
        p: Parts<'_>,
    ) -> (Leader, Option<Arc<walcast_outbox::OutboxHealth>>) {
        let tag = crate::election::source_tag(p.origin, &spec.name);
        let mut cfg = p.cdc.source_config(spec, p.origin);
        // Tagged: a worker taking over terminates the stale leader's sessions by this tag.
        cfg.database_url = walcast_lease::postgres::tagged_url(&cfg.database_url, &tag);
        cfg.replication_url = walcast_lease::postgres::tagged_url(&cfg.replication_url, &tag);
        let check_url = spec.check_url.as_deref().unwrap_or_default();
        let mut realtime = p.cdc.realtime_config_for(&spec.database_url, check_url);
        realtime.database_url = cfg.database_url.clone();
        realtime.check_url = walcast_lease::postgres::tagged_url(check_url, &tag);
        realtime.projects = Some(p.projects.clone());
        let (outbox, outbox_health) = outbox_consumer(p.cdc, &cfg, p.bus, &p.projects);
        let links = walcast_realtime::FrontLinks::new(realtime.links);
        let matcher = p.registrar.matcher().clone();
        let mut consumers = walcast_realtime::factories(realtime, matcher, links.clone());
        consumers.extend(outbox);
        let (changes, snapshots) = change_stream(p.cdc, &cfg, p.bus, &p.projects).unzip();
        consumers.extend(changes);
        let snapshots = snapshots.flatten();
        let maintenance = outbox_maintenance(p.cdc, &cfg);
        let leader = Leader {
            source: spec.name.clone(),
            cfg,
            bus: p.bus.clone(),
            registrar: p.registrar,
            admin: p.admin,
            health: p.health,
            known_fronts: p.known_fronts,
            links,
            consumers,
            snapshots,
            maintenance,
            projects: p.projects,
            failure: Default::default(),
            root: p.root,
        };
        (leader, outbox_health)
    }

    /// The subscriptions it answers for.
    pub(crate) fn registrar(&self) -> &Registrar {
        &self.registrar
    }

    /// Whether a failure of its pipeline for good stops the process (the default source).
    pub(crate) fn stops_process(&self) -> bool {
        self.root.is_some()
    }

    /// Why its last term's pipeline stopped for good, if it did (taken).
    pub(crate) fn take_failure(&self) -> Option<walcast_pipeline::PipelineError> {
        self.failure.lock().ok().and_then(|mut f| f.take())
    }
}

impl Leader {
    /// Lead one term, as work for the leader's source (its metrics carry `source`).
    pub(crate) async fn term(self: Arc<Self>, fence: Fence) {
        let source = self.source.clone();
        walcast_core::source_scope::within(&source, self.lead(fence)).await
    }

    async fn lead(self: Arc<Self>, fence: Fence) {
        let term = fence.token().clone();
        self.health.set_leader(true);
        let projects = self.spawn_projects(&term).await;
        let maintenance = self.spawn_maintenance(&fence);
        let links = self.spawn_links(&fence);
        let responder = self.serve_fronts(&term).await;
        let snapshots = self.spawn_snapshots(&term);
        let run = walcast_pipeline::run(
            self.cfg.clone(),
            self.bus.clone(),
            self.health.clone(),
            fence.clone(),
            self.consumers.clone(),
        );
        if let Err(e) = run.await {
            tracing::error!(source = %self.source, error = %e, "the pipeline stopped for good");
            self.health.set_error(Some(e.to_string()));
            if let Ok(mut f) = self.failure.lock() {
                *f = Some(e);
            }
            if let Some(root) = &self.root {
                root.cancel();
            }
        }
        term.cancel();
        if let Some(t) = responder {
            let _ = t.await;
        }
        if let Some(t) = maintenance {
            let _ = t.await;
        }
        let _ = links.await;
        let _ = projects.await;
        if let Some(t) = snapshots {
            let _ = t.await;
        }
        self.health.set_leader(false);
    }

    /// Read the source's projects now, then every [`REFRESH`] until the term ends.
    async fn spawn_projects(&self, term: &CancellationToken) -> tokio::task::JoinHandle<()> {
        if let Err(e) = self.projects.refresh().await {
            tracing::warn!(source = %self.source, error = %e, "cannot read the source's projects from the control database; retrying");
        }
        let (projects, stop) = (self.projects.clone(), term.clone());
        walcast_core::source_scope::spawn(async move {
            let mut tick = tokio::time::interval(REFRESH);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                if let Err(e) = projects.refresh().await {
                    tracing::warn!(source = %projects.source(), error = %e, "cannot read the source's projects from the control database");
                }
            }
        })
    }

    /// This term's heartbeats to the fronts and answers to their resend requests (see
    /// `walcast_realtime::delivery::links`), until the term ends.
    fn spawn_links(&self, fence: &Fence) -> tokio::task::JoinHandle<()> {
        let publisher = walcast_pipeline::Publisher::for_source(
            self.bus.clone(),
            fence.clone(),
            self.cfg.origin.clone(),
            &self.source,
        )
        .for_consumer("links");
        let (links, bus, stop) = (self.links.clone(), self.bus.clone(), fence.token().clone());
        let lead = links.clone().lead(
            publisher,
            self.registrar.matcher().clone(),
            stop.clone().cancelled_owned(),
        );
        let source = self.source.clone();
        walcast_core::source_scope::spawn(async move {
            let handler = links.handler();
            let serve = walcast_bus::links::serve_nats(&bus, &source, handler, stop.cancelled());
            let (_, served) = tokio::join!(lead, serve);
            if let Err(e) = served {
                tracing::error!(error = %e, "resend requests stopped");
            }
        })
    }

    /// This term's snapshotter (`walcast snapshot`), until the term ends.
    fn spawn_snapshots(&self, term: &CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        let (cfg, board) = self.snapshots.clone()?;
        let runner = walcast_changes::snapshot::Snapshotter::new(cfg, board, self.health.clone());
        Some(walcast_core::source_scope::spawn(runner.run(term.clone())))
    }

    /// The outbox partition maintenance of this term: at once, then every interval, while
    /// the fence is open; it ends with the term.
    fn spawn_maintenance(&self, fence: &Fence) -> Option<tokio::task::JoinHandle<()>> {
        let m = self.maintenance.clone()?;
        let (gate, stop) = (fence.clone(), fence.token().clone());
        Some(walcast_core::source_scope::spawn(
            m.run(move || gate.is_open(), stop.cancelled_owned()),
        ))
    }

    /// Over NATS: answer the fronts' registrations and admin requests for this term, and
    /// return once the fronts registered again (each subscription from its own position),
    /// so the backlog is matched against all of them before anything is decoded.
    async fn serve_fronts(&self, term: &CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        if !matches!(self.bus, Bus::Nats(_)) {
            return None;
        }
        let recorded = self.recorded_fronts().await;
        let mut expected = self.known_fronts.alive(FRONT_ALIVE);
        expected.extend(recorded);
        let (bus, admin, t) = (self.bus.clone(), self.admin.clone(), term.clone());
        let handler: Arc<dyn walcast_bus::subs::SubsHandler> = Arc::new(self.registrar.clone());
        let (resynced, resync_done) = tokio::sync::oneshot::channel();
        let source = self.source.clone();
        let task = walcast_core::source_scope::spawn(async move {
            let s = source.as_str();
            let subs =
                walcast_bus::subs::serve_nats(&bus, s, handler, expected, resynced, t.cancelled());
            let admin = walcast_bus::admin::serve_nats(&bus, s, admin, t.cancelled());
            let (subs, admin) = tokio::join!(subs, admin);
            if let Err(e) = subs {
                tracing::error!(error = %e, "subscription registry stopped");
            }
            if let Err(e) = admin {
                tracing::error!(error = %e, "admin requests stopped");
            }
        });
        tokio::select! {
            _ = term.cancelled() => {}
            _ = resync_done => {}
        }
        let keep = self.registrar.fronts().clone().keep(
            self.registrar.matcher().clone(),
            self.cfg.database_url.clone(),
            term.clone().cancelled_owned(),
        );
        let keep = walcast_core::source_scope::spawn(keep);
        Some(walcast_core::source_scope::spawn(async move {
            let _ = tokio::join!(task, keep);
        }))
    }

    /// The fronts the previous leader had subscriptions from (none if unreadable: then
    /// the resync waits only for fronts this worker heard from or that answer at once).
    async fn recorded_fronts(&self) -> std::collections::HashSet<String> {
        let read = async {
            let client = walcast_pipeline::connect(&self.cfg.database_url).await?;
            self.registrar.fronts().load(&client).await
        };
        match tokio::time::timeout(std::time::Duration::from_secs(5), read).await {
            Ok(Ok(fronts)) => fronts,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot read the recorded fronts");
                Default::default()
            }
            Err(_) => {
                tracing::warn!("reading the recorded fronts timed out");
                Default::default()
            }
        }
    }
}

/// The outbox relay's consumer and health, when enabled (and the bus is NATS).
fn outbox_consumer(
    cdc: &CdcArgs,
    cfg: &walcast_pipeline::PipelineConfig,
    bus: &Bus,
    projects: &Arc<SourceProjects>,
) -> (
    Option<std::sync::Arc<dyn walcast_pipeline::ConsumerFactory>>,
    Option<Arc<walcast_outbox::OutboxHealth>>,
) {
    let Some(mut config) = cdc.outbox.to_config(&cfg.database_url) else {
        return (None, None);
    };
    // The default source relays every project's events as it always did (an outbox
    // project need not be a stored project); another source only its own projects'.
    if !walcast_bus::source::is_default(projects.source()) {
        let gate: Arc<dyn walcast_outbox::config::ProjectGate> =
            Arc::new(OutboxGate(projects.clone()));
        config.projects = walcast_outbox::config::Projects(Some(gate));
    }
    let Bus::Nats(_) = bus else {
        tracing::warn!("the outbox relay needs NATS with JetStream (NATS_URL): walcast.emit events and outbox rows are NOT relayed by this process");
        return (None, None);
    };
    walcast_outbox::telemetry::describe();
    let outbox_health = Arc::new(walcast_outbox::OutboxHealth::new());
    let factory = walcast_outbox::consumer_factory(config, outbox_health.clone());
    (Some(factory), Some(outbox_health))
}

/// A snapshotter's settings and the board it shares with the change-stream consumer.
type Snapshots = (
    walcast_changes::snapshot::SnapshotConfig,
    Arc<walcast_changes::snapshot::Board>,
);

/// The change-stream consumer, when enabled and the bus is NATS (README "Change streams"),
/// and the snapshotter publishing through it.
fn change_stream(
    cdc: &CdcArgs,
    cfg: &walcast_pipeline::PipelineConfig,
    bus: &Bus,
    projects: &Arc<SourceProjects>,
) -> Option<(
    std::sync::Arc<dyn walcast_pipeline::ConsumerFactory>,
    Option<Snapshots>,
)> {
    let mut config = cdc
        .changes
        .to_config(&cfg.database_url, cdc.max_record_bytes)?;
    let Bus::Nats(_) = bus else {
        tracing::info!("change streams need NATS with JetStream (NATS_URL): off in this process");
        return None;
    };
    config.projects = Some(projects.clone());
    let snapshots = cdc.changes.snapshot_config(&cfg.database_url).map(|mut s| {
        s.projects = Some(projects.clone());
        (s, Arc::new(walcast_changes::snapshot::Board::default()))
    });
    config.board = snapshots.as_ref().map(|(_, b)| b.clone());
    Some((walcast_changes::factory(config), snapshots))
}

/// Partition maintenance of the outbox tables and of `realtime.messages` (always:
/// whatever the bus, and with the relay off, inserts need the next day's partition).
fn outbox_maintenance(
    cdc: &CdcArgs,
    cfg: &walcast_pipeline::PipelineConfig,
) -> Option<walcast_outbox::maintain::Maintenance> {
    walcast_outbox::telemetry::describe();
    Some(walcast_outbox::maintain::Maintenance {
        database_url: cfg.database_url.clone(),
        interval: std::time::Duration::from_secs(cdc.outbox.maintain_interval_secs),
        lock_timeout: walcast_outbox::config::MAINTAIN_LOCK_TIMEOUT,
    })
}
