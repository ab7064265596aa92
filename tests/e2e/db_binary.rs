//! `realtime.send_binary` on the wire, through a raw socket: the bytes arrive as
//! binary kind 4 exactly as Supabase frames it — kind, sizes of topic, event and meta,
//! payload encoding 0 (binary), then topic, event, meta `{"id": …}` and the bytes
//! untouched — live and replayed (`meta.replayed`), and only to the writing project's
//! channels: another project's key on the same topic gets neither, and a login not mapped
//! to a project cannot send bytes for it.

use std::time::Duration;

use serde_json::{json, Value};
use walcast_testkit::phoenix::{Msg, PhoenixClient};

use crate::support::projects::create_project;
use crate::support::{ws, Stack, Worker};

const STARTUP: Duration = Duration::from_secs(60);
/// How long "nothing arrives" is watched.
const QUIET: Duration = Duration::from_millis(1500);
/// Bytes that mean something elsewhere: NUL, a newline (the bus envelope's separator),
/// JSON, a backslash.
const BYTES: &[u8] = b"\xde\x00\n{\"id\":1}\\\xff";

/// A kind 4 message taken apart: topic, event, meta, payload encoding, payload.
#[derive(Debug)]
struct Kind4 {
    topic: String,
    event: String,
    meta: Value,
    encoding: u8,
    payload: Vec<u8>,
}

fn kind4(b: &[u8]) -> Kind4 {
    assert!(b.len() >= 5 && b[0] == 4, "not kind 4: {b:?}");
    let (t, e, m) = (b[1] as usize, b[2] as usize, b[3] as usize);
    let rest = &b[5..];
    Kind4 {
        topic: String::from_utf8(rest[..t].to_vec()).expect("topic"),
        event: String::from_utf8(rest[t..t + e].to_vec()).expect("event"),
        meta: serde_json::from_slice(&rest[t + e..t + e + m]).expect("meta"),
        encoding: b[4],
        payload: rest[t + e + m..].to_vec(),
    }
}

/// The next binary message within `within` (frames skipped), or `None`.
async fn next_binary(sock: &mut PhoenixClient, within: Duration) -> Option<Kind4> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match sock.try_recv(left).await {
            None | Some(Msg::Ended(_)) => return None,
            Some(Msg::Binary(b)) => return Some(kind4(&b)),
            Some(Msg::Frame(_)) => {}
            Some(other) => panic!("unexpected {other:?}"),
        }
    }
}

async fn join(front: &Worker, key: &str, replay: bool) -> PhoenixClient {
    let mut sock = PhoenixClient::connect(&front.ws_url(key)).await;
    let mut config = json!({"private": true, "broadcast": {"self": false}});
    if replay {
        config["broadcast"]["replay"] = json!({"since": 0, "limit": 25});
    }
    let (_, reply) = sock.join("realtime:bin", config, None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    sock
}

/// `realtime.send_binary(BYTES, 'blob', 'bin', true)` as `login` for `project`; psql's
/// output, warnings included.
fn send_binary_as(stack: &Stack, login: &str, project: &str) -> String {
    let hex: String = BYTES.iter().map(|b| format!("{b:02x}")).collect();
    stack.sql(&format!(
        "SET SESSION AUTHORIZATION {login}; SET walcast.project = '{project}';
         SELECT realtime.send_binary('\\x{hex}'::bytea, 'blob', 'bin', true);"
    ))
}

fn assert_bytes(got: &Kind4, replayed: bool) {
    assert_eq!(
        (got.topic.as_str(), got.event.as_str(), got.encoding),
        ("realtime:bin", "blob", 0),
        "{got:?}"
    );
    assert_eq!(got.payload, BYTES, "{got:?}");
    let id = got.meta["id"].as_str().expect("meta.id");
    assert_eq!(id.len(), 36, "{got:?}");
    assert_eq!(got.meta.get("replayed").is_some(), replayed, "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_binary_is_kind_4_with_its_bytes_and_stays_in_its_project() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(STARTUP);
    let a = create_project(&stack, "A");
    let b = create_project(&stack, "B");
    stack.sql(&format!(
        "CREATE POLICY open_read ON realtime.messages FOR SELECT TO PUBLIC USING (true);
         CREATE POLICY open_write ON realtime.messages FOR INSERT TO PUBLIC WITH CHECK (true);
         CREATE ROLE alice LOGIN; CREATE ROLE mallory LOGIN;
         GRANT USAGE ON SCHEMA realtime TO alice, mallory;
         GRANT SELECT, INSERT ON realtime.messages TO alice, mallory;
         INSERT INTO walcast.project_roles VALUES ('{}', 'alice');",
        a.id
    ));

    let mut sa = join(&front, &a.service, false).await;
    let mut sb = join(&front, &b.service, false).await;
    send_binary_as(&stack, "alice", &a.id);
    let got = next_binary(&mut sa, ws::TIMEOUT).await.expect("A's bytes");
    assert_bytes(&got, false);
    assert!(
        next_binary(&mut sb, QUIET).await.is_none(),
        "B got A's bytes"
    );

    // Replayed: to A's key only, as they were sent.
    let mut ra = join(&front, &a.service, true).await;
    let replayed = next_binary(&mut ra, ws::TIMEOUT).await.expect("A's replay");
    assert_bytes(&replayed, true);
    assert_eq!(replayed.meta["id"], got.meta["id"]);
    let mut rb = join(&front, &b.service, true).await;
    assert!(next_binary(&mut rb, QUIET).await.is_none(), "B's replay");

    // mallory is not mapped to A: refused (a warning), nothing written or sent.
    let out = send_binary_as(&stack, "mallory", &a.id);
    assert!(out.contains("may not act for project"), "{out}");
    assert!(
        next_binary(&mut sa, QUIET).await.is_none(),
        "mallory's bytes"
    );
    let rows = stack.sql(&format!(
        "SELECT count(*) FROM realtime.messages WHERE project = '{}' AND binary_payload IS NOT NULL",
        a.id
    ));
    assert_eq!(rows.trim(), "1");
}
