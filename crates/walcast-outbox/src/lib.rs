//! The transactional outbox relay (see `docs/outbox.md`).
//!
//! Applications emit events in their own transactions — `walcast.emit(topic, key,
//! payload, headers)` (a transactional logical message, no table written) or a row in an
//! insert-only outbox table (`walcast.outbox_create`) — and the leading cdc-worker's one
//! WAL read relays them to NATS JetStream in commit order: [`relay::Relay`] is a
//! [`walcast_cdc::consumer::Consumer`] next to realtime delivery, and the slot is
//! acknowledged past a transaction only once JetStream acknowledged every event of it
//! (`PubAck`), or the quarantine holds those it refused for good.
//!
//! - [`event`]: the events and their JetStream messages (pure);
//! - [`publish`]: the stream, sending, and transient vs permanent failures;
//! - [`quarantine`]: refused events, kept until `walcast outbox redrive`;
//! - [`backoff`], [`time`]: pure helpers; [`health`], [`telemetry`]: what operators see;
//! - [`maintain`]: partition maintenance (the leading cdc-worker runs it);
//! - [`redrive`], [`replay`] (paced by [`rate`]): what `walcast outbox redrive|replay` do.

pub mod backoff;
pub mod config;
pub mod event;
pub mod health;
pub mod maintain;
pub mod publish;
pub mod quarantine;
pub mod rate;
pub mod redrive;
pub mod relay;
pub mod replay;
pub mod telemetry;
pub mod time;

use std::sync::Arc;

pub use config::OutboxConfig;
pub use event::OutboxEvent;
pub use health::{OutboxHealth, OutboxHealthReport};
pub use relay::Relay;
use walcast_cdc::{CdcHealth, ConsumerFactory};

/// The schema holding every outbox table's partitions.
pub const PARTS_SCHEMA: &str = "walcast_outbox_parts";

/// A [`ConsumerFactory`] that makes a relay for each cdc session.
pub fn consumer_factory(
    cfg: OutboxConfig,
    nats: async_nats::Client,
    health: Arc<OutboxHealth>,
    cdc_health: Arc<CdcHealth>,
) -> ConsumerFactory {
    Arc::new(move || {
        Box::new(Relay::new(
            cfg.clone(),
            nats.clone(),
            health.clone(),
            cdc_health.clone(),
        ))
    })
}
