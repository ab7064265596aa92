//! Channel lifecycle on one connection: join, leave, token refresh and expiry,
//! broadcast and presence pushes.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::Value;
use tokio::time::{Duration, Instant};
use walcast_protocol::message::{events, TOPIC_PREFIX};
use walcast_protocol::server::{self, SystemStatus};
use walcast_protocol::{
    channel_name, BroadcastBody, BroadcastPush, ClientMessage, Frame, JoinRequest, MessageError,
    PgChangeBinding, PresenceAction, RawValue, Replay, UserBroadcast,
};

use crate::auth::{now_secs, AuthError, Verified};
use crate::conn::Conn;
use crate::outbound::{ChanOut, Out};
use crate::registration;
use crate::sink::SinkRef;
use crate::subscribe::{self, Subscribed};
use crate::telemetry;
use crate::topics::TopicKey;
use crate::{broadcast, presence, private};

/// `system` message after a successful subscription.
pub const SUBSCRIBED: &str = "Subscribed to PostgreSQL";

pub(crate) struct Channel {
    pub id: u64,
    pub join_ref: Option<String>,
    pub key: TopicKey,
    pub out: Arc<ChanOut>,
    pub bindings: Vec<PgChangeBinding>,
    /// Registry numbers of the accepted subscriptions.
    pub subs: Vec<u64>,
    pub token: String,
    pub exp: i64,
    pub check_at: Instant,
    pub presence_key: String,
    pub tracked: bool,
    pub ack: bool,
    /// The subscriber's claims (a private channel's write check needs them).
    pub claims: Value,
    /// Private channel: whether it may send (asked at its first send).
    pub may_write: Option<bool>,
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

impl Conn {
    fn push(&self, f: &Frame) {
        self.handle.push_frame(f, self.vsn);
    }

    fn out(&self, f: &Frame) -> Option<Out> {
        Out::frame(f, self.vsn)
    }

    fn reply_error(&self, f: &Frame, reason: &str) {
        self.push(&server::reply_error(
            f.join_ref.as_deref(),
            f.ref_.as_deref(),
            &f.topic,
            reason,
        ));
    }

    fn reply_ok(&self, f: &Frame) {
        self.push(&server::reply_ok(
            f.join_ref.as_deref(),
            f.ref_.as_deref(),
            &f.topic,
            None,
        ));
    }

    fn check_at(&self, exp: i64) -> Instant {
        let left = Duration::from_secs(exp.saturating_sub(now_secs()).max(0) as u64);
        Instant::now() + left.min(self.shared.cfg.token_check_interval)
    }

    pub(crate) async fn on_frame(&mut self, f: Frame) {
        let msg = ClientMessage::parse(&f);
        match msg {
            Ok(ClientMessage::Heartbeat) => self.reply_ok(&f),
            Ok(ClientMessage::Join(j)) => self.join(&f, j).await,
            Ok(ClientMessage::Leave) => self.leave(&f).await,
            Err(e) if f.event == events::JOIN => {
                telemetry::error("bad_join");
                metrics::counter!(telemetry::JOINS, "result" => "error").increment(1);
                self.reply_error(
                    &f,
                    &server::error_reason("InvalidJoinPayload", &e.to_string()),
                );
            }
            _ if !self.channels.contains_key(&f.topic) => {
                telemetry::error("unmatched_topic");
                self.reply_error(&f, "unmatched topic");
            }
            Ok(ClientMessage::AccessToken(t)) => self.refresh(&f.topic, t).await,
            Ok(ClientMessage::Broadcast(b)) => self.broadcast(&f, b).await,
            Ok(ClientMessage::Presence(a)) => self.presence(&f, a).await,
            Ok(ClientMessage::Unknown(ev)) => {
                telemetry::error("unknown_event");
                self.reply_error(
                    &f,
                    &server::error_reason("UnknownEvent", &format!("unknown event `{ev}`")),
                );
            }
            Err(MessageError::PresencePayloadNotMap) => {
                telemetry::error("bad_payload");
                self.reply_error(&f, &MessageError::PresencePayloadNotMap.to_string());
            }
            Err(e) => {
                telemetry::error("bad_payload");
                self.reply_error(&f, &server::error_reason("InvalidPayload", &e.to_string()));
            }
        }
    }

    fn join_error(&self, f: &Frame, code: &str, text: &str) {
        metrics::counter!(telemetry::JOINS, "result" => "error").increment(1);
        self.reply_error(f, &server::error_reason(code, text));
    }

    async fn join(&mut self, f: &Frame, req: JoinRequest) {
        let topic = f.topic.as_str();
        let Some(name) = topic.strip_prefix(TOPIC_PREFIX) else {
            telemetry::error("unmatched_topic");
            return self.reply_error(f, "unmatched topic");
        };
        if name.is_empty() {
            return self.join_error(f, "TopicNameRequired", "You must provide a topic name");
        }
        if !self.joins.take() {
            telemetry::limit("join_rate");
            return self.join_error(f, "TooManyJoins", "Too many joins per second");
        }
        // A second join on a joined topic replaces the channel.
        if let Some(old) = self.channels.remove(topic) {
            let close = self.out(&server::phx_close(old.join_ref.as_deref(), topic));
            self.close_channel(old, close.into_iter().collect()).await;
        }
        if let Err((code, text)) = self.join_limits(req.config.postgres_changes.len()) {
            return self.join_error(f, code, &text);
        }
        let (token, auth) = match self.join_credentials(&req).await {
            Ok(v) => v,
            Err(e) => return self.join_error(f, e.code(), &e.to_string()),
        };
        let exp = auth.exp().unwrap_or(i64::MAX);
        let claims = Value::Object(auth.claims);
        if req.config.private && !self.may_read(f, name, &claims).await {
            return;
        }
        self.open_channel(f, req, token, exp, claims).await;
    }

    /// A private channel's read check; `false` once the join was refused.
    async fn may_read(&self, f: &Frame, name: &str, claims: &Value) -> bool {
        match private::may(&self.shared, &self.project, name, claims, false).await {
            Ok(true) => true,
            Ok(false) => {
                self.join_error(f, "Unauthorized", &private::read_refused(name));
                false
            }
            Err(e) => {
                self.join_error(f, "UnableToConnectToProject", &e);
                false
            }
        }
    }

    /// Open the channel of an accepted join: route its topic and subscribe its bindings,
    /// answer, keep it.
    async fn open_channel(
        &mut self,
        f: &Frame,
        req: JoinRequest,
        token: String,
        exp: i64,
        claims: Value,
    ) {
        let topic = f.topic.as_str();
        let id = self.shared.next_id();
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
            self.shared.cfg.outbound_queue,
        ));
        let bindings = req.config.postgres_changes;
        let Subscribed { subs, refused } =
            match self.subscribe(&out, &key, &bindings, &claims).await {
                Ok(v) => v,
                Err(e) => return self.join_error(f, "UnableToSubscribe", &e),
            };
        let join_ref = f.join_ref.clone().or_else(|| f.ref_.clone());
        let presence = req.config.presence.enabled.then_some(&key);
        let mut first = self.first_frames(f, &bindings, &refused, presence).await;
        let mut replayed_ids = HashSet::new();
        if let Some(replay) = req.config.broadcast.replay.filter(|_| key.private) {
            let (frames, ids) = self.replayed(&key, replay).await;
            first.extend(frames);
            replayed_ids = ids;
        }
        out.open(first, replayed_ids);
        metrics::counter!(telemetry::JOINS, "result" => "ok").increment(1);
        self.shared
            .channels
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        metrics::gauge!(telemetry::CHANNELS).increment(1.0);
        let presence_key = match req.config.presence.key.as_str() {
            "" => uuid_v4(),
            k => k.to_string(),
        };
        let check_at = self.check_at(exp);
        let channel = Channel {
            id,
            join_ref,
            key,
            out,
            bindings,
            subs,
            token,
            exp,
            check_at,
            presence_key,
            tracked: false,
            ack: req.config.broadcast.ack,
            claims,
            may_write: None,
        };
        self.channels.insert(topic.to_string(), channel);
    }

    /// What a joined channel says first: the join reply, the `system` message of its
    /// bindings (subscribed, or the refusals), and the `presence_state` if presence is on.
    async fn first_frames(
        &self,
        f: &Frame,
        bindings: &[PgChangeBinding],
        refused: &registration::Refused,
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
        }
        if let Some(key) = presence {
            let metas = self.shared.presence.list(key.clone()).await;
            let state = presence::presence_map(&metas);
            first.extend(self.out(&server::presence_state(join_ref, topic, &state)));
        }
        first
    }

    /// A private channel's stored broadcasts since the replay's start, as broadcasts with
    /// `meta: {id, replayed: true}`, and their ids (none if the worker cannot be asked:
    /// logged).
    async fn replayed(&self, key: &TopicKey, replay: Replay) -> (Vec<Out>, HashSet<String>) {
        let Some(admin) = self.shared.projects.admin() else {
            return Default::default();
        };
        let name = channel_name(&key.topic);
        let timeout = self.shared.cfg.register_timeout;
        let asked = admin.replay(&key.project, name, replay.since_ms, replay.limit, timeout);
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
            .filter_map(|m| {
                let meta = serde_json::json!({ "id": m.id, "replayed": true }).to_string();
                let b = UserBroadcast {
                    event: m.event,
                    meta: RawValue::from_string(meta).ok(),
                    body: BroadcastBody::Json(RawValue::from_string(m.payload).ok()?),
                };
                self.out(&server::broadcast(&key.topic, b))
            })
            .collect();
        (frames, ids)
    }

    /// The socket's channel limit and the channel's binding limit.
    fn join_limits(&self, bindings: usize) -> Result<(), (&'static str, String)> {
        let cfg = &self.shared.cfg;
        if self.channels.len() >= cfg.max_channels_per_socket {
            telemetry::limit("channels");
            let text = format!(
                "Too many channels (max {} per connection)",
                cfg.max_channels_per_socket
            );
            return Err(("TooManyChannels", text));
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
    async fn join_credentials(&self, req: &JoinRequest) -> Result<(String, Verified), AuthError> {
        let token = self
            .creds
            .token_for_join(req.access_token.as_deref())
            .unwrap_or_default();
        let bindings = &req.config.postgres_changes;
        let auth =
            subscribe::verify_subscriber(&self.shared, &self.project, &token, bindings).await?;
        Ok((token, auth))
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
        let shared = &self.shared;
        shared.topics.add(key, out.clone());
        let sink: SinkRef = out.clone();
        let result = subscribe::subscribe(shared, &self.project, bindings, claims, sink).await;
        if result.is_err() {
            out.close(Vec::new());
            shared.topics.remove(key, out.id);
        }
        result
    }

    async fn leave(&mut self, f: &Frame) {
        let reply = server::reply_ok(f.join_ref.as_deref(), f.ref_.as_deref(), &f.topic, None);
        match self.channels.remove(&f.topic) {
            None => self.push(&reply),
            Some(ch) => {
                let mut last: Vec<Out> = self.out(&reply).into_iter().collect();
                last.extend(self.out(&server::phx_close(ch.join_ref.as_deref(), &f.topic)));
                self.close_channel(ch, last).await;
            }
        }
    }

    /// Close a channel: queue `last`, stop delivery, unregister, untrack.
    pub(crate) async fn close_channel(&mut self, ch: Channel, last: Vec<Out>) {
        ch.out.close(last);
        let shared = self.shared.clone();
        shared.topics.remove(&ch.key, ch.id);
        let removed = shared.registry.remove(&ch.subs);
        registration::unregister(&shared, removed).await;
        if ch.tracked {
            let owner = format!("{}:{}", shared.front_id, ch.id);
            if let Some(d) = shared.presence.untrack(ch.key.clone(), owner).await {
                presence::send_diff(&shared, &ch.key, &d);
            }
        }
        shared
            .channels
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        metrics::gauge!(telemetry::CHANNELS).decrement(1.0);
    }

    /// Send `system` error then `phx_close`, and close the channel.
    async fn shut(&mut self, topic: &str, message: &str) {
        let Some(ch) = self.channels.remove(topic) else {
            return;
        };
        let jr = ch.join_ref.as_deref();
        let mut last: Vec<Out> = Vec::with_capacity(2);
        last.extend(self.out(&server::system(
            jr,
            topic,
            "system",
            SystemStatus::Error,
            message,
        )));
        last.extend(self.out(&server::phx_close(jr, topic)));
        self.close_channel(ch, last).await;
    }

    pub(crate) async fn teardown(&mut self) {
        let topics: Vec<String> = self.channels.keys().cloned().collect();
        for t in topics {
            if let Some(ch) = self.channels.remove(&t) {
                self.close_channel(ch, Vec::new()).await;
            }
        }
    }

    async fn refresh(&mut self, topic: &str, token: Option<String>) {
        let Some(token) = token.filter(|t| !t.is_empty() && !t.starts_with("sb_")) else {
            return;
        };
        let Some(ch) = self.channels.get(topic) else {
            return;
        };
        if ch.token == token {
            return;
        }
        let verified = subscribe::verify_subscriber(&self.shared, &self.project, &token, &[]).await;
        let auth = match verified {
            Ok(v) => v,
            Err(e) => return self.shut(topic, &e.to_string()).await,
        };
        let exp = auth.exp().unwrap_or(i64::MAX);
        let claims = Value::Object(auth.claims);
        if !self.still_may_read(topic, &claims).await {
            let name = channel_name(topic).to_string();
            return self.shut(topic, &private::read_refused(&name)).await;
        }
        let check_at = self.check_at(exp);
        let shared = self.shared.clone();
        let Some(ch) = self.channels.get_mut(topic) else {
            return;
        };
        ch.token = token;
        ch.exp = exp;
        ch.check_at = check_at;
        ch.claims = claims.clone();
        ch.may_write = None;
        if ch.bindings.is_empty() {
            return;
        }
        let (specs, collided) = shared.registry.set_claims(&ch.subs, &claims);
        let jr = ch.join_ref.clone();
        let out = ch.out.clone();
        if !collided.is_empty() {
            // Out of the map already; the worker forgets them too.
            let removed = crate::registry::Removed {
                ids: collided.clone(),
                ..Default::default()
            };
            registration::unregister(&shared, removed).await;
        }
        let msg = match registration::register(&shared, specs).await {
            Ok(mut refused) => {
                let why = crate::registry::COLLISION.to_string();
                refused.extend(collided.into_iter().map(|id| (id, why.clone())));
                subscribed_message(jr.as_deref(), topic, &refused)
            }
            Err(e) => server::system(
                jr.as_deref(),
                topic,
                "postgres_changes",
                SystemStatus::Error,
                &e,
            ),
        };
        if let Some(o) = self.out(&msg) {
            out.deliver(o);
        }
    }

    /// Token expiry: channels whose check time passed.
    pub(crate) async fn check_tokens(&mut self, now: Instant) {
        let due: Vec<String> = self
            .channels
            .iter()
            .filter(|(_, c)| c.check_at <= now)
            .map(|(t, _)| t.clone())
            .collect();
        for topic in due {
            let Some(exp) = self.channels.get(&topic).map(|c| c.exp) else {
                continue;
            };
            let secs = now_secs();
            if exp <= secs {
                telemetry::error("token_expired");
                let msg = AuthError::Expired(secs - exp).to_string();
                self.shut(&topic, &msg).await;
            } else {
                let at = self.check_at(exp);
                if let Some(c) = self.channels.get_mut(&topic) {
                    c.check_at = at;
                }
            }
        }
    }

    async fn broadcast(&mut self, f: &Frame, b: BroadcastPush) {
        if !self.may_write(&f.topic).await {
            // Dropped, as Supabase drops a send its policies refuse.
            return;
        }
        let Some(ch) = self.channels.get(&f.topic) else {
            return;
        };
        metrics::counter!(telemetry::BROADCASTS, "source" => "socket").increment(1);
        let ub = UserBroadcast {
            event: b.event,
            meta: b.meta,
            body: b.payload,
        };
        let except = (!ch.out.broadcast_self).then_some(ch.id);
        let (key, ack) = (ch.key.clone(), ch.ack);
        broadcast::send(&self.shared, &key, &ub, except).await;
        if ack {
            self.reply_ok(f);
        }
    }

    /// Whether the channel may send: public channels always; a private one if its
    /// policies allow it (asked once, kept for the channel's life).
    async fn may_write(&mut self, topic: &str) -> bool {
        let Some(ch) = self.channels.get(topic) else {
            return false;
        };
        if !ch.key.private {
            return true;
        }
        if let Some(known) = ch.may_write {
            return known;
        }
        let name = channel_name(topic).to_string();
        let claims = ch.claims.clone();
        let allowed = private::may(&self.shared, &self.project, &name, &claims, true)
            .await
            .unwrap_or(false);
        if let Some(ch) = self.channels.get_mut(topic) {
            ch.may_write = Some(allowed);
        }
        allowed
    }

    /// A refreshed token of a private channel: are its new claims still allowed to read?
    /// (Public channels: always.) A failure to ask counts as no.
    async fn still_may_read(&self, topic: &str, claims: &Value) -> bool {
        if !self.channels.get(topic).is_some_and(|c| c.key.private) {
            return true;
        }
        let name = channel_name(topic);
        let asked = private::may(&self.shared, &self.project, name, claims, false).await;
        asked.unwrap_or(false)
    }

    async fn presence(&mut self, f: &Frame, action: PresenceAction) {
        if let Err(why) = presence::admit(&mut self.presence_events, &action) {
            return self.reply_error(f, why);
        }
        if matches!(action, PresenceAction::Track { .. }) && !self.may_write(&f.topic).await {
            // Tracking on a private channel needs the write policy, as sending does.
            return self.reply_error(
                f,
                "Unauthorized: You do not have permissions to write to this Channel topic",
            );
        }
        let shared = self.shared.clone();
        let Some(ch) = self.channels.get_mut(&f.topic) else {
            return;
        };
        let owner = format!("{}:{}", shared.front_id, ch.id);
        let key = ch.key.clone();
        let diff = match action {
            PresenceAction::Track { payload } => {
                ch.tracked = true;
                ch.out
                    .presence
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                let pkey = ch.presence_key.clone();
                shared
                    .presence
                    .track(key.clone(), owner, pkey, payload)
                    .await
            }
            PresenceAction::Untrack => {
                ch.tracked = false;
                shared.presence.untrack(key.clone(), owner).await
            }
        };
        self.reply_ok(f);
        if let Some(d) = diff {
            presence::send_diff(&shared, &key, &d);
        }
    }
}

/// The `system` message for a (re-)subscription: ok, or the worker's refusals.
fn subscribed_message(
    join_ref: Option<&str>,
    topic: &str,
    refused: &std::collections::HashMap<String, String>,
) -> Frame {
    if refused.is_empty() {
        return server::system(
            join_ref,
            topic,
            "postgres_changes",
            SystemStatus::Ok,
            SUBSCRIBED,
        );
    }
    let mut reasons: Vec<&str> = refused.values().map(String::as_str).collect();
    reasons.sort_unstable();
    reasons.dedup();
    server::system(
        join_ref,
        topic,
        "postgres_changes",
        SystemStatus::Error,
        &reasons.join("; "),
    )
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
