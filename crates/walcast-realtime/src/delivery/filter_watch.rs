//! Telling the subscriptions whose filter reads a column their role may not `SELECT`.
//!
//! The authorizer withholds every change from such a subscription, at that change and
//! whatever its filter would have said (see [`crate::authorize`]): a column revoked
//! since the join, or a table enabled after a wildcard binding that has the column but
//! does not let the role read it. This tells each of them why, once per table, with a
//! `system` error on its channel ([`NOTICE_SUBS_WITHHELD`]; the subscription goes on,
//! and fires again once the column is granted back).
//!
//! The notice must not depend on the changes: sent where a matching change is withheld,
//! it would tell what the column holds (or that a row the role cannot see changed). So a
//! task of its own compares every filtered class with the catalog, in one statement, when
//! the pipeline decodes a DDL notice or a realtime-tables edit ([`FilterWatch::poke`]) and
//! every [`SWEEP_EVERY`] (role memberships, and privileges without the event triggers,
//! change without a notice).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio_postgres::{Client, Statement};
use walcast_bus::subs::{SubsEnded, NOTICE_SUBS_WITHHELD};
use walcast_pipeline::Position;
use walcast_wal2json::Lsn;

use crate::delivery::outlet::Outlet;
use crate::error::RealtimeError;
use crate::subscriptions::matcher::{Class, Matcher};
use crate::telemetry;

/// How often every filtered class is compared with the catalog, besides the pokes.
pub const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Subscription ids per notice, at most (a notice is one bus message).
const IDS_PER_NOTICE: usize = 1_000;

/// Per (class, column read by its filter): the enabled tables of the class's project it
/// covers where that column exists and its role may not read it. `$1`…`$5`: project,
/// schema (or `*`), table (or `''`: every table of the schema), role, column.
const UNREADABLE_SQL: &str = "
SELECT q.n, t.schema_name::text, t.table_name::text
  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) WITH ORDINALITY
       AS q(project, schema, tbl, role, col, n)
  JOIN walcast.realtime_tables t ON t.project_id = q.project
   AND (q.schema = '*' OR t.schema_name = q.schema) AND (q.tbl = '' OR t.table_name = q.tbl)
  JOIN pg_attribute a ON a.attrelid = to_regclass(format('%I.%I', t.schema_name, t.table_name))
   AND a.attname = q.col AND a.attnum > 0 AND NOT a.attisdropped
 WHERE NOT coalesce((SELECT has_column_privilege(r.oid, a.attrelid, a.attnum, 'SELECT')
                       FROM pg_roles r WHERE r.rolname = q.role), false)";

/// The watch's task; ends when dropped (with the consumer of its session).
pub struct FilterWatch {
    poke: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FilterWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FilterWatch {
    /// Watch `matcher`'s filtered classes against the database at `database_url`, telling
    /// through `outlet`; notices are stamped with the commit `position` holds.
    pub fn spawn(
        matcher: Arc<Matcher>,
        database_url: String,
        outlet: Arc<Outlet>,
        position: Arc<AtomicU64>,
    ) -> FilterWatch {
        let poke = Arc::new(Notify::new());
        let watch = Watch {
            matcher,
            database_url,
            outlet,
            position,
            client: None,
            told: HashSet::new(),
        };
        let task = walcast_core::source_scope::spawn(watch.run(poke.clone()));
        FilterWatch { poke, task }
    }

    /// Privileges or the realtime tables may have changed: compare again now.
    pub fn poke(&self) {
        self.poke.notify_one();
    }
}

/// (project, schema or `*`, table or `''`, role, column): what one row of the statement asks.
type Combo = (String, String, String, String, String);

/// (subscription id, `schema.table`).
type Told = (String, String);

struct Watch {
    matcher: Arc<Matcher>,
    database_url: String,
    outlet: Arc<Outlet>,
    position: Arc<AtomicU64>,
    /// Its connection and statement.
    client: Option<(Client, Statement)>,
    /// Subscriptions told, per table, while that stays so (told again after a GRANT
    /// back and another REVOKE).
    told: HashSet<Told>,
}

impl Watch {
    async fn run(mut self, poke: Arc<Notify>) {
        loop {
            let _ = tokio::time::timeout(SWEEP_EVERY, poke.notified()).await;
            if let Err(e) = self.sweep().await {
                tracing::warn!(error = %e, "cannot compare subscription filters with column privileges; trying again");
                self.client = None;
            }
        }
    }

    async fn client(&mut self) -> Result<&(Client, Statement), RealtimeError> {
        if self.client.as_ref().is_none_or(|(c, _)| c.is_closed()) {
            let client = walcast_pgtls::connect(&self.database_url).await?;
            let stmt = client.prepare(UNREADABLE_SQL).await?;
            self.client = Some((client, stmt));
        }
        self.client.as_ref().ok_or(RealtimeError::RlsUnavailable(
            "the filter watch's connection",
        ))
    }

    /// Compare every filtered class with the catalog; tell the subscriptions newly
    /// withheld a table's changes.
    async fn sweep(&mut self) -> Result<(), RealtimeError> {
        let classes = self.matcher.filtered_classes();
        if classes.is_empty() {
            self.told.clear();
            return Ok(());
        }
        let (combos, by_combo) = combos(&classes);
        let arrays: [Vec<&str>; 5] = [
            combos.iter().map(|c| c.0.as_str()).collect(),
            combos.iter().map(|c| c.1.as_str()).collect(),
            combos.iter().map(|c| c.2.as_str()).collect(),
            combos.iter().map(|c| c.3.as_str()).collect(),
            combos.iter().map(|c| c.4.as_str()).collect(),
        ];
        let (client, stmt) = self.client().await?;
        let [a, b, c, d, e] = &arrays;
        let rows = client.query(stmt, &[a, b, c, d, e]).await?;
        // (class, table) → why.
        let mut blocked: BTreeMap<(String, String), String> = BTreeMap::new();
        for row in rows {
            let n: i64 = row.try_get(0)?;
            let table = format!(
                "{}.{}",
                row.try_get::<_, String>(1)?,
                row.try_get::<_, String>(2)?
            );
            let Some(i) = usize::try_from(n - 1).ok() else {
                continue;
            };
            let (Some(combo), Some(keys)) = (combos.get(i), by_combo.get(i)) else {
                continue;
            };
            for key in keys {
                let why = message(&table, &combo.4, &combo.3);
                blocked.entry((key.clone(), table.clone())).or_insert(why);
            }
        }
        self.tell(blocked).await
    }

    /// Tell each subscription of the blocked (class, table) pairs not told yet.
    async fn tell(
        &mut self,
        blocked: BTreeMap<(String, String), String>,
    ) -> Result<(), RealtimeError> {
        let mut now: HashSet<Told> = HashSet::new();
        // (front, table, why) → subscriptions to tell.
        let mut notices: BTreeMap<(String, String, String), Vec<String>> = BTreeMap::new();
        for ((class, table), why) in blocked {
            for (front, ids) in self.matcher.class_subs(&class) {
                for id in ids {
                    let pair = (id, table.clone());
                    if !self.told.contains(&pair) {
                        let key = (front.clone(), table.clone(), why.clone());
                        notices.entry(key).or_default().push(pair.0.clone());
                    }
                    now.insert(pair);
                }
            }
        }
        let at = Position::commit(Lsn(self.position.load(Ordering::Acquire)));
        for ((front, table, why), ids) in notices {
            for chunk in ids.chunks(IDS_PER_NOTICE) {
                let notice = SubsEnded {
                    ids: chunk.to_vec(),
                    message: why.clone(),
                };
                let payload = serde_json::to_vec(&notice).map_err(|e| {
                    RealtimeError::Event(walcast_pipeline::change_event::EventError::Json(e))
                })?;
                let out = &self.outlet;
                let notice = Some(NOTICE_SUBS_WITHHELD);
                out.links
                    .send(&out.publisher, &front, at, notice, Bytes::from(payload))
                    .await?;
                tracing::warn!(%front, subscriptions = chunk.len(), reason = %why, "subscriptions told their filter reads a column their role may not read");
                metrics::counter!(telemetry::FILTER_UNREADABLE_NOTICES)
                    .increment(chunk.len() as u64);
                self.told
                    .extend(chunk.iter().map(|id| (id.clone(), table.clone())));
            }
        }
        // Forget what is no longer so (a GRANT back, a subscription gone).
        self.told.retain(|pair| now.contains(pair));
        Ok(())
    }
}

/// The distinct questions for the statement, and per question the classes asking it.
fn combos(classes: &[Arc<Class>]) -> (Vec<Combo>, Vec<Vec<String>>) {
    let mut index: HashMap<Combo, usize> = HashMap::new();
    let mut combos: Vec<Combo> = Vec::new();
    let mut by_combo: Vec<Vec<String>> = Vec::new();
    for class in classes {
        let f = &class.fields;
        if f.role.is_empty() {
            // Refused at every change anyway ("no role claim").
            continue;
        }
        let cols: HashSet<&str> = class.filter_columns().collect();
        for col in cols {
            let combo: Combo = (
                f.project.clone(),
                f.schema.clone(),
                f.table.clone().unwrap_or_default(),
                f.role.clone(),
                col.to_string(),
            );
            let i = *index.entry(combo.clone()).or_insert_with(|| {
                combos.push(combo);
                by_combo.push(Vec::new());
                combos.len() - 1
            });
            if let Some(keys) = by_combo.get_mut(i) {
                keys.push(class.key.clone());
            }
        }
    }
    (combos, by_combo)
}

/// The `system` error a subscription gets.
fn message(table: &str, column: &str, role: &str) -> String {
    format!(
        "Changes of {table} are not delivered to this subscription: its filter reads column \
         {column:?}, which role {role:?} may not read (a GRANT of it resumes them)"
    )
}
