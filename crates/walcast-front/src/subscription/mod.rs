//! `postgres_changes` on this front: a client's subscriptions to a table's changes, from
//! the join (or SSE request) to each change delivered.
//!
//! * [`subscribe`]: a transport's subscription, the same for every transport: verify the
//!   subscriber, make each binding a subscription that delivers to the transport's sink,
//!   register them with the worker, keep the accepted.
//! * [`registry`]: this front's subscriptions by number and by class, each with its sink
//!   (the subscription registry's front side).
//! * [`registration`]: what this front tells the cdc-worker of its subscriptions
//!   ([`registration::Registration`]): register, unregister, the background queue, the
//!   periodic sync, a new leader's resync and roll call, the worker's notices.
//! * [`sink`]: where a subscription's changes go ([`sink::Sink`], one per transport: a
//!   WebSocket channel's gate, an SSE stream).
//! * [`fanout`]: the reader of this front's delivery subject: changes to their sinks, in
//!   the leader's order (`fanout::sequence`), behind the term and replay guards
//!   (`fanout::guards`), each encoded once (`fanout::encode`).
//! * [`source_watch`]: subscribers told when their project's source stops streaming, and
//!   when it streams again.

pub(crate) mod fanout;
pub(crate) mod registration;
pub(crate) mod registry;
pub(crate) mod sink;
pub(crate) mod source_watch;
pub(crate) mod subscribe;
