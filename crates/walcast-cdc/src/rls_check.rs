//! One round trip of row-level-security checks for a batch of changes.
//!
//! Every statement of a batch is queued on the connection before the first reply is
//! read (tokio-postgres pipelines requests that are issued without waiting), inside one
//! `REPEATABLE READ READ ONLY` transaction that is always rolled back:
//!
//! ```text
//! BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY
//! SELECT set_config('statement_timeout', $1, true)
//! per table:  SAVEPOINT; <which rows still hold the change's values>; ROLLBACK TO + RELEASE
//! per (table, role, claims):
//!             SAVEPOINT; set_config('role', $1, true), set_config('request.jwt.claims', $2, true);
//!             <which of the rows exist for that role>; ROLLBACK TO + RELEASE
//! ROLLBACK
//! ```
//!
//! One snapshot serves the whole batch, so "the row still holds this change's values" and
//! "the row is visible" are judged together: a change is never judged by a later version
//! of its row. The savepoints confine a failing check (a policy that raises, an unknown
//! role, the timeout) to its own group; `ROLLBACK TO` also undoes its `set_config`.
//!
//! Savepoints double the statements per group, and checks rarely fail, so a batch first
//! runs without them (`isolate: false`; each group's `set_config` replaces the previous
//! one's). If anything failed there, every statement after the failure failed with it
//! (the transaction is aborted): the caller then runs the whole batch again, isolated.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use crate::rls_sql::{current_sql, visible_sql, CatalogColumn};
use crate::CdcError;

/// The rows of one table to check, and who to check them for.
#[derive(Debug, Default)]
pub struct TableCheck {
    pub schema: String,
    pub table: String,
    pub pk: Vec<CatalogColumn>,
    /// Columns compared to find rows that changed again since (must include the key).
    pub compare: Vec<CatalogColumn>,
    /// Per row: values of `compare`, in order, as Postgres text.
    pub rows: Vec<Vec<Option<String>>>,
    pub groups: Vec<GroupCheck>,
}

/// One role + claims, and the rows (indices into [`TableCheck::rows`]) it needs judged.
#[derive(Debug, Default, Clone)]
pub struct GroupCheck {
    pub role: String,
    pub claims: String,
    pub rows: Vec<usize>,
}

#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// Send everything before reading replies (false: one statement per round trip).
    pub pipelined: bool,
    /// `statement_timeout` for each check, in milliseconds.
    pub timeout_ms: u64,
    /// Each statement in its own savepoint, so one failure fails only itself.
    pub isolate: bool,
}

impl TableOutcome {
    /// No statement of this table failed.
    pub fn all_ok(&self) -> bool {
        self.current.is_ok() && self.groups.iter().all(Result::is_ok)
    }
}

/// Row indices that passed, or why the statement failed.
pub type Passed = Result<HashSet<usize>, String>;

#[derive(Debug)]
pub struct TableOutcome {
    /// Rows that still hold the change's values.
    pub current: Passed,
    /// Per group, in order: rows visible to it.
    pub groups: Vec<Passed>,
}

type Reply<'a> = Pin<Box<dyn Future<Output = Result<Vec<i64>, tokio_postgres::Error>> + Send + 'a>>;

const SAVEPOINT: &str = "SAVEPOINT walcast_check";
const RESTORE: &str = "ROLLBACK TO SAVEPOINT walcast_check; RELEASE SAVEPOINT walcast_check";
const SET_CLAIMS: &str =
    "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true)";
const SET_TIMEOUT: &str = "SELECT set_config('statement_timeout', $1, true)";

async fn prepared(
    client: &Client,
    cache: &mut HashMap<String, Statement>,
    sql: &str,
) -> Result<Statement, tokio_postgres::Error> {
    if let Some(s) = cache.get(sql) {
        return Ok(s.clone());
    }
    let s = client.prepare(sql).await?;
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
fn query<'a>(
    client: &'a Client,
    stmt: &'a Statement,
    params: Vec<&'a (dyn ToSql + Sync)>,
) -> Reply<'a> {
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
    Visible(usize, usize),
}

/// Column-major arrays (one `text[]` per column) of the chosen rows.
fn arrays(
    rows: &[Vec<Option<String>>],
    pick: &[usize],
    cols: &[usize],
) -> Vec<Vec<Option<String>>> {
    cols.iter()
        .map(|&c| {
            pick.iter()
                .map(|&r| rows.get(r).and_then(|row| row.get(c).cloned()).flatten())
                .collect()
        })
        .collect()
}

/// 1-based positions from `WITH ORDINALITY` back to row indices.
fn to_rows(positions: &[i64], pick: &[usize]) -> HashSet<usize> {
    positions
        .iter()
        .filter_map(|p| usize::try_from(*p).ok()?.checked_sub(1))
        .filter_map(|p| pick.get(p).copied())
        .collect()
}

pub async fn run_checks(
    client: &Client,
    cache: &mut HashMap<String, Statement>,
    tables: &[TableCheck],
    opts: &CheckOptions,
) -> Result<Vec<TableOutcome>, CdcError> {
    let set_claims = prepared(client, cache, SET_CLAIMS).await?;
    let set_timeout = prepared(client, cache, SET_TIMEOUT).await?;
    let timeout = opts.timeout_ms.to_string();
    // Statements and bound arrays first (prepare failures fail that table only), then
    // the replies, which borrow them.
    struct Plan {
        current: Result<Statement, String>,
        visible: Result<Statement, String>,
        all_rows: Vec<usize>,
        current_arrays: Vec<Vec<Option<String>>>,
        group_arrays: Vec<Vec<Vec<Option<String>>>>,
    }
    let mut plans = Vec::with_capacity(tables.len());
    for t in tables {
        let key_cols: Vec<usize> =
            t.pk.iter()
                .filter_map(|(name, _)| t.compare.iter().position(|(c, _)| c == name))
                .collect();
        let current = match current_sql(&t.schema, &t.table, &t.pk, &t.compare) {
            None => Err("the change does not carry its primary key".to_string()),
            Some(sql) => prepared(client, cache, &sql)
                .await
                .map_err(|e| crate::db_message(&e)),
        };
        let visible = prepared(client, cache, &visible_sql(&t.schema, &t.table, &t.pk))
            .await
            .map_err(|e| crate::db_message(&e));
        let all_rows: Vec<usize> = (0..t.rows.len()).collect();
        let all_cols: Vec<usize> = (0..t.compare.len()).collect();
        plans.push(Plan {
            current,
            visible,
            current_arrays: arrays(&t.rows, &all_rows, &all_cols),
            group_arrays: t
                .groups
                .iter()
                .map(|g| arrays(&t.rows, &g.rows, &key_cols))
                .collect(),
            all_rows,
        });
    }

    let prepared: Prepared = plans
        .iter()
        .map(|p| {
            (
                p.current.as_ref().err().cloned(),
                p.visible.as_ref().err().cloned(),
                p.all_rows.clone(),
            )
        })
        .collect();
    let mut steps: Vec<(Step, Reply<'_>)> = Vec::new();
    steps.push((
        Step::Control,
        control(client, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"),
    ));
    steps.push((Step::Control, exec(client, &set_timeout, vec![&timeout])));
    for (ti, plan) in plans.iter().enumerate() {
        if let Ok(stmt) = &plan.current {
            if opts.isolate {
                steps.push((Step::Control, control(client, SAVEPOINT)));
            }
            let params = plan
                .current_arrays
                .iter()
                .map(|a| a as &(dyn ToSql + Sync))
                .collect();
            steps.push((Step::Current(ti), query(client, stmt, params)));
            if opts.isolate {
                steps.push((Step::Control, control(client, RESTORE)));
            }
        }
    }
    for (ti, (t, plan)) in tables.iter().zip(&plans).enumerate() {
        let Ok(stmt) = &plan.visible else { continue };
        for (gi, g) in t.groups.iter().enumerate() {
            let Some(group_arrays) = plan.group_arrays.get(gi) else {
                continue;
            };
            if opts.isolate {
                steps.push((Step::Control, control(client, SAVEPOINT)));
            }
            steps.push((
                Step::Claims(ti, gi),
                exec(client, &set_claims, vec![&g.role, &g.claims]),
            ));
            let params = group_arrays
                .iter()
                .map(|a| a as &(dyn ToSql + Sync))
                .collect();
            steps.push((Step::Visible(ti, gi), query(client, stmt, params)));
            if opts.isolate {
                steps.push((Step::Control, control(client, RESTORE)));
            }
        }
    }
    steps.push((Step::Control, control(client, "ROLLBACK")));

    if opts.pipelined {
        // The first poll of each reply queues its request on the connection, in order;
        // the server then answers them back to back.
        let early = kick(&mut steps);
        let mut replies = Vec::with_capacity(steps.len());
        for ((step, reply), done) in steps.into_iter().zip(early) {
            let r = match done {
                Some(r) => r,
                None => reply.await,
            };
            replies.push((step, r));
        }
        collect(tables, &prepared, replies)
    } else {
        let mut replies = Vec::with_capacity(steps.len());
        for (step, reply) in steps {
            replies.push((step, reply.await));
        }
        collect(tables, &prepared, replies)
    }
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

/// Per table: (prepare error of the version statement, prepare error of the check, rows).
type Prepared = Vec<(Option<String>, Option<String>, Vec<usize>)>;

fn collect(
    tables: &[TableCheck],
    prepared: &Prepared,
    replies: Vec<(Step, Result<Vec<i64>, tokio_postgres::Error>)>,
) -> Result<Vec<TableOutcome>, CdcError> {
    let mut out: Vec<TableOutcome> = tables
        .iter()
        .zip(prepared)
        .map(|(t, (cur_err, vis_err, _))| TableOutcome {
            current: match cur_err {
                Some(e) => Err(e.clone()),
                None => Err("not checked".into()),
            },
            groups: t
                .groups
                .iter()
                .map(|_| Err(vis_err.clone().unwrap_or_else(|| "not checked".into())))
                .collect(),
        })
        .collect();
    let mut claim_errors: HashMap<(usize, usize), String> = HashMap::new();
    for (step, reply) in replies {
        match (step, reply) {
            (Step::Control, Err(e)) => return Err(e.into()),
            (Step::Control, Ok(_)) => {}
            (Step::Current(ti), r) => {
                if let (Some(o), Some((_, _, rows))) = (out.get_mut(ti), prepared.get(ti)) {
                    o.current = r
                        .map(|p| to_rows(&p, rows))
                        .map_err(|e| crate::db_message(&e));
                }
            }
            (Step::Claims(ti, gi), Err(e)) => {
                claim_errors.insert((ti, gi), crate::db_message(&e));
            }
            (Step::Claims(..), Ok(_)) => {}
            (Step::Visible(ti, gi), r) => {
                let pick = tables
                    .get(ti)
                    .and_then(|t| t.groups.get(gi))
                    .map(|g| g.rows.as_slice())
                    .unwrap_or_default();
                if let Some(slot) = out.get_mut(ti).and_then(|o| o.groups.get_mut(gi)) {
                    *slot = match (claim_errors.remove(&(ti, gi)), r) {
                        (Some(e), _) => Err(e),
                        (None, r) => r
                            .map(|p| to_rows(&p, pick))
                            .map_err(|e| crate::db_message(&e)),
                    };
                }
            }
        }
    }
    Ok(out)
}
