//! Per-project usage on this front, and the per-project limit on connected users.
//!
//! Each project seen here (only projects of verified keys: bounded by the directory) has
//! its counters: connected users (sockets with at least one joined channel, and SSE
//! streams), channels, joins, messages and bytes in and out, and refusals. They are read
//! by `GET /metrics/projects` (one labelled series per project, kept off `/metrics` so its
//! cardinality does not grow with the projects), by the inspector (a key sees its own
//! project; the operator sees every project) and by this front's health beacon.
//!
//! **Connected users** are limited per project across the cluster, as Supabase's
//! `max_concurrent_users`: a socket's first join (or an SSE stream) is refused with
//! `ConnectionRateLimitReached: Too many connected users` when this front's users of the
//! project plus those the other fronts announced in their beacons (at most
//! [`REMOTE_FRESH`] old) reach the limit. Eventually consistent: fronts that admit users
//! within the same second may overshoot by what each admitted in that second.
//!
//! The limit is the project's own (`max_concurrent_users`, set through the management
//! API; the [`Limits`] lookup reads it from the project directory) or else this front's
//! default (`PROJECT_MAX_USERS`). A new limit holds from the directory's next refresh
//! (at once after a management API change). Lowering it below the users connected now
//! ends no socket and leaves no channel: only new users are refused until enough leave.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::cluster::Heard;
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
}

impl ProjectCounts {
    fn load(&self, c: &AtomicU64) -> u64 {
        let _ = self;
        c.load(Ordering::Relaxed)
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

/// A project's own connected-users limit, if it has one (the project directory's).
pub type Limits = Arc<dyn Fn(&str) -> Option<u64> + Send + Sync>;

/// This front's per-project usage.
pub struct Usage {
    front_id: String,
    /// The default connected-users limit of a project.
    max_users: u64,
    limits: Limits,
    heard: Arc<Heard>,
    started: Instant,
    projects: RwLock<HashMap<String, Arc<ProjectCounts>>>,
}

impl Usage {
    pub(crate) fn new(
        front_id: String,
        max_users: u64,
        limits: Limits,
        heard: Arc<Heard>,
    ) -> Usage {
        Usage {
            front_id,
            max_users,
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

    /// The default limit of connected users per project.
    pub fn default_max_users(&self) -> u64 {
        self.max_users
    }

    /// `project`'s limit of connected users: its own, else the default.
    pub fn max_users(&self, project: &str) -> u64 {
        (self.limits)(project).unwrap_or(self.max_users)
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
            self.log_refusal(project, &counts, users, limit);
            return Err(TooManyUsers {
                project: project.to_string(),
                users,
                limit,
            });
        }
        Ok(UserSlot { counts })
    }

    /// Count a refusal of another per-project limit.
    pub fn refused(&self, project: &str) {
        self.of(project).refused.fetch_add(1, Ordering::Relaxed);
    }

    fn log_refusal(&self, project: &str, counts: &ProjectCounts, users: u64, limit: u64) {
        let now = self.started.elapsed().as_millis() as u64 + 1;
        let last = counts.logged_at.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < LOG_EVERY_MS {
            return;
        }
        if counts
            .logged_at
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            tracing::warn!(
                project,
                users,
                limit,
                "project at its connected-users limit: joins refused (ConnectionRateLimitReached)"
            );
        }
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

    /// Every project's counters, by project id.
    pub fn snapshot(&self) -> BTreeMap<String, ProjectUsage> {
        self.read()
            .iter()
            .map(|(p, c)| (p.clone(), ProjectUsage::of(c)))
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
}

impl ProjectUsage {
    fn of(c: &ProjectCounts) -> ProjectUsage {
        ProjectUsage {
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

/// The series of `GET /metrics/projects`, in Prometheus' text format.
pub fn render(usage: &BTreeMap<String, ProjectUsage>) -> String {
    type Field = fn(&ProjectUsage) -> u64;
    let series: [(&str, &str, &str, Field); 8] = [
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
    ];
    let mut out = String::new();
    for (name, kind, help, field) in series {
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
mod tests {
    use super::*;

    fn usage(max: u64) -> Usage {
        Usage::new(
            "me".into(),
            max,
            Arc::new(|_| None),
            Arc::new(Heard::default()),
        )
    }

    #[test]
    fn users_are_limited_per_project_and_released() {
        let u = usage(2);
        let a = u.admit("p").expect("first");
        let _b = u.admit("p").expect("second");
        let e = u.admit("p").expect_err("third refused");
        assert_eq!((e.users, e.limit), (2, 2));
        assert!(u.admit("q").is_ok(), "another project is not affected");
        drop(a);
        assert!(u.admit("p").is_ok(), "a released slot is taken again");
        assert_eq!(u.snapshot()["p"].refused, 1);
    }

    #[test]
    fn a_project_s_own_limit_replaces_the_default() {
        let own: Arc<RwLock<HashMap<String, u64>>> = Arc::default();
        let lookup = own.clone();
        let limits: Limits = Arc::new(move |p| lookup.read().unwrap().get(p).copied());
        let u = Usage::new("me".into(), 3, limits, Arc::new(Heard::default()));
        own.write().unwrap().insert("small".into(), 1);
        own.write().unwrap().insert("closed".into(), 0);
        assert_eq!((u.max_users("small"), u.max_users("other")), (1, 3));
        let first = u.admit("small").expect("the first of one");
        let e = u.admit("small").expect_err("the second refused");
        assert_eq!((e.users, e.limit), (1, 1));
        assert_eq!(u.admit("closed").expect_err("zero: nobody").limit, 0);
        let others: Vec<UserSlot> = (0..3).map(|_| u.admit("other").unwrap()).collect();
        assert!(
            u.admit("other").is_err(),
            "the default still holds elsewhere"
        );
        // Lowered below the users connected: they stay, new ones are refused.
        own.write().unwrap().insert("other".into(), 1);
        assert_eq!(u.snapshot()["other"].users, 3);
        assert!(u.admit("other").is_err());
        drop(others);
        assert!(u.admit("other").is_ok(), "room again once they left");
        // Raised, then back to the default.
        own.write().unwrap().insert("small".into(), 2);
        let _second = u.admit("small").expect("room under the raised limit");
        own.write().unwrap().remove("small");
        let _third = u.admit("small").expect("the default again: 3");
        drop(first);
    }

    #[test]
    fn beacon_lists_only_projects_with_users() {
        let u = usage(10);
        let _a = u.admit("p").unwrap();
        drop(u.admit("q").unwrap());
        assert_eq!(u.users(), BTreeMap::from([("p".to_string(), 1)]));
    }

    #[test]
    fn metrics_escape_project_ids() {
        let m = BTreeMap::from([("a\"b\\c".to_string(), ProjectUsage::default())]);
        let text = render(&m);
        assert!(
            text.contains("walcast_project_users{project=\"a\\\"b\\\\c\"} 0"),
            "{text}"
        );
    }
}
