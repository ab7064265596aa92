//! The snapshotter: on the source's leader, one term at a time, it takes the running or
//! oldest queued snapshot of `walcast.snapshots` and reads it chunk by chunk, each chunk
//! between a low and a high signed watermark, handing the rows to the change-stream
//! consumer through the [`Board`]. After JetStream acknowledged a chunk's `READ` events it
//! stores the chunk's last key: a new leader resumes from there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::value::RawValue;
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use walcast_bus::ColumnInfo;
use walcast_pipeline::{PipelineHealth, SnapshotProgress};
use walcast_protocol::filter::Filter;

use super::board::{row_key, Board, ChunkMeta, ChunkRow};
use super::query::{chunk_query, ChunkQuery, Shape};
use super::store::{self, Snapshot, SnapshotError};
use super::{Mark, SnapshotConfig, Watermark, PREFIX};
use crate::telemetry;

/// How long to wait for transactions running when a low watermark committed to finish
/// (see [`Snapshotter::settle_horizon`]).
const HORIZON_WAIT: Duration = Duration::from_millis(200);
/// After an error, before trying again.
const BACKOFF: Duration = Duration::from_secs(2);

/// See the module docs.
pub struct Snapshotter {
    cfg: SnapshotConfig,
    board: Arc<Board>,
    health: Arc<PipelineHealth>,
}

/// What one chunk attempt came to.
enum Chunk {
    /// No row left: the snapshot is done.
    Empty,
    /// Stored: rows read, rows published, the last key.
    Stored {
        read: i64,
        last_key: String,
    },
    /// Not stored in time (a restart of the consumer, JetStream slow): read it again.
    Retry,
    Stopped,
}

/// A snapshot being read.
struct Active {
    snap: Snapshot,
    shape: Shape,
    query: ChunkQuery,
    meta: Arc<ChunkMeta>,
}

impl Snapshotter {
    pub fn new(cfg: SnapshotConfig, board: Arc<Board>, health: Arc<PipelineHealth>) -> Self {
        Snapshotter { cfg, board, health }
    }

    /// Work until `stop` (the term's end).
    pub async fn run(self, stop: CancellationToken) {
        loop {
            let r = tokio::select! {
                _ = stop.cancelled() => return,
                r = self.session(&stop) => r,
            };
            if let Err(e) = r {
                tracing::warn!(error = %e, "snapshotter: retrying");
            }
            self.health.set_snapshot(None);
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(BACKOFF) => {}
            }
        }
    }

    async fn session(&self, stop: &CancellationToken) -> Result<(), SnapshotError> {
        let client = walcast_pgtls::connect(&self.cfg.database_url)
            .await
            .map_err(|e| SnapshotError::Connect(e.to_string()))?;
        client.batch_execute(store::READ_SETTINGS).await?;
        loop {
            match store::next(&client).await? {
                Some(snap) => self.snapshot(&client, snap, stop).await?,
                None => tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(self.cfg.poll) => {}
                },
            }
            if stop.is_cancelled() {
                return Ok(());
            }
        }
    }

    /// Read one snapshot to its end (or the term's, or its cancellation).
    async fn snapshot(
        &self,
        client: &Client,
        snap: Snapshot,
        stop: &CancellationToken,
    ) -> Result<(), SnapshotError> {
        let id = snap.id;
        let active = match self.prepare(client, snap).await {
            Ok(a) => a,
            Err(e) if e.is_permanent() => return self.end(client, id, "failed", Some(e)).await,
            Err(e) => return Err(e),
        };
        tracing::info!(id, table = %active.meta.table, "snapshot running");
        metrics::gauge!(telemetry::SNAPSHOTS_RUNNING).increment(1.0);
        let r = self.chunks(client, active, stop).await;
        metrics::gauge!(telemetry::SNAPSHOTS_RUNNING).decrement(1.0);
        self.health.set_snapshot(None);
        match r {
            Err(e) if e.is_permanent() => self.end(client, id, "failed", Some(e)).await,
            other => other,
        }
    }

    async fn end(
        &self,
        client: &Client,
        id: i64,
        state: &'static str,
        error: Option<SnapshotError>,
    ) -> Result<(), SnapshotError> {
        let message = error.map(|e| e.to_string());
        match &message {
            Some(m) => tracing::warn!(id, error = %m, "snapshot failed"),
            None => tracing::info!(id, state, "snapshot ended"),
        }
        store::finish(client, id, state, message.as_deref()).await?;
        metrics::counter!(telemetry::SNAPSHOTS_ENDED, "state" => state).increment(1);
        Ok(())
    }

    /// The table's shape and chunk queries; refused when the table no longer streams for
    /// the snapshot's project or the project is not on this source.
    async fn prepare(&self, client: &Client, snap: Snapshot) -> Result<Active, SnapshotError> {
        let name = walcast_core::sql::qualified(&snap.schema, &snap.table);
        if let Some(p) = &self.cfg.projects {
            if !p.admits(&snap.project, "snapshot").await.unwrap_or(false) {
                return Err(SnapshotError::NotStreaming {
                    table: name,
                    project: snap.project,
                });
            }
        }
        if !store::streaming(client, &snap.project, &snap.schema, &snap.table).await? {
            return Err(SnapshotError::NotStreaming {
                table: name,
                project: snap.project,
            });
        }
        let shape = store::shape(client, &snap.schema, &snap.table).await?;
        let query = chunk_query(&shape, &Filter::parse(&snap.filter)?).map_err(|source| {
            SnapshotError::Query {
                table: name,
                source,
            }
        })?;
        let columns = shape
            .columns
            .iter()
            .map(|c| ColumnInfo {
                name: c.name.clone(),
                type_name: c.typname.clone(),
            })
            .collect();
        let meta = Arc::new(ChunkMeta {
            project: snap.project.clone(),
            schema: snap.schema.clone(),
            table: snap.table.clone(),
            pk: shape.pk.clone(),
            columns,
        });
        Ok(Active {
            snap,
            shape,
            query,
            meta,
        })
    }

    /// Chunk after chunk, paced to `rows_per_sec`.
    async fn chunks(
        &self,
        client: &Client,
        mut a: Active,
        stop: &CancellationToken,
    ) -> Result<(), SnapshotError> {
        let (started, mut read_now) = (Instant::now(), 0u64);
        loop {
            self.show(&a.snap);
            match self.chunk(client, &a, stop).await? {
                Chunk::Stopped => return Ok(()),
                Chunk::Empty => return self.end(client, a.snap.id, "done", None).await,
                Chunk::Retry => {
                    metrics::counter!(telemetry::SNAPSHOT_CHUNKS, "outcome" => "retried")
                        .increment(1);
                    tracing::info!(
                        id = a.snap.id,
                        "snapshot chunk not stored in time: reading it again"
                    );
                }
                Chunk::Stored { read, last_key } => {
                    metrics::counter!(telemetry::SNAPSHOT_CHUNKS, "outcome" => "stored")
                        .increment(1);
                    if !store::progress(client, a.snap.id, &last_key, read).await? {
                        tracing::info!(id = a.snap.id, "snapshot cancelled");
                        return Ok(());
                    }
                    a.snap.rows_done += read;
                    a.snap.chunks_done += 1;
                    a.snap.last_key = Some(last_key);
                    read_now += read as u64;
                    if read < i64::from(self.cfg.chunk_rows.max(1)) {
                        // A short chunk read every row after the last key: a row
                        // written since is on the stream as its change.
                        self.show(&a.snap);
                        return self.end(client, a.snap.id, "done", None).await;
                    }
                }
            }
            if !self.pace(started, read_now, stop).await {
                return Ok(());
            }
        }
    }

    fn show(&self, s: &Snapshot) {
        self.health.set_snapshot(Some(SnapshotProgress {
            id: s.id,
            project: s.project.clone(),
            table: format!("{}.{}", s.schema, s.table),
            rows_done: s.rows_done,
            rows_estimate: s.rows_estimate,
            chunks_done: s.chunks_done,
        }));
    }

    /// Sleep until `read` rows since `started` are within the rate; `false`: stopped.
    async fn pace(&self, started: Instant, read: u64, stop: &CancellationToken) -> bool {
        if self.cfg.rows_per_sec == 0 {
            return !stop.is_cancelled();
        }
        let due = Duration::from_secs_f64(read as f64 / self.cfg.rows_per_sec as f64);
        let wait = due.saturating_sub(started.elapsed());
        tokio::select! {
            _ = stop.cancelled() => false,
            _ = tokio::time::sleep(wait) => true,
        }
    }

    /// One chunk: low watermark, read, high watermark, wait for its rows to be stored.
    async fn chunk(
        &self,
        client: &Client,
        a: &Active,
        stop: &CancellationToken,
    ) -> Result<Chunk, SnapshotError> {
        let key = (a.snap.id, nonce());
        let done = self.board.register(key, a.meta.clone());
        let read = async {
            self.emit(client, key, Mark::Low).await?;
            self.settle_horizon(client).await?;
            let rows = self.read(client, a).await?;
            let Some(last) = rows.last().map(|r| r.key.clone()) else {
                return Ok(None);
            };
            let n = rows.len() as i64;
            self.board.fill(key, rows);
            self.emit(client, key, Mark::High).await?;
            Ok::<_, SnapshotError>(Some((n, last)))
        };
        let (n, last_key) = match read.await {
            Ok(Some(r)) => r,
            Ok(None) => {
                self.board.remove(key);
                return Ok(Chunk::Empty);
            }
            Err(e) => {
                self.board.remove(key);
                return Err(e);
            }
        };
        let outcome = tokio::select! {
            _ = stop.cancelled() => Chunk::Stopped,
            r = tokio::time::timeout(self.cfg.ack_timeout, done) => match r {
                Ok(Ok(published)) => {
                    metrics::counter!(telemetry::SNAPSHOT_ROWS).increment(published);
                    Chunk::Stored { read: n, last_key }
                }
                _ => Chunk::Retry,
            },
        };
        self.board.remove(key);
        Ok(outcome)
    }

    async fn emit(
        &self,
        client: &Client,
        key: super::board::ChunkKey,
        mark: Mark,
    ) -> Result<(), SnapshotError> {
        let body = serde_json::to_string(&Watermark {
            id: key.0,
            chunk: key.1,
            mark,
        })
        .map_err(|source| SnapshotError::Row {
            table: PREFIX.into(),
            source,
        })?;
        client
            .execute("SELECT walcast.emit_signed($1, $2)", &[&PREFIX, &body])
            .await?;
        Ok(())
    }

    /// A transaction whose commit record precedes the low watermark in the WAL may still
    /// be invisible to a snapshot taken right after (its commit is recorded, and it leaves
    /// the running transactions a moment later): the chunk would miss its change, and the
    /// consumer, noting changes from the low watermark on, would not drop the row. So
    /// wait until the transactions running now (after the low watermark committed) are
    /// over, for at most [`HORIZON_WAIT`] (a transaction still running by then is a long
    /// one, not one in the middle of its commit).
    async fn settle_horizon(&self, client: &Client) -> Result<(), SnapshotError> {
        let xip: Vec<String> = client
            .query(
                "SELECT x::text FROM pg_snapshot_xip(pg_current_snapshot()) x",
                &[],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let deadline = Instant::now() + HORIZON_WAIT;
        while !xip.is_empty() && Instant::now() < deadline {
            let running: i64 = client
                .query_one(
                    "SELECT count(*) FROM unnest($1::text[]) x
                      WHERE pg_xact_status(x::xid8) = 'in progress'",
                    &[&xip],
                )
                .await?
                .get(0);
            if running == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// The chunk's rows, after the last stored key.
    async fn read(&self, client: &Client, a: &Active) -> Result<Vec<ChunkRow>, SnapshotError> {
        let limit = i64::from(self.cfg.chunk_rows.max(1));
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&limit];
        let sql = match &a.snap.last_key {
            Some(last) => {
                params.push(last);
                &a.query.next
            }
            None => &a.query.first,
        };
        params.extend(
            a.query
                .filter_params
                .iter()
                .map(|p| p as &(dyn ToSql + Sync)),
        );
        let rows = client.query(sql.as_str(), &params).await?;
        let table = format!("{}.{}", a.shape.schema, a.shape.table);
        rows.iter()
            .map(|r| {
                let text: String = r.get(0);
                let bad = |source| SnapshotError::Row {
                    table: table.clone(),
                    source,
                };
                let map: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_str(&text).map_err(bad)?;
                let key = row_key(&map, &a.shape.pk).unwrap_or_default();
                let record = RawValue::from_string(text).map_err(bad)?;
                Ok(ChunkRow { key, record })
            })
            .collect()
    }
}

/// A chunk attempt's nonce: unique within the process, unlikely to repeat across
/// processes (a watermark replayed from before a restart must name no chunk on the board).
fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    // Below 2^53: exact as a JSON number anywhere.
    h.finish() >> 11
}
