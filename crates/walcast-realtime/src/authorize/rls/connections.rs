//! The connections an [`RlsChecker`](super::RlsChecker) checks on: per lane, one of the
//! check login's, and one of walcast's own for the current-row comparisons.

use std::collections::HashMap;

use tokio_postgres::{Client, Statement};

use crate::authorize::check::{run_checks, CheckOptions, Connections, TableCheck, TableOutcome};
use crate::error::RealtimeError;

/// Where a lane connects: the check login, and walcast's own login.
#[derive(Clone, Copy)]
pub(super) struct Urls<'a> {
    pub(super) check: &'a str,
    pub(super) own: &'a str,
}

/// One connection that runs checks, with its prepared statements, and (only once a
/// batch needs it) one of walcast's own for the current-row comparisons.
#[derive(Default)]
pub(super) struct Lane {
    pub(super) client: Option<Client>,
    pub(super) statements: HashMap<String, Statement>,
    pub(super) own: Option<Client>,
    pub(super) own_statements: HashMap<String, Statement>,
}

impl Lane {
    pub(super) async fn check(
        &mut self,
        url: Urls<'_>,
        tables: &[TableCheck],
        opts: &CheckOptions,
    ) -> Result<Vec<TableOutcome>, RealtimeError> {
        let result = self.check_on(url, tables, opts).await;
        if result.is_err() {
            // The sessions may be mid-transaction: start over on fresh ones.
            self.client = None;
            self.statements.clear();
            self.own = None;
            self.own_statements.clear();
        }
        result
    }

    async fn check_on(
        &mut self,
        url: Urls<'_>,
        tables: &[TableCheck],
        opts: &CheckOptions,
    ) -> Result<Vec<TableOutcome>, RealtimeError> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.statements.clear();
            self.client = Some(check_connection(url.check).await?);
        }
        let compare = tables
            .iter()
            .any(|t| t.groups.iter().any(|g| !g.by_row.is_empty()));
        if compare && self.own.as_ref().is_none_or(|c| c.is_closed()) {
            self.own_statements.clear();
            self.own = Some(own_connection(url.own).await?);
        }
        let Some(client) = self.client.as_ref() else {
            return Err(RealtimeError::RlsUnavailable(
                "the lane's connection was not kept",
            ));
        };
        for isolate in [false, true] {
            let conns = Connections {
                check: client,
                check_statements: &mut self.statements,
                own: match (compare, self.own.as_ref()) {
                    (true, Some(own)) => Some((own, &mut self.own_statements)),
                    _ => None,
                },
            };
            let opts = CheckOptions {
                isolate,
                ..opts.clone()
            };
            let out = run_checks(conns, tables, &opts).await?;
            // Something failed and took the rest of the batch with it: again, with every
            // statement in its own savepoint.
            if isolate || out.iter().all(TableOutcome::all_ok) {
                return Ok(out);
            }
        }
        Err(RealtimeError::RlsUnavailable("no check was run"))
    }
}

/// walcast's own connection for current-row comparisons: an empty `search_path`, so
/// no operator or function but Postgres's own is found by name.
async fn own_connection(url: &str) -> Result<Client, RealtimeError> {
    let client = walcast_pgtls::connect(url).await?;
    client.batch_execute("SET search_path = ''").await?;
    Ok(client)
}

/// A connection for checks. Checks for one role differ only in the claims, which
/// policies read when they run: one generic plan serves them all instead of planning
/// each group (Postgres re-plans by itself when the role changes).
async fn check_connection(url: &str) -> Result<Client, RealtimeError> {
    let client = walcast_pgtls::connect(url).await?;
    client
        .batch_execute("SET plan_cache_mode = force_generic_plan")
        .await?;
    Ok(client)
}
