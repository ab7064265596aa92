//! Broadcast from the database: a [`Consumer`] that turns each committed insert into
//! `realtime.messages` (what `realtime.send` and `realtime.broadcast_changes` write) into
//! a broadcast on the bus, which every front delivers to the topic's channels.
//!
//! Only committed rows are read (the WAL), in commit order; a rolled-back `send` is
//! never seen. The body is the row's `payload` with its `id` added (as Supabase sends
//! it), and `meta.id` is the id too. Broadcasts from the database belong to the default
//! project.

use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde_json::value::RawValue;
use serde_json::Value;
use walcast_bus::broadcast::{encode_envelope, BroadcastTarget, Envelope};
use walcast_bus::Bus;
use walcast_wal2json::{Change, Column};

use crate::consumer::{Consumer, Handled, Item};
use crate::realtime_tables::DEFAULT_PROJECT;
use crate::{telemetry, CdcError};

/// The schema of `realtime.messages` and its partitions (`messages_YYYY_MM_DD`).
pub const REALTIME_SCHEMA: &str = "realtime";

/// One broadcast read from a `realtime.messages` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DbMessage {
    pub subject: String,
    pub payload: Bytes,
}

fn value(columns: &[Column<'_>], name: &str) -> Option<Value> {
    let raw = columns.iter().find(|c| c.name == name)?.value?;
    serde_json::from_str(raw.get()).ok()
}

/// The broadcast of an inserted `realtime.messages` row (`None`: not a broadcast row).
pub fn message(columns: &[Column<'_>]) -> Option<DbMessage> {
    if value(columns, "extension")?.as_str()? != "broadcast" {
        return None;
    }
    let topic = value(columns, "topic")?.as_str()?.to_string();
    let event = value(columns, "event").and_then(|e| e.as_str().map(String::from));
    let id = value(columns, "id")?.as_str()?.to_string();
    let private = value(columns, "private")
        .and_then(|p| p.as_bool())
        .unwrap_or(false);
    // jsonb arrives as its text in a JSON string.
    let mut body = match value(columns, "payload") {
        Some(Value::String(text)) => serde_json::from_str(&text).ok()?,
        _ => Value::Null,
    };
    if let Value::Object(m) = &mut body {
        m.entry("id").or_insert_with(|| Value::from(id.clone()));
    }
    let meta = RawValue::from_string(serde_json::json!({ "id": id }).to_string()).ok()?;
    let env = Envelope {
        event: event.unwrap_or_default().into(),
        binary: false,
        meta: Some(&meta),
    };
    let target = BroadcastTarget {
        project: DEFAULT_PROJECT.to_string(),
        private,
        name: topic,
    };
    let payload = encode_envelope(&env, body.to_string().as_bytes())?;
    Some(DbMessage {
        subject: target.subject(),
        payload,
    })
}

/// The consumer (see the module docs).
pub struct DbBroadcast {
    bus: Bus,
    txn: Vec<DbMessage>,
    unconfirmed: bool,
}

impl DbBroadcast {
    pub fn new(bus: Bus) -> DbBroadcast {
        DbBroadcast {
            bus,
            txn: Vec::new(),
            unconfirmed: false,
        }
    }

    async fn publish(&mut self) -> Result<(), CdcError> {
        for m in std::mem::take(&mut self.txn) {
            self.bus.publish(m.subject, &[], m.payload).await?;
            metrics::counter!(telemetry::DB_BROADCASTS).increment(1);
            self.unconfirmed = true;
        }
        Ok(())
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

    fn handle<'a>(&'a mut self, item: Item<'a>) -> BoxFuture<'a, Result<Handled, CdcError>> {
        Box::pin(async move {
            match item {
                Item::Begin(_) => self.txn.clear(),
                Item::Change(_, Change::Insert(row))
                    if row.schema == REALTIME_SCHEMA && row.table.starts_with("messages") =>
                {
                    self.txn.extend(message(&row.columns));
                }
                Item::Change(..) => {}
                Item::Commit(_) => self.publish().await?,
            }
            Ok(Handled::Continue)
        })
    }

    fn barrier(&mut self) -> BoxFuture<'_, Result<(), CdcError>> {
        Box::pin(async move {
            if std::mem::take(&mut self.unconfirmed) {
                self.bus.barrier().await?;
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

    #[test]
    fn a_send_becomes_a_broadcast_with_its_id() {
        let vals: Vec<(&str, Box<RawValue>)> = [
            ("topic", r#""room:1""#),
            ("extension", r#""broadcast""#),
            ("payload", r#""{\"a\": 1}""#),
            ("event", r#""ev""#),
            ("private", "true"),
            ("id", r#""u-1""#),
        ]
        .into_iter()
        .map(|(k, v)| (k, RawValue::from_string(v.into()).unwrap()))
        .collect();
        let cols: Vec<Column<'_>> = vals
            .iter()
            .map(|(k, v)| Column {
                name: Cow::Borrowed(k),
                type_name: Cow::Borrowed(""),
                type_oid: None,
                value: Some(v),
            })
            .collect();
        let m = message(&cols).unwrap();
        let target = BroadcastTarget {
            project: "default".into(),
            private: true,
            name: "room:1".into(),
        };
        assert_eq!(BroadcastTarget::parse(&m.subject), Some(target));
        let (env, body) = walcast_bus::broadcast::decode_envelope(&m.payload).unwrap();
        assert_eq!(env.event, "ev");
        assert_eq!(env.meta.map(RawValue::get), Some(r#"{"id":"u-1"}"#));
        assert_eq!(&body[..], br#"{"a":1,"id":"u-1"}"#);
    }
}
