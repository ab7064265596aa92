// Large audiences: 40,000 subscriptions on one table across two ws-front processes
// (several channels per socket, up to 100 distinct bindings per channel: realtime-js
// collapses identical ones), realtime-js clients, nats-server
// with max_payload lowered to 64 KB. Every subscriber gets every change; what the worker
// publishes per change does not grow with the audience (100 vs 40,000 subscribers); a
// bystander on another table keeps receiving. With row-level security on and distinct
// claims (40,000 subscriptions judged one by one), every message still fits 64 KB, each
// user gets exactly the rows its policy allows, and nothing is skipped; a change split
// over several messages still reaches each channel in one frame (two where a message
// ends): before, each message named subscriptions of every channel, so a channel got
// the change once per message, and a socket's queue overflowed under load (the socket
// was closed as a slow consumer, the client reconnected and missed the rows).
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, jwt, subscribed, uniq, until, metric } from './lib/harness.js'

const MAX_PAYLOAD = 65536
const CHANNELS = 100
const BINDINGS = 100

let env, worker, front1, front2
const clients = []

before(async () => {
  env = await startEnv({ natsMaxPayload: MAX_PAYLOAD })
  await env.db.query('CREATE TABLE feed (id int8 PRIMARY KEY, v text)')
  await env.db.query('CREATE TABLE other (id int8 PRIMARY KEY, v text)')
  await env.db.query('CREATE TABLE inbox (id int8 PRIMARY KEY, owner text NOT NULL, v text)')
  worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url })
  for (const t of ['feed', 'other', 'inbox']) await enableTable(env, t)
  await env.db.query('ALTER TABLE inbox ENABLE ROW LEVEL SECURITY')
  await env.db.query("CREATE POLICY mine ON inbox FOR SELECT USING (owner = auth.jwt() ->> 'sub' OR owner = 'everyone')")
  front1 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
  front2 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
})
after(async () => {
  for (const rt of clients) {
    await rt.removeAllChannels().catch(() => {})
    rt.disconnect()
  }
  await front1?.stop()
  await front2?.stop()
  await worker?.stop()
  await env?.stop()
})

/** A socket as user `sub`, `channels` channels with `bindings` bindings each on `table`; counts deliveries per row id. */
async function socket(front, sub, table, channels, bindings) {
  const token = jwt({ role: 'authenticated', sub })
  const rt = client(front, { apikey: token, accessToken: async () => token, logger: () => {}, timeout: 60000 })
  clients.push(rt)
  const got = new Map()
  const count = (p) => {
    const id = Number(p.new.id)
    got.set(id, (got.get(id) ?? 0) + 1)
  }
  const joins = []
  for (let c = 0; c < channels; c += 1) {
    const ch = rt.channel(uniq(`${table}-${sub}`))
    // Distinct filters that every row passes (v is never 'z…').
    for (let b = 0; b < bindings; b += 1) ch.on('postgres_changes', { event: 'INSERT', schema: 'public', table, filter: `v=neq.z${b}` }, count)
    joins.push(subscribed(ch, 120000))
  }
  await Promise.all(joins)
  return { sub, got, expect: channels * bindings }
}

/** Insert one row and return [messages, bytes] the worker published for it, once `sockets` all received it. */
async function publishedFor(table, id, sockets) {
  const [m0, b0] = [await metric(worker, 'walcast_cdc_published_messages_total'), await metric(worker, 'walcast_cdc_published_bytes_total')]
  await env.db.query(`INSERT INTO ${table} VALUES ($1, 'x')`, [id])
  for (const s of sockets) {
    await until(`${s.sub} to get row ${id} ${s.expect} times (has ${s.got.get(id) ?? 0})`, () => (s.got.get(id) ?? 0) >= s.expect, 120000)
  }
  // Deliveries go first; the audience-free copy on the table subject is the change's last message.
  await until('the change to be published on its table subject', async () => (await metric(worker, 'walcast_cdc_published_messages_total')) >= m0 + 3, 10000)
  return [(await metric(worker, 'walcast_cdc_published_messages_total')) - m0, (await metric(worker, 'walcast_cdc_published_bytes_total')) - b0]
}

test('40,000 subscriptions on one table over two fronts: all deliver, bytes per change as with 100, a bystander keeps receiving', async () => {
  const small = [await socket(front1, 'small-1', 'feed', 1, 50), await socket(front2, 'small-2', 'feed', 1, 50)]
  const [m100, b100] = await publishedFor('feed', 1, small)
  for (const s of small) assert.equal(s.got.get(1), 50)

  const started = Date.now()
  // 8 sockets x 100 channels x the same 50 bindings = 40,000.
  const big = await Promise.all(
    Array.from({ length: 8 }, (_, i) => socket(i % 2 ? front2 : front1, `u${i}`, 'feed', CHANNELS, 50)),
  )
  const joinMs = Date.now() - started
  const bystander = await socket(front2, 'bystander', 'other', 1, 1)
  const all = [...small, ...big]
  const [m40k, b40k] = await publishedFor('feed', 2, all)
  console.log(`# 40,100 subscriptions joined in ${joinMs} ms; per change: ${m100} messages / ${b100} bytes with 100 subscriptions, ${m40k} / ${b40k} with 40,100`)
  assert.equal(m40k, m100, 'as many messages per change')
  assert.ok(Math.abs(b40k - b100) <= 16, `bytes per change ${b40k} vs ${b100} (only the row's own digits may differ)`)
  for (const s of all) assert.equal(s.got.get(2), s.expect, `${s.sub}: every binding exactly once`)

  // The bystander, and more changes for everyone, in order.
  await env.db.query("INSERT INTO other VALUES (1, 'still here')")
  await publishedFor('feed', 3, all)
  await until('the bystander row', () => bystander.got.get(1) === 1, 30000)
  assert.equal(await metric(worker, 'walcast_cdc_changes_skipped_total'), 0)
})

test('row-level security with distinct claims and 40,000 subscriptions: every message fits 64 KB, each user gets exactly its rows', async () => {
  const users = await Promise.all([
    socket(front1, 'r1', 'inbox', CHANNELS, BINDINGS),
    socket(front1, 'r2', 'inbox', CHANNELS, BINDINGS),
    socket(front2, 'r3', 'inbox', CHANNELS, BINDINGS),
    socket(front2, 'r4', 'inbox', CHANNELS, BINDINGS),
  ])
  const frames = async () => (await metric(front1, 'walcast_front_deliveries_total')) + (await metric(front2, 'walcast_front_deliveries_total'))
  const frames0 = await frames()
  await env.db.query("INSERT INTO inbox VALUES (1, 'everyone', 'hello all')")
  await env.db.query("INSERT INTO inbox VALUES (2, 'r1', 'for r1 only')")
  await env.db.query("INSERT INTO inbox VALUES (3, 'r3', 'for r3 only')")
  await env.db.query("INSERT INTO inbox VALUES (4, 'everyone', 'last')")
  for (const u of users) {
    await until(`${u.sub} to get the last row ${u.expect} times (has ${u.got.get(4) ?? 0})`, () => (u.got.get(4) ?? 0) >= u.expect, 120000)
  }
  for (const u of users) {
    const own = { r1: 2, r3: 3 }[u.sub]
    const expected = new Map([[1, u.expect], [4, u.expect]])
    if (own) expected.set(own, u.expect)
    assert.deepEqual(new Map([...u.got].sort((a, b) => a[0] - b[0])), new Map([...expected].sort((a, b) => a[0] - b[0])), `${u.sub}: exactly the rows its policy allows`)
  }
  assert.ok((await metric(worker, 'walcast_cdc_changes_split_total')) > 0, 'verdicts for 20,000 subscriptions per front took several messages')
  // Rows 1 and 4 to the 400 channels, 2 and 3 to one user's 100; one more frame per channel at
  // most where a message of a split change ends (about ten messages per change and front).
  const channels = 2 * 4 * CHANNELS + 2 * CHANNELS
  const sent = (await frames()) - frames0
  console.log(`# ${sent} frames for ${channels} (channel, change) deliveries`)
  assert.ok(sent >= channels && sent <= channels * 1.1, `${sent} frames for ${channels} (channel, change) deliveries`)
  assert.equal(await metric(front1, 'walcast_front_slow_consumer_disconnects_total'), 0)
  assert.equal(await metric(front2, 'walcast_front_slow_consumer_disconnects_total'), 0)
  const largest = await metric(worker, 'walcast_cdc_largest_message_bytes')
  assert.ok(largest > 0 && largest <= MAX_PAYLOAD, `largest message ${largest} bytes`)
  assert.equal(await metric(worker, 'walcast_cdc_changes_skipped_total'), 0)
  assert.equal(await metric(worker, 'walcast_cdc_changes_oversized_total'), 0)
})
