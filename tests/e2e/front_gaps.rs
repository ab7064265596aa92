//! A front's NATS link cut for a moment under load (no silent loss between the
//! leader and a front): a `ws-front` reaching NATS through a [`TcpProxy`], a second one
//! reaching it directly, a `cdc-worker`, a writer at 50 rows/s; the link is cut for 3 s,
//! restored, later cut for 1 s. The client of the cut front gets every row once and in
//! order (the leader resends what NATS dropped), or, when the leader no longer has it, a
//! `system` error on its channel: never silence. `/health` reports the disconnects.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::{Msg, PhoenixClient};
use walcast_testkit::TcpProxy;

use crate::support::ws::anon;
use crate::support::{Stack, Worker};

/// What a client saw: the ids of the rows, in arrival order, and the `system` messages
/// after the join.
#[derive(Default, Debug)]
struct Seen {
    rows: Vec<i64>,
    systems: Vec<Value>,
}

impl Seen {
    fn postgres_errors(&self) -> Vec<&Value> {
        self.systems
            .iter()
            .filter(|s| s["extension"] == "postgres_changes" && s["status"] == "error")
            .collect()
    }
}

/// Read `ws` until `rows` rows arrived (or a `postgres_changes` error did, with `stop_on_error`),
/// or `within` passed.
async fn read(mut ws: PhoenixClient, rows: usize, stop_on_error: bool, within: Duration) -> Seen {
    let deadline = Instant::now() + within;
    let mut seen = Seen::default();
    while seen.rows.len() < rows && (!stop_on_error || seen.postgres_errors().is_empty()) {
        let left = deadline.saturating_duration_since(Instant::now());
        match ws.try_recv(left.min(Duration::from_secs(5))).await {
            Some(Msg::Frame(f)) if f[3] == "postgres_changes" => {
                seen.rows
                    .push(f[4]["data"]["record"]["id"].as_i64().expect("id"));
            }
            Some(Msg::Frame(f)) if f[3] == "system" => seen.systems.push(f[4].clone()),
            Some(Msg::Frame(_)) | Some(Msg::Binary(_)) => {}
            Some(other) => panic!("the socket ended: {other:?}"),
            None if Instant::now() >= deadline => break,
            None => {}
        }
    }
    seen
}

/// The stack: a worker (with `worker_env`) and NATS directly, a front through the proxy,
/// another directly; a table `g` enabled.
struct Setup {
    stack: Stack,
    _worker: Worker,
    proxy: TcpProxy,
    cut: Worker,
    direct: Worker,
}

fn setup(worker_env: &[(&str, &str)]) -> Setup {
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE g (id int PRIMARY KEY)");
    stack.enable("g");
    let mut worker = stack.worker(worker_env);
    worker.wait_active(Duration::from_secs(60));
    let proxy = TcpProxy::start(stack.nats.port()).expect("proxy");
    let through = format!("nats://127.0.0.1:{}", proxy.port());
    let mut cut = Worker::front(&through, &[("GAP_RECOVERY_MS", "5000")]);
    let mut direct = Worker::front(&stack.nats.url(), &[]);
    cut.wait_http(Duration::from_secs(30));
    direct.wait_http(Duration::from_secs(30));
    Setup {
        stack,
        _worker: worker,
        proxy,
        cut,
        direct,
    }
}

async fn subscribe(front: &Worker) -> PhoenixClient {
    let mut ws = PhoenixClient::connect(&front.ws_url(&anon())).await;
    ws.join_subscribed(
        "realtime:g",
        json!([{"event": "INSERT", "schema": "public", "table": "g"}]),
    )
    .await;
    ws
}

/// Insert rows 1..=`n` at 50 rows/s, calling `at(i)` before row i.
async fn write(stack: &Stack, n: i32, mut at: impl FnMut(i32)) {
    let db = stack.pg.connect().await.expect("connect");
    let stmt = db
        .prepare("INSERT INTO g VALUES ($1)")
        .await
        .expect("prepare");
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    for i in 1..=n {
        tick.tick().await;
        at(i);
        db.execute(&stmt, &[&i]).await.expect("insert");
    }
}

/// 3 s cut after 2 s of writing, 1 s cut 4 s after the first ends, 12 s of writing.
const ROWS: i32 = 600;

fn cuts(proxy: &TcpProxy) -> impl FnMut(i32) + '_ {
    move |i| match i {
        100 => proxy.cut(),
        250 => proxy.restore(),
        450 => proxy.cut(),
        500 => proxy.restore(),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_front_recovers_every_row_in_order() {
    let _machine = crate::support::alone().await;
    let s = setup(&[]);
    let cut_ws = subscribe(&s.cut).await;
    let direct_ws = subscribe(&s.direct).await;
    let within = Duration::from_secs(60);
    let cut_reader = tokio::spawn(read(cut_ws, ROWS as usize, false, within));
    let direct_reader = tokio::spawn(read(direct_ws, ROWS as usize, false, within));
    write(&s.stack, ROWS, cuts(&s.proxy)).await;
    let cut = cut_reader.await.expect("reader");
    let direct = direct_reader.await.expect("reader");
    let all: Vec<i64> = (1..=i64::from(ROWS)).collect();
    assert_eq!(direct.rows, all, "the front with a steady link");
    assert!(
        cut.postgres_errors().is_empty(),
        "a system error although the leader kept everything: {:?}",
        cut.systems
    );
    assert_eq!(
        cut.rows.len(),
        all.len(),
        "rows of the cut front (first missing: {:?}); log:\n{}",
        all.iter().find(|i| !cut.rows.contains(i)),
        s.cut.log_text()
    );
    assert_eq!(cut.rows, all, "every row once, in order");
    let recovered = s.cut.metric("walcast_front_delivery_recovered_total");
    eprintln!(
        "cut front: {recovered:?} messages recovered, {:?} disconnects, systems {:?}",
        s.cut.metric("walcast_front_bus_disconnects_total"),
        cut.systems
    );
    assert!(
        recovered.is_some_and(|n| n > 0.0),
        "the cut made a gap that was recovered: {recovered:?}"
    );
    assert!(
        cut.systems
            .iter()
            .any(|m| m["extension"] == "system" && m["status"] == "error"),
        "the channel is told broadcasts may have been missed: {:?}",
        cut.systems
    );
    let health = s.cut.health().expect("health");
    let front = &health["front"];
    assert_eq!(front["bus_disconnected_recently"], true, "{health}");
    assert!(front["bus_disconnects"].as_u64() >= Some(2), "{health}");
    assert!(front["bus_last_disconnect"].is_string(), "{health}");
    let steady = s.direct.health().expect("health");
    assert_eq!(
        steady["front"]["bus_disconnected_recently"], false,
        "{steady}"
    );
    assert!(
        s.cut.metric("walcast_front_bus_disconnects_total") >= Some(2.0),
        "disconnects counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_leaders_buffer_the_channel_gets_a_system_error() {
    let _machine = crate::support::alone().await;
    // The leader keeps one message per front: a 3 s cut cannot be recovered.
    let s = setup(&[("CDC_RESEND_MAX_MESSAGES", "1")]);
    let cut_ws = subscribe(&s.cut).await;
    let reader = tokio::spawn(read(cut_ws, usize::MAX, true, Duration::from_secs(40)));
    let rows = 300;
    write(&s.stack, rows, |i| match i {
        50 => s.proxy.cut(),
        200 => s.proxy.restore(),
        _ => {}
    })
    .await;
    let seen = reader.await.expect("reader");
    let errors = seen.postgres_errors();
    assert!(
        !errors.is_empty(),
        "rows lost without a word: {} of {rows} arrived; systems {:?}; log:\n{}",
        seen.rows.len(),
        seen.systems,
        s.cut.log_text()
    );
    let message = errors[0]["message"].as_str().unwrap_or_default();
    assert!(message.contains("could not be recovered"), "{message}");
    assert!(s.cut.metric("walcast_front_delivery_lost_total") > Some(0.0));
    // Rows were delivered once and in order on both sides of the loss.
    assert!(seen.rows.windows(2).all(|w| w[0] < w[1]), "{:?}", seen.rows);
    // Delivery carries on after the loss.
    let mut ws = subscribe(&s.cut).await;
    let db = s.stack.pg.connect().await.expect("connect");
    db.execute("INSERT INTO g VALUES (100000)", &[])
        .await
        .expect("insert");
    ws.wait_frame("postgres_changes", Duration::from_secs(20), |p| {
        p["data"]["record"]["id"] == 100000
    })
    .await;
}
