//! Leadership through a Kubernetes `coordination.k8s.io/v1` Lease.
//!
//! Every write is a compare-and-set: a new Lease is created (409 `AlreadyExists` when
//! someone else created it first), an existing one is replaced carrying the
//! `resourceVersion` we read (409 `Conflict` when someone wrote in between). The rule of
//! [`decision`] runs on our own monotonic clock, never on the timestamps
//! stored in the Lease:
//!
//! * a lease held by another is taken over only after its `resourceVersion` stayed the
//!   same, on our clock, for a full duration (the longer of ours and its
//!   `leaseDurationSeconds`);
//! * the holder renews every third of the duration, sending each renewal with the
//!   `resourceVersion` of its last write, and cancels its term as soon as a renewal fails
//!   (any error, a 409, or no answer in time). Every request of a term is bounded by the
//!   time left until [`decision::deadline`], so a hung API server cannot keep us leader
//!   past `duration - margin` after the last renewal that succeeded was sent.
//! * the term's [`Fence`] is open until that same deadline: a holder frozen past it (its
//!   renewals could not even be sent) finds it closed when it wakes and acts no more.
//!   The term number is the Lease's `leaseTransitions`.
//!
//! On a graceful shutdown, once the leader's work has stopped, the fence is closed and
//! then the lease is released (empty holder), so the next worker takes over without
//! waiting and never while our fence is open.
//!
//! The Lease is the typed object of `k8s-openapi`, read and written by the standard client
//! (`kube`), configured as kubectl is (see [`client`]). A replace sends back the object as
//! read, so what walcast does not touch (labels, annotations, owner references, the
//! fields of coordinated leader election) is kept.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};

use crate::decision::{self, Decision, Local, Millis, Observed, Timing};
use crate::fence::Fence;
use crate::status::LeaseStatus;
use crate::telemetry;

mod connect;

pub use connect::{client, KubeLeaseError, MAX_BODY};

#[derive(Clone, Debug)]
pub struct KubeLeaseConfig {
    /// The API server's URL, used without credentials (`kubectl proxy`; plain http
    /// allowed, for tests); `None`: the kubeconfig, else the in-cluster configuration
    /// (see [`client`]).
    pub api_url: Option<String>,
    /// The kubeconfig files, a list as in `KUBECONFIG`; `None`: `~/.kube/config`.
    pub kubeconfig: Option<std::ffi::OsString>,
    /// The kubeconfig's context to use; `None`: its current context.
    pub context: Option<String>,
    pub namespace: String,
    /// Name of the Lease object: workers with the same name compete.
    pub name: String,
    /// This worker's `holderIdentity` (e.g. the pod name). Must be unique among workers.
    pub identity: String,
    /// Lease duration; the holder renews every third of it.
    pub duration: Duration,
}

impl KubeLeaseConfig {
    /// The leader stops a fifth of the duration before its lease could expire.
    pub fn timing(&self) -> Timing {
        Timing::for_duration(self.duration)
    }

    fn renew_every(&self) -> Duration {
        self.timing().renew_every()
    }
}

/// Elect until `shutdown`. Each time we become leader, `lead(fence)` runs; it must check
/// the fence before acting and return soon after the fence's token is cancelled
/// (leadership in doubt, or shutdown). Fails only when the client cannot be made.
pub async fn run<F, Fut>(
    cfg: KubeLeaseConfig,
    status: Arc<LeaseStatus>,
    shutdown: CancellationToken,
    lead: F,
) -> Result<(), KubeLeaseError>
where
    F: FnMut(Fence) -> Fut,
    Fut: Future<Output = ()>,
{
    let client = client(&cfg).await?;
    run_with_client(client, cfg, status, shutdown, lead).await;
    Ok(())
}

/// [`run`] with a client already built.
pub async fn run_with_client<F, Fut>(
    client: kube::Client,
    cfg: KubeLeaseConfig,
    status: Arc<LeaseStatus>,
    shutdown: CancellationToken,
    mut lead: F,
) where
    F: FnMut(Fence) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut elector = Elector {
        api: Api::namespaced(client, &cfg.namespace),
        clock: Instant::now(),
        local: Local::default(),
        versions: Versions::default(),
        cfg,
    };
    while !shutdown.is_cancelled() {
        let Some(lease) = elector.acquire(&shutdown, &status).await else {
            return;
        };
        let term = transitions(Some(&lease)).unwrap_or(0);
        let timing = elector.cfg.timing();
        let Some(deadline) = decision::deadline(&elector.local, timing) else {
            continue;
        };
        let fence = Fence::new(term, shutdown.child_token(), at(elector.clock, deadline));
        metrics::counter!(telemetry::TERMS).increment(1);
        tracing::info!(
            lease = %elector.cfg.name,
            identity = %elector.cfg.identity,
            term,
            "became leader (Kubernetes Lease)"
        );
        status.leading(&elector.cfg.identity, &fence);
        let mut renewer = Renewer {
            api: elector.api.clone(),
            cfg: elector.cfg.clone(),
            clock: elector.clock,
            local: elector.local.clone(),
            lease,
            fence: fence.clone(),
        };
        // A task of its own (see `Keeper`): dropping `run` stops the renewals too.
        let work_done = CancellationToken::new();
        let keeper = {
            let (fence, work_done) = (fence.clone(), work_done.clone());
            crate::Keeper::spawn(async move {
                let reason = renewer.hold().await;
                fence.token().cancel();
                // Released only once `lead` has returned (the work has stopped), and with
                // the fence already closed: a follower takes a free Lease at its next
                // read, maybe before the answer to our release reaches us.
                if reason == Ended::Shutdown {
                    work_done.cancelled().await;
                    fence.revoke();
                    renewer.release().await;
                }
                fence.revoke();
                renewer.local
            })
        };
        // Let it start before the work: spawned from a worker thread, it waits in that
        // worker's own slot, which no other thread takes from while the work runs.
        tokio::task::yield_now().await;
        lead(fence.clone()).await;
        fence.token().cancel();
        work_done.cancel();
        if let Some(local) = keeper.join().await {
            elector.local = local;
        }
        decision::lost(&mut elector.local);
        status.following();
        tracing::warn!(lease = %elector.cfg.name, term, "leadership ended");
    }
}

/// Maps the opaque `resourceVersion` strings onto the numbers of [`decision::Observed`]:
/// a new number whenever the string changes.
#[derive(Default)]
struct Versions {
    last: Option<String>,
    n: u64,
}

impl Versions {
    fn number(&mut self, rv: Option<&str>) -> u64 {
        if self.last.as_deref() != rv || rv.is_none() {
            self.n += 1;
            self.last = rv.map(str::to_owned);
        }
        self.n
    }
}

fn millis(clock: Instant) -> Millis {
    clock.elapsed().as_millis() as Millis
}

/// The moment `ms` after `clock`'s origin, as a std instant (for the [`Fence`]).
fn at(clock: Instant, ms: Millis) -> std::time::Instant {
    clock.into_std() + Duration::from_millis(ms)
}

fn holder(lease: &Lease) -> Option<&str> {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
}

/// A concurrent write won: 409 `Conflict` (a replace carrying an old `resourceVersion`)
/// or `AlreadyExists` (a create).
fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Now as a `MicroTime`.
fn micro_time_now() -> MicroTime {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
    let jiff = k8s_openapi::jiff::Timestamp::from_microsecond(micros)
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    MicroTime(jiff)
}

struct Elector {
    api: Api<Lease>,
    cfg: KubeLeaseConfig,
    clock: Instant,
    local: Local,
    versions: Versions,
}

impl Elector {
    /// Read and write until we hold the lease; None on shutdown.
    async fn acquire(
        &mut self,
        shutdown: &CancellationToken,
        status: &LeaseStatus,
    ) -> Option<Lease> {
        let timing = self.cfg.timing();
        let every = self.cfg.renew_every();
        let mut announced = None::<String>;
        loop {
            if shutdown.is_cancelled() {
                return None;
            }
            if let Some(lease) = self.try_once(timing, every, &mut announced, status).await {
                return Some(lease);
            }
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    /// One read, and a write when the rule says so. Some(lease) when we won it.
    async fn try_once(
        &mut self,
        timing: Timing,
        bound: Duration,
        announced: &mut Option<String>,
        status: &LeaseStatus,
    ) -> Option<Lease> {
        let current = self.read(bound).await?;
        let now = millis(self.clock);
        let observed = current.as_ref().map(|l| Observed {
            holder: holder(l).map(str::to_owned),
            version: self.versions.number(l.metadata.resource_version.as_deref()),
        });
        // Wait for the longer of our duration and the one the holder announced.
        let theirs = current
            .as_ref()
            .and_then(|l| l.spec.as_ref())
            .and_then(|s| s.lease_duration_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
            .unwrap_or_default();
        let wait_timing = Timing {
            duration: timing.duration.max(theirs),
            ..timing
        };
        match decision::decide(
            now,
            &self.cfg.identity,
            observed.as_ref(),
            &mut self.local,
            wait_timing,
        ) {
            Decision::Wait => {
                decision::lost(&mut self.local);
                let held = Held {
                    holder: observed.and_then(|o| o.holder),
                    transitions: transitions(current.as_ref()),
                    wait: wait_timing.duration,
                };
                self.waiting(held, now, announced, status);
                None
            }
            Decision::Acquire | Decision::Renew => self.claim(current, bound, timing).await,
        }
    }

    /// Read the Lease (`Some(None)`: there is none); `None` when the read failed (logged).
    async fn read(&self, bound: Duration) -> Option<Option<Lease>> {
        match tokio::time::timeout(bound, self.api.get_opt(&self.cfg.name)).await {
            Ok(Ok(l)) => Some(l),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, lease = %self.cfg.name, "leader election: cannot read the Lease");
                None
            }
            Err(_) => {
                tracing::warn!(lease = %self.cfg.name, "leader election: reading the Lease timed out");
                None
            }
        }
    }

    /// Create or replace the Lease as ours (the write carries the read's
    /// `resourceVersion`: a concurrent writer makes it fail with 409). Some(lease) when
    /// written with time left to lead.
    async fn claim(
        &mut self,
        current: Option<Lease>,
        bound: Duration,
        timing: Timing,
    ) -> Option<Lease> {
        let sent = millis(self.clock);
        let (lease, create) = claimed(current, &self.cfg);
        let pp = PostParams::default();
        let write = async {
            if create {
                self.api.create(&pp, &lease).await
            } else {
                self.api.replace(&self.cfg.name, &pp, &lease).await
            }
        };
        match tokio::time::timeout(bound, write).await {
            Ok(Ok(written)) => {
                decision::won(&mut self.local, sent);
                self.versions
                    .number(written.metadata.resource_version.as_deref());
                // Usable only if there is time left to lead.
                decision::is_leader(&self.local, millis(self.clock), timing).then_some(written)
            }
            Ok(Err(e)) => {
                decision::lost(&mut self.local);
                if is_conflict(&e) {
                    tracing::info!(lease = %self.cfg.name, "lost the race for the Lease");
                } else {
                    tracing::warn!(error = %e, lease = %self.cfg.name, "leader election: cannot write the Lease");
                }
                None
            }
            Err(_) => {
                decision::lost(&mut self.local);
                tracing::warn!(lease = %self.cfg.name, "leader election: writing the Lease timed out");
                None
            }
        }
    }
}

/// A Lease someone else holds, as read.
struct Held {
    holder: Option<String>,
    transitions: Option<u64>,
    /// How long its version must stay unchanged before we take it.
    wait: Duration,
}

fn transitions(lease: Option<&Lease>) -> Option<u64> {
    lease
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.lease_transitions)
        .and_then(|t| u64::try_from(t).ok())
}

impl Elector {
    /// Report a Lease held by another (for `/health`), and announce a new holder once.
    fn waiting(
        &self,
        held: Held,
        now: Millis,
        announced: &mut Option<String>,
        status: &LeaseStatus,
    ) {
        let left = self.local.seen.map(|(_, since)| {
            let end = since.saturating_add(held.wait.as_millis() as Millis);
            Duration::from_millis(end.saturating_sub(now))
        });
        status.observed(held.holder.as_deref(), held.transitions, left);
        let h = held.holder.unwrap_or_default();
        if announced.as_deref() != Some(h.as_str()) {
            tracing::info!(lease = %self.cfg.name, holder = %h, "another worker leads; waiting for its Lease to expire");
            *announced = Some(h);
        }
    }
}

/// The Lease with us as holder, and whether it must be created.
fn claimed(current: Option<Lease>, cfg: &KubeLeaseConfig) -> (Lease, bool) {
    let now = micro_time_now();
    let secs = i32::try_from(cfg.duration.as_secs().max(1)).unwrap_or(i32::MAX);
    match current {
        None => (
            Lease {
                metadata: ObjectMeta {
                    name: Some(cfg.name.clone()),
                    namespace: Some(cfg.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(cfg.identity.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            },
            true,
        ),
        Some(mut lease) => {
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            }
            spec.holder_identity = Some(cfg.identity.clone());
            spec.lease_duration_seconds = Some(secs);
            spec.acquire_time = Some(now.clone());
            spec.renew_time = Some(now);
            (lease, false)
        }
    }
}

/// `lease` given up: no holder (nor its times), the term number kept.
fn released(mut lease: Lease) -> Lease {
    if let Some(spec) = lease.spec.as_mut() {
        spec.holder_identity = None;
        spec.acquire_time = None;
        spec.renew_time = None;
    }
    lease
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ended {
    Shutdown,
    Lost,
}

/// Keeps the lease while a term lasts.
struct Renewer {
    api: Api<Lease>,
    cfg: KubeLeaseConfig,
    clock: Instant,
    local: Local,
    /// Our last successful write, carrying its `resourceVersion`.
    lease: Lease,
    /// The term's fence, extended by every renewal that succeeded.
    fence: Fence,
}

impl Renewer {
    /// Renew until the term is cancelled or a renewal fails. Lost: the fence is revoked.
    async fn hold(&mut self) -> Ended {
        let ended = self.renew_until_lost().await;
        if ended == Ended::Lost {
            self.fence.revoke();
        }
        ended
    }

    async fn renew_until_lost(&mut self) -> Ended {
        let timing = self.cfg.timing();
        let every = self.cfg.renew_every();
        let term = self.fence.token().clone();
        loop {
            let Some(deadline) = decision::deadline(&self.local, timing) else {
                return Ended::Lost;
            };
            let last = self.local.renewed_at.unwrap_or(0);
            let next = last.saturating_add(every.as_millis() as Millis);
            let until_next = Duration::from_millis(next.saturating_sub(millis(self.clock)));
            tokio::select! {
                _ = term.cancelled() => return if self.fence.is_open() { Ended::Shutdown } else { Ended::Lost },
                _ = tokio::time::sleep(until_next) => {}
            }
            let sent = millis(self.clock);
            let left = Duration::from_millis(deadline.saturating_sub(sent));
            if left.is_zero() {
                tracing::error!(lease = %self.cfg.name, "lease deadline reached without a renewal: stepping down");
                return Ended::Lost;
            }
            let mut lease = self.lease.clone();
            if let Some(spec) = lease.spec.as_mut() {
                spec.renew_time = Some(micro_time_now());
            }
            let pp = PostParams::default();
            let renewal = self.api.replace(&self.cfg.name, &pp, &lease);
            let result = tokio::select! {
                _ = term.cancelled() => return Ended::Shutdown,
                r = tokio::time::timeout(left, renewal) => r,
            };
            match result {
                Ok(Ok(written)) if holder(&written) == Some(self.cfg.identity.as_str()) => {
                    metrics::counter!(telemetry::RENEWALS, "result" => "ok").increment(1);
                    decision::won(&mut self.local, sent);
                    if let Some(d) = decision::deadline(&self.local, timing) {
                        self.fence.extend(at(self.clock, d));
                    }
                    self.lease = written;
                }
                Ok(Ok(_)) => {
                    metrics::counter!(telemetry::RENEWALS, "result" => "lost").increment(1);
                    tracing::error!(lease = %self.cfg.name, "the Lease names another holder: stepping down");
                    return Ended::Lost;
                }
                Ok(Err(e)) if is_conflict(&e) => {
                    metrics::counter!(telemetry::RENEWALS, "result" => "lost").increment(1);
                    tracing::error!(lease = %self.cfg.name, "the Lease was written by another worker: stepping down");
                    return Ended::Lost;
                }
                Ok(Err(e)) => {
                    metrics::counter!(telemetry::RENEWALS, "result" => "failed").increment(1);
                    tracing::error!(error = %e, lease = %self.cfg.name, "renewing the Lease failed: stepping down");
                    return Ended::Lost;
                }
                Err(_) => {
                    metrics::counter!(telemetry::RENEWALS, "result" => "failed").increment(1);
                    tracing::error!(lease = %self.cfg.name, "renewing the Lease got no answer before the deadline: stepping down");
                    return Ended::Lost;
                }
            }
        }
    }

    /// Give the lease up (empty holder) so that the next worker need not wait. Only while
    /// it is still ours: the write carries our last `resourceVersion`.
    async fn release(&mut self) {
        let timing = self.cfg.timing();
        let Some(deadline) = decision::deadline(&self.local, timing) else {
            return;
        };
        let left = Duration::from_millis(deadline.saturating_sub(millis(self.clock)));
        if left.is_zero() {
            return;
        }
        let lease = released(self.lease.clone());
        let pp = PostParams::default();
        let release = self.api.replace(&self.cfg.name, &pp, &lease);
        match tokio::time::timeout(left, release).await {
            Ok(Ok(_)) => tracing::info!(lease = %self.cfg.name, "released the Lease"),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, lease = %self.cfg.name, "could not release the Lease")
            }
            Err(_) => tracing::warn!(lease = %self.cfg.name, "releasing the Lease timed out"),
        }
        decision::lost(&mut self.local);
    }
}

#[cfg(test)]
mod tests;
