//! The ws-front process: WebSocket + SSE for realtime clients, fed by NATS.

use anyhow::Context;
use clap::Parser;
use walcast_bus::admin::AdminClient;
use walcast_bus::subs::SubsClient;
use walcast_bus::Bus;
use walcast_front::Front;

use crate::config::{redact_url, HttpArgs, LogArgs};
use crate::front::FrontArgs;
use crate::http::{ops_router, serve, OpsState};

/// Serves realtime clients (Supabase Realtime protocol) from the changes the cdc-worker
/// publishes on NATS. Run as many replicas as you like.
#[derive(Parser, Debug, Clone)]
#[command(name = "ws-front", version, about)]
pub struct WsFrontConfig {
    /// NATS server the cdc-worker publishes to.
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    pub nats_url: String,
    #[command(flatten)]
    pub nats_auth: crate::config::NatsAuthArgs,
    #[command(flatten)]
    pub front: FrontArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

pub async fn main(cfg: WsFrontConfig) -> anyhow::Result<()> {
    crate::telemetry::init_logs(&cfg.log);
    cfg.front.validate()?;
    cfg.front.operator.warn_if_none();
    let mut described = cfg.front.describe();
    described["nats_url"] = redact_url(&cfg.nats_url).into();
    described["nats_auth"] = cfg.nats_auth.describe();
    described["http"] = cfg.http.describe();
    tracing::info!(config = %described, "ws-front starting");
    let metrics = crate::telemetry::init_metrics()?;
    let id = format!("front-{}", crate::cdc_worker::instance_id());
    let bus = Bus::nats_with(
        &cfg.nats_url,
        &format!("walcast-{id}"),
        &cfg.nats_auth.auth().inbox_for("front"),
    )
    .await
    .with_context(|| format!("connecting to NATS at {}", redact_url(&cfg.nats_url)))?;
    let subs = SubsClient::new(&bus, None)?;
    let admin = AdminClient::new(&bus, None)?;
    let listener = cfg.http.bind().await?;
    let signal = crate::shutdown::on_signal();
    let cancel = tokio_util::sync::CancellationToken::new();
    let presence = cfg.front.presence(&bus, &id, &cancel);
    let front = Front::start_with_presence(
        cfg.front.config(&id),
        bus.clone(),
        subs,
        cfg.front.projects(admin)?,
        presence,
        cancel.clone(),
    )
    .await
    .context("starting the front")?;
    crate::shutdown::drain_then_stop(signal, front.clone(), cancel.clone());
    let state = OpsState {
        sources: None,
        cdc: None,
        outbox: None,
        front: Some(front.clone()),
        bus,
        metrics,
        lease_mode: String::new(),
        lease: None,
        key: cfg.front.operator.key(),
    };
    let tracker = tokio_util::task::TaskTracker::new();
    crate::beacon::spawn(&tracker, id, state.clone(), cancel.clone());
    let router = front.router().merge(ops_router(state));
    tracing::info!(addr = ?listener.local_addr().ok(), "serving realtime clients");
    serve(listener, router, cancel.clone().cancelled_owned())
        .await
        .context("http server")?;
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
    front.closed().await;
    Ok(())
}
