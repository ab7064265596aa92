// "Join means subscribed": 200 times in a row, a NEW channel is subscribed and, from its
// SUBSCRIBED callback, a row is inserted; that row must arrive (bounded per iteration).
// Run against both CDC sources, each with its own `walcast serve` on the same database.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, VSNS } from './lib/harness.js'

const ROUNDS = 200
const PER_ROUND_MS = 5000

let env
before(async () => {
  env = await startEnv()
  await env.db.query('CREATE TABLE r (id int8 PRIMARY KEY, source text, round int4)')
})
after(async () => {
  await env?.stop()
})

let nextId = 1
let enabled = false

/** Subscribe `name`; on SUBSCRIBED insert a row; resolve with what arrived, or fail after `ms`. */
function roundTrip(rt, name, row, { filter, ms = PER_ROUND_MS }) {
  return new Promise((resolve, reject) => {
    const got = []
    const statuses = []
    const t = setTimeout(
      () => reject(new Error(`${name}: row ${row.id} not received within ${ms} ms (statuses ${statuses.join(',')}, got ${JSON.stringify(got)})`)),
      ms,
    )
    const ch = rt.channel(name).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'r', ...(filter ? { filter } : {}) }, (p) => {
      got.push(p.new)
      if (p.new.id === row.id) {
        clearTimeout(t)
        resolve({ ch, got })
      }
    })
    ch.subscribe((status, err) => {
      statuses.push(status)
      if (status === 'SUBSCRIBED') {
        env.db.query('INSERT INTO r VALUES ($1, $2, $3)', [row.id, row.source, row.round]).catch(reject)
      } else {
        clearTimeout(t)
        reject(new Error(`${name}: ${status}${err ? `: ${err.message}` : ''}`))
      }
    })
  })
}

for (const source of ['stream', 'poll']) {
  describe(`CDC_SOURCE=${source}`, () => {
    let server
    before(async () => {
      server = await startProcess(env, 'walcast', ['serve'], { CDC_SOURCE: source, CDC_SLOT_NAME: `walcast_js_${source}` })
      // The registry table exists once the first server ran its migrations.
      if (!enabled) await enableTable(env, 'r')
      enabled = true
    })
    after(async () => {
      await server?.stop()
    })

    for (const vsn of VSNS) {
      test(`${ROUNDS} times in a row (vsn ${vsn}): subscribe a new channel, insert on SUBSCRIBED, receive it`, async (t) => {
        const rt = client(server, { vsn })
        try {
          const started = Date.now()
          for (let round = 0; round < ROUNDS; round++) {
            const row = { id: nextId++, source, round }
            // Alternate unfiltered and filtered bindings: both must be live at SUBSCRIBED.
            const filter = round % 2 ? `id=eq.${row.id}` : undefined
            const { ch, got } = await roundTrip(rt, `once-${source}-${vsn}-${round}`, row, { filter })
            assert.deepEqual(got, [row], `round ${round}: exactly the new row, first`)
            assert.equal(await rt.removeChannel(ch), 'ok')
          }
          const ms = Date.now() - started
          t.diagnostic(`${source} vsn ${vsn}: ${ROUNDS} rounds in ${ms} ms (${(ms / ROUNDS).toFixed(1)} ms each)`)
        } finally {
          await rt.removeAllChannels()
          await rt.disconnect()
        }
      })
    }
  })
}
