// Row-level security through the unmodified client: two users with their own JWTs on a
// table with the policy `owner = auth.uid() OR shared`. Each receives exactly the rows it
// may SELECT (content and order), never a column its role may not read, sees a row move
// into its sight and not out of it (without the old version it never saw), gets the
// DELETEs of rows it could see and no other, and a filter on a column it may not read is
// refused while the channel keeps serving.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, collector, subscribed, subscribeTracked, uniq, jwt, VSNS } from './lib/harness.js'

let st, db
let nextId = 1

const ALICE = '00000000-0000-4000-8000-00000000a11c'
const BOB = '00000000-0000-4000-8000-000000000b0b'

before(async () => {
  st = await startStack({
    setupSql: ['CREATE TABLE docs (id int8 PRIMARY KEY, owner uuid NOT NULL, shared bool NOT NULL, body text, secret text)'],
    tables: ['docs'],
  })
  db = st.env.db
  // The server has run its migrations by now: the roles and auth.uid() exist.
  await db.query(`REVOKE ALL ON docs FROM anon, authenticated;
    GRANT SELECT (id, owner, shared, body) ON docs TO authenticated;
    ALTER TABLE docs ENABLE ROW LEVEL SECURITY;
    CREATE POLICY own_or_shared ON docs FOR SELECT TO authenticated USING (owner = auth.uid() OR shared)`)
})
after(async () => {
  await st?.stop()
})

const T = (extra = {}) => ({ event: '*', schema: 'public', table: 'docs', ...extra })
const user = (sub) => jwt({ role: 'authenticated', sub })

async function listen(sub, vsn) {
  const rt = client(st.server, { vsn, apikey: user(sub) })
  const got = collector(sub)
  await subscribed(rt.channel(uniq('rls')).on('postgres_changes', T(), got))
  return { rt, got }
}

const summary = (p) => [p.eventType, p.eventType === 'DELETE' ? p.old : p.new]

for (const vsn of VSNS) {
  describe(`vsn ${vsn}`, () => {
    test('each user receives exactly what its policy lets it SELECT, never a hidden column', async () => {
      const alice = await listen(ALICE, vsn)
      const bob = await listen(BOB, vsn)
      try {
        const [a1, b1, s1] = [nextId++, nextId++, nextId++]
        await db.query('INSERT INTO docs VALUES ($1, $2, false, $3, $4)', [a1, ALICE, 'alice private', 'sa'])
        await db.query('INSERT INTO docs VALUES ($1, $2, false, $3, $4)', [b1, BOB, 'bob private', 'sb'])
        await db.query('INSERT INTO docs VALUES ($1, $2, true, $3, $4)', [s1, BOB, 'for all', 'ss'])
        // The shared row comes last: once a user has it, it has everything before it.
        await alice.got.wait(2)
        await bob.got.wait(2)
        const row = (id, owner, shared, body) => ({ id, owner, shared, body })
        assert.deepEqual(alice.got.items.map(summary), [
          ['INSERT', row(a1, ALICE, false, 'alice private')],
          ['INSERT', row(s1, BOB, true, 'for all')],
        ])
        assert.deepEqual(bob.got.items.map(summary), [
          ['INSERT', row(b1, BOB, false, 'bob private')],
          ['INSERT', row(s1, BOB, true, 'for all')],
        ])

        // Alice gives her row to Bob: it enters Bob's sight, leaves Alice's (no event).
        await db.query('UPDATE docs SET owner = $1, body = $2 WHERE id = $3', [BOB, 'now bob', a1])
        await db.query('UPDATE docs SET body = $1 WHERE id = $2', ['still for all', s1])
        await alice.got.wait(3)
        await bob.got.wait(4)
        assert.deepEqual(alice.got.items.slice(2).map(summary), [['UPDATE', row(s1, BOB, true, 'still for all')]])
        assert.deepEqual(bob.got.items.slice(2).map(summary), [
          ['UPDATE', row(a1, BOB, false, 'now bob')],
          ['UPDATE', row(s1, BOB, true, 'still for all')],
        ])
        // Bob never could SELECT alice's version of a1: its old_record tells nothing of it.
        assert.deepEqual(bob.got.items[2].old, {})
        assert.deepEqual(bob.got.items[3].old, row(s1, BOB, true, 'for all'))

        // A DELETE is judged on the deleted row: only who could SELECT it gets it, with
        // what it may read of it. Bob's private row: Bob only.
        await db.query('DELETE FROM docs WHERE id = $1', [b1])
        await db.query('DELETE FROM docs WHERE id = $1', [s1])
        await alice.got.wait(4)
        await bob.got.wait(6)
        assert.deepEqual(alice.got.items.slice(3).map(summary), [['DELETE', row(s1, BOB, true, 'still for all')]])
        assert.deepEqual(bob.got.items.slice(4).map(summary), [
          ['DELETE', row(b1, BOB, false, 'bob private')],
          ['DELETE', row(s1, BOB, true, 'still for all')],
        ])

        for (const p of [...alice.got.items, ...bob.got.items]) {
          assert.ok(!('secret' in p.new) && !('secret' in p.old), `secret leaked: ${JSON.stringify(p)}`)
        }
      } finally {
        for (const u of [alice, bob]) {
          await u.rt.removeAllChannels()
          await u.rt.disconnect()
        }
      }
    })

    test('a filter on a column the role may not read is refused; the channel stays open', async () => {
      const rt = client(st.server, { vsn, apikey: user(ALICE) })
      try {
        const sys = collector('system')
        const got = collector('changes')
        const name = uniq('peek')
        const ch = rt.channel(name).on('system', {}, sys).on('postgres_changes', T({ filter: 'secret=eq.sa' }), got)
        const s = subscribeTracked(ch)
        assert.equal((await s.first).status, 'SUBSCRIBED')
        await sys.wait(1)
        assert.equal(sys.items[0].status, 'error')
        assert.match(sys.items[0].message, /permission denied for column "secret"/)
        // Nothing arrives on the refused binding, even for a row the filter would match.
        const own = await listen(ALICE, vsn)
        const id = nextId++
        await db.query('INSERT INTO docs VALUES ($1, $2, false, $3, $4)', [id, ALICE, 'mine', 'sa'])
        await own.got.wait(1)
        assert.equal(got.items.length, 0, JSON.stringify(got.items))
        assert.equal(ch.state, 'joined')
        await own.rt.removeAllChannels()
        await own.rt.disconnect()
      } finally {
        await rt.removeAllChannels()
        await rt.disconnect()
      }
    })
  })
}
