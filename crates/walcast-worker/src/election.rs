//! How a source's leader is elected (a Postgres lease row, a Kubernetes Lease, or none),
//! and the names leases and sessions go by.

use walcast_lease::kubernetes::KubeLeaseConfig;
use walcast_lease::postgres::PgLeaseConfig;
use walcast_lease::LeaseMode;

use crate::config::{CdcArgs, DbArgs};

/// The `application_name` of this process's pipeline and lease sessions: a worker that
/// takes over our expired lease terminates them (Postgres lease mode).
pub fn session_tag(origin: &str) -> String {
    format!("walcast-cdc-{origin}")
}

/// A gate asked before every attempt to take a lease.
pub type Gate = Box<dyn Fn() -> bool + Send + Sync>;

/// How a source's leader is elected.
pub enum Election {
    /// No election (`LEASE_MODE=none`): one term that never closes.
    None,
    /// A lease row in the source's own database, tried while the gate says so. A worker
    /// taking an expired lease terminates the stale leader's sessions there.
    Postgres(PgLeaseConfig, Gate),
    /// A Kubernetes Lease.
    Kubernetes(KubeLeaseConfig),
}

/// The `application_name` of a process's sessions for `source`: a worker taking over
/// the source's lease terminates the stale leader's sessions by it, and two sources may
/// be databases of one server, whose sessions one `pg_stat_activity` lists.
pub(crate) fn source_tag(origin: &str, source: &str) -> String {
    let tag = session_tag(origin);
    match walcast_bus::source::is_default(source) {
        true => tag,
        false => format!("{tag}-{source}"),
    }
}

/// How `/health` names the election mode.
pub(crate) fn describe_mode(mode: LeaseMode) -> String {
    match mode {
        LeaseMode::None => "none (no election: never run two workers)".to_string(),
        m => m.to_string(),
    }
}

/// How the default source is elected: by the process's election mode (a lease row in
/// its database, which is the control database, or a Kubernetes Lease), always tried
/// (it is given up only by its own election, never for the share).
pub(crate) fn for_default(mode: LeaseMode, db: &DbArgs, cdc: &CdcArgs, origin: &str) -> Election {
    match mode {
        LeaseMode::None => {
            tracing::warn!("LEASE_MODE=none: no leader election. Running two cdc-workers on one slot reorders changes; use it for development only");
            Election::None
        }
        LeaseMode::Kubernetes => {
            let cfg = KubeLeaseConfig {
                api_url: cdc.lease.lease_kube_api_url.clone(),
                kubeconfig: cdc.lease.lease_kubeconfig.clone(),
                context: cdc.lease.lease_kube_context.clone(),
                namespace: cdc.lease.lease_namespace.clone(),
                name: kubernetes_name(&lease_name(cdc)),
                identity: lease_identity(),
                duration: cdc.lease.duration(),
            };
            tracing::info!(lease = %cfg.name, namespace = %cfg.namespace, identity = %cfg.identity, "electing through a Kubernetes Lease");
            Election::Kubernetes(cfg)
        }
        LeaseMode::Postgres | LeaseMode::Auto => {
            let source = walcast_bus::source::DEFAULT_SOURCE;
            let pg = postgres_lease(cdc, origin, source, &db.database_url);
            tracing::info!(lease = %pg.name, identity = %pg.identity, session = %pg.session_tag, "electing through a Postgres lease row");
            Election::Postgres(pg, Box::new(|| true))
        }
    }
}

/// The lease row of `source` in its database (`database_url`), this process's sessions
/// there tagged so that a worker taking the lease over terminates them.
pub(crate) fn postgres_lease(
    cdc: &CdcArgs,
    origin: &str,
    source: &str,
    database_url: &str,
) -> PgLeaseConfig {
    let tag = source_tag(origin, source);
    PgLeaseConfig {
        url: walcast_lease::postgres::tagged_url(database_url, &tag),
        name: lease_name(cdc),
        identity: lease_identity(),
        session_tag: tag,
        duration: cdc.lease.duration(),
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
