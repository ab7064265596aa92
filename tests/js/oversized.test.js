// Nothing deterministic stalls the slot: a row too large for one bus message (over
// MAX_RECORD_BYTES, or over nats-server's own max_payload) is delivered the Supabase way —
// its large values dropped, its primary key kept, errors ["Error 413: Payload Too Large"] —
// and the changes after it keep flowing, for its table and for every other.
// cdc-worker → NATS → ws-front, both CDC sources, the real realtime-js client.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, collector, subscribed, uniq } from './lib/harness.js'

const SCENARIOS = [
  { name: 'a 2 MB row, default limits', natsMaxPayload: undefined, bigBytes: 2_000_000 },
  { name: 'a 100 KB row, nats-server max_payload 64 KB', natsMaxPayload: 65536, bigBytes: 100_000 },
]

for (const sc of SCENARIOS) {
  describe(sc.name, () => {
    let env, front
    const clients = []
    before(async () => {
      env = await startEnv({ natsMaxPayload: sc.natsMaxPayload })
      await env.db.query('CREATE TABLE big (id int8 PRIMARY KEY, tag text, body text)')
      await env.db.query('CREATE TABLE other (id int8 PRIMARY KEY, v text)')
      // Migrations run with the first worker; tables are enabled after it.
      const first = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url, CDC_SLOT_NAME: 'walcast_first' })
      await enableTable(env, 'big')
      await enableTable(env, 'other')
      await first.stop()
      // The stopped worker's walsender ends a moment after its client went away.
      for (let tries = 0; ; tries++) {
        const r = await env.db.query("SELECT active FROM pg_replication_slots WHERE slot_name = 'walcast_first'")
        if (r.rows.length === 0 || !r.rows[0].active || tries >= 100) break
        await new Promise((resolve) => setTimeout(resolve, 100))
      }
      await env.db.query("SELECT pg_drop_replication_slot('walcast_first')")
      front = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
    })
    after(async () => {
      for (const rt of clients) {
        await rt.removeAllChannels().catch(() => {})
        await rt.disconnect()
      }
      await front?.stop()
      await env?.stop()
    })

    let nextId = 1
    for (const source of ['stream', 'poll']) {
      test(`CDC_SOURCE=${source}: the big row arrives with the 413 error and its key; the rows around it and another table arrive whole`, async () => {
        const worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url, CDC_SOURCE: source, CDC_SLOT_NAME: `walcast_${source}` })
        try {
          const rt = client(front, { logger: () => {} })
          clients.push(rt)
          const got = collector('big')
          const others = collector('other')
          await subscribed(rt.channel(uniq('big')).on('postgres_changes', { event: '*', schema: 'public', table: 'big' }, got))
          await subscribed(rt.channel(uniq('other')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'other' }, others))
          const [a, b, c] = [nextId++, nextId++, nextId++]
          const huge = 'x'.repeat(sc.bigBytes)
          await env.db.query("INSERT INTO big VALUES ($1, 'small-before', 'short')", [a])
          await env.db.query("INSERT INTO big VALUES ($1, 'the-big-one', $2)", [b, huge])
          await env.db.query("INSERT INTO big VALUES ($1, 'small-after', 'short')", [c])
          await env.db.query("UPDATE big SET tag = 'touched' WHERE id = $1", [b])
          await env.db.query("INSERT INTO other VALUES ($1, 'bystander')", [a])
          await got.wait(4, 'four changes on big', 30000)
          await others.wait(1, 'the bystander row', 30000)

          assert.deepEqual(got.items.map((p) => [p.eventType, p.new.id]), [['INSERT', a], ['INSERT', b], ['INSERT', c], ['UPDATE', b]])
          assert.deepEqual(got.items[0].new, { id: a, tag: 'small-before', body: 'short' })
          assert.equal(got.items[0].errors, null)
          // The Supabase way: values over 64 bytes dropped, the key and small values kept.
          assert.deepEqual(got.items[1].errors, ['Error 413: Payload Too Large'])
          assert.deepEqual(got.items[1].new, { id: b, tag: 'the-big-one' })
          assert.deepEqual(got.items[2].new, { id: c, tag: 'small-after', body: 'short' })
          assert.deepEqual(got.items[3].errors, ['Error 413: Payload Too Large'])
          assert.deepEqual(got.items[3].new, { id: b, tag: 'touched' })
          assert.deepEqual(got.items[3].old, { id: b, tag: 'the-big-one' })
          assert.deepEqual(others.items[0].new, { id: a, v: 'bystander' })

          const health = await worker.health()
          assert.equal(health.cdc_active, true, JSON.stringify(health))
          assert.equal(health.oversized_changes_total, 2, JSON.stringify(health))
          assert.equal(health.skipped_changes_total, 0, JSON.stringify(health))
          assert.equal(health.last_skipped_change.table, 'public.big')
          assert.equal(health.last_skipped_change.reason, 'payload_too_large')
          const metrics = await (await fetch(`${worker.url}/metrics`, worker.figures)).text()
          assert.match(metrics, /walcast_cdc_changes_oversized_total(\{source="default"\})? 2/)
        } finally {
          await worker.stop()
        }
      })
    }
  })
}
