// A frozen leader is replaced and fenced. While a writer commits one row after
// another, the leading cdc-worker is stopped with SIGSTOP for 30 s (a long stall, a paused
// VM, a stuck network path: it keeps its sockets and sessions), in both lease modes
// (Postgres lease row; Kubernetes Lease against the test kit's fake API server) and both
// sources. Changes must flow again within the lease duration plus a bounded margin; once
// continued, the old leader must step down and publish nothing new: checked on NATS itself
// (a message it had buffered before freezing may leave when it wakes, but only with its
// old, lower term, and the fronts drop it; each leader's messages in strictly increasing
// (commit_lsn, seq)), and realtime-js clients on two fronts get every row exactly once, in
// commit order.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, subscribed, uniq, until } from './harness.js'
import { natsTap } from './nats_tap.js'

const LEASE_SECS = 6
const FREEZE_MS = 30000
// Worst case from the freeze (docs/architecture.md, Leader election and fencing):
// Postgres, the lease expires one duration after the last renewal (which came before the
// freeze) and a follower reads again right then; Kubernetes, a follower must see the last version
// unchanged for a full duration and reads every third of it, so up to two thirds more.
// Then the new leader starts reading: 3 s of margin for that on a busy machine.
const takeoverBoundMs = (mode) => LEASE_SECS * 1000 * (mode === 'kubernetes' ? 5 / 3 : 1) + 3000

// Change messages: the table subject (no audience) and the fronts' delivery subjects
// (not their heartbeats and notices, nor what a leader sent a front again).
const isChange = (m) =>
  (m.subject.startsWith('walcast.realtime.') || m.subject.startsWith('walcast.deliver.')) &&
  !m.headers['walcast-notice'] &&
  !m.headers['walcast-resent']
const position = (m) => [m.headers['walcast-lsn'], Number(m.headers['walcast-seq'])]
const lsnValue = (lsn) => {
  const [hi, lo] = lsn.split('/')
  return BigInt(`0x${hi}`) * 2n ** 32n + BigInt(`0x${lo}`)
}
/** `/health`, or `{}` when the process does not answer within a second (it may be frozen). */
const healthOf = (w) =>
  fetch(`${w.url}/health`, { ...w.figures, signal: AbortSignal.timeout(1000) })
    .then((r) => r.json())
    .catch(() => ({}))
const before_ = (a, b) => {
  const [la, lb] = [lsnValue(a[0]), lsnValue(b[0])]
  return la < lb || (la === lb && a[1] < b[1])
}

/** Where a row went on NATS: each change message naming it (subject, origin, term, position). */
const natsTrace = (tap, id) => {
  const needle = new RegExp(`"id":"?${id}"?[,}]`)
  const hits = tap.messages.filter((m) => isChange(m) && needle.test(m.payload.toString('utf8')))
  if (!hits.length) return 'never published'
  return hits.map((m) => `${m.subject} origin ${m.headers['walcast-origin']} term ${m.headers['walcast-term']} at ${position(m)}`).join(' | ')
}

/** Every non-zero counter of a process whose name says a change was dropped, withheld or lost. */
const LOSS_COUNTERS = /^walcast_\w*(denied|unjudged|lagged|lost|dropped|invisible|errors|skipped|fenced|restarts)\w*_total/
const losses = async (p) => {
  const text = await fetch(`${p.url}/metrics`, { ...p.figures, signal: AbortSignal.timeout(2000) }).then((r) => r.text()).catch(() => '')
  const hits = text.split('\n').filter((l) => LOSS_COUNTERS.test(l) && Number(l.split(' ').at(-1)) > 0)
  return hits.join(', ') || 'none'
}

/** The scenario for one lease mode (`postgres` or `kubernetes`), both sources. */
export function freezeSuite(mode) {
  for (const source of ['stream', 'poll']) {
    describe(`LEASE_MODE=${mode}, CDC_SOURCE=${source}`, () => {
      let env, front1, front2, tap
      const workers = []
      const clients = []
      const startWorker = async () => {
        const w = await startProcess(env, 'cdc-worker', [], {
          NATS_URL: env.nats_url,
          CDC_SOURCE: source,
          LEASE_MODE: mode,
          LEASE_DURATION_SECS: String(LEASE_SECS),
          ...(mode === 'kubernetes' ? { LEASE_KUBE_API_URL: env.kube_api_url } : {}),
        }, { standby: workers.length > 0 })
        workers.push(w)
        return w
      }
      const leader = async () => {
        let found
        await until('a leading cdc-worker that reads the slot', async () => {
          for (const w of workers) {
            const h = await healthOf(w)
            if (h.leader && h.cdc_active) found = w
          }
          return found !== undefined
        }, 60000)
        return found
      }

      before(async () => {
        env = await startEnv({ fakeKube: mode === 'kubernetes' })
        await env.db.query('CREATE TABLE fz (id int8 PRIMARY KEY, v text)')
        await startWorker()
        await enableTable(env, 'fz')
        await startWorker()
        front1 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
        front2 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
        tap = await natsTap(env.nats_url, 'walcast.>')
      })
      after(async () => {
        for (const w of workers) if (w.child.signalCode === null) w.child.kill('SIGCONT')
        tap?.close()
        for (const rt of clients) {
          await rt.removeAllChannels().catch(() => {})
          await rt.disconnect()
        }
        await front1?.stop()
        await front2?.stop()
        for (const w of workers) await w.stop().catch(() => {})
        await env?.stop()
      })

      test('SIGSTOP the leader for 30 s under a writer: replaced within the lease, silent after SIGCONT, every row exactly once in order', async () => {
        const subscribers = []
        for (const [front, vsn] of [[front1, '2.0.0'], [front2, '2.0.0'], [front1, '1.0.0'], [front2, '1.0.0']]) {
          const rt = client(front, { vsn, logger: () => {} })
          clients.push(rt)
          const got = []
          const told = []
          const channel = rt.channel(uniq('fz'))
            .on('system', {}, (p) => { if (p.status !== 'ok') told.push(p.message ?? JSON.stringify(p)) })
            .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'fz' }, (p) => got.push({ id: Number(p.new.id), at: performance.now() }))
          await subscribed(channel)
          subscribers.push({ name: `front${front === front1 ? 1 : 2}/vsn ${vsn}`, got, told })
        }
        let stop = false
        let nextId = 1
        const writer = (async () => {
          while (!stop) {
            await env.db.query("INSERT INTO fz VALUES ($1, 'w')", [nextId])
            nextId += 1
            await new Promise((r) => setTimeout(r, 5))
          }
        })()
        const rowsBeyond = async (n, what) => {
          const target = nextId + n
          await until(`the writer to pass row ${target} (${what})`, () => nextId >= target, 60000)
        }
        const changes = () => tap.messages.filter((m) => m.subject.startsWith('walcast.realtime.'))

        await rowsBeyond(50, 'before the freeze')
        const old = await leader()
        const seen = changes().length
        await until('a change on NATS from the leader', () => changes().length > seen)
        const oldOrigin = changes().at(-1).headers['walcast-origin']

        old.child.kill('SIGSTOP')
        const frozen = performance.now()
        const frozenAt = nextId
        const fromOthers = () => tap.messages.find((m) => m.at > frozen && isChange(m) && m.headers['walcast-origin'] !== oldOrigin)
        await until('a change published by another worker while the leader is frozen', () => fromOthers() !== undefined, takeoverBoundMs(mode) + 10000)
        const takeoverMs = fromOthers().at - frozen
        const newOrigin = fromOthers().headers['walcast-origin']
        assert.ok(takeoverMs <= takeoverBoundMs(mode), `changes flowed again ${Math.round(takeoverMs)} ms after SIGSTOP; bound ${takeoverBoundMs(mode)} ms (lease ${LEASE_SECS} s)`)
        const standby = await leader()
        assert.notEqual(standby, old)

        await new Promise((r) => setTimeout(r, FREEZE_MS - (performance.now() - frozen)))
        old.child.kill('SIGCONT')
        const resumed = performance.now()
        const resumedAt = nextId
        await until('the old leader to step down after SIGCONT', async () => (await healthOf(old)).leader === false, 10000)
        const steppedDownMs = performance.now() - resumed
        const h = await old.health()
        assert.equal(h.cdc_active, false, JSON.stringify(h))
        assert.notEqual(h.lease_holder, undefined, JSON.stringify(h))
        await rowsBeyond(100, 'after SIGCONT')
        stop = true
        await writer

        const { rows } = await env.db.query('SELECT id FROM fz ORDER BY id')
        const expected = rows.map((r) => Number(r.id))
        for (const s of subscribers) {
          await until(`${s.name} to receive all ${expected.length} rows (has ${s.got.length})`, () => s.got.length >= expected.length, 60000).catch(async (e) => {
            // Which rows, and how the others fared, say where to look.
            const have = new Set(s.got.map((g) => g.id))
            const missing = expected.filter((id) => !have.has(id))
            const others = subscribers.map((o) => `${o.name}: ${o.got.length}`).join(', ')
            const onNats = missing.slice(0, 3).map((id) => `${id}: ${natsTrace(tap, id)}`).join('; ')
            const told = s.told.length ? s.told.slice(0, 3).join(' | ') : 'nothing'
            const counts = await Promise.all([...workers, front1, front2].map(async (p, i) => `${i < workers.length ? `worker ${i + 1}` : `front ${i - workers.length + 1}`}: ${await losses(p)}`))
            throw new Error(`${e.message}; missing ids ${JSON.stringify(missing.slice(0, 20))}; frozen at row ~${frozenAt}, resumed at row ~${resumedAt}; ${others}; on NATS: ${onNats}; the channel was told: ${told}; counters: ${counts.join('; ')}`)
          })
        }
        await tap.flush()

        // On NATS: a leader frozen in the middle of a publish may release, when it wakes,
        // what it had handed to its connection before its fence closed (the window is
        // narrow, not closed, at NATS). Each such message carries its old term, lower than
        // the new leader's, and the fronts drop it: none reaches a client (checked below,
        // and by the fronts' count of dropped stale-term messages).
        const all = tap.messages.filter(isChange)
        const firstNew = all.findIndex((m) => m.headers['walcast-origin'] !== oldOrigin)
        const newTerm = Number(all[firstNew].headers['walcast-term'])
        const oldTerm = Number(all[firstNew - 1].headers['walcast-term'])
        assert.ok(Number.isInteger(oldTerm) && newTerm > oldTerm, `terms on NATS: old ${oldTerm}, new ${newTerm}`)
        const stale = all.slice(firstNew).filter((m) => m.headers['walcast-origin'] === oldOrigin)
        for (const m of stale) {
          const term = Number(m.headers['walcast-term'])
          assert.ok(term < newTerm, `the old leader published at term ${term} after the new leader's term ${newTerm}: ${m.subject} ${position(m)}`)
        }
        const staleDeliveries = stale.filter((m) => m.subject.startsWith('walcast.deliver.')).length
        if (staleDeliveries > 0) {
          let dropped = 0
          for (const f of [front1, front2]) {
            const text = await (await fetch(`${f.url}/metrics`, f.figures)).text()
            const line = text.split('\n').find((l) => l.startsWith('walcast_front_stale_term_dropped_total'))
            dropped += line ? Number(line.split(' ').at(-1)) : 0
          }
          assert.ok(dropped >= staleDeliveries, `the old leader released ${staleDeliveries} delivery message(s) after the takeover; the fronts dropped ${dropped} as stale`)
        }
        for (const origin of [oldOrigin, newOrigin]) {
          const mine = changes().filter((m) => m.headers['walcast-origin'] === origin).map(position)
          for (let i = 1; i < mine.length; i += 1) {
            assert.ok(before_(mine[i - 1], mine[i]), `${origin === oldOrigin ? 'old' : 'new'} leader: ${mine[i - 1]} then ${mine[i]} (out of order or duplicate)`)
          }
        }
        // At the clients: every row once, in commit order.
        let gapMs = 0
        for (const s of subscribers) {
          const ids = s.got.map((g) => g.id)
          assert.deepEqual(ids, expected, `${s.name}: every committed row once, in commit order`)
          const during = s.got.filter((g) => g.at > frozen)
          if (during.length) gapMs = Math.max(gapMs, during[0].at - frozen)
        }
        const metrics = await (await fetch(`${old.url}/metrics`, old.figures)).text()
        const fenced = metrics.split('\n').filter((l) => l.startsWith('walcast_lease_fenced_total')).join(', ') || 'none'
        console.log(`# ${mode}/${source}: changes on NATS from the new leader ${Math.round(takeoverMs)} ms after SIGSTOP (${stale.length} late message(s) of the old term, dropped by the fronts), first row at the clients after ${Math.round(gapMs)} ms; old leader stepped down ${Math.round(steppedDownMs)} ms after SIGCONT (fenced actions: ${fenced}); ${expected.length} rows`)
      })
    })
  }
}
