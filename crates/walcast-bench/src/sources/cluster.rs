//! The cdc-workers: started as children (the real entry point, `walcast-bench
//! scale-worker`), asked who leads what through `/health`, measured idle from `/proc`,
//! and killed to time takeovers.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::bail;
use futures_util::future::join_all;

use crate::scale::Proc;
use crate::ws::{http_get, proc_kb};

/// The workers, their shared settings and log.
pub(super) struct Cluster {
    pub procs: Vec<Proc>,
    env: Vec<(&'static str, String)>,
    log: PathBuf,
    started: usize,
}

/// The workers' resources over an idle spell.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Idle {
    /// VmRSS, all workers together, at the end of the spell.
    pub rss_mb: f64,
    /// User + system CPU, all workers together, per wall-clock second.
    pub cpu_ms_per_sec: f64,
}

/// One takeover: the killed worker's sources and how long each took to be led again.
#[derive(Debug, Clone, Default)]
pub(super) struct Takeover {
    pub secs: BTreeMap<String, f64>,
}

/// The sources a `/health` body shows led with an active pipeline (the default included).
fn leading(health: &serde_json::Value) -> Vec<String> {
    let active = |v: &serde_json::Value| v["leader"] == true && v["cdc_active"] == true;
    let mut out = Vec::new();
    if active(health) {
        out.push("default".to_string());
    }
    for s in health["sources"].as_array().into_iter().flatten() {
        if active(s) {
            out.push(s["name"].as_str().unwrap_or_default().to_string());
        }
    }
    out
}

impl Cluster {
    /// Start `n` workers on the control database `db` and `nats`; returns once each
    /// answers `/health`.
    pub async fn start(
        n: usize,
        db: String,
        nats: String,
        lease_secs: u64,
        log: PathBuf,
    ) -> anyhow::Result<Cluster> {
        let env = vec![
            ("CHECK_DATABASE_URL", walcast_testkit::as_check_login(&db)),
            ("DATABASE_URL", db),
            ("NATS_URL", nats),
            ("LEASE_MODE", "postgres".to_string()),
            ("LEASE_DURATION_SECS", lease_secs.to_string()),
        ];
        let mut c = Cluster {
            procs: Vec::new(),
            env,
            log,
            started: 0,
        };
        for _ in 0..n {
            c.spawn()?;
        }
        for p in &mut c.procs {
            p.wait_healthy(false).await?;
        }
        Ok(c)
    }

    /// Start one more worker (not waited for).
    pub fn spawn(&mut self) -> anyhow::Result<()> {
        let env: Vec<(&str, String)> = self.env.iter().map(|(k, v)| (*k, v.clone())).collect();
        let name = format!("cdc-worker {}", self.started);
        self.started += 1;
        let p = Proc::start_logged("scale-worker", name, &env, Some(&self.log))?;
        self.procs.push(p);
        Ok(())
    }

    /// What each worker leads now (an empty list for one that does not answer).
    pub async fn leading(&self) -> Vec<Vec<String>> {
        let bodies = join_all(self.procs.iter().map(|p| http_get(p.port, "/health"))).await;
        bodies
            .into_iter()
            .map(|b| {
                let h = b
                    .and_then(|b| serde_json::from_str(&b).ok())
                    .unwrap_or_default();
                leading(&h)
            })
            .collect()
    }

    /// Wait until every one of `names` is led by exactly one worker, no worker leads
    /// more than its fair share, and that has held for two seconds; what each leads.
    pub async fn wait_spread(
        &self,
        names: &[String],
        secs: u64,
    ) -> anyhow::Result<Vec<Vec<String>>> {
        let share = names.len().div_ceil(self.procs.len().max(1));
        let deadline = Instant::now() + Duration::from_secs(secs);
        let mut stable_since: Option<Instant> = None;
        loop {
            let held = self.leading().await;
            let mut all: Vec<&String> = held.iter().flatten().collect();
            all.sort();
            let mut want: Vec<&String> = names.iter().collect();
            want.sort();
            let ok = all == want && held.iter().all(|h| h.len() <= share);
            match (ok, stable_since) {
                (true, Some(t)) if t.elapsed() >= Duration::from_secs(2) => return Ok(held),
                (true, None) => stable_since = Some(Instant::now()),
                (false, _) => stable_since = None,
                _ => {}
            }
            if Instant::now() > deadline {
                bail!(
                    "the {} sources not spread over the workers within {secs} s: {held:?}",
                    names.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The workers' RSS and CPU over `secs` seconds in which nothing is written.
    pub async fn idle(&self, secs: u64) -> Idle {
        let pids: Vec<String> = self
            .procs
            .iter()
            .map(|p| p.child.id().to_string())
            .collect();
        let cpu = || pids.iter().map(|p| crate::cpu::secs(p)).sum::<f64>();
        let (cpu0, t0) = (cpu(), Instant::now());
        tokio::time::sleep(Duration::from_secs(secs.max(1))).await;
        let used = cpu() - cpu0;
        let wall = t0.elapsed().as_secs_f64();
        let rss_kb: u64 = pids.iter().map(|p| proc_kb(p, "VmRSS:")).sum();
        Idle {
            rss_mb: rss_kb as f64 / 1024.0,
            cpu_ms_per_sec: used * 1000.0 / wall,
        }
    }

    /// kill -9 the worker leading the most sources; for each of them, the time until
    /// another worker's `/health` shows it led with an active pipeline.
    pub async fn takeover(&mut self, max_wait: u64) -> anyhow::Result<Takeover> {
        let held = self.leading().await;
        let Some(victim) = (0..held.len()).max_by_key(|&i| held[i].len()) else {
            bail!("no worker to kill");
        };
        let names = held[victim].clone();
        if names.is_empty() {
            bail!("no worker leads anything: {held:?}");
        }
        let mut proc = self.procs.remove(victim);
        proc.child.kill()?;
        let at = Instant::now();
        let _ = proc.child.wait();
        drop(proc);
        let mut out = Takeover::default();
        let deadline = at + Duration::from_secs(max_wait);
        while out.secs.len() < names.len() {
            let now_held = self.leading().await;
            let took = at.elapsed().as_secs_f64();
            for name in now_held.into_iter().flatten() {
                if names.contains(&name) {
                    out.secs.entry(name).or_insert(took);
                }
            }
            if Instant::now() > deadline {
                let left: Vec<_> = names
                    .iter()
                    .filter(|n| !out.secs.contains_key(*n))
                    .collect();
                bail!("{left:?} (of the killed worker's {names:?}) not taken over within {max_wait} s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(out)
    }
}
