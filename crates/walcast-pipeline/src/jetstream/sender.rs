//! The pipelined sender: a task that sends a consumer's messages to JetStream, in order,
//! many in flight, and hands what each answer means to the consumer.
//!
//! The consumer hands it messages in commit order, a run of them at a time (one wake-up
//! for many while a backlog drains), through an unbounded channel (the consumer bounds
//! what is outstanding, counting [`SenderHandle::done`]). The task sends each without
//! waiting for its answer (at most `max_in_flight` outstanding; later ones stay queued,
//! unsent, in order) and takes the answers in order: stored; refused for good (the
//! consumer skips or quarantines it); or — a transient failure, or no answer within the
//! timeout — resent with everything after it, in order, after a capped exponential
//! backoff (JetStream's duplicate window drops what had already landed). "No stream
//! listens" re-creates the stream first, and is a refusal only the second time in a row.
//! A closed fence, a closed connection or an error of the consumer's ends the task; the
//! consumer reads why at its next call ([`SenderHandle::take_failure`]).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio::sync::{mpsc, watch};
use tokio::time::Sleep;
use walcast_core::Backoff;

use super::answers::{Answer, Answers, Failure, Stored, Token};

/// Messages in flight, at most, whatever `max_in_flight` says: the answers'
/// subscription buffers 65,536 messages (async-nats' default), and a burst of answers
/// past that would be dropped, timed out and resent, again and again.
pub const MAX_IN_FLIGHT_CAP: usize = 16_384;

/// How many messages may be out, how long an answer may take, how long to wait before
/// sending again.
#[derive(Clone, Copy, Debug)]
pub struct SenderLimits {
    pub max_in_flight: usize,
    pub ack_timeout: Duration,
    pub retry: Backoff,
}

/// Why a sender stops, besides an error of its consumer's.
#[derive(Debug, Clone)]
pub enum Stop {
    /// The leadership term ended: nothing more is sent.
    Fenced(walcast_lease::Fenced),
    /// The answers' subscription ended (the connection is gone for good).
    AnswersClosed,
}

/// What a consumer sends, and what it does with each answer.
pub trait Outgoing: Send + 'static {
    /// One message.
    type Item: Send + Sync + 'static;
    /// Why the sender stopped, as the consumer reports it.
    type Error: std::fmt::Display + Send + 'static;
    /// Names the sender in logs (`outbox`, `change-stream`).
    const NAME: &'static str;

    /// The connection the messages go out on (their answers are subscribed to there).
    fn client(&self) -> async_nats::Client;
    /// Make sure the stream exists (at the first send, and again after
    /// [`Outgoing::stream_lost`]), then send `item` with JetStream's answer to `reply`.
    /// Never waits for the answer.
    fn send<'a>(
        &'a mut self,
        item: &'a Self::Item,
        reply: String,
    ) -> BoxFuture<'a, Result<(), Failure>>;
    /// The stream is to be checked again before the next send.
    fn stream_lost(&mut self);
    /// The subject `item` goes to, for reports.
    fn subject(&self, item: &Self::Item) -> String;
    /// JetStream stored `item` (`duplicate`: it had it), `waited` after it was sent.
    fn stored(&mut self, item: Self::Item, duplicate: bool, waited: Duration);
    /// JetStream will never take `item`: skip it (reported, counted) or stop (`Err`).
    /// It is counted done only once this returned `Ok` (a quarantine that failed must
    /// not let the consumer confirm the message's position).
    fn refused<'a>(
        &'a mut self,
        item: &'a Self::Item,
        kind: &'static str,
        error: String,
    ) -> BoxFuture<'a, Result<(), Self::Error>>;
    /// A transient failure: every outstanding message is sent again after `wait`.
    fn retrying(&mut self, error: &str, wait: Duration, pending: usize);
    /// The sender stops for `why`: the error to report.
    fn stopped(&self, why: Stop) -> Self::Error;
    /// The first outstanding message is now `first` (`None`: none is outstanding).
    fn oldest(&mut self, _first: Option<&Self::Item>) {}
}

/// The consumer's handle on its sender task (aborted on drop).
pub struct SenderHandle<O: Outgoing> {
    tx: mpsc::UnboundedSender<Vec<O::Item>>,
    done: watch::Receiver<u64>,
    failure: Arc<Mutex<Option<O::Error>>>,
    task: tokio::task::JoinHandle<()>,
}

impl<O: Outgoing> Drop for SenderHandle<O> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl<O: Outgoing> SenderHandle<O> {
    /// Start the task (inside a Tokio runtime), as work for the current source.
    pub fn spawn(out: O, limits: SenderLimits) -> SenderHandle<O> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (done_tx, done) = watch::channel(0);
        let failure = Arc::new(Mutex::new(None));
        let task = Task {
            out,
            limits,
            answers: None,
            done: done_tx,
            in_flight: VecDeque::new(),
            queued: VecDeque::new(),
            attempt: 0,
            send_failed: false,
            timer: Box::pin(tokio::time::sleep(Duration::from_secs(3600))),
        };
        let shared = failure.clone();
        let task = walcast_core::source_scope::spawn(async move {
            if let Err(e) = task.serve(rx).await {
                tracing::warn!(error = %e, sender = O::NAME, "JetStream sender stopped");
                *shared.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            }
        });
        SenderHandle {
            tx,
            done,
            failure,
            task,
        }
    }

    /// Queue messages, in order (never waits). `false`: the task has ended.
    pub fn send(&self, items: Vec<O::Item>) -> bool {
        self.tx.send(items).is_ok()
    }

    /// Messages done so far (stored or refused), without waiting.
    pub fn done(&self) -> u64 {
        *self.done.borrow()
    }

    /// Wait until `n` messages are done; `false` if the task ended first.
    pub async fn wait_done(&mut self, n: u64) -> bool {
        self.done.wait_for(|d| *d >= n).await.is_ok()
    }

    /// Why the task ended (taken once).
    pub fn take_failure(&self) -> Option<O::Error> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// A message sent (or to send again) and its answer.
struct InFlight<I> {
    item: I,
    /// What its answer will name (`None`: the send itself failed; `answer` says why).
    token: Option<Token>,
    /// `None` until it came.
    answer: Option<Answer>,
    sent: Instant,
    /// JetStream said no stream listens on its subject after the stream was re-checked.
    stream_checked: bool,
}

struct Task<O: Outgoing> {
    out: O,
    limits: SenderLimits,
    /// Made at the first send.
    answers: Option<Answers>,
    done: watch::Sender<u64>,
    in_flight: VecDeque<InFlight<O::Item>>,
    /// Messages received and not sent yet (past `max_in_flight`), in order.
    queued: VecDeque<O::Item>,
    /// Transient failures in a row of the first outstanding message.
    attempt: u32,
    /// A send failed for a reason that may pass (the stream could not be made, the
    /// connection is down): the messages after it are not tried until the retry resends
    /// them all in order, so one outage costs one failed send, not one per message.
    send_failed: bool,
    /// Fires at or before the first outstanding message's deadline (moved only when it
    /// must be, not for every message).
    timer: Pin<Box<Sleep>>,
}

/// What the task does next.
enum Next<I> {
    /// The next message to send.
    Send(I),
    /// Messages from the consumer (`None`: it is gone).
    Received(Option<Vec<I>>),
    Answer(Answer),
    /// The answers' subscription ended.
    Closed,
}

impl<O: Outgoing> Task<O> {
    async fn serve(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Vec<O::Item>>,
    ) -> Result<(), O::Error> {
        let max = self.limits.max_in_flight.clamp(1, MAX_IN_FLIGHT_CAP);
        loop {
            match self.next(&mut rx, self.in_flight.len() < max).await {
                Next::Send(item) => self.push(item).await,
                Next::Received(Some(items)) => self.queued.extend(items),
                Next::Received(None) => return Ok(()),
                Next::Closed => return Err(self.out.stopped(Stop::AnswersClosed)),
                Next::Answer(Ok(Stored { duplicate })) => self.stored(duplicate),
                Next::Answer(Err(Failure::Permanent { kind, error })) => {
                    self.refused(kind, error).await?
                }
                Next::Answer(Err(Failure::Fenced(e))) => {
                    return Err(self.out.stopped(Stop::Fenced(e)))
                }
                Next::Answer(Err(Failure::Transient(e) | Failure::NoStream(e))) => {
                    self.retry(&e).await
                }
            }
        }
    }

    /// The next message (when there is room for one), or the first outstanding
    /// message's answer, whichever comes first. Answers to later ones are filed meanwhile.
    async fn next(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<Vec<O::Item>>,
        room: bool,
    ) -> Next<O::Item> {
        if room {
            if let Some(item) = self.queued.pop_front() {
                return Next::Send(item);
            }
        }
        loop {
            let Some(first) = self.in_flight.front_mut() else {
                return Next::Received(rx.recv().await);
            };
            if let Some(answer) = first.answer.take() {
                return Next::Answer(self.judge(answer));
            }
            let deadline = tokio::time::Instant::from_std(first.sent + self.limits.ack_timeout);
            if self.timer.deadline() > deadline {
                self.timer.as_mut().reset(deadline);
            }
            tokio::select! {
                biased;
                items = rx.recv(), if room => return Next::Received(items),
                answer = next_answer(&mut self.answers) => match answer {
                    Some((token, answer)) => self.file(token, answer),
                    None => return Next::Closed,
                },
                () = self.timer.as_mut() => {
                    if tokio::time::Instant::now() >= deadline {
                        let waited = self.limits.ack_timeout.as_millis();
                        return Next::Answer(Err(Failure::Transient(format!(
                            "no answer from JetStream in {waited} ms"
                        ))));
                    }
                    self.timer.as_mut().reset(deadline);
                }
            }
        }
    }

    /// Keep an answer with its message (an answer to a message resent since, or a second
    /// one, is dropped: the resend has its own token).
    fn file(&mut self, token: Token, answer: Answer) {
        let entry = self.in_flight.iter_mut().find(|f| f.token == Some(token));
        if let Some(f) = entry {
            if f.answer.is_none() {
                f.answer = Some(answer);
            }
        }
    }

    /// The first outstanding message's answer, with "no stream" a refusal the second
    /// time in a row (the stream was re-created in between).
    fn judge(&mut self, answer: Answer) -> Answer {
        let Some(first) = self.in_flight.front_mut() else {
            return answer;
        };
        match answer {
            Err(Failure::NoStream(_)) if first.stream_checked => Err(Failure::Permanent {
                kind: "no_stream",
                error: format!("no stream listens on {}", self.out.subject(&first.item)),
            }),
            Err(Failure::NoStream(error)) => {
                first.stream_checked = true;
                Err(Failure::NoStream(error))
            }
            other => other,
        }
    }

    async fn push(&mut self, item: O::Item) {
        let (token, answer) = match self.send(&item).await {
            Ok(token) => (Some(token), None),
            Err(failure) => (None, Some(Err(failure))),
        };
        let first = self.in_flight.is_empty();
        self.in_flight.push_back(InFlight {
            item,
            token,
            answer,
            sent: Instant::now(),
            stream_checked: false,
        });
        if first {
            self.out.oldest(self.in_flight.front().map(|f| &f.item));
        }
    }

    async fn send(&mut self, item: &O::Item) -> Result<Token, Failure> {
        if self.send_failed {
            return Err(Failure::Transient(
                "not sent: an earlier message could not be sent".into(),
            ));
        }
        let sent = self.try_send(item).await;
        if let Err(Failure::Transient(_) | Failure::NoStream(_)) = &sent {
            self.send_failed = true;
        }
        sent
    }

    async fn try_send(&mut self, item: &O::Item) -> Result<Token, Failure> {
        if self.answers.is_none() {
            self.answers = Some(Answers::subscribe(&self.out.client()).await?);
        }
        let Some(answers) = self.answers.as_mut() else {
            return Err(Failure::Transient("no answer subscription".into()));
        };
        let (token, reply) = answers.next_reply();
        self.out.send(item, reply).await?;
        Ok(token)
    }

    /// The first outstanding message is done: counted.
    fn done_one(&mut self) -> Option<InFlight<O::Item>> {
        let f = self.in_flight.pop_front()?;
        self.done.send_modify(|d| *d += 1);
        self.attempt = 0;
        self.out.oldest(self.in_flight.front().map(|f| &f.item));
        Some(f)
    }

    fn stored(&mut self, duplicate: bool) {
        if let Some(f) = self.done_one() {
            self.out.stored(f.item, duplicate, f.sent.elapsed());
        }
    }

    async fn refused(&mut self, kind: &'static str, error: String) -> Result<(), O::Error> {
        let Some(first) = self.in_flight.front() else {
            return Ok(());
        };
        self.out.refused(&first.item, kind, error).await?;
        self.done_one();
        Ok(())
    }

    /// Wait, then resend every outstanding message in order (the ones after the failed
    /// one may have landed: the duplicate window drops them). Messages still queued wait
    /// (in `queued` and the channel, after them).
    async fn retry(&mut self, error: &str) {
        let wait = self.limits.retry.delay(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        self.out.retrying(error, wait, self.in_flight.len());
        tokio::time::sleep(wait).await;
        self.out.stream_lost();
        self.send_failed = false;
        let mut pending = std::mem::take(&mut self.in_flight);
        for f in pending.iter_mut() {
            f.sent = Instant::now();
            (f.token, f.answer) = match self.send(&f.item).await {
                Ok(token) => (Some(token), None),
                Err(failure) => (None, Some(Err(failure))),
            };
        }
        self.in_flight = pending;
    }
}

/// The next answer, or never before the first send.
async fn next_answer(answers: &mut Option<Answers>) -> Option<(Token, Answer)> {
    match answers {
        Some(a) => a.next().await,
        None => std::future::pending().await,
    }
}
