//! The events the relay publishes: headers, the event id, and [`Event`] read from a
//! JetStream message.

use std::fmt;
use std::str::FromStr;

use async_nats::jetstream;
use async_nats::HeaderMap;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use walcast_core::{ChangeId, Lsn};

/// The stream the relay publishes to unless configured otherwise.
pub const DEFAULT_STREAM: &str = "WALCAST_OUTBOX";
/// The subjects of that stream: `walcast.outbox.<project>.<topic>`.
pub const DEFAULT_FILTER_SUBJECT: &str = "walcast.outbox.>";
/// What every outbox subject starts with, before `<project>.<topic>`.
pub const SUBJECT_PREFIX: &str = "walcast.outbox.";

/// The change streams' stream (README "Change streams" of walcast).
pub const CHANGES_STREAM: &str = "WALCAST_CHANGES";
/// Its subjects: `walcast.changes.<project>.<schema>.<table>`.
pub const CHANGES_FILTER_SUBJECT: &str = "walcast.changes.>";

/// Header names of the relay's messages.
pub mod headers {
    /// JetStream's de-duplication id; the relay sets it to the event id.
    pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
    /// The event id (a UUID), the same as `Nats-Msg-Id` as the relay publishes it.
    pub const EVENT_ID: &str = "Walcast-Event-Id";
    /// The ordering key (absent when the event has none).
    pub const KEY: &str = "Walcast-Key";
    /// The commit LSN of the transaction that emitted the event, `X/Y` as `pg_lsn`.
    pub const COMMIT_LSN: &str = "Walcast-Commit-Lsn";
    /// The project.
    pub const PROJECT: &str = "Walcast-Project";
    /// The topic (dot-separated tokens of `[A-Za-z0-9_-]`).
    pub const TOPIC: &str = "Walcast-Topic";
    /// Outbox-table events only: the event type.
    pub const EVENT_TYPE: &str = "Walcast-Event-Type";
    /// Outbox-table events only: the payload's schema version.
    pub const SCHEMA_VERSION: &str = "Walcast-Schema-Version";
    /// Outbox-table events only: when the event occurred (the row's `occurred_at`).
    pub const OCCURRED_AT: &str = "Walcast-Occurred-At";
}

/// An event id: a UUID, read from its canonical text form
/// (`xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, hex digits of either case) and shown in
/// lowercase, as Postgres prints a `uuid`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId([u8; 16]);

impl EventId {
    /// The 16 bytes of the UUID.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// The UUID with these 16 bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> EventId {
        EventId(bytes)
    }
}

/// The text is not a UUID in its canonical hyphenated form.
#[derive(thiserror::Error, Debug, Clone, Copy, PartialEq, Eq)]
#[error("not a UUID: expected xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx in hexadecimal")]
pub struct ParseEventIdError;

impl FromStr for EventId {
    type Err = ParseEventIdError;

    fn from_str(s: &str) -> Result<EventId, ParseEventIdError> {
        let s = s.as_bytes();
        if s.len() != 36 {
            return Err(ParseEventIdError);
        }
        let mut bytes = [0u8; 16];
        let mut digits = s
            .iter()
            .enumerate()
            .filter(|(i, _)| !matches!(i, 8 | 13 | 18 | 23));
        if [8, 13, 18, 23].iter().any(|&i| s[i] != b'-') {
            return Err(ParseEventIdError);
        }
        for byte in &mut bytes {
            let (Some((_, hi)), Some((_, lo))) = (digits.next(), digits.next()) else {
                return Err(ParseEventIdError);
            };
            *byte = (hex_value(*hi).ok_or(ParseEventIdError)? << 4)
                | hex_value(*lo).ok_or(ParseEventIdError)?;
        }
        Ok(EventId(bytes))
    }
}

fn hex_value(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EventId({self})")
    }
}

/// Why a message is not an event this crate can handle exactly once. Such a message is
/// terminated (`+TERM`, never redelivered) and logged.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventError {
    /// Neither `Walcast-Event-Id` nor `Nats-Msg-Id`: nothing to de-duplicate by.
    #[error("no Walcast-Event-Id or Nats-Msg-Id header: the event cannot be de-duplicated")]
    MissingId,
    /// The id header is not a UUID.
    #[error("event id {value:?} (header {header}) is not a UUID")]
    BadId {
        /// The header it was read from.
        header: &'static str,
        /// Its value (cut to 64 characters).
        value: String,
    },
}

impl EventError {
    /// A short label for logs and metrics: `missing_id` or `bad_id`.
    pub fn reason(&self) -> &'static str {
        match self {
            EventError::MissingId => "missing_id",
            EventError::BadId { .. } => "bad_id",
        }
    }
}

/// One delivery of an outbox event.
#[derive(Clone, Debug)]
pub struct Event {
    /// The event id (`Walcast-Event-Id`, else `Nats-Msg-Id`): what the inbox records.
    pub id: EventId,
    /// `Walcast-Project`, else the subject's token after `walcast.outbox.` (empty if neither).
    pub project: String,
    /// `Walcast-Topic`, else the rest of the subject after the project (empty if neither).
    pub topic: String,
    /// The ordering key, `Walcast-Key`.
    pub key: Option<String>,
    /// `Walcast-Commit-Lsn`, when present and valid.
    pub commit_lsn: Option<Lsn>,
    /// The subject the event was published on.
    pub subject: String,
    /// All headers, the relay's and the user's own.
    pub headers: HeaderMap,
    /// The payload: JSON text.
    pub payload: Bytes,
    /// Which delivery of this message this is, from 1 (JetStream's count).
    pub delivered: i64,
    /// The message's sequence number in the stream.
    pub stream_sequence: u64,
    /// A change-stream message: its identity (from `Nats-Msg-Id`, which matches the
    /// event id). Its event id is exact within a project only, so the inbox records it
    /// under `<consumer>/<project>`.
    pub change: Option<ChangeId>,
}

/// A change of a change stream (the payload of its messages), as [`Event::change_event`]
/// reads it. `record` is the new row (INSERT, UPDATE), `old_record` the old one (UPDATE,
/// DELETE); a `TRUNCATE` has neither: the table was emptied.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct ChangeRecord {
    pub project: String,
    pub schema: String,
    pub table: String,
    /// `INSERT`, `UPDATE`, `DELETE` or `TRUNCATE`.
    #[serde(rename = "type")]
    pub kind: String,
    pub commit_lsn: Lsn,
    pub seq: u32,
    #[serde(default)]
    pub record: Option<serde_json::Value>,
    #[serde(default)]
    pub old_record: Option<serde_json::Value>,
    /// Primary-key column names.
    #[serde(default)]
    pub pk: Vec<String>,
}

impl Event {
    /// The event in a JetStream message; an error when it has no usable id.
    pub fn from_message(message: &jetstream::Message) -> Result<Event, EventError> {
        let mut event = Event::from_parts(
            message.subject.as_str(),
            message.headers.clone().unwrap_or_default(),
            message.payload.clone(),
        )?;
        if let Ok(info) = message.info() {
            event.delivered = info.delivered;
            event.stream_sequence = info.stream_sequence;
        }
        Ok(event)
    }

    /// The event of a message published on `subject` with `headers` and `payload`
    /// (`delivered` 1, `stream_sequence` 0).
    pub fn from_parts(
        subject: &str,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<Event, EventError> {
        let id = event_id(&headers)?;
        let change = headers
            .get(headers::NATS_MSG_ID)
            .and_then(|v| ChangeId::parse(v.as_str()))
            .filter(|c| EventId::from_bytes(c.uuid_bytes()) == id);
        let text = |name: &str| headers.get(name).map(|v| v.as_str().to_string());
        let (subject_project, subject_topic) = subject
            .strip_prefix(SUBJECT_PREFIX)
            .and_then(|rest| rest.split_once('.'))
            .unwrap_or_default();
        Ok(Event {
            id,
            project: text(headers::PROJECT).unwrap_or_else(|| subject_project.to_string()),
            topic: text(headers::TOPIC).unwrap_or_else(|| subject_topic.to_string()),
            key: text(headers::KEY),
            commit_lsn: headers
                .get(headers::COMMIT_LSN)
                .and_then(|v| v.as_str().parse().ok()),
            subject: subject.to_string(),
            payload,
            delivered: 1,
            stream_sequence: 0,
            headers,
            change,
        })
    }

    /// The value of header `name`, if present (the first one if repeated).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.as_str())
    }

    /// `Walcast-Event-Type` (outbox-table events).
    pub fn event_type(&self) -> Option<&str> {
        self.header(headers::EVENT_TYPE)
    }

    /// `Walcast-Schema-Version` (outbox-table events).
    pub fn schema_version(&self) -> Option<&str> {
        self.header(headers::SCHEMA_VERSION)
    }

    /// `Walcast-Occurred-At` (outbox-table events), as the relay wrote it.
    pub fn occurred_at(&self) -> Option<&str> {
        self.header(headers::OCCURRED_AT)
    }

    /// The change of a change-stream message (see [`ChangeRecord`]).
    pub fn change_event(&self) -> Result<ChangeRecord, serde_json::Error> {
        self.json()
    }

    /// The `consumer_name` its inbox row is recorded under for the durable `durable`:
    /// the durable's name, or for a change-stream message `<durable>/<project>`.
    pub fn inbox_name(&self, durable: &str) -> String {
        match &self.change {
            Some(c) => format!("{durable}/{}", c.project),
            None => durable.to_string(),
        }
    }

    /// The payload deserialized from JSON.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }
}

/// `Walcast-Event-Id` first: a re-publication (a replay to another subject) may carry
/// another `Nats-Msg-Id`, never another event id.
fn event_id(headers: &HeaderMap) -> Result<EventId, EventError> {
    let (header, value) = [headers::EVENT_ID, headers::NATS_MSG_ID]
        .into_iter()
        .find_map(|name| headers.get(name).map(|v| (name, v.as_str())))
        .ok_or(EventError::MissingId)?;
    value.parse().map_err(|_| EventError::BadId {
        header,
        value: value.chars().take(64).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0b7c2a3e-5f1d-4c8e-9a6b-1d2e3f405162";

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, *v);
        }
        h
    }

    #[test]
    fn event_ids_read_canonical_uuids_and_print_lowercase() {
        let id: EventId = ID.to_uppercase().parse().expect("uppercase uuid");
        assert_eq!(id.to_string(), ID);
        assert_eq!(id.as_bytes()[0], 0x0b);
        assert_eq!(id.as_bytes()[15], 0x62);
        for bad in [
            "",
            "0b7c2a3e5f1d4c8e9a6b1d2e3f405162",
            "0b7c2a3e-5f1d-4c8e-9a6b-1d2e3f40516",
            "0b7c2a3e-5f1d-4c8e-9a6b-1d2e3f40516g",
            "0b7c2a3e-5f1d-4c8e-9a6b+1d2e3f405162",
            "{b7c2a3e-5f1d-4c8e-9a6b-1d2e3f40516}",
            "0b7c2a3e-5f1d-4c8e-9a6b-1d2e3f4051é",
        ] {
            assert_eq!(bad.parse::<EventId>(), Err(ParseEventIdError), "{bad:?}");
        }
    }

    #[test]
    fn an_event_reads_the_relay_headers() {
        let h = headers(&[
            (headers::NATS_MSG_ID, ID),
            (headers::EVENT_ID, ID),
            (headers::KEY, "order-7"),
            (headers::COMMIT_LSN, "16/B374D848"),
            (headers::PROJECT, "shop"),
            (headers::TOPIC, "orders.created"),
            (headers::EVENT_TYPE, "OrderCreated"),
            ("X-Trace", "abc"),
        ]);
        let ev = Event::from_parts("walcast.outbox.shop.orders.created", h, "{\"n\":3}".into())
            .expect("event");
        assert_eq!(ev.id.to_string(), ID);
        assert_eq!(
            (ev.project.as_str(), ev.topic.as_str()),
            ("shop", "orders.created")
        );
        assert_eq!(ev.key.as_deref(), Some("order-7"));
        assert_eq!(ev.commit_lsn, Some(Lsn(0x16_B374_D848)));
        assert_eq!(ev.event_type(), Some("OrderCreated"));
        assert_eq!(ev.schema_version(), None);
        assert_eq!(ev.header("X-Trace"), Some("abc"));
        let v: serde_json::Value = ev.json().expect("json");
        assert_eq!(v["n"], 3);
    }

    #[test]
    fn project_and_topic_fall_back_to_the_subject() {
        let h = headers(&[(headers::NATS_MSG_ID, ID)]);
        let ev = Event::from_parts("walcast.outbox.shop.a.b", h.clone(), Bytes::new()).unwrap();
        assert_eq!((ev.project.as_str(), ev.topic.as_str()), ("shop", "a.b"));
        assert_eq!(ev.key, None);
        assert_eq!(ev.commit_lsn, None);
        let ev = Event::from_parts("replay.shop.a", h, Bytes::new()).unwrap();
        assert_eq!((ev.project.as_str(), ev.topic.as_str()), ("", ""));
    }

    #[test]
    fn the_event_id_header_wins_over_the_message_id() {
        let other = "ffffffff-ffff-4fff-bfff-ffffffffffff";
        let h = headers(&[
            (headers::NATS_MSG_ID, "replay-1"),
            (headers::EVENT_ID, other),
        ]);
        let ev = Event::from_parts("walcast.outbox.p.t", h, Bytes::new()).unwrap();
        assert_eq!(ev.id.to_string(), other);
    }

    #[test]
    fn a_change_stream_message_is_recorded_per_project() {
        let id = ChangeId {
            project: "shop".into(),
            commit_lsn: Lsn(0x1_0000_0010),
            seq: 2,
            part: 0,
        };
        let h = headers(&[
            (headers::NATS_MSG_ID, &id.msg_id()),
            (headers::EVENT_ID, &id.uuid()),
        ]);
        let body = r#"{"project":"shop","schema":"public","table":"t","type":"TRUNCATE","commit_lsn":"1/10","seq":2,"columns":[]}"#;
        let ev = Event::from_parts("walcast.changes.shop.public.t", h, body.into()).unwrap();
        assert_eq!(ev.change.as_ref(), Some(&id));
        assert_eq!(ev.inbox_name("mirror"), "mirror/shop");
        let c = ev.change_event().unwrap();
        assert_eq!((c.kind.as_str(), c.seq, c.record), ("TRUNCATE", 2, None));
        // A message id that does not match the event id is no change identity.
        let h = headers(&[
            (headers::NATS_MSG_ID, &id.msg_id()),
            (headers::EVENT_ID, ID),
        ]);
        let ev = Event::from_parts("walcast.changes.shop.public.t", h, Bytes::new()).unwrap();
        assert_eq!(ev.change, None);
        assert_eq!(ev.inbox_name("mirror"), "mirror");
    }

    #[test]
    fn messages_without_a_usable_id_are_errors() {
        let err = Event::from_parts("walcast.outbox.p.t", HeaderMap::new(), Bytes::new());
        assert_eq!(err.unwrap_err(), EventError::MissingId);
        let h = headers(&[(headers::NATS_MSG_ID, "not-a-uuid")]);
        let err = Event::from_parts("walcast.outbox.p.t", h, Bytes::new()).unwrap_err();
        assert_eq!(err.reason(), "bad_id");
        assert!(err.to_string().contains("not-a-uuid"), "{err}");
    }
}
