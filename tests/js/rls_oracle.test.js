// Row-level security against an oracle, through the unmodified client, against
// both CDC sources: 50 users, each a client with its own JWT, on `items` with the policies
// `owner = auth.uid() OR shared` and one joining a membership table; several writers doing
// thousands of random inserts, updates (moving rows in and out of users' sight) and
// deletes while another writer adds and removes memberships. A service_role client
// subscribed to `items` and `members` on one channel learns the commit order of both
// (the pipeline delivers in commit order): the oracle's timeline. Against the policies
// evaluated on each version's own values, with the memberships as of its commit:
// - nothing reaches a user who could not SELECT that version (nor anon, which has no
//   policy), and what reaches it is the whole row, in commit order, once;
// - every version a user could SELECT reaches it, whether or not the row changed again
//   before the check;
// - the one exception, both ways: a membership of that user in that row's group that
//   changed after the version committed and before it was delivered (a policy reading
//   another table sees it as it is when the check runs). Counted and reported;
// - a DELETE is judged the same way, on the row it deleted: it reaches exactly the users
//   who could SELECT that version (with the same exception), with its values; anon, which
//   has no policy, gets nothing at all;
// - at the end, the rows whose latest version each user received are exactly what a
//   SELECT as that user returns (but for memberships changed after that version).
// "Before it was delivered": committed (`commit_timestamp`, Postgres's clock, truncated to
// the millisecond) no later than the service_role client received that version (this
// machine's clock, the same one), which is after the check (a batch is published once
// checked). "At commit": walcast checks only once every transaction decoded before the
// version is visible; a commit is in the WAL before it is visible, and backends become
// visible in any order, so a check that did not wait could read a state older than the
// version's commit (a removed member could get an item of the group it had just
// left, only on a busy machine).
//
// Run with every core busy (`busyLoops`), as CI runs beside other jobs: the races this
// checks need a loaded machine.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import { startStack, client, collector, subscribed, until, jwt, metric, busyLoops } from './lib/harness.js'

const USERS = 50
const GROUPS = 10
const WRITERS = 5
const OPS_PER_WRITER = 1000
const IDS = 400
/**
 * One membership change per this many item transactions: often, so that many commit right
 * beside an item of their group (a check that did not wait for visibility fails about 1 run
 * in 3 under load at 4, none in 8 at 20).
 */
const CHURN_EVERY = 4
/** Writers wait while more changes than this are committed but not yet delivered. */
const MAX_LAG = 50
// Generous for a debug build on a shared 2-core machine; a stall fails with counts.
const RECEIVE_MS = 120000

const uid = (u) => `00000000-0000-4000-8000-${String(u).padStart(12, '0')}`
const userOf = (id) => Number(id.split('-').pop())
const key = (u, g) => `${u}/${g}`

// Every core busy for the whole file (both sources), bounded, stopped at the end.
let load
before(() => {
  load = busyLoops({ ms: 300000 })
})
after(async () => {
  await load?.stop()
})

/** A seeded PRNG (mulberry32): `int(lo, hi)` inclusive, `chance(p)`. */
function random(seed) {
  let a = seed >>> 0
  const next = () => {
    a = (a + 0x6d2b79f5) >>> 0
    let t = Math.imul(a ^ (a >>> 15), a | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
  return { int: (lo, hi) => lo + Math.floor(next() * (hi - lo + 1)), chance: (p) => next() < p }
}

for (const source of ['stream', 'poll']) {
  describe(`CDC_SOURCE=${source}`, () => {
    let st
    before(async () => {
      st = await startStack({
        setupSql: [
          'CREATE TABLE items (id int PRIMARY KEY, owner uuid NOT NULL, shared bool NOT NULL, group_id int, body text NOT NULL)',
          'CREATE TABLE members (group_id int, user_id uuid, PRIMARY KEY (group_id, user_id))',
          // Without RLS, on every client's channel: committed last, once a client has its
          // row it has everything before (commit order).
          'CREATE TABLE done (id int PRIMARY KEY)',
        ],
        tables: ['items', 'members', 'done'],
        serverEnv: { CDC_SOURCE: source },
      })
      await st.env.db.query(`ALTER TABLE items ENABLE ROW LEVEL SECURITY;
        CREATE POLICY own_or_shared ON items FOR SELECT TO authenticated USING (owner = auth.uid() OR shared);
        CREATE POLICY via_group ON items FOR SELECT TO authenticated
          USING (EXISTS (SELECT 1 FROM members m WHERE m.group_id = items.group_id AND m.user_id = auth.uid()));
        ALTER TABLE members ENABLE ROW LEVEL SECURITY;
        CREATE POLICY mine ON members FOR SELECT TO authenticated USING (user_id = auth.uid())`)
    })
    after(async () => {
      await st?.stop()
    })

    test('every user receives exactly what RLS allows, judged on each version', async (t) => {
      const started = Date.now()
      const db = st.env.db
      const clients = []
      const listen = async (claims, tables, onEvent = () => {}) => {
        const rt = client(st.server, { apikey: jwt(claims) })
        clients.push(rt)
        const got = collector(claims.sub ?? claims.role)
        let ch = rt.channel(`oracle-${clients.length}`)
        for (const table of tables) ch = ch.on('postgres_changes', { event: '*', schema: 'public', table }, (p) => (onEvent(), got(p)))
        await subscribed(ch)
        return got
      }
      const conns = []
      try {
        // The timeline: every change of both tables, in commit order, with when it arrived.
        const arrived = []
        const svc = await listen({ role: 'service_role' }, ['items', 'members', 'done'], () => arrived.push(Date.now()))
        const users = await Promise.all(Array.from({ length: USERS }, (_, u) => listen({ role: 'authenticated', sub: uid(u) }, ['items', 'done'])))
        const anon = await listen({ role: 'anon' }, ['items', 'done'])

        // Committed changes (items and members), for the writers' backpressure.
        let committed = 0
        const rng = random(7)
        const initial = new Set()
        for (let u = 0; u < USERS; u++) for (let i = 0; i < 2; i++) initial.add(key(u, rng.int(1, GROUPS)))
        for (const m of initial) {
          const [u, g] = m.split('/')
          await db.query('INSERT INTO members VALUES ($1, $2)', [g, uid(u)])
          committed += 1
        }

        const churnRng = random(99)
        const churn = new pg.Client({ connectionString: st.env.database_url })
        await churn.connect()
        conns.push(churn)
        let toggles = 0
        let churned = Promise.resolve()
        // One statement, one change: removes the membership, or adds it if there was none.
        // One at a time, on their own connection, beside the writers.
        const toggle = () =>
          (churned = churned.then(async () => {
            await churn.query(
              `WITH gone AS (DELETE FROM members WHERE group_id = $1 AND user_id = $2 RETURNING 1)
               INSERT INTO members SELECT $1::int, $2::uuid WHERE NOT EXISTS (SELECT FROM gone)`,
              [churnRng.int(1, GROUPS), uid(churnRng.int(0, USERS - 1))],
            )
            toggles += 1
            committed += 1
          }))
        let txns = 0
        const writer = async (w) => {
          const c = new pg.Client({ connectionString: st.env.database_url })
          await c.connect()
          conns.push(c)
          const r = random(1000 + w)
          const mine = Array.from({ length: IDS }, (_, i) => i + 1).filter((i) => i % WRITERS === w)
          const exists = new Set()
          let ops = 0
          while (ops < OPS_PER_WRITER) {
            const inTxn = Math.min(r.int(1, 3), OPS_PER_WRITER - ops)
            let sql = 'BEGIN;'
            for (let i = 0; i < inTxn; i++, ops++) {
              const id = mine[r.int(0, mine.length - 1)]
              const owner = uid(r.int(0, USERS - 1))
              const shared = r.chance(0.1)
              const group = r.chance(0.5) ? r.int(1, GROUPS) : 'NULL'
              const body = `b${w}-${ops}`
              if (!exists.has(id)) {
                sql += `INSERT INTO items VALUES (${id}, '${owner}', ${shared}, ${group}, '${body}');`
                exists.add(id)
              } else if (r.chance(0.75)) {
                // Change one or two of the fields the policies look at, and the body.
                const set = [`owner = '${owner}'`, `shared = ${shared}`, `group_id = ${group}`, `owner = '${owner}', group_id = ${group}`][r.int(0, 3)]
                sql += `UPDATE items SET ${set}, body = '${body}' WHERE id = ${id};`
              } else {
                sql += `DELETE FROM items WHERE id = ${id};`
                exists.delete(id)
              }
            }
            // Values here are generated by the test itself (ints, uuids, bools).
            await c.query(sql + 'COMMIT;')
            committed += inTxn
            if (++txns % CHURN_EVERY === 0) await toggle()
            // Paced by the pipeline rather than a clock: a bounded backlog.
            await until(`delivery within ${MAX_LAG} changes of the writers (${svc.items.length} of ${committed})`, () => svc.items.length >= committed - MAX_LAG, RECEIVE_MS)
          }
          return ops
        }
        const total = (await Promise.all(Array.from({ length: WRITERS }, (_, w) => writer(w)))).reduce((a, b) => a + b, 0)
        const closing = await db.query('DELETE FROM items WHERE id = (SELECT min(id) FROM items) RETURNING id')
        assert.equal(closing.rowCount, 1)
        await db.query('INSERT INTO done VALUES (1)')
        committed += 2
        const wrote = Date.now() - started
        assert.ok(total >= 5000, `only ${total} changes written`)
        assert.ok(toggles >= 300, `only ${toggles} membership changes`)

        await svc.wait(committed, `the service_role client's ${committed} changes`, RECEIVE_MS)
        const events = svc.items.map((p, n) => ({ ...p, at: arrived[n], row: p.eventType === 'DELETE' ? p.old : p.new }))
        assert.equal(events.length, committed, 'exactly one event per change')
        assert.deepEqual([events.at(-2).eventType, events.at(-2).row.id], ['DELETE', closing.rows[0].id])
        assert.equal(events.pop().table, 'done')
        for (const [who, got] of [...users.map((g, u) => [`u${u}`, g]), ['anon', anon]]) {
          await until(`${who}: the closing row`, () => got.items.some((p) => p.table === 'done'), RECEIVE_MS)
          const items = got.items.filter((p) => p.table === 'items')
          got.items.splice(0, got.items.length, ...items)
        }
        // anon has no policy: nothing at all, not even a DELETE's key.
        assert.deepEqual(anon.items, [])

        // Where each delivery sits in the timeline: versions by their (unique) body, DELETEs
        // by their row's next DELETE.
        const byBody = new Map()
        const deletesOf = new Map()
        const changes = new Map() // (user, group) → [[position, member afterwards]]
        const lastOf = new Map() // row id → position of its last change
        events.forEach((e, n) => {
          if (e.table === 'members') {
            const k = key(userOf(e.row.user_id), e.row.group_id)
            changes.set(k, [...(changes.get(k) ?? []), [n, e.eventType !== 'DELETE']])
            return
          }
          lastOf.set(e.row.id, n)
          if (e.eventType === 'DELETE') deletesOf.set(e.row.id, [...(deletesOf.get(e.row.id) ?? []), n])
          else byBody.set(e.row.body, n)
        })
        const received = users.map((got, u) => {
          const at = new Map()
          let last = -1
          for (const p of got.items) {
            const n = p.eventType === 'DELETE' ? deletesOf.get(p.old.id)?.find((n) => n > last) : byBody.get(p.new.body)
            assert.ok(n > last, `u${u}: ${JSON.stringify(p)} is not the next change in commit order after #${last}`)
            at.set(n, p)
            last = n
          }
          return at
        })
        // Membership values (user, group) may have had when the version at `n` was checked:
        // those committed after it and before it was delivered.
        const laterMemberships = (n, u, g) =>
          (changes.get(key(u, g)) ?? []).filter(([m]) => m > n && Date.parse(events[m].commit_timestamp) <= events[n].at).map(([, member]) => member)

        // For failures: the version's commit and arrival, and the user's changes in that group.
        const when = (n) => `committed ${events[n].commit_timestamp}, received ${new Date(events[n].at).toISOString()}`
        const history = (n, u, g) =>
          `change ${n}, ${when(n)}; u${u} in group ${g}: ` +
          ((changes.get(key(u, g)) ?? []).map(([m, member]) => `change ${m} ${member ? 'added' : 'removed'}, ${when(m)}`).join('; ') || 'never')

        const members = new Set()
        const held = Array.from({ length: USERS }, () => new Map()) // row id → last version received (null: deleted)
        let delivered = 0
        let deleted = 0
        const inBetween = { delivered: 0, withheld: 0 }
        events.forEach((e, n) => {
          if (e.table === 'members') {
            const k = key(userOf(e.row.user_id), e.row.group_id)
            if (e.eventType === 'DELETE') members.delete(k)
            else members.add(k)
            return
          }
          // A DELETE is judged on the version it deleted (REPLICA IDENTITY FULL: its old row).
          const item = e.row
          const kind = e.eventType
          for (let u = 0; u < USERS; u++) {
            const got = received[u].get(n)
            const values = kind === 'DELETE' ? got?.old : got?.new
            const own = item.owner === uid(u) || item.shared
            const may = own || (item.group_id !== null && members.has(key(u, item.group_id)))
            const later = !own && item.group_id !== null ? laterMemberships(n, u, item.group_id) : []
            if (got) {
              assert.ok(
                may || later.includes(true),
                `UNAUTHORIZED: u${u} received ${kind} ${JSON.stringify(values)} (${history(n, u, item.group_id)}): not visible by its own values with the memberships at commit or at any time before it was delivered`,
              )
              assert.deepEqual(values, item, `u${u} gets every column`)
              inBetween.delivered += may ? 0 : 1
              delivered += 1
              deleted += kind === 'DELETE' ? 1 : 0
              held[u].set(item.id, kind === 'DELETE' ? null : item)
            } else if (may) {
              assert.ok(
                later.includes(false),
                `u${u} could SELECT change ${n} of row ${item.id} (${JSON.stringify(item)}) by its own values, and no membership changed before the check, but it was not delivered (${history(n, u, item.group_id)})`,
              )
              inBetween.withheld += 1
            }
          }
        })
        assert.ok(delivered > 1000, `only ${delivered} deliveries: the workload is too thin`)
        assert.ok(deleted > 50, `only ${deleted} DELETEs delivered: the workload is too thin`)

        // The final state, read as each user through Postgres itself.
        let excluded = 0
        for (let u = 0; u < USERS; u++) {
          await db.query('BEGIN')
          await db.query("SELECT set_config('role', 'authenticated', true), set_config('request.jwt.claims', $1, true)", [
            JSON.stringify({ role: 'authenticated', sub: uid(u) }),
          ])
          const { rows } = await db.query('SELECT id, owner::text, shared, group_id, body FROM items')
          await db.query('ROLLBACK')
          // A row whose group membership changed for u after its last version: u's verdict
          // on that version may predate the change, and nothing announces the change.
          const unsettled = (id) => {
            const last = events[lastOf.get(id)]
            return (
              last.eventType !== 'DELETE' &&
              last.row.group_id !== null &&
              (changes.get(key(u, last.row.group_id)) ?? []).some(([m]) => m > lastOf.get(id))
            )
          }
          excluded += [...lastOf.keys()].filter(unsettled).length
          const sorted = (rows) => rows.sort((a, b) => a.id - b.id)
          const seen = sorted(rows.filter((r) => !unsettled(r.id)))
          // Rows whose latest version this user received (a stale copy means the row moved
          // out of sight, which Supabase does not announce either).
          const current = sorted(
            // (`held` keeps the timeline's own objects: the latest version is the same one.)
            [...held[u].values()].filter((v) => v && !unsettled(v.id) && events[lastOf.get(v.id)].row === v),
          )
          assert.deepEqual(current, seen, `u${u}: rows received at their latest version differ from SELECT as u${u}`)
        }
        const m = async (name) => metric(st.server, `walcast_cdc_rls_${name}_total`)
        t.diagnostic(
          `${source}: ${total} row changes, ${toggles} membership changes (and ${initial.size} initial), ${delivered} deliveries (${deleted} DELETEs), ` +
            `${inBetween.delivered + inBetween.withheld} verdicts (${inBetween.delivered} delivered, ${inBetween.withheld} withheld) that differ from ` +
            `the memberships at commit because a membership changed between commit and delivery, ` +
            `${excluded} (user, row) pairs left out of the final comparison for a membership changed after the row's last version; ` +
            `${load.cores} cores kept busy; ` +
            `written in ${wrote} ms, checked after ${Date.now() - started} ms; ` +
            `denied ${await m('denied')}, checks ${await m('checks')}`,
        )
        // Every version carried every column the policies read: none judged by its row.
        assert.equal(await m('current_row'), 0)
        assert.equal(await m('superseded'), 0)
        assert.equal(await m('errors'), 0)
        // No check ran before a transaction decoded ahead of it was visible.
        assert.equal(await m('invisible'), 0)
      } finally {
        for (const c of conns) await c.end().catch(() => {})
        await Promise.all(clients.map(async (rt) => (await rt.removeAllChannels(), await rt.disconnect())))
      }
    })
  })
}
