//! Subscribing to `postgres_changes`, the same way for every transport: verify the
//! subscriber, make each binding a subscription that delivers to the transport's
//! [`Sink`](crate::subscription::sink::Sink), register them with the cdc-worker, keep the accepted.
//!
//! A WebSocket join (the `channel` module) and an SSE stream (the `sse` module) both go
//! through here; they differ only in how they answer (a join reply and a `system`
//! message, or `ready` and an HTTP status).

use std::sync::Arc;

use serde_json::Value;
use walcast_protocol::PgChangeBinding;

use crate::auth::{AuthError, Verified};
use crate::projects::Projects;
use crate::subscription::registration::{Refused, Registration};
use crate::subscription::registry::{self, Target};
use crate::subscription::sink::SinkRef;
use crate::telemetry;

/// The accepted subscriptions (their numbers in the registry) and the refused ones (the
/// subscription id → the worker's reason).
pub(crate) struct Subscribed {
    pub subs: Vec<u64>,
    pub refused: Refused,
}

/// The subscriber: `token` verified as a token of `project` that carries `role` and
/// `exp`, with every binding in a schema the project may use (tenant isolation; the
/// worker also refuses any table not enabled for the project).
pub(crate) async fn verify_subscriber(
    projects: &Projects,
    project: &str,
    token: &str,
    bindings: &[PgChangeBinding],
) -> Result<Verified, AuthError> {
    let auth = projects
        .verify_for(project, token)
        .await
        .and_then(|v| v.require_role_and_exp().map(|_| v))
        .inspect_err(|_| telemetry::error("auth"))?;
    for b in bindings {
        auth.check_schema(&b.schema)
            .inspect_err(|_| telemetry::error("schema_not_allowed"))?;
    }
    Ok(auth)
}

/// Make `bindings` routable to `sink` (changes matched before the transport answers the
/// client wait in the sink), register them, and drop the refused ones.
/// `Err`: the registration itself failed (nothing is left behind).
pub(crate) async fn subscribe(
    registration: &Arc<Registration>,
    project: &str,
    bindings: &[PgChangeBinding],
    claims: &Value,
    sink: SinkRef,
) -> Result<Subscribed, String> {
    let mut subs = Vec::with_capacity(bindings.len());
    let mut specs = Vec::with_capacity(bindings.len());
    let mut collided = Refused::new();
    let registry = registration.registry();
    // Its changes come from the leader of its project's source.
    let Some(source) = registration.source_of(project) else {
        telemetry::error("unknown_project_source");
        return Err(format!(
            "Unable to subscribe to changes: unknown project {project:?}"
        ));
    };
    // One copy of the claims for every binding (and the worker's matcher, in one process).
    let claims = Arc::new(claims.clone());
    for b in bindings {
        let (n, sid) = registry.alloc();
        let spec = registry::spec_for(sid, registration.front_id(), project, b, &claims);
        let target = Target {
            sink: sink.clone(),
            binding: b.id,
            spec: spec.clone(),
            source: source.clone(),
        };
        match registry.insert(n, target) {
            Ok(()) => {
                specs.push(spec);
                subs.push(n);
            }
            // Its class key names a class of other fields: never merged, never registered.
            Err(why) => {
                collided.insert(spec.id, why.to_string());
            }
        }
    }
    let mut refused = match registration.register_join(&subs, specs.clone()).await {
        Ok(r) => r,
        Err(e) => {
            // The worker may still register them late: drop them there too.
            let removed = registry.remove(&subs);
            registration.unregister(removed).await;
            return Err(e.to_string());
        }
    };
    let refused_ns: Vec<u64> = subs
        .iter()
        .zip(&specs)
        .filter(|(_, s)| refused.contains_key(&s.id))
        .map(|(n, _)| *n)
        .collect();
    // The worker keeps nothing of a refused subscription; saying it is gone anyway keeps
    // the worker's view and ours the same whatever it did.
    let removed = registry.remove(&refused_ns);
    registration.unregister(removed).await;
    subs.retain(|n| !refused_ns.contains(n));
    refused.extend(collided);
    Ok(Subscribed { subs, refused })
}
