//! SQL a tenant wrote never runs with walcast's powers (docs/security.md, "The two
//! logins"). Project B's own login writes a function that tries every way back to the
//! session user (`set_config('role', 'none')`, `RESET ROLE`, `SET ROLE NONE`,
//! `SET SESSION AUTHORIZATION`) or over to a role that bypasses row-level security, and
//! then, if it can read walcast's secrets or another project's hidden rows, takes a
//! session advisory lock: a mark that outlives the rolled-back check, so the test sees
//! on which connection, and with which powers, the function ran. It then switches back
//! to the role it was called as, so the rest of the check goes on as it would have. B's policies call it
//! on every path that runs tenant SQL: the row-level security checks of changes (own
//! values and a version judged by its row, where a column of B's domain type is
//! compared), SSE snapshots, private-channel checks. And the attack as first seen: an
//! SSE snapshot whose rows spell project A's JWT secret.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::{Msg, PhoenixClient};

use crate::support::projects::{binding, create_project, Project};
use crate::support::{Stack, Worker};

const STARTUP: Duration = Duration::from_secs(60);
/// Advisory-lock keys of the canary: `MARK + variant`.
const MARK: i64 = 4_242_000;

/// The ways back to more power that the canary tries, by variant.
const VARIANTS: &[(i32, &str)] = &[
    (0, "NULL"),
    (1, "PERFORM set_config('role', 'none', true)"),
    (2, "RESET ROLE"),
    (3, "SET LOCAL ROLE NONE"),
    (
        4,
        "PERFORM set_config('session_authorization', 'postgres', true)",
    ),
    (5, "SET LOCAL SESSION AUTHORIZATION DEFAULT"),
    (6, "SET LOCAL ROLE service_role"),
];

/// B's schema and login, A's hidden table, the canary, B's domain type.
fn tenants(stack: &Stack) -> (Project, Project) {
    let a = create_project(stack, "A");
    let b = create_project(stack, "B");
    let cases: String = VARIANTS
        .iter()
        .map(|(n, how)| format!("WHEN {n} THEN {how};"))
        .collect();
    stack.sql(&format!(
        "CREATE TABLE {a}.hidden (id int PRIMARY KEY);
         INSERT INTO {a}.hidden VALUES (1);
         ALTER TABLE {a}.hidden ENABLE ROW LEVEL SECURITY;
         GRANT SELECT ON {a}.hidden TO anon, authenticated, service_role;
         CREATE ROLE b_owner LOGIN;
         GRANT USAGE, CREATE ON SCHEMA {b} TO b_owner;
         SET ROLE b_owner;
         CREATE FUNCTION {b}.canary(variant int) RETURNS boolean LANGUAGE plpgsql AS $f$
         DECLARE
             powers boolean := false;
             entered text := current_user;
         BEGIN
             BEGIN
                 CASE variant {cases} ELSE NULL; END CASE;
             EXCEPTION WHEN OTHERS THEN NULL;
             END;
             BEGIN
                 powers := has_table_privilege('walcast.projects', 'SELECT');
             EXCEPTION WHEN OTHERS THEN NULL;
             END;
             BEGIN
                 powers := powers OR EXISTS (SELECT FROM {a}.hidden);
             EXCEPTION WHEN OTHERS THEN NULL;
             END;
             IF powers THEN
                 PERFORM pg_try_advisory_lock({MARK} + variant);
             END IF;
             -- Back as it came in, so the rest of the check runs as it would have.
             BEGIN
                 PERFORM set_config('role', entered, true);
             EXCEPTION WHEN OTHERS THEN NULL;
             END;
             RETURN true;
         END $f$;
         CREATE DOMAIN {b}.tag AS text CHECK ({b}.canary(9));
         RESET ROLE;",
        a = a.schema,
        b = b.schema,
    ));
    (a, b)
}

/// The canary's marks held by any session: (variant, holder's login).
fn marks(stack: &Stack) -> Vec<String> {
    let out = stack.sql(&format!(
        "SELECT l.objid::int8 - {MARK} || ' held by ' || a.usename FROM pg_locks l
           JOIN pg_stat_activity a ON a.pid = l.pid
          WHERE l.locktype = 'advisory' AND l.objid BETWEEN {MARK} AND {MARK} + 99"
    ));
    out.lines().map(str::to_string).collect()
}

/// `walcast serve` on the stack's database, serving once ready.
fn serve(stack: &Stack) -> Worker {
    let mut w = Worker::serve(&stack.pg.url(), &[]);
    w.wait_http(STARTUP);
    w
}

/// Enable `table` of `p` through the REST API (the project's service key).
fn enable(w: &Worker, p: &Project, table: &str) {
    let path = crate::support::projects::realtime_path(&p.id, table);
    let (status, body) = w.request(
        "PUT",
        &path,
        &[("apikey", p.service.as_str())],
        Some(r#"{"enabled": true}"#),
    );
    assert_eq!(status, 200, "enable {table}: {body}");
}

/// The records of an SSE snapshot of `table` read with `key`, in order.
fn snapshot(w: &Worker, key: &str, table: &str) -> Vec<Value> {
    let mut s = TcpStream::connect(("127.0.0.1", w.port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let req = format!(
        "GET /realtime/v1/sse?apikey={key}&table={table}&snapshot=true HTTP/1.0\r\nHost: x\r\n\r\n"
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut rows = Vec::new();
    let mut event = String::new();
    for line in BufReader::new(s).lines() {
        let line = line.expect("an SSE line within a minute");
        if let Some(e) = line.strip_prefix("event:") {
            event = e.trim().to_string();
        } else if let Some(d) = line.strip_prefix("data:") {
            match event.as_str() {
                "snapshot" => {
                    let v: Value = serde_json::from_str(d.trim()).unwrap();
                    rows.push(v["data"]["record"].clone());
                }
                "snapshot_done" => return rows,
                "ready" => {}
                other => panic!("unexpected event {other}: {d}"),
            }
        } else if line.starts_with("HTTP/") {
            assert!(line.contains(" 200 "), "{line}");
        }
    }
    panic!("the snapshot never ended");
}

fn assert_unmarked(stack: &Stack, what: &str) {
    let marks = marks(stack);
    assert!(
        marks.is_empty(),
        "{what}: tenant SQL ran with walcast's powers (variant {marks:?})"
    );
}

/// Changes judged on their own values, a version judged by its row (a column of B's
/// domain type compared), and an SSE snapshot: every variant of the canary runs, none
/// with more than the subscriber's powers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_of_changes_and_snapshots_run_without_walcasts_powers() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (_a, b) = tenants(&stack);
    stack.sql(&format!(
        "SET ROLE b_owner;
         CREATE TABLE {b}.notes (id int PRIMARY KEY, variant int NOT NULL, tag {b}.tag,
                                 big text NOT NULL DEFAULT '');
         ALTER TABLE {b}.notes ALTER COLUMN big SET STORAGE EXTERNAL;
         GRANT SELECT ON {b}.notes TO anon;
         ALTER TABLE {b}.notes ENABLE ROW LEVEL SECURITY;
         CREATE POLICY canary ON {b}.notes FOR SELECT TO anon
             USING (length(big) >= 0 AND {b}.canary(variant));",
        b = b.schema
    ));
    let server = serve(&stack);
    enable(&server, &b, "notes");
    // Only the key as old row: an UPDATE leaving `big` alone lacks it, so its version is
    // judged by the row, which walcast compares column by column.
    stack.sql(&format!(
        "ALTER TABLE {}.notes REPLICA IDENTITY DEFAULT",
        b.schema
    ));
    let mut sock = PhoenixClient::connect(&server.ws_url(&b.anon)).await;
    sock.join_subscribed("realtime:notes", binding(&b.schema, "notes"))
        .await;
    let rows: Vec<String> = VARIANTS
        .iter()
        .map(|(n, _)| format!("({n}, {n}, 't{n}', repeat(md5('{n}'), 100))"))
        .collect();
    stack.sql(&format!(
        "SET ROLE b_owner;
         INSERT INTO {b}.notes VALUES {};
         UPDATE {b}.notes SET tag = tag || '!';",
        rows.join(", "),
        b = b.schema
    ));
    // Every insert and every update reaches B's subscriber: the policy ran, and allowed.
    let mut seen = Vec::new();
    let deadline = Instant::now() + STARTUP;
    while seen.len() < 2 * VARIANTS.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        match sock.try_recv(left).await {
            Some(Msg::Frame(f)) if f[3] == "postgres_changes" => {
                let data = &f[4]["data"];
                seen.push((data["type"].clone(), data["record"]["id"].clone()));
            }
            Some(Msg::Frame(_)) => {}
            other => panic!(
                "changes within a minute: got {seen:?}, then {other:?}\n{}",
                server.log_text()
            ),
        }
    }
    assert_unmarked(&stack, "changes");
    let records = snapshot(&server, &b.anon, "notes");
    assert_eq!(records.len(), VARIANTS.len(), "{records:?}");
    assert_unmarked(&stack, "SSE snapshot");
}

/// The attack as first seen: B's policy resets the role and lets through the rows that
/// spell A's JWT secret; B's anon key asks for an SSE snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_cannot_spell_another_projects_secret() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (a, b) = tenants(&stack);
    stack.sql(&format!(
        "SET ROLE b_owner;
         CREATE TABLE {b}.spell (pos int, ch text, PRIMARY KEY (pos, ch));
         INSERT INTO {b}.spell SELECT p, substr('0123456789abcdef', c, 1)
           FROM generate_series(1, 64) p, generate_series(1, 16) c;
         CREATE FUNCTION {b}.spells(pos int, ch text) RETURNS boolean LANGUAGE plpgsql AS $f$
         BEGIN
             PERFORM set_config('role', 'none', true);
             RETURN EXISTS (SELECT FROM walcast.projects
                             WHERE name = 'A' AND substr(jwt_secret, pos, 1) = ch);
         EXCEPTION WHEN OTHERS THEN RETURN false;
         END $f$;
         GRANT SELECT ON {b}.spell TO anon;
         ALTER TABLE {b}.spell ENABLE ROW LEVEL SECURITY;
         CREATE POLICY spell ON {b}.spell FOR SELECT TO anon USING ({b}.spells(pos, ch));",
        b = b.schema
    ));
    let server = serve(&stack);
    enable(&server, &b, "spell");
    let rows = snapshot(&server, &b.anon, "spell");
    let spelt: String = rows
        .iter()
        .filter_map(|r| r["ch"].as_str())
        .collect::<Vec<_>>()
        .concat();
    assert_ne!(spelt, a.secret, "B's snapshot spelt A's secret");
    assert!(rows.is_empty(), "the policy saw walcast's table: {rows:?}");
}

/// A private channel's policy (the operator's, on `realtime.messages`) calling B's
/// function: the function runs without walcast's powers, for reads and writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_channel_policies_run_without_walcasts_powers() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (_a, b) = tenants(&stack);
    for (n, _) in VARIANTS {
        stack.sql(&format!(
            "CREATE POLICY read_{n} ON realtime.messages FOR SELECT TO anon
                 USING (realtime.topic() = 'room{n}' AND {b}.canary({n}));
             CREATE POLICY write_{n} ON realtime.messages FOR INSERT TO anon
                 WITH CHECK (realtime.topic() = 'room{n}' AND {b}.canary({n}));",
            b = b.schema
        ));
    }
    let server = serve(&stack);
    let url = server.ws_url(&b.anon).replace("vsn=2.0.0", "vsn=1.0.0");
    let mut sock = PhoenixClient::connect(&url).await;
    for (n, _) in VARIANTS {
        let topic = format!("realtime:room{n}");
        let config = json!({"private": true, "broadcast": {"self": true}});
        let (jr, reply) = sock.join(&topic, config, None).await;
        assert_eq!(reply[4]["status"], "ok", "join room{n}: {reply}");
        let r = format!("b{n}");
        let payload = json!({"type": "broadcast", "event": "e", "payload": {"n": n}});
        sock.send(Some(&jr), Some(&r), &topic, "broadcast", payload)
            .await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match sock.try_recv(left).await {
                Some(Msg::Frame(f)) if f[3] == "broadcast" => break,
                Some(Msg::Frame(_)) => {}
                other => panic!("room{n}: no broadcast back ({other:?})"),
            }
        }
    }
    assert_unmarked(&stack, "private channels");
}

/// The check login can commit nothing in `realtime.messages` (its rows exist only inside
/// the checks), nor read walcast's tables.
#[test]
fn the_check_login_commits_nothing_and_reads_no_secret() {
    let stack = Stack::start("stream");
    let (_a, b) = tenants(&stack);
    // Inserts pass the policies: only the check login's own rule can refuse them.
    stack.sql("CREATE POLICY any_insert ON realtime.messages FOR INSERT TO anon WITH CHECK (true)");
    let _server = serve(&stack);
    let check = walcast_testkit::as_check_login(&stack.pg.url());
    let psql = |sql: &str| {
        std::process::Command::new(stack.pg.bindir().join("psql"))
            .args(["-X", "-q", "-A", "-t", "-d", &check, "-c", sql])
            .output()
            .expect("psql")
    };
    for sql in [
        format!(
            "SET walcast.project = '{}'; SELECT walcast.probe_message('room')",
            b.id
        ),
        format!(
            "SET ROLE anon; SET walcast.project = '{}';
             INSERT INTO realtime.messages (topic, extension, payload)
             VALUES ('room', 'broadcast', '{{}}')",
            b.id
        ),
        "SELECT jwt_secret FROM walcast.projects".to_string(),
        "SELECT key FROM walcast.message_key".to_string(),
    ] {
        let out = psql(&sql);
        assert!(
            !out.status.success(),
            "the check login did: {sql}\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let stored = stack.sql("SELECT count(*) FROM realtime.messages");
    assert_eq!(stored.trim(), "0");
}

/// What a start with this check login says, once the process has exited.
fn refused(stack: &Stack, check: Option<&str>) -> String {
    let extra: Vec<(&str, &str)> = vec![("CHECK_DATABASE_URL", check.unwrap_or(""))];
    let mut w = Worker::serve(&stack.pg.url(), &extra);
    let deadline = Instant::now() + STARTUP;
    loop {
        if let Ok(Some(status)) = w.child.try_wait() {
            assert!(!status.success(), "{status}");
            return w.log_text();
        }
        assert!(
            Instant::now() < deadline,
            "started anyway: {}",
            w.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A missing check login, walcast's own, or one that may do more than act as the
/// subscriber roles is refused at start, saying why.
#[test]
fn a_missing_or_powerful_check_login_is_refused_at_start() {
    let stack = Stack::start("stream");
    let url = |login: &str| stack.pg.url_for(login, "postgres");
    let log = refused(&stack, None);
    assert!(log.contains("CHECK_DATABASE_URL is not set"), "{log}");
    let log = refused(&stack, Some(&stack.pg.url()));
    assert!(log.contains("is walcast's own login"), "{log}");
    let cases = [
        (
            "c_super",
            "CREATE ROLE c_super LOGIN SUPERUSER",
            "is a superuser",
        ),
        (
            "c_bypass",
            "CREATE ROLE c_bypass LOGIN BYPASSRLS",
            "bypasses row-level security",
        ),
        (
            "c_create",
            "CREATE ROLE c_create LOGIN CREATEROLE",
            "may create roles",
        ),
        (
            "c_repl",
            "CREATE ROLE c_repl LOGIN REPLICATION",
            "may replicate",
        ),
        (
            "c_service",
            "CREATE ROLE c_service LOGIN; GRANT service_role TO c_service",
            "may act as role \"service_role\"",
        ),
        (
            "c_walcast",
            "CREATE ROLE c_walcast LOGIN NOINHERIT; GRANT postgres TO c_walcast",
            "may act as role \"postgres\"",
        ),
        (
            "c_reads",
            "CREATE ROLE c_reads LOGIN; GRANT SELECT ON walcast.projects TO c_reads",
            "may read tables of the walcast schema",
        ),
    ];
    // The migrations (and the API roles) come with the first start.
    let mut ok = Worker::serve(&stack.pg.url(), &[]);
    ok.wait_http(STARTUP);
    drop(ok);
    for (login, create, why) in cases {
        stack.sql(create);
        let log = refused(&stack, Some(&url(login)));
        assert!(log.contains(why), "{login}: {log}");
        assert!(log.contains(login), "{login}: {log}");
    }
}

/// A change stream's snapshot reads a tenant's table on walcast's own login: its filter
/// is checked at start and evaluated chunk by chunk, on a column of the tenant's domain
/// type (whose `CHECK` calls the canary), and its rows are read whole. Nothing of the
/// tenant's runs there, and every row is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_stream_snapshot_runs_nothing_of_the_tenants() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (_a, b) = tenants(&stack);
    stack.sql(&format!(
        "GRANT CREATE ON SCHEMA public TO b_owner;
         SET ROLE b_owner;
         CREATE TYPE public.pair AS (x {b}.tag, y int);
         CREATE TABLE public.items (id int PRIMARY KEY, tag {b}.tag, p public.pair);
         INSERT INTO public.items SELECT g, 't' || (g % 2), ROW('x', g)::public.pair FROM generate_series(1, 50) g;
         ALTER TABLE public.items ENABLE ROW LEVEL SECURITY;
         CREATE POLICY canary ON public.items USING ({b}.canary(8));",
        b = b.schema
    ));
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_walcast"))
            .args(args)
            .env("DATABASE_URL", stack.pg.url())
            .output()
            .expect("run walcast")
    };
    let out = cli(&["changes", "enable", "items"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut worker = stack.worker(&[("SNAPSHOT_ROWS_PER_SEC", "0")]);
    worker.wait_active(STARTUP);
    let out = cli(&["snapshot", "start", "items", "--where", "tag=eq.t1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_unmarked(&stack, "snapshot start");
    let deadline = Instant::now() + STARTUP;
    loop {
        let state = stack.sql("SELECT state || ' ' || coalesce(error, '') FROM walcast.snapshots");
        if state.starts_with("done") {
            break;
        }
        assert!(
            !state.starts_with("failed") && Instant::now() < deadline,
            "snapshot: {state}\n{}",
            worker.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let done = stack.sql("SELECT rows_done FROM walcast.snapshots");
    assert_eq!(done.trim(), "25", "the rows with tag t1");
    assert_unmarked(&stack, "snapshot chunks");
    // A composite over the domain can be neither filtered on nor a key: refused, saying so.
    let out = cli(&["snapshot", "start", "items", "--where", "p=eq.(x,1)"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cannot filter on"),
        "{err}"
    );
    assert_unmarked(&stack, "a refused snapshot");
}
