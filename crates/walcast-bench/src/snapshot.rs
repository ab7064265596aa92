//! Snapshots (`walcast snapshot`): a table of `--rows` rows snapshotted onto its change
//! stream while a writer runs single-row transactions at `--writer-rate` — inserts of new
//! keys, and (`--update-share` of them) updates and deletes of the table's rows, all over
//! the key range the snapshot reads. Prints the snapshot's rows/s and the writer's p99
//! latency without and with the snapshot running, and their ratio (the bound is 2).
//! With `--check` (default), a mirror of the stream applied by position must end
//! equal to the table ([`crate::snapshot_check`]); else the benchmark fails.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use tokio_util::sync::CancellationToken;
use walcast_bus::Bus;
use walcast_changes::config::ChangeStreamConfig;
use walcast_changes::snapshot::{store, Board, SnapshotConfig, Snapshotter};
use walcast_lease::Fence;
use walcast_pipeline::{PipelineConfig, PipelineHealth};

#[derive(Args)]
pub struct SnapshotBench {
    /// Rows in the table before the snapshot.
    #[arg(long, default_value_t = 200_000)]
    rows: i64,
    /// The writer's single-row inserts per second (during both phases).
    #[arg(long, default_value_t = 1_000)]
    writer_rate: u32,
    /// Seconds the writer runs alone first (its latency without the snapshot).
    #[arg(long, default_value_t = 10)]
    baseline_secs: u64,
    /// `SNAPSHOT_ROWS_PER_SEC` (0: no limit).
    #[arg(long, default_value_t = walcast_changes::snapshot::DEFAULT_ROWS_PER_SEC)]
    rows_per_sec: u32,
    /// `SNAPSHOT_CHUNK_ROWS`.
    #[arg(long, default_value_t = walcast_changes::snapshot::DEFAULT_CHUNK_ROWS)]
    chunk_rows: u32,
    /// Fail when the snapshot has not ended within this many seconds.
    #[arg(long, default_value_t = 1_800)]
    max_wait: u64,
    /// Percent of the writer's statements that update (three in four) or delete (one in
    /// four) a row of the table, all over its key range, instead of inserting a new key.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(0..=100))]
    update_share: u32,
    /// Consume the change stream into a mirror applied by position and compare it with
    /// the table at the end (fail on a difference).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    check: bool,
}

/// The row whose insert ends the run: the mirror has every change once it has it.
const MARKER: i64 = i64::MIN;
const SUBJECT: &str = "walcast.changes.default.public.bench";

pub async fn run(args: SnapshotBench) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rows > 0 && args.writer_rate > 0,
        "--rows and --writer-rate must be positive"
    );
    let crate::env::BenchEnv {
        pg,
        nats,
        mut admin,
    } = crate::env::start_without_table(&format!(
        "CREATE TABLE bench (id int8 PRIMARY KEY, title text NOT NULL, v int8 NOT NULL);
         INSERT INTO bench SELECT g, 'row ' || g, g FROM generate_series(1, {}) g;
         ANALYZE bench;",
        args.rows
    ))
    .await?;
    walcast_changes::tables::enable(&admin, "default", "public", "bench").await?;
    let db = pg.url();
    let cancel = CancellationToken::new();
    let health = Arc::new(PipelineHealth::new("walcast"));
    let board = Arc::new(Board::default());
    let pipeline = spawn_pipeline(&db, &nats.url(), &board, &health, &cancel).await?;
    let mut snap = SnapshotConfig::new(db.clone());
    snap.rows_per_sec = args.rows_per_sec;
    snap.chunk_rows = args.chunk_rows.max(1);
    let runner = Snapshotter::new(snap, board, health);
    let snapshotter = tokio::spawn(runner.run(cancel.clone()));

    let writer = walcast_pipeline::connect(&db).await?;
    let mirror = args.check.then(|| {
        let quiet = Duration::from_secs(args.max_wait);
        tokio::spawn(crate::snapshot_check::consume(
            nats.url(),
            SUBJECT.to_string(),
            MARKER,
            quiet,
        ))
    });
    // New keys below the table's: the snapshot does not chase the writer's inserts (those
    // are on the stream as INSERTs); its updates and deletes are all over the table's.
    let mix = Mix {
        rows: args.rows,
        update_share: args.update_share,
    };
    let alone = write(&writer, (-1, mix), args.writer_rate, async {
        tokio::time::sleep(Duration::from_secs(args.baseline_secs)).await;
        Ok(0.0)
    })
    .await?;
    let id = store::start(&mut admin, "default", "public", "bench", "").await?;
    let started = Instant::now();
    let wait = wait_done(&admin, id, args.max_wait);
    let during = write(&writer, (-10_000_001, mix), args.writer_rate, wait).await?;
    let secs = started.elapsed().as_secs_f64();
    let rows_done = during.result;
    let checked = match mirror {
        Some(task) => {
            writer
                .execute("INSERT INTO bench VALUES ($1, 'end', 0)", &[&MARKER])
                .await?;
            Some(check(&admin, task.await??).await?)
        }
        None => None,
    };
    cancel.cancel();
    let _ = snapshotter.await;
    let _ = pipeline.await;
    report(
        &args,
        (rows_done, secs),
        (alone.latencies, during.latencies),
    );
    if checked == Some(false) {
        anyhow::bail!("the mirror of the change stream differs from the table");
    }
    Ok(())
}

/// Print the snapshot's rows/s and the writer's p99 latencies.
fn report(
    args: &SnapshotBench,
    (rows_done, secs): (f64, f64),
    (alone, during): (Vec<f64>, Vec<f64>),
) {
    let (p_alone, p_during) = (p99(alone), p99(during));
    println!("snapshot: {rows_done:.0} rows in {secs:.2}s = {:.0} rows/s (SNAPSHOT_ROWS_PER_SEC {}, SNAPSHOT_CHUNK_ROWS {}, writer {}/s, {}% updates and deletes)", rows_done / secs, args.rows_per_sec, args.chunk_rows, args.writer_rate, args.update_share);
    println!("writer p99 latency, alone        : {:.2} ms", p_alone * 1e3);
    println!(
        "writer p99 latency, with snapshot: {:.2} ms",
        p_during * 1e3
    );
    println!(
        "ratio with / alone               : {:.2}",
        p_during / p_alone
    );
}

/// Compare the mirror with the table and print the result: whether they are equal.
async fn check(
    db: &tokio_postgres::Client,
    mirror: crate::snapshot_check::Mirror,
) -> anyhow::Result<bool> {
    let d = crate::snapshot_check::compare(db, &mirror).await?;
    let equal = d.missing_or_different == 0 && d.extra == 0;
    println!(
        "mirror equals table: {} ({} table rows; {} missing or different, {} extra)",
        if equal { "yes" } else { "no" },
        d.table_rows,
        d.missing_or_different,
        d.extra
    );
    println!(
        "stream: {} events, {} READ; READ of a key read before: {}; READ behind a change already applied (dropped by position; a duplicate at the seam for a consumer not dropping): {}",
        mirror.messages, mirror.reads, mirror.reads_again, mirror.reads_behind
    );
    Ok(equal)
}

/// The pipeline with the change-stream consumer sharing `board`, unfenced.
async fn spawn_pipeline(
    db: &str,
    nats: &str,
    board: &Arc<Board>,
    health: &Arc<PipelineHealth>,
    cancel: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<Result<(), walcast_pipeline::PipelineError>>> {
    let bus = Bus::nats(nats, "bench-pub").await?;
    let mut cfg = PipelineConfig::new(db);
    cfg.origin = "bench".into();
    let mut changes = ChangeStreamConfig::new(db);
    changes.board = Some(board.clone());
    let consumers = vec![walcast_changes::factory(changes)];
    Ok(tokio::spawn(walcast_pipeline::run(
        cfg,
        bus,
        health.clone(),
        Fence::unfenced(cancel.clone()),
        consumers,
    )))
}

/// Rows done once snapshot `id` is `done` (bounded).
async fn wait_done(db: &tokio_postgres::Client, id: i64, max_wait: u64) -> anyhow::Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(max_wait);
    loop {
        let r = db
            .query_one(
                "SELECT state, rows_done, error FROM walcast.snapshots WHERE id = $1",
                &[&id],
            )
            .await?;
        let (state, rows): (String, i64) = (r.get(0), r.get(1));
        match state.as_str() {
            "done" => return Ok(rows as f64),
            "queued" | "running" => {}
            _ => anyhow::bail!("snapshot {state}: {:?}", r.get::<_, Option<String>>(2)),
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "snapshot not done within {max_wait} s ({rows} rows)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Written {
    latencies: Vec<f64>,
    result: f64,
}

/// What the writer does: `update_share` percent of its statements touch the table's keys
/// `1..=rows`, the others insert new keys.
#[derive(Clone, Copy)]
struct Mix {
    rows: i64,
    update_share: u32,
}

/// Single-row statements at `rate` per second until `until` ends (inserts with keys
/// from `first_id` down, and the `mix`'s updates and deletes); each one's latency.
async fn write(
    db: &tokio_postgres::Client,
    (first_id, mix): (i64, Mix),
    rate: u32,
    until: impl std::future::Future<Output = anyhow::Result<f64>>,
) -> anyhow::Result<Written> {
    let insert = db
        .prepare("INSERT INTO bench (id, title, v) VALUES ($1, 'new', 0)")
        .await?;
    let update = db
        .prepare("UPDATE bench SET v = v + 1, title = 'updated' WHERE id = $1")
        .await?;
    let delete = db.prepare("DELETE FROM bench WHERE id = $1").await?;
    let period = Duration::from_secs_f64(1.0 / f64::from(rate));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut latencies = Vec::new();
    tokio::pin!(until);
    let (mut id, mut n) = (first_id, 0i64);
    loop {
        tokio::select! {
            r = &mut until => return Ok(Written { latencies, result: r? }),
            _ = tick.tick() => {
                let t = Instant::now();
                // 7919 is prime: the touched keys walk the whole range.
                let key = (n * 7_919).rem_euclid(mix.rows) + 1;
                match n % 100 < i64::from(mix.update_share) {
                    true if n % 4 == 3 => db.execute(&delete, &[&key]).await?,
                    true => db.execute(&update, &[&key]).await?,
                    false => {
                        id -= 1;
                        db.execute(&insert, &[&(id + 1)]).await?
                    }
                };
                latencies.push(t.elapsed().as_secs_f64());
                n += 1;
            }
        }
    }
}

fn p99(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * 0.99) as usize).min(v.len() - 1)]
}
