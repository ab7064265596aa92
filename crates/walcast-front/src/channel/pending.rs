//! Commands in flight on one socket, and the frames of their topics that wait behind them.
//!
//! Three commands may wait for the cdc-worker (each up to `REGISTER_TIMEOUT_MS`, longer
//! during a takeover): a join (its registration, a private channel's read check, a
//! replay), a token refresh (`access_token`: the channel's subscriptions registered
//! again with the new claims, a private channel's read checked again) and a private
//! channel's first broadcast or presence track (its write check). Each runs beside the
//! socket's other frames, polled by the socket's own task: heartbeats, other channels
//! and their commands are answered meanwhile. What the client sends on the command's
//! own topic (a leave, a join, a broadcast, another refresh) waits here and is handled,
//! in order, once the command is answered, so a channel's frames keep their order (the
//! broadcast that needs the write check waits behind it too).
//!
//! Bounded: a topic has at most one command in flight; joins in flight count as
//! channels (the socket's channel limit, checked at each join, and its join rate bound
//! them), the other commands run on joined channels; at most [`MAX_WAITING`] frames of
//! at most `MAX_FRAME_BYTES` in all wait; one more is refused with an error reply.

use std::collections::{HashMap, VecDeque};

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use serde_json::Value;
use sync_wrapper::SyncWrapper;
use walcast_protocol::Frame;

use super::Channel;
use crate::limits::usage::UserSlot;

/// Frames a socket may have waiting behind its commands in flight.
pub const MAX_WAITING: usize = 16;

/// A command in flight, once answered.
pub(crate) struct Done {
    pub topic: String,
    pub answer: Answer,
}

/// What a command in flight answered.
pub(crate) enum Answer {
    /// A join: the channel it opened (`None`: refused, and told so) and the socket's
    /// user slot if this join admitted the socket as one.
    Join {
        channel: Option<Box<Channel>>,
        user: Option<UserSlot>,
    },
    /// A token refresh of the channel numbered `id`.
    Refresh { id: u64, outcome: Refreshed },
    /// The write check of the private channel numbered `id`: whether it may send.
    Write { id: u64, allowed: bool },
}

/// How a token refresh went.
pub(crate) enum Refreshed {
    /// Refused (the token does not verify, or its claims may not read the private
    /// channel): the channel is shut with this message.
    Refused(String),
    Taken(Box<Taken>),
}

/// A refresh taken: the channel's new token, its expiry and claims, and the `system`
/// message of its subscriptions registered again (none without `postgres_changes`).
pub(crate) struct Taken {
    pub token: String,
    pub exp: i64,
    pub claims: Value,
    pub said: Option<Frame>,
}

/// Why a frame could not wait.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Full {
    Frames,
    Bytes,
}

type Running = FuturesUnordered<BoxFuture<'static, Done>>;

/// A topic's command in flight: whether it is a join, and the frames received since,
/// in order, with their sizes on the wire.
#[derive(Default)]
struct Waiting {
    join: bool,
    frames: VecDeque<(Frame, usize)>,
}

/// The commands in flight of one socket.
#[derive(Default)]
pub(crate) struct Pending {
    /// Allocated at the socket's first command in flight (most sockets have one or two).
    running: Option<Box<SyncWrapper<Running>>>,
    in_flight: usize,
    /// Each topic with a command in flight → what waits behind it.
    waiting: HashMap<String, Waiting>,
    joins: usize,
    frames: usize,
    bytes: usize,
}

impl Pending {
    /// Whether `topic` has a command in flight.
    pub(crate) fn holds(&self, topic: &str) -> bool {
        self.waiting.contains_key(topic)
    }

    /// The joins in flight.
    pub(crate) fn joins(&self) -> usize {
        self.joins
    }

    /// Whether a command is in flight (then [`Pending::next`] completes).
    pub(crate) fn is_running(&self) -> bool {
        self.in_flight > 0
    }

    /// Run `command` (a join if `join`) for `topic`, which has none in flight.
    pub(crate) fn start(&mut self, topic: String, join: bool, command: BoxFuture<'static, Done>) {
        let waiting = Waiting {
            join,
            frames: VecDeque::new(),
        };
        let before = self.waiting.insert(topic, waiting);
        debug_assert!(before.is_none(), "one command in flight per topic");
        self.joins += usize::from(join);
        let running = self
            .running
            .get_or_insert_with(|| Box::new(SyncWrapper::new(Running::new())));
        running.get_mut().push(command);
        self.in_flight += 1;
    }

    /// Whether one more frame of `size` bytes may wait: `Err` when the socket's waiting
    /// frames are at their bound (`max_bytes` in all, [`MAX_WAITING`] frames).
    pub(crate) fn room(&self, size: usize, max_bytes: usize) -> Result<(), Full> {
        if self.frames >= MAX_WAITING {
            return Err(Full::Frames);
        }
        if self.bytes.saturating_add(size) > max_bytes {
            return Err(Full::Bytes);
        }
        Ok(())
    }

    /// Keep `f` (`size` bytes on the wire, within [`Pending::room`]), of a topic with a
    /// command in flight, until that command is answered.
    pub(crate) fn wait(&mut self, f: Frame, size: usize) {
        let Some(waiting) = self.waiting.get_mut(&f.topic) else {
            debug_assert!(false, "a frame waits only behind a command in flight");
            return;
        };
        waiting.frames.push_back((f, size));
        self.frames += 1;
        self.bytes += size;
    }

    /// The command of `topic` is answered: the frames that waited behind it, in order.
    pub(crate) fn finish(&mut self, topic: &str) -> VecDeque<(Frame, usize)> {
        let Some(waiting) = self.waiting.remove(topic) else {
            return VecDeque::new();
        };
        self.joins -= usize::from(waiting.join);
        let queue = waiting.frames;
        self.frames -= queue.len();
        self.bytes -= queue.iter().map(|(_, n)| n).sum::<usize>();
        queue
    }

    /// The next command answered; never completes while none is in flight.
    pub(crate) async fn next(&mut self) -> Done {
        if let Some(running) = self.running.as_mut() {
            if let Some(done) = running.get_mut().next().await {
                self.in_flight -= 1;
                return done;
            }
        }
        std::future::pending().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use walcast_protocol::Payload;

    fn frame(topic: &str) -> Frame {
        Frame {
            join_ref: None,
            ref_: None,
            topic: topic.into(),
            event: "broadcast".into(),
            payload: Payload::empty(),
        }
    }

    fn join(topic: &str) -> BoxFuture<'static, Done> {
        let topic = topic.to_string();
        Box::pin(async move {
            Done {
                topic,
                answer: Answer::Join {
                    channel: None,
                    user: None,
                },
            }
        })
    }

    fn write_check(topic: &str) -> BoxFuture<'static, Done> {
        let topic = topic.to_string();
        Box::pin(async move {
            Done {
                topic,
                answer: Answer::Write {
                    id: 1,
                    allowed: true,
                },
            }
        })
    }

    #[tokio::test]
    async fn frames_wait_in_order_within_their_bounds() {
        let mut p = Pending::default();
        assert!(!p.is_running());
        p.start("realtime:a".into(), true, join("realtime:a"));
        p.start("realtime:b".into(), false, write_check("realtime:b"));
        assert_eq!(
            (p.joins(), p.holds("realtime:a"), p.holds("realtime:b")),
            (1, true, true)
        );
        assert!(!p.holds("realtime:c"));
        for i in 0..MAX_WAITING {
            let topic = if i % 2 == 0 {
                "realtime:a"
            } else {
                "realtime:b"
            };
            assert_eq!(p.room(10, 1000), Ok(()));
            p.wait(frame(topic), 10);
        }
        assert_eq!(p.room(10, 1000), Err(Full::Frames));
        let a = p.finish("realtime:a");
        assert_eq!(a.len(), MAX_WAITING / 2);
        assert!(a.iter().all(|(f, n)| f.topic == "realtime:a" && *n == 10));
        assert_eq!(p.joins(), 0, "the join answered");
        assert_eq!(p.room(1000 - 80, 1000), Ok(()));
        p.wait(frame("realtime:b"), 1000 - 80);
        assert_eq!(p.room(1, 1000), Err(Full::Bytes));
        assert_eq!(p.finish("realtime:b").len(), MAX_WAITING / 2 + 1);
        assert_eq!((p.frames, p.bytes, p.joins), (0, 0, 0));
        assert!(p.finish("realtime:b").is_empty(), "finished once");
        let mut answered = vec![p.next().await.topic, p.next().await.topic];
        answered.sort();
        assert_eq!(answered, ["realtime:a", "realtime:b"]);
        assert!(!p.is_running());
    }
}
