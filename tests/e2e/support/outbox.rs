//! The outbox relay's JetStream stream as the tests read it, and emitting events.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use walcast_testkit::Postgres;

/// The relay's stream (its default name).
pub const STREAM: &str = "WALCAST_OUTBOX";

/// One message of the outbox stream.
#[derive(Debug, Clone)]
pub struct Stored {
    /// Its sequence in the stream.
    pub seq: u64,
    pub subject: String,
    pub headers: HashMap<String, String>,
    pub payload: serde_json::Value,
    /// When JetStream stored it (just before its PubAck).
    pub stored_at: SystemTime,
}

impl Stored {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The payload's `n`, or -1.
    pub fn n(&self) -> i64 {
        self.payload["n"].as_i64().unwrap_or(-1)
    }

    /// `Walcast-Commit-Lsn` as a number (`X/Y` = X·2³² + Y).
    pub fn commit_lsn(&self) -> u64 {
        let lsn = self.header("Walcast-Commit-Lsn").unwrap_or_default();
        let (hi, lo) = lsn
            .split_once('/')
            .unwrap_or_else(|| panic!("no Walcast-Commit-Lsn on message {}: {lsn:?}", self.seq));
        let hex = |s: &str| u64::from_str_radix(s, 16).expect("hex LSN");
        (hex(hi) << 32) | hex(lo)
    }
}

/// The outbox stream, once the relay created it (bounded).
pub async fn outbox_stream(nats_url: &str, timeout: Duration) -> stream::Stream {
    let client = async_nats::connect(nats_url)
        .await
        .expect("connect to NATS");
    let js = jetstream::new(client);
    let deadline = Instant::now() + timeout;
    loop {
        match js.get_stream(STREAM).await {
            Ok(s) => return s,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("the outbox stream {STREAM} was not created within {timeout:?}: {e}"),
        }
    }
}

/// How many messages the stream holds.
pub async fn stored_count(stream: &mut stream::Stream) -> u64 {
    stream.info().await.expect("stream info").state.messages
}

/// Wait until the stream holds at least `n` messages, or fail saying how many it holds.
pub async fn wait_stored(stream: &mut stream::Stream, n: u64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let have = stored_count(stream).await;
        if have >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the outbox stream holds {have} messages, {n} expected within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every message of the stream, in stream order, once it holds at least `n` (bounded).
pub async fn stream_with(nats_url: &str, n: u64, timeout: Duration) -> Vec<Stored> {
    let mut stream = outbox_stream(nats_url, timeout).await;
    wait_stored(&mut stream, n, timeout).await;
    read_all(&mut stream).await
}

/// Every message the stream holds now, in stream order (an ordered consumer, bounded).
pub async fn read_all(stream: &mut stream::Stream) -> Vec<Stored> {
    let last = stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence;
    let mut out = Vec::new();
    if last == 0 {
        return out;
    }
    let reader = stream
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await
        .expect("ordered consumer");
    let mut messages = reader.messages().await.expect("consume");
    let timeout = Duration::from_secs(30);
    loop {
        let m = tokio::time::timeout(timeout, messages.next())
            .await
            .unwrap_or_else(|_| panic!("no message within {timeout:?} after {} read", out.len()))
            .expect("the consumer ended")
            .expect("message");
        let stored = stored(&m);
        let done = stored.seq >= last;
        out.push(stored);
        if done {
            return out;
        }
    }
}

fn stored(m: &jetstream::Message) -> Stored {
    let info = m.info().expect("message info");
    let nanos = u64::try_from(info.published.unix_timestamp_nanos()).expect("time after 1970");
    let headers = m
        .headers
        .iter()
        .flat_map(|h| h.iter())
        .map(|(k, v)| {
            let v = v.first().map(|v| v.to_string()).unwrap_or_default();
            (k.to_string(), v)
        })
        .collect();
    Stored {
        seq: info.stream_sequence,
        subject: m.subject.to_string(),
        headers,
        payload: serde_json::from_slice(&m.payload).expect("payload is JSON"),
        stored_at: UNIX_EPOCH + Duration::from_nanos(nanos),
    }
}

pub async fn client(pg: &Postgres) -> tokio_postgres::Client {
    walcast_pipeline::connect(&pg.url()).await.expect("connect")
}

/// `walcast.emit` in its own transaction; the event id.
pub async fn emit(c: &tokio_postgres::Client, topic: &str, key: &str, payload: &str) -> String {
    let row = c
        .query_one(
            "SELECT walcast.emit($1, $2, $3::text::jsonb)::text",
            &[&topic, &key, &payload],
        )
        .await
        .expect("walcast.emit");
    row.get(0)
}
