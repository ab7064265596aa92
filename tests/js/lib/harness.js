// Test harness: a real Postgres + wal2json and nats-server from the Rust test kit
// (walcast-testenv), the real walcast binaries, the real @supabase/realtime-js client.
import { spawn } from 'node:child_process'
import { createHmac } from 'node:crypto'
import { once } from 'node:events'
import fs from 'node:fs/promises'
import net from 'node:net'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import pg from 'pg'
import WebSocket from 'ws'
import { RealtimeClient } from '@supabase/realtime-js'
import { serverLog } from './logs.js'

const here = path.dirname(fileURLToPath(import.meta.url))
export const root = path.resolve(here, '../../..')
const targetDir = process.env.CARGO_TARGET_DIR || path.join(root, 'target')
export const bin = (name) => path.join(targetDir, 'debug', name)

export const SECRET = 'walcast-js-test-secret-0123456789abcdef'

/**
 * `METRICS_API_KEY` of every process `startProcess` starts, unless its env sets one: a
 * process's `/metrics` and full `/health` are read with it (`proc.figures`).
 */
export const FIGURES_KEY = 'walcast-js-figures-key-0123456789abcdef'

const b64url = (buf) => Buffer.from(buf).toString('base64url')

/** An HS256 JWT, or with `alg` 'none' an unsigned one. */
export function jwt(claims, { secret = SECRET, alg = 'HS256' } = {}) {
  const now = Math.floor(Date.now() / 1000)
  const body = { iat: now, exp: now + 3600, role: 'anon', ...claims }
  const head = b64url(JSON.stringify({ alg, typ: 'JWT' }))
  const payload = b64url(JSON.stringify(body))
  if (alg === 'none') return `${head}.${payload}.`
  const sig = createHmac('sha256', secret).update(`${head}.${payload}`).digest()
  return `${head}.${payload}.${b64url(sig)}`
}

/** Resolve when `pred()` is true; fail with `what` after `ms`. */
export async function until(what, pred, ms = 20000) {
  const deadline = Date.now() + ms
  for (;;) {
    if (await pred()) return
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 10))
  }
}

// Ports for the servers a test starts come from below the kernel's ephemeral range (where
// outgoing connections take theirs), walked from an offset of this process's id, so a
// client socket cannot take a port between this answer and the server's bind.
const PORT_LOW = 20000
let portsHanded = 0

export async function freePort() {
  const ephemeral = Number((await readFileOr('/proc/sys/net/ipv4/ip_local_port_range', '32768')).split(/\s+/)[0])
  const span = Math.max(ephemeral, PORT_LOW + 1000) - PORT_LOW
  const offset = (process.pid * 7919) % span
  for (let i = 0; i < 4096; i++) {
    const port = PORT_LOW + ((offset + portsHanded++) % span)
    if (await canListen(port)) return port
  }
  const srv = net.createServer()
  srv.listen(0, '127.0.0.1')
  await once(srv, 'listening')
  const { port } = srv.address()
  srv.close()
  return port
}

async function canListen(port) {
  const srv = net.createServer()
  const ok = await new Promise((resolve) => {
    srv.once('error', () => resolve(false))
    srv.listen(port, '127.0.0.1', () => resolve(true))
  })
  if (ok) await new Promise((r) => srv.close(r))
  return ok
}

async function readFileOr(file, fallback) {
  try {
    return await fs.readFile(file, 'utf8')
  } catch {
    return fallback
  }
}

/**
 * Start the throwaway services. `natsMaxPayload` lowers nats-server's max_payload (bytes).
 * `fakeKube` also serves the test kit's fake Kubernetes API server (Leases only) at
 * `env.kube_api_url`, for cdc-workers with `LEASE_MODE=kubernetes`.
 * `env.command('restart-postgres' | 'restart-nats')` restarts one (Postgres: immediate
 * shutdown, i.e. a crash restart); `env.db` is then reconnected.
 */
export async function startEnv({ natsMaxPayload, fakeKube = false, extraPostgres = 0 } = {}) {
  const extra = natsMaxPayload ? { WALCAST_TESTENV_NATS_MAX_PAYLOAD: String(natsMaxPayload) } : {}
  if (fakeKube) extra.WALCAST_TESTENV_FAKE_KUBE = '1'
  if (extraPostgres) extra.WALCAST_TESTENV_EXTRA_POSTGRES = String(extraPostgres)
  const child = spawn(bin('walcast-testenv'), [], { stdio: ['pipe', 'pipe', 'inherit'], env: { ...process.env, ...extra } })
  let buf = ''
  const lines = []
  const waiters = []
  child.stdout.on('data', (d) => {
    buf += d
    for (let i = buf.indexOf('\n'); i >= 0; i = buf.indexOf('\n')) {
      const line = buf.slice(0, i)
      buf = buf.slice(i + 1)
      if (waiters.length) waiters.shift()(line)
      else lines.push(line)
    }
  })
  const nextLine = (what, ms = 60000) =>
    new Promise((resolve, reject) => {
      if (lines.length) return resolve(lines.shift())
      const t = setTimeout(() => reject(new Error(`walcast-testenv: no answer to ${what} within ${ms} ms`)), ms)
      waiters.push((l) => {
        clearTimeout(t)
        resolve(l)
      })
    })
  const exited = new Promise((resolve, reject) =>
    child.on('exit', (code) => reject(new Error(`walcast-testenv exited ${code} (is Postgres with wal2json and nats-server installed? run ./dev/test)`))),
  )
  exited.catch(() => {})
  const line = await Promise.race([nextLine('start'), exited])
  const env = JSON.parse(line)
  const connect = async () => {
    const c = new pg.Client({ connectionString: env.database_url })
    c.on('error', () => {})
    await c.connect()
    return c
  }
  const db = await connect()
  return {
    ...env,
    db,
    async command(cmd) {
      child.stdin.write(cmd + '\n')
      const answer = await nextLine(cmd)
      if (answer !== 'ok') throw new Error(`walcast-testenv ${cmd}: ${answer}`)
      if (cmd === 'restart-postgres') {
        await this.db.end().catch(() => {})
        this.db = await connect()
      }
    },
    async stop() {
      await this.db.end().catch(() => {})
      child.stdin.end()
      await once(child, 'exit')
    },
  }
}

/**
 * Start a walcast binary (`walcast serve`, `cdc-worker`, `ws-front`) and wait for /health
 * (with `cdc_active` not false, unless `standby`: a cdc-worker that may not lead).
 */
export async function startProcess(env, name, args, extraEnv = {}, { standby = false } = {}) {
  const port = await freePort()
  // The key this process's figures are read with: its METRICS_API_KEY, else its
  // MANAGEMENT_API_KEY (empty ones are unset).
  const figuresKey = [extraEnv.METRICS_API_KEY ?? FIGURES_KEY, extraEnv.MANAGEMENT_API_KEY].find((k) => k)
  const child = spawn(bin(name), args, {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: {
      PATH: process.env.PATH,
      DATABASE_URL: env.database_url,
      CHECK_DATABASE_URL: env.check_database_url,
      SECRETS_KEY: env.secrets_key,
      JWT_SECRET: SECRET,
      PORT: String(port),
      HOST: '127.0.0.1',
      CDC_POLL_IDLE_MS: '20',
      ...(process.env.WALCAST_TEST_LOG_LEVEL ? { LOG_LEVEL: process.env.WALCAST_TEST_LOG_LEVEL } : {}),
      LOG_FORMAT: 'json',
      METRICS_API_KEY: FIGURES_KEY,
      ...extraEnv,
    },
  })
  const log = serverLog(name, child)
  const proc = {
    port,
    child,
    log: () => log.text(),
    url: `http://127.0.0.1:${port}`,
    /** fetch options that present the operator's figures key (`/metrics`, the full `/health`). */
    figures: { headers: figuresKey ? { authorization: `Bearer ${figuresKey}` } : {} },
    async health() {
      const r = await fetch(`http://127.0.0.1:${port}/health`, this.figures)
      return r.json()
    },
    async stop() {
      if (child.exitCode !== null || child.signalCode !== null) return
      child.kill('SIGTERM')
      await once(child, 'exit')
    },
  }
  await until(`${name} healthy`, async () => {
    if (child.exitCode !== null) throw new Error(`${name} exited ${child.exitCode}:\n${log.text()}`)
    try {
      const h = await proc.health()
      return standby || h.cdc_active !== false
    } catch {
      return false
    }
  }, 60000)
  return proc
}

/** A realtime-js client for a server, vsn 2.0.0 unless given. */
export function client(server, { apikey = jwt({}), vsn, accessToken, ...opts } = {}) {
  const params = { apikey }
  const o = { params, transport: WebSocket, heartbeatIntervalMs: 25000, ...opts }
  if (vsn) o.vsn = vsn
  if (accessToken) o.accessToken = accessToken
  return new RealtimeClient(`ws://127.0.0.1:${server.port}/realtime/v1`, o)
}

/** Subscribe a channel and resolve with its first terminal status. */
export function subscribe(channel, ms = 15000) {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error('no subscribe status within ' + ms + ' ms')), ms)
    channel.subscribe((status, err) => {
      if (status === 'SUBSCRIBED' || status === 'CHANNEL_ERROR' || status === 'TIMED_OUT' || status === 'CLOSED') {
        clearTimeout(t)
        resolve({ status, err })
      }
    })
  })
}

// ---------------------------------------------------------------------------
// Helpers shared by the protocol acceptance tests.

/** Both protocol versions realtime-js speaks; 2.0.0 is its default. */
export const VSNS = ['2.0.0', '1.0.0']

/** Enable realtime on a table the way `walcast realtime enable` does (the table needs a PK). */
export async function enableTable(env, table, schema = 'public') {
  await env.db.query('INSERT INTO walcast.realtime_tables (schema_name, table_name) VALUES ($1, $2)', [schema, table])
  // As a Supabase project's default privileges do: the subscribers' roles may read it.
  await env.db.query(`GRANT SELECT ON "${schema}"."${table}" TO anon, authenticated, service_role`)
  await env.db.query(`ALTER TABLE "${schema}"."${table}" REPLICA IDENTITY FULL`)
}

/**
 * Start the throwaway services, run `setupSql` (table creation), start `walcast serve`
 * with `serverEnv`, then enable `tables`. Returns `{ env, server, stop }`.
 */
export async function startStack({ setupSql = [], tables = [], serverEnv = {} } = {}) {
  const env = await startEnv()
  let server
  try {
    for (const q of setupSql) await env.db.query(q)
    server = await startProcess(env, 'walcast', ['serve'], serverEnv)
    for (const t of tables) await enableTable(env, t)
  } catch (e) {
    await server?.stop()
    await env.stop()
    throw e
  }
  return {
    env,
    server,
    async stop() {
      await server?.stop()
      await env.stop()
    },
  }
}

/**
 * A callback that records what it receives. `cb.items` is the list; `cb.wait(n, what)`
 * resolves once `n` items arrived (bounded, with a clear message).
 */
export function collector(name = 'callback') {
  const items = []
  const cb = (x) => {
    items.push(x)
  }
  cb.items = items
  cb.wait = (n, what = `${n} item(s) on ${name}`, ms = 10000) =>
    until(`${what} (got ${items.length}: ${JSON.stringify(items).slice(0, 600)})`, () => items.length >= n, ms)
  return cb
}

/**
 * Subscribe and record every status the channel reports (`statuses`, in order).
 * `first` resolves with the first status, bounded by `ms`.
 */
export function subscribeTracked(channel, ms = 15000) {
  const statuses = []
  let resolveFirst
  const first = new Promise((resolve, reject) => {
    resolveFirst = resolve
    setTimeout(() => reject(new Error(`no subscribe status within ${ms} ms on ${channel.topic}`)), ms).unref()
  })
  channel.subscribe((status, err) => {
    statuses.push({ status, err })
    resolveFirst({ status, err })
  })
  return { first, statuses }
}

/** Subscribe and assert that the channel reports SUBSCRIBED. */
export async function subscribed(channel, ms = 15000) {
  const { status, err } = await subscribe(channel, ms)
  if (status !== 'SUBSCRIBED') {
    throw new Error(`${channel.topic}: expected SUBSCRIBED, got ${status}${err ? `: ${err.message}` : ''}`)
  }
  return channel
}

/** A Prometheus metric of a process (`startProcess`'s), summed over its labels; 0 when absent. */
export async function metric(proc, name) {
  const text = await (await fetch(`${proc.url}/metrics`, proc.figures)).text()
  let sum = 0
  for (const m of text.matchAll(new RegExp(`^${name}(\\{[^}]*\\})? (\\S+)`, 'gm'))) sum += Number(m[2])
  return sum
}

/**
 * Keep the CPU busy beside a test: one child process per core (`cores`, default every
 * core) spinning until `stop()` or, at the latest, for `ms`. Races that need a busy
 * machine show up then, not only on CI runners that happen to be loaded.
 */
export function busyLoops({ cores = os.availableParallelism(), ms = 300000 } = {}) {
  const spin = `const end = Date.now() + ${Number(ms)}; while (Date.now() < end) {}`
  const children = Array.from({ length: cores }, () => spawn(process.execPath, ['-e', spin], { stdio: 'ignore' }))
  return {
    cores,
    async stop() {
      await Promise.all(
        children.map(async (c) => {
          if (c.exitCode !== null || c.signalCode !== null) return
          const exited = once(c, 'exit')
          c.kill('SIGKILL')
          await exited
        }),
      )
    },
  }
}

/** A unique channel name per call, so tests never share topics by accident. */
let channelSeq = 0
export function uniq(prefix = 'ch') {
  channelSeq += 1
  return `${prefix}-${process.pid}-${channelSeq}`
}

/** ISO-8601 UTC with milliseconds and a `Z`, as `commit_timestamp` must be. */
export const ISO_Z = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$/
