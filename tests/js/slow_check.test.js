// A check that cannot finish within the lag bound is cut off at it. One transaction of
// 40 rows on a table whose SELECT policy sleeps 100 ms per row takes about 4 s to check; the project's lag bound is 1.5 s. The subscriber must be told
// (a `system` error) by about the bound, not receive the rows after it in silence; the
// database must stop running the cancelled check; and the project's next row, on its
// own, must arrive. (CI once saw a slow tenant's subscribers wait past the bound with
// nothing: its lane had merged its backlog into one check too large to finish in time.)
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, subscribed, jwt, uniq, metric, until } from './lib/harness.js'
import { latencyRecorder } from './lib/tenants.js'

const MAX_LAG_MS = 1500
const ROWS = 40
const USER = '00000000-0000-4000-8000-00000000c0de'

let st
let rt
before(async () => {
  st = await startStack({
    setupSql: [
      `CREATE FUNCTION slow_ok(id int8) RETURNS bool LANGUAGE plpgsql VOLATILE
         AS $$ BEGIN PERFORM pg_sleep(0.1); RETURN id > 0; END $$`,
      'CREATE TABLE slow (id int8 PRIMARY KEY, at int8 NOT NULL)',
    ],
    tables: ['slow'],
    serverEnv: { REALTIME_MAX_LAG_MS: String(MAX_LAG_MS) },
  })
  await st.env.db.query(`ALTER TABLE slow ENABLE ROW LEVEL SECURITY;
    CREATE POLICY sleepy ON slow FOR SELECT TO authenticated USING (slow_ok(id));
    GRANT SELECT ON slow TO authenticated`)
})
after(async () => {
  await rt?.disconnect()
  await st?.stop()
})

const sleeping = async () =>
  Number((await st.env.db.query("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'")).rows[0].count)

test('a check past the lag bound is cancelled and its subscriber told by the bound', async () => {
  rt = client(st.server, { apikey: jwt({ role: 'authenticated', sub: USER }) })
  const rec = latencyRecorder()
  const noticed = []
  const ch = rt
    .channel(uniq('slow'))
    .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'slow' }, rec.onChange)
    .on('system', {}, (m) => {
      rec.onSystem(m)
      if (m.status === 'error') noticed.push(Date.now())
    })
  await subscribed(ch)

  const committed = Date.now()
  await st.env.db.query(`INSERT INTO slow SELECT i, $1 FROM generate_series(1, ${ROWS}) i`, [committed])
  await until('a system error on the channel', () => noticed.length > 0, 15000)
  const after = noticed[0] - committed
  const ids = Array.from({ length: ROWS }, (_, i) => i + 1)
  const got = ids.length - rec.missing(ids).length
  const detail = `told after ${after} ms, ${got}/${ROWS} rows received: ${rec.errors[0]}`
  console.log(detail)
  assert.match(rec.errors[0], /fell more than 1500 ms behind/, detail)
  // The whole check takes about 4 s: told before it could have finished.
  assert.ok(after < 3500, `told only after ${after} ms\n${detail}`)
  await until('the cancelled check to stop sleeping in the database', async () => (await sleeping()) === 0, 3000)
  // The transaction may reach the lane in several batches, each cut and counted in turn.
  let lagged = 0
  const counted = async () => (lagged = await metric(st.server, 'walcast_realtime_changes_lagged_total')) >= ROWS - got
  await until('every missing row counted as lagged', counted, 5000).catch(() => {})
  assert.ok(lagged >= ROWS - got, `${lagged} counted as lagged\n${detail}`)

  // The project's next row, alone, is checked in time and delivered.
  await st.env.db.query('INSERT INTO slow VALUES ($1, $2)', [1000, Date.now()])
  await until('the next row', () => rec.rows.has(1000), 10000)
  assert.ok(rec.rows.get(1000) < MAX_LAG_MS, `the next row took ${rec.rows.get(1000)} ms`)
})
