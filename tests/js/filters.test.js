// postgres_changes filters (eq, neq, lt, lte, gt, gte, in, comma-AND, is, quoted in) through
// realtime-js, over vsn 2.0.0 and 1.0.0. Absence is proven the same way everywhere: the
// rows that must be filtered out are committed first, a matching row last; an unfiltered
// observer on the same socket sees every row, and the filtered channel sees only matches.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, collector, subscribed, uniq, VSNS } from './lib/harness.js'

let st, db
let nextId = 1

before(async () => {
  st = await startStack({
    setupSql: ['CREATE TABLE f (id int8 PRIMARY KEY, owner int4, status text, score numeric, tag text)'],
    tables: ['f'],
  })
  db = st.env.db
})
after(async () => {
  await st?.stop()
})

// [filter, rows in commit order as {owner,status,score,tag,match}]
const CASES = [
  ['owner=eq.7', [{ owner: 8 }, { owner: 70 }, { owner: 7, match: true }]],
  ['status=neq.draft', [{ status: 'draft' }, { status: 'open', match: true }]],
  ['score=lt.10', [{ score: 10 }, { score: 15 }, { score: 9.5, match: true }]],
  ['score=lte.10', [{ score: 11 }, { score: 10.001 }, { score: 10, match: true }]],
  ['score=gt.10', [{ score: 10 }, { score: 3 }, { score: 10.01, match: true }]],
  ['score=gte.10', [{ score: 9.99 }, { score: 10, match: true }]],
  ['status=in.(open,closed)', [{ status: 'draft' }, { status: 'opened' }, { status: 'open', match: true }, { status: 'closed', match: true }]],
  ['owner=eq.7,status=eq.open', [{ owner: 7, status: 'draft' }, { owner: 8, status: 'open' }, { owner: 7, status: 'open', match: true }]],
  ['owner=gte.5,owner=lt.8,status=in.(a,b)', [{ owner: 4, status: 'a' }, { owner: 8, status: 'a' }, { owner: 6, status: 'c' }, { owner: 5, status: 'b', match: true }]],
  ['tag=in.("x,y",z)', [{ tag: 'x' }, { tag: 'y' }, { tag: 'x,y', match: true }, { tag: 'z', match: true }]],
  ['tag=is.null', [{ tag: 'a' }, { tag: null, match: true }]],
]

async function insertRow(r) {
  const id = nextId++
  await db.query('INSERT INTO f (id, owner, status, score, tag) VALUES ($1, $2, $3, $4, $5)', [
    id,
    r.owner ?? 1,
    r.status ?? 'none',
    r.score ?? 0,
    'tag' in r ? r.tag : 'none',
  ])
  return id
}

for (const vsn of VSNS) {
  describe(`vsn ${vsn}`, () => {
    let rt, observer, observerCh
    before(async () => {
      rt = client(st.server, { vsn })
      observer = collector('unfiltered observer')
      observerCh = await subscribed(
        rt.channel(uniq('observer')).on('postgres_changes', { event: '*', schema: 'public', table: 'f' }, observer),
      )
    })
    after(async () => {
      await rt.removeAllChannels()
      await rt.disconnect()
    })

    for (const [filter, rows] of CASES) {
      test(`filter ${filter}: only matching rows arrive`, async () => {
        const got = collector(filter)
        const sys = collector('system')
        const ch = await subscribed(
          rt
            .channel(uniq('flt'))
            .on('system', {}, sys)
            .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'f', filter }, got),
        )
        await sys.wait(1)
        assert.deepEqual(
          { extension: sys.items[0].extension, status: sys.items[0].status, message: sys.items[0].message },
          { extension: 'postgres_changes', status: 'ok', message: 'Subscribed to PostgreSQL' },
          `the filter ${filter} must be accepted`,
        )
        const before = observer.items.length
        const inserted = []
        for (const r of rows) inserted.push({ id: await insertRow(r), match: !!r.match })
        const want = inserted.filter((r) => r.match).map((r) => r.id)
        // Every row was streamed (the observer saw all of them, the last one included) ...
        await observer.wait(before + rows.length)
        assert.deepEqual(observer.items.slice(before).map((p) => p.new.id), inserted.map((r) => r.id))
        // ... and the filtered channel got exactly the matches, the last row being one of them.
        await got.wait(want.length)
        assert.deepEqual(got.items.map((p) => p.new.id), want, `filter ${filter}`)
        await rt.removeChannel(ch)
      })
    }

    test('a filter applies to UPDATE (new row) and DELETE (old row) as well', async () => {
      const got = collector('owner=eq.7 *')
      const ch = await subscribed(
        rt.channel(uniq('flt-all')).on('postgres_changes', { event: '*', schema: 'public', table: 'f', filter: 'owner=eq.7' }, got),
      )
      const other = await insertRow({ owner: 8, status: 'a' })
      const mine = await insertRow({ owner: 7, status: 'a' })
      await db.query("UPDATE f SET status = 'b' WHERE id = $1", [other])
      await db.query("UPDATE f SET status = 'b' WHERE id = $1", [mine])
      await db.query('DELETE FROM f WHERE id = $1', [other])
      await db.query('DELETE FROM f WHERE id = $1', [mine])
      await got.wait(3)
      assert.deepEqual(
        got.items.map((p) => [p.eventType, p.new.id ?? null, p.old.id ?? null, p.new.status ?? p.old.status]),
        [
          ['INSERT', mine, null, 'a'],
          ['UPDATE', mine, mine, 'b'],
          ['DELETE', null, mine, 'b'],
        ],
      )
      await rt.removeChannel(ch)
    })

    test('a filtered-out row never arrives, a later matching row arrives alone', async () => {
      const got = collector('status=eq.wanted')
      const ch = await subscribed(
        rt
          .channel(uniq('absent'))
          .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'f', filter: 'status=eq.wanted' }, got),
      )
      await insertRow({ status: 'unwanted' })
      await insertRow({ status: 'Wanted' })
      await insertRow({ status: 'wanted ' })
      const hit = await insertRow({ status: 'wanted' })
      await got.wait(1)
      assert.deepEqual(got.items.map((p) => [p.new.id, p.new.status]), [[hit, 'wanted']])
      // One more matching row: still nothing but matches, in order.
      const hit2 = await insertRow({ status: 'wanted' })
      await got.wait(2)
      assert.deepEqual(got.items.map((p) => p.new.id), [hit, hit2])
      await rt.removeChannel(ch)
    })
  })
}
