//! The consumer side of the walcast outbox: apply each event exactly once to your
//! Postgres database.
//!
//! The relay publishes every outbox event to a JetStream stream (`WALCAST_OUTBOX`,
//! subjects `walcast.outbox.<project>.<topic>`) with its id in `Nats-Msg-Id` and
//! `Walcast-Event-Id`. JetStream delivers at least once: after a crash, a lost ack or an
//! ack-wait expiry the same event comes again. [`InboxConsumer`] turns that into "applied
//! once": for each delivery it
//!
//! 1. begins a transaction on your database,
//! 2. inserts `(consumer_name, event_id)` into the inbox table, `ON CONFLICT DO NOTHING`,
//! 3. if the row is new, calls your [`Handler`] with the transaction and the [`Event`],
//! 4. commits, and only then acks (waiting for JetStream to confirm the ack).
//!
//! A redelivered event finds its inbox row, commits nothing and is acked: its side
//! effects, written through the same transaction, happen once whatever crashed where.
//! A failing handler rolls back (the inbox row with it), the message is nak'd with an
//! exponential backoff (`retry_base · 2^(n-1)`, at most `retry_max`) and comes back; the
//! last delivery `max_deliver` allows is terminated instead and counted. A message with
//! no usable event id cannot be de-duplicated: it is terminated and logged, never handled.
//!
//! ```no_run
//! use walcast_inbox::{ConsumerConfig, Event, Handler, HandlerError, Inbox, InboxConsumer};
//! use tokio_postgres::Transaction;
//! use tokio_util::sync::CancellationToken;
//!
//! struct Orders;
//!
//! impl Handler for Orders {
//!     async fn handle(&self, tx: &mut Transaction<'_>, event: &Event) -> Result<(), HandlerError> {
//!         let order: serde_json::Value = event.json()?;
//!         tx.execute("INSERT INTO shipments (order_id) VALUES ($1)", &[&order["id"].as_i64()])
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn run(db: tokio_postgres::Client, nats: async_nats::Client) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = Inbox::default(); // table walcast_inbox
//! inbox.migrate(&db).await?;
//! let js = async_nats::jetstream::new(nats);
//! let mut consumer = InboxConsumer::bind(&js, db, &inbox, ConsumerConfig::new("shipping")).await?;
//! let cancel = CancellationToken::new(); // cancel it to stop gracefully
//! consumer.run(&Orders, &cancel).await?;
//! # Ok(()) }
//! ```
//!
//! `examples/inbox_consumer.rs` is a runnable one. Metric names are in [`telemetry`]
//! (call [`telemetry::describe`] once the recorder is installed).
//!
//! What to know:
//! * Only side effects made through the transaction are exactly-once. Anything else the
//!   handler does (an HTTP call, a publish) happens again on a redelivery.
//! * Events are handled one at a time, in delivery order: per key (and per subject) that
//!   is the stream's order while nothing fails. A nak'd event comes back after later
//!   ones; set [`ConsumerConfig::max_ack_pending`] to `Some(1)` to hold everything behind
//!   it instead. For throughput, run several processes on the same durable: the inbox
//!   row's key serialises two that get the same event, and the second finds it applied.
//! * The inbox grows by one row per event; [`Inbox::prune`] deletes old rows. Keep them
//!   longer than the stream keeps events, or a late redelivery applies again.

mod backoff;
mod consumer;
mod error;
mod event;
mod inbox;
pub mod telemetry;

pub use consumer::{
    ConsumerConfig, Handler, HandlerError, InboxConsumer, Outcome, SettleHook, DEFAULT_ACK_WAIT,
    DEFAULT_BATCH_SIZE, DEFAULT_FETCH_WAIT, DEFAULT_MAX_DELIVER, DEFAULT_RETRY_BASE,
    DEFAULT_RETRY_MAX,
};
pub use error::InboxError;
pub use event::{
    headers, ChangeRecord, Event, EventError, EventId, ParseEventIdError, CHANGES_FILTER_SUBJECT,
    CHANGES_STREAM, DEFAULT_FILTER_SUBJECT, DEFAULT_STREAM, SUBJECT_PREFIX,
};
pub use inbox::{Inbox, DEFAULT_TABLE};
pub use walcast_core::ChangeId;
pub use walcast_core::Lsn;
