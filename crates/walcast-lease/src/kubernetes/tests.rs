use std::time::Duration;

use serde_json::{json, Value};

use super::*;

fn cfg() -> KubeLeaseConfig {
    KubeLeaseConfig {
        api_url: None,
        kubeconfig: None,
        context: None,
        namespace: "ns".into(),
        name: "w".into(),
        identity: "pod-2".into(),
        duration: Duration::from_secs(15),
    }
}

#[test]
fn a_replace_keeps_what_walcast_does_not_touch() {
    let read = json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": "w", "namespace": "ns", "resourceVersion": "7", "uid": "u1",
            "labels": {"a": "b"}, "annotations": {"c": "d"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "x", "uid": "u0"}]
        },
        "spec": {
            "holderIdentity": "pod-1", "leaseDurationSeconds": 10, "leaseTransitions": 2,
            "renewTime": "2026-12-03T08:00:00.123456Z", "preferredHolder": "pod-3",
            "strategy": "OldestEmulationVersion"
        }
    });
    let lease: Lease = serde_json::from_value(read.clone()).unwrap();
    let (written, create) = claimed(Some(lease), &cfg());
    assert!(!create);
    let v = serde_json::to_value(&written).unwrap();
    assert_eq!(v["apiVersion"], read["apiVersion"]);
    assert_eq!(v["kind"], read["kind"]);
    // The compare-and-set carries the version read, and nothing of the object is lost.
    assert_eq!(v["metadata"], read["metadata"]);
    assert_eq!(v["spec"]["preferredHolder"], "pod-3");
    assert_eq!(v["spec"]["strategy"], "OldestEmulationVersion");
    assert_eq!(v["spec"]["holderIdentity"], "pod-2");
    assert_eq!(v["spec"]["leaseTransitions"], 3, "a new holder, a new term");
    assert_eq!(v["spec"]["leaseDurationSeconds"], 15);
}

#[test]
fn a_new_lease_is_created_as_ours_in_the_first_term() {
    let (lease, create) = claimed(None, &cfg());
    assert!(create);
    let v = serde_json::to_value(&lease).unwrap();
    assert_eq!(v["apiVersion"], "coordination.k8s.io/v1");
    assert_eq!(v["kind"], "Lease");
    assert_eq!(v["metadata"], json!({"name": "w", "namespace": "ns"}));
    assert_eq!(v["spec"]["holderIdentity"], "pod-2");
    assert_eq!(v["spec"]["leaseTransitions"], 0);
}

#[test]
fn a_released_lease_sends_no_holder() {
    let (lease, _) = claimed(None, &cfg());
    let v = serde_json::to_value(released(lease)).unwrap();
    assert_eq!(
        v["spec"],
        json!({"leaseDurationSeconds": 15, "leaseTransitions": 0})
    );
}

/// `MicroTime`: RFC 3339 in UTC with exactly six fractional digits.
#[test]
fn renewals_are_stamped_in_micro_time() {
    let text = match serde_json::to_value(micro_time_now()).unwrap() {
        Value::String(s) => s,
        other => panic!("not a string: {other}"),
    };
    let b = text.as_bytes();
    assert_eq!(b.len(), 27, "{text}");
    for (i, c) in b.iter().enumerate() {
        let want_digit = !matches!(i, 4 | 7 | 10 | 13 | 16 | 19 | 26);
        assert_eq!(c.is_ascii_digit(), want_digit, "{text} at {i}");
    }
    assert_eq!(
        (b[4], b[7], b[10], b[13], b[16], b[19], b[26]),
        (b'-', b'-', b'T', b':', b':', b'.', b'Z'),
        "{text}"
    );
}

#[test]
fn only_a_409_is_a_lost_race() {
    let status = |code: u16, reason: &str| {
        kube::Error::Api(
            kube::core::Status::failure("the object has been modified", reason)
                .with_code(code)
                .boxed(),
        )
    };
    assert!(is_conflict(&status(409, "Conflict")));
    assert!(is_conflict(&status(409, "AlreadyExists")));
    assert!(!is_conflict(&status(404, "NotFound")));
    assert!(!is_conflict(&status(500, "InternalError")));
}
