//! Tests of the matcher: matching, classes (fields, collisions, limits), sync.

use super::*;
use walcast_bus::subs::SubscriptionSpec;
use walcast_bus::ChangeKind;
use walcast_protocol::filter::CompiledFilter;
use walcast_protocol::filter::{Filter, SliceRecord};

fn ids(v: Vec<MatchedClass>) -> Vec<String> {
    v.iter()
        .flat_map(|m| m.subs().map(|s| s.spec.id.clone()))
        .collect()
}

fn spec(id: &str, table: Option<&str>, event: &str, filter: Option<&str>) -> SubscriptionSpec {
    SubscriptionSpec {
        id: id.into(),
        front: "f".into(),
        project: "default".into(),
        schema: "public".into(),
        table: table.map(String::from),
        event: event.into(),
        filter: filter.map(String::from),
        select: None,
        claims: serde_json::json!({"role": "anon"}).into(),
        from: None,
    }
}

fn add(m: &Matcher, id: &str, table: Option<&str>, event: &str, filter: Option<&str>, from: u64) {
    let f = filter.map(|f| CompiledFilter::new(Filter::parse(f).unwrap()).unwrap());
    m.insert(Sub::new(spec(id, table, event, filter), f, Lsn(from)));
}

#[test]
fn event_table_filter_and_position() {
    let m = Matcher::default();
    add(&m, "a", Some("t"), "*", None, 0);
    add(&m, "b", Some("t"), "INSERT", Some("id=eq.1"), 0);
    add(&m, "c", None, "delete", None, 0);
    add(&m, "d", Some("t"), "*", None, 100);
    add(&m, "e", Some("other"), "*", None, 0);
    let one = [("id", "int4", Some("1"))];
    let two = [("id", "int4", Some("2"))];
    let ins1 = ids(m.matches(
        "default",
        "public",
        "t",
        ChangeKind::Insert,
        Lsn(50),
        &SliceRecord(&one),
    ));
    assert_eq!(ins1, ["a", "b"]);
    let ins2 = ids(m.matches(
        "default",
        "public",
        "t",
        ChangeKind::Insert,
        Lsn(150),
        &SliceRecord(&two),
    ));
    assert_eq!(ins2, ["a", "d"]);
    let del = ids(m.matches(
        "default",
        "public",
        "t",
        ChangeKind::Delete,
        Lsn(150),
        &SliceRecord(&one),
    ));
    assert_eq!(del, ["a", "d", "c"]);
    assert!(m
        .matches(
            "p2",
            "public",
            "t",
            ChangeKind::Insert,
            Lsn(150),
            &SliceRecord(&one)
        )
        .is_empty());
}

#[test]
fn a_filter_error_denies_only_that_subscription() {
    let m = Matcher::default();
    add(&m, "ok", Some("t"), "*", None, 0);
    add(&m, "bad", Some("t"), "*", Some("id=eq.1"), 0);
    let rec = [("id", "int4", Some("not a number"))];
    let got = ids(m.matches(
        "default",
        "public",
        "t",
        ChangeKind::Insert,
        Lsn(1),
        &SliceRecord(&rec),
    ));
    assert_eq!(got, ["ok"]);
}

#[test]
fn a_forced_key_never_merges_classes_with_other_fields() {
    let m = Matcher::default();
    let service = SubscriptionSpec {
        claims: serde_json::json!({"role": "service_role"}).into(),
        ..spec("svc", Some("t"), "*", None)
    };
    assert!(m.insert(Sub::new(service, None, Lsn(0))));
    // An anon subscription whose key was made to equal the service_role class's.
    let forged = |id: &str, select: Option<Vec<String>>| {
        let mut sub = Sub::new(
            SubscriptionSpec {
                select,
                ..spec(id, Some("t"), "*", None)
            },
            None,
            Lsn(0),
        );
        sub.class = m.read().by_id["svc"].class.clone();
        sub
    };
    assert!(!m.insert(forged("anon", None)), "another role: refused");
    let refused = m.insert_all(vec![
        forged("anon2", Some(vec!["x".into()])),
        forged("anon3", None),
    ]);
    let refused: Vec<&str> = refused.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(refused, ["anon2", "anon3"]);
    assert_eq!(m.len(), 1);
    let rec = [("id", "int4", Some("1"))];
    let got = ids(m.matches(
        "default",
        "public",
        "t",
        ChangeKind::Insert,
        Lsn(1),
        &SliceRecord(&rec),
    ));
    assert_eq!(got, ["svc"]);
    // The same fields do join the class.
    let twin = SubscriptionSpec {
        claims: serde_json::json!({"role": "service_role", "sub": "other"}).into(),
        ..spec("svc2", Some("t"), "*", None)
    };
    assert!(m.insert(Sub::new(twin, None, Lsn(0))));
    assert_eq!(m.read().classes.len(), 1);
}

#[test]
fn sync_and_expiry_drop_subscriptions() {
    let m = Matcher::default();
    add(&m, "f:1", Some("t"), "*", None, 0);
    add(&m, "f:2", Some("t"), "*", None, 0);
    // Registered just now: a list that lacks it may predate it.
    m.sync("f", &["f:2".to_string()], SYNC_GRACE);
    assert_eq!(m.len(), 2);
    m.sync("f", &["f:2".to_string()], Duration::ZERO);
    assert_eq!(m.len(), 1);
    assert_eq!(m.expire_fronts(Duration::from_secs(60)), 0);
    assert_eq!(m.expire_fronts(Duration::ZERO), 1);
    assert!(m.is_empty());
    m.remove(&["nope".into()]);
}

#[test]
fn classes_are_capped_per_project_and_per_front() {
    let m = Matcher::with_limits(ClassLimits {
        per_project: 3,
        per_front: 4,
        ..ClassLimits::default()
    });
    let sub = |id: &str, front: &str, project: &str, n: u32| {
        let filter = format!("id=eq.{n}");
        let spec = SubscriptionSpec {
            front: front.into(),
            project: project.into(),
            ..spec(id, Some("t"), "*", Some(&filter))
        };
        let f = CompiledFilter::new(Filter::parse(&filter).unwrap()).unwrap();
        Sub::new(spec, Some(f), Lsn(0))
    };
    // One edit of five classes of one project: the first three fit.
    let refused = m.insert_all(
        (0..5)
            .map(|n| sub(&format!("a:{n}"), "a", "p1", n))
            .collect(),
    );
    let ids: Vec<&str> = refused.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["a:3", "a:4"]);
    assert!(
        refused[0]
            .1
            .contains("project \"p1\" has 3 distinct subscriptions"),
        "{refused:?}"
    );
    // Joining an existing class is always possible, from any front.
    assert!(m.insert(sub("a:9", "a", "p1", 0)));
    assert!(m.insert(sub("b:1", "b", "p1", 1)));
    // Another project has its own room, but front `a` has room for one class only.
    assert!(m.insert(sub("a:10", "a", "p2", 7)));
    assert!(!m.insert(sub("a:11", "a", "p2", 8)), "front a is full");
    assert!(m.insert(sub("b:2", "b", "p2", 8)), "front b is not");
    // A class that goes away makes room again.
    m.remove(&["a:0".into(), "a:9".into()]);
    assert!(m.insert(sub("a:12", "a", "p1", 5)));
    assert_eq!(m.read().classes.len(), 5);
}

#[test]
fn a_filter_is_compiled_once_and_a_hostile_pattern_stays_cheap() {
    let m = Matcher::default();
    add(
        &m,
        "p",
        Some("t"),
        "*",
        Some(&format!("v=like.{}b", "%a".repeat(200))),
        0,
    );
    let long = "a".repeat(256 * 1024);
    let rec = [("v", "text", Some(long.as_str()))];
    let started = Instant::now();
    for _ in 0..10 {
        assert!(ids(m.matches(
            "default",
            "public",
            "t",
            ChangeKind::Insert,
            Lsn(1),
            &SliceRecord(&rec),
        ))
        .is_empty());
    }
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn the_memory_of_patterns_is_capped_per_project_and_returned_when_classes_go() {
    let one = CompiledFilter::new(Filter::parse("v=match.a.{100}c").unwrap())
        .unwrap()
        .heap_bytes();
    let m = Matcher::with_limits(ClassLimits {
        filter_bytes_per_project: one * 3 + one / 2,
        filter_bytes: one * 5,
        ..ClassLimits::default()
    });
    let sub = |id: &str, project: &str, n: u32| {
        let filter = format!("v=match.a.{{{}}}c", 100 + n);
        let spec = SubscriptionSpec {
            project: project.into(),
            ..spec(id, Some("t"), "*", Some(&filter))
        };
        let f = CompiledFilter::new(Filter::parse(&filter).unwrap()).unwrap();
        Sub::new(spec, Some(f), Lsn(0))
    };
    // Three patterns of about that size fit the project; a fourth is refused, saying why.
    let refused = m.insert_all((0..2).map(|n| sub(&format!("a{n}"), "a", n)).collect());
    assert!(refused.is_empty(), "{refused:?}");
    let r = m.insert_all(vec![sub("a9", "a", 9), sub("a8", "a", 8)]);
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(r[0].1.contains("would hold more than"), "{}", r[0].1);
    // Joining a class whose patterns are counted already costs nothing.
    assert!(m.insert(sub("a3", "a", 0)));
    let (own, all) = m.filter_bytes("a");
    assert!(own >= 3 * one && all == own, "{own} {all}");
    // Another project has its own budget, under the worker's.
    assert!(m.insert(sub("b0", "b", 0)));
    assert!(!m.insert(sub("b1", "b", 1)), "the worker's budget is full");
    // Classes gone, their memory with them.
    m.remove(&[
        "a0".into(),
        "a1".into(),
        "a3".into(),
        "a9".into(),
        "a8".into(),
    ]);
    assert_eq!(m.filter_bytes("a").0, 0);
    assert!(m.insert(sub("b1", "b", 1)));
}
