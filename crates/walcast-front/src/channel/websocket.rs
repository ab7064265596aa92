//! The WebSocket route: a connection's upgrade, its read loop, its writer task and frame
//! decoding.
//!
//! The read loop owns the connection's [`Channels`] and hands them client frames one at
//! a time (see [`super`]); a command that waits for the
//! cdc-worker (a join, a token refresh, a private channel's write check) runs beside
//! them, polled by the same loop, so nothing else on the socket waits for it.
//! Everything for the client — replies and
//! fan-out alike — goes through the connection's bounded queue to the writer task, which
//! batches writes and closes the socket with the recorded close code when the connection
//! is killed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};
use hyper::upgrade::Upgraded;
use serde_json::Value;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_protocol::message::PHOENIX_TOPIC;
use walcast_protocol::{server, Frame, Vsn};

use super::{Channels, Services};
use crate::auth::credentials::Credentials;
use crate::auth::Verified;
use crate::connection::open::ConnSlot;
use crate::connection::socket::{self, writer, ReadLimits, Upgrade};
use crate::connection::{ConnHandle, CLOSE_GOING_AWAY, CLOSE_TOO_BIG};
use crate::reply::{draining_response, error_response};
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
/// from the headers: see [`crate::auth::credentials`]).
pub(crate) async fn upgrade(
    State(sockets): State<Arc<Sockets>>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    ws: Result<Upgrade, Response>,
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
            return error_response(e.http_status(), &e.to_string());
        }
    };
    let ws = match ws {
        Ok(ws) => ws,
        Err(r) => return r,
    };
    let Some(slot) = ConnSlot::acquire(&services.connections) else {
        return error_response(StatusCode::TOO_MANY_REQUESTS, "too many connections");
    };
    let limit = services
        .cfg
        .max_frame_bytes
        .saturating_mul(2)
        .max(64 * 1024);
    let limits = ReadLimits {
        max_message_bytes: limit,
    };
    ws.accept(move |socket| {
        let tracker = sockets.tracker.clone();
        tracker.track_future(run(sockets, socket, limits, vsn, socket_auth, creds, slot))
    })
}

struct Conn {
    channels: Channels,
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
    socket: Upgraded,
    limits: ReadLimits,
    vsn: Vsn,
    auth: Verified,
    creds: Credentials,
    slot: ConnSlot,
) {
    let services = sockets.services.clone();
    let id = services.connections.next_id();
    let (handle, rx) = ConnHandle::new(id, services.cfg.outbound_queue);
    let (mut stream, sink) = socket::open(socket, handle.clone(), limits).await;
    let writer = tokio::spawn(writer::write_loop(sink, rx, handle.clone()));
    services.connections.opened(&handle, &auth.project);
    let mut conn = Conn {
        max_frame_bytes: services.cfg.max_frame_bytes,
        idle_timeout: services.cfg.idle_timeout,
        channels: Channels::new(services.clone(), handle.clone(), vsn, auth.project, creds),
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
            _ = handle.recheck.notified() => Box::pin(conn.channels.recheck_tokens()).await,
            msg = stream.next() => match msg {
                None => break,
                Some(Err(e)) => {
                    read_failed(&handle, &e);
                    break;
                }
                Some(Ok(Message::Close(_))) => {
                    // tungstenite made the answer (the client's code echoed); flushing
                    // queues it for the writer, which sends it instead of a Close of its own.
                    let _ = stream.flush().await;
                    handle.peer_closed();
                    break;
                }
                Some(Ok(m)) => {
                    conn.last_seen = Instant::now();
                    if !Box::pin(conn.on_message(m)).await {
                        break;
                    }
                }
            },
            done = conn.channels.pending.next(), if conn.channels.pending.is_running() => {
                Box::pin(conn.channels.done(done)).await;
            }
        }
    }
    // Stop the writer (it sends the close frame), then drop every channel.
    handle.kill.cancel();
    Box::pin(conn.channels.teardown()).await;
    services.connections.closed(&handle);
    let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
    drop(slot);
}

/// The client's frames could not be read: too large (1009), not WebSocket (1002), or the
/// socket failed (no Close can reach the client then, but the writer tries).
fn read_failed(handle: &ConnHandle, e: &WsError) {
    match e {
        WsError::Capacity(_) => {
            telemetry::limit("frame_size");
            handle.close_with(CLOSE_TOO_BIG, "frame too large");
        }
        WsError::ConnectionClosed | WsError::AlreadyClosed | WsError::Io(_) => {
            telemetry::error("socket_read");
            handle.kill.cancel();
        }
        _ => {
            telemetry::error("socket_read");
            handle.close_with(1002, "protocol error");
        }
    }
}

impl Conn {
    /// A client frame, counted for its project once the socket is one of its users.
    fn count_in(&self, len: usize) {
        if let Some(c) = self.channels.handle.usage() {
            c.messages_in
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            c.bytes_in
                .fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Returns false when the connection must close.
    async fn on_message(&mut self, m: Message) -> bool {
        let max = self.max_frame_bytes;
        let vsn = self.channels.vsn;
        let size = m.len();
        let frame = match m {
            Message::Text(t) => {
                metrics::counter!(telemetry::FRAMES_IN).increment(1);
                self.count_in(t.len());
                if t.len() > max {
                    return self.too_big(t.len());
                }
                let t = t.as_str();
                Frame::decode_text(t, vsn).map_err(|e| (salvage(t, vsn), e))
            }
            Message::Binary(b) => {
                metrics::counter!(telemetry::FRAMES_IN).increment(1);
                self.count_in(b.len());
                if b.len() > max {
                    return self.too_big(b.len());
                }
                Frame::decode_client_binary(&b, vsn).map_err(|e| (Salvage::default(), e))
            }
            // Answered in the read loop.
            Message::Close(_) => return false,
            Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => return true,
        };
        match frame {
            Ok(f) => self.channels.apply(f, size).await,
            Err((s, e)) => {
                telemetry::error("malformed_frame");
                let topic = s.topic.as_deref().unwrap_or(PHOENIX_TOPIC);
                let reply = server::reply_error(
                    s.join_ref.as_deref(),
                    s.ref_.as_deref(),
                    topic,
                    &server::error_reason("MalformedMessage", &e.to_string()),
                );
                self.channels.handle.push_frame(&reply, vsn);
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
        self.channels.handle.close_with(CLOSE_TOO_BIG, &reason);
        false
    }

    fn next_deadline(&self) -> Instant {
        self.channels.next_check(self.last_seen + self.idle_timeout)
    }

    /// Idle check and token expiry. Returns false when the connection must close.
    async fn on_timer(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.last_seen + self.idle_timeout {
            telemetry::error("idle_timeout");
            self.channels.handle.close_with(1000, "heartbeat timeout");
            return false;
        }
        self.channels.check_tokens(now).await;
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
