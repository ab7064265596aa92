//! Broadcast: local delivery, relay between fronts over the bus, and the REST API.
//!
//! A broadcast is delivered directly to this front's channels of the topic and published
//! on the bus (subject and envelope: [`walcast_bus::broadcast`]) with header
//! `Walcast-Origin` = this front's id. Every front relays the messages of the others (and
//! the database's, sent by the cdc-worker) to its own channels and drops its own echo.
//!
//! * here: [`Broadcasts`] — what broadcast takes (the bus, this front's channels by topic,
//!   the policies of private topics) — local delivery, and sending to the other fronts;
//! * `relay`: the other fronts' and the database's broadcasts, delivered here;
//! * `rest`: the REST API (`POST /realtime/v1/api/broadcast` …);
//! * `link`: after this front's NATS link was lost, every channel told that broadcasts
//!   and presence may have been missed.
//!
//! The Phoenix command a client broadcasts with is `channel::send`.

pub(crate) mod link;
pub(crate) mod relay;
pub(crate) mod rest;

use std::sync::Arc;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use walcast_bus::broadcast::{BroadcastTarget, Envelope};
use walcast_bus::{Bus, HEADER_ORIGIN, HEADER_PUSHED};
use walcast_protocol::message::TOPIC_PREFIX;
use walcast_protocol::{channel_name, server, BroadcastBody, UserBroadcast, Vsn, WireMessage};

use crate::auth::private::Policies;
use crate::connection::{Out, TopicKey, Topics};
use crate::limits::rates::Rate;
use crate::limits::usage::Usage;
use crate::projects::Projects;
use crate::telemetry;

pub use walcast_bus::broadcast::{BROADCAST_ALL, BROADCAST_PREFIX};

fn target(key: &TopicKey) -> BroadcastTarget {
    BroadcastTarget {
        project: key.project.clone(),
        private: key.private,
        name: channel_name(&key.topic).to_string(),
    }
}

/// A broadcast's subject and payload on the bus.
fn encode_message(key: &TopicKey, b: &UserBroadcast) -> Option<(String, Bytes)> {
    let (binary, body): (bool, &[u8]) = match &b.body {
        BroadcastBody::Json(v) => (false, v.get().as_bytes()),
        BroadcastBody::Binary(bytes) => (true, bytes),
    };
    let env = Envelope::new(
        std::borrow::Cow::Borrowed(&b.event),
        binary,
        b.meta.as_deref(),
    );
    target(key).message(env, body)
}

/// A broadcast from the bus: its topic and the broadcast.
fn decode_message(subject: &str, payload: &Bytes) -> Option<(TopicKey, UserBroadcast)> {
    let (t, env, body) = BroadcastTarget::of_message(subject, payload)?;
    let body = if env.binary {
        BroadcastBody::Binary(body)
    } else {
        let text = String::from_utf8(body.to_vec()).ok()?;
        BroadcastBody::Json(RawValue::from_string(text).ok()?)
    };
    let key = TopicKey {
        project: t.project,
        private: t.private,
        topic: format!("{TOPIC_PREFIX}{}", t.name),
    };
    let b = UserBroadcast {
        event: env.event.into_owned(),
        meta: env.meta.map(RawValue::to_owned),
        body,
    };
    Some((key, b))
}

/// How a broadcast came, which decides its framing for 2.0.0 sockets (Supabase's rule):
/// one that came as a binary push (kind 3) goes out as binary kind 4; one that came as
/// JSON (a JSON push, the REST API, the database) as a text frame, unless its body is raw
/// bytes (kind 4: it has no text form). 1.0.0 sockets always get text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// A client's binary push.
    Binary,
    /// Anything else.
    Json,
}

/// Broadcast on this front: delivery to its channels, the relay between fronts, the
/// REST API.
pub(crate) struct Broadcasts {
    front_id: String,
    bus: Bus,
    topics: Arc<Topics>,
    projects: Projects,
    policies: Policies,
    max_frame_bytes: usize,
    usage: Arc<Usage>,
}

impl Broadcasts {
    /// `max_frame_bytes` bounds a REST message's payload (and so does its project's
    /// payload limit, in `usage`).
    pub(crate) fn new(
        front_id: String,
        bus: Bus,
        topics: Arc<Topics>,
        (policies, projects): (Policies, Projects),
        max_frame_bytes: usize,
        usage: Arc<Usage>,
    ) -> Broadcasts {
        Broadcasts {
            front_id,
            bus,
            topics,
            projects,
            policies,
            max_frame_bytes,
            usage,
        }
    }

    /// Deliver to this front's channels of the topic (except channel `except`), framed as
    /// Supabase frames it ([`Pushed`]).
    fn deliver_local(&self, key: &TopicKey, b: &UserBroadcast, how: Pushed, except: Option<u64>) {
        let members = self.topics.members(key);
        if members.is_empty() {
            return;
        }
        // Only the database's broadcasts of private topics can have been replayed.
        let id = key.private.then(|| meta_id(b)).flatten();
        let frame = match how {
            Pushed::Binary => server::broadcast_pushed(&key.topic, b.clone()),
            Pushed::Json => server::broadcast(&key.topic, b.clone()),
        };
        let mut v1: Option<Option<Out>> = None;
        let mut v2: Option<Option<Out>> = None;
        let (mut sent, mut bytes) = (0u64, 0u64);
        for m in members {
            if Some(m.id) == except {
                continue;
            }
            let slot = match m.vsn {
                Vsn::V1 => &mut v1,
                Vsn::V2 => &mut v2,
            };
            let out = slot.get_or_insert_with(|| encode_for(&frame, m.vsn));
            if let Some(o) = out {
                sent += 1;
                bytes += o.len() as u64;
                m.deliver_broadcast(o.clone(), id.as_ref());
            }
        }
        if sent > 0 {
            let counted = [(Rate::Events, sent), (Rate::Bytes, bytes)];
            self.usage.count(&key.project, &counted);
        }
    }

    /// Deliver locally and relay to the other fronts.
    pub(crate) async fn send(
        &self,
        key: &TopicKey,
        b: &UserBroadcast,
        how: Pushed,
        except: Option<u64>,
    ) {
        self.deliver_local(key, b, how, except);
        let Some((subject, payload)) = encode_message(key, b) else {
            return;
        };
        let origin = (HEADER_ORIGIN, self.front_id.as_str());
        let headers: &[(&str, &str)] = match how {
            Pushed::Binary => &[origin, (HEADER_PUSHED, "1")],
            Pushed::Json => &[origin],
        };
        if let Err(e) = self.bus.publish(subject, headers, payload).await {
            telemetry::error("broadcast_publish");
            tracing::warn!(error = %e, "cannot relay broadcast");
        }
    }
}

/// A broadcast's `meta.id`, if it has one.
fn meta_id(b: &UserBroadcast) -> Option<Arc<str>> {
    #[derive(Deserialize)]
    struct Meta<'a> {
        #[serde(borrow)]
        id: Option<std::borrow::Cow<'a, str>>,
    }
    let meta: Meta<'_> = serde_json::from_str(b.meta.as_deref()?.get()).ok()?;
    Some(Arc::from(&*meta.id?))
}

fn encode_for(frame: &walcast_protocol::Frame, vsn: Vsn) -> Option<Out> {
    match frame.encode_server(vsn) {
        Ok(WireMessage::Text(t)) => Some(Out::text(&t)),
        Ok(WireMessage::Binary(b)) => Some(Out::binary(&b)),
        // Kind 4 cannot carry a topic or event over 255 bytes: fall back to text.
        Err(_) => frame.encode_text(vsn).ok().map(|t| Out::text(&t)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_and_envelopes_round_trip() {
        let b = UserBroadcast {
            event: "cur\nsor".into(),
            meta: None,
            body: BroadcastBody::Binary(Bytes::from_static(b"\n\x00\x01")),
        };
        for topic in [
            "realtime:room 1".to_string(),
            format!("realtime:{}", "é".repeat(1500)),
        ] {
            let key = TopicKey {
                project: "p.1".into(),
                private: true,
                topic,
            };
            let (subject, payload) = encode_message(&key, &b).unwrap();
            assert!(subject.len() < 300, "{subject}");
            assert_eq!(decode_message(&subject, &payload), Some((key, b.clone())));
        }
        let garbage = Bytes::from_static(b"garbage");
        assert!(decode_message("walcast.broadcast.p.public.x", &garbage).is_none());
    }
}
