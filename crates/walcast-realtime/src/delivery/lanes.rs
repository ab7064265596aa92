//! Per-project delivery lanes: after decoding and matching (on the pipeline's task), each
//! project's changes are authorized and published by a lane of its own, a task with its
//! own RLS checker (and connections), in commit order within the project and
//! independently of the other projects. A project whose checks are slow therefore holds
//! only itself: its lane falls behind while the others keep up.
//!
//! A lane's lag is bounded, in time ([`LaneLimits::max_lag`]: a batch older than that
//! when its turn comes is not checked, and a check still running when its batch reaches
//! that age is cancelled, on the server too) and in bytes ([`LaneLimits::max_bytes`]:
//! past it a new batch is not even queued). A change skipped so is still published
//! audience-free on its table's subject; its subscribers are told (a `subs-lagged`
//! notice on their front's subject, which the front turns into a `system` error on each
//! channel, at most once per subscription every `NOTICE_EVERY` (5 s)), and it is
//! logged and counted.
//!
//! Projects that cannot keep up (a batch waited over `LAGGING_AFTER` (1 s) or a check
//! took over `SLOW_CHECK` (250 ms), in the last `LAGGING_FOR` (30 s)) share one check
//! slot between them, so however many tenants have slow policies, they occupy at most one
//! database connection at a time and leave the database's cores to those that keep up.
//!
//! A lane that fell behind merges the batches waiting in its queue into the one it takes
//! (in order, up to `max_batch` changes, at one catalog view): a check costs a statement
//! per group of subscribers whatever its number of changes, so a backlog is checked in a
//! few large batches rather than in the many small ones it was handed. A check cancelled
//! at its deadline halves what the lane merges next, and quick checks double it back
//! (`task::MergeCap`), so that a slow project's backlog is checked in pieces that finish
//! in time.
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
use walcast_pipeline::health::PartLag;
use walcast_pipeline::Position;
use walcast_wal2json::Lsn;

use crate::authorize::rls::RlsChecker;
use crate::authorize::PendingChange;
use crate::catalog::change::{Notice, View};
use crate::config::{LaneLimits, RlsOptions};
use crate::delivery::outlet::Outlet;
use crate::error::RealtimeError;
use crate::telemetry;

mod filters;
mod task;

use task::LaneTask;

/// Transactions decoded and not yet passed to a lane, at most: then they are sent on
/// their own, and the lane confirms their visibility (one query) once it has this many.
const MAX_UNCONFIRMED: usize = 4096;

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

/// A stable shard for a project (FNV-1a), so routing survives restarts.
pub fn shard_of(project: &str, shards: usize) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in project.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % shards.max(1) as u64) as usize
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
    /// The check login's URL (see [`walcast_control::check_login`]).
    check_url: String,
    rls: RlsOptions,
    limits: LaneLimits,
    outlet: Arc<Outlet>,
    /// The lagging projects' one check slot (see `LAGGING_AFTER` (1 s)).
    lagging: Arc<tokio::sync::Semaphore>,
}

impl Lanes {
    pub fn new(
        database_url: String,
        check_url: String,
        rls: RlsOptions,
        limits: LaneLimits,
        outlet: Arc<Outlet>,
    ) -> Lanes {
        Lanes {
            lanes: Vec::new(),
            by_project: HashMap::new(),
            max: rls.shards.max(1),
            database_url,
            check_url,
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
            shard_of(project, self.lanes.len())
        };
        self.by_project.insert(project.to_string(), i);
        i
    }

    fn spawn(&mut self, name: String, seed: impl FnOnce(&mut RlsChecker)) -> usize {
        let mut rls = RlsChecker::new(
            self.database_url.clone(),
            self.check_url.clone(),
            self.rls.connections,
        );
        seed(&mut rls);
        let (tx, rx) = mpsc::unbounded_channel();
        let progress = Arc::new(Progress::default());
        let lagging = self.lagging.clone();
        let outlet = self.outlet.clone();
        let task = LaneTask::new(
            name.clone(),
            rls,
            outlet,
            progress.clone(),
            self.limits,
            &self.rls,
            lagging,
        );
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

/// About what a change holds in memory while it waits.
fn change_bytes(c: &PendingChange) -> usize {
    let row: usize = c
        .row
        .iter()
        .chain(&c.old)
        .map(|(k, v)| k.len() + v.as_ref().map_or(0, String::len))
        .sum();
    c.event.record_bytes() + row + 256
}
