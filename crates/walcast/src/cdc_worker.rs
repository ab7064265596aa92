//! The cdc-worker process: migrations, the CDC pipeline, and `/health` + `/metrics`.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::admin::AdminHandler;
use walcast_bus::subs::KnownFronts;
use walcast_bus::Bus;

use walcast_lease::{Fence, LeaseMode, LeaseStatus};
use walcast_realtime::subscriptions::matcher::Matcher;
use walcast_realtime::subscriptions::registrar::Registrar;

use crate::config::{redact_url, CdcArgs, DbArgs, HttpArgs, LogArgs};
use crate::http::{ops_router, serve, OpsState};
use crate::leader::{Leader, Parts};
use crate::share::Workers;
use crate::supervisor;
use walcast_bus::source::DEFAULT_SOURCE;
use walcast_realtime::source_projects::SourceProjects;

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
    /// NATS server to publish changes to.
    #[arg(long, env = "NATS_URL")]
    pub nats_url: String,
    #[command(flatten)]
    pub nats_auth: crate::config::NatsAuthArgs,
    #[command(flatten)]
    pub http: HttpArgs,
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
        "nats_url": nats_url.map(redact_url),
        "cdc_source": cdc.source.to_string(),
        "ack_interval_ms": cdc.ack_interval_ms,
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
        "lease_mode": cdc.lease.lease_mode.to_string(),
        "lease_name": cdc.lease.lease_name,
        "lease_duration_secs": cdc.lease.lease_duration_secs,
        "lease_kube_api_url": cdc.lease.lease_kube_api_url,
        "listen": format!("{}:{}", http.host, http.port),
        "outbox": cdc.outbox.describe(),
    })
}

/// A random id for this process, sent as `Walcast-Origin`.
pub fn instance_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// The `application_name` of this process's pipeline and lease sessions: a worker that
/// takes over our expired lease terminates them (Postgres lease mode).
pub fn session_tag(origin: &str) -> String {
    format!("walcast-cdc-{origin}")
}

/// Apply our migrations (idempotent, serialised by an advisory lock).
pub async fn migrate(database_url: &str) -> anyhow::Result<()> {
    let mut client = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    walcast_realtime::migrate::migrate(&mut client)
        .await
        .context("applying migrations")?;
    Ok(())
}

/// Fail fast, with the fix, on configuration the operator must change. Transient states
/// (a slot still held by a dying session) are left to the pipeline's retries.
pub async fn preflight(db: &DbArgs, cdc: &CdcArgs) -> anyhow::Result<()> {
    let url = db.replication_url();
    let client = walcast_pipeline::connect(url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(url)))?;
    match walcast_pipeline::preflight::preflight(&client, &cdc.slot_name, cdc.allow_unbounded_wal)
        .await
    {
        Ok(report) => {
            tracing::info!(
                server = %report.server_version,
                role = %report.role,
                max_slot_wal_keep_size = %report.max_slot_wal_keep_size,
                slot_exists = report.slot_exists,
                "preflight passed"
            );
            Ok(())
        }
        Err(e) if e.is_fatal() => Err(anyhow::anyhow!("preflight failed: {e}")),
        Err(e) => {
            tracing::warn!(error = %e, "preflight: will retry");
            Ok(())
        }
    }
}

/// Run migrations, the pipeline and the ops HTTP server until `cancel` fires or the
/// pipeline hits an error that needs the operator.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    db: &DbArgs,
    cdc: &CdcArgs,
    bus: Bus,
    registrar: Registrar,
    admin: Arc<dyn AdminHandler>,
    roles: walcast_realtime::roles::RolePolicy,
    front: Option<walcast_front::Front>,
    origin: String,
    listener: TcpListener,
    metrics: PrometheusHandle,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    preflight(db, cdc).await?;
    migrate(&db.database_url).await?;
    let tag = session_tag(&origin);
    let known_fronts = KnownFronts::default();
    let parts = Parts {
        cdc,
        origin: &origin,
        bus: &bus,
        registrar,
        admin,
        known_fronts: known_fronts.clone(),
        projects: Arc::new(SourceProjects::new(DEFAULT_SOURCE, &db.database_url)),
        root: Some(cancel.clone()),
    };
    let (leader, outbox_health) = Leader::build(&cdc.default_source(db), parts);
    let health = leader.health().clone();
    let leader = Arc::new(leader);
    let tracker = TaskTracker::new();
    spawn_front_expiry(
        &tracker,
        leader.registrar().matcher().clone(),
        cancel.clone(),
    );
    spawn_front_listener(&tracker, known_fronts.clone(), bus.clone(), cancel.clone());
    let mode = lease_mode(cdc);
    let status = Arc::new(LeaseStatus::default());
    let process = front
        .as_ref()
        .map_or_else(|| format!("worker-{origin}"), |f| f.id().to_string());
    let ctx = supervisor::Context {
        cdc: cdc.clone(),
        control_url: db.database_url.clone(),
        bus: bus.clone(),
        origin: origin.clone(),
        roles,
        known_fronts,
        mode,
        workers: Arc::new(Workers::new(process.clone())),
        sources: Arc::default(),
        default_health: health.clone(),
    };
    let sources = spawn_sources(&tracker, ctx, cancel.clone());
    let state = OpsState {
        cdc: Some(health.clone()),
        sources: Some(sources),
        outbox: outbox_health,
        front: front.clone(),
        bus: bus.clone(),
        metrics,
        lease_mode: describe_mode(mode),
        lease: (mode != LeaseMode::None).then(|| status.clone()),
    };
    crate::beacon::spawn(&tracker, process, state.clone(), cancel.clone());
    spawn_http(&tracker, listener, front.as_ref(), state, cancel.clone());
    tracing::info!(front = front.is_some(), lease = %mode, "serving HTTP");

    let lead = |fence: Fence| leader.clone().term(fence);
    let election = elect(mode, db, cdc, tag, status, &cancel, lead).await;
    stop_all(&cancel, tracker, front).await;
    election.context("Kubernetes leader election")?;
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
    let (workers, bus, stop) = (ctx.workers.clone(), ctx.bus.clone(), cancel.clone());
    tracker.spawn(async move { workers.listen(&bus, stop.cancelled()).await });
    tracker.spawn(supervisor::run(ctx, cancel));
    sources
}

/// How `/health` names the election mode.
fn describe_mode(mode: LeaseMode) -> String {
    match mode {
        LeaseMode::None => "none (no election: never run two workers)".to_string(),
        m => m.to_string(),
    }
}

/// Drop subscriptions of fronts that stopped syncing (died).
pub(crate) fn spawn_front_expiry(
    tracker: &TaskTracker,
    matcher: Arc<Matcher>,
    cancel: CancellationToken,
) {
    tracker.spawn(async move {
        let mut tick = tokio::time::interval(walcast_bus::subs::SYNC_INTERVAL);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => { matcher.expire_dead_fronts(); }
            }
        }
    });
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
    listener: TcpListener,
    front: Option<&walcast_front::Front>,
    state: OpsState,
    cancel: CancellationToken,
) {
    let router = match front {
        Some(f) => f.router().merge(ops_router(state)),
        None => ops_router(state),
    };
    tracing::info!(addr = ?listener.local_addr().ok(), "HTTP listening");
    tracker.spawn(async move {
        if let Err(e) = serve(listener, router, cancel.cancelled_owned()).await {
            tracing::error!(error = %e, "http server failed");
        }
    });
}

/// Run `lead` for every term this worker wins, until `cancel`. Each term gets a fence
/// (open until the lease could have expired, on our own clock); without election, one
/// term that never closes.
async fn elect<F, Fut>(
    mode: LeaseMode,
    db: &DbArgs,
    cdc: &CdcArgs,
    tag: String,
    status: Arc<LeaseStatus>,
    cancel: &CancellationToken,
    mut lead: F,
) -> Result<(), walcast_lease::kubernetes::KubeLeaseError>
where
    F: FnMut(Fence) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    match mode {
        LeaseMode::None => {
            tracing::warn!("LEASE_MODE=none: no leader election. Running two cdc-workers on one slot reorders changes; use it for development only");
            lead(Fence::unfenced(cancel.child_token())).await;
            Ok(())
        }
        LeaseMode::Kubernetes => {
            let cfg = walcast_lease::kubernetes::KubeLeaseConfig {
                api_url: cdc.lease.lease_kube_api_url.clone(),
                namespace: cdc.lease.lease_namespace.clone(),
                name: kubernetes_name(&lease_name(cdc)),
                identity: lease_identity(),
                duration: cdc.lease.duration(),
            };
            tracing::info!(lease = %cfg.name, namespace = %cfg.namespace, identity = %cfg.identity, "electing through a Kubernetes Lease");
            walcast_lease::kubernetes::run(cfg, status, cancel.clone(), lead).await
        }
        LeaseMode::Postgres | LeaseMode::Auto => {
            let pg = walcast_lease::postgres::PgLeaseConfig {
                url: walcast_lease::postgres::tagged_url(&db.database_url, &tag),
                name: lease_name(cdc),
                identity: lease_identity(),
                session_tag: tag,
                duration: cdc.lease.duration(),
            };
            tracing::info!(lease = %pg.name, identity = %pg.identity, session = %pg.session_tag, "electing through a Postgres lease row");
            walcast_lease::postgres::run(pg, status, cancel.clone(), lead).await;
            Ok(())
        }
    }
}

/// The election mode in force: `auto` is Kubernetes inside a cluster
/// (`KUBERNETES_SERVICE_HOST` set), else Postgres.
fn lease_mode(cdc: &CdcArgs) -> LeaseMode {
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    cdc.lease.lease_mode.resolve(in_cluster)
}

/// Workers with the same lease name compete; defaults to the slot name.
pub(crate) fn lease_name(cdc: &CdcArgs) -> String {
    cdc.lease
        .lease_name
        .clone()
        .unwrap_or_else(|| cdc.slot_name.clone())
}

/// A valid Kubernetes object name (RFC 1123 subdomain: lower case, digits, `-`, `.`) for
/// a lease name: the default, the slot name `walcast_cdc_slot`, becomes
/// `walcast-cdc-slot` (the Postgres lease keeps the name as it is).
fn kubernetes_name(name: &str) -> String {
    let mapped: String = name
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '.' | '-') => c,
            _ => '-',
        })
        .collect();
    let trimmed = mapped.trim_matches(|c: char| c == '-' || c == '.');
    match trimmed.is_empty() {
        true => "walcast".to_string(),
        false => trimmed.chars().take(253).collect(),
    }
}

/// This worker's Lease `holderIdentity`: the pod name (`HOSTNAME` in Kubernetes), else
/// one made up for this process.
pub(crate) fn lease_identity() -> String {
    match std::env::var("HOSTNAME") {
        Ok(h) if !h.is_empty() => h,
        _ => format!(
            "cdc-worker-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ),
    }
}

/// Entry point of the `cdc-worker` binary.
pub async fn main(cfg: CdcWorkerConfig) -> anyhow::Result<()> {
    crate::telemetry::init_logs(&cfg.log);
    let mut described = describe(&cfg.db, &cfg.cdc, Some(&cfg.nats_url), &cfg.http);
    described["nats_auth"] = cfg.nats_auth.describe();
    described["allowed_roles"] = serde_json::json!(cfg.roles.allowed_roles);
    tracing::info!(config = %described, "cdc-worker starting");
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
    let listener = TcpListener::bind((cfg.http.host.as_str(), cfg.http.port))
        .await
        .with_context(|| format!("binding {}:{}", cfg.http.host, cfg.http.port))?;
    let cancel = crate::shutdown::on_signal();
    let roles = cfg.roles.policy();
    let registrar = Registrar::new(
        Matcher::with_limits(cfg.cdc.class_limits()),
        cfg.db.database_url.clone(),
        roles.clone(),
    );
    let admin = Arc::new(walcast_realtime::admin::Admin::new(
        cfg.db.database_url.clone(),
        roles,
    ));
    let roles = cfg.roles.policy();
    run(
        &cfg.db, &cfg.cdc, bus, registrar, admin, roles, None, origin, listener, metrics, cancel,
    )
    .await
}

#[cfg(test)]
mod tests {
    #[test]
    fn lease_names_become_valid_kubernetes_names() {
        assert_eq!(
            super::kubernetes_name("walcast_cdc_slot"),
            "walcast-cdc-slot"
        );
        assert_eq!(super::kubernetes_name("My.Lease_1"), "my.lease-1");
        assert_eq!(super::kubernetes_name("__"), "walcast");
    }
}
