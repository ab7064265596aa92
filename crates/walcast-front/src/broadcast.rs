//! Broadcast: local delivery, relay between fronts over the bus, and the REST API.
//!
//! A broadcast is delivered directly to this front's channels of the topic and published
//! on the bus (subject and envelope: [`walcast_bus::broadcast`]) with header
//! `Walcast-Origin` = this front's id. Every front relays the messages of the others (and
//! the database's, sent by the cdc-worker) to its own channels and drops its own echo.
//!
//! REST authorisation: the acting token (see [`crate::credentials`]: `access_token`, else
//! `Authorization: Bearer …`, else the project key). Any valid token of the project may
//! broadcast to public channels (as anyone holding the anon key can through a socket);
//! to a private channel, a `service_role` token or one the app's INSERT policy on
//! `realtime.messages` allows ([`crate::private`]); refused messages are dropped.
//!
//! [`Broadcasts`] owns what this takes: the bus, this front's channels by topic (through
//! [`Delivery`]) and the policies of private topics.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio_util::sync::CancellationToken;
use walcast_bus::broadcast::{BroadcastTarget, Envelope};
use walcast_bus::source::HEADER_SOURCE;
use walcast_bus::{Bus, BusMessage, Subscription, HEADER_ORIGIN, HEADER_PUSHED, HEADER_TERM};
use walcast_protocol::message::TOPIC_PREFIX;
use walcast_protocol::{channel_name, server, BroadcastBody, UserBroadcast, Vsn, WireMessage};

use crate::credentials::Credentials;
use crate::delivery::Delivery;
use crate::guards::TermGuard;
use crate::listen::next_message;
use crate::outbound::Out;
use crate::private::Policies;
use crate::projects::Projects;
use crate::rates::Rate;
use crate::reply::{auth_status, error_response};
use crate::telemetry;
use crate::topics::TopicKey;
use crate::usage::{MessageRefused, Usage};

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
    delivery: Arc<Delivery>,
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
        delivery: Arc<Delivery>,
        (policies, projects): (Policies, Projects),
        max_frame_bytes: usize,
        usage: Arc<Usage>,
    ) -> Broadcasts {
        Broadcasts {
            front_id,
            bus,
            delivery,
            projects,
            policies,
            max_frame_bytes,
            usage,
        }
    }

    /// Deliver to this front's channels of the topic (except channel `except`), framed as
    /// Supabase frames it ([`Pushed`]).
    fn deliver_local(&self, key: &TopicKey, b: &UserBroadcast, how: Pushed, except: Option<u64>) {
        let members = self.delivery.topics.members(key);
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

    /// May a REST message of `size` bytes go to a topic of `project`? Not to a public one
    /// of a private-only project (403); not over the frame limit or the project's payload
    /// limit (413). (Nothing is counted: see [`Self::rest_rate`].)
    fn rest_refusal(
        &self,
        project: &str,
        private: bool,
        size: usize,
    ) -> Option<(StatusCode, String)> {
        if !private && self.projects.private_only(project) {
            telemetry::error("private_only");
            let text = crate::projects::PRIVATE_ONLY_MESSAGE;
            return Some((StatusCode::FORBIDDEN, text.to_string()));
        }
        if size > self.max_frame_bytes {
            return Some((StatusCode::PAYLOAD_TOO_LARGE, "payload too large".into()));
        }
        match self.usage.check_payload(project, size) {
            Ok(()) => None,
            Err(e) => Some(refusal(e)),
        }
    }

    /// May `count` REST messages of `bytes` in all go now, within the project's messages/s
    /// and bytes/s (429 if not)? Counted if so.
    fn rest_rate(&self, project: &str, count: usize, bytes: usize) -> Option<(StatusCode, String)> {
        self.usage
            .take_messages(project, count as u64, bytes as u64)
            .err()
            .map(refusal)
    }

    /// `leader`: the source whose leader published it (a database broadcast), `None`
    /// for another front's.
    fn relay_one(&self, msg: &BusMessage, leader: Option<&str>) {
        if msg.header(HEADER_ORIGIN) == Some(self.front_id.as_str()) {
            return;
        }
        let Some((key, b)) = decode_message(&msg.subject, &msg.payload) else {
            telemetry::error("bad_broadcast_relay");
            return;
        };
        // A source's database speaks only for the projects on that source.
        if let Some(source) = leader {
            if !crate::fanout::from_its_source(&self.projects, source, &key.project) {
                return;
            }
        }
        metrics::counter!(telemetry::BROADCASTS, "source" => "bus").increment(1);
        let how = match msg.header(HEADER_PUSHED) {
            Some(_) => Pushed::Binary,
            None => Pushed::Json,
        };
        self.deliver_local(&key, &b, how, None);
    }
}

/// Relay the other fronts' broadcasts, and the leaders' database broadcasts, to local
/// channels. A database broadcast carries its leader's term and source: one of a term
/// older than the newest seen of that source (a frozen leader's late message) is
/// dropped, as changes are, and so is one of a project not on that source.
pub(crate) async fn relay_loop(
    broadcasts: Arc<Broadcasts>,
    mut sub: Subscription,
    cancel: CancellationToken,
) {
    let mut terms = TermGuard::default();
    while let Some(msg) = next_message(&mut sub, &cancel, "broadcast relay").await {
        // Only a leader's messages carry a term (and, but for the default, a source).
        let leader = msg
            .header(HEADER_TERM)
            .map(|_| walcast_bus::source::of_header(msg.header(HEADER_SOURCE)));
        let source = leader.unwrap_or(walcast_bus::source::DEFAULT_SOURCE);
        if terms.admit(source, msg.header(HEADER_TERM), std::time::Instant::now()) {
            broadcasts.relay_one(&msg, leader);
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

/// Who sends a REST broadcast.
struct RestSender {
    project: String,
    claims: serde_json::Value,
    /// Private topics already judged in this request.
    judged: HashMap<String, bool>,
}

impl RestSender {
    /// May it send to `topic`? Public topics: yes; private ones: a `service_role` token,
    /// or the app's INSERT policy on `realtime.messages` (asked once per topic).
    async fn may_send(&mut self, policies: &Policies, private: bool, topic: &str) -> bool {
        if !private || self.claims["role"] == "service_role" {
            return true;
        }
        let name = channel_name(topic).to_string();
        if let Some(known) = self.judged.get(&name) {
            return *known;
        }
        let asked = policies.may(&self.project, &name, &self.claims, true).await;
        let allowed = asked.unwrap_or(false);
        self.judged.insert(name, allowed);
        allowed
    }
}

/// Authorise a REST broadcast: the acting token (see [`crate::credentials`]), verified.
async fn rest_auth(
    projects: &Projects,
    headers: &HeaderMap,
    query: &HashMap<String, String>,
) -> Result<RestSender, (StatusCode, String)> {
    let creds = Credentials::from_request(query, headers);
    let token = creds.token().unwrap_or("");
    match projects.verify(token).await {
        Ok(v) => Ok(RestSender {
            project: v.project,
            claims: serde_json::Value::Object(v.claims),
            judged: HashMap::new(),
        }),
        Err(e) => Err((auth_status(&e), e.to_string())),
    }
}

#[derive(Deserialize)]
struct Batch {
    messages: Vec<RestMessage>,
}

#[derive(Deserialize)]
struct RestMessage {
    topic: String,
    event: String,
    #[serde(default)]
    payload: Option<Box<RawValue>>,
    #[serde(default)]
    private: Option<bool>,
    /// Becomes the broadcast's `meta.id`.
    #[serde(default)]
    id: Option<String>,
}

/// Messages one REST broadcast request may carry.
pub(crate) const MAX_REST_MESSAGES: usize = 1000;
/// Distinct private topics one REST request may send to without a `service_role` token:
/// each is a policy check on the worker, shared by every front.
pub(crate) const MAX_REST_PRIVATE_TOPICS: usize = 20;

/// `POST /realtime/v1/api/broadcast` with `{"messages":[{topic,event,payload,private}]}`.
pub(crate) async fn rest_batch(
    State(bc): State<Arc<Broadcasts>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut sender = match rest_auth(&bc.projects, &headers, &query).await {
        Ok(a) => a,
        Err((status, msg)) => return error_response(status, &msg),
    };
    let batch: Batch = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return error_response(StatusCode::BAD_REQUEST, &format!("invalid body: {e}"));
        }
    };
    if let Err(why) = bounded(&batch, &sender) {
        crate::telemetry::limit("rest_broadcast");
        return error_response(StatusCode::PAYLOAD_TOO_LARGE, &why);
    }
    // The whole request is refused (nothing sent, nothing counted) or taken in whole.
    let mut total = 0;
    for m in &batch.messages {
        let size = m.payload.as_ref().map_or(2, |p| p.get().len());
        let private = m.private.unwrap_or(false);
        if let Some((status, why)) = bc.rest_refusal(&sender.project, private, size) {
            return error_response(status, &why);
        }
        total += size;
    }
    let count = batch.messages.len();
    if let Some((status, why)) = bc.rest_rate(&sender.project, count, total) {
        return error_response(status, &why);
    }
    let mut out = Vec::with_capacity(count);
    for m in batch.messages {
        let private = m.private.unwrap_or(false);
        let payload = m.payload.unwrap_or_else(empty_object);
        if !sender.may_send(&bc.policies, private, &m.topic).await {
            // Dropped, as Supabase drops what the policies refuse (the reply stays 202).
            continue;
        }
        let meta = m
            .id
            .and_then(|id| RawValue::from_string(serde_json::json!({ "id": id }).to_string()).ok());
        out.push((
            rest_key(&sender.project, private, &m.topic),
            UserBroadcast {
                event: m.event,
                meta,
                body: BroadcastBody::Json(payload),
            },
        ));
    }
    for (key, b) in out {
        metrics::counter!(telemetry::BROADCASTS, "source" => "rest").increment(1);
        bc.send(&key, &b, Pushed::Json, None).await;
    }
    StatusCode::ACCEPTED.into_response()
}

/// The HTTP answer to a message refused by its project's limits.
fn refusal(e: MessageRefused) -> (StatusCode, String) {
    match e {
        MessageRefused::TooLarge { size, max } => (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("Payload size exceeded: {size} bytes, at most {max}"),
        ),
        MessageRefused::OverRate(_) => (
            StatusCode::TOO_MANY_REQUESTS,
            crate::usage::TOO_MANY_MESSAGES.to_string(),
        ),
    }
}

/// `{}` as a raw JSON value.
fn empty_object() -> Box<RawValue> {
    serde_json::value::to_raw_value(&serde_json::Map::new())
        .unwrap_or_else(|_| RawValue::NULL.to_owned())
}

/// A request's size in messages and in private topics to judge (see the constants).
fn bounded(batch: &Batch, sender: &RestSender) -> Result<(), String> {
    if batch.messages.len() > MAX_REST_MESSAGES {
        return Err(format!(
            "too many messages: at most {MAX_REST_MESSAGES} per request"
        ));
    }
    if sender.claims["role"] == "service_role" {
        return Ok(());
    }
    let private: std::collections::HashSet<&str> = batch
        .messages
        .iter()
        .filter(|m| m.private.unwrap_or(false))
        .map(|m| channel_name(&m.topic))
        .collect();
    if private.len() > MAX_REST_PRIVATE_TOPICS {
        return Err(format!(
            "too many private topics: at most {MAX_REST_PRIVATE_TOPICS} per request"
        ));
    }
    Ok(())
}

fn rest_key(project: &str, private: bool, topic: &str) -> TopicKey {
    let name = topic.strip_prefix(TOPIC_PREFIX).unwrap_or(topic);
    TopicKey {
        project: project.to_string(),
        private,
        topic: format!("{TOPIC_PREFIX}{name}"),
    }
}

/// `POST /realtime/v1/api/broadcast/<topic>/events/<event>[?private=true]`, raw body.
pub(crate) async fn rest_single(
    State(bc): State<Arc<Broadcasts>>,
    Path((topic, event)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut sender = match rest_auth(&bc.projects, &headers, &query).await {
        Ok(a) => a,
        Err((status, msg)) => return error_response(status, &msg),
    };
    let private = query.get("private").map(String::as_str) == Some("true");
    let refused = bc.rest_refusal(&sender.project, private, body.len());
    if let Some((status, why)) = refused.or_else(|| bc.rest_rate(&sender.project, 1, body.len())) {
        return error_response(status, &why);
    }
    if !sender.may_send(&bc.policies, private, &topic).await {
        return StatusCode::ACCEPTED.into_response();
    }
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let as_json = if ctype.contains("json") || ctype.is_empty() {
        std::str::from_utf8(&body)
            .ok()
            .and_then(|t| RawValue::from_string(t.to_string()).ok())
    } else {
        None
    };
    let body = match as_json {
        Some(j) => BroadcastBody::Json(j),
        None if ctype.contains("json") => {
            return error_response(StatusCode::BAD_REQUEST, "body is not valid JSON");
        }
        None => BroadcastBody::Binary(body),
    };
    let key = rest_key(&sender.project, private, &topic);
    metrics::counter!(telemetry::BROADCASTS, "source" => "rest").increment(1);
    let b = UserBroadcast {
        event,
        meta: None,
        body,
    };
    bc.send(&key, &b, Pushed::Json, None).await;
    StatusCode::ACCEPTED.into_response()
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
