//! Shared pieces of the inbox tests: a real Postgres and nats-server (JetStream), the
//! relay's message format, a handler whose side effect is a row, and the outcomes of
//! every delivery as a channel.

#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishAckFuture, publish::PublishAck};
use async_nats::HeaderMap;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Transaction};
use tokio_util::sync::CancellationToken;
use walcast_inbox::{
    headers, ConsumerConfig, Event, Handler, HandlerError, Inbox, InboxConsumer, InboxError,
    Outcome, SettleHook,
};
use walcast_testkit::{Nats, Postgres};

/// Await `fut` for at most `secs` seconds, panicking with what was awaited.
pub async fn within<T>(secs: u64, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {secs} s waiting for {what}"),
    }
}

/// A Postgres with the inbox and the side-effect table, a nats-server with the relay's
/// stream.
pub struct Env {
    pub pg: Postgres,
    pub nats: Nats,
    pub js: jetstream::Context,
    pub db: Client,
}

impl Env {
    /// Start both servers; the stream keeps duplicates out for `duplicate_window`.
    pub async fn start(duplicate_window: Duration) -> Env {
        // The consumer's logs with the test's output (RUST_LOG, default warnings).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn".into()),
            )
            .with_test_writer()
            .try_init();
        let pg = Postgres::start().expect("postgres");
        let nats = Nats::start().expect("nats-server");
        let client = async_nats::connect(nats.url()).await.expect("nats connect");
        let js = jetstream::new(client);
        js.create_stream(jetstream::stream::Config {
            name: walcast_inbox::DEFAULT_STREAM.into(),
            subjects: vec![walcast_inbox::DEFAULT_FILTER_SUBJECT.into()],
            duplicate_window,
            ..Default::default()
        })
        .await
        .expect("create stream");
        let db = pg.connect().await.expect("postgres connect");
        Inbox::default().migrate(&db).await.expect("migrate");
        db.batch_execute(
            "CREATE TABLE effects (
                 seq bigserial PRIMARY KEY,
                 event_id uuid NOT NULL,
                 key text,
                 n int NOT NULL,
                 delivered int NOT NULL
             )",
        )
        .await
        .expect("effects table");
        Env { pg, nats, js, db }
    }

    /// A consumer on its own Postgres and NATS connections (a process of its own),
    /// running until cancelled or aborted.
    pub async fn spawn(
        &self,
        config: ConsumerConfig,
        handler: Effects,
        hook: SettleHook,
    ) -> (JoinHandle<Result<(), InboxError>>, CancellationToken) {
        self.spawn_with(config, handler, hook, CancellationToken::new())
            .await
    }

    /// [`Env::spawn`], stopped by `cancel`.
    pub async fn spawn_with(
        &self,
        config: ConsumerConfig,
        handler: Effects,
        hook: SettleHook,
        cancel: CancellationToken,
    ) -> (JoinHandle<Result<(), InboxError>>, CancellationToken) {
        let db = self.pg.connect().await.expect("postgres connect");
        let nats = async_nats::connect(self.nats.url())
            .await
            .expect("nats connect");
        let js = jetstream::new(nats);
        let mut consumer = InboxConsumer::bind(&js, db, &Inbox::default(), config)
            .await
            .expect("bind")
            .before_settle(hook);
        let stop = cancel.clone();
        let task = tokio::spawn(async move { consumer.run(&handler, &stop).await });
        (task, cancel)
    }

    /// Every side effect: (event id, key, n, delivered) in the order they were written.
    pub async fn effects(&self) -> Vec<(String, Option<String>, i32, i32)> {
        self.db
            .query(
                "SELECT event_id::text, key, n, delivered FROM effects ORDER BY seq",
                &[],
            )
            .await
            .expect("effects")
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect()
    }

    /// How many side effects each event id has.
    pub async fn effect_counts(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for (id, ..) in self.effects().await {
            *counts.entry(id).or_default() += 1;
        }
        counts
    }

    /// The inbox rows of `consumer`.
    pub async fn inbox_ids(&self, consumer: &str) -> Vec<String> {
        self.db
            .query(
                "SELECT event_id::text FROM walcast_inbox WHERE consumer_name = $1",
                &[&consumer],
            )
            .await
            .expect("inbox")
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// JetStream's view of the durable: (unacked deliveries, messages not yet delivered).
    pub async fn pending(&self, durable: &str) -> (usize, u64) {
        let stream = self
            .js
            .get_stream(walcast_inbox::DEFAULT_STREAM)
            .await
            .expect("stream");
        let info = stream.consumer_info(durable).await.expect("consumer info");
        (info.num_ack_pending, info.num_pending)
    }
}

/// A fresh random-looking UUID (v4 layout) from a counter and the process id.
pub fn new_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        nanos,
        std::process::id() & 0xffff,
        (n >> 12) & 0xfff,
        n & 0xfff,
        n
    )
}

/// The headers the relay sets for event `id` with `key` (`Nats-Msg-Id` = event id).
pub fn relay_headers(id: &str, key: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(headers::NATS_MSG_ID, id);
    h.insert(headers::EVENT_ID, id);
    h.insert(headers::KEY, key);
    h.insert(headers::COMMIT_LSN, "0/16B3748");
    h.insert(headers::PROJECT, "shop");
    h.insert(headers::TOPIC, "orders.created");
    h.insert("X-User-Header", "kept");
    h
}

/// Publish one message on the relay's subject; returns JetStream's ack.
pub async fn publish(js: &jetstream::Context, headers: HeaderMap, n: i32) -> PublishAck {
    let ack: PublishAckFuture = js
        .publish_with_headers(
            "walcast.outbox.shop.orders.created",
            headers,
            format!("{{\"n\":{n}}}").into(),
        )
        .await
        .expect("publish");
    ack.await.expect("publish ack")
}

/// Publish event `n` with a fresh id and `key`, as the relay does; returns the id.
pub async fn publish_event(js: &jetstream::Context, key: &str, n: i32) -> String {
    let id = new_id();
    let ack = publish(js, relay_headers(&id, key), n).await;
    assert!(!ack.duplicate, "a fresh id is not a duplicate");
    id
}

/// The handler: writes one `effects` row (the side effect) through the transaction,
/// then fails if told to for this event and delivery.
#[derive(Clone, Default)]
pub struct Effects {
    /// Event id → deliveries (1, 2, …) up to which the handler fails after writing.
    pub fail_until: Arc<Mutex<HashMap<String, i64>>>,
}

impl Effects {
    pub fn failing(fail_until: &[(&str, i64)]) -> Effects {
        let map = fail_until
            .iter()
            .map(|(id, n)| (id.to_string(), *n))
            .collect();
        Effects {
            fail_until: Arc::new(Mutex::new(map)),
        }
    }
}

#[derive(serde::Deserialize)]
struct Payload {
    n: i32,
}

impl Handler for Effects {
    async fn handle(&self, tx: &mut Transaction<'_>, event: &Event) -> Result<(), HandlerError> {
        assert_eq!(event.header("X-User-Header"), Some("kept"));
        let payload: Payload = event.json()?;
        tx.execute(
            "INSERT INTO effects (event_id, key, n, delivered) VALUES ($1::text::uuid, $2, $3, $4)",
            &[
                &event.id.to_string(),
                &event.key,
                &payload.n,
                &(event.delivered as i32),
            ],
        )
        .await?;
        let limit = self
            .fail_until
            .lock()
            .unwrap()
            .get(&event.id.to_string())
            .copied();
        match limit {
            Some(limit) if event.delivered <= limit => {
                Err(format!("injected failure on delivery {}", event.delivered).into())
            }
            _ => Ok(()),
        }
    }
}

/// One settled delivery as the hook saw it: (event id, payload n, delivered, outcome).
pub type Seen = (String, i32, i64, Outcome);

/// A hook reporting every outcome on a channel.
pub fn report() -> (SettleHook, mpsc::UnboundedReceiver<Seen>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let hook: SettleHook = Arc::new(move |event: &Event, outcome: &Outcome| {
        let n = event.json::<Payload>().map(|p| p.n).unwrap_or(-1);
        let _ = tx.send((event.id.to_string(), n, event.delivered, *outcome));
        Box::pin(async {})
    });
    (hook, rx)
}

/// Receive outcomes until `done` says the collected ones are enough.
pub async fn collect_until(
    rx: &mut mpsc::UnboundedReceiver<Seen>,
    secs: u64,
    what: &str,
    done: impl Fn(&[Seen]) -> bool,
) -> Vec<Seen> {
    let mut seen = Vec::new();
    within(secs, what, async {
        while !done(&seen) {
            seen.push(rx.recv().await.expect("consumer ended"));
        }
    })
    .await;
    seen
}

/// A config for tests: short ack wait (a killed consumer's events come back after it)
/// and retries, small batches.
pub fn test_config(durable: &str) -> ConsumerConfig {
    let mut c = ConsumerConfig::new(durable);
    c.ack_wait = Duration::from_secs(2);
    c.batch_size = 5;
    c.fetch_wait = Duration::from_millis(500);
    c.retry_base = Duration::from_millis(50);
    c.retry_max = Duration::from_millis(400);
    c
}

/// Cancel a consumer and wait for `run` to return `Ok`.
pub async fn stop(task: JoinHandle<Result<(), InboxError>>, cancel: CancellationToken) {
    cancel.cancel();
    within(10, "the consumer to stop after cancel", task)
        .await
        .expect("consumer task")
        .expect("run returns Ok on cancel");
}
