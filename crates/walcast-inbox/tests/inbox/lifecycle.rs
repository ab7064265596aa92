//! The inbox table, binding, stopping, and losing the database, against a real Postgres
//! and nats-server.

use std::time::{Duration, Instant};

use walcast_inbox::{ConsumerConfig, EventId, Inbox, InboxConsumer, InboxError, Outcome};

use crate::support::*;

/// `migrate` is idempotent and safe to run concurrently; table and schema names are
/// quoted identifiers; `contains` and `prune` use the same table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_table_is_created_once_under_any_name() {
    let env = Env::start(Duration::from_secs(120)).await;
    env.db
        .batch_execute("CREATE SCHEMA \"App Data\"")
        .await
        .expect("schema");
    let inbox = Inbox::in_schema("App Data", "Inbox \"v2\"");
    let (a, b) = (
        env.pg.connect().await.unwrap(),
        env.pg.connect().await.unwrap(),
    );
    let (ra, rb) = tokio::join!(inbox.migrate(&a), inbox.migrate(&b));
    ra.expect("first migrate");
    rb.expect("concurrent migrate");
    inbox.migrate(&a).await.expect("migrate again");
    let tables = env
        .pg
        .psql("SELECT count(*) FROM pg_tables WHERE schemaname = 'App Data' AND tablename = 'Inbox \"v2\"'")
        .expect("psql");
    assert_eq!(tables, "1");

    let id: EventId = new_id().parse().expect("uuid");
    assert!(!inbox.contains(&a, "c", id).await.expect("contains"));
    env.db
        .execute(
            &format!(
                "INSERT INTO {} (consumer_name, event_id, received_at) \
                 VALUES ('c', $1::text::uuid, now() - interval '2 days')",
                inbox.table_sql()
            ),
            &[&id.to_string()],
        )
        .await
        .expect("insert");
    assert!(inbox.contains(&a, "c", id).await.expect("contains"));
    assert!(!inbox.contains(&a, "other", id).await.expect("contains"));
    let day = Duration::from_secs(86_400);
    assert_eq!(inbox.prune(&a, day * 3).await.expect("prune"), 0);
    assert_eq!(inbox.prune(&a, day).await.expect("prune"), 1);
    assert!(!inbox.contains(&a, "c", id).await.expect("contains"));
}

/// Binding fails with a kind the caller can branch on: a bad setting before anything is
/// contacted, a missing stream, a missing inbox table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_errors_say_what_is_wrong() {
    let env = Env::start(Duration::from_secs(120)).await;
    let bind = |config: ConsumerConfig, inbox: Inbox| {
        let (pg, js) = (&env.pg, &env.js);
        async move {
            let db = pg.connect().await.expect("connect");
            InboxConsumer::bind(js, db, &inbox, config).await.err()
        }
    };
    let err = bind(ConsumerConfig::new("a.b"), Inbox::default()).await;
    assert!(matches!(err, Some(InboxError::Config(_))), "{err:?}");

    let mut config = ConsumerConfig::new("c");
    config.stream = "NO_SUCH_STREAM".into();
    let err = bind(config, Inbox::default()).await.expect("an error");
    assert!(err.is_stream_not_found(), "{err}");

    let err = bind(ConsumerConfig::new("c"), Inbox::new("missing"))
        .await
        .expect("an error");
    assert!(
        matches!(&err, InboxError::Postgres { .. }) && !err.is_connection_lost(),
        "{err}"
    );
    assert!(err.to_string().contains("Inbox::migrate"), "{err}");
}

/// Cancelling an idle consumer (waiting in a pull request) returns `Ok` once that
/// request ends, within `fetch_wait`; a message published meanwhile is released to the
/// next consumer at once, not after the ack wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_an_idle_consumer_within_fetch_wait() {
    let env = Env::start(Duration::from_secs(120)).await;
    let mut config = test_config("idle");
    config.ack_wait = Duration::from_secs(60);
    config.fetch_wait = Duration::from_secs(2);
    let (hook, mut rx) = report();
    let (task, cancel) = env.spawn(config.clone(), Effects::default(), hook).await;
    // Its pull request is waiting once the server counts it.
    within(10, "the pull request", async {
        loop {
            let stream = env
                .js
                .get_stream(walcast_inbox::DEFAULT_STREAM)
                .await
                .unwrap();
            if stream.consumer_info("idle").await.unwrap().num_waiting > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let started = Instant::now();
    cancel.cancel();
    let id = publish_event(&env.js, "k", 1).await;
    within(10, "the consumer to stop", task)
        .await
        .expect("task")
        .expect("run returns Ok on cancel");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(4), "stopped after {took:?}");
    assert!(
        rx.try_recv().is_err(),
        "a cancelled consumer starts nothing"
    );

    let (hook, mut rx) = report();
    let (task, cancel) = env.spawn(config, Effects::default(), hook).await;
    // Well before the 60 s ack wait.
    let seen = collect_until(&mut rx, 10, "the released event", |s| !s.is_empty()).await;
    stop(task, cancel).await;
    assert!(
        matches!(&seen[..], [(i, 1, _, Outcome::Applied)] if *i == id),
        "{seen:?}"
    );
}

/// The consumer's Postgres session is terminated: `run` returns an error saying the
/// connection is lost (retrying cannot help), the event it was handling is nak'd, and a
/// consumer on a new connection applies it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_database_connection_stops_the_consumer_and_nothing_is_lost() {
    let env = Env::start(Duration::from_secs(120)).await;
    let (hook, _rx) = report();
    let (task, _cancel) = env
        .spawn(test_config("lost"), Effects::default(), hook)
        .await;
    let terminated: i64 = env
        .db
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'",
            &[],
        )
        .await
        .expect("terminate")
        .get(0);
    assert_eq!(terminated, 1, "the consumer's session");
    let id = publish_event(&env.js, "k", 1).await;
    let err = within(30, "run to fail", task)
        .await
        .expect("task")
        .expect_err("the connection is gone");
    assert!(
        matches!(err, InboxError::ConnectionLost { .. }) && err.is_connection_lost(),
        "{err}"
    );

    let (hook, mut rx) = report();
    let (task, cancel) = env
        .spawn(test_config("lost"), Effects::default(), hook)
        .await;
    let seen = collect_until(&mut rx, 30, "the event", |s| !s.is_empty()).await;
    stop(task, cancel).await;
    assert!(
        matches!(&seen[..], [(i, 1, _, Outcome::Applied)] if *i == id),
        "nak'd by the first, applied by the second: {seen:?}"
    );
    assert_eq!(env.effect_counts().await.get(&id), Some(&1));
}
