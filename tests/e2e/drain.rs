//! Graceful drain: SIGTERM to a ws-front with 1,000 connected sockets turns `/readyz` to
//! 503 at once, refuses new sockets, closes the open ones (1001) spread over `DRAIN_SECS`
//! rather than all in the same second, and the process exits before the window ends.

use std::time::{Duration, Instant};

use crate::support::ws::anon;
use crate::support::{Stack, Worker};
use futures_util::StreamExt;
use tokio_tungstenite::tungstenite::Message;
use walcast_testkit::phoenix::PhoenixClient;

const CLIENTS: usize = 1000;
const DRAIN_SECS: u64 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_front_gradually() {
    let _machine = crate::support::alone().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let mut front = Worker::front(&stack.nats.url(), &[("DRAIN_SECS", "4")]);
    front.wait_http(Duration::from_secs(60));
    let (status, body) = front.status("/readyz");
    assert_eq!((status, body.as_str()), (200, "ready"));
    let url = front.ws_url(&anon());

    let mut sockets = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        sockets.push(PhoenixClient::connect(&url).await);
    }
    // Each socket reports when and how it was closed.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for s in sockets {
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut ws = s.ws;
            while let Some(m) = ws.next().await {
                if let Ok(Message::Close(c)) = m {
                    let code = c.map(|c| u16::from(c.code));
                    let _ = tx.send((Instant::now(), code));
                    return;
                }
                if m.is_err() {
                    break;
                }
            }
            let _ = tx.send((Instant::now(), None));
        });
    }
    drop(tx);
    let health = front.health().expect("health");
    assert_eq!(health["front"]["connections"], CLIENTS, "{health}");

    let term = Instant::now();
    front.signal("TERM");
    // The signal reaches the process's handler asynchronously: a request sent in the same
    // instant may still be answered `ready`. "At once" is within half a second.
    let (status, why) = loop {
        let (status, why) = front.status("/readyz");
        if status == 503 || term.elapsed() > Duration::from_millis(500) {
            break (status, why);
        }
    };
    let took = term.elapsed();
    assert_eq!(status, 503, "/readyz {took:?} after SIGTERM: {why}");
    assert!(why.contains("draining"), "{why}");
    assert!(took < Duration::from_millis(500), "/readyz took {took:?}");
    let refused = tokio_tungstenite::connect_async(url.as_str()).await;
    assert!(refused.is_err(), "a new socket was accepted while draining");

    let mut closes = Vec::with_capacity(CLIENTS);
    let deadline = Duration::from_secs(DRAIN_SECS + 10);
    while closes.len() < CLIENTS {
        match tokio::time::timeout(deadline, rx.recv()).await {
            Ok(Some(c)) => closes.push(c),
            Ok(None) => break,
            Err(_) => panic!("only {} of {CLIENTS} sockets closed", closes.len()),
        }
    }
    assert_eq!(closes.len(), CLIENTS);
    assert!(
        closes.iter().all(|(_, code)| *code == Some(1001)),
        "every socket closed with 1001: {:?}",
        closes
            .iter()
            .filter(|(_, c)| *c != Some(1001))
            .take(5)
            .collect::<Vec<_>>()
    );
    let mut at: Vec<f64> = closes
        .iter()
        .map(|(t, _)| t.duration_since(term).as_secs_f64())
        .collect();
    at.sort_by(f64::total_cmp);
    let window = DRAIN_SECS as f64;
    // Spread: a tenth closes in the first 10% of the window, not all at once; the 10th and
    // 90th percentiles lie at least half the window apart; all within the window.
    let (p10, p90, last) = (at[CLIENTS / 10], at[CLIENTS * 9 / 10], at[CLIENTS - 1]);
    assert!(
        p90 - p10 >= window * 0.5,
        "closes not spread: p10 {p10:.2} s, p90 {p90:.2} s"
    );
    assert!(
        last < window,
        "last close at {last:.2} s, after the {window} s window"
    );
    let (exited, log) = front.wait_exit(Duration::from_secs(DRAIN_SECS + 5));
    let exit_at = term.elapsed().as_secs_f64();
    assert!(exited, "ws-front did not exit cleanly:\n{log}");
    assert!(
        exit_at < window,
        "exited {exit_at:.2} s after SIGTERM, after the {window} s window"
    );
}
