// What an app does with the unmodified supabase-js against walcast, run by
// supabase_js.test.js under each supported Node version (`node --test` on this file).
// The stack is the caller's: WALCAST_SCENARIO (JSON) names its URL, database, keys and
// whether to give supabase-js the `ws` package as its WebSocket (Node without a native one).
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { createClient } from '@supabase/supabase-js'
import WebSocket from 'ws'
import pg from 'pg'
import { subscribe, until } from './harness.js'

const cfg = JSON.parse(process.env.WALCAST_SCENARIO)
const db = new pg.Client({ connectionString: cfg.databaseUrl })
await db.connect()
const clients = []
after(async () => {
  for (const c of clients) c.realtime.disconnect()
  await db.end()
})

let seq = 0
const uniq = (p) => `${p}-${process.pid}-${++seq}`
const nextId = () => Math.floor(Math.random() * 1e9)

/** A supabase-js client as an app makes one (`options` merged in). */
function supabase(options = {}) {
  const realtime = cfg.transport === 'ws' ? { transport: WebSocket } : {}
  const client = createClient(cfg.url, cfg.anonKey, {
    auth: { persistSession: false, autoRefreshToken: false },
    ...options,
    realtime: { ...realtime, ...options.realtime },
  })
  clients.push(client)
  return client
}

/** Insert todos, then wait until `got` holds `want` ids (and a while more for extras). */
async function expectRows(got, rows, want) {
  for (const r of rows) {
    await db.query('INSERT INTO todos (id, owner, title, done) VALUES ($1, $2, $3, $4)',
      [r.id, r.owner, r.title, r.done])
  }
  await until(`rows ${want}`, () => want.every((id) => got.some((c) => c.new.id === id)))
  // A row the subscriber may not see would come right behind the ones it may.
  await new Promise((r) => setTimeout(r, 500))
  assert.deepEqual(got.map((c) => c.new.id).sort(), [...want].sort())
}

test('postgres_changes with a filter and a user JWT set by realtime.setAuth', async () => {
  const sb = supabase()
  try {
    await sb.realtime.setAuth(cfg.userA)
    const got = []
    const ch = sb.channel(uniq('todos'))
      .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'todos', filter: 'done=eq.false' },
        (c) => got.push(c))
    assert.equal((await subscribe(ch)).status, 'SUBSCRIBED')
    const mine = { id: nextId(), owner: cfg.userAId, title: 'mine', done: false }
    await expectRows(got, [
      mine,
      { id: nextId(), owner: cfg.userAId, title: 'mine, done', done: true },
      { id: nextId(), owner: cfg.userBId, title: 'theirs', done: false },
    ], [mine.id])
    assert.equal(got[0].new.title, 'mine')
    assert.equal(got[0].eventType, 'INSERT')
  } finally {
    await sb.removeAllChannels()
  }
})

test('the accessToken option, awaited before the first subscribe: changes arrive as the user', async () => {
  const sb = supabase({ accessToken: async () => cfg.userB })
  try {
    // supabase-js asks the callback without waiting for it: a channel subscribed at once
    // joins with the project key (as anon) and stays so. Awaiting this first makes the
    // first join carry the user's token (the README's pattern).
    await sb.realtime.setAuth()
    const got = []
    const ch = sb.channel(uniq('todos'))
      .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'todos' }, (c) => got.push(c))
    assert.equal((await subscribe(ch)).status, 'SUBSCRIBED')
    const theirs = { id: nextId(), owner: cfg.userBId, title: 'b', done: false }
    await expectRows(got, [theirs, { id: nextId(), owner: cfg.userAId, title: 'a', done: false }], [theirs.id])
  } finally {
    await sb.removeAllChannels()
  }
})

test('broadcast with ack and self, over the socket and over REST', async () => {
  const sb = supabase()
  const other = supabase()
  try {
    const topic = uniq('room')
    const mine = []
    const theirs = []
    const ch = sb.channel(topic, { config: { broadcast: { ack: true, self: true } } })
      .on('broadcast', { event: 'hello' }, (m) => mine.push(m.payload))
    const listener = other.channel(topic).on('broadcast', { event: 'hello' }, (m) => theirs.push(m.payload))
    assert.equal((await subscribe(ch)).status, 'SUBSCRIBED')
    assert.equal((await subscribe(listener)).status, 'SUBSCRIBED')
    assert.equal(await ch.send({ type: 'broadcast', event: 'hello', payload: { n: 1 } }), 'ok')
    await until('self and the other client get it', () => mine.length === 1 && theirs.length === 1)
    // A channel not joined sends through the REST broadcast endpoint.
    const rest = supabase().channel(topic)
    assert.equal(await rest.httpSend('hello', { n: 2 }).then(() => 'ok', (e) => e.message), 'ok')
    await until('the REST broadcast', () => theirs.length === 2)
    assert.deepEqual(theirs, [{ n: 1 }, { n: 2 }])
  } finally {
    await sb.removeAllChannels()
    await other.removeAllChannels()
  }
})

test('presence: each client sees the other join and leave', async () => {
  const a = supabase()
  const b = supabase()
  try {
    const topic = uniq('lobby')
    const chA = a.channel(topic, { config: { presence: { key: 'alice' } } })
    chA.on('presence', { event: 'sync' }, () => {})
    assert.equal((await subscribe(chA)).status, 'SUBSCRIBED')
    await chA.track({ online_at: 1 })
    const chB = b.channel(topic, { config: { presence: { key: 'bob' } } })
    chB.on('presence', { event: 'sync' }, () => {})
    assert.equal((await subscribe(chB)).status, 'SUBSCRIBED')
    await chB.track({ online_at: 2 })
    await until('both present for both', () =>
      ['alice', 'bob'].every((k) => k in chA.presenceState() && k in chB.presenceState()))
    await b.removeChannel(chB)
    await until('bob gone for alice', () => !('bob' in chA.presenceState()))
  } finally {
    await a.removeAllChannels()
    await b.removeAllChannels()
  }
})

test('private channels: the policy decides who joins', async () => {
  const owner = supabase()
  const anon = supabase()
  try {
    await owner.realtime.setAuth(cfg.userA)
    const topic = `notes:${cfg.userAId}`
    const ok = await subscribe(owner.channel(topic, { config: { private: true } }))
    assert.equal(ok.status, 'SUBSCRIBED')
    const refused = await subscribe(anon.channel(topic, { config: { private: true } }))
    assert.equal(refused.status, 'CHANNEL_ERROR')
    assert.match(refused.err.message, /You do not have permissions to read from this Channel topic/)
  } finally {
    await owner.removeAllChannels()
    await anon.removeAllChannels()
  }
})

test('what walcast does not serve is an error, not an empty success', async () => {
  const sb = supabase()
  const { data, error, status } = await sb.from('todos').select()
  assert.equal(data, null)
  assert.equal(status, 404)
  assert.match(error.message, /walcast serves only \/realtime\/v1/)
  const insert = await sb.from('todos').insert({ id: 1, title: 'x' })
  assert.notEqual(insert.error, null, 'an insert is not reported as done')
})
