//! Tests of the front's registry: ready classes, pending joins, class fields.

use super::*;
use crate::connection::{ChanOut, ConnHandle};
use std::sync::Arc;

fn todos_insert(id: &str) -> SubscriptionSpec {
    SubscriptionSpec {
        id: id.into(),
        front: "f".into(),
        project: "default".into(),
        schema: "public".into(),
        table: Some("todos".into()),
        event: "INSERT".into(),
        filter: None,
        select: None,
        claims: serde_json::json!({"role": "anon"}).into(),
        from: None,
    }
}

fn claim(r: &Registry) -> Option<Lsn> {
    r.claim_ready(&todos_insert("x"), "default")
        .map(|(at, _)| at)
}

/// A registry with subscriptions 1..=n of one class (`f:1` …).
fn registry_of(n: u64) -> (Registry, String) {
    let r = Registry::new("f");
    let (conn, _rx) = ConnHandle::new(1, 8);
    let out = Arc::new(ChanOut::new(
        1,
        conn,
        "t",
        walcast_protocol::Vsn::V2,
        false,
        false,
        8,
    ));
    for _ in 0..n {
        let (k, id) = r.alloc();
        let spec = todos_insert(&id);
        r.insert(
            k,
            Target {
                sink: out.clone(),
                binding: 1,
                spec,
                source: "default".into(),
            },
        )
        .unwrap();
    }
    (r, walcast_bus::subs::class_key(&todos_insert("x")))
}

#[test]
fn a_class_is_ready_only_while_the_worker_has_one_of_its_subscriptions_by_class() {
    let (r, class) = registry_of(3);
    assert_eq!(claim(&r), None, "nothing confirmed yet");
    r.confirm("f:1", false, Lsn(10));
    assert_eq!(claim(&r), None, "row-checked: never ready");
    r.confirm("f:1", true, Lsn(10));
    r.saw("default", Lsn(7));
    assert_eq!(claim(&r), Some(Lsn(10)), "from the class's own position");
    r.saw("default", Lsn(20));
    assert_eq!(claim(&r), Some(Lsn(20)), "from the newest change seen");
    r.end_pending(&[class.clone(), class.clone()]);
    // The only registered member leaves: the class is no longer ready.
    let removed = r.remove(&[1]);
    assert_eq!(removed.ids, vec!["f:1".to_string()]);
    assert!(!removed.wait);
    assert_eq!(claim(&r), None);
}

#[test]
fn removing_waits_while_a_claimed_join_is_on_its_way() {
    let (r, class) = registry_of(2);
    r.confirm("f:1", true, Lsn(5));
    assert!(claim(&r).is_some());
    assert!(
        r.remove(&[1]).wait,
        "f:2 is not registered yet: f:1's unregister must wait"
    );
    r.end_pending(std::slice::from_ref(&class));
    assert!(!r.any_pending(std::slice::from_ref(&class)));
    assert!(!r.remove(&[2]).wait);
}

#[tokio::test]
async fn settle_returns_when_the_registration_arrived() {
    let (r, class) = registry_of(1);
    r.confirm("f:1", true, Lsn(5));
    assert!(claim(&r).is_some());
    let r = Arc::new(r);
    let r2 = r.clone();
    let c2 = class.clone();
    let ender = tokio::spawn(async move {
        tokio::task::yield_now().await;
        r2.end_pending(&[c2]);
    });
    let started = std::time::Instant::now();
    r.settle(&[class], Duration::from_secs(10)).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    ender.await.unwrap();
}

#[test]
fn a_forced_key_never_merges_subscriptions_of_other_fields() {
    // Every class gets the same key: only the fields can tell them apart.
    let r = Registry::with_keys("f", |_| format!("c{}", "0".repeat(32)));
    let (conn, _rx) = ConnHandle::new(1, 8);
    let out = Arc::new(ChanOut::new(
        1,
        conn,
        "t",
        walcast_protocol::Vsn::V2,
        false,
        false,
        8,
    ));
    let target = |id: &str, role: &str| Target {
        sink: out.clone(),
        binding: 1,
        spec: SubscriptionSpec {
            claims: serde_json::json!({ "role": role }).into(),
            from: Some(Lsn(1)),
            ..todos_insert(id)
        },
        source: "default".into(),
    };
    r.insert(1, target("f:1", "service_role")).unwrap();
    r.confirm("f:1", true, Lsn(1));
    let anon = target("f:2", "anon");
    assert!(
        r.claim_ready(&anon.spec, "default").is_none(),
        "another class's readiness"
    );
    assert_eq!(r.insert(2, anon), Err(COLLISION));
    let select = Target {
        spec: SubscriptionSpec {
            select: Some(vec!["id".into()]),
            ..target("f:3", "service_role").spec
        },
        ..target("f:3", "service_role")
    };
    assert_eq!(r.insert(3, select), Err(COLLISION));
    assert_eq!(r.len(), 1);
    let ev: walcast_bus::ChangeEvent = serde_json::from_value(serde_json::json!({
        "project": "default", "schema": "public", "table": "todos", "type": "INSERT",
        "commit_timestamp": "x", "commit_lsn": "0/10", "seq": 0, "columns": [],
        "subs": [format!("c{}", "0".repeat(32))]
    }))
    .unwrap();
    let groups = r.groups(&ev);
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].1.as_slice(), [1]);
    // A token refresh to another role cannot move a subscription into that class.
    r.insert(4, target("f:4", "service_role")).unwrap();
    let (specs, refused) = r.set_claims(&[4], &serde_json::json!({"role": "anon"}));
    assert!(specs.is_empty());
    assert_eq!(refused, ["f:4"]);
    assert_eq!(r.len(), 1);
    // The same fields join, and may claim the ready class.
    r.insert(5, target("f:5", "service_role")).unwrap();
    assert!(r
        .claim_ready(&target("f:5", "service_role").spec, "default")
        .is_some());
}

#[test]
fn a_subscription_covers_only_its_table_and_event() {
    let spec = todos_insert("f:1");
    let ev = |table: &str, kind: &str| -> walcast_bus::ChangeEvent {
        serde_json::from_value(serde_json::json!({
            "project": "default", "schema": "public", "table": table, "type": kind,
            "commit_timestamp": "x", "commit_lsn": "0/1", "seq": 0, "columns": []
        }))
        .unwrap()
    };
    let covers = |spec: &SubscriptionSpec, ev: &walcast_bus::ChangeEvent| {
        may_carry(&ClassView::of(spec), ev)
    };
    assert!(covers(&spec, &ev("todos", "INSERT")));
    assert!(!covers(&spec, &ev("todos", "DELETE")));
    assert!(!covers(&spec, &ev("secrets", "INSERT")));
    let other = SubscriptionSpec {
        project: "other".into(),
        ..spec.clone()
    };
    assert!(!covers(&other, &ev("todos", "INSERT")), "another project's");
    let fields = ClassFields::of(&spec);
    assert!(may_carry(
        &ClassView::of_fields(&fields),
        &ev("todos", "INSERT")
    ));
    assert!(!may_carry(
        &ClassView::of_fields(&fields),
        &ev("todos", "UPDATE")
    ));
    let all = SubscriptionSpec {
        schema: "*".into(),
        table: None,
        event: "*".into(),
        ..spec
    };
    assert!(covers(&all, &ev("secrets", "DELETE")));
}

#[test]
fn positions_seen_are_per_source() {
    let (r, _) = registry_of(1);
    r.confirm("f:1", true, Lsn(10));
    // Source s2's positions are far ahead: they say nothing of the default source's.
    r.saw("s2", Lsn(1_000_000));
    assert_eq!(claim(&r), Some(Lsn(10)));
    r.saw("default", Lsn(12));
    assert_eq!(claim(&r), Some(Lsn(12)));
}
