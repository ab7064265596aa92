// Private-channel checks are answered side by side and time-limited: a policy on
// realtime.messages that takes 30 s for one topic denies that join once the check's
// statement_timeout (5 s) runs out, and joins to other private topics made meanwhile are
// answered at once, through `walcast serve` and through a ws-front asking a cdc-worker over
// NATS; and a replay `since` out of range is refused with its reason. Before, every check went through one session, one at a time, with no timeout: the
// slow topic held every other project's private joins until the front gave up on them.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, client, subscribeTracked, jwt } from './lib/harness.js'

const USER = '00000000-0000-4000-8000-0000000000d4'
const token = jwt({ role: 'authenticated', sub: USER })

async function join(server, topic) {
  const rt = client(server, { logger: () => {} })
  await rt.setAuth(token)
  const ch = rt.channel(topic, { config: { private: true } })
  const started = Date.now()
  const first = await subscribeTracked(ch, 20000).first
  return { rt, first, ms: Date.now() - started }
}

const setups = {
  serve: async (env) => ({ front: await startProcess(env, 'walcast', ['serve']), procs: [] }),
  'ws-front + cdc-worker': async (env) => {
    const worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url })
    const front = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
    return { front, procs: [worker] }
  },
}

for (const [name, setup] of Object.entries(setups)) {
  describe(name, () => {
    let env, front, procs
    before(async () => {
      env = await startEnv()
      ;({ front, procs } = await setup(env)) // applies the migrations (roles, realtime.messages)
      // pg_sleep in a policy: the slowest mistake an app can make, on one topic only.
      await env.db.query(`
        CREATE POLICY slow_or_fast ON realtime.messages FOR SELECT TO authenticated
          USING (CASE WHEN realtime.topic() = 'slow' THEN pg_sleep(30) IS NOT NULL
                      ELSE realtime.topic() LIKE 'fast-%' END)`)
    })
    after(async () => {
      await front?.stop()
      for (const p of procs ?? []) await p.stop()
      await env?.stop()
    })

    test('a slow policy denies its own join and holds no other', async () => {
      const slow = join(front, 'slow')
      await new Promise((r) => setTimeout(r, 300)) // the slow check is running
      const fast = await Promise.all([1, 2, 3].map((i) => join(front, `fast-${i}`)))
      try {
        for (const f of fast) {
          assert.equal(f.first.status, 'SUBSCRIBED')
          assert.ok(f.ms < 3000, `a fast private join took ${f.ms} ms behind the slow check`)
        }
        const s = await slow
        try {
          // Refused by the check's timeout, or by the front's own wait for the answer.
          assert.notEqual(s.first.status, 'SUBSCRIBED')
        } finally {
          await s.rt.disconnect()
        }
      } finally {
        for (const f of fast) await f.rt.disconnect()
      }
    })

    test('a replay since -1e300 is refused with the reason; the socket keeps working', async () => {
      const rt = client(front, { logger: () => {} })
      await rt.setAuth(token)
      try {
        const bad = rt.channel('fast-replay', { config: { private: true, broadcast: { replay: { since: -1e300 } } } })
        const refused = await subscribeTracked(bad, 10000).first
        assert.equal(refused.status, 'CHANNEL_ERROR')
        assert.match(refused.err.message, /since/)
        const good = rt.channel('fast-after', { config: { private: true } })
        const after = await subscribeTracked(good, 10000).first
        assert.equal(after.status, 'SUBSCRIBED', JSON.stringify(after.err?.message))
      } finally {
        await rt.disconnect()
      }
    })
  })
}
