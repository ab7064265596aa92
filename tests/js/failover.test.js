// Positions survive faults: while a writer commits one row after another, the leading
// cdc-worker is killed with SIGKILL (a standby takes over), restarted, and Postgres is
// crash-restarted (`-m immediate`), each three times. realtime-js clients on two ws-front
// processes must receive every committed row exactly once, in commit order: the backlog a
// new leader replays is matched against every subscription from its own position, and the
// fronts drop what they already delivered.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, subscribed, uniq, until } from './lib/harness.js'

const LEASE = '3'

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

      // One row per transaction, one after another, until told to stop; a failed insert
      // (Postgres restarting) is tried again with the same id (it may have committed).
      let stop = false
      let nextId = 1
      const writer = (async () => {
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
      const rowsBeyond = async (n) => {
        const target = nextId + n
        await until(`the writer to pass row ${target}`, () => nextId >= target, 60000)
      }

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
      stop = true
      await writer

      const { rows } = await env.db.query('SELECT id FROM f ORDER BY id')
      const expected = rows.map((r) => Number(r.id))
      assert.ok(expected.length >= 270, `the writer committed ${expected.length} rows`)
      for (const s of subscribers) {
        await until(
          `${s.name} to receive all ${expected.length} rows (has ${s.got.length})`,
          () => s.got.length >= expected.length,
          60000,
        )
      }
      for (const s of subscribers) {
        const ids = s.got.map(Number)
        const dups = ids.filter((id, i) => ids.indexOf(id) !== i)
        assert.deepEqual(dups, [], `${s.name} received duplicates`)
        assert.deepEqual(ids, expected, `${s.name}: every committed row once, in commit order (faults: ${faults.join(', ')})`)
      }
    })
  })
}
