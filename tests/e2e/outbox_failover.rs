//! Per-key order on the outbox stream across leader kills: two cdc-workers share a
//! Postgres lease, 8 writers emit events on 20 keys with `walcast.emit`, and the leader is
//! killed (`kill -9`) three times under that load, the other taking over each time and
//! the killed one restarted. On the JetStream stream, afterwards: every event exactly once
//! (the replays after each kill removed by JetStream's duplicate window), and for every
//! key each writer's events in its own order with no gap.

both_sources!(per_key_order_holds_on_the_stream_across_three_leader_kills);

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::stream::Stream as JsStream;

use crate::support::outbox::{client, emit, outbox_stream, read_all, stored_count, Stored};
use crate::support::{Stack, Worker};

const LEASE: &[(&str, &str)] = &[("LEASE_MODE", "postgres"), ("LEASE_DURATION_SECS", "3")];
const WRITERS: usize = 8;
const KEYS: usize = 20;
const KILLS: usize = 3;
/// Events stored under each leader before it is killed (and after the last takeover).
const PROGRESS: u64 = 300;
/// Replays JetStream recognised by `Nats-Msg-Id` and did not store again.
const DUPLICATES: &str = "walcast_outbox_published_total{duplicate=\"true\"}";

/// One event a writer emitted (committed).
struct Emitted {
    id: String,
    key: usize,
    seq: i64,
}

/// Writers emitting, each in its own session, one event per transaction, cycling over the
/// keys; the payload carries (writer, key, seq of this writer on this key).
struct Emitters {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Emitted>>>,
}

impl Emitters {
    async fn start(stack: &Stack) -> Emitters {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for w in 0..WRITERS {
            let c = client(&stack.pg).await;
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                let mut seqs = [0i64; KEYS];
                let mut out = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let key = (i + 3 * w) % KEYS;
                    let seq = seqs[key];
                    let payload = format!(r#"{{"w": {w}, "k": {key}, "s": {seq}}}"#);
                    let id = emit(&c, "orders", &format!("key-{key}"), &payload).await;
                    out.push(Emitted { id, key, seq });
                    seqs[key] += 1;
                    i += 1;
                }
                out
            }));
        }
        Emitters { stop, tasks }
    }

    /// Stop them; what each writer emitted, by writer.
    async fn stop(self) -> Vec<Vec<Emitted>> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for t in self.tasks {
            all.push(t.await.expect("writer task"));
        }
        all
    }
}

fn is_leader(w: &Worker) -> bool {
    w.health()
        .is_some_and(|h| h["leader"] == true && h["cdc_active"] == true)
}

/// The index of the leading worker (bounded wait).
async fn leader(workers: &[Worker; 2], timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(i) = workers.iter().position(is_leader) {
            return i;
        }
        assert!(
            Instant::now() < deadline,
            "no leading, active worker within {timeout:?}: {:?} / {:?}",
            workers[0].health(),
            workers[1].health()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait until `n` more messages are stored than `from` (bounded); the new count.
async fn progress(stream: &mut JsStream, from: u64, n: u64, what: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let have = stored_count(stream).await;
        if have >= from + n {
            return have;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the stream went from {from} to {have} messages in 60 s, {n} more expected"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn per_key_order_holds_on_the_stream_across_three_leader_kills(source: &'static str) {
    let stack = Stack::start(source);
    let mut first = stack.worker(LEASE);
    first.wait_active(Duration::from_secs(60));
    let mut workers = [first, stack.worker(LEASE)];
    workers[1].wait_http(Duration::from_secs(30));
    let emitters = Emitters::start(&stack).await;
    let mut stream = outbox_stream(&stack.nats.url(), Duration::from_secs(30)).await;
    let mut stored = 0;
    let (mut takeovers, mut replays) = (Vec::new(), 0.0);
    for kill in 1..=KILLS {
        stored = progress(
            &mut stream,
            stored,
            PROGRESS,
            &format!("before kill {kill}"),
        )
        .await;
        let old = leader(&workers, Duration::from_secs(30)).await;
        replays += workers[old].metric(DUPLICATES).unwrap_or(0.0);
        workers[old].kill9();
        let killed = Instant::now();
        let new = 1 - old;
        let deadline = killed + Duration::from_secs(30);
        while !is_leader(&workers[new]) {
            assert!(
                Instant::now() < deadline,
                "kill {kill}: no takeover within 30 s: {:?}",
                workers[new].health()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        takeovers.push(killed.elapsed());
        workers[old] = stack.worker(LEASE);
        workers[old].wait_http(Duration::from_secs(30));
    }
    progress(&mut stream, stored, PROGRESS, "after the last kill").await;
    let emitted = emitters.stop().await;
    let total: usize = emitted.iter().map(Vec::len).sum();
    let got = settled(&mut stream, total as u64).await;
    let last = leader(&workers, Duration::from_secs(30)).await;
    replays += workers[last].metric(DUPLICATES).unwrap_or(0.0);
    assert_each_once(&got, &emitted);
    assert_per_key_order(&got, &emitted);
    eprintln!(
        "outbox failover ({source}): {total} events, {KILLS} leader kills (takeovers {takeovers:?}), {replays} replays dropped by the duplicate window; every event once, per-key order kept"
    );
}

/// Every message, once the stream holds `n` and has stopped growing for a second.
pub(crate) async fn settled(stream: &mut JsStream, n: u64) -> Vec<Stored> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last = (stored_count(stream).await, Instant::now());
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let have = stored_count(stream).await;
        if have != last.0 {
            last = (have, Instant::now());
        } else if have >= n && last.1.elapsed() >= Duration::from_secs(1) {
            return read_all(stream).await;
        }
        assert!(
            Instant::now() < deadline,
            "the stream holds {have} messages, {n} committed events expected within 120 s"
        );
    }
}

/// Every emitted event exactly once, and nothing else.
fn assert_each_once(got: &[Stored], emitted: &[Vec<Emitted>]) {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for s in got {
        *seen
            .entry(s.header("Nats-Msg-Id").unwrap_or_default())
            .or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "duplicated on the stream: {twice:?}");
    let ids: HashSet<&str> = emitted.iter().flatten().map(|e| e.id.as_str()).collect();
    let lost: Vec<_> = ids.iter().filter(|id| !seen.contains_key(*id)).collect();
    assert!(
        lost.is_empty(),
        "{} of {} committed events lost, e.g. {:?}",
        lost.len(),
        ids.len(),
        &lost[..lost.len().min(5)]
    );
    let unknown: Vec<_> = seen.keys().filter(|id| !ids.contains(*id)).collect();
    assert!(unknown.is_empty(), "events never emitted: {unknown:?}");
}

/// For every key, each writer's events in the order it emitted them, none missing; and
/// the stream in commit order (commit LSNs never go back).
fn assert_per_key_order(got: &[Stored], emitted: &[Vec<Emitted>]) {
    let mut next: HashMap<(i64, i64), i64> = HashMap::new();
    for s in got {
        let (w, k, seq) = (
            s.payload["w"].as_i64(),
            s.payload["k"].as_i64(),
            s.payload["s"].as_i64(),
        );
        let (Some(w), Some(k), Some(seq)) = (w, k, seq) else {
            panic!("message {} has no (w, k, s): {}", s.seq, s.payload);
        };
        assert_eq!(
            s.header("Walcast-Key"),
            Some(format!("key-{k}").as_str()),
            "{s:?}"
        );
        let expected = next.entry((w, k)).or_insert(0);
        assert_eq!(
            seq, *expected,
            "key {k}, writer {w}: event {seq} at stream position {} where {} was next",
            s.seq, *expected
        );
        *expected += 1;
    }
    for (w, events) in emitted.iter().enumerate() {
        for e in events {
            let sent = next.get(&(w as i64, e.key as i64)).copied().unwrap_or(0);
            assert!(
                e.seq < sent,
                "key {}, writer {w}: event {} missing",
                e.key,
                e.seq
            );
        }
    }
    for pair in got.windows(2) {
        assert!(
            pair[0].commit_lsn() <= pair[1].commit_lsn(),
            "commit order broken at stream positions {} and {}: {:?} then {:?}",
            pair[0].seq,
            pair[1].seq,
            pair[0].header("Walcast-Commit-Lsn"),
            pair[1].header("Walcast-Commit-Lsn")
        );
    }
}
