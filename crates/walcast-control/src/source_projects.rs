//! The projects of one source (README "Sources"), as the control database says: what a
//! source's leader may speak for.
//!
//! A source's database may belong to a tenant (a dedicated database), who can write
//! anything into it: a `walcast.realtime_tables` row naming another project, a
//! `realtime.messages` row with another project's id. So the leader of a source delivers,
//! publishes, registers and answers only for the projects the control database puts on
//! that source; anything else read from it is dropped, counted
//! ([`crate::telemetry::FOREIGN_PROJECT_DROPPED`]) and logged.
//!
//! The set is read when a term starts, every [`REFRESH`] while it lasts, and at once
//! (at most every [`MISS_REFRESH`]) when a registration or an admin request names a
//! project it does not know (a project created a moment ago).

use std::collections::{HashMap, HashSet};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use crate::error::ControlError;
use crate::tables::DEFAULT_PROJECT;

/// How often a leading source reads its projects again.
pub const REFRESH: Duration = Duration::from_secs(5);
/// The least time between two reads caused by an unknown project.
pub const MISS_REFRESH: Duration = Duration::from_millis(200);

/// The projects of `source`: id → schema.
pub struct SourceProjects {
    source: String,
    control_url: String,
    ids: RwLock<HashMap<String, String>>,
    /// Projects looked up and not found since the last periodic read: not looked up
    /// again until then (a project's id is random, so none is looked up before it
    /// exists, except by whoever forges it).
    absent: RwLock<HashSet<String>>,
    /// When the set was last read (serialises the reads).
    read_at: Mutex<Option<Instant>>,
}

/// Absent projects remembered at most (then forgotten all at once).
const MAX_ABSENT: usize = 10_000;

impl std::fmt::Debug for SourceProjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceProjects")
            .field("source", &self.source)
            .field("projects", &self.len())
            .finish()
    }
}

impl SourceProjects {
    /// The projects of `source`, read from the control database at `control_url`.
    pub fn new(source: &str, control_url: &str) -> SourceProjects {
        let ids = match walcast_bus::source::is_default(source) {
            true => HashMap::from([(
                DEFAULT_PROJECT.to_string(),
                crate::projects::DEFAULT_SCHEMA.to_string(),
            )]),
            false => HashMap::new(),
        };
        SourceProjects {
            source: source.to_string(),
            control_url: control_url.to_string(),
            ids: RwLock::new(ids),
            absent: RwLock::new(HashSet::new()),
            read_at: Mutex::new(None),
        }
    }

    /// A fixed set (tests, tools).
    pub fn fixed(source: &str, projects: &[(&str, &str)]) -> SourceProjects {
        let s = SourceProjects::new(source, "");
        let mut ids = s.write();
        ids.extend(projects.iter().map(|(p, s)| (p.to_string(), s.to_string())));
        drop(ids);
        s
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, String>> {
        self.ids.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, String>> {
        self.ids.write().unwrap_or_else(|p| p.into_inner())
    }

    fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether `project` is on this source, as last read.
    pub fn contains(&self, project: &str) -> bool {
        self.read().contains_key(project)
    }

    /// Read the set again from the control database.
    pub async fn refresh(&self) -> Result<(), ControlError> {
        let mut read_at = self.read_at.lock().await;
        self.load().await?;
        self.absent
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        *read_at = Some(Instant::now());
        Ok(())
    }

    async fn load(&self) -> Result<(), ControlError> {
        if self.control_url.is_empty() {
            return Ok(());
        }
        let client = walcast_pgtls::connect(&self.control_url).await?;
        let rows = client
            .query(
                "SELECT id, schema_name FROM walcast.projects WHERE source = $1",
                &[&self.source],
            )
            .await?;
        let mut ids: HashMap<String, String> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        if walcast_bus::source::is_default(&self.source) {
            ids.insert(
                DEFAULT_PROJECT.to_string(),
                crate::projects::DEFAULT_SCHEMA.to_string(),
            );
        }
        *self.write() = ids;
        Ok(())
    }

    /// The schema of `project` if it is on this source. One not known is looked up again
    /// (reads at most every [`MISS_REFRESH`]: a second miss waits for the next one), once
    /// until the next periodic read.
    pub async fn schema_of(&self, project: &str) -> Result<Option<String>, ControlError> {
        if let Some(s) = self.read().get(project) {
            return Ok(Some(s.clone()));
        }
        if self.is_absent(project) {
            return Ok(None);
        }
        {
            let mut read_at = self.read_at.lock().await;
            if let Some(wait) = read_at.and_then(|t| MISS_REFRESH.checked_sub(t.elapsed())) {
                tokio::time::sleep(wait).await;
            }
            if !self.read().contains_key(project) {
                self.load().await?;
                *read_at = Some(Instant::now());
            }
        }
        let found = self.read().get(project).cloned();
        if found.is_none() {
            let mut absent = self.absent.write().unwrap_or_else(|p| p.into_inner());
            if absent.len() >= MAX_ABSENT {
                absent.clear();
            }
            absent.insert(project.to_string());
        }
        Ok(found)
    }

    fn is_absent(&self, project: &str) -> bool {
        let absent = self.absent.read().unwrap_or_else(|p| p.into_inner());
        absent.contains(project)
            || (project == DEFAULT_PROJECT && !walcast_bus::source::is_default(&self.source))
    }

    /// Whether something read from this source for `project` may pass: the project is on
    /// the source (read again at once, at most every [`MISS_REFRESH`], when it is not
    /// known: it may be new). Else it is counted and logged as `what`.
    pub async fn admits(&self, project: &str, what: &'static str) -> Result<bool, ControlError> {
        if self.contains(project) || self.schema_of(project).await?.is_some() {
            return Ok(true);
        }
        self.foreign(project, what);
        Ok(false)
    }

    /// Count and log something read from this source for a project not on it.
    pub fn foreign(&self, project: &str, what: &'static str) {
        metrics::counter!(crate::telemetry::FOREIGN_PROJECT_DROPPED, "what" => what).increment(1);
        tracing::warn!(source = %self.source, %project, what, "dropped: the project is not on this source (its database names a project it does not hold)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_default_source_holds_the_default_project_and_no_other_does() {
        let d = SourceProjects::new("default", "");
        assert!(d.contains(DEFAULT_PROJECT));
        assert_eq!(
            d.schema_of(DEFAULT_PROJECT).await.unwrap().as_deref(),
            Some("public")
        );
        let s = SourceProjects::fixed("shop", &[("p1", "project_p1")]);
        assert!(
            !s.contains(DEFAULT_PROJECT),
            "the default project is the default source's"
        );
        assert!(s.contains("p1"));
        assert_eq!(s.schema_of("p2").await.unwrap(), None);
        assert!(
            s.is_absent("p2"),
            "not looked up again before the next read"
        );
        assert!(s.is_absent(DEFAULT_PROJECT));
        s.refresh().await.unwrap();
        assert!(!s.is_absent("p2"));
    }
}
