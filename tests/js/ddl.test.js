// Privileges and schema changes take effect at their WAL position, through the unmodified
// client, under a writer at ~200 rows/s, with both sources (stream and poll) and NATS:
// after a REVOKE no row committed later carries the revoked column, after the GRANT back
// every row does; after ADD COLUMN / RENAME COLUMN / ALTER COLUMN TYPE every row committed
// later has the new shape. A dropped table leaves the registry and its subscribers get a
// system error while other tables keep flowing. Without the event triggers (walcast's role
// is not a superuser) a REVOKE still never leaks.
//
// "Committed after" is decided on the database, not by time: `before` is the largest id
// visible right before the statement, `after` the largest visible right after it, both
// read on the connection that runs it. A row with id <= before committed before the
// statement; a row with id > after committed after it; in between it raced the statement.
// Rows arrive in commit order, so the shape may change only once, inside that window.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { once } from 'node:events'
import pg from 'pg'
import {
  startEnv,
  startProcess,
  enableTable,
  client,
  collector,
  subscribed,
  uniq,
  until,
  bin,
  jwt,
} from './lib/harness.js'

/**
 * An SSE stream (`/realtime/v1/sse`) read in the background: `events` collects
 * `{ event, data }` as they arrive; `ready` resolves on `event: ready`; `ended` once the
 * server ends the stream.
 */
function sseStream(server, query) {
  const ctl = new AbortController()
  const events = []
  let onReady
  const ready = new Promise((resolve) => (onReady = resolve))
  const ended = (async () => {
    const params = new URLSearchParams({ apikey: jwt({}), ...query })
    const res = await fetch(`${server.url}/realtime/v1/sse?${params}`, { signal: ctl.signal })
    if (res.status !== 200) assert.fail(`SSE status ${res.status}: ${await res.text()}`)
    const decoder = new TextDecoder()
    let buf = ''
    for await (const chunk of res.body) {
      buf += decoder.decode(chunk, { stream: true })
      for (let i = buf.indexOf('\n\n'); i >= 0; i = buf.indexOf('\n\n')) {
        const block = buf.slice(0, i)
        buf = buf.slice(i + 2)
        const field = (name) => block.split('\n').find((l) => l.startsWith(`${name}:`))?.slice(name.length + 1).trim()
        const ev = { event: field('event'), data: field('data') }
        events.push(ev)
        if (ev.event === 'ready') onReady()
      }
    }
  })().catch((e) => (e.name === 'AbortError' ? undefined : Promise.reject(e)))
  return { events, ready, ended, close: () => ctl.abort() }
}

/** Inserts into `d1` every 5 ms (about 200 rows/s) on its own connection. */
async function startWriter(url) {
  const c = new pg.Client({ connectionString: url })
  c.on('error', () => {})
  await c.connect()
  let running = true
  let k = 0
  const ids = []
  const errors = []
  const loop = (async () => {
    while (running) {
      const started = Date.now()
      try {
        k += 1
        const r = await c.query('INSERT INTO d1 (k) VALUES ($1) RETURNING id', [k])
        ids.push(Number(r.rows[0].id))
      } catch (e) {
        errors.push(e.message)
      }
      const rest = 5 - (Date.now() - started)
      if (rest > 0) await new Promise((r) => setTimeout(r, rest))
    }
  })()
  return {
    ids,
    errors,
    /** Resolve once `n` more rows were written. */
    async more(n, what) {
      const target = ids.length + n
      await until(`${n} more rows written (${what})`, () => ids.length >= target, 10000)
    },
    async stop() {
      running = false
      await loop
      await c.end()
      return ids.at(-1)
    },
  }
}

/** Run `sql` on `db` and return the id window around it (see the header). */
async function around(db, sql) {
  const max = async () => Number((await db.query('SELECT coalesce(max(id), 0) AS m FROM d1')).rows[0].m)
  const before = await max()
  await db.query(sql)
  const after = await max()
  return { before, after, sql }
}

/**
 * Check that in delivery order the rows switch from `old(row)` to `!old(row)` exactly
 * once, inside the window: every row <= before is old, every row > after is new.
 */
function assertSwitch(rows, w, isNew, what) {
  for (const r of rows) {
    if (r.id <= w.before) assert.ok(!isNew(r), `${what}: row ${r.id} committed before \`${w.sql}\` already has the new shape: ${JSON.stringify(r)}`)
    if (r.id > w.after) assert.ok(isNew(r), `${what}: row ${r.id} committed after \`${w.sql}\` has the old shape: ${JSON.stringify(r)}`)
  }
  const flips = rows.filter((r, i) => i > 0 && isNew(r) !== isNew(rows[i - 1]))
  assert.ok(flips.length <= 1, `${what}: the shape changed ${flips.length} times in commit order: ${flips.map((r) => r.id)}`)
}

/** Rows of `got` (INSERT payloads) with ids in (from, to], in arrival order. */
const rowsIn = (got, from, to) => got.items.map((p) => p.new).filter((r) => r.id > from && r.id <= to)

function assertOrdered(rows, what) {
  for (let i = 1; i < rows.length; i++) {
    assert.ok(rows[i].id > rows[i - 1].id, `${what}: row ${rows[i].id} arrived after ${rows[i - 1].id}`)
  }
}

async function realtimeList(env) {
  const child = spawn(bin('walcast'), ['realtime', 'list'], {
    env: { PATH: process.env.PATH, DATABASE_URL: env.database_url },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  let out = ''
  child.stdout.on('data', (d) => (out += d))
  child.stderr.on('data', (d) => (out += d))
  const [code] = await once(child, 'exit')
  assert.equal(code, 0, `walcast realtime list failed: ${out}`)
  return out.split('\n').filter(Boolean)
}

/** Is `public.<table>` in `walcast realtime list`? */
const listed = async (env, table) => (await realtimeList(env)).includes(`"public"."${table}"`)

const TABLE = `CREATE TABLE d1 (id bigserial PRIMARY KEY, k int NOT NULL, a text NOT NULL DEFAULT 'A',
               c text NOT NULL DEFAULT 'C')`

for (const source of ['stream', 'poll']) {
  describe(`CDC_SOURCE=${source}`, () => {
    // cdc-worker and ws-front as separate processes over NATS: the worker can restart
    // while the clients stay subscribed on the front.
    let env, worker, front, rt
    const startWorker = () => startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url, CDC_SOURCE: source })
    before(async () => {
      env = await startEnv()
      await env.db.query(TABLE)
      await env.db.query('CREATE TABLE d2 (id int PRIMARY KEY, v text)')
      worker = await startWorker()
      front = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
      await enableTable(env, 'd1')
      await enableTable(env, 'd2')
      rt = client(front)
    })
    after(async () => {
      rt?.disconnect()
      await front?.stop()
      await worker?.stop()
      await env?.stop()
    })

    test('the event triggers are in place and /health says so', async () => {
      const h = await worker.health()
      assert.equal(h.ddl_tracking, 'event_trigger', JSON.stringify(h))
    })

    test('REVOKE and GRANT back apply from their commit on, under a writer', async () => {
      const got = collector('d1')
      await subscribed(rt.channel(uniq('ddl')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'd1' }, got))
      const writer = await startWriter(env.database_url)
      try {
        await writer.more(40, 'before the REVOKE')
        const revoke = await around(env.db, 'REVOKE SELECT ON d1 FROM anon; GRANT SELECT (id, k, a) ON d1 TO anon')
        await writer.more(60, 'after the REVOKE')
        const grant = await around(env.db, 'GRANT SELECT ON d1 TO anon')
        await writer.more(60, 'after the GRANT')
        // REVOKE and GRANT back 0 ms apart: rows between them are never judged by the GRANT.
        const quick = await around(env.db, 'REVOKE SELECT (c) ON d1 FROM anon; REVOKE SELECT ON d1 FROM anon; GRANT SELECT (id, k, a) ON d1 TO anon')
        const back = await around(env.db, 'GRANT SELECT ON d1 TO anon')
        await writer.more(40, 'after the quick REVOKE/GRANT')
        const last = await writer.stop()
        assert.deepEqual(writer.errors, [])
        await got.wait(1, `row ${last}`, 20000)
        await until(`row ${last} at the client`, () => got.items.some((p) => p.new.id === last), 20000)

        const hasC = (r) => 'c' in r
        const all = got.items.map((p) => p.new)
        assertOrdered(all, 'commit order')
        // Every row with the column carries its value; no row lacks a readable column.
        for (const r of all) {
          assert.equal(r.a, 'A', JSON.stringify(r))
          if (hasC(r)) assert.equal(r.c, 'C')
        }
        // Around the REVOKE: with c, then without.
        assertSwitch(rowsIn(got, 0, grant.before), revoke, (r) => !hasC(r), 'REVOKE')
        assert.ok(rowsIn(got, revoke.after, grant.before).length > 0, 'rows between REVOKE and GRANT arrived')
        // Around the GRANT back: without, then with; the first row after it has c.
        assertSwitch(rowsIn(got, revoke.after, quick.before), grant, hasC, 'GRANT')
        const firstAfterGrant = all.find((r) => r.id > grant.after)
        assert.ok(firstAfterGrant && hasC(firstAfterGrant), `first row after the GRANT: ${JSON.stringify(firstAfterGrant)}`)
        // The quick pair: no row committed between them carries c.
        for (const r of rowsIn(got, quick.after, back.before)) {
          assert.ok(!hasC(r), `row ${r.id} committed between the quick REVOKE and GRANT carries c`)
        }
        for (const r of rowsIn(got, back.after, last)) assert.ok(hasC(r), `row ${r.id} after the quick GRANT lacks c`)
        // Nothing was withheld: a row judged after the GRANT already committed is judged
        // by the state the REVOKE's notice carried.
        const arrived = new Set(all.map((r) => r.id))
        assert.deepEqual(writer.ids.filter((id) => !arrived.has(id)), [], 'rows lost')
      } finally {
        await writer.stop().catch(() => {})
      }
    })

    test('ADD COLUMN, RENAME COLUMN and ALTER COLUMN TYPE: every row committed after has the new shape', async () => {
      const got = collector('d1 shape')
      await subscribed(rt.channel(uniq('shape')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'd1' }, got))
      const writer = await startWriter(env.database_url)
      try {
        await writer.more(30, 'before ADD COLUMN')
        const add = await around(env.db, 'ALTER TABLE d1 ADD COLUMN e int NOT NULL DEFAULT 7')
        await writer.more(60, 'after ADD COLUMN')
        const rename = await around(env.db, 'ALTER TABLE d1 RENAME COLUMN c TO c2')
        await writer.more(60, 'after RENAME COLUMN')
        const retype = await around(env.db, 'ALTER TABLE d1 ALTER COLUMN k TYPE text USING k::text')
        await writer.more(60, 'after ALTER COLUMN TYPE')
        const last = await writer.stop()
        assert.deepEqual(writer.errors, [])
        await until(`row ${last} at the client`, () => got.items.some((p) => p.new.id === last), 20000)
        const all = got.items.map((p) => p.new)
        assertOrdered(all, 'commit order')
        const start = Math.min(...all.map((r) => r.id)) - 1

        assertSwitch(rowsIn(got, start, rename.before), add, (r) => r.e === 7, 'ADD COLUMN')
        assertSwitch(rowsIn(got, add.after, retype.before), rename, (r) => r.c2 === 'C' && !('c' in r), 'RENAME COLUMN')
        assertSwitch(rowsIn(got, rename.after, last), retype, (r) => typeof r.k === 'string', 'ALTER COLUMN TYPE')
        for (const r of rowsIn(got, retype.after, last)) {
          assert.deepEqual(Object.keys(r).sort(), ['a', 'c2', 'e', 'id', 'k'], JSON.stringify(r))
          assert.equal(r.c2, 'C')
        }
        const arrived = new Set(all.map((r) => r.id))
        assert.deepEqual(writer.ids.filter((id) => id > start && !arrived.has(id)), [], 'rows lost')
      } finally {
        await writer.stop().catch(() => {})
      }
    })

    test('a restarted worker resumes at the epoch of its position: nothing withheld, shape as committed', async () => {
      const got = collector('d1 across a restart')
      await subscribed(rt.channel(uniq('restart')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'd1' }, got))
      const insert = async (n) => {
        const ids = []
        for (let i = 0; i < n; i++) ids.push(Number((await env.db.query('INSERT INTO d1 (k) VALUES (2) RETURNING id')).rows[0].id))
        return ids
      }
      // Two notices in one transaction (one position), a row after them delivered (so
      // the slot is acknowledged past them), then a restart from the slot.
      await env.db.query('REVOKE SELECT ON d1 FROM anon; GRANT SELECT ON d1 TO anon')
      const [marker] = await insert(1)
      await until(`row ${marker} before the restart`, () => got.items.some((p) => p.new.id === marker), 15000)
      await worker.stop()
      worker = await startWorker()
      const ids = await insert(20)
      await until('the 20 rows after the restart', () => got.items.some((p) => p.new.id === ids.at(-1)), 20000)
      assert.deepEqual(got.items.map((p) => p.new.id), [marker, ...ids])
      assert.ok(got.items.every((p) => p.new.c2 === 'C' && p.new.e === 7), JSON.stringify(got.items[0]))
      assert.doesNotMatch(worker.log(), /withholding/)

      // Catching up a backlog: a REVOKE and the GRANT back both committed while the
      // worker was down. The rows between them never carry the column and none is
      // withheld (judged by the state the REVOKE's notice carried).
      await worker.stop()
      const before = await insert(5)
      await env.db.query('REVOKE SELECT ON d1 FROM anon; GRANT SELECT (id, k, a) ON d1 TO anon')
      const between = await insert(5)
      await env.db.query('GRANT SELECT ON d1 TO anon')
      const afterGrant = await insert(5)
      worker = await startWorker()
      await until('the backlog at the client', () => got.items.some((p) => p.new.id === afterGrant.at(-1)), 20000)
      const tail = got.items.slice(1 + ids.length).map((p) => p.new)
      assert.deepEqual(tail.map((r) => r.id), [...before, ...between, ...afterGrant])
      for (const r of tail) {
        const inside = between.includes(r.id)
        assert.equal('c2' in r, !inside, `row ${r.id} (${inside ? 'between REVOKE and GRANT' : 'outside'}): ${JSON.stringify(r)}`)
      }
      assert.doesNotMatch(worker.log(), /withholding/)
    })

    test('DROP TABLE: the table leaves the registry, its subscribers get a system error, others keep flowing', async () => {
      const sys = collector('d2 system')
      const gone = collector('d2 changes')
      const ch2 = rt.channel(uniq('drop')).on('system', {}, sys).on('postgres_changes', { event: '*', schema: 'public', table: 'd2' }, gone)
      await subscribed(ch2)
      const sse = sseStream(front, { table: 'd2', channel: uniq('sse-d2') })
      await Promise.race([
        sse.ready,
        sse.ended.then(() => assert.fail(`SSE ended before ready: ${JSON.stringify(sse.events)}`)),
        new Promise((_, reject) => setTimeout(() => reject(new Error(`no SSE ready within 15 s: ${JSON.stringify(sse.events)}`)), 15000)),
      ])
      const got = collector('d1 after drop')
      await subscribed(rt.channel(uniq('keep')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'd1' }, got))
      await env.db.query("INSERT INTO d2 VALUES (1, 'before')")
      await gone.wait(1, 'the d2 row before the drop')
      assert.ok(await listed(env, 'd2'), 'd2 listed before the drop')

      await env.db.query('DROP TABLE d2')
      await until('a system error on the d2 channel', () => sys.items.some((m) => m.status === 'error'), 15000)
      const err = sys.items.find((m) => m.status === 'error')
      assert.match(err.message, /public\.d2 was dropped/)
      assert.equal(err.extension, 'postgres_changes')
      assert.ok(!(await listed(env, 'd2')), 'd2 still listed')
      assert.ok(await listed(env, 'd1'), 'd1 no longer listed')
      // The SSE reader of d2 is told the same, then its stream ends.
      await Promise.race([sse.ended, new Promise((_, reject) => setTimeout(() => reject(new Error(`the SSE stream of d2 did not end: ${JSON.stringify(sse.events)}`)), 15000))])
      const last = sse.events.at(-1)
      assert.equal(last.event, 'system', JSON.stringify(sse.events))
      assert.match(JSON.parse(last.data).message, /public\.d2 was dropped/)
      assert.deepEqual(sse.events.filter((e) => e.event === 'postgres_changes').map((e) => JSON.parse(e.data).data.record), [{ id: 1, v: 'before' }])

      const r = await env.db.query('INSERT INTO d1 (k) VALUES (1) RETURNING id')
      const id = Number(r.rows[0].id)
      await until(`d1 row ${id} after the drop`, () => got.items.some((p) => p.new.id === id), 15000)
      assert.deepEqual(gone.items.map((p) => p.new), [{ id: 1, v: 'before' }])
      const h = await worker.health()
      assert.equal(h.cdc_active, true)
    })
  })
}

describe('without the event triggers (walcast role not a superuser)', () => {
  let env, server, rt, appUrl
  before(async () => {
    env = await startEnv()
    const db = env.db
    // What a DBA gives a non-superuser walcast: login, replication, the subscriber roles.
    await db.query(`CREATE ROLE walcast_app LOGIN REPLICATION PASSWORD 'app';
      CREATE ROLE anon NOLOGIN NOINHERIT; CREATE ROLE authenticated NOLOGIN NOINHERIT;
      CREATE ROLE service_role NOLOGIN NOINHERIT BYPASSRLS;
      GRANT anon, authenticated, service_role TO walcast_app;
      GRANT anon, authenticated TO walcast_check;
      GRANT CREATE ON DATABASE postgres TO walcast_app;
      CREATE SCHEMA walcast AUTHORIZATION walcast_app; CREATE SCHEMA auth AUTHORIZATION walcast_app`)
    await db.query(TABLE)
    const u = new URL(env.database_url)
    u.username = 'walcast_app'
    u.password = 'app'
    appUrl = u.toString()
    server = await startProcess({ ...env, database_url: appUrl }, 'walcast', ['serve'], { NATS_URL: env.nats_url })
    await enableTable(env, 'd1')
    rt = client(server)
  })
  after(async () => {
    rt?.disconnect()
    await server?.stop()
    await env?.stop()
  })

  test('/health reports per-batch tracking and no trigger was created', async () => {
    const h = await server.health()
    assert.equal(h.ddl_tracking, 'per_batch', JSON.stringify(h))
    const t = await env.db.query("SELECT evtname FROM pg_event_trigger WHERE evtname LIKE 'walcast%'")
    assert.deepEqual(t.rows, [])
    assert.match(server.log(), /not tracked at their WAL position/)
  })

  test('a REVOKE never leaks: no row committed after it carries the column', async () => {
    const got = collector('d1 fallback')
    await subscribed(rt.channel(uniq('fb')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'd1' }, got))
    const writer = await startWriter(env.database_url)
    try {
      await writer.more(40, 'before the REVOKE')
      const revoke = await around(env.db, 'REVOKE SELECT ON d1 FROM anon; GRANT SELECT (id, k, a) ON d1 TO anon')
      await writer.more(80, 'after the REVOKE')
      const last = await writer.stop()
      await until(`row ${last} at the client`, () => got.items.some((p) => p.new.id === last), 20000)
      const all = got.items.map((p) => p.new)
      assertOrdered(all, 'commit order')
      for (const r of all.filter((r) => r.id > revoke.after)) {
        assert.ok(!('c' in r), `row ${r.id} committed after the REVOKE carries c`)
      }
      assert.ok(all.some((r) => r.id <= revoke.before && r.c === 'C'), 'rows before the REVOKE carried c')
    } finally {
      await writer.stop().catch(() => {})
    }
  })

  test('a dropped table leaves the registry and its subscribers are told', async () => {
    await env.db.query('CREATE TABLE d3 (id int PRIMARY KEY)')
    await enableTable(env, 'd3')
    const sys = collector('d3 system')
    await subscribed(rt.channel(uniq('fbdrop')).on('system', {}, sys).on('postgres_changes', { event: '*', schema: 'public', table: 'd3' }, () => {}))
    await env.db.query('DROP TABLE d3')
    // Without sql_drop, the periodic registry check (TABLE_FILTER_REFRESH_MS) finds it.
    await until('a system error on the d3 channel', () => sys.items.some((m) => m.status === 'error'), 20000)
    assert.ok(!(await listed(env, 'd3')), 'd3 still listed')
  })
})
