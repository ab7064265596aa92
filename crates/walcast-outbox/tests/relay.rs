//! The relay's contract with the driver, against a real nats-server: `settle` answers
//! at once whatever JetStream does, with the commit of the last transaction whose every
//! event is acknowledged; `accepting` turns false past `max_queued`; once JetStream is
//! back every event lands once and `settle` reaches what was handed.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use walcast_outbox::{OutboxConfig, OutboxHealth, Relay};
use walcast_pipeline::{Consumer, Item, PipelineHealth, TxnContext};
use walcast_testkit::Nats;
use walcast_wal2json::{Change, Lsn, Message};

const AT: &str = "2026-12-01T00:00:00.000Z";

/// Hand the relay one transaction committed at `lsn` with one `walcast.emit` event.
async fn txn(relay: &mut Relay, lsn: u64) {
    let ctx = TxnContext {
        xid: Some(lsn as u32),
        commit_lsn: Lsn(lsn),
        commit_timestamp: AT.into(),
    };
    let content = format!(
        r#"{{"id":"00000000-0000-4000-8000-{lsn:012}","project":"default","topic":"t","key":"k","payload":{{"n":{lsn}}},"headers":null}}"#
    );
    let message = Change::Message(Message {
        xid: ctx.xid,
        timestamp: None,
        lsn: Some(Lsn(lsn - 1)),
        transactional: true,
        prefix: Cow::Borrowed(walcast_outbox::event::MESSAGE_PREFIX),
        content: Cow::Owned(content),
    });
    relay.handle(Item::Begin(&ctx)).await.expect("begin");
    relay
        .handle(Item::Change(&ctx, &message))
        .await
        .expect("change");
    relay.handle(Item::Commit(&ctx)).await.expect("commit");
}

/// `settle(handed)`, which must answer at once.
async fn settle(relay: &mut Relay, handed: u64) -> Lsn {
    let started = Instant::now();
    let at = relay.settle(Lsn(handed)).await.expect("settle");
    let took = started.elapsed();
    assert!(took < Duration::from_millis(100), "settle took {took:?}");
    at
}

/// Settle until the relay is durable at `want` (bounded).
async fn settled_at(relay: &mut Relay, handed: u64, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let at = settle(relay, handed).await;
        if at == Lsn(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "settled at {at}, {want:X} expected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_never_waits_on_jetstream_and_every_event_lands_once() {
    let mut nats = Nats::start().expect("nats-server");
    let mut cfg = OutboxConfig::new("postgres://unused");
    cfg.ack_timeout = Duration::from_millis(500);
    cfg.retry.cap = Duration::from_millis(200);
    cfg.max_queued = 3;
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let publisher = walcast_outbox::publish::Publisher::new(client, cfg.clone());
    let health = Arc::new(PipelineHealth::new("slot"));
    let mut relay = Relay::new(cfg, publisher, Arc::new(OutboxHealth::new()), health);

    txn(&mut relay, 100).await;
    settled_at(&mut relay, 100, 100).await;

    // JetStream gone: the relay holds the events, answers at once, and stays at 100.
    nats.stop();
    txn(&mut relay, 200).await;
    assert!(relay.accepting(), "two outstanding of three");
    txn(&mut relay, 300).await;
    txn(&mut relay, 400).await;
    assert!(!relay.accepting(), "three outstanding: full");
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        assert_eq!(settle(&mut relay, 450).await, Lsn(100));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    nats.restart().expect("restart nats-server");
    settled_at(&mut relay, 450, 450).await;
    assert!(relay.accepting());
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream("WALCAST_OUTBOX").await.expect("stream");
    let info = stream.info().await.expect("info");
    assert_eq!(info.state.messages, 4, "every event once");
}
