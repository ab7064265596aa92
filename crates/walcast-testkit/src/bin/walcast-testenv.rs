//! `walcast-testenv`: start a throwaway Postgres (logical, wal2json) and nats-server, print
//! their URLs as one JSON line, and keep them until stdin closes. Lets tests in other
//! languages (tests/js) use the same kit: spawn it, read the line, close stdin to stop.
//! `WALCAST_TESTENV_NATS_MAX_PAYLOAD` (bytes) lowers nats-server's `max_payload`.
//! `WALCAST_TESTENV_FAKE_KUBE=1` also serves the fake Kubernetes API server (Leases
//! only, see `walcast_testkit::fake_kube`); its URL is `kube_api_url`.
//! `WALCAST_TESTENV_EXTRA_POSTGRES=N` also starts N more Postgres instances (other
//! databases for walcast's sources); their URLs are `extra_database_urls`, their check
//! logins' `extra_check_urls`. `check_database_url` is walcast's `CHECK_DATABASE_URL`,
//! `secrets_key` its `SECRETS_KEY` ([`walcast_testkit::SECRETS_KEY`]).
//! Commands on stdin, one a line, each answered by a line `ok` or `error: …`:
//! `restart-postgres` (immediate shutdown, then start: a crash restart) and
//! `restart-nats` (SIGKILL, then start on the same port and store), and
//! `stop-extra-postgres N` (immediate shutdown of the Nth extra instance, from 0: a
//! source's database goes down) and `start-extra-postgres N` (it comes back, same port
//! and data).

use std::io::{BufRead, Write};

use walcast_testkit::{Nats, Postgres};

/// The extra Postgres instances asked for (kept until we exit).
fn extra_postgres() -> Vec<Postgres> {
    let n: usize = std::env::var("WALCAST_TESTENV_EXTRA_POSTGRES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (0..n)
        .map(|_| {
            Postgres::start().unwrap_or_else(|e| {
                eprintln!("walcast-testenv: cannot start an extra postgres: {e}");
                std::process::exit(1);
            })
        })
        .collect()
}

fn main() {
    let mut pg = match Postgres::start() {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("walcast-testenv: cannot start postgres: {e}");
            std::process::exit(1);
        }
    };
    let max_payload = std::env::var("WALCAST_TESTENV_NATS_MAX_PAYLOAD")
        .ok()
        .and_then(|v| v.parse().ok());
    let mut nats = match Nats::start_with_max_payload(max_payload) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("walcast-testenv: cannot start nats-server: {e}");
            std::process::exit(1);
        }
    };
    // Kept alive (serving) until we exit.
    let kube = std::env::var("WALCAST_TESTENV_FAKE_KUBE")
        .is_ok_and(|v| v == "1")
        .then(fake_kube);
    let kube_url = match &kube {
        Some((_, url)) => format!(",\"kube_api_url\":\"{url}\""),
        None => String::new(),
    };
    let mut extra = extra_postgres();
    let urls: Vec<String> = extra.iter().map(|p| format!("\"{}\"", p.url())).collect();
    let checks: Vec<String> = extra
        .iter()
        .map(|p| format!("\"{}\"", p.check_url()))
        .collect();
    let kube_url = format!(
        "{kube_url},\"extra_database_urls\":[{}],\"extra_check_urls\":[{}]",
        urls.join(","),
        checks.join(",")
    );
    let line = format!(
        "{{\"database_url\":\"{}\",\"check_database_url\":\"{}\",\"secrets_key\":\"{}\",\"nats_url\":\"{}\",\"pg_port\":{},\"nats_port\":{}{kube_url}}}",
        pg.url(),
        pg.check_url(),
        walcast_testkit::SECRETS_KEY,
        nats.url(),
        pg.port(),
        nats.port()
    );
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
    // Block until our parent closes stdin (or dies).
    let stdin = std::io::stdin();
    let mut buf = String::new();
    while matches!(stdin.lock().read_line(&mut buf), Ok(n) if n > 0) {
        let result = match buf.trim() {
            "restart-postgres" => pg.restart().map_err(|e| e.to_string()),
            "restart-nats" => nats.restart().map_err(|e| e.to_string()),
            cmd if cmd.starts_with("stop-extra-postgres ") => {
                extra_nth(&mut extra, cmd).map(Postgres::stop)
            }
            cmd if cmd.starts_with("start-extra-postgres ") => {
                extra_nth(&mut extra, cmd).and_then(|pg| pg.restart().map_err(|e| e.to_string()))
            }
            "" => Ok(()),
            other => Err(format!("unknown command {other:?}")),
        };
        let _ = match result {
            Ok(()) => writeln!(out, "ok"),
            Err(e) => writeln!(out, "error: {}", e.replace('\n', " ")),
        };
        let _ = out.flush();
        buf.clear();
    }
    drop(kube);
    drop(nats);
    drop(pg);
}

/// The Nth extra Postgres named by `<command> N`.
fn extra_nth<'a>(extra: &'a mut [Postgres], cmd: &str) -> Result<&'a mut Postgres, String> {
    let n: usize = cmd
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("not an index: {cmd:?}"))?;
    extra
        .get_mut(n)
        .ok_or_else(|| format!("no extra postgres {n}"))
}

/// The fake Kubernetes API server on its own runtime, and its URL (one endpoint for
/// every client).
fn fake_kube() -> (tokio::runtime::Runtime, String) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            eprintln!("walcast-testenv: cannot start a runtime for the fake Kubernetes API: {e}");
            std::process::exit(1);
        });
    let api = walcast_testkit::fake_kube::FakeApi::new();
    let url = rt.block_on(api.endpoint("workers"));
    (rt, url)
}
