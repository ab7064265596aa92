// Per-project limits across fronts: a project's connected users are counted on
// every front (each front announces its counts in its health beacon) and, at the limit,
// a further join on any front is refused with Supabase's `ConnectionRateLimitReached:
// Too many connected users`, while another project on the same fronts is unaffected; a
// socket already counted opens more channels; a user leaving frees a place. The counts
// are on `/metrics/projects` and in the inspector (a project key sees its own project).
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, client, subscribe, subscribed, uniq, until, jwt } from './lib/harness.js'
import { createProject } from './lib/tenants.js'

const LIMIT = 3
let env, worker, front1, front2, a, b
const clients = []
// The operator key: every project's counters (`/metrics/projects`) are served to it only.
const OPERATOR = 'walcast-js-limits-operator-key-0123456789abcdef'
const asOperator = { headers: { authorization: `Bearer ${OPERATOR}` } }

before(async () => {
  env = await startEnv()
  worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url })
  a = await createProject(env, 'limited-a')
  b = await createProject(env, 'limited-b')
  const limits = { NATS_URL: env.nats_url, PROJECT_MAX_USERS: String(LIMIT), MANAGEMENT_API_KEY: OPERATOR }
  front1 = await startProcess(env, 'ws-front', [], limits)
  front2 = await startProcess(env, 'ws-front', [], limits)
})
after(async () => {
  for (const rt of clients) {
    await rt.removeAllChannels().catch(() => {})
    await rt.disconnect()
  }
  await front2?.stop()
  await front1?.stop()
  await worker?.stop()
  await env?.stop()
})

function newClient(front, project) {
  const rt = client(front, { apikey: project.anon_key, logger: () => {} })
  clients.push(rt)
  return rt
}

/** What a front's inspector says of `project` (asked with that project's own key). */
async function seen(front, project) {
  const r = await fetch(`${front.url}/inspector/api/health?apikey=${project.anon_key}`)
  const body = await r.json()
  return body.projects
}

async function projectMetric(front, name, project) {
  const text = await (await fetch(`${front.url}/metrics/projects`, asOperator)).text()
  const m = text.match(new RegExp(`^${name}\\{project="${project}"\\} (\\S+)`, 'm'))
  return m ? Number(m[1]) : 0
}

test('a project at its connected-users limit is refused on every front; another project is not', async () => {
  const users = []
  for (const front of [front1, front1, front2]) {
    const rt = newClient(front, a)
    await subscribed(rt.channel(uniq('lim')))
    users.push(rt)
  }
  // Each front has heard the other's beacon: both count all three (front1 learns of
  // front2's user only from front2's next beacon after it joined).
  await until('front2 counts the three users of project a', async () => (await seen(front2, a))[a.id]?.users === LIMIT)
  await until('front1 counts the three users of project a', async () => (await seen(front1, a))[a.id]?.users === LIMIT)
  // A socket already counted opens another channel.
  await subscribed(users[2].channel(uniq('lim-second')))

  for (const front of [front2, front1]) {
    const over = newClient(front, a)
    const { status, err } = await subscribe(over.channel(uniq('lim-over')))
    assert.equal(status, 'CHANNEL_ERROR', `front ${front.port}: the fourth user is refused`)
    assert.match(String(err?.message ?? err), /ConnectionRateLimitReached: Too many connected users/)
    await over.disconnect()
  }
  assert.ok((await projectMetric(front2, 'walcast_project_refused_total', a.id)) >= 1)
  assert.equal(await projectMetric(front1, 'walcast_project_users', a.id), 2)

  // Project b on the same fronts is unaffected.
  for (const front of [front1, front2, front2]) {
    await subscribed(newClient(front, b).channel(uniq('other')))
  }

  // One user of a leaves: a place is free again (once front2's count reached the others).
  await users[0].removeAllChannels()
  await users[0].disconnect()
  await until('front2 sees project a at two users', async () => (await seen(front2, a))[a.id]?.users === LIMIT - 1)
  await subscribed(newClient(front2, a).channel(uniq('lim-again')))
})

test("the inspector shows a project key its own project's counts only; the operator sees every project", async () => {
  const own = await seen(front1, a)
  assert.deepEqual(Object.keys(own), [a.id])
  assert.equal(own[a.id].max_users, LIMIT)
  const operator = jwt({ role: 'service_role' })
  const r = await fetch(`${front1.url}/inspector/api/health?apikey=${operator}`)
  const all = (await r.json()).projects
  assert.ok(all[a.id] && all[b.id], `operator sees both projects: ${JSON.stringify(Object.keys(all))}`)
  assert.equal((await fetch(`${front1.url}/metrics/projects`)).status, 401, 'per-project figures without the operator key')
  const text = await (await fetch(`${front1.url}/metrics/projects`, asOperator)).text()
  assert.match(text, /# TYPE walcast_project_users gauge/)
  assert.match(text, new RegExp(`walcast_project_joins_total\\{project="${b.id}"\\} [1-9]`))
})
