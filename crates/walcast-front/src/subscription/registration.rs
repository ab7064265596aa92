//! Talking to the cdc-worker about this front's subscriptions ([`Registration`]): register
//! (on join, token refresh and resync), unregister, the periodic sync, answering a new
//! leader's resync request, and the worker's notice that it ended subscriptions (their
//! table was dropped). The map they keep is [`super::registry`].
//!
//! Each source (database) has its own leader: a subscription is registered with, and
//! unregistered from, the leader of its project's source (a batch is split by source),
//! the sync goes to every source's leader with only that source's ids, and a resync
//! request (on a source's own resync subject) is answered with that source's
//! subscriptions only.
//!
//! A join of a subscription whose class the worker already delivers by class to this
//! front (see [`Registry::claim_ready`]) needs no
//! round trip: it is in effect as soon as it is in the map, and is registered with the
//! worker in the background (so the worker knows it for a resync, a sync, and in case
//! the table turns on row-level security). Until that registration arrived, removing
//! other subscriptions of the class waits, so the worker never forgets the class while
//! a member it has not heard of depends on it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::subs::{
    FrontHello, RegisterRequest, ResyncProgress, SubsClient, SubsEnded, SubscriptionSpec,
    SyncMessage, UnregisterRequest, SUBJECT_RESYNC, SYNC_INTERVAL,
};
use walcast_bus::{BusError, BusMessage, Subscription};

use crate::cluster::listen::next_message;
use crate::config::FrontConfig;
use crate::projects::Projects;
use crate::subscription::registry::{Registry, Removed};
use crate::telemetry;

/// Attempts of a registration in the background or on a resync, at least, before the
/// client is told it failed.
const BACKGROUND_ATTEMPTS: u32 = 3;
/// How long a background registration is tried again while no leader answers, before
/// its channel is told it failed: a takeover (a frozen or killed leader replaced within
/// its lease, and the new one answering) is not a failure. As long as the fronts give a
/// source without a leader before telling its subscribers.
const BACKGROUND_PATIENCE: Duration = crate::subscription::source_watch::NO_LEADER_GRACE;
/// The pause between two attempts (a request no worker listens to fails at once).
const RETRY_PAUSE: Duration = Duration::from_secs(1);
/// Joined subscriptions waiting for their background registration; when full, a join
/// waits for the worker instead.
pub(crate) const BACKGROUND_QUEUE: usize = 65_536;

/// A subscription in effect whose registration with the worker is still to be sent.
pub(crate) type Background = (u64, SubscriptionSpec);

/// Refused ids → the worker's reason.
pub(crate) type Refused = HashMap<String, String>;

/// This front's side of the conversation with the cdc-worker about subscriptions: the
/// subscription client, the registry the answers update, and the queue of background
/// registrations.
pub(crate) struct Registration {
    front_id: String,
    subs: SubsClient,
    registry: Arc<Registry>,
    /// Which source each project is on.
    projects: Projects,
    background: mpsc::Sender<Background>,
    /// Delayed unregistrations run on it (see [`Registration::unregister`]).
    tracker: TaskTracker,
    register_timeout: Duration,
    resync_batch: usize,
}

impl Registration {
    /// The registration, and the queue of background registrations for [`background_loop`].
    pub(crate) fn new(
        (front_id, subs): (String, SubsClient),
        (registry, projects): (Arc<Registry>, Projects),
        tracker: TaskTracker,
        cfg: &FrontConfig,
    ) -> (Registration, mpsc::Receiver<Background>) {
        let (background, queue) = mpsc::channel(BACKGROUND_QUEUE);
        let registration = Registration {
            front_id,
            subs,
            registry,
            projects,
            background,
            tracker,
            register_timeout: cfg.register_timeout,
            resync_batch: cfg.resync_batch.max(1),
        };
        (registration, queue)
    }

    /// This front's id (the `front` of its subscription specs).
    pub(crate) fn front_id(&self) -> &str {
        &self.front_id
    }

    /// The subscriptions the registration keeps up to date.
    pub(crate) fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The source of a project (`None`: unknown to the directory).
    pub(crate) fn source_of(&self, project: &str) -> Option<String> {
        self.projects.source_of(project)
    }

    /// The source a subscription is registered on: the one it was made with, else its
    /// project's.
    fn source_for(&self, spec: &SubscriptionSpec) -> Option<String> {
        self.registry()
            .source_of(&spec.id)
            .or_else(|| self.source_of(&spec.project))
    }

    /// Register specs with the leaders of their projects' sources. `Ok` maps each refused
    /// id to the worker's reason; `Err` is why a request failed (no answer in time, NATS
    /// down …; the other sources' answers are applied). An accepted subscription keeps
    /// the position it first became effective from.
    pub(crate) async fn register(&self, specs: Vec<SubscriptionSpec>) -> Result<Refused, BusError> {
        let (groups, mut refused) = group_by_source(specs, |s| self.source_for(s));
        let mut failed = None;
        for (source, specs) in groups {
            match self.register_to(&source, specs).await {
                Ok(r) => refused.extend(r),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(refused),
        }
    }

    /// [`Registration::register`] of specs all on `source`.
    async fn register_to(
        &self,
        source: &str,
        specs: Vec<SubscriptionSpec>,
    ) -> Result<Refused, BusError> {
        if specs.is_empty() {
            return Ok(HashMap::new());
        }
        let ids: Vec<String> = specs.iter().map(|s| s.id.clone()).collect();
        let reply = self
            .subs
            .register(
                source,
                RegisterRequest { subs: specs },
                self.register_timeout,
            )
            .await
            .inspect_err(|_| telemetry::error("register"))?;
        metrics::counter!(telemetry::REGISTRATIONS, "path" => "worker").increment(ids.len() as u64);
        let results: HashMap<&str, &walcast_bus::subs::RegisterResult> =
            reply.results.iter().map(|r| (r.id.as_str(), r)).collect();
        let mut refused = HashMap::new();
        let mut accepted = Vec::with_capacity(ids.len());
        for id in ids {
            match results.get(id.as_str()) {
                Some(r) if r.ok => {
                    if let Some(at) = reply.effective_from {
                        self.registry().confirm(&id, r.by_class, at);
                    }
                    accepted.push(id);
                }
                Some(r) => {
                    let why = r
                        .error
                        .clone()
                        .unwrap_or_else(|| "subscription refused by the cdc-worker".into());
                    refused.insert(id, why);
                }
                None => {
                    refused.insert(
                        id,
                        "the cdc-worker did not answer for this subscription".into(),
                    );
                }
            }
        }
        if let Some(at) = reply.effective_from {
            self.registry().set_from(&accepted, at);
        }
        Ok(refused)
    }

    /// Register the subscriptions of a join: those of a ready class at once (registered
    /// with the worker in the background), the others with the worker, waited for.
    pub(crate) async fn register_join(
        &self,
        subs: &[u64],
        specs: Vec<SubscriptionSpec>,
    ) -> Result<Refused, BusError> {
        let registry = self.registry();
        let mut slow = Vec::new();
        for (n, mut spec) in subs.iter().zip(specs) {
            let claimed = self
                .source_for(&spec)
                .and_then(|source| registry.claim_ready(&spec, &source));
            let Some((from, class)) = claimed else {
                slow.push(spec);
                continue;
            };
            let mut queued = spec.clone();
            queued.from = Some(from);
            if self.background.try_send((*n, queued)).is_err() {
                // The queue is full (or closing): this one waits for the worker.
                registry.end_pending(std::slice::from_ref(&class));
                slow.push(spec);
                continue;
            }
            registry.set_from(std::slice::from_ref(&spec.id), from);
            spec.from = Some(from);
            metrics::counter!(telemetry::REGISTRATIONS, "path" => "ready_class").increment(1);
        }
        self.register(slow).await
    }

    /// [`Registration::register`], tried again while the request fails as a whole: at
    /// least [`BACKGROUND_ATTEMPTS`] times, and until `patience` has passed (`what` names
    /// the caller in the logs).
    async fn register_retrying(
        &self,
        specs: &[SubscriptionSpec],
        what: &'static str,
        patience: Duration,
    ) -> Result<Refused, BusError> {
        let started = tokio::time::Instant::now();
        let mut attempt = 1;
        loop {
            match self.register(specs.to_vec()).await {
                Err(e) if attempt < BACKGROUND_ATTEMPTS || started.elapsed() < patience => {
                    tracing::warn!(attempt, error = %e, what, "registration failed; retrying");
                    attempt += 1;
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                outcome => return outcome,
            }
        }
    }

    /// How long a background registration may take at most, tries and pauses included.
    fn background_limit(&self) -> Duration {
        let tries = (self.register_timeout + RETRY_PAUSE) * BACKGROUND_ATTEMPTS;
        BACKGROUND_PATIENCE.max(tries) + self.register_timeout
    }

    /// The worker's registration of subscriptions already in effect; one it refuses (the
    /// table left realtime, a privilege was revoked in between) is removed and its channel
    /// told, as a refused join would have been.
    async fn register_in_background(self: &Arc<Self>, subs: Vec<(u64, SubscriptionSpec)>) {
        let specs: Vec<SubscriptionSpec> = subs.iter().map(|(_, s)| s.clone()).collect();
        let outcome = self
            .register_retrying(&specs, "background", BACKGROUND_PATIENCE)
            .await;
        let refused: Refused = match outcome {
            Ok(refused) => refused,
            Err(e) => specs
                .iter()
                .map(|s| (s.id.clone(), format!("Unable to subscribe to changes: {e}")))
                .collect(),
        };
        let ended: Vec<(u64, String)> = subs
            .iter()
            .filter_map(|(n, spec)| refused.get(&spec.id).map(|why| (*n, why.clone())))
            .collect();
        self.end_subscriptions(ended, "refused_after_join").await;
    }

    /// End subscriptions already in effect: tell each sink why (`Sink::end`), remove them
    /// and tell the worker. `what` names the cause in the error counter.
    pub(crate) async fn end_subscriptions(
        self: &Arc<Self>,
        ended: Vec<(u64, String)>,
        what: &'static str,
    ) {
        for (n, why) in ended {
            let sink = self.registry().sink_of(n);
            let id = sink.as_ref().map(|(_, s)| s.id.clone()).unwrap_or_default();
            tracing::warn!(%id, reason = %why, what, "subscription ended by the worker");
            telemetry::error(what);
            if let Some((sink, _)) = sink {
                sink.end(&why);
            }
            let removed = self.registry().remove(&[n]);
            self.unregister(removed).await;
        }
    }

    /// The worker ended some of our subscriptions (their table was dropped; its notice on
    /// the delivery subject): each channel gets a `system` error and the subscriptions are
    /// removed.
    pub(crate) async fn subs_ended(self: &Arc<Self>, m: &BusMessage) {
        let Some(notice) = subs_notice(m) else {
            return;
        };
        let ended: Vec<(u64, String)> = notice
            .ids
            .iter()
            .filter_map(|id| self.registry().own(id))
            .map(|n| (n, notice.message.clone()))
            .collect();
        self.end_subscriptions(ended, "table_dropped").await;
    }

    /// The worker skipped changes for some of our subscriptions (`changes_lagged`: their
    /// project lagged past its bound, or their checks could not judge them) or withholds
    /// them (`changes_withheld`: say, their filter reads a column their role may no longer
    /// read): each channel gets one `system` error, however many of its subscriptions the
    /// notice names; the subscriptions go on.
    pub(crate) fn subs_warned(&self, m: &BusMessage, kind: &'static str) {
        let Some(notice) = subs_notice(m) else {
            return;
        };
        let mut told = std::collections::HashSet::new();
        let mut subscriptions = 0usize;
        for id in &notice.ids {
            let Some(n) = self.registry().own(id) else {
                continue;
            };
            if let Some((sink, _)) = self.registry().sink_of(n) {
                subscriptions += 1;
                if told.insert(sink.id()) {
                    sink.warn(&notice.message);
                }
            }
        }
        if subscriptions > 0 {
            metrics::counter!(telemetry::ERRORS, "kind" => kind).increment(subscriptions as u64);
            tracing::warn!(subscriptions, channels = told.len(), kind, reason = %notice.message, "changes not delivered to subscriptions: their channels told");
        }
    }

    /// Tell the worker these subscriptions are gone (errors are logged: `sync` repairs
    /// them). While a registration of one of their classes is on its way, this is sent
    /// only once it arrived (in the background), so the worker keeps the class for the
    /// subscription that depends on it.
    pub(crate) async fn unregister(self: &Arc<Self>, removed: Removed) {
        if removed.ids.is_empty() {
            return;
        }
        if !removed.wait {
            return self.send_unregister(removed.by_source()).await;
        }
        let me = self.clone();
        self.tracker.spawn(async move {
            let limit = me.background_limit();
            me.registry().settle(&removed.classes, limit).await;
            me.send_unregister(removed.by_source()).await;
        });
    }

    /// Unregister ids from the leader of their source.
    async fn send_unregister(&self, by_source: BTreeMap<String, Vec<String>>) {
        for (source, ids) in by_source {
            if let Err(e) = self
                .subs
                .unregister(&source, UnregisterRequest { ids })
                .await
            {
                telemetry::error("unregister");
                tracing::warn!(%source, error = %e, "unregister failed (the next sync repairs it)");
            }
        }
    }

    /// Register one chunk with a new leader (tried [`BACKGROUND_ATTEMPTS`] times). What it
    /// refuses, or what could not be registered at all, ends with a `system` error to its
    /// channel: a subscription the new leader does not know would stay subscribed and deaf.
    async fn resync_chunk(self: &Arc<Self>, chunk: &[SubscriptionSpec]) {
        let outcome = self
            .register_retrying(chunk, "resync", Duration::ZERO)
            .await;
        let refused: Refused = match outcome {
            Ok(refused) => refused,
            Err(e) => chunk
                .iter()
                .map(|s| {
                    let why = format!("Unable to subscribe to changes after a failover: {e}");
                    (s.id.clone(), why)
                })
                .collect(),
        };
        let ended: Vec<(u64, String)> = refused
            .into_iter()
            .filter_map(|(id, why)| self.registry().own(&id).map(|n| (n, why)))
            .collect();
        self.end_subscriptions(ended, "refused_on_resync").await;
    }

    /// Answer a resync request (a new leader of a source, named by the request's subject):
    /// register that source's subscriptions again, telling the leader where we are.
    async fn resync(self: &Arc<Self>, request: &BusMessage) {
        let Some(source) = walcast_bus::source::of_subject(&request.subject, SUBJECT_RESYNC) else {
            telemetry::error("bad_resync_subject");
            tracing::warn!(subject = %request.subject, "a resync request on an unknown subject");
            return;
        };
        // The request's payload is where the new leader waits for our progress.
        let reply_to = std::str::from_utf8(&request.payload)
            .ok()
            .filter(|s| !s.is_empty())
            .map(str::to_string);
        let progress = |done: bool| ResyncProgress {
            front: self.front_id.clone(),
            done,
        };
        if let Some(to) = &reply_to {
            if let Err(e) = self.subs.answer(to, &progress(false)).await {
                tracing::warn!(error = %e, "cannot answer a resync request");
            }
        }
        let specs = self.registry().specs_of(source);
        tracing::info!(
            count = specs.len(),
            source,
            "resync requested: registering the source's subscriptions again"
        );
        // In batches, so joins are not held behind one huge registration.
        for chunk in specs.chunks(self.resync_batch) {
            self.resync_chunk(chunk).await;
        }
        if let Some(to) = &reply_to {
            if let Err(e) = self.subs.answer(to, &progress(true)).await {
                tracing::warn!(error = %e, "cannot report a finished resync");
            }
        }
    }
}

/// Send the background registrations in batches (of up to `resync_batch`), one batch at
/// a time: a burst of joins costs the worker a few requests, not one per join.
pub(crate) async fn background_loop(
    registration: Arc<Registration>,
    mut queue: mpsc::Receiver<Background>,
    cancel: CancellationToken,
) {
    let max = registration.resync_batch;
    loop {
        let mut batch = Vec::with_capacity(max);
        tokio::select! {
            _ = cancel.cancelled() => return,
            n = queue.recv_many(&mut batch, max) => if n == 0 { return },
        }
        let classes: Vec<String> = batch
            .iter()
            .map(|(_, s)| registration.registry().class_of(s))
            .collect();
        registration.register_in_background(batch).await;
        registration.registry().end_pending(&classes);
    }
}

/// Every [`SYNC_INTERVAL`]: send each source's leader the full list of this front's
/// subscription ids of that source ([`sync_lists`]).
pub(crate) async fn sync_loop(registration: Arc<Registration>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(SYNC_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let lists = sync_lists(
            registration.registry().ids_by_source(),
            registration.projects.sources(),
        );
        for (source, ids) in lists {
            let msg = SyncMessage::whole(registration.front_id.clone(), ids);
            if let Err(e) = registration.subs.sync(&source, msg).await {
                telemetry::error("sync");
                tracing::warn!(%source, error = %e, "subscription sync failed");
            }
        }
    }
}

/// The sync lists: one for the default source always (workers learn from it which
/// fronts are alive), and one for every other source a known project is on or a
/// subscription is registered on (an empty list tells that leader to drop what it holds
/// for this front).
pub(crate) fn sync_lists(
    mut ids: HashMap<String, Vec<String>>,
    sources: impl IntoIterator<Item = String>,
) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = sources
        .into_iter()
        .chain([walcast_bus::source::DEFAULT_SOURCE.to_string()])
        .map(|s| (s, Vec::new()))
        .collect();
    for (source, ids) in ids.drain() {
        out.entry(source).or_default().extend(ids);
    }
    out
}

/// Split specs by the source `source_for` names; those it names none for (their
/// project is unknown) are refused.
pub(crate) fn group_by_source(
    specs: Vec<SubscriptionSpec>,
    source_for: impl Fn(&SubscriptionSpec) -> Option<String>,
) -> (BTreeMap<String, Vec<SubscriptionSpec>>, Refused) {
    let mut groups: BTreeMap<String, Vec<SubscriptionSpec>> = BTreeMap::new();
    let mut refused = Refused::new();
    for spec in specs {
        match source_for(&spec) {
            Some(source) => groups.entry(source).or_default().push(spec),
            None => {
                let why = format!(
                    "Unable to subscribe to changes: unknown project {:?}",
                    spec.project
                );
                refused.insert(spec.id, why);
            }
        }
    }
    (groups, refused)
}

/// On every roll call (a worker starting), say that this front exists: a new leader then
/// waits for this front's resync even if it is slow to answer.
pub(crate) async fn roll_call_loop(
    registration: Arc<Registration>,
    mut sub: Subscription,
    cancel: CancellationToken,
) {
    while let Some(request) = next_message(&mut sub, &cancel, "roll call").await {
        let Ok(to) = std::str::from_utf8(&request.payload) else {
            continue;
        };
        let hello = FrontHello {
            front: registration.front_id.clone(),
        };
        if let Err(e) = registration.subs.answer(to, &hello).await {
            tracing::warn!(error = %e, "cannot answer a roll call");
        }
    }
}

/// On every resync request (a new leader of a source), register that source's
/// subscriptions again.
pub(crate) async fn resync_loop(
    registration: Arc<Registration>,
    mut sub: Subscription,
    cancel: CancellationToken,
) {
    while let Some(request) = next_message(&mut sub, &cancel, "resync").await {
        registration.resync(&request).await;
    }
}

/// A `subs-ended` or `subs-lagged` notice's body (logged and counted when undecodable).
fn subs_notice(m: &BusMessage) -> Option<SubsEnded> {
    serde_json::from_slice(&m.payload)
        .inspect_err(|e| {
            telemetry::error("bad_notice");
            tracing::warn!(error = %e, "undecodable notice on the delivery subject");
        })
        .ok()
}

#[cfg(test)]
mod tests;
