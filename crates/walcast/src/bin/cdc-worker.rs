use clap::Parser;
use walcast_worker::cdc_worker::{main as worker_main, CdcWorkerConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    worker_main(CdcWorkerConfig::parse()).await
}
