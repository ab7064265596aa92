//! Broadcasts on the bus: their subjects and their envelope, shared by the fronts (which
//! relay their clients' broadcasts to each other) and the cdc-worker (which sends the
//! database's, `realtime.send`).
//!
//! Subject: `walcast.broadcast.<project>.<public|private>.<channel name>` (tokens encoded
//! with [`encode_token`]). Payload: one line of JSON `{"event":…,"binary":bool,"meta":…}`,
//! a `\n`, then the body bytes (JSON text, or raw bytes for binary broadcasts). A channel
//! name (or project) too long to spell in a token is a digest in the subject: the head line
//! then also carries `"project"` and `"name"`, which receivers take (once they check that
//! they give this very subject). Build and read messages with [`BroadcastTarget::message`]
//! and [`BroadcastTarget::of_message`].

use std::borrow::Cow;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::subject::{decode_token, encode_token, is_digest};

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

    /// The target a subject names, when it spells it (`None` for a digest token).
    pub fn parse(subject: &str) -> Option<BroadcastTarget> {
        let (p, private, name) = split(subject)?;
        Some(BroadcastTarget {
            project: decode_token(p).ok()?,
            private,
            name: decode_token(name).ok()?,
        })
    }

    /// A broadcast to this target: its subject and payload (the target in the head line
    /// when the subject cannot spell it). `None`: the head line cannot be written.
    pub fn message<'b>(&'b self, mut env: Envelope<'b>, body: &[u8]) -> Option<(String, Bytes)> {
        let subject = self.subject();
        if split(&subject).is_some_and(|(p, _, n)| is_digest(p) || is_digest(n)) {
            env.project = Some(Cow::Borrowed(&self.project));
            env.name = Some(Cow::Borrowed(&self.name));
        }
        Some((subject, encode_envelope(&env, body)?))
    }

    /// A broadcast message's target, envelope and body: `None` if it is not one, or if
    /// its head line names a target whose subject is not this one.
    pub fn of_message<'p>(
        subject: &str,
        payload: &'p Bytes,
    ) -> Option<(BroadcastTarget, Envelope<'p>, Bytes)> {
        let (env, body) = decode_envelope(payload)?;
        let target = match (&env.project, &env.name) {
            (Some(project), Some(name)) => {
                let t = BroadcastTarget {
                    project: project.to_string(),
                    private: split(subject)?.1,
                    name: name.to_string(),
                };
                (t.subject() == subject).then_some(t)?
            }
            _ => BroadcastTarget::parse(subject)?,
        };
        Some((target, env, body))
    }
}

/// A broadcast subject's project token, namespace and name token.
fn split(subject: &str) -> Option<(&str, bool, &str)> {
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
    Some((p, private, name))
}

/// The head line of a broadcast's payload.
#[derive(Serialize, Deserialize, Debug)]
pub struct Envelope<'a> {
    #[serde(borrow)]
    pub event: Cow<'a, str>,
    pub binary: bool,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<&'a RawValue>,
    /// The target's project, when its subject cannot spell it (set by
    /// [`BroadcastTarget::message`]).
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    pub project: Option<Cow<'a, str>>,
    /// The target's channel name, likewise.
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    pub name: Option<Cow<'a, str>>,
}

impl<'a> Envelope<'a> {
    /// The head line of a broadcast of `event`.
    pub fn new(event: Cow<'a, str>, binary: bool, meta: Option<&'a RawValue>) -> Envelope<'a> {
        Envelope {
            event,
            binary,
            meta,
            project: None,
            name: None,
        }
    }
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
        let env = Envelope::new(Cow::Borrowed("ev"), false, Some(&meta));
        let bytes = encode_envelope(&env, br#"{"a":1}"#).unwrap();
        let (back, body) = decode_envelope(&bytes).unwrap();
        assert_eq!((back.event.as_ref(), back.binary), ("ev", false));
        assert_eq!(back.meta.map(RawValue::get), Some(r#"{"id":"1"}"#));
        assert_eq!(&body[..], br#"{"a":1}"#);
    }

    #[test]
    fn long_names_travel_in_the_head_line_and_must_match_the_subject() {
        for name in ["k".repeat(1500), "é".repeat(1500), "room:1".to_string()] {
            let t = BroadcastTarget {
                project: "p".into(),
                private: false,
                name: name.clone(),
            };
            let (subject, payload) = t
                .message(Envelope::new(Cow::Borrowed("ev"), false, None), b"{}")
                .unwrap();
            assert!(subject.len() < 300, "{subject}");
            let (back, env, body) = BroadcastTarget::of_message(&subject, &payload).unwrap();
            assert_eq!(back, t);
            assert_eq!(env.event, "ev");
            assert_eq!(&body[..], b"{}");
            // Spelled names do not ride along.
            assert_eq!(env.name.is_some(), name.len() > 100);
            // Another target's head line on this subject is refused.
            let other = BroadcastTarget {
                name: format!("{name}x"),
                ..t.clone()
            };
            let (_, forged) = other
                .message(Envelope::new(Cow::Borrowed("ev"), false, None), b"{}")
                .unwrap();
            if env.name.is_some() {
                assert!(BroadcastTarget::of_message(&subject, &forged).is_none());
            }
        }
    }
}
