// What an operator's tooling asks a process: `walcast probe`, the health check of images
// without curl (0 when the process answers its probe route with 200, 1 with the reason
// when it refuses, cannot be reached, or is slow), and the release it runs on /metrics.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { once } from 'node:events'
import { spawn } from 'node:child_process'
import fs from 'node:fs'
import path from 'node:path'
import { startStack, bin, freePort, root } from './lib/harness.js'

let st, refusing
before(async () => {
  st = await startStack()
  // A process that is alive but not ready, and one that never answers.
  refusing = http.createServer((req, res) => {
    if (req.url === '/readyz') {
      res.writeHead(503, { 'content-type': 'text/plain' })
      res.end('not ready: the bus (NATS) is not connected')
    } else if (req.url === '/livez') {
      res.end('ok')
    }
  })
  refusing.listen(0, '127.0.0.1')
  await once(refusing, 'listening')
})
after(async () => {
  refusing?.closeAllConnections()
  refusing?.close()
  await st?.stop()
})

/**
 * `walcast probe` with `args` (in an empty directory: no .env), its exit code and output.
 * Asynchronous: the servers it asks run in this process.
 */
async function probe(args, env = {}) {
  const child = spawn(bin('walcast'), ['probe', ...args], { cwd: '/', env: { PATH: process.env.PATH, ...env } })
  let out = ''
  let err = ''
  child.stdout.on('data', (d) => { out += d })
  child.stderr.on('data', (d) => { err += d })
  const [code] = await once(child, 'close')
  return { code, out, err }
}

test('a live and ready walcast: exit 0, by URL or by its PORT', async () => {
  let r = await probe(['--url', st.server.url])
  assert.equal(r.code, 0, r.err)
  assert.match(r.out, /\/livez: 200 OK/)
  r = await probe(['--ready', '--url', `${st.server.url}/`])
  assert.equal(r.code, 0, r.err)
  assert.match(r.out, /\/readyz: 200 OK/)
  r = await probe(['--ready'], { PORT: String(st.server.port) })
  assert.equal(r.code, 0, r.err)
})

test('not ready, nothing listening, or no answer in time: exit 1 with the reason', async () => {
  const refusingUrl = `http://127.0.0.1:${refusing.address().port}`
  let r = await probe(['--url', refusingUrl])
  assert.equal(r.code, 0, 'alive')
  r = await probe(['--ready', '--url', refusingUrl])
  assert.equal(r.code, 1)
  assert.match(r.err, /503 Service Unavailable: not ready: the bus \(NATS\) is not connected/)
  r = await probe(['--url', `http://127.0.0.1:${await freePort()}`])
  assert.equal(r.code, 1)
  assert.match(r.err, /asking http:\/\/127\.0\.0\.1:\d+\/livez/)
  // A peer that accepts and never answers.
  const silent = http.createServer(() => {})
  silent.listen(0, '127.0.0.1')
  await once(silent, 'listening')
  r = await probe(['--url', `http://127.0.0.1:${silent.address().port}`, '--timeout-ms', '300'])
  silent.closeAllConnections()
  silent.close()
  assert.equal(r.code, 1)
  assert.match(r.err, /no answer within 300 ms/)
  r = await probe(['--url', 'https://example.com'])
  assert.equal(r.code, 1)
  assert.match(r.err, /must be an http:\/\/ address/)
})

test('the release a process runs is on /metrics, as walcast_build_info', async () => {
  const version = fs.readFileSync(path.join(root, 'Cargo.toml'), 'utf8').match(/^version = "([^"]+)"/m)[1]
  const text = await (await fetch(`${st.server.url}/metrics`, st.server.figures)).text()
  assert.match(text, new RegExp(`^walcast_build_info\\{version="${version.replaceAll('.', '\\.')}"\\} 1$`, 'm'))
})
