// Helpers of the fault-isolation tests: projects made with `walcast project
// create`, rows written at a steady rate, INSERT→client latencies and their percentiles.
import { execFile } from 'node:child_process'
import { promisify } from 'node:util'
import pg from 'pg'
import { bin } from './harness.js'

const run = promisify(execFile)

/** `walcast project create --name <name>`: `{ id, schema, jwt_secret, anon_key, service_role_key }`. */
export async function createProject(env, name) {
  const { stdout } = await run(bin('walcast'), ['project', 'create', '--name', name], {
    env: { PATH: process.env.PATH, DATABASE_URL: env.database_url, SECRETS_KEY: env.secrets_key },
  })
  return JSON.parse(stdout)
}

/** A new connection to the test database (each writer has its own). */
export async function connect(env) {
  const c = new pg.Client({ connectionString: env.database_url })
  c.on('error', () => {})
  await c.connect()
  return c
}

/** `PUT …/realtime {"enabled": true}` (or `enabled`) on a front: `{ status, body, ms }`. */
export async function enableViaRest(server, project, table, serviceKey, enabled = true) {
  const started = Date.now()
  const r = await fetch(`${server.url}/v1/db/${project}/schema/tables/${table}/realtime`, {
    method: 'PUT',
    headers: { apikey: serviceKey, 'content-type': 'application/json' },
    body: JSON.stringify({ enabled }),
  })
  return { status: r.status, body: await r.text(), ms: Date.now() - started }
}

/**
 * Insert rows `first, first + 1, …` with `sql` (parameters: id, the ms it was sent) at
 * `rate` per second until `n` rows are written or `stop()` is called. Returns
 * `{ done, stop }`: `done` resolves with the ids written. The schedule is absolute (a late
 * tick is caught up at once), so a slow machine cannot lower the rate unnoticed.
 */
export function writePaced(db, sql, { first, n = Infinity, rate }) {
  let stopped = false
  const done = (async () => {
    const ids = []
    const start = Date.now()
    for (let i = 0; i < n && !stopped; i++) {
      const due = start + (i * 1000) / rate
      const wait = due - Date.now()
      if (wait > 0) await new Promise((r) => setTimeout(r, wait))
      if (stopped) break
      await db.query(sql, [first + i, Date.now()])
      ids.push(first + i)
    }
    return ids
  })()
  return {
    done,
    stop() {
      stopped = true
    },
  }
}

/**
 * A `postgres_changes` callback recording each row's INSERT→client latency by id (the row's
 * `at` is the ms its INSERT was sent), and a `system` callback recording errors.
 */
export function latencyRecorder() {
  const rows = new Map()
  const errors = []
  return {
    rows,
    errors,
    onChange: (p) => {
      const id = Number(p.new.id)
      if (!rows.has(id)) rows.set(id, Date.now() - Number(p.new.at))
    },
    onSystem: (m) => {
      if (m.status === 'error') errors.push(m.message)
    },
    has: (ids) => ids.every((id) => rows.has(id)),
    missing: (ids) => ids.filter((id) => !rows.has(id)),
  }
}

/** `{ n, p50, p99, max }` in ms of the latencies of `ids` (rows never received excluded). */
export function stats(rec, ids) {
  const v = ids.filter((id) => rec.rows.has(id)).map((id) => rec.rows.get(id))
  v.sort((a, b) => a - b)
  const at = (p) => (v.length ? v[Math.min(v.length, Math.max(1, Math.ceil(v.length * p))) - 1] : NaN)
  return { n: v.length, p50: at(0.5), p99: at(0.99), max: v.length ? v[v.length - 1] : NaN }
}

/** Resolve once `pred()` holds or `ms` passed; whether it held. */
export async function waitFor(pred, ms) {
  const deadline = Date.now() + ms
  while (!pred()) {
    if (Date.now() > deadline) return false
    await new Promise((r) => setTimeout(r, 20))
  }
  return true
}
