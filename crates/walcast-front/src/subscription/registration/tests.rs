//! Tests of the registration's routing by source.

use super::*;

fn spec(id: &str, project: &str) -> SubscriptionSpec {
    SubscriptionSpec {
        id: id.into(),
        front: "f".into(),
        project: project.into(),
        schema: "public".into(),
        table: Some("todos".into()),
        event: "*".into(),
        filter: None,
        select: None,
        claims: serde_json::json!({"role": "anon"}).into(),
        from: None,
    }
}

#[test]
fn a_batch_is_split_by_its_projects_sources() {
    let on = |s: &SubscriptionSpec| match s.project.as_str() {
        "default" | "p1" => Some("default".to_string()),
        "p2" | "p3" => Some("s2".to_string()),
        "p4" => Some("s4".to_string()),
        _ => None,
    };
    let specs = vec![
        spec("f:1", "p2"),
        spec("f:2", "default"),
        spec("f:3", "p3"),
        spec("f:4", "gone"),
        spec("f:5", "p4"),
        spec("f:6", "p1"),
    ];
    let (groups, refused) = group_by_source(specs, on);
    let ids =
        |source: &str| -> Vec<String> { groups[source].iter().map(|s| s.id.clone()).collect() };
    assert_eq!(groups.len(), 3);
    assert_eq!(ids("default"), ["f:2", "f:6"]);
    assert_eq!(ids("s2"), ["f:1", "f:3"]);
    assert_eq!(ids("s4"), ["f:5"]);
    assert_eq!(
        refused.len(),
        1,
        "an unknown project's subscription is refused"
    );
    assert!(refused["f:4"].contains("unknown project"));
}

#[test]
fn every_source_gets_its_own_sync_list_and_the_default_always_one() {
    let mut ids = HashMap::new();
    ids.insert("s2".to_string(), vec!["f:1".to_string(), "f:3".to_string()]);
    ids.insert("gone".to_string(), vec!["f:9".to_string()]);
    let lists = sync_lists(ids, ["s2".to_string(), "s3".to_string()]);
    let sources: Vec<&str> = lists.keys().map(String::as_str).collect();
    assert_eq!(sources, ["default", "gone", "s2", "s3"]);
    assert!(
        lists["default"].is_empty(),
        "the default still hears we are alive"
    );
    assert_eq!(lists["s2"], ["f:1", "f:3"]);
    assert!(
        lists["s3"].is_empty(),
        "an empty list drops what s3 holds for us"
    );
    assert_eq!(lists["gone"], ["f:9"]);
}
