// Each kind of row-level-security policy judges a version as a SELECT of that very version
// would, through the unmodified client, against both CDC sources: a restrictive
// policy, a policy `TO authenticated` only (anon gets nothing, a member role of
// authenticated gets it), `FORCE ROW LEVEL SECURITY` with the table owner subscribed, a
// table owner without FORCE (sees every version), a policy over the whole row. Each
// subscriber is a client with its own JWT; two or three versions of a row are written per
// transaction, each SELECTed as every subscriber right after it is written, inside the
// transaction. Each subscriber receives exactly the versions its SELECT returned, with that
// content, in order, and the closing DELETE only if its SELECT returned the row deleted,
// with that content.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startStack, client, collector, subscribed, until, jwt, metric } from './lib/harness.js'

const TABLES = ['restr', 'authonly', 'forced', 'owned', 'whole']
/** Per table: [subscriber, role, sub]. */
const AUDIENCE = {
  restr: [['u1', 'authenticated', 'u1'], ['u2', 'authenticated', 'u2']],
  authonly: [['u1', 'authenticated', 'u1'], ['anon', 'anon', 'u1'], ['staff', 'staff', 'u1']],
  forced: [['owner', 'tbl_owner', 'u9'], ['u1', 'authenticated', 'u1']],
  owned: [['owner', 'tbl_owner', 'u9'], ['u1', 'authenticated', 'u1']],
  whole: [['u1', 'authenticated', 'u1']],
}
/** Per transaction: the versions it writes to every table, [row id, statement]. */
const VERSIONS = [
  [
    [1, "INSERT INTO {t} VALUES (1, 'u1', 1, false)"],
    [1, 'UPDATE {t} SET level = 7 WHERE id = 1'],
    [1, 'UPDATE {t} SET archived = true WHERE id = 1'],
  ],
  [
    [1, "UPDATE {t} SET archived = false, owner = 'u2', level = 0 WHERE id = 1"],
    [2, "INSERT INTO {t} VALUES (2, 'u2', 9, false)"],
  ],
  [
    [2, 'UPDATE {t} SET level = 3 WHERE id = 2'],
    [3, "INSERT INTO {t} VALUES (3, 'u1', 6, true)"],
    [3, "UPDATE {t} SET owner = 'u2' WHERE id = 3"],
  ],
]
const OWN = "owner = auth.jwt() ->> 'sub'"

/** Row `id` of `table` as SELECTed by `role` with `claims`, inside the open transaction. */
async function selectAs(db, role, claims, table, id) {
  await db.query('SAVEPOINT oracle')
  await db.query("SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true)", [role, JSON.stringify(claims)])
  const { rows } = await db.query(`SELECT row_to_json(t)::text AS r FROM ${table} t WHERE id = $1`, [id])
  // Also undoes the role and claims.
  await db.query('ROLLBACK TO SAVEPOINT oracle')
  return rows.length ? JSON.parse(rows[0].r) : undefined
}

for (const source of ['stream', 'poll']) {
  describe(`CDC_SOURCE=${source}`, () => {
    let st
    before(async () => {
      st = await startStack({
        setupSql: [
          ...TABLES.map((t) => `CREATE TABLE ${t} (id int PRIMARY KEY, owner text NOT NULL, level int NOT NULL, archived bool NOT NULL)`),
          'CREATE TABLE marker (id int PRIMARY KEY)',
          // Before the server starts, so that it lets its check login act as them.
          'CREATE ROLE tbl_owner NOLOGIN',
          'CREATE ROLE staff NOLOGIN',
        ],
        tables: [...TABLES, 'marker'],
        // `staff` (a member of authenticated) and `tbl_owner` act as themselves: allowed roles.
        serverEnv: { CDC_SOURCE: source, ALLOWED_ROLES: 'anon,authenticated,service_role,staff,tbl_owner' },
      })
      // After the server's migrations: the roles and auth.* helpers exist.
      await st.env.db.query(`GRANT authenticated TO staff;
        GRANT USAGE ON SCHEMA auth TO tbl_owner;
        GRANT SELECT ON marker TO tbl_owner;
        ALTER TABLE forced OWNER TO tbl_owner;
        ALTER TABLE owned OWNER TO tbl_owner;
        ALTER TABLE restr ENABLE ROW LEVEL SECURITY;
        CREATE POLICY mine_or_high ON restr FOR SELECT TO authenticated USING (${OWN} OR level >= 5);
        CREATE POLICY not_archived ON restr AS RESTRICTIVE FOR SELECT TO authenticated USING (NOT archived);
        ALTER TABLE authonly ENABLE ROW LEVEL SECURITY;
        CREATE POLICY high ON authonly FOR SELECT TO authenticated USING (level >= 5);
        ALTER TABLE forced ENABLE ROW LEVEL SECURITY;
        ALTER TABLE forced FORCE ROW LEVEL SECURITY;
        CREATE POLICY low ON forced FOR SELECT TO tbl_owner USING (level < 5);
        CREATE POLICY mine ON forced FOR ALL TO authenticated USING (${OWN});
        ALTER TABLE owned ENABLE ROW LEVEL SECURITY;
        CREATE POLICY high ON owned FOR SELECT USING (level >= 5);
        CREATE FUNCTION high_row(r whole) RETURNS bool LANGUAGE sql AS 'SELECT r.level >= 5';
        ALTER TABLE whole ENABLE ROW LEVEL SECURITY;
        CREATE POLICY high ON whole FOR SELECT TO authenticated USING (high_row(whole))`)
    })
    after(async () => {
      await st?.stop()
    })

    test('every subscriber receives exactly the versions a SELECT as it returned, in order', async () => {
      const db = st.env.db
      const subs = []
      try {
        for (const table of TABLES) {
          for (const [name, role, sub] of AUDIENCE[table]) {
            const rt = client(st.server, { apikey: jwt({ role, sub }) })
            const got = collector(`${table}/${name}`)
            // A table without RLS on the same channel: once its row arrives, so has
            // everything committed before it.
            const marked = collector(`${table}/${name} marker`)
            subs.push({ table, name, role, claims: { role, sub }, rt, got, marked, expected: [] })
            const marker = { event: 'INSERT', schema: 'public', table: 'marker' }
            const ch = rt.channel(`${table}-${name}`).on('postgres_changes', { event: '*', schema: 'public', table }, got)
            await subscribed(ch.on('postgres_changes', marker, marked))
          }
        }
        // Write, and right after each version, SELECT it as every subscriber of its table.
        for (const txn of VERSIONS) {
          await db.query('BEGIN')
          for (const table of TABLES) {
            for (const [id, step] of txn) {
              await db.query(step.replaceAll('{t}', table))
              for (const s of subs.filter((s) => s.table === table)) {
                const row = await selectAs(db, s.role, s.claims, table, id)
                if (row) s.expected.push([step.split(' ')[0], row])
              }
            }
          }
          await db.query('COMMIT')
        }
        // A DELETE is judged as a SELECT of the row it deleted, right before.
        await db.query('BEGIN')
        for (const table of TABLES) {
          for (const s of subs.filter((s) => s.table === table)) {
            const row = await selectAs(db, s.role, s.claims, table, 3)
            if (row) s.expected.push(['DELETE', row])
          }
          await db.query(`DELETE FROM ${table} WHERE id = 3`)
        }
        await db.query('COMMIT')
        await db.query('INSERT INTO marker VALUES (1)')
        const summary = (p) => [p.eventType, p.eventType === 'DELETE' ? p.old : p.new]
        for (const s of subs) {
          await until(`${s.table}/${s.name}: the marker`, () => s.marked.items.length > 0, 60000)
          assert.deepEqual(
            s.got.items.map(summary),
            s.expected,
            `${s.table}/${s.name}: deliveries differ from a SELECT of each version`,
          )
        }
        // The oracle is not vacuous: each kind lets some versions through and holds some back.
        const count = (table, name) => subs.find((s) => s.table === table && s.name === name).expected.length
        const n = VERSIONS.flat().length
        // (The last row, DELETEd: archived, at level 6, u2's.)
        assert.deepEqual([count('restr', 'u1'), count('restr', 'u2')], [3, 4])
        assert.equal(count('authonly', 'anon'), 0, 'no policy for anon')
        assert.equal(count('authonly', 'u1'), 6)
        assert.equal(count('authonly', 'staff'), 6, 'a member of authenticated')
        // FORCE: the owner is held to its policy (level < 5); without it, sees every version.
        assert.deepEqual([count('forced', 'owner'), count('forced', 'u1')], [3, 4])
        assert.deepEqual([count('owned', 'owner'), count('owned', 'u1')], [n + 1, 6])
        assert.equal(count('whole', 'u1'), 6, 'a policy on the whole row')
        // Every version carried every column its policy reads: none judged by its row.
        assert.equal(await metric(st.server, 'walcast_cdc_rls_current_row_total'), 0)
        assert.equal(await metric(st.server, 'walcast_cdc_rls_superseded_total'), 0)
      } finally {
        await Promise.all(subs.map(async (s) => (await s.rt.removeAllChannels(), await s.rt.disconnect())))
      }
    })
  })
}
