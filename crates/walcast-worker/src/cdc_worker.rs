//! The cdc-worker process: migrations, the CDC pipeline, and `/health` + `/metrics`.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::admin::AdminHandler;
use walcast_bus::subs::KnownFronts;
use walcast_bus::Bus;

use walcast_control::roles::RolePolicy;
use walcast_control::secrets::SecretKeys;
use walcast_lease::LeaseMode;
use walcast_realtime::subscriptions::matcher::Matcher;
use walcast_realtime::subscriptions::registrar::Registrar;

use crate::config::{redact_url, CdcArgs, DbArgs, HttpArgs, LogArgs};
use crate::http::{ops_router, serve, OpsHttp, OpsState};
use crate::leader::{Leader, Parts};
use crate::server::Listening;
use crate::share::Workers;
use crate::supervisor;
use walcast_bus::source::DEFAULT_SOURCE;
use walcast_control::source_projects::SourceProjects;

/// Reads the WAL through a wal2json slot and publishes every change to NATS.
#[derive(Parser, Debug, Clone)]
#[command(name = "cdc-worker", version, about)]
pub struct CdcWorkerConfig {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub cdc: CdcArgs,
    #[command(flatten)]
    pub roles: crate::config::RolesArgs,
    #[command(flatten)]
    pub secrets: crate::config::SecretsArgs,
    /// NATS server to publish changes to.
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    pub nats_url: String,
    #[command(flatten)]
    pub nats_auth: crate::config::NatsAuthArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub operator: crate::operator::OperatorArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// The effective configuration as JSON, secrets redacted.
pub fn describe(
    db: &DbArgs,
    cdc: &CdcArgs,
    nats_url: Option<&str>,
    http: &HttpArgs,
) -> serde_json::Value {
    json!({
        "database_url": redact_url(&db.database_url),
        "replication_url": db.replication_url.as_deref().map(redact_url),
        "check_database_url": db.check_database_url.as_deref().map(redact_url),
        "nats_url": nats_url.map(redact_url),
        "cdc_source": cdc.source.to_string(),
        "ack_interval_ms": cdc.ack_interval_ms,
        "heartbeat_interval_ms": cdc.heartbeat_interval_ms,
        "slot_name": cdc.slot_name,
        "num_shards": cdc.num_shards,
        "rls_batch": cdc.rls_batch,
        "max_record_bytes": cdc.max_record_bytes,
        "resend_max_messages": cdc.resend_max_messages,
        "resend_max_bytes": cdc.resend_max_bytes,
        "resend_max_secs": cdc.resend_max_secs,
        "rls_mode": format!("{:?}", cdc.rls_mode).to_lowercase(),
        "rls_check_timeout_ms": cdc.rls_check_timeout_ms,
        "rls_connections": cdc.rls_connections,
        "poll_batch": cdc.poll_batch,
        "poll_max_batch": cdc.poll_max_batch,
        "poll_idle_ms": cdc.poll_idle_ms,
        "table_filter_refresh_ms": cdc.table_filter_refresh_ms,
        "allow_unbounded_wal": cdc.allow_unbounded_wal,
        "max_classes_per_project": cdc.max_classes_per_project,
        "max_classes_per_front": cdc.max_classes_per_front,
        "max_filter_bytes_per_project": cdc.max_filter_bytes_per_project,
        "max_filter_bytes": cdc.max_filter_bytes,
        "lease_mode": cdc.lease.lease_mode.to_string(),
        "lease_name": cdc.lease.lease_name,
        "lease_duration_secs": cdc.lease.lease_duration_secs,
        "lease_kube_api_url": cdc.lease.lease_kube_api_url.as_deref().map(redact_url),
        "lease_kubeconfig": cdc.lease.lease_kubeconfig.as_ref().map(|k| k.to_string_lossy()),
        "lease_kube_context": cdc.lease.lease_kube_context,
        "http": http.describe(),
        "outbox": cdc.outbox.describe(),
        "changes": cdc.changes.describe(),
    })
}

pub use crate::database::{migrate, preflight};
pub use crate::election::session_tag;
use crate::election::{describe_mode, for_default, lease_mode};
use crate::lead::SourceState;

/// A random id for this process, sent as `Walcast-Origin`.
pub fn instance_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// What a cdc-worker runs with, besides its options: made by the process (`cdc-worker`,
/// or `walcast serve` with its front beside it).
pub struct Worker<'a> {
    pub db: &'a DbArgs,
    pub cdc: &'a CdcArgs,
    /// The keys of the secrets stored in the control database.
    pub keys: Arc<SecretKeys>,
    pub bus: Bus,
    /// The default source's subscription registry.
    pub registrar: Registrar,
    /// The default source's answers to the fronts' admin requests.
    pub admin: Arc<dyn AdminHandler>,
    /// The roles a token may act as.
    pub roles: RolePolicy,
    /// The front served beside the worker, in one process (`walcast serve`).
    pub front: Option<walcast_front::Front>,
    /// This process's id ([`instance_id`]).
    pub origin: String,
    pub ops: OpsHttp,
}

/// Run migrations, the pipeline and the ops HTTP server until `cancel` fires or the
/// pipeline hits an error that needs the operator.
pub async fn run(w: Worker<'_>, cancel: CancellationToken) -> anyhow::Result<()> {
    let (db, cdc) = (w.db, w.cdc);
    preflight(db, cdc).await?;
    crate::database::prepare_control(db, &w.keys, &w.roles).await?;
    let known_fronts = KnownFronts::default();
    let spec = cdc.default_source(db);
    let default = Arc::new(SourceState::new(&spec));
    let parts = Parts {
        cdc,
        origin: &w.origin,
        bus: &w.bus,
        registrar: w.registrar,
        admin: w.admin,
        known_fronts: known_fronts.clone(),
        projects: Arc::new(SourceProjects::new(DEFAULT_SOURCE, &db.database_url)),
        health: default.health.clone(),
        root: Some(cancel.clone()),
    };
    let (leader, outbox_health) = Leader::build(&spec, parts);
    let leader = Arc::new(leader);
    let tracker = TaskTracker::new();
    spawn_front_listener(
        &tracker,
        known_fronts.clone(),
        w.bus.clone(),
        cancel.clone(),
    );
    let mode = lease_mode(cdc);
    let process = w
        .front
        .as_ref()
        .map_or(format!("worker-{}", w.origin), |f| f.id().to_string());
    let ctx = supervisor::Context {
        cdc: cdc.clone(),
        control_url: db.database_url.clone(),
        bus: w.bus.clone(),
        origin: w.origin.clone(),
        roles: w.roles,
        keys: w.keys,
        known_fronts,
        mode,
        workers: Arc::new(Workers::new(process.clone())),
        sources: Arc::default(),
        default: default.clone(),
    };
    let sources = spawn_sources(&tracker, ctx, cancel.clone());
    let state = OpsState {
        cdc: Some(default.health.clone()),
        sources: Some(sources),
        outbox: outbox_health,
        front: w.front.clone(),
        bus: w.bus.clone(),
        metrics: w.ops.metrics,
        lease_mode: describe_mode(mode),
        lease: (mode != LeaseMode::None).then(|| default.lease.clone()),
        key: w.ops.key,
    };
    crate::beacon::spawn(&tracker, process, state.clone(), cancel.clone());
    spawn_http(&tracker, w.ops.listener, w.front.as_ref(), state, &cancel);
    tracing::info!(front = w.front.is_some(), lease = %mode, "serving HTTP");

    let election = for_default(mode, db, cdc, &w.origin);
    let led = crate::lead::lead(default, leader.clone(), election, cancel.clone()).await;
    stop_all(&cancel, tracker, w.front).await;
    led.context("Kubernetes leader election")?;
    match leader.take_failure() {
        Some(e) => Err(anyhow::anyhow!(e)).context("cdc pipeline stopped"),
        None => Ok(()),
    }
}

/// Stop every task of the process, and the front's sockets.
async fn stop_all(
    cancel: &CancellationToken,
    tracker: TaskTracker,
    front: Option<walcast_front::Front>,
) {
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
    if let Some(f) = front {
        f.closed().await;
    }
}

/// The other sources' supervisor and the live-worker count it shares them by.
fn spawn_sources(
    tracker: &TaskTracker,
    ctx: supervisor::Context,
    cancel: CancellationToken,
) -> Arc<supervisor::Sources> {
    let sources = ctx.sources.clone();
    if !matches!(ctx.bus, Bus::Nats(_)) {
        // In process, the front reaches only this process's default leader.
        tracing::info!("no NATS: only the default source is read (other sources need NATS_URL)");
        return sources;
    }
    let (workers, bus, stop) = (ctx.workers.clone(), ctx.bus.clone(), cancel.clone());
    tracker.spawn(async move { workers.listen(&bus, stop.cancelled()).await });
    tracker.spawn(supervisor::run(ctx, cancel));
    sources
}

/// Every front heard from (leading or not), so that a term's resync waits for them.
fn spawn_front_listener(
    tracker: &TaskTracker,
    known: KnownFronts,
    bus: Bus,
    cancel: CancellationToken,
) {
    tracker.spawn(async move {
        if let Err(e) = known.listen(&bus, cancel.cancelled()).await {
            tracing::warn!(error = %e, "cannot listen for fronts; a new leader waits only for fronts that answer at once");
        }
    });
}

/// The ops endpoints (and the front's routes, in one process) until `cancel`.
fn spawn_http(
    tracker: &TaskTracker,
    listener: Listening,
    front: Option<&walcast_front::Front>,
    state: OpsState,
    cancel: &CancellationToken,
) {
    let cancel = cancel.clone();
    let router = match front {
        Some(f) => f.router().merge(ops_router(state)),
        None => crate::http::worker_router(state),
    };
    tracing::info!(addr = ?listener.local_addr().ok(), "HTTP listening");
    tracker.spawn(async move {
        if let Err(e) = serve(listener, router, cancel.cancelled_owned()).await {
            tracing::error!(error = %e, "http server failed");
        }
    });
}

/// Entry point of the `cdc-worker` binary.
pub async fn main(cfg: CdcWorkerConfig) -> anyhow::Result<()> {
    crate::telemetry::init_logs(&cfg.log);
    let keys = cfg.secrets.keys()?;
    cfg.operator.validate(None)?;
    let mut described = describe(&cfg.db, &cfg.cdc, Some(&cfg.nats_url), &cfg.http);
    described["nats_auth"] = cfg.nats_auth.describe();
    described["secrets"] = crate::config::SecretsArgs::describe(&keys);
    described["operator_keys"] = cfg.operator.describe();
    described["allowed_roles"] = serde_json::json!(cfg.roles.allowed_roles);
    tracing::info!(config = %described, "cdc-worker starting");
    cfg.operator.warn_if_none();
    let metrics = crate::telemetry::init_metrics()?;
    let origin = instance_id();
    let name = format!("walcast-cdc-worker-{origin}");
    let bus = Bus::nats_with(
        &cfg.nats_url,
        &name,
        &cfg.nats_auth.auth().inbox_for("worker"),
    )
    .await
    .with_context(|| format!("connecting to NATS at {}", redact_url(&cfg.nats_url)))?;
    let listener = cfg.http.bind().await?;
    let cancel = crate::shutdown::on_signal();
    let roles = cfg.roles.policy();
    let registrar = Registrar::new(
        Matcher::with_limits(cfg.cdc.class_limits()),
        cfg.db.database_url.clone(),
        roles.clone(),
    );
    let admin = Arc::new(
        walcast_realtime::admin::Admin::new(
            cfg.db.database_url.clone(),
            cfg.db.check_database_url.as_deref().unwrap_or_default(),
            roles,
            keys.clone(),
        )
        .answering(Arc::new(
            walcast_changes::snapshot::manage::SnapshotRequests,
        )),
    );
    let roles = cfg.roles.policy();
    let ops = OpsHttp {
        listener,
        metrics,
        key: cfg.operator.key(),
    };
    let worker = Worker {
        db: &cfg.db,
        cdc: &cfg.cdc,
        keys,
        bus,
        registrar,
        admin,
        roles,
        front: None,
        origin,
        ops,
    };
    run(worker, cancel).await
}
