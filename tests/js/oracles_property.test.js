// Property: no subscriber receives anything, or any filter outcome, about a version of a row
// it could not SELECT. Randomized and reproducible (`ORACLE_SEED`; the seed is printed),
// through the unmodified client against both CDC sources: random policies (permissive and
// restrictive, per role, created and dropped mid-stream), random column grants and revokes,
// RLS switched on and off, random INSERT/UPDATE/DELETE, subscribers of several roles and
// claims with random filters (every operator, several columns) and events.
//
// The truth is Postgres's own: around each statement, each subscriber's SELECT of the row
// (as its role, with its claims, of the columns its role may read) before (the old version)
// and after (the new one). Each binding must receive exactly, in order:
// - an INSERT or UPDATE whose new version its SELECT returned and its filter matches (on
//   the version's values, every column its filter reads readable), with those values;
//   an UPDATE's `old_record` is what its SELECT returned of the old version, or empty;
// - a DELETE whose deleted version its SELECT returned and its filter matches, with those
//   values;
// and nothing else. Statements that change privileges or policies wait until everything
// before them is delivered (a check is then never at a catalog ahead of its change). About
// 15 s per source on a loaded 2-core machine; `ORACLE_STEPS` makes a run longer.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, enableTable, client, collector, subscribed, until, jwt } from './lib/harness.js'

const SEED = Number(process.env.ORACLE_SEED ?? 17)
const STEPS = Number(process.env.ORACLE_STEPS ?? 300)
const TABLES = ['p', 'q']
const COLUMNS = ['id', 'owner', 'grp', 'lvl', 'body', 'secret']
/** Columns a step may revoke or grant (`id` stays readable, to name rows in messages). */
const GRANTABLE = ['owner', 'grp', 'lvl', 'body', 'secret']
const OWNERS = ['u1', 'u2', 'u3', 'zz']
const BODIES = ['pub-a', 'pub-b', 'priv-a', 'Priv-b']
const SUBSCRIBERS = [
  ['anon', { role: 'anon' }],
  ['u1', { role: 'authenticated', sub: 'u1' }],
  ['u2', { role: 'authenticated', sub: 'u2' }],
  ['u3', { role: 'authenticated', sub: 'u3' }],
  ['svc', { role: 'service_role' }],
]
const FILTERS = [
  'owner=eq.u1',
  'owner=neq.u2',
  'owner=in.(u1,u3)',
  'lvl=gt.4',
  'lvl=lte.3',
  'lvl=eq.7',
  'lvl=gte.5,owner=eq.u2',
  'grp=is.null',
  'grp=not.is.null',
  'grp=eq.2',
  'body=like.pub*',
  'body=ilike.PRIV%',
  'body=lt.priv',
  'secret=eq.s1',
  'secret=neq.s1',
]
const POLICIES = [
  "owner = auth.jwt() ->> 'sub'",
  'lvl >= 5',
  "owner = auth.jwt() ->> 'sub' OR grp = 1",
  "body LIKE 'pub%'",
  'secret = \'s2\'',
]
const RESTRICTIVE = ['lvl < 9', "body <> 'Priv-b'", 'grp IS DISTINCT FROM 3']

/** A seeded PRNG (mulberry32). */
function random(seed) {
  let a = seed >>> 0
  const next = () => {
    a = (a + 0x6d2b79f5) >>> 0
    let t = Math.imul(a ^ (a >>> 15), a | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
  const int = (lo, hi) => lo + Math.floor(next() * (hi - lo + 1))
  return { int, chance: (p) => next() < p, pick: (xs) => xs[int(0, xs.length - 1)] }
}

/** One condition of a filter on a row's values, as walcast evaluates it (SQL NULL: no match). */
function holds(cond, row) {
  const [column, rest] = cond.split(/=(.*)/s)
  const negated = rest.startsWith('not.')
  const [op, operand] = (negated ? rest.slice(4) : rest).split(/\.(.*)/s)
  const v = row[column]
  if (op === 'is') return negated ? v !== null : v === null
  if (v === null || v === undefined) return false
  const num = typeof v === 'number'
  const cast = (x) => (num ? Number(x) : x)
  const like = (p, flags) => new RegExp(`^${p.replace(/[.+?^${}()|[\]\\]/g, '\\$&').replace(/[*%]/g, '.*').replace(/_/g, '.')}$`, flags).test(String(v))
  const r = {
    eq: () => v === cast(operand),
    neq: () => v !== cast(operand),
    lt: () => v < cast(operand),
    lte: () => v <= cast(operand),
    gt: () => v > cast(operand),
    gte: () => v >= cast(operand),
    in: () => operand.slice(1, -1).split(',').map(cast).includes(v),
    like: () => like(operand, ''),
    ilike: () => like(operand, 'i'),
  }[op]()
  return negated ? !r : r
}
/** A filter's conditions (a comma inside `(…)` does not split). */
const conditions = (filter) => (filter ? filter.split(/,(?![^(]*\))/) : [])
const matches = (filter, row) => conditions(filter).every((c) => holds(c, row))
const filterColumns = (filter) => conditions(filter).map((c) => c.split('=')[0])

for (const [source, seed] of [['stream', SEED], ['poll', SEED + 1]]) {
  describe(`CDC_SOURCE=${source}`, () => {
    let env, server, db
    before(async () => {
      env = await startEnv()
      db = env.db
      for (const t of TABLES) {
        await db.query(`CREATE TABLE ${t} (id int PRIMARY KEY, owner text NOT NULL, grp int, lvl int NOT NULL, body text NOT NULL, secret text NOT NULL)`)
      }
      await db.query('CREATE TABLE done (id int PRIMARY KEY)')
      server = await startProcess(env, 'walcast', ['serve'], {
        CDC_SOURCE: source,
        CDC_SLOT_NAME: `walcast_js_prop_${source}`,
        REALTIME_MAX_LAG_MS: '600000',
      })
      for (const t of [...TABLES, 'done']) await enableTable(env, t)
      await db.query(`REVOKE ALL ON p, q FROM anon, authenticated;
        GRANT SELECT (${COLUMNS}) ON p, q TO anon, authenticated;
        ALTER TABLE p ENABLE ROW LEVEL SECURITY`)
    })
    after(async () => {
      await server?.stop()
      await env?.stop()
    })

    test(`seed ${seed}: nothing about a version a subscriber could not SELECT`, async (t) => {
      const rng = random(seed)
      const log = [] // the statements, for a failure's message
      const clients = []
      const bindings = [] // { who, claims, table, event, filter, got }
      const markers = []
      try {
        // Policies to start with: some per role on p (q has RLS off until a step turns it on).
        const policies = new Map() // name → { table }
        let nextPolicy = 0
        const createPolicy = async (table) => {
          const name = `pol${nextPolicy++}`
          const role = rng.pick(['anon', 'authenticated', 'PUBLIC'])
          const restrictive = rng.chance(0.25)
          const using = restrictive ? rng.pick(RESTRICTIVE) : rng.pick(POLICIES)
          const sql = `CREATE POLICY ${name} ON ${table} AS ${restrictive ? 'RESTRICTIVE' : 'PERMISSIVE'} FOR SELECT TO ${role} USING (${using})`
          await db.query(sql)
          log.push(sql)
          policies.set(name, { table })
        }
        for (let i = 0; i < 3; i++) await createPolicy('p')
        for (let i = 0; i < 2; i++) await createPolicy('q')

        // Subscribers: an unfiltered binding per table and event kind, random filtered ones.
        for (const [who, claims] of SUBSCRIBERS) {
          const rt = client(server, { apikey: jwt(claims) })
          clients.push(rt)
          const marked = collector(`${who} marker`)
          const system = collector(`${who} system`)
          markers.push([who, marked, system])
          const done = { event: 'INSERT', schema: 'public', table: 'done' }
          let ch = rt.channel(`prop-${who}`).on('system', {}, system).on('postgres_changes', done, marked)
          for (const table of TABLES) {
            // Distinct bindings (realtime-js gives two identical ones on a channel one id).
            const specs = [{ event: '*' }]
            while (specs.length < 5) {
              const spec = { event: rng.pick(['*', 'INSERT', 'UPDATE', 'DELETE']), filter: rng.pick(FILTERS) }
              if (!specs.some((x) => x.event === spec.event && x.filter === spec.filter)) specs.push(spec)
            }
            for (const spec of specs) {
              const got = collector(`${who} ${table} ${spec.event} ${spec.filter ?? ''}`)
              bindings.push({ who, claims, table, ...spec, got, expected: [] })
              ch = ch.on('postgres_changes', { schema: 'public', table, ...spec }, got)
            }
          }
          await subscribed(ch)
        }

        // What a role may read of a table (cached until a grant changes).
        const readable = new Map()
        const columnsOf = async (role, table) => {
          const k = `${role}/${table}`
          if (!readable.has(k)) {
            const { rows } = await db.query(
              `SELECT attname::text AS c FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped
                 AND has_column_privilege($2, attrelid, attnum, 'SELECT') ORDER BY attnum`,
              [table, role],
            )
            readable.set(k, rows.map((r) => r.c))
          }
          return readable.get(k)
        }
        /** Row `id` as `claims` would SELECT it (its readable columns), or undefined. */
        const selectAs = async (claims, table, id) => {
          const cols = await columnsOf(claims.role, table)
          await db.query('BEGIN')
          try {
            await db.query("SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true)", [claims.role, JSON.stringify(claims)])
            const fields = cols.map((c) => `'${c}', ${c}`).join(', ')
            const { rows } = await db.query(`SELECT json_build_object(${fields})::text AS r FROM ${table} WHERE id = $1`, [id])
            return rows.length ? JSON.parse(rows[0].r) : undefined
          } finally {
            await db.query('ROLLBACK')
          }
        }
        const full = async (table, id) => {
          const { rows } = await db.query(`SELECT row_to_json(t)::text AS r FROM ${table} t WHERE id = $1`, [id])
          return rows.length ? JSON.parse(rows[0].r) : undefined
        }
        /** Each subscriber's view of a row, and the row itself. */
        const views = async (table, id) => {
          const seen = new Map()
          for (const [who, claims] of SUBSCRIBERS) seen.set(who, await selectAs(claims, table, id))
          return { seen, row: await full(table, id) }
        }

        let marker = 0
        const barrier = async () => {
          marker += 1
          await db.query('INSERT INTO done VALUES ($1)', [marker])
          for (const [who, marked] of markers) await until(`${who}: marker ${marker}`, () => marked.items.length >= marker, 60000)
        }

        const ids = { p: new Set(), q: new Set() }
        let nextId = 1
        const value = () => ({
          owner: rng.pick(OWNERS),
          grp: rng.chance(0.3) ? null : rng.int(1, 3),
          lvl: rng.int(0, 9),
          body: rng.pick(BODIES),
          secret: rng.pick(['s1', 's2']),
        })
        const counts = { dml: 0, ddl: 0, expected: 0 }
        for (let step = 0; step < STEPS; step++) {
          if (rng.chance(0.12)) {
            // A statement on privileges or policies, once everything before it is delivered.
            await barrier()
            const table = rng.pick(TABLES)
            const kind = rng.int(0, 3)
            let sql
            if (kind === 0) {
              const [column, role] = [rng.pick(GRANTABLE), rng.pick(['anon', 'authenticated'])]
              sql = rng.chance(0.5) ? `REVOKE SELECT (${column}) ON ${table} FROM ${role}` : `GRANT SELECT (${column}) ON ${table} TO ${role}`
              readable.clear()
            } else if (kind === 1 && policies.size > 0) {
              const name = rng.pick([...policies.keys()])
              sql = `DROP POLICY ${name} ON ${policies.get(name).table}`
              policies.delete(name)
            } else if (kind === 2 && table === 'q') {
              sql = `ALTER TABLE q ${rng.chance(0.5) ? 'ENABLE' : 'DISABLE'} ROW LEVEL SECURITY`
            }
            if (sql) {
              await db.query(sql)
              log.push(sql)
            } else {
              await createPolicy(table)
            }
            counts.ddl += 1
            continue
          }
          const table = rng.pick(TABLES)
          const existing = [...ids[table]]
          const op = existing.length === 0 || (existing.length < 12 && rng.chance(0.4)) ? 'INSERT' : rng.chance(0.7) ? 'UPDATE' : 'DELETE'
          const id = op === 'INSERT' ? nextId++ : rng.pick(existing)
          const before = op === 'INSERT' ? undefined : await views(table, id)
          const v = value()
          let sql
          if (op === 'INSERT') {
            sql = `INSERT INTO ${table} VALUES (${id}, '${v.owner}', ${v.grp}, ${v.lvl}, '${v.body}', '${v.secret}')`
            ids[table].add(id)
          } else if (op === 'UPDATE') {
            const set = Object.entries(v).filter(() => rng.chance(0.5))
            if (set.length === 0) set.push(['lvl', v.lvl])
            sql = `UPDATE ${table} SET ${set.map(([c, x]) => `${c} = ${typeof x === 'string' ? `'${x}'` : x}`).join(', ')} WHERE id = ${id}`
          } else {
            sql = `DELETE FROM ${table} WHERE id = ${id}`
            ids[table].delete(id)
          }
          // Values are the test's own (ints and fixed strings).
          await db.query(sql)
          log.push(sql)
          counts.dml += 1
          const after = op === 'DELETE' ? undefined : await views(table, id)
          // What each binding of the table must receive.
          for (const b of bindings.filter((b) => b.table === table && (b.event === '*' || b.event === op))) {
            const version = op === 'DELETE' ? before : after
            const seen = version.seen.get(b.who)
            if (!seen) continue
            const cols = await columnsOf(b.claims.role, table)
            if (!filterColumns(b.filter).every((c) => cols.includes(c))) continue
            if (!matches(b.filter, version.row)) continue
            const old = op === 'UPDATE' ? (before.seen.get(b.who) ?? {}) : op === 'DELETE' ? seen : {}
            b.expected.push([op, op === 'DELETE' ? {} : seen, old])
            counts.expected += 1
          }
        }
        await barrier()

        const summary = (p) => [p.eventType, p.new, p.old]
        for (const b of bindings) {
          const name = `${b.who} on ${b.table} (${b.event}${b.filter ? `, ${b.filter}` : ''})`
          const system = markers.find(([who]) => who === b.who)[2].items.map((m) => m.message)
          assert.deepEqual(
            b.got.items.map(summary),
            b.expected,
            `seed ${seed}: ${name} received other than what its SELECTs allow; its channel was told ${JSON.stringify(system)}; statements:\n${log.join(';\n')}`,
          )
        }
        assert.ok(counts.expected > 100, `only ${counts.expected} deliveries expected: too thin`)
        t.diagnostic(`seed ${seed}: ${counts.dml} row changes, ${counts.ddl} grant/policy/RLS statements, ${bindings.length} bindings, ${counts.expected} deliveries`)
      } finally {
        await Promise.all(clients.map(async (rt) => (await rt.removeAllChannels(), rt.disconnect())))
      }
    })
  })
}
