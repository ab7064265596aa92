//! `walcast tail`: change events from NATS, printed as JSON lines.

use anyhow::Context;
use clap::Args;
use futures_util::StreamExt;
use walcast_bus::Bus;

use walcast_worker::config::redact_url;

#[derive(Args, Debug, Clone)]
pub struct TailArgs {
    /// NATS server the cdc-worker publishes to.
    #[arg(
        long,
        env = "NATS_URL",
        hide_env_values = true,
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    #[command(flatten)]
    pub nats_auth: walcast_worker::config::NatsAuthArgs,
    /// Subject pattern to follow.
    #[arg(long, default_value = walcast_bus::subject::REALTIME_ALL)]
    pub subject: String,
    /// Stop after this many messages.
    #[arg(long)]
    pub count: Option<usize>,
}

/// Print change events as JSON lines.
pub async fn tail(args: TailArgs) -> anyhow::Result<()> {
    let bus = Bus::nats_with(
        &args.nats_url,
        "walcast-tail",
        &args.nats_auth.auth().inbox_for("tail"),
    )
    .await
    .with_context(|| format!("connecting to {}", redact_url(&args.nats_url)))?;
    let mut sub = bus.subscribe(&args.subject).await?;
    let mut seen = 0usize;
    while let Some(msg) = sub.next().await {
        println!("{}", String::from_utf8_lossy(&msg.payload));
        seen += 1;
        if args.count.is_some_and(|c| seen >= c) {
            break;
        }
    }
    Ok(())
}
