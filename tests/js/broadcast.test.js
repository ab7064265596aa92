// Broadcast and presence between two realtime-js clients: `self`, `ack`, event routing,
// every pairing of protocol versions (2.0.0 sends binary kind 3 and receives kind 4, 1.0.0
// uses text frames), raw binary payloads, the REST endpoints (httpSend and the send()
// fallback), and presence track / untrack / leave.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, collector, subscribed, uniq, until, VSNS } from './lib/harness.js'

let st
before(async () => {
  st = await startStack()
})
after(async () => {
  await st?.stop()
})

const quiet = { logger: () => {} }
const clients = []
function newClient(opts) {
  const rt = client(st.server, { ...quiet, ...opts })
  clients.push(rt)
  return rt
}
after(async () => {
  for (const rt of clients) {
    await rt.removeAllChannels().catch(() => {})
    await rt.disconnect()
  }
})

for (const sendVsn of VSNS) {
  for (const recvVsn of VSNS) {
    describe(`sender vsn ${sendVsn}, receiver vsn ${recvVsn}`, () => {
      test('self: false — the other client receives, the sender does not', async () => {
        const topic = uniq('bc')
        const a = newClient({ vsn: sendVsn })
        const b = newClient({ vsn: recvVsn })
        const gotA = collector('sender')
        const gotB = collector('receiver')
        const chA = await subscribed(a.channel(topic).on('broadcast', { event: 'msg' }, gotA))
        const chB = await subscribed(b.channel(topic).on('broadcast', { event: 'msg' }, gotB))
        assert.equal(await chA.send({ type: 'broadcast', event: 'msg', payload: { n: 1, s: 'hé', nested: { a: [1, null] } } }), 'ok')
        await gotB.wait(1)
        assert.deepEqual(gotB.items[0], { type: 'broadcast', event: 'msg', payload: { n: 1, s: 'hé', nested: { a: [1, null] } } })
        // The receiver answers; the sender gets that, and never its own message.
        assert.equal(await chB.send({ type: 'broadcast', event: 'msg', payload: { n: 2 } }), 'ok')
        await gotA.wait(1)
        assert.deepEqual(gotA.items.map((m) => m.payload), [{ n: 2 }])
        assert.deepEqual(gotB.items.map((m) => m.payload.n), [1])
      })

      test('self: true — the sender receives its own message too', async () => {
        const topic = uniq('bcself')
        const a = newClient({ vsn: sendVsn })
        const b = newClient({ vsn: recvVsn })
        const gotA = collector('sender')
        const gotB = collector('receiver')
        const chA = await subscribed(a.channel(topic, { config: { broadcast: { self: true } } }).on('broadcast', { event: 'msg' }, gotA))
        await subscribed(b.channel(topic).on('broadcast', { event: 'msg' }, gotB))
        await chA.send({ type: 'broadcast', event: 'msg', payload: { k: 'v' } })
        await gotA.wait(1)
        await gotB.wait(1)
        assert.deepEqual(gotA.items, [{ type: 'broadcast', event: 'msg', payload: { k: 'v' } }])
        assert.deepEqual(gotB.items, [{ type: 'broadcast', event: 'msg', payload: { k: 'v' } }])
      })

      test('ack: true — send() resolves ok once the server acknowledged, and the message arrives', async () => {
        const topic = uniq('bcack')
        const a = newClient({ vsn: sendVsn })
        const b = newClient({ vsn: recvVsn })
        const gotB = collector('receiver')
        const chA = await subscribed(a.channel(topic, { config: { broadcast: { ack: true } } }))
        await subscribed(b.channel(topic).on('broadcast', { event: '*' }, gotB))
        for (let i = 0; i < 5; i++) {
          assert.equal(await chA.send({ type: 'broadcast', event: `e${i}`, payload: { i } }), 'ok')
        }
        await gotB.wait(5)
        assert.deepEqual(gotB.items.map((m) => [m.event, m.payload.i]), [0, 1, 2, 3, 4].map((i) => [`e${i}`, i]))
      })

      test('the receiver routes by event name', async () => {
        const topic = uniq('bcroute')
        const a = newClient({ vsn: sendVsn })
        const b = newClient({ vsn: recvVsn })
        const onA = collector('event a')
        const onAny = collector('event *')
        const chA = await subscribed(a.channel(topic))
        await subscribed(b.channel(topic).on('broadcast', { event: 'a' }, onA).on('broadcast', { event: '*' }, onAny))
        await chA.send({ type: 'broadcast', event: 'b', payload: { x: 1 } })
        await chA.send({ type: 'broadcast', event: 'a', payload: { x: 2 } })
        await onAny.wait(2)
        await onA.wait(1)
        assert.deepEqual(onAny.items.map((m) => [m.event, m.payload.x]), [['b', 1], ['a', 2]])
        assert.deepEqual(onA.items.map((m) => [m.event, m.payload.x]), [['a', 2]])
      })
    })
  }
}

test('vsn 2.0.0: a raw binary payload round-trips byte for byte', async () => {
  const topic = uniq('bcbin')
  const a = newClient()
  const b = newClient()
  const gotB = collector('receiver')
  const chA = await subscribed(a.channel(topic))
  await subscribed(b.channel(topic).on('broadcast', { event: 'bin' }, gotB))
  const bytes = new Uint8Array([0, 1, 2, 250, 255, 10, 13, 123, 34])
  assert.equal(await chA.send({ type: 'broadcast', event: 'bin', payload: bytes.buffer }), 'ok')
  await gotB.wait(1)
  const p = gotB.items[0].payload
  assert.ok(p instanceof ArrayBuffer, `payload is ${p?.constructor?.name}`)
  assert.deepEqual([...new Uint8Array(p)], [...bytes])
})

test('messages on another topic do not arrive', async () => {
  const topic = uniq('bciso')
  const a = newClient()
  const b = newClient()
  const gotB = collector('receiver')
  const other = await subscribed(a.channel(uniq('bcother')))
  const same = await subscribed(a.channel(topic))
  await subscribed(b.channel(topic).on('broadcast', { event: '*' }, gotB))
  await other.send({ type: 'broadcast', event: 'x', payload: { from: 'other topic' } })
  await same.send({ type: 'broadcast', event: 'x', payload: { from: 'same topic' } })
  await gotB.wait(1)
  assert.deepEqual(gotB.items.map((m) => m.payload.from), ['same topic'])
})

for (const vsn of VSNS) {
  test(`vsn ${vsn}: httpSend() posts to the REST endpoint (202) and subscribers receive it`, async () => {
    const topic = uniq('bchttp')
    const a = newClient({ vsn })
    const b = newClient({ vsn })
    const gotB = collector('receiver')
    await subscribed(b.channel(topic).on('broadcast', { event: 'rest' }, gotB))
    const chA = a.channel(topic) // never joined: REST needs no subscription
    assert.deepEqual(await chA.httpSend('rest', { via: 'httpSend' }), { success: true })
    await gotB.wait(1)
    assert.deepEqual(gotB.items, [{ type: 'broadcast', event: 'rest', payload: { via: 'httpSend' } }])
  })

  test(`vsn ${vsn}: send() on a channel that is not joined falls back to the batch REST endpoint`, async () => {
    const topic = uniq('bcfallback')
    const a = newClient({ vsn })
    const b = newClient({ vsn })
    const gotB = collector('receiver')
    await subscribed(b.channel(topic).on('broadcast', { event: 'rest' }, gotB))
    const chA = a.channel(topic)
    assert.equal(await chA.send({ type: 'broadcast', event: 'rest', payload: { via: 'batch' } }), 'ok')
    await gotB.wait(1)
    assert.deepEqual(gotB.items, [{ type: 'broadcast', event: 'rest', payload: { via: 'batch' } }])
  })
}

test('httpSend() with a bad token is refused with the server error', async () => {
  const a = newClient()
  await a.setAuth('not-a-jwt')
  await assert.rejects(a.channel(uniq('bchttpbad')).httpSend('x', { a: 1 }), (e) => {
    assert.match(e.message, /token/i)
    return true
  })
})

for (const vsn of VSNS) {
  describe(`presence, vsn ${vsn}`, () => {
    test('track: the other client sees join and sync; untrack: leave; leaving the channel: leave', async () => {
      const topic = uniq('pres')
      const a = newClient({ vsn })
      const b = newClient({ vsn })
      const joins = collector('join')
      const leaves = collector('leave')
      const syncs = collector('sync')
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
      await until('B to see ann in its state', () => chB.presenceState().ann?.length === 1)
      const j = joins.items[0]
      assert.equal(j.event, 'join')
      assert.equal(j.key, 'ann')
      assert.equal(j.newPresences.length, 1)
      assert.equal(j.newPresences[0].user, 'ann')
      assert.equal(j.newPresences[0].n, 1)
      assert.equal(typeof j.newPresences[0].presence_ref, 'string')
      const st1 = chB.presenceState()
      assert.deepEqual(Object.keys(st1), ['ann'])
      assert.deepEqual({ ...st1.ann[0], presence_ref: 'x' }, { user: 'ann', n: 1, presence_ref: 'x' })

      // Untrack: a leave for ann, and the state is empty again.
      assert.equal(await chA.untrack(), 'ok')
      await leaves.wait(1)
      assert.equal(leaves.items[0].key, 'ann')
      assert.equal(leaves.items[0].leftPresences[0].user, 'ann')
      await until('B state to be empty', () => Object.keys(chB.presenceState()).length === 0)

      // Track again, then leave the channel: leaving untracks.
      assert.equal(await chA.track({ user: 'ann', n: 2 }), 'ok')
      await joins.wait(2)
      assert.equal(joins.items[1].newPresences[0].n, 2)
      await a.removeChannel(chA)
      await leaves.wait(2)
      assert.equal(leaves.items[1].key, 'ann')
      assert.equal(leaves.items[1].leftPresences[0].n, 2)
      await until('B state to be empty after A left', () => Object.keys(chB.presenceState()).length === 0)
      assert.equal(joins.items.length, 2)
    })

    test('a client joining later gets the current state in its first sync; a disconnect is a leave', async () => {
      const topic = uniq('presstate')
      const a = newClient({ vsn })
      const chA = await subscribed(a.channel(topic, { config: { presence: { key: 'bob' } } }))
      assert.equal(await chA.track({ user: 'bob' }), 'ok')
      const b = newClient({ vsn })
      const syncs = collector('sync')
      const leaves = collector('leave')
      const chB = await subscribed(
        b.channel(topic).on('presence', { event: 'sync' }, syncs).on('presence', { event: 'leave' }, leaves),
      )
      await until('the state to hold bob', () => chB.presenceState().bob?.length === 1)
      assert.equal(chB.presenceState().bob[0].user, 'bob')
      await a.disconnect()
      await leaves.wait(1, 'a leave once the tracking socket is gone')
      assert.equal(leaves.items[0].key, 'bob')
      await until('B state to be empty', () => Object.keys(chB.presenceState()).length === 0)
    })
  })
}
