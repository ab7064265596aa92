//! Telling the subscriptions whose role may not read what they asked for: a table it may
//! not `SELECT` at all, or a column their filter reads.
//!
//! The authorizer withholds every change from such a subscription, at that change and
//! whatever its filter would have said (see [`crate::authorize`]): a table never granted
//! to the role, a privilege revoked since the join, or a table enabled after a wildcard
//! binding that has the column but does not let the role read it. This tells each of them
//! why, once per table, with a `system` error on its channel ([`NOTICE_SUBS_WITHHELD`];
//! the subscription goes on, and receives again once the privilege is granted) — so a
//! join that can never receive anything says so within a second instead of staying silent.
//! A wildcard binding (every table of a schema) is told only about the columns its filter
//! reads: that its role may not read some of the schema's tables is no news.
//!
//! The notice must not depend on the changes: sent where a matching change is withheld,
//! it would tell what the column holds (or that a row the role cannot see changed). So a
//! task of its own compares the classes with the catalog, in one statement each way, when
//! the pipeline decodes a DDL notice or a realtime-tables edit ([`PrivilegeWatch::poke`])
//! and every [`SWEEP_EVERY`] (role memberships, and privileges without the event triggers,
//! change without a notice). Privileges are public in Postgres (`has_table_privilege`
//! answers any login), so the notice tells nothing the subscriber could not ask itself.

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

/// How often the classes are compared with the catalog, besides the pokes.
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

/// Per (class naming one table): the enabled tables it covers (one per schema when its
/// schema is `*`) that its role may not read at all (no column). `$1`…`$4`: project,
/// schema (or `*`), table, role.
const NO_SELECT_SQL: &str = "
SELECT q.n, t.schema_name::text, t.table_name::text
  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) WITH ORDINALITY
       AS q(project, schema, tbl, role, n)
  JOIN walcast.realtime_tables t ON t.project_id = q.project
   AND (q.schema = '*' OR t.schema_name = q.schema) AND t.table_name = q.tbl
  CROSS JOIN LATERAL (SELECT to_regclass(format('%I.%I', t.schema_name, t.table_name)) AS rel) c
 WHERE c.rel IS NOT NULL
   AND NOT coalesce((SELECT has_any_column_privilege(r.oid, c.rel, 'SELECT')
                       FROM pg_roles r WHERE r.rolname = q.role), false)";

/// The watch's task; ends when dropped (with the consumer of its session).
pub struct PrivilegeWatch {
    poke: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PrivilegeWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PrivilegeWatch {
    /// Watch `matcher`'s filtered classes against the database at `database_url`, telling
    /// through `outlet`; notices are stamped with the commit `position` holds.
    pub fn spawn(
        matcher: Arc<Matcher>,
        database_url: String,
        outlet: Arc<Outlet>,
        position: Arc<AtomicU64>,
    ) -> PrivilegeWatch {
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
        PrivilegeWatch { poke, task }
    }

    /// Privileges or the realtime tables may have changed: compare again now.
    pub fn poke(&self) {
        self.poke.notify_one();
    }
}

/// (project, schema or `*`, table or `''`, role, column): what one row of a statement asks
/// (the column empty for the table statement).
type Combo = (String, String, String, String, String);

/// (subscription id, `schema.table`).
type Told = (String, String);

/// What a subscription may not read.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Unreadable {
    Table,
    Column,
}

/// (class, table) → what it may not read there, and the message.
type Blocked = BTreeMap<(String, String), (Unreadable, String)>;

struct Watch {
    matcher: Arc<Matcher>,
    database_url: String,
    outlet: Arc<Outlet>,
    position: Arc<AtomicU64>,
    /// Its connection and statements.
    client: Option<Statements>,
    /// Subscriptions told, per table, while that stays so (told again after a GRANT
    /// back and another REVOKE — once a comparison saw the GRANT: a GRANT revoked again
    /// before the next comparison is not seen at all).
    told: HashSet<Told>,
}

struct Statements {
    client: Client,
    columns: Statement,
    tables: Statement,
}

impl Watch {
    async fn run(mut self, poke: Arc<Notify>) {
        loop {
            let _ = tokio::time::timeout(SWEEP_EVERY, poke.notified()).await;
            if let Err(e) = self.sweep().await {
                tracing::warn!(error = %e, "cannot compare subscriptions with the role privileges; trying again");
                self.client = None;
            }
        }
    }

    async fn client(&mut self) -> Result<&Statements, RealtimeError> {
        if self.client.as_ref().is_none_or(|s| s.client.is_closed()) {
            let client = walcast_pgtls::connect(&self.database_url).await?;
            let columns = client.prepare(UNREADABLE_SQL).await?;
            let tables = client.prepare(NO_SELECT_SQL).await?;
            self.client = Some(Statements {
                client,
                columns,
                tables,
            });
        }
        self.client.as_ref().ok_or(RealtimeError::RlsUnavailable(
            "the privilege watch's connection",
        ))
    }

    /// Compare the classes with the catalog; tell the subscriptions newly withheld a
    /// table's changes.
    async fn sweep(&mut self) -> Result<(), RealtimeError> {
        let classes = self.matcher.classes();
        if classes.is_empty() {
            self.told.clear();
            return Ok(());
        }
        let mut blocked = Blocked::new();
        let (tables, by_table) = combos(&classes, Unreadable::Table);
        if !tables.is_empty() {
            let st = self.client().await?;
            let rows = query(&st.client, &st.tables, &tables, 4).await?;
            note(&mut blocked, rows, &tables, &by_table, Unreadable::Table)?;
        }
        let (columns, by_column) = combos(&classes, Unreadable::Column);
        if !columns.is_empty() {
            let st = self.client().await?;
            let rows = query(&st.client, &st.columns, &columns, 5).await?;
            note(&mut blocked, rows, &columns, &by_column, Unreadable::Column)?;
        }
        self.tell(blocked).await
    }

    /// Tell each subscription of the blocked (class, table) pairs not told yet.
    async fn tell(&mut self, blocked: Blocked) -> Result<(), RealtimeError> {
        let mut now: HashSet<Told> = HashSet::new();
        // (front, table, what, why) → subscriptions to tell.
        let mut notices: BTreeMap<(String, String, Unreadable, String), Vec<String>> =
            BTreeMap::new();
        for ((class, table), (what, why)) in blocked {
            for (front, ids) in self.matcher.class_subs(&class) {
                for id in ids {
                    let pair = (id, table.clone());
                    if !self.told.contains(&pair) {
                        let key = (front.clone(), table.clone(), what, why.clone());
                        notices.entry(key).or_default().push(pair.0.clone());
                    }
                    now.insert(pair);
                }
            }
        }
        let at = Position::commit(Lsn(self.position.load(Ordering::Acquire)));
        for ((front, table, what, why), ids) in notices {
            for chunk in ids.chunks(IDS_PER_NOTICE) {
                self.send(&front, at, chunk, &why).await?;
                let counter = match what {
                    Unreadable::Table => telemetry::TABLE_UNREADABLE_NOTICES,
                    Unreadable::Column => telemetry::FILTER_UNREADABLE_NOTICES,
                };
                metrics::counter!(counter).increment(chunk.len() as u64);
                self.told
                    .extend(chunk.iter().map(|id| (id.clone(), table.clone())));
            }
        }
        // Forget what is no longer so (a GRANT back, a subscription gone).
        self.told.retain(|pair| now.contains(pair));
        Ok(())
    }

    /// One notice to `front` for the subscriptions `ids`.
    async fn send(
        &self,
        front: &str,
        at: Position,
        ids: &[String],
        why: &str,
    ) -> Result<(), RealtimeError> {
        let notice = SubsEnded {
            ids: ids.to_vec(),
            message: why.to_string(),
        };
        let payload = serde_json::to_vec(&notice).map_err(|e| {
            RealtimeError::Event(walcast_pipeline::change_event::EventError::Json(e))
        })?;
        let out = &self.outlet;
        let notice = Some(NOTICE_SUBS_WITHHELD);
        out.links
            .send(&out.publisher, front, at, notice, Bytes::from(payload))
            .await?;
        tracing::warn!(%front, subscriptions = ids.len(), reason = %why, "subscriptions told their role may not read what they asked for");
        Ok(())
    }
}

/// Run `stmt` with the first `width` fields of each combo as text arrays.
async fn query(
    client: &Client,
    stmt: &Statement,
    combos: &[Combo],
    width: usize,
) -> Result<Vec<tokio_postgres::Row>, RealtimeError> {
    let arrays: [Vec<&str>; 5] = [
        combos.iter().map(|c| c.0.as_str()).collect(),
        combos.iter().map(|c| c.1.as_str()).collect(),
        combos.iter().map(|c| c.2.as_str()).collect(),
        combos.iter().map(|c| c.3.as_str()).collect(),
        combos.iter().map(|c| c.4.as_str()).collect(),
    ];
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = arrays[..width]
        .iter()
        .map(|a| a as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    Ok(client.query(stmt, &params).await?)
}

/// Add a statement's rows (combo number, schema, table) to `blocked`; a (class, table)
/// already blocked keeps its first reason (a table it may not read at all comes first).
fn note(
    blocked: &mut Blocked,
    rows: Vec<tokio_postgres::Row>,
    combos: &[Combo],
    by_combo: &[Vec<String>],
    what: Unreadable,
) -> Result<(), RealtimeError> {
    for row in rows {
        let n: i64 = row.try_get(0)?;
        let (schema, name): (String, String) = (row.try_get(1)?, row.try_get(2)?);
        let table = format!("{schema}.{name}");
        let Some(i) = usize::try_from(n - 1).ok() else {
            continue;
        };
        let (Some(combo), Some(keys)) = (combos.get(i), by_combo.get(i)) else {
            continue;
        };
        let why = match what {
            Unreadable::Table => table_message(&schema, &name, &combo.3),
            Unreadable::Column => column_message(&table, &combo.4, &combo.3),
        };
        for key in keys {
            blocked
                .entry((key.clone(), table.clone()))
                .or_insert_with(|| (what, why.clone()));
        }
    }
    Ok(())
}

/// The distinct questions of one statement, and per question the classes asking it:
/// for [`Unreadable::Table`] each class naming one table, for [`Unreadable::Column`] each
/// column a class's filter reads.
fn combos(classes: &[Arc<Class>], what: Unreadable) -> (Vec<Combo>, Vec<Vec<String>>) {
    let mut index: HashMap<Combo, usize> = HashMap::new();
    let mut combos: Vec<Combo> = Vec::new();
    let mut by_combo: Vec<Vec<String>> = Vec::new();
    for class in classes {
        let f = &class.fields;
        if f.role.is_empty() {
            // Refused at every change anyway ("no role claim").
            continue;
        }
        let cols: Vec<&str> = match what {
            Unreadable::Table if f.table.is_some() => vec![""],
            Unreadable::Table => Vec::new(),
            Unreadable::Column => {
                let set: HashSet<&str> = class.filter_columns().collect();
                set.into_iter().collect()
            }
        };
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

/// The `system` error of a subscription whose role may not read its table, with the
/// statement that grants it (runnable as is).
fn table_message(schema: &str, table: &str, role: &str) -> String {
    let grant = format!(
        "GRANT SELECT ON {}.{} TO {}",
        ident(schema),
        ident(table),
        ident(role)
    );
    format!(
        "Changes of {schema}.{table} are not delivered to this subscription: role {role:?} \
         may not read the table ({grant} resumes them)"
    )
}

/// An SQL identifier as written in a statement: bare when it needs no quotes.
fn ident(name: &str) -> String {
    let bare = name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    match bare {
        true => name.to_string(),
        false => format!("\"{}\"", name.replace('"', "\"\"")),
    }
}

/// The `system` error of a subscription whose filter reads a column its role may not read.
fn column_message(table: &str, column: &str, role: &str) -> String {
    format!(
        "Changes of {table} are not delivered to this subscription: its filter reads column \
         {column:?}, which role {role:?} may not read (a GRANT of it resumes them)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::subscriptions::matcher::Sub;
    use walcast_bus::subs::SubscriptionSpec;
    use walcast_protocol::filter::{CompiledFilter, Filter};

    fn add(m: &Matcher, id: &str, table: Option<&str>, filter: Option<&str>, role: &str) {
        let spec = SubscriptionSpec {
            id: id.into(),
            front: "f".into(),
            project: "default".into(),
            schema: "public".into(),
            table: table.map(String::from),
            event: "*".into(),
            filter: filter.map(String::from),
            select: None,
            claims: serde_json::json!({ "role": role }).into(),
            from: None,
        };
        let compiled = filter.map(|f| CompiledFilter::new(Filter::parse(f).unwrap()).unwrap());
        assert!(m.insert(Sub::new(spec, compiled, Lsn(0))));
    }

    fn questions(m: &Matcher, what: Unreadable) -> Vec<(Combo, usize)> {
        let (combos, by_combo) = combos(&m.classes(), what);
        let mut out: Vec<(Combo, usize)> = combos
            .into_iter()
            .zip(by_combo.iter().map(Vec::len))
            .collect();
        out.sort();
        out
    }

    fn combo(table: &str, role: &str, column: &str) -> Combo {
        let s = |v: &str| v.to_string();
        (s("default"), s("public"), s(table), s(role), s(column))
    }

    #[test]
    fn a_table_is_asked_about_for_each_role_naming_it_and_columns_for_each_filter() {
        let m = Matcher::default();
        add(&m, "f:1", Some("t"), None, "anon");
        add(&m, "f:2", Some("t"), Some("v=eq.1"), "anon");
        add(&m, "f:3", Some("t"), None, "authenticated");
        add(&m, "f:4", None, Some("v=eq.2"), "anon");
        add(&m, "f:5", None, None, "anon");
        add(&m, "f:6", Some("t"), None, "");
        assert_eq!(
            questions(&m, Unreadable::Table),
            [
                (combo("t", "anon", ""), 2),
                (combo("t", "authenticated", ""), 1),
            ],
            "one question per (table, role), asked by both of anon's classes; wildcards and \
             classes without a role ask none"
        );
        assert_eq!(
            questions(&m, Unreadable::Column),
            [(combo("", "anon", "v"), 1), (combo("t", "anon", "v"), 1)]
        );
    }

    #[test]
    fn messages_name_the_grant() {
        assert_eq!(
            table_message("my app", "To\"do", "Web User"),
            "Changes of my app.To\"do are not delivered to this subscription: role \"Web User\" \
             may not read the table (GRANT SELECT ON \"my app\".\"To\"\"do\" TO \"Web User\" \
             resumes them)"
        );
        assert_eq!(
            table_message("public", "todos", "anon"),
            "Changes of public.todos are not delivered to this subscription: role \"anon\" may \
             not read the table (GRANT SELECT ON public.todos TO anon resumes them)"
        );
        assert!(column_message("public.staff", "salary", "anon").contains("column \"salary\""));
    }
}
