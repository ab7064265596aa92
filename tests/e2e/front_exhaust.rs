//! Unauthenticated clients against a real ws-front: connections that never finish their
//! request head, and heads too large to be one. The front stays reachable (`/health` and
//! `/readyz` answer within a second with 20,000 stalled connections held, all from the
//! probe's own address), its memory stays bounded, and what it refused or timed out is
//! closed and counted.
//!
//! 20,000 sockets are more than one process of this machine may hold, so the stalling
//! clients are helper processes: this test binary run again on [`stall_helper`].

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use walcast_testkit::Nats;

use crate::support::Worker;

/// Stalled connections held at once by the helpers, together.
const STALLED: usize = 20_000;
/// Helper processes they are spread over.
const HELPERS: usize = 5;
/// How long the helpers try to open their connections.
const CONNECT_FOR: Duration = Duration::from_secs(45);
/// How fast a fresh probe must be answered under the attack.
const PROBE_WITHIN: Duration = Duration::from_secs(1);
/// Connections sending a huge unfinished head, and how much each sends.
const HUGE_HEADS: usize = 1000;
const HUGE_HEAD_BYTES: usize = 390 * 1024;
/// A head under the size limit, that stalls: closed by the header timeout.
const STALLED_HEAD_BYTES: usize = 8 * 1024;
/// Growth of the front's peak resident memory allowed through the huge-head attack.
const HUGE_HEAD_RSS_BOUND_KB: u64 = 64 * 1024;
/// The header timeout the huge-head test runs the front with (the default is longer).
const HEADER_TIMEOUT_MS: u64 = 3000;

/// The start of a request head that never ends.
const UNFINISHED: &[u8] = b"GET /health HTTP/1.1\r\nhost: x\r\nx-wait: ";

/// Not a test of its own: [`stall_helper`]'s body when this binary is run as a helper
/// (`WALCAST_STALL_PORT` set). It opens `WALCAST_STALL_COUNT` connections to the port,
/// writes an unfinished head on each (trying for at most [`CONNECT_FOR`]), says `held <n>`
/// on stdout, and keeps them until its stdin closes.
#[test]
#[ignore = "run by the stalled-connections test as a helper process"]
fn stall_helper() {
    let Ok(port) = std::env::var("WALCAST_STALL_PORT") else {
        return;
    };
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("port");
    let count: usize = std::env::var("WALCAST_STALL_COUNT")
        .expect("count")
        .parse()
        .expect("count");
    let mut held = Vec::with_capacity(count);
    let deadline = Instant::now() + CONNECT_FOR;
    while held.len() < count && Instant::now() < deadline {
        // A connect the listener's backlog dropped is tried again.
        if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            let _ = s.write_all(UNFINISHED);
            held.push(s);
        }
    }
    println!("held {}", held.len());
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// A helper process holding `count` stalled connections to `port` (killed on drop).
struct Helper(Child);

impl Helper {
    fn start(port: u16, count: usize) -> Helper {
        let child = Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "front_exhaust::stall_helper",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("WALCAST_STALL_PORT", port.to_string())
            .env("WALCAST_STALL_COUNT", count.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn helper");
        Helper(child)
    }

    /// Wait for `held <n>`: how many it holds.
    fn held(&mut self) -> usize {
        let out = self.0.stdout.take().expect("stdout");
        for line in BufReader::new(out).lines() {
            let line = line.expect("helper output");
            // (The test harness may have started the line with the test's name.)
            if let Some((_, n)) = line.split_once("held ") {
                return n.trim().parse().expect("count");
            }
        }
        panic!("helper ended without holding its connections");
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET path` on a fresh connection, answered whole within `within`: the status line, or
/// why not.
fn probe(port: u16, path: &str, within: Duration) -> Result<String, String> {
    let start = Instant::now();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut s = TcpStream::connect_timeout(&addr, within).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(within)).unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let mut got = Vec::new();
    let read = s.read_to_end(&mut got);
    let took = start.elapsed();
    let text = String::from_utf8_lossy(&got).into_owned();
    match read {
        Ok(_) if took <= within && !text.is_empty() => {
            Ok(text.lines().next().unwrap_or("").to_string())
        }
        Ok(_) => Err(format!("answered after {took:?}: {text:?}")),
        Err(e) => Err(format!("no answer after {took:?} ({e}); got {text:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_within_a_second_under_20000_stalled_connections() {
    let _machine = crate::support::alone().await;
    let nats = Nats::start().expect("nats");
    let mut front = Worker::front(&nats.url(), &[]);
    front.wait_http(Duration::from_secs(30));
    let started = Instant::now();
    let port = front.port;
    let (held, helpers) = tokio::task::spawn_blocking(move || {
        let mut helpers: Vec<Helper> = (0..HELPERS)
            .map(|_| Helper::start(port, STALLED / HELPERS))
            .collect();
        let held: usize = helpers.iter_mut().map(Helper::held).sum();
        (held, helpers)
    })
    .await
    .expect("helpers");
    assert_eq!(held, STALLED);
    eprintln!(
        "{held} stalled connections opened in {:?}",
        started.elapsed()
    );
    // Fresh probes from the attackers' own address, each answered within a second.
    for path in ["/health", "/readyz", "/health", "/livez", "/readyz"] {
        let answer = tokio::task::spawn_blocking(move || probe(port, path, PROBE_WITHIN))
            .await
            .unwrap();
        match answer {
            Ok(status) => assert!(status.contains(" 200 "), "{path}: {status}"),
            Err(why) => panic!("{path} under {STALLED} stalled connections: {why}"),
        }
    }
    let evicted = front
        .metric("walcast_http_connections_evicted_total")
        .unwrap_or(0.0);
    assert!(
        evicted >= (STALLED / 2) as f64,
        "only {evicted} stalled connections closed to make room"
    );
    drop(helpers);
}

/// One connection sending `bytes` of header lines that never end: true once the front
/// closed it (EOF or reset) within `within`.
async fn huge_head(port: u16, bytes: usize, within: Duration) -> bool {
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    let line = format!("x-pad: {}\r\n", "a".repeat(1000));
    let mut sent = 0;
    let write = async {
        s.write_all(UNFINISHED).await?;
        s.write_all(b"\r\n").await?;
        while sent < bytes {
            s.write_all(line.as_bytes()).await?;
            sent += line.len();
        }
        Ok::<_, std::io::Error>(())
    };
    let _ = tokio::time::timeout(within, write).await;
    let mut sink = [0u8; 4096];
    let closed = async {
        loop {
            match s.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, closed).await.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_and_stalled_heads_leave_memory_bounded_and_are_closed() {
    let _machine = crate::support::alone().await;
    let nats = Nats::start().expect("nats");
    let timeout = HEADER_TIMEOUT_MS.to_string();
    let mut front = Worker::front(&nats.url(), &[("HTTP_HEADER_TIMEOUT_MS", &timeout)]);
    front.wait_http(Duration::from_secs(30));
    let rss_before = front.proc_kb("VmRSS");
    let port = front.port;
    let within = Duration::from_millis(HEADER_TIMEOUT_MS) + Duration::from_secs(20);
    // Heads past any limit, then heads under it that stall: both closed.
    let mut open = 0;
    for bytes in [HUGE_HEAD_BYTES, STALLED_HEAD_BYTES] {
        let started = Instant::now();
        let tasks: Vec<_> = (0..HUGE_HEADS)
            .map(|_| tokio::spawn(huge_head(port, bytes, within)))
            .collect();
        for t in tasks {
            if !t.await.unwrap() {
                open += 1;
            }
        }
        eprintln!(
            "{HUGE_HEADS} heads of {bytes} bytes done in {:?}",
            started.elapsed()
        );
    }
    let peak = front.proc_kb("VmHWM");
    let grew = peak.saturating_sub(rss_before);
    eprintln!("peak RSS {peak} kB, {grew} kB over the {rss_before} kB before");
    assert!(
        grew <= HUGE_HEAD_RSS_BOUND_KB,
        "{HUGE_HEADS} huge heads took the front's peak memory from {rss_before} kB to {peak} kB"
    );
    assert_eq!(
        open, 0,
        "{open} of {HUGE_HEADS} huge heads were never closed"
    );
    match probe(port, "/health", PROBE_WITHIN) {
        Ok(status) => assert!(status.contains(" 200 "), "{status}"),
        Err(why) => panic!("/health after the huge heads: {why}"),
    }
}
