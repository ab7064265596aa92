//! The broadcast REST API: `POST /realtime/v1/api/broadcast` (a batch) and
//! `POST /realtime/v1/api/broadcast/{topic}/events/{event}` (one message, raw body).
//!
//! Authorisation: the acting token (see [`crate::auth::credentials`]: `access_token`, else
//! `Authorization: Bearer …`, else the project key). Any valid token of the project may
//! broadcast to public channels (as anyone holding the anon key can through a socket);
//! to a private channel, a `service_role` token or one the app's INSERT policy on
//! `realtime.messages` allows ([`crate::auth::private`]); refused messages are dropped.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use walcast_protocol::message::TOPIC_PREFIX;
use walcast_protocol::{channel_name, BroadcastBody, UserBroadcast};

use super::{Broadcasts, Pushed};
use crate::auth::credentials::Credentials;
use crate::auth::private::Policies;
use crate::connection::TopicKey;
use crate::limits::usage::MessageRefused;
use crate::projects::Projects;
use crate::reply::error_response;
use crate::telemetry;

impl Broadcasts {
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

/// Authorise a REST broadcast: the acting token (see [`crate::auth::credentials`]), verified.
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
        Err(e) => Err((e.http_status(), e.to_string())),
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
pub(crate) async fn batch(
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
            crate::limits::usage::TOO_MANY_MESSAGES.to_string(),
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
pub(crate) async fn single(
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
