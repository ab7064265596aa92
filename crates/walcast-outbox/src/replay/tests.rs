use super::*;
use crate::event::HEADER_KEY;

fn at(s: &str) -> DateTime {
    async_nats::datetime::parse_rfc3339(s).expect("a time")
}

fn lsn(s: &str) -> Lsn {
    s.parse().expect("an LSN")
}

fn replay(prefix: &str, project: &str) -> Replay {
    Replay {
        stream: "WALCAST_OUTBOX".into(),
        project: project.into(),
        from: Position::Lsn(Lsn(0)),
        to: None,
        subject_prefix: prefix.into(),
        rate: 100,
        allow_same_stream: false,
    }
}

#[test]
fn positions_are_lsns_or_rfc3339_times() {
    assert_eq!(
        "16/B374D848".parse::<Position>().unwrap(),
        Position::Lsn(Lsn(0x16_B374_D848))
    );
    assert_eq!(
        "2026-12-01T10:00:00+01:00".parse::<Position>().unwrap(),
        Position::Time(at("2026-12-01T09:00:00Z"))
    );
    for bad in ["yesterday", "16/", "2026-12-01", "1/2/3", ""] {
        let e = bad.parse::<Position>().expect_err(bad);
        assert!(e.to_string().contains("RFC 3339"), "{e}");
    }
}

#[test]
fn steps_by_time() {
    let from = Position::Time(at("2026-12-01T10:00:00Z"));
    let to = Position::Time(at("2026-12-01T11:00:00Z"));
    let s = |t: &str| step(Some(Lsn(5)), at(t), &from, Some(&to));
    assert_eq!(s("2026-12-01T09:59:59.999Z"), Step::Skip);
    assert_eq!(s("2026-12-01T10:00:00Z"), Step::Send);
    assert_eq!(s("2026-12-01T11:00:00Z"), Step::Send);
    assert_eq!(s("2026-12-01T11:00:00.001Z"), Step::Stop);
    assert_eq!(
        step(None, at("2026-12-01T12:00:00Z"), &from, None),
        Step::Send
    );
}

#[test]
fn steps_by_lsn_skip_outside_the_range_and_never_stop() {
    let (from, to) = (Position::Lsn(lsn("0/100")), Position::Lsn(lsn("0/200")));
    let t = at("2026-12-01T10:00:00Z");
    let s = |l: Option<&str>| step(l.map(lsn), t, &from, Some(&to));
    assert_eq!(s(Some("0/FF")), Step::Skip);
    assert_eq!(s(Some("0/100")), Step::Send);
    assert_eq!(s(Some("0/200")), Step::Send);
    // A redriven event of the range may come after later ones: keep reading.
    assert_eq!(s(Some("0/201")), Step::Skip);
    assert_eq!(s(None), Step::Skip);
}

#[test]
fn overlapping_subjects() {
    assert!(subjects_overlap("walcast.outbox.>", "walcast.outbox.p.>"));
    assert!(subjects_overlap("walcast.>", "walcast.outbox.p.>"));
    assert!(subjects_overlap(">", "replay.p.>"));
    assert!(subjects_overlap("*.p.>", "replay.p.>"));
    assert!(subjects_overlap("replay.p.t", "replay.p.>"));
    assert!(subjects_overlap("replay.*.t", "replay.p.>"));
    assert!(!subjects_overlap("walcast.outbox.>", "replay.p.>"));
    assert!(!subjects_overlap("replay.p", "replay.p.>"));
    assert!(!subjects_overlap("replay.q.>", "replay.p.>"));
    assert!(!subjects_overlap("a.b", "a.b.c"));
    assert!(subjects_overlap("a.b", "a.b"));
}

#[test]
fn replay_subjects_come_from_the_topic() {
    let mut h = HeaderMap::new();
    h.insert(HEADER_TOPIC, "orders.paid");
    let s = |subject: &str, h: Option<&HeaderMap>| replay_subject("replay", "p", subject, h);
    assert_eq!(
        s("walcast.outbox.p.x", Some(&h)).as_deref(),
        Some("replay.p.orders.paid")
    );
    assert_eq!(
        s("walcast.outbox.p.orders.x", None).as_deref(),
        Some("replay.p.orders.x")
    );
    assert_eq!(s("walcast.outbox.q.orders", None), None);
    let mut wild = HeaderMap::new();
    wild.insert(HEADER_TOPIC, "orders.>");
    assert_eq!(s("walcast.outbox.p.orders", Some(&wild)), None);
}

#[test]
fn replayed_headers_drop_nats_ones_and_name_the_original() {
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", "e1");
    h.insert("nats-expected-stream", "X");
    h.insert(HEADER_EVENT_ID, "e1");
    h.insert(HEADER_KEY, "k");
    h.insert("trace", "t-1");
    let r = replay_headers(Some(&h));
    assert!(r.get("Nats-Msg-Id").is_none());
    assert!(r.get("nats-expected-stream").is_none());
    assert_eq!(r.get(HEADER_REPLAY_OF).map(|v| v.as_str()), Some("e1"));
    assert_eq!(r.get(HEADER_EVENT_ID).map(|v| v.as_str()), Some("e1"));
    assert_eq!(r.get(HEADER_KEY).map(|v| v.as_str()), Some("k"));
    assert_eq!(r.get("trace").map(|v| v.as_str()), Some("t-1"));
    assert!(replay_headers(None).is_empty());
}

#[test]
fn names_are_checked_and_a_captured_target_refused_unless_allowed() {
    assert!(replay("replay", "default").check().is_ok());
    assert!(matches!(
        replay("replay.>", "default").check(),
        Err(ReplayError::Prefix(_))
    ));
    assert!(matches!(
        replay("replay", "a.b").check(),
        Err(ReplayError::Project(_))
    ));
    let subjects = vec!["walcast.outbox.>".to_string()];
    let mut r = replay("walcast.outbox.replay", "p");
    let e = r.check_capture(&subjects).expect_err("captured");
    assert!(e.to_string().contains("walcast.outbox.replay.p.>"), "{e}");
    r.allow_same_stream = true;
    assert!(r.check_capture(&subjects).is_ok());
    assert!(replay("replay", "p").check_capture(&subjects).is_ok());
}

#[test]
fn progress_rate() {
    let p = Progress {
        sent: 100,
        elapsed: Duration::from_millis(500),
        ..Default::default()
    };
    assert_eq!(p.rate(), 200.0);
    assert_eq!(Progress::default().rate(), 0.0);
}
