//! The copy-both replication stream.

use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use walcast_core::Lsn;

use crate::conn::{server_error, Backend, Conn};
use crate::messages::{encode_standby_status, parse_copy_data, pg_now_micros, ReplEvent};
use crate::ReplError;

/// A running `START_REPLICATION ... LOGICAL` stream. Made by
/// [`ReplicationClient::start_logical`](crate::ReplicationClient::start_logical).
pub struct ReplicationStream {
    conn: Conn,
    /// The server sent CopyDone: no more data will come.
    server_done: bool,
    /// We sent CopyDone.
    client_done: bool,
    /// An error ended the stream; every further call fails with `Closed`.
    failed: bool,
    /// Highest `wal_end` seen in any message.
    last_wal_end: Lsn,
}

impl ReplicationStream {
    pub(crate) fn new(conn: Conn) -> ReplicationStream {
        ReplicationStream {
            conn,
            server_done: false,
            client_done: false,
            failed: false,
            last_wal_end: Lsn::ZERO,
        }
    }

    /// The next event; `Ok(None)` once the server has ended the copy (then call
    /// [`stop`](Self::stop)).
    ///
    /// Cancel-safe: it can be a branch of `tokio::select!` (e.g. against a timer). Bytes
    /// read before the future is dropped stay buffered in the stream.
    ///
    /// An `ErrorResponse` (e.g. the slot was dropped or terminated) is returned as
    /// [`ReplError::Server`]; the stream is then dead and later calls return
    /// [`ReplError::Closed`].
    pub async fn next_event(&mut self) -> Result<Option<ReplEvent>, ReplError> {
        if self.failed {
            return Err(ReplError::Closed);
        }
        if self.server_done {
            return Ok(None);
        }
        let result = self.read_event().await;
        if result.is_err() {
            self.failed = true;
        }
        result
    }

    async fn read_event(&mut self) -> Result<Option<ReplEvent>, ReplError> {
        loop {
            match self.conn.read().await? {
                Backend::Msg(Message::CopyData(body)) => {
                    let event = parse_copy_data(body.into_bytes())?;
                    let wal_end = match &event {
                        ReplEvent::XLogData { wal_end, .. } => *wal_end,
                        ReplEvent::Keepalive { wal_end, .. } => *wal_end,
                    };
                    self.last_wal_end = self.last_wal_end.max(wal_end);
                    return Ok(Some(event));
                }
                Backend::Msg(Message::CopyDone) => {
                    self.server_done = true;
                    return Ok(None);
                }
                Backend::Msg(Message::ErrorResponse(body)) => return Err(server_error(&body)),
                other => self.conn.ignore_or_reject(other, "replication streaming")?,
            }
        }
    }

    /// Standby status update: written = flushed = applied = `flushed`, the position up to
    /// which the caller has durably handled the stream, stamped with the current time.
    /// `reply` asks the server for a keepalive in return.
    ///
    /// The server moves the slot's `confirmed_flush_lsn` to `flushed` (never to `0/0`).
    /// When every `XLogData` before a keepalive has been handled, the keepalive's
    /// `wal_end` is a safe value to report.
    pub async fn send_status(&mut self, flushed: Lsn, reply: bool) -> Result<(), ReplError> {
        self.send_status_full(flushed, flushed, flushed, reply)
            .await
    }

    /// Standby status update with separate written / flushed / applied positions.
    pub async fn send_status_full(
        &mut self,
        written: Lsn,
        flushed: Lsn,
        applied: Lsn,
        reply: bool,
    ) -> Result<(), ReplError> {
        if self.failed || self.client_done {
            return Err(ReplError::Closed);
        }
        encode_standby_status(
            &mut self.conn.wbuf,
            written,
            flushed,
            applied,
            pg_now_micros(),
            reply,
        );
        if let Err(e) = self.conn.flush().await {
            self.failed = true;
            return Err(e);
        }
        Ok(())
    }

    /// The highest server WAL end seen in any message so far.
    pub fn last_wal_end(&self) -> Lsn {
        self.last_wal_end
    }

    /// End the copy (CopyDone), drain what the server still sends until `ReadyForQuery`,
    /// and close the connection.
    ///
    /// Data still in flight is discarded: report progress with
    /// [`send_status`](Self::send_status) before stopping. The server finishes the
    /// transaction it is decoding before it answers, so this can take a while after a
    /// large transaction; wrap it in a timeout if that matters.
    pub async fn stop(mut self) -> Result<(), ReplError> {
        if self.failed {
            self.conn.close().await;
            return Ok(());
        }
        let result = self.finish_copy().await;
        self.conn.close().await;
        result
    }

    async fn finish_copy(&mut self) -> Result<(), ReplError> {
        if !self.client_done {
            frontend::copy_done(&mut self.conn.wbuf);
            self.client_done = true;
            self.conn.flush().await?;
        }
        let mut error = None;
        let mut drained = 0usize;
        loop {
            match self.conn.read().await? {
                Backend::Msg(Message::CopyData(_)) => drained += 1,
                Backend::Msg(Message::CopyDone) => self.server_done = true,
                Backend::Msg(Message::CommandComplete(_)) => {}
                Backend::Msg(Message::ErrorResponse(body)) => {
                    error.get_or_insert(server_error(&body));
                }
                Backend::Msg(Message::ReadyForQuery(_)) => break,
                other => self.conn.ignore_or_reject(other, "the end of streaming")?,
            }
        }
        tracing::debug!(drained, "replication stream stopped");
        match error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
