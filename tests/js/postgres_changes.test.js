// postgres_changes through the real realtime-js client: INSERT / UPDATE / DELETE / `*`
// bindings, the payload realtime-js hands to callbacks, several channels on one socket,
// several bindings on one channel, and unsubscribe. Every case runs over vsn 2.0.0 and 1.0.0.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, collector, subscribed, uniq, VSNS, ISO_Z } from './lib/harness.js'

let st, db
let nextId = 1000
const ids = (n) => Array.from({ length: n }, () => nextId++)

before(async () => {
  st = await startStack({
    setupSql: [
      'CREATE TABLE items (id int8 PRIMARY KEY, owner int4, title text)',
      'CREATE TABLE notes (id int8 PRIMARY KEY, body text)',
    ],
    tables: ['items', 'notes'],
  })
  db = st.env.db
})
after(async () => {
  await st?.stop()
})

const items = (event, extra = {}) => ({ event, schema: 'public', table: 'items', ...extra })

/** The envelope fields every change must carry, checked the same way for every event. */
function assertEnvelope(p, { table = 'items', eventType }) {
  assert.equal(p.schema, 'public')
  assert.equal(p.table, table)
  assert.equal(p.eventType, eventType)
  assert.match(p.commit_timestamp, ISO_Z, `commit_timestamp ${p.commit_timestamp}`)
  const age = Math.abs(Date.now() - Date.parse(p.commit_timestamp))
  assert.ok(age < 60000, `commit_timestamp ${p.commit_timestamp} is ${age} ms away from now`)
  assert.equal(p.errors, null)
}

for (const vsn of VSNS) {
  describe(`vsn ${vsn}`, () => {
    let rt
    before(() => {
      rt = client(st.server, { vsn })
    })
    after(async () => {
      await rt.removeAllChannels()
      await rt.disconnect()
    })

    test('INSERT binding gets inserts only, with new row and empty old', async () => {
      const got = collector('INSERT')
      const ch = await subscribed(rt.channel(uniq('ins')).on('postgres_changes', items('INSERT'), got))
      const [a, b] = ids(2)
      await db.query('INSERT INTO items VALUES ($1, 1, $2)', [a, 'first'])
      await db.query("UPDATE items SET title = 'changed' WHERE id = $1", [a])
      await db.query('DELETE FROM items WHERE id = $1', [a])
      await db.query('INSERT INTO items VALUES ($1, 2, $2)', [b, 'second'])
      await got.wait(2)
      assert.equal(got.items.length, 2, 'the UPDATE and DELETE must not reach an INSERT binding')
      for (const p of got.items) assertEnvelope(p, { eventType: 'INSERT' })
      assert.deepEqual(got.items[0].new, { id: a, owner: 1, title: 'first' })
      assert.deepEqual(got.items[0].old, {})
      assert.deepEqual(got.items[1].new, { id: b, owner: 2, title: 'second' })
      await rt.removeChannel(ch)
    })

    test('UPDATE binding gets updates only, with new and old rows', async () => {
      const got = collector('UPDATE')
      const ch = await subscribed(rt.channel(uniq('upd')).on('postgres_changes', items('UPDATE'), got))
      const [a] = ids(1)
      await db.query('INSERT INTO items VALUES ($1, 1, $2)', [a, 'before'])
      await db.query("UPDATE items SET title = 'after', owner = 5 WHERE id = $1", [a])
      await db.query('DELETE FROM items WHERE id = $1', [a])
      await db.query('INSERT INTO items VALUES ($1, 1, $2)', [a, 'again'])
      await db.query("UPDATE items SET title = 'last' WHERE id = $1", [a])
      await got.wait(2)
      assert.equal(got.items.length, 2, 'INSERT and DELETE must not reach an UPDATE binding')
      for (const p of got.items) assertEnvelope(p, { eventType: 'UPDATE' })
      assert.deepEqual(got.items[0].new, { id: a, owner: 5, title: 'after' })
      assert.deepEqual(got.items[0].old, { id: a, owner: 1, title: 'before' })
      assert.deepEqual(got.items[1].new, { id: a, owner: 1, title: 'last' })
      assert.deepEqual(got.items[1].old, { id: a, owner: 1, title: 'again' })
      await rt.removeChannel(ch)
    })

    test('DELETE binding gets deletes only, with the old row and empty new', async () => {
      const got = collector('DELETE')
      const ch = await subscribed(rt.channel(uniq('del')).on('postgres_changes', items('DELETE'), got))
      const [a, b] = ids(2)
      await db.query('INSERT INTO items VALUES ($1, 3, $2), ($3, 4, $4)', [a, 'gone', b, 'gone too'])
      await db.query("UPDATE items SET title = 'x' WHERE id = $1", [b])
      await db.query('DELETE FROM items WHERE id = $1', [a])
      await db.query('DELETE FROM items WHERE id = $1', [b])
      await got.wait(2)
      assert.equal(got.items.length, 2, 'INSERT and UPDATE must not reach a DELETE binding')
      for (const p of got.items) assertEnvelope(p, { eventType: 'DELETE' })
      assert.deepEqual(got.items[0].old, { id: a, owner: 3, title: 'gone' })
      assert.deepEqual(got.items[0].new, {})
      assert.deepEqual(got.items[1].old, { id: b, owner: 4, title: 'x' })
      await rt.removeChannel(ch)
    })

    test('`*` binding gets INSERT, UPDATE and DELETE in commit order', async () => {
      const got = collector('*')
      const ch = await subscribed(rt.channel(uniq('all')).on('postgres_changes', items('*'), got))
      const [a] = ids(1)
      await db.query('INSERT INTO items VALUES ($1, 1, $2)', [a, 'one'])
      await db.query("UPDATE items SET title = 'two' WHERE id = $1", [a])
      await db.query('DELETE FROM items WHERE id = $1', [a])
      await got.wait(3)
      assert.deepEqual(
        got.items.map((p) => [p.eventType, p.new, p.old]),
        [
          ['INSERT', { id: a, owner: 1, title: 'one' }, {}],
          ['UPDATE', { id: a, owner: 1, title: 'two' }, { id: a, owner: 1, title: 'one' }],
          ['DELETE', {}, { id: a, owner: 1, title: 'two' }],
        ],
      )
      for (const p of got.items) assertEnvelope(p, { eventType: p.eventType })
      await rt.removeChannel(ch)
    })

    test('a multi-row transaction arrives whole and in order', async () => {
      const got = collector('*')
      const ch = await subscribed(rt.channel(uniq('txn')).on('postgres_changes', items('*'), got))
      const batch = ids(5)
      await db.query('BEGIN')
      for (const id of batch) await db.query('INSERT INTO items VALUES ($1, 9, $2)', [id, `r${id}`])
      await db.query('DELETE FROM items WHERE id = $1', [batch[0]])
      await db.query('COMMIT')
      await got.wait(6)
      assert.deepEqual(
        got.items.map((p) => [p.eventType, p.new.id ?? p.old.id]),
        [...batch.map((id) => ['INSERT', id]), ['DELETE', batch[0]]],
      )
      const ts = new Set(got.items.map((p) => p.commit_timestamp))
      assert.equal(ts.size, 1, `one transaction, one commit_timestamp: ${[...ts]}`)
      await rt.removeChannel(ch)
    })

    test('a binding without `table` gets every enabled table of the schema', async () => {
      const got = collector('schema-wide')
      const ch = await subscribed(rt.channel(uniq('schema')).on('postgres_changes', { event: 'INSERT', schema: 'public' }, got))
      const [a, b] = ids(2)
      await db.query('INSERT INTO notes VALUES ($1, $2)', [a, 'note'])
      await db.query('INSERT INTO items VALUES ($1, 1, $2)', [b, 'item'])
      await got.wait(2)
      assert.deepEqual(
        got.items.map((p) => [p.table, p.new]),
        [
          ['notes', { id: a, body: 'note' }],
          ['items', { id: b, owner: 1, title: 'item' }],
        ],
      )
      await rt.removeChannel(ch)
    })

    test('two bindings with different events on one channel are split by the client', async () => {
      const ins = collector('INSERT')
      const del = collector('DELETE')
      const all = collector('*')
      const ch = await subscribed(
        rt
          .channel(uniq('split'))
          .on('postgres_changes', items('INSERT'), ins)
          .on('postgres_changes', items('DELETE'), del)
          .on('postgres_changes', items('*'), all),
      )
      const [a] = ids(1)
      await db.query('INSERT INTO items VALUES ($1, 1, $2)', [a, 'x'])
      await db.query("UPDATE items SET title = 'y' WHERE id = $1", [a])
      await db.query('DELETE FROM items WHERE id = $1', [a])
      await all.wait(3)
      await ins.wait(1)
      await del.wait(1)
      assert.deepEqual(all.items.map((p) => p.eventType), ['INSERT', 'UPDATE', 'DELETE'])
      assert.deepEqual(ins.items.map((p) => [p.eventType, p.new.id]), [['INSERT', a]])
      assert.deepEqual(del.items.map((p) => [p.eventType, p.old.id]), [['DELETE', a]])
      await rt.removeChannel(ch)
    })

    test('two channels on one socket each get only their own changes', async () => {
      const onItems = collector('items channel')
      const onNotes = collector('notes channel')
      const onOwner7 = collector('owner 7 channel')
      const c1 = await subscribed(rt.channel(uniq('own-items')).on('postgres_changes', items('*'), onItems))
      const c2 = await subscribed(
        rt.channel(uniq('own-notes')).on('postgres_changes', { event: '*', schema: 'public', table: 'notes' }, onNotes),
      )
      const c3 = await subscribed(rt.channel(uniq('own-7')).on('postgres_changes', items('*', { filter: 'owner=eq.7' }), onOwner7))
      const [n1, i1, i2, n2] = ids(4)
      await db.query('INSERT INTO notes VALUES ($1, $2)', [n1, 'n1'])
      await db.query('INSERT INTO items VALUES ($1, 6, $2)', [i1, 'i1'])
      await db.query('INSERT INTO items VALUES ($1, 7, $2)', [i2, 'i2'])
      await db.query('INSERT INTO notes VALUES ($1, $2)', [n2, 'n2'])
      await onItems.wait(2)
      await onNotes.wait(2)
      await onOwner7.wait(1)
      // The last insert (n2) was seen by the notes channel, so anything misrouted before it is here too.
      assert.deepEqual(onItems.items.map((p) => [p.table, p.new.id]), [['items', i1], ['items', i2]])
      assert.deepEqual(onNotes.items.map((p) => [p.table, p.new.id]), [['notes', n1], ['notes', n2]])
      assert.deepEqual(onOwner7.items.map((p) => [p.table, p.new.id]), [['items', i2]])
      await Promise.all([c1, c2, c3].map((c) => rt.removeChannel(c)))
    })

    test('channel.unsubscribe() stops delivery', async () => {
      const gone = collector('unsubscribed channel')
      const stays = collector('control channel')
      const c1 = await subscribed(rt.channel(uniq('unsub')).on('postgres_changes', items('*'), gone))
      const c2 = await subscribed(rt.channel(uniq('control')).on('postgres_changes', items('*'), stays))
      const [a, b] = ids(2)
      await db.query('INSERT INTO items VALUES ($1, 1, $2)', [a, 'before leave'])
      await gone.wait(1)
      await stays.wait(1)
      assert.equal(await c1.unsubscribe(), 'ok')
      await db.query('INSERT INTO items VALUES ($1, 1, $2)', [b, 'after leave'])
      await db.query('UPDATE items SET owner = 2 WHERE id = $1', [a])
      await stays.wait(3)
      assert.deepEqual(stays.items.map((p) => [p.eventType, p.new.id]), [['INSERT', a], ['INSERT', b], ['UPDATE', a]])
      assert.deepEqual(gone.items.map((p) => p.new.id), [a], 'nothing after unsubscribe()')
      await rt.removeChannel(c2)
    })

    test('removeChannel() stops delivery', async () => {
      const gone = collector('removed channel')
      const stays = collector('control channel')
      const c1 = await subscribed(rt.channel(uniq('rm')).on('postgres_changes', items('INSERT'), gone))
      const c2 = await subscribed(rt.channel(uniq('control')).on('postgres_changes', items('INSERT'), stays))
      const [a, b] = ids(2)
      await db.query('INSERT INTO items VALUES ($1, 1, $2)', [a, 'before'])
      await gone.wait(1)
      assert.equal(await rt.removeChannel(c1), 'ok')
      assert.ok(!rt.getChannels().includes(c1))
      await db.query('INSERT INTO items VALUES ($1, 1, $2)', [b, 'after'])
      await stays.wait(2)
      assert.deepEqual(stays.items.map((p) => p.new.id), [a, b])
      assert.deepEqual(gone.items.map((p) => p.new.id), [a], 'nothing after removeChannel()')
      await rt.removeChannel(c2)
    })
  })
}
