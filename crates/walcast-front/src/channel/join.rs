//! `phx_join`: open a channel — check the limits and the token, route the topic, subscribe
//! the `postgres_changes` bindings, answer (join reply, `system`, `presence_state`,
//! replayed broadcasts), keep the channel.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::Value;
use walcast_bus::admin::StoredBroadcast;
use walcast_protocol::message::TOPIC_PREFIX;
use walcast_protocol::server;
use walcast_protocol::{
    channel_name, BroadcastBody, Frame, JoinRequest, PgChangeBinding, RawValue, Replay,
    UserBroadcast, Vsn,
};

use super::{subscribed_message, Channel, Session};
use crate::auth::{AuthError, Verified};
use crate::outbound::{ChanOut, Out};
use crate::registration::Refused;
use crate::sink::SinkRef;
use crate::subscribe::{self, Subscribed};
use crate::telemetry;
use crate::topics::TopicKey;
use crate::usage::TooManyUsers;

pub(super) async fn apply(s: &mut Session, f: &Frame, req: JoinRequest) {
    let topic = f.topic.as_str();
    let Some(name) = topic.strip_prefix(TOPIC_PREFIX) else {
        telemetry::error("unmatched_topic");
        return s.reply_error(f, "unmatched topic");
    };
    if name.is_empty() {
        return join_error(s, f, "TopicNameRequired", "You must provide a topic name");
    }
    if let Err(label) = join_rate(s) {
        let (code, text) = JOIN_RATE;
        s.services.usage.refuse(&s.project, label, code, text);
        return join_error(s, f, code, text);
    }
    // A second join on a joined topic replaces the channel.
    if let Some(old) = s.channels.remove(topic) {
        let close = s.out(&server::phx_close(old.join_ref.as_deref(), topic));
        s.close_channel(old, close.into_iter().collect()).await;
    }
    if let Err((code, text)) = join_limits(s, req.config.postgres_changes.len()) {
        return join_error(s, f, code, &text);
    }
    let (token, auth) = match join_credentials(s, &req).await {
        Ok(v) => v,
        Err(e) => return join_error(s, f, e.code(), &e.to_string()),
    };
    if !req.config.private && s.services.projects.private_only(&s.project) {
        telemetry::error("private_only");
        let text = crate::projects::PRIVATE_ONLY_MESSAGE;
        let text = text.split_once(": ").map_or(text, |(_, t)| t);
        return join_error(s, f, "PrivateOnly", text);
    }
    let exp = auth.exp().unwrap_or(i64::MAX);
    let claims = Value::Object(auth.claims);
    if req.config.private && !may_read(s, f, name, &claims).await {
        return;
    }
    open_channel(s, f, req, token, exp, claims).await;
}

/// The socket's first channel makes it one of its project's connected users (until it
/// closes), within the project's limit across the fronts.
fn admit_user(s: &mut Session) -> Result<(), TooManyUsers> {
    if s.user.is_some() {
        return Ok(());
    }
    let slot = s.services.usage.admit(&s.project)?;
    s.handle.count_for(slot.counts().clone());
    s.user = Some(slot);
    Ok(())
}

fn join_error(s: &Session, f: &Frame, code: &str, text: &str) {
    metrics::counter!(telemetry::JOINS, "result" => "error").increment(1);
    s.reply_error(f, &server::error_reason(code, text));
}

/// A private channel's read check; `false` once the join was refused.
async fn may_read(s: &Session, f: &Frame, name: &str, claims: &Value) -> bool {
    match s
        .services
        .policies
        .may(&s.project, name, claims, false)
        .await
    {
        Ok(true) => true,
        Ok(false) => {
            join_error(s, f, "Unauthorized", &crate::private::read_refused(name));
            false
        }
        Err(e) => {
            join_error(s, f, "UnableToConnectToProject", &e.to_string());
            false
        }
    }
}

/// Why the bindings could not be subscribed (no leader answered): the reason its
/// source is not streaming, when known, else the registration's error `e`.
fn subscribe_error(s: &Session, e: String) -> String {
    super::ready::not_streaming(s).map_or(e, |(why, _)| {
        format!("Unable to subscribe to changes: {why}")
    })
}

/// Open the channel of an accepted join: route its topic and subscribe its bindings,
/// answer, keep it.
async fn open_channel(
    s: &mut Session,
    f: &Frame,
    req: JoinRequest,
    token: String,
    exp: i64,
    claims: Value,
) {
    let topic = f.topic.as_str();
    if let Err(e) = admit_user(s) {
        return join_error(s, f, TooManyUsers::CODE, &e.to_string());
    }
    let id = s.services.connections.next_id();
    let key = TopicKey {
        project: s.project.clone(),
        private: req.config.private,
        topic: topic.to_string(),
    };
    let out = Arc::new(ChanOut::new(
        id,
        s.handle.clone(),
        topic,
        s.vsn,
        req.config.broadcast.self_,
        req.config.presence.enabled,
        s.services.cfg.outbound_queue,
    ));
    let bindings = req.config.postgres_changes;
    let Subscribed { subs, refused } = match subscribe(s, &out, &key, &bindings, &claims).await {
        Ok(v) => v,
        Err(e) => return join_error(s, f, "UnableToSubscribe", &subscribe_error(s, e)),
    };
    let join_ref = f.join_ref.clone().or_else(|| f.ref_.clone());
    let presence = req.config.presence.enabled.then_some(&key);
    let mut first = first_frames(s, f, &bindings, &refused, presence).await;
    let (ready, ready_wait) = match req.config.broadcast.replication_ready {
        true => super::ready::at_join(s, join_ref.as_deref(), topic),
        false => (None, None),
    };
    first.extend(ready.and_then(|r| s.out(&r)));
    let mut replayed_ids = HashSet::new();
    if let Some(replay) = req.config.broadcast.replay.filter(|_| key.private) {
        let (frames, ids) = replayed(s, &key, replay).await;
        first.extend(frames);
        replayed_ids = ids;
    }
    out.open(first, replayed_ids);
    metrics::counter!(telemetry::JOINS, "result" => "ok").increment(1);
    s.services.connections.channel_joined();
    if let Some(u) = &s.user {
        u.counts().joins.fetch_add(1, Ordering::Relaxed);
        u.counts().channels.fetch_add(1, Ordering::Relaxed);
    }
    let presence_key = match req.config.presence.key.as_str() {
        "" => uuid_v4(),
        k => k.to_string(),
    };
    let channel = Channel {
        id,
        join_ref,
        claims: key.private.then_some(claims),
        key,
        out,
        has_bindings: !bindings.is_empty(),
        subs,
        token,
        exp,
        check_at: s.check_at(exp),
        presence_key,
        tracked: false,
        ack: req.config.broadcast.ack,
        may_write: None,
        ready_wait,
    };
    s.channels.insert(topic.to_string(), Box::new(channel));
}

/// What a joined channel says first: the join reply, the `system` message of its
/// bindings (subscribed, or the refusals), and the `presence_state` if presence is on.
async fn first_frames(
    s: &Session,
    f: &Frame,
    bindings: &[PgChangeBinding],
    refused: &Refused,
    presence: Option<&TopicKey>,
) -> Vec<Out> {
    let (topic, join_ref) = (
        f.topic.as_str(),
        f.join_ref.as_deref().or(f.ref_.as_deref()),
    );
    let reply = server::join_reply_ok(f.join_ref.as_deref(), f.ref_.as_deref(), topic, bindings);
    let mut first: Vec<Out> = s.out(&reply).into_iter().collect();
    if !bindings.is_empty() {
        first.extend(s.out(&subscribed_message(join_ref, topic, refused)));
        let failing = super::ready::failing_source_message(s, join_ref, topic);
        first.extend(failing.and_then(|m| s.out(&m)));
    }
    if let Some(key) = presence {
        let metas = s.services.presence.list(key.clone()).await;
        let state = crate::presence::presence_map(&metas);
        first.extend(s.out(&server::presence_state(join_ref, topic, &state)));
    }
    first
}

/// A private channel's stored broadcasts since the replay's start, as broadcasts with
/// `meta: {id, replayed: true}`, and their ids (none if the worker cannot be asked:
/// logged).
async fn replayed(s: &Session, key: &TopicKey, replay: Replay) -> (Vec<Out>, HashSet<String>) {
    let Some(admin) = s.services.projects.admin() else {
        return Default::default();
    };
    let Some(source) = s.services.projects.source_of(&key.project) else {
        telemetry::error("replay");
        tracing::warn!(project = %key.project, "broadcast replay of an unknown project");
        return Default::default();
    };
    let name = channel_name(&key.topic);
    let timeout = s.services.cfg.register_timeout;
    let asked = admin.replay(
        &source,
        &key.project,
        name,
        replay.since_ms,
        replay.limit,
        timeout,
    );
    let messages = match asked.await {
        Ok(m) => m,
        Err(e) => {
            telemetry::error("replay");
            tracing::warn!(error = %e, topic = %key.topic, "broadcast replay failed");
            return Default::default();
        }
    };
    let ids = messages.iter().map(|m| m.id.clone()).collect();
    let frames = messages
        .into_iter()
        .filter_map(|m| replayed_frame(s, &key.topic, m))
        .collect();
    (frames, ids)
}

/// One replayed broadcast for this socket. A binary one (`realtime.send_binary`) goes as
/// kind 4 with the binary payload encoding; a socket of vsn 1.0.0 cannot carry bytes and
/// is sent nothing for it, as Supabase does (its id is still replayed: the live copy
/// would not reach it either).
fn replayed_frame(s: &Session, topic: &str, m: StoredBroadcast) -> Option<Out> {
    let body = match m.binary {
        Some(_) if s.vsn == Vsn::V1 => return None,
        Some(bytes) => BroadcastBody::Binary(bytes.into()),
        None => BroadcastBody::Json(RawValue::from_string(m.payload).ok()?),
    };
    let meta = serde_json::json!({ "id": m.id, "replayed": true }).to_string();
    let b = UserBroadcast {
        event: m.event,
        meta: RawValue::from_string(meta).ok(),
        body,
    };
    s.out(&server::broadcast(topic, b))
}

/// Supabase's code and text for a join over the socket's or the project's joins/s.
const JOIN_RATE: (&str, &str) = ("ClientJoinRateLimitReached", "Too many joins per second");

/// The socket's joins per second, then its project's across the fronts; `Err`: the
/// `walcast_limits_total` kind of the limit reached.
fn join_rate(s: &mut Session) -> Result<(), &'static str> {
    if !s.joins.take() {
        return Err("join_rate");
    }
    let usage = &s.services.usage;
    match usage.take(&s.project, &[(crate::rates::Rate::Joins, 1)]) {
        Ok(()) => Ok(()),
        Err(_) => Err("project_joins"),
    }
}

/// The socket's channel limit (its project's `max_channels_per_client`) and the
/// channel's binding limit.
fn join_limits(s: &Session, bindings: usize) -> Result<(), (&'static str, String)> {
    let cfg = &s.services.cfg;
    let max_channels = s.services.usage.quotas(&s.project).channels_per_client;
    if s.channels.len() as u64 >= max_channels {
        let (code, text) = ("ChannelRateLimitReached", "Too many channels");
        s.services.usage.refuse(&s.project, "channels", code, text);
        return Err((code, text.to_string()));
    }
    if bindings > cfg.max_bindings_per_channel {
        telemetry::limit("bindings");
        let text = format!(
            "Too many postgres_changes bindings (max {} per channel)",
            cfg.max_bindings_per_channel
        );
        return Err(("TooManyBindings", text));
    }
    Ok(())
}

/// The join's token (its `access_token`, else the socket's: see
/// [`crate::credentials`]), verified as the subscriber of its bindings.
async fn join_credentials(s: &Session, req: &JoinRequest) -> Result<(String, Verified), AuthError> {
    let token = s
        .creds
        .token_for_join(req.access_token.as_deref())
        .unwrap_or_default();
    let bindings = &req.config.postgres_changes;
    let projects = &s.services.projects;
    let auth = subscribe::verify_subscriber(projects, &s.project, &token, bindings).await?;
    Ok((token, auth))
}

/// Route the topic's broadcasts and the bindings' changes to `out`; `Err` leaves
/// nothing behind.
async fn subscribe(
    s: &Session,
    out: &Arc<ChanOut>,
    key: &TopicKey,
    bindings: &[PgChangeBinding],
    claims: &Value,
) -> Result<Subscribed, String> {
    let topics = &s.services.delivery.topics;
    topics.add(key, out.clone());
    let sink: SinkRef = out.clone();
    let registrar = &s.services.registrar;
    let result = subscribe::subscribe(registrar, &s.project, bindings, claims, sink).await;
    if result.is_err() {
        out.close(Vec::new());
        topics.remove(key, out.id);
    }
    result
}

fn uuid_v4() -> String {
    let b: [u8; 16] = rand::random();
    let h =
        |r: std::ops::Range<usize>| -> String { b[r].iter().map(|x| format!("{x:02x}")).collect() };
    let mut s = format!("{}-{}-4{}-", h(0..4), h(4..6), &h(6..8)[1..]);
    s.push_str(&format!("{:x}", 8 | (b[8] & 3)));
    s.push_str(&h(8..10)[1..]);
    s.push('-');
    s.push_str(&h(10..16));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_shape() {
        let u = uuid_v4();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert!(u.chars().filter(|c| *c == '-').count() == 4);
    }
}
