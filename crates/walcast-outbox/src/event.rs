//! Outbox events, pure: parsed from a `walcast.emit` message or an outbox-table row, and
//! turned into a JetStream message (subject, headers, body). No IO.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use walcast_wal2json::{Column, Lsn};

/// The logical-message prefix of `walcast.emit`.
pub const MESSAGE_PREFIX: &str = "walcast.outbox";
/// Subjects: `walcast.outbox.<project>.<topic>`.
pub const SUBJECT_PREFIX: &str = "walcast.outbox";

/// Headers the relay sets (a user header may not use the `Nats-` or `Walcast-` prefix).
pub const HEADER_MSG_ID: &str = "Nats-Msg-Id";
pub const HEADER_EVENT_ID: &str = "Walcast-Event-Id";
pub const HEADER_KEY: &str = "Walcast-Key";
pub const HEADER_COMMIT_LSN: &str = "Walcast-Commit-Lsn";
pub const HEADER_PROJECT: &str = "Walcast-Project";
pub const HEADER_TOPIC: &str = "Walcast-Topic";
pub const HEADER_EVENT_TYPE: &str = "Walcast-Event-Type";
pub const HEADER_SCHEMA_VERSION: &str = "Walcast-Schema-Version";
pub const HEADER_OCCURRED_AT: &str = "Walcast-Occurred-At";

/// Why an event cannot be relayed as it is. Deterministic: retrying gives the same answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error("not an outbox event: {0}")]
    Malformed(String),
    #[error("topic {0:?} is not dot-separated tokens of letters, digits, _ or -")]
    Topic(String),
    #[error("project {0:?} cannot be a subject token")]
    Project(String),
    #[error("header {name:?}: {why}")]
    Header { name: String, why: &'static str },
}

/// A header's name as [`OutboxEvent::for_each_header`] gives it: one of the relay's
/// own (a constant, which the NATS client can take without copying) or the user's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Name<'a> {
    Ours(&'static str),
    User(&'a str),
}

impl<'a> Name<'a> {
    pub fn as_str(self) -> &'a str {
        match self {
            Name::Ours(n) => n,
            Name::User(n) => n,
        }
    }
}

/// One event to relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// A UUID: the JetStream `Nats-Msg-Id`.
    pub id: String,
    pub project: String,
    pub topic: String,
    /// The ordering key (per-key order holds on the stream).
    pub key: Option<String>,
    /// JSON text.
    pub payload: String,
    /// The user's headers, then ours for outbox-table rows (event type …).
    pub headers: Vec<(String, String)>,
    /// End of the commit record of its transaction.
    pub commit_lsn: Lsn,
    /// Its transaction's commit time (UTC, ms, `Z`).
    pub committed_at: String,
}

#[derive(Deserialize)]
struct EmitContent<'a> {
    id: String,
    project: String,
    topic: String,
    key: Option<String>,
    #[serde(borrow)]
    payload: &'a RawValue,
    headers: Option<serde_json::Map<String, Value>>,
}

/// Whether a topic (or project) is dot-separated tokens of `[A-Za-z0-9_-]`.
pub fn valid_topic(topic: &str) -> bool {
    !topic.is_empty()
        && topic.split('.').all(|t| {
            !t.is_empty()
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        })
}

/// Longest header name, header value, topic and project accepted (bytes). Anything longer
/// is refused before it meets NATS (whose control line and payload limits it would strain).
pub const MAX_HEADER_NAME: usize = 256;
pub const MAX_HEADER_VALUE: usize = 4096;
pub const MAX_TOPIC: usize = 256;
pub const MAX_PROJECT: usize = 64;

/// Why a header name cannot be sent (`None`: it can): printable ASCII without ':' (what
/// NATS and async-nats accept), bounded.
fn header_name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() || name.len() > MAX_HEADER_NAME {
        return Some("a name is 1 to 256 bytes");
    }
    if !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
        return Some("a name is printable ASCII without ':' or spaces");
    }
    None
}

/// Why a header value cannot be sent (`None`: it can): no control character (a line
/// break would end the header; async-nats panics on one), bounded.
fn header_value_problem(value: &str) -> Option<&'static str> {
    if value.len() > MAX_HEADER_VALUE {
        return Some("a value is at most 4096 bytes");
    }
    if value.chars().any(char::is_control) {
        return Some("a value cannot contain a line break or another control character");
    }
    None
}

/// A header (any: ours or the user's) that NATS takes as it is.
fn check_header_text(name: &str, value: &str) -> Result<(), EventError> {
    match header_name_problem(name).or_else(|| header_value_problem(value)) {
        Some(why) => Err(EventError::Header {
            name: name.chars().take(MAX_HEADER_NAME).collect(),
            why,
        }),
        None => Ok(()),
    }
}

fn check_header(name: &str, value: &str) -> Result<(), EventError> {
    check_header_text(name, value)?;
    let lower = name.to_ascii_lowercase();
    if lower.starts_with("nats-") || lower.starts_with("walcast-") {
        return Err(EventError::Header {
            name: name.to_string(),
            why: "the Nats- and Walcast- prefixes are reserved",
        });
    }
    Ok(())
}

/// The user's `headers` object as header pairs: strings as they are, other values as JSON.
fn user_headers(
    h: Option<serde_json::Map<String, Value>>,
) -> Result<Vec<(String, String)>, EventError> {
    let mut out = Vec::new();
    for (name, value) in h.unwrap_or_default() {
        let value = match value {
            Value::String(s) => s,
            Value::Null => continue,
            other => other.to_string(),
        };
        check_header(&name, &value)?;
        out.push((name, value));
    }
    Ok(out)
}

impl OutboxEvent {
    /// The event of a `walcast.emit` message's content.
    pub fn from_message(
        content: &str,
        commit_lsn: Lsn,
        committed_at: &str,
    ) -> Result<Self, EventError> {
        let c: EmitContent<'_> =
            serde_json::from_str(content).map_err(|e| EventError::Malformed(e.to_string()))?;
        let ev = OutboxEvent {
            id: c.id,
            project: c.project,
            topic: c.topic,
            key: c.key,
            payload: c.payload.get().to_string(),
            headers: user_headers(c.headers)?,
            commit_lsn,
            committed_at: committed_at.to_string(),
        };
        ev.validate()?;
        Ok(ev)
    }

    /// The event of a row inserted into an outbox table of `project`: topic =
    /// `aggregate_type`, key = `aggregate_id`, the event type, schema version and time of
    /// occurrence as headers.
    pub fn from_row(
        project: &str,
        columns: &[Column<'_>],
        commit_lsn: Lsn,
        committed_at: &str,
    ) -> Result<Self, EventError> {
        let row = Row(columns);
        let headers = match row.text("headers")? {
            Some(h) => {
                serde_json::from_str(&h).map_err(|e| EventError::Malformed(e.to_string()))?
            }
            None => None,
        };
        let mut headers = user_headers(headers)?;
        for (name, column) in [
            (HEADER_EVENT_TYPE, "event_type"),
            (HEADER_SCHEMA_VERSION, "schema_version"),
            (HEADER_OCCURRED_AT, "occurred_at"),
        ] {
            if let Some(v) = row.text(column)? {
                headers.push((name.to_string(), v));
            }
        }
        let required = |c: &str| {
            row.text(c)?
                .ok_or_else(|| EventError::Malformed(format!("{c} is missing")))
        };
        let ev = OutboxEvent {
            id: required("id")?,
            project: project.to_string(),
            topic: required("aggregate_type")?,
            key: row.text("aggregate_id")?,
            payload: required("payload")?,
            headers,
            commit_lsn,
            committed_at: committed_at.to_string(),
        };
        ev.validate()?;
        Ok(ev)
    }

    /// Everything that meets NATS — subject tokens, every header name and value (ours
    /// included: the id, key, event type … come from the database) — is checked here,
    /// before it can reach async-nats (which panics on a line break in a header).
    pub fn validate(&self) -> Result<(), EventError> {
        if !valid_topic(&self.topic) || self.topic.len() > MAX_TOPIC {
            return Err(EventError::Topic(
                self.topic.chars().take(MAX_TOPIC).collect(),
            ));
        }
        let project_ok = valid_topic(&self.project) && !self.project.contains('.');
        if !project_ok || self.project.len() > MAX_PROJECT {
            let p = self.project.chars().take(MAX_PROJECT).collect();
            return Err(EventError::Project(p));
        }
        // Every header but the commit LSN (`X/X` in hex digits, never a problem), checked
        // where it is, without copying it.
        self.visit_headers(None, |name, value| check_header_text(name.as_str(), value))
    }

    /// Calls `f` on every header of the JetStream message (ours, then the user's; see
    /// [`OutboxEvent::message_headers`]) in order, stopping at the first error.
    pub fn for_each_header<'a, E>(
        &'a self,
        f: impl FnMut(Name<'a>, &str) -> Result<(), E>,
    ) -> Result<(), E> {
        self.visit_headers(Some(&self.commit_lsn.to_string()), f)
    }

    /// The headers in order, the commit LSN's only when given.
    fn visit_headers<'a, E>(
        &'a self,
        lsn: Option<&str>,
        mut f: impl FnMut(Name<'a>, &str) -> Result<(), E>,
    ) -> Result<(), E> {
        f(Name::Ours(HEADER_MSG_ID), &self.id)?;
        f(Name::Ours(HEADER_EVENT_ID), &self.id)?;
        if let Some(lsn) = lsn {
            f(Name::Ours(HEADER_COMMIT_LSN), lsn)?;
        }
        f(Name::Ours(HEADER_PROJECT), &self.project)?;
        f(Name::Ours(HEADER_TOPIC), &self.topic)?;
        if let Some(k) = &self.key {
            f(Name::Ours(HEADER_KEY), k)?;
        }
        for (n, v) in &self.headers {
            f(Name::User(n), v)?;
        }
        Ok(())
    }

    /// `walcast.outbox.<project>.<topic>`.
    pub fn subject(&self) -> String {
        format!("{SUBJECT_PREFIX}.{}.{}", self.project, self.topic)
    }

    /// The length of [`OutboxEvent::subject`], without building it.
    pub fn subject_len(&self) -> usize {
        SUBJECT_PREFIX.len() + 2 + self.project.len() + self.topic.len()
    }

    /// Every header of its JetStream message: ours (the id twice: `Nats-Msg-Id` for
    /// JetStream's duplicate window, `Walcast-Event-Id` for consumers), then the user's.
    pub fn message_headers(&self) -> Vec<(&str, String)> {
        let mut h = Vec::new();
        let listed = self.for_each_header(|name, value| {
            h.push((name.as_str(), value.to_string()));
            Ok::<(), std::convert::Infallible>(())
        });
        let Ok(()) = listed;
        h
    }
}

/// The columns of an inserted row, by name.
struct Row<'a>(&'a [Column<'a>]);

impl Row<'_> {
    /// A column's value as text (JSON strings unquoted, numbers as written); `None` for
    /// SQL NULL or a missing column.
    fn text(&self, name: &str) -> Result<Option<String>, EventError> {
        let Some(raw) = self.0.iter().find(|c| c.name == name).and_then(|c| c.value) else {
            return Ok(None);
        };
        let v: Value = serde_json::from_str(raw.get())
            .map_err(|e| EventError::Malformed(format!("{name}: {e}")))?;
        Ok(match v {
            Value::Null => None,
            Value::String(s) => Some(s),
            other => Some(other.to_string()),
        })
    }
}

/// The outbox id of a partition named `o<id>_<yyyymmdd>`.
pub fn partition_outbox(name: &str) -> Option<i32> {
    let (id, day) = name.strip_prefix('o')?.split_once('_')?;
    (day.len() == 8 && day.bytes().all(|b| b.is_ascii_digit()))
        .then(|| id.parse().ok())
        .flatten()
}

#[cfg(test)]
mod tests;
