//! Two real cdc-worker processes electing through a Postgres advisory lock: exactly one
//! reads the slot; when it is killed the other takes over within the lease duration, and
//! the stream has no gap and stays in commit order.

mod support;

use std::time::{Duration, Instant};

use support::{assert_writers_complete_in_order, dedup, Collector, Stack, Worker, Writers};

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
