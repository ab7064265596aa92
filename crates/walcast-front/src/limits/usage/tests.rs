//! Unit tests of the per-project usage and limits.
use super::*;

fn defaults(max_users: u64) -> ProjectLimits {
    crate::FrontConfig {
        project_max_users: max_users,
        ..Default::default()
    }
    .project_defaults()
}

fn usage(max: u64) -> Usage {
    Usage::new(
        "me".into(),
        defaults(max),
        Arc::new(|_| ProjectLimits::default()),
        Arc::new(Heard::default()),
    )
}

#[test]
fn users_are_limited_per_project_and_released() {
    let u = usage(2);
    let a = u.admit("p").expect("first");
    let _b = u.admit("p").expect("second");
    let e = u.admit("p").expect_err("third refused");
    assert_eq!((e.users, e.limit), (2, 2));
    assert!(u.admit("q").is_ok(), "another project is not affected");
    drop(a);
    assert!(u.admit("p").is_ok(), "a released slot is taken again");
    assert_eq!(u.snapshot()["p"].refused, 1);
}

#[test]
fn a_project_s_own_limit_replaces_the_default() {
    let own: Arc<RwLock<HashMap<String, u64>>> = Arc::default();
    let lookup = own.clone();
    let limits: Limits = Arc::new(move |p| ProjectLimits {
        max_concurrent_users: lookup.read().unwrap().get(p).map(|n| *n as u32),
        ..Default::default()
    });
    let u = Usage::new("me".into(), defaults(3), limits, Arc::new(Heard::default()));
    own.write().unwrap().insert("small".into(), 1);
    own.write().unwrap().insert("closed".into(), 0);
    assert_eq!((u.max_users("small"), u.max_users("other")), (1, 3));
    let first = u.admit("small").expect("the first of one");
    let e = u.admit("small").expect_err("the second refused");
    assert_eq!((e.users, e.limit), (1, 1));
    assert_eq!(u.admit("closed").expect_err("zero: nobody").limit, 0);
    let others: Vec<UserSlot> = (0..3).map(|_| u.admit("other").unwrap()).collect();
    assert!(
        u.admit("other").is_err(),
        "the default still holds elsewhere"
    );
    // Lowered below the users connected: they stay, new ones are refused.
    own.write().unwrap().insert("other".into(), 1);
    assert_eq!(u.snapshot()["other"].users, 3);
    assert!(u.admit("other").is_err());
    drop(others);
    assert!(u.admit("other").is_ok(), "room again once they left");
    // Raised, then back to the default.
    own.write().unwrap().insert("small".into(), 2);
    let _second = u.admit("small").expect("room under the raised limit");
    own.write().unwrap().remove("small");
    let _third = u.admit("small").expect("the default again: 3");
    drop(first);
}

#[test]
fn beacon_lists_only_projects_with_users() {
    let u = usage(10);
    let _a = u.admit("p").unwrap();
    drop(u.admit("q").unwrap());
    assert_eq!(u.users(), BTreeMap::from([("p".to_string(), 1)]));
}

#[test]
fn metrics_escape_project_ids() {
    let m = BTreeMap::from([("a\"b\\c".to_string(), ProjectUsage::default())]);
    let text = render(&m);
    assert!(
        text.contains("walcast_project_users{project=\"a\\\"b\\\\c\"} 0"),
        "{text}"
    );
}

fn rates_defaults(events: u32, joins: u32) -> ProjectLimits {
    let mut cfg = crate::FrontConfig::default();
    cfg.project_rates.events_per_second = events;
    cfg.project_rates.joins_per_second = joins;
    cfg.project_rates.bytes_per_second = 1000;
    cfg.project_rates.max_payload_kb = 1;
    cfg.project_defaults()
}

#[test]
fn rates_are_limited_per_project_and_counted_only_when_admitted() {
    let u = Usage::new(
        "me".into(),
        rates_defaults(3, 2),
        Arc::new(|_| ProjectLimits::default()),
        Arc::new(Heard::default()),
    );
    assert!(u.take("p", &[(Rate::Joins, 1)]).is_ok());
    assert!(u.take("p", &[(Rate::Joins, 1)]).is_ok());
    let over = u.take("p", &[(Rate::Joins, 1)]).expect_err("third join");
    assert_eq!((over.rate, over.seen, over.limit), (Rate::Joins, 2, 2));
    assert!(u.take("q", &[(Rate::Joins, 1)]).is_ok(), "q has its own");
    // Sent messages count against the project's messages (a broadcast to 3 members).
    u.count("p", &[(Rate::Events, 3), (Rate::Bytes, 30)]);
    match u.admit_message("p", 10) {
        Err(MessageRefused::OverRate(o)) => assert_eq!(o.rate, Rate::Events),
        other => panic!("{other:?}"),
    }
    assert!(u.admit_message("q", 10).is_ok());
    // Bytes: 1000 per second; a refused message counts nothing.
    assert!(u.admit_message("r", 600).is_ok());
    assert!(matches!(
        u.admit_message("r", 600),
        Err(MessageRefused::OverRate(OverRate {
            rate: Rate::Bytes,
            ..
        }))
    ));
    assert!(u.admit_message("r", 300).is_ok(), "room for 300 more bytes");
    // The payload limit: 1 KiB.
    assert_eq!(
        u.admit_message("s", 1025),
        Err(MessageRefused::TooLarge {
            size: 1025,
            max: 1024
        })
    );
    let snap = u.snapshot();
    assert_eq!(snap["p"].rates.joins, 2);
    // `take` leaves the counting of a refusal to its caller; `admit_message` counts it.
    assert_eq!(snap["p"].refused, 1);
    assert_eq!(u.rates()["r"].bytes, 900);
}

#[test]
fn the_other_fronts_rates_count() {
    let heard = Arc::new(Heard::default());
    let u = Usage::new(
        "me".into(),
        rates_defaults(100, 10),
        Arc::new(|_| ProjectLimits::default()),
        heard.clone(),
    );
    let other = walcast_bus::beacon::Beacon {
        process: "front-b".into(),
        at_ms: 1,
        bus_connected: true,
        worker: None,
        front: Some(walcast_bus::beacon::FrontBeacon {
            project_rates: BTreeMap::from([(
                "p".to_string(),
                ProjectRates {
                    joins: 9,
                    ..Default::default()
                },
            )]),
            ..Default::default()
        }),
        sources: Vec::new(),
    };
    heard.lock().observe(other, Instant::now());
    assert!(u.take("p", &[(Rate::Joins, 1)]).is_ok(), "9 there + 1 here");
    assert!(u.take("p", &[(Rate::Joins, 1)]).is_err(), "the 11th");
    assert!(u.take("q", &[(Rate::Joins, 5)]).is_ok());
}

#[test]
fn a_project_s_own_rate_limits_replace_the_defaults() {
    let limits: Limits = Arc::new(|p| ProjectLimits {
        max_joins_per_second: (p == "small").then_some(1),
        max_channels_per_client: (p == "small").then_some(2),
        max_payload_size_in_kb: (p == "small").then_some(0),
        ..Default::default()
    });
    let u = Usage::new(
        "me".into(),
        rates_defaults(100, 10),
        limits,
        Arc::new(Heard::default()),
    );
    let q = u.quotas("small");
    assert_eq!(
        (q.joins_per_second, q.channels_per_client, q.payload_bytes),
        (1, 2, 0)
    );
    assert_eq!(u.quotas("other").joins_per_second, 10);
    assert!(u.take("small", &[(Rate::Joins, 1)]).is_ok());
    assert!(u.take("small", &[(Rate::Joins, 1)]).is_err());
    assert!(matches!(
        u.admit_message("small", 1),
        Err(MessageRefused::TooLarge { .. })
    ));
}
