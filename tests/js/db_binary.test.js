// Binary broadcasts from the database (`realtime.send_binary`, walcast-control/sql/0016) through the
// unmodified client, as Supabase's own e2e suite expects them: a vsn 2.0.0 client gets
// the bytes exactly, as an ArrayBuffer (kind 4, binary payload encoding) with `meta.id`;
// a vsn 1.0.0 socket cannot carry bytes and gets nothing of them (its JSON broadcasts
// still arrive); a replay returns them byte-exact, in order with the JSON ones, with
// `meta.replayed`; a private topic's bytes reach only readers the policies allow, and a
// role the policies refuse cannot send any; an oversized one is skipped and counted and
// the next arrives; a plain login role cannot inject one (no privilege on
// realtime.messages, no schema to add a table to, logical messages it emits are not
// broadcasts).
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import { startEnv, startProcess, startStack, client, collector, subscribed, subscribeTracked, until, uniq } from './lib/harness.js'

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/
/** Every byte value, then bytes that would mean something as text: JSON, a newline, NUL. */
const ALL = Buffer.concat([Buffer.from(Array.from({ length: 256 }, (_, i) => i)), Buffer.from('{"id":1}\n\0\\x00')])
/** What Supabase's e2e suite sends. */
const DEADBEEF = Buffer.from([0xde, 0xad, 0xbe, 0xef, 0x00, 0xff])
/** Lower than the default so an oversized message is cheap to write. */
const MAX_RECORD_BYTES = 65536

const bytesOf = (m) => {
  assert.ok(m.payload instanceof ArrayBuffer, `an ArrayBuffer, not ${JSON.stringify(m.payload)}`)
  return Buffer.from(m.payload)
}

async function sample(proc, line) {
  // `name{labels}` as given, whatever labels follow (a worker's series carry `source`).
  const text = await (await fetch(`${proc.url}/metrics`, proc.figures)).text()
  const prefix = line.endsWith('}') ? line.slice(0, -1) : line
  const hit = text.split('\n').find((l) => l.startsWith(`${line} `) || l.startsWith(`${prefix},`))
  return hit ? Number(hit.split(' ').at(-1)) : 0
}

describe('realtime.send_binary', () => {
  let st, db
  before(async () => {
    st = await startStack({ serverEnv: { MAX_RECORD_BYTES: String(MAX_RECORD_BYTES) } })
    db = st.env.db
    await db.query(`
      CREATE POLICY bin_read ON realtime.messages FOR SELECT TO anon
        USING (realtime.topic() LIKE 'bin-ok:%')`)
  })
  after(async () => {
    await st?.stop()
  })

  test('a vsn 2.0.0 client gets the bytes exactly; a vsn 1.0.0 one only the JSON', async () => {
    const topic = uniq('bin-live')
    const v2 = client(st.server, { vsn: '2.0.0' })
    const v1 = client(st.server, { vsn: '1.0.0' })
    const got2 = collector('v2')
    const got1 = collector('v1')
    try {
      await subscribed(v2.channel(topic).on('broadcast', { event: 'bin' }, got2).on('broadcast', { event: 'json' }, got2))
      await subscribed(v1.channel(topic).on('broadcast', { event: 'bin' }, got1).on('broadcast', { event: 'json' }, got1))
      const before = await sample(st.server, 'walcast_cdc_db_broadcasts_total{payload="binary"}')
      await db.query("SELECT realtime.send_binary($1::bytea, 'bin', $2, false)", [ALL, topic])
      await db.query("SELECT realtime.send_binary(''::bytea, 'bin', $1, false)", [topic])
      await db.query(`SELECT realtime.send_binary($1::bytea, 'bin', $2, false)`, [DEADBEEF, topic])
      // No bytes: a warning, nothing sent (it would arrive before the JSON one).
      await db.query("SELECT realtime.send_binary(NULL, 'bin', $1, false)", [topic])
      await db.query(`SELECT realtime.send('{"after": true}', 'json', $1, false)`, [topic])
      await got2.wait(4)
      assert.deepEqual(got2.items.map((m) => m.event), ['bin', 'bin', 'bin', 'json'])
      assert.ok(bytesOf(got2.items[0]).equals(ALL), 'every byte value, as sent')
      assert.equal(bytesOf(got2.items[1]).length, 0)
      assert.ok(bytesOf(got2.items[2]).equals(DEADBEEF))
      for (const m of got2.items) assert.match(m.meta?.id, UUID)
      assert.deepEqual(got2.items[3].payload, { after: true, id: got2.items[3].meta.id })
      await got1.wait(1)
      assert.deepEqual(got1.items.map((m) => m.event), ['json'], 'vsn 1.0.0: no bytes, as Supabase')
      await until('the binary broadcasts counted', async () =>
        (await sample(st.server, 'walcast_cdc_db_broadcasts_total{payload="binary"}')) >= before + 3)
    } finally {
      v2.disconnect()
      v1.disconnect()
    }
  })

  // From the database's clock, a step past the last message (`since` has ms resolution).
  async function replayStart() {
    await new Promise((r) => setTimeout(r, 5))
    const { rows } = await db.query('SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::int8 AS ms')
    return Number(rows[0].ms)
  }

  async function replayJoin(topic, since, vsn, got) {
    const rt = client(st.server, { vsn })
    const ch = rt.channel(topic, { config: { private: true, broadcast: { replay: { since, limit: 25 } } } })
    ch.on('broadcast', { event: 'stored' }, got)
    assert.equal((await subscribeTracked(ch).first).status, 'SUBSCRIBED')
    return rt
  }

  test('a replay returns the bytes exactly, in order with the JSON messages', async () => {
    const topic = uniq('bin-ok:replay')
    const since = await replayStart()
    await db.query(`SELECT realtime.send('{"n": 1}', 'stored', $1, true)`, [topic])
    await db.query("SELECT realtime.send_binary($1::bytea, 'stored', $2, true)", [DEADBEEF, topic])
    await db.query(`SELECT realtime.send('{"n": 3}', 'stored', $1, true)`, [topic])
    await db.query("SELECT realtime.send_binary($1::bytea, 'stored', $2, true)", [ALL, topic])
    const got = collector('replay v2')
    const got1 = collector('replay v1')
    const rt = await replayJoin(topic, since, '2.0.0', got)
    const rt1 = await replayJoin(topic, since, '1.0.0', got1)
    try {
      await got.wait(4)
      assert.ok(got.items.every((m) => m.meta?.replayed === true && UUID.test(m.meta.id)))
      assert.equal(got.items[0].payload.n, 1)
      assert.ok(bytesOf(got.items[1]).equals(DEADBEEF), 'replayed bytes, exactly')
      assert.equal(got.items[2].payload.n, 3)
      assert.ok(bytesOf(got.items[3]).equals(ALL))
      // Live after the replay: a new binary message arrives once, not replayed.
      await db.query("SELECT realtime.send_binary('\\x0102'::bytea, 'stored', $1, true)", [topic])
      await got.wait(5)
      assert.ok(bytesOf(got.items[4]).equals(Buffer.from([1, 2])))
      assert.equal(got.items[4].meta?.replayed, undefined)
      // vsn 1.0.0: the JSON messages only, as Supabase.
      await got1.wait(2)
      assert.deepEqual(got1.items.map((m) => [m.payload.n, m.meta?.replayed]), [[1, true], [3, true]])
    } finally {
      rt.disconnect()
      rt1.disconnect()
    }
  })

  test("a private topic's bytes: refused to a client without the policy, unsendable by a refused role", async () => {
    const secret = uniq('bin-secret')
    const rt = client(st.server)
    try {
      const ch = rt.channel(secret, { config: { private: true } })
      const first = await subscribeTracked(ch).first
      assert.equal(first.status, 'CHANNEL_ERROR')
      assert.equal(first.err.message, `Unauthorized: You do not have permissions to read from this Channel topic: ${secret}`)
    } finally {
      await rt.removeAllChannels()
      rt.disconnect()
    }
    // anon may read `bin-ok:*` but no policy lets it write: its send_binary warns and
    // writes nothing; the reader gets only the one the database's owner sends next.
    const topic = uniq('bin-ok:write')
    const reader = client(st.server)
    const got = collector('reader')
    try {
      await subscribed(reader.channel(topic, { config: { private: true } }).on('broadcast', { event: 'bin' }, got))
      const warnings = []
      const onNotice = (n) => warnings.push(n.message)
      db.on('notice', onNotice)
      try {
        await db.query('BEGIN')
        await db.query('SET LOCAL ROLE anon')
        await db.query("SELECT realtime.send_binary('\\xbad0'::bytea, 'bin', $1, true)", [topic])
        await db.query('COMMIT')
      } finally {
        db.off('notice', onNotice)
      }
      assert.ok(
        warnings.some((w) => w.startsWith('ErrorSendingBroadcastMessage: new row violates row-level security policy')),
        JSON.stringify(warnings),
      )
      await db.query("SELECT realtime.send_binary('\\x600d'::bytea, 'bin', $1, true)", [topic])
      await got.wait(1)
      await new Promise((r) => setTimeout(r, 300))
      assert.deepEqual(got.items.map((m) => bytesOf(m).toString('hex')), ['600d'])
      const { rows } = await db.query('SELECT count(*)::int AS n FROM realtime.messages WHERE topic = $1', [topic])
      assert.equal(rows[0].n, 1)
    } finally {
      reader.disconnect()
    }
  })

  test('an oversized binary broadcast is skipped and counted; the next one arrives', async () => {
    const topic = uniq('bin-big')
    const rt = client(st.server)
    const got = collector('big')
    const skipped = 'walcast_cdc_changes_skipped_total{reason="payload_too_large"}'
    try {
      await subscribed(rt.channel(topic).on('broadcast', { event: 'bin' }, got))
      const before = await sample(st.server, skipped)
      const big = Buffer.alloc(MAX_RECORD_BYTES + 1, 7)
      await db.query("SELECT realtime.send_binary($1::bytea, 'bin', $2, false)", [big, topic])
      await db.query("SELECT realtime.send_binary('\\x01'::bytea, 'bin', $1, false)", [topic])
      await got.wait(1)
      await new Promise((r) => setTimeout(r, 300))
      assert.deepEqual(got.items.map((m) => bytesOf(m).toString('hex')), ['01'])
      assert.equal(await sample(st.server, skipped), before + 1)
      const health = await (await fetch(`${st.server.url}/health`, st.server.figures)).json()
      assert.match(JSON.stringify(health), /realtime\.messages/)
    } finally {
      rt.disconnect()
    }
  })

  test('a plain login role cannot inject a binary broadcast', async () => {
    const topic = uniq('bin-forge')
    await db.query('CREATE ROLE mallory LOGIN')
    const url = new URL(st.env.database_url)
    url.username = 'mallory'
    url.password = ''
    const mallory = new pg.Client({ connectionString: url.toString() })
    mallory.on('error', () => {})
    await mallory.connect()
    const rt = client(st.server)
    const got = collector('forge')
    try {
      await subscribed(rt.channel(topic).on('broadcast', { event: 'bin' }, got))
      const refused = async (sql, params) => {
        const e = await mallory.query(sql, params).then(() => null, (e) => e)
        assert.equal(e?.code, '42501', `${sql}: ${e?.message}`)
      }
      await refused(
        "INSERT INTO realtime.messages (topic, extension, binary_payload, event, private) VALUES ($1, 'broadcast', '\\xbad1', 'bin', false)",
        [topic],
      )
      await refused('CREATE TABLE realtime.messages_forged (LIKE realtime.messages)')
      // send_binary runs as its caller, who may not even use the schema.
      await refused("SELECT realtime.send_binary('\\xbad2'::bytea, 'bin', $1, false)", [topic])
      // Logical messages that look like a database broadcast (the bus envelope, a row,
      // an outbox event for a broadcast subject) are not broadcasts; walcast.* ones are
      // unsigned and skipped as forged.
      const envelope = `{"event":"bin","binary":true,"meta":{"id":"x"}}\n\xba\xd3`
      for (const [prefix, content] of [
        ['walcast.broadcast', envelope],
        ['walcast.outbox', JSON.stringify({ id: 'x', project: 'default', topic: `walcast.broadcast.default.public.${topic}`, payload: {} })],
        ['realtime.messages', JSON.stringify({ topic, extension: 'broadcast', event: 'bin', binary_payload: '\\xbad4' })],
        ['realtime', envelope],
      ]) {
        await mallory.query('SELECT pg_logical_emit_message(true, $1::text, $2::text)', [prefix, content])
      }
      await db.query("SELECT realtime.send_binary('\\x600d'::bytea, 'bin', $1, false)", [topic])
      await got.wait(1)
      await new Promise((r) => setTimeout(r, 300))
      assert.deepEqual(got.items.map((m) => bytesOf(m).toString('hex')), ['600d'], 'only the genuine one')
      const { rows } = await db.query('SELECT count(*)::int AS n FROM realtime.messages WHERE topic = $1', [topic])
      assert.equal(rows[0].n, 1)
    } finally {
      rt.disconnect()
      await mallory.end().catch(() => {})
    }
  })
})

// wal2json cuts the `\x` off a bytea's text output, which is hex only under
// `bytea_output = hex`: a database set to `escape` must not change a byte, whichever way
// the worker reads the slot.
for (const source of ['stream', 'poll']) {
  describe(`send_binary with bytea_output = escape, ${source} source`, () => {
    let st
    before(async () => {
      st = await startStack({
        setupSql: [`DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET bytea_output = escape', current_database()); END $$`],
        serverEnv: { CDC_SOURCE: source },
      })
    })
    after(async () => {
      await st?.stop()
    })

    test('the bytes arrive exactly', async () => {
      const topic = uniq('bin-escape')
      const rt = client(st.server)
      const got = collector('escape')
      try {
        await subscribed(rt.channel(topic).on('broadcast', { event: 'bin' }, got))
        // Printable bytes first: cut by two characters, their escape form would still
        // read as hex.
        const printable = Buffer.from('abcdef0123')
        for (const b of [printable, ALL]) {
          await st.env.db.query("SELECT realtime.send_binary($1::bytea, 'bin', $2, false)", [b, topic])
        }
        await got.wait(2)
        assert.ok(bytesOf(got.items[0]).equals(printable), bytesOf(got.items[0]).toString('hex'))
        assert.ok(bytesOf(got.items[1]).equals(ALL))
      } finally {
        rt.disconnect()
      }
    })
  })
}

// cdc-worker → NATS → ws-front: a replay travels in one NATS reply, and binary messages
// can make it larger than nats-server's max_payload. The join is not left waiting for a
// reply NATS refused: it gets the oldest messages that fit, in order, at once.
describe('a replay larger than one NATS message', () => {
  const MAX_PAYLOAD = 65536
  let env, worker, front
  before(async () => {
    env = await startEnv({ natsMaxPayload: MAX_PAYLOAD })
    worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url })
    front = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
    await env.db.query(`
      CREATE POLICY bin_read ON realtime.messages FOR SELECT TO anon
        USING (realtime.topic() LIKE 'bin-ok:%')`)
  })
  after(async () => {
    await front?.stop()
    await worker?.stop()
    await env?.stop()
  })

  test('the join gets the oldest that fit, byte-exact, without waiting', async () => {
    const topic = uniq('bin-ok:big-replay')
    const { rows } = await env.db.query('SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8 - 5 AS ms')
    const since = Number(rows[0].ms)
    // 20,000 bytes each, 26,668 in base64: two fit in 64 KiB, five do not.
    const parts = [1, 2, 3, 4, 5].map((n) => Buffer.alloc(20000, n))
    // A listener joined before the sends sees their live copies: once it has all five,
    // none can reach the replaying channel live (on a loaded machine the stream may lag
    // the join, and a live copy of a message the replay left out would be delivered).
    const watcher = client(front)
    const live = collector('live copies')
    const wch = watcher.channel(topic, { config: { private: true } })
    wch.on('broadcast', { event: 'stored' }, live)
    await subscribed(wch)
    for (const p of parts) {
      await env.db.query("SELECT realtime.send_binary($1::bytea, 'stored', $2, true)", [p, topic])
    }
    await live.wait(5)
    watcher.disconnect()
    const rt = client(front)
    const got = collector('big replay')
    try {
      const ch = rt.channel(topic, { config: { private: true, broadcast: { replay: { since, limit: 25 } } } })
      ch.on('broadcast', { event: 'stored' }, got)
      const started = Date.now()
      assert.equal((await subscribeTracked(ch).first).status, 'SUBSCRIBED')
      const joinMs = Date.now() - started
      assert.ok(joinMs < 2000, `joined in ${joinMs} ms`)
      await got.wait(2)
      await new Promise((r) => setTimeout(r, 300))
      assert.equal(got.items.length, 2, 'the oldest two fit')
      got.items.forEach((m, i) => {
        assert.ok(bytesOf(m).equals(parts[i]), `message ${i + 1} exactly`)
        assert.equal(m.meta?.replayed, true)
      })
      // And live after it, through the same NATS.
      await env.db.query("SELECT realtime.send_binary('\\x0a0b'::bytea, 'stored', $1, true)", [topic])
      await got.wait(3)
      assert.ok(bytesOf(got.items[2]).equals(Buffer.from([10, 11])))
    } finally {
      rt.disconnect()
    }
  })
})
