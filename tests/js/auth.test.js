// Tokens and refused joins: refresh with setAuth keeps a channel, an expiring or bad token
// closes it (system error, then phx_close, reported CLOSED, no rejoin), joins with bad
// tokens are refused with `InvalidJWTToken: ...`, and joins whose postgres_changes cannot
// be served are acknowledged and then reported through a `system` error.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import WebSocket from 'ws'
import { startStack, client, collector, subscribed, subscribeTracked, uniq, until, jwt, VSNS } from './lib/harness.js'

let st, db
let nextId = 1

before(async () => {
  st = await startStack({
    setupSql: ['CREATE TABLE t (id int8 PRIMARY KEY, v text)', 'CREATE TABLE off (id int8 PRIMARY KEY, v text)'],
    tables: ['t'],
  })
  db = st.env.db
})
after(async () => {
  await st?.stop()
})

const T = (event = '*', extra = {}) => ({ event, schema: 'public', table: 't', ...extra })
const nowSecs = () => Math.floor(Date.now() / 1000)
const insert = async () => {
  const id = nextId++
  await db.query('INSERT INTO t VALUES ($1, $2)', [id, `row ${id}`])
  return id
}
const SUBSCRIBED_OK = { extension: 'postgres_changes', status: 'ok', message: 'Subscribed to PostgreSQL' }
const pick = ({ extension, status, message }) => ({ extension, status, message })

/** A second, independent client that sees every insert into `t`: the witness for absence. */
async function witness() {
  const rt = client(st.server)
  const got = collector('witness')
  await subscribed(rt.channel(uniq('witness')).on('postgres_changes', T('INSERT'), got))
  return { rt, got }
}

for (const vsn of VSNS) {
  describe(`vsn ${vsn}`, () => {
    test('setAuth(newToken) before expiry keeps the channel receiving past the old expiry', async () => {
      const rt = client(st.server, { vsn })
      try {
        const exp = nowSecs() + 4
        await rt.setAuth(jwt({ exp }))
        const got = collector('changes')
        const sys = collector('system')
        const ch = rt.channel(uniq('refresh')).on('system', {}, sys).on('postgres_changes', T('INSERT'), got)
        const s = subscribeTracked(ch)
        assert.equal((await s.first).status, 'SUBSCRIBED')
        await sys.wait(1)
        const a = await insert()
        await got.wait(1)
        await rt.setAuth(jwt({ exp: nowSecs() + 3600 }))
        // The server re-subscribes with the new claims and says so again.
        await sys.wait(2, 'the system message after the token refresh')
        assert.deepEqual(sys.items.map(pick), [SUBSCRIBED_OK, SUBSCRIBED_OK])
        // Let the first token's expiry pass (this is the point of the test, not a synchronisation).
        await until('the first token to expire', () => Date.now() > exp * 1000 + 2000, 10000)
        const b = await insert()
        await got.wait(2)
        assert.deepEqual(got.items.map((p) => p.new.id), [a, b])
        assert.deepEqual(s.statuses.map((x) => x.status), ['SUBSCRIBED'], 'no CLOSED / CHANNEL_ERROR')
        assert.equal(sys.items.length, 2, `no system error: ${JSON.stringify(sys.items)}`)
        assert.equal(ch.state, 'joined')
      } finally {
        await rt.removeAllChannels()
        await rt.disconnect()
      }
    })

    test('token refreshes under a steady writer: every row arrives, once, in order', async () => {
      // Each refresh registers the channel's subscriptions again with the new claims; a
      // change decoded meanwhile must still reach them (as supabase-js refreshes every
      // channel's token while rows keep coming).
      const rt = client(st.server, { vsn })
      try {
        const got = collector('changes')
        const ch = rt.channel(uniq('refresh-writer')).on('postgres_changes', T('INSERT'), got)
        await subscribed(ch)
        let stop = false
        const written = []
        const writer = (async () => {
          while (!stop) {
            written.push(await insert())
            await new Promise((r) => setTimeout(r, 2))
          }
        })()
        for (let i = 0; i < 25; i++) {
          await rt.setAuth(jwt({ exp: nowSecs() + 3600, n: i }))
          await new Promise((r) => setTimeout(r, 40))
        }
        stop = true
        await writer
        await until(`every row written (${written.length}; got ${got.items.length})`, () => got.items.length >= written.length, 20000).catch((e) => {
          const have = new Set(got.items.map((p) => p.new.id))
          throw new Error(`${e.message}; missing ${JSON.stringify(written.filter((id) => !have.has(id)).slice(0, 20))}`)
        })
        assert.deepEqual(got.items.map((p) => p.new.id), written)
      } finally {
        await rt.removeAllChannels()
        await rt.disconnect()
      }
    })

    test('a token that expires closes the channel: system error, then CLOSED, nothing more', async () => {
      const rt = client(st.server, { vsn })
      const w = await witness()
      try {
        const exp = nowSecs() + 3
        await rt.setAuth(jwt({ exp }))
        const got = collector('changes')
        const sys = collector('system')
        const name = uniq('expire')
        const ch = rt.channel(name).on('system', {}, sys).on('postgres_changes', T('INSERT'), got)
        const s = subscribeTracked(ch)
        assert.equal((await s.first).status, 'SUBSCRIBED')
        const a = await insert()
        await got.wait(1)
        await until(`CLOSED after the token expired (statuses ${JSON.stringify(s.statuses)})`, () =>
          s.statuses.some((x) => x.status === 'CLOSED'), 12000)
        assert.ok(Date.now() >= exp * 1000 - 1000, 'closed before the token expired')
        assert.deepEqual(s.statuses.map((x) => x.status), ['SUBSCRIBED', 'CLOSED'])
        assert.equal(sys.items.length, 2, JSON.stringify(sys.items))
        assert.deepEqual(pick(sys.items[0]), SUBSCRIBED_OK)
        const err = sys.items[1]
        assert.equal(err.extension, 'system')
        assert.equal(err.status, 'error')
        assert.match(err.message, /^Token has expired \d+ seconds ago$/)
        assert.equal(err.channel, name)
        assert.equal(ch.state, 'closed')
        // Nothing more arrives: the witness gets the next row, the closed channel does not.
        const b = await insert()
        await until('the witness to see the row', () => w.got.items.some((p) => p.new.id === b))
        assert.deepEqual(got.items.map((p) => p.new.id), [a])
        // And the client did not rejoin on its own.
        assert.deepEqual(s.statuses.map((x) => x.status), ['SUBSCRIBED', 'CLOSED'])
      } finally {
        await rt.removeAllChannels()
        await rt.disconnect()
        await w.rt.removeAllChannels()
        await w.rt.disconnect()
      }
    })

    test('refreshing with a badly signed token closes the channel', async () => {
      const rt = client(st.server, { vsn })
      try {
        const sys = collector('system')
        const name = uniq('badrefresh')
        const ch = rt.channel(name).on('system', {}, sys).on('postgres_changes', T('INSERT'), () => {})
        const s = subscribeTracked(ch)
        assert.equal((await s.first).status, 'SUBSCRIBED')
        await sys.wait(1)
        await rt.setAuth(jwt({}, { secret: 'not-the-secret' }))
        await until(`CLOSED after a bad token (statuses ${JSON.stringify(s.statuses)})`, () =>
          s.statuses.some((x) => x.status === 'CLOSED'))
        await sys.wait(2)
        assert.deepEqual(pick(sys.items[1]), {
          extension: 'system',
          status: 'error',
          message: 'Invalid token: signature verification failed',
        })
        assert.equal(sys.items[1].channel, name)
        assert.deepEqual(s.statuses.map((x) => x.status), ['SUBSCRIBED', 'CLOSED'])
      } finally {
        await rt.removeAllChannels()
        await rt.disconnect()
      }
    })

    const BAD_TOKENS = [
      ['signed with another secret', () => jwt({}, { secret: 'not-the-secret' }), /^InvalidJWTToken: Invalid token: signature verification failed$/],
      ['unsigned (alg none)', () => jwt({}, { alg: 'none' }), /^InvalidJWTToken: Invalid token: /],
      ['expired', () => jwt({ exp: nowSecs() - 12 }), /^InvalidJWTToken: Token has expired (1[2-9]|[2-9]\d) seconds ago$/],
      ['without role', () => jwt({ role: undefined }), /^InvalidJWTToken: Fields `role` and `exp` are required in JWT$/],
      ['without exp', () => jwt({ exp: undefined }), /^InvalidJWTToken: Fields `role` and `exp` are required in JWT$/],
      ['not a JWT', () => 'garbage', /^InvalidJWTToken: Invalid token: /],
      // Roles outside ALLOWED_ROLES (default anon, authenticated, service_role): `none`, a
      // superuser, walcast's own login role (the test database's `postgres`).
      ['acting as role none', () => jwt({ role: 'none' }), /^InvalidJWTToken: Invalid token: the role "none" is not allowed$/],
      ['acting as the superuser postgres', () => jwt({ role: 'postgres' }), /^InvalidJWTToken: Invalid token: the role "postgres" is not allowed$/],
      ['not valid before ten minutes from now (nbf)', () => jwt({ nbf: nowSecs() + 600 }), /^InvalidJWTToken: Token is not valid yet: valid in (59\d|600) seconds$/],
    ]
    for (const [what, token, reason] of BAD_TOKENS) {
      test(`a join with a token ${what} is refused: CHANNEL_ERROR with the reason`, async () => {
        const rt = client(st.server, { vsn })
        try {
          await rt.setAuth(token())
          const ch = rt.channel(uniq('badjoin')).on('postgres_changes', T('INSERT'), () => {})
          const s = subscribeTracked(ch)
          const { status, err } = await s.first
          assert.equal(status, 'CHANNEL_ERROR')
          assert.match(err.message, reason)
        } finally {
          await rt.removeAllChannels()
          await rt.disconnect()
        }
      })
    }

    const REFUSED = [
      [
        'a bad filter',
        T('*', { filter: 'id=zz.1' }),
        (m) => assert.match(m, /^Error parsing `filter` params: .*zz/),
      ],
      [
        'a filter on an unknown column',
        T('*', { filter: 'nope=eq.1' }),
        (m) => assert.match(m, /nope/),
      ],
      [
        'a filter value that does not cast to the column type',
        T('*', { filter: 'id=eq.abc' }),
        (m) => assert.match(m, /abc/),
      ],
      [
        'an unknown table',
        { event: '*', schema: 'public', table: 'nope' },
        (m) =>
          assert.equal(
            m,
            'Unable to subscribe to changes with given parameters. Please check Realtime is enabled for the given connect parameters: [event: *, schema: public, table: nope, filters: ]',
          ),
      ],
      [
        'a table not enabled for realtime',
        { event: 'INSERT', schema: 'public', table: 'off' },
        (m) =>
          assert.equal(
            m,
            'Unable to subscribe to changes with given parameters. Please check Realtime is enabled for the given connect parameters: [event: INSERT, schema: public, table: off, filters: ]',
          ),
      ],
    ]
    for (const [what, binding, check] of REFUSED) {
      test(`a join with ${what}: SUBSCRIBED, then a system error, the channel stays open`, async () => {
        const rt = client(st.server, { vsn })
        try {
          const sys = collector('system')
          const got = collector('changes')
          const name = uniq('refused')
          const ch = rt.channel(name).on('system', {}, sys).on('postgres_changes', binding, got)
          const s = subscribeTracked(ch)
          assert.equal((await s.first).status, 'SUBSCRIBED')
          await sys.wait(1)
          const e = sys.items[0]
          assert.equal(e.extension, 'postgres_changes')
          assert.equal(e.status, 'error')
          assert.equal(e.channel, name)
          check(e.message)
          assert.equal(ch.state, 'joined')
          assert.deepEqual(s.statuses.map((x) => x.status), ['SUBSCRIBED'])
        } finally {
          await rt.removeAllChannels()
          await rt.disconnect()
        }
      })
    }

    test('one refused binding does not stop the others on the channel', async () => {
      const rt = client(st.server, { vsn })
      try {
        const sys = collector('system')
        const good = collector('t INSERT')
        const bad = collector('off INSERT')
        const ch = rt
          .channel(uniq('mixed'))
          .on('system', {}, sys)
          .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'off' }, bad)
          .on('postgres_changes', T('INSERT'), good)
        const s = subscribeTracked(ch)
        assert.equal((await s.first).status, 'SUBSCRIBED')
        await sys.wait(1)
        assert.equal(sys.items[0].status, 'error')
        assert.match(sys.items[0].message, /table: off/)
        await db.query("INSERT INTO off VALUES ($1, 'x')", [nextId++])
        const id = await insert()
        await good.wait(1)
        assert.deepEqual(good.items.map((p) => p.new.id), [id])
        assert.equal(bad.items.length, 0)
      } finally {
        await rt.removeAllChannels()
        await rt.disconnect()
      }
    })
  })
}

test('the WebSocket upgrade refuses a bad apikey with 401 and a JSON error', async () => {
  const now = Math.floor(Date.now() / 1000)
  const bad = [jwt({}, { secret: 'nope' }), 'garbage', jwt({ role: 'none' }), jwt({ role: 'postgres' }), jwt({ nbf: now + 600 })]
  for (const apikey of bad) {
    const ws = new WebSocket(`ws://127.0.0.1:${st.server.port}/realtime/v1/websocket?apikey=${encodeURIComponent(apikey)}&vsn=2.0.0`)
    const res = await new Promise((resolve, reject) => {
      ws.on('unexpected-response', (_req, r) => resolve(r))
      ws.on('open', () => reject(new Error('upgrade accepted with a bad apikey')))
      ws.on('error', () => {})
    })
    assert.equal(res.statusCode, 401)
    let body = ''
    for await (const c of res) body += c
    assert.equal(typeof JSON.parse(body).error, 'string', body)
    ws.terminate()
  }
})

test('heartbeats are answered (realtime-js reports ok for each)', async () => {
  const rt = client(st.server, { heartbeatIntervalMs: 200 })
  try {
    const beats = collector('heartbeat status')
    rt.onHeartbeat(beats)
    await subscribed(rt.channel(uniq('hb')))
    await until(`3 heartbeat replies (${JSON.stringify(beats.items)})`, () => beats.items.filter((s) => s === 'ok').length >= 3, 10000)
    assert.deepEqual(beats.items.filter((s) => s !== 'sent' && s !== 'ok'), [], 'no timeout / error / disconnected')
  } finally {
    await rt.removeAllChannels()
    await rt.disconnect()
  }
})
