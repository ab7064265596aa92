//! One round trip of row-level-security checks for a batch of changes.
//!
//! Every statement of a batch is queued on the connection before the first reply is
//! read (tokio-postgres pipelines requests that are issued without waiting), inside one
//! `REPEATABLE READ READ ONLY` transaction that is always rolled back:
//!
//! ```text
//! BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY
//! SELECT set_config('statement_timeout', $1, true)
//! per table with versions judged by the current row, on walcast's own connection in the
//! check's snapshot (exported by the check connection first, see below):
//!             SAVEPOINT; <which rows still hold those versions' values>; ROLLBACK TO + RELEASE
//! per (table, role, claims):
//!             SAVEPOINT; set_config('role', $1, true), set_config('request.jwt.claims', $2, true)
//!                        (and `request.jwt.claim.sub` etc.: `claim_settings!` in `authorize`);
//!             <which versions the policies allow, on their own values>;
//!             <which of the current-row versions' rows exist for that role>;
//!             ROLLBACK TO + RELEASE
//! ROLLBACK
//! ```
//!
//! A version is judged by its own values ([`crate::authorize::sql::own_values_sql`]) unless it
//! lacks a value its policies read ([`crate::authorize::policy::judged_by`]); then by
//! the row's current state: visible by primary key for the role *and*
//! still holding the version's values in the same snapshot (a version whose row changed
//! since cannot be judged, and is withheld: "superseded"). The savepoints confine a
//! failing check (a policy that raises, the timeout) to its own group; `ROLLBACK TO`
//! also undoes its `set_config`.
//!
//! The check connection's session user is the check login ([`walcast_control::check_login`]): a
//! policy that resets the role gains nothing. That login may read no table, so the
//! current-row comparison runs on walcast's own connection ([`Connections::own`]), which
//! imports the check transaction's snapshot (`pg_export_snapshot`, one round trip more,
//! only for a batch that has such versions), with row security off and nothing of the
//! tenant's cast to ([`crate::authorize::sql::current_sql`]).
//!
//! Savepoints double the statements per group, and checks rarely fail, so a batch first
//! runs without them (`isolate: false`; each group's `set_config` replaces the previous
//! one's). If anything failed there, every statement after the failure failed with it
//! (the transaction is aborted): the caller then runs the whole batch again, isolated.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use crate::authorize::policy::Predicate;
use crate::authorize::sql::CatalogColumn;
use crate::error::RealtimeError;

mod plan;

use plan::{plan_table, Bound, TablePlan};

/// One version of a row: its columns as Postgres text (`None` = NULL). A column the
/// change does not carry is not listed.
pub type Version = Vec<(String, Option<String>)>;

/// The versions of one table to check, and who to check them for.
#[derive(Debug, Default, Clone)]
pub struct TableCheck {
    pub schema: String,
    pub table: String,
    pub pk: Vec<CatalogColumn>,
    /// The table's columns (those a current-row comparison may use).
    pub columns: Vec<CatalogColumn>,
    pub versions: Arc<Vec<Version>>,
    pub groups: Vec<GroupCheck>,
}

/// One role + claims, the condition its policies make, and the versions (indices into
/// [`TableCheck::versions`]) it needs judged.
#[derive(Debug, Clone)]
pub struct GroupCheck {
    pub role: String,
    pub claims: String,
    pub predicate: Arc<Predicate>,
    /// Judged by their own values.
    pub own: Vec<usize>,
    /// Judged by the row's current state (their own values are incomplete).
    pub by_row: Vec<usize>,
}

#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// Send everything before reading replies (false: one statement per round trip).
    pub pipelined: bool,
    /// `statement_timeout` for each check, in milliseconds.
    pub timeout_ms: u64,
    /// Each statement in its own savepoint, so one failure fails only itself.
    pub isolate: bool,
    /// When the whole check must be done by: past it, it is cancelled (the
    /// statements on the server too) and fails with [`RealtimeError::CheckDeadline`].
    pub deadline: Option<std::time::Instant>,
}

/// What one group may see.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GroupOutcome {
    pub visible: HashSet<usize>,
    /// Current-row versions the role could see by the row, whose row no longer holds
    /// them (withheld: they cannot be judged).
    pub superseded: HashSet<usize>,
}

#[derive(Debug)]
pub struct TableOutcome {
    /// Why the current-row comparison failed (its versions are then withheld).
    pub current_error: Option<String>,
    /// Per group, in order: what it may see, or why its check failed.
    pub groups: Vec<Result<GroupOutcome, String>>,
}

impl TableOutcome {
    /// No statement of this table failed.
    pub fn all_ok(&self) -> bool {
        self.current_error.is_none() && self.groups.iter().all(Result::is_ok)
    }
}

type Reply<'a> = Pin<Box<dyn Future<Output = Result<Vec<i64>, tokio_postgres::Error>> + Send + 'a>>;

const SAVEPOINT: &str = "SAVEPOINT walcast_check";
const RESTORE: &str = "ROLLBACK TO SAVEPOINT walcast_check; RELEASE SAVEPOINT walcast_check";
/// Sets one group's role (`$1`) and claims (`$2`, JSON text) for the statements after it.
pub const SET_CLAIMS: &str = concat!(
    "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true)",
    claim_settings!()
);
const SET_TIMEOUT: &str = "SELECT set_config('statement_timeout', $1, true)";

async fn prepared(
    client: &Client,
    cache: &mut HashMap<String, Statement>,
    sql: &str,
) -> Result<Statement, String> {
    prepared_as(client, cache, sql, None).await
}

/// [`prepared`], parsed as `role` when given: names are looked up when a statement is
/// parsed, with the privileges of the role then (the check login has none: it could not
/// even see the schemas a policy names).
async fn prepared_as(
    client: &Client,
    cache: &mut HashMap<String, Statement>,
    sql: &str,
    role: Option<&str>,
) -> Result<Statement, String> {
    if let Some(s) = cache.get(sql) {
        return Ok(s.clone());
    }
    let msg = |e: tokio_postgres::Error| walcast_pgtls::db_message(&e);
    if let Some(role) = role {
        client
            .execute("SELECT set_config('role', $1, false)", &[&role])
            .await
            .map_err(msg)?;
    }
    let s = client.prepare(sql).await.map_err(msg);
    if role.is_some() {
        client.batch_execute("RESET ROLE").await.map_err(msg)?;
    }
    let s = s?;
    cache.insert(sql.to_string(), s.clone());
    Ok(s)
}

fn control<'a>(client: &'a Client, sql: &'a str) -> Reply<'a> {
    Box::pin(async move { client.batch_execute(sql).await.map(|()| Vec::new()) })
}

/// A statement whose rows are ignored.
fn exec<'a>(
    client: &'a Client,
    stmt: &'a Statement,
    params: Vec<&'a (dyn ToSql + Sync)>,
) -> Reply<'a> {
    Box::pin(async move { client.query(stmt, &params).await.map(|_| Vec::new()) })
}

/// A statement returning row positions (`bigint`).
fn query<'a>(client: &'a Client, stmt: &'a Statement, arrays: &'a [Array]) -> Reply<'a> {
    let params: Vec<&(dyn ToSql + Sync)> = arrays.iter().map(|a| a as _).collect();
    Box::pin(async move {
        let rows = client.query(stmt, &params).await?;
        rows.iter()
            .map(|r| r.try_get::<_, i64>(0))
            .collect::<Result<Vec<i64>, _>>()
    })
}

/// Which step a reply belongs to.
#[derive(Clone, Copy)]
enum Step {
    Control,
    Current(usize),
    Claims(usize, usize),
    Own(usize, usize),
    ByRow(usize, usize),
}

/// One bound `text[]`: a column's values over the chosen versions.
type Array = Vec<Option<String>>;

/// Column-major arrays (one `text[]` per column name) of the chosen versions; a column a
/// version does not carry is bound as NULL.
fn arrays<'a>(
    versions: &[Version],
    pick: &[usize],
    names: impl Iterator<Item = &'a str>,
) -> Vec<Array> {
    names
        .map(|name| {
            pick.iter()
                .map(|&r| {
                    versions
                        .get(r)
                        .and_then(|v| v.iter().find(|(n, _)| n == name))
                        .and_then(|(_, value)| value.clone())
                })
                .collect()
        })
        .collect()
}

/// 1-based positions from `WITH ORDINALITY` back to version indices.
fn to_rows(positions: &[i64], pick: &[usize]) -> HashSet<usize> {
    positions
        .iter()
        .filter_map(|p| usize::try_from(*p).ok()?.checked_sub(1))
        .filter_map(|p| pick.get(p).copied())
        .collect()
}

/// The connections a batch is checked on, each with its prepared statements.
pub struct Connections<'a> {
    /// The check login's: every statement that runs as a subscriber.
    pub check: &'a Client,
    pub check_statements: &'a mut HashMap<String, Statement>,
    /// walcast's own (catalog) login's, for the current-row comparisons; `None` when the
    /// batch has none.
    pub own: Option<(&'a Client, &'a mut HashMap<String, Statement>)>,
}

/// The requests of a batch, in order (see the module docs).
fn steps<'a>(
    client: &'a Client,
    own: Option<&'a Client>,
    tables: &'a [TableCheck],
    plans: &'a [TablePlan],
    control_stmts: &'a (Statement, Statement, String),
    opts: &CheckOptions,
) -> Vec<(Step, Reply<'a>)> {
    let (set_claims, set_timeout, timeout) = control_stmts;
    let mut steps: Vec<(Step, Reply<'a>)> = Vec::new();
    if own.is_none() {
        // Otherwise begun with the snapshot's export (see `begin_shared`).
        steps.push((Step::Control, control(client, BEGIN)));
    }
    steps.push((Step::Control, exec(client, set_timeout, vec![timeout])));
    let isolated = |steps: &mut Vec<(Step, Reply<'a>)>, on: &'a Client, inner| {
        if opts.isolate {
            steps.push((Step::Control, control(on, SAVEPOINT)));
        }
        steps.extend(inner);
        if opts.isolate {
            steps.push((Step::Control, control(on, RESTORE)));
        }
    };
    if let Some(own) = own {
        for (ti, plan) in plans.iter().enumerate() {
            if let Some(Bound {
                stmt: Ok(s),
                arrays,
                ..
            }) = &plan.current
            {
                let current = vec![(Step::Current(ti), query(own, s, arrays))];
                isolated(&mut steps, own, current);
            }
        }
        steps.push((Step::Control, control(own, "ROLLBACK")));
    }
    for (ti, (t, plan)) in tables.iter().zip(plans).enumerate() {
        for (gi, (g, (own, by_row))) in t.groups.iter().zip(&plan.groups).enumerate() {
            let mut inner = vec![(
                Step::Claims(ti, gi),
                exec(client, set_claims, vec![&g.role, &g.claims]),
            )];
            if let Some(Bound {
                stmt: Ok(s),
                arrays,
                ..
            }) = own
            {
                inner.push((Step::Own(ti, gi), query(client, s, arrays)));
            }
            if let Some(Bound {
                stmt: Ok(s),
                arrays,
                ..
            }) = by_row
            {
                inner.push((Step::ByRow(ti, gi), query(client, s, arrays)));
            }
            if inner.len() > 1 {
                isolated(&mut steps, client, inner);
            }
        }
    }
    steps.push((Step::Control, control(client, "ROLLBACK")));
    steps
}

const BEGIN: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";

/// Begin the check transaction on `check` and the current-row comparisons' on `own`, in
/// the check's snapshot, with row security off (a policy that would apply is an error,
/// never run) and the check's statement timeout.
async fn begin_shared(check: &Client, own: &Client, timeout_ms: u64) -> Result<(), RealtimeError> {
    check.batch_execute(BEGIN).await?;
    let id: String = check
        .query_one("SELECT pg_export_snapshot()", &[])
        .await?
        .try_get(0)?;
    if !id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
        return Err(RealtimeError::RlsUnavailable("an unexpected snapshot id"));
    }
    own.batch_execute(&format!(
        "{BEGIN}; SET TRANSACTION SNAPSHOT '{id}'; SET LOCAL row_security = off; \
         SET LOCAL statement_timeout = {timeout_ms}"
    ))
    .await?;
    Ok(())
}

pub async fn run_checks(
    mut conns: Connections<'_>,
    tables: &[TableCheck],
    opts: &CheckOptions,
) -> Result<Vec<TableOutcome>, RealtimeError> {
    let client = conns.check;
    let set_claims = client.prepare(SET_CLAIMS);
    let set_timeout = client.prepare(SET_TIMEOUT);
    let control_stmts = (
        set_claims.await?,
        set_timeout.await?,
        opts.timeout_ms.to_string(),
    );
    let mut plans = Vec::with_capacity(tables.len());
    for t in tables {
        plans.push(plan_table(&mut conns, t).await);
    }
    let compare = plans
        .iter()
        .any(|p| p.current.as_ref().is_some_and(|b| b.stmt.is_ok()));
    let own = match (&conns.own, compare) {
        (Some((own, _)), true) => {
            begin_shared(client, own, opts.timeout_ms).await?;
            Some(*own)
        }
        _ => None,
    };
    let mut steps = steps(client, own, tables, &plans, &control_stmts, opts);
    let mut replies = Vec::with_capacity(steps.len());
    if opts.pipelined {
        // The first poll of each reply queues its request on the connection, in order;
        // the server then answers them back to back.
        let early = kick(&mut steps);
        for ((step, reply), done) in steps.into_iter().zip(early) {
            let r = match done {
                Some(r) => r,
                None => reply.await,
            };
            replies.push((step, r));
        }
    } else {
        for (step, reply) in steps {
            replies.push((step, reply.await));
        }
    }
    collect(tables, &plans, replies)
}

/// Poll each reply once, in order: that queues its request on the connection. (A plain
/// function, so the no-op context never lives across an await.)
fn kick(steps: &mut [(Step, Reply<'_>)]) -> Vec<Option<Result<Vec<i64>, tokio_postgres::Error>>> {
    let waker = futures_util::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    steps
        .iter_mut()
        .map(|(_, reply)| match reply.as_mut().poll(&mut cx) {
            Poll::Ready(r) => Some(r),
            Poll::Pending => None,
        })
        .collect()
}

/// Replies of one group: the claims error, and the own-values and current-row results.
#[derive(Default)]
struct GroupReplies {
    claims: Option<String>,
    own: Option<Result<HashSet<usize>, String>>,
    by_row: Option<Result<HashSet<usize>, String>>,
}

/// The versions a group's statement (own values or current row) refers to.
fn picked(plans: &[TablePlan], ti: usize, gi: usize, own: bool) -> &[usize] {
    let group = plans.get(ti).and_then(|p| p.groups.get(gi));
    let bound = group.and_then(|(o, r)| if own { o.as_ref() } else { r.as_ref() });
    bound.map(|b| b.pick.as_slice()).unwrap_or_default()
}

/// The result of a planned statement; one that was not answered did not prepare.
fn answered<T: Default>(planned: Planned, reply: Option<Result<T, String>>) -> Result<T, String> {
    match (planned, reply) {
        (None, _) => Ok(T::default()),
        (Some(_), Some(r)) => r,
        (Some(error), None) => Err(error.unwrap_or_else(|| "not checked".into())),
    }
}

/// Whether a statement was planned (`None`: nothing to check), and if so why it could
/// not be sent, if it could not.
type Planned = Option<Option<String>>;

fn planned(bound: Option<&Bound>) -> Planned {
    bound.map(|b| b.stmt.as_ref().err().cloned())
}

fn collect(
    tables: &[TableCheck],
    plans: &[TablePlan],
    replies: Vec<(Step, Result<Vec<i64>, tokio_postgres::Error>)>,
) -> Result<Vec<TableOutcome>, RealtimeError> {
    let mut current: HashMap<usize, Result<HashSet<usize>, String>> = HashMap::new();
    let mut groups: HashMap<(usize, usize), GroupReplies> = HashMap::new();
    for (step, reply) in replies {
        if let Step::Control = step {
            reply?;
            continue;
        }
        let reply = reply.map_err(|e| walcast_pgtls::db_message(&e));
        match step {
            Step::Control => {}
            Step::Current(ti) => {
                let rows = plans
                    .get(ti)
                    .and_then(|p| p.current.as_ref())
                    .map(|b| b.pick.as_slice())
                    .unwrap_or_default();
                current.insert(ti, reply.map(|p| to_rows(&p, rows)));
            }
            Step::Claims(ti, gi) => groups.entry((ti, gi)).or_default().claims = reply.err(),
            Step::Own(ti, gi) => {
                let r = reply.map(|p| to_rows(&p, picked(plans, ti, gi, true)));
                groups.entry((ti, gi)).or_default().own = Some(r);
            }
            Step::ByRow(ti, gi) => {
                let r = reply.map(|p| to_rows(&p, picked(plans, ti, gi, false)));
                groups.entry((ti, gi)).or_default().by_row = Some(r);
            }
        }
    }
    Ok(tables
        .iter()
        .zip(plans)
        .enumerate()
        .map(|(ti, (t, plan))| {
            let current = answered(planned(plan.current.as_ref()), current.remove(&ti));
            let outcomes = (0..t.groups.len())
                .map(|gi| {
                    let replies = groups.remove(&(ti, gi)).unwrap_or_default();
                    let (own, by_row) = match plan.groups.get(gi) {
                        Some((o, r)) => (o.as_ref(), r.as_ref()),
                        None => (None, None),
                    };
                    outcome(replies, planned(own), planned(by_row), &current)
                })
                .collect();
            TableOutcome {
                current_error: current.err(),
                groups: outcomes,
            }
        })
        .collect())
}

/// One group's verdict from its replies: what its own-values check allowed, and what
/// its current-row check allowed among the versions their rows still hold.
fn outcome(
    replies: GroupReplies,
    own: Planned,
    by_row: Planned,
    current: &Result<HashSet<usize>, String>,
) -> Result<GroupOutcome, String> {
    if let Some(e) = replies.claims {
        return Err(e);
    }
    let mut visible = answered(own, replies.own)?;
    let by_row = answered(by_row, replies.by_row)?;
    let mut superseded = HashSet::new();
    for r in by_row {
        match current {
            Ok(still) if still.contains(&r) => {
                visible.insert(r);
            }
            Ok(_) => {
                superseded.insert(r);
            }
            Err(_) => {}
        }
    }
    Ok(GroupOutcome {
        visible,
        superseded,
    })
}

#[cfg(test)]
mod tests;
