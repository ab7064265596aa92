//! Two real cdc-worker processes electing through a Postgres advisory lock: exactly one
//! reads the slot; when it is killed the other takes over within the lease duration, and
//! the stream has no gap and stays in commit order.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{dedup, rec, Collector, Stack, Worker};

both_sources!(a_killed_leader_is_replaced_within_the_lease_without_a_gap);

const LEASE: &[(&str, &str)] = &[("LEASE_MODE", "postgres"), ("LEASE_DURATION_SECS", "3")];

fn is_leader(w: &Worker) -> bool {
    w.health()
        .is_some_and(|h| h["leader"] == true && h["cdc_active"] == true)
}

async fn a_killed_leader_is_replaced_within_the_lease_without_a_gap(source: &'static str) {
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE l (writer int, i int, PRIMARY KEY (writer, i))");
    stack.enable("l");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut a = stack.worker(LEASE);
    a.wait_active(Duration::from_secs(60));
    let mut b = stack.worker(LEASE);
    // b is up (serving /health) but follows.
    let deadline = Instant::now() + Duration::from_secs(30);
    while b.health().is_none() {
        assert!(
            Instant::now() < deadline,
            "second worker not serving /health"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let hb = b.health().unwrap();
    assert_eq!(hb["leader"], false, "{hb}");
    assert_eq!(hb["cdc_active"], false, "{hb}");
    assert_eq!(hb["lease_mode"], "postgres", "{hb}");
    assert!(is_leader(&a));
    let readers = stack.sql(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'walcast-leader-election'",
    );
    assert_eq!(
        readers, "1",
        "only the leader holds an election session with the lock"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for writer in 0..2 {
        let client = stack.pg.connect().await.unwrap();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let stmt = client
                .prepare("INSERT INTO l VALUES ($1, $2)")
                .await
                .unwrap();
            let mut i = 0i32;
            while !stop.load(Ordering::Relaxed) {
                client.execute(&stmt, &[&writer, &i]).await.unwrap();
                i += 1;
            }
            i as i64
        }));
    }
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
    assert!(
        took <= Duration::from_secs(3),
        "takeover took {took:?}, lease is 3 s"
    );
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
    stop.store(true, Ordering::Relaxed);
    let mut written: HashMap<i64, i64> = HashMap::new();
    for (w, t) in tasks.into_iter().enumerate() {
        written.insert(w as i64, t.await.unwrap());
    }
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
    let mut next: HashMap<i64, i64> = HashMap::new();
    for e in &kept {
        let r = rec(e);
        let (w, i) = (r["writer"].as_i64().unwrap(), r["i"].as_i64().unwrap());
        let expected = next.entry(w).or_insert(0);
        assert_eq!(
            i, *expected,
            "writer {w}: gap or reorder across the failover"
        );
        *expected += 1;
    }
    assert_eq!(next, written);
    eprintln!(
        "failover ({source}): leader after {took:?}, reading after {reading:?} (kill -9 to first poll/stream); {total} changes, no gap"
    );
}
