//! The relay's contract with the driver, against a real nats-server: `settle` answers
//! at once whatever JetStream does, with the commit of the last transaction whose every
//! event is acknowledged; `accepting` turns false past `max_queued`; once JetStream is
//! back every event lands once and `settle` reaches what was handed. And the publisher
//! under it: each of many answers on its one subscription names its event.

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

/// An event of project `default`, topic `t`, with `id`'s last digits and `pad` bytes.
fn event(id: u64, pad: usize) -> walcast_outbox::event::OutboxEvent {
    let content = format!(
        r#"{{"id":"00000000-0000-4000-8000-{id:012}","project":"default","topic":"t","key":"k","payload":{{"pad":"{}"}},"headers":null}}"#,
        "x".repeat(pad)
    );
    walcast_outbox::event::OutboxEvent::from_message(&content, Lsn(id), AT).expect("event")
}

/// The next answer, bounded.
async fn answer(
    p: &mut walcast_outbox::publish::Publisher,
) -> (u64, walcast_outbox::publish::Answer) {
    tokio::time::timeout(Duration::from_secs(10), p.next_answer())
        .await
        .expect("an answer in time")
        .expect("the subscription is open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_answer_on_the_one_subscription_names_its_event() {
    use walcast_outbox::publish::{Failure, Stored};
    let nats = Nats::start_with_max_payload(Some(64 * 1024)).expect("nats-server");
    let cfg = OutboxConfig::new("postgres://unused");
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let mut p = walcast_outbox::publish::Publisher::new(client.clone(), cfg);
    p.ensure_stream().await.expect("stream");

    // Three out at once (the third repeats the first's id): answered in turn, by token.
    let sent = [
        p.send(&event(1, 10)).await.expect("send"),
        p.send(&event(2, 10)).await.expect("send"),
        p.send(&event(1, 10)).await.expect("send"),
    ];
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(answer(&mut p).await);
    }
    got.sort_by_key(|(t, _)| *t);
    let stored = |duplicate| Ok(Stored { duplicate });
    assert_eq!(
        got,
        [
            (sent[0], stored(false)),
            (sent[1], stored(false)),
            (sent[2], stored(true))
        ]
    );

    // Over the server's max_payload: refused for good before anything is sent.
    match p.send(&event(3, 70 * 1024)).await {
        Err(Failure::Permanent { kind, .. }) => assert_eq!(kind, "too_large"),
        other => panic!("70 KB over a 64 KB max_payload: {other:?}"),
    }

    // Over the stream's message size: JetStream's error, permanent.
    let js = async_nats::jetstream::new(client);
    let mut info = js.get_stream("WALCAST_OUTBOX").await.expect("stream");
    let mut config = info.info().await.expect("info").config.clone();
    config.max_message_size = 1024;
    js.update_stream(config).await.expect("update");
    let token = p.send(&event(4, 4096)).await.expect("send");
    match answer(&mut p).await {
        (t, Err(Failure::Permanent { kind, .. })) if t == token => assert_eq!(kind, "too_large"),
        other => panic!("4 KB into a 1 KB stream: {other:?}"),
    }

    // No stream listens: NATS answers for it.
    js.delete_stream("WALCAST_OUTBOX").await.expect("delete");
    let token = p.send(&event(5, 10)).await.expect("send");
    match answer(&mut p).await {
        (t, Err(Failure::NoStream(_))) if t == token => {}
        other => panic!("no stream: {other:?}"),
    }
}
