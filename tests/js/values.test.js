// Column values as realtime-js hands them to callbacks, for the types apps rely on. The
// expected values are what the reference server produces (it sends each value as
// `to_jsonb(value)`, and realtime-js converts by column type), so the oracle is also
// checked against Postgres' own `to_jsonb(row)`.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { isDeepStrictEqual } from 'node:util'
import { startStack, client, collector, subscribed, uniq, VSNS } from './lib/harness.js'

let st, db
let nextId = 1

before(async () => {
  st = await startStack({
    setupSql: [
      'SET TIME ZONE UTC',
      `CREATE TABLE v (
        id int8 PRIMARY KEY, b bool, i8 int8, i4 int4, i2 int2, f8 float8, num numeric,
        j json, jb jsonb, ai int4[], at text[], ts timestamptz, tsn timestamp, t text, u uuid, nul text)`,
    ],
    tables: ['v'],
  })
  db = st.env.db
  await db.query('SET TIME ZONE UTC')
})
after(async () => {
  await st?.stop()
})

// [what, SQL literal for each column, the JS value the callback must receive]
const ROWS = [
  {
    what: 'scalars, json, arrays, timestamps',
    sql: {
      b: 'true', i8: '1234567890123', i4: '-2147483648', i2: '-7', f8: '1.5', num: '12345.678',
      j: `'{"a":1,"b":[1,2],"c":{"d":"e"}}'`, jb: `'{"k":"v","n":null,"arr":[true,1.25]}'`,
      ai: `'{1,2,3}'`, at: `'{a,b}'`, ts: `'2026-01-02 03:04:05.123+00'`, tsn: `'2026-01-02 03:04:05.5'`,
      t: `'plain text'`, u: `'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'`, nul: 'NULL',
    },
    want: {
      b: true, i8: 1234567890123, i4: -2147483648, i2: -7, f8: 1.5, num: 12345.678,
      j: { a: 1, b: [1, 2], c: { d: 'e' } }, jb: { k: 'v', n: null, arr: [true, 1.25] },
      ai: [1, 2, 3], at: ['a', 'b'], ts: '2026-01-02T03:04:05.123+00:00', tsn: '2026-01-02T03:04:05.5',
      t: 'plain text', u: 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', nul: null,
    },
  },
  {
    what: 'false, zero, empty and NULL-bearing arrays, negative numeric, json scalars',
    sql: {
      b: 'false', i8: '0', i4: '0', i2: '0', f8: '-0.25', num: '-0.5',
      j: `'"just a string"'`, jb: `'[1,"two",null]'`,
      ai: `'{}'`, at: `'{}'`, ts: `'1999-12-31 23:59:59+00'`, tsn: `'1999-12-31 23:59:59'`,
      t: `''`, u: `'00000000-0000-0000-0000-000000000000'`, nul: 'NULL',
    },
    want: {
      b: false, i8: 0, i4: 0, i2: 0, f8: -0.25, num: -0.5,
      j: 'just a string', jb: [1, 'two', null],
      ai: [], at: [], ts: '1999-12-31T23:59:59+00:00', tsn: '1999-12-31T23:59:59',
      t: '', u: '00000000-0000-0000-0000-000000000000', nul: null,
    },
  },
  {
    what: 'text arrays whose elements need quoting (space, comma, quote, NULL), int arrays with NULL',
    sql: {
      b: 'NULL', i8: '9007199254740991', i4: '1', i2: '1', f8: '1e100', num: '0.1',
      j: `'{}'`, jb: `'{}'`,
      ai: `'{1,NULL,-3}'`, at: `ARRAY['a', 'b c', 'd,e', 'q"uote', NULL, 'NULL']`,
      ts: `'2026-06-30 12:00:00.5+02'`, tsn: 'NULL', t: `'hé "q" \\ end'`, u: 'NULL', nul: 'NULL',
    },
    want: {
      b: null, i8: 9007199254740991, i4: 1, i2: 1, f8: 1e100, num: 0.1,
      j: {}, jb: {},
      ai: [1, null, -3], at: ['a', 'b c', 'd,e', 'q"uote', null, 'NULL'],
      ts: '2026-06-30T10:00:00.5+00:00', tsn: null, t: 'hé "q" \\ end', u: null, nul: null,
    },
  },
]

const COLS = Object.keys(ROWS[0].sql)

/** Compare a received row with the expected one, listing every wrong column at once. */
function assertRow(got, want, what = 'new') {
  const wrong = {}
  for (const c of new Set([...Object.keys(want), ...Object.keys(got)])) {
    if (!isDeepStrictEqual(got[c], want[c])) wrong[c] = { got: got[c], want: want[c] }
  }
  assert.deepEqual(wrong, {}, `${what}: wrong columns ${JSON.stringify(wrong)}`)
}

for (const vsn of VSNS) {
  describe(`vsn ${vsn}`, () => {
    let rt, got, ch
    before(async () => {
      rt = client(st.server, { vsn })
      got = collector('values')
      ch = await subscribed(rt.channel(uniq('values')).on('postgres_changes', { event: '*', schema: 'public', table: 'v' }, got))
    })
    after(async () => {
      await rt.removeChannel(ch)
      await rt.disconnect()
    })

    for (const row of ROWS) {
      test(`INSERT: ${row.what}`, async () => {
        const id = nextId++
        const n = got.items.length
        await db.query(`INSERT INTO v (id, ${COLS.join(', ')}) VALUES (${id}, ${COLS.map((c) => row.sql[c]).join(', ')})`)
        await got.wait(n + 1)
        const p = got.items[n]
        assert.equal(p.eventType, 'INSERT')
        const want = { id, ...row.want }
        // The oracle is what the reference server sends: to_jsonb of the row.
        const { rows } = await db.query('SELECT to_jsonb(v)::text AS j FROM v WHERE id = $1', [id])
        assert.deepEqual(JSON.parse(rows[0].j), want, 'the expected values must be the to_jsonb form')
        assertRow(p.new, want)
      })
    }

    test('UPDATE and DELETE convert old rows the same way', async () => {
      const id = nextId++
      const n = got.items.length
      const row = ROWS[0]
      await db.query(`INSERT INTO v (id, ${COLS.join(', ')}) VALUES (${id}, ${COLS.map((c) => row.sql[c]).join(', ')})`)
      await db.query(`UPDATE v SET b = false, jb = '{"x":[1]}', ai = '{4}' WHERE id = $1`, [id])
      await db.query('DELETE FROM v WHERE id = $1', [id])
      await got.wait(n + 3)
      const [ins, upd, del] = got.items.slice(n)
      const before = { id, ...row.want }
      const after = { ...before, b: false, jb: { x: [1] }, ai: [4] }
      assert.deepEqual([ins.eventType, upd.eventType, del.eventType], ['INSERT', 'UPDATE', 'DELETE'])
      assertRow(ins.new, before, 'INSERT new')
      assertRow(upd.new, after, 'UPDATE new')
      assertRow(upd.old, before, 'UPDATE old')
      assertRow(del.old, after, 'DELETE old')
      assert.deepEqual(del.new, {})
    })
  })
}
