//! The subscription registry between fronts and the cdc-worker, over real NATS: what a
//! front registers is validated, matched while decoding, and effective at once.

use std::time::Duration;

use crate::support::{rec, Collector, Stack};
use walcast_bus::subs::{
    RegisterRequest, SubsClient, SubscriptionSpec, SyncMessage, UnregisterRequest,
};
use walcast_bus::Bus;

both_sources!(registered_subscriptions_are_matched_from_the_reply_on);

fn spec(id: &str, table: &str, event: &str, filter: Option<&str>) -> SubscriptionSpec {
    SubscriptionSpec {
        id: id.into(),
        front: "front1".into(),
        project: "default".into(),
        schema: "public".into(),
        table: Some(table.into()),
        event: event.into(),
        filter: filter.map(String::from),
        select: None,
        claims: serde_json::json!({"role": "anon"}).into(),
        from: None,
    }
}

async fn registered_subscriptions_are_matched_from_the_reply_on(source: &'static str) {
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE t (id int PRIMARY KEY, owner text, n int); CREATE TABLE off (id int PRIMARY KEY)");
    stack.sql("CREATE TABLE p (id int PRIMARY KEY); ALTER TABLE p ENABLE ROW LEVEL SECURITY");
    stack.enable("t");
    stack.enable("p");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let bus = Bus::nats(&stack.nats.url(), "test-front").await.unwrap();
    let subs = SubsClient::new(&bus, None).unwrap();
    let reply = subs
        .register(
            walcast_bus::source::DEFAULT_SOURCE,
            RegisterRequest {
                subs: vec![
                    spec("front1:1", "t", "*", None),
                    spec("front1:2", "t", "INSERT", Some("owner=eq.ann")),
                    spec("front1:3", "t", "UPDATE", Some("n=gt.10")),
                    spec("front1:4", "off", "*", None),
                    spec("front1:5", "t", "*", Some("nope=eq.1")),
                    spec("front1:6", "t", "*", Some("n=eq.notanumber")),
                    spec("front1:7", "t", "*", Some("owner=zz.1")),
                ],
            },
            Duration::from_secs(10),
        )
        .await
        .expect("worker answers");
    let oks: Vec<bool> = reply.results.iter().map(|r| r.ok).collect();
    assert_eq!(
        oks,
        [true, true, true, false, false, false, false],
        "{:?}",
        reply.results
    );
    assert!(reply.results[3]
        .error
        .as_deref()
        .unwrap()
        .starts_with("Unable to subscribe to changes"));
    assert!(
        reply.results[4].error.as_deref().unwrap().contains("nope"),
        "{:?}",
        reply.results[4]
    );
    assert!(reply.results[5]
        .error
        .as_deref()
        .unwrap()
        .starts_with("Error parsing `filter` params"));
    assert!(reply.results[6]
        .error
        .as_deref()
        .unwrap()
        .starts_with("Error parsing `filter` params"));
    assert!(reply.effective_from.is_some());
    // Which are delivered by class (so a front may join more of their class at once):
    // those of a table without RLS; on a table with it, even DELETEs only are judged per
    // subscriber (on the row deleted).
    assert!(reply.results[..3].iter().all(|r| r.by_class));
    let rls = subs
        .register(
            walcast_bus::source::DEFAULT_SOURCE,
            RegisterRequest {
                subs: vec![
                    spec("front1:8", "p", "*", None),
                    spec("front1:9", "p", "DELETE", None),
                ],
            },
            Duration::from_secs(10),
        )
        .await
        .expect("worker answers");
    let by_class: Vec<(bool, bool)> = rls.results.iter().map(|r| (r.ok, r.by_class)).collect();
    assert_eq!(
        by_class,
        [(true, false), (true, false)],
        "{:?}",
        rls.results
    );
    // A table that does not exist: a new join gets Supabase's generic refusal; one already
    // in effect at its front (registered again: `from` set) was ended by a DROP and is
    // told so, whether or not the worker's notice of the drop came first.
    let mut in_effect = spec("front1:11", "gone", "*", None);
    in_effect.from = Some(walcast_core::Lsn(1));
    let gone = subs
        .register(
            walcast_bus::source::DEFAULT_SOURCE,
            RegisterRequest {
                subs: vec![spec("front1:10", "gone", "*", None), in_effect],
            },
            Duration::from_secs(10),
        )
        .await
        .expect("worker answers");
    let errors: Vec<&str> = gone
        .results
        .iter()
        .map(|r| r.error.as_deref().unwrap_or(""))
        .collect();
    assert!(errors[0].starts_with("Unable to subscribe to changes with given parameters"));
    assert_eq!(
        errors[1],
        "Table public.gone was dropped: this subscription has ended"
    );

    // Right after the reply: every change committed now must be matched.
    stack.sql("INSERT INTO t VALUES (1, 'ann', 5)");
    stack.sql("INSERT INTO t VALUES (2, 'bob', 50)");
    stack.sql("UPDATE t SET n = 20 WHERE id = 1");
    stack.sql("UPDATE t SET n = 1 WHERE id = 2");
    stack.sql("DELETE FROM t WHERE id = 2");
    collector.wait_count(5, Duration::from_secs(60)).await;
    let got: Vec<(i64, Vec<String>)> = collector
        .snapshot()
        .iter()
        .map(|e| {
            let id = if e.record.is_some() {
                rec(e)["id"].as_i64().unwrap()
            } else {
                -1
            };
            (id, e.subs.clone())
        })
        .collect();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        got,
        [
            (1, s(&["front1:1", "front1:2"])),
            (2, s(&["front1:1"])),
            (1, s(&["front1:1", "front1:3"])),
            (2, s(&["front1:1"])),
            (-1, s(&["front1:1"])),
        ]
    );

    // Unregister one; a sync without the other drops it too (once it is older than the
    // grace that protects registrations racing with a list taken before them).
    tokio::time::sleep(walcast_realtime::subscriptions::matcher::SYNC_GRACE).await;
    subs.unregister(
        walcast_bus::source::DEFAULT_SOURCE,
        UnregisterRequest {
            ids: vec!["front1:2".into()],
        },
    )
    .await
    .unwrap();
    subs.sync(
        walcast_bus::source::DEFAULT_SOURCE,
        SyncMessage::whole("front1".into(), vec!["front1:1".into()]),
    )
    .await
    .unwrap();
    let last = insert_after_edits(&stack, &bus, &subs, &collector, "(3, 'ann', 99)", 6).await;
    assert_eq!(last, ["front1:1"]);

    // A list longer than one NATS message (100,000 ids, ~1.7 MB) goes in parts, and the
    // worker applies it whole: the listed subscription stays.
    let mut many: Vec<String> = (0..100_000).map(|i| format!("front1:x{i}")).collect();
    many.push("front1:1".into());
    subs.sync(
        walcast_bus::source::DEFAULT_SOURCE,
        SyncMessage::whole("front1".into(), many),
    )
    .await
    .unwrap();
    let last = insert_after_edits(&stack, &bus, &subs, &collector, "(4, 'ann', 100)", 7).await;
    assert_eq!(last, ["front1:1"]);
}

/// Once the worker applied the registry messages sent so far (it handles them in order:
/// a round trip through it proves it), insert `row` and return the audience of the
/// `n`th event.
async fn insert_after_edits(
    stack: &Stack,
    bus: &Bus,
    subs: &SubsClient,
    collector: &Collector,
    row: &str,
    n: usize,
) -> Vec<String> {
    bus.barrier().await.unwrap();
    subs.register(
        walcast_bus::source::DEFAULT_SOURCE,
        RegisterRequest::default(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    stack.sql(&format!("INSERT INTO t VALUES {row}"));
    collector.wait_count(n, Duration::from_secs(60)).await;
    collector.snapshot().pop().unwrap().subs
}
