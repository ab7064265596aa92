//! Row-level security against an oracle: 50 users with distinct claims, policies
//! `owner = auth.uid() OR shared` and one joining a membership table, several writers
//! doing random inserts, updates (moving rows in and out of users' sight) and deletes,
//! thousands of changes, while another writer adds and removes memberships. The worker's
//! decision for every change and every user is compared with the policies evaluated on
//! that change's own values, with the memberships as they were when it committed (the
//! stream carries the membership changes in commit order):
//! - nothing is delivered to a user who could not `SELECT` that version of the row;
//! - every version a user could `SELECT` reaches it — whether or not the row changed
//!   again before the check;
//! - the one exception, both ways: a membership of that user in that row's group that
//!   changed after the version committed and before it was published (a policy reading
//!   another table sees it as it is when the check runs). Counted and reported;
//! - DELETEs reach every user whose role may read the table, with only the key;
//! - at the end, the rows whose latest version each user received are exactly what a
//!   `SELECT` as that user returns (but for memberships changed after that version).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::support::{Collector, Stack};
use rand::{Rng, SeedableRng};
use walcast_bus::subs::{RegisterRequest, SubsClient, SubscriptionSpec};
use walcast_bus::{Bus, ChangeEvent, ChangeKind};

const USERS: usize = 50;
const GROUPS: i32 = 10;
const WRITERS: i32 = 5;
const OPS_PER_WRITER: usize = 1100;
const IDS: i32 = 400;
/// Pause between two membership changes while the writers run.
const MEMBERSHIP_EVERY: Duration = Duration::from_millis(100);

fn uid(u: usize) -> String {
    format!("00000000-0000-4000-8000-{u:012}")
}

fn spec(id: &str, claims: serde_json::Value) -> SubscriptionSpec {
    SubscriptionSpec {
        id: id.into(),
        front: "oracle".into(),
        project: "default".into(),
        schema: "public".into(),
        table: Some("items".into()),
        event: "*".into(),
        filter: None,
        select: None,
        claims,
        from: None,
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Item {
    owner: String,
    shared: bool,
    group: Option<i64>,
    body: String,
}

impl Item {
    fn from_json(v: &serde_json::Value) -> Item {
        Item {
            owner: v["owner"].as_str().expect("owner").to_string(),
            shared: v["shared"].as_bool().expect("shared"),
            group: v["group_id"].as_i64(),
            body: v["body"].as_str().expect("body").to_string(),
        }
    }
}

/// Subscriber id → the JSON it received of the event.
fn deliveries(ev: &ChangeEvent) -> BTreeMap<String, serde_json::Value> {
    let mut out = BTreeMap::new();
    for v in ev.variants().expect("variants") {
        let body = v
            .record
            .as_ref()
            .or(v.old_record.as_ref())
            .expect("record")
            .get()
            .to_string();
        for s in &v.subs {
            out.insert(s.clone(), serde_json::from_str(&body).expect("record json"));
        }
    }
    out
}

/// One writer: random operations on its own ids (id % WRITERS == w), one to three per
/// transaction. Returns the number of row changes committed.
async fn writer(pg_url: String, w: i32, seed: u64) -> usize {
    let (client, conn) = tokio_postgres::connect(&pg_url, tokio_postgres::NoTls)
        .await
        .expect("writer connect");
    tokio::spawn(conn);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mine: Vec<i32> = (1..=IDS).filter(|i| i % WRITERS == w).collect();
    let mut exists: BTreeSet<i32> = BTreeSet::new();
    let mut changes = 0usize;
    let mut ops = 0usize;
    while ops < OPS_PER_WRITER {
        let in_txn = rng.random_range(1..=3usize).min(OPS_PER_WRITER - ops);
        let mut sql = String::from("BEGIN;");
        for _ in 0..in_txn {
            let id = mine[rng.random_range(0..mine.len())];
            let owner = uid(rng.random_range(0..USERS));
            let shared = rng.random_bool(0.1);
            let group = if rng.random_bool(0.5) {
                rng.random_range(1..=GROUPS).to_string()
            } else {
                "NULL".to_string()
            };
            let body = format!("b{w}-{ops}");
            if !exists.contains(&id) {
                sql.push_str(&format!(
                    "INSERT INTO items VALUES ({id}, '{owner}', {shared}, {group}, '{body}');"
                ));
                exists.insert(id);
            } else if rng.random_bool(0.75) {
                // Change one or two of the fields the policies look at, and the body.
                let set = match rng.random_range(0..4) {
                    0 => format!("owner = '{owner}'"),
                    1 => format!("shared = {shared}"),
                    2 => format!("group_id = {group}"),
                    _ => format!("owner = '{owner}', group_id = {group}"),
                };
                sql.push_str(&format!(
                    "UPDATE items SET {set}, body = '{body}' WHERE id = {id};"
                ));
            } else {
                sql.push_str(&format!("DELETE FROM items WHERE id = {id};"));
                exists.remove(&id);
            }
            ops += 1;
            changes += 1;
        }
        sql.push_str("COMMIT;");
        // Values here are generated by the test itself (ints, uuids, bools).
        client
            .batch_execute(&sql)
            .await
            .expect("writer transaction");
        // Paced like an application rather than a bulk load.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    changes
}

/// Add or remove random memberships until `stop`. Returns how many it committed.
async fn membership_writer(pg_url: String, stop: Arc<AtomicBool>, seed: u64) -> usize {
    let (client, conn) = tokio_postgres::connect(&pg_url, tokio_postgres::NoTls)
        .await
        .expect("membership writer connect");
    tokio::spawn(conn);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let (g, u) = (
            rng.random_range(1..=GROUPS),
            uid(rng.random_range(0..USERS)),
        );
        // Values generated by the test itself (an int and a uuid).
        let deleted = client
            .execute(
                &format!("DELETE FROM members WHERE group_id = {g} AND user_id = '{u}'"),
                &[],
            )
            .await
            .expect("remove membership");
        if deleted == 0 {
            client
                .batch_execute(&format!("INSERT INTO members VALUES ({g}, '{u}')"))
                .await
                .expect("add membership");
        }
        n += 1;
        tokio::time::sleep(MEMBERSHIP_EVERY).await;
    }
    n
}

/// `uid(u)` back to `u`.
fn user_of(uid: &str) -> usize {
    uid.rsplit('-')
        .next()
        .and_then(|s| s.parse().ok())
        .expect("a test user id")
}

/// Milliseconds since the epoch of a `commit_timestamp` (`YYYY-MM-DDTHH:MM:SS.mmmZ`).
fn unix_millis(ts: &str) -> i64 {
    let n = |r: std::ops::Range<usize>| -> i64 { ts[r].parse().expect("timestamp field") };
    let (y, m, d) = (n(0..4), n(5..7), n(8..10));
    // Days from civil (proleptic Gregorian), as in walcast-protocol's timestamp module.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    ((days * 24 + n(11..13)) * 60 + n(14..16)) * 60_000 + n(17..19) * 1000 + n(20..23)
}

/// The (user, group) of a change of `members`.
fn membership_of(ev: &ChangeEvent) -> (usize, i64) {
    let row = match ev.kind {
        ChangeKind::Delete => ev.old_record.as_ref(),
        _ => ev.record.as_ref(),
    };
    let row: serde_json::Value =
        serde_json::from_str(row.expect("membership row").get()).expect("json");
    let user = user_of(row["user_id"].as_str().expect("user_id"));
    (user, row["group_id"].as_i64().expect("group_id"))
}

/// The membership changes of the stream: (user, group) → (position, member afterwards).
fn membership_changes(events: &[ChangeEvent]) -> HashMap<(usize, i64), Vec<(usize, bool)>> {
    let mut out: HashMap<(usize, i64), Vec<(usize, bool)>> = HashMap::new();
    for (n, ev) in events
        .iter()
        .enumerate()
        .filter(|(_, e)| e.table == "members")
    {
        out.entry(membership_of(ev))
            .or_default()
            .push((n, ev.kind != ChangeKind::Delete));
    }
    out
}

both_sources!(every_user_gets_exactly_what_rls_allows);

async fn every_user_gets_exactly_what_rls_allows(source: &'static str) {
    let stack = Stack::start(source);
    stack.sql(
        "CREATE TABLE items (id int PRIMARY KEY, owner uuid NOT NULL, shared bool NOT NULL,
                             group_id int, body text NOT NULL);
         CREATE TABLE members (group_id int, user_id uuid, PRIMARY KEY (group_id, user_id));",
    );
    stack.enable("items"); // also creates the roles and auth.* helpers
                           // Its changes come in the stream too, in commit order: the oracle's timeline.
    stack.enable("members");
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut initial: HashSet<(usize, i64)> = HashSet::new();
    let mut inserts = String::new();
    for u in 0..USERS {
        for _ in 0..2 {
            let g = rng.random_range(1..=GROUPS);
            if initial.insert((u, i64::from(g))) {
                inserts.push_str(&format!("INSERT INTO members VALUES ({g}, '{}');", uid(u)));
            }
        }
    }
    stack.sql(&inserts);
    stack.sql(
        "ALTER TABLE items ENABLE ROW LEVEL SECURITY;
         CREATE POLICY own_or_shared ON items FOR SELECT TO authenticated
             USING (owner = auth.uid() OR shared);
         CREATE POLICY via_group ON items FOR SELECT TO authenticated
             USING (EXISTS (SELECT 1 FROM members m
                             WHERE m.group_id = items.group_id AND m.user_id = auth.uid()));
         ALTER TABLE members ENABLE ROW LEVEL SECURITY;
         CREATE POLICY mine ON members FOR SELECT TO authenticated USING (user_id = auth.uid());
         GRANT SELECT ON members TO authenticated;",
    );

    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let bus = Bus::nats(&stack.nats.url(), "oracle").await.expect("bus");
    let subs = SubsClient::new(&bus, None).expect("subs client");
    let mut specs: Vec<SubscriptionSpec> = (0..USERS)
        .map(|u| {
            spec(
                &format!("u{u}"),
                serde_json::json!({"role": "authenticated", "sub": uid(u), "exp": 4102444800u64}),
            )
        })
        .collect();
    specs.push(spec("service", serde_json::json!({"role": "service_role"})));
    specs.push(spec("anon", serde_json::json!({"role": "anon"})));
    let reply = subs
        .register(RegisterRequest { subs: specs }, Duration::from_secs(20))
        .await
        .expect("register");
    assert!(reply.results.iter().all(|r| r.ok), "{:?}", reply.results);

    let stop = Arc::new(AtomicBool::new(false));
    let churn = tokio::spawn(membership_writer(stack.pg.url(), stop.clone(), 99));
    let tasks: Vec<_> = (0..WRITERS)
        .map(|w| tokio::spawn(writer(stack.pg.url(), w, 1000 + w as u64)))
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("writer");
    }
    stop.store(true, Ordering::Relaxed);
    let toggles = churn.await.expect("membership writer");
    assert!(total >= 5000, "only {total} changes written");
    assert!(toggles >= 30, "only {toggles} membership changes");
    collector
        .wait_count(total + toggles, Duration::from_secs(180))
        .await;
    let events = collector.snapshot();
    assert_eq!(
        events.len(),
        total + toggles,
        "exactly one event per change"
    );
    let arrived: Vec<i64> = collector
        .arrivals()
        .iter()
        .map(|t| {
            let d = t.duration_since(SystemTime::UNIX_EPOCH).expect("clock");
            i64::try_from(d.as_micros()).expect("micros")
        })
        .collect();
    let changes = membership_changes(&events);
    let oracle = Oracle {
        events: &events,
        arrived: &arrived,
        changes: &changes,
    };
    let verdicts = oracle.check_deliveries(&initial);
    assert!(
        verdicts.delivered > 1000,
        "only {} deliveries: the workload is too thin",
        verdicts.delivered
    );
    let excluded = final_state_matches(&stack, &oracle, &verdicts.held).await;
    let metric = |name: &str| worker.metric(name).unwrap_or(0.0);
    eprintln!(
        "metrics: superseded {} current-row {} denied {} checks {} errors {}",
        metric("walcast_cdc_rls_superseded_total"),
        metric("walcast_cdc_rls_current_row_total"),
        metric("walcast_cdc_rls_denied_total"),
        metric("walcast_cdc_rls_checks_total"),
        metric("walcast_cdc_rls_errors_total"),
    );
    eprintln!(
        "oracle ({source}): {total} row changes, {toggles} membership changes, {} deliveries, \
         {} verdicts that differ from the memberships at commit because a membership changed \
         between commit and check, {excluded} (user, row) pairs left out of the final \
         comparison for a membership changed after the row's last version",
        verdicts.delivered, verdicts.in_between
    );
    // Every version carried every column the policies read: none judged by its row.
    assert_eq!(metric("walcast_cdc_rls_current_row_total"), 0.0);
    assert_eq!(metric("walcast_cdc_rls_superseded_total"), 0.0);
    assert_eq!(metric("walcast_cdc_rls_errors_total"), 0.0);
}

/// The collected stream, with arrival times (µs since the epoch) and the membership
/// changes it carries.
struct Oracle<'a> {
    events: &'a [ChangeEvent],
    arrived: &'a [i64],
    changes: &'a HashMap<(usize, i64), Vec<(usize, bool)>>,
}

#[derive(Default)]
struct Verdicts {
    delivered: usize,
    /// Verdicts explained only by a membership that changed between commit and check.
    in_between: usize,
    /// user → row id → last version received (None after a DELETE).
    held: HashMap<usize, BTreeMap<i64, Option<Item>>>,
}

impl Oracle<'_> {
    /// Membership values (user, group) may have had when the version at `n` was checked:
    /// those committed after it and before it was published.
    fn later_memberships(&self, n: usize, user: usize, group: i64) -> Vec<bool> {
        let published = self.arrived[n];
        self.changes
            .get(&(user, group))
            .map(|c| {
                c.iter()
                    .filter(|(pos, _)| {
                        *pos > n
                            && unix_millis(&self.events[*pos].commit_timestamp) * 1000 < published
                    })
                    .map(|(_, member)| *member)
                    .collect()
            })
            .unwrap_or_default()
    }

    fn check_deliveries(&self, initial: &HashSet<(usize, i64)>) -> Verdicts {
        let users: BTreeSet<String> = (0..USERS).map(|u| format!("u{u}")).collect();
        let mut members = initial.clone();
        let mut v = Verdicts::default();
        for (n, ev) in self.events.iter().enumerate() {
            if ev.table == "members" {
                if ev.kind == ChangeKind::Delete {
                    members.remove(&membership_of(ev));
                } else {
                    members.insert(membership_of(ev));
                }
                continue;
            }
            let got = deliveries(ev);
            let full = &got["service"];
            let id = full["id"].as_i64().expect("id");
            if ev.kind == ChangeKind::Delete {
                let to: BTreeSet<String> =
                    got.keys().filter(|k| k.starts_with('u')).cloned().collect();
                assert_eq!(to, users, "DELETE of {id} goes to every authenticated user");
                for (who, body) in &got {
                    if who != "service" {
                        assert_eq!(
                            body,
                            &serde_json::json!({"id": id}),
                            "{who}: DELETE carries only the key"
                        );
                    }
                }
                for u in 0..USERS {
                    v.held.entry(u).or_default().insert(id, None);
                }
                continue;
            }
            assert!(!got.contains_key("anon"), "anon has no policy: {ev:?}");
            let item = Item::from_json(full);
            for u in 0..USERS {
                let own = item.owner == uid(u) || item.shared;
                let at_commit = item.group.is_some_and(|g| members.contains(&(u, g)));
                let may = own || at_commit;
                let later = match (own, item.group) {
                    (false, Some(g)) => self.later_memberships(n, u, g),
                    _ => Vec::new(),
                };
                match got.get(&format!("u{u}")) {
                    Some(body) => {
                        assert!(
                            may || later.contains(&true),
                            "UNAUTHORIZED: u{u} received {body} (change {n}): not visible by its \
                             own values with the memberships at commit or at any time before \
                             it was published"
                        );
                        assert_eq!(body, full, "u{u} gets every column");
                        v.in_between += usize::from(!may);
                        v.delivered += 1;
                        v.held.entry(u).or_default().insert(id, Some(item.clone()));
                    }
                    None if may => {
                        assert!(
                            later.contains(&false),
                            "u{u} could SELECT change {n} of row {id} ({item:?}) by its own \
                             values, and no membership changed before the check, but it was \
                             not delivered"
                        );
                        v.in_between += 1;
                    }
                    None => {}
                }
            }
        }
        v
    }
}

/// The final state, read as each user through Postgres itself, against the rows whose
/// latest version the user received. Returns the (user, row) pairs left out because the
/// user's membership in the row's group changed after the row's last version.
async fn final_state_matches(
    stack: &Stack,
    oracle: &Oracle<'_>,
    held: &HashMap<usize, BTreeMap<i64, Option<Item>>>,
) -> usize {
    let events = oracle.events;
    // Row id → position of its last change.
    let mut last_index: HashMap<i64, usize> = HashMap::new();
    for (n, ev) in events
        .iter()
        .enumerate()
        .filter(|(_, e)| e.table == "items")
    {
        last_index.insert(deliveries(ev)["service"]["id"].as_i64().expect("id"), n);
    }
    let (client, conn) = tokio_postgres::connect(&stack.pg.url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    let mut excluded = 0;
    for u in 0..USERS {
        client.batch_execute("BEGIN").await.expect("begin");
        let claims = serde_json::json!({"role": "authenticated", "sub": uid(u)}).to_string();
        client
            .execute(
                "SELECT set_config('role', 'authenticated', true), set_config('request.jwt.claims', $1, true)",
                &[&claims],
            )
            .await
            .expect("set claims");
        let rows = client
            .query(
                "SELECT id::bigint, owner::text, shared, group_id::bigint, body FROM items",
                &[],
            )
            .await
            .expect("select as user");
        client.batch_execute("ROLLBACK").await.expect("rollback");
        // A row whose group membership changed for u after its last version: u's verdict
        // on that version may predate the change, and nothing announces the change.
        let unsettled = |id: &i64| {
            let last = &events[last_index[id]];
            last.kind != ChangeKind::Delete
                && Item::from_json(&deliveries(last)["service"])
                    .group
                    .and_then(|g| oracle.changes.get(&(u, g)))
                    .is_some_and(|c| c.iter().any(|(pos, _)| *pos > last_index[id]))
        };
        let seen: BTreeMap<i64, Item> = rows
            .iter()
            .map(|r| {
                let item = Item {
                    owner: r.get(1),
                    shared: r.get(2),
                    group: r.get(3),
                    body: r.get(4),
                };
                (r.get(0), item)
            })
            .filter(|(id, _)| !unsettled(id))
            .collect();
        let all_held = held.get(&u).cloned().unwrap_or_default();
        excluded += last_index.keys().filter(|id| unsettled(id)).count();
        // Rows whose latest version this user received (a stale copy means the row moved
        // out of sight, which Supabase does not announce either).
        let current: BTreeMap<i64, Item> = all_held
            .iter()
            .filter_map(|(id, v)| Some((*id, v.clone()?)))
            .filter(|(id, v)| {
                let last = &events[last_index[id]];
                !unsettled(id)
                    && last.kind != ChangeKind::Delete
                    && Item::from_json(&deliveries(last)["service"]) == *v
            })
            .collect();
        assert_eq!(
            current, seen,
            "u{u}: rows received at their latest version differ from SELECT as u{u}"
        );
    }
    excluded
}
