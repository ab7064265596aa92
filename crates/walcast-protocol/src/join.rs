//! `phx_join` configuration and `postgres_changes` bindings.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::filter::{Filter, FilterError};
use crate::payload::ChangeType;

/// `config.broadcast` of a join.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BroadcastConfig {
    /// Reply `ok` to each broadcast push.
    pub ack: bool,
    /// Deliver the channel's own broadcasts back to it (`self` on the wire).
    pub self_: bool,
    /// `replay`: the private channel's stored messages to send first.
    pub replay: Option<Replay>,
    /// `replication_ready`: send the `system` message "Replication connection
    /// established" once the change stream is running.
    pub replication_ready: bool,
}

/// `config.broadcast.replay`: messages stored since `since_ms` (Unix milliseconds), at
/// most `limit` ([`REPLAY_MAX`] when absent or larger).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replay {
    /// Messages inserted at or after this time (Unix milliseconds).
    pub since_ms: i64,
    /// At most this many (1 to [`REPLAY_MAX`]).
    pub limit: u32,
}

/// The most messages a replay sends, as Supabase caps it.
pub const REPLAY_MAX: u32 = 25;

/// The latest `since` a replay accepts: 9999-12-31T23:59:59.999Z.
pub const REPLAY_SINCE_MAX_MS: i64 = 253_402_300_799_999;

/// `config.presence` of a join.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PresenceConfig {
    /// Presence key; empty means the server generates one.
    pub key: String,
    /// Whether the client listens to presence.
    pub enabled: bool,
}

/// The `config` object of a `phx_join` (missing fields default to false / "").
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JoinConfig {
    /// Broadcast options.
    pub broadcast: BroadcastConfig,
    /// Presence options.
    pub presence: PresenceConfig,
    /// `postgres_changes` bindings, in client order.
    pub postgres_changes: Vec<PgChangeBinding>,
    /// RLS-authorised (private) channel.
    pub private: bool,
}

/// One entry of `config.postgres_changes`, with its original JSON kept verbatim.
#[derive(Debug, Clone)]
pub struct PgChangeBinding {
    /// The entry exactly as the client sent it (echoed in the join reply, plus `id`).
    pub raw: Box<RawValue>,
    /// `event`: `*`, `INSERT`, `UPDATE` or `DELETE` (case as typed).
    pub event: String,
    /// `schema` (`*` = all schemas).
    pub schema: String,
    /// `table` (absent or `*` = all tables).
    pub table: Option<String>,
    /// `filter` string (absent or empty = no filter).
    pub filter: Option<String>,
    /// `select` column list, if given.
    pub select: Option<Vec<String>>,
    /// Stable id: see [`binding_id`].
    pub id: u32,
}

impl PartialEq for PgChangeBinding {
    fn eq(&self, other: &Self) -> bool {
        self.raw.get() == other.raw.get()
            && self.event == other.event
            && self.schema == other.schema
            && self.table == other.table
            && self.filter == other.filter
            && self.select == other.select
            && self.id == other.id
    }
}

/// Which change types a binding's `event` selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventFilter {
    /// `*`
    All,
    /// One change type.
    Only(ChangeType),
}

/// A `postgres_changes` entry is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindingError {
    /// The entry is not a JSON object.
    #[error("postgres_changes entry must be an object")]
    NotAnObject,
    /// A required field is missing or not a string.
    #[error("postgres_changes entry field `{0}` is missing or not a string")]
    MissingField(&'static str),
    /// A field has the wrong JSON type.
    #[error("postgres_changes entry field `{field}` must be {expected}")]
    WrongType {
        /// Field name.
        field: &'static str,
        /// Expected JSON type.
        expected: &'static str,
    },
    /// `event` is not `*`, `INSERT`, `UPDATE` or `DELETE`.
    #[error("postgres_changes entry has unknown event `{0}`")]
    UnknownEvent(String),
}

#[derive(Deserialize)]
struct RawBinding {
    #[serde(default)]
    event: Option<Value>,
    #[serde(default)]
    schema: Option<Value>,
    #[serde(default)]
    table: Option<Value>,
    #[serde(default)]
    filter: Option<Value>,
    #[serde(default)]
    select: Option<Value>,
}

fn opt_string(v: Option<Value>, field: &'static str) -> Result<Option<String>, BindingError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(BindingError::WrongType {
            field,
            expected: "a string",
        }),
    }
}

impl PgChangeBinding {
    /// Parse one entry, keeping its text verbatim. `event` and `schema` are required; the
    /// event must be `*`/`INSERT`/`UPDATE`/`DELETE` in any case.
    pub fn from_raw(raw: Box<RawValue>) -> Result<PgChangeBinding, BindingError> {
        if !raw.get().trim_start().starts_with("{") {
            return Err(BindingError::NotAnObject);
        }
        let rb: RawBinding =
            serde_json::from_str(raw.get()).map_err(|_| BindingError::NotAnObject)?;
        let event = opt_string(rb.event, "event")?.ok_or(BindingError::MissingField("event"))?;
        let schema =
            opt_string(rb.schema, "schema")?.ok_or(BindingError::MissingField("schema"))?;
        // `table: '*'` means every table of the schema, as an absent table does.
        let table = opt_string(rb.table, "table")?.filter(|t| t != "*");
        let filter = opt_string(rb.filter, "filter")?;
        let select = match rb.select {
            None | Some(Value::Null) => None,
            Some(Value::Array(items)) => Some(
                items
                    .into_iter()
                    .map(|v| match v {
                        Value::String(s) => Ok(s),
                        _ => Err(BindingError::WrongType {
                            field: "select",
                            expected: "an array of strings",
                        }),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            Some(_) => {
                return Err(BindingError::WrongType {
                    field: "select",
                    expected: "an array of strings",
                })
            }
        };
        if parse_event(&event).is_none() {
            return Err(BindingError::UnknownEvent(event));
        }
        let id = binding_id(
            &event,
            &schema,
            table.as_deref(),
            filter.as_deref(),
            select.as_deref(),
        );
        Ok(PgChangeBinding {
            raw,
            event,
            schema,
            table,
            filter,
            select,
            id,
        })
    }

    /// The change types this binding selects.
    pub fn event_filter(&self) -> EventFilter {
        parse_event(&self.event).unwrap_or(EventFilter::All)
    }

    /// Whether a change of type `t` is selected by `event` (case-insensitive, `*` = all).
    pub fn matches_type(&self, t: ChangeType) -> bool {
        match self.event_filter() {
            EventFilter::All => true,
            EventFilter::Only(only) => only == t,
        }
    }

    /// Parse `filter` (absent or empty = the empty filter, matching everything).
    pub fn parse_filter(&self) -> Result<Filter, FilterError> {
        Filter::parse(self.filter.as_deref().unwrap_or(""))
    }

    /// The join-reply entry: the original object with `"id":<id>` appended.
    ///
    /// If the client's object already had an `id` key the appended one comes last, which is
    /// the one `JSON.parse` keeps.
    pub fn reply_entry(&self) -> String {
        let text = self.raw.get().trim();
        let inner = text
            .strip_prefix('{')
            .and_then(|t| t.strip_suffix('}'))
            .unwrap_or("");
        let mut out = String::with_capacity(text.len() + 20);
        out.push('{');
        if !inner.trim().is_empty() {
            out.push_str(inner);
            out.push(',');
        }
        out.push_str("\"id\":");
        out.push_str(&self.id.to_string());
        out.push('}');
        out
    }
}

fn parse_event(event: &str) -> Option<EventFilter> {
    if event == "*" {
        return Some(EventFilter::All);
    }
    ChangeType::parse_ci(event).map(EventFilter::Only)
}

/// FNV-1a 32-bit hash.
fn fnv1a(state: &mut u32, bytes: &[u8]) {
    for b in bytes {
        *state ^= u32::from(*b);
        *state = state.wrapping_mul(0x0100_0193);
    }
}

fn hash_field(state: &mut u32, v: Option<&str>) {
    match v {
        None => fnv1a(state, &[0]),
        Some(s) => {
            fnv1a(state, &[1]);
            fnv1a(state, &(s.len() as u64).to_le_bytes());
            fnv1a(state, s.as_bytes());
        }
    }
}

/// Stable binding id: FNV-1a (32 bit) over the length-prefixed canonical content of
/// `(event, schema, table, filter, select)`. Identical entries give identical ids in every
/// process; `select` only contributes when present, so entries without it hash exactly on
/// `(event, schema, table, filter)`.
pub fn binding_id(
    event: &str,
    schema: &str,
    table: Option<&str>,
    filter: Option<&str>,
    select: Option<&[String]>,
) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    hash_field(&mut h, Some(event));
    hash_field(&mut h, Some(schema));
    hash_field(&mut h, table);
    hash_field(&mut h, filter);
    if let Some(cols) = select {
        fnv1a(&mut h, &[2]);
        fnv1a(&mut h, &(cols.len() as u64).to_le_bytes());
        for c in cols {
            hash_field(&mut h, Some(c));
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Result<PgChangeBinding, BindingError> {
        PgChangeBinding::from_raw(RawValue::from_string(s.to_owned()).unwrap())
    }

    #[test]
    fn a_star_table_is_every_table() {
        let star = b(r#"{"event":"*","schema":"public","table":"*"}"#).unwrap();
        let absent = b(r#"{"event":"*","schema":"public"}"#).unwrap();
        assert_eq!(star.table, None);
        assert_eq!(star.id, absent.id);
        assert_eq!(
            star.raw.get(),
            r#"{"event":"*","schema":"public","table":"*"}"#
        );
    }

    #[test]
    fn parses_and_echoes() {
        let x =
            b(r#"{"event":"INSERT","schema":"public","table":"todos","filter":"user_id=eq.42"}"#)
                .unwrap();
        assert_eq!(x.table.as_deref(), Some("todos"));
        let entry = x.reply_entry();
        assert_eq!(
            entry,
            format!(
                r#"{{"event":"INSERT","schema":"public","table":"todos","filter":"user_id=eq.42","id":{}}}"#,
                x.id
            )
        );
        let v: Value = serde_json::from_str(&entry).unwrap();
        assert_eq!(v["id"], Value::from(x.id));
        assert!(x.matches_type(ChangeType::Insert));
        assert!(!x.matches_type(ChangeType::Delete));
    }

    #[test]
    fn ids_stable_and_distinct() {
        let a = b(r#"{"event":"*","schema":"public","table":"t"}"#).unwrap();
        let a2 = b(r#"{ "table":"t", "schema":"public","event":"*"}"#).unwrap();
        let c = b(r#"{"event":"*","schema":"public","table":"t","filter":"a=eq.1"}"#).unwrap();
        let d = b(r#"{"event":"*","schema":"public","table":"t","select":["a"]}"#).unwrap();
        assert_eq!(a.id, a2.id);
        assert_ne!(a.id, c.id);
        assert_ne!(a.id, d.id);
        // Hard-coded so an accidental change of the hash is noticed.
        assert_eq!(a.id, binding_id("*", "public", Some("t"), None, None));
    }

    #[test]
    fn event_case_insensitive() {
        let x = b(r#"{"event":"update","schema":"public"}"#).unwrap();
        assert!(x.matches_type(ChangeType::Update));
        assert_eq!(b(r#"{}"#), Err(BindingError::MissingField("event")));
        assert_eq!(b(r#"[1]"#), Err(BindingError::NotAnObject));
        assert!(matches!(
            b(r#"{"event":"TRUNCATE","schema":"public"}"#),
            Err(BindingError::UnknownEvent(_))
        ));
        let empty = b("{}");
        assert!(empty.is_err());
    }

    #[test]
    fn reply_entry_of_minimal_object() {
        let x = b(r#" {"event":"*","schema":"s"} "#).unwrap();
        assert!(x.reply_entry().ends_with(&format!(",\"id\":{}}}", x.id)));
    }
}
