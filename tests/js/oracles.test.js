// No subscriber learns anything about a version of a row it could not SELECT, through the
// unmodified client, with both sources (stream and poll):
// - a DELETE is judged like an INSERT, on the deleted version's own values: a user who
//   never saw a row learns nothing from which of its filters (every operator, on every
//   column type) would have matched it; the owner gets the deleted row's readable values;
// - `old_record` carries only what the subscriber could SELECT of the old version: a note
//   handed from alice to bob reaches bob with an empty `old_record`, not alice's text;
//   an old version that cannot be judged (replica identity DEFAULT) is withheld;
// - a filter reads only columns the role may read at each change: after a REVOKE of the
//   filtered column, or on a table enabled after a wildcard binding, the binding does not
//   fire (every operator), its channel is told once why, and a GRANT back restores it.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, collector, subscribed, uniq, until, jwt, metric } from './lib/harness.js'

const ALICE = '00000000-0000-4000-8000-00000000a11c'
const BOB = '00000000-0000-4000-8000-000000000b0b'
const user = (sub) => jwt({ role: 'authenticated', sub })

// [matching, not matching] a row whose body is 'pin-4821' and whose n is 4821.
const ON_BODY = [
  ['eq.pin-4821', 'eq.pin-0000'],
  ['neq.pin-0000', 'neq.pin-4821'],
  ['lt.pin-5', 'lt.pin-1'],
  ['lte.pin-4821', 'lte.pin-0'],
  ['gt.pin-1', 'gt.pin-5'],
  ['gte.pin-4821', 'gte.pin-9'],
  ['in.(pin-4821,pin-1)', 'in.(pin-0000,pin-1)'],
  ['like.pin-48*', 'like.pin-00*'],
  ['ilike.PIN-48%', 'ilike.PIN-00%'],
  ['match.^pin-4', 'match.^pin-0'],
  ['imatch.^PIN-4', 'imatch.^PIN-0'],
  ['isdistinct.pin-0000', 'isdistinct.pin-4821'],
  ['not.is.null', 'is.null'],
]
const ON_N = [
  ['eq.4821', 'eq.0'],
  ['neq.0', 'neq.4821'],
  ['lt.5000', 'lt.4000'],
  ['lte.4821', 'lte.4820'],
  ['gt.4000', 'gt.5000'],
  ['gte.4821', 'gte.4822'],
  ['in.(4821,1)', 'in.(0,1)'],
  ['like.48*', 'like.00*'],
  ['match.^48', 'match.^00'],
  ['isdistinct.0', 'isdistinct.4821'],
]
/** Every filter of both lists: `[filter, matches]`. */
const FILTERS = [
  ...ON_BODY.flatMap(([yes, no]) => [
    [`body=${yes}`, true],
    [`body=${no}`, false],
  ]),
  ...ON_N.flatMap(([yes, no]) => [
    [`n=${yes}`, true],
    [`n=${no}`, false],
  ]),
]

// Bindings matching a salary of 150000, one per operator.
const ON_SALARY = [
  'eq.150000',
  'neq.1',
  'lt.200000',
  'lte.150000',
  'gt.100000',
  'gte.100000',
  'in.(150000,1)',
  'like.15*',
  'ilike.15%',
  'match.^15',
  'imatch.^15',
  'isdistinct.1',
  'not.is.null',
].map((op) => `salary=${op}`)

const idOf = (p) => p.new?.id ?? p.old?.id

/**
 * One channel of `apikey`'s with an unfiltered `sync` binding (`syncOn`) and one binding
 * per filter (`on`: the binding's table and event): `{ rt, ch, sync, got: [[filter, cb]], system }`.
 */
async function listen(server, apikey, { syncOn, on, filters }) {
  const rt = client(server, { apikey })
  const system = collector('system')
  const sync = collector('sync')
  let ch = rt.channel(uniq('oracle')).on('system', {}, system).on('postgres_changes', syncOn, sync)
  const got = filters.map((f) => [f, collector(f)])
  for (const [f, cb] of got) ch = ch.on('postgres_changes', { ...on, filter: f }, cb)
  await subscribed(ch)
  return { rt, ch, sync, got, system }
}

async function close(...listeners) {
  for (const l of listeners) {
    if (!l) continue
    await l.rt.removeAllChannels()
    l.rt.disconnect()
  }
}

/**
 * anon's filters on `staff.salary` (every operator) fire until `salary` is revoked from
 * anon, never after (nor a DELETE's), each channel is told once why, and they fire again
 * once it is granted back. `staff` has no RLS; anon may read (id, name, salary).
 */
async function revokedMidStream({ server, db, newId }) {
  const staff = { event: 'INSERT', schema: 'public', table: 'staff' }
  const anon = await listen(server, jwt({ role: 'anon' }), { syncOn: staff, on: staff, filters: ON_SALARY })
  const dels = await listen(server, jwt({ role: 'anon' }), { syncOn: staff, on: { ...staff, event: 'DELETE' }, filters: ['salary=gte.100000'] })
  try {
    const insert = async (name, salary) => {
      const id = newId()
      await db.query('INSERT INTO staff VALUES ($1, $2, $3)', [id, name, salary])
      return id
    }
    const synced = (l, id) => until(`the row ${id}`, () => l.sync.items.some((p) => p.new.id === id))
    const first = await insert('ann', 150000)
    await synced(anon, first)
    for (const [f, cb] of anon.got) {
      await until(`${f}: the first row`, () => cb.items.length === 1)
      assert.deepEqual(cb.items[0].new, { id: first, name: 'ann', salary: 150000 }, f)
    }
    const withheldBefore = await metric(server, 'walcast_cdc_filter_unreadable_total')
    await db.query('REVOKE SELECT (salary) ON staff FROM anon')
    const [high, low] = [await insert('bea', 150000), await insert('cy', 50000)]
    await db.query('DELETE FROM staff WHERE id = $1', [first])
    const last = await insert('dee', 10)
    await synced(anon, last)
    await synced(dels, last)
    assert.deepEqual(
      anon.sync.items.slice(1).map((p) => p.new),
      [{ id: high, name: 'bea' }, { id: low, name: 'cy' }, { id: last, name: 'dee' }],
      'the unfiltered binding goes on, without the revoked column',
    )
    for (const [f, cb] of anon.got) assert.equal(cb.items.length, 1, `${f} fired after the REVOKE: ${JSON.stringify(cb.items)}`)
    assert.deepEqual(dels.got[0][1].items, [], 'a DELETE filtered on the revoked column')
    // Each channel is told why, once (one `system` error however many of its bindings).
    const told = (l) => l.system.items.filter((s) => s.status === 'error' && /salary/.test(s.message))
    await until('every filtered channel told', () => told(anon).length >= 1 && told(dels).length >= 1)
    assert.match(told(anon)[0].message, /column "salary"/)
    assert.ok((await metric(server, 'walcast_cdc_filter_unreadable_total')) > withheldBefore)
    await new Promise((r) => setTimeout(r, 2500))
    assert.equal(told(anon).length, 1, 'told once')
    assert.equal(told(dels).length, 1)

    // Granted again: the filters fire again.
    await db.query('GRANT SELECT (salary) ON staff TO anon')
    const again = await insert('eve', 150000)
    for (const [f, cb] of anon.got) {
      await until(`${f}: the row after the GRANT`, () => cb.items.length === 2)
      assert.deepEqual(cb.items[1].new, { id: again, name: 'eve', salary: 150000 }, f)
    }
    assert.equal(anon.ch.state, 'joined')
  } finally {
    await close(anon, dels)
  }
}

for (const source of ['stream', 'poll']) {
  describe(`CDC_SOURCE=${source}`, () => {
    let env, server, db
    let nextId = 1
    before(async () => {
      env = await startEnv()
      db = env.db
      await db.query(`CREATE TABLE notes (id int8 PRIMARY KEY, owner uuid NOT NULL, shared bool NOT NULL,
                        body text, n int4, secret text);
                      CREATE TABLE notes_key (id int8 PRIMARY KEY, owner uuid NOT NULL, shared bool NOT NULL, body text);
                      CREATE TABLE staff (id int8 PRIMARY KEY, name text, salary int4);
                      CREATE SCHEMA hr;
                      CREATE TABLE hr.other (id int8 PRIMARY KEY, name text);
                      CREATE TABLE hr.payroll (id int8 PRIMARY KEY, name text, salary int4)`)
      server = await startProcess(env, 'walcast', ['serve'], { CDC_SOURCE: source, CDC_SLOT_NAME: `walcast_js_o_${source}` })
      for (const t of ['notes', 'notes_key', 'staff']) await enableTable(env, t)
      await enableTable(env, 'other', 'hr')
      // The server has run its migrations: the roles and auth.uid() exist.
      await db.query(`ALTER TABLE notes_key REPLICA IDENTITY DEFAULT;
        REVOKE ALL ON notes, notes_key, staff FROM anon, authenticated;
        GRANT SELECT (id, owner, shared, body, n) ON notes TO anon, authenticated;
        GRANT SELECT ON notes_key TO authenticated;
        GRANT SELECT (id, name, salary) ON staff TO anon;
        GRANT USAGE ON SCHEMA hr TO anon;
        ALTER TABLE notes ENABLE ROW LEVEL SECURITY;
        ALTER TABLE notes_key ENABLE ROW LEVEL SECURITY;
        CREATE POLICY own_or_shared ON notes FOR SELECT TO authenticated USING (owner = auth.uid() OR shared);
        CREATE POLICY shared_only ON notes FOR SELECT TO anon USING (shared);
        CREATE POLICY own ON notes_key FOR SELECT TO authenticated USING (owner = auth.uid())`)
    })
    after(async () => {
      await server?.stop()
      await env?.stop()
    })

    test('a DELETE of a row bob cannot see tells him nothing, whatever his filters', async () => {
      const notes = { event: '*', schema: 'public', table: 'notes' }
      const deletes = { event: 'DELETE', schema: 'public', table: 'notes' }
      const filters = FILTERS.map(([f]) => f)
      const bob = await listen(server, user(BOB), { syncOn: notes, on: deletes, filters })
      const anon = await listen(server, jwt({ role: 'anon' }), { syncOn: notes, on: deletes, filters: ['body=eq.pin-4821', 'n=eq.4821'] })
      const alice = await listen(server, user(ALICE), { syncOn: notes, on: deletes, filters: ['body=eq.pin-4821'] })
      try {
        const [hidden, shared] = [nextId++, nextId++]
        await db.query(`INSERT INTO notes VALUES ($1, $2, false, 'pin-4821', 4821, 's')`, [hidden, ALICE])
        await db.query(`INSERT INTO notes VALUES ($1, $2, true, 'pin-4821', 4821, 's')`, [shared, ALICE])
        await db.query('DELETE FROM notes WHERE id = $1', [hidden])
        await db.query('DELETE FROM notes WHERE id = $1', [shared])
        // The shared row's DELETE comes last: whoever has it had everything before it.
        const deleted = (l, id) => l.sync.items.some((p) => p.eventType === 'DELETE' && idOf(p) === id)
        for (const [who, l] of [['bob', bob], ['anon', anon], ['alice', alice]]) {
          await until(`${who}: the shared row's DELETE`, () => deleted(l, shared))
        }
        for (const [who, l] of [['bob', bob], ['anon', anon]]) {
          const fired = [['(no filter)', l.sync], ...l.got].filter(([, cb]) => cb.items.some((p) => idOf(p) === hidden))
          const told = fired.map(([f, cb]) => `${f} → ${JSON.stringify(cb.items.find((p) => idOf(p) === hidden).old)}`)
          assert.deepEqual(told, [], `${who}'s bindings that fired on a row ${who} never could see`)
        }
        // Bob may see the shared row: its DELETE reaches exactly his matching filters, with
        // the values he may read of it.
        const visible = { id: shared, owner: ALICE, shared: true, body: 'pin-4821', n: 4821 }
        for (const [f, cb] of bob.got) {
          const want = FILTERS.find(([x]) => x === f)[1] ? [['DELETE', visible]] : []
          assert.deepEqual(cb.items.map((p) => [p.eventType, p.old]), want, `bob's ${f}`)
        }
        // The owner may SELECT the deleted version: she gets it, without the column her
        // role may not read.
        const own = alice.sync.items.filter((p) => p.eventType === 'DELETE').map((p) => p.old)
        assert.deepEqual(own, [{ id: hidden, owner: ALICE, shared: false, body: 'pin-4821', n: 4821 }, visible])
        assert.deepEqual(alice.got[0][1].items.map((p) => p.old.id), [hidden, shared])
      } finally {
        await close(bob, anon, alice)
      }
    })

    test("old_record carries only what the subscriber could SELECT of the old version", async () => {
      const on = { event: 'UPDATE', schema: 'public', table: 'notes' }
      const bob = await listen(server, user(BOB), { syncOn: { event: '*', schema: 'public', table: 'notes' }, on, filters: ['body=eq.[redacted]', 'body=like.v*'] })
      try {
        const [handed, shared] = [nextId++, nextId++]
        await db.query(`INSERT INTO notes VALUES ($1, $2, false, 'alice: the safe code is 4821', 4821, 's')`, [handed, ALICE])
        await db.query(`UPDATE notes SET owner = $1, body = '[redacted]' WHERE id = $2`, [BOB, handed])
        await db.query(`INSERT INTO notes VALUES ($1, $2, true, 'v1', 1, 's')`, [shared, ALICE])
        await db.query(`UPDATE notes SET body = 'v2', n = 2 WHERE id = $1`, [shared])
        await db.query('DELETE FROM notes WHERE id = $1', [handed])
        await until('bob: the handed note DELETE', () => bob.sync.items.some((p) => p.eventType === 'DELETE'))
        const summary = (p) => [p.eventType, p.new, p.old]
        assert.deepEqual(bob.sync.items.map(summary), [
          // Bob never could SELECT the note as alice had it: nothing of that version.
          ['UPDATE', { id: handed, owner: BOB, shared: false, body: '[redacted]', n: 4821 }, {}],
          ['INSERT', { id: shared, owner: ALICE, shared: true, body: 'v1', n: 1 }, {}],
          // A version he could see: its values, never a column his role may not read.
          ['UPDATE', { id: shared, owner: ALICE, shared: true, body: 'v2', n: 2 }, { id: shared, owner: ALICE, shared: true, body: 'v1', n: 1 }],
          ['DELETE', {}, { id: handed, owner: BOB, shared: false, body: '[redacted]', n: 4821 }],
        ])
        assert.deepEqual(bob.got[0][1].items.map((p) => [p.new.id, p.old]), [[handed, {}]], 'filter on the new version')
        assert.deepEqual(bob.got[1][1].items.map((p) => [p.new.id, p.old.body]), [[shared, 'v1']])
      } finally {
        await close(bob)
      }
    })

    test('an old version without the values its policies read is withheld, counted', async () => {
      const bob = await listen(server, user(BOB), { syncOn: { event: '*', schema: 'public', table: 'notes_key' }, on: { event: 'DELETE', schema: 'public', table: 'notes_key' }, filters: ['body=eq.mine'] })
      try {
        const before = await metric(server, 'walcast_cdc_rls_old_unjudged_total')
        const [mine, last] = [nextId++, nextId++]
        await db.query(`INSERT INTO notes_key VALUES ($1, $2, false, 'mine')`, [mine, BOB])
        await db.query(`UPDATE notes_key SET body = 'still mine' WHERE id = $1`, [mine])
        await db.query('DELETE FROM notes_key WHERE id = $1', [mine])
        await db.query(`INSERT INTO notes_key VALUES ($1, $2, false, 'last')`, [last, BOB])
        await until('bob: the last row', () => bob.sync.items.some((p) => idOf(p) === last))
        // Replica identity DEFAULT: the old version is the key alone, and the policy reads
        // `owner`: it cannot be judged, so nothing of it is sent — no old values, no DELETE.
        assert.deepEqual(bob.sync.items.map((p) => [p.eventType, idOf(p), p.old]), [
          ['INSERT', mine, {}],
          ['UPDATE', mine, {}],
          ['INSERT', last, {}],
        ])
        assert.deepEqual(bob.got[0][1].items, [])
        assert.ok((await metric(server, 'walcast_cdc_rls_old_unjudged_total')) >= before + 2)
      } finally {
        await close(bob)
      }
    })

    test('a filter on a column revoked mid-stream no longer fires (every operator); told once', () =>
      revokedMidStream({ server, db, newId: () => nextId++ }))

    test('a wildcard binding never filters on a column of a table enabled later that its role may not read', async () => {
      const other = { event: 'INSERT', schema: 'hr', table: 'other' }
      const anon = await listen(server, jwt({ role: 'anon' }), {
        syncOn: other,
        on: { event: 'INSERT', schema: 'hr' },
        filters: ['salary=gte.100000', 'salary=like.15*'],
      })
      try {
        // Enabled after the binding: anon may read every column but `salary`.
        await db.query(`GRANT SELECT (id, name) ON hr.payroll TO anon;
          ALTER TABLE hr.payroll REPLICA IDENTITY FULL;
          INSERT INTO walcast.realtime_tables (schema_name, table_name) VALUES ('hr', 'payroll')`)
        await db.query(`INSERT INTO hr.payroll VALUES (1, 'ann', 150000), (2, 'bea', 50000)`)
        await db.query(`INSERT INTO hr.other VALUES (1, 'last')`)
        await until('the last row', () => anon.sync.items.length === 1)
        for (const [f, cb] of anon.got) assert.deepEqual(cb.items, [], `${f} filtered on a column anon may not read`)
        await until('told why', () => anon.system.items.filter((s) => s.status === 'error' && /hr\.payroll/.test(s.message)).length >= 1)
      } finally {
        await close(anon)
      }
    })
  })
}

describe('without the event triggers (walcast role not a superuser)', () => {
  let env, server, db
  let nextId = 1
  before(async () => {
    env = await startEnv()
    db = env.db
    // What a DBA gives a non-superuser walcast: login, replication, the subscriber roles;
    // and its check login the roles checks run as (walcast may not grant them itself).
    await db.query(`CREATE ROLE walcast_app LOGIN REPLICATION PASSWORD 'app';
      CREATE ROLE anon NOLOGIN NOINHERIT; CREATE ROLE authenticated NOLOGIN NOINHERIT;
      CREATE ROLE service_role NOLOGIN NOINHERIT BYPASSRLS;
      GRANT anon, authenticated, service_role TO walcast_app;
      GRANT anon, authenticated TO walcast_check;
      GRANT CREATE ON DATABASE postgres TO walcast_app;
      CREATE SCHEMA walcast AUTHORIZATION walcast_app; CREATE SCHEMA auth AUTHORIZATION walcast_app;
      CREATE TABLE staff (id int8 PRIMARY KEY, name text, salary int4)`)
    const u = new URL(env.database_url)
    u.username = 'walcast_app'
    u.password = 'app'
    server = await startProcess({ ...env, database_url: u.toString() }, 'walcast', ['serve'], {})
    await enableTable(env, 'staff')
    await db.query('REVOKE ALL ON staff FROM anon; GRANT SELECT (id, name, salary) ON staff TO anon')
  })
  after(async () => {
    await server?.stop()
    await env?.stop()
  })

  test('a filter on a column revoked mid-stream no longer fires (every operator); told once', async () => {
    assert.equal((await server.health()).ddl_tracking, 'per_batch')
    await revokedMidStream({ server, db, newId: () => nextId++ })
  })
})
