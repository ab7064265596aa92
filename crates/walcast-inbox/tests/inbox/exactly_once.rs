//! Each event applied once, against a real Postgres and a real nats-server with
//! JetStream, with messages in the relay's format: a consumer killed between its commit
//! and its ack, duplicates, handler failures, per-key order, unidentifiable messages.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use walcast_inbox::{headers, Event, Outcome, SettleHook};

use crate::support::*;

/// The crash window "consumer after its side effect before its ack", injected
/// three times: the consumer commits an event's side effect and is killed (its task
/// aborted: its Postgres and NATS connections go with it) before acking it. JetStream
/// delivers the event again to the next consumer, whose inbox says it was applied: no
/// second side effect, and every event applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_between_commit_and_ack_applies_nothing_twice() {
    let env = Env::start(Duration::from_secs(120)).await;
    let mut published = Vec::new();
    for round in 0..3 {
        let ids = publish_round(&env, 12).await;
        published.extend(ids.iter().cloned());
        // A different position each round, in the first batch or a later one.
        let victim = ids[[3, 7, 0][round]].clone();
        let before = crash_after_commit(&env, &victim).await;
        // The next consumer: the victim comes back (after the ack wait) as a duplicate;
        // everything else of the round the killed one had not settled is applied.
        let (hook, mut rx) = report();
        let (task, cancel) = env
            .spawn(test_config("crashy"), Effects::default(), hook)
            .await;
        let after = collect_until(&mut rx, 30, "the round's events after the crash", |s| {
            ids.iter()
                .all(|id| s.iter().chain(&before).any(|(i, ..)| i == id))
                && s.iter().any(|(i, ..)| *i == victim)
        })
        .await;
        stop(task, cancel).await;
        let victim_seen: Vec<_> = after.iter().filter(|(i, ..)| *i == victim).collect();
        assert!(
            matches!(victim_seen[..], [(_, _, delivered, Outcome::Duplicate)] if *delivered >= 2),
            "round {round}: the victim must come back once as a duplicate: {after:?}"
        );
        for (id, _, _, outcome) in &after {
            assert!(
                matches!(outcome, Outcome::Applied | Outcome::Duplicate),
                "round {round}: {id}: {outcome:?}"
            );
        }
    }
    assert_each_applied_once(&env, "crashy", &published).await;
    assert_eq!(env.pending("crashy").await, (0, 0), "all acked");
}

/// Publish `count` events over three keys; their ids in order.
async fn publish_round(env: &Env, count: i32) -> Vec<String> {
    let mut ids = Vec::new();
    for n in 0..count {
        ids.push(publish_event(&env.js, &format!("k{}", n % 3), n).await);
    }
    ids
}

/// Run a consumer until it has committed `victim` and is about to ack it, then kill it;
/// returns what it settled before (and the victim).
async fn crash_after_commit(env: &Env, victim: &str) -> Vec<Seen> {
    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel();
    let target = victim.to_string();
    let hook: SettleHook = Arc::new(move |event: &Event, outcome: &Outcome| {
        let id = event.id.to_string();
        let frozen = id == target;
        let _ = seen_tx.send((id, 0, event.delivered, *outcome));
        if frozen {
            // Between the commit and the ack until killed.
            Box::pin(std::future::pending())
        } else {
            Box::pin(async {})
        }
    });
    let (task, _cancel) = env
        .spawn(test_config("crashy"), Effects::default(), hook)
        .await;
    let seen = collect_until(&mut seen_rx, 30, "the victim's commit", |s| {
        s.iter().any(|(i, ..)| i == victim)
    })
    .await;
    assert_eq!(
        seen.last().map(|(_, _, d, o)| (*d, *o)),
        Some((1, Outcome::Applied)),
        "the victim's first delivery is applied"
    );
    let effects = env.effect_counts().await;
    assert_eq!(effects.get(victim), Some(&1), "its side effect committed");
    task.abort();
    let ended = within(10, "the killed consumer to end", task).await;
    assert!(ended.expect_err("aborted").is_cancelled());
    seen
}

/// Every published event has exactly one side effect and one inbox row, and there are
/// no others.
async fn assert_each_applied_once(env: &Env, consumer: &str, published: &[String]) {
    let counts = env.effect_counts().await;
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "side effects applied twice: {twice:?}");
    let expected: HashSet<&String> = published.iter().collect();
    let applied: HashSet<&String> = counts.keys().collect();
    assert_eq!(applied, expected, "every event applied, nothing else");
    let mut inbox = env.inbox_ids(consumer).await;
    inbox.sort();
    let mut want: Vec<String> = published.to_vec();
    want.sort();
    assert_eq!(inbox, want, "one inbox row per event");
}

/// The same event twice: one `Nats-Msg-Id` published again after the duplicate window
/// (JetStream stores it twice), and one event re-published with another `Nats-Msg-Id`
/// but the same `Walcast-Event-Id` (as a replay would). Each is applied once; the second
/// delivery is a duplicate. An event with only `Nats-Msg-Id` is applied by that id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_are_applied_once() {
    let window = Duration::from_millis(500);
    let env = Env::start(window).await;
    let (x, y, z) = (new_id(), new_id(), new_id());
    publish(&env.js, relay_headers(&x, "a"), 1).await;
    assert!(
        publish(&env.js, relay_headers(&x, "a"), 1).await.duplicate,
        "inside the window JetStream drops it"
    );
    publish_outside_window(&env, &x).await;
    publish(&env.js, relay_headers(&y, "b"), 2).await;
    let mut replay = relay_headers(&y, "b");
    replay.insert(headers::NATS_MSG_ID, "replay-of-y");
    assert!(!publish(&env.js, replay, 2).await.duplicate);
    let mut only_msg_id = HeaderMap::new();
    only_msg_id.insert(headers::NATS_MSG_ID, z.as_str());
    only_msg_id.insert("X-User-Header", "kept");
    publish(&env.js, only_msg_id, 3).await;

    let (hook, mut rx) = report();
    let (task, cancel) = env
        .spawn(test_config("dups"), Effects::default(), hook)
        .await;
    let seen = collect_until(&mut rx, 30, "five deliveries", |s| s.len() == 5).await;
    stop(task, cancel).await;
    let outcomes: Vec<(&str, Outcome)> = seen.iter().map(|(i, _, _, o)| (i.as_str(), *o)).collect();
    assert_eq!(
        outcomes,
        [
            (x.as_str(), Outcome::Applied),
            (x.as_str(), Outcome::Duplicate),
            (y.as_str(), Outcome::Applied),
            (y.as_str(), Outcome::Duplicate),
            (z.as_str(), Outcome::Applied),
        ]
    );
    assert_each_applied_once(&env, "dups", &[x, y, z]).await;
    assert_eq!(env.pending("dups").await, (0, 0), "all acked");
}

/// Publish `id` again until JetStream stores it (its duplicate window passed).
async fn publish_outside_window(env: &Env, id: &str) {
    within(10, "the duplicate window to pass", async {
        while publish(&env.js, relay_headers(id, "a"), 1).await.duplicate {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
}

/// A handler that fails after writing its side effect rolls it back; the event is nak'd
/// with a growing delay, delivered again and applied once. An event that fails on every
/// delivery is terminated at `max_deliver`, never applied, and does not hold up others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_handler_rolls_back_and_the_event_is_applied_once_later() {
    let env = Env::start(Duration::from_secs(120)).await;
    let flaky = publish_event(&env.js, "a", 1).await;
    let poison = publish_event(&env.js, "b", 2).await;
    let fine = publish_event(&env.js, "c", 3).await;
    let handler = Effects::failing(&[(&flaky, 2), (&poison, i64::MAX)]);
    let mut config = test_config("flaky");
    config.max_deliver = 3;
    let (hook, mut rx) = report();
    let (task, cancel) = env.spawn(config, handler, hook).await;
    let seen = collect_until(&mut rx, 30, "the retries", |s| {
        s.iter()
            .any(|(i, _, _, o)| *i == flaky && *o == Outcome::Applied)
            && s.iter()
                .any(|(i, _, _, o)| *i == poison && *o == Outcome::GaveUp)
            && s.iter().any(|(i, ..)| *i == fine)
    })
    .await;
    stop(task, cancel).await;

    let of = |id: &str| -> Vec<(i64, Outcome)> {
        seen.iter()
            .filter(|(i, ..)| i == id)
            .map(|(_, _, d, o)| (*d, *o))
            .collect()
    };
    // Each nak's delay is its step of the schedule (50 ms, 100 ms), jittered into the
    // step's upper half; the step's ceiling stands for it in the comparison.
    let stepped = |outcomes: Vec<(i64, Outcome)>| -> Vec<(i64, Outcome)> {
        outcomes
            .into_iter()
            .map(|(n, o)| match o {
                Outcome::Retry { delay } => {
                    let ceiling = Duration::from_millis(50 << (n - 1));
                    assert!(
                        delay >= ceiling / 2 && delay <= ceiling,
                        "delivery {n}: {delay:?} outside the upper half of {ceiling:?}"
                    );
                    (n, Outcome::Retry { delay: ceiling })
                }
                o => (n, o),
            })
            .collect()
    };
    let retry = |ms| Outcome::Retry {
        delay: Duration::from_millis(ms),
    };
    assert_eq!(
        stepped(of(&flaky)),
        [(1, retry(50)), (2, retry(100)), (3, Outcome::Applied)]
    );
    assert_eq!(
        stepped(of(&poison)),
        [(1, retry(50)), (2, retry(100)), (3, Outcome::GaveUp)]
    );
    assert_eq!(of(&fine), [(1, Outcome::Applied)]);

    let effects = env.effects().await;
    let rows: Vec<(&str, i32)> = effects
        .iter()
        .map(|(i, _, _, d)| (i.as_str(), *d))
        .collect();
    assert!(
        rows.len() == 2
            && rows.contains(&(flaky.as_str(), 3))
            && rows.contains(&(fine.as_str(), 1)),
        "only the successful deliveries' side effects remain: {rows:?}"
    );
    let inbox: HashSet<String> = env.inbox_ids("flaky").await.into_iter().collect();
    assert_eq!(
        inbox,
        HashSet::from([flaky, fine]),
        "the poison event is not in the inbox"
    );
    assert_eq!(
        env.pending("flaky").await,
        (0, 0),
        "the poison event was terminated"
    );
}

/// Handled sequentially, the events of one key are applied in their stream order, also
/// across a graceful restart in the middle (the stopped consumer naks what it fetched
/// and did not start, which JetStream delivers first). Messages without a usable event
/// id are terminated, never handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_is_kept_across_a_graceful_restart() {
    let env = Env::start(Duration::from_secs(120)).await;
    let keys = ["k0", "k1", "k2", "k3"];
    let mut ids = Vec::new();
    for n in 0..100 {
        if n == 10 {
            publish_unidentifiable(&env).await;
        }
        ids.push(publish_event(&env.js, keys[n as usize % keys.len()], n).await);
    }
    let mut config = test_config("ordered");
    config.batch_size = 7;
    // Stopped from its hook at the 38th event (stream sequence 40, as two unidentifiable
    // messages came before): the 5th of its 6th batch (sequences 36 to 42).
    let (hook, mut rx) = report();
    let cancel = CancellationToken::new();
    let (stop_at_38, count) = (cancel.clone(), Arc::new(AtomicUsize::new(0)));
    let stopping: SettleHook = Arc::new(move |event: &Event, outcome: &Outcome| {
        if count.fetch_add(1, Ordering::SeqCst) + 1 == 38 {
            stop_at_38.cancel();
        }
        hook(event, outcome)
    });
    let (task, cancel) = env
        .spawn_with(config.clone(), Effects::default(), stopping, cancel)
        .await;
    within(
        10,
        "the consumer to stop at the 38th event",
        cancel.cancelled(),
    )
    .await;
    stop(task, cancel).await;
    let first = collect_until(&mut rx, 1, "38 events", |s| s.len() == 38).await;
    assert!(rx.try_recv().is_err(), "the consumer stops after the 38th");
    let (hook, mut rx) = report();
    let (task, cancel) = env.spawn(config, Effects::default(), hook).await;
    let rest = collect_until(&mut rx, 30, "the rest", |s| s.len() == 62).await;
    stop(task, cancel).await;
    assert!(
        rest.iter()
            .take(2)
            .all(|(.., delivered, _)| *delivered == 2),
        "the 6th batch's last two were released to the next consumer, first: {rest:?}"
    );
    assert!(first
        .iter()
        .chain(&rest)
        .all(|(.., o)| *o == Outcome::Applied));

    let mut last: HashMap<String, i32> = HashMap::new();
    let effects = env.effects().await;
    for (id, key, n, delivered) in &effects {
        let key = key.clone().expect("key");
        let before = last.insert(key.clone(), *n);
        assert!(
            before.is_none_or(|b| b < *n),
            "{key}: {n} (event {id}, delivery {delivered}) applied after {before:?}"
        );
    }
    assert_each_applied_once(&env, "ordered", &ids).await;
    assert_eq!(
        env.pending("ordered").await,
        (0, 0),
        "all acked or terminated"
    );
}

/// One message without any id header and one whose id is not a UUID.
async fn publish_unidentifiable(env: &Env) {
    let mut no_id = HeaderMap::new();
    no_id.insert(headers::KEY, "k0");
    publish(&env.js, no_id, -1).await;
    let mut bad_id = HeaderMap::new();
    bad_id.insert(headers::EVENT_ID, "order-7");
    publish(&env.js, bad_id, -2).await;
}
