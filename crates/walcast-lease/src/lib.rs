//! Leader election for the cdc-worker.
//!
//! A logical slot has one reader at a time, and two workers taking turns on it would
//! reorder changes, so exactly one worker may read. Each leadership **term** comes with a
//! [`CancellationToken`](tokio_util::sync::CancellationToken) that is cancelled as soon as
//! leadership is in doubt; the worker stops reading when it fires.
//!
//! * [`decision`]: the pure rule of a lease with a holder, a renew time and a duration
//!   (Kubernetes `Lease` semantics), evaluated on the elector's own clock.
//! * [`kubernetes`]: a `coordination.k8s.io/v1` Lease, written compare-and-set on its
//!   `resourceVersion`; the holder steps down before its lease could expire.
//! * [`postgres`]: an advisory lock held by a dedicated session; losing the session loses
//!   leadership.
//! * `none`: always leader, only when asked for explicitly (loud warning).

pub mod decision;
pub mod kubernetes;
pub mod postgres;

use std::fmt;

/// How leadership is decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseMode {
    /// Kubernetes when running in a cluster, else Postgres.
    Auto,
    Kubernetes,
    Postgres,
    /// Always leader. Development only: two workers would both read the slot.
    None,
}

impl std::str::FromStr for LeaseMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(LeaseMode::Auto),
            "kubernetes" => Ok(LeaseMode::Kubernetes),
            "postgres" => Ok(LeaseMode::Postgres),
            "none" => Ok(LeaseMode::None),
            other => Err(format!(
                "unknown LEASE_MODE {other:?} (expected auto, kubernetes, postgres or none)"
            )),
        }
    }
}

impl fmt::Display for LeaseMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LeaseMode::Auto => "auto",
            LeaseMode::Kubernetes => "kubernetes",
            LeaseMode::Postgres => "postgres",
            LeaseMode::None => "none",
        })
    }
}

impl LeaseMode {
    /// Resolve `auto`: Kubernetes inside a cluster (`KUBERNETES_SERVICE_HOST` set), else
    /// Postgres.
    pub fn resolve(self, in_cluster: bool) -> LeaseMode {
        match self {
            LeaseMode::Auto if in_cluster => LeaseMode::Kubernetes,
            LeaseMode::Auto => LeaseMode::Postgres,
            other => other,
        }
    }
}
