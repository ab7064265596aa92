//! Postgres lease-row electors against a real Postgres: one open fence at a time; a
//! holder that stops renewing (killed, or cut off by a lock) is replaced about one
//! duration after its last renewal, not before, with its fence already closed and its
//! tagged sessions terminated; a stopped holder releases the lease.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use walcast_lease::postgres::{self, PgLeaseConfig};
use walcast_lease::{Action, Fence, LeaseStatus};
use walcast_testkit::Postgres;

const NAME: &str = "cdc";

#[derive(Clone, Debug)]
struct Term {
    who: String,
    start: Instant,
    end: Option<Instant>,
    fence: Fence,
}

/// Every term of every elector, and the overlaps seen when one began.
struct Terms {
    log: Mutex<Vec<Term>>,
    violations: Mutex<Vec<String>>,
    changed: watch::Sender<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Terms {
    fn new() -> (Arc<Self>, watch::Receiver<u64>) {
        let (changed, rx) = watch::channel(0);
        let t = Terms {
            log: Mutex::default(),
            violations: Mutex::default(),
            changed,
        };
        (Arc::new(t), rx)
    }

    fn start(&self, who: &str, fence: &Fence) -> usize {
        let mut log = lock(&self.log);
        let open: Vec<String> = log
            .iter()
            .filter(|t| t.fence.is_open())
            .map(|t| format!("{} (term {})", t.who, t.fence.term()))
            .collect();
        if !open.is_empty() {
            lock(&self.violations).push(format!(
                "{who} began term {} while the fences of {open:?} are open",
                fence.term()
            ));
        }
        if let Some(last) = log.last() {
            if fence.term() <= last.fence.term() {
                lock(&self.violations).push(format!(
                    "term {} after term {}: terms must grow",
                    fence.term(),
                    last.fence.term()
                ));
            }
        }
        log.push(Term {
            who: who.to_string(),
            start: Instant::now(),
            end: None,
            fence: fence.clone(),
        });
        let i = log.len() - 1;
        drop(log);
        self.changed.send_modify(|v| *v += 1);
        i
    }

    fn end(&self, i: usize) {
        if let Some(t) = lock(&self.log).get_mut(i) {
            t.end.get_or_insert_with(Instant::now);
        }
        self.changed.send_modify(|v| *v += 1);
    }

    fn all(&self) -> Vec<Term> {
        lock(&self.log).clone()
    }

    fn assert_exclusive(&self) {
        let v = lock(&self.violations).clone();
        assert!(v.is_empty(), "two leaders at once: {v:?}");
    }
}

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

fn tag(name: &str) -> String {
    format!("walcast-test-{name}")
}

fn spawn_elector(url: &str, terms: &Arc<Terms>, name: &str, d: Duration) -> Elector {
    let cfg = PgLeaseConfig {
        url: url.to_string(),
        name: NAME.into(),
        identity: name.into(),
        session_tag: tag(name),
        duration: d,
    };
    let shutdown = CancellationToken::new();
    let (terms, who, sd) = (terms.clone(), name.to_string(), shutdown.clone());
    let task = tokio::spawn(async move {
        let lead = move |fence: Fence| {
            let (terms, who) = (terms.clone(), who.clone());
            async move {
                let _guard = TermGuard(terms.clone(), terms.start(&who, &fence));
                fence.cancelled().await;
            }
        };
        postgres::run(cfg, Arc::new(LeaseStatus::default()), sd, lead).await;
    });
    Elector {
        name: name.into(),
        shutdown,
        task,
    }
}

async fn setup() -> Postgres {
    let pg = Postgres::start().expect("start postgres");
    let client = pg.connect().await.expect("connect");
    client
        .batch_execute("CREATE SCHEMA walcast")
        .await
        .expect("schema");
    client
        .batch_execute(include_str!("../../../walcast-control/sql/0005_leases.sql"))
        .await
        .expect("lease table");
    pg
}

async fn wait_terms(
    terms: &Terms,
    rx: &mut watch::Receiver<u64>,
    within: Duration,
    what: &str,
    mut pred: impl FnMut(&[Term]) -> bool,
) {
    let r = tokio::time::timeout(within, async {
        while !pred(&terms.all()) {
            if rx.changed().await.is_err() {
                return;
            }
        }
    })
    .await;
    assert!(
        r.is_ok(),
        "timed out after {within:?} waiting for {what}: {:?}",
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

/// The lease row's renew time and term, on the database clock: (ms since renewed, term).
async fn row(client: &tokio_postgres::Client) -> (f64, i64) {
    let r = client
        .query_one(
            "SELECT (extract(epoch FROM clock_timestamp() - renewed_at) * 1000)::float8, term FROM walcast.leases WHERE name = $1",
            &[&NAME],
        )
        .await
        .expect("lease row");
    (r.get::<_, f64>(0), r.get(1))
}

fn three(url: &str, terms: &Arc<Terms>, d: Duration) -> Vec<Elector> {
    ["a", "b", "c"]
        .iter()
        .map(|n| spawn_elector(url, terms, n, d))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_is_replaced_after_its_lease_and_its_sessions_are_terminated() {
    let d = Duration::from_millis(1500);
    let pg = setup().await;
    let (terms, mut rx) = Terms::new();
    let mut electors = three(&pg.url(), &terms, d);
    wait_terms(&terms, &mut rx, 5 * d, "a first leader", |t| !t.is_empty()).await;
    let first = terms.all()[0].clone();
    // A session of the leader's that outlives it, as a frozen walsender does.
    let (walsender, conn) = tokio_postgres::connect(
        &postgres::tagged_url(&pg.url(), &tag(&first.who)),
        tokio_postgres::NoTls,
    )
    .await
    .expect("tagged session");
    let walsender_ended = tokio::spawn(conn);
    tokio::time::sleep(d).await;
    // Kill it: no release, no renewal.
    let i = electors.iter().position(|e| e.name == first.who).unwrap();
    let killed = electors.remove(i);
    killed.task.abort();
    let _ = killed.task.await;
    let admin = pg.connect().await.expect("connect");
    let (since_renewal, term) = row(&admin).await;
    let killed_at = Instant::now();
    wait_terms(&terms, &mut rx, 3 * d, "a new leader", |t| t.len() >= 2).await;
    let next = terms.all()[1].clone();
    let took = next.start - killed_at;
    // Taken over once expired on the database clock, not before.
    let after_renewal = took.as_secs_f64() * 1000.0 + since_renewal;
    assert!(
        after_renewal >= d.as_millis() as f64 - 20.0,
        "taken over {after_renewal} ms after the last renewal, lease {d:?}"
    );
    assert!(
        took < d + Duration::from_millis(500),
        "takeover took {took:?}"
    );
    assert_eq!(
        next.fence.term() as i64,
        term + 1,
        "the fencing number grows"
    );
    assert!(
        first.fence.check(Action::Publish).is_err(),
        "the killed holder's fence"
    );
    // Its session is gone.
    let ended = tokio::time::timeout(Duration::from_secs(5), walsender_ended).await;
    assert!(
        ended.is_ok(),
        "the stale holder's tagged session was not terminated"
    );
    assert!(walsender.is_closed());
    stop(electors).await;
    terms.assert_exclusive();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_from_the_row_stops_before_its_lease_expires() {
    let d = Duration::from_millis(1500);
    let pg = setup().await;
    let (terms, mut rx) = Terms::new();
    let electors = three(&pg.url(), &terms, d);
    wait_terms(&terms, &mut rx, 5 * d, "a first leader", |t| !t.is_empty()).await;
    let first = terms.all()[0].clone();
    tokio::time::sleep(d / 2).await;
    // Nobody can read or write the row while we hold this lock: renewals hang.
    let mut blocker = pg.connect().await.expect("connect");
    let tx = blocker.transaction().await.expect("begin");
    tx.batch_execute("LOCK TABLE walcast.leases IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock");
    let locked_at = Instant::now();
    wait_terms(&terms, &mut rx, 2 * d, "the leader to step down", |t| {
        t[0].end.is_some()
    })
    .await;
    let ended = terms.all()[0].end.unwrap();
    assert!(
        ended - locked_at < d,
        "stopped {:?} after its renewals began to hang",
        ended - locked_at
    );
    assert!(!first.fence.is_open());
    tokio::time::sleep(d).await;
    tx.rollback().await.expect("unlock");
    wait_terms(&terms, &mut rx, 3 * d, "a new leader", |t| t.len() >= 2).await;
    stop(electors).await;
    terms.assert_exclusive();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_holder_releases_the_lease() {
    let d = Duration::from_millis(3000);
    let pg = setup().await;
    let (terms, mut rx) = Terms::new();
    let mut electors = three(&pg.url(), &terms, d);
    wait_terms(&terms, &mut rx, 5 * d, "a first leader", |t| !t.is_empty()).await;
    let leader = terms.all()[0].who.clone();
    let i = electors.iter().position(|e| e.name == leader).unwrap();
    let stopped_at = Instant::now();
    stop(vec![electors.remove(i)]).await;
    wait_terms(&terms, &mut rx, 2 * d, "a new leader", |t| t.len() >= 2).await;
    let took = terms.all()[1].start - stopped_at;
    // Released: the next read (a third of the duration at most) takes it.
    assert!(took < d / 2, "takeover after a graceful stop took {took:?}");
    stop(electors).await;
    terms.assert_exclusive();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_open_fence_at_a_time_while_sessions_are_terminated_at_random() {
    let d = Duration::from_millis(1000);
    let pg = setup().await;
    let (terms, mut rx) = Terms::new();
    let electors = three(&pg.url(), &terms, d);
    wait_terms(&terms, &mut rx, 5 * d, "a first leader", |t| !t.is_empty()).await;
    let admin = pg.connect().await.expect("connect");
    let until = Instant::now() + 8 * d;
    let mut kills = 0u64;
    while Instant::now() < until {
        // One elector's lease session at a time, every ~300 ms.
        let who = ["a", "b", "c"][(kills % 3) as usize];
        admin
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                &[&tag(who)],
            )
            .await
            .expect("terminate");
        kills += 1;
        tokio::time::sleep(d * 3 / 10).await;
        terms.assert_exclusive();
    }
    wait_terms(&terms, &mut rx, 4 * d, "a leader after the faults", |t| {
        t.iter().any(|t| t.end.is_none())
    })
    .await;
    stop(electors).await;
    terms.assert_exclusive();
}

/// A leader whose work holds its thread for several durations without an await (a long
/// backlog parsed at once, a loaded machine) keeps its lease: the renewals run in a task
/// of their own, and its fence stays open throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_that_holds_its_thread_does_not_delay_the_renewals() {
    let d = Duration::from_millis(1500);
    let pg = setup().await;
    let cfg = PgLeaseConfig {
        url: pg.url(),
        name: NAME.into(),
        identity: "busy".into(),
        session_tag: tag("busy"),
        duration: d,
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = Arc::new(Mutex::new(Some(tx)));
    let shutdown = CancellationToken::new();
    let lead = move |fence: Fence| {
        let tx = tx.clone();
        async move {
            let until = std::time::Instant::now() + 3 * d;
            while std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Some(tx) = lock(&tx).take() {
                let _ = tx.send((fence.term(), fence.check(Action::Publish).is_ok()));
            }
            fence.cancelled().await;
        }
    };
    let status = Arc::new(LeaseStatus::default());
    let stop = shutdown.clone();
    let waited = tokio::spawn(async move {
        let reported = tokio::time::timeout(10 * d, rx).await;
        stop.cancel();
        reported
    });
    // In the test's own thread, as the binaries run it (from `main`).
    postgres::run(cfg, status, shutdown, lead).await;
    let reported = waited.await.expect("joined");
    let (term, open) = reported.expect("the leader's work ends").expect("reported");
    assert!(
        open,
        "term {term}: the fence closed while the work held its thread for 3 durations"
    );
}
