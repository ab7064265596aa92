//! Which source (database, docs/architecture.md "Several databases") a task works for, so
//! that the metrics it records carry a `source` label without every call site naming it.
//!
//! A worker runs each source's work (its election, its pipeline, its consumers, its
//! answers to the fronts) [`within`] the source's name; tasks that work spawns inherit it
//! ([`spawn`], [`inherit`]). The process's metrics recorder (the `walcast` crate's
//! `telemetry.rs`) adds `source="<name>"` to every series registered from such a task.
//! Work for no source (a front, the process itself) records its series unlabelled.

use std::future::Future;
use std::sync::Arc;

tokio::task_local! {
    static SOURCE: Option<Arc<str>>;
}

/// `fut` run as work for `source`.
pub fn within<F: Future>(
    source: &str,
    fut: F,
) -> tokio::task::futures::TaskLocalFuture<Option<Arc<str>>, F> {
    SOURCE.scope(Some(Arc::from(source)), fut)
}

/// `f` called as work for `source` (a synchronous call, e.g. from another source's task or
/// from a front in the same process).
pub fn within_sync<R>(source: &str, f: impl FnOnce() -> R) -> R {
    SOURCE.sync_scope(Some(Arc::from(source)), f)
}

/// The source the current task works for, if any.
pub fn current() -> Option<Arc<str>> {
    SOURCE.try_with(Clone::clone).ok().flatten()
}

/// `fut` run for the source the current task works for (if any): wrap a future that
/// is spawned (a spawned task does not inherit task-locals by itself).
pub fn inherit<F: Future>(fut: F) -> tokio::task::futures::TaskLocalFuture<Option<Arc<str>>, F> {
    SOURCE.scope(current(), fut)
}

/// `tokio::spawn`, the task working for the current task's source.
pub fn spawn<F>(fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(inherit(fut))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn spawned_tasks_inherit_the_source() {
        assert_eq!(current(), None);
        let seen = within("shop", async {
            let direct = current();
            let spawned = spawn(async { current() }).await.unwrap();
            let plain = tokio::spawn(async { current() }).await.unwrap();
            (direct, spawned, plain)
        })
        .await;
        assert_eq!(seen.0.as_deref(), Some("shop"));
        assert_eq!(seen.1.as_deref(), Some("shop"));
        assert_eq!(seen.2, None, "tokio::spawn alone does not inherit");
        let nested = within("a", within("b", async { current() })).await;
        assert_eq!(nested.as_deref(), Some("b"));
        assert_eq!(within_sync("c", current).as_deref(), Some("c"));
    }
}
