//! What the change stream's sender does with each message: the consumer hands each
//! committed transaction's messages to the pipeline's pipelined JetStream sender
//! ([`walcast_pipeline::jetstream::sender`], as the outbox relay does), which sends them
//! in order, many in flight, and resends on transient failures (no answer in time, NATS
//! or JetStream down). Here: how a message is sent (the stream made sure of first, its
//! headers), and what its answer means — counted, and checked for order, when stored;
//! skipped, reported and counted when refused for good (too large for the stream).

use std::sync::{Arc, Mutex};

use async_nats::jetstream::stream;
use async_nats::{HeaderMap, HeaderValue};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use walcast_core::{Backoff, ChangeId};
use walcast_pipeline::jetstream::{self, Failure, Stop};
use walcast_pipeline::{JetStreamPublisher, PipelineHealth, Position, PublishError};

use crate::config::ChangeStreamConfig;
use crate::telemetry;

/// Header names of a change-stream message besides the publisher's.
pub mod headers {
    /// JetStream's de-duplication id: [`walcast_core::ChangeId::msg_id`].
    pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
    /// The event id an inbox records: [`walcast_core::ChangeId::uuid`].
    pub const EVENT_ID: &str = "Walcast-Event-Id";
    pub const PROJECT: &str = "Walcast-Project";
    pub const COMMIT_LSN: &str = "Walcast-Commit-Lsn";
}

/// One message of the change stream.
#[derive(Clone, Debug)]
pub struct StreamMessage {
    pub subject: String,
    pub id: ChangeId,
    pub payload: Bytes,
    /// `schema.table`, for reports.
    pub table: String,
}

/// The consumer's handle on its sender task.
pub(crate) type SenderHandle = jetstream::SenderHandle<StreamOut>;

/// Start the change stream's sender, publishing through `js`.
pub(crate) fn spawn(
    cfg: ChangeStreamConfig,
    js: JetStreamPublisher,
    health: Arc<PipelineHealth>,
    stored: Stored,
) -> SenderHandle {
    let limits = jetstream::SenderLimits {
        max_in_flight: cfg.max_in_flight,
        ack_timeout: cfg.ack_timeout,
        retry: Backoff {
            base: std::time::Duration::from_millis(100),
            cap: std::time::Duration::from_secs(10),
        },
    };
    let out = StreamOut {
        cfg,
        js,
        health,
        stream_ready: false,
        stored,
        last_fresh: None,
    };
    SenderHandle::spawn(out, limits)
}

/// The change-stream side of the consumer's sender.
pub(crate) struct StreamOut {
    cfg: ChangeStreamConfig,
    js: JetStreamPublisher,
    health: Arc<PipelineHealth>,
    stream_ready: bool,
    /// The newest position JetStream stored a message of (not as a duplicate), kept
    /// across the sessions of this process.
    stored: Stored,
    /// The last position this sender stored (not as a duplicate).
    last_fresh: Option<(walcast_core::Lsn, u32)>,
}

/// See [`StreamOut`]'s `stored`.
pub(crate) type Stored = Arc<Mutex<Option<(walcast_core::Lsn, u32)>>>;

/// The [`Stored`] of a source's messages to a stream in this process: kept across its
/// sessions and leadership terms (a lost publish is often resent by the next session).
pub(crate) fn stored_for(stream: &str, source: &str) -> Stored {
    type All = Mutex<std::collections::HashMap<(String, String), Stored>>;
    static ALL: std::sync::OnceLock<All> = std::sync::OnceLock::new();
    let all = ALL.get_or_init(Default::default);
    let mut all = all.lock().unwrap_or_else(|p| p.into_inner());
    all.entry((stream.to_string(), source.to_string()))
        .or_default()
        .clone()
}

impl StreamOut {
    /// The message's headers besides the publisher's.
    fn headers(m: &StreamMessage) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            headers::NATS_MSG_ID,
            HeaderValue::from(m.id.msg_id().as_str()),
        );
        h.insert(headers::EVENT_ID, HeaderValue::from(m.id.uuid().as_str()));
        h.insert(headers::PROJECT, HeaderValue::from(m.id.project.as_str()));
        let lsn = m.id.commit_lsn.to_string();
        h.insert(headers::COMMIT_LSN, HeaderValue::from(lsn.as_str()));
        h
    }

    /// Count a change stored after a later one (README "Change streams", Order): stored
    /// now (not a duplicate) below a position stored before in this process, or a
    /// duplicate (stored earlier) above the last one this sender stored now.
    fn check_order(&mut self, id: &ChangeId, duplicate: bool) {
        let at = (id.commit_lsn, id.seq);
        let mut stored = self.stored.lock().unwrap_or_else(|p| p.into_inner());
        let reordered = match duplicate {
            false => stored.is_some_and(|s| s > at),
            true => self.last_fresh.take_if(|f| *f < at).is_some(),
        };
        if !duplicate {
            *stored = (*stored).max(Some(at));
            self.last_fresh = Some(at);
        }
        if reordered {
            metrics::counter!(telemetry::CHANGE_STREAM_REORDERED).increment(1);
            tracing::warn!(msg_id = %id, duplicate, "change stream: a change was stored after a later one (a publish was lost and resent)");
        }
    }
}

impl jetstream::Outgoing for StreamOut {
    type Item = StreamMessage;
    type Error = PublishError;
    const NAME: &'static str = "change-stream";

    fn client(&self) -> async_nats::Client {
        self.js.client().clone()
    }

    fn send<'a>(
        &'a mut self,
        m: &'a StreamMessage,
        reply: String,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            if !self.stream_ready {
                ensure_stream(self.js.context(), &self.cfg)
                    .await
                    .map_err(|e| {
                        tracing::warn!(stream = %self.cfg.stream, error = %e, "change stream: cannot create or update the stream; retrying");
                        Failure::Transient(format!("stream {}: {e}", self.cfg.stream))
                    })?;
                self.stream_ready = true;
            }
            let at = Position::change(m.id.commit_lsn, m.id.seq);
            let (subject, payload) = (m.subject.clone(), m.payload.clone());
            self.js
                .publish_with_reply(subject, reply, at, Self::headers(m), payload)
                .await
                .map_err(Failure::from_publish)
        })
    }

    fn stream_lost(&mut self) {
        self.stream_ready = false;
    }

    fn subject(&self, m: &StreamMessage) -> String {
        m.subject.clone()
    }

    fn stored(&mut self, m: StreamMessage, duplicate: bool, waited: std::time::Duration) {
        self.check_order(&m.id, duplicate);
        let dup = if duplicate { "true" } else { "false" };
        metrics::counter!(telemetry::CHANGE_STREAM_PUBLISHED, "duplicate" => dup).increment(1);
        metrics::histogram!(telemetry::CHANGE_STREAM_ACK_SECONDS).record(waited.as_secs_f64());
    }

    /// Never storable (too large for the stream, no stream listening after it was
    /// made again): skipped, reported, counted.
    fn refused<'a>(
        &'a mut self,
        m: &'a StreamMessage,
        kind: &'static str,
        error: String,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        metrics::counter!(telemetry::CHANGE_STREAM_FAILURES, "kind" => kind).increment(1);
        let reason = match kind {
            "too_large" => "payload_too_large",
            _ => "change_stream_refused",
        };
        self.health.report_skip(
            &m.table,
            Some(m.id.commit_lsn),
            reason,
            &format!("change stream refused it: {error}"),
        );
        Box::pin(std::future::ready(Ok(())))
    }

    fn retrying(&mut self, error: &str, wait: std::time::Duration, pending: usize) {
        metrics::counter!(telemetry::CHANGE_STREAM_FAILURES, "kind" => "transient").increment(1);
        tracing::warn!(
            error,
            retry_in_ms = wait.as_millis() as u64,
            pending,
            "change-stream publish failed; resending"
        );
    }

    fn stopped(&self, why: Stop) -> PublishError {
        match why {
            Stop::Fenced(f) => PublishError::Fenced(f),
            Stop::AnswersClosed => PublishError::Bus(walcast_bus::BusError::Closed(
                "JetStream's answers stopped coming: the NATS connection closed",
            )),
        }
    }
}

/// Create the stream, or update it to the settings (JetStream's `Context` only: the
/// sender's answers are not `Sync`).
async fn ensure_stream(
    js: &async_nats::jetstream::Context,
    cfg: &ChangeStreamConfig,
) -> Result<(), String> {
    let config = stream::Config {
        name: cfg.stream.clone(),
        subjects: vec![walcast_bus::subject::CHANGES_ALL.to_string()],
        num_replicas: cfg.replicas,
        max_age: cfg.max_age,
        max_bytes: cfg.max_bytes,
        duplicate_window: cfg.duplicate_window,
        storage: stream::StorageType::File,
        ..Default::default()
    };
    js.create_or_update_stream(config)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(stream = %cfg.stream, "change stream ready");
    Ok(())
}
