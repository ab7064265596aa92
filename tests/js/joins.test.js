// Joins to a table without row-level security need no round trip to the cdc-worker once
// the worker delivers that subscription's class to the front: with the worker frozen
// (SIGSTOP), a second client joining the same binding is SUBSCRIBED at once, and gets
// every row committed after its join, even when the first (registered) client leaves
// while the worker is still frozen. A join to an RLS table still waits for the worker.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import fs from 'node:fs'
import { startEnv, startProcess, enableTable, client, subscribe, subscribed, collector, uniq, jwt, until } from './lib/harness.js'

/** Resolves with the channel's first status, or 'pending' if none came within `ms`. */
async function statusWithin(promise, ms) {
  let timer
  const late = new Promise((resolve) => (timer = setTimeout(() => resolve('pending'), ms)))
  const first = await Promise.race([promise.then((s) => s.status), late])
  clearTimeout(timer)
  return first
}

for (const source of ['stream', 'poll']) {
  describe(`joins without a round trip (CDC_SOURCE=${source})`, () => {
    let env, worker, front
    const clients = []

    before(async () => {
      env = await startEnv()
      await env.db.query('CREATE TABLE j (id int8 PRIMARY KEY, v text)')
      await env.db.query('CREATE TABLE r (id int8 PRIMARY KEY, v text)')
      await env.db.query('ALTER TABLE r ENABLE ROW LEVEL SECURITY')
      await env.db.query('CREATE POLICY everyone ON r FOR SELECT USING (true)')
      worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url, CDC_SOURCE: source })
      await enableTable(env, 'j')
      await enableTable(env, 'r')
      front = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
    })
    after(async () => {
      if (worker?.child.signalCode === null) worker.child.kill('SIGCONT')
      for (const rt of clients) {
        await rt.removeAllChannels().catch(() => {})
        await rt.disconnect()
      }
      await front?.stop()
      await worker?.stop()
      await env?.stop()
    })

    test('a join of a class the front already receives is SUBSCRIBED with the worker frozen, and loses nothing', async () => {
      const binding = { event: 'INSERT', schema: 'public', table: 'j' }
      const rtA = client(front, { apikey: jwt({ role: 'anon' }) })
      const rtB = client(front, { apikey: jwt({ role: 'anon' }) })
      const rtC = client(front, { apikey: jwt({ role: 'anon' }) })
      clients.push(rtA, rtB, rtC)
      const gotA = collector('client A')
      const chanA = await subscribed(rtA.channel(uniq('a')).on('postgres_changes', binding, (p) => gotA(p.new.id)))
      await env.db.query("INSERT INTO j VALUES (1, 'before')")
      await gotA.wait(1, 'row 1 at the registered client A')

      worker.child.kill('SIGSTOP')
      try {
        const gotB = collector('client B')
        const started = Date.now()
        const b = await subscribe(rtB.channel(uniq('b')).on('postgres_changes', binding, (p) => gotB(p.new.id)), 3000)
        const tookB = Date.now() - started
        assert.equal(b.status, 'SUBSCRIBED', `client B: ${b.err?.message ?? ''}`)
        assert.ok(tookB < 2000, `client B joined in ${tookB} ms: it waited for the frozen worker`)

        // An RLS table's join must be judged by the worker: it waits.
        const c = subscribe(rtC.channel(uniq('c')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'r' }, () => {}), 15000)
        const early = await statusWithin(c, 1000)
        if (early !== 'pending') {
          // Say how it was answered: was the worker stopped, and which path did the join take?
          const state = fs.readFileSync(`/proc/${worker.child.pid}/stat`, 'utf8').split(') ')[1]?.[0]
          const text = await (await fetch(`${front.url}/metrics`, front.figures)).text()
          const paths = text.split('\n').filter((l) => l.startsWith('walcast_front_registrations_total'))
          assert.fail(`a join to an RLS table answered (${early}) without the worker: worker state ${state}, ${paths.join('; ')}`)
        }

        // Committed after B's join, while the worker is frozen; then A leaves, also
        // while frozen: B must still get it (the worker must not forget the class).
        await env.db.query("INSERT INTO j VALUES (2, 'frozen')")
        await rtA.removeChannel(chanA)
        worker.child.kill('SIGCONT')
        assert.equal((await c).status, 'SUBSCRIBED', 'the RLS join after the worker resumed')
        await env.db.query("INSERT INTO j VALUES (3, 'after')")
        await gotB.wait(2, 'rows 2 and 3 at client B')
        assert.deepEqual(gotB.items, [2, 3])
        await until('client B registered with the worker in the background', async () => {
          const text = await (await fetch(`${front.url}/metrics`, front.figures)).text()
          return /walcast_front_registrations_total\{path="ready_class"\} 1\b/.test(text)
        })
        assert.deepEqual(gotA.items, [1], 'client A left before rows 2 and 3')
      } finally {
        if (worker.child.signalCode === null) worker.child.kill('SIGCONT')
      }
    })
  })
}
