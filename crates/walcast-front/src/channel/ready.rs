//! `config.broadcast.replication_ready`: a channel that asks for it gets the `system`
//! message `{extension:"system", status:"ok", message:"Replication connection
//! established"}` once the change stream runs (a recent health beacon of a leader of the
//! channel's project's source says its CDC is active, see [`crate::cluster`]): with its first frames if it already
//! does, else when it is first seen running (checked every [`POLL`]). Not running within
//! `replication_ready_timeout` ([`crate::FrontConfig`], a minute): a `system` error, and
//! the channel is closed, as Supabase does.

use tokio::time::{Duration, Instant};
use walcast_protocol::server::{self, SystemStatus};
use walcast_protocol::Frame;

use super::{Channels, Services};

/// The message, as Supabase words it.
pub const READY: &str = "Replication connection established";
/// The error when the stream does not run in time.
pub const NOT_READY: &str = "Replication connection was not established in time";
/// How often a waiting channel looks again.
pub const POLL: Duration = Duration::from_millis(500);

/// A channel's wait for the stream.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadyWait {
    pub poll_at: Instant,
    pub deadline: Instant,
}

/// The `system` message saying the stream runs.
pub(super) fn ready_message(join_ref: Option<&str>, topic: &str) -> Frame {
    server::system(join_ref, topic, "system", SystemStatus::Ok, READY)
}

/// Whether the leader of `project`'s source is heard streaming.
fn stream_runs(sv: &Services, project: &str, now: Instant) -> bool {
    let Some(source) = sv.projects.source_of(project) else {
        return false;
    };
    sv.heard.lock().pipeline_active(&source, now.into_std())
}

/// Why `project` gets no changes while no leader of its source is heard streaming
/// ([`crate::subscription::source_watch::not_streaming`]).
pub(super) fn not_streaming(sv: &Services, project: &str) -> Option<(String, bool)> {
    crate::subscription::source_watch::not_streaming(&sv.heard, &sv.projects, project)
}

/// At a join with `postgres_changes` accepted while a worker reports that its source
/// fails: the `system` error saying why (its changes wait until the source streams).
pub(super) fn failing_source_message(
    sv: &Services,
    project: &str,
    join_ref: Option<&str>,
    topic: &str,
) -> Option<Frame> {
    let (why, reported) = not_streaming(sv, project)?;
    reported.then(|| {
        server::system(
            join_ref,
            topic,
            "postgres_changes",
            SystemStatus::Error,
            &format!("Subscribed, but {why}"),
        )
    })
}

/// At a join that asked for it: the message now (to go with the first frames), or the
/// wait.
pub(super) fn at_join(
    sv: &Services,
    project: &str,
    join_ref: Option<&str>,
    topic: &str,
) -> (Option<Frame>, Option<ReadyWait>) {
    let now = Instant::now();
    if stream_runs(sv, project, now) {
        return (Some(ready_message(join_ref, topic)), None);
    }
    let wait = ReadyWait {
        poll_at: now + POLL,
        deadline: now + sv.cfg.replication_ready_timeout,
    };
    (None, Some(wait))
}

/// Answer the waits due by `now`: the message if the stream runs, the error (and the
/// channel closed) past the deadline, else look again in [`POLL`]. A channel with a
/// command in flight is looked at once it is answered.
pub(super) async fn check(s: &mut Channels, now: Instant) {
    let due: Vec<String> = s
        .channels
        .iter()
        .filter(|(t, c)| c.ready_wait.is_some_and(|w| w.poll_at <= now) && !s.pending.holds(t))
        .map(|(t, _)| t.clone())
        .collect();
    if due.is_empty() {
        return;
    }
    let runs = stream_runs(&s.services, &s.project, now);
    let not_ready = match runs {
        true => NOT_READY.to_string(),
        false => not_streaming(&s.services, &s.project).map_or_else(
            || NOT_READY.to_string(),
            |(why, _)| format!("{NOT_READY}: {why}"),
        ),
    };
    for topic in due {
        let vsn = s.vsn;
        let Some(ch) = s.channels.get_mut(&topic) else {
            continue;
        };
        let Some(wait) = ch.ready_wait.as_mut() else {
            continue;
        };
        if runs {
            ch.ready_wait = None;
            let f = ready_message(ch.join_ref.as_deref(), &topic);
            if let Some(o) = crate::connection::Out::frame(&f, vsn) {
                ch.out.deliver(o);
            }
        } else if now >= wait.deadline {
            crate::telemetry::error("replication_not_ready");
            s.shut(&topic, &not_ready).await;
        } else {
            wait.poll_at = now + POLL;
        }
    }
}
