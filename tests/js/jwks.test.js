// Asymmetric user tokens and secret rotation through the unmodified client: an ES256
// token whose key is in the project's JWKS (chosen by `kid`) joins and receives; a
// refresh with a token of an unknown `kid` closes the channel; during a rotation a token
// signed with the previous secret still works. Both sources.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { generateKeyPairSync, sign } from 'node:crypto'
import { startStack, client, collector, subscribeTracked, uniq, until, jwt } from './lib/harness.js'

const b64url = (buf) => Buffer.from(buf).toString('base64url')
const { privateKey, publicKey } = generateKeyPairSync('ec', { namedCurve: 'P-256' })
const JWKS = { keys: [{ ...publicKey.export({ format: 'jwk' }), kid: 'user-key-1', alg: 'ES256', use: 'sig' }] }
const PREVIOUS = 'walcast-js-previous-secret-0123456789'

function es256(claims, kid = 'user-key-1') {
  const now = Math.floor(Date.now() / 1000)
  const head = b64url(JSON.stringify({ alg: 'ES256', typ: 'JWT', kid }))
  const body = b64url(JSON.stringify({ iat: now, exp: now + 3600, role: 'authenticated', ...claims }))
  const sig = sign('sha256', Buffer.from(`${head}.${body}`), { key: privateKey, dsaEncoding: 'ieee-p1363' })
  return `${head}.${body}.${b64url(sig)}`
}

for (const source of ['stream', 'poll']) describe(`JWKS and rotation, ${source} source`, () => {
  let st, db
  before(async () => {
    st = await startStack({
      setupSql: ['CREATE TABLE k (id int8 PRIMARY KEY, v text)'],
      tables: ['k'],
      serverEnv: { JWT_JWKS: JSON.stringify(JWKS), JWT_SECRET_PREVIOUS: PREVIOUS, CDC_SOURCE: source },
    })
    db = st.env.db
  })
  after(async () => {
    await st?.stop()
  })

  test('an ES256 user token from the JWKS joins and receives; an unknown kid closes the channel', async () => {
    const rt = client(st.server)
    const got = collector('changes')
    const sys = collector('system')
    try {
      await rt.setAuth(es256({ sub: 'u1' }))
      const ch = rt
        .channel(uniq('es256'))
        .on('system', {}, sys)
        .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'k' }, got)
      const s = subscribeTracked(ch)
      assert.equal((await s.first).status, 'SUBSCRIBED')
      await sys.wait(1)
      await db.query("INSERT INTO k VALUES (1, 'one')")
      await got.wait(1)
      assert.deepEqual(got.items[0].new, { id: 1, v: 'one' })

      await rt.setAuth(es256({ sub: 'u1' }, 'retired-key'))
      await until(`CLOSED after an unknown kid (statuses ${JSON.stringify(s.statuses)})`, () =>
        s.statuses.some((x) => x.status === 'CLOSED'))
      await sys.wait(2)
      assert.equal(sys.items[1].status, 'error')
      assert.match(sys.items[1].message, /no key "retired-key" for ES256/)
    } finally {
      await rt.removeAllChannels()
      await rt.disconnect()
    }
  })

  test('during a rotation the previous secret still verifies', async () => {
    const rt = client(st.server, { apikey: jwt({}, { secret: PREVIOUS }) })
    const got = collector('changes')
    try {
      const ch = rt.channel(uniq('rotation')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'k' }, got)
      const s = subscribeTracked(ch)
      assert.equal((await s.first).status, 'SUBSCRIBED')
      await db.query("INSERT INTO k VALUES (2, 'two')")
      await got.wait(1)
      assert.equal(got.items[0].new.id, 2)
    } finally {
      await rt.removeAllChannels()
      await rt.disconnect()
    }
  })
})
