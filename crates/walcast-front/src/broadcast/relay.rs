//! The relay: the other fronts' broadcasts, and the leaders' database broadcasts,
//! delivered to this front's channels.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use walcast_bus::source::HEADER_SOURCE;
use walcast_bus::{BusMessage, Subscription, HEADER_ORIGIN, HEADER_PUSHED, HEADER_TERM};

use super::{decode_message, Broadcasts, Pushed};
use crate::cluster::listen::next_message;
use crate::subscription::fanout::from_its_source;
use crate::subscription::fanout::guards::TermGuard;
use crate::telemetry;

impl Broadcasts {
    /// `leader`: the source whose leader published it (a database broadcast), `None`
    /// for another front's.
    fn relay_one(&self, msg: &BusMessage, leader: Option<&str>) {
        if msg.header(HEADER_ORIGIN) == Some(self.front_id.as_str()) {
            return;
        }
        let Some((key, b)) = decode_message(&msg.subject, &msg.payload) else {
            telemetry::error("bad_broadcast_relay");
            return;
        };
        // A source's database speaks only for the projects on that source.
        if let Some(source) = leader {
            if !from_its_source(&self.projects, source, &key.project) {
                return;
            }
        }
        metrics::counter!(telemetry::BROADCASTS, "source" => "bus").increment(1);
        let how = match msg.header(HEADER_PUSHED) {
            Some(_) => Pushed::Binary,
            None => Pushed::Json,
        };
        self.deliver_local(&key, &b, how, None);
    }
}

/// Relay the other fronts' broadcasts, and the leaders' database broadcasts, to local
/// channels. A database broadcast carries its leader's term and source: one of a term
/// older than the newest seen of that source (a frozen leader's late message) is
/// dropped, as changes are, and so is one of a project not on that source.
pub(crate) async fn run(
    broadcasts: Arc<Broadcasts>,
    mut sub: Subscription,
    cancel: CancellationToken,
) {
    let mut terms = TermGuard::default();
    while let Some(msg) = next_message(&mut sub, &cancel, "broadcast relay").await {
        // Only a leader's messages carry a term (and, but for the default, a source).
        let leader = msg
            .header(HEADER_TERM)
            .map(|_| walcast_bus::source::of_header(msg.header(HEADER_SOURCE)));
        let source = leader.unwrap_or(walcast_bus::source::DEFAULT_SOURCE);
        if terms.admit(source, msg.header(HEADER_TERM), std::time::Instant::now()) {
            broadcasts.relay_one(&msg, leader);
        }
    }
}
