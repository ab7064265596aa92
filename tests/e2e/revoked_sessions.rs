//! Sessions end when no key accepts their token any more: a project's secret rotated (at
//! once, or when its window ends), the project suspended or deleted. A cdc-worker and two
//! ws-fronts over NATS, the management API on one; on both fronts, a socket's channel
//! whose token no longer verifies gets a `system` error and `phx_close` (as on expiry) and
//! an SSE stream a `system` event and its end, within seconds; a channel whose token a
//! new key signed (given at join or later through `access_token`) and another project's
//! sockets go on receiving.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::PhoenixClient;

use crate::management::{create, items, op, path, subscribed, Created, APPLIED, OPERATOR, STARTUP};
use crate::support::projects::sign;
use crate::support::ws::now;
use crate::support::{Stack, Worker};

/// What a channel or stream is told when its token's key is gone.
const REVOKED: &str = "Invalid token: signature verification failed";
const SUSPENDED: &str = "RealtimeDisabledForTenant: Realtime disabled for this tenant";
const DELETED: &str = "TenantNotFound: this project was deleted";

/// A worker and two fronts (the API on the first).
struct Setup {
    stack: Stack,
    _worker: Worker,
    api: Worker,
    other: Worker,
}

fn setup() -> Setup {
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let mut api = Worker::front(&stack.nats.url(), &[("MANAGEMENT_API_KEY", OPERATOR)]);
    api.wait_http(STARTUP);
    let mut other = Worker::front(&stack.nats.url(), &[]);
    other.wait_http(STARTUP);
    Setup {
        stack,
        _worker: worker,
        api,
        other,
    }
}

/// A project with its table `items`.
fn project(s: &Setup, name: &str) -> Created {
    let p = create(&s.api, name);
    items(&s.stack, &p);
    p
}

/// Rotate `p`'s secret with a window of `secs`: (new secret, new anon key).
fn rotate(s: &Setup, p: &Created, secs: u64) -> (String, String) {
    let body = json!({ "previous_valid_secs": secs }).to_string();
    let (status, v) = op(
        &s.api,
        "POST",
        &format!("{}/rotate", path(&p.id)),
        Some(&body),
    );
    assert_eq!(status, 200, "{v}");
    let field = |k: &str| v[k].as_str().unwrap().to_string();
    (field("jwt_secret"), field("anon_key"))
}

/// An anon token of `p` signed with `secret`, distinct from any other (its `exp`).
fn user_token(p: &Created, secret: &str, salt: i64) -> String {
    let claims = json!({"role": "anon", "ref": p.id, "exp": now() + 3600 + salt});
    sign(secret, claims)
}

/// One server-sent event, or the stream's end.
#[derive(Debug)]
enum Sse {
    Event(String, Value),
    Ended,
}

/// An SSE stream of `p`'s `items` opened with `key`, its `ready` read.
fn sse(front: &Worker, p: &Created, key: &str) -> mpsc::Receiver<Sse> {
    let mut s = TcpStream::connect(("127.0.0.1", front.port)).expect("connect");
    let query = format!("apikey={key}&schema={}&table=items", p.schema);
    let req = format!("GET /realtime/v1/sse?{query} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut head = String::new();
    r.read_line(&mut head).expect("status line");
    assert!(head.contains(" 200 "), "{head}");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (mut event, mut data) = (String::new(), String::new());
        let mut body = false;
        for line in r.lines() {
            let Ok(line) = line else { break };
            if !body {
                body = line.is_empty();
            } else if line.is_empty() && !event.is_empty() {
                let v = serde_json::from_str(&data).unwrap_or(Value::String(data.clone()));
                let _ = tx.send(Sse::Event(std::mem::take(&mut event), v));
                data.clear();
            } else if let Some(v) = line.strip_prefix("event:") {
                event = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.trim_start());
            }
        }
        let _ = tx.send(Sse::Ended);
    });
    match rx.recv_timeout(APPLIED * 5) {
        Ok(Sse::Event(e, _)) if e == "ready" => rx,
        other => panic!("no ready: {other:?}"),
    }
}

/// The stream gets row `id` (its next event).
fn sse_gets(rx: &mpsc::Receiver<Sse>, id: i32, what: &str) {
    match rx.recv_timeout(APPLIED * 3) {
        Ok(Sse::Event(e, v)) if e == "postgres_changes" => {
            assert_eq!(v["data"]["record"]["id"], id, "{what}: {v}")
        }
        other => panic!("{what}: row {id} not received: {other:?}"),
    }
}

/// The stream is told `message` in a `system` error within `within`, then ends.
fn sse_ended(rx: &mpsc::Receiver<Sse>, message: &str, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Sse::Event(e, v)) if e == "system" => {
                assert_eq!(v["status"], "error", "{what}: {v}");
                assert_eq!(v["message"], message, "{what}: {v}");
                break;
            }
            Ok(Sse::Event(e, _)) if e == "postgres_changes" => {}
            other => panic!("{what}: not ended within {within:?}: {other:?}"),
        }
    }
    match rx.recv_timeout(APPLIED) {
        Ok(Sse::Ended) => {}
        other => panic!("{what}: the stream goes on after its end: {other:?}"),
    }
}

/// The channel `topic` of `sock` is shut with `message` within `within` (a `system` error
/// then `phx_close`, as on token expiry).
async fn shut_within(sock: &mut PhoenixClient, topic: &str, message: &str, within: Duration) {
    let shut = tokio::time::timeout(within, sock.expect_shut(topic, message)).await;
    assert!(shut.is_ok(), "{topic}: not shut within {within:?}");
}

/// Insert row `id` of `p`'s table; each socket of `socks` gets it on `topic`.
async fn all_get(s: &Setup, p: &Created, socks: &mut [&mut PhoenixClient], topic: &str, id: i32) {
    s.stack.sql(&format!(
        "INSERT INTO \"{}\".items VALUES ({id}, 'x')",
        p.schema
    ));
    for (n, sock) in socks.iter_mut().enumerate() {
        let f = sock
            .wait_frame("postgres_changes", APPLIED * 3, |d| {
                d["data"]["record"]["id"] == id
            })
            .await;
        assert_eq!(f[2], topic, "socket {n}: {f}");
    }
}

/// Join `topic` with `p`'s table and `token` as the join's `access_token`.
async fn subscribed_with(front: &Worker, p: &Created, topic: &str, token: &str) -> PhoenixClient {
    let mut sock = PhoenixClient::connect(&front.ws_url(token)).await;
    let config =
        json!({"postgres_changes": [{"event": "*", "schema": p.schema, "table": "items"}]});
    let (_, reply) = sock.join(topic, config, Some(token)).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    sock.wait_frame("system", APPLIED * 3, |d| d["status"] == "ok")
        .await;
    sock
}

/// Send `token` as the channel's new `access_token`.
async fn refresh(sock: &mut PhoenixClient, topic: &str, token: &str) {
    let r = sock.next_ref();
    let payload = json!({ "access_token": token });
    sock.send(Some("1"), Some(&r), topic, "access_token", payload)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_without_a_window_ends_old_sessions_on_every_front() {
    let _machine = crate::support::shared().await;
    let s = setup();
    let (a, b) = (project(&s, "A"), project(&s, "B"));
    let topic = "realtime:a";
    let mut on_api = subscribed(&s.api, &a, topic).await;
    let mut on_other = subscribed(&s.other, &a, topic).await;
    let stream = sse(&s.other, &a, &a.anon);
    let stream_api = sse(&s.api, &a, &a.anon);
    let mut sb = subscribed(&s.other, &b, "realtime:b").await;

    let (new_secret, new_anon) = rotate(&s, &a, 0);
    shut_within(&mut on_api, topic, REVOKED, APPLIED).await;
    shut_within(&mut on_other, topic, REVOKED, APPLIED).await;
    sse_ended(&stream, REVOKED, APPLIED, "SSE on the other front");
    sse_ended(&stream_api, REVOKED, APPLIED, "SSE on the API front");

    // The new key's sessions, and another project's, are served.
    let renewed = Created {
        anon: new_anon.clone(),
        ..clone(&a)
    };
    let mut fresh = subscribed(&s.other, &renewed, topic).await;
    let user = user_token(&a, &new_secret, 1);
    let mut fresh_user = subscribed_with(&s.api, &a, topic, &user).await;
    let fresh_stream = sse(&s.api, &a, &new_anon);
    all_get(&s, &a, &mut [&mut fresh, &mut fresh_user], topic, 1).await;
    sse_gets(&fresh_stream, 1, "the new key's stream");
    all_get(&s, &b, &mut [&mut sb], "realtime:b", 1).await;
    // And the old sockets got nothing more.
    on_api.assert_silent(Duration::from_millis(300)).await;
    on_other.assert_silent(Duration::from_millis(300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_with_a_window_serves_old_sessions_until_it_ends() {
    let _machine = crate::support::shared().await;
    let s = setup();
    let (a, b) = (project(&s, "A"), project(&s, "B"));
    let topic = "realtime:a";
    let mut on_api = subscribed(&s.api, &a, topic).await;
    let mut on_other = subscribed(&s.other, &a, topic).await;
    let mut renewed = subscribed(&s.other, &a, topic).await;
    let mut old_later = subscribed(&s.api, &a, topic).await;
    let stream = sse(&s.other, &a, &a.anon);
    let mut sb = subscribed(&s.api, &b, "realtime:b").await;

    let window = Duration::from_secs(8);
    let asked = Instant::now();
    let (new_secret, _) = rotate(&s, &a, window.as_secs());
    // Within the window: one channel moves to a token of the new secret, another to a
    // fresh token of the old one (accepted now, and ended with the window).
    refresh(&mut renewed, topic, &user_token(&a, &new_secret, 2)).await;
    refresh(&mut old_later, topic, &user_token(&a, &a.secret, 3)).await;
    let mut all = [&mut on_api, &mut on_other, &mut renewed, &mut old_later];
    all_get(&s, &a, &mut all, topic, 1).await;
    sse_gets(&stream, 1, "within the window");
    assert!(
        asked.elapsed() < window,
        "the window passed before the checks"
    );

    let ended_by = window + APPLIED;
    for sock in [&mut on_api, &mut on_other, &mut old_later] {
        let left = ended_by.saturating_sub(asked.elapsed());
        shut_within(sock, topic, REVOKED, left).await;
        assert!(
            asked.elapsed() >= window - Duration::from_millis(500),
            "ended before the window's end"
        );
    }
    sse_ended(
        &stream,
        REVOKED,
        ended_by.saturating_sub(asked.elapsed()),
        "SSE",
    );
    all_get(&s, &a, &mut [&mut renewed], topic, 2).await;
    all_get(&s, &b, &mut [&mut sb], "realtime:b", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suspension_and_deletion_end_sockets_and_streams_on_every_front() {
    let _machine = crate::support::shared().await;
    let s = setup();
    let (a, b) = (project(&s, "A"), project(&s, "B"));
    let topic = "realtime:a";
    let mut sb = subscribed(&s.other, &b, "realtime:b").await;
    let stream_b = sse(&s.api, &b, &b.anon);
    for (patch, message) in [(Some(r#"{"suspended": true}"#), SUSPENDED), (None, DELETED)] {
        let mut on_api = subscribed(&s.api, &a, topic).await;
        let mut on_other = subscribed(&s.other, &a, topic).await;
        let streams = [sse(&s.api, &a, &a.anon), sse(&s.other, &a, &a.anon)];
        let (status, v) = match patch {
            Some(body) => op(&s.api, "PATCH", &path(&a.id), Some(body)),
            None => op(&s.api, "DELETE", &path(&a.id), None),
        };
        assert_eq!(status, 200, "{v}");
        crate::management::assert_ended(&mut on_api, topic, message).await;
        crate::management::assert_ended(&mut on_other, topic, message).await;
        for st in &streams {
            sse_ended(st, message, APPLIED, message);
        }
        if patch.is_some() {
            op(
                &s.api,
                "PATCH",
                &path(&a.id),
                Some(r#"{"suspended": false}"#),
            );
            tokio::time::sleep(APPLIED).await;
        }
    }
    all_get(&s, &b, &mut [&mut sb], "realtime:b", 1).await;
    sse_gets(&stream_b, 1, "another project's stream");
}

fn clone(p: &Created) -> Created {
    Created {
        id: p.id.clone(),
        schema: p.schema.clone(),
        secret: p.secret.clone(),
        anon: p.anon.clone(),
    }
}
