//! The NATS permissions walcast ships (`docker/nats/walcast-permissions.conf`): a
//! cdc-worker and a ws-front, each as its own user, deliver a change and share presence
//! with no permission violation; `walcast tail`'s user reads the table subjects and
//! nothing else (no project secrets from `walcast.cdc.admin`, no other process's replies,
//! no forged change on a front's delivery subject); an outbox consumer's user consumes and
//! acknowledges `WALCAST_OUTBOX` and cannot read the changes. Without these permissions
//! any NATS user could do all of that.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures_util::StreamExt;
use serde_json::json;
use walcast_testkit::phoenix::PhoenixClient;
use walcast_testkit::{Nats, Postgres};

use crate::support::ws::anon;
use crate::support::{Stack, Worker};

const PERMISSIONS: &str = include_str!("../../docker/nats/walcast-permissions.conf");
const USERS: [(&str, &str); 4] = [
    ("WORKER", "worker-pw"),
    ("FRONT", "front-pw"),
    ("TAIL", "tail-pw"),
    ("OUTBOX", "outbox-pw"),
];

/// The shipped file with the passwords filled in (nats-server reads them from its
/// environment in a deployment).
fn conf() -> String {
    USERS.iter().fold(PERMISSIONS.to_string(), |c, (who, pw)| {
        c.replace(&format!("$WALCAST_NATS_{who}_PASSWORD"), &format!("{pw:?}"))
    })
}

async fn connect_as(port: u16, user: &str, pw: &str, inbox: &str) -> async_nats::Client {
    async_nats::ConnectOptions::with_user_and_password(user.into(), pw.into())
        .custom_inbox_prefix(inbox)
        .connect(format!("nats://127.0.0.1:{port}"))
        .await
        .expect("connect as a walcast NATS user")
}

fn violations(nats: &Nats, user: &str) -> Vec<String> {
    let who = format!("User {user:?}");
    nats.log_text()
        .lines()
        .filter(|l| l.contains("Violation") && l.contains(&who))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_walcast_user_does_its_job_and_nothing_more() {
    let _machine = crate::support::shared().await;
    let nats = Nats::start_with_conf(Some(conf())).expect("nats-server with the permissions");
    let port = nats.port();
    let url = |user: &str, pw: &str| format!("nats://{user}:{pw}@127.0.0.1:{port}");
    let stack = Stack {
        pg: Postgres::start().unwrap(),
        nats,
        source: "stream",
    };
    stack.sql("CREATE TABLE t (id int PRIMARY KEY)");
    stack.enable("t");
    let mut worker = Worker::spawn(&stack.pg.url(), &url("walcast-worker", "worker-pw"), &[]);
    worker.wait_active(Duration::from_secs(60));
    let mut front = Worker::front(&url("walcast-front", "front-pw"), &[]);
    front.wait_http(Duration::from_secs(60));

    // The tail's user follows the table subject.
    let tail = connect_as(port, "walcast-tail", "tail-pw", "_WALCAST_INBOX.tail").await;
    let mut changes = tail.subscribe("walcast.realtime.>").await.unwrap();
    tail.flush().await.unwrap();

    let mut ws = PhoenixClient::connect(&front.ws_url(&anon())).await;
    let config = json!({"presence": {"key": "", "enabled": true}, "broadcast": {"self": false}, "postgres_changes": [{"event": "INSERT", "schema": "public", "table": "t"}], "private": false});
    let (jr, reply) = ws.join("realtime:t", config, None).await;
    let refused = |n: &Nats| {
        n.log_text()
            .lines()
            .filter(|l| l.contains("Violation"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        reply[4]["status"],
        "ok",
        "{reply}\n{}\nFRONT {}\nWORKER {}",
        refused(&stack.nats),
        front.log_text(),
        worker.log_text()
    );
    ws.wait_frame("system", Duration::from_secs(30), |p| p["status"] == "ok")
        .await;
    // Tracking writes the presence to the shared KV bucket (the front's JetStream rights).
    let track = json!({"type": "presence", "event": "track", "payload": {"who": "me"}});
    ws.send(Some(&jr), Some("p1"), "realtime:t", "presence", track)
        .await;
    ws.wait_frame("phx_reply", Duration::from_secs(10), |p| {
        p["status"] == "ok"
    })
    .await;
    stack.sql("INSERT INTO t VALUES (7)");
    let f = ws
        .wait_frame("postgres_changes", Duration::from_secs(30), |_| true)
        .await;
    assert_eq!(f[4]["data"]["record"]["id"], 7, "{f}");
    let seen = tokio::time::timeout(Duration::from_secs(10), changes.next()).await;
    assert!(
        matches!(seen, Ok(Some(_))),
        "the tail user receives the change"
    );

    // What the tail's user may not do.
    let secrets = tail
        .request("walcast.cdc.admin", r#"{"op":"projects"}"#.into())
        .await;
    assert!(
        secrets.is_err(),
        "the tail user got an admin reply: {secrets:?}"
    );
    let forged = json!({"commit_lsn": "FFFFFFFF/FFFFFFFF"}).to_string();
    tail.publish("walcast.deliver.x", forged.into())
        .await
        .unwrap();
    tail.publish("walcast.realtime.default.public.t", "{}".into())
        .await
        .unwrap();
    let snoop = tail.subscribe("_WALCAST_INBOX.front.>").await.unwrap();
    tail.flush().await.unwrap();
    drop(snoop);

    // The outbox consumer's user consumes and acknowledges the outbox stream.
    stack.sql("SELECT walcast.emit('orders.paid', 'k1', '{\"n\": 1}')");
    let consumer_client = connect_as(port, "walcast-outbox", "outbox-pw", "_INBOX").await;
    let js = jetstream::new(consumer_client.clone());
    let stream = loop {
        match js.get_stream("WALCAST_OUTBOX").await {
            Ok(s) => break s,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let pull = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("perm-test".into()),
            ..Default::default()
        })
        .await
        .expect("the outbox user creates a consumer");
    let mut msgs = pull.messages().await.unwrap();
    let m = tokio::time::timeout(Duration::from_secs(30), msgs.next())
        .await
        .expect("an outbox event within 30 s")
        .unwrap()
        .unwrap();
    assert_eq!(m.subject.as_str(), "walcast.outbox.default.orders.paid");
    m.ack().await.unwrap();
    let peek = consumer_client
        .subscribe("walcast.realtime.>")
        .await
        .unwrap();
    consumer_client.flush().await.unwrap();
    drop(peek);

    // Let the server log what it refused, then read it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let nats = &stack.nats;
    for user in ["walcast-worker", "walcast-front"] {
        assert_eq!(violations(nats, user), Vec::<String>::new(), "{user}");
    }
    let tail_refused = violations(nats, "walcast-tail").join("\n");
    for what in [
        "walcast.cdc.admin",
        "walcast.deliver.x",
        "walcast.realtime.default",
        "_WALCAST_INBOX.front",
    ] {
        assert!(
            tail_refused.contains(what),
            "{what} not refused:\n{tail_refused}"
        );
    }
    let outbox_refused = violations(nats, "walcast-outbox").join("\n");
    assert!(
        outbox_refused.contains("walcast.realtime"),
        "{outbox_refused}"
    );
    assert_eq!(
        outbox_refused.lines().count(),
        1,
        "only the peek was refused:\n{outbox_refused}"
    );
}
