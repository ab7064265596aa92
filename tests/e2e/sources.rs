//! Sources end to end (README "Sources"): `walcast source add|list|remove` against real
//! Postgres clusters (the control database and the sources' own), checks that refuse an
//! unusable database with its fix, passwords never shown, and projects whose schema is
//! in a source's database while their row stays in the control database.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;
use walcast_testkit::Postgres;

/// `walcast <args>` with DATABASE_URL = `control`'s.
fn walcast(control: &Postgres, args: &[&str]) -> Output {
    walcast_on(&control.url(), args)
}

/// `walcast <args>` on `database_url`. A `--source-database-url` among the arguments (of
/// `source add`) comes with its server's check login (SOURCE_CHECK_URL).
fn walcast_on(database_url: &str, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_walcast"));
    cmd.args(args)
        .env("DATABASE_URL", database_url)
        .env("SECRETS_KEY", crate::support::SECRETS_KEY)
        .env_remove("CDC_SLOT_NAME");
    if let Some(i) = args.iter().position(|a| *a == "--source-database-url") {
        if let Some(db) = args.get(i + 1) {
            cmd.env("SOURCE_CHECK_URL", walcast_testkit::as_check_login(db));
        }
    }
    cmd.output()
        .unwrap_or_else(|e| panic!("run walcast {args:?}: {e}"))
}

fn ok(out: Output, what: &str) -> Value {
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text}"))
}

/// The command failed; its stderr.
fn failed(out: Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success(),
        "{what} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    err
}

fn names(control: &Postgres) -> Vec<String> {
    let list = ok(walcast(control, &["source", "list"]), "source list");
    list.as_array()
        .expect("an array")
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect()
}

fn one(pg: &Postgres, sql: &str) -> String {
    pg.psql(sql).unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sources_are_checked_listed_and_refused() {
    let _machine = crate::support::shared().await;
    let mut pgs = Postgres::start_many(2).expect("start postgres");
    let (shop, control) = (pgs.pop().unwrap(), pgs.pop().unwrap());
    let list = ok(walcast(&control, &["source", "list"]), "source list");
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!(list[0]["name"], "default");
    assert_eq!(list[0]["database_url"], Value::Null);
    assert_eq!(list[0]["slot_name"], Value::Null);

    // Checked: preflight passes, walcast's migrations are applied to it.
    let added = ok(
        walcast(
            &control,
            &[
                "source",
                "add",
                "shop",
                "--source-database-url",
                &shop.url(),
            ],
        ),
        "source add shop",
    );
    assert_eq!(added["name"], "shop");
    assert_eq!(added["slot_name"], "walcast_src_shop");
    assert_eq!(
        one(
            &shop,
            "SELECT to_regclass('walcast.realtime_tables') IS NOT NULL"
        ),
        "t"
    );
    // The check's temporary slot is gone.
    assert_eq!(one(&shop, "SELECT count(*) FROM pg_replication_slots"), "0");
    // Declared again as it is (a chart's upgrade hook): no change; otherwise refused.
    let again = [
        "source",
        "add",
        "shop",
        "--source-database-url",
        &shop.url(),
        "--if-missing",
    ];
    assert_eq!(
        ok(walcast(&control, &again), "add --if-missing")["name"],
        "shop"
    );
    let other = format!("{}?application_name=x", shop.url());
    let differs = walcast(
        &control,
        &[
            "source",
            "add",
            "shop",
            "--source-database-url",
            &other,
            "--if-missing",
        ],
    );
    assert!(!differs.status.success(), "a different shop was accepted");

    // Unchecked, with passwords in its URLs: stored as given, shown without them.
    let vault_db = "postgres://walcast:hunter2@127.0.0.1:1/vault?sslmode=disable";
    let vault_repl = "postgres://repl@127.0.0.1:1/vault?password=s3cret";
    let added = walcast(
        &control,
        &[
            "source",
            "add",
            "vault-2",
            "--source-database-url",
            vault_db,
            "--replication-url",
            vault_repl,
            "--skip-check",
        ],
    );
    let text = String::from_utf8_lossy(&added.stdout).to_string();
    let added = ok(added, "source add vault-2");
    assert_eq!(added["slot_name"], "walcast_src_vault_2");
    let out = walcast(&control, &["source", "list"]);
    let listed = String::from_utf8_lossy(&out.stdout).to_string();
    let list = ok(out, "source list");
    for shown in [&text, &listed] {
        assert!(
            !shown.contains("hunter2") && !shown.contains("s3cret"),
            "a password shown: {shown}"
        );
    }
    assert_eq!(list.as_array().map(Vec::len), Some(3), "{list}");
    assert_eq!(
        list[2]["database_url"],
        "postgres://walcast:***@127.0.0.1:1/vault?sslmode=disable"
    );
    assert_eq!(
        list[2]["replication_url"],
        "postgres://repl@127.0.0.1:1/vault?password=***"
    );
    // Stored encrypted, bound to its row and column.
    let stored = one(
        &control,
        "SELECT database_url FROM walcast.sources WHERE name = 'vault-2'",
    );
    assert!(
        stored.starts_with("enc:v1:") && !stored.contains("hunter2"),
        "{stored}"
    );
    let keys =
        walcast_control::secrets::SecretKeys::new(crate::support::SECRETS_KEY, None).expect("keys");
    let place = walcast_control::secrets::Place::source("database_url", "vault-2");
    assert_eq!(keys.open(place, &stored).expect("decrypts"), vault_db);

    refusals(&control, &shop);
    assert_eq!(names(&control), ["default", "shop", "vault-2"]);
}

/// Duplicates, bad names and unusable databases are refused, each saying why, and
/// nothing is stored.
fn refusals(control: &Postgres, shop: &Postgres) {
    let add = |args: &[&str]| {
        let mut argv = vec!["source", "add"];
        argv.extend(args);
        failed(walcast(control, &argv), &format!("{args:?}"))
    };
    let e = add(&[
        "shop",
        "--source-database-url",
        "postgres://x/y",
        "--skip-check",
    ]);
    assert!(e.contains("a source named \"shop\" already exists"), "{e}");
    let e = add(&[
        "other",
        "--source-database-url",
        "postgres://x/y",
        "--slot-name",
        "walcast_src_shop",
        "--skip-check",
    ]);
    assert!(
        e.contains("\"walcast_src_shop\" is already the slot of another source"),
        "{e}"
    );
    let thirty_one = "a".repeat(31);
    for bad in [
        "../x",
        "a.b",
        "*",
        "Default",
        "default",
        &thirty_one,
        "1x",
        "a b",
    ] {
        let e = add(&[
            bad,
            "--source-database-url",
            "postgres://x/y",
            "--skip-check",
        ]);
        assert!(
            e.contains("source name") || e.contains("default source"),
            "{bad}: {e}"
        );
    }
    for bad in ["Bad", "a-b", "x.y"] {
        let e = add(&[
            "fine",
            "--source-database-url",
            "postgres://x/y",
            "--slot-name",
            bad,
            "--skip-check",
        ]);
        assert!(e.contains("slot name"), "{bad}: {e}");
    }
    let e = add(&[
        "fine",
        "--source-database-url",
        "postgres://x/y",
        "--slot-name",
        "walcast_cdc_slot",
        "--skip-check",
    ]);
    assert!(e.contains("CDC_SLOT_NAME"), "{e}");

    // A server without logical decoding: refused with the fix.
    let replica = Postgres::builder()
        .setting("wal_level", "replica")
        .start()
        .expect("start postgres (wal_level=replica)");
    let e = add(&["old", "--source-database-url", &replica.url()]);
    assert!(
        e.contains("wal_level is \"replica\"")
            && e.contains("ALTER SYSTEM SET wal_level = logical"),
        "{e}"
    );
    assert_eq!(
        one(&replica, "SELECT to_regclass('walcast.sources') IS NULL"),
        "t",
        "migrations applied to a refused source"
    );
    // The control database itself.
    let e = add(&["self", "--source-database-url", &control.url()]);
    assert!(e.contains("is the control database itself"), "{e}");
    // A database that does not exist.
    let e = add(&[
        "gone",
        "--source-database-url",
        &shop.url_for("postgres", "nope"),
    ]);
    assert!(e.contains("connecting to") && e.contains("nope"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn projects_on_a_source_live_in_its_database() {
    let _machine = crate::support::shared().await;
    let mut pgs = Postgres::start_many(2).expect("start postgres");
    let (shop, control) = (pgs.pop().unwrap(), pgs.pop().unwrap());
    ok(
        walcast(
            &control,
            &[
                "source",
                "add",
                "shop",
                "--source-database-url",
                &shop.url(),
            ],
        ),
        "source add shop",
    );
    let p = ok(
        walcast(
            &control,
            &["project", "create", "--name", "Shop", "--source", "shop"],
        ),
        "project create --source shop",
    );
    assert_eq!(p["source"], "shop");
    let (id, schema) = (p["id"].as_str().unwrap(), p["schema"].as_str().unwrap());
    let exists = format!("SELECT count(*) FROM pg_namespace WHERE nspname = '{schema}'");
    assert_eq!(
        one(&shop, &exists),
        "1",
        "the schema is in the source's database"
    );
    assert_eq!(
        one(&control, &exists),
        "0",
        "the schema is in the control database"
    );
    assert_eq!(
        one(
            &shop,
            &format!("SELECT has_schema_privilege('anon', '{schema}', 'USAGE')")
        ),
        "t"
    );
    assert_eq!(
        one(
            &control,
            &format!("SELECT source FROM walcast.projects WHERE id = '{id}'")
        ),
        "shop"
    );
    assert_eq!(
        one(&shop, "SELECT count(*) FROM walcast.projects"),
        "0",
        "the project's row is in the source's database"
    );
    let list = ok(walcast(&control, &["project", "list"]), "project list");
    assert_eq!(list[0]["source"], "shop", "{list}");
    let got = ok(walcast(&control, &["project", "get", id]), "project get");
    assert_eq!(got["source"], "shop", "{got}");

    let e = failed(
        walcast(
            &control,
            &["project", "create", "--name", "X", "--source", "nope"],
        ),
        "project create --source nope",
    );
    assert!(e.contains("unknown source \"nope\""), "{e}");
    let e = failed(
        walcast(&control, &["source", "remove", "shop"]),
        "source remove shop with a project",
    );
    assert!(e.contains("still has 1 project(s)"), "{e}");

    // Realtime on a table of the project, in the source's database; deleting the
    // project turns it off there.
    shop.psql(&format!(
        "CREATE TABLE \"{schema}\".items (id int PRIMARY KEY, v text)"
    ))
    .expect("create table");
    let out = walcast_on(
        &shop.url(),
        &[
            "realtime",
            "--project",
            id,
            "enable",
            &format!("{schema}.items"),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let registered =
        format!("SELECT count(*) FROM walcast.realtime_tables WHERE project_id = '{id}'");
    assert_eq!(one(&shop, &registered), "1");
    let deleted = ok(
        walcast(&control, &["project", "delete", id]),
        "project delete",
    );
    assert_eq!(deleted["deleted"], true, "{deleted}");
    assert_eq!(deleted["tables"][0]["table"], "items", "{deleted}");
    assert_eq!(one(&shop, &registered), "0");
    assert_eq!(one(&control, "SELECT count(*) FROM walcast.projects"), "0");
    assert_eq!(one(&shop, &exists), "1", "the schema and its data are kept");

    // Removed, its (inactive) slot dropped.
    shop.psql("SELECT pg_create_logical_replication_slot('walcast_src_shop', 'wal2json')")
        .expect("create the source's slot");
    let out = walcast(&control, &["source", "remove", "shop", "--drop-slot"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("dropped replication slot \"walcast_src_shop\""),
        "{err}"
    );
    assert_eq!(one(&shop, "SELECT count(*) FROM pg_replication_slots"), "0");
    assert_eq!(names(&control), ["default"]);
    let e = failed(
        walcast(&control, &["source", "remove", "shop"]),
        "source remove shop again",
    );
    assert!(e.contains("no source named \"shop\""), "{e}");
    let e = failed(
        walcast(&control, &["source", "remove", "default"]),
        "source remove default",
    );
    assert!(e.contains("default source"), "{e}");
}

/// The sources' URLs carry credentials: a login role of the control database that is
/// not walcast's own cannot read them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_role_cannot_read_the_sources() {
    let _machine = crate::support::shared().await;
    let control = Postgres::start().expect("start postgres");
    ok(
        walcast(
            &control,
            &[
                "source",
                "add",
                "vault",
                "--source-database-url",
                "postgres://u:hunter2@127.0.0.1:1/v",
                "--skip-check",
            ],
        ),
        "source add vault",
    );
    control
        .psql("CREATE ROLE mallory LOGIN; GRANT USAGE ON SCHEMA walcast TO mallory;")
        .expect("create role");
    let (mallory, conn) = tokio_postgres::connect(
        &control.url_for("mallory", "postgres"),
        tokio_postgres::NoTls,
    )
    .await
    .expect("connect as mallory");
    tokio::spawn(conn);
    for sql in [
        "SELECT database_url FROM walcast.sources",
        "SELECT count(*) FROM walcast.sources",
    ] {
        let e = mallory.query(sql, &[]).await.expect_err(sql);
        assert_eq!(
            e.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "{sql}: {e}"
        );
    }
}

/// `pg_recvlogical` reading `slot` of `pg` (an active slot, as a worker's), once it is.
fn read_slot(pg: &Postgres, slot: &str) -> std::process::Child {
    let child = Command::new(pg.bindir().join("pg_recvlogical"))
        .args(["-d", &pg.url(), "-S", slot, "--start", "-f", "/dev/null"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run pg_recvlogical");
    let active = format!("SELECT active FROM pg_replication_slots WHERE slot_name = '{slot}'");
    wait_for(|| one(pg, &active) == "t", &format!("{slot} active"));
    child
}

fn wait_for(mut done: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `remove --drop-slot` waits for the slot's reader to let go (as the worker that led
/// the source does within seconds), and says so when it never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_slot_waits_for_the_reader_to_let_go() {
    let _machine = crate::support::shared().await;
    let mut pgs = Postgres::start_many(2).expect("start postgres");
    let (shop, control) = (pgs.pop().unwrap(), pgs.pop().unwrap());
    for name in ["a", "b"] {
        ok(
            walcast(
                &control,
                &["source", "add", name, "--source-database-url", &shop.url()],
            ),
            "source add",
        );
        one(
            &shop,
            &format!("SELECT 1 FROM pg_create_logical_replication_slot('walcast_src_{name}', 'wal2json')"),
        );
    }

    let mut reader = read_slot(&shop, "walcast_src_a");
    let mut remove = Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(["source", "remove", "a", "--drop-slot"])
        .env("DATABASE_URL", control.url())
        .env("SECRETS_KEY", crate::support::SECRETS_KEY)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run walcast source remove");
    // The row goes first; then the command waits for the slot.
    let gone = "SELECT count(*) FROM walcast.sources WHERE name = 'a'";
    wait_for(|| one(&control, gone) == "0", "source a removed");
    assert!(
        remove.try_wait().expect("try_wait").is_none(),
        "remove --drop-slot did not wait for the active slot"
    );
    reader.kill().expect("stop pg_recvlogical");
    let _ = reader.wait();
    let out = remove.wait_with_output().expect("walcast source remove");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("dropped replication slot \"walcast_src_a\""),
        "{err}"
    );
    let slots = "SELECT string_agg(slot_name, ',') FROM pg_replication_slots";
    assert_eq!(one(&shop, slots), "walcast_src_b");

    // A reader that never lets go: the source is removed, the slot kept, and the
    // command says what to do.
    let mut reader = read_slot(&shop, "walcast_src_b");
    let e = failed(
        walcast(&control, &["source", "remove", "b", "--drop-slot"]),
        "source remove b --drop-slot (slot held)",
    );
    assert!(
        e.contains("still read by process")
            && e.contains("walcast slot drop --slot-name walcast_src_b"),
        "{e}"
    );
    assert_eq!(one(&shop, slots), "walcast_src_b");
    assert_eq!(names(&control), ["default"]);
    reader.kill().expect("stop pg_recvlogical");
    let _ = reader.wait();
}

/// The management API's `"source"`: the same operations as `walcast project create
/// --source`, through a front and the leading worker (`walcast serve`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_management_api_creates_projects_on_a_source() {
    use crate::management::{op, path, OPERATOR, PROJECTS, STARTUP};
    let _machine = crate::support::shared().await;
    let mut pgs = Postgres::start_many(2).expect("start postgres");
    let (shop, control) = (pgs.pop().unwrap(), pgs.pop().unwrap());
    ok(
        walcast(
            &control,
            &[
                "source",
                "add",
                "shop",
                "--source-database-url",
                &shop.url(),
            ],
        ),
        "source add shop",
    );
    let mut w = crate::support::Worker::serve(&control.url(), &[("MANAGEMENT_API_KEY", OPERATOR)]);
    w.wait_active(STARTUP);

    let (status, v) = op(
        &w,
        "POST",
        PROJECTS,
        Some(r#"{"name": "api", "source": "shop"}"#),
    );
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["source"], "shop", "{v}");
    let (id, schema) = (v["id"].as_str().unwrap(), v["schema"].as_str().unwrap());
    let exists = format!("SELECT count(*) FROM pg_namespace WHERE nspname = '{schema}'");
    assert_eq!(one(&shop, &exists), "1");
    assert_eq!(one(&control, &exists), "0");
    let (status, g) = op(&w, "GET", &path(id), None);
    assert_eq!((status, &g["source"]), (200, &Value::from("shop")), "{g}");

    for (body, says) in [
        (
            r#"{"name": "x", "source": "nope"}"#,
            "unknown source \"nope\"",
        ),
        (r#"{"name": "x", "source": "../x"}"#, "unknown source"),
        (
            r#"{"name": "x", "source": 5}"#,
            "\"source\" must be a string",
        ),
    ] {
        let (status, v) = op(&w, "POST", PROJECTS, Some(body));
        assert_eq!(status, 422, "{body}: {v}");
        assert_eq!(v["error"], "invalid_body", "{body}: {v}");
        assert!(v["message"].as_str().unwrap().contains(says), "{body}: {v}");
    }
    // "default" (or nothing) is the deployment's own database.
    let (status, v) = op(
        &w,
        "POST",
        PROJECTS,
        Some(r#"{"name": "here", "source": "default"}"#),
    );
    assert_eq!(
        (status, &v["source"]),
        (201, &Value::from("default")),
        "{v}"
    );
    let here = format!(
        "SELECT count(*) FROM pg_namespace WHERE nspname = '{}'",
        v["schema"].as_str().unwrap()
    );
    assert_eq!(one(&control, &here), "1");

    let (status, d) = op(&w, "DELETE", &path(id), None);
    assert_eq!(status, 200, "{d}");
    assert_eq!(
        one(
            &control,
            &format!("SELECT count(*) FROM walcast.projects WHERE id = '{id}'")
        ),
        "0"
    );
}
