//! The inbox table: one row per (consumer, event) applied.

use std::time::Duration;

use tokio_postgres::{Client, GenericClient, Statement, Transaction};

use crate::{EventId, InboxError};

/// The inbox table's name unless configured otherwise.
pub const DEFAULT_TABLE: &str = "walcast_inbox";

/// Serialises concurrent [`Inbox::migrate`] calls (two `CREATE TABLE IF NOT EXISTS`
/// racing can both try to create it); any constant, shared by every inbox table.
const MIGRATE_LOCK: i64 = 0x7761_6c63_6962_6f78; // "walcibox"

/// Where the inbox lives: a table `(consumer_name text, event_id uuid, received_at
/// timestamptz, primary key (consumer_name, event_id))`. A row means "this consumer
/// applied this event": it is inserted in the same transaction as the handler's side
/// effects, so both commit or neither does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inbox {
    /// The quoted, possibly schema-qualified, table name.
    table: String,
}

impl Default for Inbox {
    fn default() -> Inbox {
        Inbox::new(DEFAULT_TABLE)
    }
}

impl Inbox {
    /// The table `table`, found through the `search_path` (the name is quoted: it is
    /// taken as written, case and all).
    pub fn new(table: &str) -> Inbox {
        Inbox {
            table: quote_ident(table),
        }
    }

    /// The table `table` in schema `schema` (both quoted).
    pub fn in_schema(schema: &str, table: &str) -> Inbox {
        Inbox {
            table: format!("{}.{}", quote_ident(schema), quote_ident(table)),
        }
    }

    /// The table's name as it appears in SQL (quoted).
    pub fn table_sql(&self) -> &str {
        &self.table
    }

    /// Create the table if it does not exist (idempotent; concurrent calls wait for
    /// each other). The schema, if any, must exist.
    pub async fn migrate(&self, client: &Client) -> Result<(), InboxError> {
        // One simple query: one implicit transaction, so the lock holds until the end.
        let sql = format!(
            "SELECT pg_advisory_xact_lock({MIGRATE_LOCK});
             CREATE TABLE IF NOT EXISTS {} (
                 consumer_name text NOT NULL,
                 event_id uuid NOT NULL,
                 received_at timestamptz NOT NULL DEFAULT now(),
                 PRIMARY KEY (consumer_name, event_id)
             )",
            self.table
        );
        client
            .batch_execute(&sql)
            .await
            .map_err(|e| InboxError::postgres("creating the inbox table", e))
    }

    /// Whether `consumer_name` applied event `id`.
    pub async fn contains(
        &self,
        client: &impl GenericClient,
        consumer_name: &str,
        id: EventId,
    ) -> Result<bool, InboxError> {
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE consumer_name = $1 AND event_id = $2::text::uuid)",
            self.table
        );
        let row = client
            .query_one(&sql, &[&consumer_name, &id.to_string()])
            .await
            .map_err(|e| InboxError::postgres("reading the inbox", e))?;
        Ok(row.get(0))
    }

    /// Delete rows received more than `older_than` ago; returns how many. An event
    /// delivered again after its row is gone is applied again: keep rows longer than
    /// the stream keeps events (its `max_age`) plus the longest redelivery delay.
    pub async fn prune(&self, client: &Client, older_than: Duration) -> Result<u64, InboxError> {
        let sql = format!(
            "DELETE FROM {} WHERE received_at < now() - make_interval(secs => $1::float8)",
            self.table
        );
        client
            .execute(&sql, &[&older_than.as_secs_f64()])
            .await
            .map_err(|e| InboxError::postgres("pruning the inbox", e))
    }

    /// The statement recording an event, prepared on `client`:
    /// parameters consumer name (`text`), event id (`text`, cast to `uuid`).
    pub(crate) async fn prepare_claim(&self, client: &Client) -> Result<Statement, InboxError> {
        let sql = format!(
            "INSERT INTO {} (consumer_name, event_id) VALUES ($1, $2::text::uuid) \
             ON CONFLICT DO NOTHING",
            self.table
        );
        client.prepare(&sql).await.map_err(|e| {
            InboxError::postgres("preparing the inbox insert (was Inbox::migrate run?)", e)
        })
    }
}

/// Insert the inbox row in `tx`: true if it is new, false if the event was applied
/// already. Waits for a concurrent transaction holding the same row to end.
pub(crate) async fn claim(
    tx: &Transaction<'_>,
    statement: &Statement,
    consumer_name: &str,
    id: EventId,
) -> Result<bool, tokio_postgres::Error> {
    let inserted = tx
        .execute(statement, &[&consumer_name, &id.to_string()])
        .await?;
    Ok(inserted == 1)
}

/// `"name"`, with embedded quotes doubled.
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(Inbox::default().table_sql(), "\"walcast_inbox\"");
        assert_eq!(
            Inbox::new("My \"In\"box").table_sql(),
            "\"My \"\"In\"\"box\""
        );
        assert_eq!(
            Inbox::in_schema("app", "inbox").table_sql(),
            "\"app\".\"inbox\""
        );
    }
}
