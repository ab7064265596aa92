//! The failures that made a team rewrite its outbox relay, reproduced
//! against naive relays written here, on the very workload walcast relays at the same
//! time:
//! - polling by timestamp (`occurred_at > last_seen`, `occurred_at` = `now()`, the start
//!   of the transaction) skips for good the events of a transaction that commits after a
//!   later-started one has been polled; walcast delivers every one, in commit order;
//! - polling by `xid8` below the snapshot horizon (`pg_snapshot_xmin`, Watermill-style)
//!   delivers nothing while a session sits idle in a transaction that took an xid; walcast
//!   keeps delivering, within the same bound as without it.

both_sources!(
    timestamp_polling_loses_late_commits_and_walcast_does_not,
    xid8_horizon_polling_stalls_behind_an_idle_transaction_and_walcast_does_not,
);

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio_postgres::Client;

use crate::support::outbox::{client, outbox_stream, read_all, stream_with, wait_stored, Stored};
use crate::support::Stack;

/// Bound on commit → stored in JetStream for walcast, idle transaction or not.
const LATENCY_BOUND: Duration = Duration::from_secs(2);

/// The `n` of each message, in stream order.
fn ns(got: &[Stored]) -> Vec<i64> {
    got.iter().map(Stored::n).collect()
}

/// A relay that polls an outbox table by time: `occurred_at > last_seen`, then moves
/// `last_seen` to the largest `occurred_at` it delivered.
struct TimestampRelay {
    last_seen: SystemTime,
    /// The `n` of each event delivered, in delivery order.
    delivered: Vec<i64>,
}

impl TimestampRelay {
    fn new() -> TimestampRelay {
        TimestampRelay {
            last_seen: UNIX_EPOCH,
            delivered: Vec::new(),
        }
    }

    async fn poll(&mut self, db: &Client) {
        let rows = db
            .query(
                "SELECT occurred_at, (payload->>'n')::int8 FROM orders_outbox
                 WHERE occurred_at > $1 ORDER BY occurred_at",
                &[&self.last_seen],
            )
            .await
            .expect("timestamp poll");
        for r in rows {
            self.last_seen = self.last_seen.max(r.get(0));
            self.delivered.push(r.get(1));
        }
    }
}

/// An event row in the walcast outbox table `orders_outbox`, in the session's current
/// transaction (or its own); its id.
async fn insert_event(c: &Client, n: i64) -> String {
    let key = format!("k{}", n % 3);
    c.query_one(
        "INSERT INTO orders_outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('orders', $1, 'created', jsonb_build_object('n', $2::int8))
         RETURNING id::text",
        &[&key, &n],
    )
    .await
    .expect("insert into the outbox")
    .get(0)
}

async fn timestamp_polling_loses_late_commits_and_walcast_does_not(source: &'static str) {
    let stack = Stack::start(source);
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    stack.sql("SELECT walcast.outbox_create('default', 'public', 'orders_outbox')");
    let (a, b, relay_db) = (
        client(&stack.pg).await,
        client(&stack.pg).await,
        client(&stack.pg).await,
    );
    let mut relay = TimestampRelay::new();
    let (mut ids, mut late, mut early) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..3i64 {
        // A starts first (its now() is the earlier), B starts later and commits first,
        // the relay polls in between, then A commits.
        a.batch_execute("BEGIN").await.unwrap();
        let id_a = insert_event(&a, 10 * round + 1).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        ids.push(insert_event(&b, 10 * round + 2).await);
        relay.poll(&relay_db).await;
        a.batch_execute("COMMIT").await.unwrap();
        ids.push(id_a);
        early.push(10 * round + 2);
        late.push(10 * round + 1);
    }
    for _ in 0..5 {
        relay.poll(&relay_db).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stored = stack.sql("SELECT count(*) FROM orders_outbox");
    assert_eq!(stored.trim(), "6", "every event is committed in the table");
    assert_eq!(
        relay.delivered, early,
        "the timestamp relay delivers only the events of the later-started transactions"
    );
    assert!(
        late.iter().all(|n| !relay.delivered.contains(n)),
        "the timestamp relay lost {late:?} for good (delivered {:?})",
        relay.delivered
    );

    let got = stream_with(&stack.nats.url(), 6, Duration::from_secs(30)).await;
    assert_eq!(
        ns(&got),
        [2, 1, 12, 11, 22, 21],
        "walcast: all six, in commit order, each once"
    );
    let msg_ids: Vec<&str> = got.iter().filter_map(|s| s.header("Nats-Msg-Id")).collect();
    assert_eq!(
        msg_ids, ids,
        "walcast: the outbox rows' ids, in commit order"
    );
    eprintln!(
        "timestamp polling ({source}): naive relay lost {} of 6 events ({late:?}); walcast lost 0",
        late.len()
    );
}

/// A relay that polls an outbox table by `(xid8, id)` offset, only below the snapshot
/// horizon `pg_snapshot_xmin(pg_current_snapshot())` (every transaction below it has
/// ended, so no row can still appear behind the offset).
struct XidRelay {
    offset: (String, i64),
    delivered: Vec<i64>,
}

impl XidRelay {
    fn new() -> XidRelay {
        XidRelay {
            offset: ("0".into(), 0),
            delivered: Vec::new(),
        }
    }

    async fn poll(&mut self, db: &Client) {
        let rows = db
            .query(
                // Not `tx::text` named `tx`: ORDER BY would sort by that text.
                "SELECT tx::text AS offset_tx, id, (payload->>'n')::int8 FROM xid_outbox
                 WHERE (tx, id) > ($1::text::xid8, $2)
                   AND tx < pg_snapshot_xmin(pg_current_snapshot())
                 ORDER BY tx, id",
                &[&self.offset.0, &self.offset.1],
            )
            .await
            .expect("xid8 poll");
        for r in rows {
            self.offset = (r.get(0), r.get(1));
            self.delivered.push(r.get(2));
        }
    }

    /// Poll every 20 ms until it delivered `n` events in all, or `timeout` passed.
    async fn poll_until(&mut self, db: &Client, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.delivered.len() < n && Instant::now() < deadline {
            self.poll(db).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// One transaction writing event `n` both ways: a row of the naive relay's table and
/// `walcast.emit`. When it committed (as the client saw it).
async fn write_both(c: &Client, n: i64) -> SystemTime {
    c.execute("SELECT emit_both($1)", &[&n])
        .await
        .expect("emit_both");
    SystemTime::now()
}

/// For each of `got` whose `n` is in `committed`: JetStream's store time − commit time.
fn latencies(got: &[Stored], committed: &[(i64, SystemTime)]) -> Vec<Duration> {
    committed
        .iter()
        .map(|(n, at)| {
            let s = got
                .iter()
                .find(|s| s.n() == *n)
                .unwrap_or_else(|| panic!("event {n} not on the stream"));
            s.stored_at.duration_since(*at).unwrap_or_default()
        })
        .collect()
}

const XID_SETUP: &str = "
    CREATE TABLE xid_outbox (
        id      bigserial,
        tx      xid8  NOT NULL DEFAULT pg_current_xact_id(),
        payload jsonb NOT NULL,
        PRIMARY KEY (tx, id));
    CREATE FUNCTION emit_both(n int8) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO xid_outbox (payload) VALUES (jsonb_build_object('n', n));
        PERFORM walcast.emit('orders', 'k' || (n % 3), jsonb_build_object('n', n));
    END $$;";

async fn xid8_horizon_polling_stalls_behind_an_idle_transaction_and_walcast_does_not(
    source: &'static str,
) {
    let stack = Stack::start(source);
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    stack.sql(XID_SETUP);
    let (writer, relay_db, idle) = (
        client(&stack.pg).await,
        client(&stack.pg).await,
        client(&stack.pg).await,
    );
    let mut relay = XidRelay::new();
    // Without an idle transaction both relays deliver.
    let mut before = Vec::new();
    for n in 0..5 {
        before.push((n, write_both(&writer, n).await));
    }
    relay
        .poll_until(&relay_db, 5, Duration::from_secs(10))
        .await;
    assert_eq!(relay.delivered, [0, 1, 2, 3, 4], "the xid8 relay works");
    let mut stream = outbox_stream(&stack.nats.url(), Duration::from_secs(30)).await;
    wait_stored(&mut stream, 5, Duration::from_secs(30)).await;

    // A session idle in a transaction that took an xid, as `BEGIN` and one query do.
    idle.batch_execute("BEGIN").await.unwrap();
    idle.query_one("SELECT pg_current_xact_id()", &[])
        .await
        .unwrap();
    let mut during = Vec::new();
    for n in 5..25 {
        during.push((n, write_both(&writer, n).await));
    }
    wait_stored(&mut stream, 25, LATENCY_BOUND + Duration::from_secs(1)).await;
    let stalled_from = Instant::now();
    relay.poll_until(&relay_db, 6, Duration::from_secs(2)).await;
    let stall = stalled_from.elapsed();
    let in_table = stack.sql("SELECT count(*) FROM xid_outbox");
    assert_eq!(
        in_table.trim(),
        "25",
        "every event is committed in the table"
    );
    assert_eq!(
        relay.delivered.len(),
        5,
        "the xid8 relay must deliver nothing behind the idle transaction: {:?}",
        relay.delivered
    );
    let got = read_all(&mut stream).await;
    idle.batch_execute("ROLLBACK").await.unwrap();
    assert_xid_outcome(&got, &before, &during);

    // Once the idle transaction ended, the xid8 relay catches up (a stall, not a loss).
    relay
        .poll_until(&relay_db, 25, Duration::from_secs(10))
        .await;
    assert_eq!(relay.delivered, (0..25).collect::<Vec<i64>>());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = read_all(&mut stream).await;
    assert_eq!(
        ns(&after),
        ns(&got),
        "walcast sent nothing more, no duplicate"
    );
    eprintln!(
        "xid8 polling ({source}): naive relay delivered 0 of 20 events in {stall:?} behind an idle transaction; walcast all 20"
    );
}

/// walcast: every event once, in commit order, while the idle transaction is open; each
/// within [`LATENCY_BOUND`] of its commit, as without it.
fn assert_xid_outcome(got: &[Stored], before: &[(i64, SystemTime)], during: &[(i64, SystemTime)]) {
    assert_eq!(
        ns(got),
        (0..25).collect::<Vec<i64>>(),
        "walcast: every event once, in commit order, the idle transaction still open"
    );
    let max = |l: Vec<Duration>| l.into_iter().max().unwrap_or_default();
    let (without, with) = (max(latencies(got, before)), max(latencies(got, during)));
    assert!(
        with < LATENCY_BOUND && without < LATENCY_BOUND,
        "walcast commit → JetStream: max {with:?} with the idle transaction, {without:?} without; bound {LATENCY_BOUND:?}"
    );
    eprintln!(
        "walcast commit → JetStream, max: {without:?} without, {with:?} with an idle transaction"
    );
}
