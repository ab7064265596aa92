//! This front's NATS link: broadcast and presence between fronts go over core NATS, which
//! drops what was sent to us while the link was down, and nothing can bring it back. So
//! after every reconnection each joined channel is told with a `system` message that
//! messages may have been missed, and the loss is counted (`/health` shows the last one).

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use walcast_bus::Bus;
use walcast_protocol::server::{self, SystemStatus};

use crate::connection::{Out, Topics};
use crate::telemetry;

/// What a channel is told after a reconnection.
pub(crate) const MISSED_BROADCASTS: &str = "This server lost its link to the other servers for \
     a moment: broadcast and presence messages sent meanwhile may have been missed (they \
     cannot be recovered)";

/// Until `cancel`: on every reconnection of the bus, count the loss and tell every
/// joined channel.
pub(crate) async fn watch(topics: Arc<Topics>, bus: Bus, cancel: CancellationToken) {
    let Some(events) = bus.link_events().cloned() else {
        return;
    };
    let mut reconnected = events.reconnections();
    let mut counted = 0;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = reconnected.changed() => if r.is_err() { return },
        }
        let disconnects = events.disconnects();
        metrics::counter!(telemetry::BUS_DISCONNECTS).increment(disconnects - counted);
        counted = disconnects;
        let channels = topics.all();
        tracing::warn!(
            channels = channels.len(),
            "NATS link back after a loss: every channel is told broadcasts may have been missed"
        );
        for c in &channels {
            let f = server::system(
                None,
                &c.topic,
                "system",
                SystemStatus::Error,
                MISSED_BROADCASTS,
            );
            if let Some(out) = Out::frame(&f, c.vsn) {
                c.deliver(out);
            }
        }
        metrics::counter!(telemetry::BROADCAST_GAP_NOTICES).increment(channels.len() as u64);
    }
}
