// Supabase parity of postgres_changes, through the unmodified client, with both sources:
// `table: '*'` is every enabled table of the schema (as an absent table is), `select`
// limits the record to those columns plus the primary key, and adding a table to the
// `supabase_realtime` publication enables it with no walcast command.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, collector, subscribed, uniq } from './lib/harness.js'

for (const source of ['stream', 'poll']) {
  describe(`${source} source`, () => {
    let st, db
    before(async () => {
      st = await startStack({
        setupSql: [
          'CREATE TABLE pa (id int8 PRIMARY KEY, title text, body text, secret text)',
          'CREATE TABLE pb (id int8 PRIMARY KEY, title text)',
          'CREATE TABLE pubt (id int8 PRIMARY KEY, title text)',
        ],
        tables: ['pa', 'pb'],
        serverEnv: { CDC_SOURCE: source },
      })
      db = st.env.db
    })
    after(async () => {
      await st?.stop()
    })

    test("table '*' receives every enabled table's inserts", async () => {
      const rt = client(st.server, { vsn: '2.0.0' })
      const all = collector('table *')
      try {
        await subscribed(
          rt.channel(uniq('star')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: '*' }, all),
        )
        await db.query("INSERT INTO pa VALUES (1, 'a1', 'b', 's')")
        await db.query("INSERT INTO pb VALUES (2, 'b2')")
        await all.wait(2)
        assert.deepEqual(
          all.items.map((p) => [p.table, p.new.id]),
          [
            ['pa', 1],
            ['pb', 2],
          ],
        )
      } finally {
        rt.disconnect()
      }
    })

    test('a table added to the supabase_realtime publication streams, no walcast command run', async () => {
      await db.query('CREATE PUBLICATION supabase_realtime')
      await db.query('ALTER PUBLICATION supabase_realtime ADD TABLE pubt')
      await db.query('GRANT SELECT ON pubt TO anon, authenticated, service_role')
      const rt = client(st.server, { vsn: '2.0.0' })
      const got = collector('publication')
      try {
        await subscribed(rt.channel(uniq('pub')).on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'pubt' }, got))
        await db.query("INSERT INTO pubt VALUES (1, 'published')")
        await got.wait(1)
        assert.deepEqual(got.items[0].new, { id: 1, title: 'published' })
        const { rows } = await db.query(
          "SELECT via_publication FROM walcast.realtime_tables WHERE table_name = 'pubt'",
        )
        assert.deepEqual(rows, [{ via_publication: true }])
        await db.query('ALTER PUBLICATION supabase_realtime DROP TABLE pubt')
        const after = await db.query("SELECT count(*)::int AS n FROM walcast.realtime_tables WHERE table_name = 'pubt'")
        assert.equal(after.rows[0].n, 0, 'removed from the publication: disabled')
      } finally {
        rt.disconnect()
      }
    })

    test('select limits the record to its columns and the key', async () => {
      const rt = client(st.server, { vsn: '2.0.0' })
      const some = collector('select')
      const every = collector('no select')
      try {
        const ch = rt
          .channel(uniq('select'))
          .on('postgres_changes', { event: '*', schema: 'public', table: 'pa', select: ['title'] }, some)
          .on('postgres_changes', { event: '*', schema: 'public', table: 'pa' }, every)
        await subscribed(ch)
        await db.query("INSERT INTO pa VALUES (10, 't10', 'body', 'shh')")
        await db.query("UPDATE pa SET title = 't11' WHERE id = 10")
        await some.wait(2)
        await every.wait(2)
        assert.deepEqual(
          some.items.map((p) => [p.eventType, p.new]),
          [
            ['INSERT', { id: 10, title: 't10' }],
            ['UPDATE', { id: 10, title: 't11' }],
          ],
        )
        assert.deepEqual(every.items[0].new, { id: 10, title: 't10', body: 'body', secret: 'shh' })
      } finally {
        rt.disconnect()
      }
    })
  })
}
