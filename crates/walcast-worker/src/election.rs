//! How a cdc-worker elects the default source's leader (Postgres lease row, Kubernetes
//! Lease, or none), and the names its lease and sessions go by.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use walcast_lease::{Fence, LeaseMode, LeaseStatus};

use crate::config::{CdcArgs, DbArgs};

/// The `application_name` of this process's pipeline and lease sessions: a worker that
/// takes over our expired lease terminates them (Postgres lease mode).
pub fn session_tag(origin: &str) -> String {
    format!("walcast-cdc-{origin}")
}

/// How `/health` names the election mode.
pub(crate) fn describe_mode(mode: LeaseMode) -> String {
    match mode {
        LeaseMode::None => "none (no election: never run two workers)".to_string(),
        m => m.to_string(),
    }
}

/// Run `lead` for every term this worker wins, until `cancel`. Each term gets a fence
/// (open until the lease could have expired, on our own clock); without election, one
/// term that never closes.
pub(crate) async fn elect<F, Fut>(
    mode: LeaseMode,
    db: &DbArgs,
    cdc: &CdcArgs,
    tag: String,
    status: Arc<LeaseStatus>,
    cancel: &CancellationToken,
    mut lead: F,
) -> Result<(), walcast_lease::kubernetes::KubeLeaseError>
where
    F: FnMut(Fence) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    match mode {
        LeaseMode::None => {
            tracing::warn!("LEASE_MODE=none: no leader election. Running two cdc-workers on one slot reorders changes; use it for development only");
            lead(Fence::unfenced(cancel.child_token())).await;
            Ok(())
        }
        LeaseMode::Kubernetes => {
            let cfg = walcast_lease::kubernetes::KubeLeaseConfig {
                api_url: cdc.lease.lease_kube_api_url.clone(),
                kubeconfig: cdc.lease.lease_kubeconfig.clone(),
                context: cdc.lease.lease_kube_context.clone(),
                namespace: cdc.lease.lease_namespace.clone(),
                name: kubernetes_name(&lease_name(cdc)),
                identity: lease_identity(),
                duration: cdc.lease.duration(),
            };
            tracing::info!(lease = %cfg.name, namespace = %cfg.namespace, identity = %cfg.identity, "electing through a Kubernetes Lease");
            walcast_lease::kubernetes::run(cfg, status, cancel.clone(), lead).await
        }
        LeaseMode::Postgres | LeaseMode::Auto => {
            let pg = walcast_lease::postgres::PgLeaseConfig {
                url: walcast_lease::postgres::tagged_url(&db.database_url, &tag),
                name: lease_name(cdc),
                identity: lease_identity(),
                session_tag: tag,
                duration: cdc.lease.duration(),
            };
            tracing::info!(lease = %pg.name, identity = %pg.identity, session = %pg.session_tag, "electing through a Postgres lease row");
            walcast_lease::postgres::run(pg, status, cancel.clone(), lead).await;
            Ok(())
        }
    }
}

/// The election mode in force: `auto` is Kubernetes inside a cluster
/// (`KUBERNETES_SERVICE_HOST` set), else Postgres.
pub(crate) fn lease_mode(cdc: &CdcArgs) -> LeaseMode {
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    cdc.lease.lease_mode.resolve(in_cluster)
}

/// Workers with the same lease name compete; defaults to the slot name.
pub(crate) fn lease_name(cdc: &CdcArgs) -> String {
    cdc.lease
        .lease_name
        .clone()
        .unwrap_or_else(|| cdc.slot_name.clone())
}

/// A valid Kubernetes object name (RFC 1123 subdomain: lower case, digits, `-`, `.`) for
/// a lease name: the default, the slot name `walcast_cdc_slot`, becomes
/// `walcast-cdc-slot` (the Postgres lease keeps the name as it is).
fn kubernetes_name(name: &str) -> String {
    let mapped: String = name
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '.' | '-') => c,
            _ => '-',
        })
        .collect();
    let trimmed = mapped.trim_matches(|c: char| c == '-' || c == '.');
    match trimmed.is_empty() {
        true => "walcast".to_string(),
        false => trimmed.chars().take(253).collect(),
    }
}

/// This worker's Lease `holderIdentity`: the pod name (`HOSTNAME` in Kubernetes), else
/// one made up for this process.
pub(crate) fn lease_identity() -> String {
    match std::env::var("HOSTNAME") {
        Ok(h) if !h.is_empty() => h,
        _ => format!(
            "cdc-worker-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn lease_names_become_valid_kubernetes_names() {
        assert_eq!(
            super::kubernetes_name("walcast_cdc_slot"),
            "walcast-cdc-slot"
        );
        assert_eq!(super::kubernetes_name("My.Lease_1"), "my.lease-1");
        assert_eq!(super::kubernetes_name("__"), "walcast");
    }
}
