//! Every consumer of the pipeline publishes through its fenced publisher, not only
//! realtime delivery: database broadcast (`realtime.send`) and the outbox relay
//! (`walcast.emit`) under a leader frozen (SIGSTOP) for several lease durations while a
//! second worker takes over. Every message carries `Walcast-Term`; after the takeover
//! nothing of the old term reaches a client (a broadcast) or the stream (an event), and
//! nothing is lost. Postgres lease, stream source.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use walcast_bus::broadcast::{encode_envelope, BroadcastTarget, Envelope, BROADCAST_ALL};
use walcast_bus::{Bus, HEADER_ORIGIN, HEADER_TERM};
use walcast_testkit::phoenix::{Msg, PhoenixClient};

use crate::outbox_failover::settled;
use crate::support::outbox::{client, emit, outbox_stream, stored_count};
use crate::support::{ws, Stack, Worker};

const LEASE_SECS: u64 = 3;
const LEASE: &[(&str, &str)] = &[("LEASE_MODE", "postgres"), ("LEASE_DURATION_SECS", "3")];
const STARTUP: Duration = Duration::from_secs(60);

fn is_leader(w: &Worker) -> bool {
    w.health()
        .is_some_and(|h| h["leader"] == true && h["cdc_active"] == true)
}

/// Two workers sharing a lease, the first leading.
fn workers(stack: &Stack) -> (Worker, Worker) {
    let mut a = stack.worker(LEASE);
    a.wait_active(STARTUP);
    let mut b = stack.worker(LEASE);
    b.wait_http(Duration::from_secs(30));
    (a, b)
}

/// Freeze `a` (the leader) until `b` leads and for four lease durations in all, then
/// continue it and wait until it stepped down.
async fn freeze_until_taken_over(a: &Worker, b: &mut Worker) {
    a.signal("STOP");
    let frozen = Instant::now();
    let deadline = frozen + Duration::from_secs(LEASE_SECS + 20);
    while !is_leader(b) {
        assert!(Instant::now() < deadline, "no takeover: {:?}", b.health());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep_until((frozen + Duration::from_secs(4 * LEASE_SECS)).into()).await;
    a.signal("CONT");
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.health().is_none_or(|h| h["leader"] != false) {
        assert!(
            Instant::now() < deadline,
            "the old leader did not step down"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `(origin, term, n)` of every database broadcast on NATS, in arrival order.
type Seen = Arc<Mutex<Vec<(String, Option<u64>, i64)>>>;

async fn watch_broadcasts(nats: &str) -> Seen {
    let bus = Bus::nats(nats, "fenced-watch").await.expect("bus");
    let mut sub = bus.subscribe(BROADCAST_ALL).await.expect("subscribe");
    bus.barrier().await.expect("barrier");
    let seen: Seen = Arc::default();
    let s = seen.clone();
    tokio::spawn(async move {
        let _bus = bus;
        while let Some(m) = sub.next().await {
            let origin = m.header(HEADER_ORIGIN).unwrap_or_default().to_string();
            let term = m.header(HEADER_TERM).and_then(|t| t.parse().ok());
            let n = body_n(&m.payload);
            s.lock().unwrap().push((origin, term, n));
        }
    });
    seen
}

/// `n` of a broadcast envelope's JSON body.
fn body_n(payload: &[u8]) -> i64 {
    let body = payload
        .splitn(2, |b| *b == b'\n')
        .nth(1)
        .unwrap_or_default();
    serde_json::from_slice::<Value>(body).map_or(i64::MIN, |v| v["n"].as_i64().unwrap_or(i64::MIN))
}

/// A client on the public topic `room`; the `n` of every broadcast it receives.
async fn room_client(front: &Worker) -> Arc<Mutex<Vec<i64>>> {
    let url = front.ws_url(&ws::anon()).replace("vsn=2.0.0", "vsn=1.0.0");
    let mut sock = PhoenixClient::connect(&url).await;
    let (_, reply) = sock
        .join("realtime:room", json!({"private": false}), None)
        .await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    let got: Arc<Mutex<Vec<i64>>> = Arc::default();
    let g = got.clone();
    tokio::spawn(async move {
        loop {
            match sock.try_recv(Duration::from_secs(600)).await {
                None | Some(Msg::Ended(_)) => return,
                Some(Msg::Frame(f)) if f[3] == "broadcast" => {
                    let n = f[4]["payload"]["n"].as_i64().unwrap_or(i64::MIN);
                    g.lock().unwrap().push(n);
                }
                Some(_) => {}
            }
        }
    });
    got
}

/// `realtime.send` in a loop, one transaction each, until cancelled; how many were sent.
fn sender(stack: &Stack, stop: CancellationToken) -> tokio::task::JoinHandle<i64> {
    let pg = stack.pg.url();
    tokio::spawn(async move {
        let c = walcast_pipeline::connect(&pg).await.expect("connect");
        let mut n = 0i64;
        while !stop.is_cancelled() {
            c.execute(
                "SELECT realtime.send(jsonb_build_object('n', $1::int8), 'tick', 'room', false)",
                &[&n],
            )
            .await
            .expect("send");
            n += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        n
    })
}

async fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// After the first message of another origin, the old leader's messages (if any came:
/// one its NATS client held when it froze) are of an older term; every message has one.
/// Returns (old term, new term).
fn assert_terms(seen: &[(String, Option<u64>, i64)]) -> (u64, u64) {
    assert!(
        seen.iter().all(|(_, t, _)| t.is_some()),
        "a message without Walcast-Term"
    );
    let old = seen[0].0.clone();
    let takeover = seen
        .iter()
        .position(|(o, ..)| *o != old)
        .expect("a takeover");
    let old_term = seen[0].1.unwrap();
    let new_term = seen[takeover].1.unwrap();
    assert!(new_term > old_term, "terms {old_term} then {new_term}");
    let late: Vec<_> = seen[takeover..]
        .iter()
        .filter(|(o, ..)| *o == old)
        .collect();
    assert!(
        late.iter().all(|(_, t, _)| t.unwrap() < new_term),
        "the old leader published after the takeover with a current term: {late:?}"
    );
    (old_term, new_term)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_broadcasts_of_a_frozen_leader_never_reach_a_client() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (a, mut b) = workers(&stack);
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(STARTUP);
    let seen = watch_broadcasts(&stack.nats.url()).await;
    let got = room_client(&front).await;
    let stop = CancellationToken::new();
    let sending = sender(&stack, stop.clone());
    wait_for("100 broadcasts", STARTUP, || {
        got.lock().unwrap().len() >= 100
    })
    .await;

    freeze_until_taken_over(&a, &mut b).await;
    let mid = got.lock().unwrap().len();
    wait_for("100 more broadcasts", STARTUP, || {
        got.lock().unwrap().len() >= mid + 100
    })
    .await;
    stop.cancel();
    let sent = sending.await.expect("sender");
    wait_for(
        &format!("all {sent} broadcasts at the client"),
        STARTUP,
        || got.lock().unwrap().iter().collect::<HashSet<_>>().len() >= sent as usize,
    )
    .await;
    let (old_term, new_term) = assert_terms(&seen.lock().unwrap());

    // The fronts' term guard covers broadcasts: one of the old term released now (as a
    // frozen leader's NATS client would) reaches no client; one of the current term does.
    let nats = Bus::nats(&stack.nats.url(), "late").await.expect("bus");
    for (term, n) in [(old_term, -1i64), (new_term, -2)] {
        let target = BroadcastTarget {
            project: "default".into(),
            private: false,
            name: "room".into(),
        };
        let env = Envelope::new("tick".into(), false, None);
        let payload = encode_envelope(&env, json!({ "n": n }).to_string().as_bytes()).unwrap();
        let term = term.to_string();
        let headers = [(HEADER_ORIGIN, "late-leader"), (HEADER_TERM, term.as_str())];
        nats.publish(target.subject(), &headers, payload)
            .await
            .expect("publish");
    }
    nats.barrier().await.expect("barrier");
    wait_for(
        "the current term's broadcast",
        Duration::from_secs(10),
        || got.lock().unwrap().contains(&-2),
    )
    .await;
    let got = got.lock().unwrap().clone();
    assert!(
        !got.contains(&-1),
        "a broadcast of the old term reached the client"
    );
    eprintln!(
        "database broadcast freeze: {sent} sent, {} delivered (replays included), terms {old_term} → {new_term}",
        got.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_events_of_a_frozen_leader_never_reach_the_stream() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (a, mut b) = workers(&stack);
    let stop = CancellationToken::new();
    let c = client(&stack.pg).await;
    let s = stop.clone();
    let emitting = tokio::spawn(async move {
        let mut ids = Vec::new();
        while !s.is_cancelled() {
            let n = ids.len();
            ids.push(
                emit(
                    &c,
                    "orders",
                    &format!("k{}", n % 7),
                    &format!(r#"{{"n": {n}}}"#),
                )
                .await,
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        ids
    });
    let mut stream = outbox_stream(&stack.nats.url(), Duration::from_secs(30)).await;
    let deadline = Instant::now() + STARTUP;
    while stored_count(&mut stream).await < 100 {
        assert!(Instant::now() < deadline, "100 events stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    freeze_until_taken_over(&a, &mut b).await;
    let mid = stored_count(&mut stream).await;
    while stored_count(&mut stream).await < mid + 100 {
        assert!(
            Instant::now() < deadline + STARTUP,
            "100 more events stored"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    let ids = emitting.await.expect("emitter");
    let stored = settled(&mut stream, ids.len() as u64).await;

    let terms: Vec<u64> = stored
        .iter()
        .map(|s| {
            s.header(HEADER_TERM)
                .and_then(|t| t.parse().ok())
                .expect("every event carries Walcast-Term")
        })
        .collect();
    let first_new = terms
        .iter()
        .position(|t| *t > terms[0])
        .expect("a takeover");
    let new_term = terms[first_new];
    assert!(
        terms[first_new..].iter().all(|t| *t >= new_term),
        "an event of the old term was stored after the new leader's first: {:?}",
        &terms[first_new..]
    );
    let stored_ids: Vec<&str> = stored
        .iter()
        .filter_map(|s| s.header("Nats-Msg-Id"))
        .collect();
    let unique: HashSet<&str> = stored_ids.iter().copied().collect();
    assert_eq!(unique.len(), stored_ids.len(), "an event stored twice");
    let lost: Vec<&String> = ids
        .iter()
        .filter(|id| !unique.contains(id.as_str()))
        .collect();
    assert!(
        lost.is_empty(),
        "{} events lost, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    eprintln!(
        "outbox freeze: {} events, each once; terms {} → {new_term}",
        ids.len(),
        terms[0]
    );
}
