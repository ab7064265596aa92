//! Typed client → server messages.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::frame::{BroadcastBody, Frame, Payload};
use crate::join::{BindingError, BroadcastConfig, JoinConfig, PgChangeBinding, PresenceConfig};
use crate::json;

/// Phoenix event names used by the protocol (the crate's [`events`](mod@crate::events)
/// module, also here where they always were).
pub use crate::events;

/// The topic of heartbeats.
pub const PHOENIX_TOPIC: &str = "phoenix";
/// Prefix of every channel topic.
pub const TOPIC_PREFIX: &str = "realtime:";

/// A client message, interpreted.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientMessage {
    /// `heartbeat` on topic `phoenix`.
    Heartbeat,
    /// `phx_join`.
    Join(JoinRequest),
    /// `phx_leave`.
    Leave,
    /// `access_token` (`None` when the token is null or absent).
    AccessToken(Option<String>),
    /// `broadcast` (binary kind 3 or text form).
    Broadcast(BroadcastPush),
    /// `presence` track/untrack.
    Presence(PresenceAction),
    /// Any other event (the event name).
    Unknown(String),
}

/// Payload of a `phx_join`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct JoinRequest {
    /// Channel configuration.
    pub config: JoinConfig,
    /// User JWT, often absent (fall back to the socket's `apikey`).
    pub access_token: Option<String>,
}

/// A broadcast sent by a client.
#[derive(Debug, Clone)]
pub struct BroadcastPush {
    /// `type` field of the text form (normally `"broadcast"`); `None` for binary pushes.
    pub type_: Option<String>,
    /// User event name.
    pub event: String,
    /// Payload (JSON, or raw bytes from a binary push).
    pub payload: BroadcastBody,
    /// Meta from a binary push or the text form, if any.
    pub meta: Option<Box<RawValue>>,
    /// It came as a binary push (kind 3), not as JSON text: Supabase relays those as
    /// binary kind 4 to 2.0.0 sockets, and the others as text.
    pub binary: bool,
}

/// A presence push.
#[derive(Debug, Clone)]
pub enum PresenceAction {
    /// Track with this (object) payload.
    Track {
        /// The tracked state (a JSON object).
        payload: Box<RawValue>,
    },
    /// Stop tracking.
    Untrack,
}

/// A client message could not be interpreted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// The payload does not have the expected shape.
    #[error("invalid {event} payload: {reason}")]
    InvalidPayload {
        /// Phoenix event.
        event: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A `postgres_changes` entry of a join is invalid.
    #[error("invalid postgres_changes entry {index}: {source}")]
    Binding {
        /// Position in `config.postgres_changes`.
        index: usize,
        /// The problem.
        source: BindingError,
    },
    /// Presence track payload is not a JSON object (text used by the reference server).
    #[error("Presence track payload must be a map")]
    PresencePayloadNotMap,
    /// Presence event other than track/untrack.
    #[error("unknown presence event `{0}`")]
    UnknownPresenceEvent(String),
}

impl ClientMessage {
    /// Interpret a decoded client frame.
    pub fn parse(frame: &Frame) -> Result<ClientMessage, MessageError> {
        let ev = frame.event.as_str();
        if ev == events::HEARTBEAT && frame.topic == PHOENIX_TOPIC {
            return Ok(ClientMessage::Heartbeat);
        }
        match (&frame.payload, ev) {
            (Payload::Broadcast(b), _) => Ok(ClientMessage::Broadcast(BroadcastPush {
                type_: None,
                event: b.event.clone(),
                payload: b.body.clone(),
                meta: b.meta.clone(),
                binary: true,
            })),
            (Payload::Json(p), events::JOIN) => parse_join(p).map(ClientMessage::Join),
            (Payload::Json(_), events::LEAVE) => Ok(ClientMessage::Leave),
            (Payload::Json(p), events::ACCESS_TOKEN) => {
                parse_access_token(p).map(ClientMessage::AccessToken)
            }
            (Payload::Json(p), events::BROADCAST) => {
                parse_broadcast(p).map(ClientMessage::Broadcast)
            }
            (Payload::Json(p), events::PRESENCE) => parse_presence(p).map(ClientMessage::Presence),
            (Payload::Json(_), other) => Ok(ClientMessage::Unknown(other.to_owned())),
        }
    }
}

fn invalid(event: &'static str, reason: impl Into<String>) -> MessageError {
    MessageError::InvalidPayload {
        event,
        reason: reason.into(),
    }
}

fn object<'a, T: Deserialize<'a>>(p: &'a RawValue, event: &'static str) -> Result<T, MessageError> {
    if !p.get().trim_start().starts_with("{") {
        return Err(invalid(event, "payload must be a JSON object"));
    }
    serde_json::from_str(p.get()).map_err(|e| invalid(event, e.to_string()))
}

fn flag(v: Option<&Value>, event: &'static str, name: &str) -> Result<bool, MessageError> {
    match v {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(event, format!("`{name}` must be a boolean"))),
    }
}

/// `config.broadcast.replay`: `{since: <ms>, limit?: <n>}`.
fn replay(v: Option<&Value>) -> Result<Option<crate::join::Replay>, MessageError> {
    let ev = events::JOIN;
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let since = v.get("since").and_then(Value::as_f64);
    let range = 0.0..=crate::join::REPLAY_SINCE_MAX_MS as f64;
    let Some(since) = since.filter(|s| range.contains(s)) else {
        return Err(invalid(
            ev,
            "`config.broadcast.replay.since` must be a time in ms since 1970, from 0 to 253402300799999 (year 9999)",
        ));
    };
    let limit = match v.get("limit") {
        None | Some(Value::Null) => crate::join::REPLAY_MAX,
        Some(l) => l
            .as_u64()
            .map(|l| l.min(u64::from(crate::join::REPLAY_MAX)) as u32)
            .ok_or_else(|| invalid(ev, "`config.broadcast.replay.limit` must be a count"))?,
    };
    Ok(Some(crate::join::Replay {
        since_ms: since as i64,
        limit,
    }))
}

fn token(v: Option<Value>, event: &'static str) -> Result<Option<String>, MessageError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(event, "`access_token` must be a string or null")),
    }
}

#[derive(Deserialize)]
struct RawJoin {
    #[serde(default)]
    config: Option<RawConfig>,
    #[serde(default)]
    access_token: Option<Value>,
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    broadcast: Option<Value>,
    #[serde(default)]
    presence: Option<Value>,
    #[serde(default)]
    postgres_changes: Option<Vec<Box<RawValue>>>,
    #[serde(default)]
    private: Option<Value>,
}

fn sub_object<'a>(
    v: &'a Option<Value>,
    name: &str,
) -> Result<Option<&'a serde_json::Map<String, Value>>, MessageError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => Ok(Some(m)),
        Some(_) => Err(invalid(
            events::JOIN,
            format!("`config.{name}` must be an object"),
        )),
    }
}

fn parse_join(p: &RawValue) -> Result<JoinRequest, MessageError> {
    let ev = events::JOIN;
    let rj: RawJoin = object(p, ev)?;
    let access_token = token(rj.access_token, ev)?;
    let Some(rc) = rj.config else {
        return Ok(JoinRequest {
            config: JoinConfig::default(),
            access_token,
        });
    };
    let mut config = JoinConfig {
        private: flag(rc.private.as_ref(), ev, "config.private")?,
        ..JoinConfig::default()
    };
    if let Some(b) = sub_object(&rc.broadcast, "broadcast")? {
        config.broadcast = BroadcastConfig {
            ack: flag(b.get("ack"), ev, "config.broadcast.ack")?,
            self_: flag(b.get("self"), ev, "config.broadcast.self")?,
            replay: replay(b.get("replay"))?,
            replication_ready: flag(
                b.get("replication_ready"),
                ev,
                "config.broadcast.replication_ready",
            )?,
        };
    }
    if let Some(pr) = sub_object(&rc.presence, "presence")? {
        let key = match pr.get("key") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            Some(_) => {
                return Err(invalid(ev, "`config.presence.key` must be a string"));
            }
        };
        config.presence = PresenceConfig {
            key,
            enabled: flag(pr.get("enabled"), ev, "config.presence.enabled")?,
        };
    }
    for (index, raw) in rc
        .postgres_changes
        .unwrap_or_default()
        .into_iter()
        .enumerate()
    {
        let binding = PgChangeBinding::from_raw(raw)
            .map_err(|source| MessageError::Binding { index, source })?;
        config.postgres_changes.push(binding);
    }
    Ok(JoinRequest {
        config,
        access_token,
    })
}

#[derive(Deserialize)]
struct RawAccessToken {
    #[serde(default)]
    access_token: Option<Value>,
}

fn parse_access_token(p: &RawValue) -> Result<Option<String>, MessageError> {
    let r: RawAccessToken = object(p, events::ACCESS_TOKEN)?;
    token(r.access_token, events::ACCESS_TOKEN)
}

#[derive(Deserialize)]
struct RawBroadcast {
    #[serde(default, rename = "type")]
    type_: Option<Value>,
    #[serde(default)]
    event: Option<Value>,
    #[serde(default)]
    payload: Option<Box<RawValue>>,
    #[serde(default)]
    meta: Option<Box<RawValue>>,
}

fn parse_broadcast(p: &RawValue) -> Result<BroadcastPush, MessageError> {
    let ev = events::BROADCAST;
    let r: RawBroadcast = object(p, ev)?;
    let type_ = match r.type_ {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => return Err(invalid(ev, "`type` must be a string")),
    };
    let event = match r.event {
        Some(Value::String(s)) => s,
        _ => return Err(invalid(ev, "`event` must be a string")),
    };
    Ok(BroadcastPush {
        type_,
        event,
        // A missing payload is treated as `{}`; an explicit `null` is kept.
        payload: BroadcastBody::Json(r.payload.unwrap_or_else(json::empty_object)),
        meta: r.meta.filter(|m| m.get() != "null"),
        binary: false,
    })
}

#[derive(Deserialize)]
struct RawPresence {
    #[serde(default)]
    event: Option<Value>,
    #[serde(default)]
    payload: Option<Box<RawValue>>,
}

fn parse_presence(p: &RawValue) -> Result<PresenceAction, MessageError> {
    let ev = events::PRESENCE;
    let r: RawPresence = object(p, ev)?;
    let event = match r.event {
        Some(Value::String(s)) => s,
        _ => return Err(invalid(ev, "`event` must be a string")),
    };
    if event.eq_ignore_ascii_case("track") {
        let payload = r.payload.unwrap_or_else(json::empty_object);
        if !payload.get().trim_start().starts_with("{") {
            return Err(MessageError::PresencePayloadNotMap);
        }
        Ok(PresenceAction::Track { payload })
    } else if event.eq_ignore_ascii_case("untrack") {
        Ok(PresenceAction::Untrack)
    } else {
        Err(MessageError::UnknownPresenceEvent(event))
    }
}

impl PartialEq for PresenceAction {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (PresenceAction::Track { payload: a }, PresenceAction::Track { payload: b }) => {
                a.get() == b.get()
            }
            (PresenceAction::Untrack, PresenceAction::Untrack) => true,
            _ => false,
        }
    }
}

impl PartialEq for BroadcastPush {
    fn eq(&self, other: &Self) -> bool {
        self.type_ == other.type_
            && self.binary == other.binary
            && self.event == other.event
            && self.payload == other.payload
            && self.meta.as_ref().map(|m| m.get()) == other.meta.as_ref().map(|m| m.get())
    }
}

/// The channel name of a topic (`realtime:room1` → `room1`); other topics are returned whole.
pub fn channel_name(topic: &str) -> &str {
    topic.strip_prefix(TOPIC_PREFIX).unwrap_or(topic)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vsn::Vsn;

    fn parse(text: &str) -> Result<ClientMessage, MessageError> {
        ClientMessage::parse(&Frame::decode_text(text, Vsn::V2).unwrap())
    }

    #[test]
    fn heartbeat_and_leave() {
        assert_eq!(
            parse(r#"[null,"1","phoenix","heartbeat",{}]"#),
            Ok(ClientMessage::Heartbeat)
        );
        assert_eq!(
            parse(r#"["3","12","realtime:r","phx_leave",{}]"#),
            Ok(ClientMessage::Leave)
        );
        assert_eq!(
            parse(r#"["3","12","realtime:r","whatever",{}]"#),
            Ok(ClientMessage::Unknown("whatever".into()))
        );
    }

    #[test]
    fn full_join() {
        let m = parse(
            r#"["3","3","realtime:room1","phx_join",{"config":{"broadcast":{"ack":false,"self":true},"presence":{"key":"","enabled":true},"postgres_changes":[{"event":"INSERT","schema":"public","table":"todos","filter":"user_id=eq.42"},{"event":"*","schema":"public","table":"todos"}],"private":false},"access_token":"jwt","version":"realtime-js/2.119.0"}]"#,
        )
        .unwrap();
        let ClientMessage::Join(j) = m else {
            panic!("not a join")
        };
        assert_eq!(j.access_token.as_deref(), Some("jwt"));
        assert!(j.config.broadcast.self_);
        assert!(!j.config.broadcast.ack);
        let m = parse(
            r#"["3","3","realtime:r","phx_join",{"config":{"broadcast":{"replication_ready":true}}}]"#,
        );
        let Ok(ClientMessage::Join(r)) = m else {
            panic!("not a join")
        };
        assert!(r.config.broadcast.replication_ready);
        assert!(j.config.presence.enabled);
        assert_eq!(j.config.postgres_changes.len(), 2);
        assert_eq!(
            j.config.postgres_changes[0].raw.get(),
            r#"{"event":"INSERT","schema":"public","table":"todos","filter":"user_id=eq.42"}"#
        );
    }

    #[test]
    fn shallow_merged_join() {
        let m = parse(
            r#"["3","3","realtime:r","phx_join",{"config":{"broadcast":{"self":true},"presence":{"enabled":true}}}]"#,
        )
        .unwrap();
        let ClientMessage::Join(j) = m else {
            panic!("not a join")
        };
        assert!(!j.config.broadcast.ack);
        assert!(!j.config.broadcast.replication_ready);
        assert_eq!(j.config.presence.key, "");
        assert!(j.config.postgres_changes.is_empty());
        assert_eq!(j.access_token, None);
        assert!(parse(r#"["3","3","realtime:r","phx_join",{}]"#).is_ok());
        assert!(matches!(
            parse(r#"["3","3","realtime:r","phx_join",{"config":{"postgres_changes":[{}]}}]"#),
            Err(MessageError::Binding { index: 0, .. })
        ));
        assert!(parse(r#"["3","3","realtime:r","phx_join",[]]"#).is_err());
    }

    #[test]
    fn access_token() {
        assert_eq!(
            parse(r#"["3","9","realtime:r","access_token",{"access_token":"t"}]"#),
            Ok(ClientMessage::AccessToken(Some("t".into())))
        );
        assert_eq!(
            parse(r#"["3","9","realtime:r","access_token",{"access_token":null}]"#),
            Ok(ClientMessage::AccessToken(None))
        );
    }

    #[test]
    fn broadcast_text() {
        let m = parse(
            r#"["3","7","realtime:r","broadcast",{"type":"broadcast","event":"cursor","payload":{"x":1}}]"#,
        )
        .unwrap();
        let ClientMessage::Broadcast(b) = m else {
            panic!("not a broadcast")
        };
        assert_eq!(b.type_.as_deref(), Some("broadcast"));
        assert!(!b.binary, "a JSON push");
        assert_eq!(b.event, "cursor");
        assert_eq!(
            b.payload,
            BroadcastBody::Json(RawValue::from_string("{\"x\":1}".into()).unwrap())
        );
    }

    #[test]
    fn broadcast_binary_push() {
        let f = Frame {
            join_ref: Some("3".into()),
            ref_: Some("7".into()),
            topic: "realtime:r".into(),
            event: events::BROADCAST.into(),
            payload: Payload::Broadcast(crate::frame::UserBroadcast {
                event: "cursor".into(),
                meta: None,
                body: BroadcastBody::Json(RawValue::from_string("{\"x\":1}".into()).unwrap()),
            }),
        };
        let crate::frame::WireMessage::Binary(bytes) = f.encode_client(Vsn::V2).unwrap() else {
            panic!("kind 3 is binary")
        };
        let back = Frame::decode_client_binary(&bytes, Vsn::V2).unwrap();
        let Ok(ClientMessage::Broadcast(b)) = ClientMessage::parse(&back) else {
            panic!("not a broadcast")
        };
        assert!(b.binary, "a binary push");
        assert_eq!(b.event, "cursor");
    }

    #[test]
    fn presence() {
        assert!(matches!(
            parse(
                r#"["3","8","realtime:r","presence",{"type":"presence","event":"track","payload":{"u":1}}]"#
            ),
            Ok(ClientMessage::Presence(PresenceAction::Track { .. }))
        ));
        assert_eq!(
            parse(r#"["3","8","realtime:r","presence",{"type":"presence","event":"untrack"}]"#),
            Ok(ClientMessage::Presence(PresenceAction::Untrack))
        );
        let e = parse(
            r#"["3","8","realtime:r","presence",{"type":"presence","event":"track","payload":1}]"#,
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "Presence track payload must be a map");
    }

    #[test]
    fn replay_since_and_limit_are_validated() {
        let join = |replay: &str| {
            parse(&format!(
                r#"["3","3","realtime:r","phx_join",{{"config":{{"broadcast":{{"replay":{replay}}},"private":true}}}}]"#
            ))
        };
        let Ok(ClientMessage::Join(j)) = join(r#"{"since":1700000000000.5,"limit":99}"#) else {
            panic!("a valid replay")
        };
        let r = j.config.broadcast.replay.unwrap();
        assert_eq!((r.since_ms, r.limit), (1_700_000_000_000, 25));
        for bad in [
            r#"{"since":-1e300}"#,
            r#"{"since":-1}"#,
            r#"{"since":1e300}"#,
            r#"{"since":"0"}"#,
            r#"{}"#,
            r#"{"since":0,"limit":-1}"#,
            r#"{"since":0,"limit":1.5}"#,
        ] {
            let e = join(bad).unwrap_err();
            assert!(
                e.to_string().contains("config.broadcast.replay"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn channel_names() {
        assert_eq!(channel_name("realtime:room1"), "room1");
        assert_eq!(channel_name("realtime:"), "");
        assert_eq!(channel_name("phoenix"), "phoenix");
    }
}
