// Broadcast from the database through the unmodified client, with both sources:
// `realtime.send` on a public topic delivers `{...payload, id}` with `meta.id`, only once
// committed (a rolled-back send delivers nothing), 10,000 sends of one transaction arrive
// in order, and a trigger calling `realtime.broadcast_changes` delivers the row change to
// a private channel.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, collector, subscribed, uniq } from './lib/harness.js'

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/

for (const source of ['stream', 'poll']) {
  describe(`${source} source`, () => {
    let st, db
    before(async () => {
      st = await startStack({
        setupSql: ['CREATE TABLE notes (id int8 PRIMARY KEY, body text)'],
        serverEnv: { CDC_SOURCE: source },
      })
      db = st.env.db
      await db.query(`CREATE FUNCTION notes_broadcast() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          PERFORM realtime.broadcast_changes('notes:' || coalesce(NEW.id, OLD.id), TG_OP, TG_OP,
                                             TG_TABLE_NAME, TG_TABLE_SCHEMA, NEW, OLD);
          RETURN NULL;
        END $$;
        CREATE TRIGGER notes_broadcast AFTER INSERT OR UPDATE OR DELETE ON notes
          FOR EACH ROW EXECUTE FUNCTION notes_broadcast();
        -- The private notes channels are readable by anyone with the anon key.
        CREATE POLICY notes_read ON realtime.messages FOR SELECT TO anon
          USING (realtime.topic() LIKE 'notes:%')`)
    })
    after(async () => {
      await st?.stop()
    })

    test('realtime.send delivers committed sends in order, with their id', async () => {
      const topic = uniq('db-send')
      const rt = client(st.server, { vsn: '2.0.0' })
      const got = collector('send')
      try {
        await subscribed(rt.channel(topic).on('broadcast', { event: 'note' }, got))
        await db.query("SELECT realtime.send('{\"n\": 1}', 'note', $1, false)", [topic])
        await db.query('BEGIN')
        await db.query("SELECT realtime.send('{\"n\": 99}', 'note', $1, false)", [topic])
        await db.query('ROLLBACK')
        await db.query("SELECT realtime.send('{\"n\": 2}', 'note', $1, false)", [topic])
        await got.wait(2)
        assert.deepEqual(got.items.map((m) => m.payload.n), [1, 2], 'the rolled-back send is absent')
        for (const m of got.items) {
          assert.match(m.payload.id, UUID)
          assert.equal(m.meta?.id, m.payload.id)
          assert.equal(m.event, 'note')
        }
      } finally {
        rt.disconnect()
      }
    })

    test('10,000 sends of one transaction arrive in order', async () => {
      const topic = uniq('db-bulk')
      const rt = client(st.server, { vsn: '2.0.0' })
      const got = collector('bulk')
      try {
        await subscribed(rt.channel(topic).on('broadcast', { event: 'bulk' }, got))
        await db.query(
          "SELECT realtime.send(jsonb_build_object('i', g), 'bulk', $1, false) FROM generate_series(1, 10000) g",
          [topic],
        )
        await got.wait(10000, '10,000 broadcasts', 60000)
        const is = got.items.map((m) => m.payload.i)
        assert.deepEqual(is, Array.from({ length: 10000 }, (_, k) => k + 1))
      } finally {
        rt.disconnect()
      }
    })

    test('broadcast_changes in a trigger delivers the row change to a private channel', async () => {
      const rt = client(st.server, { vsn: '2.0.0' })
      const got = collector('changes')
      try {
        const ch = rt.channel('notes:7', { config: { private: true } })
        await subscribed(ch.on('broadcast', { event: 'INSERT' }, got).on('broadcast', { event: 'DELETE' }, got))
        await db.query("INSERT INTO notes VALUES (7, 'hello')")
        await db.query('DELETE FROM notes WHERE id = 7')
        await got.wait(2)
        const [ins, del] = got.items
        assert.equal(ins.event, 'INSERT')
        assert.deepEqual(
          { ...ins.payload, id: undefined },
          { operation: 'INSERT', table: 'notes', schema: 'public', record: { id: 7, body: 'hello' }, old_record: null, id: undefined },
        )
        assert.match(ins.meta?.id, UUID)
        assert.deepEqual(del.payload.old_record, { id: 7, body: 'hello' })
        assert.equal(del.payload.record, null)
      } finally {
        rt.disconnect()
      }
    })
  })
}
