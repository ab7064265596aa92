//! The durable pull consumer and its run loop: one transaction per delivery, the inbox
//! row and the handler's side effects in it, the ack after the commit.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::{self, Batch};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use tokio_postgres::{Client, Statement, Transaction};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::event::{DEFAULT_FILTER_SUBJECT, DEFAULT_STREAM};
use crate::{backoff, inbox, telemetry, Event, EventError, Inbox, InboxError};

/// Default [`ConsumerConfig::ack_wait`].
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Default [`ConsumerConfig::max_deliver`].
pub const DEFAULT_MAX_DELIVER: i64 = 10;
/// Default [`ConsumerConfig::batch_size`].
pub const DEFAULT_BATCH_SIZE: usize = 32;
/// Default [`ConsumerConfig::fetch_wait`].
pub const DEFAULT_FETCH_WAIT: Duration = Duration::from_secs(5);
/// Default [`ConsumerConfig::retry_base`].
pub const DEFAULT_RETRY_BASE: Duration = Duration::from_secs(1);
/// Default [`ConsumerConfig::retry_max`].
pub const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(300);

/// Backoff between failed pull requests (the NATS connection is down, the consumer was
/// deleted …).
const FETCH_RETRY_BASE: Duration = Duration::from_millis(100);
const FETCH_RETRY_MAX: Duration = Duration::from_secs(5);

/// The durable consumer's settings. [`ConsumerConfig::new`] gives the defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumerConfig {
    /// The JetStream stream (default `WALCAST_OUTBOX`).
    pub stream: String,
    /// The durable consumer's name; also the `consumer_name` of its inbox rows, so two
    /// durables on the same stream each apply every event once.
    pub durable: String,
    /// Which subjects to consume (default `walcast.outbox.>`, every project and topic).
    pub filter_subject: String,
    /// How long JetStream waits for an ack before delivering again. Longer than a
    /// handler's transaction takes, times `batch_size` (a fetched batch is handled one
    /// message after the other and every message's clock runs from its delivery).
    pub ack_wait: Duration,
    /// Deliveries of one message at most (-1: no limit). The last allowed delivery that
    /// fails is terminated (`+TERM`) and counted in
    /// [`GAVE_UP`](crate::telemetry::GAVE_UP); JetStream would stop there anyway and
    /// publish a `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES` advisory, which a
    /// redelivery by ack-wait expiry can still reach.
    pub max_deliver: i64,
    /// Deliveries not yet acked at most across this durable (`None`: the server's
    /// default, 1000). `Some(1)` keeps per-key order even across failures, as a nak'd
    /// event would otherwise come back after later ones.
    pub max_ack_pending: Option<i64>,
    /// Messages asked for per pull request.
    pub batch_size: usize,
    /// How long a pull request waits for messages when there are none; also how long
    /// a cancelled consumer may take to stop. Less than `ack_wait`.
    pub fetch_wait: Duration,
    /// Delay of the nak after a delivery's first failure, doubled after each further
    /// failure of the same message …
    pub retry_base: Duration,
    /// … up to this.
    pub retry_max: Duration,
}

impl ConsumerConfig {
    /// The defaults for the durable consumer `durable` of the change streams
    /// (`WALCAST_CHANGES`, every project's tables: narrow `filter_subject` to
    /// `walcast.changes.<project>.>` or one table's subject).
    pub fn changes(durable: impl Into<String>) -> ConsumerConfig {
        ConsumerConfig {
            stream: crate::event::CHANGES_STREAM.into(),
            filter_subject: crate::event::CHANGES_FILTER_SUBJECT.into(),
            ..ConsumerConfig::new(durable)
        }
    }

    /// The defaults, for the durable consumer `durable`.
    pub fn new(durable: impl Into<String>) -> ConsumerConfig {
        ConsumerConfig {
            stream: DEFAULT_STREAM.into(),
            durable: durable.into(),
            filter_subject: DEFAULT_FILTER_SUBJECT.into(),
            ack_wait: DEFAULT_ACK_WAIT,
            max_deliver: DEFAULT_MAX_DELIVER,
            max_ack_pending: None,
            batch_size: DEFAULT_BATCH_SIZE,
            fetch_wait: DEFAULT_FETCH_WAIT,
            retry_base: DEFAULT_RETRY_BASE,
            retry_max: DEFAULT_RETRY_MAX,
        }
    }

    /// Check the settings without contacting anything.
    pub fn validate(&self) -> Result<(), InboxError> {
        let bad = |what: String| Err(InboxError::Config(what));
        for (what, name) in [("stream", &self.stream), ("durable", &self.durable)] {
            if name.is_empty()
                || name
                    .chars()
                    .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
            {
                return bad(format!(
                    "{what} name {name:?} must be non-empty, without whitespace, '.', '*', '>', '/' or '\\'"
                ));
            }
        }
        if self.filter_subject.is_empty() {
            return bad("filter_subject is empty".into());
        }
        if self.max_deliver == 0 || self.max_deliver < -1 {
            return bad(format!(
                "max_deliver {} must be -1 (no limit) or at least 1",
                self.max_deliver
            ));
        }
        if self.max_ack_pending.is_some_and(|n| n < 1) {
            return bad("max_ack_pending must be at least 1".into());
        }
        if self.batch_size == 0 {
            return bad("batch_size must be at least 1".into());
        }
        let zero = [
            ("ack_wait", self.ack_wait),
            ("fetch_wait", self.fetch_wait),
            ("retry_base", self.retry_base),
        ];
        if let Some((what, _)) = zero.iter().find(|(_, d)| d.is_zero()) {
            return bad(format!("{what} must be more than zero"));
        }
        if self.fetch_wait >= self.ack_wait {
            return bad(
                "fetch_wait must be less than ack_wait (messages held while a stopping \
                 consumer waits for its pull request to end must not expire)"
                    .into(),
            );
        }
        if self.retry_max < self.retry_base {
            return bad("retry_max must not be less than retry_base".into());
        }
        Ok(())
    }

    fn pull_config(&self) -> pull::Config {
        pull::Config {
            durable_name: Some(self.durable.clone()),
            description: Some("walcast inbox consumer".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver,
            filter_subject: self.filter_subject.clone(),
            max_ack_pending: self.max_ack_pending.unwrap_or_default(),
            ..Default::default()
        }
    }
}

/// What a handler returns when it fails: anything that is an error. The delivery is
/// rolled back and tried again later.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// Applies events: runs in the transaction that also records the event in the inbox.
///
/// Do every side effect through `tx` (or make it idempotent by other means): the
/// transaction commits only when `handle` returns `Ok`, then the message is acked. A
/// side effect outside the transaction (an HTTP call, a publish) may happen more than
/// once. Do not commit or roll back `tx` yourself.
pub trait Handler: Send + Sync {
    /// Apply `event` inside `tx`. An error rolls everything back (the inbox row too) and
    /// the event is delivered again after a backoff.
    fn handle(
        &self,
        tx: &mut Transaction<'_>,
        event: &Event,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// What became of one delivery of an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// New: the handler ran and its transaction (with the inbox row) committed; acked.
    Applied,
    /// Already in the inbox: nothing applied; acked.
    Duplicate,
    /// The handler or the transaction failed: rolled back; nak'd, to come back after
    /// `delay`.
    Retry {
        /// The nak's delay.
        delay: Duration,
    },
    /// The last allowed delivery failed: rolled back; terminated, not applied.
    GaveUp,
}

impl Outcome {
    fn ack_kind(self) -> AckKind {
        match self {
            Outcome::Applied | Outcome::Duplicate => AckKind::Ack,
            Outcome::Retry { delay } => AckKind::Nak(Some(delay)),
            Outcome::GaveUp => AckKind::Term,
        }
    }
}

/// Called with each event and its outcome after its transaction ended and before the
/// message is acked, nak'd or terminated. For instrumentation and fault injection in
/// tests (a hook that never returns is a consumer that died between commit and ack);
/// keep it short, the ack wait runs meanwhile.
pub type SettleHook = Arc<dyn Fn(&Event, &Outcome) -> BoxFuture<'static, ()> + Send + Sync>;

/// A failure of one delivery's transaction.
enum Failure {
    Handler(HandlerError),
    Database(&'static str, tokio_postgres::Error),
}

/// A durable JetStream pull consumer applying each event exactly once to Postgres.
pub struct InboxConsumer {
    config: ConsumerConfig,
    db: Client,
    claim: Statement,
    consumer: PullConsumer,
    before_settle: Option<SettleHook>,
}

impl InboxConsumer {
    /// Create (or update to `config`) the durable consumer on its stream, and prepare
    /// the inbox insert on `db`, the connection every delivery's transaction uses. The
    /// inbox table must exist ([`Inbox::migrate`]).
    pub async fn bind(
        js: &jetstream::Context,
        db: Client,
        inbox: &Inbox,
        config: ConsumerConfig,
    ) -> Result<InboxConsumer, InboxError> {
        config.validate()?;
        let stream = js
            .get_stream(&config.stream)
            .await
            .map_err(|source| InboxError::Stream {
                stream: config.stream.clone(),
                source,
            })?;
        let consumer = stream
            .create_consumer(config.pull_config())
            .await
            .map_err(|source| InboxError::Consumer {
                stream: config.stream.clone(),
                durable: config.durable.clone(),
                source,
            })?;
        let claim = inbox.prepare_claim(&db).await?;
        info!(stream = %config.stream, durable = %config.durable,
              filter = %config.filter_subject, inbox = %inbox.table_sql(), "inbox consumer bound");
        Ok(InboxConsumer {
            config,
            db,
            claim,
            consumer,
            before_settle: None,
        })
    }

    /// Call `hook` with every event's outcome between the end of its transaction and
    /// the ack (see [`SettleHook`]).
    pub fn before_settle(mut self, hook: SettleHook) -> InboxConsumer {
        self.before_settle = Some(hook);
        self
    }

    /// The settings it was bound with.
    pub fn config(&self) -> &ConsumerConfig {
        &self.config
    }

    /// The Postgres connection back.
    pub fn into_client(self) -> Client {
        self.db
    }

    /// Fetch batches and handle their messages one after the other until `cancel`.
    /// Cancelling lets the message being handled finish (commit and ack), waits for the
    /// open pull request to end (at most [`ConsumerConfig::fetch_wait`]), naks the
    /// fetched messages not started (they come back first, in order) and returns `Ok`.
    /// Returns an error only when retrying cannot help ([`InboxError::ConnectionLost`]:
    /// connect again and bind a new consumer); failed pull requests are retried with a
    /// backoff.
    pub async fn run<H: Handler>(
        &mut self,
        handler: &H,
        cancel: &CancellationToken,
    ) -> Result<(), InboxError> {
        info!(durable = %self.config.durable, "inbox consumer running");
        let mut failures = 0;
        while !cancel.is_cancelled() {
            match self.run_batch(handler, cancel).await {
                Ok(()) => failures = 0,
                Err(Stop::Fatal(e)) => {
                    error!(durable = %self.config.durable, error = %e, "inbox consumer stopped");
                    return Err(e);
                }
                Err(Stop::Fetch(e)) => {
                    failures += 1;
                    let delay = backoff::delay(FETCH_RETRY_BASE, FETCH_RETRY_MAX, failures);
                    metrics::counter!(telemetry::FETCH_ERRORS, "consumer" => self.config.durable.clone())
                        .increment(1);
                    warn!(durable = %self.config.durable, error = %e, ?delay, "pull request failed; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => {}
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        info!(durable = %self.config.durable, "inbox consumer stopped (cancelled)");
        Ok(())
    }

    /// One pull request and its messages.
    async fn run_batch<H: Handler>(
        &mut self,
        handler: &H,
        cancel: &CancellationToken,
    ) -> Result<(), Stop> {
        let request = self
            .consumer
            .batch()
            .max_messages(self.config.batch_size)
            .expires(self.config.fetch_wait)
            .messages();
        // Not abandoned on cancel: a request sent and forgotten would still be handed
        // messages, which would come back only after the ack wait.
        let mut batch = request.await.map_err(|e| Stop::Fetch(Box::new(e)))?;
        loop {
            let next = tokio::select! {
                biased;
                _ = cancel.cancelled() => None,
                next = batch.next() => Some(next),
            };
            let message = match next {
                None => {
                    self.release(batch, None).await;
                    return Ok(());
                }
                Some(None) => return Ok(()),
                Some(Some(Err(e))) => return Err(Stop::Fetch(e)),
                Some(Some(Ok(message))) => message,
            };
            if let Err((e, message)) = self.process(handler, message).await {
                // Its commit may or may not have happened: let it come back now, the
                // inbox tells.
                self.release(batch, Some(message)).await;
                return Err(Stop::Fatal(e));
            }
        }
    }

    /// Nak (without delay) `failed` and every other message of `batch` not handled, in
    /// order, once the batch's pull request is over: JetStream delivers them again
    /// before any later message, so whoever consumes next keeps the stream's order.
    /// Waiting for the end of the request (its count reached, or `fetch_wait`) matters:
    /// nak'd while it is open, a message could be handed straight back to it, and a
    /// request abandoned while open is still handed new messages, which then come back
    /// only after the ack wait (nats-server 2.9 does not drop it when the subscription
    /// goes).
    async fn release(&self, mut batch: Batch, failed: Option<jetstream::Message>) {
        let mut unhandled = Vec::from_iter(failed);
        while let Some(Ok(message)) = batch.next().await {
            unhandled.push(message);
        }
        drop(batch);
        for message in &unhandled {
            self.settle(message, AckKind::Nak(None)).await;
        }
        if !unhandled.is_empty() {
            debug!(
                released = unhandled.len(),
                "released the batch's unhandled messages"
            );
        }
    }

    /// Handle one message: transaction, hook, ack/nak/term.
    async fn process<H: Handler>(
        &mut self,
        handler: &H,
        message: jetstream::Message,
    ) -> Result<(), (InboxError, jetstream::Message)> {
        let event = match Event::from_message(&message) {
            Ok(event) => event,
            Err(e) => {
                self.unidentified(&message, &e).await;
                return Ok(());
            }
        };
        let span = info_span!("inbox_event", event_id = %event.id,
                              delivered = event.delivered, subject = %event.subject);
        async {
            let outcome = match self.apply(handler, &event).await {
                Ok(outcome) => outcome,
                // Not settled here: released with the rest of the batch.
                Err(e) => return Err((e, message)),
            };
            if let Some(hook) = &self.before_settle {
                hook(&event, &outcome).await;
            }
            self.settle(&message, outcome.ack_kind()).await;
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// The delivery's transaction and what became of it (logged and counted).
    async fn apply<H: Handler>(
        &mut self,
        handler: &H,
        event: &Event,
    ) -> Result<Outcome, InboxError> {
        let name = self.config.durable.as_str();
        let claim_as = event.inbox_name(name);
        let (reason, error) = match transact(&mut self.db, &self.claim, &claim_as, handler, event)
            .await
        {
            Ok(outcome) => {
                let metric = match outcome {
                    Outcome::Duplicate => {
                        info!("already applied (a redelivery or a duplicate): acking");
                        telemetry::DUPLICATES
                    }
                    _ => {
                        debug!("applied");
                        telemetry::APPLIED
                    }
                };
                metrics::counter!(metric, "consumer" => name.to_string()).increment(1);
                return Ok(outcome);
            }
            Err(Failure::Handler(e)) => ("handler", e),
            Err(Failure::Database(context, source)) if self.db.is_closed() => {
                return Err(InboxError::ConnectionLost { context, source });
            }
            Err(Failure::Database(context, e)) => ("database", format!("{context}: {e}").into()),
        };
        Ok(self.retry_or_give_up(event, reason, &*error))
    }

    fn retry_or_give_up(
        &self,
        event: &Event,
        reason: &'static str,
        error: &(dyn std::error::Error + Send + Sync),
    ) -> Outcome {
        let c = &self.config;
        let consumer = c.durable.clone();
        if c.max_deliver > 0 && event.delivered >= c.max_deliver {
            metrics::counter!(telemetry::GAVE_UP, "consumer" => consumer).increment(1);
            error!(reason, error = %error, max_deliver = c.max_deliver,
                   "last allowed delivery failed: rolled back, terminating the message");
            return Outcome::GaveUp;
        }
        let delay = backoff::delay(c.retry_base, c.retry_max, event.delivered);
        metrics::counter!(telemetry::RETRIES, "consumer" => consumer, "reason" => reason)
            .increment(1);
        warn!(reason, error = %error, ?delay, "delivery failed: rolled back, retrying after a delay");
        Outcome::Retry { delay }
    }

    /// A message without a usable event id: terminated, since it cannot be
    /// de-duplicated (handling it could apply it twice).
    async fn unidentified(&self, message: &jetstream::Message, e: &EventError) {
        let sequence = message
            .info()
            .map(|i| i.stream_sequence)
            .unwrap_or_default();
        error!(subject = %message.subject, stream_sequence = sequence, error = %e,
               "terminating a message without a usable event id: it cannot be de-duplicated");
        metrics::counter!(telemetry::UNIDENTIFIED,
            "consumer" => self.config.durable.clone(), "reason" => e.reason())
        .increment(1);
        self.settle(message, AckKind::Term).await;
    }

    /// Ack, nak or terminate, waiting for JetStream's confirmation; a failure is
    /// logged and counted: the message comes back after the ack wait.
    async fn settle(&self, message: &jetstream::Message, kind: AckKind) {
        if let Err(e) = message.double_ack_with(kind).await {
            metrics::counter!(telemetry::SETTLE_ERRORS, "consumer" => self.config.durable.clone())
                .increment(1);
            warn!(?kind, error = %e, "could not settle the delivery; it comes back after the ack wait");
        }
    }
}

/// Why [`InboxConsumer::run_batch`] ended early.
enum Stop {
    /// The pull request failed: retried after a backoff.
    Fetch(async_nats::Error),
    /// Retrying cannot help: `run` returns it.
    Fatal(InboxError),
}

/// BEGIN; claim the inbox row; if new, the handler; COMMIT. Dropping a transaction not
/// committed rolls it back.
async fn transact<H: Handler>(
    db: &mut Client,
    claim: &Statement,
    consumer: &str,
    handler: &H,
    event: &Event,
) -> Result<Outcome, Failure> {
    let mut tx = db
        .transaction()
        .await
        .map_err(|e| Failure::Database("BEGIN", e))?;
    let new = inbox::claim(&tx, claim, consumer, event.id)
        .await
        .map_err(|e| Failure::Database("inserting into the inbox", e))?;
    if new {
        if let Err(e) = handler.handle(&mut tx, event).await {
            // A failed rollback leaves nothing behind either: the server ends the
            // transaction when the connection goes.
            let _ = tx.rollback().await;
            return Err(Failure::Handler(e));
        }
    }
    tx.commit()
        .await
        .map_err(|e| Failure::Database("COMMIT", e))?;
    Ok(if new {
        Outcome::Applied
    } else {
        Outcome::Duplicate
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid() {
        let c = ConsumerConfig::new("billing");
        c.validate().expect("defaults");
        assert_eq!(c.stream, "WALCAST_OUTBOX");
        assert_eq!(c.filter_subject, "walcast.outbox.>");
        let p = c.pull_config();
        assert_eq!(p.durable_name.as_deref(), Some("billing"));
        assert_eq!(p.ack_policy, AckPolicy::Explicit);
        assert_eq!(p.max_deliver, DEFAULT_MAX_DELIVER);
    }

    #[test]
    fn invalid_settings_are_config_errors() {
        type Change = fn(&mut ConsumerConfig);
        let cases: [(&str, Change); 9] = [
            ("durable", |c| c.durable = "a.b".into()),
            ("stream", |c| c.stream = String::new()),
            ("max_deliver", |c| c.max_deliver = 0),
            ("batch_size", |c| c.batch_size = 0),
            ("ack_wait", |c| c.ack_wait = Duration::ZERO),
            ("retry_max", |c| c.retry_max = Duration::from_millis(1)),
            ("max_ack_pending", |c| c.max_ack_pending = Some(0)),
            ("filter_subject", |c| c.filter_subject = String::new()),
            ("fetch_wait", |c| c.fetch_wait = c.ack_wait),
        ];
        for (what, change) in cases {
            let mut c = ConsumerConfig::new("billing");
            change(&mut c);
            let err = c.validate().expect_err(what);
            assert!(matches!(err, InboxError::Config(_)), "{what}: {err}");
            assert!(err.to_string().contains(what), "{what}: {err}");
        }
    }

    #[test]
    fn outcomes_settle_as_ack_nak_or_term() {
        let delay = Duration::from_secs(2);
        assert!(matches!(Outcome::Applied.ack_kind(), AckKind::Ack));
        assert!(matches!(Outcome::Duplicate.ack_kind(), AckKind::Ack));
        assert!(matches!(Outcome::Retry { delay }.ack_kind(), AckKind::Nak(Some(d)) if d == delay));
        assert!(matches!(Outcome::GaveUp.ack_kind(), AckKind::Term));
    }
}
