//! Hostile frames against a real `walcast serve`, while a well-behaved client receives a
//! steady stream of changes: every hostile socket gets the right error reply or close
//! reason, and the well-behaved client receives every change, in order, without a gap.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::ws::anon;
use crate::support::{Stack, Worker};
use serde_json::{json, Value};
use walcast_testkit::phoenix::{pg_config, Msg, PhoenixClient};

const MAX_FRAME: usize = 64 * 1024;
const MIN_ROWS: i64 = 300;

fn reason(f: &Value) -> &str {
    assert_eq!(f[3], "phx_reply", "{f}");
    assert_eq!(f[4]["status"], "error", "{f}");
    f[4]["response"]["reason"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_sockets_get_errors_and_a_good_client_misses_nothing() {
    let _machine = crate::support::alone().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE t (id int8 PRIMARY KEY, n int8 NOT NULL, note text)");
    stack.sql("CREATE TABLE not_enabled (id int8 PRIMARY KEY)");
    stack.sql("CREATE TABLE quiet (id int8 PRIMARY KEY)");
    stack.enable("t");
    stack.enable("quiet");
    let mut server = Worker::serve(
        &stack.pg.url(),
        &[("MAX_FRAME_BYTES", &MAX_FRAME.to_string())],
    );
    server.wait_active(Duration::from_secs(60));
    let url = server.ws_url(&anon());
    let t_all = json!([{"event": "*", "schema": "public", "table": "t"}]);

    // The well-behaved client and a steady writer (a row every 2 ms, until told to stop
    // and at least MIN_ROWS written).
    let mut good = PhoenixClient::connect(&url).await;
    good.join_subscribed("realtime:good", t_all.clone()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let pg = stack.pg.connect().await.expect("connect");
        tokio::spawn(async move {
            let mut n = 0i64;
            while !stop.load(Ordering::Relaxed) || n < MIN_ROWS {
                pg.execute("INSERT INTO t VALUES ($1, $1, 'steady')", &[&n])
                    .await
                    .expect("insert");
                n += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            n
        })
    };
    let (want_tx, mut want_rx) = tokio::sync::oneshot::channel::<usize>();
    let reader = tokio::spawn(async move {
        let mut got: Vec<i64> = Vec::new();
        let mut want: Option<usize> = None;
        while want.is_none_or(|w| got.len() < w) {
            tokio::select! {
                w = &mut want_rx, if want.is_none() => want = Some(w.expect("row count")),
                f = good.recv_frame() => {
                    assert_eq!(f[2], "realtime:good", "{f}");
                    assert_eq!(f[3], "postgres_changes", "the good client got {f}");
                    got.push(f[4]["data"]["record"]["n"].as_i64().expect("n"));
                }
            }
        }
        (good, got)
    });

    // 1. Invalid JSON: an error reply on `phoenix`, and the socket lives on.
    let mut c = PhoenixClient::connect(&url).await;
    c.send_text("{not json").await;
    let f = c.recv_frame().await;
    assert_eq!(f[2], "phoenix", "{f}");
    assert!(reason(&f).starts_with("MalformedMessage: "), "{f}");
    // Valid JSON, wrong shape, refs recoverable: the reply carries them.
    c.send_text(r#"["7","8","realtime:x","phx_join"]"#).await;
    let f = c.recv_frame().await;
    assert_eq!(
        (&f[0], &f[1], &f[2]),
        (&json!("7"), &json!("8"), &json!("realtime:x"))
    );
    assert!(reason(&f).starts_with("MalformedMessage: "), "{f}");
    c.heartbeat_ok().await;

    // 2. Unknown events: on a topic not joined, and on a joined one.
    c.send(
        None,
        Some("20"),
        "realtime:nowhere",
        "bogus_event",
        json!({}),
    )
    .await;
    assert_eq!(reason(&c.reply_to("20").await), "unmatched topic");
    let (jr, reply) = c.join("realtime:plain", json!({}), None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    c.send(
        Some(&jr),
        Some("21"),
        "realtime:plain",
        "bogus_event",
        json!({}),
    )
    .await;
    assert_eq!(
        reason(&c.reply_to("21").await),
        "UnknownEvent: unknown event `bogus_event`"
    );
    c.heartbeat_ok().await;

    // 3. Binary garbage: not kind 3, and a truncated kind 3.
    c.send_binary(vec![0xff, 0, 1, 2]).await;
    assert!(reason(&c.recv_frame().await).starts_with("MalformedMessage"));
    c.send_binary(vec![3, 10, 10]).await;
    assert!(reason(&c.recv_frame().await).starts_with("MalformedMessage"));
    c.heartbeat_ok().await;

    // 4. Joins the worker refuses: bad filter syntax, unknown column, a value that does
    //    not cast, a table not enabled, a table that does not exist. The join itself is
    //    ok (as with Supabase) and a `system` error says why; nothing is delivered.
    let refusals = [
        ("n=zz.1", "t", "Error parsing `filter` params"),
        ("nope=eq.1", "t", "nope"),
        ("n=eq.notanumber", "t", "Error parsing `filter` params"),
        (
            "",
            "not_enabled",
            "Unable to subscribe to changes with given parameters",
        ),
        (
            "",
            "no_such_table",
            "Unable to subscribe to changes with given parameters",
        ),
    ];
    for (i, (filter, table, expect)) in refusals.iter().enumerate() {
        let topic = format!("realtime:refused{i}");
        let mut b = json!({"event": "*", "schema": "public", "table": table});
        if !filter.is_empty() {
            b["filter"] = json!(filter);
        }
        let (_, reply) = c.join(&topic, pg_config(json!([b])), None).await;
        assert_eq!(reply[4]["status"], "ok", "{reply}");
        let sys = c.recv_frame().await;
        assert_eq!(
            (sys[2].as_str(), sys[3].as_str()),
            (Some(topic.as_str()), Some("system")),
            "{sys}"
        );
        assert_eq!(sys[4]["status"], "error", "{sys}");
        let msg = sys[4]["message"].as_str().unwrap_or("");
        assert!(msg.contains(expect), "{table} {filter}: {msg}");
    }
    // A malformed join config.
    c.send(
        Some("30"),
        Some("30"),
        "realtime:bad",
        "phx_join",
        json!({"config": {"postgres_changes": [{"schema": 1}]}}),
    )
    .await;
    assert!(reason(&c.reply_to("30").await).starts_with("InvalidJoinPayload: "));
    // The empty topic.
    c.send(
        Some("31"),
        Some("31"),
        "realtime:",
        "phx_join",
        json!({"config": {}}),
    )
    .await;
    assert!(reason(&c.reply_to("31").await).starts_with("TopicNameRequired"));
    // None of the refused channels got a change, and the socket still works.
    c.heartbeat_ok().await;

    // 5. Oversized frames: closed with 1009.
    let mut big = PhoenixClient::connect(&url).await;
    let pad = "x".repeat(MAX_FRAME + 1024);
    big.send(
        None,
        Some("1"),
        "phoenix",
        "heartbeat",
        json!({ "pad": pad }),
    )
    .await;
    match big.recv().await {
        Msg::Close(code, why) => {
            assert_eq!(code, 1009, "{why}");
            assert!(why.starts_with("frame too large"), "{why}");
        }
        m => panic!("expected a 1009 close, got {m:?}"),
    }
    let mut huge = PhoenixClient::connect(&url).await;
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        use futures_util::SinkExt;
        let msg = tokio_tungstenite::tungstenite::Message::Binary(vec![3u8; 4 * MAX_FRAME].into());
        let _ = huge.ws.send(msg).await;
    })
    .await;
    match huge.recv().await {
        Msg::Close(code, why) => assert_eq!(code, 1009, "{why}"),
        // The server may stop reading and close before our write completes.
        Msg::Ended(e) => println!("oversized binary: stream ended: {e}"),
        m => panic!("expected a 1009 close, got {m:?}"),
    }

    // 6. 1,000 joins on one socket: 100 channels (MAX_CHANNELS_PER_SOCKET), the rest
    //    refused by the channel limit or the join rate limit; every join answered. (On a
    //    table nobody writes: 100 channels of the steady stream on a socket that is busy
    //    sending would, rightly, be closed as a slow consumer.)
    let quiet = json!([{"event": "*", "schema": "public", "table": "quiet"}]);
    let mut many = PhoenixClient::connect(&url).await;
    let (mut ok, mut channels, mut rate, mut replies) = (0, 0, 0, 0);
    let mut sent = 0;
    while replies < 1000 {
        // Send in steps of 50 joins and read between them: joins of a class the front
        // already delivers are answered at once, and a client that sent all 1,000 before
        // reading 1,100 replies would, rightly, be a slow consumer.
        if sent < 1000 && sent <= replies + 50 {
            for i in sent..(sent + 50).min(1000) {
                let r = format!("j{i}");
                many.send(
                    Some(&r),
                    Some(&r),
                    &format!("realtime:room{i}"),
                    "phx_join",
                    json!({ "config": pg_config(quiet.clone()) }),
                )
                .await;
            }
            sent = (sent + 50).min(1000);
        }
        let f = many.recv_frame().await;
        match f[3].as_str() {
            Some("phx_reply") => {
                replies += 1;
                if f[4]["status"] == "ok" {
                    ok += 1;
                } else {
                    let why = reason(&f);
                    if why.starts_with("ChannelRateLimitReached") {
                        channels += 1;
                    } else if why.starts_with("ClientJoinRateLimitReached") {
                        rate += 1;
                    } else {
                        panic!("unexpected join error {f}");
                    }
                }
            }
            Some("system") => assert_eq!(f[4]["status"], "ok", "{f}"),
            _ => panic!("unexpected {f}"),
        }
    }
    println!(
        "1000 joins: {ok} ok, {channels} ChannelRateLimitReached, {rate} ClientJoinRateLimitReached"
    );
    assert_eq!(ok, 100);
    assert!(channels > 0 && rate > 0, "{channels} {rate}");
    let health = server.health().expect("health");
    assert!(
        health["front"]["channels"].as_u64() >= Some(101),
        "{health}"
    );
    drop(many);

    // Stop writing; the good client must get every row, in order, exactly once.
    stop.store(true, Ordering::Relaxed);
    let rows = writer.await.expect("writer") as usize;
    want_tx.send(rows).expect("reader alive");
    let (mut good, got) = tokio::time::timeout(Duration::from_secs(60), reader)
        .await
        .expect("the good client did not receive every change within 60 s")
        .expect("reader");
    let expected: Vec<i64> = (0..rows as i64).collect();
    assert_eq!(got, expected, "gap, duplicate or reorder");
    assert!(
        rows > 100,
        "only {rows} rows written during the hostile phase"
    );
    good.heartbeat_ok().await;
    println!("the good client received all {rows} changes in order");
    let errors = server.get("/metrics").unwrap_or_default();
    assert!(
        errors.contains("walcast_front_errors_total{kind=\"malformed_frame\"}"),
        "malformed frames not counted"
    );
}
