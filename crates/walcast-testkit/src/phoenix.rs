//! A raw Phoenix (Supabase Realtime) WebSocket client for tests, speaking vsn `1.0.0`
//! (JSON objects) and `2.0.0` (JSON arrays plus binary frames).
//!
//! Frames are handled as `[join_ref, ref, topic, event, payload]` whatever the vsn: a
//! `1.0.0` object is normalised to that array when received and built from it when sent.
//! Every wait is bounded (by the client's timeout or an explicit duration) and panics
//! with what it was waiting for.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// Bound of each single wait (connect, next message) unless set with
/// [`PhoenixClient::with_timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);

/// The Phoenix serializer version a socket speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vsn {
    /// `1.0.0`: JSON object text frames.
    V1,
    /// `2.0.0`: JSON array text frames and binary broadcasts.
    V2,
}

impl Vsn {
    /// The `vsn` query parameter of a socket URL; `2.0.0` when absent, as the server has it.
    pub fn of_url(url: &str) -> Vsn {
        let vsn = url
            .split_once('?')
            .and_then(|(_, q)| q.split('&').find_map(|kv| kv.strip_prefix("vsn=")));
        match vsn {
            Some("1.0.0") => Vsn::V1,
            None | Some("2.0.0") => Vsn::V2,
            Some(other) => panic!("this client speaks vsn 1.0.0 and 2.0.0, not {other}"),
        }
    }
}

/// A join config as realtime-js sends it, with these `postgres_changes` bindings.
pub fn pg_config(bindings: Value) -> Value {
    json!({
        "broadcast": {"ack": false, "self": false},
        "presence": {"key": "", "enabled": false},
        "postgres_changes": bindings,
        "private": false
    })
}

/// One server message.
#[derive(Debug, Clone, PartialEq)]
pub enum Msg {
    /// A text frame as `[join_ref, ref, topic, event, payload]`, whatever the vsn.
    Frame(Value),
    Binary(Vec<u8>),
    /// A close frame: code and reason (1005 and no reason for a close without a status).
    Close(u16, String),
    /// The stream ended without a close frame (EOF or a socket error), with the error.
    Ended(String),
}

impl Msg {
    pub fn frame(&self) -> &Value {
        match self {
            Msg::Frame(v) => v,
            other => panic!("expected a text frame, got {other:?}"),
        }
    }

    pub fn event(&self) -> &str {
        let f = self.frame();
        f[3].as_str()
            .unwrap_or_else(|| panic!("frame without an event: {f}"))
    }

    pub fn payload(&self) -> &Value {
        &self.frame()[4]
    }
}

pub struct PhoenixClient {
    /// The socket itself, for what the protocol helpers do not do (raw or oversized
    /// messages, reading it elsewhere).
    pub ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    vsn: Vsn,
    timeout: Duration,
    next_ref: u64,
}

impl PhoenixClient {
    /// Connect to `url`, speaking the vsn its query asks for (see [`Vsn::of_url`]).
    pub async fn connect(url: &str) -> PhoenixClient {
        let (ws, _) = tokio::time::timeout(DEFAULT_TIMEOUT, tokio_tungstenite::connect_async(url))
            .await
            .unwrap_or_else(|_| panic!("connect {url}: no answer within {DEFAULT_TIMEOUT:?}"))
            .unwrap_or_else(|e| panic!("connect {url}: {e}"));
        PhoenixClient::new(ws, Vsn::of_url(url))
    }

    /// Connect to `url` on 127.0.0.1:`port` with a small socket receive buffer (set before
    /// connecting, so the TCP window stays small) and a small WebSocket read buffer: a
    /// client that stops reading then holds as little as possible.
    pub async fn connect_small(url: &str, port: u16, rcvbuf: u32) -> PhoenixClient {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        sock.set_recv_buffer_size(rcvbuf).expect("SO_RCVBUF");
        let stream = sock
            .connect(([127, 0, 0, 1], port).into())
            .await
            .expect("tcp connect");
        let cfg = WebSocketConfig::default().read_buffer_size(4096);
        let (ws, _) = tokio::time::timeout(
            DEFAULT_TIMEOUT,
            tokio_tungstenite::client_async_with_config(
                url,
                MaybeTlsStream::Plain(stream),
                Some(cfg),
            ),
        )
        .await
        .expect("handshake timed out")
        .expect("handshake");
        PhoenixClient::new(ws, Vsn::of_url(url))
    }

    fn new(ws: WebSocketStream<MaybeTlsStream<TcpStream>>, vsn: Vsn) -> PhoenixClient {
        PhoenixClient {
            ws,
            vsn,
            timeout: DEFAULT_TIMEOUT,
            next_ref: 0,
        }
    }

    /// Bound each later wait for a message by `timeout` instead of [`DEFAULT_TIMEOUT`].
    pub fn with_timeout(mut self, timeout: Duration) -> PhoenixClient {
        self.timeout = timeout;
        self
    }

    pub fn vsn(&self) -> Vsn {
        self.vsn
    }

    /// A fresh ref: "1", "2", …
    pub fn next_ref(&mut self) -> String {
        self.next_ref += 1;
        self.next_ref.to_string()
    }

    /// Send `[join_ref, ref, topic, event, payload]` in this client's vsn.
    pub async fn send(
        &mut self,
        join_ref: Option<&str>,
        r: Option<&str>,
        topic: &str,
        event: &str,
        payload: Value,
    ) {
        let text = match self.vsn {
            Vsn::V1 => json!({
                "topic": topic, "event": event, "payload": payload, "ref": r, "join_ref": join_ref
            }),
            Vsn::V2 => json!([join_ref, r, topic, event, payload]),
        };
        self.send_text(&text.to_string()).await;
    }

    pub async fn send_text(&mut self, text: &str) {
        self.ws
            .send(Message::Text(text.into()))
            .await
            .expect("send text");
    }

    pub async fn send_binary(&mut self, b: Vec<u8>) {
        self.ws
            .send(Message::Binary(b.into()))
            .await
            .expect("send binary");
    }

    /// The next message within `d` (pings skipped), `None` on timeout. The end of the
    /// stream is a message: [`Msg::Ended`].
    pub async fn try_recv(&mut self, d: Duration) -> Option<Msg> {
        tokio::time::timeout(d, self.next_msg()).await.ok()
    }

    /// The next message (a close or the end of the stream included), or panic after the
    /// client's timeout.
    pub async fn recv(&mut self) -> Msg {
        let d = self.timeout;
        self.try_recv(d)
            .await
            .unwrap_or_else(|| panic!("no message within {d:?}"))
    }

    /// The next text frame; panics on anything else (binary, close, end of stream).
    pub async fn recv_frame(&mut self) -> Value {
        match self.recv().await {
            Msg::Frame(v) => v,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    /// The next frame with `event`, skipping other frames and binary messages; panics on a
    /// close or the end of the stream. Each message is awaited for the client's timeout.
    pub async fn recv_event(&mut self, event: &str) -> Msg {
        loop {
            let m = self.recv().await;
            match &m {
                Msg::Frame(v) if v[3] == event => return m,
                Msg::Close(..) | Msg::Ended(_) => {
                    panic!("closed while waiting for {event}: {m:?}")
                }
                Msg::Frame(_) | Msg::Binary(_) => {}
            }
        }
    }

    /// The next frame with `event` whose payload satisfies `pred`, skipping other frames;
    /// panics on anything but a frame, or when none came within `within` in all.
    pub async fn wait_frame(
        &mut self,
        event: &str,
        within: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.try_recv(left).await {
                None => panic!("no {event} matching within {within:?}"),
                Some(Msg::Frame(f)) if f[3] == event && pred(&f[4]) => return f,
                Some(Msg::Frame(_)) => continue,
                Some(other) => panic!("socket ended while waiting for {event}: {other:?}"),
            }
        }
    }

    /// Panics if a frame, a binary message or a close arrives within `d`. The end of the
    /// stream without a close frame is not something arriving: it passes (tell it apart
    /// with [`try_recv`](Self::try_recv)).
    pub async fn assert_silent(&mut self, d: Duration) {
        match self.try_recv(d).await {
            None | Some(Msg::Ended(_)) => {}
            Some(m) => panic!("expected nothing within {d:?}, got {m:?}"),
        }
    }

    /// Skip frames until `topic` is shut as Supabase shuts a channel: a `system` error
    /// with `message`, then `phx_close`. Returns the `ok` replies seen on the way (pushes
    /// accepted before the shut). Panics on another `system` error for the topic, on a
    /// close or the end of the stream.
    pub async fn expect_shut(&mut self, topic: &str, message: &str) -> usize {
        let mut ok = 0;
        loop {
            let f = self.recv_frame().await;
            if f[2] != topic {
                continue;
            }
            match f[3].as_str() {
                Some("phx_reply") if f[4]["status"] == "ok" => ok += 1,
                Some("system") if f[4]["status"] == "error" => {
                    assert_eq!(f[4]["message"], message, "{f}");
                    let close = self.recv_frame().await;
                    assert_eq!(close[3], "phx_close", "{close}");
                    return ok;
                }
                _ => {}
            }
        }
    }

    /// Skip frames until the `phx_reply` with ref `r`; returns it. Fails on anything but
    /// frames (a close, the end of the stream).
    pub async fn reply_to(&mut self, r: &str) -> Value {
        loop {
            let f = self.recv_frame().await;
            if f[3] == "phx_reply" && f[1] == r {
                return f;
            }
        }
    }

    /// Join `topic` with `config` (and an `access_token` when given); returns (join_ref,
    /// reply frame) after checking that the next frame is the reply to this join.
    pub async fn join(
        &mut self,
        topic: &str,
        config: Value,
        token: Option<&str>,
    ) -> (String, Value) {
        let r = self.next_ref();
        let mut payload = json!({ "config": config });
        if let Some(t) = token {
            payload["access_token"] = json!(t);
        }
        self.send(Some(&r), Some(&r), topic, "phx_join", payload)
            .await;
        let f = self.recv_frame().await;
        assert_eq!(f[3], "phx_reply", "{f}");
        assert_eq!(f[0], json!(r), "{f}");
        assert_eq!(f[1], json!(r), "{f}");
        assert_eq!(f[2], topic, "{f}");
        (r, f)
    }

    /// Join with these `postgres_changes` bindings and expect ok plus the `Subscribed to
    /// PostgreSQL` system message; returns the join_ref.
    pub async fn join_subscribed(&mut self, topic: &str, bindings: Value) -> String {
        let (jr, reply) = self.join(topic, pg_config(bindings), None).await;
        assert_eq!(reply[4]["status"], "ok", "{reply}");
        let sys = self.recv_frame().await;
        assert_eq!(sys[3], "system", "{sys}");
        assert_eq!(sys[4]["status"], "ok", "{sys}");
        assert_eq!(sys[4]["message"], "Subscribed to PostgreSQL", "{sys}");
        jr
    }

    /// Send a heartbeat and expect its ok reply as the very next message.
    pub async fn heartbeat_ok(&mut self) {
        let r = self.next_ref();
        self.send(None, Some(&r), "phoenix", "heartbeat", json!({}))
            .await;
        let f = self.recv_frame().await;
        assert_eq!(
            f,
            json!([null, r, "phoenix", "phx_reply", {"status": "ok", "response": {}}])
        );
    }

    /// Send a heartbeat and wait for its ok reply, skipping other frames meanwhile.
    pub async fn heartbeat_ok_skipping_changes(&mut self) {
        let r = self.next_ref();
        self.send(None, Some(&r), "phoenix", "heartbeat", json!({}))
            .await;
        let f = self.reply_to(&r).await;
        assert_eq!(f[4]["status"], "ok", "{f}");
    }

    async fn next_msg(&mut self) -> Msg {
        loop {
            let m = match self.ws.next().await {
                None => return Msg::Ended("end of stream".into()),
                Some(Err(e)) => return Msg::Ended(e.to_string()),
                Some(Ok(m)) => m,
            };
            return match m {
                Message::Text(t) => Msg::Frame(self.decode(&t)),
                Message::Binary(b) => Msg::Binary(b.to_vec()),
                Message::Close(Some(c)) => Msg::Close(c.code.into(), c.reason.to_string()),
                Message::Close(None) => Msg::Close(1005, String::new()),
                _ => continue,
            };
        }
    }

    /// A text frame as `[join_ref, ref, topic, event, payload]`.
    fn decode(&self, text: &str) -> Value {
        let v: Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("bad frame {e}: {text}"));
        match self.vsn {
            Vsn::V1 => json!([
                v["join_ref"],
                v["ref"],
                v["topic"],
                v["event"],
                v["payload"]
            ]),
            Vsn::V2 => v,
        }
    }
}
