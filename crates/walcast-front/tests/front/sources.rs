//! Sources: a front follows the leaders of several sources over a real NATS. Two
//! stand-in leaders, the default source's and source `s2`'s, serve the subscription
//! subjects with the worker's own `serve_nats`; project `p2` is on `s2`, the default
//! project on the default source.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use walcast_bus::links::{ResendHandler, ResendReply, ResendRequest};
use walcast_bus::source::HEADER_SOURCE;
use walcast_bus::subs::{
    BoxFuture, RegisterRequest, ResyncProgress, SubsClient, SubsHandler, SubscriptionSpec,
};
use walcast_bus::{Bus, HEADER_FRONT_SEQ, HEADER_ORIGIN, HEADER_TERM};
use walcast_front::{Front, FrontConfig, Projects};
use walcast_testkit::tokens::Claims;
use walcast_testkit::Nats;

use crate::support::{connect, Call, PhoenixClient, TestWorker, SECRET, TIMEOUT};

const P2_SECRET: &str = "p2-secret-with-enough-bytes-0123456789";

/// A change to publish: project, schema, row id, subscription id.
type Change<'a> = (&'a str, &'a str, u64, &'a str);

/// A stand-in leader's resend service: records what it is asked, has nothing to resend.
#[derive(Default)]
struct Resends(Mutex<Vec<ResendRequest>>);

impl ResendHandler for Resends {
    fn resend(&self, req: ResendRequest) -> BoxFuture<ResendReply> {
        let reply = ResendReply::lost(req.from, req.from, "not kept in this test");
        self.0.lock().unwrap().push(req);
        Box::pin(async move { reply })
    }
}

fn resends(bus: &Bus, source: &'static str, cancel: &CancellationToken) -> Arc<Resends> {
    let resends = Arc::new(Resends::default());
    let (handler, bus, c) = (resends.clone(), bus.clone(), cancel.clone());
    tokio::spawn(async move {
        let handler = handler as Arc<dyn ResendHandler>;
        let served = walcast_bus::links::serve_nats(&bus, source, handler, c.cancelled_owned());
        served.await.unwrap();
    });
    resends
}

struct Sources {
    _nats: Nats,
    bus: Bus,
    /// The stand-in leaders of the default source and of `s2`.
    default: Arc<TestWorker>,
    s2: Arc<TestWorker>,
    /// Their resend services.
    default_resends: Arc<Resends>,
    s2_resends: Arc<Resends>,
    front: Front,
    addr: SocketAddr,
    cancel: CancellationToken,
}

impl Drop for Sources {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A stand-in leader of `source` serving its subscription subjects; returns once it
/// answers registrations.
async fn leader(bus: &Bus, source: &'static str, cancel: &CancellationToken) -> Arc<TestWorker> {
    let worker = Arc::new(TestWorker::default());
    let (handler, bus2, c) = (worker.clone(), bus.clone(), cancel.clone());
    tokio::spawn(async move {
        let (resynced, _) = tokio::sync::oneshot::channel();
        let handler = handler as Arc<dyn SubsHandler>;
        let shutdown = c.cancelled_owned();
        let served = walcast_bus::subs::serve_nats(
            &bus2,
            source,
            handler,
            HashSet::new(),
            resynced,
            shutdown,
        );
        served.await.unwrap();
    });
    let probe = SubsClient::new(bus, None).unwrap();
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let asked = probe.register(
            source,
            RegisterRequest { subs: Vec::new() },
            Duration::from_millis(500),
        );
        if asked.await.is_ok() {
            return worker;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{source} never served"
        );
    }
}

async fn start() -> Sources {
    let nats = Nats::start().unwrap();
    let bus = Bus::nats(&nats.url(), "front-sources-test").await.unwrap();
    let cancel = CancellationToken::new();
    let default = leader(&bus, "default", &cancel).await;
    let s2 = leader(&bus, "s2", &cancel).await;
    let (default_resends, s2_resends) = (
        resends(&bus, "default", &cancel),
        resends(&bus, "s2", &cancel),
    );
    let projects = Projects::new(SECRET);
    projects.insert_on("p2", "project_p2", P2_SECRET, "s2");
    let subs = SubsClient::new(&bus, None).unwrap();
    let front = Front::start(
        FrontConfig::default(),
        bus.clone(),
        subs,
        projects,
        cancel.clone(),
    )
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (router, c) = (front.router(), cancel.clone());
    tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async move { c.cancelled().await })
            .await
            .unwrap();
    });
    Sources {
        _nats: nats,
        bus,
        default,
        s2,
        default_resends,
        s2_resends,
        front,
        addr,
        cancel,
    }
}

impl Sources {
    /// A socket of the default project, or of `p2`.
    async fn client(&self, p2: bool) -> PhoenixClient {
        let key = if p2 {
            Claims::role("anon").claim("ref", "p2").sign(P2_SECRET)
        } else {
            Claims::role("anon").sign(SECRET)
        };
        let url = format!(
            "ws://{}/realtime/v1/websocket?apikey={key}&vsn=2.0.0",
            self.addr
        );
        connect(&url).await
    }

    /// Publish a change of `project` to this front, as the leader of `source` (`None`:
    /// no `Walcast-Source` header, the default source).
    async fn change(&self, source: Option<&str>, project: &str, schema: &str, id: u64, sub: &str) {
        let headers: Vec<(&str, &str)> = source.map(|s| (HEADER_SOURCE, s)).into_iter().collect();
        self.publish(&headers, (project, schema, id, sub)).await;
    }

    /// [`Sources::change`] numbered `n` in the stream of `source`'s leader of `term`.
    async fn numbered(&self, source: Option<&str>, term: &str, n: u64, change: Change<'_>) {
        let n = n.to_string();
        let mut headers = vec![
            (HEADER_TERM, term),
            (HEADER_ORIGIN, "leader-process"),
            (HEADER_FRONT_SEQ, n.as_str()),
        ];
        headers.extend(source.map(|s| (HEADER_SOURCE, s)));
        self.publish(&headers, change).await;
    }

    async fn publish(&self, headers: &[(&str, &str)], change: Change<'_>) {
        let (project, schema, id, sub) = change;
        let lsn = 0x10_0000 + id;
        let ev = json!({
            "project": project, "schema": schema, "table": "t", "type": "INSERT",
            "commit_timestamp": "2026-01-01T00:00:00.123Z",
            "commit_lsn": format!("0/{lsn:X}"), "seq": 0,
            "columns": [{"name": "id", "type": "int8"}], "pk": ["id"],
            "record": {"id": id}, "subs": [sub],
        });
        self.bus
            .publish(
                walcast_bus::subject::delivery_subject(self.front.id()),
                headers,
                Bytes::from(serde_json::to_vec(&ev).unwrap()),
            )
            .await
            .unwrap();
    }

    async fn wait_for(&self, what: &str, f: impl Fn(&Sources) -> bool) {
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        while !f(self) {
            assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The subscriptions a stand-in leader was asked to register (its readiness probes,
/// empty, left out), as ids per request.
fn registrations(w: &TestWorker) -> Vec<Vec<String>> {
    w.register_calls()
        .into_iter()
        .filter(|r| !r.is_empty())
        .map(|r| r.into_iter().map(|s: SubscriptionSpec| s.id).collect())
        .collect()
}

fn t_in(schema: &str) -> Value {
    json!([{"event": "*", "schema": schema, "table": "t"}])
}

#[tokio::test]
async fn a_projects_subscriptions_go_to_the_leader_of_its_source() {
    let s = start().await;
    let mut c = s.client(true).await;
    let jr = c.join_subscribed("realtime:a", t_in("project_p2")).await;
    let on_s2 = registrations(&s.s2);
    assert_eq!(on_s2.len(), 1, "{on_s2:?}");
    assert!(
        registrations(&s.default).is_empty(),
        "nothing on the default subject"
    );
    let id = on_s2[0][0].clone();

    // The periodic sync: s2's list has it, the default's (still sent: the workers learn
    // from it that this front lives) does not.
    let synced = |w: &TestWorker, want: &[String]| {
        w.calls.lock().unwrap().iter().any(|c| match c {
            Call::Sync(m) => m.front == s.front.id() && m.ids == want,
            _ => false,
        })
    };
    s.wait_for("s2's sync", |s| synced(&s.s2, std::slice::from_ref(&id)))
        .await;
    s.wait_for("the default's sync", |s| synced(&s.default, &[]))
        .await;

    c.send(Some(&jr), Some("9"), "realtime:a", "phx_leave", json!({}))
        .await;
    s.wait_for("unregistered on s2", |s| {
        s.s2.unregistered() == [id.clone()]
    })
    .await;
    assert!(s.default.unregistered().is_empty());
}

#[tokio::test]
async fn a_resync_of_one_source_registers_only_its_subscriptions() {
    let s = start().await;
    let (mut c2, mut c1) = (s.client(true).await, s.client(false).await);
    c2.join_subscribed("realtime:a", t_in("project_p2")).await;
    c1.join_subscribed("realtime:b", t_in("public")).await;
    let p2_id = registrations(&s.s2)[0][0].clone();
    assert_eq!(registrations(&s.default).len(), 1);

    // s2's new leader asks, on s2's own resync subject.
    let inbox = format!("test.resync.{}", rand_suffix());
    let mut progress = s.bus.subscribe(&inbox).await.unwrap();
    let subject = walcast_bus::source::subject("s2", walcast_bus::subs::SUBJECT_RESYNC);
    s.bus
        .publish(subject, &[], Bytes::from(inbox.clone()))
        .await
        .unwrap();
    for done in [false, true] {
        let m = tokio::time::timeout(TIMEOUT, progress.next())
            .await
            .expect("resync progress")
            .unwrap();
        let p: ResyncProgress = serde_json::from_slice(&m.payload).unwrap();
        assert_eq!((p.front.as_str(), p.done), (s.front.id(), done));
    }
    assert_eq!(registrations(&s.s2), [vec![p2_id.clone()], vec![p2_id]]);
    assert_eq!(
        registrations(&s.default).len(),
        1,
        "the default source's are left alone"
    );
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

#[tokio::test]
async fn a_source_speaks_only_for_its_own_projects() {
    let s = start().await;
    let (mut c2, mut c1) = (s.client(true).await, s.client(false).await);
    c2.join_subscribed("realtime:a", t_in("project_p2")).await;
    c1.join_subscribed("realtime:b", t_in("public")).await;
    let p2_id = registrations(&s.s2)[0][0].clone();
    let default_id = registrations(&s.default)[0][0].clone();

    // s2's leader, for its own project: delivered.
    s.change(Some("s2"), "p2", "project_p2", 1, &p2_id).await;
    let m = c2.recv_event("postgres_changes").await;
    assert_eq!(m.payload()["data"]["record"], json!({"id": 1}));

    // s2's leader for the default project (forged, far ahead to poison the replay
    // guard), and the default leader for p2: both dropped.
    s.change(Some("s2"), "default", "public", 0xFFFF, &default_id)
        .await;
    s.change(None, "p2", "project_p2", 0xFFFF, &p2_id).await;
    c1.assert_silent(Duration::from_millis(300)).await;
    c2.assert_silent(Duration::from_millis(300)).await;

    // The genuine streams go on, their positions untouched by the forgeries.
    s.change(None, "default", "public", 2, &default_id).await;
    let m = c1.recv_event("postgres_changes").await;
    assert_eq!(m.payload()["data"]["record"], json!({"id": 2}));
    s.change(Some("s2"), "p2", "project_p2", 3, &p2_id).await;
    let m = c2.recv_event("postgres_changes").await;
    assert_eq!(m.payload()["data"]["record"], json!({"id": 3}));
}

/// Two leaders' numbered streams on one delivery subject: their terms and numbers are
/// unrelated, and a gap in s2's stream is asked of s2's leader and told to s2's channels
/// only, while the default source's stream goes on.
#[tokio::test]
async fn a_gap_in_one_sources_stream_is_its_own() {
    let s = start().await;
    let (mut c2, mut c1) = (s.client(true).await, s.client(false).await);
    c2.join_subscribed("realtime:a", t_in("project_p2")).await;
    c1.join_subscribed("realtime:b", t_in("public")).await;
    let p2_id = registrations(&s.s2)[0][0].clone();
    let default_id = registrations(&s.default)[0][0].clone();
    let record = |m: Value| m[4]["data"]["record"]["id"].clone();

    s.numbered(None, "1", 1, ("default", "public", 1, &default_id))
        .await;
    assert_eq!(record(c1.recv_frame().await), 1);
    s.numbered(Some("s2"), "7", 1, ("p2", "project_p2", 2, &p2_id))
        .await;
    assert_eq!(record(c2.recv_frame().await), 2);
    // Term 7 of s2 says nothing of the default source's term 1.
    s.numbered(None, "1", 2, ("default", "public", 3, &default_id))
        .await;
    assert_eq!(record(c1.recv_frame().await), 3);

    // s2's number 2 never comes: 3 is held, s2's leader is asked and has lost 2.
    s.numbered(Some("s2"), "7", 3, ("p2", "project_p2", 4, &p2_id))
        .await;
    let lost = c2.recv_frame().await;
    assert_eq!(
        (&lost[3], &lost[4]["status"]),
        (&json!("system"), &json!("error")),
        "{lost}"
    );
    assert_eq!(record(c2.recv_frame().await), 4, "then what was held");
    let asked = s.s2_resends.0.lock().unwrap().clone();
    assert!(!asked.is_empty());
    assert_eq!((asked[0].term, asked[0].from), (7, 2));
    assert!(
        s.default_resends.0.lock().unwrap().is_empty(),
        "the default's leader is not asked"
    );

    // The default source's channel heard nothing of it, and its stream goes on.
    s.numbered(None, "1", 3, ("default", "public", 5, &default_id))
        .await;
    let next = c1.recv_frame().await;
    assert_eq!(
        next[3], "postgres_changes",
        "no loss told to the default's channel: {next}"
    );
    assert_eq!(record(next), 5);
}
