//! `phx_join`: open a channel — check the limits and the token, route the topic, subscribe
//! the `postgres_changes` bindings, answer (join reply, `system`, `presence_state`,
//! replayed broadcasts), keep the channel.
//!
//! What the socket's own state decides (the topic, the join rates, the channel limit) is
//! checked at once. The rest may wait for the cdc-worker (a private channel's check, the
//! registration, a replay), so it runs as a join in flight ([`super::pending`]) on a
//! [`Joiner`] — what it needs of the socket, owned — beside the socket's other frames;
//! its channel joins the connection's channels once it is answered.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::Value;
use walcast_bus::admin::StoredBroadcast;
use walcast_protocol::message::TOPIC_PREFIX;
use walcast_protocol::server;
use walcast_protocol::{
    channel_name, BroadcastBody, Frame, JoinRequest, Payload, PgChangeBinding, RawValue, Replay,
    UserBroadcast, Vsn,
};

use super::pending::{Answer, Done};
use super::{subscribed_message, Channel, Channels, Services};
use crate::connection::topics::TopicKey;
use crate::connection::{ChanOut, ConnHandle, Out};
use crate::limits::usage::{TooManyUsers, UserSlot};
use crate::subscription::registration::Refused;
use crate::subscription::sink::SinkRef;
use crate::subscription::subscribe::{self, Subscribed};
use crate::telemetry;

pub(super) async fn apply(s: &mut Channels, f: Frame, req: JoinRequest) {
    let topic = f.topic.as_str();
    let Some(name) = topic.strip_prefix(TOPIC_PREFIX) else {
        telemetry::error("unmatched_topic");
        return s.reply_error(&f, "unmatched topic");
    };
    if name.is_empty() {
        let text = "You must provide a topic name";
        return join_error(&s.handle, s.vsn, &f, "TopicNameRequired", text);
    }
    if let Err(label) = join_rate(s) {
        let (code, text) = JOIN_RATE;
        s.services.usage.refuse(&s.project, label, code, text);
        return join_error(&s.handle, s.vsn, &f, code, text);
    }
    // A second join on a joined topic replaces the channel.
    if let Some(old) = s.channels.remove(topic) {
        let close = s.out(&server::phx_close(old.join_ref.as_deref(), topic));
        s.close_channel(old, close.into_iter().collect()).await;
    }
    if let Err((code, text)) = join_limits(s, req.config.postgres_changes.len()) {
        return join_error(&s.handle, s.vsn, &f, code, &text);
    }
    let joiner = Joiner {
        services: s.services.clone(),
        handle: s.handle.clone(),
        vsn: s.vsn,
        project: s.project.clone(),
        token: s
            .creds
            .token_for_join(req.access_token.as_deref())
            .unwrap_or_default(),
    };
    // The join keeps the frame's refs and topic, not its payload (parsed into `req`).
    let f = Frame {
        payload: Payload::empty(),
        ..f
    };
    let topic = f.topic.clone();
    // Most joins need nothing from the worker (no bindings, or a class this front
    // receives already) and are answered here, in the order they came.
    s.run(topic, true, Box::pin(joiner.run(f, req))).await;
}

/// What a join in flight needs of its socket, owned: it runs beside the socket's other
/// frames, and its channel joins the connection's channels once answered.
pub(super) struct Joiner {
    services: Arc<Services>,
    handle: Arc<ConnHandle>,
    vsn: Vsn,
    project: String,
    /// The join's token: its `access_token`, else the socket's (see [`crate::auth::credentials`]).
    token: String,
}

impl Joiner {
    async fn run(self, f: Frame, req: JoinRequest) -> Done {
        let mut user = None;
        let channel = self.checked(&f, req, &mut user).await;
        Done {
            topic: f.topic,
            answer: Answer::Join { channel, user },
        }
    }

    /// The join's credentials and checks, then its channel; `None` once refused (and
    /// answered). `user`: the socket's slot as a user of its project, if this join
    /// admitted it.
    async fn checked(
        &self,
        f: &Frame,
        req: JoinRequest,
        user: &mut Option<UserSlot>,
    ) -> Option<Box<Channel>> {
        let projects = &self.services.projects;
        let bindings = &req.config.postgres_changes;
        let verified =
            subscribe::verify_subscriber(projects, &self.project, &self.token, bindings).await;
        let auth = match verified {
            Ok(v) => v,
            Err(e) => return self.refuse(f, e.code(), &e.to_string()),
        };
        if !req.config.private && projects.private_only(&self.project) {
            telemetry::error("private_only");
            let text = crate::projects::PRIVATE_ONLY_MESSAGE;
            let text = text.split_once(": ").map_or(text, |(_, t)| t);
            return self.refuse(f, "PrivateOnly", text);
        }
        let exp = auth.exp().unwrap_or(i64::MAX);
        let claims = Value::Object(auth.claims);
        if req.config.private && !self.may_read(f, &claims).await {
            return None;
        }
        *user = match self.admit_user() {
            Ok(slot) => slot,
            Err(e) => return self.refuse(f, TooManyUsers::CODE, &e.to_string()),
        };
        self.open_channel(f, req, exp, claims).await
    }

    /// The socket's first channel makes it one of its project's connected users (until
    /// it closes), within the project's limit across the fronts. The joins of a socket
    /// run on its task, so no two admit it.
    fn admit_user(&self) -> Result<Option<UserSlot>, TooManyUsers> {
        if self.handle.usage().is_some() {
            return Ok(None);
        }
        let slot = self.services.usage.admit(&self.project)?;
        self.handle.count_for(slot.counts().clone());
        Ok(Some(slot))
    }

    /// Refuse the join (answered with `code: text`); `None`, the channel it does not open.
    fn refuse(&self, f: &Frame, code: &str, text: &str) -> Option<Box<Channel>> {
        join_error(&self.handle, self.vsn, f, code, text);
        None
    }

    fn out(&self, f: &Frame) -> Option<Out> {
        Out::frame(f, self.vsn)
    }

    /// A private channel's read check; `false` once the join was refused.
    async fn may_read(&self, f: &Frame, claims: &Value) -> bool {
        let name = channel_name(&f.topic);
        let policies = &self.services.policies;
        match policies.may(&self.project, name, claims, false).await {
            Ok(true) => true,
            Ok(false) => {
                self.refuse(f, "Unauthorized", &crate::auth::private::read_refused(name));
                false
            }
            Err(e) => {
                self.refuse(f, "UnableToConnectToProject", &e.to_string());
                false
            }
        }
    }

    /// Why the bindings could not be subscribed (no leader answered): the reason its
    /// source is not streaming, when known, else the registration's error `e`.
    fn subscribe_error(&self, e: String) -> String {
        super::ready::not_streaming(&self.services, &self.project).map_or(e, |(why, _)| {
            format!("Unable to subscribe to changes: {why}")
        })
    }

    /// Open the channel of an accepted join: route its topic and subscribe its bindings,
    /// answer.
    async fn open_channel(
        &self,
        f: &Frame,
        req: JoinRequest,
        exp: i64,
        claims: Value,
    ) -> Option<Box<Channel>> {
        let topic = f.topic.as_str();
        let sv = &self.services;
        let id = sv.connections.next_id();
        let key = TopicKey {
            project: self.project.clone(),
            private: req.config.private,
            topic: topic.to_string(),
        };
        let out = Arc::new(ChanOut::new(
            id,
            self.handle.clone(),
            topic,
            self.vsn,
            req.config.broadcast.self_,
            req.config.presence.enabled,
            sv.cfg.outbound_queue,
        ));
        let bindings = &req.config.postgres_changes;
        let Subscribed { subs, refused } = match self.subscribe(&out, &key, bindings, &claims).await
        {
            Ok(v) => v,
            Err(e) => return self.refuse(f, "UnableToSubscribe", &self.subscribe_error(e)),
        };
        let join_ref = f.join_ref.clone().or_else(|| f.ref_.clone());
        let presence = req.config.presence.enabled.then_some(&key);
        let mut first = self.first_frames(f, bindings, &refused, presence).await;
        let (ready, ready_wait) = match req.config.broadcast.replication_ready {
            true => super::ready::at_join(sv, &self.project, join_ref.as_deref(), topic),
            false => (None, None),
        };
        first.extend(ready.and_then(|r| self.out(&r)));
        let mut replayed_ids = HashSet::new();
        if let Some(replay) = req.config.broadcast.replay.filter(|_| key.private) {
            let (frames, ids) = self.replayed(&key, replay).await;
            first.extend(frames);
            replayed_ids = ids;
        }
        out.open(first, replayed_ids);
        metrics::counter!(telemetry::JOINS, "result" => "ok").increment(1);
        let presence_key = match req.config.presence.key.as_str() {
            "" => uuid_v4(),
            k => k.to_string(),
        };
        Some(Box::new(Channel {
            id,
            join_ref,
            claims: key.private.then_some(claims),
            key,
            out,
            has_bindings: !bindings.is_empty(),
            subs,
            token: self.token.clone(),
            exp,
            check_at: super::check_at(&sv.cfg, exp),
            presence_key,
            tracked: false,
            ack: req.config.broadcast.ack,
            may_write: None,
            ready_wait,
        }))
    }

    /// What a joined channel says first: the join reply, the `system` message of its
    /// bindings (subscribed, or the refusals), and the `presence_state` if presence is on.
    async fn first_frames(
        &self,
        f: &Frame,
        bindings: &[PgChangeBinding],
        refused: &Refused,
        presence: Option<&TopicKey>,
    ) -> Vec<Out> {
        let (topic, join_ref) = (
            f.topic.as_str(),
            f.join_ref.as_deref().or(f.ref_.as_deref()),
        );
        let reply =
            server::join_reply_ok(f.join_ref.as_deref(), f.ref_.as_deref(), topic, bindings);
        let mut first: Vec<Out> = self.out(&reply).into_iter().collect();
        if !bindings.is_empty() {
            first.extend(self.out(&subscribed_message(join_ref, topic, refused)));
            let sv = &self.services;
            let failing = super::ready::failing_source_message(sv, &self.project, join_ref, topic);
            first.extend(failing.and_then(|m| self.out(&m)));
        }
        if let Some(key) = presence {
            let metas = self.services.presence.list(key.clone()).await;
            let state = crate::presence::presence_map(&metas);
            first.extend(self.out(&server::presence_state(join_ref, topic, &state)));
        }
        first
    }

    /// A private channel's stored broadcasts since the replay's start, as broadcasts with
    /// `meta: {id, replayed: true}`, and their ids (none if the worker cannot be asked:
    /// logged).
    async fn replayed(&self, key: &TopicKey, replay: Replay) -> (Vec<Out>, HashSet<String>) {
        let projects = &self.services.projects;
        let Some(admin) = projects.admin() else {
            return Default::default();
        };
        let Some(source) = projects.source_of(&key.project) else {
            telemetry::error("replay");
            tracing::warn!(project = %key.project, "broadcast replay of an unknown project");
            return Default::default();
        };
        let name = channel_name(&key.topic);
        let timeout = self.services.cfg.register_timeout;
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
            .filter_map(|m| self.replayed_frame(&key.topic, m))
            .collect();
        (frames, ids)
    }

    /// One replayed broadcast for this socket. A binary one (`realtime.send_binary`) goes
    /// as kind 4 with the binary payload encoding; a socket of vsn 1.0.0 cannot carry
    /// bytes and is sent nothing for it, as Supabase does (its id is still replayed: the
    /// live copy would not reach it either).
    fn replayed_frame(&self, topic: &str, m: StoredBroadcast) -> Option<Out> {
        let body = match m.binary {
            Some(_) if self.vsn == Vsn::V1 => return None,
            Some(bytes) => BroadcastBody::Binary(bytes.into()),
            None => BroadcastBody::Json(RawValue::from_string(m.payload).ok()?),
        };
        let meta = serde_json::json!({ "id": m.id, "replayed": true }).to_string();
        let b = UserBroadcast {
            event: m.event,
            meta: RawValue::from_string(meta).ok(),
            body,
        };
        self.out(&server::broadcast(topic, b))
    }

    /// Route the topic's broadcasts and the bindings' changes to `out`; `Err` leaves
    /// nothing behind.
    async fn subscribe(
        &self,
        out: &Arc<ChanOut>,
        key: &TopicKey,
        bindings: &[PgChangeBinding],
        claims: &Value,
    ) -> Result<Subscribed, String> {
        let topics = &self.services.topics;
        topics.add(key, out.clone());
        let sink: SinkRef = out.clone();
        let registration = &self.services.registration;
        let result =
            subscribe::subscribe(registration, &self.project, bindings, claims, sink).await;
        if result.is_err() {
            out.close(Vec::new());
            topics.remove(key, out.id);
        }
        result
    }
}

fn join_error(handle: &ConnHandle, vsn: Vsn, f: &Frame, code: &str, text: &str) {
    metrics::counter!(telemetry::JOINS, "result" => "error").increment(1);
    let reason = server::error_reason(code, text);
    let reply = server::reply_error(f.join_ref.as_deref(), f.ref_.as_deref(), &f.topic, &reason);
    handle.push_frame(&reply, vsn);
}

/// Supabase's code and text for a join over the socket's or the project's joins/s.
const JOIN_RATE: (&str, &str) = ("ClientJoinRateLimitReached", "Too many joins per second");

/// The socket's joins per second, then its project's across the fronts; `Err`: the
/// `walcast_limits_total` kind of the limit reached.
fn join_rate(s: &mut Channels) -> Result<(), &'static str> {
    if !s.joins.take() {
        return Err("join_rate");
    }
    let usage = &s.services.usage;
    match usage.take(&s.project, &[(crate::limits::rates::Rate::Joins, 1)]) {
        Ok(()) => Ok(()),
        Err(_) => Err("project_joins"),
    }
}

/// The socket's channel limit (its project's `max_channels_per_client`; joins in flight
/// count, so they are bounded by it too) and the channel's binding limit.
fn join_limits(s: &Channels, bindings: usize) -> Result<(), (&'static str, String)> {
    let cfg = &s.services.cfg;
    let max_channels = s.services.usage.quotas(&s.project).channels_per_client;
    if (s.channels.len() + s.pending.joins()) as u64 >= max_channels {
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
