//! What every benchmark starts with: throwaway Postgres and nats-server, our migrations,
//! and (all but `outbox`) one table with realtime enabled.

use anyhow::Context;
use walcast_testkit::{Nats, Postgres};

pub struct BenchEnv {
    pub pg: Postgres,
    pub nats: Nats,
    pub admin: tokio_postgres::Client,
}

/// The keys of the secrets the benchmarks store ([`walcast_testkit::SECRETS_KEY`], which
/// they give walcast's processes).
pub fn secret_keys() -> anyhow::Result<walcast_control::secrets::SecretKeys> {
    Ok(walcast_control::secrets::SecretKeys::new(
        walcast_testkit::SECRETS_KEY,
        None,
    )?)
}

/// Start the services, apply migrations, run `setup_sql` and enable `public.<table>`.
pub async fn start(setup_sql: &str, table: &str) -> anyhow::Result<BenchEnv> {
    let env = start_without_table(setup_sql).await?;
    walcast_control::tables::enable(&env.admin, "default", "public", table).await?;
    Ok(env)
}

/// Start the services, apply migrations and run `setup_sql` (no realtime table).
pub async fn start_without_table(setup_sql: &str) -> anyhow::Result<BenchEnv> {
    let pg = Postgres::start().context("starting postgres")?;
    let nats = Nats::start().context("starting nats-server")?;
    let admin = pg.connect().await?;
    let mut migr = walcast_pipeline::connect(&pg.url()).await?;
    walcast_control::migrate::migrate(&mut migr).await?;
    admin.batch_execute(setup_sql).await?;
    Ok(BenchEnv { pg, nats, admin })
}

/// The `bench` table and a `load(n)` procedure committing `n` single-row inserts.
pub const LOAD_TABLE_SQL: &str =
    "CREATE TABLE bench (id int8 PRIMARY KEY, title text, done bool, at timestamptz);
     CREATE PROCEDURE load(n int) LANGUAGE plpgsql AS $$
     BEGIN
       FOR i IN 1..n LOOP
         INSERT INTO bench VALUES (i, 'row ' || i, i % 2 = 0, now());
         COMMIT;
       END LOOP;
     END $$;";

/// Create a wal2json slot for each name, all at the current position.
pub async fn create_slots(admin: &tokio_postgres::Client, slots: &[&str]) -> anyhow::Result<()> {
    for s in slots {
        admin
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'wal2json')",
                &[s],
            )
            .await
            .with_context(|| format!("creating slot {s}"))?;
    }
    Ok(())
}

/// `CALL load(rows)` ([`LOAD_TABLE_SQL`]); seconds it took.
pub async fn load(admin: &tokio_postgres::Client, rows: usize) -> anyhow::Result<f64> {
    let t = std::time::Instant::now();
    admin
        .execute("CALL load($1)", &[&i32::try_from(rows)?])
        .await?;
    Ok(t.elapsed().as_secs_f64())
}

/// Run a pipeline with `cfg` and `consumers` (publishing to `nats`) until `done` resolves,
/// failing after `max_wait` seconds; the seconds it ran.
pub async fn run_pipeline_until(
    cfg: walcast_pipeline::PipelineConfig,
    nats: &str,
    consumers: Vec<std::sync::Arc<dyn walcast_pipeline::ConsumerFactory>>,
    done: impl std::future::Future<Output = anyhow::Result<()>>,
    max_wait: u64,
) -> anyhow::Result<f64> {
    let bus = walcast_bus::Bus::nats(nats, "bench-pub").await?;
    let cancel = tokio_util::sync::CancellationToken::new();
    let slot = cfg.read.slot.clone();
    let started = std::time::Instant::now();
    let task = tokio::spawn(walcast_pipeline::run(
        cfg,
        bus,
        std::sync::Arc::new(walcast_pipeline::PipelineHealth::new(&slot)),
        walcast_lease::Fence::unfenced(cancel.clone()),
        consumers,
    ));
    let finished = tokio::time::timeout(std::time::Duration::from_secs(max_wait), done).await;
    let secs = started.elapsed().as_secs_f64();
    cancel.cancel();
    let worker = task.await;
    match finished {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => anyhow::bail!("{slot}: not done within {max_wait} s (worker: {worker:?})"),
    }
    worker??;
    Ok(secs)
}
