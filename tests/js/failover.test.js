// Positions survive faults: while a writer commits one row after another, the leading
// cdc-worker is killed with SIGKILL (a standby takes over), restarted, and Postgres is
// crash-restarted (`-m immediate`), each three times. realtime-js clients on two ws-front
// processes must receive every committed row exactly once, in commit order: the backlog a
// new leader replays is matched against every subscription from its own position, and the
// fronts drop what they already delivered.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { writeFile } from 'node:fs/promises'
import os from 'node:os'
import path from 'node:path'
import { startEnv, startProcess, enableTable, client, subscribed, uniq, until } from './lib/harness.js'

const LEASE = '3'

/** `[1,2,3,7,8]` → `1-3,7-8`. */
const ranges = (ids) => {
  const out = []
  for (const id of ids) {
    const last = out[out.length - 1]
    if (last && id === last[1] + 1) last[1] = id
    else out.push([id, id])
  }
  return out.map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`)).join(',')
}

/**
 * One row per transaction into `f`, one after another from `firstId`, until `stop()`; a
 * failed insert (Postgres restarting) is tried again with the same id (it may have
 * committed). `rowsBeyond(n)` resolves once n more rows were written.
 */
function startWriter(env, firstId) {
  let stop = false
  let nextId = firstId
  const done = (async () => {
    while (!stop) {
      try {
        await env.db.query("INSERT INTO f VALUES ($1, 'w') ON CONFLICT DO NOTHING", [nextId])
        nextId += 1
      } catch {
        await new Promise((r) => setTimeout(r, 50))
      }
      await new Promise((r) => setTimeout(r, 5))
    }
  })()
  return {
    async rowsBeyond(n) {
      const target = nextId + n
      await until(`the writer to pass row ${target}`, () => nextId >= target, 60000)
    },
    async stop() {
      stop = true
      await done
    },
  }
}

for (const source of ['stream', 'poll']) {
  describe(`CDC_SOURCE=${source}`, () => {
    let env, front1, front2
    const workers = []
    const clients = []
    const startWorker = async () => {
      const w = await startProcess(env, 'cdc-worker', [], {
        NATS_URL: env.nats_url,
        CDC_SOURCE: source,
        LEASE_MODE: 'postgres',
        LEASE_DURATION_SECS: LEASE,
      }, { standby: workers.length > 0 })
      workers.push(w)
      return w
    }
    /** Every process's log in one file (for a failure message); returns its path. */
    const saveLogs = async () => {
      const names = ['front1', 'front2', ...workers.map((_, i) => `cdc-worker ${i}`)]
      const logs = [front1, front2, ...workers].map((p, i) => `=== ${names[i]}\n${p.log()}`).join('\n')
      const file = path.join(os.tmpdir(), `walcast-failover-${source}-${process.pid}.log`)
      await writeFile(file, logs)
      return file
    }
    const alive = () => workers.filter((w) => w.child.exitCode === null && w.child.signalCode === null)
    const leader = async () => {
      let found
      await until('a leading cdc-worker that reads the slot', async () => {
        for (const w of alive()) {
          const h = await w.health().catch(() => ({}))
          if (h.leader && h.cdc_active) found = w
        }
        return found !== undefined
      }, 60000)
      return found
    }

    before(async () => {
      env = await startEnv()
      await env.db.query('CREATE TABLE f (id int8 PRIMARY KEY, v text)')
      await startWorker()
      await enableTable(env, 'f')
      await startWorker()
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
      await env?.stop()
    })

    test('leader kill -9, worker restart and Postgres crash restart, 3 times each, under a writer: every row exactly once, in order, on both fronts', async () => {
      const subscribers = []
      for (const [front, vsn] of [[front1, '2.0.0'], [front2, '2.0.0'], [front1, '1.0.0'], [front2, '1.0.0']]) {
        const rt = client(front, { vsn, logger: () => {} })
        clients.push(rt)
        const got = []
        await subscribed(rt.channel(uniq('f')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'f' }, (p) => got.push(p.new.id)))
        subscribers.push({ name: `front${front === front1 ? 1 : 2}/vsn ${vsn}`, got })
      }

      const writer = startWriter(env, 1)
      const rowsBeyond = writer.rowsBeyond
      const faults = []
      for (let round = 0; round < 3; round += 1) {
        await rowsBeyond(30)
        const l = await leader()
        l.child.kill('SIGKILL')
        faults.push('leader kill -9')
        await startWorker()
        await rowsBeyond(30)
        await leader()

        const r = await leader()
        await r.stop()
        faults.push('worker restart')
        await startWorker()
        await rowsBeyond(30)
        await leader()

        await env.command('restart-postgres')
        faults.push('postgres restart -m immediate')
        await rowsBeyond(30)
        await leader()
      }
      await writer.stop()

      const { rows } = await env.db.query('SELECT id FROM f ORDER BY id')
      const expected = rows.map((r) => Number(r.id))
      assert.ok(expected.length >= 270, `the writer committed ${expected.length} rows`)
      try {
        for (const s of subscribers) {
          await until(
            `${s.name} to receive all ${expected.length} rows (has ${s.got.length})`,
            () => s.got.length >= expected.length,
            60000,
          )
        }
      } catch (e) {
        const missing = subscribers.map((s) => {
          const have = new Set(s.got.map(Number))
          return `${s.name}: missing ${JSON.stringify(expected.filter((id) => !have.has(id)))}`
        })
        const file = await saveLogs()
        throw new Error(`${e.message}; ${missing.join('; ')}; faults: ${faults.join(', ')}; process logs in ${file}`)
      }
      for (const s of subscribers) {
        const ids = s.got.map(Number)
        const dups = ids.filter((id, i) => ids.indexOf(id) !== i)
        assert.deepEqual(dups, [], `${s.name} received duplicates`)
        assert.deepEqual(ids, expected, `${s.name}: every committed row once, in commit order (faults: ${faults.join(', ')})`)
      }
    })

    // A new leader waits for every front it knows to be alive, not only for those that
    // answer its resync request within the grace: front1 is paused (SIGSTOP) for longer
    // than that grace while the leader is killed, and must still get every row.
    test('a front paused through a takeover, longer than the resync grace, still gets every row', async () => {
      const { rows } = await env.db.query('SELECT coalesce(max(id), 0)::int8 AS m FROM f')
      const first = Number(rows[0].m) + 1
      const subscribers = []
      for (const [name, front] of [['front1', front1], ['front2', front2]]) {
        const rt = client(front, { logger: () => {} })
        clients.push(rt)
        const got = []
        const on = (p) => Number(p.new.id) >= first && got.push(Number(p.new.id))
        await subscribed(rt.channel(uniq('p')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'f' }, on))
        subscribers.push({ name, got })
      }
      const writer = startWriter(env, first)
      await writer.rowsBeyond(20)
      const old = await leader()
      front1.child.kill('SIGSTOP')
      try {
        old.child.kill('SIGKILL')
        await startWorker()
        await until('a new term to begin (a worker says it leads)', async () => {
          for (const w of alive()) {
            if ((await w.health().catch(() => ({}))).leader) return true
          }
          return false
        }, 60000)
        // The pause is the fault: it goes on for four times the resync grace (500 ms)
        // after the new leader asked the fronts to register again.
        await new Promise((r) => setTimeout(r, 2000))
      } finally {
        front1.child.kill('SIGCONT')
      }
      await leader()
      await writer.rowsBeyond(30)
      await writer.stop()
      const all = await env.db.query('SELECT id FROM f WHERE id >= $1 ORDER BY id', [first])
      const expected = all.rows.map((r) => Number(r.id))
      for (const s of subscribers) {
        const missing = () => JSON.stringify(expected.filter((id) => !s.got.includes(id)).slice(0, 20))
        await until(`${s.name} to receive all ${expected.length} rows`, () => s.got.length >= expected.length, 30000).catch(async (e) => {
          throw new Error(`${e.message} (has ${s.got.length}: ${ranges(s.got)}; missing ${missing()}); process logs in ${await saveLogs()}`)
        })
        assert.deepEqual(s.got, expected, `${s.name}: every row once, in commit order`)
      }
    })
  })
}
