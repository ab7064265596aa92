//! Fault isolation between tenants: what one project's slow work costs the
//! others. Two phases, each on its own throwaway Postgres and nats-server, with one
//! cdc-worker and one ws-front (the real entry points, children of this process) over
//! NATS, as a shared deployment runs them:
//!
//! * **A, slow tenant** ([`slow`]): the default project's plain table, written at
//!   `--rows-per-sec` with one subscriber, first alone (the baseline) and then beside
//!   `--noisy` projects whose table's `SELECT` policy is slow (a correlated subquery on an
//!   unindexed `--members`-row table) written at `--noisy-rate` each with
//!   `--noisy-subscribers` authenticated users each who may see every row, so every check
//!   really runs. Reported: the quiet table's INSERT→client latency alone and beside them,
//!   the ratio, its rows missed, and what the noisy subscribers got (rows, or `system`
//!   error notices).
//! * **B, enable burst** ([`burst`]): `--tables` tables of another project enabled through
//!   the REST API over `--burst-secs`, while the default project's table is written at
//!   `--rows-per-sec` with a subscriber. Reported: that table's latency before the burst
//!   (the baseline) and during it, the total enable time, and how long a change of the
//!   last enabled table takes to reach a subscriber that joins once the burst is over.
//!
//! Latency: each row carries the microsecond (`now_micros`) taken just before its INSERT
//! was sent; a client compares it with its clock when the change arrives (one machine).
//! A row never delivered counts as arriving at the end of the wait (a floor, marked `≥`).
//! The command fails only when rows were missed with no `system` notice on the channel
//! that missed them: the timings are reported, never checked.

mod burst;
mod client;
mod slow;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;

use crate::scale::Proc;

#[derive(Args, Debug, Clone)]
pub struct IsolationBench {
    /// Phases to run, in order: `slow` (A, slow tenant) and `burst` (B, enable burst).
    #[arg(long, value_delimiter = ',', default_value = "slow,burst")]
    phases: Vec<String>,
    /// Projects whose table has a slow `SELECT` policy (phase A).
    #[arg(long, default_value_t = 4)]
    noisy: usize,
    /// Subscribers per noisy project, each an authenticated user of its own who may see
    /// every row (phase A).
    #[arg(long, default_value_t = 10)]
    noisy_subscribers: usize,
    /// Rows per second written to each noisy project's table (phase A).
    #[arg(long, default_value_t = 30)]
    noisy_rate: u64,
    /// Rows of each noisy project's unindexed membership table, read by its policy.
    #[arg(long, default_value_t = 100_000)]
    members: usize,
    /// Rows per second written to the default project's table (both phases).
    #[arg(long, default_value_t = 20)]
    rows_per_sec: u64,
    /// Seconds of each measured window of phase A (alone, then beside the noisy ones).
    #[arg(long, default_value_t = 20)]
    secs: u64,
    /// Tables enabled through the REST API in phase B.
    #[arg(long, default_value_t = 2000)]
    tables: usize,
    /// Seconds over which the enables are spread (phase B).
    #[arg(long, default_value_t = 20)]
    burst_secs: u64,
    /// Seconds of the baseline window before the burst (phase B).
    #[arg(long, default_value_t = 5)]
    before_secs: u64,
    /// Enable requests in flight at most (phase B).
    #[arg(long, default_value_t = 8)]
    enable_concurrency: usize,
    /// Seconds to wait, after the last write of a window, for its rows.
    #[arg(long, default_value_t = 30)]
    max_wait: u64,
    /// `LOG_LEVEL` of the worker and the front (their logs go to a file in the temp dir).
    #[arg(long, default_value = "warn")]
    log_level: String,
}

pub async fn run(args: IsolationBench) -> anyhow::Result<()> {
    for p in &args.phases {
        if p != "slow" && p != "burst" {
            bail!("unknown phase {p:?} (slow or burst)");
        }
    }
    println!(
        "isolation: one cdc-worker + one ws-front over nats-server (debug or release: this \
         binary's build), {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let mut failures = Vec::new();
    for p in &args.phases {
        let missed = match p.as_str() {
            "slow" => slow::run(&args).await?,
            _ => burst::run(&args).await?,
        };
        failures.extend(missed);
    }
    if !failures.is_empty() {
        bail!(
            "rows missed with no system notice:\n  {}",
            failures.join("\n  ")
        );
    }
    Ok(())
}

/// The walcast processes of one phase, killed on drop (before the services they use).
pub(crate) struct Stack {
    pub(crate) front: Proc,
    _worker: Proc,
    pub(crate) env: crate::env::BenchEnv,
    pub(crate) log: PathBuf,
}

impl Stack {
    /// Start a cdc-worker and a ws-front on `env` (set up already), logging to a file.
    pub(crate) async fn start(
        env: crate::env::BenchEnv,
        phase: &str,
        log_level: &str,
    ) -> anyhow::Result<Stack> {
        let log = std::env::temp_dir().join(format!(
            "walcast-bench-isolation-{phase}-{}.log",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&log);
        let base = [
            ("DATABASE_URL", env.pg.url()),
            ("CHECK_DATABASE_URL", env.pg.check_url()),
            ("NATS_URL", env.nats.url()),
            ("LOG_LEVEL", log_level.to_string()),
            ("LOG_FORMAT", "json".to_string()),
        ];
        let mut worker =
            Proc::start_logged("scale-worker", "cdc-worker".into(), &base, Some(&log))?;
        worker.wait_healthy(true).await?;
        let mut front = Proc::start_logged("scale-front", "ws-front".into(), &base, Some(&log))?;
        front.wait_healthy(false).await?;
        Ok(Stack {
            front,
            _worker: worker,
            env,
            log,
        })
    }

    /// Print how many warnings and errors the processes logged, and the most frequent
    /// warning and error messages.
    pub(crate) fn report_log(&self) {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut counts: std::collections::BTreeMap<(String, String), usize> = Default::default();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let level = v["level"].as_str().unwrap_or("").to_string();
            if level == "WARN" || level == "ERROR" {
                let msg = v["message"].as_str().unwrap_or("").to_string();
                *counts.entry((level, msg)).or_default() += 1;
            }
        }
        let total = |l: &str| -> usize {
            counts
                .iter()
                .filter(|((lv, _), _)| lv == l)
                .map(|(_, n)| n)
                .sum()
        };
        println!(
            "worker and front log: {} warning(s), {} error(s) ({})",
            total("WARN"),
            total("ERROR"),
            self.log.display()
        );
        let mut top: Vec<_> = counts.into_iter().collect();
        top.sort_by_key(|t| std::cmp::Reverse(t.1));
        for ((level, msg), n) in top.into_iter().take(3) {
            println!("  {n} × {level} {msg}");
        }
    }
}

/// Latencies of one window (ms), missed rows counted at the end of the wait.
#[derive(Debug, Clone, Default)]
pub(crate) struct Window {
    pub(crate) sent: usize,
    pub(crate) missed: usize,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
}

impl Window {
    /// From each row's latency (`None`: never arrived) and the floor for those missed.
    pub(crate) fn of(latencies: &[Option<f64>], missed_floor: impl Fn(usize) -> f64) -> Window {
        let mut v: Vec<f64> = latencies
            .iter()
            .enumerate()
            .map(|(i, l)| l.unwrap_or_else(|| missed_floor(i)))
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let pct = |p: f64| {
            if v.is_empty() {
                return f64::NAN;
            }
            let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
            v[i]
        };
        Window {
            sent: latencies.len(),
            missed: latencies.iter().filter(|l| l.is_none()).count(),
            p50: pct(0.5),
            p99: pct(0.99),
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }

    /// `p50 / p99 / max` in ms, `≥` when some rows never arrived.
    pub(crate) fn text(&self) -> String {
        let ge = if self.missed > 0 { "≥" } else { "" };
        format!(
            "{ge}{:.0} / {ge}{:.0} / {ge}{:.0}",
            self.p50, self.p99, self.max
        )
    }
}

/// `a / b`, NaN when `b` is not positive.
pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::NAN
    }
}

/// Sleep until `deadline` or until `done()` holds, polling every 20 ms.
pub(crate) async fn wait_until(deadline: Instant, done: impl Fn() -> bool) -> bool {
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}
