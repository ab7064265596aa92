//! The project directory: project id → (schema, verification keys).
//!
//! A token selects its project through its `ref` claim (absent or `"default"` = the
//! default project) and is verified with that project's secret.
//!
//! With an [`AdminClient`] the directory learns the stored projects from the cdc-worker:
//! at start, every [`DirectoryConfig::refresh_every`], and when a token names an unknown
//! project. Those on-demand refreshes happen at most once per
//! [`DirectoryConfig::min_refresh`] (tokens with random `ref`s cannot hammer the worker)
//! and concurrent misses share one refresh (the `directory` submodule).

mod directory;
mod status;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use walcast_bus::admin::AdminClient;
use walcast_bus::source::DEFAULT_SOURCE;
// The tests' (their module, `projects/tests.rs`, takes everything from here).
#[cfg(test)]
use {std::time::Duration, tokio::time::Instant, walcast_bus::admin::AdminError};

use directory::Directory;
pub use directory::DirectoryConfig;
use status::Status;
pub use status::{ProjectEvent, PRIVATE_ONLY_MESSAGE, SUSPENDED_MESSAGE};

use crate::auth::keys::ProjectKeys;
use crate::auth::remote_jwks::AfterMiss;
use crate::auth::{peek_claims, verify_with, AuthError, Verified, DEFAULT_PROJECT, DEFAULT_SCHEMA};

/// Project id → (schema, verification keys). Cheap to clone.
#[derive(Clone)]
pub struct Projects {
    inner: Arc<Inner>,
}

struct Inner {
    table: Table,
    directory: Option<Directory>,
    /// The roles a token may act as (`ALLOWED_ROLES`).
    allowed_roles: RwLock<Arc<[String]>>,
    /// Projects deleted, suspended, made private-only or whose keys changed, as refreshes
    /// (and the ends of rotation windows) see them.
    events: tokio::sync::broadcast::Sender<ProjectEvent>,
}

/// Default of [`Projects::set_allowed_roles`]: Supabase's API roles.
pub const DEFAULT_ALLOWED_ROLES: &[&str] = &["anon", "authenticated", "service_role"];

#[derive(Clone)]
struct Entry {
    schema: Arc<str>,
    /// The source (database) its schema is in.
    source: Arc<str>,
    keys: ProjectKeys,
    /// What its keys were made from (a digest): a refresh that changes it makes every
    /// session of the project check its token again.
    keys_tag: [u8; 32],
    status: Status,
}

impl Entry {
    /// The keys valid now (a rotated secret's predecessor only within its window).
    fn keys_now(&self) -> &ProjectKeys {
        match &self.status.rotated {
            Some((current, from_ms)) if status::now_ms() >= *from_ms => current,
            _ => &self.keys,
        }
    }
}

/// The known projects, the default one always among them.
struct Table {
    map: RwLock<HashMap<String, Entry>>,
    default: Entry,
}

impl Table {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Entry>> {
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Entry>> {
        self.map.write().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, id: &str) -> Option<Entry> {
        self.read().get(id).cloned()
    }

    /// Replace every project with `stored` and the default one; how many there are now,
    /// and what changed for the projects known before.
    fn replace(&self, mut stored: HashMap<String, Entry>) -> (usize, Vec<ProjectEvent>) {
        stored.insert(DEFAULT_PROJECT.to_string(), self.default.clone());
        let n = stored.len();
        let mut map = self.write();
        let mut events: Vec<ProjectEvent> = map
            .iter()
            .filter_map(|(id, old)| {
                status::events(id, &old.status, stored.get(id).map(|e| &e.status))
            })
            .collect();
        events.extend(map.iter().filter_map(|(id, old)| {
            let new = stored.get(id)?;
            (new.keys_tag != old.keys_tag).then(|| ProjectEvent::KeysChanged(id.clone()))
        }));
        *map = stored;
        (n, events)
    }

    /// The earliest end of a rotation window after `after_ms` (Unix ms), if any.
    fn next_window_end(&self, after_ms: i64) -> Option<i64> {
        self.read()
            .values()
            .filter_map(|e| e.status.rotated.as_ref().map(|(_, end)| *end))
            .filter(|end| *end > after_ms)
            .min()
    }

    /// The projects whose rotation window ended in `(from_ms, to_ms]`.
    fn windows_ended(&self, from_ms: i64, to_ms: i64) -> Vec<String> {
        self.read()
            .iter()
            .filter(|(_, e)| {
                e.status
                    .rotated
                    .as_ref()
                    .is_some_and(|(_, end)| from_ms < *end && *end <= to_ms)
            })
            .map(|(id, _)| id.clone())
            .collect()
    }
}

impl Projects {
    /// Only the default project (id [`DEFAULT_PROJECT`], schema `public`) with this
    /// secret; no directory.
    pub fn new(default_keys: impl Into<ProjectKeys>) -> Projects {
        Projects::build(default_keys.into(), None)
    }

    /// The default project plus the stored projects, learnt from the cdc-worker through
    /// `admin`. Start [`Projects::refresh_loop`] to load them and keep them current.
    pub fn with_directory(
        default_keys: impl Into<ProjectKeys>,
        admin: AdminClient,
        cfg: DirectoryConfig,
    ) -> Projects {
        Projects::build(default_keys.into(), Some(Directory::new(admin, cfg)))
    }

    fn build(default_keys: ProjectKeys, directory: Option<Directory>) -> Projects {
        let default = Entry {
            schema: Arc::from(DEFAULT_SCHEMA),
            source: Arc::from(DEFAULT_SOURCE),
            keys: default_keys,
            keys_tag: [0; 32],
            status: Status::default(),
        };
        let mut map = HashMap::new();
        map.insert(DEFAULT_PROJECT.to_string(), default.clone());
        Projects {
            inner: Arc::new(Inner {
                table: Table {
                    map: RwLock::new(map),
                    default,
                },
                directory,
                allowed_roles: RwLock::new(
                    DEFAULT_ALLOWED_ROLES
                        .iter()
                        .map(|r| r.to_string())
                        .collect(),
                ),
                events: tokio::sync::broadcast::channel(1024).0,
            }),
        }
    }

    /// Projects deleted, suspended, made private-only or whose keys changed, as the
    /// directory's refreshes and the ends of rotation windows see them (the front ends
    /// their sockets, or checks their sessions' tokens again).
    pub fn events(&self) -> tokio::sync::broadcast::Receiver<ProjectEvent> {
        self.inner.events.subscribe()
    }

    /// A known project's own connected-users limit (`None`: unknown, or the default).
    pub fn max_users(&self, id: &str) -> Option<u64> {
        self.limits(id).max_concurrent_users.map(u64::from)
    }

    /// A known project's own limits (each `None`: the default; all `None`: unknown).
    pub fn limits(&self, id: &str) -> walcast_bus::admin::ProjectLimits {
        self.read()
            .get(id)
            .map(|e| e.status.limits)
            .unwrap_or_default()
    }

    /// Whether a known project refuses public channels.
    pub fn private_only(&self, id: &str) -> bool {
        self.entry(id).is_some_and(|e| e.status.private_only)
    }

    /// Refresh the directory now (a management notice: a project changed), at once
    /// unless a refresh is running (then after it).
    pub async fn refresh_now(&self) {
        if let Some(dir) = &self.inner.directory {
            let _ = dir.refresh(&self.inner.table, &self.inner.events).await;
        }
    }

    /// Tokens may act only as these roles (a token naming another `role` is refused
    /// wherever it is presented).
    pub fn set_allowed_roles(&self, roles: impl IntoIterator<Item = String>) {
        let roles: Arc<[String]> = roles
            .into_iter()
            .map(|r| r.trim().to_string())
            .filter(|r| !r.is_empty())
            .collect();
        *self
            .inner
            .allowed_roles
            .write()
            .unwrap_or_else(|p| p.into_inner()) = roles;
    }

    /// A token's `role`, if any, must be a string naming an allowed role.
    fn check_role(&self, v: &Verified) -> Result<(), AuthError> {
        let Some(role) = v.claims.get("role") else {
            return Ok(());
        };
        let Some(role) = role.as_str() else {
            return Err(AuthError::Malformed("`role` must be a string".into()));
        };
        let allowed = self
            .inner
            .allowed_roles
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|a| a == role);
        if !allowed {
            crate::telemetry::error("role_not_allowed");
            return Err(AuthError::RoleNotAllowed(role.to_string()));
        }
        Ok(())
    }

    /// The worker's admin client, when this front has a directory.
    pub fn admin(&self) -> Option<&AdminClient> {
        self.inner.directory.as_ref().map(Directory::admin)
    }

    /// Add (or replace) a project. With a directory, the next refresh replaces every
    /// project but the default one with the worker's list.
    pub fn insert(&self, id: impl Into<String>, schema: &str, secret: impl AsRef<[u8]>) {
        self.insert_on(id, schema, secret, DEFAULT_SOURCE);
    }

    /// [`Projects::insert`] of a project on `source`.
    pub fn insert_on(
        &self,
        id: impl Into<String>,
        schema: &str,
        secret: impl AsRef<[u8]>,
        source: &str,
    ) {
        let entry = Entry {
            schema: Arc::from(schema),
            source: Arc::from(source),
            keys: ProjectKeys::secret(secret),
            keys_tag: [0; 32],
            status: Status::default(),
        };
        self.write().insert(id.into(), entry);
    }

    /// The source (database) a known project is on (`None`: unknown). The default
    /// project is on the default source.
    pub fn source_of(&self, id: &str) -> Option<String> {
        self.read().get(id).map(|e| e.source.to_string())
    }

    /// Whether a known project is on `source` (no allocation: asked per change).
    pub fn is_on(&self, id: &str, source: &str) -> bool {
        self.read().get(id).is_some_and(|e| &*e.source == source)
    }

    /// Every source some known project is on, the default one always among them.
    pub fn sources(&self) -> std::collections::BTreeSet<String> {
        let map = self.read();
        let mut names: std::collections::BTreeSet<&str> =
            map.values().map(|e| &*e.source).collect();
        names.insert(DEFAULT_SOURCE);
        names.into_iter().map(str::to_string).collect()
    }

    /// Remove a project (the default one cannot be removed).
    pub fn remove(&self, id: &str) -> bool {
        if id == DEFAULT_PROJECT {
            return false;
        }
        self.write().remove(id).is_some()
    }

    /// Whether a project is known now (without asking the worker).
    pub fn contains(&self, id: &str) -> bool {
        self.read().contains_key(id)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Entry>> {
        self.inner.table.read()
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Entry>> {
        self.inner.table.write()
    }

    fn entry(&self, id: &str) -> Option<Entry> {
        self.inner.table.get(id)
    }

    /// The schema of a project, asking the worker if it is not known yet.
    pub async fn schema(&self, id: &str) -> Result<String, AuthError> {
        Ok(self.resolve(id).await?.schema.to_string())
    }

    /// A known project, or one the directory learns by refreshing (rate-limited).
    async fn resolve(&self, id: &str) -> Result<Entry, AuthError> {
        if let Some(e) = self.entry(id) {
            return Ok(e);
        }
        let Some(dir) = &self.inner.directory else {
            return Err(AuthError::UnknownProject(id.to_string()));
        };
        let refreshed = dir
            .refresh_after_miss(&self.inner.table, &self.inner.events)
            .await;
        match (self.entry(id), refreshed) {
            (Some(e), _) => Ok(e),
            (None, Ok(())) => Err(AuthError::UnknownProject(id.to_string())),
            (None, Err(e)) => Err(AuthError::DirectoryUnavailable(e.message)),
        }
    }

    /// Fetch the default project's JWKS URL (`JWT_JWKS_URL`), if it has one, now and every
    /// refresh interval (after a failed fetch: once the miss interval has passed) until
    /// `cancel` fires. A change makes every session of the project check its token again:
    /// a key the provider removed ends the sessions it verified.
    pub async fn jwks_loop(self, cancel: CancellationToken) {
        let Some(remote) = self.inner.table.default.keys.remote.clone() else {
            return;
        };
        let cfg = remote.config().clone();
        loop {
            let wait = match remote.refresh().await {
                Ok(changed) => {
                    if changed {
                        self.keys_changed(DEFAULT_PROJECT);
                    }
                    cfg.refresh_every
                }
                Err(_) => cfg.min_refresh,
            };
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Every session of `project` checks its token again.
    fn keys_changed(&self, project: &str) {
        let _ = self
            .inner
            .events
            .send(ProjectEvent::KeysChanged(project.to_string()));
    }

    /// Load the projects now and every `refresh_every` until `cancel` fires (nothing to
    /// do without a directory).
    pub async fn refresh_loop(self, cancel: CancellationToken) {
        if let Some(dir) = &self.inner.directory {
            dir.refresh_loop(&self.inner.table, &self.inner.events, cancel)
                .await;
        }
    }

    /// Verify a token, choosing the project by its `ref` claim (absent = default).
    pub async fn verify(&self, token: &str) -> Result<Verified, AuthError> {
        let unverified = peek_claims(token)?;
        let project = match unverified.get("ref") {
            None | Some(Value::Null) => DEFAULT_PROJECT.to_string(),
            Some(Value::String(r)) => r.clone(),
            Some(_) => return Err(AuthError::Malformed("`ref` must be a string".into())),
        };
        let entry = self.resolve(&project).await?;
        let v = match verify_with(project.clone(), &entry.schema, entry.keys_now(), token) {
            Err(e @ (AuthError::Signature | AuthError::UnknownKey { .. })) => {
                self.verify_after_refresh(project, token).await.ok_or(e)?
            }
            other => other?,
        };
        self.check_role(&v)?;
        if entry.status.suspended {
            crate::telemetry::error("project_suspended");
            return Err(AuthError::Suspended(v.project));
        }
        Ok(v)
    }

    /// A token whose signature did not verify may be signed with keys this front has not
    /// learnt yet (a rotation made through another front): verify it once more after a
    /// refresh of the directory, which is shared and rate-limited like a miss's. `None`:
    /// still refused (the caller answers with the first refusal).
    async fn verify_after_refresh(&self, project: String, token: &str) -> Option<Verified> {
        let remote = self.entry(&project)?.keys_now().remote.clone();
        if let Some(remote) = remote {
            let outcome = remote.refresh_after_miss().await;
            if outcome == AfterMiss::Changed {
                self.keys_changed(&project);
            }
            if outcome != AfterMiss::Unchanged {
                let entry = self.entry(&project)?;
                return verify_with(project, &entry.schema, entry.keys_now(), token).ok();
            }
        }
        let dir = self.inner.directory.as_ref()?;
        let _ = dir
            .refresh_after_miss(&self.inner.table, &self.inner.events)
            .await;
        let entry = self.entry(&project)?;
        verify_with(project, &entry.schema, entry.keys_now(), token).ok()
    }

    /// Whether a session of `project` may keep acting with `token`: verified again with the
    /// project's keys in force now (a rotated secret only within its window), its times
    /// and role checked, the project neither gone nor suspended. From what this front
    /// knows, without asking the worker: sessions are checked again whenever a project's
    /// keys change ([`ProjectEvent::KeysChanged`]).
    pub fn check_session(&self, project: &str, token: &str) -> Result<(), AuthError> {
        let entry = self
            .entry(project)
            .ok_or_else(|| AuthError::UnknownProject(project.to_string()))?;
        let v = verify_with(project.to_string(), &entry.schema, entry.keys_now(), token)?;
        self.check_role(&v)?;
        if entry.status.suspended {
            return Err(AuthError::Suspended(v.project));
        }
        Ok(())
    }

    /// Verify a token for a known project: its `ref` claim, if any, must name it.
    pub async fn verify_for(&self, project: &str, token: &str) -> Result<Verified, AuthError> {
        let v = self.verify(token).await?;
        if v.project != project {
            return Err(AuthError::WrongProject {
                token: v.project,
                socket: project.to_string(),
            });
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests;
