// Several sources in one test: the extra Postgres instances of `startEnv({ extraPostgres })`
// made sources s1, s2, … each with a project p1, p2, … and a table `t` in its schema.
import { execFile } from 'node:child_process'
import { promisify } from 'node:util'
import pg from 'pg'
import { bin } from './harness.js'

const run = promisify(execFile)

/** `walcast <args>` against the control database; its stdout as JSON. */
export async function walcast(env, args) {
  const { stdout } = await run(bin('walcast'), args, {
    env: { PATH: process.env.PATH, DATABASE_URL: env.database_url, SECRETS_KEY: env.secrets_key },
  })
  return JSON.parse(stdout)
}

/** `walcast migrate` on the control database. */
export async function migrate(env) {
  await run(bin('walcast'), ['migrate'], {
    env: { PATH: process.env.PATH, DATABASE_URL: env.database_url, SECRETS_KEY: env.secrets_key },
  })
}

/** A pg client of `url` whose connection errors (a stopped instance) are ignored. */
export async function connectUrl(url) {
  const c = new pg.Client({ connectionString: url })
  c.on('error', () => {})
  await c.connect()
  return c
}

/**
 * Each extra Postgres instance as source `s<i>` with project `p<i>` and a table
 * `<schema>.t (id int8 PRIMARY KEY, v text)` readable by the API roles. Returns the
 * projects (`walcast project create`'s answer plus `source` and `db`, a client the caller
 * ends).
 */
export async function addSources(env) {
  const projects = []
  for (const [i, url] of env.extra_database_urls.entries()) {
    const name = `s${i + 1}`
    const check = env.extra_check_urls[i]
    await walcast(env, ['source', 'add', name, '--source-database-url', url, '--check-url', check])
    const p = await walcast(env, ['project', 'create', '--name', `p${i + 1}`, '--source', name])
    const db = await connectUrl(url)
    await db.query(`CREATE TABLE ${p.schema}.t (id int8 PRIMARY KEY, v text)`)
    await db.query(`GRANT SELECT ON ${p.schema}.t TO anon, authenticated, service_role`)
    projects.push({ ...p, source: name, db })
  }
  return projects
}

/** A cdc-worker sharing sources by Postgres leases of 3 s. */
export const WORKER_ENV = (env) => ({ NATS_URL: env.nats_url, LEASE_MODE: 'postgres', LEASE_DURATION_SECS: '3' })
