//! Broadcasts on the bus: their subjects and their envelope, shared by the fronts (which
//! relay their clients' broadcasts to each other) and the cdc-worker (which sends the
//! database's, `realtime.send`).
//!
//! Subject: `walcast.broadcast.<project>.<public|private>.<channel name>` (tokens encoded
//! with [`encode_token`]). Payload: one line of JSON `{"event":…,"binary":bool,"meta":…}`,
//! a `\n`, then the body bytes (JSON text, or raw bytes for binary broadcasts).

use std::borrow::Cow;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::subject::{decode_token, encode_token};

/// Prefix of broadcast subjects.
pub const BROADCAST_PREFIX: &str = "walcast.broadcast";
/// Subscription pattern for every broadcast.
pub const BROADCAST_ALL: &str = "walcast.broadcast.>";

/// Where a broadcast goes: a project's public or private channel `name` (without the
/// `realtime:` prefix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BroadcastTarget {
    pub project: String,
    pub private: bool,
    pub name: String,
}

impl BroadcastTarget {
    pub fn subject(&self) -> String {
        format!(
            "{BROADCAST_PREFIX}.{}.{}.{}",
            encode_token(&self.project),
            if self.private { "private" } else { "public" },
            encode_token(&self.name)
        )
    }

    pub fn parse(subject: &str) -> Option<BroadcastTarget> {
        let rest = subject.strip_prefix(BROADCAST_PREFIX)?.strip_prefix('.')?;
        let mut it = rest.split('.');
        let (p, ns, name) = (it.next()?, it.next()?, it.next()?);
        if it.next().is_some() {
            return None;
        }
        let private = match ns {
            "private" => true,
            "public" => false,
            _ => return None,
        };
        Some(BroadcastTarget {
            project: decode_token(p).ok()?,
            private,
            name: decode_token(name).ok()?,
        })
    }
}

/// The head line of a broadcast's payload.
#[derive(Serialize, Deserialize, Debug)]
pub struct Envelope<'a> {
    #[serde(borrow)]
    pub event: Cow<'a, str>,
    pub binary: bool,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<&'a RawValue>,
}

/// A broadcast's payload: the envelope line, then the body.
pub fn encode_envelope(env: &Envelope<'_>, body: &[u8]) -> Option<Bytes> {
    let head = serde_json::to_vec(env).ok()?;
    let mut out = Vec::with_capacity(head.len() + 1 + body.len());
    out.extend_from_slice(&head);
    out.push(b'\n');
    out.extend_from_slice(body);
    Some(Bytes::from(out))
}

/// The envelope and body of a broadcast's payload.
pub fn decode_envelope(payload: &Bytes) -> Option<(Envelope<'_>, Bytes)> {
    let nl = payload.iter().position(|&c| c == b'\n')?;
    let env: Envelope<'_> = serde_json::from_slice(&payload[..nl]).ok()?;
    Some((env, payload.slice(nl + 1..)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_and_envelopes_round_trip() {
        let t = BroadcastTarget {
            project: "p.1".into(),
            private: true,
            name: "room:a b".into(),
        };
        assert_eq!(BroadcastTarget::parse(&t.subject()), Some(t.clone()));
        assert_eq!(BroadcastTarget::parse("walcast.broadcast.p.other.x"), None);
        let meta = RawValue::from_string(r#"{"id":"1"}"#.into()).unwrap();
        let env = Envelope {
            event: Cow::Borrowed("ev"),
            binary: false,
            meta: Some(&meta),
        };
        let bytes = encode_envelope(&env, br#"{"a":1}"#).unwrap();
        let (back, body) = decode_envelope(&bytes).unwrap();
        assert_eq!((back.event.as_ref(), back.binary), ("ev", false));
        assert_eq!(back.meta.map(RawValue::get), Some(r#"{"id":"1"}"#));
        assert_eq!(&body[..], br#"{"a":1}"#);
    }
}
