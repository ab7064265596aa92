// The example app's backend. walcast serves only realtime, so an app needs something that
// signs its users in and writes their rows; in a Supabase app those are Auth and PostgREST.
// Here one small server stands in for both: it serves the page, signs a user's token with
// the local stack's JWT secret (sign-in by name only: a demo, not an identity provider),
// and runs each write as that user under row-level security, the way PostgREST does.
//
// Settings come from the environment, else from the `.env` that ./dev/up writes:
// WALCAST_URL, ANON_KEY, SERVICE_ROLE_KEY, JWT_SECRET, DATABASE_URL; EXAMPLE_PORT (3000) and
// EXAMPLE_HOST (127.0.0.1) say where it listens.
import http from 'node:http'
import fs from 'node:fs'
import path from 'node:path'
import { createHash, createHmac, timingSafeEqual } from 'node:crypto'
import { fileURLToPath } from 'node:url'
import pg from 'pg'

const here = path.dirname(fileURLToPath(import.meta.url))
const repo = path.resolve(here, '..', '..')
const MAX_BODY = 4096
const TOKEN_SECS = 3600

/** The settings: the environment first, then the `.env` ./dev/up wrote (either place). */
function settings() {
  const fromFile = {}
  for (const file of [path.join(repo, '.env'), path.join(repo, '.walcast-dev', '.env')]) {
    const text = fs.existsSync(file) ? fs.readFileSync(file, 'utf8') : ''
    if (!text.startsWith('# written by ./dev/up')) continue
    for (const line of text.split('\n')) {
      const m = line.match(/^([A-Z_][A-Z0-9_]*)=(.*)$/)
      if (m && !(m[1] in fromFile)) fromFile[m[1]] = m[2]
    }
    break
  }
  const missing = []
  const get = (name, fallback) => {
    const value = process.env[name] || fromFile[name] || fallback
    if (!value) missing.push(name)
    return value
  }
  const s = {
    walcastUrl: get('WALCAST_URL'),
    anonKey: get('ANON_KEY'),
    serviceKey: get('SERVICE_ROLE_KEY'),
    jwtSecret: get('JWT_SECRET'),
    databaseUrl: get('DATABASE_URL'),
    port: Number(get('EXAMPLE_PORT', '3000')),
    host: get('EXAMPLE_HOST', '127.0.0.1'),
  }
  if (missing.length) {
    console.error(`missing settings (${missing.join(', ')}): start ./dev/up first, or set them in the environment`)
    process.exit(2)
  }
  return s
}

const b64url = (v) => Buffer.from(v).toString('base64url')

/** An HS256 token for a signed-in user, as Supabase Auth would give it. */
function signToken(secret, user) {
  const now = Math.floor(Date.now() / 1000)
  const claims = {
    sub: user.id, role: 'authenticated', aud: 'authenticated', iat: now, exp: now + TOKEN_SECS,
    user_metadata: { name: user.name },
  }
  const unsigned = `${b64url(JSON.stringify({ alg: 'HS256', typ: 'JWT' }))}.${b64url(JSON.stringify(claims))}`
  return `${unsigned}.${createHmac('sha256', secret).update(unsigned).digest('base64url')}`
}

/** The claims of a token this server signed and that has not expired, else null. */
function verifyToken(secret, token) {
  const parts = (token || '').split('.')
  if (parts.length !== 3) return null
  try {
    if (JSON.parse(Buffer.from(parts[0], 'base64url')).alg !== 'HS256') return null
    const want = createHmac('sha256', secret).update(`${parts[0]}.${parts[1]}`).digest()
    const got = Buffer.from(parts[2], 'base64url')
    if (got.length !== want.length || !timingSafeEqual(got, want)) return null
    const claims = JSON.parse(Buffer.from(parts[1], 'base64url'))
    if (claims.role !== 'authenticated' || !(claims.exp > Date.now() / 1000)) return null
    return claims
  } catch {
    return null
  }
}

/** A stable user id for a name (a UUID made from its hash): the same name, the same user. */
function userId(name) {
  const h = createHash('sha256').update(`example-user:${name}`).digest('hex')
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-4${h.slice(13, 16)}-8${h.slice(17, 20)}-${h.slice(20, 32)}`
}

/** Run `fn(client)` in a transaction as the token's user: its role and claims, bound. */
async function asUser(pool, claims, fn) {
  const c = await pool.connect()
  try {
    await c.query('BEGIN')
    await c.query(
      `SELECT set_config('role', 'authenticated', true), set_config('request.jwt.claims', $1, true),
              set_config('request.jwt.claim.sub', $2, true), set_config('request.jwt.claim.role', 'authenticated', true)`,
      [JSON.stringify(claims), claims.sub],
    )
    const result = await fn(c)
    await c.query('COMMIT')
    return result
  } catch (e) {
    await c.query('ROLLBACK').catch(() => {})
    throw e
  } finally {
    c.release()
  }
}

/** The body as JSON (at most MAX_BODY bytes), or throws a 4xx error. */
async function readJson(req) {
  let size = 0
  const chunks = []
  for await (const chunk of req) {
    size += chunk.length
    if (size > MAX_BODY) throw Object.assign(new Error('body too large'), { status: 413 })
    chunks.push(chunk)
  }
  try {
    return JSON.parse(Buffer.concat(chunks).toString('utf8') || '{}')
  } catch {
    throw Object.assign(new Error('body is not JSON'), { status: 400 })
  }
}

const STATIC = {
  '/': ['public/index.html', 'text/html; charset=utf-8'],
  '/app.js': ['public/app.js', 'text/javascript; charset=utf-8'],
  '/style.css': ['public/style.css', 'text/css; charset=utf-8'],
  '/supabase.js': ['node_modules/@supabase/supabase-js/dist/umd/supabase.js', 'text/javascript; charset=utf-8'],
}

function send(res, status, body, type = 'application/json') {
  res.writeHead(status, { 'content-type': type, 'cache-control': 'no-store', 'x-content-type-options': 'nosniff' })
  res.end(type === 'application/json' ? JSON.stringify(body) : body)
}

/** The API: sign in, then the signed-in user's todos (read, add, mark done, delete). */
async function api(s, pool, req, res, url) {
  if (req.method === 'POST' && url.pathname === '/api/session') {
    const { name } = await readJson(req)
    if (typeof name !== 'string' || !/^[\p{L}\p{N} _.-]{1,32}$/u.test(name.trim())) {
      return send(res, 400, { error: 'a name is 1 to 32 letters, digits, spaces, _ . or -' })
    }
    const user = { id: userId(name.trim()), name: name.trim() }
    return send(res, 200, { user, token: signToken(s.jwtSecret, user) })
  }
  const claims = verifyToken(s.jwtSecret, (req.headers.authorization || '').replace(/^Bearer /, ''))
  if (!claims) return send(res, 401, { error: 'sign in first' })
  const id = url.pathname.match(/^\/api\/todos\/(\d{1,18})$/)?.[1]
  if (req.method === 'GET' && url.pathname === '/api/todos') {
    const rows = await asUser(pool, claims, (c) => c.query('SELECT * FROM public.example_todos ORDER BY id'))
    return send(res, 200, rows.rows)
  }
  if (req.method === 'POST' && url.pathname === '/api/todos') {
    const { title } = await readJson(req)
    if (typeof title !== 'string' || !title.trim() || title.length > 200) return send(res, 400, { error: 'a title is 1 to 200 characters' })
    const r = await asUser(pool, claims, (c) => c.query('INSERT INTO public.example_todos (title) VALUES ($1) RETURNING *', [title.trim()]))
    return send(res, 201, r.rows[0])
  }
  if (req.method === 'PATCH' && id) {
    const { done } = await readJson(req)
    if (typeof done !== 'boolean') return send(res, 400, { error: '`done` is true or false' })
    const r = await asUser(pool, claims, (c) => c.query('UPDATE public.example_todos SET done = $1 WHERE id = $2 RETURNING *', [done, id]))
    return r.rows.length ? send(res, 200, r.rows[0]) : send(res, 404, { error: 'no such todo of yours' })
  }
  if (req.method === 'DELETE' && id) {
    const r = await asUser(pool, claims, (c) => c.query('DELETE FROM public.example_todos WHERE id = $1', [id]))
    return r.rowCount ? send(res, 204, '', 'text/plain') : send(res, 404, { error: 'no such todo of yours' })
  }
  return send(res, 404, { error: 'no such route' })
}

/** Create the tables and policies, then turn realtime on for the todos (walcast's REST API). */
async function setUp(s, pool) {
  await pool.query(fs.readFileSync(path.join(here, 'schema.sql'), 'utf8'))
  const r = await fetch(`${s.walcastUrl}/v1/db/default/schema/tables/example_todos/realtime`, {
    method: 'PUT',
    headers: { apikey: s.serviceKey, 'content-type': 'application/json' },
    body: JSON.stringify({ enabled: true }),
  })
  const answer = await r.json().catch(() => ({}))
  if (!r.ok) throw new Error(`walcast refused to enable realtime on example_todos: ${r.status} ${JSON.stringify(answer)}`)
  if (answer.warning) console.warn(answer.warning)
}

async function main() {
  const s = settings()
  const pool = new pg.Pool({ connectionString: s.databaseUrl, max: 5 })
  pool.on('error', (e) => console.error('database:', e.message))
  await setUp(s, pool)
  const server = http.createServer(async (req, res) => {
    const url = new URL(req.url, 'http://localhost')
    try {
      if (url.pathname === '/config.json') return send(res, 200, { url: s.walcastUrl, anonKey: s.anonKey })
      if (url.pathname.startsWith('/api/')) return await api(s, pool, req, res, url)
      const file = req.method === 'GET' && STATIC[url.pathname]
      if (!file) return send(res, 404, { error: 'no such route' })
      send(res, 200, fs.readFileSync(path.join(here, file[0])), file[1])
    } catch (e) {
      if (!e.status) console.error(`${req.method} ${url.pathname}:`, e.message)
      if (!res.headersSent) send(res, e.status || 500, { error: e.status ? e.message : 'internal error' })
    }
  })
  server.listen(s.port, s.host, () => console.log(`the example app: http://${s.host}:${s.port} (walcast at ${s.walcastUrl})`))
  const stop = () => {
    server.close(() => pool.end().then(() => process.exit(0)))
    server.closeAllConnections()
  }
  process.on('SIGINT', stop)
  process.on('SIGTERM', stop)
}

main().catch((e) => {
  console.error(e.message)
  process.exit(1)
})
