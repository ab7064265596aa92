//! What every benchmark starts with: throwaway Postgres and nats-server, our migrations,
//! and (all but `outbox`) one table with realtime enabled.

use anyhow::Context;
use walcast_testkit::{Nats, Postgres};

pub struct BenchEnv {
    pub pg: Postgres,
    pub nats: Nats,
    pub admin: tokio_postgres::Client,
}

/// Start the services, apply migrations, run `setup_sql` and enable `public.<table>`.
pub async fn start(setup_sql: &str, table: &str) -> anyhow::Result<BenchEnv> {
    let env = start_without_table(setup_sql).await?;
    walcast_realtime::catalog::tables::enable(&env.admin, "default", "public", table).await?;
    Ok(env)
}

/// Start the services, apply migrations and run `setup_sql` (no realtime table).
pub async fn start_without_table(setup_sql: &str) -> anyhow::Result<BenchEnv> {
    let pg = Postgres::start().context("starting postgres")?;
    let nats = Nats::start().context("starting nats-server")?;
    let admin = pg.connect().await?;
    let mut migr = walcast_pipeline::connect(&pg.url()).await?;
    walcast_realtime::migrate::migrate(&mut migr).await?;
    admin.batch_execute(setup_sql).await?;
    Ok(BenchEnv { pg, nats, admin })
}
