//! One connection: hyper's HTTP/1 with its head limits, watched by a timer of our own.
//!
//! hyper's own header timeout needs a timer this server did not give it, and knows nothing
//! of keep-alive idleness; the watch here follows what the connection does instead:
//!
//! | phase | until | then |
//! |---|---|---|
//! | waiting for its first request head (from accept) | `HTTP_HEADER_TIMEOUT_MS` | closed, counted `header` |
//! | waiting for its next one (keep-alive, from the end of its last response) | `HTTP_IDLE_TIMEOUT_MS` | closed, counted `idle` |
//! | answering a request | its handler's own bounds | — |
//! | streaming an admitted response (SSE) | as long as the stream lasts | — |
//!
//! While waiting or answering, the connection holds a place among the pending ones
//! ([`super::pending`]) and may be closed to make room; streaming, it does not (the
//! front counted it in `MAX_CONNECTIONS` when it let it in). An upgrade (a WebSocket)
//! ends the connection here: the socket is the front's from then on.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::{header, Request, Response};
use axum::Router;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::pending::{PeerKey, Slot};
use super::Shared;
use crate::telemetry;

/// What a connection is doing, for its timer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for a request head until then; `first`: its first one.
    Waiting { until: Instant, first: bool },
    /// Answering a request.
    Busy,
    /// Streaming an admitted response.
    Streaming,
}

struct State {
    phase: Phase,
    slot: Slot,
}

/// A connection's phase and its place among the pending ones, shared by its task (the
/// timer) and its service (which sees requests start and responses end).
struct Watch {
    state: Mutex<State>,
    changed: Notify,
    idle_timeout: std::time::Duration,
}

impl Watch {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, phase: Phase) {
        self.lock().phase = phase;
        self.changed.notify_one();
    }

    /// A request head arrived: busy, and the newest of the pending.
    fn request_started(&self) {
        let mut s = self.lock();
        s.phase = Phase::Busy;
        s.slot.renew(true);
        drop(s);
        self.changed.notify_one();
    }

    /// Its response began: a stream the handler admitted leaves the pending.
    fn responded(&self, streaming: bool) {
        if streaming {
            let mut s = self.lock();
            s.phase = Phase::Streaming;
            s.slot.leave();
            drop(s);
            self.changed.notify_one();
        }
    }

    /// Its response ended: waiting for the next request (pending again, if it had left).
    fn response_done(&self) {
        self.lock().slot.renew(false);
        let until = Instant::now() + self.idle_timeout;
        self.set(Phase::Waiting {
            until,
            first: false,
        });
    }

    fn phase(&self) -> Phase {
        self.lock().phase
    }
}

impl Watch {
    /// A new connection's watch: waiting for its first head.
    fn new(slot: Slot, limits: &super::Limits) -> Arc<Watch> {
        let until = Instant::now() + limits.header_timeout;
        Arc::new(Watch {
            state: Mutex::new(State {
                phase: Phase::Waiting { until, first: true },
                slot,
            }),
            changed: Notify::new(),
            idle_timeout: limits.idle_timeout,
        })
    }

    /// Completes when the phase's time is up (never while busy or streaming).
    async fn expiry(&self) {
        match self.phase() {
            Phase::Waiting { until, .. } => tokio::time::sleep_until(until).await,
            Phase::Busy | Phase::Streaming => std::future::pending().await,
        }
    }

    /// The phase that timed out, if the time is up (`header` or `idle`).
    fn timed_out(&self) -> Option<&'static str> {
        match self.phase() {
            Phase::Waiting { until, first } if until <= Instant::now() => {
                Some(if first { "header" } else { "idle" })
            }
            _ => None,
        }
    }
}

/// Serve one connection until it ends, is upgraded, times out, is closed to make room or,
/// at shutdown, has finished the request in flight.
pub(super) async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    closing: CancellationToken,
    shared: Arc<Shared>,
) {
    let evict = CancellationToken::new();
    let slot = shared.pending.admit(PeerKey::of(peer.ip()), evict.clone());
    let limits = &shared.limits;
    let watch = Watch::new(slot, limits);
    let service = Watched {
        inner: TowerToHyperService::new(router),
        watch: watch.clone(),
    };
    let conn = http1::Builder::new()
        .max_buf_size(limits.max_header_bytes)
        .max_headers(limits.max_headers)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::pin!(conn);
    let mut shutting_down = false;
    let result = loop {
        tokio::select! {
            r = conn.as_mut() => break Some(r),
            _ = closing.cancelled(), if !shutting_down => {
                shutting_down = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = evict.cancelled() => break None,
            _ = watch.changed.notified() => {}
            _ = watch.expiry() => {
                if let Some(phase) = watch.timed_out() {
                    telemetry::http_timed_out(phase);
                    break None;
                }
            }
        }
    };
    if let Some(Err(e)) = result {
        ended_with(&e);
    }
}

/// A connection hyper ended with an error: a head refused is counted, the rest traced.
fn ended_with(e: &hyper::Error) {
    if e.is_parse_too_large() {
        telemetry::http_refused("too_large");
    } else if e.is_parse() {
        telemetry::http_refused("malformed");
    } else {
        tracing::trace!(error = %e, "HTTP connection ended with an error");
    }
}

/// The router, seen through the connection's watch.
#[derive(Clone)]
struct Watched {
    inner: TowerToHyperService<Router>,
    watch: Arc<Watch>,
}

type Answer = Pin<Box<dyn Future<Output = Result<Response<Tracked>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Watched {
    type Response = Response<Tracked>;
    type Error = Infallible;
    type Future = Answer;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        self.watch.request_started();
        let answer = self.inner.call(req);
        let watch = self.watch.clone();
        Box::pin(async move {
            let res = answer.await?;
            watch.responded(is_stream(&res));
            Ok(res.map(|body| Tracked {
                body,
                watch: Some(watch),
            }))
        })
    }
}

/// A response that lasts as long as its client stays: an event stream (the front sends
/// one only once it admitted the client, counted in `MAX_CONNECTIONS`).
fn is_stream(res: &Response<Body>) -> bool {
    res.headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

/// A response body that tells the watch when hyper is done with it (written whole, or
/// given up): the connection then waits for its next request.
struct Tracked {
    body: Body,
    watch: Option<Arc<Watch>>,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(w) = self.watch.take() {
            w.response_done();
        }
    }
}
