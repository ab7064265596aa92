//! `walcast outbox replay`: re-publish events the JetStream stream still holds (it keeps
//! `OUTBOX_MAX_AGE_SECS`) to a separate subject, `<prefix>.<project>.<topic>`, in stream
//! order, at a limited rate.
//!
//! - **Where it starts**: at an RFC 3339 time, the first event JetStream *stored* at or
//!   after it (a consumer with `DeliverPolicy::ByStartTime`); at an LSN, the stream's
//!   beginning, skipping events whose `Walcast-Commit-Lsn` is below it.
//! - **Where it ends**: at `to` (a time: the first event stored after it ends the replay;
//!   an LSN: events committed after it are skipped, so a redriven event of the range is
//!   still found), and at the stream's last sequence when the replay started, never
//!   later: events relayed meanwhile are not replayed, and a replay into the same stream
//!   cannot feed itself.
//! - **What a replayed message is**: the original's body and headers, less every `Nats-`
//!   header (the original `Nats-Msg-Id` would make a stream capturing the replay subject
//!   drop it as a duplicate of the original), plus `Walcast-Replay-Of: <event id>`.
//!   Consumers still deduplicate by `Walcast-Event-Id`. Published with core NATS (flushed
//!   at the end): a replay is for a subscriber catching up, not a second source of truth.
//!   A prefix whose subjects the outbox stream itself captures is refused unless allowed:
//!   the replays would be stored again, beside the originals, for every outbox consumer.

use std::str::FromStr;
use std::time::{Duration, Instant};

use async_nats::datetime::DateTime;
use async_nats::jetstream::consumer::pull::{Ordered, OrderedConfig};
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::HeaderMap;
use futures_util::StreamExt;
use walcast_wal2json::Lsn;

use crate::event::{valid_topic, HEADER_COMMIT_LSN, HEADER_EVENT_ID, HEADER_TOPIC, SUBJECT_PREFIX};
use crate::rate::TokenBucket;

/// The header naming the event a replayed message repeats.
pub const HEADER_REPLAY_OF: &str = "Walcast-Replay-Of";
/// The longest wait for the next message while the stream says more are pending.
const STALL: Duration = Duration::from_secs(30);
const REPORT_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("{0:?} is neither an RFC 3339 time (2026-12-01T10:00:00Z) nor an LSN (16/B374D848)")]
    Position(String),
    #[error("subject prefix {0:?} must be dot-separated tokens of letters, digits, _ or - (no wildcards)")]
    Prefix(String),
    #[error("project {0:?} cannot be a subject token")]
    Project(String),
    #[error("the stream {stream} captures {subject} (its subjects: {subjects}): the replayed events would be stored again beside the originals; choose another subject prefix, or allow it (--allow-same-stream)")]
    Captured {
        stream: String,
        subject: String,
        subjects: String,
    },
    #[error("stream {stream}: {error}")]
    Stream { stream: String, error: String },
    #[error("reading the stream: {0}")]
    Read(String),
    #[error("no message from the stream for {0:?} although more were pending")]
    Stalled(Duration),
    #[error("publishing to {subject}: {error}")]
    Publish { subject: String, error: String },
}

/// Where a replay starts or ends.
#[derive(Clone, Debug, PartialEq)]
pub enum Position {
    /// When JetStream stored the event.
    Time(DateTime),
    /// The event's commit LSN (`Walcast-Commit-Lsn`).
    Lsn(Lsn),
}

impl FromStr for Position {
    type Err = ReplayError;

    /// `X/Y` is an LSN; anything else must be an RFC 3339 time.
    fn from_str(s: &str) -> Result<Position, ReplayError> {
        let bad = || ReplayError::Position(s.to_string());
        if s.contains('/') {
            return s.parse().map(Position::Lsn).map_err(|_| bad());
        }
        async_nats::datetime::parse_rfc3339(s)
            .map(Position::Time)
            .map_err(|_| bad())
    }
}

/// What to do with one message of the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Send,
    Skip,
    Stop,
}

/// Pure: the step for a message committed at `lsn` (`None`: no such header) and stored
/// at `stored`, for a replay of `from..=to`.
pub fn step(lsn: Option<Lsn>, stored: DateTime, from: &Position, to: Option<&Position>) -> Step {
    match to {
        Some(Position::Time(t)) if stored > *t => return Step::Stop,
        Some(Position::Lsn(l)) if lsn.is_none_or(|x| x > *l) => return Step::Skip,
        _ => {}
    }
    match from {
        Position::Time(t) if stored < *t => Step::Skip,
        Position::Lsn(l) if lsn.is_none_or(|x| x < *l) => Step::Skip,
        _ => Step::Send,
    }
}

/// Pure: whether some subject matches both patterns (`*` one token, `>` one or more).
pub fn subjects_overlap(a: &str, b: &str) -> bool {
    let (mut a, mut b) = (a.split('.'), b.split('.'));
    loop {
        match (a.next(), b.next()) {
            (None, None) => return true,
            (Some(">"), Some(_)) | (Some(_), Some(">")) => return true,
            (Some(x), Some(y)) if x == y || x == "*" || y == "*" => {}
            _ => return false,
        }
    }
}

/// Pure: the replay subject of an outbox message (`None` if it names no topic).
pub fn replay_subject(
    prefix: &str,
    project: &str,
    subject: &str,
    headers: Option<&HeaderMap>,
) -> Option<String> {
    let topic = headers
        .and_then(|h| h.get(HEADER_TOPIC))
        .map(|v| v.as_str().to_string())
        .or_else(|| {
            let own = format!("{SUBJECT_PREFIX}.{project}.");
            subject.strip_prefix(&own).map(str::to_string)
        })
        .filter(|t| valid_topic(t))?;
    Some(format!("{prefix}.{project}.{topic}"))
}

/// Pure: the headers of a replayed message: the original's without `Nats-` ones, and
/// `Walcast-Replay-Of` = its event id.
pub fn replay_headers(original: Option<&HeaderMap>) -> HeaderMap {
    let mut out = HeaderMap::new();
    let Some(h) = original else {
        return out;
    };
    for (name, values) in h.iter() {
        let n: &str = name.as_ref();
        if n.to_ascii_lowercase().starts_with("nats-") {
            continue;
        }
        for v in values {
            out.append(name.clone(), v.clone());
        }
    }
    if let Some(id) = h.get(HEADER_EVENT_ID) {
        out.insert(HEADER_REPLAY_OF, id.clone());
    }
    out
}

/// How far a replay got.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    /// Messages of the project read from the stream.
    pub read: u64,
    pub sent: u64,
    /// Read, outside the range.
    pub skipped: u64,
    /// The project's messages from the start position when the replay began (an upper
    /// bound of what it reads).
    pub total: u64,
    pub elapsed: Duration,
}

impl Progress {
    /// Events sent per second so far.
    pub fn rate(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.sent as f64 / secs
        } else {
            0.0
        }
    }
}

/// A replay of one project's events.
#[derive(Clone, Debug)]
pub struct Replay {
    /// The outbox stream.
    pub stream: String,
    pub project: String,
    pub from: Position,
    pub to: Option<Position>,
    /// Events go to `<subject_prefix>.<project>.<topic>`.
    pub subject_prefix: String,
    /// Events per second, at most.
    pub rate: u32,
    /// Replay even to subjects the outbox stream captures.
    pub allow_same_stream: bool,
}

#[cfg(test)]
mod tests;

impl Replay {
    /// The subjects replayed events go to.
    pub fn target(&self) -> String {
        format!("{}.{}.>", self.subject_prefix, self.project)
    }

    /// The names are valid subject tokens (checked before anything is read).
    pub fn check(&self) -> Result<(), ReplayError> {
        if !valid_topic(&self.subject_prefix) {
            return Err(ReplayError::Prefix(self.subject_prefix.clone()));
        }
        if !valid_topic(&self.project) || self.project.contains('.') {
            return Err(ReplayError::Project(self.project.clone()));
        }
        Ok(())
    }

    /// Refuse a target the stream captures (unless allowed).
    fn check_capture(&self, subjects: &[String]) -> Result<(), ReplayError> {
        let target = self.target();
        if self.allow_same_stream || !subjects.iter().any(|s| subjects_overlap(s, &target)) {
            return Ok(());
        }
        Err(ReplayError::Captured {
            stream: self.stream.clone(),
            subject: target,
            subjects: subjects.join(", "),
        })
    }

    fn consumer_config(&self) -> OrderedConfig {
        let deliver_policy = match &self.from {
            Position::Time(t) => DeliverPolicy::ByStartTime { start_time: *t },
            Position::Lsn(_) => DeliverPolicy::All,
        };
        OrderedConfig {
            filter_subject: format!("{SUBJECT_PREFIX}.{}.>", self.project),
            deliver_policy,
            ..Default::default()
        }
    }

    /// Run it on `client`, calling `report` every second and once at the end.
    pub async fn run(
        &self,
        client: &async_nats::Client,
        mut report: impl FnMut(&Progress),
    ) -> Result<Progress, ReplayError> {
        self.check()?;
        let started = Instant::now();
        let mut p = Progress::default();
        let Some((mut messages, last)) = self.open(client, &mut p).await? else {
            report(&p);
            return Ok(p);
        };
        let mut bucket = TokenBucket::per_second(self.rate);
        let mut next_report = started + REPORT_EVERY;
        while let Some(msg) = next(&mut messages).await? {
            let info = msg.info().map_err(|e| ReplayError::Read(e.to_string()))?;
            let (seq, pending, stored) = (info.stream_sequence, info.pending, info.published);
            if seq > last {
                break;
            }
            p.read += 1;
            match step(commit_lsn(&msg), stored, &self.from, self.to.as_ref()) {
                Step::Stop => break,
                Step::Skip => p.skipped += 1,
                Step::Send => {
                    bucket.acquire().await;
                    match self.publish(client, &msg).await? {
                        true => p.sent += 1,
                        false => p.skipped += 1,
                    }
                }
            }
            if Instant::now() >= next_report {
                p.elapsed = started.elapsed();
                report(&p);
                next_report = Instant::now() + REPORT_EVERY;
            }
            if seq >= last || pending == 0 {
                break;
            }
        }
        client.flush().await.map_err(|e| ReplayError::Publish {
            subject: self.target(),
            error: e.to_string(),
        })?;
        p.elapsed = started.elapsed();
        report(&p);
        Ok(p)
    }

    /// The project's messages from the start position (an ordered consumer, no acks) and
    /// the stream's last sequence now; `None` when there is nothing to read.
    async fn open(
        &self,
        client: &async_nats::Client,
        p: &mut Progress,
    ) -> Result<Option<(Ordered, u64)>, ReplayError> {
        let failed = |e: &dyn std::fmt::Display| ReplayError::Stream {
            stream: self.stream.clone(),
            error: e.to_string(),
        };
        let js = async_nats::jetstream::new(client.clone());
        let mut stream = js.get_stream(&self.stream).await.map_err(|e| failed(&e))?;
        let info = stream.info().await.map_err(|e| failed(&e))?;
        let (empty, last) = (info.state.messages == 0, info.state.last_sequence);
        self.check_capture(&info.config.subjects.clone())?;
        if empty {
            return Ok(None);
        }
        let consumer = stream
            .create_consumer(self.consumer_config())
            .await
            .map_err(|e| failed(&e))?;
        p.total = consumer.cached_info().num_pending;
        if p.total == 0 {
            return Ok(None);
        }
        let messages = consumer.messages().await.map_err(|e| failed(&e))?;
        Ok(Some((messages, last)))
    }

    /// Send one message to its replay subject; `false` if it names no topic.
    async fn publish(
        &self,
        client: &async_nats::Client,
        msg: &async_nats::jetstream::Message,
    ) -> Result<bool, ReplayError> {
        let headers = msg.headers.as_ref();
        let subject = replay_subject(&self.subject_prefix, &self.project, &msg.subject, headers);
        let Some(subject) = subject else {
            tracing::warn!(subject = %msg.subject, "outbox message without a topic: not replayed");
            return Ok(false);
        };
        client
            .publish_with_headers(
                subject.clone(),
                replay_headers(headers),
                msg.payload.clone(),
            )
            .await
            .map_err(|e| ReplayError::Publish {
                subject,
                error: e.to_string(),
            })?;
        Ok(true)
    }
}

/// The next message, `None` at the end; a stream that stays silent for [`STALL`] is an
/// error, not a hang.
async fn next(
    messages: &mut Ordered,
) -> Result<Option<async_nats::jetstream::Message>, ReplayError> {
    match tokio::time::timeout(STALL, messages.next()).await {
        Err(_) => Err(ReplayError::Stalled(STALL)),
        Ok(None) => Ok(None),
        Ok(Some(Err(e))) => Err(ReplayError::Read(e.to_string())),
        Ok(Some(Ok(m))) => Ok(Some(m)),
    }
}

/// The message's `Walcast-Commit-Lsn`.
fn commit_lsn(msg: &async_nats::jetstream::Message) -> Option<Lsn> {
    msg.headers
        .as_ref()?
        .get(HEADER_COMMIT_LSN)?
        .as_str()
        .parse()
        .ok()
}
