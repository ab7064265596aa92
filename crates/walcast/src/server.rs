//! Serving a router on a TCP listener: HTTP/1.1, one task per connection, with upgrades.
//!
//! Our own accept loop rather than `axum::serve`, for one reason: axum serves each
//! connection through hyper-util's protocol sniffer, which wraps the socket in a private
//! type, so a WebSocket upgrade hands the front an opaque stream. Served here with
//! hyper's HTTP/1 connection directly, the upgrade gives the front the `TcpStream`
//! itself (see `walcast_front::socket::open`): its writer then writes each frame with one
//! `send` on its own half of the socket, not through a lock shared with the reader and
//! three layers of boxed IO. Measured in docs/benchmarks.md (issue 28, session 23).
//!
//! Otherwise it behaves as `axum::serve` did: HTTP/1 only, no timers; an accept error
//! other than a peer's reset is logged and retried after a second (the likely cause is
//! running out of file descriptors); at shutdown, no new connection is accepted, each open
//! one finishes the request in flight and closes, and `serve` returns once all have.

use std::future::Future;
use std::io;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long to wait before accepting again after an error that is not the peer's.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// Serve `router` on `listener` until `shutdown` completes, then let the open
/// connections finish their requests.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let conns = TaskTracker::new();
    let closing = CancellationToken::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
        };
        conns.spawn(connection(stream, router.clone(), closing.clone()));
    }
    drop(listener);
    closing.cancel();
    conns.close();
    conns.wait().await;
    Ok(())
}

/// One connection's requests, and its upgrade if it asks for one.
async fn connection(stream: TcpStream, router: Router, closing: CancellationToken) {
    let service = TowerToHyperService::new(router);
    let conn = http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        _ = closing.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::trace!(error = %e, "HTTP connection ended with an error");
    }
}

async fn accept_failed(e: io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "accept failed; accepting again in a second");
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::extract::Request;
    use axum::http::StatusCode;
    use axum::response::Response;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::{mpsc, oneshot};

    async fn start(router: Router) -> (u16, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.await;
            };
            serve(listener, router, shutdown).await.unwrap();
        });
        (port, stop, server)
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
}
