// The management API through the unmodified client (walcast serve, in-process bus): a
// project created through the API, its realtime-js channels told with a `system` error
// when it is made private-only, suspended or deleted (Supabase's messages), a public join
// of a private-only project refused with `PrivateOnly`, and the operator key alone
// accepted; a suspended project's SSE streams end with a `system` event; a rotated
// secret's sessions told and closed, the new key's served.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, collector, subscribeTracked, uniq, until } from './lib/harness.js'
import { enableViaRest } from './lib/tenants.js'

const OPERATOR = 'walcast-js-operator-key-0123456789abcdef'

describe('management API', () => {
  let st
  const api = async (method, path, body, key = OPERATOR) => {
    const headers = { 'content-type': 'application/json' }
    if (key) headers.authorization = `Bearer ${key}`
    const r = await fetch(`${st.server.url}/management/v1/projects${path}`, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
    })
    return { status: r.status, body: await r.json() }
  }
  before(async () => {
    st = await startStack({ serverEnv: { MANAGEMENT_API_KEY: OPERATOR } })
  })
  after(async () => {
    await st?.stop()
  })

  const clients = []
  /** A client of the project, joined to a public channel, recording its system messages. */
  const joined = async (anon) => {
    const rt = client(st.server, { apikey: anon })
    clients.push(rt)
    const sys = collector('system')
    const ch = rt.channel(uniq('room')).on('system', {}, sys)
    const s = subscribeTracked(ch)
    const first = await s.first
    return { rt, ch, sys, s, first }
  }
  /** The channel got `message` as a system error, and was closed or errored. */
  const told = async (c, message) => {
    await until(`system "${message}" (got ${JSON.stringify(c.sys.items)})`, () =>
      c.sys.items.some((m) => m.status === 'error' && m.message === message))
    await until(`closed (statuses ${JSON.stringify(c.s.statuses)})`, () =>
      c.s.statuses.some((x) => x.status === 'CLOSED' || x.status === 'CHANNEL_ERROR'))
    c.rt.removeAllChannels()
  }

  test('private-only, suspend and delete reach realtime-js clients as Supabase words them', async () => {
    try {
      assert.equal((await api('GET', '', undefined, null)).status, 401)
      const created = await api('POST', '', { name: 'js' })
      assert.equal(created.status, 201, JSON.stringify(created.body))
      const { id, anon_key: anon, service_role_key: service } = created.body
      assert.equal((await api('GET', `/${id}`, undefined, service)).status, 403)

      const a = await joined(anon)
      assert.equal(a.first.status, 'SUBSCRIBED')
      assert.equal((await api('PATCH', `/${id}`, { private_only: true })).status, 200)
      const privateOnly = 'PrivateOnly: This project only allows private channels'
      await told(a, privateOnly)
      // A new public join is refused with Supabase's error.
      const refused = await joined(anon)
      assert.equal(refused.first.status, 'CHANNEL_ERROR')
      assert.match(String(refused.first.err?.message ?? refused.first.err), /PrivateOnly/)
      refused.rt.removeAllChannels()
      assert.equal((await api('PATCH', `/${id}`, { private_only: false })).status, 200)

      let b
      await until('public joins accepted again', async () => {
        b = await joined(anon)
        if (b.first.status !== 'SUBSCRIBED') b.rt.removeAllChannels()
        return b.first.status === 'SUBSCRIBED'
      })
      assert.equal((await api('PATCH', `/${id}`, { suspended: true })).status, 200)
      await told(b, 'RealtimeDisabledForTenant: Realtime disabled for this tenant')
      assert.equal((await api('PATCH', `/${id}`, { suspended: false })).status, 200)

      let c
      await until('joins accepted after the suspension', async () => {
        try {
          c = await joined(anon)
        } catch {
          return false
        }
        if (c.first.status !== 'SUBSCRIBED') c.rt.removeAllChannels()
        return c.first.status === 'SUBSCRIBED'
      })
      const deleted = await api('DELETE', `/${id}`)
      assert.equal(deleted.status, 200, JSON.stringify(deleted.body))
      await told(c, 'TenantNotFound: this project was deleted')
      assert.equal((await api('GET', `/${id}`)).status, 404)
    } finally {
      for (const rt of clients) {
        rt.removeAllChannels()
        rt.disconnect()
      }
    }
  })

  test("a secret rotated without a window closes its old keys' channels, as expiry does", async () => {
    try {
      const created = await api('POST', '', { name: 'rotated' })
      assert.equal(created.status, 201, JSON.stringify(created.body))
      const { id, anon_key: anon } = created.body
      const old = await joined(anon)
      assert.equal(old.first.status, 'SUBSCRIBED')
      const rotated = await api('POST', `/${id}/rotate`, { previous_valid_secs: 0 })
      assert.equal(rotated.status, 200, JSON.stringify(rotated.body))
      await told(old, 'Invalid token: signature verification failed')
      // The client does not rejoin a channel closed so (it would be refused: 401 at connect).
      const fresh = await joined(rotated.body.anon_key)
      assert.equal(fresh.first.status, 'SUBSCRIBED')
      await new Promise((r) => setTimeout(r, 500))
      assert.deepEqual(fresh.sys.items.filter((m) => m.status === 'error'), [])
    } finally {
      for (const rt of clients) {
        rt.removeAllChannels()
        rt.disconnect()
      }
    }
  })

  test("a suspended project's SSE stream gets a system event and ends", async () => {
    const created = await api('POST', '', { name: 'sse' })
    assert.equal(created.status, 201)
    const { id, schema, anon_key: anon, service_role_key: service } = created.body
    await st.env.db.query(`CREATE TABLE "${schema}".items (id int8 PRIMARY KEY, v text)`)
    await st.env.db.query(`GRANT SELECT ON "${schema}".items TO anon, authenticated, service_role`)
    assert.equal((await enableViaRest(st.server, id, 'items', service)).status, 200)
    const params = new URLSearchParams({ apikey: anon, schema, table: 'items' })
    const res = await fetch(`${st.server.url}/realtime/v1/sse?${params}`)
    assert.equal(res.status, 200)
    let text = ''
    const read = (async () => {
      for await (const chunk of res.body) text += new TextDecoder().decode(chunk)
    })()
    await until(`ready (got ${text})`, () => text.includes('event: ready'))
    assert.equal((await api('PATCH', `/${id}`, { suspended: true })).status, 200)
    await read
    assert.match(text, /event: system\ndata: .*RealtimeDisabledForTenant: Realtime disabled for this tenant/)
    const again = await fetch(`${st.server.url}/realtime/v1/sse?${params}`)
    assert.equal(again.status, 403)
    await again.body?.cancel()
  })
})
