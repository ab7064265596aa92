//! Secrets at rest (README "Running a platform", docs/security.md): the projects' JWT
//! secrets and the sources' connection URLs are stored encrypted with `SECRETS_KEY`, each
//! value bound to its row and column; the key rotates with `SECRETS_KEY_PREVIOUS`; a wrong
//! or missing key is a clear error that names the key needed.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::PhoenixClient;
use walcast_testkit::Postgres;

use crate::management::{op, path, ws_status, OPERATOR};
use crate::support::projects::{binding, sign};
use crate::support::ws::now;
use crate::support::{shared, Stack, Worker, SECRETS_KEY as KEY};

/// The keys a rotation moves to.
const NEW_KEY: &str = "the-next-secrets-key-of-these-tests-0123456789abcdef";
const THIRD_KEY: &str = "a-third-secrets-key-of-these-tests-0123456789abcdef";
const STARTUP: Duration = Duration::from_secs(60);
/// Within this a front applies what the worker tells it.
const APPLIED: Duration = Duration::from_secs(15);
/// The password of every login of the clusters here: it must never be found in a row.
const PASSWORD: &str = "pw-Xq7w-never-stored-in-plain-text";

/// `walcast <args>` on the control database `control`, with only `env` besides.
fn walcast(control: &str, env: &[(&str, &str)], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("DATABASE_URL", control)
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("run walcast {args:?}: {e}"))
}

/// The command succeeded; its output as JSON.
fn ok(out: Output, what: &str) -> Value {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text}"))
}

/// A cluster whose logins sign in with [`PASSWORD`].
fn cluster() -> Postgres {
    Postgres::builder()
        .password_auth("scram-sha-256", PASSWORD)
        .start()
        .expect("start postgres")
}

/// Every stored value of the secret columns, and the rows' whole text.
fn raw(stack: &Stack) -> (Vec<String>, String) {
    let values = stack.sql(
        "SELECT v FROM walcast.projects, unnest(ARRAY[jwt_secret, jwt_secret_previous]) v
          WHERE v IS NOT NULL
         UNION ALL
         SELECT v FROM walcast.sources,
                unnest(ARRAY[database_url, replication_url, check_url]) v
          WHERE v IS NOT NULL
         ORDER BY 1",
    );
    let rows = stack.sql(
        "SELECT p::text FROM walcast.projects p UNION ALL SELECT s::text FROM walcast.sources s",
    );
    (values.lines().map(String::from).collect(), rows)
}

/// Wait until the worker reads source `name`.
fn wait_source(w: &Worker, name: &str) {
    let deadline = Instant::now() + STARTUP;
    loop {
        let active = w.health().is_some_and(|h| {
            h["sources"].as_array().is_some_and(|a| {
                a.iter()
                    .any(|s| s["name"] == name && s["cdc_active"] == true)
            })
        });
        if active {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "source {name} not read: {:?}\n{}",
            w.health(),
            w.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// After `walcast source add` and `walcast project create` (and a rotation of its secret),
/// no row holds a secret or a password in plain text; the worker reads the source with
/// the URLs it decrypts, and a front accepts tokens signed with the project's secrets
/// (current and previous), which it gets from the worker over NATS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_and_source_urls_are_stored_encrypted_and_still_work() {
    let _machine = shared().await;
    let (control, shop) = (cluster(), cluster());
    let stack = Stack::with_pg(control, "stream");
    let control = stack.pg.url();
    let env = [("SECRETS_KEY", KEY)];
    let db = shop.url();
    assert!(db.contains(PASSWORD), "{db}");
    let repl = format!("{db}?application_name=walcast_repl");
    let added = walcast(
        &control,
        &env,
        &[
            "source",
            "add",
            "shop",
            "--source-database-url",
            &db,
            "--replication-url",
            &repl,
            "--check-url",
            &shop.check_url(),
        ],
    );
    ok(added, "source add");
    let p = ok(
        walcast(
            &control,
            &env,
            &["project", "create", "--name", "shop", "--source", "shop"],
        ),
        "project create",
    );
    let id = p["id"].as_str().unwrap().to_string();
    let schema = p["schema"].as_str().unwrap().to_string();
    let first = p["jwt_secret"].as_str().unwrap().to_string();
    let rotated = ok(
        walcast(
            &control,
            &env,
            &["project", "rotate", &id, "--window-secs", "600"],
        ),
        "project rotate",
    );
    let secret = rotated["jwt_secret"].as_str().unwrap().to_string();
    assert_ne!(first, secret);

    let (values, rows) = raw(&stack);
    assert_eq!(values.len(), 5, "two secrets and three URLs: {values:?}");
    for plain in [first.as_str(), secret.as_str(), PASSWORD] {
        assert!(
            !rows.contains(plain),
            "{plain:?} stored in plain text: {rows}"
        );
    }
    for v in &values {
        assert!(v.starts_with("enc:v1:"), "not encrypted: {v}");
    }

    let mut worker = stack.worker(&[("LEASE_MODE", "postgres"), ("SECRETS_KEY", KEY)]);
    worker.wait_active(STARTUP);
    wait_source(&worker, "shop");
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(STARTUP);
    shop.psql(&format!(
        "CREATE TABLE \"{schema}\".items (id int PRIMARY KEY, v text);
         GRANT SELECT ON \"{schema}\".items TO anon, authenticated, service_role;"
    ))
    .expect("create table");
    let on_shop = walcast(
        &shop.url(),
        &[],
        &[
            "realtime",
            "--project",
            &id,
            "enable",
            &format!("{schema}.items"),
        ],
    );
    assert!(on_shop.status.success(), "{on_shop:?}");

    let mut socks = Vec::new();
    for s in [&secret, &first] {
        let key = sign(s, json!({"role": "anon", "ref": id, "exp": now() + 3600}));
        let mut sock = PhoenixClient::connect(&front.ws_url(&key)).await;
        sock.join_subscribed("realtime:items", binding(&schema, "items"))
            .await;
        socks.push(sock);
    }
    shop.psql(&format!("INSERT INTO \"{schema}\".items VALUES (1, 'x')"))
        .expect("insert");
    for sock in &mut socks {
        sock.wait_frame("postgres_changes", STARTUP, |d| {
            d["data"]["record"]["id"] == 1
        })
        .await;
    }
}

/// `walcast secrets status` with `key` (and no previous one): its report.
fn status(control: &str, key: &str) -> Value {
    ok(
        walcast(control, &[("SECRETS_KEY", key)], &["secrets", "status"]),
        "secrets status",
    )
}

/// The command failed; its stderr.
fn failed(out: Output, what: &str) -> String {
    assert!(
        !out.status.success(),
        "{what} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Every stored value is under key `id`.
fn all_under(stack: &Stack, id: &str, n: usize) {
    let (values, _) = raw(stack);
    assert_eq!(values.len(), n, "{values:?}");
    for v in &values {
        assert!(
            v.starts_with(&format!("enc:v1:{id}:")),
            "not under {id}: {v}"
        );
    }
}

/// The key rotates: with the new key current and the old one previous, `walcast secrets
/// rotate` rewrites every value, after which the old key alone reads nothing (a clear
/// error naming the key needed, for the CLI and at a worker's start) and the new key
/// alone reads everything; a worker started with a third key and the second as previous
/// rewrites everything itself. No key, a short key, the same key twice: refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_secrets_key_rotates_and_a_wrong_key_is_refused() {
    let _machine = shared().await;
    let stack = Stack::start("stream");
    let control = stack.pg.url();
    let a = [("SECRETS_KEY", KEY)];
    let p = ok(
        walcast(&control, &a, &["project", "create", "--name", "one"]),
        "project create",
    );
    let vault = [
        "source",
        "add",
        "vault",
        "--source-database-url",
        "postgres://u:hunter2@127.0.0.1:1/v",
        "--check-url",
        "postgres://c:hunter3@127.0.0.1:1/v",
        "--skip-check",
    ];
    ok(walcast(&control, &a, &vault), "source add");
    let id_a = status(&control, KEY)["key_id"]
        .as_str()
        .unwrap()
        .to_string();
    all_under(&stack, &id_a, 3);

    let both = [("SECRETS_KEY", NEW_KEY), ("SECRETS_KEY_PREVIOUS", KEY)];
    let r = ok(walcast(&control, &both, &["secrets", "rotate"]), "rotate");
    let id_b = r["key_id"].as_str().unwrap().to_string();
    assert_ne!(id_a, id_b);
    assert_eq!(r["previous_key_id"], id_a.as_str(), "{r}");
    assert_eq!(
        (&r["reencrypted"], &r["encrypted"]),
        (&json!(3), &json!(0)),
        "{r}"
    );
    assert_eq!(r["by_key"], json!({ &id_b: 3 }), "{r}");
    all_under(&stack, &id_b, 3);
    let again = ok(
        walcast(&control, &both, &["secrets", "rotate"]),
        "rotate again",
    );
    assert_eq!(again["reencrypted"], 0, "idempotent: {again}");

    // The old key alone: refused, naming the key needed.
    let e = failed(
        walcast(&control, &a, &["project", "list"]),
        "list with the old key",
    );
    assert!(
        e.contains(&format!("encrypted with key {id_b}")) && e.contains("SECRETS_KEY_PREVIOUS"),
        "{e}"
    );
    let mut w = stack.worker(&a);
    let (started, log) = w.wait_exit(STARTUP);
    assert!(
        !started && log.contains(&format!("encrypted with key {id_b}")),
        "{log}"
    );
    // The new key alone: everything read.
    let list = ok(
        walcast(&control, &[("SECRETS_KEY", NEW_KEY)], &["project", "list"]),
        "list with the new key",
    );
    assert_eq!(list[0]["id"], p["id"], "{list}");
    let sources = ok(
        walcast(&control, &[("SECRETS_KEY", NEW_KEY)], &["source", "list"]),
        "source list",
    );
    assert_eq!(sources[1]["database_url"], "postgres://u:***@127.0.0.1:1/v");

    // No key, a short one, the same twice: refused at start, saying why.
    for (env, why) in [
        (vec![("SECRETS_KEY", "")], "SECRETS_KEY is not set"),
        (
            vec![("SECRETS_KEY", "short")],
            "SECRETS_KEY is shorter than 32 bytes",
        ),
        (
            vec![("SECRETS_KEY", NEW_KEY), ("SECRETS_KEY_PREVIOUS", NEW_KEY)],
            "SECRETS_KEY_PREVIOUS is the same key as SECRETS_KEY",
        ),
    ] {
        let mut w = stack.worker(&env);
        let (started, log) = w.wait_exit(STARTUP);
        assert!(!started && log.contains(why), "{why}: {log}");
        let e = failed(walcast(&control, &env, &["project", "list"]), why);
        assert!(e.contains(why), "{e}");
    }

    // Rotated at a worker's start; its front accepts the project's key.
    let third = [
        ("SECRETS_KEY", THIRD_KEY),
        ("SECRETS_KEY_PREVIOUS", NEW_KEY),
    ];
    let mut worker = stack.worker(&third);
    worker.wait_active(STARTUP);
    let id_c = status(&control, THIRD_KEY)["key_id"]
        .as_str()
        .unwrap()
        .to_string();
    all_under(&stack, &id_c, 3);
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(STARTUP);
    let anon = p["anon_key"].as_str().unwrap();
    assert_eq!(ws_status(&front, anon).await, 101);

    // The keys are never printed: the effective configuration names their ids only, and
    // `--help` hides the values it would take from the environment.
    let log = worker.log_text();
    let described = log.lines().find(|l| l.contains("cdc-worker starting"));
    let described = described.unwrap_or_else(|| panic!("no configuration logged: {log}"));
    assert!(
        described.contains("secrets_key_id") && described.contains(&id_c),
        "{described}"
    );
    let help = Command::new(env!("CARGO_BIN_EXE_cdc-worker"))
        .arg("--help")
        .envs(third)
        .output()
        .expect("cdc-worker --help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("[env: SECRETS_KEY]"), "{help}");
    for text in [log.as_str(), &help] {
        assert!(
            !text.contains(THIRD_KEY) && !text.contains(NEW_KEY),
            "{text}"
        );
    }
}

/// A project's stored secret copied from another project's row, from its own previous
/// secret's column, altered, or replaced by plain text: that project is left out (its
/// keys refused, counted, logged), never served with a secret an attacker chose or
/// knows, and the other projects go on. A project stored under a key the worker does not
/// have fails the worker's list as a whole: the fronts keep the projects they know.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_moved_altered_or_planted_is_refused_and_the_others_go_on() {
    let _machine = shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let mut front = Worker::front(&stack.nats.url(), &[("MANAGEMENT_API_KEY", OPERATOR)]);
    front.wait_http(STARTUP);
    let create = |name: &str| {
        let (status, v) = op(
            &front,
            "POST",
            crate::management::PROJECTS,
            Some(&json!({"name": name}).to_string()),
        );
        assert_eq!(status, 201, "{v}");
        v
    };
    let (a, b, c, d, e) = (
        create("a"),
        create("b"),
        create("c"),
        create("d"),
        create("e"),
    );
    let field = |v: &Value, k: &str| v[k].as_str().unwrap().to_string();
    let (status, rotated) = op(
        &front,
        "POST",
        &format!("{}/rotate", path(&field(&c, "id"))),
        Some(r#"{"previous_valid_secs": 600}"#),
    );
    assert_eq!(status, 200, "{rotated}");
    for p in [&a, &b, &d, &e] {
        assert_eq!(ws_status(&front, &field(p, "anon_key")).await, 101);
    }
    let (ia, ib, ic, id) = (
        field(&a, "id"),
        field(&b, "id"),
        field(&c, "id"),
        field(&d, "id"),
    );
    let planted = "a-secret-the-attacker-knows-0123456789abcdef";
    stack.sql(&format!(
        "UPDATE walcast.projects SET jwt_secret = (SELECT jwt_secret FROM walcast.projects WHERE id = '{ia}') WHERE id = '{ib}';
         UPDATE walcast.projects SET jwt_secret = jwt_secret_previous WHERE id = '{ic}';
         UPDATE walcast.projects SET jwt_secret = '{planted}' WHERE id = '{id}';"
    ));
    // Altered: one character of the value changed.
    let stored = stack.sql(&format!(
        "SELECT jwt_secret FROM walcast.projects WHERE id = '{}'",
        field(&e, "id")
    ));
    let last = stored.chars().last().unwrap();
    let altered = format!(
        "{}{}",
        &stored[..stored.len() - 1],
        if last == 'A' { 'B' } else { 'A' }
    );
    stack.sql(&format!(
        "UPDATE walcast.projects SET jwt_secret = '{altered}' WHERE id = '{}'",
        field(&e, "id")
    ));
    // A change through the API makes every front reload the list at once.
    let (status, _) = op(&front, "PATCH", &path(&ia), Some(r#"{"name": "a2"}"#));
    assert_eq!(status, 200);

    let b_with_a = sign(
        &field(&a, "jwt_secret"),
        json!({"role": "service_role", "ref": ib, "exp": now() + 600}),
    );
    let d_planted = sign(
        planted,
        json!({"role": "service_role", "ref": id, "exp": now() + 600}),
    );
    let refused = [
        ("b's own key", field(&b, "anon_key")),
        ("a token of b signed with a's secret", b_with_a),
        ("c's key", field(&c, "anon_key")),
        ("a token of d signed with the planted secret", d_planted),
        ("e's key", field(&e, "anon_key")),
    ];
    let deadline = Instant::now() + APPLIED;
    for (what, key) in &refused {
        loop {
            let got = ws_status(&front, key).await;
            if got == 401 {
                break;
            }
            assert!(Instant::now() < deadline, "{what}: handshake {got}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(
        ws_status(&front, &field(&a, "anon_key")).await,
        101,
        "a goes on"
    );
    let log = worker.log_text();
    for why in ["does not decrypt with key", "is stored in plain text"] {
        assert!(log.contains(why), "{why}: {log}");
    }
    let left_out = worker.metric(r#"walcast_secrets_unreadable_total{table="projects"}"#);
    assert!(left_out.unwrap_or_default() >= 4.0, "{left_out:?}");

    // The key rotated by a process the worker is not in step with (a rolling upgrade):
    // every value is now under a key the worker does not have. Its list fails as a whole
    // and the fronts keep the projects they know: a is still served, the new one not yet.
    let rotating = [("SECRETS_KEY", NEW_KEY), ("SECRETS_KEY_PREVIOUS", KEY)];
    let f = ok(
        walcast(
            &stack.pg.url(),
            &rotating,
            &["project", "create", "--name", "f"],
        ),
        "create under another key",
    );
    let f_key = f["anon_key"].as_str().unwrap();
    // Unknown to the front, which asks the worker: not accepted (503: nobody could say).
    for _ in 0..2 {
        let got = ws_status(&front, f_key).await;
        assert!(matches!(got, 401 | 503), "f's key: {got}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(
        ws_status(&front, &field(&a, "anon_key")).await,
        101,
        "a goes on"
    );
    let log = worker.log_text();
    assert!(log.contains("which is not configured"), "{log}");
}

/// A database written before there was a key: its plain-text secrets are encrypted at the
/// first start given the key (`walcast migrate` without one refuses, naming how many
/// there are), the secrets work as before, and the next pass leaves every value as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_text_of_an_older_walcast_is_encrypted_at_start() {
    let _machine = shared().await;
    let stack = Stack::start("stream");
    let control = stack.pg.url();
    ok_status(
        walcast(&control, &[], &["migrate"]),
        "migrate a fresh database",
    );
    let (secret, previous) = (
        "a-secret-stored-in-plain-text-0123456789abcdef",
        "its-predecessor-in-plain-text-0123456789abcdef",
    );
    stack.sql(&format!(
        "INSERT INTO walcast.projects (id, name, schema_name, jwt_secret, jwt_secret_previous)
         VALUES ('old', 'old', 'project_old', '{secret}', '{previous}');
         INSERT INTO walcast.sources (name, database_url, slot_name, check_url)
         VALUES ('legacy', 'postgres://u:hunter2@127.0.0.1:1/l', 'walcast_src_legacy',
                 'postgres://c:hunter3@127.0.0.1:1/l')"
    ));
    let e = failed(
        walcast(&control, &[], &["migrate"]),
        "migrate without a key",
    );
    assert!(
        e.contains("4 secret(s)") && e.contains("plain text") && e.contains("SECRETS_KEY"),
        "{e}"
    );

    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let id = status(&control, KEY)["key_id"]
        .as_str()
        .unwrap()
        .to_string();
    all_under(&stack, &id, 4);
    let (before, rows) = raw(&stack);
    for plain in [secret, previous, "hunter2", "hunter3"] {
        assert!(!rows.contains(plain), "{plain} still in plain text: {rows}");
    }
    let again = ok(
        walcast(&control, &[("SECRETS_KEY", KEY)], &["secrets", "rotate"]),
        "a second pass",
    );
    assert_eq!(
        (&again["encrypted"], &again["reencrypted"]),
        (&json!(0), &json!(0))
    );
    assert_eq!(
        raw(&stack).0,
        before,
        "values already encrypted are left as they are"
    );

    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(STARTUP);
    for s in [secret, previous] {
        let key = sign(s, json!({"role": "anon", "ref": "old", "exp": now() + 600}));
        assert_eq!(ws_status(&front, &key).await, 101, "signed with {s}");
    }
}

/// The command succeeded.
fn ok_status(out: Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
