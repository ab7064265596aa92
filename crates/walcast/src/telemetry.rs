//! Logs (tracing) and metrics (Prometheus).

use std::io::IsTerminal;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

use crate::config::{LogArgs, LogFormat};

/// Sources this worker gave up because it led more than its fair share.
pub const SOURCES_GIVEN_UP: &str = "walcast_sources_given_up_total";
/// Sources this worker runs (leads or stands by for), the default one excluded.
pub const SOURCES: &str = "walcast_sources";

fn describe() {
    metrics::describe_counter!(
        SOURCES_GIVEN_UP,
        "Sources given up to another worker (this one led more than its fair share)"
    );
    metrics::describe_gauge!(
        SOURCES,
        "Sources other than the default that this worker runs (leads or stands by for)"
    );
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

/// Install the Prometheus recorder; the handle renders `/metrics`.
pub fn init_metrics() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets(&[
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ])
        .map_err(|e| anyhow::anyhow!("metrics buckets: {e}"))?
        .install_recorder()
        .map_err(|e| anyhow::anyhow!("installing the metrics recorder: {e}"))?;
    walcast_pipeline::telemetry::describe();
    walcast_realtime::telemetry::describe();
    walcast_lease::telemetry::describe();
    walcast_front::telemetry::describe();
    describe();
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
