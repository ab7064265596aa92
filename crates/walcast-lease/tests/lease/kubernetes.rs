//! Three real Kubernetes Lease electors against the fake API server, over real HTTP.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use walcast_lease::kubernetes::{self, KubeLeaseConfig};
use walcast_lease::{Action, Fence, LeaseStatus};
use walcast_testkit::fake_kube::FakeApi;

const NS: &str = "walcast";
const NAME: &str = "cdc";

#[derive(Clone, Debug)]
struct Term {
    who: String,
    start: Instant,
    end: Option<Instant>,
    fence: Fence,
}

/// Every term of every elector, as the electors saw them: from `lead` being called to
/// the term's token firing (or the elector being killed).
#[derive(Default)]
struct Terms {
    log: Mutex<Vec<Term>>,
    /// Overlaps seen live, at the start of a term.
    violations: Mutex<Vec<String>>,
    changed: Mutex<Option<watch::Sender<u64>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Terms {
    fn new() -> (Arc<Self>, watch::Receiver<u64>) {
        let (tx, rx) = watch::channel(0);
        let t = Terms::default();
        *lock(&t.changed) = Some(tx);
        (Arc::new(t), rx)
    }

    fn bump(&self) {
        if let Some(tx) = lock(&self.changed).as_ref() {
            tx.send_modify(|v| *v += 1);
        }
    }

    fn start(&self, who: &str, fence: &Fence) -> usize {
        let mut log = lock(&self.log);
        let active: Vec<String> = log
            .iter()
            .filter(|t| t.end.is_none())
            .map(|t| t.who.clone())
            .collect();
        if !active.is_empty() {
            lock(&self.violations).push(format!("{who} became leader while {active:?} lead"));
        }
        // Stricter: whatever the others' tasks are doing, none of their fences is open.
        let open: Vec<String> = log
            .iter()
            .filter(|t| t.fence.is_open())
            .map(|t| format!("{} (term {})", t.who, t.fence.term()))
            .collect();
        if !open.is_empty() {
            lock(&self.violations).push(format!(
                "{who} became leader while the fences of {open:?} are open"
            ));
        }
        log.push(Term {
            who: who.to_string(),
            start: Instant::now(),
            end: None,
            fence: fence.clone(),
        });
        drop(log);
        self.bump();
        lock(&self.log).len() - 1
    }

    fn end(&self, i: usize) {
        if let Some(t) = lock(&self.log).get_mut(i) {
            t.end.get_or_insert_with(Instant::now);
        }
        self.bump();
    }

    fn all(&self) -> Vec<Term> {
        lock(&self.log).clone()
    }

    fn current(&self) -> Option<Term> {
        lock(&self.log).iter().find(|t| t.end.is_none()).cloned()
    }

    /// No two terms of different electors overlap, and none was seen live.
    fn assert_exclusive(&self) {
        let v = lock(&self.violations).clone();
        assert!(v.is_empty(), "two leaders at once: {v:?}");
        let all = self.all();
        let far = Instant::now() + Duration::from_secs(3600);
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                let (ae, be) = (a.end.unwrap_or(far), b.end.unwrap_or(far));
                assert!(
                    ae <= b.start || be <= a.start,
                    "overlapping terms: {a:?} and {b:?}"
                );
            }
        }
    }
}

/// Records the end of a term when dropped: when the term's token fires, or when the
/// elector is killed in the middle of it.
struct TermGuard(Arc<Terms>, usize);

impl Drop for TermGuard {
    fn drop(&mut self) {
        self.0.end(self.1);
    }
}

struct Elector {
    name: String,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

async fn spawn_elector(api: &FakeApi, terms: &Arc<Terms>, name: &str, d: Duration) -> Elector {
    let cfg = KubeLeaseConfig {
        api_url: Some(api.endpoint(name).await),
        kubeconfig: None,
        context: None,
        namespace: NS.into(),
        name: NAME.into(),
        identity: name.into(),
        duration: d,
    };
    let shutdown = CancellationToken::new();
    let terms = terms.clone();
    let who = name.to_string();
    let sd = shutdown.clone();
    let task = tokio::spawn(async move {
        let lead = move |fence: Fence| {
            let terms = terms.clone();
            let who = who.clone();
            async move {
                let _guard = TermGuard(terms.clone(), terms.start(&who, &fence));
                fence.cancelled().await;
            }
        };
        kubernetes::run(cfg, Arc::new(LeaseStatus::default()), sd, lead)
            .await
            .expect("elector client");
    });
    Elector {
        name: name.into(),
        shutdown,
        task,
    }
}

async fn three(api: &FakeApi, terms: &Arc<Terms>, d: Duration) -> Vec<Elector> {
    let mut v = Vec::new();
    for n in ["a", "b", "c"] {
        v.push(spawn_elector(api, terms, n, d).await);
    }
    v
}

/// Wait (bounded) until `pred` holds over the terms.
async fn wait_terms(
    terms: &Terms,
    rx: &mut watch::Receiver<u64>,
    within: Duration,
    what: &str,
    mut pred: impl FnMut(&[Term]) -> bool,
) {
    let r = tokio::time::timeout(within, async {
        loop {
            if pred(&terms.all()) {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    })
    .await;
    assert!(
        r.is_ok(),
        "timed out after {within:?} waiting for {what}: terms {:?}",
        terms.all()
    );
}

async fn stop(electors: Vec<Elector>) {
    for e in electors {
        e.shutdown.cancel();
        let r = tokio::time::timeout(Duration::from_secs(10), e.task).await;
        assert!(r.is_ok(), "elector {} did not stop after shutdown", e.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_under_500s_and_hangs() {
    let d = Duration::from_millis(1000);
    let api = FakeApi::new();
    let (terms, mut rx) = Terms::new();
    let electors = three(&api, &terms, d).await;
    wait_terms(&terms, &mut rx, 5 * d, "a first leader", |t| !t.is_empty()).await;
    // 8% of requests fail with 500, 6% hang (half of those after applying the write).
    api.chaos(80, 60);
    let run_until = Instant::now() + 10 * d;
    while Instant::now() < run_until {
        let _ = tokio::time::timeout_at(run_until, rx.changed()).await;
        terms.assert_exclusive();
    }
    api.chaos(0, 0);
    // Still electing once the faults stop.
    wait_terms(&terms, &mut rx, 6 * d, "a leader after the faults", |t| {
        t.iter().any(|t| t.end.is_none())
    })
    .await;
    terms.assert_exclusive();
    assert!(
        terms.all().len() >= 2,
        "the faults should have ended some terms: {:?}",
        terms.all()
    );
    stop(electors).await;
    terms.assert_exclusive();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_only_after_a_full_duration() {
    let d = Duration::from_millis(1000);
    let api = FakeApi::new();
    let (terms, mut rx) = Terms::new();
    let mut electors = three(&api, &terms, d).await;
    wait_terms(&terms, &mut rx, 5 * d, "a first leader", |t| !t.is_empty()).await;
    let leader = terms.current().expect("a leader").who;
    // Let it renew a few times, then kill it: no release, no more renewals.
    tokio::time::sleep(d).await;
    let i = electors
        .iter()
        .position(|e| e.name == leader)
        .expect("leader");
    let killed = electors.remove(i);
    killed.task.abort();
    let _ = killed.task.await;
    let killed_at = Instant::now();
    wait_terms(&terms, &mut rx, 4 * d, "a new leader", |t| {
        t.iter().any(|t| t.who != leader)
    })
    .await;
    let last_write = api
        .writes()
        .iter()
        .filter(|w| w.client == leader)
        .map(|w| w.arrived)
        .max()
        .expect("the leader wrote");
    let next = terms
        .all()
        .into_iter()
        .find(|t| t.who != leader)
        .expect("a new term");
    assert!(
        next.start >= last_write + d,
        "{} took over {:?} after the last renewal of {leader}, less than the duration {d:?}",
        next.who,
        next.start - last_write
    );
    assert!(
        next.start - killed_at < 2 * d,
        "takeover took {:?}",
        next.start - killed_at
    );
    stop(electors).await;
    terms.assert_exclusive();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_leader_releases_the_lease() {
    let d = Duration::from_millis(1500);
    let api = FakeApi::new();
    let (terms, mut rx) = Terms::new();
    let mut electors = three(&api, &terms, d).await;
    wait_terms(&terms, &mut rx, 5 * d, "a first leader", |t| !t.is_empty()).await;
    let leader = terms.current().expect("a leader").who;
    let i = electors
        .iter()
        .position(|e| e.name == leader)
        .expect("leader");
    let stopped = electors.remove(i);
    let stopped_at = Instant::now();
    stop(vec![stopped]).await;
    wait_terms(&terms, &mut rx, 4 * d, "a new leader", |t| {
        t.iter().any(|t| t.who != leader)
    })
    .await;
    let next = terms
        .all()
        .into_iter()
        .find(|t| t.who != leader)
        .expect("a new term");
    // Released: the others need not wait for a full duration.
    assert!(
        next.start - stopped_at < d,
        "takeover after a graceful stop took {:?}",
        next.start - stopped_at
    );
    stop(electors).await;
    terms.assert_exclusive();
}

/// A released Lease is taken at the next read, so the leader's fence must close before
/// its release is sent, not once the answer is back: here the answer comes a full
/// duration late (the releasing worker not scheduled), long after a follower read the
/// free Lease and began its term, which checks that no other fence is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_closes_its_fence_before_releasing_the_lease() {
    let d = Duration::from_millis(1000);
    let api = FakeApi::new();
    api.delay_release_replies(d);
    let (terms, mut rx) = Terms::new();
    let mut electors = three(&api, &terms, d).await;
    wait_terms(&terms, &mut rx, 5 * d, "a first leader", |t| !t.is_empty()).await;
    let leader = terms.current().expect("a leader").who;
    let i = electors
        .iter()
        .position(|e| e.name == leader)
        .expect("leader");
    let stopped = electors.remove(i);
    let stopped_at = Instant::now();
    stopped.shutdown.cancel();
    wait_terms(&terms, &mut rx, 2 * d, "a new leader", |t| {
        t.iter().any(|t| t.who != leader)
    })
    .await;
    let next = terms
        .all()
        .into_iter()
        .find(|t| t.who != leader)
        .expect("a new term");
    // Taken because it was released, not because it ran out.
    assert!(
        next.start - stopped_at < d,
        "takeover after a graceful stop took {:?}",
        next.start - stopped_at
    );
    stop(vec![stopped]).await;
    stop(electors).await;
    terms.assert_exclusive();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_api_stops_before_its_lease_expires() {
    let d = Duration::from_millis(1500);
    let api = FakeApi::new();
    let (terms, mut rx) = Terms::new();
    let electors = three(&api, &terms, d).await;
    wait_terms(&terms, &mut rx, 5 * d, "a first leader", |t| !t.is_empty()).await;
    let leader = terms.current().expect("a leader");
    tokio::time::sleep(d / 2).await;
    api.cut_off(&leader.who);
    wait_terms(
        &terms,
        &mut rx,
        2 * d,
        "the cut-off leader to step down",
        |t| t.iter().any(|t| t.who == leader.who && t.end.is_some()),
    )
    .await;
    let ended = terms
        .all()
        .into_iter()
        .find(|t| t.who == leader.who && t.end.is_some())
        .and_then(|t| t.end)
        .expect("the term ended");
    let last_renewal = api
        .writes()
        .iter()
        .filter(|w| w.client == leader.who)
        .map(|w| w.arrived)
        .max()
        .expect("the leader wrote");
    assert!(
        ended < last_renewal + d,
        "the cut-off leader stopped {:?} after its last renewal, not before the duration {d:?}",
        ended - last_renewal
    );
    // Its fence is closed: nothing it would still try to do goes through.
    let cut = terms
        .all()
        .into_iter()
        .find(|t| t.who == leader.who)
        .expect("the term");
    assert!(cut.fence.check(Action::Publish).is_err(), "{:?}", cut.fence);
    // Another takes over, after the lease expired.
    wait_terms(&terms, &mut rx, 3 * d, "a new leader", |t| {
        t.iter().any(|t| t.who != leader.who)
    })
    .await;
    let next = terms
        .all()
        .into_iter()
        .find(|t| t.who != leader.who)
        .expect("a new term");
    assert!(next.start >= last_renewal + d, "taken over too early");
    api.restore(&leader.who);
    stop(electors).await;
    terms.assert_exclusive();
}
