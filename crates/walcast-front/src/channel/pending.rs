//! Joins in flight on one socket, and the frames of their topics that wait behind them.
//!
//! A join may wait for the cdc-worker (its registration, a private channel's check, a
//! replay: each up to `REGISTER_TIMEOUT_MS`, longer during a takeover). It runs beside
//! the socket's other frames, polled by the socket's own task: heartbeats, other
//! channels and their commands are answered meanwhile. What the client sends on the
//! join's own topic (a leave, a second join, an early broadcast) waits here and is
//! handled, in order, once the join is answered, so a channel's frames keep their order.
//!
//! Bounded: joins in flight count as channels (the socket's channel limit, checked at
//! each join, and its join rate bound them), and at most [`MAX_WAITING`] frames of at
//! most `MAX_FRAME_BYTES` in all wait; one more is refused with an error reply.

use std::collections::{HashMap, VecDeque};

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use sync_wrapper::SyncWrapper;
use walcast_protocol::Frame;

use super::Channel;
use crate::usage::UserSlot;

/// Frames a socket may have waiting behind its joins in flight.
pub const MAX_WAITING: usize = 16;

/// A join in flight, once answered: the channel it opened (`None`: refused, and told
/// so) and the socket's user slot if this join admitted the socket as one.
pub(crate) struct JoinDone {
    pub topic: String,
    pub channel: Option<Box<Channel>>,
    pub user: Option<UserSlot>,
}

/// Why a frame could not wait.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Full {
    Frames,
    Bytes,
}

type Running = FuturesUnordered<BoxFuture<'static, JoinDone>>;

/// The joins in flight of one socket.
#[derive(Default)]
pub(crate) struct Pending {
    /// Allocated at the socket's first join (most sockets join once or twice).
    running: Option<Box<SyncWrapper<Running>>>,
    in_flight: usize,
    /// Each topic with a join in flight → its frames received since, in order, with
    /// their sizes on the wire.
    waiting: HashMap<String, VecDeque<(Frame, usize)>>,
    frames: usize,
    bytes: usize,
}

impl Pending {
    /// Whether `topic` has a join in flight.
    pub(crate) fn holds(&self, topic: &str) -> bool {
        self.waiting.contains_key(topic)
    }

    /// The joins in flight.
    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether a join is in flight (then [`Pending::next`] completes).
    pub(crate) fn is_running(&self) -> bool {
        self.in_flight > 0
    }

    /// Run `join` for `topic`, which has none in flight.
    pub(crate) fn start(&mut self, topic: String, join: BoxFuture<'static, JoinDone>) {
        self.waiting.insert(topic, VecDeque::new());
        let running = self
            .running
            .get_or_insert_with(|| Box::new(SyncWrapper::new(Running::new())));
        running.get_mut().push(join);
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
    /// join in flight, until that join is answered.
    pub(crate) fn wait(&mut self, f: Frame, size: usize) {
        let Some(queue) = self.waiting.get_mut(&f.topic) else {
            debug_assert!(false, "a frame waits only behind a join in flight");
            return;
        };
        queue.push_back((f, size));
        self.frames += 1;
        self.bytes += size;
    }

    /// The join of `topic` is answered: the frames that waited behind it, in order.
    pub(crate) fn finish(&mut self, topic: &str) -> VecDeque<(Frame, usize)> {
        let queue = self.waiting.remove(topic).unwrap_or_default();
        self.frames -= queue.len();
        self.bytes -= queue.iter().map(|(_, n)| n).sum::<usize>();
        queue
    }

    /// The next join answered; never completes while none is in flight.
    pub(crate) async fn next(&mut self) -> JoinDone {
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

    fn done(topic: &str) -> BoxFuture<'static, JoinDone> {
        let topic = topic.to_string();
        Box::pin(async move {
            JoinDone {
                topic,
                channel: None,
                user: None,
            }
        })
    }

    #[tokio::test]
    async fn frames_wait_in_order_within_their_bounds() {
        let mut p = Pending::default();
        assert!(!p.is_running());
        p.start("realtime:a".into(), done("realtime:a"));
        p.start("realtime:b".into(), done("realtime:b"));
        assert_eq!(
            (p.len(), p.holds("realtime:a"), p.holds("realtime:c")),
            (2, true, false)
        );
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
        assert_eq!(p.room(1000 - 80, 1000), Ok(()));
        p.wait(frame("realtime:b"), 1000 - 80);
        assert_eq!(p.room(1, 1000), Err(Full::Bytes));
        assert_eq!(p.finish("realtime:b").len(), MAX_WAITING / 2 + 1);
        assert_eq!((p.frames, p.bytes), (0, 0));
        let mut answered = vec![p.next().await.topic, p.next().await.topic];
        answered.sort();
        assert_eq!(answered, ["realtime:a", "realtime:b"]);
        assert!(!p.is_running());
    }
}
