//! Reading a bus subscription in a task that stops with the front.

use tokio_util::sync::CancellationToken;

/// The next message of a bus subscription, or `None` once `cancel` fires or the
/// subscription ends (which is logged: `what` names it).
pub(crate) async fn next_message(
    sub: &mut walcast_bus::Subscription,
    cancel: &CancellationToken,
    what: &str,
) -> Option<walcast_bus::BusMessage> {
    use futures_util::StreamExt;
    tokio::select! {
        _ = cancel.cancelled() => None,
        m = sub.next() => {
            if m.is_none() {
                tracing::warn!("{what} subscription ended");
            }
            m
        }
    }
}
