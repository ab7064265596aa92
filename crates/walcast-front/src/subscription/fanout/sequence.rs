//! Gaps in the leader's numbered stream to this front (see [`walcast_bus::links`]), as a
//! pure state machine: messages, heartbeats, the leader's answers and the clock go in;
//! what to deliver (in order), what to ask for again and what is lost come out. The
//! fan-out task (`fanout`) does the I/O.
//!
//! Each source (database) has its own leader, so its own stream: [`Sequencers`] keeps one
//! [`Sequencer`] per source (the `Walcast-Source` header), and a gap in one source's
//! stream holds nothing of another's.
//!
//! A stream is `(source, term, origin)`. The first stream this front sees is taken from wherever
//! it is (a front that just started missed nothing); a later one must start at 1. A
//! message past the next expected number is held, and the numbers before it are asked
//! for; they are given up (reported lost) when the leader says it no longer has them,
//! when the recovery window passes, or when too many messages are held.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// One leader term of one worker process, for one source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StreamId {
    pub source: String,
    pub term: u64,
    pub origin: String,
}

/// Numbers `from..=to` of which `missing` never arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Loss {
    /// The source whose stream lost them.
    pub source: String,
    pub from: u64,
    pub to: u64,
    pub missing: u64,
    pub why: String,
}

/// One thing to pass on, in order.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum InOrder<T> {
    Deliver(T),
    Lost(Loss),
}

/// What to do after an input.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Step<T> {
    /// Deliver or report these, in this order.
    pub out: Vec<InOrder<T>>,
    /// Ask the leader of this stream for `from..=to` again.
    pub ask: Option<(StreamId, u64, u64)>,
    /// Messages that arrived again (already delivered): dropped.
    pub duplicates: u64,
}

impl<T> Default for Step<T> {
    fn default() -> Self {
        Step {
            out: Vec::new(),
            ask: None,
            duplicates: 0,
        }
    }
}

/// An open gap: since when, and how far it was asked for.
struct Gap {
    since: Instant,
    asked_at: Instant,
    asked_to: u64,
    answered: bool,
}

/// How long to wait for an answer before asking again.
const ASK_AGAIN: Duration = Duration::from_secs(1);

pub(crate) struct Sequencer<T> {
    stream: Option<StreamId>,
    /// The first number not delivered yet.
    next: u64,
    /// The highest number known to exist (a message or a heartbeat).
    known: u64,
    held: BTreeMap<u64, T>,
    /// Ranges the leader said it cannot send, by first number.
    gone: BTreeMap<u64, (u64, String)>,
    gap: Option<Gap>,
    window: Duration,
    max_held: usize,
}

impl<T> Sequencer<T> {
    /// Give up a gap after `window`, or once `max_held` messages wait behind it.
    pub(crate) fn new(window: Duration, max_held: usize) -> Sequencer<T> {
        Sequencer {
            stream: None,
            next: 1,
            known: 0,
            held: BTreeMap::new(),
            gone: BTreeMap::new(),
            gap: None,
            window,
            max_held: max_held.max(1),
        }
    }

    /// Whether a gap is open.
    pub(crate) fn waiting(&self) -> bool {
        self.gap.is_some()
    }

    /// Message number `seq` of `stream`.
    pub(crate) fn message(&mut self, stream: StreamId, seq: u64, item: T, now: Instant) -> Step<T> {
        let mut step = Step::default();
        self.follow(stream, seq, now, &mut step);
        if seq < self.next || self.held.contains_key(&seq) {
            step.duplicates += 1;
            return step;
        }
        self.known = self.known.max(seq);
        self.held.insert(seq, item);
        self.settle(now, &mut step);
        step
    }

    /// A heartbeat of `stream`: `last` is the last number sent.
    pub(crate) fn heartbeat(&mut self, stream: StreamId, last: u64, now: Instant) -> Step<T> {
        let mut step = Step::default();
        self.follow(stream, last + 1, now, &mut step);
        self.known = self.known.max(last);
        self.settle(now, &mut step);
        step
    }

    /// The leader of `stream` answered; `lost`: what it cannot send, and why.
    pub(crate) fn answered(
        &mut self,
        stream: &StreamId,
        lost: Option<(u64, u64, String)>,
        now: Instant,
    ) -> Step<T> {
        let mut step = Step::default();
        if self.stream.as_ref() != Some(stream) {
            return step;
        }
        if let Some(g) = &mut self.gap {
            g.answered = true;
        }
        if let Some((from, to, why)) = lost {
            if to >= self.next {
                self.gone.insert(from.max(self.next), (to, why));
            }
        }
        self.settle(now, &mut step);
        step
    }

    /// Time passed: a gap open past the window is given up; an unanswered request is
    /// sent again.
    pub(crate) fn tick(&mut self, now: Instant) -> Step<T> {
        let mut step = Step::default();
        let Some(g) = &self.gap else {
            return step;
        };
        if now.saturating_duration_since(g.since) >= self.window {
            let why = format!("the leader did not resend them within {:?}", self.window);
            self.give_up(self.known, why, &mut step);
            self.settle(now, &mut step);
        } else if !g.answered && now.saturating_duration_since(g.asked_at) >= ASK_AGAIN {
            self.ask(self.next, now, &mut step);
        }
        step
    }

    /// A new stream: what the old one still misses is lost (its leader is gone), what it
    /// held is delivered; the new one starts at 1, or where it is for the first stream.
    fn follow(&mut self, stream: StreamId, seq: u64, now: Instant, step: &mut Step<T>) {
        if self.stream.as_ref() == Some(&stream) {
            return;
        }
        let first = self.stream.is_none();
        if !first {
            self.give_up(self.known, "the leader changed".into(), step);
            self.settle(now, step);
        }
        self.stream = Some(stream);
        self.next = if first { seq.max(1) } else { 1 };
        self.known = self.next - 1;
        self.gone.clear();
        self.gap = None;
    }

    /// Deliver what is in order, apply what the leader gave up, open, extend or close
    /// the gap.
    fn settle(&mut self, now: Instant, step: &mut Step<T>) {
        loop {
            if let Some(item) = self.held.remove(&self.next) {
                step.out.push(InOrder::Deliver(item));
                self.next += 1;
            } else if let Some((to, why)) = self.gone.remove(&self.next) {
                self.give_up(to, why, step);
            } else {
                break;
            }
        }
        self.gone.retain(|_, (to, _)| *to >= self.next);
        if self.known < self.next {
            self.gap = None;
            return;
        }
        if self.held.len() > self.max_held {
            let why = format!("more than {} messages waited behind it", self.max_held);
            self.give_up(self.known, why, step);
            return self.settle(now, step);
        }
        match &self.gap {
            None => {
                self.gap = Some(Gap {
                    since: now,
                    asked_at: now,
                    asked_to: 0,
                    answered: false,
                });
                self.ask(self.next, now, step);
            }
            Some(g) if g.asked_to < self.known => match self.first_missing(g.asked_to + 1) {
                Some(from) => self.ask(from, now, step),
                None => {
                    if let Some(g) = &mut self.gap {
                        g.asked_to = self.known;
                    }
                }
            },
            Some(_) => {}
        }
    }

    /// The first number from `from` up to the highest known that is not held.
    fn first_missing(&self, from: u64) -> Option<u64> {
        let mut n = from.max(self.next);
        for k in self.held.range(n..).map(|(k, _)| *k) {
            if k != n {
                break;
            }
            n += 1;
        }
        (n <= self.known).then_some(n)
    }

    fn ask(&mut self, from: u64, now: Instant, step: &mut Step<T>) {
        let (Some(stream), Some(g)) = (&self.stream, &mut self.gap) else {
            return;
        };
        let from = from.max(self.next);
        g.asked_at = now;
        g.asked_to = self.known;
        g.answered = false;
        step.ask = Some((stream.clone(), from, self.known));
    }

    /// Give up everything missing up to `to`: report it, deliver what was held up to
    /// there, in order.
    fn give_up(&mut self, to: u64, why: String, step: &mut Step<T>) {
        if to < self.next {
            return;
        }
        let from = self.next;
        let source = self.stream.as_ref().map(|s| s.source.clone());
        let later = self.held.split_off(&(to + 1));
        let held = std::mem::replace(&mut self.held, later);
        let missing = (to - from + 1) - held.len() as u64;
        if missing > 0 {
            step.out.push(InOrder::Lost(Loss {
                source: source.unwrap_or_default(),
                from,
                to,
                missing,
                why,
            }));
        }
        step.out.extend(held.into_values().map(InOrder::Deliver));
        self.next = to + 1;
        self.gap = None;
    }
}

/// One [`Sequencer`] per source: the streams of different sources' leaders are
/// unrelated (their own terms and numbers).
pub(crate) struct Sequencers<T> {
    by_source: HashMap<String, Sequencer<T>>,
    window: Duration,
    max_held: usize,
}

impl<T> Sequencers<T> {
    /// See [`Sequencer::new`] (per source).
    pub(crate) fn new(window: Duration, max_held: usize) -> Sequencers<T> {
        Sequencers {
            by_source: HashMap::new(),
            window,
            max_held,
        }
    }

    fn of(&mut self, source: &str) -> &mut Sequencer<T> {
        if !self.by_source.contains_key(source) {
            let q = Sequencer::new(self.window, self.max_held);
            self.by_source.insert(source.to_string(), q);
        }
        self.by_source.get_mut(source).expect("inserted just above")
    }

    /// Whether a gap is open in some source's stream.
    pub(crate) fn waiting(&self) -> bool {
        self.by_source.values().any(Sequencer::waiting)
    }

    /// See [`Sequencer::message`].
    pub(crate) fn message(&mut self, stream: StreamId, seq: u64, item: T, now: Instant) -> Step<T> {
        self.of(&stream.source.clone())
            .message(stream, seq, item, now)
    }

    /// See [`Sequencer::heartbeat`].
    pub(crate) fn heartbeat(&mut self, stream: StreamId, last: u64, now: Instant) -> Step<T> {
        self.of(&stream.source.clone()).heartbeat(stream, last, now)
    }

    /// See [`Sequencer::answered`].
    pub(crate) fn answered(
        &mut self,
        stream: &StreamId,
        lost: Option<(u64, u64, String)>,
        now: Instant,
    ) -> Step<T> {
        match self.by_source.get_mut(&stream.source) {
            Some(q) => q.answered(stream, lost, now),
            None => Step::default(),
        }
    }

    /// See [`Sequencer::tick`]: a step per source with an open gap.
    pub(crate) fn tick(&mut self, now: Instant) -> Vec<Step<T>> {
        self.by_source
            .values_mut()
            .filter(|q| q.waiting())
            .map(|q| q.tick(now))
            .collect()
    }
}

#[cfg(test)]
mod tests;
