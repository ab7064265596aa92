//! The seam between decoding and what is done with the changes: a [`Consumer`] receives
//! every decoded transaction, in WAL order, from the driver.
//!
//! Realtime delivery (in `walcast-realtime`) is one consumer; another capability that
//! needs the WAL (an outbox relay, database broadcast) is another, added next to it
//! without touching the sources or the other consumers. A consumer:
//! - names the tables it needs ([`Consumer::tables`]): the sources decode the union of
//!   every consumer's tables;
//! - receives each transaction as [`Item`]s: its begin, each change (rows, TRUNCATE,
//!   transactional logical messages, of every consumer's tables, so it filters), its commit;
//! - may hold work ([`Consumer::has_pending`], [`Consumer::flush`]), flushed whenever the
//!   source has nothing waiting;
//! - says in [`Consumer::settle`], without waiting on anything slow, how far what it was
//!   handed is durable where it goes: the driver acknowledges the lowest such position of
//!   all consumers, so a crash replays and never skips, and no consumer waits for another;
//! - may refuse more for a while ([`Consumer::accepting`]): it is then handed the
//!   transactions it missed once it accepts again;
//! - publishes only through the [`crate::Publisher`] the session handed it, which checks
//!   the leadership term's fence before every message and stamps it with the origin,
//!   term and position (a consumer holds neither the bus nor the fence).

use futures_util::future::BoxFuture;
use walcast_wal2json::{Change, Lsn};

use crate::error::ConsumerError;
use crate::txn::TxnContext;

/// One step of a decoded transaction.
#[derive(Clone, Copy, Debug)]
pub enum Item<'a> {
    Begin(&'a TxnContext),
    /// A change of one of the decoded tables (any consumer's) or a transactional logical
    /// message, inside the transaction.
    Change(&'a TxnContext, &'a Change<'a>),
    /// Its end; `commit_lsn` is the position acknowledged once every consumer's barrier
    /// passed.
    Commit(&'a TxnContext),
}

/// What an item did to the consumer's [`Consumer::tables`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handled {
    Continue,
    /// `tables()` changed: after this transaction's commit the driver acknowledges it and
    /// restarts the source with the new filter, so what follows is decoded with it.
    TablesChanged,
}

/// When [`Consumer::refresh`] is called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refresh {
    /// Once per session, before the first line: load state (the filter is built after).
    Start,
    /// Periodically (`TABLE_FILTER_REFRESH_MS`), between transactions, everything up to
    /// `confirmed` acknowledged: re-read state as a safety net against drift.
    Check { confirmed: Lsn },
}

/// A consumer of decoded transactions (see the module docs). Methods return boxed futures
/// so that consumers of different types sit side by side behind `Box<dyn Consumer>`.
pub trait Consumer: Send {
    /// For logs.
    fn name(&self) -> &'static str;

    /// The `(schema, table)`s this consumer needs decoded, as of its current position.
    fn tables(&self) -> Vec<(String, String)>;

    /// Schemas whose every table this consumer needs decoded (tables created later
    /// included, without a restart).
    fn schemas(&self) -> Vec<String> {
        Vec::new()
    }

    /// The prefixes of the transactional logical messages this consumer needs decoded
    /// (`pg_logical_emit_message`): the sources decode the union of every consumer's.
    fn message_prefixes(&self) -> Vec<String> {
        Vec::new()
    }

    /// Load or re-check state; `true` if [`Consumer::tables`] changed.
    fn refresh(&mut self, _when: Refresh) -> BoxFuture<'_, Result<bool, ConsumerError>> {
        Box::pin(async { Ok(false) })
    }

    /// One step of a transaction, in WAL order.
    fn handle<'a>(&'a mut self, item: Item<'a>) -> BoxFuture<'a, Result<Handled, ConsumerError>>;

    /// Work is held, to be done by [`Consumer::flush`].
    fn has_pending(&self) -> bool {
        false
    }

    /// Do the held work (the driver calls it when the source has nothing waiting).
    fn flush(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async { Ok(()) })
    }

    /// Flush, then wait until everything handed over so far is durable where it goes.
    fn barrier(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>>;

    /// Without waiting on anything slow: the position up to which everything this
    /// consumer was handed is durable where it goes (at most `handed`, the commit of the
    /// last transaction it was handed or the source's caught-up position). The driver
    /// acknowledges the slot at the lowest such position of all consumers, and never waits
    /// for one consumer to hand the next transaction to the others. Default: the blocking
    /// [`Consumer::barrier`], then `handed`.
    fn settle(&mut self, handed: Lsn) -> BoxFuture<'_, Result<Lsn, ConsumerError>> {
        Box::pin(async move {
            self.barrier().await?;
            Ok(handed)
        })
    }

    /// Whether it takes more transactions now. `false` (its own bounded buffer is full):
    /// the driver stops handing it transactions, from the next one on, and keeps the slot's
    /// acknowledgement at its settled position; once it is `true` again the driver reads
    /// the WAL again from the slot's position and hands it only the transactions it has not
    /// had (the others get nothing twice).
    fn accepting(&self) -> bool {
        true
    }

    /// The source restarts from the last acknowledged commit: forget a partial
    /// transaction (its items come again).
    fn reset(&mut self) {}
}
