// A socket never waits on one channel (README "Realtime clients"): a join that waits for
// the cdc-worker holds up neither the socket's heartbeats nor its other channels. Two
// cdc-workers, a writer, and a realtime-js client with a 2 s heartbeat on a ws-front,
// following a table on one channel. The leader is frozen (SIGSTOP) past its lease and
// the client joins two channels of classes the front does not receive yet: their joins
// wait for a worker (the frozen one, then the one taking over). Meanwhile the client's
// heartbeats are answered, so it never reconnects, and its first channel receives every
// row once, in order; the new channels, once subscribed, every row committed after.
// Before, the socket handled one frame at a time: the waiting joins held up its
// heartbeat replies, realtime-js took the connection for dead and reconnected, and its
// channel lost the rows committed until it had joined again.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import WebSocket from 'ws'
import { startEnv, startProcess, enableTable, client, subscribed, uniq, until } from './lib/harness.js'

const LEASE_SECS = 6
const FREEZE_MS = 15000
const HEARTBEAT_MS = 2000

/** `/health`, or `{}` when the process does not answer within a second (frozen). */
const healthOf = (w) =>
  fetch(`${w.url}/health`, { ...w.figures, signal: AbortSignal.timeout(1000) })
    .then((r) => r.json())
    .catch(() => ({}))
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

describe('a join waiting for a worker during a takeover', () => {
  let env, front
  const workers = []
  const clients = []

  before(async () => {
    env = await startEnv()
    await env.db.query('CREATE TABLE tj (id int8 PRIMARY KEY, v text)')
    const wenv = { NATS_URL: env.nats_url, LEASE_DURATION_SECS: String(LEASE_SECS) }
    workers.push(await startProcess(env, 'cdc-worker', [], wenv))
    await enableTable(env, 'tj')
    workers.push(await startProcess(env, 'cdc-worker', [], wenv, { standby: true }))
    front = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
  })
  after(async () => {
    for (const w of workers) if (w.child.signalCode === null) w.child.kill('SIGCONT')
    for (const rt of clients) {
      await rt.removeAllChannels().catch(() => {})
      await rt.disconnect()
    }
    await front?.stop()
    for (const w of workers) await w.stop().catch(() => {})
    await env?.stop()
  })

  test('heartbeats are answered and the joined channel misses nothing while new joins wait', async () => {
    let opened = 0
    class Counted extends WebSocket {
      constructor(...args) {
        super(...args)
        opened += 1
      }
    }
    const beats = []
    const rt = client(front, {
      transport: Counted,
      heartbeatIntervalMs: HEARTBEAT_MS,
      heartbeatCallback: (status) => beats.push(status),
      logger: () => {},
    })
    clients.push(rt)
    const gotA = []
    await subscribed(rt.channel(uniq('tj')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'tj' }, (p) => gotA.push(Number(p.new.id))))

    let stop = false
    let nextId = 1
    const writer = (async () => {
      while (!stop) {
        await env.db.query("INSERT INTO tj VALUES ($1, 'w')", [nextId])
        nextId += 1
        await sleep(10)
      }
    })()
    const late = []
    try {
      await until('rows flowing', () => gotA.length >= 20, 30000)
      let old
      await until('the leader', async () => {
        for (const w of workers) if ((await healthOf(w)).cdc_active) old = w
        return old !== undefined
      })
      old.child.kill('SIGSTOP')
      const frozen = performance.now()
      // Two channels of new classes: their joins wait for a worker.
      for (const filter of ['id=gt.0', 'v=eq.w']) {
        const s = { filter, got: [], from: undefined, statuses: [] }
        rt.channel(uniq('tj'))
          .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'tj', filter }, (p) => s.got.push(Number(p.new.id)))
          .subscribe((status) => {
            s.statuses.push(status)
            if (status === 'SUBSCRIBED' && s.from === undefined) s.from = nextId
          })
        late.push(s)
      }
      const standby = workers.find((w) => w !== old)
      await until('the other worker to take over', async () => (await healthOf(standby)).cdc_active === true, FREEZE_MS + 20000)
      console.log(`# taken over ${Math.round(performance.now() - frozen)} ms after SIGSTOP`)
      await until('the new channels subscribed', () => late.every((s) => s.from !== undefined), 60000)
      await sleep(Math.max(0, FREEZE_MS - (performance.now() - frozen)))
      old.child.kill('SIGCONT')
      await until('the old leader to step down', async () => (await healthOf(old)).leader === false, 15000)
      await sleep(2000)
    } finally {
      stop = true
      await writer
    }

    const last = nextId - 1
    const expected = Array.from({ length: last }, (_, i) => i + 1)
    await until(`every row on the first channel (has ${gotA.length} of ${last})`, () => gotA.length >= last, 60000).catch((e) => {
      const have = new Set(gotA)
      const missing = expected.filter((id) => !have.has(id))
      throw new Error(`${e.message}; ${missing.length} missing, from ${missing[0]} to ${missing.at(-1)}; sockets opened ${opened}; heartbeats ${JSON.stringify(beats.filter((b) => b !== 'sent' && b !== 'ok'))}`)
    })
    assert.equal(opened, 1, `the client reconnected (heartbeats: ${JSON.stringify(beats.filter((b) => b !== 'sent' && b !== 'ok'))})`)
    assert.deepEqual(beats.filter((b) => b === 'timeout'), [], 'a heartbeat timed out')
    assert.deepEqual(gotA, expected, 'the first channel: every row once, in order')
    for (const s of late) {
      const after = expected.filter((id) => id > s.from)
      await until(`${s.filter}: every row after its SUBSCRIBED`, () => s.got.filter((id) => id > s.from).length >= after.length, 60000)
      assert.deepEqual(s.got.filter((id) => id > s.from), after, `${s.filter}: every row committed after SUBSCRIBED, once, in order (statuses ${s.statuses})`)
    }
    console.log(`# ${last} rows; the new channels: ${late.map((s) => s.statuses.join('→')).join(', ')}`)
  })
})
