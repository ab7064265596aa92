//! `walcast serve`: the all-in-one server (the CDC pipeline and the realtime front in one
//! process), run by `walcast_worker::serve`.

use anyhow::Context;
use walcast_bus::Bus;
use walcast_worker::config::{CdcArgs, DbArgs, HttpArgs, LogArgs};

#[derive(clap::Args, Debug, Clone)]
pub struct ServeConfig {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    cdc: CdcArgs,
    #[command(flatten)]
    secrets: walcast_worker::config::SecretsArgs,
    /// NATS server; unset = in-process bus (single process, no scale-out).
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    nats_url: Option<String>,
    #[command(flatten)]
    nats_auth: walcast_worker::config::NatsAuthArgs,
    /// In-process bus queue size per subscriber (when NATS_URL is unset).
    #[arg(long, env = "BUS_CAPACITY", default_value_t = 65_536)]
    bus_capacity: usize,
    #[command(flatten)]
    front: walcast_worker::front::FrontArgs,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    log: LogArgs,
}

pub async fn serve(cfg: ServeConfig) -> anyhow::Result<()> {
    walcast_worker::telemetry::init_logs(&cfg.log);
    cfg.front.validate()?;
    let keys = cfg.secrets.keys()?;
    cfg.front.operator.warn_if_none();
    let mut described =
        walcast_worker::cdc_worker::describe(&cfg.db, &cfg.cdc, cfg.nats_url.as_deref(), &cfg.http);
    described["front"] = cfg.front.describe();
    described["secrets"] = walcast_worker::config::SecretsArgs::describe(&keys);
    described["nats_auth"] = cfg.nats_auth.describe();
    tracing::info!(config = %described, "walcast serve starting");
    let metrics = walcast_worker::telemetry::init_metrics()?;
    let origin = walcast_worker::cdc_worker::instance_id();
    let bus = match &cfg.nats_url {
        Some(url) => Bus::nats_with(
            url,
            &format!("walcast-{origin}"),
            &cfg.nats_auth.auth().inbox_for("worker"),
        )
        .await
        .with_context(|| {
            format!(
                "connecting to NATS at {}",
                walcast_worker::config::redact_url(url)
            )
        })?,
        None => Bus::local(cfg.bus_capacity),
    };
    let ops = walcast_worker::http::OpsHttp {
        listener: cfg.http.bind().await?,
        metrics,
        key: cfg.front.operator.key(),
    };
    let cancel = walcast_worker::shutdown::on_signal();
    let serve = walcast_worker::serve::Serve {
        db: &cfg.db,
        cdc: &cfg.cdc,
        keys,
        front: &cfg.front,
        bus,
        ops,
    };
    walcast_worker::serve::run(serve, cancel).await
}
