//! SSE `?snapshot=true` through the real parts: a cdc-worker and a ws-front on one
//! nats-server. The rows a subscriber may see (row-level security applies), then the
//! changes, on one stream: with a writer busy all along, the client's copy (rows, then
//! changes applied) ends equal to the rows visible to it, no change twice (every update
//! adds exactly one to `v`), none missed. An anon client gets no row its policies hide;
//! a hostile filter is a value; a snapshot over `SSE_SNAPSHOT_MAX_ROWS` is refused (413).
//! On a nats-server whose `max_payload` is 64 KiB, a snapshot of megabytes comes whole in
//! parts, then the changes, as above; over `SSE_SNAPSHOT_MAX_BYTES` is a 413; a part
//! forged or repeated on the bus makes the front refuse the snapshot (503), never send
//! it cut short or mixed.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::ws::{anon, now, token};
use crate::support::{Stack, Worker};

/// One server-sent event.
#[derive(Debug, Clone)]
struct Sse {
    event: String,
    data: String,
}

/// Open an SSE stream: its status, and (200) its events as they arrive or (else) the body.
fn open(port: u16, query: &str) -> (u16, mpsc::Receiver<Sse>, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let req = format!("GET /realtime/v1/sse?{query} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut status = 0;
    loop {
        let mut line = String::new();
        assert!(r.read_line(&mut line).expect("head") > 0, "no head");
        if status == 0 {
            status = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        }
        if line == "\r\n" {
            break;
        }
    }
    let (tx, rx) = mpsc::channel();
    if status != 200 {
        let mut body = String::new();
        let _ = r.read_to_string(&mut body);
        return (status, rx, body);
    }
    std::thread::spawn(move || {
        let (mut event, mut data) = (String::new(), String::new());
        for line in r.lines() {
            let Ok(line) = line else { return };
            if line.is_empty() {
                if !event.is_empty() || !data.is_empty() {
                    let ev = Sse {
                        event: std::mem::take(&mut event),
                        data: std::mem::take(&mut data),
                    };
                    if tx.send(ev).is_err() {
                        return;
                    }
                }
            } else if let Some(v) = line.strip_prefix("event:") {
                event = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
    });
    (status, rx, String::new())
}

fn next(rx: &mpsc::Receiver<Sse>) -> Sse {
    rx.recv_timeout(Duration::from_secs(60))
        .expect("an event within a minute")
}

/// The rows of a snapshot stream (id → record) after `ready`, up to `snapshot_done`.
fn rows(rx: &mpsc::Receiver<Sse>) -> BTreeMap<i64, Value> {
    assert_eq!(next(rx).event, "ready");
    let mut rows = BTreeMap::new();
    loop {
        let ev = next(rx);
        let v: Value = serde_json::from_str(&ev.data).unwrap();
        match ev.event.as_str() {
            "snapshot" => {
                let rec = v["data"]["record"].clone();
                let id = rec["id"].as_i64().unwrap();
                assert!(rows.insert(id, rec).is_none(), "row {id} twice");
            }
            "snapshot_done" => {
                assert_eq!(v["rows"].as_u64().unwrap() as usize, rows.len());
                return rows;
            }
            other => panic!("{other} before snapshot_done: {}", ev.data),
        }
    }
}

fn user(sub: &str) -> String {
    token(json!({"role": "authenticated", "sub": sub, "exp": now() + 3600}))
}

fn setup(stack: &Stack) {
    setup_rows(stack, 400, 0);
}

/// `items`: `n` rows, half u1's, half u2's, each with `pad` bytes of padding.
fn setup_rows(stack: &Stack, n: usize, pad: usize) {
    stack.sql(
        "CREATE TABLE items (id bigint PRIMARY KEY, owner text NOT NULL, v int NOT NULL,
                             pad text NOT NULL DEFAULT '')",
    );
    stack.enable("items");
    stack.sql(&format!(
        "ALTER TABLE items ENABLE ROW LEVEL SECURITY;
         CREATE POLICY own ON items FOR SELECT TO authenticated
           USING (owner = auth.jwt() ->> 'sub');
         INSERT INTO items SELECT g, CASE WHEN g % 2 = 0 THEN 'u1' ELSE 'u2' END, 0,
                                  repeat('x', {pad})
           FROM generate_series(1, {n}) g;"
    ));
}

/// Until stopped: new rows, `v + 1` on existing ones, deletions, for both owners.
fn writer(stack: &Stack, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    let pg = stack.pg.url();
    tokio::spawn(async move {
        let (client, conn) = tokio_postgres::connect(&pg, tokio_postgres::NoTls)
            .await
            .expect("writer connects");
        tokio::spawn(conn);
        let mut n = 0u64;
        let mut next_id = 1_000_000i64;
        while !stop.load(Ordering::Relaxed) {
            let sql = match n % 4 {
                0 => {
                    next_id += 1;
                    format!(
                        "INSERT INTO items VALUES ({next_id}, 'u{}', 0)",
                        1 + next_id % 2
                    )
                }
                1 | 2 => format!(
                    "UPDATE items SET v = v + 1 WHERE id = {}",
                    1 + (n * 7) % 400
                ),
                _ => format!("DELETE FROM items WHERE id = {}", 1 + (n * 13) % 400),
            };
            client.batch_execute(&sql).await.expect("write");
            n += 1;
        }
        n
    })
}

/// Apply one change to the copy, refusing duplicates and gaps on the way.
fn apply(copy: &mut BTreeMap<i64, Value>, data: &str) {
    let v: Value = serde_json::from_str(data).unwrap();
    let d = &v["data"];
    match d["type"].as_str().unwrap() {
        "INSERT" => {
            let id = d["record"]["id"].as_i64().unwrap();
            let old = copy.insert(id, d["record"].clone());
            assert!(old.is_none(), "INSERT of {id} the copy already has: {data}");
        }
        "UPDATE" => {
            let id = d["record"]["id"].as_i64().unwrap();
            let was = copy
                .get(&id)
                .unwrap_or_else(|| panic!("UPDATE of missing {id}"));
            assert_eq!(
                d["record"]["v"].as_i64().unwrap(),
                was["v"].as_i64().unwrap() + 1,
                "an update twice or one missed: {data}"
            );
            copy.insert(id, d["record"].clone());
        }
        "DELETE" => {
            // A deleted row cannot be judged by its policy: every reader of the table gets
            // its key (README, RLS). Even ids are u1's, whose copy this is.
            let id = d["old_record"]["id"].as_i64().unwrap();
            let had = copy.remove(&id).is_some();
            assert!(had || id % 2 != 0, "DELETE of missing {id}: {data}");
        }
        other => panic!("change type {other}"),
    }
}

/// The rows `owner` may see, as superuser.
fn visible(stack: &Stack, owner: &str) -> BTreeMap<i64, Value> {
    let out = stack.sql(&format!(
        "SELECT coalesce(json_agg(row_to_json(i) ORDER BY id), '[]') FROM items i WHERE owner = '{owner}'"
    ));
    let rows: Vec<Value> = serde_json::from_str(out.trim()).unwrap();
    rows.into_iter()
        .map(|r| (r["id"].as_i64().unwrap(), r))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_then_changes_equals_the_visible_rows() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    setup(&stack);
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(Duration::from_secs(60));
    snapshot_then_changes(&stack, &front).await;
}

/// Open u1's snapshot stream on `front` with a writer busy all along; check that its
/// copy (the rows, then the changes applied) ends as the rows u1 may see. The copy.
async fn snapshot_then_changes(stack: &Stack, front: &Worker) -> BTreeMap<i64, Value> {
    let stop = Arc::new(AtomicBool::new(false));
    let writes = writer(stack, stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await; // the writer is busy
    let query = format!(
        "apikey={}&access_token={}&table=items&snapshot=true",
        anon(),
        user("u1")
    );
    let port = front.port;
    let (status, rx, body) = tokio::task::spawn_blocking(move || open(port, &query))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let (mut copy, rx) = tokio::task::spawn_blocking(move || (rows(&rx), rx))
        .await
        .unwrap();
    assert!(copy.values().all(|r| r["owner"] == "u1"), "only u1's rows");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let written = writes.await.unwrap();
    assert!(written > 20, "the writer wrote ({written})");
    // A last row: once it is in the copy, every earlier change is too.
    stack.sql("INSERT INTO items VALUES (-1, 'u1', 0)");
    let copy = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !copy.contains_key(&-1) {
            assert!(Instant::now() < deadline, "the last row never came");
            let ev = next(&rx);
            assert_eq!(ev.event, "postgres_changes", "{}", ev.data);
            apply(&mut copy, &ev.data);
        }
        copy
    })
    .await
    .unwrap();
    assert_eq!(copy, visible(stack, "u1"), "the copy is what u1 may see");
    let skipped = front
        .metric("walcast_front_sse_snapshot_skipped_changes_total")
        .unwrap_or(0.0);
    eprintln!("{written} writes; {skipped} changes the rows already held");
    copy
}

/// A nats-server whose messages are at most 64 KiB.
fn small_messages_stack() -> Stack {
    Stack {
        pg: walcast_testkit::Postgres::builder()
            .start()
            .expect("start postgres"),
        nats: walcast_testkit::Nats::start_with_max_payload(Some(64 * 1024))
            .expect("start nats-server"),
        source: "stream",
    }
}

/// A cdc-worker (active) and a front on `stack`.
fn worker_and_front(stack: &Stack) -> (Worker, Worker) {
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(Duration::from_secs(60));
    (worker, front)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_larger_than_one_nats_message_comes_whole_in_parts() {
    let _machine = crate::support::shared().await;
    let stack = small_messages_stack();
    // u1's 2000 rows of 1 KiB: some 2 MiB, over thirty 64 KiB messages.
    setup_rows(&stack, 4000, 1024);
    let (_worker, front) = worker_and_front(&stack);
    let copy = snapshot_then_changes(&stack, &front).await;
    assert!(copy.len() > 1900, "{} rows", copy.len());
    assert_eq!(
        front.metric("walcast_front_sse_snapshots_total{outcome=\"ok\"}"),
        Some(1.0)
    );

    // Over SSE_SNAPSHOT_MAX_BYTES: refused before the stream starts, with the reason.
    let mut small = Worker::front(&stack.nats.url(), &[("SSE_SNAPSHOT_MAX_BYTES", "500000")]);
    small.wait_http(Duration::from_secs(60));
    let query = format!(
        "apikey={}&access_token={}&table=items&snapshot=true",
        anon(),
        user("u1")
    );
    let port = small.port;
    let (status, _, body) = tokio::task::spawn_blocking(move || open(port, &query))
        .await
        .unwrap();
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("SSE_SNAPSHOT_MAX_BYTES"), "{body}");
}

/// Until `stop`: on every snapshot request seen on the bus, `meddle` with its reply inbox
/// (`client`, the request's reply subject, its nonce). How many requests were seen.
fn on_snapshot_requests(
    client: async_nats::Client,
    meddle: fn(
        async_nats::Client,
        async_nats::Subject,
        String,
    ) -> futures_util::future::BoxFuture<'static, ()>,
) -> tokio::task::JoinHandle<()> {
    use futures_util::StreamExt;
    tokio::spawn(async move {
        let mut reqs = client.subscribe("walcast.>").await.unwrap();
        while let Some(m) = reqs.next().await {
            let Ok(v) = serde_json::from_slice::<Value>(&m.payload) else {
                continue;
            };
            if let (Some("snapshot_rows"), Some(reply)) = (v["op"].as_str(), m.reply) {
                let nonce = v["nonce"].as_str().unwrap_or_default().to_string();
                tokio::spawn(meddle(client.clone(), reply, nonce));
            }
        }
    })
}

/// Open u1's snapshot stream: its status and body (events are not read).
async fn u1_snapshot(port: u16) -> (u16, String) {
    let query = format!(
        "apikey={}&access_token={}&table=items&snapshot=true",
        anon(),
        user("u1")
    );
    let (status, _, body) = tokio::task::spawn_blocking(move || open(port, &query))
        .await
        .unwrap();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_or_repeated_part_is_refused_never_sent() {
    use futures_util::{FutureExt, StreamExt};
    let _machine = crate::support::shared().await;
    let stack = small_messages_stack();
    setup_rows(&stack, 4000, 1024);
    let (_worker, front) = worker_and_front(&stack);
    let client = async_nats::connect(stack.nats.url()).await.unwrap();

    // A part forged with the request's nonce, published at once: it takes number 0, the
    // worker's part 0 then repeats it.
    let forge = on_snapshot_requests(client.clone(), |c, reply, nonce| {
        async move {
            let part = json!({"nonce": nonce, "seq": 0, "body": {"rows": [
                {"id": -5, "owner": "u1", "v": 0, "pad": "forged"}
            ]}});
            c.publish(reply, part.to_string().into()).await.unwrap();
            c.flush().await.unwrap();
        }
        .boxed()
    });
    let (status, body) = u1_snapshot(front.port).await;
    assert_eq!(status, 503, "a forged part: {body}");
    assert!(body.contains("part"), "{body}");
    eprintln!("forged: {body}");
    forge.abort();

    // The worker's own first part, sent again (as a replay would).
    let repeat = on_snapshot_requests(client.clone(), |c, reply, _| {
        async move {
            let mut parts = c.subscribe(reply.clone()).await.unwrap();
            c.flush().await.unwrap();
            if let Some(first) = parts.next().await {
                c.publish(reply, first.payload).await.unwrap();
                c.flush().await.unwrap();
            }
        }
        .boxed()
    });
    // The meddler must subscribe to the inbox before the first part: the worker takes
    // a while (planning, reading 2000 rows); a try where it was late is retried.
    let mut refused = false;
    for _ in 0..5 {
        let (status, body) = u1_snapshot(front.port).await;
        assert!(status == 503 || status == 200, "{status} {body}");
        if status == 503 {
            assert!(body.contains("part"), "{body}");
            eprintln!("repeated: {body}");
            refused = true;
            break;
        }
    }
    assert!(refused, "a repeated part was never refused");
    repeat.abort();
    // Nobody meddling: the snapshot comes.
    let (status, body) = u1_snapshot(front.port).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        front
            .metric("walcast_front_sse_snapshots_total{outcome=\"unavailable\"}")
            .unwrap_or(0.0)
            >= 2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_is_limited_by_rls_and_bounded() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    setup(&stack);
    stack.sql(
        "CREATE TABLE hidden (id int PRIMARY KEY);
         INSERT INTO hidden VALUES (1);",
    );
    stack.enable("hidden");
    stack.sql("REVOKE ALL ON hidden FROM anon");
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let mut front = Worker::front(&stack.nats.url(), &[("SSE_SNAPSHOT_MAX_ROWS", "150")]);
    front.wait_http(Duration::from_secs(60));
    let port = front.port;
    let ask = move |query: String| {
        tokio::task::spawn_blocking(move || {
            let (status, rx, body) = open(port, &query);
            let rows = (status == 200).then(|| rows(&rx));
            (status, rows, body)
        })
    };

    // No policy lets anon see a row: none comes.
    let (status, got, body) = ask(format!("apikey={}&table=items&snapshot=true", anon()))
        .await
        .unwrap();
    assert_eq!((status, got.map(|r| r.len())), (200, Some(0)), "{body}");
    // A table anon may not read at all: refused.
    let (status, _, body) = ask(format!("apikey={}&table=hidden&snapshot=true", anon()))
        .await
        .unwrap();
    assert!(
        status == 403 || status == 400,
        "anon reading hidden: {status} {body}"
    );
    // u2 sees its own rows only; a hostile filter is one value among others.
    let hostile = "owner=eq.%22u1%27)%3B%20DROP%20TABLE%20items%3B--%22";
    let (status, got, body) = ask(format!(
        "apikey={}&access_token={}&table=items&snapshot=true&filter={hostile}",
        anon(),
        user("u2")
    ))
    .await
    .unwrap();
    assert_eq!((status, got.map(|r| r.len())), (200, Some(0)), "{body}");
    let (status, got, body) = ask(format!(
        "apikey={}&access_token={}&table=items&snapshot=true&filter=id=lte.100",
        anon(),
        user("u2")
    ))
    .await
    .unwrap();
    let got = got.unwrap_or_else(|| panic!("{status} {body}"));
    assert_eq!(got.len(), 50, "u2's odd ids up to 100");
    assert!(got.values().all(|r| r["owner"] == "u2"));
    // u1's 200 rows are over SSE_SNAPSHOT_MAX_ROWS 150: 413, with the reason.
    let (status, _, body) = ask(format!(
        "apikey={}&access_token={}&table=items&snapshot=true",
        anon(),
        user("u1")
    ))
    .await
    .unwrap();
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("SSE_SNAPSHOT_MAX_ROWS"), "{body}");
    assert_eq!(
        front.metric("walcast_front_sse_snapshots_total{outcome=\"too_large\"}"),
        Some(1.0)
    );
    // A snapshot of every table is refused: it reads one table.
    let (status, _, body) = ask(format!("apikey={}&snapshot=true", anon()))
        .await
        .unwrap();
    assert_eq!(status, 400, "{body}");
    assert_eq!(stack.sql("SELECT count(*) FROM items").trim(), "400");
}
