use super::*;

fn s(term: u64) -> StreamId {
    StreamId {
        source: "default".into(),
        term,
        origin: "o".into(),
    }
}

fn seq() -> Sequencer<u64> {
    Sequencer::new(Duration::from_secs(5), 100)
}

/// The numbers delivered, and each loss as `(from, to, missing)`, in order.
fn outs(step: &Step<u64>) -> Vec<(u64, u64, u64)> {
    step.out
        .iter()
        .map(|o| match o {
            InOrder::Deliver(n) => (*n, *n, 0),
            InOrder::Lost(l) => (l.from, l.to, l.missing),
        })
        .collect()
}

fn delivered(step: &Step<u64>) -> Vec<u64> {
    step.out
        .iter()
        .filter_map(|o| match o {
            InOrder::Deliver(n) => Some(*n),
            InOrder::Lost(_) => None,
        })
        .collect()
}

#[test]
fn in_order_messages_pass_through_and_the_first_stream_starts_anywhere() {
    let (mut q, t) = (seq(), Instant::now());
    assert_eq!(delivered(&q.message(s(1), 41, 41, t)), [41]);
    assert_eq!(delivered(&q.message(s(1), 42, 42, t)), [42]);
    let hb = q.heartbeat(s(1), 42, t);
    assert!(hb.out.is_empty() && hb.ask.is_none());
    assert!(!q.waiting());
}

#[test]
fn a_gap_holds_later_messages_asks_and_fills_in_order() {
    let (mut q, t) = (seq(), Instant::now());
    q.message(s(1), 1, 1, t);
    let step = q.message(s(1), 4, 4, t);
    assert!(step.out.is_empty(), "held");
    assert_eq!(step.ask, Some((s(1), 2, 4)));
    assert!(q.waiting());
    assert!(q.message(s(1), 5, 5, t).ask.is_none(), "asked once");
    assert!(q.message(s(1), 3, 3, t).out.is_empty(), "2 still missing");
    assert_eq!(delivered(&q.message(s(1), 2, 2, t)), [2, 3, 4, 5]);
    assert!(!q.waiting());
    assert_eq!(
        q.message(s(1), 3, 3, t).duplicates,
        1,
        "a resend of a delivered one"
    );
}

#[test]
fn a_heartbeat_shows_a_gap_nothing_else_would() {
    let (mut q, t) = (seq(), Instant::now());
    q.message(s(1), 1, 1, t);
    let step = q.heartbeat(s(1), 3, t);
    assert_eq!(step.ask, Some((s(1), 2, 3)));
    q.message(s(1), 2, 2, t);
    assert_eq!(delivered(&q.message(s(1), 3, 3, t)), [3]);
    assert!(!q.waiting());
}

#[test]
fn what_the_leader_no_longer_has_is_reported_then_the_rest_delivered() {
    let (mut q, t) = (seq(), Instant::now());
    q.message(s(1), 1, 1, t);
    q.message(s(1), 6, 6, t);
    // It can resend 4..=5, not 2..=3.
    let step = q.answered(&s(1), Some((2, 3, "gone".into())), t);
    assert_eq!(outs(&step), [(2, 3, 2)]);
    q.message(s(1), 4, 4, t);
    assert_eq!(delivered(&q.message(s(1), 5, 5, t)), [5, 6]);
    assert!(!q.waiting());
}

#[test]
fn past_the_window_the_gap_is_given_up() {
    let (mut q, t) = (seq(), Instant::now());
    q.message(s(1), 1, 1, t);
    q.message(s(1), 3, 3, t);
    q.message(s(1), 5, 5, t);
    let again = q.tick(t + Duration::from_millis(1500));
    assert_eq!(again.ask, Some((s(1), 2, 5)), "unanswered: asked again");
    assert!(q.tick(t + Duration::from_secs(4)).out.is_empty());
    let step = q.tick(t + Duration::from_secs(5));
    assert_eq!(outs(&step), [(2, 5, 2), (3, 3, 0), (5, 5, 0)]);
    assert!(!q.waiting());
    assert_eq!(delivered(&q.message(s(1), 6, 6, t)), [6]);
}

#[test]
fn too_many_held_gives_up_at_once() {
    let (mut q, t) = (Sequencer::new(Duration::from_secs(5), 2), Instant::now());
    q.message(s(1), 1, 1, t);
    q.message(s(1), 3, 3, t);
    q.message(s(1), 4, 4, t);
    let step = q.message(s(1), 5, 5, t);
    assert_eq!(outs(&step), [(2, 5, 1), (3, 3, 0), (4, 4, 0), (5, 5, 0)]);
}

#[test]
fn a_new_term_starts_at_one_and_the_old_terms_gap_is_lost() {
    let (mut q, t) = (seq(), Instant::now());
    q.message(s(1), 1, 1, t);
    q.message(s(1), 3, 3, t);
    let step = q.message(s(2), 2, 20, t);
    assert_eq!(outs(&step), [(2, 3, 1), (3, 3, 0)]);
    assert_eq!(step.ask, Some((s(2), 1, 2)), "the new term's 1 is missing");
    assert_eq!(delivered(&q.message(s(2), 1, 10, t)), [10, 20]);
    // An answer for the old stream changes nothing.
    assert!(q
        .answered(&s(1), Some((1, 9, "x".into())), t)
        .out
        .is_empty());
}

#[test]
fn a_later_cut_while_waiting_extends_the_request() {
    let (mut q, t) = (seq(), Instant::now());
    q.message(s(1), 1, 1, t);
    assert_eq!(q.message(s(1), 3, 3, t).ask, Some((s(1), 2, 3)));
    assert_eq!(q.heartbeat(s(1), 6, t).ask, Some((s(1), 4, 6)));
    for n in [2, 4, 5] {
        q.message(s(1), n, n, t);
    }
    assert_eq!(delivered(&q.message(s(1), 6, 6, t)), [6]);
    assert!(!q.waiting());
}

fn on(source: &str, term: u64) -> StreamId {
    StreamId {
        source: source.into(),
        term,
        origin: "o".into(),
    }
}

#[test]
fn two_sources_streams_interleave_without_holding_each_other() {
    let (mut q, t) = (Sequencers::new(Duration::from_secs(5), 100), Instant::now());
    assert_eq!(delivered(&q.message(on("a", 9), 1, 1, t)), [1]);
    // Another source's stream, with its own (lower) term and its own numbers.
    assert_eq!(delivered(&q.message(on("b", 1), 1, 101, t)), [101]);
    assert_eq!(delivered(&q.message(on("a", 9), 2, 2, t)), [2]);
    // A gap in a: 3 is missing, 4 is held, and a's leader is asked.
    let step = q.message(on("a", 9), 4, 4, t);
    assert!(step.out.is_empty());
    assert_eq!(step.ask, Some((on("a", 9), 3, 4)));
    assert!(q.waiting());
    // b goes on meanwhile, never asked about.
    let step = q.message(on("b", 1), 2, 102, t);
    assert_eq!(delivered(&step), [102]);
    assert!(step.ask.is_none());
    assert_eq!(delivered(&q.heartbeat(on("b", 1), 2, t)), Vec::<u64>::new());
    // a's answer reaches only a.
    assert!(q.answered(&on("b", 1), None, t).out.is_empty());
    assert_eq!(delivered(&q.message(on("a", 9), 3, 3, t)), [3, 4]);
    assert!(!q.waiting());
}

#[test]
fn a_loss_names_its_source_and_a_tick_concerns_only_the_waiting_one() {
    let t = Instant::now();
    let mut q = Sequencers::new(Duration::from_secs(5), 100);
    q.message(on("a", 1), 1, 1, t);
    q.message(on("b", 1), 1, 11, t);
    q.message(on("b", 1), 3, 13, t);
    let steps = q.tick(t + Duration::from_secs(6));
    assert_eq!(steps.len(), 1, "only b waits");
    let lost: Vec<&Loss> = steps[0]
        .out
        .iter()
        .filter_map(|o| match o {
            InOrder::Lost(l) => Some(l),
            InOrder::Deliver(_) => None,
        })
        .collect();
    assert_eq!(lost.len(), 1);
    assert_eq!(
        (lost[0].source.as_str(), lost[0].from, lost[0].missing),
        ("b", 2, 1)
    );
    assert_eq!(delivered(&steps[0]), [13]);
    assert_eq!(
        delivered(&q.message(on("a", 1), 2, 2, t)),
        [2],
        "a never waited"
    );
}
