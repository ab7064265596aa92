// "Could not judge" is not "may not see". A change withheld from a subscriber because its
// row-level security check could not give an answer (the check timed out, was cancelled,
// or failed: a policy that raises, one that reads a system column) is told to that
// subscriber with a `system` error, at most once per subscription every 5 s, and counted
// per project; only a policy's answer (its expression false or NULL) is silent. Before,
// such subscribers were denied in silence: under load, a slow policy and a tight
// CDC_RLS_CHECK_TIMEOUT_MS left them without their changes and nothing said why.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, subscribed, jwt, uniq, until, busyLoops } from './lib/harness.js'

const TIMEOUT_MS = 300
const FAST = 5
const AUDIT = 3
const ROWS = 80
const RATE = 10
const NOTICE_EVERY_MS = 5000

const uid = (n) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`

let st
const clients = []
before(async () => {
  st = await startStack({
    setupSql: [
      // An audit lookup that takes half a second per row: past the check timeout.
      `CREATE FUNCTION audit_ok(id int8) RETURNS bool LANGUAGE plpgsql VOLATILE
         AS $$ BEGIN PERFORM pg_sleep(0.5); RETURN id > 0; END $$`,
      `CREATE FUNCTION refuse(id int8) RETURNS bool LANGUAGE plpgsql VOLATILE
         AS $$ BEGIN RAISE EXCEPTION 'row % is off limits', id; END $$`,
      'CREATE TABLE docs (id int8 PRIMARY KEY, owner text NOT NULL, at int8 NOT NULL)',
      'CREATE TABLE notes (id int8 PRIMARY KEY, owner text NOT NULL)',
      'CREATE TABLE tagged (id int8 PRIMARY KEY, owner text NOT NULL)',
    ],
    tables: ['docs', 'notes', 'tagged'],
    serverEnv: { CDC_RLS_CHECK_TIMEOUT_MS: String(TIMEOUT_MS) },
  })
  await st.env.db.query(`
    ALTER TABLE docs ENABLE ROW LEVEL SECURITY;
    CREATE POLICY read ON docs FOR SELECT TO authenticated USING (
      CASE WHEN auth.jwt() ->> 'team' = 'audit' THEN audit_ok(id)
           ELSE owner = auth.jwt() ->> 'sub' END);
    ALTER TABLE notes ENABLE ROW LEVEL SECURITY;
    CREATE POLICY read ON notes FOR SELECT TO authenticated USING (
      CASE WHEN owner = 'nobody' THEN refuse(id) ELSE owner = auth.jwt() ->> 'sub' END);
    ALTER TABLE tagged ENABLE ROW LEVEL SECURITY;
    CREATE POLICY read ON tagged FOR SELECT TO authenticated USING (
      owner = auth.jwt() ->> 'sub' AND xmin IS NOT NULL)`)
})
after(async () => {
  for (const rt of clients) await rt.disconnect()
  await st?.stop()
})

/** One client as user `n` (`team` in its claims) on `table`: its rows and its system errors. */
async function user(n, team, table) {
  const token = jwt({ role: 'authenticated', sub: uid(n), team })
  const rt = client(st.server, { apikey: token })
  clients.push(rt)
  const u = { n, rows: new Set(), errors: [] }
  const ch = rt
    .channel(uniq(`${table}-${team}`))
    .on('postgres_changes', { event: 'INSERT', schema: 'public', table }, (p) => u.rows.add(Number(p.new.id)))
    .on('system', {}, (m) => {
      if (m.status === 'error') u.errors.push({ at: Date.now(), message: m.message })
    })
  await subscribed(ch, 30000)
  return u
}

/** The value of one series of a metric (`labels` as in the exposition), 0 when absent. */
async function series(name, labels) {
  const text = await (await fetch(`${st.server.url}/metrics`, st.server.figures)).text()
  const line = text.split('\n').find((l) => l.startsWith(`${name}{`) && labels.every((x) => l.includes(x)))
  return line ? Number(line.split(' ').pop()) : 0
}

test('checks that time out under load: each affected subscriber is told, at most every 5 s; the others get exactly their rows', async () => {
  const fast = []
  for (let n = 1; n <= FAST; n++) fast.push(await user(n, 'ops', 'docs'))
  const audit = []
  for (let n = 1; n <= AUDIT; n++) audit.push(await user(100 + n, 'audit', 'docs'))
  const bystander = await user(999, 'ops', 'docs') // owns nothing: the policy says no

  const load = busyLoops({ cores: 1 })
  const started = Date.now()
  const ids = []
  try {
    for (let i = 1; i <= ROWS; i++) {
      const due = started + (i * 1000) / RATE
      if (due > Date.now()) await new Promise((r) => setTimeout(r, due - Date.now()))
      await st.env.db.query('INSERT INTO docs (id, owner, at) VALUES ($1, $2, $3)', [i, uid(1 + (i % FAST)), Date.now()])
      ids.push(i)
    }
    const own = (u) => ids.filter((i) => 1 + (i % FAST) === u.n)
    const done = () => fast.every((u) => own(u).every((i) => u.rows.has(i))) && audit.every((u) => u.errors.length > 0)
    await until('every owner its rows and every audit subscriber a notice', done, 60000).catch(() => {})
  } finally {
    await load.stop()
  }
  const lines = [
    ...fast.map((u) => `ops ${u.n}: ${u.rows.size} rows, ${u.errors.length} system errors`),
    ...audit.map((u) => `audit ${u.n}: ${u.rows.size} rows, ${u.errors.length} system errors: ${u.errors[0]?.message ?? ''}`),
    `bystander: ${bystander.rows.size} rows, ${bystander.errors.length} system errors`,
  ].join('\n')
  console.log(lines)
  for (const u of fast) {
    const mine = ids.filter((i) => 1 + (i % FAST) === u.n)
    assert.deepEqual([...u.rows].sort((a, b) => a - b), mine, `ops ${u.n}: exactly its rows\n${lines}`)
    assert.deepEqual(u.errors, [], `ops ${u.n}: judged, so not told\n${lines}`)
  }
  for (const u of audit) {
    assert.ok(u.errors.length > 0, `audit ${u.n}: its checks timed out and nothing told it\n${lines}`)
    assert.match(u.errors[0].message, /could not be judged/, lines)
    assert.match(u.errors[0].message, /timed out/, lines)
    assert.equal(u.rows.size, 0, lines)
    const gaps = u.errors.slice(1).map((e, i) => e.at - u.errors[i].at)
    assert.ok(gaps.every((g) => g > NOTICE_EVERY_MS - 1500), `audit ${u.n}: told more often than every 5 s: ${gaps}`)
  }
  assert.equal(bystander.rows.size, 0, lines)
  assert.deepEqual(bystander.errors, [], `the policy's "no" is silent\n${lines}`)
  const withheld = await series('walcast_realtime_unjudged_total', ['project="default"', 'reason="timeout"'])
  assert.ok(withheld >= AUDIT, `walcast_realtime_unjudged_total{project="default",reason="timeout"} = ${withheld}`)
  const told = await series('walcast_realtime_unjudged_notices_total', ['project="default"'])
  assert.ok(told >= AUDIT, `walcast_realtime_unjudged_notices_total{project="default"} = ${told}`)
})

test('a policy that raises, or reads a system column, tells its subscribers; its answer "no" stays silent', async () => {
  const a = await user(1, 'ops', 'notes')
  const b = await user(2, 'ops', 'notes')
  // A row the policy raises on: no group of the batch can be judged.
  await st.env.db.query("INSERT INTO notes VALUES (1, 'nobody')")
  await until('both told', () => a.errors.length > 0 && b.errors.length > 0, 20000)
  assert.match(a.errors[0].message, /could not be judged.*check failed/)
  assert.doesNotMatch(a.errors[0].message, /off limits/, 'the policy error itself is never sent')
  // Past the notices' 5 s: a's own row reaches a; b, whom the policy answers no, hears nothing.
  await new Promise((r) => setTimeout(r, NOTICE_EVERY_MS))
  const bErrors = b.errors.length
  await st.env.db.query(`INSERT INTO notes VALUES (2, '${uid(1)}')`)
  await until("a's row", () => a.rows.has(2), 20000)
  await new Promise((r) => setTimeout(r, 1000))
  assert.equal(b.errors.length, bErrors, 'a "no" is silent')
  assert.equal(b.rows.size, 0)
  assert.equal(a.errors.length, 1)

  // A policy reading xmin cannot be evaluated on a version: told, every time (rate-limited).
  const c = await user(3, 'ops', 'tagged')
  await st.env.db.query(`INSERT INTO tagged VALUES (1, '${uid(3)}')`)
  await until('c told', () => c.errors.length > 0, 20000)
  assert.match(c.errors[0].message, /could not be judged.*check failed/)
  assert.equal(c.rows.size, 0)
  assert.ok((await series('walcast_realtime_unjudged_total', ['project="default"', 'reason="failed"'])) >= 3)
})

test("a notice says nothing of the row: every subscription with the withheld one's claims is told, whatever its filter", async () => {
  // Two channels of one audit user, one filtering on the row's id, one on an id never
  // written. Told only where the filter matched, the notice would say what the row holds.
  const token = jwt({ role: 'authenticated', sub: uid(700), team: 'audit' })
  const rt = client(st.server, { apikey: token })
  clients.push(rt)
  const channel = (filter) => {
    const u = { rows: new Set(), errors: [] }
    const ch = rt
      .channel(uniq(`docs-filtered-${filter}`))
      .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'docs', filter }, (p) => u.rows.add(Number(p.new.id)))
      .on('system', {}, (m) => {
        if (m.status === 'error') u.errors.push(m.message)
      })
    return { u, ch }
  }
  const hit = channel('id=eq.7777')
  const miss = channel('id=eq.-1')
  await subscribed(hit.ch, 30000)
  await subscribed(miss.ch, 30000)
  await st.env.db.query('INSERT INTO docs (id, owner, at) VALUES (7777, $1, 0)', [uid(1)])
  await until('the matching channel told', () => hit.u.errors.length > 0, 30000)
  await until('the other channel told too', () => miss.u.errors.length > 0, 10000)
  assert.match(miss.u.errors[0], /could not be judged/)
  assert.equal(hit.u.rows.size + miss.u.rows.size, 0)
})
