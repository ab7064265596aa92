//! Sending to JetStream with many messages in flight: the one pipelined sender the
//! outbox relay and the change streams share.
//!
//! - [`answers`]: messages go out as core NATS publishes whose reply subject is one of
//!   the sender's own (`<inbox>.<token>`, under one wildcard subscription), so
//!   JetStream's answers come back on that subscription, each naming its message by its
//!   token: no reply inbox, future or timer per message. Each answer is judged:
//!   stored, refused for good, or worth retrying.
//! - [`sender`]: a task of its own that owns the JetStream side, so that nothing a
//!   consumer's methods do waits on JetStream. It keeps a window of messages in flight,
//!   takes their answers in order, resends everything outstanding (in order, after a
//!   capped backoff) on a transient failure, and hands what each answer means to the
//!   consumer's [`sender::Outgoing`] (count it, skip it, quarantine it).
//!
//! Every message goes through the fence ([`crate::JetStreamPublisher`]); a tool beside
//! the pipeline that no lease governs may send directly on a client (the outbox's
//! redrive).

pub mod answers;
pub mod sender;

pub use answers::{Answer, Answers, Failure, Stored, Token};
pub use sender::{Outgoing, SenderHandle, SenderLimits, Stop};
