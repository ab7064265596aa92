//! `access_token`: a channel's token refreshed (its subscriptions re-registered with the
//! new claims), and token expiry or revocation (the channel closed with a `system` error):
//! a channel's token — the join's, or the last one given through `access_token` — is
//! verified again at each check (every `token_check_interval` and at `exp`) and whenever
//! its project's keys change, so a secret rotated (once its window ends), a project
//! suspended or deleted ends the channels no key accepts any more.
//!
//! A refresh that waits for the cdc-worker (a private channel's read check, the
//! subscriptions' registration) runs on a [`Refresh`] — what it needs of the channel,
//! owned — beside the socket's other frames ([`super::pending`]); the frames of its
//! channel wait behind it, and its outcome applies once it is answered. The checks pass
//! over a channel with a command in flight; it is checked once that is answered.

use std::sync::Arc;

use serde_json::Value;
use tokio::time::Instant;
use walcast_protocol::server::{self, SystemStatus};
use walcast_protocol::{channel_name, Frame};

use super::pending::{Answer, Done, Refreshed, Taken};
use super::{subscribed_message, Channels, Services};
use crate::auth::AuthError;
use crate::subscription::registry::{Removed, COLLISION};
use crate::subscription::subscribe;
use crate::telemetry;

pub(super) async fn apply(s: &mut Channels, topic: &str, token: Option<String>) {
    let Some(token) = token.filter(|t| !t.is_empty() && !t.starts_with("sb_")) else {
        return;
    };
    let Some(ch) = s.channels.get(topic) else {
        return;
    };
    if ch.token == token {
        return;
    }
    let id = ch.id;
    let refresh = Refresh {
        services: s.services.clone(),
        project: s.project.clone(),
        topic: topic.to_string(),
        private: ch.key.private,
        subs: ch.has_bindings.then(|| ch.subs.clone()),
        join_ref: ch.join_ref.clone(),
    };
    let command = async move {
        let topic = refresh.topic.clone();
        let outcome = refresh.run(token).await;
        Done {
            topic,
            answer: Answer::Refresh { id, outcome },
        }
    };
    s.run(topic.to_string(), false, Box::pin(command)).await;
}

/// A refresh answered: the channel numbered `id`, if still open on `topic`, takes the
/// new token (and is told how its subscriptions were registered again), or is shut.
pub(super) async fn answered(s: &mut Channels, topic: &str, id: u64, outcome: Refreshed) {
    if s.channels.get(topic).is_none_or(|c| c.id != id) {
        return;
    }
    let Taken {
        token,
        exp,
        claims,
        said,
    } = match outcome {
        Refreshed::Refused(why) => return s.shut(topic, &why).await,
        Refreshed::Taken(taken) => *taken,
    };
    let check_at = s.check_at(exp);
    let said = said.and_then(|m| s.out(&m));
    let Some(ch) = s.channels.get_mut(topic) else {
        return;
    };
    ch.token = token;
    ch.exp = exp;
    ch.check_at = check_at;
    ch.claims = ch.key.private.then_some(claims);
    // New claims: a private channel's policies are asked again at its next send.
    ch.may_write = None;
    if let Some(o) = said {
        ch.out.deliver(o);
    }
}

/// What a token refresh needs of its channel, owned: it may run beside the socket's
/// other frames.
struct Refresh {
    services: Arc<Services>,
    project: String,
    topic: String,
    private: bool,
    /// Its accepted subscriptions, if it asked for `postgres_changes`.
    subs: Option<Vec<u64>>,
    join_ref: Option<String>,
}

impl Refresh {
    /// Verify `token`, ask a private channel's policies whether its claims may still
    /// read, register the subscriptions again with them.
    async fn run(self, token: String) -> Refreshed {
        let projects = &self.services.projects;
        let verified = subscribe::verify_subscriber(projects, &self.project, &token, &[]).await;
        let auth = match verified {
            Ok(v) => v,
            Err(e) => return Refreshed::Refused(e.to_string()),
        };
        let exp = auth.exp().unwrap_or(i64::MAX);
        let claims = Value::Object(auth.claims);
        if !self.still_may_read(&claims).await {
            let name = channel_name(&self.topic);
            return Refreshed::Refused(crate::auth::private::read_refused(name));
        }
        let said = match &self.subs {
            Some(subs) => Some(self.resubscribe(subs, &claims).await),
            None => None,
        };
        Refreshed::Taken(Box::new(Taken {
            token,
            exp,
            claims,
            said,
        }))
    }

    /// Register the channel's subscriptions again with new claims; the `system` message
    /// that tells the client how it went.
    async fn resubscribe(&self, subs: &[u64], claims: &Value) -> Frame {
        let (jr, topic) = (self.join_ref.as_deref(), self.topic.as_str());
        let registration = &self.services.registration;
        let (specs, collided) = registration.registry().set_claims(subs, claims);
        if !collided.is_empty() {
            // Out of the map already; the worker forgets them too.
            let source = registration
                .source_of(&self.project)
                .unwrap_or_else(|| walcast_bus::source::DEFAULT_SOURCE.to_string());
            let removed = Removed {
                ids: collided.clone(),
                sources: vec![source; collided.len()],
                ..Default::default()
            };
            registration.unregister(removed).await;
        }
        match registration.register(specs).await {
            Ok(mut refused) => {
                let why = COLLISION.to_string();
                refused.extend(collided.into_iter().map(|id| (id, why.clone())));
                subscribed_message(jr, topic, &refused)
            }
            Err(e) => {
                let why = e.to_string();
                server::system(jr, topic, "postgres_changes", SystemStatus::Error, &why)
            }
        }
    }

    /// A refreshed token of a private channel: are its new claims still allowed to
    /// read? (Public channels: always.) A failure to ask counts as no.
    async fn still_may_read(&self, claims: &Value) -> bool {
        if !self.private {
            return true;
        }
        let name = channel_name(&self.topic);
        let policies = &self.services.policies;
        let asked = policies.may(&self.project, name, claims, false).await;
        asked.unwrap_or(false)
    }
}

/// Token expiry: channels whose check time passed are closed if their token expired or
/// no longer verifies, else checked again later.
pub(super) async fn check_expiry(s: &mut Channels, now: Instant) {
    let due: Vec<String> = s
        .channels
        .iter()
        .filter(|(t, c)| c.check_at <= now && !s.pending.holds(t))
        .map(|(t, _)| t.clone())
        .collect();
    check(s, due).await;
}

/// Check every channel's token now (its project's keys changed).
pub(super) async fn check_all(s: &mut Channels) {
    let all: Vec<String> = s
        .channels
        .keys()
        .filter(|t| !s.pending.holds(t))
        .cloned()
        .collect();
    check(s, all).await;
}

/// Check one channel's token now (its command in flight was answered).
pub(super) async fn check_one(s: &mut Channels, topic: &str) {
    check(s, vec![topic.to_string()]).await;
}

/// Close each of these channels whose token no key accepts now (expired, or its key
/// gone); check the others again later.
async fn check(s: &mut Channels, topics: Vec<String>) {
    for topic in topics {
        let Some((token, exp)) = s.channels.get(&topic).map(|c| (c.token.clone(), c.exp)) else {
            continue;
        };
        match s.services.projects.check_session(&s.project, &token) {
            Ok(()) => {
                let at = s.check_at(exp);
                if let Some(c) = s.channels.get_mut(&topic) {
                    c.check_at = at;
                }
            }
            Err(e) => {
                telemetry::error(match e {
                    AuthError::Expired(_) => "token_expired",
                    _ => "token_revoked",
                });
                s.shut(&topic, &e.to_string()).await;
            }
        }
    }
}
