// A takeover is not a failure (docs/architecture.md "Several databases: a leader per
// source", the notices to subscribed clients; "Joins without a round trip"). Two
// cdc-workers, a writer, realtime-js clients on a ws-front listening to `system`
// messages. The leader is frozen (SIGSTOP) past its lease, the other takes over, the old
// one is continued (it finds its term fenced); then the new leader is frozen the same way
// and the old one takes over again. A client joining just after the first freeze is
// subscribed at once (its class is delivered to the front already) and registered in the
// background. Throughout, no client gets a `system` error, and every row arrives once, in
// order. Before, a woken leader kept reporting its fence as the source's error, so the
// next takeover's gap was told as a failure ("its change stream failed") and, a second
// later, as "streams changes again"; and a background registration that no leader
// answered for 15 s ended its subscription ("Unable to subscribe to changes: … no
// cdc-worker answered"), leaving the client deaf. A real failure is still told: with both
// workers frozen, no leader at all for longer than the bound, the clients are told once,
// and that it streams again after.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, subscribed, uniq, until } from './lib/harness.js'

// Long enough that a takeover leaves a few seconds with no leader heard streaming (the
// fronts count a leader as streaming while its last beacon is under 5 s old): the window
// in which a stale error was told.
const LEASE_SECS = 15
const FREEZE_MS = (LEASE_SECS + 5) * 1000
// The fronts' bound for no leader at all (`NO_LEADER_GRACE`), and the beacons' freshness.
const NO_LEADER_MS = 30000
const FRESH_MS = 5000

/** `/health`, or `{}` when the process does not answer within a second (frozen). */
const healthOf = (w) =>
  fetch(`${w.url}/health`, { ...w.figures, signal: AbortSignal.timeout(1000) })
    .then((r) => r.json())
    .catch(() => ({}))
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

describe('takeovers are not failures', () => {
  let env, front
  const workers = []
  const clients = []

  before(async () => {
    env = await startEnv()
    await env.db.query('CREATE TABLE tk (id int8 PRIMARY KEY, v text)')
    const wenv = { NATS_URL: env.nats_url, LEASE_DURATION_SECS: String(LEASE_SECS) }
    workers.push(await startProcess(env, 'cdc-worker', [], wenv))
    await enableTable(env, 'tk')
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

  test('SIGSTOP the leader past its lease, twice: no "failed" notice, every row; no leader at all past the bound: told', async () => {
    const leader = async () => {
      let found
      await until('a leading cdc-worker that streams', async () => {
        for (const w of workers) {
          const h = await healthOf(w)
          if (h.leader && h.cdc_active) found = w
        }
        return found !== undefined
      }, 60000)
      return found
    }
    const subscribers = []
    const join = async (name, vsn, filter) => {
      const rt = client(front, { vsn, logger: () => {} })
      clients.push(rt)
      const s = { name, got: [], system: [], from: 0 }
      await subscribed(rt.channel(uniq('tk'))
        .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'tk', filter }, (p) => s.got.push(Number(p.new.id)))
        .on('system', {}, (m) => s.system.push({ at: performance.now(), ...m })))
      subscribers.push(s)
      return s
    }
    // Two classes (each registered with the worker at its join).
    await join('vsn 2.0.0', '2.0.0', undefined)
    await join('vsn 1.0.0', '1.0.0', 'id=gt.0')
    const errors = () => subscribers.flatMap((s) => s.system.filter((m) => m.status === 'error').map((m) => `${s.name}: ${m.message}`))

    // Two takeovers: each leader frozen past its lease, replaced, then continued.
    async function takeovers() {
      for (const round of [1, 2]) {
        const old = await leader()
        old.child.kill('SIGSTOP')
        const frozen = performance.now()
        if (round === 1) {
          // The first class, joined at once and registered in the background.
          const started = performance.now()
          const s = await join('joined by class', '2.0.0', undefined)
          s.from = nextId
          const took = performance.now() - started
          assert.ok(took < 3000, `joined by class in ${Math.round(took)} ms: it waited for the frozen worker`)
        }
        const standby = workers.find((w) => w !== old)
        await until(`round ${round}: the other worker to take over`, async () => {
          const h = await healthOf(standby)
          return h.leader && h.cdc_active
        }, FREEZE_MS + 20000)
        console.log(`# round ${round}: taken over ${Math.round(performance.now() - frozen)} ms after SIGSTOP`)
        await sleep(Math.max(0, FREEZE_MS - (performance.now() - frozen)))
        old.child.kill('SIGCONT')
        await until(`round ${round}: the old leader to step down`, async () => (await healthOf(old)).leader === false, 15000)
        assert.deepEqual(errors(), [], `round ${round}: a takeover told as a failure`)
      }
      // Long enough for the fronts to have told a failure that a worker reports.
      await sleep(8000)
      assert.deepEqual(errors(), [], 'a woken, fenced leader told as a failure of the stream')
    }

    let stop = false
    let nextId = 1
    const writer = (async () => {
      while (!stop) {
        await env.db.query("INSERT INTO tk VALUES ($1, 'w')", [nextId])
        nextId += 1
        await sleep(20)
      }
    })()
    try {
      await takeovers()
    } finally {
      stop = true
      await writer
    }

    // Every row once, in order (for the client joined later, every row committed after
    // its SUBSCRIBED).
    const allRows = async (what) => {
      for (const s of subscribers) {
        const expected = Array.from({ length: nextId - 1 - s.from }, (_, i) => s.from + i + 1)
        const got = () => s.got.filter((id) => id > s.from)
        await until(`${s.name}: every row ${what} (has ${got().length} of ${expected.length})`, () => got().length >= expected.length, 60000)
        assert.deepEqual(got(), expected, `${s.name}: every row once, in order, ${what}`)
      }
    }
    await allRows('through the takeovers')

    // A real failure: no leader at all for longer than the bound is told, once, and so is
    // the recovery.
    for (const w of workers) w.child.kill('SIGSTOP')
    const frozen = performance.now()
    await until('the clients told that no worker reads the source', () => subscribers.every((s) => s.system.some((m) => m.status === 'error')), NO_LEADER_MS + FRESH_MS + 30000)
    const toldAfter = Math.min(...subscribers.map((s) => s.system.find((m) => m.status === 'error').at)) - frozen
    assert.ok(toldAfter >= NO_LEADER_MS, `told after ${Math.round(toldAfter)} ms, before the bound`)
    for (const s of subscribers) {
      const told = s.system.filter((m) => m.status === 'error')
      assert.equal(told.length, 1, `${s.name}: ${JSON.stringify(told)}`)
      assert.match(told[0].message, /^the database of project "default" \(source "default"\) is not streaming changes: no cdc-worker is reading it;/)
    }
    for (const w of workers) w.child.kill('SIGCONT')
    const again = 'the database of project "default" (source "default") streams changes again'
    await until('the clients told the source streams again', () => subscribers.every((s) => s.system.some((m) => m.status === 'ok' && m.message === again)), 60000)
    await leader()
    for (let i = 0; i < 5; i += 1) {
      await env.db.query("INSERT INTO tk VALUES ($1, 'after')", [nextId])
      nextId += 1
    }
    await allRows('after the recovery')
    console.log(`# no leader at all: told after ${Math.round(toldAfter)} ms`)
  })
})
