//! The pure parts of [`crate::authorize`]: settling groups by their rule, applying the
//! checks' outcomes, and shaping the audience — no database.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use walcast_bus::subs::SubscriptionSpec;
use walcast_bus::ChangeEvent;
use walcast_wal2json::Lsn;

use super::*;
use crate::authorize::check::{GroupOutcome, TableCheck, TableOutcome};
use crate::authorize::policy::{ColumnFact, Predicate, Rule};
use crate::subscriptions::matcher::Sub;

fn sub(id: &str, front: &str, role: &str) -> Arc<Sub> {
    let spec = SubscriptionSpec {
        id: id.into(),
        front: front.into(),
        project: "default".into(),
        schema: "public".into(),
        table: Some("t".into()),
        event: "*".into(),
        filter: None,
        select: None,
        claims: serde_json::json!({ "role": role }).into(),
        from: None,
    };
    Arc::new(Sub::new(spec, None, Lsn(0)))
}

fn cols(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn event(columns: &[&str]) -> ChangeEvent {
    let columns: Vec<_> = columns
        .iter()
        .map(|c| serde_json::json!({ "name": c, "type": "text" }))
        .collect();
    serde_json::from_value(serde_json::json!({
        "project": "default", "schema": "public", "table": "t", "type": "INSERT",
        "commit_timestamp": "2026-01-01T00:00:00.000Z", "commit_lsn": "0/10", "seq": 0,
        "columns": columns,
    }))
    .unwrap()
}

fn owner_predicate() -> Arc<Predicate> {
    Arc::new(Predicate {
        condition: "owner = current_setting('x')".into(),
        columns: vec![ColumnFact {
            name: "owner".into(),
            ty: "text".into(),
            nan_as_null: false,
        }],
    })
}

fn table_check(versions: Vec<Version>) -> TableCheck {
    TableCheck {
        schema: "public".into(),
        table: "t".into(),
        pk: Vec::new(),
        columns: Vec::new(),
        versions: Arc::new(versions),
        groups: Vec::new(),
    }
}

/// Changes 0 and 1 of a batch, both of table `t`, each waited on by one group per role.
fn gather(roles: &[&str]) -> Gather {
    let mut g = Gather::default();
    for change in [0, 1] {
        g.row_of(change, Which::New);
        for role in roles {
            let s = sub(&format!("f:{role}{change}"), "f", role);
            let key = (role.to_string(), s.claims_json.clone());
            g.groups
                .entry(key)
                .or_default()
                .push(waiting(change, Which::New, s));
        }
    }
    g
}

fn waiting(change: usize, which: Which, sub: Arc<Sub>) -> Waiting {
    Waiting {
        change,
        which,
        sub,
        cols: cols(&["id"]),
        delivers: true,
    }
}

/// The subscription ids withheld unjudged from one change, with why.
fn withheld(w: &[Withheld]) -> Vec<(&str, Unjudged)> {
    let mut v: Vec<(&str, Unjudged)> = w.iter().map(|(_, id, why)| (id.as_str(), *why)).collect();
    v.sort_unstable();
    v
}

fn ids(allowed: &[Allowed]) -> Vec<&str> {
    let mut v: Vec<&str> = allowed.iter().map(|(_, _, id)| id.as_str()).collect();
    v.sort_unstable();
    v
}

#[test]
fn settled_rules_need_no_statement() {
    let rules: HashMap<_, _> = [
        (("public".into(), "t".into(), "exempt".into()), Rule::All),
        (("public".into(), "t".into(), "none".into()), Rule::Nothing),
    ]
    .into_iter()
    .collect();
    let mut check = table_check(vec![Vec::new(), Vec::new()]);
    let mut verdicts = Verdicts::new(2);
    let g = gather(&["exempt", "none", "unread"]);
    let subs = settle_groups(&mut check, g, &rules, RlsMode::Batched, &mut verdicts);
    assert!(check.groups.is_empty(), "no statement for settled rules");
    assert!(subs.groups.is_empty());
    assert_eq!(ids(&verdicts.allowed[0]), ["f:exempt0"]);
    assert_eq!(ids(&verdicts.allowed[1]), ["f:exempt1"]);
    // No permissive policy is the policies' answer: silent. A role whose policies could
    // not be read as of the batch (no rule) is withheld unjudged, to be told.
    let unread = |i: usize| withheld(&verdicts.unjudged[i]);
    assert_eq!(unread(0), [("f:unread0", Unjudged::Catalog)]);
    assert_eq!(unread(1), [("f:unread1", Unjudged::Catalog)]);
}

#[test]
fn a_condition_judges_complete_versions_by_their_own_values() {
    let key = ("public".to_string(), "t".to_string(), "user".to_string());
    let rules: HashMap<_, _> = [(key, Rule::Where(owner_predicate()))]
        .into_iter()
        .collect();
    let complete = vec![("owner".to_string(), Some("a".to_string()))];
    let missing = vec![("id".to_string(), Some("1".to_string()))];
    let mut check = table_check(vec![complete, missing]);
    let mut verdicts = Verdicts::new(2);
    let subs = settle_groups(
        &mut check,
        gather(&["user"]),
        &rules,
        RlsMode::Batched,
        &mut verdicts,
    );
    assert_eq!(check.groups.len(), 1);
    assert_eq!(check.groups[0].own, [0]);
    assert_eq!(check.groups[0].by_row, [1]);
    assert_eq!(subs.groups.len(), 1);
    assert!(
        verdicts.allowed.iter().all(Vec::is_empty),
        "nothing allowed before the check"
    );
}

#[test]
fn outcomes_allow_only_visible_versions_and_errors_withhold_their_group_unjudged() {
    let key = ("public".to_string(), "t".to_string(), "user".to_string());
    let rules: HashMap<_, _> = [(key, Rule::Where(owner_predicate()))]
        .into_iter()
        .collect();
    let version = vec![("owner".to_string(), Some("a".to_string()))];
    let mut check = table_check(vec![version.clone(), version]);
    let mut verdicts = Verdicts::new(2);
    let g = gather(&["user"]);
    let subs = settle_groups(&mut check, g, &rules, RlsMode::Batched, &mut verdicts);
    let ok = TableOutcome {
        current_error: None,
        groups: vec![Ok(GroupOutcome {
            visible: HashSet::from([1]),
            superseded: HashSet::new(),
        })],
    };
    apply(&check, ok, subs, &mut verdicts);
    assert!(verdicts.allowed[0].is_empty());
    assert_eq!(ids(&verdicts.allowed[1]), ["f:user1"]);
    assert!(
        verdicts.unjudged.iter().all(Vec::is_empty),
        "the policy's answer is silent"
    );

    let errors = [
        ("ERROR: boom (P0001)", Unjudged::Failed),
        (
            "ERROR: role \"gone\" does not exist (22023)",
            Unjudged::Failed,
        ),
        (
            "ERROR: canceling statement due to statement timeout (57014)",
            Unjudged::Timeout,
        ),
        (
            "ERROR: canceling statement due to user request (57014)",
            Unjudged::Cancelled,
        ),
    ];
    for (error, why) in errors {
        check.groups.clear();
        let mut verdicts = Verdicts::new(2);
        let g = gather(&["user"]);
        let subs = settle_groups(&mut check, g, &rules, RlsMode::Batched, &mut verdicts);
        let failed = TableOutcome {
            current_error: None,
            groups: vec![Err(error.into())],
        };
        apply(&check, failed, subs, &mut verdicts);
        assert!(
            verdicts.allowed.iter().all(Vec::is_empty),
            "a failed check denies"
        );
        assert_eq!(
            withheld(&verdicts.unjudged[0]),
            [("f:user0", why)],
            "{error}"
        );
        assert_eq!(
            withheld(&verdicts.unjudged[1]),
            [("f:user1", why)],
            "{error}"
        );
    }
}

#[test]
fn a_superseded_version_and_a_failed_comparison_are_unjudged_an_invisible_one_is_not() {
    let key = ("public".to_string(), "t".to_string(), "user".to_string());
    let rules: HashMap<_, _> = [(key, Rule::Where(owner_predicate()))]
        .into_iter()
        .collect();
    // Both lack the column the policy reads: judged by their row.
    let version = vec![("id".to_string(), Some("1".to_string()))];
    let mut check = table_check(vec![version.clone(), version]);
    let mut verdicts = Verdicts::new(2);
    let g = gather(&["user"]);
    let subs = settle_groups(&mut check, g, &rules, RlsMode::Batched, &mut verdicts);
    let outcome = TableOutcome {
        current_error: None,
        groups: vec![Ok(GroupOutcome {
            visible: HashSet::new(),
            superseded: HashSet::from([0]),
        })],
    };
    apply(&check, outcome, subs, &mut verdicts);
    assert_eq!(
        withheld(&verdicts.unjudged[0]),
        [("f:user0", Unjudged::Superseded)]
    );
    assert!(
        verdicts.unjudged[1].is_empty(),
        "not visible by its row: the answer"
    );

    check.groups.clear();
    let mut verdicts = Verdicts::new(2);
    let g = gather(&["user"]);
    let subs = settle_groups(&mut check, g, &rules, RlsMode::Batched, &mut verdicts);
    let outcome = TableOutcome {
        current_error: Some("ERROR: boom (XX000)".into()),
        groups: vec![Ok(GroupOutcome::default())],
    };
    apply(&check, outcome, subs, &mut verdicts);
    let failed = |i: usize| withheld(&verdicts.unjudged[i]);
    assert_eq!(failed(0), [("f:user0", Unjudged::Failed)]);
    assert_eq!(failed(1), [("f:user1", Unjudged::Failed)]);
}

#[test]
fn audience_groups_by_front_and_columns() {
    let ev = event(&["id", "owner"]);
    let allowed: Vec<Allowed> = vec![
        ("f2".into(), cols(&["id", "owner"]), "class-a".into()),
        ("f1".into(), cols(&["id"]), "f1:1".into()),
        ("f1".into(), cols(&["id"]), "f1:2".into()),
        ("f1".into(), cols(&["id", "owner"]), "f1:3".into()),
        // Seen again with other columns: the first decision stands.
        ("f1".into(), cols(&["owner"]), "f1:1".into()),
        // No column it may see: not in the audience.
        ("f1".into(), BTreeSet::new(), "f1:4".into()),
    ];
    let a = audience(&ev, allowed, &HashSet::new());
    assert_eq!(
        a,
        vec![
            FrontAudience {
                front: "f1".into(),
                groups: vec![
                    (Some(cols(&["id"])), vec!["f1:1".into(), "f1:2".into()]),
                    (None, vec!["f1:3".into()]),
                ],
                hidden_old: vec![],
            },
            FrontAudience {
                front: "f2".into(),
                groups: vec![(None, vec!["class-a".into()])],
                hidden_old: vec![],
            },
        ]
    );
}

#[test]
fn the_versions_judged_decide_delivery_or_only_the_old_record() {
    use walcast_bus::ChangeKind::*;
    assert_eq!(judged_versions(Insert, false), [(Which::New, true)]);
    assert_eq!(
        judged_versions(Update, true),
        [(Which::New, true), (Which::Old, false)]
    );
    assert_eq!(judged_versions(Update, false), [(Which::New, true)]);
    // A DELETE is judged on the row it removed, like an INSERT on the row it wrote.
    assert_eq!(judged_versions(Delete, true), [(Which::Old, true)]);
    assert_eq!(judged_versions(Delete, false), [(Which::Old, true)]);
    assert!(judged_versions(Truncate, false).is_empty());
}

#[test]
fn old_versions_are_judged_by_their_own_values_or_withheld() {
    let key = ("public".to_string(), "t".to_string(), "user".to_string());
    let rules: HashMap<_, _> = [(key, Rule::Where(owner_predicate()))]
        .into_iter()
        .collect();
    let complete = vec![("owner".to_string(), Some("a".to_string()))];
    let key_only = vec![("id".to_string(), Some("1".to_string()))];
    // Change 0: an UPDATE (new version delivers, old only shows its old_record); change
    // 1: a DELETE whose old row is the key alone (replica identity DEFAULT).
    let u = sub("f:u", "f", "user");
    let mut g = Gather::default();
    let mut check = table_check(vec![complete.clone(), complete, key_only]);
    let mut verdicts = Verdicts::new(2);
    verdicts.hidden_old[0].insert("f:u".into());
    for (change, which, delivers) in [
        (0, Which::New, true),
        (0, Which::Old, false),
        (1, Which::Old, true),
    ] {
        g.row_of(change, which);
        let mut w = waiting(change, which, u.clone());
        w.delivers = delivers;
        let key = ("user".to_string(), u.claims_json.clone());
        g.groups.entry(key).or_default().push(w);
    }
    let subs = settle_groups(&mut check, g, &rules, RlsMode::Batched, &mut verdicts);
    assert_eq!(check.groups[0].own, [0, 1], "old and new side by side");
    assert!(
        check.groups[0].by_row.is_empty(),
        "an old version is never judged by the row that replaced it"
    );
    // Both checked versions of change 0 visible: delivered, with its old_record.
    let ok = TableOutcome {
        current_error: None,
        groups: vec![Ok(GroupOutcome {
            visible: HashSet::from([0, 1]),
            superseded: HashSet::new(),
        })],
    };
    apply(&check, ok, subs, &mut verdicts);
    assert_eq!(ids(&verdicts.allowed[0]), ["f:u"]);
    assert!(verdicts.hidden_old[0].is_empty());
    assert!(verdicts.allowed[1].is_empty(), "not judged: no DELETE");
}

#[test]
fn an_old_version_not_visible_is_withheld_from_the_update() {
    let ev = event(&["id", "owner"]);
    let allowed: Vec<Allowed> = vec![
        ("f1".into(), cols(&["id", "owner"]), "f1:1".into()),
        ("f1".into(), cols(&["id", "owner"]), "f1:2".into()),
        ("f1".into(), cols(&["id"]), "f1:3".into()),
    ];
    let hidden = HashSet::from(["f1:2".to_string(), "f1:3".to_string()]);
    assert_eq!(
        audience(&ev, allowed, &hidden),
        vec![FrontAudience {
            front: "f1".into(),
            groups: vec![(None, vec!["f1:1".into()])],
            hidden_old: vec![
                (Some(cols(&["id"])), vec!["f1:3".into()]),
                (None, vec!["f1:2".into()]),
            ],
        }]
    );
}
