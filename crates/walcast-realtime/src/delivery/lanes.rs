//! Per-project delivery lanes: after decoding and matching (on the pipeline's task), each
//! project's changes are authorized and published by a lane of its own, a task with its
//! own RLS checker (and connections), in commit order within the project and
//! independently of the other projects. A project whose checks are slow therefore holds
//! only itself: its lane falls behind while the others keep up.
//!
//! A lane's lag is bounded, in time ([`LaneLimits::max_lag`]: a batch older than that
//! when its turn comes is not checked) and in bytes ([`LaneLimits::max_bytes`]: past it a
//! new batch is not even queued). A change skipped so is still published audience-free
//! on its table's subject; its subscribers are told (a `subs-lagged` notice on their
//! front's subject, which the front turns into a `system` error on each channel, at most
//! once per subscription every [`NOTICE_EVERY`]), and it is logged and counted.
//!
//! Projects that cannot keep up (a batch waited over [`LAGGING_AFTER`] or a check took
//! over [`SLOW_CHECK`], in the last [`LAGGING_FOR`]) share one check
//! slot between them, so however many tenants have slow policies, they occupy at most one
//! database connection at a time and leave the database's cores to those that keep up.
//!
//! A lane that fell behind merges the batches waiting in its queue into the one it takes
//! (in order, up to `max_batch` changes, at one catalog view): a check costs a statement
//! per group of subscribers whatever its number of changes, so a backlog is checked in a
//! few large batches rather than in the many small ones it was handed.
//!
//! The lanes report how far they got ([`Lanes::position`]): the slot is acknowledged at
//! the lowest position of all, so a crash replays what a slow lane had not published.
//! There are at most `max` lanes (`CDC_NUM_SHARDS`): beyond, projects share lanes by
//! hash. A lane's checker learns, in order with its batches, every transaction decoded
//! before them (their visibility is waited for before a check) and every DDL notice.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use walcast_bus::subs::{SubsEnded, NOTICE_SUBS_LAGGED};
use walcast_pipeline::health::PartLag;
use walcast_pipeline::Position;
use walcast_wal2json::Lsn;

use crate::authorize::rls::RlsChecker;
use crate::authorize::{authorize_batch, Audience, PendingChange};
use crate::catalog::change::{Notice, View};
use crate::config::{LaneLimits, RlsMode, RlsOptions};
use crate::delivery::outlet::Outlet;
use crate::error::RealtimeError;
use crate::telemetry;

/// Transactions decoded and not yet passed to a lane, at most: then they are sent on
/// their own, and the lane confirms their visibility (one query) once it has this many.
const MAX_UNCONFIRMED: usize = 4096;

/// A subscription is told of skipped changes at most this often.
pub const NOTICE_EVERY: Duration = Duration::from_secs(5);

/// Subscriptions remembered as told, at most (then forgotten, so told again sooner).
const MAX_TOLD: usize = 100_000;

/// A batch that waited longer than this for its turn is a lagging project's: its checks
/// take the lagging projects' one shared slot, so projects that cannot keep up never
/// occupy more than one database connection at a time between them (the database's
/// cores stay free for the projects that keep up).
const LAGGING_AFTER: Duration = Duration::from_secs(1);

/// A check that took longer marks its project as lagging too.
const SLOW_CHECK: Duration = Duration::from_millis(250);

/// How long a project stays lagging after its last slow check or late batch.
const LAGGING_FOR: Duration = Duration::from_secs(30);

/// What a lane is handed, in WAL order.
enum Work {
    /// Transactions decoded before what follows.
    Decoded(Vec<u32>),
    /// A DDL notice at its position (see [`RlsChecker::on_notice`]).
    Notice(Arc<Notice>, View),
    Batch(Batch),
    /// A notice for a front, in order with the changes before it.
    Publish {
        front: String,
        at: Position,
        notice: &'static str,
        payload: Bytes,
    },
}

struct Batch {
    changes: Vec<PendingChange>,
    view: View,
    /// Every transaction committed at or before it is complete in this and earlier
    /// batches.
    through: Lsn,
    sent: Instant,
    bytes: usize,
    /// Skipped at once: the lane had too many bytes waiting.
    overflow: bool,
    /// Batches handed to the lane that this one stands for (more than one once merged).
    handed: usize,
}

/// What a lane and the consumer share.
#[derive(Default)]
struct Progress {
    /// Work sent and not yet done.
    outstanding: AtomicUsize,
    /// Every change of the lane committed at or before it is published (or skipped).
    done: AtomicU64,
    bytes: AtomicUsize,
    /// When each waiting batch was sent, oldest first.
    waiting: Mutex<VecDeque<Instant>>,
    skipped: AtomicU64,
    /// What stopped the lane's task (the consumer returns it; the session restarts).
    failed: Mutex<Option<RealtimeError>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Progress {
    fn lag(&self) -> Duration {
        lock(&self.waiting)
            .front()
            .map_or(Duration::ZERO, |t| t.elapsed())
    }
}

/// The consumer's side of one lane.
struct Lane {
    /// The project, or `shared-<n>` for a lane projects share.
    name: String,
    tx: mpsc::UnboundedSender<Work>,
    progress: Arc<Progress>,
    /// Transactions decoded since its last work.
    xids: Vec<u32>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Every lane of a consumer (see the module docs).
pub struct Lanes {
    lanes: Vec<Lane>,
    by_project: HashMap<String, usize>,
    max: usize,
    database_url: String,
    rls: RlsOptions,
    limits: LaneLimits,
    outlet: Arc<Outlet>,
    /// The lagging projects' one check slot (see [`LAGGING_AFTER`]).
    lagging: Arc<tokio::sync::Semaphore>,
}

impl Lanes {
    pub fn new(
        database_url: String,
        rls: RlsOptions,
        limits: LaneLimits,
        outlet: Arc<Outlet>,
    ) -> Lanes {
        Lanes {
            lanes: Vec::new(),
            by_project: HashMap::new(),
            max: rls.shards.max(1),
            database_url,
            rls,
            limits,
            outlet,
            lagging: Arc::new(tokio::sync::Semaphore::new(1)),
        }
    }

    /// The lane of `project`, made (its checker prepared by `seed`) if it has none.
    pub fn lane_for(&mut self, project: &str, seed: impl FnOnce(&mut RlsChecker)) -> usize {
        if let Some(i) = self.by_project.get(project) {
            return *i;
        }
        let i = if self.lanes.len() < self.max {
            let name = project.to_string();
            self.spawn(name, seed)
        } else {
            crate::delivery::consumer::shard_of(project, self.lanes.len())
        };
        self.by_project.insert(project.to_string(), i);
        i
    }

    fn spawn(&mut self, name: String, seed: impl FnOnce(&mut RlsChecker)) -> usize {
        let mut rls = RlsChecker::new(self.database_url.clone(), self.rls.connections);
        seed(&mut rls);
        let (tx, rx) = mpsc::unbounded_channel();
        let progress = Arc::new(Progress::default());
        let task = LaneTask {
            name: name.clone(),
            rls,
            outlet: self.outlet.clone(),
            progress: progress.clone(),
            limits: self.limits,
            mode: self.rls.mode,
            max_batch: match self.rls.mode {
                RlsMode::Naive => 1,
                RlsMode::Batched => self.rls.max_batch.max(1),
            },
            timeout_ms: self.rls.timeout_ms,
            told: HashMap::new(),
            lagging: self.lagging.clone(),
            lagging_until: None,
        };
        tracing::info!(lane = %name, "delivery lane started");
        self.lanes.push(Lane {
            name,
            tx,
            progress,
            xids: Vec::new(),
            task: walcast_core::source_scope::spawn(task.run(rx)),
        });
        self.lanes.len() - 1
    }

    /// A transaction was decoded: every lane's next check waits until it is visible.
    pub fn decoded(&mut self, xid: u32) {
        for lane in &mut self.lanes {
            lane.xids.push(xid);
            if lane.xids.len() >= MAX_UNCONFIRMED {
                let xids = std::mem::take(&mut lane.xids);
                send(lane, Work::Decoded(xids));
            }
        }
    }

    /// A DDL notice: each lane applies it after what it was handed before.
    pub fn notice(&mut self, notice: Notice, to: View) {
        let notice = Arc::new(notice);
        for lane in &mut self.lanes {
            send(lane, Work::Notice(notice.clone(), to));
        }
    }

    /// Hand lane `i` a batch of its project's changes.
    pub fn batch(&mut self, i: usize, changes: Vec<PendingChange>, view: View, through: Lsn) {
        let Some(lane) = self.lanes.get_mut(i) else {
            return;
        };
        let bytes: usize = changes.iter().map(change_bytes).sum();
        let overflow = lane.progress.bytes.load(Ordering::Relaxed) > self.limits.max_bytes;
        lane.progress.bytes.fetch_add(bytes, Ordering::Relaxed);
        let sent = Instant::now();
        lock(&lane.progress.waiting).push_back(sent);
        let batch = Batch {
            changes,
            view,
            through,
            sent,
            bytes,
            overflow,
            handed: 1,
        };
        send(lane, Work::Batch(batch));
    }

    /// Publish a notice for `front` after what `project`'s lane was handed (at once if it
    /// has no lane). `false`: it has none, the caller publishes.
    pub fn publish_after(
        &mut self,
        project: &str,
        front: String,
        at: Position,
        notice: &'static str,
        payload: Bytes,
    ) -> bool {
        let Some(lane) = self
            .by_project
            .get(project)
            .and_then(|i| self.lanes.get_mut(*i))
        else {
            return false;
        };
        let work = Work::Publish {
            front,
            at,
            notice,
            payload,
        };
        send(lane, work);
        true
    }

    /// The first failure of a lane, if one stopped.
    pub fn failure(&self) -> Result<(), RealtimeError> {
        for lane in &self.lanes {
            if let Some(e) = lock(&lane.progress.failed).take() {
                return Err(e);
            }
            if lane.task.is_finished() {
                return Err(RealtimeError::RlsUnavailable("a delivery lane ended"));
            }
        }
        Ok(())
    }

    /// Everything committed at or before the returned position is published by every
    /// lane (`handed`: the last commit handed to the consumer).
    pub fn position(&self, handed: Lsn) -> Lsn {
        self.lanes
            .iter()
            .map(|l| match l.progress.outstanding.load(Ordering::Acquire) {
                0 => handed,
                _ => Lsn(l.progress.done.load(Ordering::Acquire)),
            })
            .fold(handed, Lsn::min)
    }

    /// Nothing is waiting in any lane.
    pub fn idle(&self) -> bool {
        self.lanes
            .iter()
            .all(|l| l.progress.outstanding.load(Ordering::Acquire) == 0)
    }

    /// Each lane's lag in metrics, and the lagging ones on `/health`.
    pub fn report(&self) {
        for lane in &self.lanes {
            let p = &lane.progress;
            let lag = p.lag();
            let label = lane.name.clone();
            metrics::gauge!(telemetry::LANE_LAG, "lane" => label).set(lag.as_secs_f64());
            let queued = lock(&p.waiting).len() as u64;
            let part = format!("realtime/{}", lane.name);
            let report = (queued > 0).then(|| PartLag {
                lag_ms: lag.as_millis() as u64,
                queued,
                skipped_total: p.skipped.load(Ordering::Relaxed),
            });
            self.outlet.health.set_part_lag(&part, report);
        }
    }
}

fn send(lane: &mut Lane, work: Work) {
    if !lane.xids.is_empty() && !matches!(work, Work::Decoded(_)) {
        let xids = std::mem::take(&mut lane.xids);
        send(lane, Work::Decoded(xids));
    }
    lane.progress.outstanding.fetch_add(1, Ordering::AcqRel);
    if lane.tx.send(work).is_err() {
        // The task ended: its failure is reported by `failure`.
        lane.progress.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `next` may be checked together with a batch at `view` handed before it that has
/// `room` changes left: not skipped at once, the same catalog view (or, without event
/// triggers, both reading the catalog afresh anyway), and room for its changes.
fn mergeable(view: View, room: usize, next: &Batch) -> bool {
    let same_view = match (view, next.view) {
        (View::Batch(_), View::Batch(_)) => true,
        (a, b) => a == b,
    };
    same_view && !next.overflow && next.changes.len() <= room
}

/// About what a change holds in memory while it waits.
fn change_bytes(c: &PendingChange) -> usize {
    let row: usize = c
        .row
        .iter()
        .map(|(k, v)| k.len() + v.as_ref().map_or(0, String::len))
        .sum();
    c.event.record_bytes() + row + 256
}

/// A lane's task (see the module docs).
struct LaneTask {
    name: String,
    rls: RlsChecker,
    outlet: Arc<Outlet>,
    progress: Arc<Progress>,
    limits: LaneLimits,
    mode: RlsMode,
    /// Changes checked together at most (batches waiting are merged up to it).
    max_batch: usize,
    timeout_ms: u64,
    /// Subscription → when it was last told of skipped changes.
    told: HashMap<String, Instant>,
    lagging: Arc<tokio::sync::Semaphore>,
    /// Its checks take the lagging projects' slot until then.
    lagging_until: Option<Instant>,
}

impl LaneTask {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Work>) {
        let mut held: Option<Work> = None;
        loop {
            let work = match held.take() {
                Some(work) => work,
                None => match rx.recv().await {
                    Some(work) => work,
                    None => return,
                },
            };
            let (work, items) = match work {
                Work::Batch(batch) => {
                    let (batch, items, next) = self.gather(batch, &mut rx);
                    held = next;
                    (Work::Batch(batch), items)
                }
                other => (other, 1),
            };
            if let Err(e) = self.work(work).await {
                tracing::error!(lane = %self.name, error = %e, "delivery lane failed");
                *lock(&self.progress.failed) = Some(e);
                return;
            }
            self.progress.outstanding.fetch_sub(items, Ordering::AcqRel);
        }
    }

    /// Merge into `batch` the batches already waiting behind it, while they fit in one
    /// check (`max_batch` changes) and judge by the same catalog view: a lane that fell
    /// behind checks its backlog in a few large batches rather than in the many small
    /// ones it was handed (each check costs a statement per group of subscribers,
    /// whatever its number of changes). The transactions decoded in between are noted
    /// (their visibility is waited for before the check, as it would have been for the
    /// later batches). Returns the batch, the work items it stands for, and the first
    /// item it could not take (the caller handles it next, in order).
    fn gather(
        &mut self,
        mut batch: Batch,
        rx: &mut mpsc::UnboundedReceiver<Work>,
    ) -> (Batch, usize, Option<Work>) {
        let mut items = 1;
        if batch.overflow || batch.sent.elapsed() > self.limits.max_lag {
            return (batch, items, None);
        }
        while batch.changes.len() < self.max_batch {
            let next = match rx.try_recv() {
                Ok(work) => work,
                Err(_) => return (batch, items, None),
            };
            match next {
                Work::Decoded(xids) if self.rls.unconfirmed() < MAX_UNCONFIRMED => {
                    xids.into_iter().for_each(|x| self.rls.decoded(x));
                    items += 1;
                }
                Work::Batch(b)
                    if mergeable(batch.view, self.max_batch - batch.changes.len(), &b) =>
                {
                    batch.changes.extend(b.changes);
                    batch.view = b.view;
                    batch.through = batch.through.max(b.through);
                    batch.bytes += b.bytes;
                    batch.handed += b.handed;
                    items += 1;
                }
                other => return (batch, items, Some(other)),
            }
        }
        (batch, items, None)
    }

    async fn work(&mut self, work: Work) -> Result<(), RealtimeError> {
        match work {
            Work::Decoded(xids) => {
                xids.into_iter().for_each(|x| self.rls.decoded(x));
                if self.rls.unconfirmed() >= MAX_UNCONFIRMED {
                    self.rls.wait_visible(&[]).await?;
                }
            }
            Work::Notice(notice, to) => self.rls.on_notice(&notice, to),
            Work::Publish {
                front,
                at,
                notice,
                payload,
            } => {
                let out = &self.outlet;
                out.links
                    .send(&out.publisher, &front, at, Some(notice), payload)
                    .await?;
            }
            Work::Batch(batch) => self.batch(batch).await?,
        }
        Ok(())
    }

    /// Authorize and publish a batch, or skip it if it waited too long.
    async fn batch(&mut self, mut batch: Batch) -> Result<(), RealtimeError> {
        let checked = batch.changes.iter().any(|c| !c.matched.is_empty());
        let now = Instant::now();
        if batch.sent.elapsed() > LAGGING_AFTER {
            self.lagging_until = Some(now + LAGGING_FOR);
        }
        // Held while this batch is checked, when its project lags.
        let lagging = self.lagging_until.is_some_and(|t| t > now);
        let _slot = match checked && lagging {
            true => self.lagging.clone().acquire_owned().await.ok(),
            false => None,
        };
        let late = batch.sent.elapsed() > self.limits.max_lag;
        if batch.overflow || late {
            self.skip(&mut batch, if late { "lag" } else { "bytes" })
                .await?;
        } else {
            self.rls.set_view(batch.view);
            let audiences = if !checked {
                vec![Audience::new(); batch.changes.len()]
            } else {
                let started = Instant::now();
                let audiences =
                    authorize_batch(&mut self.rls, &batch.changes, self.mode, self.timeout_ms)
                        .await?;
                if started.elapsed() > SLOW_CHECK {
                    self.lagging_until = Some(Instant::now() + LAGGING_FOR);
                }
                audiences
            };
            for (change, audience) in batch.changes.iter_mut().zip(&audiences) {
                self.outlet.publish(&mut change.event, audience).await?;
            }
        }
        let p = &self.progress;
        p.done.fetch_max(batch.through.0, Ordering::AcqRel);
        p.bytes.fetch_sub(batch.bytes, Ordering::Relaxed);
        let mut waiting = lock(&p.waiting);
        for _ in 0..batch.handed {
            waiting.pop_front();
        }
        Ok(())
    }

    /// A batch not checked: published audience-free (for services reading the table's
    /// subject), its subscribers told, logged and counted.
    async fn skip(&mut self, batch: &mut Batch, why: &'static str) -> Result<(), RealtimeError> {
        let n = batch.changes.len() as u64;
        self.progress.skipped.fetch_add(n, Ordering::Relaxed);
        metrics::counter!(telemetry::CHANGES_LAGGED, "reason" => why).increment(n);
        tracing::warn!(
            lane = %self.name,
            changes = n,
            waited_ms = batch.sent.elapsed().as_millis() as u64,
            reason = why,
            "project lagging past its bound: changes skipped for its subscribers"
        );
        let mut by_front: HashMap<String, Vec<String>> = HashMap::new();
        for change in &batch.changes {
            for m in &change.matched {
                for (front, bucket) in &m.fronts {
                    let ids = bucket
                        .iter()
                        .filter(|s| m.at > s.effective_from)
                        .map(|s| s.spec.id.clone());
                    by_front.entry(front.clone()).or_default().extend(ids);
                }
            }
        }
        for change in &mut batch.changes {
            self.outlet
                .publish(&mut change.event, &Audience::new())
                .await?;
        }
        self.tell(by_front, batch.through).await
    }

    /// Tell subscriptions (not told in the last [`NOTICE_EVERY`]) that changes were skipped.
    async fn tell(
        &mut self,
        by_front: HashMap<String, Vec<String>>,
        at: Lsn,
    ) -> Result<(), RealtimeError> {
        if self.told.len() > MAX_TOLD {
            self.told.clear();
        }
        let message = format!(
            "Changes were not delivered: this project's changes fell more than {} ms behind the database (its row-level security checks are too slow to keep up); some changes in between are missing",
            self.limits.max_lag.as_millis()
        );
        for (front, mut ids) in by_front {
            ids.sort_unstable();
            ids.dedup();
            let now = Instant::now();
            ids.retain(|id| {
                self.told
                    .get(id)
                    .is_none_or(|t| t.elapsed() >= NOTICE_EVERY)
            });
            if ids.is_empty() {
                continue;
            }
            ids.iter().for_each(|id| {
                self.told.insert(id.clone(), now);
            });
            metrics::counter!(telemetry::LAG_NOTICES).increment(ids.len() as u64);
            let payload = serde_json::to_vec(&SubsEnded {
                ids,
                message: message.clone(),
            })
            .map_err(|e| RealtimeError::Event(crate::delivery::event::EventError::Json(e)))?;
            let out = &self.outlet;
            let at = Position::commit(at);
            let notice = Some(NOTICE_SUBS_LAGGED);
            out.links
                .send(&out.publisher, &front, at, notice, payload.into())
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(view: View, overflow: bool) -> Batch {
        Batch {
            changes: Vec::new(),
            view,
            through: Lsn::ZERO,
            sent: Instant::now(),
            bytes: 0,
            overflow,
            handed: 1,
        }
    }

    #[test]
    fn batches_merge_only_at_one_catalog_view_and_never_an_overflowing_one() {
        let at = |n| View::Epoch(Some(n));
        assert!(mergeable(at(3), 10, &batch(at(3), false)));
        assert!(
            !mergeable(at(3), 10, &batch(at(4), false)),
            "a DDL in between"
        );
        assert!(!mergeable(View::Epoch(None), 10, &batch(at(4), false)));
        assert!(
            !mergeable(at(3), 10, &batch(at(3), true)),
            "skipped at once"
        );
        assert!(mergeable(View::Batch(1), 10, &batch(View::Batch(2), false)));
        assert!(!mergeable(View::Batch(1), 10, &batch(at(2), false)));
    }
}
