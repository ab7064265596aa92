//! A client that never reads, against a real `walcast serve`: it is disconnected (1013,
//! counted in `walcast_front_slow_consumer_disconnects_total`), a fast client on the same
//! channel receives every change in order, and the server's memory stays bounded.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::ws::anon;
use crate::support::{Stack, Worker};
use serde_json::json;
use walcast_testkit::phoenix::{Msg, PhoenixClient};

/// Rows written (one change each), in transactions of `PER_TXN`, one transaction every
/// `TXN_EVERY` (1,000 rows/s, 8 MB/s: a rate a reading client keeps up with even in a
/// debug build; the server closes any client that falls `OUTBOUND_QUEUE` frames behind).
const ROWS: usize = 2000;
const PER_TXN: usize = 10;
const TXN_EVERY: Duration = Duration::from_millis(10);
/// Bytes of text per row: the slow client's queue (64 frames), its socket buffers and
/// the server's socket send buffer hold far less than ROWS × PAD (16 MB).
const PAD: usize = 8 * 1024;
/// The server's peak resident memory must stay under this.
const RSS_BOUND_KB: u64 = 64 * 1024;
/// The leader keeps recent messages for each front to resend (`CDC_RESEND_MAX_BYTES`),
/// whatever its clients do; at the default 16 MiB of these rows the process holds ~45 MB
/// more (allocator overhead included), so it is kept small here: the bound above is about
/// what a client that never reads costs.
const RESEND_BYTES: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_closed_and_the_fast_one_gets_everything() {
    let _machine = crate::support::alone().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE big (id int8 PRIMARY KEY, n int8 NOT NULL, pad text NOT NULL)");
    stack.enable("big");
    let resend = RESEND_BYTES.to_string();
    let mut server = Worker::serve(
        &stack.pg.url(),
        &[("OUTBOUND_QUEUE", "64"), ("CDC_RESEND_MAX_BYTES", &resend)],
    );
    server.wait_active(Duration::from_secs(60));
    let rss_start = server.proc_kb("VmRSS");
    let url = server.ws_url(&anon());
    let bindings = json!([{"event": "*", "schema": "public", "table": "big"}]);

    let mut slow = PhoenixClient::connect_small(&url, server.port, 4096).await;
    slow.join_subscribed("realtime:room", bindings.clone())
        .await;
    let mut fast = PhoenixClient::connect(&url).await;
    fast.join_subscribed("realtime:room", bindings).await;
    assert_eq!(
        server.metric("walcast_front_slow_consumer_disconnects_total"),
        None,
        "no slow consumer before the load"
    );

    // Sample the server's RSS while the load runs.
    let peak = Arc::new(AtomicU64::new(rss_start));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        let pid = server.child.id();
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                if let Some(kb) = std::fs::read_to_string(format!("/proc/{pid}/status"))
                    .ok()
                    .and_then(|s| {
                        s.lines()
                            .find(|l| l.starts_with("VmRSS:"))
                            .and_then(|l| l.split_whitespace().nth(1))
                            .and_then(|v| v.parse::<u64>().ok())
                    })
                {
                    peak.fetch_max(kb, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    // The fast client reads everything, checking order and content.
    let reader = tokio::spawn(async move {
        let started = Instant::now();
        let mut next = 0usize;
        while next < ROWS {
            let f = fast.recv_frame().await;
            assert_eq!(f[2], "realtime:room", "{f}");
            assert_eq!(f[3], "postgres_changes", "fast client got {f}");
            let data = &f[4]["data"];
            assert_eq!(data["type"], "INSERT");
            assert_eq!(data["record"]["n"], next as u64, "out of order or gap");
            assert_eq!(data["record"]["pad"].as_str().map(str::len), Some(PAD));
            next += 1;
        }
        (fast, started.elapsed())
    });

    let writer = stack.pg.connect().await.expect("connect");
    let started = Instant::now();
    let mut tick = tokio::time::interval(TXN_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for t in 0..ROWS / PER_TXN {
        tick.tick().await;
        let from = (t * PER_TXN) as i64;
        let to = from + PER_TXN as i64 - 1;
        writer
            .execute(
                "INSERT INTO big SELECT g, g, repeat(chr(97 + (g % 26)::int), $3) \
                 FROM generate_series($1::int8, $2::int8) g ORDER BY g",
                &[&from, &to, &(PAD as i32)],
            )
            .await
            .expect("insert");
    }
    let write_time = started.elapsed();

    // The server gives up on the slow client while the fast one is being served.
    let deadline = Instant::now() + Duration::from_secs(60);
    while server
        .metric("walcast_front_slow_consumer_disconnects_total")
        .unwrap_or(0.0)
        < 1.0
    {
        assert!(
            Instant::now() < deadline,
            "slow client not disconnected within 60 s; health {:?}",
            server.health()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // What the slow client sees now: the changes that were already in flight, in order,
    // then the close (1013) — or, if the close frame itself could not be written in time,
    // the end of the stream.
    let mut slow_changes = 0usize;
    let ending = loop {
        match slow.recv().await {
            Msg::Frame(f) => {
                assert_eq!(f[3], "postgres_changes", "slow client got {f}");
                assert_eq!(f[4]["data"]["record"]["n"], slow_changes as u64);
                slow_changes += 1;
            }
            other => break other,
        }
    };
    println!("slow client: {slow_changes} changes before {ending:?}");
    assert!(
        slow_changes < ROWS,
        "the slow client received everything: it was not slow"
    );
    match &ending {
        Msg::Close(code, reason) => {
            assert_eq!(*code, 1013, "{reason}");
            assert_eq!(reason, "slow consumer: outbound queue full");
        }
        Msg::Ended(e) => println!("slow client: stream ended without a close frame: {e}"),
        Msg::Binary(_) => panic!("unexpected binary frame"),
        Msg::Frame(_) => unreachable!(),
    }

    let (mut fast, fast_time) = tokio::time::timeout(Duration::from_secs(120), reader)
        .await
        .expect("fast client did not receive every change within 120 s")
        .expect("fast reader");
    // Nothing after the last change but our heartbeat reply.
    fast.heartbeat_ok().await;
    done.store(true, Ordering::Relaxed);
    sampler.await.expect("sampler");
    let hwm = server.proc_kb("VmHWM");
    let rss_end = server.proc_kb("VmRSS");
    println!(
        "wrote {ROWS} rows of {PAD} bytes in {write_time:?}; fast client got all in \
         {fast_time:?}; server RSS start {rss_start} kB, sampled peak {} kB, VmHWM {hwm} kB, \
         end {rss_end} kB (bound {RSS_BOUND_KB} kB)",
        peak.load(Ordering::Relaxed)
    );
    let worst = hwm.max(peak.load(Ordering::Relaxed));
    assert!(
        worst < RSS_BOUND_KB,
        "server peak RSS {worst} kB over {RSS_BOUND_KB} kB"
    );
    assert_eq!(
        server.metric("walcast_front_slow_consumer_disconnects_total"),
        Some(1.0),
        "exactly one slow consumer"
    );
    let health = server.health().expect("health");
    assert_eq!(health["front"]["connections"], 1, "{health}");
    assert_eq!(health["front"]["channels"], 1, "{health}");
}
