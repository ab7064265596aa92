//! `access_token`: a channel's token refreshed (its subscriptions re-registered with the
//! new claims), and token expiry or revocation (the channel closed with a `system` error):
//! a channel's token — the join's, or the last one given through `access_token` — is
//! verified again at each check (every `token_check_interval` and at `exp`) and whenever
//! its project's keys change, so a secret rotated (once its window ends), a project
//! suspended or deleted ends the channels no key accepts any more.

use serde_json::Value;
use tokio::time::Instant;
use walcast_protocol::channel_name;
use walcast_protocol::server::{self, SystemStatus};

use super::{subscribed_message, Session};
use crate::auth::AuthError;
use crate::registry::{Removed, COLLISION};
use crate::subscribe;
use crate::telemetry;

pub(super) async fn apply(s: &mut Session, topic: &str, token: Option<String>) {
    let Some(token) = token.filter(|t| !t.is_empty() && !t.starts_with("sb_")) else {
        return;
    };
    let Some(ch) = s.channels.get(topic) else {
        return;
    };
    if ch.token == token {
        return;
    }
    let projects = &s.services.projects;
    let verified = subscribe::verify_subscriber(projects, &s.project, &token, &[]).await;
    let auth = match verified {
        Ok(v) => v,
        Err(e) => return s.shut(topic, &e.to_string()).await,
    };
    let exp = auth.exp().unwrap_or(i64::MAX);
    let claims = Value::Object(auth.claims);
    if !still_may_read(s, topic, &claims).await {
        let name = channel_name(topic).to_string();
        return s.shut(topic, &crate::private::read_refused(&name)).await;
    }
    let check_at = s.check_at(exp);
    let Some(ch) = s.channels.get_mut(topic) else {
        return;
    };
    ch.token = token;
    ch.exp = exp;
    ch.check_at = check_at;
    ch.claims = ch.key.private.then(|| claims.clone());
    ch.may_write = None;
    if !ch.has_bindings {
        return;
    }
    let subs = ch.subs.clone();
    let jr = ch.join_ref.clone();
    let out = ch.out.clone();
    let msg = resubscribe(s, &subs, &claims, jr.as_deref(), topic).await;
    if let Some(o) = s.out(&msg) {
        out.deliver(o);
    }
}

/// Register a channel's subscriptions again with new claims; the `system` message that
/// tells the client how it went.
async fn resubscribe(
    s: &Session,
    subs: &[u64],
    claims: &Value,
    jr: Option<&str>,
    topic: &str,
) -> walcast_protocol::Frame {
    let registrar = &s.services.registrar;
    let (specs, collided) = registrar.registry().set_claims(subs, claims);
    if !collided.is_empty() {
        // Out of the map already; the worker forgets them too.
        let source = registrar
            .source_of(&s.project)
            .unwrap_or_else(|| walcast_bus::source::DEFAULT_SOURCE.to_string());
        let removed = Removed {
            ids: collided.clone(),
            sources: vec![source; collided.len()],
            ..Default::default()
        };
        registrar.unregister(removed).await;
    }
    match registrar.register(specs).await {
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

/// A refreshed token of a private channel: are its new claims still allowed to read?
/// (Public channels: always.) A failure to ask counts as no.
async fn still_may_read(s: &Session, topic: &str, claims: &Value) -> bool {
    if !s.channels.get(topic).is_some_and(|c| c.key.private) {
        return true;
    }
    let name = channel_name(topic);
    let asked = s
        .services
        .policies
        .may(&s.project, name, claims, false)
        .await;
    asked.unwrap_or(false)
}

/// Token expiry: channels whose check time passed are closed if their token expired or
/// no longer verifies, else checked again later.
pub(super) async fn check_expiry(s: &mut Session, now: Instant) {
    let due: Vec<String> = s
        .channels
        .iter()
        .filter(|(_, c)| c.check_at <= now)
        .map(|(t, _)| t.clone())
        .collect();
    check(s, due).await;
}

/// Check every channel's token now (its project's keys changed).
pub(super) async fn check_all(s: &mut Session) {
    let all: Vec<String> = s.channels.keys().cloned().collect();
    check(s, all).await;
}

/// Close each of these channels whose token no key accepts now (expired, or its key
/// gone); check the others again later.
async fn check(s: &mut Session, topics: Vec<String>) {
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
