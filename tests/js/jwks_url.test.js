// User tokens verified with a JWKS that walcast fetches from a URL (an identity provider
// rotating its keys), through the unmodified client: a key added after start verifies
// within the refresh interval, tokens with made-up `kid`s do not make walcast fetch once
// each, a key removed ends the sessions it verified, a failing provider leaves the last
// keys in force, and `iss` / `aud` are checked. Bad URLs are refused at start.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { generateKeyPairSync, sign } from 'node:crypto'
import {
  startStack, startProcess, client, collector, subscribeTracked, uniq, until, jwt, metric,
} from './lib/harness.js'

const REFRESH_SECS = 3
const MIN_REFRESH_SECS = 1
const ISSUER = 'https://auth.walcast.test/'
const AUDIENCE = 'authenticated'

const b64url = (buf) => Buffer.from(buf).toString('base64url')
const pair = (kid) => {
  const { privateKey, publicKey } = generateKeyPairSync('ec', { namedCurve: 'P-256' })
  return { kid, privateKey, jwk: { ...publicKey.export({ format: 'jwk' }), kid, alg: 'ES256', use: 'sig' } }
}

function es256(key, claims = {}) {
  const now = Math.floor(Date.now() / 1000)
  const head = b64url(JSON.stringify({ alg: 'ES256', typ: 'JWT', kid: key.kid }))
  const body = b64url(JSON.stringify({
    iat: now, exp: now + 3600, role: 'authenticated', iss: ISSUER, aud: AUDIENCE, ...claims,
  }))
  const sig = sign('sha256', Buffer.from(`${head}.${body}`), { key: key.privateKey, dsaEncoding: 'ieee-p1363' })
  return `${head}.${body}.${b64url(sig)}`
}

/** The identity provider: serves `keys` at /jwks.json (or `status`), counting requests. */
async function provider(keys) {
  const p = { keys, status: 200, fetches: 0 }
  p.server = http.createServer((req, res) => {
    p.fetches++
    if (req.url !== '/jwks.json' || p.status !== 200) {
      res.writeHead(p.status === 200 ? 404 : p.status).end('{}')
      return
    }
    res.writeHead(200, { 'content-type': 'application/json' })
    res.end(JSON.stringify({ keys: p.keys.map((k) => k.jwk) }))
  })
  await new Promise((resolve) => p.server.listen(0, '127.0.0.1', resolve))
  p.url = `http://127.0.0.1:${p.server.address().port}/jwks.json`
  return p
}

/** Join one channel with `token`; its subscribe status and the `system` messages. */
async function join(st, token, table = 'k') {
  const rt = client(st.server, { apikey: apikey() })
  const got = collector('changes')
  const sys = collector('system')
  await rt.setAuth(token)
  const ch = rt
    .channel(uniq('jwks'))
    .on('system', {}, sys)
    .on('postgres_changes', { event: 'INSERT', schema: 'public', table }, got)
  const s = subscribeTracked(ch)
  const first = await s.first
  return { rt, ch, s, first, got, sys }
}

const apikey = () => jwt({ iss: ISSUER, aud: AUDIENCE })

describe('a JWKS fetched from a URL', () => {
  let st, idp, db
  const first = pair('key-1')
  const added = pair('key-2')
  before(async () => {
    idp = await provider([first])
    st = await startStack({
      setupSql: ['CREATE TABLE k (id int8 PRIMARY KEY, v text)'],
      tables: ['k'],
      serverEnv: {
        JWT_JWKS_URL: idp.url,
        JWT_JWKS_REFRESH_SECS: String(REFRESH_SECS),
        JWT_JWKS_MIN_REFRESH_SECS: String(MIN_REFRESH_SECS),
        JWT_ISSUER: ISSUER,
        JWT_AUDIENCE: AUDIENCE,
      },
    })
    db = st.env.db
  })
  after(async () => {
    await st?.stop()
    idp?.server.close()
  })

  test('a key of the provider verifies user tokens; iss and aud are checked', async () => {
    const ok = await join(st, es256(first))
    try {
      assert.equal(ok.first.status, 'SUBSCRIBED', JSON.stringify(ok.first))
      await db.query("INSERT INTO k VALUES (1, 'one')")
      await ok.got.wait(1)
      assert.equal(ok.got.items[0].new.id, 1)
    } finally {
      await ok.rt.disconnect()
    }
    for (const [claims, refused] of [
      [{ aud: 'someone-else' }, /`aud` claim is not accepted/],
      [{ aud: undefined }, /`aud` claim is not accepted/],
      [{ iss: 'https://evil.example/' }, /`iss` claim is not accepted/],
    ]) {
      const bad = await join(st, es256(first, claims))
      try {
        assert.notEqual(bad.first.status, 'SUBSCRIBED', `${JSON.stringify(claims)} joined`)
        assert.match(String(bad.first.err?.message ?? JSON.stringify(bad.first)), refused)
      } finally {
        await bad.rt.disconnect()
      }
    }
  })

  test('a key added after start verifies within the refresh interval', async () => {
    idp.keys = [first, added]
    const started = Date.now()
    let last
    await until('the added key verifies', async () => {
      last = await join(st, es256(added))
      await last.rt.disconnect()
      return last.first.status === 'SUBSCRIBED'
    }, (REFRESH_SECS + 5) * 1000)
    const took = Date.now() - started
    assert.ok(took <= (REFRESH_SECS + 2) * 1000, `accepted after ${took} ms`)
  })

  test('made-up kids do not make walcast fetch once each', async () => {
    const before = idp.fetches
    const started = Date.now()
    const tries = await Promise.all(
      Array.from({ length: 30 }, (_, i) => join(st, es256({ ...added, kid: `made-up-${i}` }))),
    )
    const seconds = (Date.now() - started) / 1000
    for (const t of tries) {
      assert.notEqual(t.first.status, 'SUBSCRIBED')
      assert.match(String(t.first.err?.message ?? ''), /no key "made-up-\d+" for ES256/)
      await t.rt.disconnect()
    }
    const fetched = idp.fetches - before
    // One fetch per MIN_REFRESH_SECS for the misses, plus the periodic ones.
    const bound = Math.ceil(seconds / MIN_REFRESH_SECS) + 1 + Math.ceil(seconds / REFRESH_SECS) + 1
    assert.ok(fetched <= bound, `${fetched} fetches for 30 unknown kids in ${seconds} s (bound ${bound})`)
  })

  test('a failing provider leaves the last keys in force', async () => {
    idp.status = 500
    const errorsBefore = await metric(st.server, 'walcast_front_jwks_fetches_total\\{result="error"\\}')
    await until('a failed fetch', async () =>
      (await metric(st.server, 'walcast_front_jwks_fetches_total\\{result="error"\\}')) > errorsBefore,
    (REFRESH_SECS + 5) * 1000)
    const still = await join(st, es256(added))
    try {
      assert.equal(still.first.status, 'SUBSCRIBED', JSON.stringify(still.first))
    } finally {
      await still.rt.disconnect()
      idp.status = 200
    }
  })

  test('a key removed by the provider ends the sessions it verified', async () => {
    const s = await join(st, es256(first))
    try {
      assert.equal(s.first.status, 'SUBSCRIBED')
      idp.keys = [added]
      const started = Date.now()
      await until(`the channel closes (statuses ${JSON.stringify(s.s.statuses)})`,
        () => s.s.statuses.some((x) => x.status === 'CLOSED' || x.status === 'CHANNEL_ERROR'),
        (REFRESH_SECS + 5) * 1000)
      const took = Date.now() - started
      assert.ok(took <= (REFRESH_SECS + 2) * 1000, `ended after ${took} ms`)
      await until('a system error naming the key', () =>
        s.sys.items.some((m) => m.status === 'error' && /no key "key-1"/.test(m.message)))
    } finally {
      await s.rt.disconnect()
    }
  })

  test('a JWKS URL in plain http to another host is refused at start, by name', async () => {
    await assert.rejects(
      startProcess(st.env, 'walcast', ['serve'], { JWT_JWKS_URL: 'http://auth.example.com/jwks.json' }, { standby: true }),
      /JWT_JWKS_URL[\s\S]*JWT_JWKS_ALLOW_HTTP/,
    )
    await assert.rejects(
      startProcess(st.env, 'walcast', ['serve'], { JWT_JWKS_URL: 'file:///etc/jwks.json' }, { standby: true }),
      /JWT_JWKS_URL[\s\S]*https/,
    )
  })
})
