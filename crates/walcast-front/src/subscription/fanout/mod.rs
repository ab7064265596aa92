//! Fan-out of change events from the bus to channels.
//!
//! One task reads this front's delivery subject (`walcast.deliver.<front id>`, see
//! [`walcast_bus::subject::delivery_subject`]): the cdc-worker sends there only the
//! changes this front's subscriptions matched, and its notices about them. The leader
//! numbers them; a gap (NATS dropped messages while our link was down) holds what follows
//! while the missing numbers are asked for again, and what cannot be had is told to every
//! `postgres_changes` channel with a `system` error (see [`sequence`] and
//! [`walcast_bus::links`]). Per event: parse once, keep only this front's subscription
//! ids, group them by channel, encode the change once, and produce each channel's frame
//! text once (cached by version, topic and ids, so identical channels share the bytes).
//! Frames go into each connection's bounded queue without waiting.
//!
//! The subject carries the streams of several leaders, one per source (database), each
//! message naming its source in `Walcast-Source` (absent: the default). Terms, numbers,
//! gaps and resend requests are per source, and a loss is told only to the channels with
//! subscriptions of that source's projects. A change of a project that is not on the
//! message's source is dropped and counted: a source's database may belong to a tenant,
//! and must never speak for another source's project.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use walcast_bus::links::{ResendClient, ResendError, ResendReply, ResendRequest, NOTICE_HEARTBEAT};
use walcast_bus::source::HEADER_SOURCE;
use walcast_bus::subs::{NOTICE_SUBS_ENDED, NOTICE_SUBS_LAGGED, NOTICE_SUBS_WITHHELD};
use walcast_bus::{BusMessage, ChangeEvent, Subscription, HEADER_NOTICE};
use walcast_bus::{HEADER_FRONT_SEQ, HEADER_ORIGIN, HEADER_RESENT, HEADER_TERM};

pub(crate) mod encode;
pub(crate) mod guards;
pub(crate) mod sequence;

use encode::encode;
use guards::{ReplayGuard, TermGuard};
use sequence::{InOrder, Loss, Sequencers, Step, StreamId};

use crate::cluster::listen::next_message;
use crate::projects::Projects;
use crate::subscription::registration::Registration;
use crate::subscription::registry::Registry;
use crate::subscription::sink::Change;
use crate::telemetry;

/// What the fan-out task works with.
pub(crate) struct Feed {
    pub registry: Arc<Registry>,
    pub registration: Arc<Registration>,
    /// Which source each project is on.
    pub projects: Projects,
    pub resend: ResendClient,
    pub front_id: String,
    /// How long a gap is recovered, and how much is held behind it.
    pub window: Duration,
    pub max_held: usize,
}

/// How often an open gap's clock is checked.
const TICK: Duration = Duration::from_millis(250);

/// A leader's answer to a resend request (or why there is none).
type Answer = (StreamId, u64, u64, Result<ResendReply, ResendError>);

struct Fanout {
    feed: Feed,
    replays: ReplayGuard,
    terms: TermGuard,
    seq: Sequencers<BusMessage>,
    answers: mpsc::UnboundedSender<Answer>,
}

pub(crate) async fn run(feed: Feed, mut sub: Subscription, cancel: CancellationToken) {
    let (answers, mut answered) = mpsc::unbounded_channel();
    let seq = Sequencers::new(feed.window, feed.max_held);
    let mut f = Fanout {
        feed,
        replays: ReplayGuard::default(),
        terms: TermGuard::default(),
        seq,
        answers,
    };
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let steps = tokio::select! {
            m = next_message(&mut sub, &cancel, "change") => match m {
                Some(m) => vec![f.on_message(m)],
                None => return,
            },
            Some(a) = answered.recv() => vec![f.on_answer(a)],
            _ = tick.tick(), if f.seq.waiting() => f.seq.tick(Instant::now()),
        };
        for step in steps {
            f.apply(step).await;
        }
    }
}

impl Fanout {
    /// A message of the delivery subject: numbered ones go through the sequencer.
    fn on_message(&mut self, m: BusMessage) -> Step<BusMessage> {
        let now = Instant::now();
        let Some(source) = source_of(&m) else {
            return Step::default();
        };
        if !self.terms.admit(source, m.header(HEADER_TERM), now) {
            return Step::default();
        }
        let Some(n) = m.header(HEADER_FRONT_SEQ).and_then(|v| v.parse().ok()) else {
            // From a worker that does not number its messages.
            let mut step = Step::default();
            step.out.push(InOrder::Deliver(m));
            return step;
        };
        let stream = StreamId {
            source: source.to_string(),
            term: m
                .header(HEADER_TERM)
                .and_then(|t| t.parse().ok())
                .unwrap_or(0),
            origin: m.header(HEADER_ORIGIN).unwrap_or_default().to_string(),
        };
        if m.header(HEADER_NOTICE) == Some(NOTICE_HEARTBEAT) {
            return self.seq.heartbeat(stream, n, now);
        }
        let resent = m.header(HEADER_RESENT).is_some();
        let step = self.seq.message(stream, n, m, now);
        if resent && step.duplicates == 0 {
            metrics::counter!(telemetry::DELIVERY_RECOVERED).increment(1);
        }
        step
    }

    fn on_answer(&mut self, (stream, from, to, answer): Answer) -> Step<BusMessage> {
        let now = Instant::now();
        let lost = match answer {
            Ok(reply) => {
                if let Some((a, b)) = reply.resent {
                    tracing::info!(
                        from = a,
                        to = b,
                        "the leader resends what this front missed"
                    );
                }
                reply
                    .lost
                    .map(|(a, b)| (a, b, reply.reason.unwrap_or_default()))
            }
            Err(ResendError::Unsupported) => Some((from, to, "nothing to resend them".into())),
            Err(e) => {
                tracing::warn!(error = %e, from, to, "resend request failed (asked again)");
                return Step::default();
            }
        };
        self.seq.answered(&stream, lost, now)
    }

    async fn apply(&mut self, step: Step<BusMessage>) {
        if step.duplicates > 0 {
            metrics::counter!(telemetry::REPLAYS_DROPPED).increment(step.duplicates);
        }
        if let Some((stream, from, to)) = step.ask {
            self.ask(stream, from, to);
        }
        for out in step.out {
            match out {
                InOrder::Deliver(m) => self.handle(m).await,
                InOrder::Lost(loss) => self.lost(&loss),
            }
        }
    }

    /// Ask the stream's leader for `from..=to` again; the answer comes back to the loop.
    fn ask(&self, stream: StreamId, from: u64, to: u64) {
        tracing::warn!(
            from,
            to,
            source = %stream.source,
            term = stream.term,
            "messages from the leader missed: asking for them again"
        );
        let req = ResendRequest {
            front: self.feed.front_id.clone(),
            term: stream.term,
            origin: stream.origin.clone(),
            from,
            to,
        };
        let (resend, answers, timeout) = (
            self.feed.resend.clone(),
            self.answers.clone(),
            self.feed.window,
        );
        tokio::spawn(async move {
            let answer = resend.request(&stream.source, &req, timeout).await;
            let _ = answers.send((stream, from, to, answer));
        });
    }

    /// Messages of a source lost for good: every channel with `postgres_changes`
    /// subscriptions of that source's projects is told.
    fn lost(&self, loss: &Loss) {
        metrics::counter!(telemetry::DELIVERY_GAPS).increment(1);
        metrics::counter!(telemetry::DELIVERY_LOST).increment(loss.missing);
        let sinks = self.feed.registry.sinks_of(&loss.source);
        tracing::error!(source = %loss.source, from = loss.from, to = loss.to, missing = loss.missing, why = %loss.why, channels = sinks.len(), "messages from a leader lost: its source's postgres_changes channels are told");
        let why = format!(
            "Some database changes may not have been delivered: this server lost its link to \
             the change stream for a moment and {} message(s) could not be recovered ({})",
            loss.missing, loss.why
        );
        for (sink, _) in sinks {
            sink.missed(&why);
        }
    }

    async fn handle(&mut self, m: BusMessage) {
        match m.header(HEADER_NOTICE) {
            None => deliver(&self.feed, &m, &mut self.replays),
            Some(NOTICE_SUBS_ENDED) => self.feed.registration.subs_ended(&m).await,
            Some(NOTICE_SUBS_LAGGED) => self.feed.registration.subs_warned(&m, "changes_lagged"),
            Some(NOTICE_SUBS_WITHHELD) => {
                self.feed.registration.subs_warned(&m, "changes_withheld")
            }
            Some(NOTICE_HEARTBEAT) => {}
            Some(other) => {
                telemetry::error("unknown_notice");
                tracing::warn!(notice = other, "unknown notice on the delivery subject");
            }
        }
    }
}

/// The source a message names (absent: the default); `None` (counted): not a source name.
fn source_of(m: &BusMessage) -> Option<&str> {
    let source = walcast_bus::source::of_header(m.header(HEADER_SOURCE));
    if walcast_bus::source::check_name(source).is_err() {
        telemetry::error("bad_source_header");
        tracing::warn!(source, "a message naming no valid source: dropped");
        return None;
    }
    Some(source)
}

/// Whether a change of `project` may come from `source`'s leader: the directory puts
/// the project on that source. Else it is dropped and counted (before the replay guard
/// sees it: another source must not poison a project's positions either).
pub(crate) fn from_its_source(projects: &Projects, source: &str, project: &str) -> bool {
    if projects.is_on(project, source) {
        return true;
    }
    let its = projects.source_of(project);
    metrics::counter!(telemetry::FOREIGN_SOURCE_DROPPED).increment(1);
    tracing::warn!(
        source,
        project,
        project_source = its.as_deref().unwrap_or("(unknown project)"),
        "dropped a change of a project that is not on the source it came from"
    );
    false
}

fn deliver(feed: &Feed, msg: &BusMessage, replays: &mut ReplayGuard) {
    let registry = &feed.registry;
    let Some(source) = source_of(msg) else {
        return;
    };
    let ev: ChangeEvent = match serde_json::from_slice(&msg.payload) {
        Ok(ev) => ev,
        Err(e) => {
            telemetry::error("bad_change_event");
            tracing::warn!(subject = %msg.subject, error = %e, "undecodable change event");
            return;
        }
    };
    if !from_its_source(&feed.projects, source, &ev.project) {
        return;
    }
    registry.saw(source, ev.commit_lsn);
    if !replays.admit(&ev) {
        return;
    }
    if ev.restricted.is_empty() {
        deliver_event(registry, &ev);
        return;
    }
    // Subscribers that may see only some columns get their own, reduced copy.
    match ev.variants() {
        Ok(variants) => variants.iter().for_each(|v| deliver_event(registry, v)),
        Err(e) => {
            telemetry::error("bad_change_event");
            tracing::warn!(subject = %msg.subject, error = %e, "cannot reduce a change event");
        }
    }
}

fn deliver_event(registry: &Registry, ev: &ChangeEvent) {
    let groups = registry.groups(ev);
    if groups.is_empty() {
        return;
    }
    let Some(encoded) = encode(ev) else {
        return;
    };
    let mut change = Change::new(ev, &encoded);
    let mut delivered = 0u64;
    for (sink, ids) in groups {
        delivered += u64::from(sink.deliver(&mut change, &ids));
    }
    // Once per change: a lookup by name for each of 10,000 deliveries was a hundredth of
    // the fan-out's CPU.
    metrics::counter!(telemetry::DELIVERIES).increment(delivered);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_is_taken_only_from_its_projects_source() {
        let projects = Projects::new(crate::auth::keys::ProjectKeys::secret("s"));
        projects.insert_on("p2", "project_p2", "x", "s2");
        projects.insert("p1", "project_p1", "y");
        assert!(from_its_source(&projects, "s2", "p2"));
        assert!(from_its_source(&projects, "default", "p1"));
        assert!(from_its_source(
            &projects,
            "default",
            crate::DEFAULT_PROJECT
        ));
        assert!(
            !from_its_source(&projects, "default", "p2"),
            "the default source speaks for s2's project"
        );
        assert!(
            !from_its_source(&projects, "s2", "p1"),
            "s2 speaks for a default-source project"
        );
        assert!(!from_its_source(&projects, "s2", crate::DEFAULT_PROJECT));
        assert!(!from_its_source(&projects, "s3", "p2"), "another source");
        assert!(
            !from_its_source(&projects, "s2", "nobody"),
            "an unknown project"
        );
    }
}
