// The official Phoenix JS client (npm `phoenix`, not realtime-js) against walcast, over vsn
// 2.0.0 (its default serializer: JSON arrays, binary kinds 0-2 only) and 1.0.0 (JSON
// objects). It must be able to read everything a JSON client is sent: broadcasts that came
// as JSON (its own pushes, the REST API) arrive as text frames, as Supabase frames them.
// Each run joins a channel with postgres_changes and broadcast {self, ack,
// replication_ready}, receives a change, sends and receives a broadcast (the ack reply
// arrives), leaves, and disconnects: its Close must be answered with a Close (code 1000,
// clean), not a dropped connection (1006).
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Socket } from 'phoenix'
import WebSocket from 'ws'
import { startStack, jwt, until, uniq } from './lib/harness.js'

let st
before(async () => {
  st = await startStack({
    setupSql: ['CREATE TABLE items (id int8 PRIMARY KEY, title text)'],
    tables: ['items'],
  })
})
after(async () => {
  await st?.stop()
})

/** `ws` (Node 20 has no global WebSocket) that records the close events it sees. */
class RecordingWebSocket extends WebSocket {
  constructor(url, protocols) {
    super(url, protocols)
    this.closes = []
    this.addEventListener('close', (e) => this.closes.push({ code: e.code, reason: e.reason, wasClean: e.wasClean }))
    RecordingWebSocket.opened.push(this)
  }
}
RecordingWebSocket.opened = []

/** vsn 1.0.0 frames: `{topic, event, payload, ref, join_ref}` objects, text only. */
const v1Serializer = {
  encode: (m, cb) => cb(JSON.stringify({ topic: m.topic, event: m.event, payload: m.payload, ref: m.ref, join_ref: m.join_ref })),
  decode: (raw, cb) => {
    assert.equal(typeof raw, 'string', 'vsn 1.0.0 frames are text')
    return cb(JSON.parse(raw))
  },
}

function newSocket(vsn) {
  const errors = []
  const opts = { params: { apikey: jwt({}) }, transport: RecordingWebSocket, vsn, logger: undefined }
  if (vsn === '1.0.0') Object.assign(opts, v1Serializer)
  const socket = new Socket(`ws://127.0.0.1:${st.server.port}/realtime/v1`, opts)
  socket.onError((e) => errors.push(e))
  socket.connect()
  const transport = RecordingWebSocket.opened.at(-1)
  return { socket, transport, errors }
}

/** Resolve with the reply to `push` ('ok' payload), reject on error or timeout. */
function reply(push, what) {
  return new Promise((resolve, reject) => {
    push
      .receive('ok', resolve)
      .receive('error', (e) => reject(new Error(`${what}: error ${JSON.stringify(e)}`)))
      .receive('timeout', () => reject(new Error(`${what}: timed out`)))
  })
}

let nextId = 1
for (const vsn of ['2.0.0', '1.0.0']) {
  describe(`phoenix ${vsn}`, () => {
    test('joins, gets a change and its own acknowledged broadcast, leaves, and its Close is answered', async () => {
      const { socket, transport, errors } = newSocket(vsn)
      const name = uniq('phx')
      const topic = `realtime:${name}`
      const config = {
        broadcast: { self: true, ack: true, replication_ready: true },
        presence: { key: '', enabled: false },
        postgres_changes: [{ event: '*', schema: 'public', table: 'items' }],
        private: false,
      }
      const channel = socket.channel(topic, { config })
      const system = []
      const changes = []
      const broadcasts = []
      const closes = []
      channel.on('system', (p) => system.push(p))
      channel.on('postgres_changes', (p) => changes.push(p))
      channel.on('broadcast', (p) => broadcasts.push(p))
      channel.on('phx_close', () => closes.push('phx_close'))

      const joined = await reply(channel.join(), 'join')
      assert.equal(joined.postgres_changes.length, 1, JSON.stringify(joined))
      const id = joined.postgres_changes[0].id
      assert.equal(typeof id, 'number')
      await until('subscribed and replication-ready system messages', () => system.length >= 2)
      assert.deepEqual(
        system.map((s) => [s.extension, s.status, s.message, s.channel]).sort(),
        [
          ['postgres_changes', 'ok', 'Subscribed to PostgreSQL', name],
          ['system', 'ok', 'Replication connection established', name],
        ],
      )

      // A postgres change.
      const rowId = nextId++
      await st.env.db.query('INSERT INTO items VALUES ($1, $2)', [rowId, `row ${vsn}`])
      await until('the change', () => changes.length >= 1)
      assert.deepEqual(changes[0].ids, [id])
      assert.equal(changes[0].data.type, 'INSERT')
      assert.deepEqual(changes[0].data.record, { id: rowId, title: `row ${vsn}` })

      // A broadcast push: acknowledged (ack) and delivered back to the sender (self).
      const ack = await reply(channel.push('broadcast', { type: 'broadcast', event: 'msg', payload: { n: 1, s: 'hé' } }), 'broadcast')
      assert.deepEqual(ack, {})
      await until('its own broadcast', () => broadcasts.length >= 1)
      assert.deepEqual(broadcasts[0], { type: 'broadcast', event: 'msg', payload: { n: 1, s: 'hé' } })

      // A REST broadcast reaches it too (a text frame under 2.0.0).
      const key = jwt({ role: 'service_role' })
      const res = await fetch(`http://127.0.0.1:${st.server.port}/realtime/v1/api/broadcast`, {
        method: 'POST',
        headers: { apikey: key, Authorization: `Bearer ${key}`, 'Content-Type': 'application/json' },
        body: JSON.stringify({ messages: [{ topic: name, event: 'rest', payload: { r: true } }] }),
      })
      assert.equal(res.status, 202)
      await until('the REST broadcast', () => broadcasts.length >= 2)
      assert.deepEqual(broadcasts[1], { type: 'broadcast', event: 'rest', payload: { r: true } })

      // Leave: ok reply, then phx_close.
      await reply(channel.leave(), 'leave')
      assert.equal(channel.state, 'closed')

      // Disconnect: the client's Close (1000) is answered with a Close, not a dropped socket.
      await new Promise((resolve) => socket.disconnect(resolve, 1000, 'bye'))
      await until('the close event', () => transport.closes.length >= 1)
      assert.deepEqual(transport.closes, [{ code: 1000, reason: 'bye', wasClean: true }])
      assert.deepEqual(errors, [], 'no socket errors')
    })
  })
}

test('a raw socket: a Close without a code is answered with an empty Close (1005, clean)', async () => {
  const ws = new WebSocket(`ws://127.0.0.1:${st.server.port}/realtime/v1/websocket?apikey=${jwt({})}&vsn=2.0.0`)
  await new Promise((resolve, reject) => {
    ws.once('open', resolve)
    ws.once('error', reject)
  })
  const closed = new Promise((resolve) => ws.once('close', (code, reason) => resolve({ code, reason: reason.toString() })))
  ws.close()
  assert.deepEqual(await closed, { code: 1005, reason: '' })
  const ws2 = new WebSocket(`ws://127.0.0.1:${st.server.port}/realtime/v1/websocket?apikey=${jwt({})}&vsn=1.0.0`)
  await new Promise((resolve) => ws2.once('open', resolve))
  const closed2 = new Promise((resolve) => ws2.once('close', (code, reason) => resolve({ code, reason: reason.toString() })))
  ws2.close(4000, 'app code')
  assert.deepEqual(await closed2, { code: 4000, reason: 'app code' })
})

test('start-up on a fresh database logs no missing-relation error (migrations run before the front asks)', () => {
  const log = st.server.log()
  assert.doesNotMatch(log, /does not exist/)
  assert.doesNotMatch(log, /cannot refresh the project directory/)
})
