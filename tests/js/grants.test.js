// A subscription whose role may not read its table is told so, instead of a silent
// SUBSCRIBED that never receives anything: a `system` error naming the grant, on a
// WebSocket channel and on an SSE stream, within seconds of its join. It goes on: once the
// role is granted SELECT the table's changes reach it, and a REVOKE later is told again. A
// binding whose role may read the table is told nothing, and a wildcard binding (every
// table of the schema) is not told about the tables its role may not read. Enabling a
// table through the REST API names the API roles that may not read it, and the GRANT.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, collector, subscribed, uniq, until, jwt } from './lib/harness.js'

let st, db
before(async () => {
  st = await startStack({
    setupSql: [
      'CREATE TABLE hidden (id int8 PRIMARY KEY, v text)',
      'CREATE TABLE shown (id int8 PRIMARY KEY, v text)',
      'CREATE TABLE "not yet" (id int8 PRIMARY KEY, v text)',
    ],
    tables: ['hidden', 'shown'],
  })
  db = st.env.db
  // The roles exist once walcast started.
  await db.query(`REVOKE ALL ON hidden FROM anon, authenticated;
    GRANT SELECT ON hidden TO authenticated; GRANT SELECT ON shown TO anon, authenticated;
    REVOKE ALL ON "not yet" FROM anon, authenticated, service_role; GRANT SELECT ON "not yet" TO authenticated`)
})
after(async () => {
  await st?.stop()
})

const TOLD = /^Changes of public\.hidden are not delivered to this subscription: role "anon" may not read the table \(GRANT SELECT ON public\.hidden TO anon resumes them\)$/

/** A channel of `role` with one binding; its `system` messages and changes collected. */
async function listen(binding, role = 'anon') {
  const rt = client(st.server, { apikey: jwt({ role }) })
  const sys = collector(`${role} system`)
  const got = collector(`${role} changes`)
  await subscribed(rt.channel(uniq('grants')).on('system', {}, sys).on('postgres_changes', binding, got))
  return { rt, sys, got, errors: () => sys.items.filter((s) => s.status === 'error') }
}

describe('a role that may not read its table', () => {
  test('a channel is told, goes on, receives once granted, and is told again after a REVOKE', async () => {
    const anon = await listen({ event: '*', schema: 'public', table: 'hidden' })
    const user = await listen({ event: '*', schema: 'public', table: 'hidden' }, 'authenticated')
    const wildcard = await listen({ event: '*', schema: 'public' })
    try {
      await until('anon told why', () => anon.errors().length >= 1, 10000)
      assert.match(anon.errors()[0].message, TOLD)
      assert.equal(anon.errors().length, 1, 'told once')
      await db.query("INSERT INTO hidden VALUES (1, 'before the grant')")
      await user.got.wait(1)
      // A second passes: a role that may read the table, and the wildcard, are told nothing.
      await new Promise((r) => setTimeout(r, 1500))
      assert.deepEqual(user.errors(), [])
      assert.deepEqual(wildcard.errors(), [])
      assert.deepEqual(anon.got.items, [], 'nothing of a table anon may not read')
      assert.equal(anon.errors().length, 1, 'still told once')

      await db.query('GRANT SELECT ON hidden TO anon')
      await db.query("INSERT INTO hidden VALUES (2, 'after the grant')")
      await anon.got.wait(1)
      assert.deepEqual(anon.got.items.map((p) => p.new), [{ id: 2, v: 'after the grant' }])

      // The watch learns the GRANT at its next comparison (a second apart, later on a
      // loaded machine); a REVOKE before it would find the subscription still told.
      await new Promise((r) => setTimeout(r, 3000))
      await db.query('REVOKE SELECT ON hidden FROM anon')
      await until('anon told again after the REVOKE', () => anon.errors().length >= 2, 10000)
      assert.match(anon.errors()[1].message, TOLD)
    } finally {
      await db.query('REVOKE ALL ON hidden FROM anon')
      for (const c of [anon, user, wildcard]) {
        await c.rt.removeAllChannels()
        await c.rt.disconnect()
      }
    }
  })

  test('an SSE stream is told after `ready`, and goes on', async () => {
    const ctl = new AbortController()
    const res = await fetch(`${st.server.url}/realtime/v1/sse?apikey=${jwt({ role: 'anon' })}&table=hidden`, { signal: ctl.signal })
    assert.equal(res.status, 200)
    const events = []
    let ended = false
    const reader = (async () => {
      const decoder = new TextDecoder()
      let buf = ''
      try {
        for await (const chunk of res.body) {
          buf += decoder.decode(chunk, { stream: true })
          for (let i = buf.indexOf('\n\n'); i >= 0; i = buf.indexOf('\n\n')) {
            const block = buf.slice(0, i)
            buf = buf.slice(i + 2)
            const field = (name) => block.split('\n').filter((l) => l.startsWith(`${name}:`)).map((l) => l.slice(name.length + 1).trim()).join('\n')
            if (field('event')) events.push({ event: field('event'), data: field('data') })
          }
        }
      } catch {}
      ended = true
    })()
    try {
      await until('the stream to be ready, then told', () => events.some((e) => e.event === 'system'), 10000)
      assert.equal(events[0].event, 'ready', JSON.stringify(events))
      const told = JSON.parse(events.find((e) => e.event === 'system').data)
      assert.equal(told.status, 'error')
      assert.match(told.message, TOLD)
      await new Promise((r) => setTimeout(r, 300))
      assert.equal(ended, false, 'the stream goes on')
    } finally {
      ctl.abort()
      await reader
    }
  })
})

test('enabling a table through the REST API names the API roles that may not read it', async () => {
  const put = (table) => fetch(`${st.server.url}/v1/db/default/schema/tables/${encodeURIComponent(table)}/realtime`, {
    method: 'PUT',
    headers: { apikey: jwt({ role: 'service_role' }), 'content-type': 'application/json' },
    body: JSON.stringify({ enabled: true }),
  })
  const r = await put('not yet')
  assert.equal(r.status, 200)
  const body = await r.json()
  assert.deepEqual(body.unreadable_by, ['anon', 'service_role'], JSON.stringify(body))
  assert.equal(body.warning,
    'anon and service_role may not SELECT "public"."not yet", so subscribers acting as those roles ' +
    'receive nothing from it; if they should: GRANT SELECT ON "public"."not yet" TO "anon", "service_role";')
  // The GRANT as given works, and then there is nothing to say.
  await db.query('GRANT SELECT ON "public"."not yet" TO "anon", "service_role"')
  const again = await (await put('not yet')).json()
  assert.equal(again.unreadable_by, undefined, JSON.stringify(again))
  assert.equal(again.warning, undefined)
})
