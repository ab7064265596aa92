import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, client, subscribe, until } from './lib/harness.js'

let env, server
before(async () => {
  env = await startEnv()
  await env.db.query('CREATE TABLE todos (id int8 PRIMARY KEY, title text, done bool)')
  server = await startProcess(env, 'walcast', ['serve'])
  await env.db.query("INSERT INTO walcast.realtime_tables (schema_name, table_name) VALUES ('public','todos')")
  await env.db.query('ALTER TABLE todos REPLICA IDENTITY FULL')
  await env.db.query('GRANT SELECT ON todos TO anon, authenticated, service_role')
})
after(async () => {
  await server?.stop()
  await env?.stop()
})

test('insert arrives', async () => {
  const rt = client(server)
  const got = []
  const ch = rt.channel('room1').on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'todos' }, (p) => got.push(p))
  const { status, err } = await subscribe(ch)
  assert.equal(status, 'SUBSCRIBED', String(err))
  await env.db.query("INSERT INTO todos VALUES (1, 'a', false)")
  await until('the insert', () => got.length >= 1)
  assert.equal(got[0].eventType, 'INSERT')
  assert.deepEqual(got[0].new, { id: 1, title: 'a', done: false })
  rt.disconnect()
})
