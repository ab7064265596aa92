//! The transactional outbox relay (see `docs/outbox.md`).
//!
//! Applications emit events in their own transactions — `walcast.emit(topic, key,
//! payload, headers)` (a transactional logical message, no table written) or a row in an
//! insert-only outbox table (`walcast.outbox_create`) — and the leading cdc-worker's one
//! WAL read relays them to NATS JetStream in commit order: [`relay::Relay`] is a
//! [`walcast_pipeline::Consumer`] next to realtime delivery, and the slot is
//! acknowledged past a transaction only once JetStream acknowledged every event of it
//! (`PubAck`), or the quarantine holds those it refused for good. A task of the relay's
//! own (`sender`) talks to JetStream, so realtime delivery never waits for it.
//!
//! - [`event`]: the events and their JetStream messages (pure);
//! - [`publish`]: the stream, sending, and transient vs permanent failures;
//! - [`quarantine`]: refused events, kept until `walcast outbox redrive`;
//! - [`time`]: a pure helper; [`health`], [`telemetry`]: what operators see;
//! - [`maintain`]: partition maintenance (the leading cdc-worker runs it);
//! - [`redrive`], [`replay`] (paced by [`rate`]): what `walcast outbox redrive|replay` do.

pub mod config;
pub mod error;
pub mod event;
pub mod health;
pub mod maintain;
pub mod publish;
pub mod quarantine;
pub mod rate;
pub mod redrive;
pub mod relay;
pub mod replay;
mod sender;
pub mod telemetry;
pub mod time;

use std::sync::Arc;

pub use config::OutboxConfig;
pub use event::OutboxEvent;
use futures_util::future::BoxFuture;
pub use health::{OutboxHealth, OutboxHealthReport};
pub use relay::Relay;
use walcast_pipeline::{Consumer, ConsumerError, ConsumerFactory, Retry, Session};

/// The schema holding every outbox table's partitions.
pub const PARTS_SCHEMA: &str = "walcast_outbox_parts";

/// A [`ConsumerFactory`] that makes a relay for each pipeline session, sending through
/// the session's fenced publisher (so the relay publishes nothing once its leadership
/// term ended, and every event carries the term). On an in-process bus (no JetStream)
/// the session fails with an error that retrying cannot fix.
pub fn consumer_factory(cfg: OutboxConfig, health: Arc<OutboxHealth>) -> Arc<dyn ConsumerFactory> {
    Arc::new(RelayFactory { cfg, health })
}

struct RelayFactory {
    cfg: OutboxConfig,
    health: Arc<OutboxHealth>,
}

impl ConsumerFactory for RelayFactory {
    fn build<'a>(
        &'a self,
        session: &'a Session<'a>,
    ) -> BoxFuture<'a, Result<Box<dyn Consumer>, ConsumerError>> {
        let publisher = session.publisher("outbox");
        let built = publish::Publisher::fenced(&publisher, self.cfg.clone())
            .map_err(|e| ConsumerError::new(Retry::Never, e))
            .map(|p| {
                let relay = Relay::new(
                    self.cfg.clone(),
                    p,
                    self.health.clone(),
                    session.health.clone(),
                );
                Box::new(relay) as Box<dyn Consumer>
            });
        Box::pin(async move { built })
    }
}
