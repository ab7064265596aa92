//! Which matched subscribers may see each change of a batch, and which of its columns.
//!
//! Per change and subscriber: the role (JWT `role` claim) must exist and may `SELECT`
//! some of the change's columns; only those are sent. Without row-level security (or
//! for a role that bypasses it) that is all. With it, a DELETE is reduced to its key and
//! an INSERT or UPDATE waits for the batch's check: one statement per (table, role,
//! claims) covering every row of the batch that group needs judged (see
//! [`crate::rls_check`]). Naive mode (for benchmarks) checks each subscriber separately.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use walcast_bus::{ChangeEvent, ChangeKind};

use crate::matcher::{MatchedClass, Sub};
use crate::rls::RlsChecker;
use crate::rls_check::{CheckOptions, GroupCheck, TableCheck};
use crate::CdcError;

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

/// How row-level security is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RlsMode {
    /// One statement per (table, role, claims) per batch, all in one round trip.
    #[default]
    Batched,
    /// One check per subscriber per change, one statement per round trip: the cost of
    /// the straightforward approach, kept for benchmarks.
    Naive,
}

fn deny(sub: &Sub, why: &str) {
    metrics::counter!("walcast_cdc_rls_denied_total").increment(1);
    tracing::debug!(sub = %sub.spec.id, why, "change not delivered to subscriber");
}

/// A subscriber waiting for a row check: change index, subscriber, columns it may see.
type Waiting = (usize, Arc<Sub>, BTreeSet<String>);

/// The checks of one table being gathered.
#[derive(Default)]
struct Gather {
    /// Change indices, in batch order.
    changes: Vec<usize>,
    position: HashMap<usize, usize>,
    /// Group key → subscribers waiting.
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

/// Decide per subscriber for every change of the batch. Errors of one check deny only the
/// subscribers of that check; an error of the connection itself is returned.
pub async fn authorize_batch(
    rls: &mut RlsChecker,
    batch: &[PendingChange],
    mode: RlsMode,
    timeout_ms: u64,
) -> Result<Vec<Audience>, CdcError> {
    let mut allowed: Vec<Vec<Allowed>> = vec![Vec::new(); batch.len()];
    let mut tables: BTreeMap<(String, String), Gather> = BTreeMap::new();
    let mut xids: Vec<u32> = Vec::new();
    // Table facts, read once per batch (the checker caches them across batches).
    let mut infos: HashMap<(String, String), crate::rls::TableInfo> = HashMap::new();
    for (i, change) in batch.iter().enumerate() {
        if change.matched.is_empty() {
            continue;
        }
        let event = &change.event;
        let key = (event.schema.clone(), event.table.clone());
        if !infos.contains_key(&key) {
            let info = rls.table(&event.schema, &event.table).await?;
            infos.insert(key.clone(), info);
        }
        let Some(info) = infos.get(&key) else {
            continue;
        };
        let event_cols: BTreeSet<&str> = event.columns.iter().map(|c| c.name.as_str()).collect();
        // Role → what it may see of this table (the checker caches across batches too,
        // this spares a lookup per subscriber).
        let mut access_memo: HashMap<&str, Result<Option<crate::rls::Access>, CdcError>> =
            HashMap::new();
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
                    tracing::warn!(error = %e, role, "privilege check failed; denying");
                    m.subs().for_each(|sub| deny(sub, "privilege check failed"));
                    continue;
                }
            };
            let mut cols: BTreeSet<String> = event_cols
                .iter()
                .filter(|c| access.columns.contains(**c))
                .map(|c| c.to_string())
                .collect();
            let judged = info.rls && !access.bypass_rls && event.kind != ChangeKind::Delete;
            if !judged {
                if info.rls && !access.bypass_rls {
                    // RLS cannot be checked on a row that is gone: send only its key.
                    cols.retain(|c| info.pk.iter().any(|(k, _)| k == c));
                }
                // The whole class sees it: name the class once per front.
                for (front, _) in &m.fronts {
                    allowed[i].push((front.clone(), cols.clone(), m.class.key.clone()));
                }
                continue;
            }
            let gather = tables
                .entry((event.schema.clone(), event.table.clone()))
                .or_default();
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
            xids.extend(event.xid);
        }
    }
    if !tables.is_empty() {
        // The stream can deliver a commit before it is visible to new snapshots.
        rls.wait_visible(&xids).await?;
        let mut checks = Vec::with_capacity(tables.len());
        let mut waiting = Vec::with_capacity(tables.len());
        for ((schema, table), gather) in tables {
            let info = match infos.remove(&(schema.clone(), table.clone())) {
                Some(info) => info,
                None => rls.table(&schema, &table).await?,
            };
            // Compare every catalog column the changes all carry.
            let compare: Vec<(String, String)> = info
                .columns
                .iter()
                .filter(|(name, _)| {
                    gather.changes.iter().all(|&i| {
                        batch
                            .get(i)
                            .is_some_and(|c| c.row.iter().any(|(n, _)| n == name))
                    })
                })
                .cloned()
                .collect();
            let rows = gather
                .changes
                .iter()
                .map(|&i| {
                    let row = batch.get(i).map(|c| c.row.as_slice()).unwrap_or_default();
                    compare
                        .iter()
                        .map(|(name, _)| {
                            row.iter()
                                .find(|(n, _)| n == name)
                                .and_then(|(_, v)| v.clone())
                        })
                        .collect()
                })
                .collect();
            let mut groups = Vec::with_capacity(gather.groups.len());
            let mut group_subs = Vec::with_capacity(gather.groups.len());
            for ((role, claims), subs) in gather.groups {
                let mut rows: Vec<usize> = subs
                    .iter()
                    .filter_map(|(i, _, _)| gather.position.get(i).copied())
                    .collect();
                rows.sort_unstable();
                rows.dedup();
                let claims = match mode {
                    RlsMode::Batched => claims,
                    RlsMode::Naive => subs
                        .first()
                        .map(|(_, s, _)| s.claims_json.clone())
                        .unwrap_or_default(),
                };
                groups.push(GroupCheck { role, claims, rows });
                group_subs.push(subs);
            }
            waiting.push((gather.position, group_subs));
            checks.push(TableCheck {
                schema,
                table,
                pk: info.pk,
                compare,
                rows,
                groups,
            });
        }
        let opts = CheckOptions {
            pipelined: mode == RlsMode::Batched,
            timeout_ms,
            isolate: true,
        };
        let statements: usize = checks.iter().map(|t| t.groups.len()).sum();
        metrics::counter!("walcast_cdc_rls_checks_total").increment(statements as u64);
        let outcomes = rls.check(&checks, &opts).await?;
        for ((check, outcome), (position, group_subs)) in checks.iter().zip(outcomes).zip(waiting) {
            let current: HashSet<usize> = match outcome.current {
                Ok(rows) => rows,
                Err(e) => {
                    metrics::counter!("walcast_cdc_rls_errors_total").increment(1);
                    tracing::warn!(error = %e, table = %check.table, "cannot compare changes with their rows; denying");
                    HashSet::new()
                }
            };
            for ((group, result), subs) in check.groups.iter().zip(outcome.groups).zip(group_subs) {
                let visible = match result {
                    Ok(v) => v,
                    Err(e) => {
                        metrics::counter!("walcast_cdc_rls_errors_total").increment(1);
                        tracing::warn!(error = %e, role = %group.role, table = %check.table, "RLS check failed; denying these subscribers");
                        HashSet::new()
                    }
                };
                for (i, sub, cols) in subs {
                    let row = position.get(&i).copied().unwrap_or(usize::MAX);
                    if !visible.contains(&row) {
                        deny(&sub, "row not visible under RLS");
                    } else if !current.contains(&row) {
                        metrics::counter!("walcast_cdc_rls_superseded_total").increment(1);
                        deny(&sub, "row changed again before it could be checked");
                    } else if let Some(a) = allowed.get_mut(i) {
                        a.push((sub.spec.front.clone(), cols, sub.spec.id.clone()));
                    }
                }
            }
        }
    }
    Ok(batch
        .iter()
        .zip(allowed)
        .map(|(change, allowed)| audience(&change.event, allowed))
        .collect())
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
