//! The snapshot benchmark's check (what snapshots promise: "the consumer's copy equals the
//! table at the end; no row twice at the seam"): the table's change stream consumed into
//! an in-memory mirror applied by position, as the README's consumer does — a message at
//! or before the position that last set its row (`(commit_lsn, seq)`) is dropped — then
//! compared with the table.
//!
//! What it counts about the seam: READ events for a key read before (a chunk published
//! again after a crash or a late acknowledgement: same rows, harmless), and READ events
//! *behind* their row, at or before the position of a change already applied to it. A
//! consumer dropping by position drops those (the README's "no duplicate at the seam");
//! one applying everything would apply such a row twice, the second time with an older
//! version. DBLog places every READ after the changes its chunk's read saw, so there
//! should be none.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use serde_json::Value;

/// A row of the benchmark's table: `(title, v)`; `None`: deleted.
pub type Row = Option<(String, i64)>;

/// `(commit_lsn, seq)`.
type Pos = (u64, u64);

/// The mirror and what it saw.
#[derive(Default)]
pub struct Mirror {
    /// Each key's row and the position that set it; whether a READ set it once.
    rows: HashMap<i64, (Pos, Row, bool)>,
    pub messages: u64,
    pub reads: u64,
    /// READ events for a key a READ had set before.
    pub reads_again: u64,
    /// READ events at or before the position of a change already applied to their row
    /// (dropped).
    pub reads_behind: u64,
}

impl Mirror {
    /// Apply one change event (its JSON); the key it touched.
    pub fn apply(&mut self, v: &Value) -> anyhow::Result<i64> {
        let pos = position(v)?;
        let kind = v["type"].as_str().context("an event without type")?;
        let (id, row) = match kind {
            "DELETE" => (key(&v["old_record"])?, None),
            "INSERT" | "UPDATE" | "READ" => row_of(&v["record"])?,
            other => anyhow::bail!("unexpected {other} event"),
        };
        self.messages += 1;
        let read = kind == "READ";
        let before = self.rows.get(&id);
        if read {
            self.reads += 1;
            if before.is_some_and(|(_, _, was_read)| *was_read) {
                self.reads_again += 1;
            }
        }
        if let Some((last, _, was_read)) = before {
            if *last >= pos {
                self.reads_behind += u64::from(read);
                return Ok(id);
            }
            let was_read = *was_read || read;
            self.rows.insert(id, (pos, row, was_read));
        } else {
            self.rows.insert(id, (pos, row, read));
        }
        Ok(id)
    }

    /// The live row of `id` (`None`: never seen or deleted).
    pub fn row(&self, id: i64) -> Option<&(String, i64)> {
        self.rows.get(&id).and_then(|(_, r, _)| r.as_ref())
    }

    /// Rows alive in the mirror.
    pub fn live(&self) -> usize {
        self.rows.values().filter(|(_, r, _)| r.is_some()).count()
    }
}

fn position(v: &Value) -> anyhow::Result<Pos> {
    let lsn: walcast_core::Lsn = v["commit_lsn"]
        .as_str()
        .context("an event without commit_lsn")?
        .parse()
        .map_err(|e| anyhow::anyhow!("commit_lsn: {e:?}"))?;
    Ok((lsn.0, v["seq"].as_u64().context("an event without seq")?))
}

fn key(record: &Value) -> anyhow::Result<i64> {
    record["id"].as_i64().context("a record without id")
}

fn row_of(record: &Value) -> anyhow::Result<(i64, Row)> {
    let title = record["title"].as_str().context("a record without title")?;
    let v = record["v"].as_i64().context("a record without v")?;
    Ok((key(record)?, Some((title.to_string(), v))))
}

/// Consume `subject` of the change stream from its start into a mirror until the event
/// of row `marker` is applied (the stream is waited for: it is created at the first
/// change). Nothing for `quiet` while waiting: an error.
pub async fn consume(
    nats: String,
    subject: String,
    marker: i64,
    quiet: Duration,
) -> anyhow::Result<Mirror> {
    let js = async_nats::jetstream::new(async_nats::connect(nats.as_str()).await?);
    let stream = walcast_changes::config::DEFAULT_CHANGES_STREAM;
    let s = loop {
        match js.get_stream(stream).await {
            Ok(s) => break s,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let config = async_nats::jetstream::consumer::pull::OrderedConfig {
        filter_subject: subject,
        ..Default::default()
    };
    let mut messages = s.create_consumer(config).await?.messages().await?;
    let mut mirror = Mirror::default();
    loop {
        let m = tokio::time::timeout(quiet, messages.next())
            .await
            .with_context(|| {
                format!(
                    "the mirror got nothing for {quiet:?} after {} events",
                    mirror.messages
                )
            })?
            .context("the consumer ended")??;
        let v: Value = serde_json::from_slice(&m.payload)?;
        if mirror.apply(&v)? == marker {
            return Ok(mirror);
        }
    }
}

/// How the mirror differs from the table.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Difference {
    pub table_rows: u64,
    /// Table rows the mirror lacks or has with other values.
    pub missing_or_different: u64,
    /// Mirror rows the table lacks.
    pub extra: u64,
}

/// Compare the mirror with the table `bench` (streamed, not held).
pub async fn compare(db: &tokio_postgres::Client, mirror: &Mirror) -> anyhow::Result<Difference> {
    let rows = db
        .query_raw("SELECT id, title, v FROM bench", std::iter::empty::<&str>())
        .await?;
    futures_util::pin_mut!(rows);
    let mut d = Difference::default();
    while let Some(r) = rows.next().await {
        let r = r?;
        let (id, title, v): (i64, String, i64) = (r.get(0), r.get(1), r.get(2));
        d.table_rows += 1;
        if mirror.row(id) != Some(&(title, v)) {
            d.missing_or_different += 1;
        }
    }
    let matched = d.table_rows - d.missing_or_different;
    d.extra = (mirror.live() as u64).saturating_sub(matched);
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(kind: &str, lsn: &str, seq: u64, id: i64, v: i64) -> Value {
        let rec = json!({"id": id, "title": "t", "v": v});
        match kind {
            "DELETE" => json!({"type": kind, "commit_lsn": lsn, "seq": seq, "old_record": rec}),
            _ => json!({"type": kind, "commit_lsn": lsn, "seq": seq, "record": rec}),
        }
    }

    #[test]
    fn a_mirror_applies_by_position_and_counts_the_seam() {
        let mut m = Mirror::default();
        m.apply(&ev("INSERT", "0/10", 0, 1, 1)).unwrap();
        // A READ placed after the insert: applied.
        m.apply(&ev("READ", "0/20", 0, 1, 1)).unwrap();
        m.apply(&ev("UPDATE", "0/30", 0, 1, 2)).unwrap();
        // A READ behind the update (an older version): dropped, counted.
        m.apply(&ev("READ", "0/20", 0, 1, 1)).unwrap();
        assert_eq!(m.row(1), Some(&("t".to_string(), 2)));
        assert_eq!((m.reads, m.reads_again, m.reads_behind), (2, 1, 1));
        // A chunk published again later: the same rows, a later position, applied.
        m.apply(&ev("READ", "1/0", 3, 1, 2)).unwrap();
        assert_eq!(m.reads_again, 2);
        m.apply(&ev("DELETE", "1/10", 0, 1, 2)).unwrap();
        assert_eq!((m.row(1), m.live()), (None, 0));
        m.apply(&ev("READ", "0/FF", 0, 2, 5)).unwrap();
        assert_eq!(m.live(), 1);
        assert!(m.apply(&json!({"type": "READ"})).is_err());
    }
}
