//! Shared helpers for the end-to-end tests: a real Postgres and nats-server from the
//! test kit, the real `cdc-worker` binary as a child process, and a NATS collector.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use walcast_bus::{Bus, ChangeEvent};
use walcast_testkit::{free_port, Nats, Postgres};

pub mod outbox;
pub mod projects;
pub mod ws;

pub use walcast_testkit::SECRETS_KEY;

/// `plain` encrypted for its place with [`SECRETS_KEY`], as walcast stores it: for the
/// tests that write `walcast.projects` and `walcast.sources` rows directly.
pub fn sealed(place: walcast_control::secrets::Place<'_>, plain: &str) -> String {
    walcast_control::secrets::SecretKeys::new(SECRETS_KEY, None)
        .and_then(|k| k.seal(place, plain))
        .expect("seal a secret")
}

/// The end-to-end tests run in one binary, two at a time, and share two cores. A test
/// whose assertions depend on timing under load (a fast reader beside a slow one, a drain
/// deadline, a thousand joins on one socket) runs alone: it holds [`alone`] while every
/// other test holds [`shared`].
static MACHINE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

pub async fn shared() -> tokio::sync::RwLockReadGuard<'static, ()> {
    MACHINE.read().await
}

pub async fn alone() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    MACHINE.write().await
}

/// Generates one test per CDC source (`poll`, `stream`) for each listed async test
/// function taking the source name: the same test body runs against both.
#[macro_export]
macro_rules! both_sources {
    ($($name:ident),* $(,)?) => {
        mod poll {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let _machine = $crate::support::shared().await;
                    super::$name("poll").await
                }
            )*
        }
        mod stream {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let _machine = $crate::support::shared().await;
                    super::$name("stream").await
                }
            )*
        }
    };
}

pub struct Stack {
    pub pg: Postgres,
    pub nats: Nats,
    /// CDC_SOURCE for the workers this stack starts.
    pub source: &'static str,
}

impl Stack {
    pub fn start(source: &'static str) -> Stack {
        Stack::with_pg(Postgres::builder().start().expect("start postgres"), source)
    }

    pub fn with_pg(pg: Postgres, source: &'static str) -> Stack {
        Stack {
            pg,
            nats: Nats::start().expect("start nats-server"),
            source,
        }
    }

    pub fn worker(&self, extra: &[(&str, &str)]) -> Worker {
        let mut env = vec![("CDC_SOURCE", self.source)];
        env.extend_from_slice(extra);
        let mut w = Worker::spawn(&self.pg.url(), &self.nats.url(), &env);
        w.source = Some(self.source);
        w
    }

    /// Run SQL (several statements allowed) as superuser.
    pub fn sql(&self, sql: &str) -> String {
        self.pg
            .psql(sql)
            .unwrap_or_else(|e| panic!("sql failed: {e}\n{sql}"))
    }

    /// Create a table and enable realtime on it through the CLI.
    pub fn enable(&self, table: &str) {
        let out = Command::new(env!("CARGO_BIN_EXE_walcast"))
            .args(["realtime", "enable", table])
            .env("DATABASE_URL", self.pg.url())
            .output()
            .expect("run walcast realtime enable");
        assert!(
            out.status.success(),
            "walcast realtime enable {table} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // As a Supabase project's default privileges do: subscribers' roles may read it.
        self.sql(&format!(
            "GRANT SELECT ON {table} TO anon, authenticated, service_role"
        ));
    }
}

/// `METRICS_API_KEY` of every process the tests start, unless a test sets its own: what
/// [`Worker::get`] (its `/metrics`, its full `/health`) reads the figures with.
pub const FIGURES_KEY: &str = "e2e-figures-key-0123456789abcdef0123456789";

/// A `cdc-worker` child process, killed on drop.
pub struct Worker {
    pub child: Child,
    /// The CDC source it was started with, when known (checked once active).
    pub source: Option<&'static str>,
    pub port: u16,
    pub log: PathBuf,
    /// The key it reads its figures with (`METRICS_API_KEY`, else `MANAGEMENT_API_KEY`).
    pub figures_key: Option<String>,
    _dir: tempfile::TempDir,
}

impl Worker {
    pub fn spawn(db: &str, nats: &str, extra: &[(&str, &str)]) -> Worker {
        let base = [
            ("DATABASE_URL", db),
            ("NATS_URL", nats),
            ("CDC_POLL_IDLE_MS", "20"),
            // A restarted worker retries the election lock every second.
            ("LEASE_DURATION_SECS", "3"),
        ];
        Worker::launch(env!("CARGO_BIN_EXE_cdc-worker"), &[], &base, extra)
    }

    /// `walcast serve` (CDC pipeline + realtime front, in-process bus) as a child process,
    /// with `JWT_SECRET` = [`ws::SECRET`] and `extra` environment variables.
    pub fn serve(db: &str, extra: &[(&str, &str)]) -> Worker {
        let base = [("DATABASE_URL", db), ("JWT_SECRET", ws::SECRET)];
        Worker::launch(env!("CARGO_BIN_EXE_walcast"), &["serve"], &base, extra)
    }

    /// A `ws-front` on `nats` (`JWT_SECRET` = [`ws::SECRET`]), serving once
    /// [`Worker::wait_http`] returns.
    pub fn front(nats: &str, extra: &[(&str, &str)]) -> Worker {
        let base = [("NATS_URL", nats), ("JWT_SECRET", ws::SECRET)];
        Worker::launch(env!("CARGO_BIN_EXE_ws-front"), &[], &base, extra)
    }

    /// Wait until the process answers `GET /health`.
    pub fn wait_http(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.get("/health").is_none() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("process exited ({status}):\n{}", self.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "no /health within {timeout:?}; log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// An HTTP request to this process: (status, body).
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> (u16, String) {
        http_request(self.port, method, path, headers, body)
            .unwrap_or_else(|| panic!("{method} {path}: no HTTP answer"))
    }

    /// GET a path: (status, body); panics if nothing answers.
    pub fn status(&self, path: &str) -> (u16, String) {
        self.request("GET", path, &[], None)
    }

    /// Send a signal (`TERM`, `STOP`, `CONT` …) to the process.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([format!("-{sig}"), self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{sig} {}", self.child.id());
    }

    /// Start `program args` with a clean environment (`base`, then `extra`), a free port
    /// on 127.0.0.1, JSON logs into a file of its own.
    fn launch(
        program: &str,
        args: &[&str],
        base: &[(&str, &str)],
        extra: &[(&str, &str)],
    ) -> Worker {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("process.log");
        let out = std::fs::File::create(&log).expect("log file");
        let port = free_port().expect("free port");
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("PORT", port.to_string())
            .env("HOST", "127.0.0.1")
            .env("LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("clone"))
            .stderr(out);
        for (k, v) in base.iter().chain(extra) {
            cmd.env(k, v);
        }
        // The check login every kit cluster has, on the same database, unless the test
        // sets CHECK_DATABASE_URL itself (empty: none); the same for the key of the
        // secrets at rest and the key that reads the figures.
        let all = || base.iter().chain(extra);
        if !all().any(|(k, _)| *k == "SECRETS_KEY") {
            cmd.env("SECRETS_KEY", SECRETS_KEY);
        }
        let figures_key = figures_key(all());
        if !all().any(|(k, _)| *k == "METRICS_API_KEY") {
            cmd.env("METRICS_API_KEY", FIGURES_KEY);
        }
        if let Some((_, db)) = all().find(|(k, _)| *k == "DATABASE_URL") {
            if !all().any(|(k, _)| *k == "CHECK_DATABASE_URL") {
                cmd.env("CHECK_DATABASE_URL", walcast_testkit::as_check_login(db));
            }
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
        Worker {
            child,
            source: None,
            port,
            log,
            figures_key,
            _dir: dir,
        }
    }

    /// The WebSocket URL of a front (`walcast serve`) with this apikey, vsn 2.0.0.
    pub fn ws_url(&self, apikey: &str) -> String {
        format!(
            "ws://127.0.0.1:{}/realtime/v1/websocket?apikey={apikey}&vsn=2.0.0",
            self.port
        )
    }

    /// A field of `/proc/<pid>/status` in kB (`VmRSS`, `VmHWM`).
    pub fn proc_kb(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find(|l| l.split(':').next() == Some(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc/{}/status", self.child.id()))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of the process's log, for a failure message.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// GET a path of the worker's HTTP server, as the operator (with its figures key:
    /// `/metrics` and the full `/health`).
    pub fn get(&self, path: &str) -> Option<String> {
        let auth = self.figures_key.as_ref().map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("Authorization", a.as_str())).collect();
        http_request(self.port, "GET", path, &headers, None).map(|(_, body)| body)
    }

    pub fn health(&self) -> Option<serde_json::Value> {
        self.get("/health")
            .and_then(|b| serde_json::from_str(&b).ok())
    }

    /// Wait until `/health` says `cdc_active: true`.
    pub fn wait_active(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(h) = self.health() {
                if h["cdc_active"] == true {
                    let log = self.log_text();
                    match self.source {
                        Some("stream") => {
                            assert!(log.contains("starting replication stream"), "{log}")
                        }
                        Some("poll") => {
                            assert!(!log.contains("starting replication stream"), "{log}")
                        }
                        _ => {}
                    }
                    return;
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "cdc-worker exited ({status}) before becoming active:\n{}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "cdc-worker not active within {timeout:?}; health: {:?}\nlog:\n{}",
                self.health(),
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait for the process to exit by itself; returns (success, log).
    pub fn wait_exit(&mut self, timeout: Duration) -> (bool, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return (status.success(), self.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "cdc-worker still running after {timeout:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Value of a Prometheus sample, e.g. `walcast_cdc_slot_lost_total` or
    /// `walcast_cdc_changes_skipped_total{reason="event"}` (see [`sample_sum`]).
    pub fn metric(&self, selector: &str) -> Option<f64> {
        sample_sum(&self.get("/metrics")?, selector)
    }
}

/// The key a process started with `env` reads its figures with: its `METRICS_API_KEY`
/// ([`FIGURES_KEY`] when unset), else its `MANAGEMENT_API_KEY`; empty ones are unset.
fn figures_key<'a>(env: impl Iterator<Item = &'a (&'a str, &'a str)> + Clone) -> Option<String> {
    let find = |name: &str| env.clone().find(|(k, _)| *k == name).map(|(_, v)| *v);
    let metrics = find("METRICS_API_KEY").unwrap_or(FIGURES_KEY);
    let management = find("MANAGEMENT_API_KEY").unwrap_or_default();
    [metrics, management]
        .into_iter()
        .find(|k| !k.is_empty())
        .map(String::from)
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The sum of the samples of a `/metrics` body that `selector` names (`name`, or
/// `name{k="v",…}`): the same name and each label given, whatever other labels they carry
/// (a worker's series carry `source`). `None` when none.
pub fn sample_sum(body: &str, selector: &str) -> Option<f64> {
    fn split(series: &str) -> (&str, Vec<&str>) {
        match series.split_once('{') {
            Some((name, labels)) => (
                name,
                labels
                    .trim_end_matches('}')
                    .split(',')
                    .filter(|l| !l.is_empty())
                    .collect(),
            ),
            None => (series, Vec::new()),
        }
    }
    let (name, want) = split(selector);
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| {
            let (n, labels) = split(series);
            n == name && want.iter().all(|w| labels.contains(w))
        })
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .fold(None, |sum, v| Some(sum.unwrap_or(0.0) + v))
}

#[test]
fn samples_are_found_whatever_other_labels_they_carry() {
    let body = "# TYPE a counter\na{source=\"default\"} 2\nb{reason=\"x\",source=\"s1\"} 1\nb{reason=\"y\",source=\"s1\"} 5\nc 7\n";
    assert_eq!(sample_sum(body, "a"), Some(2.0));
    assert_eq!(sample_sum(body, "b{reason=\"x\"}"), Some(1.0));
    assert_eq!(sample_sum(body, "b"), Some(6.0));
    assert_eq!(sample_sum(body, "c"), Some(7.0));
    assert_eq!(sample_sum(body, "d"), None);
}

pub fn http_get(port: u16, path: &str) -> Option<String> {
    http_request(port, "GET", path, &[], None).map(|(_, body)| body)
}

/// One HTTP/1.0 request: (status, body). A body is sent as JSON.
pub fn http_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    let mut req = format!("{method} {path} HTTP/1.0\r\nHost: localhost\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body.unwrap_or(""));
    s.write_all(req.as_bytes()).ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    text.split_once("\r\n\r\n")
        .map(|(_, b)| (status, b.to_string()))
}

/// Collects every change event published on NATS, in arrival order, each with the
/// audience the worker sent the fronts (its `subs` and `restricted`, with class keys
/// expanded into the ids of the subscriptions registered with that class, sorted).
#[derive(Clone)]
pub struct Collector {
    pub events: Arc<Mutex<Vec<(String, ChangeEvent)>>>,
    /// When each event of `events` arrived (same order).
    arrived: Arc<Mutex<Vec<std::time::SystemTime>>>,
    /// Every change message (table and delivery subjects) as it arrived.
    arrivals: Arc<Mutex<Vec<Arrival>>>,
    notify: Arc<tokio::sync::Notify>,
}

/// One change message as it arrived on NATS.
#[derive(Clone, Debug)]
pub struct Arrival {
    /// `Walcast-Origin`: the instance that published it.
    pub origin: String,
    pub at: Instant,
    pub subject: String,
    pub position: (walcast_wal2json::Lsn, u32),
    /// `Walcast-Term`: the publishing leader's term.
    pub term: Option<u64>,
}

/// Audiences seen on the fronts' delivery subjects, waiting for their change.
#[derive(Default)]
struct Audiences {
    /// (front, class key) → subscription ids, from the registrations seen.
    classes: std::collections::HashMap<(String, String), Vec<String>>,
    pending: std::collections::HashMap<(walcast_wal2json::Lsn, u32), ChangeEvent>,
}

impl Audiences {
    fn register(&mut self, payload: &[u8]) {
        let Ok(req) = serde_json::from_slice::<walcast_bus::subs::RegisterRequest>(payload) else {
            return;
        };
        for spec in req.subs {
            let ids = self
                .classes
                .entry((spec.front.clone(), walcast_bus::subs::class_key(&spec)))
                .or_default();
            if !ids.contains(&spec.id) {
                ids.push(spec.id);
            }
        }
    }

    fn expand(&self, front: &str, ids: &[String]) -> Vec<String> {
        ids.iter()
            .flat_map(
                |id| match self.classes.get(&(front.to_string(), id.clone())) {
                    Some(members) if walcast_bus::subs::is_class_key(id) => members.clone(),
                    _ => vec![id.clone()],
                },
            )
            .collect()
    }

    /// A front's share of a change (sent before the change itself).
    fn delivery(&mut self, front: &str, ev: ChangeEvent) {
        let subs = self.expand(front, &ev.subs);
        let restricted: Vec<walcast_bus::Restriction> = ev
            .restricted
            .iter()
            .map(|r| walcast_bus::Restriction {
                columns: r.columns.clone(),
                subs: self.expand(front, &r.subs),
            })
            .collect();
        let entry = self.pending.entry(ev.position()).or_insert_with(|| {
            let mut bare = ev.clone();
            bare.subs.clear();
            bare.restricted.clear();
            bare
        });
        entry.subs.extend(subs);
        for r in restricted {
            match entry.restricted.iter_mut().find(|x| x.columns == r.columns) {
                Some(x) => x.subs.extend(r.subs),
                None => entry.restricted.push(r),
            }
        }
    }

    /// The change itself: its audience is complete.
    fn complete(&mut self, mut ev: ChangeEvent) -> ChangeEvent {
        if let Some(seen) = self.pending.remove(&ev.position()) {
            ev.subs = seen.subs;
            ev.restricted = seen.restricted;
        }
        ev.subs.sort();
        for r in &mut ev.restricted {
            r.subs.sort();
        }
        ev
    }
}

impl Collector {
    pub async fn start(nats_url: &str) -> Collector {
        let bus = Bus::nats(nats_url, "e2e-collector")
            .await
            .expect("connect collector");
        // One subscription, so registrations, deliveries and changes keep their order.
        let mut sub = bus.subscribe("walcast.>").await.expect("subscribe");
        // A round trip makes sure the subscription is registered before we return.
        bus.barrier().await.expect("barrier");
        let c = Collector {
            events: Arc::new(Mutex::new(Vec::new())),
            arrived: Arc::new(Mutex::new(Vec::new())),
            arrivals: Arc::new(Mutex::new(Vec::new())),
            notify: Arc::new(tokio::sync::Notify::new()),
        };
        let c2 = c.clone();
        tokio::spawn(async move {
            let _keep = bus;
            let mut audiences = Audiences::default();
            let deliver = format!("{}.", walcast_bus::subject::DELIVER_PREFIX);
            while let Some(msg) = sub.next().await {
                if msg.subject == walcast_bus::subs::SUBJECT_REGISTER {
                    audiences.register(&msg.payload);
                    continue;
                }
                let front = msg
                    .subject
                    .strip_prefix(&deliver)
                    .map(|t| walcast_bus::subject::decode_token(t).expect("front token"));
                if front.is_none()
                    && walcast_bus::subject::parse_change_subject(&msg.subject).is_err()
                {
                    continue;
                }
                // Heartbeats and notices are not changes; a resent message was seen.
                if msg.header(walcast_bus::HEADER_NOTICE).is_some()
                    || msg.header(walcast_bus::HEADER_RESENT).is_some()
                {
                    continue;
                }
                let ev: ChangeEvent = serde_json::from_slice(&msg.payload).unwrap_or_else(|e| {
                    panic!(
                        "bad event JSON {e}: {}",
                        String::from_utf8_lossy(&msg.payload)
                    )
                });
                let lsn = msg.header(walcast_bus::HEADER_LSN).map(str::to_string);
                assert_eq!(lsn, Some(ev.commit_lsn.to_string()), "Walcast-Lsn header");
                c2.arrivals.lock().unwrap().push(Arrival {
                    origin: msg
                        .header(walcast_bus::HEADER_ORIGIN)
                        .unwrap_or_default()
                        .to_string(),
                    at: Instant::now(),
                    subject: msg.subject.clone(),
                    position: ev.position(),
                    term: msg
                        .header(walcast_bus::HEADER_TERM)
                        .and_then(|t| t.parse().ok()),
                });
                if let Some(front) = front {
                    audiences.delivery(&front, ev);
                    continue;
                }
                assert!(ev.subs.is_empty(), "a change subject carries no audience");
                let ev = audiences.complete(ev);
                let mut events = c2.events.lock().unwrap();
                c2.arrived
                    .lock()
                    .unwrap()
                    .push(std::time::SystemTime::now());
                events.push((msg.subject, ev));
                drop(events);
                c2.notify.notify_waiters();
            }
        });
        c
    }

    pub fn len(&self) -> usize {
        self.events.lock().unwrap().len()
    }

    /// Every change message (table and delivery subjects) with its origin, in arrival
    /// order.
    pub fn messages(&self) -> Vec<Arrival> {
        self.arrivals.lock().unwrap().clone()
    }

    pub fn snapshot(&self) -> Vec<ChangeEvent> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .map(|(_, e)| e.clone())
            .collect()
    }

    /// When each event of [`Collector::snapshot`] arrived, in the same order.
    pub fn arrivals(&self) -> Vec<std::time::SystemTime> {
        let _events = self.events.lock().unwrap();
        self.arrived.lock().unwrap().clone()
    }

    pub fn subjects(&self) -> Vec<String> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// Wait until `pred` holds on the events, or fail with `what`.
    pub async fn wait_until(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[ChangeEvent]) -> bool,
    ) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if pred(&self.snapshot()) {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let n = self.len();
                panic!("timed out after {timeout:?} waiting for {what}; {n} events received");
            }
        }
    }

    pub async fn wait_count(&self, n: usize, timeout: Duration) {
        self.wait_until(&format!("{n} events"), timeout, |e| e.len() >= n)
            .await
    }
}

/// The `record` (or `old_record`) of an event as a JSON value.
pub fn rec(ev: &ChangeEvent) -> serde_json::Value {
    serde_json::from_str(ev.record.as_ref().expect("record").get()).expect("record json")
}

pub fn old(ev: &ChangeEvent) -> serde_json::Value {
    serde_json::from_str(ev.old_record.as_ref().expect("old_record").get()).expect("old json")
}

/// Drop replays: keep an event only if its (commit_lsn, seq) is past the last one kept.
pub fn dedup(events: &[ChangeEvent]) -> Vec<ChangeEvent> {
    let mut last = None;
    let mut out = Vec::new();
    for e in events {
        if last.is_some_and(|l| e.position() <= l) {
            continue;
        }
        last = Some(e.position());
        out.push(e.clone());
    }
    out
}

/// Writers inserting `(writer, i)` rows into a table, each in its own session, one
/// transaction per row, until stopped.
pub struct Writers {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<i64>>,
}

impl Writers {
    pub async fn start(pg: &Postgres, table: &str, count: i32) -> Writers {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tasks = Vec::new();
        for writer in 0..count {
            let client = pg.connect().await.expect("writer connect");
            let stop = stop.clone();
            let sql = format!("INSERT INTO {table} VALUES ($1, $2)");
            tasks.push(tokio::spawn(async move {
                let stmt = client.prepare(&sql).await.expect("prepare insert");
                let mut i = 0i32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    client.execute(&stmt, &[&writer, &i]).await.expect("insert");
                    i += 1;
                }
                i as i64
            }));
        }
        Writers { stop, tasks }
    }

    /// Stop them; rows written per writer.
    pub async fn stop(self) -> std::collections::HashMap<i64, i64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut written = std::collections::HashMap::new();
        for (w, t) in self.tasks.into_iter().enumerate() {
            written.insert(w as i64, t.await.expect("writer task"));
        }
        written
    }
}

/// Every writer's rows arrived once each, in its own order; returns nothing on success.
pub fn assert_writers_complete_in_order(
    kept: &[ChangeEvent],
    written: &std::collections::HashMap<i64, i64>,
    what: &str,
) {
    let mut next: std::collections::HashMap<i64, i64> = std::collections::HashMap::new();
    for e in kept {
        let r = rec(e);
        let (w, i) = (r["writer"].as_i64().unwrap(), r["i"].as_i64().unwrap());
        let expected = next.entry(w).or_insert(0);
        assert_eq!(i, *expected, "writer {w}: {what}");
        *expected += 1;
    }
    assert_eq!(&next, written, "every writer's rows, all of them");
}
