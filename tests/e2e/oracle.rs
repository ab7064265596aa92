//! Row-level security against an oracle: 50 users with distinct claims, policies
//! `owner = auth.uid() OR shared` and one joining a membership table, several writers
//! doing random inserts, updates (moving rows in and out of users' sight) and deletes,
//! thousands of changes. The worker's decision for every change and every user is
//! compared with the policies evaluated on that change's own values:
//! - nothing is delivered to a user who could not `SELECT` that version of the row;
//! - a version a user could see is withheld only when the row changed again before the
//!   check (never judged by a later version);
//! - DELETEs reach every user whose role may read the table, with only the key;
//! - at the end, the rows whose latest version each user received are exactly what a
//!   `SELECT` as that user returns.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use support::{Collector, Stack};
use walcast_bus::subs::{RegisterRequest, SubsClient, SubscriptionSpec};
use walcast_bus::{Bus, ChangeEvent, ChangeKind};

const USERS: usize = 50;
const GROUPS: i32 = 10;
const WRITERS: i32 = 5;
const OPS_PER_WRITER: usize = 1100;
const IDS: i32 = 400;

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

fn visible(user: usize, item: &Item, members: &HashMap<usize, BTreeSet<i64>>) -> bool {
    item.owner == uid(user)
        || item.shared
        || item
            .group
            .is_some_and(|g| members.get(&user).is_some_and(|m| m.contains(&g)))
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
        // Paced like an application rather than a bulk load, so most checks run while
        // the row still holds the change (under a backlog most versions are superseded).
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    changes
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
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut members: HashMap<usize, BTreeSet<i64>> = HashMap::new();
    let mut inserts = String::new();
    for u in 0..USERS {
        for _ in 0..2 {
            let g = rng.random_range(1..=GROUPS);
            if members.entry(u).or_default().insert(i64::from(g)) {
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

    let tasks: Vec<_> = (0..WRITERS)
        .map(|w| tokio::spawn(writer(stack.pg.url(), w, 1000 + w as u64)))
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("writer");
    }
    assert!(total >= 5000, "only {total} changes written");
    collector.wait_count(total, Duration::from_secs(180)).await;
    let events = collector.snapshot();
    assert_eq!(events.len(), total, "exactly one event per change");

    // Later changes per row, to tell "withheld because superseded" from a lost delivery.
    let mut last_index: HashMap<i64, usize> = HashMap::new();
    for (n, ev) in events.iter().enumerate() {
        let id = deliveries(ev)["service"]["id"].as_i64().expect("id");
        last_index.insert(id, n);
    }
    let users: BTreeSet<String> = (0..USERS).map(|u| format!("u{u}")).collect();
    // user → id → last version received (None after a DELETE).
    let mut held: HashMap<usize, BTreeMap<i64, Option<Item>>> = HashMap::new();
    let (mut delivered, mut withheld_superseded) = (0usize, 0usize);
    for (n, ev) in events.iter().enumerate() {
        let got = deliveries(ev);
        let full = &got["service"];
        let id = full["id"].as_i64().expect("id");
        match ev.kind {
            ChangeKind::Delete => {
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
                    held.entry(u).or_default().insert(id, None);
                }
            }
            _ => {
                assert!(!got.contains_key("anon"), "anon has no policy: {ev:?}");
                let item = Item::from_json(full);
                for u in 0..USERS {
                    let may = visible(u, &item, &members);
                    match got.get(&format!("u{u}")) {
                        Some(body) => {
                            assert!(may, "UNAUTHORIZED: u{u} received {body} (change {n})");
                            assert_eq!(body, full, "u{u} gets every column");
                            delivered += 1;
                            held.entry(u).or_default().insert(id, Some(item.clone()));
                        }
                        None if may => {
                            assert!(
                                last_index[&id] > n,
                                "u{u} could see change {n} of row {id} ({item:?}) and it is the row's last change, but it was not delivered"
                            );
                            withheld_superseded += 1;
                        }
                        None => {}
                    }
                }
            }
        }
    }
    assert!(
        delivered > 1000,
        "only {delivered} deliveries: the workload is too thin"
    );

    // The final state, read as each user, through Postgres itself.
    let (client, conn) = tokio_postgres::connect(&stack.pg.url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
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
        let seen: BTreeMap<i64, Item> = rows
            .iter()
            .map(|r| {
                (
                    r.get(0),
                    Item {
                        owner: r.get(1),
                        shared: r.get(2),
                        group: r.get(3),
                        body: r.get(4),
                    },
                )
            })
            .collect();
        // Rows whose latest version this user received.
        let current: BTreeMap<i64, Item> = held
            .get(&u)
            .map(|h| {
                h.iter()
                    .filter_map(|(id, v)| Some((*id, v.clone()?)))
                    .filter(|(id, v)| {
                        // Still the row's final version (a stale copy means the row moved
                        // out of sight, which Supabase does not announce either).
                        events
                            .get(last_index[id])
                            .map(|e| deliveries(e)["service"].clone())
                            .is_some_and(|last| {
                                e_kind_is_write(&events[last_index[id]])
                                    && Item::from_json(&last) == *v
                            })
                    })
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(
            current, seen,
            "u{u}: rows received at their latest version differ from SELECT as u{u}"
        );
    }
    eprintln!(
        "metrics: superseded {:?} denied {:?} checks {:?} errors {:?}",
        worker.metric("walcast_cdc_rls_superseded_total"),
        worker.metric("walcast_cdc_rls_denied_total"),
        worker.metric("walcast_cdc_rls_checks_total"),
        worker.metric("walcast_cdc_rls_errors_total")
    );
    eprintln!(
        "oracle ({source}): {total} changes, {delivered} deliveries, {withheld_superseded} visible versions withheld because superseded"
    );
}

fn e_kind_is_write(ev: &ChangeEvent) -> bool {
    ev.kind != ChangeKind::Delete
}
