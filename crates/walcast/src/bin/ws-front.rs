use clap::Parser;
use walcast_worker::ws_front::{main as front_main, WsFrontConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    front_main(WsFrontConfig::parse()).await
}
