//! Phoenix channel frames and their text encodings (serializer 1.0.0 and 2.0.0).

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

pub mod binary;

use crate::json;
use crate::vsn::Vsn;
use binary::BinaryError;

/// One Phoenix channel message.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// Ref of the channel's most recent `phx_join`, if any.
    pub join_ref: Option<String>,
    /// Request ref (echoed in replies).
    pub ref_: Option<String>,
    /// Channel topic (`realtime:<name>` or `phoenix`).
    pub topic: String,
    /// Phoenix event name (`phx_join`, `broadcast`, …).
    pub event: String,
    /// Message payload.
    pub payload: Payload,
}

/// A frame payload: JSON text kept raw, or a user broadcast from/for a binary frame.
#[derive(Debug, Clone)]
pub enum Payload {
    /// Any JSON value, kept as its original text.
    Json(Box<RawValue>),
    /// A user broadcast: decoded from binary kind 3, encoded as binary kind 4 under 2.0.0
    /// (and as `{type:"broadcast",event,payload,meta?}` text under 1.0.0).
    Broadcast(UserBroadcast),
}

/// The user part of a broadcast (`channel.send({type:"broadcast", event, payload})`).
#[derive(Debug, Clone)]
pub struct UserBroadcast {
    /// The user event name (not the Phoenix event, which is always `broadcast`).
    pub event: String,
    /// Optional meta object (`{"id":…,"replayed":true}`); `None` = empty in binary form.
    pub meta: Option<Box<RawValue>>,
    /// The broadcast body.
    pub body: BroadcastBody,
}

/// Body of a user broadcast.
#[derive(Debug, Clone)]
pub enum BroadcastBody {
    /// JSON payload (binary encoding byte 1).
    Json(Box<RawValue>),
    /// Raw bytes (binary encoding byte 0, an `ArrayBuffer` on the client).
    Binary(Bytes),
}

impl BroadcastBody {
    /// Its size in bytes (the JSON text, or the raw bytes).
    pub fn len(&self) -> usize {
        match self {
            BroadcastBody::Json(v) => v.get().len(),
            BroadcastBody::Binary(b) => b.len(),
        }
    }

    /// Whether it has no bytes at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A frame ready for the WebSocket: text or binary message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireMessage {
    /// A text WebSocket message.
    Text(String),
    /// A binary WebSocket message.
    Binary(Vec<u8>),
}

/// Failure to decode an incoming frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Text frame was not valid for the serializer version.
    #[error("malformed {vsn} text frame: {message}")]
    Text {
        /// Serializer version used to decode.
        vsn: Vsn,
        /// What was wrong.
        message: String,
    },
    /// Binary frame was invalid.
    #[error(transparent)]
    Binary(#[from] BinaryError),
    /// Binary frames do not exist under 1.0.0.
    #[error("binary frames are not supported under serializer 1.0.0")]
    BinaryUnderV1,
}

/// Failure to encode an outgoing frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A raw-bytes broadcast body has no text (JSON) form.
    #[error("a binary broadcast payload cannot be sent as a text frame")]
    BinaryBodyAsText,
    /// Binary encoding failed (string too long, wrong payload kind).
    #[error(transparent)]
    Binary(#[from] BinaryError),
}

impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Payload::Json(a), Payload::Json(b)) => a.get() == b.get(),
            (Payload::Broadcast(a), Payload::Broadcast(b)) => a == b,
            _ => false,
        }
    }
}

impl PartialEq for UserBroadcast {
    fn eq(&self, other: &Self) -> bool {
        self.event == other.event
            && self.meta.as_ref().map(|m| m.get()) == other.meta.as_ref().map(|m| m.get())
            && self.body == other.body
    }
}

impl PartialEq for BroadcastBody {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (BroadcastBody::Json(a), BroadcastBody::Json(b)) => a.get() == b.get(),
            (BroadcastBody::Binary(a), BroadcastBody::Binary(b)) => a == b,
            _ => false,
        }
    }
}

impl Payload {
    /// An empty JSON object payload (`{}`).
    pub fn empty() -> Payload {
        Payload::Json(json::empty_object())
    }

    /// The JSON text of this payload, if it is JSON.
    pub fn as_json(&self) -> Option<&RawValue> {
        match self {
            Payload::Json(v) => Some(v),
            Payload::Broadcast(_) => None,
        }
    }

    /// JSON text of the payload as a text frame would carry it.
    pub fn to_json_text(&self) -> Result<String, EncodeError> {
        match self {
            Payload::Json(v) => Ok(v.get().to_owned()),
            Payload::Broadcast(b) => b.to_json_text(),
        }
    }
}

impl UserBroadcast {
    /// `{"type":"broadcast","event":…,"payload":…[,"meta":…]}` (text form of a broadcast).
    pub fn to_json_text(&self) -> Result<String, EncodeError> {
        let body = match &self.body {
            BroadcastBody::Json(v) => v.get(),
            BroadcastBody::Binary(_) => return Err(EncodeError::BinaryBodyAsText),
        };
        let mut out = String::with_capacity(body.len() + self.event.len() + 48);
        out.push_str("{\"type\":\"broadcast\",\"event\":");
        json::write_str(&mut out, &self.event);
        out.push_str(",\"payload\":");
        out.push_str(body);
        if let Some(meta) = &self.meta {
            out.push_str(",\"meta\":");
            out.push_str(meta.get());
        }
        out.push('}');
        Ok(out)
    }
}

impl Frame {
    /// Build a frame with a JSON payload.
    pub fn new(
        join_ref: Option<&str>,
        ref_: Option<&str>,
        topic: &str,
        event: &str,
        payload: Box<RawValue>,
    ) -> Frame {
        Frame {
            join_ref: join_ref.map(str::to_owned),
            ref_: ref_.map(str::to_owned),
            topic: topic.to_owned(),
            event: event.to_owned(),
            payload: Payload::Json(payload),
        }
    }

    /// Encode as a text frame (a broadcast payload becomes its `{type:"broadcast",…}` form).
    pub fn encode_text(&self, vsn: Vsn) -> Result<String, EncodeError> {
        let payload = self.payload.to_json_text()?;
        Ok(encode_text_parts(
            vsn,
            self.join_ref.as_deref(),
            self.ref_.as_deref(),
            &self.topic,
            &self.event,
            &payload,
        ))
    }

    /// Encode a server → client frame: under 2.0.0 a broadcast payload becomes binary kind 4;
    /// everything else is text.
    pub fn encode_server(&self, vsn: Vsn) -> Result<WireMessage, EncodeError> {
        match (&self.payload, vsn) {
            (Payload::Broadcast(b), Vsn::V2) => Ok(WireMessage::Binary(
                binary::encode_server_broadcast(&self.topic, b)?,
            )),
            _ => self.encode_text(vsn).map(WireMessage::Text),
        }
    }

    /// Encode a client → server frame (for test clients): under 2.0.0 a broadcast payload
    /// becomes binary kind 3; everything else is text.
    pub fn encode_client(&self, vsn: Vsn) -> Result<WireMessage, EncodeError> {
        match (&self.payload, vsn) {
            (Payload::Broadcast(_), Vsn::V2) => {
                Ok(WireMessage::Binary(binary::encode_client_push(self)?))
            }
            _ => self.encode_text(vsn).map(WireMessage::Text),
        }
    }

    /// Decode a text frame under the given serializer version.
    pub fn decode_text(text: &str, vsn: Vsn) -> Result<Frame, DecodeError> {
        let err = |e: serde_json::Error| DecodeError::Text {
            vsn,
            message: e.to_string(),
        };
        match vsn {
            Vsn::V2 => {
                let (join_ref, ref_, topic, event, payload): (
                    Option<RefValue>,
                    Option<RefValue>,
                    String,
                    String,
                    Box<RawValue>,
                ) = serde_json::from_str(text).map_err(err)?;
                Ok(Frame {
                    join_ref: join_ref.map(RefValue::into_string),
                    ref_: ref_.map(RefValue::into_string),
                    topic,
                    event,
                    payload: Payload::Json(payload),
                })
            }
            Vsn::V1 => {
                let f: V1Frame = serde_json::from_str(text).map_err(err)?;
                Ok(Frame {
                    join_ref: f.join_ref.map(RefValue::into_string),
                    ref_: f.ref_.map(RefValue::into_string),
                    topic: f.topic,
                    event: f.event,
                    payload: Payload::Json(f.payload),
                })
            }
        }
    }

    /// Decode a binary frame sent by a client (kind 3 broadcast push).
    pub fn decode_client_binary(bytes: &[u8], vsn: Vsn) -> Result<Frame, DecodeError> {
        match vsn {
            Vsn::V1 => Err(DecodeError::BinaryUnderV1),
            Vsn::V2 => Ok(binary::decode_client_push(bytes)?),
        }
    }

    /// Decode a binary frame sent by a server (kind 4 broadcast), as a client would.
    pub fn decode_server_binary(bytes: &[u8]) -> Result<Frame, DecodeError> {
        Ok(binary::decode_server_broadcast(bytes)?)
    }

    /// Decode any client message (text or binary) under `vsn`.
    pub fn decode_client(msg: &WireMessage, vsn: Vsn) -> Result<Frame, DecodeError> {
        match msg {
            WireMessage::Text(t) => Frame::decode_text(t, vsn),
            WireMessage::Binary(b) => Frame::decode_client_binary(b, vsn),
        }
    }
}

/// Write a text frame from parts; `payload` must be valid JSON text.
pub(crate) fn encode_text_parts(
    vsn: Vsn,
    join_ref: Option<&str>,
    ref_: Option<&str>,
    topic: &str,
    event: &str,
    payload: &str,
) -> String {
    let mut out = String::with_capacity(payload.len() + topic.len() + event.len() + 64);
    match vsn {
        Vsn::V2 => {
            out.push('[');
            json::write_opt_str(&mut out, join_ref);
            out.push(',');
            json::write_opt_str(&mut out, ref_);
            out.push(',');
            json::write_str(&mut out, topic);
            out.push(',');
            json::write_str(&mut out, event);
            out.push(',');
            out.push_str(payload);
            out.push(']');
        }
        Vsn::V1 => {
            out.push_str("{\"topic\":");
            json::write_str(&mut out, topic);
            out.push_str(",\"event\":");
            json::write_str(&mut out, event);
            out.push_str(",\"payload\":");
            out.push_str(payload);
            out.push_str(",\"ref\":");
            json::write_opt_str(&mut out, ref_);
            out.push_str(",\"join_ref\":");
            json::write_opt_str(&mut out, join_ref);
            out.push('}');
        }
    }
    out
}

/// A ref as sent by clients: normally a string, tolerated as a number.
#[derive(Deserialize)]
#[serde(untagged)]
enum RefValue {
    Str(String),
    Num(serde_json::Number),
}

impl RefValue {
    fn into_string(self) -> String {
        match self {
            RefValue::Str(s) => s,
            RefValue::Num(n) => n.to_string(),
        }
    }
}

#[derive(Deserialize)]
struct V1Frame {
    topic: String,
    event: String,
    payload: Box<RawValue>,
    #[serde(rename = "ref", default)]
    ref_: Option<RefValue>,
    #[serde(default)]
    join_ref: Option<RefValue>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_owned()).unwrap()
    }

    #[test]
    fn v2_heartbeat_round_trip() {
        let text = r#"[null,"12","phoenix","heartbeat",{}]"#;
        let f = Frame::decode_text(text, Vsn::V2).unwrap();
        assert_eq!(f.join_ref, None);
        assert_eq!(f.ref_.as_deref(), Some("12"));
        assert_eq!(f.topic, "phoenix");
        assert_eq!(f.event, "heartbeat");
        assert_eq!(f.encode_text(Vsn::V2).unwrap(), text);
    }

    #[test]
    fn v1_object_frame() {
        let text = r#"{"topic":"realtime:a","event":"phx_join","payload":{"x":1},"ref":"3"}"#;
        let f = Frame::decode_text(text, Vsn::V1).unwrap();
        assert_eq!(f.join_ref, None);
        assert_eq!(f.ref_.as_deref(), Some("3"));
        assert_eq!(f.payload.as_json().unwrap().get(), r#"{"x":1}"#);
        assert_eq!(
            f.encode_text(Vsn::V1).unwrap(),
            r#"{"topic":"realtime:a","event":"phx_join","payload":{"x":1},"ref":"3","join_ref":null}"#
        );
    }

    #[test]
    fn numeric_refs_tolerated() {
        let f = Frame::decode_text(r#"[1,2,"t","e",null]"#, Vsn::V2).unwrap();
        assert_eq!(f.join_ref.as_deref(), Some("1"));
        assert_eq!(f.ref_.as_deref(), Some("2"));
    }

    #[test]
    fn rejects_bad_text() {
        for t in [
            "",
            "[]",
            "[null,null,\"t\",\"e\"]",
            "[null,null,\"t\",\"e\",{},1]",
            "{}",
            "[null,null,1,\"e\",{}]",
        ] {
            assert!(Frame::decode_text(t, Vsn::V2).is_err(), "{t}");
        }
        assert!(Frame::decode_text("[null,null,\"t\",\"e\",{}]", Vsn::V1).is_err());
    }

    #[test]
    fn broadcast_text_form() {
        let f = Frame {
            join_ref: None,
            ref_: None,
            topic: "realtime:r".into(),
            event: "broadcast".into(),
            payload: Payload::Broadcast(UserBroadcast {
                event: "cursor".into(),
                meta: None,
                body: BroadcastBody::Json(raw(r#"{"x":1}"#)),
            }),
        };
        assert_eq!(
            f.encode_server(Vsn::V1).unwrap(),
            WireMessage::Text(
                r#"{"topic":"realtime:r","event":"broadcast","payload":{"type":"broadcast","event":"cursor","payload":{"x":1}},"ref":null,"join_ref":null}"#
                    .into()
            )
        );
        assert!(matches!(
            f.encode_server(Vsn::V2).unwrap(),
            WireMessage::Binary(_)
        ));
    }
}
