//! Steady load on every source's table and the commit-to-NATS latency of each change.
//!
//! Each row carries `clock_timestamp()` taken inside its transaction just before the
//! commit; a subscriber on `walcast.realtime.>` (where the changes of tables nobody
//! subscribes to are published) takes its arrival time minus that stamp (one machine's
//! clock), per project.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use walcast_bus::{Bus, ChangeEvent};

use super::setup::Src;
use crate::ws::now_micros;

/// Per project: each change's latency (ms) and the distinct row ids received.
#[derive(Default)]
struct Seen {
    latency: HashMap<String, Vec<f64>>,
    ids: HashMap<String, HashSet<i64>>,
    distinct: usize,
}

/// What the NATS subscriber received, since the last [`Received::reset`].
#[derive(Clone, Default)]
pub(super) struct Received(Arc<Mutex<Seen>>);

/// One source's results in a load phase.
#[derive(Debug, Clone, Default)]
pub(super) struct PerSource {
    pub sent: usize,
    pub received: usize,
    /// Sorted latencies, ms.
    pub latency: Vec<f64>,
}

impl Received {
    /// Subscribe to every realtime change on `nats` (the subscription is in place when
    /// this returns).
    pub async fn subscribe(nats: &str) -> anyhow::Result<Received> {
        let bus = Bus::nats(nats, "sources-sub").await?;
        let mut sub = bus.subscribe(walcast_bus::subject::REALTIME_ALL).await?;
        bus.barrier().await?;
        let out = Received::default();
        let sink = out.clone();
        tokio::spawn(async move {
            let _bus = bus;
            while let Some(m) = sub.next().await {
                sink.record(&m.payload, now_micros());
            }
        });
        Ok(out)
    }

    fn record(&self, payload: &[u8], recv_us: i64) {
        let Ok(ev) = serde_json::from_slice::<ChangeEvent>(payload) else {
            return;
        };
        let Some(v) = ev
            .record
            .and_then(|r| serde_json::from_str::<serde_json::Value>(r.get()).ok())
        else {
            return;
        };
        let (Some(id), Some(at)) = (v["id"].as_i64(), v["at"].as_str()) else {
            return;
        };
        let Ok(t) = walcast_protocol::timestamp::parse_pg_datetime(at) else {
            return;
        };
        let ms = (recv_us - t.unix_micros()) as f64 / 1000.0;
        let Ok(mut s) = self.0.lock() else { return };
        if s.ids.entry(ev.project.clone()).or_default().insert(id) {
            s.distinct += 1;
        }
        s.latency.entry(ev.project).or_default().push(ms);
    }

    fn distinct(&self) -> usize {
        self.0.lock().map(|s| s.distinct).unwrap_or(0)
    }

    fn reset(&self) {
        if let Ok(mut s) = self.0.lock() {
            *s = Seen::default();
        }
    }

    /// Wait (polling) until `n` distinct rows arrived or `timeout` passed.
    async fn wait_for(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.distinct() < n && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Each project's received count and sorted latencies.
    fn take(&self, project: &str) -> (usize, Vec<f64>) {
        let Ok(s) = self.0.lock() else {
            return (0, Vec::new());
        };
        let received = s.ids.get(project).map_or(0, HashSet::len);
        let mut v = s.latency.get(project).cloned().unwrap_or_default();
        v.sort_by(|a, b| a.total_cmp(b));
        (received, v)
    }
}

/// Write `rate` single-row transactions per second for `secs` seconds into every one of
/// `srcs` at once (their ticks staggered), ids from `first_id`; wait up to `max_wait`
/// seconds after the last write for them all; the results by source name.
pub(super) async fn steady(
    srcs: &[Src],
    rate: u32,
    secs: u64,
    first_id: i64,
    max_wait: u64,
    recv: &Received,
) -> anyhow::Result<BTreeMap<String, PerSource>> {
    recv.reset();
    let per_source = (rate as u64 * secs) as usize;
    let period = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let start = tokio::time::Instant::now() + Duration::from_millis(200);
    let mut writers = Vec::new();
    for (k, s) in srcs.iter().enumerate() {
        let at = start + period.mul_f64(k as f64 / srcs.len() as f64);
        let (url, table) = (s.url.clone(), s.table.clone());
        writers.push(tokio::spawn(write(
            url, table, at, period, per_source, first_id,
        )));
    }
    let mut sent = Vec::new();
    for w in writers {
        sent.push(w.await??);
    }
    recv.wait_for(sent.iter().sum(), Duration::from_secs(max_wait))
        .await;
    let mut out = BTreeMap::new();
    for (s, sent) in srcs.iter().zip(sent) {
        let (received, latency) = recv.take(&s.project);
        let r = PerSource {
            sent,
            received,
            latency,
        };
        out.insert(s.name.clone(), r);
    }
    Ok(out)
}

/// One source's writer: `n` inserts, one per `period` from `at`; how many were sent.
async fn write(
    url: String,
    table: String,
    at: tokio::time::Instant,
    period: Duration,
    n: usize,
    first_id: i64,
) -> anyhow::Result<usize> {
    let db = walcast_pipeline::connect(&url).await?;
    let stmt = db
        .prepare(&format!(
            "INSERT INTO {table} VALUES ($1, clock_timestamp())"
        ))
        .await?;
    let mut tick = tokio::time::interval_at(at, period);
    for i in 0..n {
        tick.tick().await;
        db.execute(&stmt, &[&(first_id + i as i64)]).await?;
    }
    Ok(n)
}

/// The `p` quantile of sorted values (NaN when empty).
pub(super) fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}
