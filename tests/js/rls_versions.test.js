// Row-level security judges each version by its own values, through the
// unmodified client. An app inserts a row owned by Alice and updates its status right
// after, as chat and order apps do, 1,000 times, while another table takes a steady
// stream of unrelated writes. With the policy `owner = auth.uid()`, Alice receives all
// 1,000 INSERTs and all 1,000 UPDATEs, in commit order, with their content (most
// INSERTs are checked after their row was already updated); Bob receives none of them.
// Against both CDC sources, each with its own `walcast serve` on the same database.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import { startEnv, startProcess, enableTable, client, collector, subscribed, uniq, jwt, until, metric } from './lib/harness.js'

const PAIRS = 1000
const ALICE = '00000000-0000-4000-8000-00000000a11c'
const BOB = '00000000-0000-4000-8000-000000000b0b'
// Generous for a debug build on a shared 2-core machine; a stall fails with counts.
const RECEIVE_MS = 180000

let env
let ready = false
let nextId = 1

before(async () => {
  env = await startEnv()
  await env.db.query(`CREATE TABLE msgs (id int8 PRIMARY KEY, owner uuid NOT NULL, status text NOT NULL, body text NOT NULL);
    CREATE TABLE noise (id int8 PRIMARY KEY, v text)`)
})
after(async () => {
  await env?.stop()
})

/** After the first server ran its migrations (roles, auth.uid()): realtime and RLS. */
async function setUpOnce() {
  if (ready) return
  await enableTable(env, 'msgs')
  await enableTable(env, 'noise')
  await env.db.query(`ALTER TABLE msgs ENABLE ROW LEVEL SECURITY;
    CREATE POLICY mine ON msgs FOR SELECT TO authenticated USING (owner = auth.uid())`)
  ready = true
}

/** Unrelated writes to `noise`, 10 rows per statement, until `stop()`; resolves the row count. */
function backgroundLoad() {
  let stopped = false
  const done = (async () => {
    const c = new pg.Client({ connectionString: env.database_url })
    await c.connect()
    let n = 0
    try {
      while (!stopped) {
        await c.query("INSERT INTO noise SELECT g, 'load' FROM generate_series($1::int8, $1::int8 + 9) g", [n + 1 + nextNoise])
        n += 10
        await new Promise((r) => setTimeout(r, 2))
      }
    } finally {
      nextNoise += n
      await c.end()
    }
    return n
  })()
  return {
    async stop() {
      stopped = true
      return done
    },
  }
}
let nextNoise = 0

async function listen(server, sub) {
  const rt = client(server, { apikey: jwt({ role: 'authenticated', sub }) })
  const got = collector(sub === ALICE ? 'alice' : 'bob')
  await subscribed(rt.channel(uniq('msgs')).on('postgres_changes', { event: '*', schema: 'public', table: 'msgs' }, got))
  return { rt, got }
}

for (const source of ['stream', 'poll']) {
  describe(`CDC_SOURCE=${source}`, () => {
    let server
    before(async () => {
      server = await startProcess(env, 'walcast', ['serve'], { CDC_SOURCE: source, CDC_SLOT_NAME: `walcast_js_v_${source}` })
      await setUpOnce()
    })
    after(async () => {
      await server?.stop()
    })

    test(`insert then update right after, ${PAIRS} times under load: the owner receives every version, another user none`, async (t) => {
      const alice = await listen(server, ALICE)
      const bob = await listen(server, BOB)
      const load = backgroundLoad()
      let noiseRows = 0
      try {
        const first = nextId
        const started = Date.now()
        for (let i = 0; i < PAIRS; i++) {
          const id = nextId++
          await env.db.query("INSERT INTO msgs VALUES ($1, $2, 'sent', $3)", [id, ALICE, `message ${id}`])
          await env.db.query("UPDATE msgs SET status = 'delivered' WHERE id = $1", [id])
        }
        const wrote = Date.now() - started
        noiseRows = await load.stop()
        // One last row each, committed after everything above: changes reach a client in
        // commit order, so once it has its last row it has had everything before it.
        const [lastA, lastB] = [nextId++, nextId++]
        await env.db.query("INSERT INTO msgs VALUES ($1, $2, 'last', 'for alice'), ($3, $4, 'last', 'for bob')", [lastA, ALICE, lastB, BOB])
        const has = (u, id) => () => u.got.items.some((p) => p.new?.id === id)
        const count = (u) => `(got ${u.got.items.length})`
        await until(`alice's last row ${count(alice)}`, has(alice, lastA), RECEIVE_MS)
        await until(`bob's last row ${count(bob)}`, has(bob, lastB), RECEIVE_MS)

        const summary = (p) => [p.eventType, p.new]
        const got = alice.got.items.map(summary)
        const inserts = got.filter(([e]) => e === 'INSERT').length - 1
        const updates = got.filter(([e]) => e === 'UPDATE').length
        assert.equal(inserts, PAIRS, `alice received ${inserts} of ${PAIRS} INSERTs (and ${updates} UPDATEs)`)
        assert.equal(updates, PAIRS, `alice received ${updates} of ${PAIRS} UPDATEs`)
        const expected = []
        for (let id = first; id < first + PAIRS; id++) {
          const row = { id, owner: ALICE, body: `message ${id}` }
          expected.push(['INSERT', { ...row, status: 'sent' }], ['UPDATE', { ...row, status: 'delivered' }])
        }
        expected.push(['INSERT', { id: lastA, owner: ALICE, status: 'last', body: 'for alice' }])
        assert.deepEqual(got, expected, 'alice: every version, in commit order, with its content')
        assert.deepEqual(bob.got.items.map(summary), [['INSERT', { id: lastB, owner: BOB, status: 'last', body: 'for bob' }]], "bob: his own row only, none of alice's")
        // Every version carried what the policy reads: none was judged by its row.
        assert.equal(await metric(server, 'walcast_cdc_rls_superseded_total'), 0)
        assert.equal(await metric(server, 'walcast_cdc_rls_current_row_total'), 0)
        t.diagnostic(`${source}: ${PAIRS} pairs written in ${wrote} ms beside ${noiseRows} rows of load; all received after ${Date.now() - started} ms`)
      } finally {
        await load.stop()
        for (const u of [alice, bob]) {
          await u.rt.removeAllChannels()
          await u.rt.disconnect()
        }
      }
    })
  })
}
