// A page on another origin, in headless Chromium: it streams changes with EventSource from
// the SSE endpoint and sends a REST broadcast with fetch (a preflighted request: JSON body,
// `apikey` header), which a realtime-js client receives. With the default (any origin)
// both work; against a server whose CORS_ALLOWED_ORIGINS lists only another origin, the
// browser refuses both (the page sees a network error, nothing is read); the answers'
// headers are checked too (preflight, exposed headers, credentials with a list).
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { once } from 'node:events'
import { launchBrowser } from './lib/browser.js'
import { startStack, startProcess, client, subscribed, collector, uniq, jwt, until } from './lib/harness.js'


let st, narrow, browser, page, pageServer, pageOrigin
const anon = jwt({})

before(async () => {
  st = await startStack({ setupSql: ['CREATE TABLE todos (id int8 PRIMARY KEY, title text)'], tables: ['todos'] })
  // A server that lets only some other origin's pages read.
  narrow = await startStack({
    setupSql: ['CREATE TABLE todos (id int8 PRIMARY KEY, title text)'],
    tables: ['todos'],
    serverEnv: { CORS_ALLOWED_ORIGINS: 'https://app.example.com', CORS_ALLOW_CREDENTIALS: 'true' },
  })
  // The page's own origin: another port of the loopback, so every call is cross-origin.
  pageServer = http.createServer((_, res) => {
    res.writeHead(200, { 'content-type': 'text/html' })
    res.end('<!doctype html><title>another origin</title>')
  })
  pageServer.listen(0, '127.0.0.1')
  await once(pageServer, 'listening')
  pageOrigin = `http://127.0.0.1:${pageServer.address().port}`
  browser = await launchBrowser()
  page = await browser.newPage()
  await page.goto(pageOrigin)
})
after(async () => {
  await browser?.close()
  pageServer?.close()
  await narrow?.stop()
  await st?.stop()
})

/** In the page: open an EventSource and resolve with the first `postgres_changes` data, or `{ error }`. */
const streamInPage = (url, ms) =>
  page.evaluate(
    (url, ms) =>
      new Promise((resolve) => {
        const es = new EventSource(url)
        const done = (v) => {
          es.close()
          resolve(v)
        }
        es.addEventListener('ready', () => {
          window.sseReady = true
        })
        es.addEventListener('postgres_changes', (e) => done({ data: JSON.parse(e.data) }))
        es.onerror = () => done({ error: `EventSource failed (readyState ${es.readyState})` })
        setTimeout(() => done({ error: 'timeout' }), ms)
      }),
    url,
    ms,
  )

/** In the page: a REST broadcast with fetch; `{ status }` or `{ error }`. */
const broadcastInPage = (base, key, topic) =>
  page.evaluate(
    async (base, key, topic) => {
      try {
        const r = await fetch(`${base}/realtime/v1/api/broadcast`, {
          method: 'POST',
          headers: { apikey: key, 'content-type': 'application/json' },
          body: JSON.stringify({ messages: [{ topic, event: 'ping', payload: { from: location.origin } }] }),
        })
        return { status: r.status }
      } catch (e) {
        return { error: String(e) }
      }
    },
    base,
    key,
    topic,
  )

describe('CORS', () => {
  test('any origin by default: a page streams changes over SSE and sends a REST broadcast', async () => {
    await page.evaluate(() => {
      window.sseReady = false
    })
    const stream = streamInPage(`${st.server.url}/realtime/v1/sse?apikey=${anon}&table=todos&event=INSERT`, 20000)
    await until('the page stream to be ready', () => page.evaluate(() => window.sseReady === true), 15000)
    await st.env.db.query("INSERT INTO todos VALUES (1, 'from psql')")
    const got = await stream
    assert.equal(got.error, undefined, got.error)
    assert.equal(got.data.data.record.title, 'from psql')

    const rt = client(st.server)
    try {
      const topic = uniq('cors-room')
      const pings = collector('broadcast')
      await subscribed(rt.channel(topic).on('broadcast', { event: 'ping' }, pings))
      const sent = await broadcastInPage(st.server.url, anon, topic)
      assert.deepEqual(sent, { status: 202 })
      await pings.wait(1)
      assert.equal(pings.items[0].payload.from, pageOrigin)
    } finally {
      await rt.removeAllChannels()
      await rt.disconnect()
    }
  })

  test('a preflight is answered for the headers the page asks for, cached an hour', async () => {
    const r = await fetch(`${st.server.url}/realtime/v1/api/broadcast`, {
      method: 'OPTIONS',
      headers: {
        origin: pageOrigin,
        'access-control-request-method': 'POST',
        'access-control-request-headers': 'apikey, content-type, x-client-info',
      },
    })
    assert.equal(r.status, 200)
    assert.equal(r.headers.get('access-control-allow-origin'), '*')
    assert.match(r.headers.get('access-control-allow-methods'), /POST/)
    assert.equal(r.headers.get('access-control-allow-headers'), 'apikey, content-type, x-client-info')
    assert.equal(r.headers.get('access-control-max-age'), '3600')
    const get = await fetch(`${st.server.url}/realtime/v1/sse?table=todos`, { headers: { origin: pageOrigin } })
    assert.equal(get.status, 401, 'no key: refused, and the page may read why')
    assert.equal(get.headers.get('access-control-allow-origin'), '*')
    assert.match(get.headers.get('access-control-expose-headers'), /retry-after/i)
    // The operator's routes are not for pages.
    const health = await fetch(`${st.server.url}/health`, { headers: { origin: pageOrigin } })
    assert.equal(health.headers.get('access-control-allow-origin'), null)
  })

  test('an origin not listed: the browser refuses the stream and the broadcast', async () => {
    const stream = await streamInPage(`${narrow.server.url}/realtime/v1/sse?apikey=${anon}&table=todos&event=INSERT`, 10000)
    assert.match(stream.error ?? '', /EventSource failed/, JSON.stringify(stream))
    const sent = await broadcastInPage(narrow.server.url, anon, uniq('cors-refused'))
    assert.match(sent.error ?? '', /TypeError/, JSON.stringify(sent))
    // The listed origin is answered, with credentials allowed; others get no grant.
    const listed = await fetch(`${narrow.server.url}/realtime/v1/sse?table=todos`, { headers: { origin: 'https://app.example.com' } })
    assert.equal(listed.headers.get('access-control-allow-origin'), 'https://app.example.com')
    assert.equal(listed.headers.get('access-control-allow-credentials'), 'true')
    const other = await fetch(`${narrow.server.url}/realtime/v1/sse?table=todos`, { headers: { origin: pageOrigin } })
    assert.equal(other.headers.get('access-control-allow-origin'), null)
  })

  test('credentials for any origin are refused at start, by name', async () => {
    await assert.rejects(
      startProcess(st.env, 'walcast', ['serve'], { CORS_ALLOW_CREDENTIALS: 'true' }, { standby: true }),
      /CORS_ALLOW_CREDENTIALS[\s\S]*any origin/,
    )
    await assert.rejects(
      startProcess(st.env, 'walcast', ['serve'], { CORS_ALLOWED_ORIGINS: 'app.example.com' }, { standby: true }),
      /"app.example.com" is not an origin/,
    )
  })
})
