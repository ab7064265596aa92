//! `kill -9` the cdc-worker at random moments while writers run: nothing is lost, and a
//! replayed change is recognisable by its (commit LSN, position).

mod support;

both_sources!(kill_9_five_times_under_load_loses_nothing);

use std::collections::HashMap;
use std::time::Duration;

use rand::Rng;
use support::{dedup, rec, Collector, Stack};

async fn kill_9_five_times_under_load_loses_nothing(source: &'static str) {
    const WRITERS: i32 = 4;
    const PER: i32 = 3000;
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE c (writer int, i int, PRIMARY KEY (writer, i))");
    stack.enable("c");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));

    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let client = stack.pg.connect().await.expect("writer connect");
        tasks.push(tokio::spawn(async move {
            let stmt = client
                .prepare("INSERT INTO c VALUES ($1, $2)")
                .await
                .unwrap();
            for i in 0..PER {
                client.execute(&stmt, &[&writer, &i]).await.unwrap();
            }
        }));
    }
    let mut seen_at_kill = Vec::new();
    for _ in 0..5 {
        // Random kill moments (not synchronisation): somewhere in the write load.
        let pause = rand::rng().random_range(150..600);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        seen_at_kill.push(collector.len());
        worker.kill9();
        worker = stack.worker(&[]);
    }
    for t in tasks {
        t.await.unwrap();
    }
    worker.wait_active(Duration::from_secs(60));
    let total = (WRITERS * PER) as usize;
    collector
        .wait_until(
            &format!("{total} distinct changes"),
            Duration::from_secs(180),
            |e| dedup(e).len() >= total,
        )
        .await;

    let raw = collector.snapshot();
    let kept = dedup(&raw);
    assert_eq!(
        kept.len(),
        total,
        "every change exactly once after dropping replays"
    );
    let mut next: HashMap<i64, i64> = HashMap::new();
    for e in &kept {
        let r = rec(e);
        let (w, i) = (r["writer"].as_i64().unwrap(), r["i"].as_i64().unwrap());
        let expected = next.entry(w).or_insert(0);
        assert_eq!(i, *expected, "writer {w}: missing or out of order");
        *expected += 1;
    }
    assert!(next.values().all(|&n| n == PER as i64));

    // A replay repeats an already delivered change verbatim: same position, same row.
    let mut first: HashMap<(walcast_wal2json::Lsn, u32), String> = HashMap::new();
    let mut replays = 0;
    for e in &raw {
        let body = e.record.as_ref().unwrap().get().to_string();
        match first.get(&e.position()) {
            Some(b) => {
                assert_eq!(b, &body, "a replay must carry the same change");
                replays += 1;
            }
            None => {
                first.insert(e.position(), body);
            }
        }
    }
    assert_eq!(raw.len(), total + replays);
    eprintln!(
        "kill -9 x5: {total} changes, {replays} replayed from unacknowledged tails; events seen at each kill: {seen_at_kill:?}"
    );
    assert!(
        seen_at_kill.windows(2).any(|w| w[1] > w[0]) && seen_at_kill[0] < total,
        "the kills must land while changes are flowing: {seen_at_kill:?}"
    );
}
