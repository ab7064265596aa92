//! Logs (tracing) and metrics (Prometheus).

use std::io::IsTerminal;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, SharedString, Unit};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

use clap::{Args, ValueEnum};

/// Sources this worker gave up because it led more than its fair share.
pub const SOURCES_GIVEN_UP: &str = "walcast_sources_given_up_total";
/// Sources this worker runs (leads or stands by for), the default one excluded.
pub const SOURCES: &str = "walcast_sources";

/// Gauge: connections not yet upgraded nor streaming an admitted response.
pub const HTTP_PENDING: &str = "walcast_http_pending_connections";
/// Counter (label `reason`: `cap`, `peer`, `fds`): waiting connections closed to make room.
pub const HTTP_EVICTED: &str = "walcast_http_connections_evicted_total";
/// Counter (label `phase`: `header`, `idle`): connections closed for sending no request in time.
pub const HTTP_TIMED_OUT: &str = "walcast_http_connections_timed_out_total";
/// Counter (label `reason`: `too_large`, `malformed`): request heads refused.
pub const HTTP_REFUSED: &str = "walcast_http_heads_refused_total";

/// Counter (label `route`: `health`, `metrics`): requests for the figures refused (no
/// key of the operator's).
pub const FIGURES_REFUSED: &str = "walcast_http_figures_refused_total";
/// 1, labelled with the release this process runs (`version`).
pub const BUILD_INFO: &str = "walcast_build_info";

pub(crate) fn figures_refused(route: &'static str) {
    metrics::counter!(FIGURES_REFUSED, "route" => route).increment(1);
}

pub(crate) fn http_pending(n: usize) {
    metrics::gauge!(HTTP_PENDING).set(n as f64);
}

pub(crate) fn http_evicted(reason: &'static str) {
    metrics::counter!(HTTP_EVICTED, "reason" => reason).increment(1);
}

pub(crate) fn http_timed_out(phase: &'static str) {
    metrics::counter!(HTTP_TIMED_OUT, "phase" => phase).increment(1);
}

pub(crate) fn http_refused(reason: &'static str) {
    metrics::counter!(HTTP_REFUSED, "reason" => reason).increment(1);
}

fn describe() {
    metrics::describe_gauge!(
        HTTP_PENDING,
        "HTTP connections not yet upgraded nor streaming an admitted response (HTTP_MAX_PENDING)"
    );
    metrics::describe_counter!(
        HTTP_EVICTED,
        "Waiting HTTP connections closed to make room for newer ones (reason: cap, peer, fds)"
    );
    metrics::describe_counter!(
        HTTP_TIMED_OUT,
        "HTTP connections closed for not sending a request head in time (phase: header, idle)"
    );
    metrics::describe_counter!(
        HTTP_REFUSED,
        "HTTP request heads refused (reason: too_large, malformed)"
    );
    metrics::describe_counter!(
        FIGURES_REFUSED,
        "Requests for /metrics or the full /health refused: no MANAGEMENT_API_KEY nor METRICS_API_KEY (route: health, metrics)"
    );
    metrics::describe_counter!(
        SOURCES_GIVEN_UP,
        "Sources given up to another worker (this one led more than its fair share)"
    );
    metrics::describe_gauge!(
        SOURCES,
        "Sources other than the default that this worker runs (leads or stands by for)"
    );
    metrics::describe_gauge!(
        BUILD_INFO,
        "Always 1; its version label is the walcast release this process runs"
    );
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    /// Text on a terminal, JSON otherwise.
    Auto,
    Json,
    Text,
}

#[derive(Args, Clone, Debug)]
pub struct LogArgs {
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Auto)]
    pub log_format: LogFormat,
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `walcast_pipeline=debug,info`.
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    pub log_level: String,
}

pub fn init_logs(args: &LogArgs) {
    let filter = EnvFilter::try_new(&args.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    let json = match args.log_format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stdout().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout);
    let _ = if json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
}

/// Install the Prometheus recorder (every series recorded by work for a source labelled
/// with it, see [`BySource`]); the handle renders `/metrics`.
pub fn init_metrics() -> anyhow::Result<PrometheusHandle> {
    let recorder = PrometheusBuilder::new()
        .set_buckets(&[
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ])
        .map_err(|e| anyhow::anyhow!("metrics buckets: {e}"))?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(BySource(recorder))
        .map_err(|e| anyhow::anyhow!("installing the metrics recorder: {e}"))?;
    walcast_pipeline::telemetry::describe();
    walcast_realtime::telemetry::describe();
    walcast_control::telemetry::describe();
    walcast_changes::telemetry::describe();
    walcast_lease::telemetry::describe();
    walcast_front::telemetry::describe();
    describe();
    metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// A recorder adding `source="<name>"` to every series registered by work for a source
/// (a task run within [`walcast_core::source_scope`]): one worker leads several sources,
/// and each source's pipeline, realtime delivery, outbox relay and lease are told apart
/// by the label, with no call site naming the source. A series already labelled
/// `source` keeps its label; work for no source (a front) records its series as named.
pub struct BySource<R>(pub R);

/// `key`, labelled with the current task's source (if any and not labelled already).
pub fn source_key(key: &Key) -> std::borrow::Cow<'_, Key> {
    match walcast_core::source_scope::current() {
        Some(source) if !key.labels().any(|l| l.key() == "source") => std::borrow::Cow::Owned(
            key.with_extra_labels(vec![Label::new("source", SharedString::from(source))]),
        ),
        _ => std::borrow::Cow::Borrowed(key),
    }
}

impl<R: metrics::Recorder> metrics::Recorder for BySource<R> {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_counter(key, unit, description)
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_gauge(key, unit, description)
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_histogram(key, unit, description)
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        self.0.register_counter(&source_key(key), metadata)
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        self.0.register_gauge(&source_key(key), metadata)
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.0.register_histogram(&source_key(key), metadata)
    }
}

/// Sources removed from this worker (`walcast source remove`): their series, left at
/// their last values by the recorder (it forgets nothing), are no longer rendered, so a
/// removed source does not look like a source no worker reads.
static REMOVED: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn removed() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<String>> {
    REMOVED.lock().unwrap_or_else(|p| p.into_inner())
}

/// `source` was removed: `/metrics` leaves its series out (until it is added again).
pub fn source_removed(source: &str) {
    removed().insert(source.to_string());
}

/// `source` runs (again) in this worker: its series are rendered.
pub fn source_added(source: &str) {
    removed().remove(source);
}

/// The Prometheus text of `/metrics`, without the series of removed sources.
pub fn render(handle: &PrometheusHandle) -> String {
    without_sources(handle.render(), &removed())
}

fn without_sources(text: String, removed: &std::collections::BTreeSet<String>) -> String {
    if removed.is_empty() {
        return text;
    }
    let labels: Vec<String> = removed.iter().map(|s| format!("source=\"{s}\"")).collect();
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let series = line.split_once('}').map_or("", |(series, _)| series);
        if labels.iter().any(|l| series.contains(l.as_str())) {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(key: &Key) -> Vec<(String, String)> {
        key.labels()
            .map(|l| (l.key().to_string(), l.value().to_string()))
            .collect()
    }

    #[tokio::test]
    async fn work_for_a_source_is_labelled_with_it() {
        let key = Key::from_parts("walcast_cdc_active", vec![Label::new("consumer", "x")]);
        assert_eq!(labels(&source_key(&key)), [("consumer".into(), "x".into())]);
        let labelled =
            walcast_core::source_scope::within("shop", async { labels(&source_key(&key)) }).await;
        assert_eq!(
            labelled,
            [
                ("consumer".into(), "x".into()),
                ("source".into(), "shop".into())
            ]
        );
        let named = Key::from_parts(
            "walcast_sources_given_up_total",
            vec![Label::new("source", "a")],
        );
        let kept =
            walcast_core::source_scope::within("shop", async { labels(&source_key(&named)) }).await;
        assert_eq!(
            kept,
            [("source".into(), "a".into())],
            "an explicit source label is kept"
        );
    }

    #[test]
    fn a_removed_source_s_series_are_left_out() {
        let text = "# TYPE walcast_cdc_active gauge\nwalcast_cdc_active{source=\"default\"} 1\nwalcast_cdc_active{source=\"shop\"} 0\nwalcast_cdc_active{source=\"shop2\"} 0\nwalcast_sources 1\n".to_string();
        let removed = ["shop".to_string()].into_iter().collect();
        assert_eq!(
            without_sources(text.clone(), &removed),
            "# TYPE walcast_cdc_active gauge\nwalcast_cdc_active{source=\"default\"} 1\nwalcast_cdc_active{source=\"shop2\"} 0\nwalcast_sources 1\n"
        );
        assert_eq!(without_sources(text.clone(), &Default::default()), text);
    }
}
