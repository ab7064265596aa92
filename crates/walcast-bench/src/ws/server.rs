//! The servers under test as child processes, and what is read from them (`/proc`, HTTP).

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use walcast_testkit::Postgres;

use super::{Target, WsBench, SECRET, UNLIMITED_PROJECT};

/// The server under test as a child process.
pub(super) struct Server {
    child: Child,
    pub(super) port: u16,
    pub(super) stdin: Option<ChildStdin>,
    pub(super) pg: Option<Postgres>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(super) fn spawn(mut cmd: Command, label: &'static str) -> anyhow::Result<(Child, u16)> {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().context("spawning the server child")?;
        let stdout = child.stdout.take().context("child stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = lines
            .next()
            .context("server exited before listening")?
            .context("reading the server's stdout")?;
        let port: u16 = first
            .strip_prefix("LISTENING ")
            .and_then(|p| p.trim().parse().ok())
            .with_context(|| format!("unexpected first line from the server: {first}"))?;
        // Forward the server's log (warnings and up) to our stderr.
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                eprintln!("[{label}] {l}");
            }
        });
        Ok((child, port))
    }

    pub(super) async fn start(target: Target, args: &WsBench) -> anyhow::Result<Server> {
        let exe = std::env::current_exe().context("current exe")?;
        match target {
            Target::Walcast => {
                // The clients' tokens carry `role: anon`, and the worker sends a role only
                // the columns it may SELECT: grant the table as a Supabase project does.
                let env = crate::env::start(
                    "CREATE TABLE bench (id int8 PRIMARY KEY, ph int4 NOT NULL, \
                     at int8 NOT NULL, pad text NOT NULL);
                     GRANT SELECT ON bench TO anon, authenticated;",
                    "bench",
                )
                .await?;
                let pg = env.pg;
                let mut cmd = Command::new(exe);
                cmd.arg("ws-server")
                    .env_clear()
                    .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                    .env("DATABASE_URL", pg.url())
                    .env("CHECK_DATABASE_URL", pg.check_url())
                    .env("JWT_SECRET", SECRET)
                    .env("SECRETS_KEY", walcast_testkit::SECRETS_KEY)
                    .env("METRICS_API_KEY", FIGURES_KEY)
                    .env("OUTBOUND_QUEUE", args.outbound_queue.to_string())
                    // One project holds every client: its per-project limits (a policy,
                    // not a capacity) are lifted, so the run measures the server.
                    .envs(UNLIMITED_PROJECT)
                    .env("HOST", "127.0.0.1")
                    .env("PORT", "0")
                    .env("LOG_FORMAT", "text")
                    .env("LOG_LEVEL", "warn")
                    .envs(args.server_env.iter().cloned());
                let (mut child, port) = Server::spawn(cmd, "walcast")?;
                drop(child.stdin.take());
                let s = Server {
                    child,
                    port,
                    stdin: None,
                    pg: Some(pg),
                };
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    if let Some(h) = s.health().await {
                        if h["cdc_active"] == true {
                            break;
                        }
                    }
                    if Instant::now() > deadline {
                        bail!(
                            "walcast serve not active within 60 s: {:?}",
                            s.health().await
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(s)
            }
            Target::Baseline => {
                let mut cmd = Command::new(exe);
                cmd.args([
                    "ws-baseline-server",
                    "--outbound-queue",
                    &args.outbound_queue.to_string(),
                    "--pad",
                    &args.pad.to_string(),
                ])
                .envs(args.server_env.iter().cloned());
                let (mut child, port) = Server::spawn(cmd, "baseline")?;
                let stdin = child.stdin.take();
                Ok(Server {
                    child,
                    port,
                    stdin,
                    pg: None,
                })
            }
        }
    }

    pub(super) async fn health(&self) -> Option<Value> {
        let body = http_get(self.port, "/health").await?;
        serde_json::from_str(&body).ok()
    }

    pub(super) async fn wait_front(
        &self,
        what: &str,
        f: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let h = self.health().await;
            if h.as_ref().is_some_and(|h| f(&h["front"])) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("server: timed out waiting for {what}; health {h:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `METRICS_API_KEY` of every server the benchmarks start: [`http_get`] reads their
/// `/metrics` and full `/health` with it.
pub(crate) const FIGURES_KEY: &str = "walcast-bench-figures-key-0123456789abcdef";

/// GET `path` of a server the benchmarks started, with [`FIGURES_KEY`]: the body.
pub(crate) async fn http_get(port: u16, path: &str) -> Option<String> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let head = format!(
            "GET {path} HTTP/1.0\r\nHost: bench\r\nAuthorization: Bearer {FIGURES_KEY}\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .ok()
        .flatten()
}

/// `/proc/<pid>/status` field in kB (VmRSS, VmHWM).
pub(crate) fn proc_kb(pid: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

pub(crate) fn fd_limit() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/limits").ok()?;
    let l = s.lines().find(|l| l.starts_with("Max open files"))?;
    l.split_whitespace().nth(3)?.parse().ok()
}
