//! Metrics labelled by source (docs/architecture.md "Several databases"): a worker leading
//! two sources reports each one's pipeline, realtime delivery and lease under
//! `source="<name>"` (`source="default"` for the default one), a broken source it runs but
//! cannot read as not active, and a removed source not at all. Called from the
//! `many_sources` tests (their setups).

use std::time::{Duration, Instant};

use crate::support::Worker;

/// The sum of `name`'s samples labelled `source="<source>"` in a `/metrics` body, if any.
pub fn sample(body: &str, name: &str, source: &str) -> Option<f64> {
    let label = format!("source=\"{source}\"");
    let values: Vec<f64> = body
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            l.split_once('}')
                .is_some_and(|(labels, _)| labels.contains(&label))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// What one source's series say on a worker.
#[derive(Debug, Default, PartialEq)]
struct Seen {
    active: Option<f64>,
    slot_lag: Option<f64>,
    decoded: Option<f64>,
    leader: Option<f64>,
}

fn seen(body: &str, source: &str) -> Seen {
    Seen {
        active: sample(body, "walcast_cdc_active", source),
        slot_lag: sample(body, "walcast_cdc_slot_lag_bytes", source),
        decoded: sample(body, "walcast_cdc_changes_decoded_total", source),
        leader: sample(body, "walcast_lease_leader", source),
    }
}

/// `w` leads every one of `sources` (at least two) and has read `rows` changes of each:
/// its `/metrics` has each source's pipeline active, its slot lag, its changes and its
/// lease under its own label, and no pipeline series without a source.
pub fn assert_labelled_per_source(w: &Worker, sources: &[String], rows: f64) {
    assert!(
        sources.len() >= 2,
        "a worker leading two sources: {sources:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let body = w.get("/metrics").unwrap_or_default();
        let all: Vec<(String, Seen)> = sources
            .iter()
            .map(|s| (s.clone(), seen(&body, s)))
            .collect();
        let ok = all.iter().all(|(_, s)| {
            s.active == Some(1.0)
                && s.slot_lag.is_some()
                && s.decoded.is_some_and(|n| n >= rows)
                && s.leader == Some(1.0)
        });
        if ok {
            let unlabelled = body
                .lines()
                .filter(|l| {
                    l.starts_with("walcast_cdc_active")
                        || l.starts_with("walcast_cdc_slot_lag_bytes")
                })
                .filter(|l| !l.contains("source=\""))
                .collect::<Vec<_>>();
            assert!(
                unlabelled.is_empty(),
                "pipeline series without a source: {unlabelled:?}"
            );
            eprintln!("per source: {all:?}");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "each source's series not labelled apart: {all:?}\n{}",
            body.lines()
                .filter(|l| l.starts_with("walcast_cdc_") || l.starts_with("walcast_lease_"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `w` runs `source` but cannot read it (its database is down, or lacks logical
/// decoding): `walcast_cdc_active{source}` is 0, so a per-source alert sees it.
pub fn assert_reported_inactive(w: &Worker, source: &str) {
    let body = w.get("/metrics").unwrap_or_default();
    assert_eq!(
        sample(&body, "walcast_cdc_active", source),
        Some(0.0),
        "a broken source's pipeline reported not active:\n{}",
        body.lines()
            .filter(|l| l.starts_with("walcast_cdc_active"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// `w` led `sources` and lost them (frozen past its lease): for each it does not lead
/// again, its gauges say so (not active, not leader, slot lag 0), so a per-source alert
/// reads the new leader's values only. Returns the sources checked.
pub fn assert_former_leader_reports_zero(w: &Worker, sources: &[&str]) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let body = w.get("/metrics").unwrap_or_default();
        let led = crate::many_sources::leading(w);
        let mut checked = Vec::new();
        let mut pending = Vec::new();
        for s in sources.iter().filter(|s| !led.iter().any(|l| l == *s)) {
            let seen = seen(&body, s);
            match (seen.active, seen.leader, seen.slot_lag) {
                (Some(a), Some(l), Some(lag)) if a == 0.0 && l == 0.0 && lag == 0.0 => {
                    checked.push(s.to_string())
                }
                _ => pending.push((s.to_string(), seen)),
            }
        }
        if pending.is_empty() {
            return checked;
        }
        assert!(
            Instant::now() < deadline,
            "a former leader still reports: {pending:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `source` was removed: `w`'s `/metrics` has none of its series left (a removed source
/// must not look like one no worker reads).
pub fn assert_no_series(w: &Worker, source: &str) {
    let body = w.get("/metrics").unwrap_or_default();
    let label = format!("source=\"{source}\"");
    let left: Vec<&str> = body.lines().filter(|l| l.contains(&label)).collect();
    assert!(
        left.is_empty(),
        "series of removed source {source}: {left:?}"
    );
}

#[test]
fn samples_are_read_by_source() {
    let body = "# TYPE walcast_cdc_active gauge\nwalcast_cdc_active{source=\"default\"} 1\nwalcast_cdc_active{source=\"s1\"} 0\nwalcast_cdc_consumer_lag_bytes{consumer=\"realtime\",source=\"s1\"} 7\nwalcast_cdc_consumer_lag_bytes{consumer=\"outbox\",source=\"s1\"} 3\n";
    assert_eq!(sample(body, "walcast_cdc_active", "default"), Some(1.0));
    assert_eq!(sample(body, "walcast_cdc_active", "s1"), Some(0.0));
    assert_eq!(sample(body, "walcast_cdc_active", "s2"), None);
    assert_eq!(
        sample(body, "walcast_cdc_consumer_lag_bytes", "s1"),
        Some(10.0)
    );
}
