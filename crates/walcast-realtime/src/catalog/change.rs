//! Privileges and schema changes at their WAL position.
//!
//! wal2json decodes neither DDL nor GRANT. Where walcast's role may create them, two
//! event triggers (`walcast-control/sql/0007_catalog_changes.sql`) write a transactional logical message,
//! a [`Notice`] with prefix [`NOTICE_PREFIX`], for every statement that can change what a
//! subscriber may read of a table (`ALTER TABLE`, `GRANT`, `REVOKE`, policies, `DROP`):
//! it is decoded exactly at that statement's commit position. The pipeline then
//! authorizes and publishes everything before it with the state it has, drops what it
//! knows of the named tables (all tables when the statement does not say which), and
//! handles dropped tables (see `realtime_catalog.rs`).
//!
//! Each notice also carries the **epoch**: a counter the trigger increments in the same
//! transaction (`walcast.catalog_epoch`), so commit order and epoch order agree. A catalog
//! read (in `catalog_read.rs`) reads the epoch in the same snapshot: equal to the epoch of
//! the last notice decoded, the snapshot shows the catalog exactly as of the position
//! being judged ([`Freshness::Exact`]); greater, it already shows a later statement
//! ([`Freshness::Ahead`]: the change is withheld rather than judged by a later state,
//! e.g. a GRANT that followed a REVOKE); smaller, a statement already decoded is not yet
//! visible ([`Freshness::Behind`]: read again). The epoch at a commit position is
//! recorded per slot (`walcast.catalog_positions`) so that a restarted worker knows it.
//!
//! Without the triggers ([`Tracking::PerBatch`]), nothing is cached across batches: each
//! batch reads the catalog afresh, right before it is authorized.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tokio_postgres::Client;
use walcast_wal2json::Lsn;

use crate::catalog::facts::{Access, TableInfo};
use crate::error::RealtimeError;
use walcast_pipeline::change_event::EventError;

/// Prefix of the notices' logical messages (the only prefix wal2json is asked for).
pub const NOTICE_PREFIX: &str = "walcast.ddl";
/// The `ddl_command_end` trigger.
pub const TRIGGER_COMMAND_END: &str = "walcast_ddl_command_end";
/// The `sql_drop` trigger.
pub const TRIGGER_SQL_DROP: &str = "walcast_sql_drop";

/// The statements whose `ddl_command_end` writes a notice.
const COMMAND_END_TAGS: &[&str] = &[
    "ALTER TABLE",
    "GRANT",
    "REVOKE",
    "CREATE POLICY",
    "ALTER POLICY",
    "DROP POLICY",
    "DROP OWNED",
    "ALTER SCHEMA",
];

/// A table named by a notice.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct NoticeTable {
    pub schema: String,
    pub table: String,
    #[serde(default)]
    pub dropped: bool,
}

/// What a role may read of a table, as a notice carries it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct RoleState {
    pub bypass: bool,
    /// The columns it may `SELECT` (never empty: a role without any is not listed).
    pub columns: Vec<String>,
}

/// A streamed table's facts at the notice's position (`walcast.table_state`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct TableState {
    pub schema: String,
    pub table: String,
    pub rls: bool,
    /// (name, type) in key order.
    pub pk: Vec<(String, String)>,
    /// (name, type, NULL may stand for NaN) in table order.
    pub columns: Vec<(String, String, bool)>,
    /// Every role that may read some column; any other may read none.
    pub roles: HashMap<String, RoleState>,
}

impl TableState {
    pub fn info(&self) -> TableInfo {
        TableInfo {
            rls: self.rls,
            pk: self.pk.clone(),
            columns: self
                .columns
                .iter()
                .map(|(n, t, _)| (n.clone(), t.clone()))
                .collect(),
            nan_as_null: self
                .columns
                .iter()
                .filter(|(_, _, nan)| *nan)
                .map(|(n, _, _)| n.clone())
                .collect(),
        }
    }

    /// What `role` may read (`None`: nothing, or no such role).
    pub fn access(&self, role: &str) -> Option<Access> {
        self.roles.get(role).map(|r| Access {
            columns: r.columns.iter().cloned().collect(),
            bypass_rls: r.bypass,
        })
    }
}

/// One `walcast.ddl` message.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Notice {
    /// The catalog epoch after the statement (`None`: written by the worker's own
    /// cleanup of tables dropped while no trigger ran, which changes no epoch).
    #[serde(default)]
    pub epoch: Option<i64>,
    /// The statement's command tag.
    #[serde(default)]
    pub tag: String,
    /// The tables it changed; `None`: unknown, possibly any.
    #[serde(default)]
    pub tables: Option<Vec<NoticeTable>>,
    /// The state after it of the streamed tables it may have changed.
    #[serde(default)]
    pub states: Vec<TableState>,
}

impl Notice {
    /// Parse a message's content. One that does not parse is taken as a change of
    /// everything (the caller logs it): strict, never stale.
    pub fn parse(content: &str) -> Result<Notice, serde_json::Error> {
        serde_json::from_str(content)
    }

    /// A notice about every table, epoch unknown.
    pub fn everything(tag: &str) -> Notice {
        Notice {
            epoch: None,
            tag: tag.to_string(),
            tables: None,
            states: Vec::new(),
        }
    }

    /// Can the statement have changed this table?
    pub fn touches(&self, schema: &str, table: &str) -> bool {
        match &self.tables {
            None => true,
            Some(ts) => ts.iter().any(|t| t.schema == schema && t.table == table),
        }
    }

    /// The tables it dropped.
    pub fn dropped(&self) -> impl Iterator<Item = &NoticeTable> {
        self.tables.iter().flatten().filter(|t| t.dropped)
    }
}

/// Which catalog state cached facts must have been read at to be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    /// Event triggers: the epoch of the last notice decoded (`None`: not known, the
    /// position predates anything recorded; reads are then taken as they are).
    Epoch(Option<i64>),
    /// No event trigger: facts of this batch only.
    Batch(u64),
}

/// How a catalog snapshot relates to the position being judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freshness {
    /// It shows the catalog as of the position.
    Exact,
    /// It shows a statement committed after the position.
    Ahead,
    /// A statement the position has seen is not visible in it yet.
    Behind,
}

/// Compare a snapshot's epoch with the view. Without an epoch (no trigger, or a view
/// that does not know its epoch) the read is taken as it is.
pub fn freshness(view: View, snapshot_epoch: Option<i64>) -> Freshness {
    match (view, snapshot_epoch) {
        (View::Epoch(Some(seen)), Some(n)) => match n.cmp(&seen) {
            std::cmp::Ordering::Equal => Freshness::Exact,
            std::cmp::Ordering::Greater => Freshness::Ahead,
            std::cmp::Ordering::Less => Freshness::Behind,
        },
        _ => Freshness::Exact,
    }
}

/// How the pipeline learns of catalog changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tracking {
    /// Notices from the event triggers, at their WAL position.
    EventTrigger,
    /// No triggers: every batch reads the catalog afresh. The reason, for the log.
    PerBatch(String),
}

impl Tracking {
    /// As `/health` and the metric name it.
    pub fn name(&self) -> &'static str {
        match self {
            Tracking::EventTrigger => "event_trigger",
            Tracking::PerBatch(_) => "per_batch",
        }
    }
}

/// Make sure both event triggers exist and fire, creating them where walcast's role may
/// (a superuser); otherwise say why not.
pub async fn ensure_triggers(client: &Client) -> Result<Tracking, RealtimeError> {
    let names = [TRIGGER_COMMAND_END, TRIGGER_SQL_DROP];
    let present = enabled_triggers(client, &names).await?;
    if present.len() == names.len() {
        return Ok(Tracking::EventTrigger);
    }
    let superuser: bool = client
        .query_one(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?
        .get(0);
    if !superuser {
        return Ok(Tracking::PerBatch(format!(
            "event triggers {TRIGGER_COMMAND_END} and {TRIGGER_SQL_DROP} are missing or disabled \
             and walcast's role is not a superuser (only a superuser may create them: see the \
             README, \"Privileges and DDL\")"
        )));
    }
    let tags: Vec<String> = COMMAND_END_TAGS.iter().map(|t| format!("'{t}'")).collect();
    // Constant text: the names and tags are ours, nothing from outside is formatted in.
    let create = [
        (
            TRIGGER_COMMAND_END,
            format!(
                "CREATE EVENT TRIGGER {TRIGGER_COMMAND_END} ON ddl_command_end \
                 WHEN TAG IN ({}) EXECUTE FUNCTION walcast.on_ddl_command_end()",
                tags.join(", ")
            ),
        ),
        (
            TRIGGER_SQL_DROP,
            format!(
                "CREATE EVENT TRIGGER {TRIGGER_SQL_DROP} ON sql_drop \
                 EXECUTE FUNCTION walcast.on_sql_drop()"
            ),
        ),
    ];
    for (name, sql) in create {
        if present.iter().any(|p| p == name) {
            continue;
        }
        let sql = format!("DROP EVENT TRIGGER IF EXISTS {name}; {sql}");
        match client.batch_execute(&sql).await {
            Ok(()) => tracing::info!(trigger = name, "event trigger created"),
            // Another worker created it at the same moment.
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Tracking::EventTrigger)
}

/// Which of `names` exist and fire in ordinary sessions.
async fn enabled_triggers(client: &Client, names: &[&str]) -> Result<Vec<String>, RealtimeError> {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    Ok(client
        .query(
            "SELECT evtname::text FROM pg_event_trigger
              WHERE evtname = ANY($1) AND evtenabled IN ('O', 'A')",
            &[&names],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Are both triggers still there and firing?
pub async fn triggers_present(client: &Client) -> Result<bool, RealtimeError> {
    let names = [TRIGGER_COMMAND_END, TRIGGER_SQL_DROP];
    Ok(enabled_triggers(client, &names).await?.len() == names.len())
}

/// Where a slot resumes: the epoch at its position and the table states the notices
/// before it carried.
#[derive(Clone, Debug, Default)]
pub struct Resume {
    /// `None` when unknown (a slot from before the triggers existed, with DDL since).
    pub seen: Option<i64>,
    pub carried: Vec<TableState>,
}

/// Where the slot resumes from: as recorded when the worker decoded the last notice at
/// or before its position; for a slot just created, the current epoch (recorded).
pub async fn resume_at(
    client: &Client,
    slot: &str,
    confirmed: Lsn,
    created: bool,
) -> Result<Resume, RealtimeError> {
    let current: i64 = client
        .query_one("SELECT n FROM walcast.catalog_epoch", &[])
        .await?
        .get(0);
    if created {
        record_epoch(client, slot, confirmed, current, &[]).await?;
        return Ok(Resume {
            seen: Some(current),
            carried: Vec::new(),
        });
    }
    let at = confirmed.to_string();
    let row = client
        .query_opt(
            "SELECT epoch, carried::text FROM walcast.catalog_positions
              WHERE slot_name = $1 AND commit_lsn <= $2::text::pg_lsn
              ORDER BY commit_lsn DESC LIMIT 1",
            &[&slot, &at],
        )
        .await?;
    // Older records say nothing the newest one at or before the position does not.
    client
        .execute(
            "DELETE FROM walcast.catalog_positions
              WHERE slot_name = $1 AND commit_lsn < (
                    SELECT max(commit_lsn) FROM walcast.catalog_positions
                     WHERE slot_name = $1 AND commit_lsn <= $2::text::pg_lsn)",
            &[&slot, &at],
        )
        .await?;
    Ok(match row {
        Some(r) => {
            let carried: String = r.get(1);
            Resume {
                seen: Some(r.get(0)),
                carried: serde_json::from_str(&carried).unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "unreadable carried table states: starting without");
                    Vec::new()
                }),
            }
        }
        // Never a notice: the epoch has not moved since the triggers exist.
        None if current == 0 => Resume {
            seen: Some(0),
            carried: Vec::new(),
        },
        None => Resume::default(),
    })
}

/// Record that from `commit_lsn` on, the slot's position has seen epoch `epoch`, with
/// these carried states (a transaction with several statements writes several notices
/// at one position: the last one counts).
pub async fn record_epoch(
    client: &Client,
    slot: &str,
    commit_lsn: Lsn,
    epoch: i64,
    carried: &[TableState],
) -> Result<(), RealtimeError> {
    let carried =
        serde_json::to_string(carried).map_err(|e| RealtimeError::Event(EventError::Json(e)))?;
    client
        .execute(
            "INSERT INTO walcast.catalog_positions (slot_name, commit_lsn, epoch, carried)
             VALUES ($1, $2::text::pg_lsn, $3, $4::text::jsonb)
             ON CONFLICT (slot_name, commit_lsn) DO UPDATE
             SET epoch = excluded.epoch, carried = excluded.carried
             WHERE excluded.epoch >= walcast.catalog_positions.epoch",
            &[&slot, &commit_lsn.to_string(), &epoch, &carried],
        )
        .await?;
    Ok(())
}

/// Without the `sql_drop` trigger, a dropped table stays in the realtime tables: remove those
/// whose table is gone and, in the same transaction, write the notice the trigger would
/// have written (no epoch, signed like every notice: see [`walcast_pipeline::signed`]), so the
/// pipeline ends their subscriptions at that position.
/// Returns how many were removed.
pub async fn prune_dropped(client: &Client) -> Result<u64, RealtimeError> {
    let row = client
        .query_one(
            "WITH gone AS (
                DELETE FROM walcast.realtime_tables
                 WHERE to_regclass(format('%I.%I', schema_name, table_name)) IS NULL
                RETURNING schema_name, table_name)
             SELECT count(*), CASE WHEN count(*) > 0 THEN walcast.emit_signed($1,
                    jsonb_build_object('epoch', NULL, 'tag', 'DROP TABLE', 'tables',
                        jsonb_agg(jsonb_build_object('schema', schema_name, 'table', table_name,
                                                     'dropped', true)))::text)::text END
               FROM gone",
            &[&NOTICE_PREFIX],
        )
        .await?;
    let n: i64 = row.get(0);
    if n > 0 {
        tracing::warn!(
            tables = n,
            "dropped tables removed from the realtime tables (no sql_drop trigger)"
        );
    }
    Ok(n.max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_parse_as_the_triggers_write_them() {
        let n = Notice::parse(
            r#"{"tag": "ALTER TABLE", "epoch": 2, "tables": [{"table": "t", "schema": "public"}]}"#,
        )
        .unwrap();
        assert_eq!(n.epoch, Some(2));
        assert!(n.touches("public", "t"));
        assert!(!n.touches("public", "u"));
        assert_eq!(n.dropped().count(), 0);

        let grant = Notice::parse(r#"{"tag": "GRANT", "epoch": 3, "tables": null}"#).unwrap();
        assert!(grant.touches("any", "table"), "unknown tables: every table");

        let drop = Notice::parse(
            r#"{"tag": "DROP TABLE", "epoch": 4, "tables": [{"table": "t2", "schema": "public", "dropped": true}]}"#,
        )
        .unwrap();
        let dropped: Vec<&str> = drop.dropped().map(|t| t.table.as_str()).collect();
        assert_eq!(dropped, ["t2"]);

        let carried = Notice::parse(
            r#"{"tag": "REVOKE", "epoch": 5, "tables": null, "states": [{"pk": [["id", "bigint"]], "rls": false, "roles": {"anon": {"bypass": false, "columns": ["id", "k"]}}, "table": "d1", "schema": "public", "columns": [["id", "bigint", false], ["k", "integer", false], ["n", "numeric", true]]}]}"#,
        )
        .unwrap();
        let state = &carried.states[0];
        let info = state.info();
        assert_eq!(info.pk, [("id".to_string(), "bigint".to_string())]);
        assert_eq!(info.columns.len(), 3);
        assert!(info.nan_as_null.contains("n") && info.nan_as_null.len() == 1);
        let anon = state.access("anon").unwrap();
        assert_eq!(anon.columns.len(), 2);
        assert!(!anon.bypass_rls);
        assert_eq!(
            state.access("authenticated"),
            None,
            "not listed: reads nothing"
        );

        let cleanup = Notice::parse(r#"{"epoch": null, "tag": "DROP TABLE", "tables": []}"#);
        assert_eq!(cleanup.unwrap().epoch, None);
        assert!(Notice::parse("not json").is_err());
    }

    #[test]
    fn a_snapshot_is_exact_only_at_the_epoch_of_the_position() {
        let at = View::Epoch(Some(5));
        assert_eq!(freshness(at, Some(5)), Freshness::Exact);
        // A later statement (say, the GRANT after a REVOKE) is already visible.
        assert_eq!(freshness(at, Some(6)), Freshness::Ahead);
        // The REVOKE just decoded is not visible to new snapshots yet.
        assert_eq!(freshness(at, Some(4)), Freshness::Behind);
        // Unknown epoch, or no triggers: taken as read.
        assert_eq!(freshness(View::Epoch(None), Some(9)), Freshness::Exact);
        assert_eq!(freshness(View::Batch(3), None), Freshness::Exact);
    }
}
