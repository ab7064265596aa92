// Private channels through the unmodified client, with both sources: joining needs the
// app's SELECT policy on realtime.messages (with realtime.topic() = the channel's topic)
// and sending needs its INSERT policy, evaluated as the user. Anon and another user are
// refused with Supabase's message; a reader who may not write has its sends dropped; the
// owner's sends and the database's reach the readers; a reader whose read the policies
// revoked is closed out at its next token refresh; a join asking for replay gets the stored
// messages first.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, collector, subscribeTracked, until, jwt } from './lib/harness.js'

const OWNER = '00000000-0000-4000-8000-0000000000a1'
const READER = '00000000-0000-4000-8000-0000000000b2'
const STRANGER = '00000000-0000-4000-8000-0000000000c3'
const TOPIC = `room:${OWNER}`
const user = (sub) => jwt({ role: 'authenticated', sub })
/** West of UTC: `since` read as UTC would be hours after every stored message. */
const ZONE = 'America/Los_Angeles'

async function join(server, token, { bcast = () => {} } = {}) {
  const rt = client(server)
  await rt.setAuth(token)
  const ch = rt.channel(TOPIC, { config: { private: true, broadcast: { self: false } } })
  ch.on('broadcast', { event: 'msg' }, bcast)
  const s = subscribeTracked(ch)
  const first = await s.first
  return { rt, ch, first }
}

for (const source of ['stream', 'poll']) {
  describe(`${source} source`, () => {
    let st, db
    before(async () => {
      // A database whose time zone is not UTC: replay's `since` (Unix ms) must still
      // meet `inserted_at` (a `timestamp` in the database's zone), as on Supabase (UTC).
      st = await startStack({
        setupSql: [`DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET timezone = %L', current_database(), '${ZONE}'); END $$`],
        serverEnv: { CDC_SOURCE: source },
      })
      db = st.env.db
      await db.query(`SET timezone = '${ZONE}'`) // opened before the ALTER: as a new session
      await db.query(`
        CREATE POLICY room_read ON realtime.messages FOR SELECT TO authenticated
          USING (realtime.topic() = 'room:${OWNER}' AND auth.uid() IN ('${OWNER}', '${READER}'));
        CREATE POLICY room_write ON realtime.messages FOR INSERT TO authenticated
          WITH CHECK (realtime.topic() = 'room:${OWNER}' AND auth.uid() = '${OWNER}')`)
    })
    after(async () => {
      await st?.stop()
    })

    test('anon and a stranger are refused with Supabase message', async () => {
      for (const token of [jwt({}), user(STRANGER)]) {
        const { rt, first } = await join(st.server, token)
        try {
          assert.equal(first.status, 'CHANNEL_ERROR')
          assert.equal(
            first.err.message,
            `Unauthorized: You do not have permissions to read from this Channel topic: ${TOPIC}`,
          )
        } finally {
          await rt.removeAllChannels()
          await rt.disconnect()
        }
      }
    })

    test("readers receive the owner's and the database's sends; a reader's own send is dropped", async () => {
      const got = collector('reader')
      const owner = await join(st.server, user(OWNER))
      const reader = await join(st.server, user(READER), { bcast: got })
      try {
        assert.equal(owner.first.status, 'SUBSCRIBED')
        assert.equal(reader.first.status, 'SUBSCRIBED')
        const ownerGot = collector('owner')
        owner.ch.on('broadcast', { event: 'msg' }, ownerGot)
        await reader.ch.send({ type: 'broadcast', event: 'msg', payload: { from: 'reader' } })
        await owner.ch.send({ type: 'broadcast', event: 'msg', payload: { from: 'owner' } })
        // Two senders have no order between them: the database sends once the owner's arrived.
        await got.wait(1)
        await db.query("SELECT realtime.send('{\"from\": \"db\"}', 'msg', $1, true)", [TOPIC])
        await got.wait(2)
        assert.deepEqual(got.items.map((m) => m.payload.from), ['owner', 'db'])
        await ownerGot.wait(1)
        assert.deepEqual(ownerGot.items.map((m) => m.payload.from), ['db'], "the reader's send was dropped")
        // Over REST (httpSend) the same policies apply: the reader's is dropped (still 202).
        assert.deepEqual(await reader.ch.httpSend('msg', { from: 'reader-http' }), { success: true })
        assert.deepEqual(await owner.ch.httpSend('msg', { from: 'owner-http' }), { success: true })
        await got.wait(3)
        assert.deepEqual(got.items.map((m) => m.payload.from), ['owner', 'db', 'owner-http'])
      } finally {
        for (const c of [owner, reader]) {
          await c.rt.removeAllChannels()
          await c.rt.disconnect()
        }
      }
    })

    // From the database's clock, after every earlier message of the topic: `since` has
    // millisecond resolution, so step past the millisecond of the last one (no event to
    // await here, only the clock), and round down: a plain cast to int8 rounds to the
    // nearest ms, which can be after a message stored right after this reading.
    async function replayStart() {
      await new Promise((r) => setTimeout(r, 5))
      const { rows } = await db.query('SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::int8 AS ms')
      return Number(rows[0].ms)
    }
    const store = (n) =>
      db.query("SELECT realtime.send(jsonb_build_object('n', $2::int), 'stored', $1, true)", [TOPIC, n])

    async function replayJoin(replay, got) {
      const rt = client(st.server)
      await rt.setAuth(user(READER))
      const ch = rt.channel(TOPIC, { config: { private: true, broadcast: { replay } } })
      ch.on('broadcast', { event: 'stored' }, got)
      const s = subscribeTracked(ch)
      assert.equal((await s.first).status, 'SUBSCRIBED')
      return rt
    }
    const seen = (got) => got.items.map((m) => [m.payload.n, m.meta?.replayed])

    test('a join with broadcast replay gets the stored messages first, marked replayed, and no live copy', async () => {
      const since = await replayStart()
      for (const n of [1, 2, 3]) await store(n)
      // Joined at once: the live copies of 1-3 may still be on their way from the worker.
      const got = collector('replay')
      const rt = await replayJoin({ since, limit: 25 }, got)
      try {
        await got.wait(3)
        await store(4)
        await got.wait(4)
        // 4 comes after any live copy of 1-3 (one pipeline, in order): none came.
        assert.deepEqual(seen(got), [[1, true], [2, true], [3, true], [4, undefined]])
        assert.equal(got.items[0].meta.id, got.items[0].payload.id)
      } finally {
        await rt.removeAllChannels()
        await rt.disconnect()
      }
    })

    test('broadcast replay stops at its limit, oldest first', async () => {
      const watcher = collector('watcher')
      const w = await replayJoin({ since: Date.now() + 3_600_000, limit: 1 }, watcher)
      const got = collector('replay')
      let rt
      try {
        const since = await replayStart()
        for (const n of [11, 12, 13]) await store(n)
        // Once another channel of the topic got all three, they were fanned out before
        // this join: none can come live.
        await watcher.wait(3)
        rt = await replayJoin({ since, limit: 2 }, got)
        await got.wait(2)
        await store(14)
        await got.wait(3)
        assert.deepEqual(seen(got), [[11, true], [12, true], [14, undefined]])
      } finally {
        for (const c of [w, rt].filter(Boolean)) {
          await c.removeAllChannels()
          await c.disconnect()
        }
      }
    })

    test('revoking the read policy then refreshing the token closes the channel', async () => {
      const reader = await join(st.server, user(READER))
      const sys = collector('system')
      try {
        assert.equal(reader.first.status, 'SUBSCRIBED')
        reader.ch.on('system', {}, sys)
        await db.query(`ALTER POLICY room_read ON realtime.messages
          USING (realtime.topic() = 'room:${OWNER}' AND auth.uid() = '${OWNER}')`)
        await reader.rt.setAuth(jwt({ role: 'authenticated', sub: READER, refreshed: 1 }))
        await until('the channel closed after the refresh', () => reader.ch.state === 'closed')
        await sys.wait(1)
        assert.equal(sys.items[0].status, 'error')
        assert.match(sys.items[0].message, /You do not have permissions to read from this Channel topic/)
      } finally {
        await reader.rt.removeAllChannels()
        await reader.rt.disconnect()
        await db.query(`ALTER POLICY room_read ON realtime.messages
          USING (realtime.topic() = 'room:${OWNER}' AND auth.uid() IN ('${OWNER}', '${READER}'))`)
      }
    })
  })
}
