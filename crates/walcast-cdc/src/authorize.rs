//! Which matched subscribers may see a change, and which of its columns.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use walcast_bus::{ChangeEvent, ChangeKind};
use walcast_wal2json::RowChange;

use crate::matcher::Sub;
use crate::rls::RlsChecker;
use crate::CdcError;

/// Subscribers grouped by the columns they may see: `None` = every column of the event.
pub type Audience = Vec<(Option<BTreeSet<String>>, Vec<String>)>;

/// Subscribers waiting for one row check, with the columns each may see.
type Waiting = Vec<(Arc<Sub>, BTreeSet<String>)>;

fn deny(sub: &Sub, why: &str) {
    metrics::counter!("walcast_cdc_rls_denied_total").increment(1);
    tracing::debug!(sub = %sub.spec.id, why, "change not delivered to subscriber");
}

/// Decide per subscriber (see [`crate::rls`]). Errors of one check deny only the
/// subscribers of that check.
pub async fn authorize(
    rls: &mut RlsChecker,
    kind: ChangeKind,
    row: &RowChange<'_>,
    event: &ChangeEvent,
    matched: Vec<Arc<Sub>>,
) -> Result<Audience, CdcError> {
    let event_cols: BTreeSet<String> = event.columns.iter().map(|c| c.name.clone()).collect();
    let (rls_on, pk) = rls.table(&row.schema, &row.table).await?;
    // (role, claims) → subscribers waiting for that row check.
    let mut checks: HashMap<(String, String), Waiting> = HashMap::new();
    let mut allowed: Vec<(BTreeSet<String>, String)> = Vec::new();
    for sub in matched {
        let Some(role) = sub
            .spec
            .claims
            .get("role")
            .and_then(|r| r.as_str())
            .map(str::to_string)
        else {
            deny(&sub, "no role claim");
            continue;
        };
        let access = match rls.access(&role, &row.schema, &row.table).await {
            Ok(Some(a)) => a,
            Ok(None) => {
                deny(&sub, "role may not read the table");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, role, "privilege check failed; denying");
                deny(&sub, "privilege check failed");
                continue;
            }
        };
        let mut cols: BTreeSet<String> = event_cols
            .iter()
            .filter(|c| access.columns.contains(*c))
            .cloned()
            .collect();
        if !rls_on || access.bypass_rls {
            allowed.push((cols, sub.spec.id.clone()));
        } else if kind == ChangeKind::Delete {
            // RLS cannot be checked on a row that is gone: send only its key.
            let keys: HashSet<&str> = pk.iter().map(|(n, _)| n.as_str()).collect();
            cols.retain(|c| keys.contains(c.as_str()));
            allowed.push((cols, sub.spec.id.clone()));
        } else {
            let claims = serde_json::to_string(&sub.spec.claims).unwrap_or_default();
            checks.entry((role, claims)).or_default().push((sub, cols));
        }
    }
    if !checks.is_empty() {
        if let Some(xid) = event.xid {
            rls.wait_visible(xid).await?;
        }
        let values: Vec<Option<String>> = pk
            .iter()
            .map(|(name, _)| {
                row.columns
                    .iter()
                    .find(|c| &c.name == name)
                    .and_then(|c| c.text().map(|t| t.into_owned()))
            })
            .collect();
        for ((role, claims), subs) in checks {
            metrics::counter!("walcast_cdc_rls_checks_total").increment(1);
            match rls
                .visible(&row.schema, &row.table, &pk, &values, &role, &claims)
                .await
            {
                Ok(true) => allowed.extend(subs.into_iter().map(|(s, c)| (c, s.spec.id.clone()))),
                Ok(false) => subs
                    .iter()
                    .for_each(|(s, _)| deny(s, "row not visible under RLS")),
                Err(e) => {
                    metrics::counter!("walcast_cdc_rls_errors_total").increment(1);
                    tracing::warn!(error = %e, role, table = %row.table, "RLS check failed; denying these subscribers");
                    subs.iter().for_each(|(s, _)| deny(s, "RLS check failed"));
                }
            }
        }
    }
    let mut groups: HashMap<BTreeSet<String>, Vec<String>> = HashMap::new();
    for (cols, id) in allowed {
        if !cols.is_empty() {
            groups.entry(cols).or_default().push(id);
        }
    }
    let mut out: Audience = groups
        .into_iter()
        .map(|(cols, ids)| ((cols != event_cols).then_some(cols), ids))
        .collect();
    out.sort_by(|a, b| a.1.cmp(&b.1));
    Ok(out)
}
