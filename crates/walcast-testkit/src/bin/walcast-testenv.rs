//! `walcast-testenv`: start a throwaway Postgres (logical, wal2json) and nats-server, print
//! their URLs as one JSON line, and keep them until stdin closes. Lets tests in other
//! languages (tests/js) use the same kit: spawn it, read the line, close stdin to stop.

use std::io::{BufRead, Write};

use walcast_testkit::{Nats, Postgres};

fn main() {
    let pg = match Postgres::start() {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("walcast-testenv: cannot start postgres: {e}");
            std::process::exit(1);
        }
    };
    let nats = match Nats::start() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("walcast-testenv: cannot start nats-server: {e}");
            std::process::exit(1);
        }
    };
    let line = format!(
        "{{\"database_url\":\"{}\",\"nats_url\":\"{}\",\"pg_port\":{},\"nats_port\":{}}}",
        pg.url(),
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
        buf.clear();
    }
    drop(nats);
    drop(pg);
}
