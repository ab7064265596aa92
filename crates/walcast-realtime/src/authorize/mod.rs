//! Which matched subscribers may see each change of a batch, and which of its columns.
//!
//! Per change and subscriber: the role (JWT `role` claim) must exist and may `SELECT`
//! some of the change's columns, and every column its filter reads (the filter was
//! evaluated on them: on a column the role may not read, which rows match is itself what
//! the role may not see); only the readable columns are sent. Without row-level security
//! (or for a role that bypasses it) that is all. With it, each version the change would
//! tell the subscriber about waits for the batch's check: an INSERT's and UPDATE's new
//! row decide delivery, a DELETE's row too, and an UPDATE's old row whether its
//! `old_record` is sent (else it is empty). The role's policies, read for the batch,
//! become a rule ([`crate::authorize::policy`]); a role they exempt sees every version,
//! a role without a permissive policy none, and otherwise one statement per (table,
//! role, claims) judges every version of the batch that group needs judged, old and new
//! side by side, on its own values (see [`crate::authorize::check`]). An old version
//! lacking a value the policies read cannot be judged (its row no longer holds it): it
//! is withheld. Naive mode (for benchmarks) checks each subscriber separately.

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
mod verdicts;
pub mod visibility;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use walcast_bus::ChangeEvent;

use crate::error::RealtimeError;
use crate::subscriptions::matcher::MatchedClass;
use crate::subscriptions::row_view::OwnedRow;
use crate::telemetry;
use check::{CheckOptions, GroupCheck, GroupOutcome, TableCheck, TableOutcome, Version};
use policy::Rule;
use rls::{Access, RlsChecker, TableInfo};
use verdicts::{
    deny, judged_versions, refuse, Allowed, Gather, Positions, Verdicts, Waiting, Which,
};
pub use verdicts::{Unjudged, Withheld};

/// Who may see a change on one front, grouped by the columns they may see (`None` =
/// every column of the event). An id is a class key (every subscription of the front in
/// that class) or a subscription id (judged one by one under row-level security).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FrontAudience {
    pub front: String,
    pub groups: Vec<(Option<BTreeSet<String>>, Vec<String>)>,
    /// As `groups`, for subscribers who may see the change but not its old version:
    /// they get it with an empty `old_record`.
    pub hidden_old: Vec<(Option<BTreeSet<String>>, Vec<String>)>,
}

/// A change's audience, per front (sorted by front).
pub type Audience = Vec<FrontAudience>;

/// A decoded change waiting for its batch to be authorized and published.
#[derive(Debug)]
pub struct PendingChange {
    pub event: ChangeEvent,
    /// The classes of its table ([`crate::subscriptions::matcher::Matcher::candidates`]):
    /// whom its table's notices concern, whatever their filters.
    pub candidates: Vec<MatchedClass>,
    /// Its row as filters see it (see `crate::subscriptions::narrow`); empty without
    /// candidates.
    pub filter_row: OwnedRow,
    /// The classes it matches: its candidates narrowed on its lane.
    pub matched: Vec<MatchedClass>,
    /// The new row's columns as Postgres text (INSERT and UPDATE; empty for DELETE),
    /// with unchanged TOASTed values taken from the old row.
    pub row: Vec<(String, Option<String>)>,
    /// The old row's columns as Postgres text (UPDATE and DELETE: the replica identity;
    /// empty for INSERT and when the change carries none).
    pub old: Vec<(String, Option<String>)>,
}

pub use crate::config::RlsMode;

/// A batch's verdicts: per change, who may see it, and who could not be judged.
#[derive(Debug, Default)]
pub struct Judged {
    pub audiences: Vec<Audience>,
    pub unjudged: Vec<Vec<Withheld>>,
}

/// What the first pass over a batch decided, and what it left to the row checks.
struct Pass {
    /// Per change: who may see it, so far.
    verdicts: Verdicts,
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
        verdicts: Verdicts::new(batch.len()),
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
    let Verdicts {
        allowed,
        hidden_old,
        unjudged,
    } = pass.verdicts;
    let audiences = batch
        .iter()
        .zip(allowed)
        .zip(hidden_old)
        .map(|((change, allowed), hidden)| audience(&change.event, allowed, &hidden))
        .collect();
    Ok(Judged {
        audiences,
        unjudged,
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
                    let verdicts = &mut self.verdicts;
                    m.subs()
                        .for_each(|sub| verdicts.unjudged(i, sub, Unjudged::Catalog));
                    continue;
                }
            };
            if m.class
                .filter_columns()
                .any(|c| !access.columns.contains(c))
            {
                // Whether the filter matched says what the column holds.
                let n = m
                    .subs()
                    .inspect(|sub| deny(sub, "filter reads an unreadable column"));
                metrics::counter!(telemetry::FILTER_UNREADABLE).increment(n.count() as u64);
                continue;
            }
            let cols = shown_columns(&event_cols, access, m.class.select.as_ref(), &pk);
            if !rls_on || access.bypass_rls {
                // The role sees every version: the whole class gets it, named once per front.
                for (front, _) in &m.fronts {
                    let entry = (front.clone(), cols.clone(), m.class.key.clone());
                    self.verdicts.allowed[i].push(entry);
                }
                continue;
            }
            for (which, delivers) in judged_versions(event.kind, !change.old.is_empty()) {
                if !delivers {
                    // Withheld unless its own check shows it.
                    let hidden = &mut self.verdicts.hidden_old[i];
                    hidden.extend(m.subs().map(|sub| sub.spec.id.clone()));
                }
                self.gather(&key, (i, *which, *delivers), m, &cols, mode);
            }
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
                    let verdicts = &mut self.verdicts;
                    subs.for_each(|sub| verdicts.unjudged(i, sub, Unjudged::Catalog));
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

    /// Leave each subscriber of class `m` to the row check of version `which` of change
    /// `i` (deciding its delivery, or only its `old_record`), grouped by (role, claims) —
    /// or one group per subscriber in naive mode.
    fn gather(
        &mut self,
        key: &(String, String),
        (i, which, delivers): (usize, Which, bool),
        m: &MatchedClass,
        cols: &BTreeSet<String>,
        mode: RlsMode,
    ) {
        let role = m.class.role.as_str();
        let gather = self.tables.entry(key.clone()).or_default();
        gather.row_of(i, which);
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
                .push(Waiting {
                    change: i,
                    which,
                    sub: sub.clone(),
                    cols: cols.clone(),
                    delivers,
                });
        }
    }
}

/// The columns of a change a class's subscriber gets: those its role may read, and of
/// those, with a binding's `select`, the selected ones and the key (as Supabase sends).
fn shown_columns(
    event_cols: &BTreeSet<&str>,
    access: &Access,
    select: Option<&BTreeSet<String>>,
    pk: &[String],
) -> BTreeSet<String> {
    let mut cols: BTreeSet<String> = event_cols
        .iter()
        .filter(|c| access.columns.contains(**c))
        .map(|c| c.to_string())
        .collect();
    if let Some(select) = select {
        cols.retain(|c| select.contains(c) || pk.contains(c));
    }
    cols
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
        let version = |&(i, which): &(usize, Which)| {
            let change = batch.get(i);
            let v = change.map(|c| if which == Which::New { &c.row } else { &c.old });
            v.cloned().unwrap_or_default()
        };
        let mut check = TableCheck {
            versions: Arc::new(gather.versions.iter().map(version).collect()),
            schema,
            table,
            pk,
            columns,
            groups: Vec::new(),
        };
        let subs = settle_groups(&mut check, gather, &rules, mode, &mut pass.verdicts);
        checks.push(check);
        waiting.push(subs);
    }
    let statements: usize = checks.iter().map(|t| t.groups.len()).sum();
    metrics::counter!(telemetry::RLS_CHECKS).increment(statements as u64);
    let outcomes = rls.check(&checks, opts).await?;
    for ((check, outcome), subs) in checks.iter().zip(outcomes).zip(waiting) {
        apply(check, outcome, subs, &mut pass.verdicts);
    }
    Ok(())
}

/// The subscribers of one table's checked groups, in group order, with the position
/// of each version among the table's versions.
struct GroupSubs {
    position: Positions,
    groups: Vec<Vec<Waiting>>,
}

/// Settle the groups whose rule needs no statement (every version, or none) and add
/// the others to `check`, each version judged by its own values where it can be.
fn settle_groups(
    check: &mut TableCheck,
    gather: Gather,
    rules: &HashMap<(String, String, String), Rule>,
    mode: RlsMode,
    verdicts: &mut Verdicts,
) -> GroupSubs {
    let mut group_subs = Vec::with_capacity(gather.groups.len());
    let mut by_row: BTreeSet<usize> = BTreeSet::new();
    // Per predicate (by address; one per role): whether each version carries what it reads.
    let mut complete: HashMap<usize, Vec<bool>> = HashMap::new();
    let mut unjudged = 0;
    let Gather {
        versions,
        position,
        groups,
    } = gather;
    for ((role, claims), subs) in groups {
        let key = (check.schema.clone(), check.table.clone(), role);
        let predicate = match rules.get(&key) {
            Some(Rule::All) => {
                subs.into_iter().for_each(|w| verdicts.grant(w));
                continue;
            }
            Some(Rule::Nothing) => {
                subs.iter()
                    .for_each(|w| refuse(w, "no policy lets the role see the row"));
                continue;
            }
            // The policies could not be read as of the batch.
            None => {
                subs.iter()
                    .for_each(|w| verdicts.unjudged_wait(w, Unjudged::Catalog));
                continue;
            }
            Some(Rule::Where(p)) => p.clone(),
        };
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
        let (own, current, old) = split_rows((&versions, &position), &subs, complete);
        for w in &subs {
            let row = position.get(&(w.change, w.which));
            if row.is_some_and(|r| old.contains(r)) {
                unjudged += 1;
                verdicts.unjudged_wait(w, Unjudged::Incomplete);
            }
        }
        by_row.extend(&current);
        let claims = match mode {
            RlsMode::Batched => claims,
            RlsMode::Naive => subs
                .first()
                .map(|w| w.sub.claims_json.clone())
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
    metrics::counter!(telemetry::RLS_OLD_UNJUDGED).increment(unjudged as u64);
    GroupSubs {
        position,
        groups: group_subs,
    }
}

/// The versions a group waits for, by how they are judged: by their own values (they
/// carry every value the predicate reads: `complete`), by their row's current state (a
/// new version lacking one), or not at all (an old version lacking one: its row no
/// longer holds it, so nothing can judge it and it stays withheld).
fn split_rows(
    (versions, position): (&[(usize, Which)], &Positions),
    subs: &[Waiting],
    complete: &[bool],
) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let mut rows: Vec<usize> = subs
        .iter()
        .filter_map(|w| position.get(&(w.change, w.which)).copied())
        .collect();
    rows.sort_unstable();
    rows.dedup();
    let (own, incomplete): (Vec<usize>, Vec<usize>) = rows
        .into_iter()
        .partition(|&r| complete.get(r).copied().unwrap_or(true));
    let is_old = |r: &usize| versions.get(*r).is_some_and(|v| v.1 == Which::Old);
    let (old, current): (Vec<usize>, Vec<usize>) = incomplete.into_iter().partition(is_old);
    (own, current, old)
}

/// Deliver or deny each waiting subscriber by its group's outcome (or, for an UPDATE's
/// old version, show or withhold its `old_record`).
/// A subscriber its check could not judge is withheld and noted to be told.
fn apply(check: &TableCheck, outcome: TableOutcome, subs: GroupSubs, verdicts: &mut Verdicts) {
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
        for w in waiting {
            let row = subs.position.get(&(w.change, w.which)).copied();
            let row = row.unwrap_or(usize::MAX);
            if let Some(why) = failed {
                verdicts.unjudged_wait(&w, why);
            } else if o.visible.contains(&row) {
                verdicts.grant(w);
            } else if o.superseded.contains(&row) {
                metrics::counter!(telemetry::RLS_SUPERSEDED).increment(1);
                verdicts.unjudged_wait(&w, Unjudged::Superseded);
            } else if !compared && group.by_row.contains(&row) {
                verdicts.unjudged_wait(&w, Unjudged::Failed);
            } else {
                refuse(&w, "row not visible under RLS");
            }
        }
    }
}

/// Per front, the allowed entries grouped by the columns they may see, apart for those
/// of `hidden` (subscription ids that may not see the change's old version).
fn audience(event: &ChangeEvent, allowed: Vec<Allowed>, hidden: &HashSet<String>) -> Audience {
    let event_cols: BTreeSet<String> = event.columns.iter().map(|c| c.name.clone()).collect();
    type Groups = BTreeMap<(bool, BTreeSet<String>), Vec<String>>;
    let mut fronts: BTreeMap<String, Groups> = BTreeMap::new();
    let mut seen: HashSet<(String, String)> = HashSet::new();
    for (front, cols, id) in allowed {
        if !cols.is_empty() && seen.insert((front.clone(), id.clone())) {
            let hide = !hidden.is_empty() && hidden.contains(&id);
            fronts
                .entry(front)
                .or_default()
                .entry((hide, cols))
                .or_default()
                .push(id);
        }
    }
    fronts
        .into_iter()
        .map(|(front, groups)| {
            let mut out = FrontAudience {
                front,
                ..FrontAudience::default()
            };
            for ((hide, cols), ids) in groups {
                let group = ((cols != event_cols).then_some(cols), ids);
                match hide {
                    true => out.hidden_old.push(group),
                    false => out.groups.push(group),
                }
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests;
