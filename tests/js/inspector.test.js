// The inspector page (/inspector) in headless Chromium (Debian's `chromium`, driven with
// puppeteer-core, which downloads no browser). Under both protocol versions, through
// `walcast serve` and through a ws-front beside a cdc-worker (cross-process): it connects with an
// anon key, subscribes to a table, shows a row inserted with psql; sends a broadcast and
// tracks a presence that come back to it; its health panel shows the pipeline active and
// the front. A key signed with another secret is refused with the reason, and anon's join
// to a private channel shows Supabase's refusal. Screenshots are saved as test artifacts.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import fs from 'node:fs'
import path from 'node:path'
import { launchBrowser } from './lib/browser.js'
import { startEnv, startProcess, enableTable, jwt, root, until } from './lib/harness.js'

const ARTIFACTS = process.env.WALCAST_TEST_ARTIFACTS || path.join(root, 'target', 'test-artifacts')


let browser
before(async () => {
  fs.mkdirSync(ARTIFACTS, { recursive: true })
  browser = await launchBrowser()
})
after(async () => {
  await browser?.close()
})

/** Run one statement with the `psql` command-line client, as a person would. */
function psql(url, sql) {
  return new Promise((resolve, reject) => {
    execFile('psql', [url, '-v', 'ON_ERROR_STOP=1', '-qc', sql], (err, stdout, stderr) =>
      err ? reject(new Error(`psql: ${stderr || err.message}`)) : resolve(stdout),
    )
  })
}

/** The page's text inside `selector` (one element). */
const text = (page, selector) => page.$eval(selector, (e) => e.textContent)

/** Wait until `selector` holds `needle`, with a message naming both (bounded). */
async function waitText(page, selector, needle, what) {
  try {
    await page.waitForFunction(
      (s, n) => [...document.querySelectorAll(s)].some((e) => e.textContent.includes(n)),
      { timeout: 20000, polling: 50 },
      selector,
      needle,
    )
  } catch {
    const seen = await page.$$eval(selector, (es) => es.map((e) => e.textContent).join(' | ')).catch(() => '')
    throw new Error(`${what}: no ${JSON.stringify(needle)} in ${selector} within 20 s; saw: ${seen.slice(0, 800)}`)
  }
}

async function openPage(server, vsn, key) {
  const page = await browser.newPage()
  await page.setViewport({ width: 1280, height: 1000 })
  const errors = []
  page.on('pageerror', (e) => errors.push(e.message))
  page.on('console', (m) => m.type() === 'error' && errors.push(m.text()))
  await page.goto(`${server.url}/inspector`, { waitUntil: 'load' })
  await page.$eval('#key', (e, k) => (e.value = k), key)
  await page.select('#vsn', vsn)
  await page.click('#connect-btn')
  return { page, errors }
}

async function joinTable(page, table) {
  await page.click('input[name=mode][value=table]')
  await page.$eval('#table', (e, t) => (e.value = t), table)
  await page.click('#join-btn')
  await page.waitForSelector('#channels li[data-status=subscribed]', { timeout: 20000 })
}

async function joinChannel(page, topic, { priv = false } = {}) {
  await page.click('input[name=mode][value=channel]')
  await page.$eval('#topic', (e, t) => (e.value = t), topic)
  if (priv) await page.click('#private')
  await page.click('#join-btn')
}

/**
 * Everything the page does for one server, checked through what it shows. With the
 * operator's key (the default project's service_role): the health panel's numbers are
 * the whole deployment's, shown to no other key (the default anon key is public).
 */
async function exercise({ server, env, vsn, label, table }) {
  const { page, errors } = await openPage(server, vsn, jwt({ role: 'service_role' }))
  try {
    await waitText(page, '#conn-status', `connected (vsn ${vsn})`, 'connected')
    await joinTable(page, table)
    const body = `hello from psql ${label}`
    await psql(env.database_url, `INSERT INTO ${table} (body) VALUES ('${body}')`)
    await waitText(page, '#log li[data-kind=postgres_changes][data-event=INSERT] .summary', body, 'the inserted row')
    assert.match(await text(page, '#log li[data-kind=postgres_changes] .summary'), new RegExp(`public\\.${table} .*"body":"${body}"`))
    // Expanding a change shows its record.
    await page.click('#log li[data-kind=postgres_changes]')
    assert.match(await text(page, '#log li[data-kind=postgres_changes] pre'), /"record": \{/)

    await joinChannel(page, `room-${label}`)
    await page.waitForSelector(`#channels li[data-topic="realtime:room-${label}"][data-status=joined]`, { timeout: 20000 })
    await page.$eval('#bcast-payload', (e, l) => (e.value = JSON.stringify({ from: l })), label)
    await page.click('#bcast-btn')
    await waitText(page, '#log li[data-kind=broadcast] .summary', `{"from":"${label}"}`, 'the broadcast sent to itself')
    await page.click('#track-btn')
    await waitText(page, '#present li', '"user":"inspector"', 'the tracked presence')

    await page.waitForSelector('#pipelines .pipeline[data-cdc-active=true][data-leader=true]', { timeout: 20000 })
    assert.match(await text(page, '#pipelines .pipeline'), /cdc_active\s*true/)
    // Its own row is live (the panel polls once a second): the page's socket, its two
    // channels, the table binding (the cells' texts run together).
    await waitText(page, '#fronts tbody tr', '(this one)1201serving', 'this front: 1 connection, 2 channels, 0 SSE, 1 subscription')
    // The filter hides what does not match, and shows it again once cleared.
    await page.$eval('#msg-filter', (e) => ((e.value = 'INSERT'), e.dispatchEvent(new Event('input'))))
    const kinds = await page.$$eval('#log li', (es) => es.map((e) => e.dataset.event))
    assert.deepEqual([...new Set(kinds)], ['INSERT'])
    await page.$eval('#msg-filter', (e) => ((e.value = ''), e.dispatchEvent(new Event('input'))))
    const shot = path.join(ARTIFACTS, `inspector-${label}.png`)
    await page.screenshot({ path: shot, fullPage: true })
    assert.deepEqual(errors, [], 'no script errors on the page')
    return shot
  } finally {
    await page.close()
  }
}

async function refusals(server, label) {
  const wrong = jwt({ role: 'anon' }, { secret: 'not-the-project-secret-0123456789abcdef' })
  const bad = await openPage(server, '2.0.0', wrong)
  try {
    await waitText(bad.page, '#conn-error', 'Key refused (HTTP 401)', 'a key signed with another secret')
    assert.equal(await text(bad.page, '#conn-status'), 'refused')
  } finally {
    await bad.page.close()
  }
  const { page } = await openPage(server, '2.0.0', jwt({ role: 'anon' }))
  try {
    await waitText(page, '#conn-status', 'connected', 'connected')
    await joinChannel(page, `secret-${label}`, { priv: true })
    await waitText(page, '#channels li .reason', 'You do not have permissions to read from this Channel topic', 'anon on a private channel')
    await waitText(page, '#log li[data-kind=refused] .summary', 'Unauthorized', 'the refusal in the log')
    await page.screenshot({ path: path.join(ARTIFACTS, `inspector-${label}-refused.png`), fullPage: true })
  } finally {
    await page.close()
  }
}

const SETUP = (t) => `CREATE TABLE ${t} (id int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY, body text NOT NULL)`

describe('walcast serve', () => {
  let env, server
  before(async () => {
    env = await startEnv()
    await env.db.query(SETUP('items'))
    server = await startProcess(env, 'walcast', ['serve'])
    await enableTable(env, 'items')
  })
  after(async () => {
    await server?.stop()
    await env?.stop()
  })

  for (const vsn of ['2.0.0', '1.0.0']) {
    test(`vsn ${vsn}: watch a table, broadcast, presence and health; screenshot`, async (t) => {
      const shot = await exercise({ server, env, vsn, label: `serve-v${vsn[0]}`, table: 'items' })
      t.diagnostic(`screenshot: ${shot}`)
    })
  }

  test('a key signed with another secret and a private channel are refused, with the reason', async () => {
    await refusals(server, 'serve')
  })

  test('the health API wants a valid key; the page comes with a strict CSP', async () => {
    const none = await fetch(`${server.url}/inspector/api/health`)
    assert.equal(none.status, 401)
    const anon = await (await fetch(`${server.url}/inspector/api/health`, { headers: { apikey: jwt({ role: 'anon' }) } })).json()
    assert.equal(anon.role, 'anon')
    // The default anon key is public: up or down only, no deployment-wide numbers.
    for (const p of anon.processes) assert.ok(!p.front || p.front.connections === 0, JSON.stringify(p))
    await until('a beacon from the pipeline', async () => {
      const h = await (await fetch(`${server.url}/inspector/api/health?apikey=${jwt({ role: 'service_role' })}`)).json()
      return h.processes.some((p) => p.worker?.cdc_active && p.front)
    })
    const page = await fetch(`${server.url}/inspector`)
    assert.equal(page.status, 200)
    assert.match(page.headers.get('content-security-policy'), /default-src 'none'/)
  })
})

describe('ws-front and cdc-worker (cross-process)', () => {
  let env, worker, front
  before(async () => {
    env = await startEnv()
    await env.db.query(SETUP('notes'))
    worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url })
    await enableTable(env, 'notes')
    front = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
  })
  after(async () => {
    await front?.stop()
    await worker?.stop()
    await env?.stop()
  })

  for (const vsn of ['2.0.0', '1.0.0']) {
    test(`vsn ${vsn} through ws-front: the same page works, and its health panel hears the worker`, async (t) => {
      const shot = await exercise({ server: front, env, vsn, label: `ws-front-v${vsn[0]}`, table: 'notes' })
      t.diagnostic(`screenshot: ${shot}`)
    })
  }

  test('refusals through ws-front', async () => {
    await refusals(front, 'ws-front')
  })

  test('a front started with INSPECTOR=false serves no inspector', async () => {
    const off = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url, INSPECTOR: 'false' })
    try {
      assert.equal((await fetch(`${off.url}/inspector`)).status, 404)
      assert.equal((await fetch(`${off.url}/inspector/api/health?apikey=${jwt({})}`)).status, 404)
    } finally {
      await off.stop()
    }
  })
})
