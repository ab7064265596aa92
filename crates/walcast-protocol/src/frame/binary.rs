//! Binary broadcast frames of serializer 2.0.0: kind 3 (client push) and kind 4 (server
//! broadcast). Sizes are single bytes, so each string is at most 255 bytes.

use bytes::Bytes;
use serde_json::value::RawValue;

use super::{BroadcastBody, Frame, Payload, UserBroadcast};

/// Kind byte of a client → server broadcast push.
pub const KIND_CLIENT_PUSH: u8 = 3;
/// Kind byte of a server → client broadcast.
pub const KIND_SERVER_BROADCAST: u8 = 4;
/// Encoding byte: raw bytes payload.
pub const ENCODING_BINARY: u8 = 0;
/// Encoding byte: JSON text payload.
pub const ENCODING_JSON: u8 = 1;

/// Failure to decode or encode a binary frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BinaryError {
    /// Zero-length message.
    #[error("empty binary frame")]
    Empty,
    /// First byte was not the expected kind.
    #[error("unsupported binary frame kind {found} (expected {expected})")]
    UnexpectedKind {
        /// Kind this decoder handles.
        expected: u8,
        /// Kind found in byte 0.
        found: u8,
    },
    /// The frame ended before the declared lengths.
    #[error("truncated binary frame: need {needed} bytes, have {available}")]
    Truncated {
        /// Bytes required by the header.
        needed: usize,
        /// Bytes present.
        available: usize,
    },
    /// A string field is not UTF-8.
    #[error("binary frame field `{0}` is not valid UTF-8")]
    InvalidUtf8(&'static str),
    /// A JSON field (meta, or a payload with encoding 1) is not valid JSON.
    #[error("binary frame field `{field}` is not valid JSON: {message}")]
    InvalidJson {
        /// Field name.
        field: &'static str,
        /// Parser message.
        message: String,
    },
    /// Unknown payload encoding byte.
    #[error("unknown binary payload encoding {0} (expected 0 or 1)")]
    UnknownEncoding(u8),
    /// A string is longer than 255 bytes and cannot be length-prefixed by one byte.
    #[error("binary frame field `{field}` is {len} bytes long (at most 255)")]
    TooLong {
        /// Field name.
        field: &'static str,
        /// Actual length in bytes.
        len: usize,
    },
    /// Tried to binary-encode a frame whose payload is not a user broadcast.
    #[error("only broadcast payloads have a binary encoding")]
    NotBroadcast,
}

fn len_u8(field: &'static str, s: &[u8]) -> Result<u8, BinaryError> {
    u8::try_from(s.len()).map_err(|_| BinaryError::TooLong {
        field,
        len: s.len(),
    })
}

fn body_parts(body: &BroadcastBody) -> (u8, &[u8]) {
    match body {
        BroadcastBody::Json(v) => (ENCODING_JSON, v.get().as_bytes()),
        BroadcastBody::Binary(b) => (ENCODING_BINARY, b.as_ref()),
    }
}

fn meta_bytes(meta: &Option<Box<RawValue>>) -> &[u8] {
    meta.as_ref().map_or(&[][..], |m| m.get().as_bytes())
}

/// Encode a server broadcast (kind 4) for `topic`.
pub fn encode_server_broadcast(topic: &str, b: &UserBroadcast) -> Result<Vec<u8>, BinaryError> {
    let meta = meta_bytes(&b.meta);
    let (encoding, body) = body_parts(&b.body);
    let header = [
        KIND_SERVER_BROADCAST,
        len_u8("topic", topic.as_bytes())?,
        len_u8("event", b.event.as_bytes())?,
        len_u8("meta", meta)?,
        encoding,
    ];
    let mut out =
        Vec::with_capacity(header.len() + topic.len() + b.event.len() + meta.len() + body.len());
    out.extend_from_slice(&header);
    out.extend_from_slice(topic.as_bytes());
    out.extend_from_slice(b.event.as_bytes());
    out.extend_from_slice(meta);
    out.extend_from_slice(body);
    Ok(out)
}

/// Encode a client broadcast push (kind 3) from a frame whose payload is a broadcast.
/// `None` refs are written as empty strings.
pub fn encode_client_push(frame: &Frame) -> Result<Vec<u8>, BinaryError> {
    let Payload::Broadcast(b) = &frame.payload else {
        return Err(BinaryError::NotBroadcast);
    };
    let join_ref = frame.join_ref.as_deref().unwrap_or("").as_bytes();
    let ref_ = frame.ref_.as_deref().unwrap_or("").as_bytes();
    let meta = meta_bytes(&b.meta);
    let (encoding, body) = body_parts(&b.body);
    let header = [
        KIND_CLIENT_PUSH,
        len_u8("join_ref", join_ref)?,
        len_u8("ref", ref_)?,
        len_u8("topic", frame.topic.as_bytes())?,
        len_u8("event", b.event.as_bytes())?,
        len_u8("meta", meta)?,
        encoding,
    ];
    let mut out = Vec::with_capacity(
        header.len()
            + join_ref.len()
            + ref_.len()
            + frame.topic.len()
            + b.event.len()
            + meta.len()
            + body.len(),
    );
    out.extend_from_slice(&header);
    for part in [
        join_ref,
        ref_,
        frame.topic.as_bytes(),
        b.event.as_bytes(),
        meta,
        body,
    ] {
        out.extend_from_slice(part);
    }
    Ok(out)
}

/// Sequential reader over a binary frame.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BinaryError> {
        let end = self.pos.saturating_add(n);
        let slice = self.buf.get(self.pos..end).ok_or(BinaryError::Truncated {
            needed: end,
            available: self.buf.len(),
        })?;
        self.pos = end;
        Ok(slice)
    }

    fn string(&mut self, n: u8, field: &'static str) -> Result<&'a str, BinaryError> {
        std::str::from_utf8(self.take(n as usize)?).map_err(|_| BinaryError::InvalidUtf8(field))
    }

    fn rest(&self) -> &'a [u8] {
        self.buf.get(self.pos..).unwrap_or(&[])
    }
}

fn header<'a, const N: usize>(
    bytes: &'a [u8],
    kind: u8,
) -> Result<(&'a [u8; N], Reader<'a>), BinaryError> {
    let found = *bytes.first().ok_or(BinaryError::Empty)?;
    if found != kind {
        return Err(BinaryError::UnexpectedKind {
            expected: kind,
            found,
        });
    }
    let head: &[u8; N] =
        bytes
            .get(..N)
            .and_then(|h| h.try_into().ok())
            .ok_or(BinaryError::Truncated {
                needed: N,
                available: bytes.len(),
            })?;
    Ok((head, Reader { buf: bytes, pos: N }))
}

fn parse_meta(meta: &[u8]) -> Result<Option<Box<RawValue>>, BinaryError> {
    if meta.is_empty() {
        return Ok(None);
    }
    let text = std::str::from_utf8(meta).map_err(|_| BinaryError::InvalidUtf8("meta"))?;
    serde_json::from_str::<Box<RawValue>>(text)
        .map(Some)
        .map_err(|e| BinaryError::InvalidJson {
            field: "meta",
            message: e.to_string(),
        })
}

fn parse_body(encoding: u8, body: &[u8]) -> Result<BroadcastBody, BinaryError> {
    match encoding {
        ENCODING_BINARY => Ok(BroadcastBody::Binary(Bytes::copy_from_slice(body))),
        ENCODING_JSON => {
            let text =
                std::str::from_utf8(body).map_err(|_| BinaryError::InvalidUtf8("payload"))?;
            // An empty JSON body is read as `{}` (lenient; a client never sends it).
            let text = if text.trim().is_empty() { "{}" } else { text };
            serde_json::from_str::<Box<RawValue>>(text)
                .map(BroadcastBody::Json)
                .map_err(|e| BinaryError::InvalidJson {
                    field: "payload",
                    message: e.to_string(),
                })
        }
        other => Err(BinaryError::UnknownEncoding(other)),
    }
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// Decode a client broadcast push (kind 3) into a frame with event `broadcast` and a
/// [`Payload::Broadcast`]. Empty refs decode as `None`.
pub fn decode_client_push(bytes: &[u8]) -> Result<Frame, BinaryError> {
    let (h, mut r) = header::<7>(bytes, KIND_CLIENT_PUSH)?;
    let [_, jr_len, ref_len, topic_len, event_len, meta_len, encoding] = *h;
    let join_ref = r.string(jr_len, "join_ref")?;
    let ref_ = r.string(ref_len, "ref")?;
    let topic = r.string(topic_len, "topic")?;
    let event = r.string(event_len, "event")?;
    let meta = parse_meta(r.take(meta_len as usize)?)?;
    let body = parse_body(encoding, r.rest())?;
    Ok(Frame {
        join_ref: non_empty(join_ref),
        ref_: non_empty(ref_),
        topic: topic.to_owned(),
        event: "broadcast".to_owned(),
        payload: Payload::Broadcast(UserBroadcast {
            event: event.to_owned(),
            meta,
            body,
        }),
    })
}

/// Decode a server broadcast (kind 4), as the client does: event `broadcast`, null refs.
pub fn decode_server_broadcast(bytes: &[u8]) -> Result<Frame, BinaryError> {
    let (h, mut r) = header::<5>(bytes, KIND_SERVER_BROADCAST)?;
    let [_, topic_len, event_len, meta_len, encoding] = *h;
    let topic = r.string(topic_len, "topic")?;
    let event = r.string(event_len, "event")?;
    let meta = parse_meta(r.take(meta_len as usize)?)?;
    let body = parse_body(encoding, r.rest())?;
    Ok(Frame {
        join_ref: None,
        ref_: None,
        topic: topic.to_owned(),
        event: "broadcast".to_owned(),
        payload: Payload::Broadcast(UserBroadcast {
            event: event.to_owned(),
            meta,
            body,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_realtime_js_push() {
        // join_ref "3", ref "7", topic "realtime:r", event "cursor", no meta, JSON {"x":1}
        let mut b = vec![3, 1, 1, 10, 6, 0, 1];
        b.extend_from_slice(b"37realtime:rcursor{\"x\":1}");
        let f = decode_client_push(&b).unwrap();
        assert_eq!(f.join_ref.as_deref(), Some("3"));
        assert_eq!(f.ref_.as_deref(), Some("7"));
        assert_eq!(f.topic, "realtime:r");
        assert_eq!(f.event, "broadcast");
        let Payload::Broadcast(ub) = &f.payload else {
            panic!("not a broadcast")
        };
        assert_eq!(ub.event, "cursor");
        assert!(ub.meta.is_none());
        assert_eq!(
            ub.body,
            BroadcastBody::Json(RawValue::from_string("{\"x\":1}".into()).unwrap())
        );
        assert_eq!(encode_client_push(&f).unwrap(), b);
    }

    #[test]
    fn kind4_layout() {
        let ub = UserBroadcast {
            event: "e".into(),
            meta: Some(RawValue::from_string("{\"id\":\"1\"}".into()).unwrap()),
            body: BroadcastBody::Binary(Bytes::from_static(&[0, 255])),
        };
        let out = encode_server_broadcast("t", &ub).unwrap();
        assert_eq!(
            out,
            b"\x04\x01\x01\x0a\x00te{\"id\":\"1\"}\x00\xff".to_vec()
        );
        let back = decode_server_broadcast(&out).unwrap();
        assert_eq!(back.payload, Payload::Broadcast(ub));
    }

    #[test]
    fn errors() {
        assert_eq!(decode_client_push(&[]), Err(BinaryError::Empty));
        assert!(matches!(
            decode_client_push(&[4]),
            Err(BinaryError::UnexpectedKind { .. })
        ));
        assert!(matches!(
            decode_client_push(&[3, 1, 0, 0, 0, 0, 1]),
            Err(BinaryError::Truncated { .. })
        ));
        assert_eq!(
            decode_client_push(&[3, 0, 0, 0, 0, 0, 7]),
            Err(BinaryError::UnknownEncoding(7))
        );
        let long = "x".repeat(256);
        let ub = UserBroadcast {
            event: long,
            meta: None,
            body: BroadcastBody::Binary(Bytes::new()),
        };
        assert_eq!(
            encode_server_broadcast("t", &ub),
            Err(BinaryError::TooLong {
                field: "event",
                len: 256
            })
        );
    }
}
