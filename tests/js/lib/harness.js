// Test harness: a real Postgres + wal2json and nats-server from the Rust test kit
// (walcast-testenv), the real walcast binaries, the real @supabase/realtime-js client.
import { spawn } from 'node:child_process'
import { createHmac } from 'node:crypto'
import { once } from 'node:events'
import net from 'node:net'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import pg from 'pg'
import WebSocket from 'ws'
import { RealtimeClient } from '@supabase/realtime-js'

const here = path.dirname(fileURLToPath(import.meta.url))
export const root = path.resolve(here, '../../..')
const targetDir = process.env.CARGO_TARGET_DIR || path.join(root, 'target')
export const bin = (name) => path.join(targetDir, 'debug', name)

export const SECRET = 'walcast-js-test-secret-0123456789abcdef'

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

async function freePort() {
  const srv = net.createServer()
  srv.listen(0, '127.0.0.1')
  await once(srv, 'listening')
  const { port } = srv.address()
  srv.close()
  return port
}

/** Start the throwaway services. */
export async function startEnv() {
  const child = spawn(bin('walcast-testenv'), [], { stdio: ['pipe', 'pipe', 'inherit'] })
  let buf = ''
  const line = await new Promise((resolve, reject) => {
    child.stdout.on('data', (d) => {
      buf += d
      const i = buf.indexOf('\n')
      if (i >= 0) resolve(buf.slice(0, i))
    })
    child.on('exit', (code) => reject(new Error(`walcast-testenv exited ${code} (is Postgres with wal2json and nats-server installed? run ./dev/test)`)))
  })
  const env = JSON.parse(line)
  const db = new pg.Client({ connectionString: env.database_url })
  await db.connect()
  return {
    ...env,
    db,
    async stop() {
      await db.end().catch(() => {})
      child.stdin.end()
      await once(child, 'exit')
    },
  }
}

/** Start a walcast binary (`walcast serve`, `cdc-worker`, `ws-front`) and wait for /health. */
export async function startProcess(env, name, args, extraEnv = {}) {
  const port = await freePort()
  const child = spawn(bin(name), args, {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: {
      PATH: process.env.PATH,
      DATABASE_URL: env.database_url,
      JWT_SECRET: SECRET,
      PORT: String(port),
      HOST: '127.0.0.1',
      CDC_POLL_IDLE_MS: '20',
      LOG_FORMAT: 'json',
      ...extraEnv,
    },
  })
  let log = ''
  child.stdout.on('data', (d) => (log += d))
  child.stderr.on('data', (d) => (log += d))
  const proc = {
    port,
    child,
    log: () => log,
    url: `http://127.0.0.1:${port}`,
    async health() {
      const r = await fetch(`http://127.0.0.1:${port}/health`)
      return r.json()
    },
    async stop() {
      if (child.exitCode !== null) return
      child.kill('SIGTERM')
      await once(child, 'exit')
    },
  }
  await until(`${name} healthy`, async () => {
    if (child.exitCode !== null) throw new Error(`${name} exited ${child.exitCode}:\n${log}`)
    try {
      const h = await proc.health()
      return h.cdc_active !== false
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
