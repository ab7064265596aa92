//! `kill -9` the cdc-worker at random moments while writers run: nothing is lost, and a
//! replayed change is recognisable by its (commit LSN, position).

both_sources!(kill_9_five_times_under_load_loses_nothing);

use std::collections::HashMap;
use std::time::Duration;

use crate::support::{assert_writers_complete_in_order, dedup, Collector, Stack, Writers};
use rand::Rng;

async fn kill_9_five_times_under_load_loses_nothing(source: &'static str) {
    const WRITERS: i32 = 4;
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE c (writer int, i int, PRIMARY KEY (writer, i))");
    stack.enable("c");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));

    // Writers run until every kill is done, so each kill lands under load.
    let writers = Writers::start(&stack.pg, "c", WRITERS).await;
    let mut seen_at_kill = Vec::new();
    for _ in 0..5 {
        // A random moment (not synchronisation) in the life of a worker that is reading.
        worker.wait_active(Duration::from_secs(60));
        let before = collector.len();
        collector
            .wait_until("the new worker to deliver", Duration::from_secs(60), |e| {
                e.len() > before
            })
            .await;
        let pause = rand::rng().random_range(150..600);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        seen_at_kill.push(collector.len());
        worker.kill9();
        worker = stack.worker(&[]);
    }
    let written = writers.stop().await;
    worker.wait_active(Duration::from_secs(60));
    let total = written.values().sum::<i64>() as usize;
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
    assert_writers_complete_in_order(&kept, &written, "missing or out of order");

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
        seen_at_kill.windows(2).all(|w| w[1] > w[0]) && seen_at_kill[4] < raw.len(),
        "every worker must have delivered before it was killed: {seen_at_kill:?}"
    );
}
