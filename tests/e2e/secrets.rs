//! Secrets are never printed: not by `--help` (which shows options' environment values)
//! of any binary or subcommand, not in the effective configuration a process logs at
//! start, not in the error that stops it. Every secret below holds [`MARK`], so one search
//! finds any of them, whatever form the output gives it.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::Worker;

const MARK: &str = "SEKRET";

/// Every secret-bearing variable, in each form a connection string takes: a URL's
/// user-info password and query parameter, a `key=value` string with a quoted value, a
/// NATS token, a key, a JWKS.
fn secret_env() -> Vec<(&'static str, String)> {
    let long = |what: &str| format!("{MARK}-{what}-0123456789abcdef0123456789abcdef");
    vec![
        (
            "DATABASE_URL",
            format!("postgres://walcast:{MARK}-db@127.0.0.1:1/db?sslpassword={MARK}-ssl"),
        ),
        (
            "POSTGRES_REPLICATION_URL",
            format!("host=127.0.0.1 port=1 user=walcast password='{MARK} repl\\'s'"),
        ),
        (
            "NATS_URL",
            format!("nats://walcast:{MARK}-nats@127.0.0.1:1"),
        ),
        ("NATS_PASSWORD", format!("{MARK}-nats-password")),
        ("JWT_SECRET", long("jwt")),
        ("JWT_SECRET_PREVIOUS", long("jwt-previous")),
        ("JWT_JWKS", format!("{{\"keys\":[{{\"kid\":\"{MARK}\"}}]}}")),
        (
            "JWT_JWKS_URL",
            format!("https://walcast:{MARK}-idp@127.0.0.1:1/jwks.json?token={MARK}-idp-query"),
        ),
        ("MANAGEMENT_API_KEY", long("management")),
        ("METRICS_API_KEY", long("metrics")),
        (
            "LEASE_KUBE_API_URL",
            format!("https://127.0.0.1:1/?token={MARK}-kube"),
        ),
        (
            "SOURCE_DATABASE_URL",
            format!("postgres://s:{MARK}-source@127.0.0.1:1/db"),
        ),
        (
            "SOURCE_REPLICATION_URL",
            format!("postgresql://127.0.0.1:1/db?password={MARK}-source-repl"),
        ),
    ]
}

/// Run `program args` with the secrets in its environment: everything it printed.
fn output(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(secret_env())
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    text
}

/// The subcommands a `--help` lists (its `Commands:` section, `help` left out).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// `--help` of `program` and of every subcommand under it, each checked; how many.
fn check_help_tree(program: &str, path: &mut Vec<String>) -> usize {
    let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
    args.push("--help");
    let help = output(program, &args);
    assert!(
        help.contains("Usage:"),
        "{program} {args:?} printed no help:\n{help}"
    );
    assert!(
        !help.contains(MARK),
        "{program} {args:?} printed a secret:\n{help}"
    );
    let mut checked = 1;
    for sub in subcommands(&help) {
        path.push(sub);
        checked += check_help_tree(program, path);
        path.pop();
    }
    checked
}

#[test]
fn help_of_every_binary_and_subcommand_hides_secret_values() {
    let mut checked = 0;
    for program in [
        env!("CARGO_BIN_EXE_walcast"),
        env!("CARGO_BIN_EXE_cdc-worker"),
        env!("CARGO_BIN_EXE_ws-front"),
    ] {
        checked += check_help_tree(program, &mut Vec::new());
    }
    // walcast's subcommands and theirs (serve, realtime enable, outbox replay, …).
    assert!(checked > 20, "only {checked} help pages found");
    // The variables are listed (`[env: DATABASE_URL]`), their values not.
    let serve = output(env!("CARGO_BIN_EXE_walcast"), &["serve", "--help"]);
    assert!(serve.contains("[env: DATABASE_URL]"), "{serve}");
}

/// Wait until `w` logged its effective configuration (or exited); its whole log then.
fn log_after_start(w: &mut Worker, starting: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = w.log_text();
        let exited = matches!(w.child.try_wait(), Ok(Some(_)));
        if exited || log.contains(starting) {
            // The connection error follows the configuration; give it a moment.
            std::thread::sleep(Duration::from_millis(if exited { 0 } else { 1500 }));
            return w.log_text();
        }
        assert!(Instant::now() < deadline, "no {starting:?} in:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_configuration_logged_at_start_and_connection_errors_hide_secrets() {
    let env = secret_env();
    let get = |k: &str| env.iter().find(|(n, _)| *n == k).unwrap().1.clone();
    // (A JWKS holds public keys; this one is no valid key set, and would stop the front
    // before it logs anything.)
    let extra: Vec<(&str, &str)> = env
        .iter()
        .filter(|(k, _)| *k != "JWT_JWKS")
        .map(|(k, v)| (*k, v.as_str()))
        .collect();
    let (db, nats) = (get("DATABASE_URL"), get("NATS_URL"));
    let mut started = [
        (Worker::spawn(&db, &nats, &extra), "cdc-worker starting"),
        (Worker::front(&nats, &extra), "ws-front starting"),
        (Worker::serve(&db, &extra), "walcast serve starting"),
    ];
    for (w, starting) in &mut started {
        let log = log_after_start(w, starting);
        assert!(log.contains(*starting), "{log}");
        assert!(!log.contains(MARK), "a secret in the log:\n{log}");
    }
    // The configuration is shown, its secrets hidden.
    let log = started[0].0.log_text();
    assert!(
        log.contains("postgres://walcast:***@127.0.0.1:1/db?sslpassword=***"),
        "{log}"
    );
    assert!(log.contains("password=***"), "{log}");
    // Commands that fail to connect name the database without its password.
    for args in [
        vec!["migrate"],
        vec!["realtime", "list"],
        vec!["project", "list"],
    ] {
        let out = output(env!("CARGO_BIN_EXE_walcast"), &args);
        assert!(
            out.contains("connecting to") || out.contains("rror"),
            "{args:?}: {out}"
        );
        assert!(
            !out.contains(MARK),
            "walcast {args:?} printed a secret:\n{out}"
        );
    }
}
