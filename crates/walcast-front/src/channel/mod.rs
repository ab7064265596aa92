//! Channels: the topics a WebSocket connection joined, and the Phoenix commands its
//! client sends on them.
//!
//! * `websocket`: the WebSocket route — the upgrade, then the connection's read loop,
//!   which hands each client frame to the connection's [`Channels`].
//! * here: [`Channels`] — one connection's joined channels and the front's [`Services`]
//!   their commands use — [`Channels::apply`], which dispatches a frame to its command,
//!   and what every command shares (replies, closing a channel, the write check of
//!   private channels). Heartbeats are answered here.
//! * one module per command, each a function of it: `join` (`phx_join`), `leave`
//!   (`phx_leave`), `access_token` (a token refreshed, and the expiry and revocation
//!   checks), `send` (`broadcast`: a client's message to its topic), `track`
//!   (`presence`: track, untrack).
//! * `pending`: a command that must wait for the cdc-worker (a join, a token refresh, a
//!   private channel's write check) runs beside the other frames: the socket never
//!   waits on one channel.
//! * `ready`: `replication_ready`, a channel told once the change stream runs.
//!
//! What a channel is beneath its commands — its gate into the connection's queue, the
//! channels by topic — is `crate::connection`'s.

mod access_token;
mod join;
mod leave;
mod pending;
mod ready;
mod send;
mod track;
pub(crate) mod websocket;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use serde_json::Value;
use tokio::time::{Duration, Instant};
use walcast_protocol::message::events;
use walcast_protocol::server::{self, SystemStatus};
use walcast_protocol::{channel_name, ClientMessage, Frame, MessageError, PresenceAction, Vsn};

use pending::{Answer, Done};

use crate::auth::credentials::Credentials;
use crate::auth::now_secs;
use crate::auth::private::Policies;
use crate::broadcast::Broadcasts;
use crate::cluster::Heard;
use crate::config::FrontConfig;
use crate::connection::{ChanOut, ConnHandle, Connections, Out, TopicKey, Topics};
use crate::limits::usage::{Usage, UserSlot};
use crate::limits::TokenBucket;
use crate::presence::admit::{EVENTS_BURST, EVENTS_PER_SECOND};
use crate::presence::{send_diff, PresenceStore};
use crate::projects::Projects;
use crate::subscription::registration::{Refused, Registration};
use crate::telemetry;

/// `system` message after a successful subscription.
pub const SUBSCRIBED: &str = "Subscribed to PostgreSQL";

/// What the commands of every connection use of the front.
pub(crate) struct Services {
    pub cfg: FrontConfig,
    pub front_id: String,
    pub projects: Projects,
    pub policies: Policies,
    /// This front's channels by topic.
    pub topics: Arc<Topics>,
    pub registration: Arc<Registration>,
    pub presence: Arc<dyn PresenceStore>,
    pub broadcasts: Arc<Broadcasts>,
    pub connections: Arc<Connections>,
    pub usage: Arc<Usage>,
    /// The processes heard from: whether the change stream runs (`replication_ready`).
    pub heard: Arc<Heard>,
}

pub(crate) struct Channel {
    pub id: u64,
    pub join_ref: Option<String>,
    pub key: TopicKey,
    pub out: Arc<ChanOut>,
    /// The join asked for `postgres_changes` (the bindings themselves are not kept: the
    /// registry holds the accepted ones, in `subs`).
    pub has_bindings: bool,
    /// Registry numbers of the accepted subscriptions.
    pub subs: Vec<u64>,
    pub token: String,
    pub exp: i64,
    pub check_at: Instant,
    pub presence_key: String,
    pub tracked: bool,
    pub ack: bool,
    /// The subscriber's claims, kept for a private channel's write check only (`None`
    /// on a public channel, which may always write: no copy per idle subscriber).
    pub claims: Option<Value>,
    /// Private channel: whether it may send (asked at its first send).
    pub may_write: Option<bool>,
    /// `replication_ready` asked and not answered yet.
    pub ready_wait: Option<ready::ReadyWait>,
}

/// One connection's channels, and what its commands need.
pub(crate) struct Channels {
    pub services: Arc<Services>,
    pub handle: Arc<ConnHandle>,
    pub vsn: Vsn,
    pub project: String,
    /// The upgrade request's credentials (a join without its own token acts with them).
    pub creds: Credentials,
    /// Boxed: a connection usually has one channel, and the map allocates room for a few.
    pub channels: HashMap<String, Box<Channel>>,
    pub joins: TokenBucket,
    /// Presence track/untrack events of this socket (see [`crate::presence::admit`]).
    pub presence_events: TokenBucket,
    /// The socket as one of its project's connected users (from its first join).
    pub user: Option<UserSlot>,
    /// Its commands in flight, and the frames of their topics that wait behind them.
    pub pending: pending::Pending,
}

impl Channels {
    pub(crate) fn new(
        services: Arc<Services>,
        handle: Arc<ConnHandle>,
        vsn: Vsn,
        project: String,
        creds: Credentials,
    ) -> Channels {
        let cfg = &services.cfg;
        Channels {
            joins: TokenBucket::new(cfg.join_burst, cfg.joins_per_second),
            presence_events: TokenBucket::new(EVENTS_BURST, EVENTS_PER_SECOND),
            services,
            handle,
            vsn,
            project,
            creds,
            channels: HashMap::new(),
            user: None,
            pending: pending::Pending::default(),
        }
    }

    /// Handle one client frame (`size` bytes on the wire). A frame of a topic whose
    /// command is in flight waits behind it, as a broadcast or track does behind the
    /// write check it needs.
    pub(crate) async fn apply(&mut self, f: Frame, size: usize) {
        if self.pending.holds(&f.topic) {
            return self.wait(f, size);
        }
        let msg = ClientMessage::parse(&f);
        if writes(&msg) && self.write_unknown(&f.topic) && self.check_write(&f.topic).await {
            return self.wait(f, size);
        }
        match msg {
            Ok(ClientMessage::Heartbeat) => self.reply_ok(&f),
            Ok(ClientMessage::Join(j)) => join::apply(self, f, j).await,
            Ok(ClientMessage::Leave) => leave::apply(self, &f).await,
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
            Ok(ClientMessage::AccessToken(t)) => access_token::apply(self, &f.topic, t).await,
            Ok(ClientMessage::Broadcast(b)) => send::apply(self, &f, b).await,
            Ok(ClientMessage::Presence(a)) => track::apply(self, &f, a).await,
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

    /// Keep a frame until its topic's command is answered; refused (an error reply)
    /// when the socket has too many waiting.
    fn wait(&mut self, f: Frame, size: usize) {
        match self.pending.room(size, self.services.cfg.max_frame_bytes) {
            Ok(()) => self.pending.wait(f, size),
            Err(full) => self.busy(&f, full),
        }
    }

    /// Refuse a frame that cannot wait behind its topic's command: too many already do.
    fn busy(&self, f: &Frame, full: pending::Full) {
        telemetry::limit("waiting_frames");
        let text = format!(
            "this channel's last command (a join, a token refresh or a write check) waits \
             for the cdc-worker, and {} (at most {} frames of {} bytes in all) already wait \
             for it or the socket's other commands",
            match full {
                pending::Full::Frames => "too many messages",
                pending::Full::Bytes => "too many bytes",
            },
            pending::MAX_WAITING,
            self.services.cfg.max_frame_bytes,
        );
        self.reply_error(f, &server::error_reason("ChannelBusy", &text));
    }

    /// Run a command that may wait for the cdc-worker: answered here if it does not
    /// (most do not), else in flight beside the socket's other frames.
    async fn run(&mut self, topic: String, join: bool, mut command: BoxFuture<'static, Done>) {
        match (&mut command).now_or_never() {
            Some(done) => self.answered(done).await,
            None => self.pending.start(topic, join, command),
        }
    }

    /// A command in flight was answered: its outcome applies, then the frames that
    /// waited behind it are handled, in order.
    pub(crate) async fn done(&mut self, done: Done) {
        let topic = done.topic.clone();
        let join = matches!(done.answer, Answer::Join { .. });
        self.answered(done).await;
        if !join {
            // The project's keys may have changed meanwhile: the checks pass over a
            // channel with a command in flight.
            access_token::check_one(self, &topic).await;
        }
        for (f, size) in self.pending.finish(&topic) {
            self.apply(f, size).await;
        }
    }

    /// A command's outcome: a join's channel joins the others, a refresh's token (or
    /// refusal) and a write check's answer apply to their channel if it is still open.
    async fn answered(&mut self, done: Done) {
        let topic = done.topic;
        match done.answer {
            Answer::Join { channel, user } => self.join_answered(channel, user),
            Answer::Refresh { id, outcome } => {
                access_token::answered(self, &topic, id, outcome).await;
            }
            Answer::Write { id, allowed } => {
                if let Some(ch) = self.channels.get_mut(&topic).filter(|c| c.id == id) {
                    ch.may_write = Some(allowed);
                }
            }
        }
    }

    /// An answered join's channel (if it opened one) joins the others; the socket's
    /// user slot, if the join admitted it, is kept.
    fn join_answered(&mut self, channel: Option<Box<Channel>>, user: Option<UserSlot>) {
        if self.user.is_none() {
            self.user = user;
        }
        let Some(ch) = channel else {
            return;
        };
        self.services.connections.channel_joined();
        if let Some(c) = self.handle.usage() {
            c.joins.fetch_add(1, Ordering::Relaxed);
            c.channels.fetch_add(1, Ordering::Relaxed);
        }
        let topic = ch.key.topic.clone();
        self.channels.insert(topic, ch);
    }

    /// The earliest token or replication readiness check of the channels (no later
    /// than `limit`). A channel with a command in flight is checked once it is answered.
    pub(crate) fn next_check(&self, limit: Instant) -> Instant {
        self.channels
            .iter()
            .filter(|(t, _)| !self.pending.holds(t))
            .map(|(_, c)| c)
            .flat_map(|c| [Some(c.check_at), c.ready_wait.as_ref().map(|w| w.poll_at)])
            .flatten()
            .fold(limit, Instant::min)
    }

    /// Token expiry: close the channels whose token expired by `now` (or no longer
    /// verifies); then answer the `replication_ready` waits that are due.
    pub(crate) async fn check_tokens(&mut self, now: Instant) {
        access_token::check_expiry(self, now).await;
        ready::check(self, now).await;
    }

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

    /// Its project's keys changed: close the channels whose token no key accepts now.
    pub(crate) async fn recheck_tokens(&mut self) {
        access_token::check_all(self).await;
    }

    /// When to check a token expiring at `exp` next.
    fn check_at(&self, exp: i64) -> Instant {
        check_at(&self.services.cfg, exp)
    }

    /// Close a channel: queue `last`, stop delivery, unregister, untrack.
    async fn close_channel(&mut self, ch: Box<Channel>, last: Vec<Out>) {
        ch.out.close(last);
        let sv = self.services.clone();
        sv.topics.remove(&ch.key, ch.id);
        let removed = sv.registration.registry().remove(&ch.subs);
        sv.registration.unregister(removed).await;
        if ch.tracked {
            let owner = format!("{}:{}", sv.front_id, ch.id);
            if let Some(d) = sv.presence.untrack(ch.key.clone(), owner).await {
                send_diff(&sv.topics, &sv.usage, &ch.key, &d);
            }
        }
        sv.connections.channel_closed();
        if let Some(c) = self.handle.usage() {
            c.channels.fetch_sub(1, Ordering::Relaxed);
        }
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

    /// Close every channel (the connection ended). Its commands in flight are answered
    /// first (each within its own timeouts), and what its joins opened is closed too.
    pub(crate) async fn teardown(&mut self) {
        while self.pending.is_running() {
            let done = self.pending.next().await;
            self.pending.finish(&done.topic);
            if let Answer::Join { channel, user } = done.answer {
                self.join_answered(channel, user);
            }
        }
        let topics: Vec<String> = self.channels.keys().cloned().collect();
        for t in topics {
            if let Some(ch) = self.channels.remove(&t) {
                self.close_channel(ch, Vec::new()).await;
            }
        }
    }

    /// Whether the channel may send (broadcast, or track presence): public channels
    /// always; a private one if its policies allow it (asked once, at its first send,
    /// and kept for the channel's life: see [`Channels::check_write`]).
    fn may_write(&self, topic: &str) -> bool {
        self.channels
            .get(topic)
            .is_some_and(|ch| !ch.key.private || ch.may_write == Some(true))
    }

    /// Whether the channel is private and its policies were not asked yet whether it
    /// may send.
    fn write_unknown(&self, topic: &str) -> bool {
        self.channels
            .get(topic)
            .is_some_and(|ch| ch.key.private && ch.may_write.is_none() && ch.claims.is_some())
    }

    /// Ask a private channel's policies whether it may send (the worker evaluates them;
    /// a failure to ask counts as no). True while the answer is awaited: the frame that
    /// needs it waits behind it.
    async fn check_write(&mut self, topic: &str) -> bool {
        let Some(ch) = self.channels.get(topic) else {
            return false;
        };
        let Some(claims) = ch.claims.clone() else {
            return false;
        };
        let (id, topic) = (ch.id, topic.to_string());
        let (policies, project) = (self.services.policies.clone(), self.project.clone());
        let asked_for = topic.clone();
        let check = async move {
            let name = channel_name(&asked_for);
            let asked = policies.may(&project, name, &claims, true).await;
            Done {
                answer: Answer::Write {
                    id,
                    allowed: asked.unwrap_or(false),
                },
                topic: asked_for,
            }
        };
        self.run(topic.clone(), false, Box::pin(check)).await;
        self.pending.holds(&topic)
    }
}

/// Whether the command sends on its channel (a broadcast, a presence track), which a
/// private channel may do only if its policies allow it.
fn writes(msg: &Result<ClientMessage, MessageError>) -> bool {
    matches!(
        msg,
        Ok(ClientMessage::Broadcast(_) | ClientMessage::Presence(PresenceAction::Track { .. }))
    )
}

/// When to check a token expiring at `exp` next.
fn check_at(cfg: &FrontConfig, exp: i64) -> Instant {
    let left = Duration::from_secs(exp.saturating_sub(now_secs()).max(0) as u64);
    Instant::now() + left.min(cfg.token_check_interval)
}

/// The `system` message for a (re-)subscription: ok, or the worker's refusals.
fn subscribed_message(join_ref: Option<&str>, topic: &str, refused: &Refused) -> Frame {
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
