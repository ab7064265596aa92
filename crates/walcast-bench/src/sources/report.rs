//! The printed tables: each number with the default source alone (the baseline) and with
//! every source, and their ratio.

use std::collections::BTreeMap;

use super::load::{pct, PerSource};
use super::setup::Src;
use super::{Results, SourcesBench};

fn ratio(x: f64, base: f64) -> f64 {
    if base > 0.0 {
        x / base
    } else {
        f64::NAN
    }
}

pub(super) fn print(args: &SourcesBench, all: &[Src], r: &Results) {
    println!();
    let per_worker: Vec<usize> = r.spread.iter().map(Vec::len).collect();
    println!(
        "{} sources led {:.1} s after they were registered; sources per worker: {per_worker:?}",
        all.len(),
        r.spread_secs
    );
    idle(args, r);
    latency(all, r);
    takeover(r);
}

fn idle(args: &SourcesBench, r: &Results) {
    let (a, b) = (r.idle_alone, r.idle_all);
    let n = args.sources as f64;
    println!();
    println!(
        "Idle, {} cdc-workers together, {} s:",
        args.workers, args.idle_secs
    );
    println!("{:<34} {:>12} {:>14}", "", "RSS (MB)", "CPU (ms/s)");
    println!(
        "{:<34} {:>12.1} {:>14.2}",
        "default source alone (baseline)", a.rss_mb, a.cpu_ms_per_sec
    );
    let with = format!("with {} more sources", args.sources);
    println!("{with:<34} {:>12.1} {:>14.2}", b.rss_mb, b.cpu_ms_per_sec);
    println!(
        "{:<34} {:>12.2} {:>14.3}",
        "per added source",
        (b.rss_mb - a.rss_mb) / n,
        (b.cpu_ms_per_sec - a.cpu_ms_per_sec) / n
    );
    println!(
        "{:<34} {:>12.2} {:>14.2}",
        "ratio to the baseline",
        ratio(b.rss_mb, a.rss_mb),
        ratio(b.cpu_ms_per_sec, a.cpu_ms_per_sec)
    );
}

/// Every sample of a phase, sorted.
fn pooled(m: &BTreeMap<String, PerSource>) -> Vec<f64> {
    let mut v: Vec<f64> = m.values().flat_map(|s| s.latency.iter().copied()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

fn latency_row(label: &str, where_: &str, s: &PerSource) {
    let l = &s.latency;
    println!(
        "{label:<22} {where_:<9} {:>12} {:>9.2} {:>9.2} {:>9.2}",
        format!("{}/{}", s.received, s.sent),
        pct(l, 0.5),
        pct(l, 0.99),
        l.last().copied().unwrap_or(f64::NAN)
    );
}

fn latency(all: &[Src], r: &Results) {
    println!();
    println!("Commit-to-NATS latency per source:");
    println!(
        "{:<22} {:<9} {:>12} {:>9} {:>9} {:>9}",
        "source", "instance", "received", "p50 ms", "p99 ms", "max ms"
    );
    for (name, s) in &r.latency_alone {
        latency_row(&format!("{name} alone (baseline)"), "control", s);
    }
    for src in all {
        let Some(s) = r.latency_all.get(&src.name) else {
            continue;
        };
        let inst = src
            .instance
            .map_or("control".to_string(), |i| format!("pg{i}"));
        latency_row(&src.name, &inst, s);
    }
    let (a, b) = (pooled(&r.latency_alone), pooled(&r.latency_all));
    let p99s: Vec<f64> = r
        .latency_all
        .values()
        .map(|s| pct(&s.latency, 0.99))
        .collect();
    let worst = p99s.iter().copied().fold(f64::NAN, f64::max);
    println!(
        "overall: p50 {:.2} ms (ratio {:.2}), p99 {:.2} ms (ratio {:.2}); worst source's p99 \
         {:.2} ms (ratio {:.2}); baseline: the default source alone, p50 {:.2} ms, p99 {:.2} ms",
        pct(&b, 0.5),
        ratio(pct(&b, 0.5), pct(&a, 0.5)),
        pct(&b, 0.99),
        ratio(pct(&b, 0.99), pct(&a, 0.99)),
        worst,
        ratio(worst, pct(&a, 0.99)),
        pct(&a, 0.5),
        pct(&a, 0.99)
    );
}

fn takeover(r: &Results) {
    let stats = |t: &super::cluster::Takeover| {
        let mut v: Vec<f64> = t.secs.values().copied().collect();
        v.sort_by(|a, b| a.total_cmp(b));
        (v.len(), pct(&v, 0.5), v.last().copied().unwrap_or(f64::NAN))
    };
    let (a, b) = (stats(&r.takeover_alone), stats(&r.takeover_all));
    println!();
    println!("Takeover after kill -9 of the worker leading the most sources:");
    println!("{:<34} {:>8} {:>9} {:>9}", "", "sources", "p50 s", "max s");
    println!(
        "{:<34} {:>8} {:>9.2} {:>9.2}",
        "default source alone (baseline)", a.0, a.1, a.2
    );
    println!(
        "{:<34} {:>8} {:>9.2} {:>9.2}",
        "with every source", b.0, b.1, b.2
    );
    println!(
        "ratio to the baseline: p50 {:.2}, max {:.2}; the killed worker's sources: {:?}",
        ratio(b.1, a.1),
        ratio(b.2, a.2),
        r.takeover_all.secs.keys().collect::<Vec<_>>()
    );
}
