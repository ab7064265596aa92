// Several databases (docs/architecture.md "Several databases: a leader per source"):
// three Postgres instances, each a source with a project (the default one, and two added
// with `walcast source add`, their projects made with `walcast project create --source`,
// their tables enabled through a front's REST API, which the source's leader answers).
// Two cdc-workers share the sources; realtime-js clients on two ws-fronts follow a table
// in each. Every row of every source reaches its clients once, in commit order per
// source, and neither worker leads all three. Then, with a third worker, under writers on
// every source: kill -9 the worker leading s1, then SIGSTOP its successor past the lease:
// every source is taken over, and every client still gets every row once, in order.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, subscribed, uniq, until } from './lib/harness.js'
import { enableViaRest } from './lib/tenants.js'
import { addSources, migrate, WORKER_ENV } from './lib/sources.js'

const ROWS = 40

/** One row per transaction into each project's table, ids from `first`, until stopped. */
function startWriters(projects, first) {
  let stop = false
  const written = {}
  const done = Promise.all(projects.map(async (p) => {
    let id = first
    while (!stop) {
      try {
        await p.db.query(`INSERT INTO ${p.schema}.t VALUES ($1, 'w')`, [id])
        id += 1
      } catch {
        await new Promise((r) => setTimeout(r, 50))
      }
      await new Promise((r) => setTimeout(r, 20))
    }
    written[p.name] = id - 1
  }))
  return { async stop() { stop = true; await done; return written } }
}

/** The sources a worker leads with an active pipeline. */
async function leading(w) {
  const h = await w.health().catch(() => ({}))
  const out = []
  if (h.leader && h.cdc_active) out.push('default')
  for (const s of h.sources ?? []) if (s.leader && s.cdc_active) out.push(s.name)
  return out.sort()
}

describe('sources', () => {
  let env, front1, front2
  const workers = []
  const clients = []
  const dbs = []
  const projects = []

  before(async () => {
    env = await startEnv({ extraPostgres: 2 })
    await migrate(env)
    await env.db.query('CREATE TABLE t (id int8 PRIMARY KEY, v text)')
    await enableTable(env, 't')
    projects.push({ name: 'default', schema: 'public', anon_key: undefined, db: env.db })
    for (const p of await addSources(env)) {
      dbs.push(p.db)
      projects.push(p)
    }
    for (let i = 0; i < 2; i += 1) {
      workers.push(await startProcess(env, 'cdc-worker', [], WORKER_ENV(env), { standby: true }))
    }
    front1 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
    front2 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
  })

  after(async () => {
    for (const rt of clients) {
      await rt.removeAllChannels().catch(() => {})
      await rt.disconnect()
    }
    await front1?.stop()
    await front2?.stop()
    for (const w of workers) await w.stop().catch(() => {})
    for (const db of dbs) await db.end().catch(() => {})
    await env?.stop()
  })

  test('three sources over two workers: every row of each reaches clients on both fronts once, in order; then a kill -9 and a freeze of workers lose nothing', async () => {
    let held = []
    await until('the three sources led, spread over both workers', async () => {
      held = await Promise.all(workers.map(leading))
      const all = held.flat().sort()
      return JSON.stringify(all) === JSON.stringify(['default', 's1', 's2']) && held.every((h) => h.length < 3)
    }, 90000)
    for (const p of projects.slice(1)) {
      // Answered by the leader of the project's source, through the front.
      const r = await enableViaRest(front1, p.id, 't', p.service_role_key)
      assert.equal(r.status, 200, `enable on ${p.name}: ${r.body}`)
    }
    const subscribers = []
    for (const p of projects) {
      for (const front of [front1, front2]) {
        const rt = client(front, p.anon_key ? { apikey: p.anon_key } : {})
        clients.push(rt)
        const got = []
        const ch = rt.channel(uniq('t')).on('postgres_changes', { event: 'INSERT', schema: p.schema, table: 't' }, (m) => got.push(Number(m.new.id)))
        await subscribed(ch)
        subscribers.push({ name: `${p.name} on ${front === front1 ? 'front1' : 'front2'}`, got })
      }
    }
    for (let id = 1; id <= ROWS; id += 1) {
      for (const p of projects) await p.db.query(`INSERT INTO ${p.schema}.t VALUES ($1, 'x')`, [id])
    }
    const want = Array.from({ length: ROWS }, (_, i) => i + 1)
    await until('every row at every client', () => subscribers.every((s) => s.got.length >= ROWS), 60000)
    await new Promise((r) => setTimeout(r, 500))
    for (const s of subscribers) assert.deepEqual(s.got, want, `${s.name}: once, in commit order`)
    console.log(`spread: ${held.map((h) => h.join('+')).join(' | ')}`)

    // A third worker: one source each. Then a kill -9 and a freeze, under writers.
    workers.push(await startProcess(env, 'cdc-worker', [], WORKER_ENV(env), { standby: true }))
    await until('one source per worker', async () => {
      held = await Promise.all(workers.map(leading))
      return held.every((h) => h.length === 1) && held.flat().length === 3
    }, 90000)
    const writers = startWriters(projects, ROWS + 1)
    await new Promise((r) => setTimeout(r, 1500))
    const leaderOf = async (source, skip) => {
      for (const [i, w] of workers.entries()) {
        if (skip.includes(i)) continue
        if ((await leading(w)).includes(source)) return i
      }
      return -1
    }
    const killed = await leaderOf('s1', [])
    workers[killed].child.kill('SIGKILL')
    let successor = -1
    await until('s1 taken over after kill -9', async () => {
      successor = await leaderOf('s1', [killed])
      return successor >= 0
    }, 30000)
    await new Promise((r) => setTimeout(r, 1500))
    const frozen = workers[successor]
    frozen.child.kill('SIGSTOP')
    await until('every source led by the last worker', async () => {
      const i = [0, 1, 2].find((j) => j !== killed && j !== successor)
      return (await leading(workers[i])).length === 3
    }, 30000)
    await new Promise((r) => setTimeout(r, 6000))
    frozen.child.kill('SIGCONT')
    await new Promise((r) => setTimeout(r, 2000))
    const written = await writers.stop()
    await until('every row at every client after the faults', () => subscribers.every((s) => {
      const p = s.name.split(' on ')[0]
      return s.got.length >= written[p]
    }), 90000)
    await new Promise((r) => setTimeout(r, 1000))
    for (const s of subscribers) {
      const p = s.name.split(' on ')[0]
      const all = Array.from({ length: written[p] }, (_, i) => i + 1)
      assert.deepEqual(s.got, all, `${s.name}: every row once, in order, across kill -9 and SIGSTOP`)
    }
    console.log(`after the faults: ${JSON.stringify(written)} rows written`)
  })
})
