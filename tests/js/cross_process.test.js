// Delivery across processes: `cdc-worker` publishes to the testenv's NATS, two `ws-front`
// processes serve realtime-js clients. Changes reach clients of both fronts; broadcasts
// reach clients connected to the other front. (Presence is per front for now: presence.rs.)
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, collector, subscribed, uniq, VSNS } from './lib/harness.js'

let env, worker, front1, front2
const clients = []

before(async () => {
  env = await startEnv()
  await env.db.query('CREATE TABLE x (id int8 PRIMARY KEY, owner int4, v text)')
  worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url })
  await enableTable(env, 'x')
  front1 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
  front2 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
})
after(async () => {
  for (const rt of clients) {
    await rt.removeAllChannels().catch(() => {})
    await rt.disconnect()
  }
  await front2?.stop()
  await front1?.stop()
  await worker?.stop()
  await env?.stop()
})

function newClient(server, opts) {
  const rt = client(server, { logger: () => {}, ...opts })
  clients.push(rt)
  return rt
}

let nextId = 1
const X = (event, extra = {}) => ({ event, schema: 'public', table: 'x', ...extra })

for (const vsn of VSNS) {
  test(`vsn ${vsn}: an insert committed after SUBSCRIBED reaches realtime-js through cdc-worker → NATS → ws-front`, async () => {
    const rt = newClient(front1, { vsn })
    const got = collector('changes')
    const sys = collector('system')
    const ch = await subscribed(rt.channel(uniq('xp')).on('system', {}, sys).on('postgres_changes', X('INSERT'), got))
    const id = nextId++
    await env.db.query('INSERT INTO x VALUES ($1, 1, $2)', [id, 'across'])
    await got.wait(1)
    assert.equal(got.items[0].eventType, 'INSERT')
    assert.deepEqual(got.items[0].new, { id, owner: 1, v: 'across' })
    await sys.wait(1)
    assert.equal(sys.items[0].status, 'ok')
    await rt.removeChannel(ch)
  })
}

test('clients of two fronts each get their changes; filters are applied across processes', async () => {
  const rt1 = newClient(front1)
  const rt2 = newClient(front2)
  const all1 = collector('front1 *')
  const mine2 = collector('front2 owner=eq.2')
  await subscribed(rt1.channel(uniq('xp1')).on('postgres_changes', X('*'), all1))
  await subscribed(rt2.channel(uniq('xp2')).on('postgres_changes', X('*', { filter: 'owner=eq.2' }), mine2))
  const [a, b] = [nextId++, nextId++]
  await env.db.query("INSERT INTO x VALUES ($1, 1, 'one')", [a])
  await env.db.query("INSERT INTO x VALUES ($1, 2, 'two')", [b])
  await env.db.query("UPDATE x SET v = 'two!' WHERE id = $1", [b])
  await env.db.query('DELETE FROM x WHERE id = $1', [b])
  await all1.wait(4)
  await mine2.wait(3)
  assert.deepEqual(all1.items.map((p) => [p.eventType, p.new.id ?? p.old.id]), [['INSERT', a], ['INSERT', b], ['UPDATE', b], ['DELETE', b]])
  assert.deepEqual(mine2.items.map((p) => [p.eventType, p.new.id ?? p.old.id]), [['INSERT', b], ['UPDATE', b], ['DELETE', b]])
  assert.deepEqual(mine2.items[1].old, { id: b, owner: 2, v: 'two' })
})

test('unsubscribing on one front stops its delivery, the other front keeps receiving', async () => {
  const rt1 = newClient(front1)
  const rt2 = newClient(front2)
  const g1 = collector('front1')
  const g2 = collector('front2')
  const c1 = await subscribed(rt1.channel(uniq('xpu1')).on('postgres_changes', X('INSERT'), g1))
  await subscribed(rt2.channel(uniq('xpu2')).on('postgres_changes', X('INSERT'), g2))
  const [a, b] = [nextId++, nextId++]
  await env.db.query("INSERT INTO x VALUES ($1, 1, 'a')", [a])
  await g1.wait(1)
  await g2.wait(1)
  assert.equal(await rt1.removeChannel(c1), 'ok')
  await env.db.query("INSERT INTO x VALUES ($1, 1, 'b')", [b])
  await g2.wait(2)
  assert.deepEqual(g2.items.map((p) => p.new.id), [a, b])
  assert.deepEqual(g1.items.map((p) => p.new.id), [a])
})

test('a broadcast sent on one front reaches a client of the other front', async () => {
  const topic = uniq('xpbc')
  const rt1 = newClient(front1)
  const rt2 = newClient(front2)
  const got = collector('front2 broadcast')
  const c1 = await subscribed(rt1.channel(topic, { config: { broadcast: { ack: true } } }))
  await subscribed(rt2.channel(topic).on('broadcast', { event: 'hello' }, got))
  assert.equal(await c1.send({ type: 'broadcast', event: 'hello', payload: { from: 'front1' } }), 'ok')
  await got.wait(1)
  assert.deepEqual(got.items, [{ type: 'broadcast', event: 'hello', payload: { from: 'front1' } }])
})
