//! Which matched subscribers may see each change of a batch, and which of its columns.
//!
//! Per change and subscriber: the role (JWT `role` claim) must exist and may `SELECT`
//! some of the change's columns; only those are sent. Without row-level security (or
//! for a role that bypasses it) that is all. With it, a DELETE is reduced to its key and
//! an INSERT or UPDATE waits for the batch's check: the role's policies, read for the
//! batch, become a rule ([`crate::authorize::policy`]); a role they exempt sees every version,
//! a role without a permissive policy none, and otherwise one statement per (table,
//! role, claims) judges every version of the batch that group needs judged, on its own
//! values (see [`crate::authorize::check`]). Naive mode (for benchmarks) checks each
//! subscriber separately.

/// The `set_config` calls (after a first, so they start with a comma) that put the claims
/// Supabase's `auth.uid()`, `auth.role()` and `auth.email()` read first
/// (`request.jwt.claim.sub`, `.role`, `.email`) beside `request.jwt.claims`, taken from the
/// same bound claims (`$2`, JSON text), each `''` when absent. A policy calling
/// `auth.uid()` then reads one setting per row instead of parsing the claims JSON for
/// every row it is evaluated on. Always all three, so one group's values never reach the
/// next group of the same transaction. It ends the statement (its `FROM` parses the
/// claims once for the three).
macro_rules! claim_settings {
    () => {
        ", set_config('request.jwt.claim.sub', coalesce(c ->> 'sub', ''), true), \
         set_config('request.jwt.claim.role', coalesce(c ->> 'role', ''), true), \
         set_config('request.jwt.claim.email', coalesce(c ->> 'email', ''), true) \
         FROM (SELECT $2::text::jsonb AS c) AS walcast_claims"
    };
}

pub mod channel;
pub mod check;
pub mod policy;
pub mod rls;
pub mod rows;
pub mod sql;
pub mod visibility;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use walcast_bus::{ChangeEvent, ChangeKind};

use crate::error::RealtimeError;
use crate::subscriptions::matcher::{MatchedClass, Sub};
use crate::telemetry;
use check::{CheckOptions, GroupCheck, GroupOutcome, TableCheck, TableOutcome, Version};
use policy::Rule;
use rls::{Access, RlsChecker, TableInfo};

/// Who may see a change on one front, grouped by the columns they may see (`None` =
/// every column of the event). An id is a class key (every subscription of the front in
/// that class) or a subscription id (judged one by one under row-level security).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FrontAudience {
    pub front: String,
    pub groups: Vec<(Option<BTreeSet<String>>, Vec<String>)>,
}

/// A change's audience, per front (sorted by front).
pub type Audience = Vec<FrontAudience>;

/// One allowed entry: front, columns, class key or subscription id.
type Allowed = (String, BTreeSet<String>, String);

/// A decoded change waiting for its batch to be authorized and published.
#[derive(Debug)]
pub struct PendingChange {
    pub event: ChangeEvent,
    pub matched: Vec<MatchedClass>,
    /// The new row's columns as Postgres text (INSERT and UPDATE; empty for DELETE),
    /// with unchanged TOASTed values taken from the old row.
    pub row: Vec<(String, Option<String>)>,
}

pub use crate::config::RlsMode;

/// Why a change was withheld from a subscriber without a judgement: only a policy's
/// answer (its expression true, false or NULL for that subscriber and that version), the
/// role's privileges and the absence of a permissive policy withhold in silence; a
/// subscriber withheld for one of these is told (see `delivery::lanes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unjudged {
    /// Its check ran past `CDC_RLS_CHECK_TIMEOUT_MS`.
    Timeout,
    /// Its check was cancelled on the server.
    Cancelled,
    /// Its check failed: a policy that raised or read what the role may not read, a
    /// system column, a role dropped since the catalog read, the current-row comparison.
    /// One statement judges a group's versions together, so its error leaves every one
    /// of them unjudged.
    Failed,
    /// The catalog (privileges, policies, the table) could not be read as of the change.
    Catalog,
    /// Judged by its row, which had changed again by the check.
    Superseded,
}

impl Unjudged {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Unjudged::Timeout => "timeout",
            Unjudged::Cancelled => "cancelled",
            Unjudged::Failed => "failed",
            Unjudged::Catalog => "catalog",
            Unjudged::Superseded => "superseded",
        }
    }

    /// What a failed check's error (as `walcast_pgtls::db_message` words it) means.
    fn of_error(error: &str) -> Unjudged {
        match error.contains("(57014)") {
            true if error.contains("statement timeout") => Unjudged::Timeout,
            true => Unjudged::Cancelled,
            false => Unjudged::Failed,
        }
    }
}

/// A subscriber withheld a change unjudged: its front, its id, why.
pub type Withheld = (String, String, Unjudged);

/// A batch's verdicts: per change, who may see it, and who could not be judged.
#[derive(Debug, Default)]
pub struct Judged {
    pub audiences: Vec<Audience>,
    pub unjudged: Vec<Vec<Withheld>>,
}

fn deny(sub: &Sub, why: &str) {
    metrics::counter!(telemetry::RLS_DENIED).increment(1);
    tracing::debug!(sub = %sub.spec.id, why, "change not delivered to subscriber");
}

/// Withhold change `i` from `sub` unjudged: denied, and noted to be told.
fn unjudged(out: &mut [Vec<Withheld>], i: usize, sub: &Sub, why: Unjudged) {
    deny(sub, why.label());
    if let Some(list) = out.get_mut(i) {
        list.push((sub.spec.front.clone(), sub.spec.id.clone(), why));
    }
}

/// A subscriber waiting for a row check: change index, subscriber, columns it may see.
type Waiting = (usize, Arc<Sub>, BTreeSet<String>);

/// The checks of one table being gathered.
#[derive(Default)]
struct Gather {
    /// Change indices, in batch order.
    changes: Vec<usize>,
    position: HashMap<usize, usize>,
    /// Group key (role, claims) → subscribers waiting.
    groups: HashMap<(String, String), Vec<Waiting>>,
}

impl Gather {
    fn row_of(&mut self, change: usize) -> usize {
        *self.position.entry(change).or_insert_with(|| {
            self.changes.push(change);
            self.changes.len() - 1
        })
    }
}

/// What the first pass over a batch decided, and what it left to the row checks.
struct Pass {
    /// Per change: who may see it, so far.
    allowed: Vec<Vec<Allowed>>,
    /// Per change: who could not be judged.
    unjudged: Vec<Vec<Withheld>>,
    /// (schema, table) → the versions and subscribers to judge under RLS.
    tables: BTreeMap<(String, String), Gather>,
    /// Transactions of the versions to judge.
    xids: Vec<u32>,
    /// Table facts, read once per batch (the checker caches them across batches).
    infos: HashMap<(String, String), TableInfo>,
}

/// Decide per subscriber for every change of the batch. Errors of one check withhold
/// only from the subscribers of that check (listed as [`Judged::unjudged`]); an error of
/// the connection itself is returned, and so is [`RealtimeError::CheckDeadline`] when
/// the row checks are not done by `deadline`.
pub async fn authorize_batch(
    rls: &mut RlsChecker,
    batch: &[PendingChange],
    mode: RlsMode,
    timeout_ms: u64,
    deadline: Option<std::time::Instant>,
) -> Result<Judged, RealtimeError> {
    let mut pass = Pass {
        allowed: vec![Vec::new(); batch.len()],
        unjudged: vec![Vec::new(); batch.len()],
        tables: BTreeMap::new(),
        xids: Vec::new(),
        infos: HashMap::new(),
    };
    for (i, change) in batch.iter().enumerate() {
        if !change.matched.is_empty() {
            pass.route(rls, i, change, mode).await?;
        }
    }
    if !pass.tables.is_empty() {
        // The stream can deliver a commit before it is visible to new snapshots.
        rls.wait_visible(&pass.xids).await?;
        let opts = CheckOptions {
            pipelined: mode == RlsMode::Batched,
            timeout_ms,
            isolate: true,
            deadline,
        };
        judge_rows(rls, batch, &mut pass, mode, &opts).await?;
    }
    let audiences = batch
        .iter()
        .zip(pass.allowed)
        .map(|(change, allowed)| audience(&change.event, allowed))
        .collect();
    Ok(Judged {
        audiences,
        unjudged: pass.unjudged,
    })
}

impl Pass {
    /// Per matched class of one change: deny (no role, no privilege), allow the whole
    /// class (no row check applies), or leave each subscriber to the row checks.
    async fn route(
        &mut self,
        rls: &mut RlsChecker,
        i: usize,
        change: &PendingChange,
        mode: RlsMode,
    ) -> Result<(), RealtimeError> {
        let event = &change.event;
        let key = (event.schema.clone(), event.table.clone());
        let Some((rls_on, pk)) = self.table_facts(rls, i, change).await? else {
            return Ok(());
        };
        let event_cols: BTreeSet<&str> = event.columns.iter().map(|c| c.name.as_str()).collect();
        // Role → what it may see of this table (the checker caches across batches too,
        // this spares a lookup per subscriber).
        let mut access_memo: HashMap<&str, Result<Option<Access>, RealtimeError>> = HashMap::new();
        for m in &change.matched {
            let role = m.class.role.as_str();
            if role.is_empty() {
                m.subs().for_each(|sub| deny(sub, "no role claim"));
                continue;
            }
            if !access_memo.contains_key(role) {
                let a = rls.access(role, &event.schema, &event.table).await;
                access_memo.insert(role, a);
            }
            let access = match access_memo.get(role) {
                Some(Ok(Some(a))) => a,
                None | Some(Ok(None)) => {
                    m.subs()
                        .for_each(|sub| deny(sub, "role may not read the table"));
                    continue;
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, role, "privilege check failed; withheld, subscribers told");
                    let out = &mut self.unjudged;
                    m.subs()
                        .for_each(|sub| unjudged(out, i, sub, Unjudged::Catalog));
                    continue;
                }
            };
            let mut cols: BTreeSet<String> = event_cols
                .iter()
                .filter(|c| access.columns.contains(**c))
                .map(|c| c.to_string())
                .collect();
            if let Some(select) = &m.class.select {
                // The binding's `select`: those columns and the key, as Supabase sends.
                cols.retain(|c| select.contains(c) || pk.contains(c));
            }
            let judged = rls_on && !access.bypass_rls && event.kind != ChangeKind::Delete;
            if !judged {
                if rls_on && !access.bypass_rls {
                    // RLS cannot be checked on a row that is gone: send only its key.
                    cols.retain(|c| pk.contains(c));
                }
                // The whole class sees it: name the class once per front.
                for (front, _) in &m.fronts {
                    self.allowed[i].push((front.clone(), cols.clone(), m.class.key.clone()));
                }
                continue;
            }
            self.gather(&key, i, m, &cols, mode);
            self.xids.extend(event.xid);
        }
        Ok(())
    }

    /// Whether RLS is on for the change's table, and its key columns; `None` when the
    /// catalog no longer (or not yet) shows the table as of this change: it is then
    /// withheld from everyone rather than judged by another state.
    async fn table_facts(
        &mut self,
        rls: &mut RlsChecker,
        i: usize,
        change: &PendingChange,
    ) -> Result<Option<(bool, Vec<String>)>, RealtimeError> {
        let event = &change.event;
        let key = (event.schema.clone(), event.table.clone());
        if !self.infos.contains_key(&key) {
            match rls.table(&event.schema, &event.table).await {
                Ok(info) => self.infos.insert(key.clone(), info),
                Err(e @ RealtimeError::CatalogMoved { .. }) => {
                    tracing::warn!(error = %e, table = %event.table, "table facts not at the change's position; withholding it, subscribers told");
                    let subs = change.matched.iter().flat_map(|m| m.subs());
                    let out = &mut self.unjudged;
                    subs.for_each(|sub| unjudged(out, i, sub, Unjudged::Catalog));
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
        }
        Ok(self
            .infos
            .get(&key)
            .map(|info| (info.rls, info.pk.iter().map(|(k, _)| k.clone()).collect())))
    }

    /// Leave each subscriber of class `m` to the row checks of change `i`, grouped by
    /// (role, claims) — or one group per subscriber in naive mode.
    fn gather(
        &mut self,
        key: &(String, String),
        i: usize,
        m: &MatchedClass,
        cols: &BTreeSet<String>,
        mode: RlsMode,
    ) {
        let role = m.class.role.as_str();
        let gather = self.tables.entry(key.clone()).or_default();
        gather.row_of(i);
        for sub in m.subs() {
            let claims = match mode {
                RlsMode::Batched => sub.claims_json.clone(),
                // Naive: a check per subscriber, even with claims shared.
                RlsMode::Naive => sub.spec.id.clone(),
            };
            gather
                .groups
                .entry((role.to_string(), claims))
                .or_default()
                .push((i, sub.clone(), cols.clone()));
        }
    }
}

/// Judge the gathered versions: each role's policies, read now, make a rule per table;
/// groups whose rule needs no statement are settled here, the others checked in one
/// batch (see [`crate::authorize::check`]).
async fn judge_rows(
    rls: &mut RlsChecker,
    batch: &[PendingChange],
    pass: &mut Pass,
    mode: RlsMode,
    opts: &CheckOptions,
) -> Result<(), RealtimeError> {
    let pairs: Vec<(String, String, String)> = pass
        .tables
        .iter()
        .flat_map(|((schema, table), g)| {
            let roles: BTreeSet<&String> = g.groups.keys().map(|(role, _)| role).collect();
            roles
                .into_iter()
                .map(|role| (schema.clone(), table.clone(), role.clone()))
        })
        .collect();
    let facts = match rls.role_facts(&pairs).await {
        Ok(facts) => facts,
        // Policies not as of these changes: no rule, every group withheld unjudged.
        Err(e @ RealtimeError::CatalogMoved { .. }) => {
            tracing::warn!(error = %e, "policies not at the batch's position; withholding its row-checked changes, subscribers told");
            Vec::new()
        }
        Err(e) => return Err(e),
    };
    let mut rules: HashMap<(String, String, String), Rule> = HashMap::new();
    for (pair, facts) in pairs.into_iter().zip(facts) {
        let info = match pass.infos.get(&(pair.0.clone(), pair.1.clone())) {
            Some(info) => info.clone(),
            None => rls.table(&pair.0, &pair.1).await?,
        };
        let rule = match facts {
            Some(f) => policy::rule(&pair.1, &info.column_facts(), &f),
            None => Rule::Nothing,
        };
        rules.insert(pair, rule);
    }
    let mut checks = Vec::with_capacity(pass.tables.len());
    let mut waiting = Vec::with_capacity(pass.tables.len());
    for ((schema, table), gather) in std::mem::take(&mut pass.tables) {
        let info = pass.infos.get(&(schema.clone(), table.clone()));
        let (pk, columns) = info
            .map(|i| (i.pk.clone(), i.columns.clone()))
            .unwrap_or_default();
        let mut check = TableCheck {
            versions: Arc::new(
                gather
                    .changes
                    .iter()
                    .map(|&i| batch.get(i).map(|c| c.row.clone()).unwrap_or_default())
                    .collect(),
            ),
            schema,
            table,
            pk,
            columns,
            groups: Vec::new(),
        };
        let subs = settle_groups(&mut check, gather, &rules, mode, pass);
        checks.push(check);
        waiting.push(subs);
    }
    let statements: usize = checks.iter().map(|t| t.groups.len()).sum();
    metrics::counter!(telemetry::RLS_CHECKS).increment(statements as u64);
    let outcomes = rls.check(&checks, opts).await?;
    for ((check, outcome), subs) in checks.iter().zip(outcomes).zip(waiting) {
        apply(check, outcome, subs, pass);
    }
    Ok(())
}

/// The subscribers of one table's checked groups, in group order, with the position
/// of each change among the table's versions.
struct GroupSubs {
    position: HashMap<usize, usize>,
    groups: Vec<Vec<Waiting>>,
}

/// Settle the groups whose rule needs no statement (every version, or none) and add
/// the others to `check`, each version judged by its own values where it can be.
fn settle_groups(
    check: &mut TableCheck,
    gather: Gather,
    rules: &HashMap<(String, String, String), Rule>,
    mode: RlsMode,
    pass: &mut Pass,
) -> GroupSubs {
    let mut group_subs = Vec::with_capacity(gather.groups.len());
    let mut by_row: BTreeSet<usize> = BTreeSet::new();
    // Per predicate (by address; one per role): whether each version carries what it reads.
    let mut complete: HashMap<usize, Vec<bool>> = HashMap::new();
    for ((role, claims), subs) in gather.groups {
        let key = (check.schema.clone(), check.table.clone(), role);
        let predicate = match rules.get(&key) {
            Some(Rule::All) => {
                for (i, sub, cols) in subs {
                    if let Some(a) = pass.allowed.get_mut(i) {
                        a.push((sub.spec.front.clone(), cols, sub.spec.id.clone()));
                    }
                }
                continue;
            }
            Some(Rule::Nothing) => {
                subs.iter()
                    .for_each(|(_, sub, _)| deny(sub, "no policy lets the role see the row"));
                continue;
            }
            // The policies could not be read as of the batch.
            None => {
                let out = &mut pass.unjudged;
                for (i, sub, _) in &subs {
                    unjudged(out, *i, sub, Unjudged::Catalog);
                }
                continue;
            }
            Some(Rule::Where(p)) => p.clone(),
        };
        let mut rows: Vec<usize> = subs
            .iter()
            .filter_map(|(i, _, _)| gather.position.get(i).copied())
            .collect();
        rows.sort_unstable();
        rows.dedup();
        let complete = complete
            .entry(Arc::as_ptr(&predicate) as usize)
            .or_insert_with(|| {
                let judged = |v: &Version| policy::judged_by(&predicate, v);
                check
                    .versions
                    .iter()
                    .map(|v| judged(v) == policy::JudgedBy::OwnValues)
                    .collect()
            });
        let (own, current): (Vec<usize>, Vec<usize>) = rows
            .into_iter()
            .partition(|&r| complete.get(r).copied().unwrap_or(true));
        by_row.extend(&current);
        let claims = match mode {
            RlsMode::Batched => claims,
            RlsMode::Naive => subs
                .first()
                .map(|(_, s, _)| s.claims_json.clone())
                .unwrap_or_default(),
        };
        check.groups.push(GroupCheck {
            role: key.2,
            claims,
            predicate,
            own,
            by_row: current,
        });
        group_subs.push(subs);
    }
    metrics::counter!(telemetry::RLS_CURRENT_ROW).increment(by_row.len() as u64);
    GroupSubs {
        position: gather.position,
        groups: group_subs,
    }
}

/// Deliver or deny each waiting subscriber by its group's outcome; a subscriber its
/// check could not judge is withheld and noted to be told.
fn apply(check: &TableCheck, outcome: TableOutcome, subs: GroupSubs, pass: &mut Pass) {
    let compared = match &outcome.current_error {
        Some(e) => {
            metrics::counter!(telemetry::RLS_ERRORS).increment(1);
            tracing::warn!(error = %e, table = %check.table, "cannot compare changes with their rows; withholding those judged by their row, subscribers told");
            false
        }
        None => true,
    };
    for ((group, result), waiting) in check.groups.iter().zip(outcome.groups).zip(subs.groups) {
        let (o, failed) = match result {
            Ok(o) => (o, None),
            Err(e) => {
                metrics::counter!(telemetry::RLS_ERRORS).increment(1);
                tracing::warn!(error = %e, role = %group.role, table = %check.table, subscribers = waiting.len(), "RLS check failed; withholding from these subscribers, told");
                (GroupOutcome::default(), Some(Unjudged::of_error(&e)))
            }
        };
        for (i, sub, cols) in waiting {
            let row = subs.position.get(&i).copied().unwrap_or(usize::MAX);
            if let Some(why) = failed {
                unjudged(&mut pass.unjudged, i, &sub, why);
            } else if o.visible.contains(&row) {
                if let Some(a) = pass.allowed.get_mut(i) {
                    a.push((sub.spec.front.clone(), cols, sub.spec.id.clone()));
                }
            } else if o.superseded.contains(&row) {
                metrics::counter!(telemetry::RLS_SUPERSEDED).increment(1);
                unjudged(&mut pass.unjudged, i, &sub, Unjudged::Superseded);
            } else if !compared && group.by_row.contains(&row) {
                unjudged(&mut pass.unjudged, i, &sub, Unjudged::Failed);
            } else {
                deny(&sub, "row not visible under RLS");
            }
        }
    }
}

fn audience(event: &ChangeEvent, allowed: Vec<Allowed>) -> Audience {
    let event_cols: BTreeSet<String> = event.columns.iter().map(|c| c.name.clone()).collect();
    let mut fronts: BTreeMap<String, BTreeMap<BTreeSet<String>, Vec<String>>> = BTreeMap::new();
    let mut seen: HashSet<(String, String)> = HashSet::new();
    for (front, cols, id) in allowed {
        if !cols.is_empty() && seen.insert((front.clone(), id.clone())) {
            fronts
                .entry(front)
                .or_default()
                .entry(cols)
                .or_default()
                .push(id);
        }
    }
    fronts
        .into_iter()
        .map(|(front, groups)| FrontAudience {
            front,
            groups: groups
                .into_iter()
                .map(|(cols, ids)| ((cols != event_cols).then_some(cols), ids))
                .collect(),
        })
        .collect()
}

#[cfg(test)]
#[path = "authorize_tests.rs"]
mod tests;
