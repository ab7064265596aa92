// The example app (examples/todos) in headless Chromium, as two people use it: each signs
// in in a browser of its own (supabase-js from the page, against `walcast serve`), sees its
// own todos arrive as they change — including one written from another device — and never
// the other's (row-level security), sees who is online in the lobby (presence on a private
// channel) and who leaves, and sees the other's wave (broadcast).
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import fs from 'node:fs'
import path from 'node:path'
import { spawn } from 'node:child_process'
import { launchBrowser } from './lib/browser.js'
import { root, startStack, freePort, jwt, until, SECRET } from './lib/harness.js'
import { serverLog } from './lib/logs.js'

const APP = path.join(root, 'examples', 'todos')
if (!fs.existsSync(path.join(APP, 'node_modules'))) {
  throw new Error(`the example's packages are not installed: run \`npm ci\` in ${APP} (./dev/test does)`)
}

let st, app, appUrl, browser

before(async () => {
  st = await startStack()
  const port = await freePort()
  const child = spawn(process.execPath, ['server.mjs'], {
    cwd: APP,
    env: {
      PATH: process.env.PATH,
      WALCAST_URL: st.server.url,
      ANON_KEY: jwt({}),
      SERVICE_ROLE_KEY: jwt({ role: 'service_role' }),
      JWT_SECRET: SECRET,
      DATABASE_URL: st.env.database_url,
      EXAMPLE_PORT: String(port),
    },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  const log = serverLog('example app', child)
  app = { child, log }
  appUrl = `http://127.0.0.1:${port}`
  await until(`the example app to listen (${log.text()})`, async () => {
    if (child.exitCode !== null) throw new Error(`the example app exited ${child.exitCode}:\n${log.text()}`)
    return (await fetch(`${appUrl}/config.json`).catch(() => null))?.ok
  }, 30000)
  browser = await launchBrowser()
})
after(async () => {
  await browser?.close()
  if (app && app.child.exitCode === null) {
    app.child.kill('SIGTERM')
    await new Promise((resolve) => app.child.once('exit', resolve))
  }
  await st?.stop()
})

/** A person in a browser of their own (no shared storage), signed in and live. */
async function signIn(name) {
  const context = await browser.createBrowserContext()
  const page = await context.newPage()
  const errors = []
  page.on('pageerror', (e) => errors.push(e.message))
  await page.goto(appUrl)
  await page.type('#name', name)
  await page.click('#signin button')
  await until(`${name}'s page to be live (${errors.join('; ')})`, () =>
    page.evaluate(() => document.getElementById('status').textContent === 'live'), 20000)
  const text = (selector) => page.$$eval(selector, (els) => els.map((e) => e.textContent))
  return {
    page,
    context,
    errors,
    todos: () => text('#todos li span'),
    online: () => text('#online li'),
    events: () => text('#events li'),
  }
}

test('two people: own todos live under RLS, who is online, and a wave', { timeout: 120000 }, async () => {
  const alice = await signIn('alice')
  const bob = await signIn('bob')

  // Presence: each sees both, by name.
  await until('both online for bob', async () => (await bob.online()).join() === 'alice,bob')
  await until('both online for alice', async () => (await alice.online()).join() === 'alice,bob')

  // A todo added in the page arrives through walcast (the page renders only what it receives).
  await alice.page.type('#title', 'buy milk')
  await alice.page.click('#add button')
  await until('alice sees her todo', async () => (await alice.todos()).includes('buy milk'))

  // One written from elsewhere (another device, a job) arrives too.
  const { rows } = await st.env.db.query(
    "SELECT owner FROM public.example_todos WHERE title = 'buy milk'")
  await st.env.db.query("INSERT INTO public.example_todos (owner, title) VALUES ($1, 'call the bank')", [rows[0].owner])
  await until('alice sees the todo written elsewhere', async () => (await alice.todos()).includes('call the bank'))

  // Bob's own todo reaches him; alice's never do (his arrives after theirs were streamed).
  await bob.page.type('#title', 'fix the bike')
  await bob.page.click('#add button')
  await until('bob sees his todo', async () => (await bob.todos()).includes('fix the bike'))
  assert.deepEqual(await bob.todos(), ['fix the bike'])
  assert.deepEqual(await alice.todos(), ['buy milk', 'call the bank'])

  // Marking done and deleting stream back as UPDATE and DELETE.
  await alice.page.click('#todos li:first-child input[type=checkbox]')
  await until('alice sees it done', () => alice.page.$eval('#todos li:first-child', (li) => li.className === 'done'))
  await alice.page.click('#todos li:last-child button')
  await until('alice sees it deleted', async () => (await alice.todos()).join() === 'buy milk')

  // A broadcast: bob sees alice's wave; she sees that it was sent.
  await alice.page.click('#wave')
  await until('bob sees the wave', async () => (await bob.events()).includes('alice waves'))
  assert.deepEqual(await alice.events(), ['you waved'])

  // Leaving: alice's browser closes, bob sees her go.
  await alice.context.close()
  await until('alice gone for bob', async () => (await bob.online()).join() === 'bob', 30000)
  assert.deepEqual(bob.errors, [])
  assert.deepEqual(alice.errors, [])
})

test('the example server refuses what a hostile page could send', async () => {
  const post = (p, body, headers = {}) =>
    fetch(`${appUrl}${p}`, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body })
  assert.equal((await post('/api/todos', JSON.stringify({ title: 'x' }))).status, 401, 'no token')
  const forged = jwt({ role: 'authenticated', sub: '00000000-0000-4000-8000-000000000001' }, { secret: 'another-secret-of-at-least-32-chars' })
  assert.equal((await post('/api/todos', JSON.stringify({ title: 'x' }), { authorization: `Bearer ${forged}` })).status, 401, 'forged token')
  const none = jwt({ role: 'authenticated', sub: '00000000-0000-4000-8000-000000000001' }, { alg: 'none' })
  assert.equal((await post('/api/todos', JSON.stringify({ title: 'x' }), { authorization: `Bearer ${none}` })).status, 401, 'alg none')
  assert.equal((await post('/api/session', JSON.stringify({ name: '<script>' }))).status, 400, 'a name with markup')
  assert.equal((await post('/api/session', 'x'.repeat(10000))).status, 413, 'an oversized body')
  const { token } = await (await post('/api/session', JSON.stringify({ name: 'carol' }))).json()
  const auth = { authorization: `Bearer ${token}` }
  // Another's todo cannot be changed: RLS hides it, so it is "not yours".
  const { rows } = await st.env.db.query("INSERT INTO public.example_todos (owner, title) VALUES (gen_random_uuid(), 'not carol''s') RETURNING id")
  const patch = await fetch(`${appUrl}/api/todos/${rows[0].id}`, { method: 'PATCH', headers: { 'content-type': 'application/json', ...auth }, body: '{"done":true}' })
  assert.equal(patch.status, 404)
  const unknown = await fetch(`${appUrl}/nope`)
  assert.equal(unknown.status, 404)
  assert.match(unknown.headers.get('content-type'), /json/)
})
