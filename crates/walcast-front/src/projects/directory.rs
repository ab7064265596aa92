//! The project directory's link to the cdc-worker: it replaces the known projects with
//! the worker's list at start, periodically, and when a token names an unknown project
//! (at most once per `min_refresh`, concurrent misses sharing one refresh).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use walcast_bus::admin::{AdminClient, AdminError, ProjectRecord};

use super::status::{ProjectEvent, Status};
use super::{Entry, Table};
use crate::auth::keys::ProjectKeys;
use crate::auth::DEFAULT_PROJECT;

/// How the directory keeps up with the worker's project list.
#[derive(Clone, Debug)]
pub struct DirectoryConfig {
    /// Bound of one request to the worker.
    pub timeout: Duration,
    /// Refreshes caused by unknown projects are at least this far apart.
    pub min_refresh: Duration,
    /// Periodic refresh.
    pub refresh_every: Duration,
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        DirectoryConfig {
            timeout: Duration::from_secs(5),
            min_refresh: Duration::from_secs(1),
            refresh_every: Duration::from_secs(30),
        }
    }
}

pub(super) struct Directory {
    admin: AdminClient,
    cfg: DirectoryConfig,
    /// When the last refresh started, and how it ended. Held during a refresh, so
    /// concurrent misses queue behind it and then share its result.
    last: tokio::sync::Mutex<Option<(Instant, Result<(), AdminError>)>>,
    /// Signalled by every refresh, so the loop watching rotation windows sees new ones.
    refreshed: tokio::sync::Notify,
}

impl Directory {
    pub(super) fn new(admin: AdminClient, cfg: DirectoryConfig) -> Directory {
        Directory {
            admin,
            cfg,
            last: tokio::sync::Mutex::new(None),
            refreshed: tokio::sync::Notify::new(),
        }
    }

    pub(super) fn admin(&self) -> &AdminClient {
        &self.admin
    }

    /// Refresh `table` because a project was unknown at `now`: share a refresh that
    /// started since, else wait until `min_refresh` after the previous one and refresh.
    pub(super) async fn refresh_after_miss(
        &self,
        table: &Table,
        events: &Events,
    ) -> Result<(), AdminError> {
        let missed_at = Instant::now();
        let mut last = self.last.lock().await;
        if let Some((started, result)) = last.as_ref() {
            if *started >= missed_at {
                return result.clone();
            }
            tokio::time::sleep_until(*started + self.cfg.min_refresh).await;
        }
        let started = Instant::now();
        let result = self.fetch(table, events).await;
        *last = Some((started, result.clone()));
        result
    }

    /// Refresh now (after the one running, if any).
    pub(super) async fn refresh(&self, table: &Table, events: &Events) -> Result<(), AdminError> {
        let mut last = self.last.lock().await;
        let started = Instant::now();
        let result = self.fetch(table, events).await;
        *last = Some((started, result.clone()));
        result
    }

    /// Replace every project of `table` but the default one with the worker's list.
    async fn fetch(&self, table: &Table, events: &Events) -> Result<(), AdminError> {
        metrics::counter!(crate::telemetry::PROJECT_REFRESHES).increment(1);
        let list = match self.admin.projects(self.cfg.timeout).await {
            Ok(l) => l,
            Err(e) => {
                crate::telemetry::error("project_directory");
                tracing::warn!(error = %e, "cannot refresh the project directory");
                return Err(e);
            }
        };
        let map: HashMap<String, Entry> = list
            .into_iter()
            .filter(|p| p.id != DEFAULT_PROJECT)
            .map(|p| {
                let entry = Entry {
                    schema: Arc::from(p.schema.as_str()),
                    source: Arc::from(record_source(&p)),
                    keys: record_keys(&p),
                    keys_tag: keys_tag(&p),
                    status: record_status(&p),
                };
                (p.id, entry)
            })
            .collect();
        let (projects, changed) = table.replace(map);
        self.refreshed.notify_one();
        tracing::debug!(projects, "project directory refreshed");
        for e in changed {
            tracing::info!(event = ?e, "project changed: its sockets end");
            let _ = events.send(e);
        }
        Ok(())
    }

    /// Load the projects into `table` now and every `refresh_every` until `cancel` fires;
    /// and as each rotation window ends, tell that the project's keys changed.
    pub(super) async fn refresh_loop(
        &self,
        table: &Table,
        events: &Events,
        cancel: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(self.cfg.refresh_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut checked_ms = super::status::now_ms();
        loop {
            let window_end = table.next_window_end(checked_ms).map(instant_at);
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {
                    let mut last = self.last.lock().await;
                    let started = Instant::now();
                    let result = self.fetch(table, events).await;
                    *last = Some((started, result));
                }
                _ = tokio::time::sleep_until(window_end.unwrap_or_else(Instant::now)),
                    if window_end.is_some() => {}
                _ = self.refreshed.notified() => {}
            }
            let now_ms = super::status::now_ms();
            for id in table.windows_ended(checked_ms, now_ms) {
                tracing::info!(project = %id, "a rotated secret's window ended: sessions are checked again");
                let _ = events.send(ProjectEvent::KeysChanged(id));
            }
            checked_ms = now_ms;
        }
    }
}

/// The instant of a Unix time in ms (now, if it is past).
fn instant_at(unix_ms: i64) -> Instant {
    let left = unix_ms.saturating_sub(super::status::now_ms()).max(0);
    Instant::now() + Duration::from_millis(left as u64)
}

/// Where a refresh tells what changed.
pub(super) type Events = tokio::sync::broadcast::Sender<ProjectEvent>;

/// A stored project's source (an empty name, as `ProjectRecord::default()` has: the
/// default source).
fn record_source(p: &ProjectRecord) -> &str {
    match p.source.as_str() {
        "" => walcast_bus::source::DEFAULT_SOURCE,
        s => s,
    }
}

/// A stored project's switches; after a rotation, its keys without the previous secret
/// from the window's end.
fn record_status(p: &ProjectRecord) -> Status {
    let rotated = p.jwt_secret_previous_until_ms.map(|until| {
        let current = ProjectRecord {
            jwt_secret_previous: None,
            ..p.clone()
        };
        (record_keys(&current), until)
    });
    Status {
        suspended: p.suspended,
        private_only: p.private_only,
        rotated,
        limits: p.limits,
    }
}

/// A digest of what a stored project's keys are made of (see [`Entry::keys_tag`]).
fn keys_tag(p: &ProjectRecord) -> [u8; 32] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let until = p.jwt_secret_previous_until_ms.map(|t| t.to_string());
    for part in [
        Some(p.jwt_secret.as_str()),
        p.jwt_secret_previous.as_deref(),
        until.as_deref(),
        p.jwks.as_deref(),
    ] {
        // Each part length-prefixed (absent: a length no string has), so no two lists of
        // parts share a digest input.
        let len = part.map_or(u64::MAX, |s| s.len() as u64);
        h.update(len.to_le_bytes());
        h.update(part.unwrap_or("").as_bytes());
    }
    h.finalize().into()
}

/// A stored project's keys: its secret, its previous one, its JWKS (a JWKS that does not
/// parse is left out, with an error in the log: the secrets still work).
fn record_keys(p: &ProjectRecord) -> ProjectKeys {
    let jwks = match p.jwks.as_deref().map(crate::auth::keys::parse_jwks) {
        None => Vec::new(),
        Some(Ok(keys)) => keys,
        Some(Err(e)) => {
            tracing::error!(project = %p.id, error = %e, "the project's JWKS is unusable; its public-key tokens are refused");
            Vec::new()
        }
    };
    let previous = p.jwt_secret_previous.as_deref().map(str::as_bytes);
    ProjectKeys::secret(p.jwt_secret.as_bytes()).with(previous, jwks)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use walcast_bus::admin::{
        AdminHandler, AdminReply, AdminRequest, ProjectLimits, ProjectRecord, LIMITS,
    };
    use walcast_bus::subs::BoxFuture;

    use super::*;
    use crate::projects::Projects;

    /// The worker's side of the project list (as in `projects`' tests).
    struct Stored(Mutex<Vec<ProjectRecord>>);

    impl AdminHandler for Stored {
        fn handle(&self, req: AdminRequest) -> BoxFuture<Result<AdminReply, AdminError>> {
            assert_eq!(req, AdminRequest::Projects);
            let projects = self.0.lock().unwrap().clone();
            Box::pin(async move { Ok(AdminReply::Projects { projects }) })
        }
    }

    fn record(id: &str, limits: ProjectLimits) -> ProjectRecord {
        ProjectRecord {
            id: id.into(),
            name: id.into(),
            schema: format!("project_{id}"),
            jwt_secret: "s".into(),
            limits,
            ..ProjectRecord::default()
        }
    }

    #[tokio::test]
    async fn a_refresh_carries_every_limit_of_a_project_and_only_its_own() {
        let own = ProjectLimits::from_array(std::array::from_fn(|i| Some(i as u32 * 10)));
        let stored = Arc::new(Stored(Mutex::new(vec![
            record("a", own),
            record("b", ProjectLimits::default()),
        ])));
        let p = Projects::with_directory(
            "s0",
            AdminClient::local(stored.clone()),
            DirectoryConfig::default(),
        );
        p.refresh_now().await;
        assert_eq!(p.limits("a"), own);
        assert_eq!(p.max_users("a"), Some(0));
        assert_eq!(p.limits("b"), ProjectLimits::default());
        assert_eq!(p.limits("default"), ProjectLimits::default());
        assert_eq!(p.limits("unknown"), ProjectLimits::default());
        // One limit back to the default, another changed: the next refresh has them.
        let mut a = own.to_array();
        a[0] = None;
        a[LIMITS - 1] = Some(u32::MAX);
        let changed = ProjectLimits::from_array(a);
        *stored.0.lock().unwrap() = vec![record("a", changed)];
        p.refresh_now().await;
        assert_eq!(p.limits("a"), changed);
        assert_eq!(p.max_users("a"), None);
        assert_eq!(p.limits("b"), ProjectLimits::default(), "b is gone");
    }

    #[tokio::test]
    async fn a_refresh_learns_each_projects_source() {
        let on_s2 = ProjectRecord {
            source: "s2".into(),
            ..record("a", ProjectLimits::default())
        };
        let stored = Arc::new(Stored(Mutex::new(vec![
            on_s2,
            record("b", ProjectLimits::default()),
        ])));
        let p = Projects::with_directory(
            "s0",
            AdminClient::local(stored.clone()),
            DirectoryConfig::default(),
        );
        p.refresh_now().await;
        assert_eq!(p.source_of("a").as_deref(), Some("s2"));
        assert_eq!(p.source_of("b").as_deref(), Some("default"));
        assert_eq!(p.source_of(DEFAULT_PROJECT).as_deref(), Some("default"));
        assert_eq!(p.source_of("unknown"), None);
        let sources: Vec<String> = p.sources().into_iter().collect();
        assert_eq!(sources, ["default", "s2"]);
    }
}
