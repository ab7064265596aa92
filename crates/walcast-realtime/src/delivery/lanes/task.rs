//! A lane's task: it takes its work in order, merges waiting batches into one check,
//! authorizes by its batch's deadline and publishes, or skips a late batch and tells its
//! subscribers (see the parent module's docs).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use walcast_bus::subs::NOTICE_SUBS_LAGGED;
use walcast_pipeline::Position;
use walcast_wal2json::Lsn;

use super::filters::narrow_batch;
use super::{lock, Batch, Progress, Work, MAX_UNCONFIRMED};
use crate::authorize::rls::RlsChecker;
use crate::authorize::{authorize_batch, Audience, Judged, PendingChange, Unjudged, Withheld};
use crate::catalog::change::View;
use crate::config::{LaneLimits, RlsMode, RlsOptions};
use crate::delivery::outlet::Outlet;
use crate::error::RealtimeError;
use crate::subscriptions::matcher::Sub;
use crate::telemetry;

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

/// A check that finished within this share of the lag bound (`max_lag / CHECK_SHARE`)
/// lets the lane merge twice as many changes into its next (see [`MergeCap`]).
const CHECK_SHARE: u32 = 4;

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

/// How many changes a lane merges into one check at most. Halved (from the size of the
/// check, not below one) when a check ran past its deadline and was cancelled, so a slow
/// project's backlog is then checked in pieces that can finish in time rather than in one
/// check cancelled whole again and again; doubled back (up to `max`) after each check
/// that finished within a [`CHECK_SHARE`] of the lag bound. A check that finished, however
/// slowly, does not shrink it: a check costs mostly a statement per group of
/// subscribers, whatever its number of changes, so smaller checks of a large audience
/// would only be slower in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MergeCap {
    cap: usize,
    max: usize,
}

impl MergeCap {
    fn new(max: usize) -> MergeCap {
        let max = max.max(1);
        MergeCap { cap: max, max }
    }

    fn cancelled(&mut self, changes: usize) {
        self.cap = (changes.min(self.cap) / 2).max(1);
    }

    fn finished(&mut self, took: Duration, max_lag: Duration) {
        if took <= max_lag / CHECK_SHARE {
            self.cap = self.cap.saturating_mul(2).min(self.max);
        }
    }
}

/// A lane's task (see the module docs).
pub(super) struct LaneTask {
    name: String,
    rls: RlsChecker,
    outlet: Arc<Outlet>,
    progress: Arc<Progress>,
    limits: LaneLimits,
    mode: RlsMode,
    timeout_ms: u64,
    /// Subscription → when it was last told of skipped changes.
    told: HashMap<String, Instant>,
    lagging: Arc<tokio::sync::Semaphore>,
    /// Its checks take the lagging projects' slot until then.
    lagging_until: Option<Instant>,
    /// Changes merged into one check at most (batches waiting are merged up to it).
    merge: MergeCap,
}

impl LaneTask {
    pub(super) fn new(
        name: String,
        rls: RlsChecker,
        outlet: Arc<Outlet>,
        progress: Arc<Progress>,
        limits: LaneLimits,
        opts: &RlsOptions,
        lagging: Arc<tokio::sync::Semaphore>,
    ) -> LaneTask {
        LaneTask {
            name,
            rls,
            outlet,
            progress,
            limits,
            mode: opts.mode,
            merge: MergeCap::new(match opts.mode {
                RlsMode::Naive => 1,
                RlsMode::Batched => opts.max_batch,
            }),
            timeout_ms: opts.timeout_ms,
            told: HashMap::new(),
            lagging,
            lagging_until: None,
        }
    }

    pub(super) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Work>) {
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
    /// check (see [`MergeCap`]) and judge by the same catalog view: a lane that fell
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
        let cap = self.merge.cap;
        while batch.changes.len() < cap {
            let next = match rx.try_recv() {
                Ok(work) => work,
                Err(_) => return (batch, items, None),
            };
            match next {
                Work::Decoded(xids) if self.rls.unconfirmed() < MAX_UNCONFIRMED => {
                    xids.into_iter().for_each(|x| self.rls.decoded(x));
                    items += 1;
                }
                Work::Batch(b) if mergeable(batch.view, cap - batch.changes.len(), &b) => {
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

    /// Narrow, authorize and publish a batch, or skip it if it waited too long.
    async fn batch(&mut self, mut batch: Batch) -> Result<(), RealtimeError> {
        let now = Instant::now();
        if batch.sent.elapsed() > LAGGING_AFTER {
            self.lagging_until = Some(now + LAGGING_FOR);
        }
        let late = batch.sent.elapsed() > self.limits.max_lag;
        if batch.overflow || late {
            self.skip(&mut batch, if late { "lag" } else { "bytes" })
                .await?;
        } else {
            let deadline = batch.sent + self.limits.max_lag;
            let unevaluated = narrow_batch(&mut batch, deadline).await;
            self.judge(&mut batch, unevaluated).await?;
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

    /// Authorize and publish a narrowed batch (or skip it when its checks ran past its
    /// bound); tell those who could not be judged, `unevaluated` among them.
    async fn judge(
        &mut self,
        batch: &mut Batch,
        unevaluated: Vec<Vec<Withheld>>,
    ) -> Result<(), RealtimeError> {
        let checked = batch.changes.iter().any(|c| !c.matched.is_empty());
        // Held while this batch is checked, when its project lags.
        let lagging = self.lagging_until.is_some_and(|t| t > Instant::now());
        let _slot = match checked && lagging {
            true => self.lagging.clone().acquire_owned().await.ok(),
            false => None,
        };
        let Some(judged) = self.authorize(batch, checked).await? else {
            return self.skip(batch, "lag").await;
        };
        for (change, audience) in batch.changes.iter_mut().zip(&judged.audiences) {
            self.outlet.publish(&mut change.event, audience).await?;
        }
        let mut unjudged = judged.unjudged;
        unjudged.resize_with(batch.changes.len(), Vec::new);
        for (u, mut more) in unjudged.iter_mut().zip(unevaluated) {
            u.append(&mut more);
        }
        self.unjudged(batch, unjudged).await
    }

    /// Who may see each change of `batch`, and who could not be judged; `None` when its
    /// checks ran past its lag bound (they were cancelled: the batch is then skipped as
    /// late, its subscribers told, rather than delivered after the bound in silence).
    async fn authorize(
        &mut self,
        batch: &Batch,
        checked: bool,
    ) -> Result<Option<Judged>, RealtimeError> {
        self.rls.set_view(batch.view);
        if !checked {
            return Ok(Some(Judged {
                audiences: vec![Audience::new(); batch.changes.len()],
                unjudged: Vec::new(),
            }));
        }
        let (started, n) = (Instant::now(), batch.changes.len().max(1) as u32);
        let deadline = batch.sent + self.limits.max_lag;
        let rls = &mut self.rls;
        let result = authorize_batch(
            rls,
            &batch.changes,
            self.mode,
            self.timeout_ms,
            Some(deadline),
        )
        .await;
        let took = started.elapsed();
        metrics::histogram!(telemetry::AUTHORIZE_SECONDS).record(took.as_secs_f64());
        if took > SLOW_CHECK {
            self.lagging_until = Some(Instant::now() + LAGGING_FOR);
        }
        match result {
            Ok(judged) => {
                self.merge.finished(took, self.limits.max_lag);
                Ok(Some(judged))
            }
            Err(RealtimeError::CheckDeadline) => {
                self.merge.cancelled(n as usize);
                tracing::warn!(lane = %self.name, changes = n, took_ms = took.as_millis() as u64,
                    "RLS checks ran past the lag bound: cancelled");
                Ok(None)
            }
            Err(e) => Err(e),
        }
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
            // Every subscription of the table, whatever its filter and event: told only
            // those a change matched, a notice would say what a row it may not see held.
            for m in &change.candidates {
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
        let message = format!(
            "Changes were not delivered: this project's changes fell more than {} ms behind the database (its row-level security checks are too slow to keep up); some changes in between are missing",
            self.limits.max_lag.as_millis()
        );
        for (front, ids) in by_front {
            let told = self.tell(&front, ids, &message, batch.through).await?;
            metrics::counter!(telemetry::LAG_NOTICES).increment(told as u64);
        }
        Ok(())
    }

    /// Tell the subscribers whose checks could not judge a change of `batch` (withheld
    /// from them: see [`Unjudged`]) that changes may be missing; counted per project.
    async fn unjudged(
        &mut self,
        batch: &Batch,
        unjudged: Vec<Vec<crate::authorize::Withheld>>,
    ) -> Result<(), RealtimeError> {
        // (project, front, why) → subscription ids.
        let mut told: HashMap<(&str, String, Unjudged), Vec<String>> = HashMap::new();
        for (change, withheld) in batch.changes.iter().zip(unjudged) {
            let withheld = widen(change, withheld);
            let project = change.event.project.as_str();
            let mut counts: HashMap<Unjudged, u64> = HashMap::new();
            for (front, id, why) in withheld {
                *counts.entry(why).or_default() += 1;
                told.entry((project, front, why)).or_default().push(id);
            }
            for (why, n) in counts {
                let labels = [
                    ("project", project.to_string()),
                    ("reason", why.label().to_string()),
                ];
                metrics::counter!(telemetry::UNJUDGED, &labels).increment(n);
            }
        }
        for ((project, front, why), ids) in told {
            let n = ids.len();
            let message = unjudged_message(why);
            let told = self.tell(&front, ids, &message, batch.through).await?;
            if told > 0 {
                tracing::warn!(lane = %self.name, project, front, reason = why.label(), subscriptions = n, told,
                    "changes withheld unjudged: subscribers told");
                let labels = [("project", project.to_string())];
                metrics::counter!(telemetry::UNJUDGED_NOTICES, &labels).increment(told as u64);
            }
        }
        Ok(())
    }

    /// Tell subscriptions of `front` (those not told in the last [`NOTICE_EVERY`]) that
    /// changes were not delivered to them, with `message`; returns how many were told.
    async fn tell(
        &mut self,
        front: &str,
        mut ids: Vec<String>,
        message: &str,
        at: Lsn,
    ) -> Result<usize, RealtimeError> {
        if self.told.len() > MAX_TOLD {
            self.told.clear();
        }
        // In their front's order: a channel's subscriptions fall in one body, so its
        // front tells it once.
        ids.sort_unstable_by(|a, b| walcast_bus::event::allocation_order(a, b));
        ids.dedup();
        let now = Instant::now();
        ids.retain(|id| {
            self.told
                .get(id)
                .is_none_or(|t| t.elapsed() >= NOTICE_EVERY)
        });
        ids.iter().for_each(|id| {
            self.told.insert(id.clone(), now);
        });
        let told = ids.len();
        if told == 0 {
            return Ok(0);
        }
        let out = &self.outlet;
        let notice = Some(NOTICE_SUBS_LAGGED);
        for body in crate::delivery::notice::bodies(ids, message)? {
            out.links
                .send(&out.publisher, front, Position::commit(at), notice, body)
                .await?;
        }
        Ok(told)
    }
}

/// The subscriptions a change's unjudged verdicts concern: every subscription of its
/// table (a candidate's, in effect at the change) with the role and claims of one
/// withheld, whatever its filter and event. The withheld alone are those the change
/// matched: telling only them would say that a row they may not see matched their filter.
fn widen(change: &PendingChange, withheld: Vec<Withheld>) -> Vec<Withheld> {
    if withheld.is_empty() {
        return withheld;
    }
    let subs: HashMap<&str, &Sub> = change
        .candidates
        .iter()
        .flat_map(|m| m.subs())
        .map(|s| (s.spec.id.as_str(), s.as_ref()))
        .collect();
    let mut groups: HashMap<(Option<&str>, &str), Unjudged> = HashMap::new();
    let mut out = Vec::new();
    for (front, id, why) in withheld {
        match subs.get(id.as_str()) {
            Some(s) => {
                groups
                    .entry((s.role(), s.claims_json.as_str()))
                    .or_insert(why);
            }
            None => out.push((front, id, why)),
        }
    }
    for s in subs.values() {
        if let Some(why) = groups.get(&(s.role(), s.claims_json.as_str())) {
            out.push((s.spec.front.clone(), s.spec.id.clone(), *why));
        }
    }
    out
}

/// What a subscriber withheld a change its checks could not judge is told (never the
/// error itself: a policy's error may quote the row).
fn unjudged_message(why: Unjudged) -> String {
    let cause = match why {
        Unjudged::Timeout => "its row-level security check timed out",
        Unjudged::Cancelled => "its row-level security check was cancelled",
        Unjudged::Failed => "its row-level security check failed",
        Unjudged::Catalog => {
            "the table's privileges and policies could not be read as of the change"
        }
        Unjudged::Superseded => "its row changed again before its row-level security check",
        Unjudged::Incomplete => {
            "the deleted row lacks a value its policies read (the table's replica identity is not FULL)"
        }
        Unjudged::Filters => {
            "this project's filters could not all be evaluated before its lag bound"
        }
    };
    format!(
        "Changes may have been missed: a change could not be judged for this subscription ({cause}) and was not delivered"
    )
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

    #[test]
    fn a_cancelled_check_halves_the_next_merge_and_quick_ones_double_it_back() {
        let lag = Duration::from_secs(10);
        let mut m = MergeCap::new(1000);
        assert_eq!(m.cap, 1000);
        m.cancelled(300);
        assert_eq!(m.cap, 150, "half the check that was cancelled");
        m.cancelled(150);
        m.cancelled(75);
        assert_eq!(m.cap, 37);
        m.finished(Duration::from_secs(9), lag);
        assert_eq!(m.cap, 37, "a slow check that finished: kept, not shrunk");
        m.finished(Duration::from_secs(2), lag);
        assert_eq!(m.cap, 74, "within a quarter of the bound: doubled");
        for _ in 0..10 {
            m.finished(Duration::from_millis(10), lag);
        }
        assert_eq!(m.cap, 1000, "never above the configured batch");
        for n in [1, 1, 1] {
            m.cancelled(n);
        }
        assert_eq!(m.cap, 1, "never below one");
        assert_eq!(MergeCap::new(0).cap, 1);
    }
}
