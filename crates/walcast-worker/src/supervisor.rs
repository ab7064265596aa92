//! The sources other than the default one (README "Sources"): which this worker leads.
//!
//! Every few seconds the supervisor reads the control database's `walcast.sources` and
//! runs one `runner` per source listed: it prepares the source's database (preflight,
//! migrations), then elects through a lease row *in that database* (so a worker taking
//! over terminates the stale leader's walsender there, and the source's own clock judges
//! it), trying only while this worker leads fewer sources than its fair share (see
//! [`crate::share`]). A worker over its share gives the source it took last up. A source
//! removed from the table is stopped (its term ends, its lease is released).
//!
//! A source that fails (its database down, wal2json missing, its slot lost) says why in
//! `/health` and is tried again later; it never stops the process or the other sources.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::subs::KnownFronts;
use walcast_bus::Bus;
use walcast_control::roles::RolePolicy;
use walcast_control::secrets::SecretKeys;
use walcast_control::source_projects::SourceProjects;
use walcast_lease::LeaseMode;

use crate::config::{redact_url, CdcArgs, SourceSpec};
use crate::election::Election;
use crate::lead::{lock, SourceState, RESERVE, RETRY_AFTER};
use crate::share::{self, Workers};

/// How often the source list is read again.
pub const REFRESH: Duration = Duration::from_secs(5);
/// The sources this worker runs, for `/health`, `/readyz` and its beacon.
#[derive(Default)]
pub struct Sources {
    states: Mutex<BTreeMap<String, Arc<SourceState>>>,
}

/// A source in `/health`.
#[derive(Serialize)]
pub struct SourceHealth {
    pub name: String,
    #[serde(flatten)]
    pub pipeline: walcast_pipeline::PipelineHealthReport,
    pub lease_holder: Option<String>,
    pub lease_term: Option<u64>,
}

impl Sources {
    pub fn all(&self) -> Vec<Arc<SourceState>> {
        lock(&self.states).values().cloned().collect()
    }

    pub fn health(&self) -> Vec<SourceHealth> {
        self.all()
            .iter()
            .map(|s| {
                let lease = s.lease.report();
                SourceHealth {
                    name: s.name.clone(),
                    pipeline: s.health.report(),
                    lease_holder: lease.holder,
                    lease_term: lease.term,
                }
            })
            .collect()
    }

    /// The sources this worker leads, and since when.
    fn held(&self) -> Vec<(String, Instant)> {
        self.all()
            .iter()
            .filter_map(|s| s.leading_since().map(|at| (s.name.clone(), at)))
            .collect()
    }

    fn get(&self, name: &str) -> Option<Arc<SourceState>> {
        lock(&self.states).get(name).cloned()
    }
}

/// What every runner shares.
#[derive(Clone)]
pub struct Context {
    pub cdc: CdcArgs,
    pub control_url: String,
    pub bus: Bus,
    pub origin: String,
    pub roles: RolePolicy,
    /// The keys of the sources' URLs (and of the projects' secrets).
    pub keys: Arc<SecretKeys>,
    pub known_fronts: KnownFronts,
    pub mode: LeaseMode,
    pub workers: Arc<Workers>,
    pub sources: Arc<Sources>,
    /// The default source (this worker may lead it too).
    pub default: Arc<SourceState>,
}

impl Context {
    /// Sources this worker leads, the default one included.
    fn held(&self) -> Vec<(String, Instant)> {
        let mut held = self.sources.held();
        if let Some(at) = self.default.leading_since() {
            held.push((self.default.name.clone(), at));
        }
        held
    }

    /// This worker's fair share now, of `total` sources (the default included).
    fn share(&self, now: Instant) -> usize {
        let total = lock(&self.sources.states).len() + 1;
        share::fair_share(total, self.workers.live(now))
    }

    /// Whether this worker may try to take `source` now: it leads, or is about to lead
    /// (attempts reserved by the other sources' electors), fewer than its share.
    fn may_take(&self, source: &SourceState) -> bool {
        let now = Instant::now();
        if source.resting(now) || !self.workers.settled(now) {
            return false;
        }
        let reserved = self
            .sources
            .all()
            .iter()
            .filter(|s| s.name != source.name && s.reserved(now))
            .count();
        if !share::may_take(self.held().len() + reserved, self.share(now)) {
            return false;
        }
        if source.likely_free() {
            *lock(&source.reserved_until) = Some(now + RESERVE);
        }
        true
    }
}

/// Run the sources listed in the control database until `cancel`.
pub async fn run(ctx: Context, cancel: CancellationToken) {
    let tracker = TaskTracker::new();
    let mut running: BTreeMap<String, (SourceSpec, CancellationToken)> = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next_read = Instant::now();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tick.tick() => {}
        }
        if Instant::now() >= next_read {
            next_read = Instant::now() + REFRESH;
            match list(&ctx.control_url, &ctx.keys).await {
                Ok(listed) => apply(&ctx, &tracker, &mut running, listed, &cancel),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the sources (walcast.sources); keeping the ones running")
                }
            }
        }
        give_up_over_share(&ctx);
    }
    for (_, (_, stop)) in running {
        stop.cancel();
    }
    tracker.close();
    tracker.wait().await;
}

/// Start the sources listed that do not run, stop those no longer listed (or changed).
/// One whose URLs cannot be read now is left as it is (running or not).
fn apply(
    ctx: &Context,
    tracker: &TaskTracker,
    running: &mut BTreeMap<String, (SourceSpec, CancellationToken)>,
    listed: Listed,
    cancel: &CancellationToken,
) {
    let Listed { specs, unreadable } = listed;
    let listed: BTreeMap<String, SourceSpec> =
        specs.into_iter().map(|s| (s.name.clone(), s)).collect();
    running.retain(|name, (spec, stop)| {
        let keep = listed.get(name) == Some(spec) || unreadable.contains(name);
        if !keep {
            tracing::info!(source = %name, "source removed or changed: stopping its pipeline");
            crate::telemetry::source_removed(name);
            stop.cancel();
            lock(&ctx.sources.states).remove(name);
        }
        keep
    });
    for (name, spec) in listed {
        if running.contains_key(&name) {
            continue;
        }
        tracing::info!(source = %name, database = %redact_url(&spec.database_url), slot = %spec.slot_name, "source added");
        crate::telemetry::source_added(&name);
        let state = Arc::new(SourceState::new(&spec));
        lock(&ctx.sources.states).insert(name.clone(), state.clone());
        let stop = cancel.child_token();
        let run = runner(ctx.clone(), spec.clone(), state, stop.clone());
        // Its metrics carry `source="<name>"` (see walcast_core::source_scope).
        tracker.spawn(walcast_core::source_scope::within(&name, run));
        running.insert(name, (spec, stop));
    }
    metrics::gauge!(crate::telemetry::SOURCES).set(running.len() as f64);
}

/// Over its share (more workers appeared): end the term of the source taken last, and
/// leave it to the others for a while.
fn give_up_over_share(ctx: &Context) {
    let now = Instant::now();
    if !ctx.workers.settled(now) {
        return;
    }
    let held = ctx.sources.held();
    let mut all = ctx.held();
    all.sort_by_key(|(_, at)| *at);
    let share = ctx.share(now);
    let Some(name) = share::to_give_up(&all, share) else {
        return;
    };
    if !held.iter().any(|(n, _)| *n == name) {
        return; // the default source: kept (it is given up only by its own election)
    }
    let Some(state) = ctx.sources.get(&name) else {
        return;
    };
    let token = lock(&state.give_up).take();
    if let Some(token) = token {
        tracing::info!(source = %name, share, live = ctx.workers.live(now), "leading more than this worker's share: giving the source up");
        metrics::counter!(crate::telemetry::SOURCES_GIVEN_UP, "source" => name.clone())
            .increment(1);
        state.rest(RETRY_AFTER);
        token.cancel();
    }
}

/// One source, until `stop`: prepare its database, then elect and lead.
async fn runner(ctx: Context, spec: SourceSpec, state: Arc<SourceState>, stop: CancellationToken) {
    // Every worker running the source reports it (`walcast_cdc_active{source}` 0 until
    // one leads it), so a source no worker can read is seen.
    state.health.set_active(false);
    while !stop.is_cancelled() {
        if let Err(e) = prepare(&ctx, &spec).await {
            let why = format!("{e:#}");
            tracing::error!(source = %spec.name, error = %why, "source not usable; trying again later");
            state.health.set_error(Some(why));
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(RETRY_AFTER) => continue,
            }
        }
        state.health.set_error(None);
        elect(&ctx, &spec, &state, &stop).await;
    }
}

/// The source's preflight (with the fix, when the operator must act) and migrations.
async fn prepare(ctx: &Context, spec: &SourceSpec) -> anyhow::Result<()> {
    let db = crate::config::DbArgs {
        database_url: spec.database_url.clone(),
        replication_url: Some(spec.replication_url.clone()),
        check_database_url: spec.check_url.clone(),
    };
    let mut cdc = ctx.cdc.clone();
    cdc.slot_name = spec.slot_name.clone();
    crate::database::preflight(&db, &cdc).await?;
    crate::database::migrate(&spec.database_url).await?;
    let check = spec.check_url.as_deref();
    crate::database::check_login(&spec.database_url, check, &ctx.roles)
        .await
        .with_context(|| {
            format!(
                "source {:?} (give it a check login: `walcast source set-check-url {} --check-url <URL>`)",
                spec.name, spec.name
            )
        })?;
    Ok(())
}

/// Elect on the source's own lease row and lead each term won, until `stop`.
async fn elect(
    ctx: &Context,
    spec: &SourceSpec,
    state: &Arc<SourceState>,
    stop: &CancellationToken,
) {
    let leader = Arc::new(source_leader(ctx, spec, state));
    let election = match ctx.mode {
        LeaseMode::None => Election::None,
        _ => {
            let cfg = crate::election::postgres_lease(
                &ctx.cdc,
                &ctx.origin,
                &spec.name,
                &spec.database_url,
            );
            let (ctx, state) = (ctx.clone(), state.clone());
            Election::Postgres(cfg, Box::new(move || ctx.may_take(&state)))
        }
    };
    // Only a Kubernetes election errs, and an added source is elected in its database.
    let _ = crate::lead::lead(state.clone(), leader, election, stop.clone()).await;
}

/// The leader of an added source: its projects, subscriptions and admin answers; a
/// failure of its pipeline ends the term, not the process.
fn source_leader(ctx: &Context, spec: &SourceSpec, state: &SourceState) -> crate::leader::Leader {
    let projects = Arc::new(SourceProjects::new(&spec.name, &ctx.control_url));
    let registrar = walcast_realtime::subscriptions::registrar::Registrar::for_source(
        walcast_realtime::subscriptions::matcher::Matcher::with_limits(ctx.cdc.class_limits()),
        spec.database_url.clone(),
        ctx.roles.clone(),
        projects.clone(),
    );
    let admin = Arc::new(
        walcast_realtime::admin::Admin::for_source(
            spec.database_url.clone(),
            spec.check_url.as_deref().unwrap_or_default(),
            ctx.roles.clone(),
            ctx.keys.clone(),
            projects.clone(),
        )
        .answering(Arc::new(
            walcast_changes::snapshot::manage::SnapshotRequests,
        )),
    );
    let (leader, _outbox) = crate::leader::Leader::build(
        spec,
        crate::leader::Parts {
            cdc: &ctx.cdc,
            origin: &ctx.origin,
            bus: &ctx.bus,
            registrar,
            admin,
            known_fronts: ctx.known_fronts.clone(),
            projects,
            health: state.health.clone(),
            root: None,
        },
    );
    leader
}

/// The sources of the control database (not the default one).
struct Listed {
    specs: Vec<SourceSpec>,
    /// Those whose URLs cannot be read (logged, counted).
    unreadable: std::collections::BTreeSet<String>,
}

/// The sources of the control database (not the default one); a URL of a key that is
/// not configured fails the list.
async fn list(control_url: &str, keys: &SecretKeys) -> anyhow::Result<Listed> {
    let client = walcast_pipeline::connect(control_url).await?;
    let rows = walcast_control::sources::list_rows(&client, keys).await?;
    let mut listed = Listed {
        specs: Vec::new(),
        unreadable: Default::default(),
    };
    for (name, s) in rows {
        let s = match s {
            Ok(s) if s.is_default() => continue,
            Ok(s) => s,
            Err(e) if e.is_unknown_key() => return Err(e.into()),
            Err(e) => {
                walcast_control::secrets::left_out("sources", &e);
                listed.unreadable.insert(name);
                continue;
            }
        };
        let urls = s.urls(control_url, None, None);
        listed.specs.push(SourceSpec {
            slot_name: s
                .slot(walcast_pipeline::config::DEFAULT_SLOT_NAME)
                .to_string(),
            name: s.name,
            database_url: urls.database_url,
            replication_url: urls.replication_url,
            check_url: urls.check_url,
        });
    }
    Ok(listed)
}
