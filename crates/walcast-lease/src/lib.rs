//! Leader election for the cdc-worker, with fencing.
//!
//! A logical slot has one reader at a time, and two workers taking turns on it would
//! reorder changes, so exactly one worker may read. Leadership comes in **terms**, each
//! numbered (the fencing number) and each with a [`Fence`]: a cheap handle that is open
//! only until `duration - margin` after the last renewal that succeeded, on this
//! process's monotonic clock. The worker checks it before every publish and every
//! acknowledgement; once it is closed the term's token is cancelled and the worker stops.
//! A leader that is frozen (SIGSTOP, a long stall, a paused VM whose clock keeps
//! counting) is replaced by the others once its lease expires, without its cooperation,
//! and publishes nothing when it wakes up.
//!
//! * [`decision`]: the pure lease rules (Kubernetes: a version unchanged for a full
//!   duration on the follower's clock; Postgres: a row expired on the database clock),
//!   property-tested for "never two open fences".
//! * [`fence`]: the fence and its deadline arithmetic.
//! * [`kubernetes`]: a `coordination.k8s.io/v1` Lease, written compare-and-set on its
//!   `resourceVersion` through the standard client (`kube`): kubeconfig or in-cluster.
//! * [`postgres`]: a lease row in `walcast.leases`, written compare-and-set on its term;
//!   a worker taking over terminates the stale holder's sessions.
//! * `none`: always leader, only when asked for explicitly (loud warning).

pub mod decision;
pub mod fence;
pub mod kubernetes;
pub mod postgres;
pub mod status;
pub mod telemetry;

pub use fence::{Action, Fence, Fenced};
pub use status::{LeaseReport, LeaseStatus};

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

/// A lease's renewals in a task of their own, so that no work of the leader — however
/// long it runs between two awaits — delays a renewal (a renewal shares no poll with
/// the work). Aborted when dropped: dropping the elector stops the renewals too.
pub(crate) struct Keeper<T>(tokio::task::JoinHandle<T>);

impl<T: Send + 'static> Keeper<T> {
    pub(crate) fn spawn(keep: impl std::future::Future<Output = T> + Send + 'static) -> Self {
        Keeper(walcast_core::source_scope::spawn(keep))
    }

    /// Its result once it ended; `None` if it panicked.
    pub(crate) async fn join(mut self) -> Option<T> {
        (&mut self.0).await.ok()
    }
}

impl<T> Drop for Keeper<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
