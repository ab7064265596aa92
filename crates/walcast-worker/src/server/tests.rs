use std::time::Instant;

use super::*;
use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::get;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

type Started = (u16, oneshot::Sender<()>, tokio::task::JoinHandle<()>);

async fn start(router: Router) -> Started {
    start_with(router, Limits::default()).await
}

async fn start_with(router: Router, limits: Limits) -> Started {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.await;
        };
        serve(Listening::on(listener, limits), router, shutdown)
            .await
            .unwrap();
    });
    (port, stop, server)
}

/// Limits small enough for a test to reach.
fn tight() -> Limits {
    Limits {
        header_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(600),
        max_pending: 3,
        max_pending_per_peer: 0,
        ..Limits::default()
    }
}

/// How long until the server closes `s` (reading and dropping what it sends).
async fn closed_after(s: &mut TcpStream, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 1024];
    tokio::time::timeout(within, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return start.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

/// Send `request` on a new connection; what the server wrote until it closed.
async fn exchange(port: u16, request: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got).await;
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn an_upgrade_hands_over_the_tcp_socket_itself() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let router = Router::new().route(
        "/up",
        get(move |mut req: Request| {
            let tx = tx.clone();
            async move {
                let on = hyper::upgrade::on(&mut req);
                tokio::spawn(async move {
                    let upgraded = on.await.unwrap();
                    let _ = tx.send(upgraded.downcast::<TokioIo<TcpStream>>().is_ok());
                });
                Response::builder()
                    .status(StatusCode::SWITCHING_PROTOCOLS)
                    .header("connection", "upgrade")
                    .header("upgrade", "test")
                    .body(Body::empty())
                    .unwrap()
            }
        }),
    );
    let (port, _stop, _server) = start(router).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let req = "GET /up HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: test\r\n\r\n";
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 101");
    assert_eq!(
        rx.recv().await,
        Some(true),
        "the upgraded stream is not the TcpStream: the front would write through \
         hyper's layers"
    );
}

#[tokio::test]
async fn garbage_and_oversized_heads_are_refused_and_serving_goes_on() {
    let router = Router::new().route("/ok", get(|| async { "fine" }));
    let (port, _stop, _server) = start(router).await;
    let garbage = exchange(port, "\x16\x03\x01 not http at all\r\n\r\n").await;
    assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage}");
    let huge = format!(
        "GET /ok HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
        "a".repeat(1 << 20)
    );
    let big = exchange(port, &huge).await;
    assert!(
        big.is_empty() || big.starts_with("HTTP/1.1 431"),
        "a megabyte of headers was answered: {big}"
    );
    let ok = exchange(
        port,
        "GET /ok HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(
        ok.starts_with("HTTP/1.1 200") && ok.ends_with("fine"),
        "{ok}"
    );
}

#[tokio::test]
async fn shutdown_lets_the_request_in_flight_finish_then_stops() {
    let router = Router::new().route(
        "/slow",
        get(|| async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            "done"
        }),
    );
    let (port, stop, server) = start(router).await;
    let request = tokio::spawn(exchange(port, "GET /slow HTTP/1.1\r\nhost: x\r\n\r\n"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.send(()).unwrap();
    let answer = request.await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("done"), "{answer}");
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("serve returns once its connections are done")
        .unwrap();
    assert!(
        TcpStream::connect(("127.0.0.1", port)).await.is_err(),
        "still accepting after shutdown"
    );
}

#[tokio::test]
async fn an_unfinished_head_is_closed_at_the_header_timeout() {
    let router = Router::new().route("/ok", get(|| async { "fine" }));
    let (port, _stop, _server) = start_with(router, tight()).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(b"GET /ok HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let took = closed_after(&mut s, Duration::from_secs(5)).await;
    let took = took.expect("a stalled head was never closed");
    assert!(took >= Duration::from_millis(250), "closed after {took:?}");
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_at_the_idle_timeout() {
    let router = Router::new().route("/ok", get(|| async { "fine" }));
    let (port, _stop, _server) = start_with(router, tight()).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    // Answered, then kept open: the idle timeout (longer than the header one) applies.
    s.write_all(b"GET /ok HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let took = closed_after(&mut s, Duration::from_secs(5)).await;
    let took = took.expect("an idle connection was never closed");
    assert!(took >= Duration::from_millis(500), "closed after {took:?}");
}

#[tokio::test]
async fn too_many_headers_are_refused() {
    let router = Router::new().route("/ok", get(|| async { "fine" }));
    let (port, _stop, _server) = start(router).await;
    let mut req = String::from("GET /ok HTTP/1.1\r\nhost: x\r\n");
    for i in 0..DEFAULT_MAX_HEADERS + 1 {
        req.push_str(&format!("x-h{i}: v\r\n"));
    }
    req.push_str("\r\n");
    let answer = exchange(port, &req).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
}

/// A route that answers an endless event stream, as the front's SSE does.
fn streaming() -> Router {
    Router::new().route("/ok", get(|| async { "fine" })).route(
        "/stream",
        get(|| async {
            let events = futures_util::stream::unfold((), |()| async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Some((
                    Ok::<_, std::io::Error>(bytes::Bytes::from_static(b": tick\n\n")),
                    (),
                ))
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(events))
                .unwrap()
        }),
    )
}

#[tokio::test]
async fn past_the_cap_the_oldest_waiting_connection_goes_and_streams_stay() {
    let (port, _stop, _server) = start_with(streaming(), tight()).await;
    // A stream, admitted by its handler: neither pending nor timed out.
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream
        .write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    // Four stalled connections for three places: the first is closed at once.
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        s.write_all(b"GET /ok HTTP/1.1\r\n").await.unwrap();
        stalled.push(s);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first = closed_after(&mut stalled[0], Duration::from_millis(200)).await;
    assert!(
        first.is_some(),
        "the oldest stalled connection is still open"
    );
    // A fresh request is the newest: answered.
    let ok = exchange(
        port,
        "GET /ok HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    // Past both timeouts the stream still flows.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut tick = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut tick))
        .await
        .expect("the stream stopped")
        .unwrap();
    assert!(n > 0, "the stream was closed");
}
