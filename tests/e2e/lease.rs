//! Two real cdc-worker processes electing a leader: exactly one reads the slot. A killed
//! leader (Postgres lease row) is replaced within the lease duration, and the stream has
//! no gap and stays in commit order. A frozen leader (SIGSTOP, both lease modes; the
//! Kubernetes API is the test kit's fake) is replaced without its cooperation, and once
//! continued it publishes nothing: no message of it reaches NATS after the new leader's
//! first. A worker configured by a kubeconfig (`KUBECONFIG`, `LEASE_KUBE_CONTEXT`) leads
//! through the API server over HTTPS with a client certificate.

use std::time::{Duration, Instant};

use crate::support::{
    assert_writers_complete_in_order, dedup, Arrival, Collector, Stack, Worker, Writers,
};
use walcast_testkit::fake_kube::{FakeApi, Secure};
use walcast_testkit::tls::TestCerts;

both_sources!(
    a_killed_leader_is_replaced_within_the_lease_without_a_gap,
    a_frozen_postgres_leader_is_replaced_and_fenced,
    a_frozen_kubernetes_leader_is_replaced_and_fenced,
);

/// Seconds; the holder renews every second.
const LEASE_SECS: u64 = 3;
const LEASE: &[(&str, &str)] = &[("LEASE_MODE", "postgres"), ("LEASE_DURATION_SECS", "3")];

fn is_leader(w: &Worker) -> bool {
    w.health()
        .is_some_and(|h| h["leader"] == true && h["cdc_active"] == true)
}

/// Wait (bounded) until the worker serves `/health`.
fn wait_health(w: &Worker, what: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(h) = w.health() {
            return h;
        }
        assert!(Instant::now() < deadline, "{what} not serving /health");
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn a_killed_leader_is_replaced_within_the_lease_without_a_gap(source: &'static str) {
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE l (writer int, i int, PRIMARY KEY (writer, i))");
    stack.enable("l");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut a = stack.worker(LEASE);
    a.wait_active(Duration::from_secs(60));
    let b = stack.worker(LEASE);
    // b is up (serving /health) but follows.
    let hb = wait_health(&b, "second worker");
    assert_eq!(hb["leader"], false, "{hb}");
    assert_eq!(hb["cdc_active"], false, "{hb}");
    assert_eq!(hb["lease_mode"], "postgres", "{hb}");
    assert!(is_leader(&a));
    let ha = a.health().unwrap();
    assert!(ha["lease_term"].as_u64().is_some_and(|t| t >= 1), "{ha}");
    assert!(
        ha["lease_expires_in_ms"]
            .as_u64()
            .is_some_and(|ms| ms <= LEASE_SECS * 1000),
        "{ha}"
    );
    // The row names the leader, whose sessions carry the tag recorded in it.
    let sessions = stack.sql(
        "SELECT count(*) FROM pg_stat_activity a JOIN walcast.leases l ON a.application_name = l.holder_session",
    );
    assert!(
        sessions.parse::<i64>().unwrap() >= 2,
        "lease, slot and pipeline sessions of the leader: {sessions}"
    );

    let writers = Writers::start(&stack.pg, "l", 2).await;
    let before = collector.len();
    collector
        .wait_until(
            "changes from the first leader",
            Duration::from_secs(60),
            |e| e.len() > before + 100,
        )
        .await;
    a.kill9();
    let killed = Instant::now();
    let deadline = killed + Duration::from_secs(30);
    while b.health().is_none_or(|h| h["leader"] != true) {
        assert!(Instant::now() < deadline, "no takeover: {:?}", b.health());
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = killed.elapsed();
    // The lease expires at most a duration after the last renewal, which came before the
    // kill; the follower reads again as soon as it can have expired.
    assert!(
        took <= Duration::from_secs(LEASE_SECS) + Duration::from_secs(1),
        "takeover took {took:?}, lease is {LEASE_SECS} s"
    );
    let mut b = b;
    b.wait_active(Duration::from_secs(60));
    let reading = killed.elapsed();
    let mid = collector.len();
    collector
        .wait_until(
            "changes from the new leader",
            Duration::from_secs(60),
            |e| e.len() > mid + 100,
        )
        .await;
    let written = writers.stop().await;
    let total = written.values().sum::<i64>() as usize;
    collector
        .wait_until(
            &format!("{total} distinct changes"),
            Duration::from_secs(120),
            |e| dedup(e).len() >= total,
        )
        .await;
    let kept = dedup(&collector.snapshot());
    assert_eq!(kept.len(), total);
    assert_writers_complete_in_order(&kept, &written, "gap or reorder across the failover");
    eprintln!(
        "failover ({source}): leader after {took:?}, reading after {reading:?} (kill -9 to first poll/stream); {total} changes, no gap"
    );
}

async fn a_frozen_postgres_leader_is_replaced_and_fenced(source: &'static str) {
    frozen_leader_is_replaced_and_fenced(source, LEASE.to_vec()).await
}

async fn a_frozen_kubernetes_leader_is_replaced_and_fenced(source: &'static str) {
    let api = FakeApi::new();
    let url = api.endpoint("workers").await;
    let env = vec![
        ("LEASE_MODE", "kubernetes"),
        ("LEASE_DURATION_SECS", "3"),
        ("LEASE_KUBE_API_URL", url.as_str()),
    ];
    frozen_leader_is_replaced_and_fenced(source, env).await;
    let lease = api.lease("default", "walcast-cdc-slot").expect("the Lease");
    assert!(
        lease["spec"]["leaseTransitions"].as_i64() >= Some(1),
        "{lease}"
    );
}

/// The kubeconfig's current context names a user the API server refuses; the context
/// `LEASE_KUBE_CONTEXT` names authenticates by client certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_configured_by_a_kubeconfig_leads() {
    let _machine = crate::support::shared().await;
    let certs = TestCerts::generate().expect("test certificates");
    let (crt, key) = certs.client("cdc-worker").expect("a client certificate");
    let api = FakeApi::new();
    let secure = Secure {
        cert: certs.server_cert.clone(),
        key: certs.server_key.clone(),
        client_ca: Some(certs.ca.clone()),
        token: None,
    };
    let url = api.secure_endpoint("worker", &secure).await;
    let q = |p: &std::path::Path| serde_json::to_string(&p.display().to_string()).unwrap();
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: nobody\n\
         clusters:\n- name: fake\n  cluster:\n    server: {url}\n    certificate-authority: {ca}\n\
         users:\n- name: nobody\n  user: {{}}\n\
         - name: worker\n  user:\n    client-certificate: {crt}\n    client-key: {key}\n\
         contexts:\n- name: nobody\n  context: {{cluster: fake, user: nobody}}\n\
         - name: by-cert\n  context: {{cluster: fake, user: worker}}\n",
        ca = q(&certs.ca),
        crt = q(&crt),
        key = q(&key),
    );
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, kubeconfig).expect("write the kubeconfig");
    let path = path.display().to_string();
    let stack = Stack::start("stream");
    let mut w = stack.worker(&[
        ("LEASE_MODE", "kubernetes"),
        ("LEASE_DURATION_SECS", "3"),
        ("KUBECONFIG", path.as_str()),
        ("LEASE_KUBE_CONTEXT", "by-cert"),
    ]);
    w.wait_active(Duration::from_secs(60));
    let h = w.health().expect("health");
    assert_eq!(h["lease_mode"], "kubernetes", "{h}");
    assert_eq!(h["leader"], true, "{h}");
    let lease = api.lease("default", "walcast-cdc-slot").expect("the Lease");
    assert_eq!(
        lease["spec"]["holderIdentity"], h["lease_holder"],
        "{lease} {h}"
    );
    assert_eq!(api.unauthorized("worker"), 0);
}

/// SIGSTOP the leader under writers for several lease durations, then SIGCONT it.
async fn frozen_leader_is_replaced_and_fenced(source: &'static str, lease: Vec<(&str, &str)>) {
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE z (writer int, i int, PRIMARY KEY (writer, i))");
    stack.enable("z");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut a = stack.worker(&lease);
    a.wait_active(Duration::from_secs(60));
    let mut b = stack.worker(&lease);
    wait_health(&b, "second worker");
    let writers = Writers::start(&stack.pg, "z", 2).await;
    let before = collector.len();
    collector
        .wait_until("changes from the leader", Duration::from_secs(60), |e| {
            e.len() > before + 100
        })
        .await;
    let first = collector
        .messages()
        .last()
        .expect("arrivals")
        .origin
        .clone();

    a.signal("STOP");
    let frozen = Instant::now();
    let theirs = |x: &Arrival| x.origin != first;
    collector
        .wait_until(
            "changes from another worker while the leader is frozen",
            Duration::from_secs(LEASE_SECS + 10),
            |_| collector.messages().iter().any(theirs),
        )
        .await;
    let arrivals = collector.messages();
    let took = arrivals.iter().find(|x| theirs(x)).unwrap().at - frozen;
    b.wait_active(Duration::from_secs(10));
    // Frozen for more than three lease durations, as a long stall or a paused VM.
    tokio::time::sleep_until((frozen + Duration::from_secs(4 * LEASE_SECS)).into()).await;
    a.signal("CONT");
    let resumed = Instant::now();
    let deadline = resumed + Duration::from_secs(10);
    while a.health().is_none_or(|h| h["leader"] != false) {
        assert!(
            Instant::now() < deadline,
            "the old leader did not step down: {:?}",
            a.health()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let stepped_down = resumed.elapsed();
    // More changes from the new leader after the old one woke: anything it still had
    // in hand would have reached NATS by now.
    let mid = collector.len();
    collector
        .wait_until("changes after the resume", Duration::from_secs(60), |e| {
            e.len() > mid + 100
        })
        .await;
    let written = writers.stop().await;
    let total = written.values().sum::<i64>() as usize;
    collector
        .wait_until(
            &format!("{total} distinct changes"),
            Duration::from_secs(120),
            |e| dedup(e).len() >= total,
        )
        .await;
    assert_fenced(&collector.messages(), &first);
    let kept = dedup(&collector.snapshot());
    assert_eq!(kept.len(), total);
    assert_writers_complete_in_order(&kept, &written, "gap or reorder across the freeze");
    let log = a.log_text();
    assert!(
        log.contains("stepping down") || log.contains("publishes and acknowledges nothing more"),
        "the old leader's log does not say it stopped:\n{log}"
    );
    assert!(is_leader(&b), "{:?}", b.health());
    b.wait_active(Duration::from_secs(5));
    eprintln!(
        "freeze ({source}, {:?}): changes from the new leader {took:?} after SIGSTOP, old leader stepped down {stepped_down:?} after SIGCONT; {total} changes",
        lease[0].1
    );
}

/// After the first message of another origin, `old` may still release what its NATS
/// client held when it froze (a fence cannot stop that: docs/architecture.md, "Leader
/// election and fencing"), but only with its own, lower term, which the fronts drop. Each
/// origin's own messages on the table subject in strictly increasing `(commit_lsn, seq)`.
fn assert_fenced(arrivals: &[Arrival], old: &str) {
    let takeover = arrivals
        .iter()
        .position(|x| x.origin != old)
        .expect("a new leader published");
    let new_term = arrivals[takeover..]
        .iter()
        .filter(|x| x.origin != old)
        .filter_map(|x| x.term)
        .min()
        .expect("the new leader's messages carry Walcast-Term");
    let stale: Vec<&Arrival> = arrivals[takeover..]
        .iter()
        .filter(|x| x.origin == old)
        .collect();
    assert!(
        stale.iter().all(|x| x.term.is_some_and(|t| t < new_term)),
        "the old leader published after the takeover with a term not below the new leader's \
         {new_term}: {:?}",
        stale.iter().find(|x| x.term.is_none_or(|t| t >= new_term))
    );
    if !stale.is_empty() {
        eprintln!(
            "{} late message(s) of the old leader after the takeover, all of an older term (dropped by fronts)",
            stale.len()
        );
    }
    for origin in [old, arrivals[takeover].origin.as_str()] {
        let mine: Vec<_> = arrivals
            .iter()
            .filter(|x| x.origin == origin && x.subject.starts_with("walcast.realtime."))
            .map(|x| x.position)
            .collect();
        for w in mine.windows(2) {
            assert!(
                w[0] < w[1],
                "{origin}: {:?} then {:?}: out of order or duplicated",
                w[0],
                w[1]
            );
        }
    }
}
