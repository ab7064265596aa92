//! A raw Phoenix (vsn 2.0.0) WebSocket client for end-to-end tests against `walcast serve`.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// `JWT_SECRET` of the servers the tests start.
pub const SECRET: &str = "e2e-secret-with-enough-bytes-0123456789";
/// Bound of every single wait for a message.
pub const TIMEOUT: Duration = Duration::from_secs(20);

pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

/// An HS256 token signed with [`SECRET`].
pub fn token(claims: Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .expect("sign jwt")
}

/// An `anon` token valid for an hour.
pub fn anon() -> String {
    token(json!({"role": "anon", "exp": now() + 3600}))
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
    /// `[join_ref, ref, topic, event, payload]`.
    Frame(Value),
    Binary(Vec<u8>),
    /// A close frame: code and reason.
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
        self.frame()[3].as_str().unwrap_or("")
    }
    pub fn payload(&self) -> &Value {
        &self.frame()[4]
    }
}

pub struct Ws {
    pub ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    next_ref: u64,
}

impl Ws {
    pub async fn connect(url: &str) -> Ws {
        let (ws, _) = tokio::time::timeout(TIMEOUT, tokio_tungstenite::connect_async(url))
            .await
            .expect("connect timed out")
            .unwrap_or_else(|e| panic!("connect {url}: {e}"));
        Ws { ws, next_ref: 0 }
    }

    /// Connect with a small socket receive buffer (set before connecting, so the TCP
    /// window stays small) and a small WebSocket read buffer: a client that stops reading
    /// then holds as little as possible.
    pub async fn connect_small(url: &str, port: u16, rcvbuf: u32) -> Ws {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        sock.set_recv_buffer_size(rcvbuf).expect("SO_RCVBUF");
        let stream = sock
            .connect(([127, 0, 0, 1], port).into())
            .await
            .expect("tcp connect");
        let cfg = WebSocketConfig::default().read_buffer_size(4096);
        let (ws, _) = tokio::time::timeout(
            TIMEOUT,
            tokio_tungstenite::client_async_with_config(
                url,
                MaybeTlsStream::Plain(stream),
                Some(cfg),
            ),
        )
        .await
        .expect("handshake timed out")
        .expect("handshake");
        Ws { ws, next_ref: 0 }
    }

    pub fn next_ref(&mut self) -> String {
        self.next_ref += 1;
        self.next_ref.to_string()
    }

    pub async fn send(
        &mut self,
        join_ref: Option<&str>,
        r: Option<&str>,
        topic: &str,
        event: &str,
        payload: Value,
    ) {
        let text = json!([join_ref, r, topic, event, payload]).to_string();
        self.send_text(&text).await;
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

    /// The next message within `d` (pings skipped), `None` on timeout.
    pub async fn try_recv(&mut self, d: Duration) -> Option<Msg> {
        tokio::time::timeout(d, self.next_msg()).await.ok()
    }

    /// The next message, or panic after [`TIMEOUT`].
    pub async fn recv(&mut self) -> Msg {
        self.try_recv(TIMEOUT)
            .await
            .unwrap_or_else(|| panic!("no message within {TIMEOUT:?}"))
    }

    /// The next text frame; panics on a close or the end of the stream.
    pub async fn recv_frame(&mut self) -> Value {
        match self.recv().await {
            Msg::Frame(v) => v,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    async fn next_msg(&mut self) -> Msg {
        loop {
            let m = match self.ws.next().await {
                None => return Msg::Ended("end of stream".into()),
                Some(Err(e)) => return Msg::Ended(e.to_string()),
                Some(Ok(m)) => m,
            };
            return match m {
                Message::Text(t) => Msg::Frame(
                    serde_json::from_str(&t).unwrap_or_else(|e| panic!("bad frame {e}: {t}")),
                ),
                Message::Binary(b) => Msg::Binary(b.to_vec()),
                Message::Close(Some(c)) => Msg::Close(c.code.into(), c.reason.to_string()),
                Message::Close(None) => Msg::Close(1005, String::new()),
                _ => continue,
            };
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

    /// Join `topic`; returns (join_ref, reply frame) after checking the reply's refs.
    pub async fn join(&mut self, topic: &str, config: Value) -> (String, Value) {
        let r = self.next_ref();
        self.send(
            Some(&r),
            Some(&r),
            topic,
            "phx_join",
            json!({ "config": config }),
        )
        .await;
        let f = self.recv_frame().await;
        assert_eq!(f[3], "phx_reply", "{f}");
        assert_eq!(f[0], json!(r), "{f}");
        assert_eq!(f[1], json!(r), "{f}");
        assert_eq!(f[2], topic, "{f}");
        (r, f)
    }

    /// Join and expect ok plus the `Subscribed to PostgreSQL` system message.
    pub async fn join_subscribed(&mut self, topic: &str, bindings: Value) -> String {
        let (jr, reply) = self.join(topic, pg_config(bindings)).await;
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

    /// Send a heartbeat and wait for its ok reply, skipping change frames meanwhile.
    pub async fn heartbeat_ok_skipping_changes(&mut self) {
        let r = self.next_ref();
        self.send(None, Some(&r), "phoenix", "heartbeat", json!({}))
            .await;
        let f = self.reply_to(&r).await;
        assert_eq!(f[4]["status"], "ok", "{f}");
    }
}
