//! Snapshots through the management API (`/management/v1/projects/{id}/snapshots`): a
//! cdc-worker and a front over NATS. A snapshot of a project's table is started, reaches
//! `done` with its rows on the change stream as READ events, and is listed; another is
//! cancelled; the CLI's checks answer as 4xx (change stream off, hostile filters and
//! names); and another project can neither see, cancel nor start a snapshot of the first
//! one's table (404 / 409, never a leak).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::changes::changes_stream;
use crate::management::{api, create, op, path, Created, OPERATOR, STARTUP};
use crate::support::outbox::read_all;
use crate::support::projects::walcast;
use crate::support::{Stack, Worker};

const ROWS: i64 = 300;
/// Slow enough that the big table's snapshot is still queued or running when cancelled.
const ENV: &[(&str, &str)] = &[
    ("SNAPSHOT_ROWS_PER_SEC", "200"),
    ("SNAPSHOT_CHUNK_ROWS", "100"),
];

fn snapshots(p: &str) -> String {
    format!("{}/snapshots", path(p))
}

fn snapshot(p: &str, id: i64) -> String {
    format!("{}/snapshots/{id}", path(p))
}

/// `POST …/snapshots` with `body`: (status, answer).
fn start(front: &Worker, p: &str, body: Value) -> (u16, Value) {
    op(front, "POST", &snapshots(p), Some(&body.to_string()))
}

/// Tables `items` (ROWS rows) and `big` (2,000 rows), change streams on for the project,
/// and `quiet`, whose change stream is off.
fn tables(stack: &Stack, p: &Created) {
    stack.sql(&format!(
        "CREATE TABLE \"{s}\".items (id int PRIMARY KEY, v text NOT NULL);
         INSERT INTO \"{s}\".items SELECT g, 'v' || g FROM generate_series(1, {ROWS}) g;
         CREATE TABLE \"{s}\".big (id int PRIMARY KEY);
         INSERT INTO \"{s}\".big SELECT generate_series(1, 2000);
         CREATE TABLE \"{s}\".quiet (id int PRIMARY KEY);",
        s = p.schema
    ));
    for t in ["items", "big"] {
        let name = format!("{}.{t}", p.schema);
        let out = walcast(stack, &["changes", "--project", &p.id, "enable", &name]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Wait until snapshot `id` of `p` is in `state`.
fn wait_state(front: &Worker, p: &str, id: i64, state: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (status, v) = op(front, "GET", &snapshot(p, id), None);
        assert_eq!(status, 200, "{v}");
        if v["state"] == state {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "snapshot {id} not {state} within 90 s: {v}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The READ events of `subject` on the change stream: waits until `rows` are there.
async fn reads(nats_url: &str, subject: &str, rows: usize) -> usize {
    let mut stream = changes_stream(nats_url).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = read_all(&mut stream)
            .await
            .iter()
            .filter(|m| m.subject == subject && m.payload["type"] == "READ")
            .count();
        if n >= rows || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Refusals of the CLI's checks, each a 4xx with its code, before anything is queued.
fn refusals(front: &Worker, a: &Created, b: &Created) {
    let s = &a.schema;
    let items = format!("{s}.items");
    for (body, want, code) in [
        (json!({"table": format!("{s}.quiet")}), 409, "not_streaming"),
        (json!({"table": "nope"}), 409, "not_streaming"),
        (
            json!({"table": items, "where": "id=eq.1; DROP TABLE x"}),
            422,
            "invalid_filter",
        ),
        (
            json!({"table": items, "where": "nope=eq.1"}),
            422,
            "invalid_filter",
        ),
        (
            json!({"table": items, "where": "id=zz.1"}),
            422,
            "invalid_filter",
        ),
        (
            json!({"table": format!("{s}.items\"; DROP TABLE x; --")}),
            422,
            "invalid_body",
        ),
        (json!({"table": "a\u{0}b"}), 422, "invalid_body"),
        (
            json!({"table": items, "where": "v=eq.".to_string() + &"x".repeat(5000)}),
            422,
            "invalid_body",
        ),
        (
            json!({"table": items, "filter": "id=eq.1"}),
            422,
            "invalid_body",
        ),
        (json!({}), 422, "invalid_body"),
    ] {
        let (status, v) = start(front, &a.id, body.clone());
        assert_eq!(
            (status, v["error"].clone()),
            (want, json!(code)),
            "{body}: {v}"
        );
    }
    // Another project may not snapshot A's table (it streams for A only).
    let (status, v) = start(front, &b.id, json!({"table": items}));
    assert_eq!(
        (status, v["error"].clone()),
        (409, json!("not_streaming")),
        "{v}"
    );
    // Only the operator key.
    let body = json!({"table": items}).to_string();
    for (auth, want) in [(None, 401), (Some(a.anon.as_str()), 403)] {
        let (status, v) = api(front, "POST", &snapshots(&a.id), auth, Some(&body));
        assert_eq!(status, want, "{v}");
    }
    let (status, v) = api(front, "GET", &snapshots(&a.id), Some("nope"), None);
    assert_eq!(status, 401, "{v}");
    for bad in ["0", "-1", "x", "1%3BDROP"] {
        let (status, v) = op(front, "GET", &format!("{}/{bad}", snapshots(&a.id)), None);
        assert_eq!(
            (status, v["error"].clone()),
            (400, json!("invalid_id")),
            "{bad}: {v}"
        );
    }
    let unknown = "0b7c6f0e-1c1a-4a53-9a1e-3f0a1f5d2c11";
    let (status, v) = op(front, "GET", &snapshots(unknown), None);
    assert_eq!(
        (status, v["error"].clone()),
        (404, json!("unknown_project")),
        "{v}"
    );
    let (status, v) = op(front, "GET", &snapshots(&a.id), None);
    assert_eq!((status, v.clone()), (200, json!([])), "nothing queued: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_through_the_management_api_stay_in_their_project() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(ENV);
    worker.wait_active(STARTUP);
    let mut front = Worker::front(&stack.nats.url(), &[("MANAGEMENT_API_KEY", OPERATOR)]);
    front.wait_http(STARTUP);
    let a = create(&front, "A");
    let b = create(&front, "B");
    tables(&stack, &a);
    refusals(&front, &a, &b);

    // A snapshot of A's items: queued, then done, its rows on the stream as READ events.
    let (status, v) = start(
        &front,
        &a.id,
        json!({"table": format!("{}.items", a.schema)}),
    );
    assert_eq!(status, 201, "{v}");
    assert_eq!(
        (v["state"].clone(), v["project"].clone()),
        (json!("queued"), json!(a.id))
    );
    let done = v["id"].as_i64().expect("an id");
    let v = wait_state(&front, &a.id, done, "done");
    assert_eq!(v["rows_done"], ROWS, "{v}");
    assert_eq!(
        (v["table"].clone(), v["where"].clone()),
        (json!("items"), json!(""))
    );
    let subject = format!("walcast.changes.{}.{}.items", a.id, a.schema);
    let n = reads(&stack.nats.url(), &subject, ROWS as usize).await;
    assert!(n >= ROWS as usize, "{n} READ events of {subject}");

    // Another, of the big table: B can neither see nor cancel it; A cancels it.
    let (status, v) = start(&front, &a.id, json!({"table": format!("{}.big", a.schema)}));
    assert_eq!(status, 201, "{v}");
    let big = v["id"].as_i64().expect("an id");
    for id in [done, big] {
        for method in ["GET", "DELETE"] {
            let (status, v) = op(&front, method, &snapshot(&b.id, id), None);
            assert_eq!(
                (status, v["error"].clone()),
                (404, json!("unknown_snapshot")),
                "{method} of A's snapshot {id} by B: {v}"
            );
            assert!(!v.to_string().contains(&a.schema), "leaked: {v}");
        }
    }
    let (status, v) = op(&front, "GET", &snapshots(&b.id), None);
    assert_eq!((status, v.clone()), (200, json!([])), "{v}");
    let (status, v) = op(&front, "DELETE", &snapshot(&a.id, big), None);
    assert_eq!(
        (status, v["state"].clone()),
        (200, json!("cancelled")),
        "{v}"
    );
    let (status, v) = op(&front, "DELETE", &snapshot(&a.id, big), None);
    assert_eq!(
        (status, v["error"].clone()),
        (409, json!("snapshot_over")),
        "{v}"
    );
    let (status, v) = op(&front, "DELETE", &snapshot(&a.id, done), None);
    assert_eq!(
        (status, v["error"].clone()),
        (409, json!("snapshot_over")),
        "{v}"
    );

    // The list: newest first, with their progress.
    let (status, list) = op(&front, "GET", &snapshots(&a.id), None);
    assert_eq!(status, 200, "{list}");
    let shown: Vec<(i64, String)> = list
        .as_array()
        .expect("a list")
        .iter()
        .map(|s| {
            (
                s["id"].as_i64().unwrap(),
                s["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [(big, "cancelled".into()), (done, "done".into())],
        "{list}"
    );
    assert!(list[1]["rows_estimate"].as_i64().is_some(), "{list}");
    let (status, one) = op(
        &front,
        "GET",
        &format!("{}?limit=1", snapshots(&a.id)),
        None,
    );
    assert_eq!(
        (status, one.as_array().map(Vec::len)),
        (200, Some(1)),
        "{one}"
    );
    let (status, v) = op(
        &front,
        "GET",
        &format!("{}?limit=0", snapshots(&a.id)),
        None,
    );
    assert_eq!(status, 400, "{v}");
}
