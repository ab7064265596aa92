// The umbrella client apps use, @supabase/supabase-js, against `walcast serve`: the
// scenarios of lib/supabase_scenarios.mjs (postgres_changes with a filter and RLS, a
// user's JWT through `realtime.setAuth` and through the `accessToken` option, broadcast
// with ack and self and over REST, presence, private channels, and the routes walcast
// does not serve) run under every Node version supabase-js supports, with its native
// WebSocket, and under the Node running these tests with the `ws` package as transport.
import { describe, test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { startStack, jwt } from './lib/harness.js'

const here = path.dirname(fileURLToPath(import.meta.url))
const SCENARIOS = path.join(here, 'lib', 'supabase_scenarios.mjs')
const USER_A = '00000000-0000-4000-8000-00000000000a'
const USER_B = '00000000-0000-4000-8000-00000000000b'

const NODES = [
  { name: 'Node 22, native WebSocket', bin: path.join(here, 'node_modules/node22/bin/node'), transport: 'native' },
  { name: 'Node 24, native WebSocket', bin: path.join(here, 'node_modules/node24/bin/node'), transport: 'native' },
  { name: `Node ${process.versions.node} (these tests' own), the ws package as transport`, bin: process.execPath, transport: 'ws' },
]

/** Run the scenarios with `node`; its exit code and output. */
function run(node, scenario) {
  return new Promise((resolve) => {
    // Not as a part of this run's test tree: a runner of its own, whose exit code counts.
    const { NODE_TEST_CONTEXT, ...env } = process.env
    const child = spawn(node.bin, ['--test', '--test-force-exit', '--test-reporter=spec', SCENARIOS], {
      cwd: here,
      env: { ...env, WALCAST_SCENARIO: JSON.stringify({ ...scenario, transport: node.transport }) },
      stdio: ['ignore', 'pipe', 'pipe'],
    })
    let out = ''
    child.stdout.on('data', (d) => { out += d })
    child.stderr.on('data', (d) => { out += d })
    child.on('close', (code) => resolve({ code, out }))
  })
}

describe('supabase-js', () => {
  let st, scenario
  before(async () => {
    st = await startStack({
      setupSql: [
        'CREATE TABLE todos (id int8 PRIMARY KEY, owner uuid, title text NOT NULL, done bool NOT NULL DEFAULT false)',
        'ALTER TABLE todos ENABLE ROW LEVEL SECURITY',
      ],
      tables: ['todos'],
    })
    // The API roles exist once walcast has started.
    await st.env.db.query(`
      CREATE POLICY own_todos ON todos FOR SELECT TO authenticated USING (owner = auth.uid());
      CREATE POLICY own_notes ON realtime.messages FOR SELECT TO authenticated
        USING (realtime.topic() = 'notes:' || auth.uid()::text)`)
    scenario = {
      url: `http://127.0.0.1:${st.server.port}`,
      databaseUrl: st.env.database_url,
      anonKey: jwt({}),
      userA: jwt({ role: 'authenticated', sub: USER_A }),
      userAId: USER_A,
      userB: jwt({ role: 'authenticated', sub: USER_B }),
      userBId: USER_B,
    }
  })
  after(async () => {
    await st?.stop()
  })

  for (const node of NODES) {
    test(node.name, async () => {
      const { code, out } = await run(node, scenario)
      assert.equal(code, 0, `the scenarios failed under ${node.name}:\n${out}`)
    })
  }
})
