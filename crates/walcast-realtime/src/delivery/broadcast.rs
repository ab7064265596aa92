//! Broadcast from the database: a [`Consumer`] that turns each committed insert into
//! `realtime.messages` (what `realtime.send` and `realtime.broadcast_changes` write) into
//! a broadcast on the bus, which every front delivers to the topic's channels.
//!
//! Only committed rows are read (the WAL), in commit order; a rolled-back `send` is
//! never seen. The body is the row's `payload` with its `id` added (as Supabase sends
//! it), and `meta.id` is the id too. A broadcast belongs to the row's `project` (set by
//! the database from the writer's `walcast.project`, see walcast-control/sql/0014_project_messages.sql),
//! and only that project's channels receive it.
//!
//! A row of `realtime.send_binary` (walcast-control/sql/0016_send_binary.sql) has its bytes in
//! `binary_payload`: wal2json writes them as hex (the decoding sessions pin
//! `bytea_output = hex`), read back byte for byte ([`walcast_wal2json::decode_bytea`]), and the bus envelope carries them raw with
//! `binary: true` (no `id` added: bytes have no field to add it to; `meta.id` has it). A
//! row whose bytes cannot be read is skipped as `undecodable`.
//!
//! A broadcast larger than `MAX_RECORD_BYTES` or than one bus message can carry is
//! skipped (logged, counted in `walcast_cdc_changes_skipped_total{reason=
//! "payload_too_large"}`, shown on `/health`): it never stalls the pipeline.
//!
//! Like every message of the pipeline it goes through the session's [`Publisher`]: not
//! sent once the leadership term's fence closed, and stamped with the term, so that the
//! fronts drop a late one from a leader that woke up after losing its lease.

use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde_json::value::RawValue;
use serde_json::Value;
use walcast_bus::broadcast::{BroadcastTarget, Envelope};
use walcast_wal2json::{Change, Column, Lsn};

use std::sync::Arc;

use walcast_bus::BusError;
use walcast_pipeline::{ConsumerError, Position, PublishError, Publisher};

use crate::telemetry;
use walcast_control::tables::DEFAULT_PROJECT;
use walcast_pipeline::consumer::{Consumer, Handled, Item};
use walcast_pipeline::health::PipelineHealth;

/// Room left in a bus message for its subject and headers.
const MESSAGE_OVERHEAD: usize = 1024;

/// How `/health` and the logs name a skipped database broadcast.
const SKIPPED_AS: &str = "realtime.messages";

/// The schema of `realtime.messages` and its partitions (`messages_YYYY_MM_DD`).
pub const REALTIME_SCHEMA: &str = "realtime";

/// One broadcast read from a `realtime.messages` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DbMessage {
    /// The project it is for.
    pub project: String,
    pub subject: String,
    pub payload: Bytes,
    /// From `realtime.send_binary` (`binary_payload`).
    pub binary: bool,
}

/// Why a broadcast cannot be published: `Some(text)` when `payload` is over
/// `max_record_bytes` or, with room for subject and headers, over the bus's
/// `max_payload`.
pub fn too_large(
    payload: usize,
    max_record_bytes: usize,
    max_payload: Option<usize>,
) -> Option<String> {
    if payload > max_record_bytes {
        return Some(format!(
            "{payload} bytes, over MAX_RECORD_BYTES ({max_record_bytes})"
        ));
    }
    let budget = max_payload?.saturating_sub(MESSAGE_OVERHEAD);
    (payload > budget)
        .then(|| format!("{payload} bytes, over the bus's max_payload less {MESSAGE_OVERHEAD}"))
}

fn value(columns: &[Column<'_>], name: &str) -> Option<Value> {
    let raw = columns.iter().find(|c| c.name == name)?.value?;
    serde_json::from_str(raw.get()).ok()
}

/// Why a `realtime.messages` row that is a broadcast cannot become one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Undecodable {
    #[error("binary_payload: {0}")]
    Bytes(#[from] walcast_wal2json::ByteaError),
    #[error("binary_payload is not a bytea")]
    NotText,
}

/// The body of a row and whether it is binary: `binary_payload`'s bytes as they are
/// (`realtime.send_binary`; taken first, as Supabase does), else `payload` with the
/// row's `id` added.
fn body(columns: &[Column<'_>], id: &str) -> Result<(bool, Vec<u8>), Undecodable> {
    if let Some(col) = columns.iter().find(|c| c.name == "binary_payload") {
        if !col.is_null() {
            // wal2json's hex less its `\x`, which `text()` puts back (a bytea column).
            let quoted = col.value.is_some_and(|v| v.get().starts_with('"'));
            let text = col.text().filter(|_| quoted).ok_or(Undecodable::NotText)?;
            return Ok((true, walcast_wal2json::decode_bytea(&text)?));
        }
    }
    // jsonb arrives as its text in a JSON string.
    let mut body = match value(columns, "payload") {
        Some(Value::String(text)) => serde_json::from_str(&text).unwrap_or(Value::Null),
        _ => Value::Null,
    };
    if let Value::Object(m) = &mut body {
        m.entry("id").or_insert_with(|| Value::from(id));
    }
    Ok((false, body.to_string().into_bytes()))
}

/// The broadcast of an inserted `realtime.messages` row (`Ok(None)`: not a broadcast row).
pub fn message(columns: &[Column<'_>]) -> Result<Option<DbMessage>, Undecodable> {
    if value(columns, "extension").as_ref().and_then(Value::as_str) != Some("broadcast") {
        return Ok(None);
    }
    let text = |name| value(columns, name).and_then(|v| v.as_str().map(String::from));
    let (Some(topic), Some(id)) = (text("topic"), text("id")) else {
        return Ok(None);
    };
    let event = text("event");
    let private = value(columns, "private")
        .and_then(|p| p.as_bool())
        .unwrap_or(false);
    // Without the column (a table that predates walcast-control/sql/0014), the default project's.
    let project = match value(columns, "project") {
        None | Some(Value::Null) => DEFAULT_PROJECT.to_string(),
        Some(Value::String(p)) => p,
        Some(_) => return Ok(None),
    };
    let (binary, body) = body(columns, &id)?;
    let meta = serde_json::json!({ "id": id }).to_string();
    let Ok(meta) = RawValue::from_string(meta) else {
        return Ok(None);
    };
    let env = Envelope::new(event.unwrap_or_default().into(), binary, Some(&meta));
    let target = BroadcastTarget {
        project,
        private,
        name: topic,
    };
    // A topic too long for a subject token travels in the head line (see the bus module).
    Ok(target
        .message(env, &body)
        .map(|(subject, payload)| DbMessage {
            project: target.project.clone(),
            subject,
            payload,
            binary,
        }))
}

/// The consumer (see the module docs).
pub struct DbBroadcast {
    publisher: Publisher,
    health: Arc<PipelineHealth>,
    max_record_bytes: usize,
    txn: Vec<DbMessage>,
    unconfirmed: bool,
    /// The projects of this source (`None`: all).
    projects: Option<Arc<walcast_control::source_projects::SourceProjects>>,
}

impl DbBroadcast {
    pub fn new(
        publisher: Publisher,
        health: Arc<PipelineHealth>,
        max_record_bytes: usize,
    ) -> DbBroadcast {
        DbBroadcast {
            publisher,
            health,
            max_record_bytes,
            txn: Vec::new(),
            unconfirmed: false,
            projects: None,
        }
    }

    /// Whether a broadcast for `project` may pass (see [`Self::for_projects`]).
    async fn admits(&self, project: &str) -> Result<bool, crate::error::RealtimeError> {
        match &self.projects {
            Some(p) => Ok(p.admits(project, "broadcast").await?),
            None => Ok(true),
        }
    }

    /// Only the broadcasts of `projects` (the source's), the others dropped and counted.
    pub fn for_projects(
        mut self,
        projects: Option<Arc<walcast_control::source_projects::SourceProjects>>,
    ) -> DbBroadcast {
        self.projects = projects;
        self
    }

    /// Publish the transaction's broadcasts; one too large for the bus is skipped
    /// (see the module docs), as is one the server refuses as too large (its
    /// `max_payload` can shrink on a reconnect): retrying could never deliver it.
    async fn publish(&mut self, commit_lsn: Lsn) -> Result<(), PublishError> {
        for m in std::mem::take(&mut self.txn) {
            let size = m.payload.len() + m.subject.len();
            let max_payload = self.publisher.max_payload();
            if let Some(why) = too_large(size, self.max_record_bytes, max_payload) {
                self.skip(commit_lsn, &why);
                continue;
            }
            let at = Position::commit(commit_lsn);
            match self.publisher.publish(m.subject, at, &[], m.payload).await {
                Err(PublishError::Bus(e @ BusError::PayloadTooLarge { .. })) => {
                    self.skip(commit_lsn, &e.to_string());
                    continue;
                }
                other => other?,
            }
            let kind = if m.binary { "binary" } else { "json" };
            metrics::counter!(telemetry::DB_BROADCASTS, "payload" => kind).increment(1);
            self.unconfirmed = true;
        }
        Ok(())
    }

    fn skip(&self, commit_lsn: Lsn, why: &str) {
        self.health.report_skip(
            SKIPPED_AS,
            Some(commit_lsn),
            "payload_too_large",
            &format!("database broadcast too large: {why}"),
        );
    }
}

impl Consumer for DbBroadcast {
    fn name(&self) -> &'static str {
        "db_broadcast"
    }

    fn tables(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    fn schemas(&self) -> Vec<String> {
        vec![REALTIME_SCHEMA.to_string()]
    }

    fn handle<'a>(&'a mut self, item: Item<'a>) -> BoxFuture<'a, Result<Handled, ConsumerError>> {
        Box::pin(async move {
            match item {
                Item::Begin(_) => self.txn.clear(),
                Item::Change(txn, Change::Insert(row))
                    if row.schema == REALTIME_SCHEMA && row.table.starts_with("messages") =>
                {
                    match message(&row.columns) {
                        Ok(Some(m)) => {
                            if self.admits(&m.project).await? {
                                self.txn.push(m);
                            }
                        }
                        Ok(None) => {}
                        Err(e) => self.health.report_skip(
                            SKIPPED_AS,
                            Some(txn.commit_lsn),
                            "undecodable",
                            &format!("database broadcast: {e}"),
                        ),
                    }
                }
                Item::Change(..) => {}
                Item::Commit(txn) => self.publish(txn.commit_lsn).await?,
            }
            Ok(Handled::Continue)
        })
    }

    fn barrier(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async move {
            if std::mem::take(&mut self.unconfirmed) {
                self.publisher.barrier().await?;
            }
            Ok(())
        })
    }

    fn reset(&mut self) {
        self.txn.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;

    /// Raw JSON values by column name (`binary_payload` typed `bytea`, OID 17).
    fn raw(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, Box<RawValue>)> {
        pairs
            .iter()
            .map(|&(k, v)| (k, RawValue::from_string(v.into()).unwrap()))
            .collect()
    }

    fn columns<'a>(vals: &'a [(&'static str, Box<RawValue>)]) -> Vec<Column<'a>> {
        vals.iter()
            .map(|(k, v)| Column {
                name: Cow::Borrowed(k),
                type_name: Cow::Borrowed(if *k == "binary_payload" { "bytea" } else { "" }),
                type_oid: (*k == "binary_payload").then_some(17),
                value: Some(v),
            })
            .collect()
    }

    const ROW: [(&str, &str); 5] = [
        ("topic", r#""room:1""#),
        ("extension", r#""broadcast""#),
        ("event", r#""ev""#),
        ("private", "true"),
        ("id", r#""u-1""#),
    ];

    #[test]
    fn a_send_becomes_a_broadcast_with_its_id() {
        let mut pairs = ROW.to_vec();
        pairs.extend([("payload", r#""{\"a\": 1}""#), ("binary_payload", "null")]);
        let vals = raw(&pairs);
        let m = message(&columns(&vals)).unwrap().unwrap();
        let target = BroadcastTarget {
            project: "default".into(),
            private: true,
            name: "room:1".into(),
        };
        assert_eq!(BroadcastTarget::parse(&m.subject), Some(target));
        assert!(!m.binary);
        let (env, body) = walcast_bus::broadcast::decode_envelope(&m.payload).unwrap();
        assert_eq!((env.event.as_ref(), env.binary), ("ev", false));
        assert_eq!(env.meta.map(RawValue::get), Some(r#"{"id":"u-1"}"#));
        assert_eq!(&body[..], br#"{"a":1,"id":"u-1"}"#);
    }

    #[test]
    fn a_send_binary_carries_its_bytes_as_they_are() {
        // wal2json writes the hex without its `\x`; bytes that look like JSON, a
        // newline (the envelope's separator) and NUL stay bytes.
        let mut pairs = ROW.to_vec();
        pairs.extend([("payload", "null"), ("binary_payload", r#""7b7d0a00ff""#)]);
        let vals = raw(&pairs);
        let m = message(&columns(&vals)).unwrap().unwrap();
        assert!(m.binary);
        let (env, body) = walcast_bus::broadcast::decode_envelope(&m.payload).unwrap();
        assert_eq!((env.event.as_ref(), env.binary), ("ev", true));
        assert_eq!(env.meta.map(RawValue::get), Some(r#"{"id":"u-1"}"#));
        assert_eq!(&body[..], b"{}\n\x00\xff");
        let mut empty = ROW.to_vec();
        empty.push(("binary_payload", r#""""#));
        let vals = raw(&empty);
        let m = message(&columns(&vals)).unwrap().unwrap();
        let (_, body) = walcast_bus::broadcast::decode_envelope(&m.payload).unwrap();
        assert!(m.binary && body.is_empty());
    }

    #[test]
    fn unreadable_bytes_are_an_error_not_a_guess() {
        for bad in [r#""abc""#, r#""zz""#, "12"] {
            let mut pairs = ROW.to_vec();
            pairs.push(("binary_payload", bad));
            let vals = raw(&pairs);
            assert!(message(&columns(&vals)).is_err(), "{bad}");
        }
        // Not a broadcast row: nothing, whatever its bytes.
        let vals = raw(&[
            ("extension", r#""presence""#),
            ("binary_payload", r#""zz""#),
        ]);
        assert_eq!(message(&columns(&vals)), Ok(None));
    }
}
