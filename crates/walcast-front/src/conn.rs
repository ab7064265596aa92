//! One WebSocket connection: the upgrade, the read loop, the writer task and frame
//! decoding.
//!
//! The read loop owns the connection's [`Session`] (its channels) and hands it client
//! frames one at a time (see [`crate::channel`]). Everything for the client — replies and
//! fan-out alike — goes through the connection's bounded queue to the writer task, which
//! batches writes and closes the socket with the recorded close code when the connection
//! is killed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::stream::SplitSink;
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_protocol::message::PHOENIX_TOPIC;
use walcast_protocol::{server, Frame, Vsn};

use crate::auth::Verified;
use crate::channel::{Services, Session};
use crate::connections::ConnSlot;
use crate::credentials::Credentials;
use crate::outbound::{ConnHandle, Out, CLOSE_GOING_AWAY, CLOSE_SLOW_CONSUMER, CLOSE_TOO_BIG};
use crate::reply::{auth_status, draining_response, error_response};
use crate::telemetry;

/// What the WebSocket route needs: the services of its connections' commands, and the
/// front's lifetime (connections close with 1001 when it is cancelled, and it waits
/// for them).
pub(crate) struct Sockets {
    pub services: Arc<Services>,
    pub cancel: CancellationToken,
    pub tracker: TaskTracker,
}

/// `GET /realtime/v1/websocket?apikey=<jwt>&vsn=<1.0.0|2.0.0>` (the key may also come
/// from the headers: see [`crate::credentials`]).
pub(crate) async fn upgrade(
    State(sockets): State<Arc<Sockets>>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let services = &sockets.services;
    if services.connections.is_draining() {
        return draining_response();
    }
    let vsn = match Vsn::from_query(q.get("vsn").map(String::as_str)) {
        Ok(v) => v,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let creds = Credentials::from_request(&q, &headers);
    let socket_auth = match services.projects.verify(creds.key().unwrap_or("")).await {
        Ok(v) => v,
        Err(e) => {
            telemetry::error("auth");
            return error_response(auth_status(&e), &e.to_string());
        }
    };
    let ws = match ws {
        Ok(ws) => ws,
        Err(r) => return r.into_response(),
    };
    let Some(slot) = ConnSlot::acquire(&services.connections) else {
        return error_response(StatusCode::TOO_MANY_REQUESTS, "too many connections");
    };
    let limit = services
        .cfg
        .max_frame_bytes
        .saturating_mul(2)
        .max(64 * 1024);
    ws.max_message_size(limit)
        .max_frame_size(limit)
        .read_buffer_size(SOCKET_READ_BUFFER)
        .write_buffer_size(SOCKET_WRITE_BUFFER)
        .on_upgrade(move |socket| {
            let tracker = sockets.tracker.clone();
            tracker.track_future(run(sockets, socket, vsn, socket_auth, creds, slot))
        })
}

/// A socket's read buffer, to start with (it grows to the largest frame read). Clients
/// send little (heartbeats, joins, an occasional broadcast), and every idle socket holds
/// it: at 4 KB it was a quarter of an idle joined connection's memory.
pub const SOCKET_READ_BUFFER: usize = 1024;

/// A socket's write buffer: frames are gathered up to this many bytes before a write.
pub const SOCKET_WRITE_BUFFER: usize = 8 * 1024;

struct Conn {
    session: Session,
    max_frame_bytes: usize,
    idle_timeout: Duration,
    last_seen: Instant,
}

/// The read loop. It lives as long as the connection, so its future (a task's allocation
/// per connection) is kept small: the commands, the timer checks and the teardown await
/// boxed futures, allocated only while they run (unboxed, the join's alone made the task
/// about 6 KB).
async fn run(
    sockets: Arc<Sockets>,
    socket: WebSocket,
    vsn: Vsn,
    auth: Verified,
    creds: Credentials,
    slot: ConnSlot,
) {
    let services = sockets.services.clone();
    let (sink, mut stream) = socket.split();
    let id = services.connections.next_id();
    let (handle, rx) = ConnHandle::new(id, services.cfg.outbound_queue);
    let writer = tokio::spawn(write_loop(sink, rx, handle.clone()));
    services.connections.opened(&handle, &auth.project);
    let mut conn = Conn {
        max_frame_bytes: services.cfg.max_frame_bytes,
        idle_timeout: services.cfg.idle_timeout,
        session: Session::new(services.clone(), handle.clone(), vsn, auth.project, creds),
        last_seen: Instant::now(),
    };
    loop {
        let deadline = conn.next_deadline();
        tokio::select! {
            _ = handle.kill.cancelled() => break,
            _ = sockets.cancel.cancelled() => {
                handle.close_with(CLOSE_GOING_AWAY, "server shutting down");
                break;
            }
            _ = tokio::time::sleep_until(deadline) => {
                if !Box::pin(conn.on_timer()).await {
                    break;
                }
            }
            msg = stream.next() => match msg {
                None => break,
                Some(Err(e)) => {
                    let text = e.to_string();
                    if text.contains("too long") || text.contains("Space limit") {
                        telemetry::limit("frame_size");
                        handle.close_with(CLOSE_TOO_BIG, "frame too large");
                    } else {
                        telemetry::error("socket_read");
                        handle.close_with(1002, "protocol error");
                    }
                    break;
                }
                Some(Ok(m)) => {
                    conn.last_seen = Instant::now();
                    if !Box::pin(conn.on_message(m)).await {
                        break;
                    }
                }
            }
        }
    }
    // Stop the writer (it sends the close frame), then drop every channel.
    handle.kill.cancel();
    Box::pin(conn.session.teardown()).await;
    services.connections.closed(&handle);
    let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
    drop(slot);
}

impl Conn {
    /// A client frame, counted for its project once the socket is one of its users.
    fn count_in(&self, len: usize) {
        if let Some(c) = self.session.handle.usage() {
            c.messages_in
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            c.bytes_in
                .fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Returns false when the connection must close.
    async fn on_message(&mut self, m: Message) -> bool {
        let max = self.max_frame_bytes;
        let vsn = self.session.vsn;
        let frame = match m {
            Message::Text(t) => {
                metrics::counter!(telemetry::FRAMES_IN).increment(1);
                self.count_in(t.len());
                if t.len() > max {
                    return self.too_big(t.len());
                }
                Frame::decode_text(&t, vsn).map_err(|e| (salvage(&t, vsn), e))
            }
            Message::Binary(b) => {
                metrics::counter!(telemetry::FRAMES_IN).increment(1);
                self.count_in(b.len());
                if b.len() > max {
                    return self.too_big(b.len());
                }
                Frame::decode_client_binary(&b, vsn).map_err(|e| (Salvage::default(), e))
            }
            Message::Close(_) => {
                // tungstenite queued the answer (the client's code echoed); the writer
                // flushes it instead of sending a Close of its own.
                self.session.handle.peer_closed();
                return false;
            }
            Message::Ping(_) | Message::Pong(_) => return true,
        };
        match frame {
            Ok(f) => self.session.apply(f).await,
            Err((s, e)) => {
                telemetry::error("malformed_frame");
                let topic = s.topic.as_deref().unwrap_or(PHOENIX_TOPIC);
                let reply = server::reply_error(
                    s.join_ref.as_deref(),
                    s.ref_.as_deref(),
                    topic,
                    &server::error_reason("MalformedMessage", &e.to_string()),
                );
                self.session.handle.push_frame(&reply, vsn);
            }
        }
        true
    }

    fn too_big(&self, len: usize) -> bool {
        telemetry::limit("frame_size");
        let reason = format!(
            "frame too large: {len} bytes (max {})",
            self.max_frame_bytes
        );
        self.session.handle.close_with(CLOSE_TOO_BIG, &reason);
        false
    }

    fn next_deadline(&self) -> Instant {
        self.session.next_check(self.last_seen + self.idle_timeout)
    }

    /// Idle check and token expiry. Returns false when the connection must close.
    async fn on_timer(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.last_seen + self.idle_timeout {
            telemetry::error("idle_timeout");
            self.session.handle.close_with(1000, "heartbeat timeout");
            return false;
        }
        self.session.check_tokens(now).await;
        true
    }
}

/// Refs and topic recovered from a frame that failed to decode, for the error reply.
#[derive(Default)]
struct Salvage {
    join_ref: Option<String>,
    ref_: Option<String>,
    topic: Option<String>,
}

fn salvage(text: &str, vsn: Vsn) -> Salvage {
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        return Salvage::default();
    };
    let s = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_owned);
    match (vsn, &v) {
        (Vsn::V2, Value::Array(a)) => Salvage {
            join_ref: s(a.first()),
            ref_: s(a.get(1)),
            topic: s(a.get(2)),
        },
        (Vsn::V1, Value::Object(o)) => Salvage {
            join_ref: s(o.get("join_ref")),
            ref_: s(o.get("ref")),
            topic: s(o.get("topic")),
        },
        _ => Salvage::default(),
    }
}

/// The socket's writing half.
type WsWriter = SplitSink<WebSocket, Message>;

fn to_message(o: Out) -> Message {
    match o {
        Out::Text(t) => Message::Text(t),
        Out::Binary(b) => Message::Binary(b),
    }
}

/// Write queued frames (batched: feed everything ready, then flush) until killed.
async fn write_loop(mut sink: WsWriter, mut rx: mpsc::Receiver<Out>, handle: Arc<ConnHandle>) {
    loop {
        let first = tokio::select! {
            biased;
            _ = handle.kill.cancelled() => break,
            m = rx.recv() => m,
        };
        let Some(first) = first else { break };
        let write = async {
            sink.feed(to_message(first)).await?;
            let mut n = 1u64;
            while n < 64 {
                match rx.try_recv() {
                    Ok(m) => {
                        sink.feed(to_message(m)).await?;
                        n += 1;
                    }
                    Err(_) => break,
                }
            }
            sink.flush().await?;
            Ok::<u64, axum::Error>(n)
        };
        let r = tokio::select! {
            _ = handle.kill.cancelled() => break,
            r = write => r,
        };
        match r {
            Ok(n) => metrics::counter!(telemetry::FRAMES_OUT).increment(n),
            Err(_) => {
                handle.kill.cancel();
                break;
            }
        }
    }
    let close = async {
        if !handle.is_peer_closed() {
            // Fails (`SendAfterClosing`) if the client's Close arrived meanwhile.
            let _ = close_ours(&mut sink, &mut rx, &handle).await;
        }
        // Sends what is still queued in the socket, among it the answer tungstenite
        // queued to a client's Close (a Close frame cannot be sent after receiving one).
        sink.close().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), close).await;
}

/// Flush what is already queued unless this is a slow consumer, then send our Close
/// with the recorded code.
async fn close_ours(
    sink: &mut WsWriter,
    rx: &mut mpsc::Receiver<Out>,
    handle: &ConnHandle,
) -> Result<(), axum::Error> {
    let (code, reason) = handle.close_reason().unwrap_or((1000, String::new()));
    if code != CLOSE_SLOW_CONSUMER {
        while let Ok(m) = rx.try_recv() {
            sink.feed(to_message(m)).await?;
        }
    }
    sink.send(Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    })))
    .await
}
