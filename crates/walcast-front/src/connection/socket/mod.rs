//! The WebSocket under a connection: the HTTP upgrade, and the socket split in two.
//!
//! * **Reading**: tungstenite parses the client's frames (masking, fragments, UTF-8,
//!   size limits). What it writes itself — the Pong to a Ping, the answer to a Close —
//!   it writes into [`ReadSide`], which queues those bytes as one more frame for the
//!   writer, in order with everything else.
//! * **Writing**: our own (see [`writer`]): every frame reaches the writer already
//!   encoded for the wire ([`wire`]), shared by all the sockets it goes to, and is
//!   written from there with vectored writes. No socket keeps a write buffer.

pub(crate) mod wire;
pub(crate) mod writer;

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use hyper::upgrade::{OnUpgrade, Upgraded};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::reply::error_response;
pub(crate) use wire::Out;
use writer::WriteHalf;

/// A socket's read buffer, to start with (it grows to the largest frame read). Clients
/// send little (heartbeats, joins, an occasional broadcast), and every idle socket holds
/// it: at 4 KB it was a quarter of an idle joined connection's memory.
pub const SOCKET_READ_BUFFER: usize = 1024;

/// What the socket's two halves need of their connection (the connection's queue and
/// its close state live with it, in `super::queue`).
pub(crate) trait Link: Send + Sync + 'static {
    /// Queue a protocol reply (a Pong, the answer to a Close) behind the frames queued
    /// before it; false if the connection is gone or, full, was closed as slow.
    fn reply(&self, out: Out) -> bool;
    /// Set when the connection is to close.
    fn killed(&self) -> &Kill;
    /// How it ends, once killed.
    fn ending(&self) -> Ending;
}

/// A connection's kill switch: a token to wait on, and a flag beside it that is cheap to
/// read. The writer reads the flag before each write; the token's own state sits behind a
/// lock in memory of its own, cold by then, and reading it there was a twentieth of the
/// front's CPU when each socket had one frame at a time to write.
#[derive(Default)]
pub(crate) struct Kill {
    flag: AtomicBool,
    token: CancellationToken,
}

impl Kill {
    pub(crate) fn cancel(&self) {
        self.flag.store(true, Ordering::Release);
        self.token.cancel();
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Completes once [`Kill::cancel`] was called.
    pub(crate) fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.token.cancelled()
    }
}

/// How a connection ends, as its writer needs to know it.
pub(crate) enum Ending {
    /// The client sent a Close; the answer is queued (after what was queued before it).
    Answered,
    /// We close it with `code` and `reason`, after what is queued if `flush`.
    Close {
        code: u16,
        reason: String,
        flush: bool,
    },
}

/// The client's frames, as tungstenite reads them.
pub(crate) type Reader = WebSocketStream<ReadSide>;

/// A valid WebSocket upgrade request (RFC 6455 §4.2.1), not yet answered.
pub(crate) struct Upgrade {
    key: HeaderValue,
    on_upgrade: OnUpgrade,
}

impl<S: Send + Sync> FromRequestParts<S> for Upgrade {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let bad = |msg: &str| error_response(StatusCode::BAD_REQUEST, msg);
        if parts.method != Method::GET {
            return Err(error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "a WebSocket upgrade is a GET",
            ));
        }
        let h = &parts.headers;
        if !has_token(h, header::CONNECTION, "upgrade") {
            return Err(bad("the Connection header does not include \"upgrade\""));
        }
        if !has_token(h, header::UPGRADE, "websocket") {
            return Err(bad("the Upgrade header is not \"websocket\""));
        }
        if h.get(header::SEC_WEBSOCKET_VERSION)
            .map(HeaderValue::as_bytes)
            != Some(b"13")
        {
            let mut r = error_response(
                StatusCode::UPGRADE_REQUIRED,
                "unsupported Sec-WebSocket-Version (13 is)",
            );
            r.headers_mut().insert(
                header::SEC_WEBSOCKET_VERSION,
                HeaderValue::from_static("13"),
            );
            return Err(r);
        }
        let Some(key) = h.get(header::SEC_WEBSOCKET_KEY).cloned() else {
            return Err(bad("the Sec-WebSocket-Key header is missing"));
        };
        let Some(on_upgrade) = parts.extensions.remove::<OnUpgrade>() else {
            return Err(error_response(
                StatusCode::UPGRADE_REQUIRED,
                "this connection cannot be upgraded",
            ));
        };
        Ok(Upgrade { key, on_upgrade })
    }
}

impl Upgrade {
    /// Answer `101 Switching Protocols`; `then` gets the socket once hyper has handed it
    /// over (it is not called if that fails: the client went away).
    pub(crate) fn accept<F, Fut>(self, then: F) -> Response
    where
        F: FnOnce(Upgraded) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let accept = derive_accept_key(self.key.as_bytes());
        let on_upgrade = self.on_upgrade;
        tokio::spawn(async move {
            match on_upgrade.await {
                Ok(u) => then(u).await,
                Err(e) => tracing::debug!(error = %e, "WebSocket upgrade failed"),
            }
        });
        let mut r = StatusCode::SWITCHING_PROTOCOLS.into_response();
        let h = r.headers_mut();
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        if let Ok(v) = HeaderValue::from_str(&accept) {
            h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
        }
        r
    }
}

/// Whether a comma-separated header holds `token` (case-insensitive).
fn has_token(h: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    h.get_all(name).iter().any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
    })
}

/// The limits of the client's frames.
pub(crate) struct ReadLimits {
    pub max_message_bytes: usize,
}

/// Split the upgraded socket: tungstenite reads (its replies queued through `conn`),
/// and the writing half goes to the writer.
pub(crate) async fn open(
    upgraded: Upgraded,
    conn: Arc<dyn Link>,
    limits: ReadLimits,
) -> (Reader, WriteHalf) {
    let (read, write, prefix): (ReadHalf, WriteHalf, Bytes) =
        match upgraded.downcast::<TokioIo<TcpStream>>() {
            Ok(parts) => {
                let (r, w) = parts.io.into_inner().into_split();
                (Box::new(r), Box::new(w), parts.read_buf)
            }
            // Served over something else: `axum::serve` (hyper-util wraps the socket in
            // its own type), TLS in front of the router, a test's duplex. It works the
            // same, each write through a lock shared with the reader; walcast's binaries
            // serve HTTP so that the upgrade yields the `TcpStream` (`walcast_worker::http::serve`).
            Err(u) => {
                let (r, w) = tokio::io::split(TokioIo::new(u));
                (Box::new(r), Box::new(w), Bytes::new())
            }
        };
    let config = WebSocketConfig::default()
        .read_buffer_size(SOCKET_READ_BUFFER)
        .write_buffer_size(0)
        .max_message_size(Some(limits.max_message_bytes))
        .max_frame_size(Some(limits.max_message_bytes));
    let side = ReadSide { read, conn };
    let reader =
        WebSocketStream::from_partially_read(side, prefix.to_vec(), Role::Server, Some(config))
            .await;
    (reader, write)
}

type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;

/// The socket's reading half, as tungstenite sees it. Its writes are tungstenite's
/// protocol replies, whole frames: they are queued on the connection like any frame.
pub(crate) struct ReadSide {
    read: ReadHalf,
    conn: Arc<dyn Link>,
}

impl AsyncRead for ReadSide {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.read).poll_read(cx, buf)
    }
}

impl AsyncWrite for ReadSide {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.conn.reply(Out::raw(Bytes::copy_from_slice(buf))) {
            Poll::Ready(Ok(buf.len()))
        } else {
            Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()))
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_tokens_match_in_lists_and_any_case() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert!(has_token(&h, header::CONNECTION, "upgrade"));
        assert!(!has_token(&h, header::CONNECTION, "close"));
        assert!(!has_token(&h, header::UPGRADE, "websocket"));
    }
}
