// A policy reading another table must see every transaction committed before the change
// it judges. Postgres writes a commit to the WAL (where the slot
// decodes it) before the committing backend leaves the process array (where snapshots see
// it); in between, a later transaction can commit and be decoded, and a check run then
// sees the older state. Seen under CPU load in `rls_oracle.test.js`: a membership removed
// just before an item was inserted into that group, and the removed user got the item.
//
// Here that window is held open on purpose: with `synchronous_standby_names` naming a
// standby that never connects, a `synchronous_commit = on` session's COMMIT is in the WAL
// and decoded but waits (invisible) until it is cancelled; every other session commits
// with `synchronous_commit = local`. The membership table is not streamed (as usual in
// Supabase projects): walcast learns of its transaction only from the slot's BEGIN/COMMIT.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import { startStack, client, collector, subscribed, until, jwt } from './lib/harness.js'

const U0 = '00000000-0000-4000-8000-000000000000'

for (const source of ['stream', 'poll']) {
  describe(`CDC_SOURCE=${source}`, () => {
    let st
    before(async () => {
      st = await startStack({
        setupSql: [
          'CREATE TABLE items (id int PRIMARY KEY, group_id int, body text NOT NULL)',
          'CREATE TABLE members (group_id int, user_id uuid, PRIMARY KEY (group_id, user_id))',
        ],
        tables: ['items'],
        serverEnv: { CDC_SOURCE: source },
      })
      await st.env.db.query(`ALTER TABLE items ENABLE ROW LEVEL SECURITY;
        CREATE POLICY via_group ON items FOR SELECT TO authenticated
          USING (EXISTS (SELECT 1 FROM members m WHERE m.group_id = items.group_id AND m.user_id = auth.uid()));
        GRANT SELECT ON members TO authenticated`)
      // Commits wait for a standby only where a session asks for it.
      await st.env.db.query("ALTER SYSTEM SET synchronous_commit = 'local'")
      await st.env.db.query("ALTER SYSTEM SET synchronous_standby_names = 'walcast_test_never_connects'")
      await st.env.db.query('SELECT pg_reload_conf()')
    })
    after(async () => {
      await st?.env.db.query('ALTER SYSTEM RESET synchronous_standby_names').catch(() => {})
      await st?.env.db.query('ALTER SYSTEM RESET synchronous_commit').catch(() => {})
      await st?.env.db.query('SELECT pg_reload_conf()').catch(() => {})
      await st?.stop()
    })

    // `itemFirst`: the item's transaction takes its id before the removal's, and another
    // transaction takes one in between and stays open, so the removal, still in the
    // process array when the item becomes visible, has an id past the snapshot's xmax.
    for (const itemFirst of [false, true]) {
      test(`a change is judged with every membership change committed before it (${itemFirst ? 'item' : 'removal'} takes its id first)`, async () => {
        const base = itemFirst ? 10 : 0
        const db = st.env.db
        await db.query('INSERT INTO members VALUES (1, $1)', [U0])
        const clients = []
        const listen = async (claims) => {
          const rt = client(st.server, { apikey: jwt(claims) })
          clients.push(rt)
          const got = collector(claims.sub ?? claims.role)
          const ch = rt.channel(`visibility-${base}-${clients.length}`).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'items' }, got)
          await subscribed(ch)
          return got
        }
        const removal = new pg.Client({ connectionString: st.env.database_url })
        const writer = new pg.Client({ connectionString: st.env.database_url })
        const idle = new pg.Client({ connectionString: st.env.database_url })
        try {
          await removal.connect()
          await writer.connect()
          await idle.connect()
          const svc = await listen({ role: 'service_role' })
          const u0 = await listen({ role: 'authenticated', sub: U0 })
          const ids = (got) => got.items.map((p) => p.new.id - base)

          // Control: a member sees its group's item.
          await db.query("INSERT INTO items VALUES ($1, 1, 'before')", [base + 1])
          await u0.wait(1, 'u0: the item of its group')

          const item = "INSERT INTO items VALUES ($1, 1, 'after the removal')"
          if (itemFirst) {
            await writer.query('BEGIN')
            await writer.query(item, [base + 2])
            await idle.query('BEGIN')
            await idle.query('SELECT pg_current_xact_id()')
          }
          // The removal commits (WAL, clog) and waits for the standby, not yet visible.
          const { rows } = await removal.query("SELECT pg_backend_pid() AS pid, set_config('synchronous_commit', 'on', false)")
          const removed = removal.query('DELETE FROM members WHERE group_id = 1 AND user_id = $1', [U0])
          await until('the removal waiting for the standby', async () => {
            const r = await db.query("SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'SyncRep'", [rows[0].pid])
            return r.rowCount === 1
          })
          assert.equal((await db.query('SELECT count(*)::int AS n FROM members')).rows[0].n, 1, 'the removal is not visible yet')

          // Committed after the removal: u0 is no longer in group 1 for this item.
          if (itemFirst) await writer.query('COMMIT')
          else await writer.query(item, [base + 2])
          // Time for walcast to decode and judge it (without waiting for the removal, it
          // would deliver it to u0 now); then the removal becomes visible.
          const decoded = Date.now()
          await until('the service_role client getting item 2, or 1 s', () => ids(svc).includes(2) || Date.now() - decoded > 1000).catch(() => {})
          await db.query('SELECT pg_cancel_backend($1)', [rows[0].pid])
          await removed
          const released = Date.now() - decoded

          await db.query("INSERT INTO items VALUES ($1, NULL, 'closing')", [base + 3])
          await svc.wait(3, 'service_role: every item', 20000)
          assert.deepEqual(ids(svc), [1, 2, 3])
          assert.deepEqual(ids(u0), [1], `u0 received items ${JSON.stringify(ids(u0))}: item 2 committed after u0 left its group (released after ${released} ms)`)
        } finally {
          await removal.end().catch(() => {})
          await writer.end().catch(() => {})
          await idle.end().catch(() => {})
          await Promise.all(clients.map(async (rt) => (await rt.removeAllChannels(), await rt.disconnect())))
        }
      })
    }
  })
}
