// Delivery across processes: `cdc-worker` publishes to the testenv's NATS, two `ws-front`
// processes serve realtime-js clients. Changes reach clients of both fronts; broadcasts
// reach clients connected to the other front; presence (JetStream KV) is shared by the
// fronts, and a killed front's presences disappear for the others within PRESENCE_TTL_SECS.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, collector, subscribed, uniq, until, VSNS } from './lib/harness.js'

let env, worker, front1, front2
const PRESENCE_TTL = '4'
const clients = []

before(async () => {
  env = await startEnv()
  await env.db.query('CREATE TABLE x (id int8 PRIMARY KEY, owner int4, v text)')
  worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url })
  await enableTable(env, 'x')
  front1 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url, PRESENCE_TTL_SECS: PRESENCE_TTL })
  front2 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url, PRESENCE_TTL_SECS: PRESENCE_TTL })
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

for (const vsn of VSNS) {
  test(`vsn ${vsn}: presence tracked on one front is seen on the other: join, sync, untrack, leave`, async () => {
    const topic = uniq('xppres')
    const a = newClient(front1, { vsn })
    const b = newClient(front2, { vsn })
    const joins = collector('front2 join')
    const leaves = collector('front2 leave')
    const syncs = collector('front2 sync')
    const chB = await subscribed(
      b
        .channel(topic)
        .on('presence', { event: 'join' }, joins)
        .on('presence', { event: 'leave' }, leaves)
        .on('presence', { event: 'sync' }, syncs),
    )
    await syncs.wait(1, 'the initial sync (presence_state)')
    assert.deepEqual(chB.presenceState(), {})

    const chA = await subscribed(a.channel(topic, { config: { presence: { key: 'ann' } } }))
    assert.equal(await chA.track({ user: 'ann', n: 1 }), 'ok')
    await joins.wait(1)
    assert.equal(joins.items[0].key, 'ann')
    assert.equal(joins.items[0].newPresences[0].user, 'ann')
    await until('front2 to see ann in its state', () => chB.presenceState().ann?.length === 1)
    await syncs.wait(2, 'a sync after the join')

    // A client joining front2 later gets ann in its first state.
    const c = newClient(front2, { vsn })
    const chC = await subscribed(c.channel(topic).on('presence', { event: 'sync' }, () => {}))
    await until('a later client of front2 to see ann', () => chC.presenceState().ann?.[0]?.user === 'ann')

    assert.equal(await chA.untrack(), 'ok')
    await leaves.wait(1)
    assert.equal(leaves.items[0].key, 'ann')
    assert.equal(leaves.items[0].leftPresences[0].user, 'ann')
    await until('front2 state to be empty', () => Object.keys(chB.presenceState()).length === 0)

    // Track again, then leave the channel on front1: a leave on front2.
    assert.equal(await chA.track({ user: 'ann', n: 2 }), 'ok')
    await joins.wait(2)
    assert.equal(joins.items[1].newPresences[0].n, 2)
    await a.removeChannel(chA)
    await leaves.wait(2)
    assert.equal(leaves.items[1].leftPresences[0].n, 2)
    await until('front2 state to be empty after front1 left', () => Object.keys(chB.presenceState()).length === 0)
  })
}

test('killing a front (SIGKILL) removes its presences for the other front within the TTL', async () => {
  const front3 = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url, PRESENCE_TTL_SECS: PRESENCE_TTL })
  try {
    const topic = uniq('xpkill')
    const a = newClient(front3)
    const b = newClient(front2)
    const leaves = collector('front2 leave')
    const chB = await subscribed(b.channel(topic).on('presence', { event: 'leave' }, leaves))
    const chA = await subscribed(a.channel(topic, { config: { presence: { key: 'zed' } } }))
    assert.equal(await chA.track({ user: 'zed' }), 'ok')
    await until('front2 to see zed', () => chB.presenceState().zed?.length === 1)
    front3.child.kill('SIGKILL')
    const killed = Date.now()
    const bound = (Number(PRESENCE_TTL) + 4) * 1000
    await until('front2 to drop zed after front3 died', () => Object.keys(chB.presenceState()).length === 0, bound)
    assert.ok(Date.now() - killed <= bound, `leave after ${Date.now() - killed} ms`)
    await leaves.wait(1)
    assert.equal(leaves.items[0].key, 'zed')
  } finally {
    // stop() waits for an exit that already happened when the process was killed.
    if (front3.child.exitCode === null && front3.child.signalCode === null) await front3.stop()
  }
})
