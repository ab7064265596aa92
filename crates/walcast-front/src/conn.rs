//! One WebSocket connection: the read loop, the writer task and frame decoding.
//!
//! The read loop owns the connection's channels and handles client frames one at a time
//! (see [`crate::channel`]). Everything for the client — replies and fan-out alike — goes
//! through the connection's bounded queue to the writer task, which batches writes and
//! closes the socket with the recorded close code when the connection is killed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::stream::SplitSink;
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;
use walcast_protocol::message::PHOENIX_TOPIC;
use walcast_protocol::{server, Frame, Vsn};

use crate::auth::Verified;
use crate::channel::Channel;
use crate::credentials::Credentials;
use crate::limits::{ConnSlot, TokenBucket};
use crate::outbound::{ConnHandle, Out};
use crate::state::Shared;
use crate::telemetry;

/// Close code: server going away (shutdown).
pub const CLOSE_GOING_AWAY: u16 = 1001;
/// Close code: a frame over `max_frame_bytes`.
pub const CLOSE_TOO_BIG: u16 = 1009;

pub(crate) struct Conn {
    pub shared: Arc<Shared>,
    pub handle: Arc<ConnHandle>,
    pub vsn: Vsn,
    pub project: String,
    /// The upgrade request's credentials (a join without its own token acts with them).
    pub creds: Credentials,
    pub channels: HashMap<String, Channel>,
    pub joins: TokenBucket,
    /// Presence track/untrack events of this socket (see [`crate::presence`]).
    pub presence_events: TokenBucket,
    pub last_seen: Instant,
}

pub(crate) async fn run(
    shared: Arc<Shared>,
    socket: WebSocket,
    vsn: Vsn,
    auth: Verified,
    creds: Credentials,
    slot: ConnSlot,
) {
    let (sink, mut stream) = socket.split();
    let (handle, rx) = ConnHandle::new(shared.next_id(), shared.cfg.outbound_queue);
    let writer = tokio::spawn(write_loop(sink, rx, handle.clone()));
    shared.conns().insert(handle.id, handle.clone());
    let mut conn = Conn {
        joins: TokenBucket::new(shared.cfg.join_burst, shared.cfg.joins_per_second),
        presence_events: TokenBucket::new(
            crate::presence::EVENTS_BURST,
            crate::presence::EVENTS_PER_SECOND,
        ),
        shared: shared.clone(),
        handle: handle.clone(),
        vsn,
        project: auth.project,
        creds,
        channels: HashMap::new(),
        last_seen: Instant::now(),
    };
    loop {
        let deadline = conn.next_deadline();
        tokio::select! {
            _ = handle.kill.cancelled() => break,
            _ = shared.cancel.cancelled() => {
                handle.close_with(CLOSE_GOING_AWAY, "server shutting down");
                break;
            }
            _ = tokio::time::sleep_until(deadline) => {
                if !conn.on_timer().await {
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
                    if !conn.on_message(m).await {
                        break;
                    }
                }
            }
        }
    }
    // Stop the writer (it sends the close frame), then drop every channel.
    handle.kill.cancel();
    conn.teardown().await;
    shared.conns().remove(&handle.id);
    let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
    drop(slot);
}

impl Conn {
    /// Returns false when the connection must close.
    async fn on_message(&mut self, m: Message) -> bool {
        let max = self.shared.cfg.max_frame_bytes;
        let frame = match m {
            Message::Text(t) => {
                metrics::counter!(telemetry::FRAMES_IN).increment(1);
                if t.len() > max {
                    return self.too_big(t.len());
                }
                Frame::decode_text(&t, self.vsn).map_err(|e| (salvage(&t, self.vsn), e))
            }
            Message::Binary(b) => {
                metrics::counter!(telemetry::FRAMES_IN).increment(1);
                if b.len() > max {
                    return self.too_big(b.len());
                }
                Frame::decode_client_binary(&b, self.vsn).map_err(|e| (Salvage::default(), e))
            }
            Message::Close(_) => return false,
            Message::Ping(_) | Message::Pong(_) => return true,
        };
        match frame {
            Ok(f) => self.on_frame(f).await,
            Err((s, e)) => {
                telemetry::error("malformed_frame");
                let topic = s.topic.as_deref().unwrap_or(PHOENIX_TOPIC);
                let reply = server::reply_error(
                    s.join_ref.as_deref(),
                    s.ref_.as_deref(),
                    topic,
                    &server::error_reason("MalformedMessage", &e.to_string()),
                );
                self.handle.push_frame(&reply, self.vsn);
            }
        }
        true
    }

    fn too_big(&self, len: usize) -> bool {
        telemetry::limit("frame_size");
        let reason = format!(
            "frame too large: {len} bytes (max {})",
            self.shared.cfg.max_frame_bytes
        );
        self.handle.close_with(CLOSE_TOO_BIG, &reason);
        false
    }

    fn next_deadline(&self) -> Instant {
        let idle = self.last_seen + self.shared.cfg.idle_timeout;
        self.channels
            .values()
            .map(|c| c.check_at)
            .fold(idle, Instant::min)
    }

    /// Idle check and token expiry. Returns false when the connection must close.
    async fn on_timer(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.last_seen + self.shared.cfg.idle_timeout {
            telemetry::error("idle_timeout");
            self.handle.close_with(1000, "heartbeat timeout");
            return false;
        }
        self.check_tokens(now).await;
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
    // Flush what is already queued unless this is a slow consumer, then close.
    let (code, reason) = handle.close_reason().unwrap_or((1000, String::new()));
    let close = async {
        if code != crate::outbound::CLOSE_SLOW_CONSUMER {
            while let Ok(m) = rx.try_recv() {
                sink.feed(to_message(m)).await?;
            }
        }
        sink.send(Message::Close(Some(CloseFrame {
            code,
            reason: reason.into(),
        })))
        .await
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), close).await;
}
