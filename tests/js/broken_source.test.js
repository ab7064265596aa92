// A broken source, seen by its clients (docs/architecture.md "Several databases: a leader
// per source": "A source whose database is down stops nothing else; its clients and
// /health say why").
// Two sources besides the default, each with a project, read by one cdc-worker; a
// realtime-js client of each project on one ws-front. Then s2's database goes down: a
// realtime-js client joining postgres_changes of p2 (no worker leads s2 any more) gets a
// channel error saying that its project's database (source s2) is not streaming and why,
// as a class (it cannot be reached), with nothing of the error itself (no host, no port)
// nor of other sources;
// a client of p2 subscribed before is told the same (a system error; it stays subscribed);
// the client of p1 on the same front keeps receiving every row, once, in order; the
// worker's /health names s2's error for the operator. When s2's database comes back, the
// subscribed p2 client is told it streams again and gets the rows written since.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, client, subscribe, subscribed, uniq, until } from './lib/harness.js'
import { enableViaRest } from './lib/tenants.js'
import { addSources, connectUrl, migrate, WORKER_ENV } from './lib/sources.js'

/** A source's entry in a worker's /health. */
async function sourceHealth(w, name) {
  const h = await w.health().catch(() => ({}))
  return (h.sources ?? []).find((s) => s.name === name)
}

describe('a broken source, seen by its clients', () => {
  let env, worker, front
  const clients = []
  const dbs = []
  const projects = []

  before(async () => {
    env = await startEnv({ extraPostgres: 2 })
    await migrate(env)
    for (const p of await addSources(env)) {
      dbs.push(p.db)
      projects.push(p)
    }
    worker = await startProcess(env, 'cdc-worker', [], WORKER_ENV(env), { standby: true })
    front = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
  })

  after(async () => {
    for (const rt of clients) {
      await rt.removeAllChannels().catch(() => {})
      await rt.disconnect()
    }
    await front?.stop()
    await worker?.stop().catch(() => {})
    for (const db of dbs) await db.end().catch(() => {})
    await env?.stop()
  })

  test("a client of a project whose database is down is told why; another source's client keeps its changes", async () => {
    await until('both sources streaming', async () => {
      const all = await Promise.all(['s1', 's2'].map((s) => sourceHealth(worker, s)))
      return all.every((s) => s?.leader && s?.cdc_active)
    }, 90000)
    for (const p of projects) {
      const r = await enableViaRest(front, p.id, 't', p.service_role_key)
      assert.equal(r.status, 200, `enable on ${p.name}: ${r.body}`)
    }
    const [p1, p2] = projects

    // p1's client, subscribed while everything runs.
    const healthy = client(front, { apikey: p1.anon_key })
    clients.push(healthy)
    const got = []
    const ch1 = healthy.channel(uniq('t')).on('postgres_changes', { event: 'INSERT', schema: p1.schema, table: 't' }, (m) => got.push(Number(m.new.id)))
    await subscribed(ch1)
    await p1.db.query(`INSERT INTO ${p1.schema}.t VALUES (1, 'before')`)
    await until('p1 row 1', () => got.length >= 1, 30000)

    // p2's client, subscribed while everything runs: told when its database stops and
    // when it streams again; its subscription goes on.
    const early = client(front, { apikey: p2.anon_key })
    clients.push(early)
    const earlyGot = []
    const earlySystem = []
    const ch0 = early.channel(uniq('t'))
      .on('postgres_changes', { event: 'INSERT', schema: p2.schema, table: 't' }, (m) => earlyGot.push(Number(m.new.id)))
      .on('system', {}, (m) => earlySystem.push(m))
    await subscribed(ch0)
    await p2.db.query(`INSERT INTO ${p2.schema}.t VALUES (1, 'before')`)
    await until('p2 row 1', () => earlyGot.length >= 1, 30000)

    // s2's database goes down.
    await p2.db.end().catch(() => {})
    await env.command('stop-extra-postgres 1')
    let s2
    await until("s2 reported down on the worker's /health, its term over", async () => {
      s2 = await sourceHealth(worker, 's2')
      return s2 && !s2.leader && !s2.cdc_active && !!s2.last_error
    }, 60000)
    console.log(`s2 on /health: ${s2.last_error}`)

    // A client of p2 joins: its channel errors, saying why.
    const broken = client(front, { apikey: p2.anon_key })
    clients.push(broken)
    // (Another class than the subscribed client's, which this front would join at once.)
    const ch2 = broken.channel(uniq('t')).on('postgres_changes', { event: 'INSERT', schema: p2.schema, table: 't', filter: 'id=gt.0' }, () => {})
    const { status, err } = await subscribe(ch2, 30000)
    assert.equal(status, 'CHANNEL_ERROR', `p2's join: ${status} ${err?.message}`)
    const said = err.message
    console.log(`p2's client was told: ${said}`)
    assert.match(said, /^UnableToSubscribe: Unable to subscribe to changes: /, said)
    assert.ok(said.includes(`the database of project "${p2.id}" (source "s2") is not streaming changes`), said)
    assert.ok(said.endsWith('its database cannot be reached'), said)
    const port = new URL(env.extra_database_urls[1]).port
    for (const secret of ['127.0.0.1', port, 's1', p1.id, 'postgres://']) {
      assert.ok(!said.includes(secret), `nothing of the error itself nor of other sources (${secret}): ${said}`)
    }
    await broken.removeAllChannels().catch(() => {})

    // An SSE stream of p2 (another class again) is refused the same way.
    const sse = await fetch(`${front.url}/realtime/v1/sse?apikey=${p2.anon_key}&schema=${p2.schema}&table=t&event=UPDATE`)
    const sseBody = await sse.text()
    assert.equal(sse.status, 503, sseBody)
    assert.equal(JSON.parse(sseBody).error, `Unable to subscribe to changes: the database of project "${p2.id}" (source "s2") is not streaming changes: its database cannot be reached`)

    // The client subscribed before is told too, once, and stays subscribed.
    const down = `the database of project "${p2.id}" (source "s2") is not streaming changes: its database cannot be reached`
    await until("the subscribed p2 client told its database stopped", () => earlySystem.some((m) => m.status === 'error'), 30000)
    const told = earlySystem.filter((m) => m.status === 'error')
    assert.equal(told.length, 1, JSON.stringify(earlySystem))
    assert.ok(told[0].message.startsWith(down), told[0].message)
    assert.equal(told[0].extension, 'postgres_changes')
    assert.equal(ch0.state, 'joined')

    // p1's client, on the same front, keeps receiving every row once, in order.
    for (let id = 2; id <= 20; id += 1) await p1.db.query(`INSERT INTO ${p1.schema}.t VALUES ($1, 'after')`, [id])
    await until('p1 rows after s2 went down', () => got.length >= 20, 60000)
    await new Promise((r) => setTimeout(r, 500))
    assert.deepEqual(got, Array.from({ length: 20 }, (_, i) => i + 1), 'p1: every row once, in order')
    assert.ok((await sourceHealth(worker, 's1'))?.cdc_active, 's1 streams on')

    // s2's database comes back: the subscribed client is told, and gets what is written.
    await env.command('start-extra-postgres 1')
    await until('s2 streaming again', async () => (await sourceHealth(worker, 's2'))?.cdc_active, 90000)
    const again = `the database of project "${p2.id}" (source "s2") streams changes again`
    await until('the subscribed p2 client told its database streams again', () => earlySystem.some((m) => m.status === 'ok' && m.message === again), 30000)
    p2.db = await connectUrl(env.extra_database_urls[1])
    dbs.push(p2.db)
    for (let id = 2; id <= 5; id += 1) await p2.db.query(`INSERT INTO ${p2.schema}.t VALUES ($1, 'after')`, [id])
    await until('p2 rows after its database came back', () => earlyGot.length >= 5, 60000)
    assert.deepEqual(earlyGot, [1, 2, 3, 4, 5], 'p2: every row once, in order')
  })
})
