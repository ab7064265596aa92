//! Hostile identifiers and filters crafted as SQL: refused with a clear error, nothing
//! executed, and everyone else keeps receiving.

use crate::support;

use std::process::Command;
use std::time::Duration;

use crate::support::{rec, Collector, Stack};
use walcast_bus::subs::{RegisterRequest, SubsClient, SubscriptionSpec};
use walcast_bus::Bus;

fn spec(id: &str, schema: &str, table: &str, filter: Option<&str>) -> SubscriptionSpec {
    SubscriptionSpec {
        id: id.into(),
        front: "f".into(),
        project: "default".into(),
        schema: schema.into(),
        table: Some(table.into()),
        event: "*".into(),
        filter: filter.map(String::from),
        select: None,
        claims: serde_json::json!({"role": "anon"}).into(),
        from: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_crafted_identifiers_and_filters_are_refused_and_run_nothing() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE t (id int PRIMARY KEY, v text)");
    stack.enable("t");

    // The CLI quotes identifiers: a crafted name is just a table that does not exist.
    let out = Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(["realtime", "enable", "\"t\"\"; DROP TABLE t; --\""])
        .env("DATABASE_URL", stack.pg.url())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does not exist"), "{err}");

    // A table streams for one project: enabling it for another is refused, not rerouted.
    let out = Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(["realtime", "--project", "other", "enable", "t"])
        .env("DATABASE_URL", stack.pg.url())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already enabled for project \"default\""),
        "{err}"
    );
    assert_eq!(
        stack
            .sql("SELECT string_agg(project_id, ',') FROM walcast.realtime_tables WHERE table_name = 't'")
            .trim(),
        "default"
    );

    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let bus = Bus::nats(&stack.nats.url(), "security-test").await.unwrap();
    let subs = SubsClient::new(&bus, None).unwrap();
    let hostile = [
        spec("h1", "public", "t\"; DROP TABLE t; --", None),
        spec("h2", "public\"; DROP TABLE t; --", "t", None),
        spec("h3", "public", "t", Some("id=eq.1); DROP TABLE t; --")),
        spec(
            "h4",
            "public",
            "t",
            Some("\"id\"\"; DROP TABLE t; --\"=eq.1"),
        ),
        spec("h5", "public", "t", Some("v=eq.'); DROP TABLE t; --")),
        spec("h6", "public", "t", Some("id=in.(1,2);DROP TABLE t")),
        spec("ok", "public", "t", None),
    ];
    let reply = subs
        .register(
            walcast_bus::source::DEFAULT_SOURCE,
            RegisterRequest {
                subs: hostile.to_vec(),
            },
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let verdicts: Vec<(String, bool)> =
        reply.results.iter().map(|r| (r.id.clone(), r.ok)).collect();
    // h5 is a valid filter whose value is the literal text `'); DROP TABLE t; --`.
    assert_eq!(
        verdicts,
        [
            ("h1".into(), false),
            ("h2".into(), false),
            ("h3".into(), false),
            ("h4".into(), false),
            ("h5".into(), true),
            ("h6".into(), false),
            ("ok".into(), true),
        ],
        "{:?}",
        reply.results
    );
    for r in reply.results.iter().filter(|r| !r.ok) {
        let e = r.error.as_deref().unwrap_or_default();
        assert!(
            e.starts_with("Unable to subscribe") || e.starts_with("Error parsing `filter` params"),
            "{}: {e}",
            r.id
        );
    }

    stack.sql("INSERT INTO t VALUES (1, 'plain')");
    stack.sql("INSERT INTO t VALUES (2, '''); DROP TABLE t; --')");
    collector.wait_count(2, Duration::from_secs(60)).await;
    let events = collector.snapshot();
    assert_eq!(events[0].subs, ["ok"]);
    assert_eq!(rec(&events[0])["v"], "plain");
    // The literal value matched only the row that holds it.
    assert_eq!(events[1].subs, ["h5", "ok"]);
    // Nothing ran: the table is still there with both rows.
    assert_eq!(stack.sql("SELECT count(*) FROM t"), "2");
}

/// Every connection walcast makes — catalog and registrar, replication (stream source),
/// the poll source, the lease, row-level security checks — goes over TLS to a Postgres
/// that refuses TCP without it, verifying the server's certificate and name
/// (`sslmode=verify-full`); a CA that did not sign the server's certificate is refused
/// with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_uses_verified_tls_to_a_tls_only_postgres() {
    let _machine = crate::support::shared().await;
    use crate::support::ws::token;
    use crate::support::Worker;
    use walcast_testkit::phoenix::PhoenixClient;
    use walcast_testkit::tls::TestCerts;
    use walcast_testkit::Postgres;

    let certs = TestCerts::generate().expect("test certificates (needs openssl)");
    let pg = Postgres::builder()
        .tls_only(&certs.server_cert, &certs.server_key)
        .start()
        .expect("start a TLS-only postgres");
    let port = pg.port();
    let stack = Stack::with_pg(pg, "stream");
    let url = |ca: &std::path::Path| {
        format!(
            "postgres://postgres@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={}",
            ca.display()
        )
    };
    stack.sql("CREATE TABLE s (id int PRIMARY KEY, owner text)");
    for (n, source) in ["stream", "poll"].into_iter().enumerate() {
        let mut server = Worker::serve(
            &url(&certs.ca),
            &[("CDC_SOURCE", source), ("LEASE_MODE", "postgres")],
        );
        server.wait_active(Duration::from_secs(60));
        if n == 0 {
            stack.enable("s");
            stack.sql(
                "ALTER TABLE s ENABLE ROW LEVEL SECURITY;
                 CREATE POLICY mine ON s FOR SELECT
                   USING (owner = current_setting('request.jwt.claims', true)::json->>'sub')",
            );
        }
        let exp = support::ws::now() + 3600;
        let alice = token(serde_json::json!({"role": "authenticated", "sub": "alice", "exp": exp}));
        let mut ws = PhoenixClient::connect(&server.ws_url(&alice)).await;
        ws.join_subscribed(
            "realtime:s",
            serde_json::json!([{"event": "INSERT", "schema": "public", "table": "s"}]),
        )
        .await;
        let base = n as i32 * 10;
        stack.sql(&format!(
            "INSERT INTO s VALUES ({}, 'bob'); INSERT INTO s VALUES ({}, 'alice')",
            base + 1,
            base + 2
        ));
        let f = loop {
            let f = ws.recv_frame().await;
            if f[3] == "postgres_changes" {
                break f;
            }
        };
        let got = &f[4]["data"]["record"];
        assert_eq!(
            got["id"],
            base + 2,
            "{source}: alice sees her row only, first: {f}"
        );
        let plain = stack.sql(
            "SELECT count(*) FILTER (WHERE NOT s.ssl) || ' ' || count(*) FILTER (WHERE s.ssl)
               FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
              WHERE a.client_addr IS NOT NULL AND a.pid <> pg_backend_pid()",
        );
        let (without, with) = plain.split_once(' ').unwrap();
        assert_eq!(without, "0", "{source}: TCP connections without TLS");
        let with: u32 = with.parse().unwrap();
        assert!(
            with >= 4,
            "{source}: only {with} TLS connections (catalog, lease, RLS, source)"
        );
    }

    // The wrong CA: refused, saying why.
    let mut wrong = Worker::serve(&url(&certs.other_ca), &[]);
    let (ok, log) = wrong.wait_exit(Duration::from_secs(60));
    assert!(
        !ok,
        "must fail with an untrusted server certificate:\n{log}"
    );
    assert!(
        log.contains("invalid peer certificate: UnknownIssuer"),
        "{log}"
    );
}

/// NATS over TLS with nkey authentication: a cdc-worker and a ws-front given the CA
/// (`NATS_CA_FILE`) and a user's nkey seed (`NATS_NKEY_FILE`) deliver a change to a
/// client; a front trusting another CA never connects and says so on `/readyz` and
/// `/health`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_over_tls_with_an_nkey() {
    let _machine = crate::support::shared().await;
    use crate::support::ws::anon;
    use crate::support::Worker;
    use walcast_testkit::phoenix::PhoenixClient;
    use walcast_testkit::tls::TestCerts;
    use walcast_testkit::{Nats, Postgres};

    let certs = TestCerts::generate().expect("test certificates (needs openssl)");
    let user = nkeys::KeyPair::new_user();
    let dir = tempfile::tempdir().unwrap();
    let seed = dir.path().join("user.nk");
    std::fs::write(&seed, user.seed().unwrap()).unwrap();
    let conf = format!(
        "tls {{ cert_file: {:?}, key_file: {:?} }}\nauthorization {{ users = [ {{ nkey: {} }} ] }}\n",
        certs.server_cert.display().to_string(),
        certs.server_key.display().to_string(),
        user.public_key()
    );
    let nats = Nats::start_with_conf(Some(conf)).expect("nats-server with TLS and nkeys");
    let url = format!("tls://localhost:{}", nats.port());
    let pg = Postgres::start().unwrap();
    let stack = Stack {
        pg,
        nats,
        source: "stream",
    };
    stack.sql("CREATE TABLE t (id int PRIMARY KEY)");
    stack.enable("t");
    let (ca, nk) = (certs.ca.display().to_string(), seed.display().to_string());
    let auth = [
        ("NATS_CA_FILE", ca.as_str()),
        ("NATS_NKEY_FILE", nk.as_str()),
    ];
    let mut worker = Worker::spawn(&stack.pg.url(), &url, &auth);
    worker.wait_active(Duration::from_secs(60));
    let mut front = Worker::front(&url, &auth);
    front.wait_http(Duration::from_secs(60));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while front.status("/readyz").0 != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            front.status("/readyz")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut ws = PhoenixClient::connect(&front.ws_url(&anon())).await;
    ws.join_subscribed(
        "realtime:t",
        serde_json::json!([{"event": "INSERT", "schema": "public", "table": "t"}]),
    )
    .await;
    stack.sql("INSERT INTO t VALUES (7)");
    let f = loop {
        let f = ws.recv_frame().await;
        if f[3] == "postgres_changes" {
            break f;
        }
    };
    assert_eq!(f[4]["data"]["record"]["id"], 7, "{f}");

    // Trusting another CA: never connected, and /readyz says why it is not ready.
    let other = certs.other_ca.display().to_string();
    let mut wrong = Worker::front(&url, &[("NATS_CA_FILE", &other), ("NATS_NKEY_FILE", &nk)]);
    wrong.wait_http(Duration::from_secs(60));
    std::thread::sleep(Duration::from_secs(2));
    let (status, why) = wrong.status("/readyz");
    assert_eq!(status, 503, "{why}");
    assert!(why.contains("NATS"), "{why}");
    assert_eq!(wrong.health().unwrap()["bus_connected"], false);
}
