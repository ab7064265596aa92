//! The baseline of the `outbox` benchmark: an outbox relay that polls a table by `xid8`
//! offset below the snapshot horizon (the Watermill-style design).
//!
//! Each row records the id of the transaction that wrote it (`pg_current_xact_id()`).
//! A poll reads the rows past the offset `(tx, id)` whose transaction is older than
//! `pg_snapshot_xmin(pg_current_snapshot())` — every transaction below that horizon has
//! ended, so no row can still appear behind the offset — in `(tx, id)` order, at most
//! `batch` of them; publishes them all to JetStream (`Nats-Msg-Id` = the row id, publishes
//! pipelined), waits for every PubAck, then stores the new offset (one upsert per batch).
//! A poll that found less than a batch waits `interval` before the next.

use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::{self, stream};
use async_nats::HeaderMap;
use bytes::Bytes;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

/// Its stream and subject (walcast's relay uses `WALCAST_OUTBOX`, `walcast.outbox.>`).
pub const STREAM: &str = "POLL_OUTBOX";
pub const SUBJECT: &str = "poll.outbox.bench";

/// The outbox table it polls, written by `bench_emit` in the same transaction as
/// `walcast.emit`, and the table its offset is stored in.
pub const SETUP_SQL: &str = "
    CREATE TABLE bench_outbox (
        id      bigserial,
        tx      xid8  NOT NULL DEFAULT pg_current_xact_id(),
        key     text  NOT NULL,
        payload jsonb NOT NULL,
        PRIMARY KEY (tx, id));
    CREATE TABLE bench_offsets (relay text PRIMARY KEY, tx xid8 NOT NULL, id int8 NOT NULL);";

pub struct PollRelay {
    pub db: Client,
    pub js: jetstream::Context,
    /// Rows per poll.
    pub batch: i64,
    /// Wait after a poll that found less than a batch.
    pub interval: Duration,
}

/// The JetStream settings walcast's relay uses (its defaults), so both pay the same.
pub fn context(client: async_nats::Client) -> jetstream::Context {
    jetstream::ContextBuilder::new()
        .timeout(walcast_outbox::config::DEFAULT_ACK_TIMEOUT)
        .max_ack_inflight(walcast_outbox::config::DEFAULT_MAX_IN_FLIGHT)
        .backpressure_on_inflight(true)
        .build(client)
}

pub fn stream_config() -> stream::Config {
    stream::Config {
        name: STREAM.into(),
        subjects: vec!["poll.outbox.>".into()],
        num_replicas: walcast_outbox::config::DEFAULT_REPLICAS,
        max_age: walcast_outbox::config::DEFAULT_MAX_AGE,
        duplicate_window: walcast_outbox::config::DEFAULT_DUPLICATE_WINDOW,
        storage: stream::StorageType::File,
        ..Default::default()
    }
}

impl PollRelay {
    /// Relay until `cancel`; an error (Postgres, NATS, a refused publish) ends it.
    pub async fn run(self, cancel: CancellationToken) -> anyhow::Result<()> {
        self.js
            .create_or_update_stream(stream_config())
            .await
            .context("creating the polling relay's stream")?;
        let mut offset = self.stored_offset().await?;
        while !cancel.is_cancelled() {
            let found = self.poll(&mut offset).await?;
            if found < self.batch {
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = tokio::time::sleep(self.interval) => {}
                }
            }
        }
        Ok(())
    }

    async fn stored_offset(&self) -> anyhow::Result<(String, i64)> {
        let row = self
            .db
            .query_opt(
                "SELECT tx::text, id FROM bench_offsets WHERE relay = $1",
                &[&"poll"],
            )
            .await?;
        Ok(row.map_or(("0".into(), 0), |r| (r.get(0), r.get(1))))
    }

    /// One poll: publish what is below the horizon past `offset`, wait for the acks,
    /// store the new offset. The number of rows found.
    async fn poll(&self, offset: &mut (String, i64)) -> anyhow::Result<i64> {
        let rows = self
            .db
            .query(
                // The offset's xid as text under another name: `ORDER BY tx` would
                // otherwise sort by that text ('10' < '9'), not by xid8.
                "SELECT tx::text AS offset_tx, id, key, payload::text FROM bench_outbox
                 WHERE (tx, id) > ($1::text::xid8, $2)
                   AND tx < pg_snapshot_xmin(pg_current_snapshot())
                 ORDER BY tx, id
                 LIMIT $3",
                &[&offset.0, &offset.1, &self.batch],
            )
            .await
            .context("polling the outbox")?;
        let mut acks = Vec::with_capacity(rows.len());
        for r in &rows {
            let (id, key, payload): (i64, &str, &str) = (r.get(1), r.get(2), r.get(3));
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", id.to_string().as_str());
            headers.insert("Outbox-Key", key);
            let ack = self
                .js
                .publish_with_headers(SUBJECT, headers, Bytes::from(payload.to_string()))
                .await
                .context("publishing")?;
            acks.push(ack);
        }
        for ack in acks {
            ack.await.context("waiting for a PubAck")?;
        }
        let Some(last) = rows.last() else {
            return Ok(0);
        };
        *offset = (last.get(0), last.get(1));
        self.db
            .execute(
                "INSERT INTO bench_offsets (relay, tx, id) VALUES ($1, $2::text::xid8, $3)
                 ON CONFLICT (relay) DO UPDATE SET tx = excluded.tx, id = excluded.id",
                &[&"poll", &offset.0, &offset.1],
            )
            .await
            .context("storing the offset")?;
        Ok(rows.len() as i64)
    }
}
