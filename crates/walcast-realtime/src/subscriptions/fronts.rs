//! The fronts a leader has subscriptions from, kept in `walcast.fronts` so that the next
//! leader knows whom to wait for.
//!
//! A new leader asks every front to register again and reads the slot once they are done
//! (see `walcast_bus::resync`). A front it does not know of and that is slow to answer
//! would be missed: the backlog would be matched without its subscriptions and its clients
//! would never get it. So a leader records a front before it answers that front's first
//! registration (a leader killed right after answering still leaves it to the next one),
//! removes it once the front expired, and a worker that takes over reads the table before
//! asking. A handful of rows, written only when a front comes or goes.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_postgres::Client;

use crate::error::RealtimeError;
use crate::subscriptions::matcher::Matcher;

/// How often the leader looks for expired fronts to remove.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// What this worker knows `walcast.fronts` holds.
#[derive(Default)]
pub struct FrontsRecord {
    written: Mutex<BTreeSet<String>>,
}

impl FrontsRecord {
    fn written(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.written.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Read the table at the start of a term: the fronts the last leader had
    /// subscriptions from.
    pub async fn load(&self, client: &Client) -> Result<HashSet<String>, RealtimeError> {
        let rows = client
            .query("SELECT front FROM walcast.fronts", &[])
            .await?;
        let fronts: BTreeSet<String> = rows.iter().map(|r| r.get(0)).collect();
        *self.written() = fronts.clone();
        Ok(fronts.into_iter().collect())
    }

    /// Record the fronts among `fronts` not recorded yet (called before a registration is
    /// answered).
    pub async fn record<'a>(
        &self,
        client: &Client,
        fronts: impl Iterator<Item = &'a str>,
    ) -> Result<(), RealtimeError> {
        let new: BTreeSet<String> = {
            let written = self.written();
            fronts
                .filter(|f| !written.contains(*f))
                .map(str::to_string)
                .collect()
        };
        if new.is_empty() {
            return Ok(());
        }
        let list: Vec<&String> = new.iter().collect();
        client
            .execute(
                "INSERT INTO walcast.fronts (front) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING",
                &[&list],
            )
            .await?;
        tracing::debug!(fronts = ?list, "recorded new fronts");
        self.written().extend(new);
        Ok(())
    }

    /// Remove recorded fronts the matcher no longer knows (expired), until `shutdown`.
    /// Errors are logged and tried again: the table only makes a takeover wait.
    pub async fn keep(
        self: Arc<Self>,
        matcher: Arc<Matcher>,
        database_url: String,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let mut client: Option<Client> = None;
        let mut tick = tokio::time::interval(CHECK_EVERY);
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tick.tick() => {}
            }
            let alive = matcher.fronts();
            let gone: Vec<String> = self.written().difference(&alive).cloned().collect();
            if gone.is_empty() {
                continue;
            }
            if client.is_none() {
                client = walcast_pgtls::connect(&database_url)
                    .await
                    .inspect_err(|e| tracing::warn!(error = %e, "cannot connect to update the recorded fronts"))
                    .ok();
            }
            let Some(c) = &client else { continue };
            let sql = "DELETE FROM walcast.fronts WHERE front = ANY($1::text[])";
            match c.execute(sql, &[&gone]).await {
                Ok(_) => {
                    tracing::info!(fronts = ?gone, "fronts gone: no longer waited for by a new leader");
                    let mut written = self.written();
                    gone.iter().for_each(|f| {
                        written.remove(f);
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot update the recorded fronts");
                    client = None;
                }
            }
        }
    }
}
