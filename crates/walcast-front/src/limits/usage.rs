//! Per-project usage on this front, and the per-project limits.
//!
//! Each project seen here (only projects of verified keys: bounded by the directory) has
//! its counters: connected users (sockets with at least one joined channel, and SSE
//! streams), channels, joins, messages and bytes in and out, refusals, and its rates over
//! the last second ([`crate::limits::rates`]). They are read by `GET /metrics/projects` (one
//! labelled series per project, kept off `/metrics` so its cardinality does not grow with
//! the projects), by the inspector (a key sees its own project; the operator sees every
//! project) and by this front's health beacon.
//!
//! **Limits across the fronts.** Connected users and the rates (joins, broadcast and
//! presence messages and their bytes, presence events) are limited per project across the
//! cluster: this front's count plus what the other fronts announced in their beacons (one
//! a second, at most [`REMOTE_FRESH`] old). Eventually consistent: fronts that admit within
//! the same second may overshoot by what each admitted in that second. A socket's first
//! join (or an SSE stream) over the users limit is refused with
//! `ConnectionRateLimitReached: Too many connected users`; what the other limits refuse,
//! and how, is the callers' (README "Running a platform").
//!
//! Each limit is the project's own (set through the management API; the [`Limits`] lookup
//! reads it from the project directory) or else this front's default (`PROJECT_MAX_*`).
//! A new limit holds from the directory's next refresh (at once after a management API
//! change). Lowering the users limit below the users connected now ends no socket and
//! leaves no channel: only new users are refused until enough leave.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use walcast_bus::admin::ProjectLimits;
use walcast_bus::beacon::ProjectRates;

use crate::cluster::Heard;
use crate::limits::rates::{Rate, Rates};
use crate::telemetry;

/// Other fronts' counts older than this are not counted (a front that stopped).
pub const REMOTE_FRESH: Duration = Duration::from_secs(3);
/// Projects a beacon announces at most (the busiest first).
pub const BEACON_MAX_PROJECTS: usize = 10_000;
/// A refused project is logged at most once per this interval.
const LOG_EVERY_MS: u64 = 10_000;

/// One project's counters on this front.
#[derive(Default, Debug)]
pub struct ProjectCounts {
    pub users: AtomicU64,
    pub channels: AtomicU64,
    pub joins: AtomicU64,
    pub refused: AtomicU64,
    pub messages_in: AtomicU64,
    pub bytes_in: AtomicU64,
    pub messages_out: AtomicU64,
    pub bytes_out: AtomicU64,
    /// Milliseconds since the front started, when a refusal was last logged (+1).
    logged_at: AtomicU64,
    rates: Mutex<Rates>,
}

impl ProjectCounts {
    fn load(&self, c: &AtomicU64) -> u64 {
        let _ = self;
        c.load(Ordering::Relaxed)
    }

    fn rates(&self) -> std::sync::MutexGuard<'_, Rates> {
        self.rates.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Why a project may not take one more user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Too many connected users")]
pub struct TooManyUsers {
    pub project: String,
    pub users: u64,
    pub limit: u64,
}

impl TooManyUsers {
    /// Supabase's code for it.
    pub const CODE: &'static str = "ConnectionRateLimitReached";
}

/// A rate over its project's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverRate {
    pub rate: Rate,
    /// The project's rate across the fronts, before what was refused.
    pub seen: u64,
    pub limit: u64,
}

/// Why a message a client sends is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageRefused {
    /// Its payload is over the project's `max_payload_size_in_kb`.
    TooLarge { size: u64, max: u64 },
    /// The project is over its messages/s or bytes/s.
    OverRate(OverRate),
}

/// Supabase's system message for a channel shut because its project sends too much.
pub const TOO_MANY_MESSAGES: &str = "Too many messages per second";

/// A project's own limits (the project directory's; each `None`: the default).
pub type Limits = Arc<dyn Fn(&str) -> ProjectLimits + Send + Sync>;

/// A project's limits in effect: its own, else the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Quotas {
    pub users: u64,
    pub joins_per_second: u64,
    pub channels_per_client: u64,
    pub events_per_second: u64,
    pub bytes_per_second: u64,
    pub presence_events_per_second: u64,
    /// The largest broadcast or presence payload, in bytes.
    pub payload_bytes: u64,
}

impl Quotas {
    fn of(own: ProjectLimits, default: &ProjectLimits) -> Quotas {
        let pick = |o: Option<u32>, d: Option<u32>| u64::from(o.or(d).unwrap_or(u32::MAX));
        Quotas {
            users: pick(own.max_concurrent_users, default.max_concurrent_users),
            joins_per_second: pick(own.max_joins_per_second, default.max_joins_per_second),
            channels_per_client: pick(own.max_channels_per_client, default.max_channels_per_client),
            events_per_second: pick(own.max_events_per_second, default.max_events_per_second),
            bytes_per_second: pick(own.max_bytes_per_second, default.max_bytes_per_second),
            presence_events_per_second: pick(
                own.max_presence_events_per_second,
                default.max_presence_events_per_second,
            ),
            payload_bytes: pick(own.max_payload_size_in_kb, default.max_payload_size_in_kb)
                .saturating_mul(1024),
        }
    }

    /// The limit of `rate`.
    pub fn of_rate(&self, rate: Rate) -> u64 {
        match rate {
            Rate::Joins => self.joins_per_second,
            Rate::Events => self.events_per_second,
            Rate::Bytes => self.bytes_per_second,
            Rate::Presence => self.presence_events_per_second,
        }
    }
}

/// This front's per-project usage.
pub struct Usage {
    front_id: String,
    /// Every limit's default (each field `Some`; a `None` would mean no limit).
    defaults: ProjectLimits,
    limits: Limits,
    heard: Arc<Heard>,
    started: Instant,
    projects: RwLock<HashMap<String, Arc<ProjectCounts>>>,
}

impl Usage {
    pub(crate) fn new(
        front_id: String,
        defaults: ProjectLimits,
        limits: Limits,
        heard: Arc<Heard>,
    ) -> Usage {
        Usage {
            front_id,
            defaults,
            limits,
            heard,
            started: Instant::now(),
            projects: RwLock::default(),
        }
    }

    /// `project`'s counters (created at first use).
    pub fn of(&self, project: &str) -> Arc<ProjectCounts> {
        if let Some(c) = self.read().get(project) {
            return c.clone();
        }
        let mut w = self.projects.write().unwrap_or_else(|p| p.into_inner());
        w.entry(project.to_string()).or_default().clone()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<ProjectCounts>>> {
        self.projects.read().unwrap_or_else(|p| p.into_inner())
    }

    /// `project`'s limits in effect.
    pub fn quotas(&self, project: &str) -> Quotas {
        Quotas::of((self.limits)(project), &self.defaults)
    }

    /// `project`'s limit of connected users: its own, else the default.
    pub fn max_users(&self, project: &str) -> u64 {
        self.quotas(project).users
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Count `wants` (rate, amount) for `project` if every one stays within the project's
    /// limit across the fronts; else count nothing, and say which is over.
    pub fn take(&self, project: &str, wants: &[(Rate, u64)]) -> Result<(), OverRate> {
        let quotas = self.quotas(project);
        let remote = {
            let heard = self.heard.lock();
            heard.front_rates(project, &self.front_id, Instant::now(), REMOTE_FRESH)
        };
        let counts = self.of(project);
        let now = self.now_ms();
        let mut rates = counts.rates();
        for &(rate, n) in wants {
            let seen = rates.rate(rate, now).saturating_add(rate.of(&remote));
            let limit = quotas.of_rate(rate);
            if seen.saturating_add(n) > limit {
                return Err(OverRate { rate, seen, limit });
            }
        }
        for &(rate, n) in wants {
            rates.add(rate, now, n);
        }
        Ok(())
    }

    /// A broadcast or presence message of `size` bytes that a client of `project` sends:
    /// within the project's payload limit and its messages/s and bytes/s across the
    /// fronts? Counted if so; counted as refused and logged if not.
    pub fn admit_message(&self, project: &str, size: usize) -> Result<(), MessageRefused> {
        self.check_payload(project, size)?;
        self.take_messages(project, 1, size as u64)
    }

    /// Is a payload of `size` bytes within `project`'s limit? (A refusal is counted and
    /// logged; nothing else is counted.)
    pub fn check_payload(&self, project: &str, size: usize) -> Result<(), MessageRefused> {
        let size = size as u64;
        let max = self.quotas(project).payload_bytes;
        if size > max {
            let detail = format!("payload of {size} bytes, max {max}");
            self.refuse(project, "payload_size", "PayloadSizeExceeded", &detail);
            return Err(MessageRefused::TooLarge { size, max });
        }
        Ok(())
    }

    /// `count` messages of `bytes` in all that clients of `project` send: counted if the
    /// project stays within its messages/s and bytes/s across the fronts; else refused
    /// (counted as such and logged), and none counted.
    pub fn take_messages(
        &self,
        project: &str,
        count: u64,
        bytes: u64,
    ) -> Result<(), MessageRefused> {
        let wants = [(Rate::Events, count), (Rate::Bytes, bytes)];
        self.take(project, &wants).map_err(|over| {
            let detail = format!(
                "{:?} {} per second, limit {}",
                over.rate, over.seen, over.limit
            );
            self.refuse(
                project,
                "project_messages",
                "MessagePerSecondRateLimitReached",
                &detail,
            );
            MessageRefused::OverRate(over)
        })
    }

    /// Count what was sent to `project`'s clients (no limit: what is refused is what
    /// they send while their project is over its rates).
    pub fn count(&self, project: &str, sent: &[(Rate, u64)]) {
        let counts = self.of(project);
        let now = self.now_ms();
        let mut rates = counts.rates();
        for &(rate, n) in sent {
            rates.add(rate, now, n);
        }
    }

    /// Count and log (at most once per project per `LOG_EVERY_MS`) a refusal by a
    /// per-project limit: `code` is Supabase's name of it, `label` the
    /// `walcast_limits_total` kind.
    pub fn refuse(&self, project: &str, label: &'static str, code: &'static str, detail: &str) {
        let counts = self.of(project);
        counts.refused.fetch_add(1, Ordering::Relaxed);
        telemetry::limit(label);
        if self.may_log(&counts) {
            tracing::warn!(project, code, detail, "refused by a per-project limit");
        }
    }

    /// `project`'s connected users on the other fronts, as last announced.
    pub fn remote_users(&self, project: &str) -> u64 {
        let heard = self.heard.lock();
        heard.front_users(project, &self.front_id, Instant::now(), REMOTE_FRESH)
    }

    /// One more connected user of `project`, released when the slot is dropped.
    pub fn admit(&self, project: &str) -> Result<UserSlot, TooManyUsers> {
        let counts = self.of(project);
        let local = counts.users.fetch_add(1, Ordering::AcqRel);
        let users = local + self.remote_users(project);
        let limit = self.max_users(project);
        if users >= limit {
            counts.users.fetch_sub(1, Ordering::AcqRel);
            counts.refused.fetch_add(1, Ordering::Relaxed);
            telemetry::limit("project_users");
            if self.may_log(&counts) {
                tracing::warn!(
                    project,
                    users,
                    limit,
                    "project at its connected-users limit: joins refused (ConnectionRateLimitReached)"
                );
            }
            return Err(TooManyUsers {
                project: project.to_string(),
                users,
                limit,
            });
        }
        Ok(UserSlot { counts })
    }

    /// Whether a refusal of `counts`' project may be logged now (one in
    /// [`LOG_EVERY_MS`]).
    fn may_log(&self, counts: &ProjectCounts) -> bool {
        let now = self.now_ms() + 1;
        let last = counts.logged_at.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < LOG_EVERY_MS {
            return false;
        }
        counts
            .logged_at
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// Connected users per project (non-zero ones, the busiest [`BEACON_MAX_PROJECTS`]),
    /// for this front's beacon.
    pub fn users(&self) -> BTreeMap<String, u64> {
        let mut v: Vec<(String, u64)> = self
            .read()
            .iter()
            .map(|(p, c)| (p.clone(), c.load(&c.users)))
            .filter(|(_, n)| *n > 0)
            .collect();
        if v.len() > BEACON_MAX_PROJECTS {
            v.sort_by_key(|e| std::cmp::Reverse(e.1));
            v.truncate(BEACON_MAX_PROJECTS);
        }
        v.into_iter().collect()
    }

    /// Rates per project over the last second (non-zero ones, the busiest
    /// [`BEACON_MAX_PROJECTS`] by messages), for this front's beacon.
    pub fn rates(&self) -> BTreeMap<String, ProjectRates> {
        let now = self.now_ms();
        let mut v: Vec<(String, ProjectRates)> = self
            .read()
            .iter()
            .map(|(p, c)| (p.clone(), c.rates().all(now)))
            .filter(|(_, r)| !r.is_empty())
            .collect();
        if v.len() > BEACON_MAX_PROJECTS {
            v.sort_by_key(|e| std::cmp::Reverse((e.1.events, e.1.joins)));
            v.truncate(BEACON_MAX_PROJECTS);
        }
        v.into_iter().collect()
    }

    /// Every project's counters, by project id.
    pub fn snapshot(&self) -> BTreeMap<String, ProjectUsage> {
        let now = self.now_ms();
        self.read()
            .iter()
            .map(|(p, c)| (p.clone(), ProjectUsage::of(c, now)))
            .collect()
    }
}

/// One project's counters at one moment (`/metrics/projects`, the inspector).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct ProjectUsage {
    pub users: u64,
    pub channels: u64,
    pub joins: u64,
    pub refused: u64,
    pub messages_in: u64,
    pub bytes_in: u64,
    pub messages_out: u64,
    pub bytes_out: u64,
    /// Rates on this front over the last second.
    pub rates: ProjectRates,
}

impl ProjectUsage {
    fn of(c: &ProjectCounts, now_ms: u64) -> ProjectUsage {
        ProjectUsage {
            rates: c.rates().all(now_ms),
            users: c.load(&c.users),
            channels: c.load(&c.channels),
            joins: c.load(&c.joins),
            refused: c.load(&c.refused),
            messages_in: c.load(&c.messages_in),
            bytes_in: c.load(&c.bytes_in),
            messages_out: c.load(&c.messages_out),
            bytes_out: c.load(&c.bytes_out),
        }
    }
}

/// A connected user of a project (a socket with a joined channel, or an SSE stream);
/// released on drop.
#[derive(Debug)]
pub struct UserSlot {
    counts: Arc<ProjectCounts>,
}

impl UserSlot {
    pub fn counts(&self) -> &Arc<ProjectCounts> {
        &self.counts
    }
}

impl Drop for UserSlot {
    fn drop(&mut self) {
        self.counts.users.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A `/metrics/projects` series: name, type, help, the field it shows.
type Series = (
    &'static str,
    &'static str,
    &'static str,
    fn(&ProjectUsage) -> u64,
);

/// The series of `GET /metrics/projects`.
const SERIES: [Series; 12] = [
    (
        "walcast_project_users",
        "gauge",
        "Connected users (sockets with a joined channel, SSE streams) on this front",
        |u| u.users,
    ),
    (
        "walcast_project_channels",
        "gauge",
        "Joined channels on this front",
        |u| u.channels,
    ),
    (
        "walcast_project_joins_total",
        "counter",
        "Joins accepted",
        |u| u.joins,
    ),
    (
        "walcast_project_refused_total",
        "counter",
        "Joins, streams and messages refused by a per-project limit",
        |u| u.refused,
    ),
    (
        "walcast_project_messages_in_total",
        "counter",
        "Broadcast and presence messages received from the project's clients",
        |u| u.messages_in,
    ),
    (
        "walcast_project_bytes_in_total",
        "counter",
        "Bytes of those messages",
        |u| u.bytes_in,
    ),
    (
        "walcast_project_messages_out_total",
        "counter",
        "Messages queued to the project's clients",
        |u| u.messages_out,
    ),
    (
        "walcast_project_bytes_out_total",
        "counter",
        "Bytes of those messages",
        |u| u.bytes_out,
    ),
    (
        "walcast_project_joins_per_second",
        "gauge",
        "Channel joins per second on this front (over the last second)",
        |u| u.rates.joins,
    ),
    (
        "walcast_project_events_per_second",
        "gauge",
        "Broadcast and presence messages received and sent per second on this front",
        |u| u.rates.events,
    ),
    (
        "walcast_project_bytes_per_second",
        "gauge",
        "Bytes of those messages per second on this front",
        |u| u.rates.bytes,
    ),
    (
        "walcast_project_presence_events_per_second",
        "gauge",
        "Presence track and untrack events per second on this front",
        |u| u.rates.presence,
    ),
];

/// The series of `GET /metrics/projects`, in Prometheus' text format.
pub fn render(usage: &BTreeMap<String, ProjectUsage>) -> String {
    let mut out = String::new();
    for (name, kind, help, field) in SERIES {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (project, u) in usage {
            let label = project
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            out.push_str(&format!("{name}{{project=\"{label}\"}} {}\n", field(u)));
        }
    }
    out
}

#[cfg(test)]
mod tests;
