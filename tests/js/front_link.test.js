// A front whose link to NATS is cut: realtime-js clients of a front that
// reaches NATS through a TCP proxy, cut for 3 s and then for 1 s while a writer inserts
// 50 rows/s, get every row once and in order — the leader numbers what it sends each
// front, the front asks again for what NATS dropped — or, past the leader's resend
// buffer, a `system` error on their channel; never silence. A client of a second front,
// connected directly, is the control.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import { startEnv, startProcess, enableTable, client, collector, subscribed, uniq, until } from './lib/harness.js'

let env, worker, cut, direct, proxy
const clients = []

/** A TCP proxy to `target` that can drop every connection and refuse new ones. */
function tcpProxy(target) {
  const { hostname, port } = new URL(target)
  const sockets = new Set()
  let down = false
  const server = net.createServer((inbound) => {
    if (down) return inbound.destroy()
    const outbound = net.connect(Number(port), hostname)
    for (const s of [inbound, outbound]) {
      sockets.add(s)
      s.on('error', () => {})
      s.on('close', () => {
        sockets.delete(s)
        inbound.destroy()
        outbound.destroy()
      })
    }
    inbound.pipe(outbound)
    outbound.pipe(inbound)
  })
  return new Promise((resolve) => {
    server.listen(0, '127.0.0.1', () => {
      const url = new URL(target)
      url.port = String(server.address().port)
      url.hostname = '127.0.0.1'
      resolve({
        url: url.toString().replace(/\/$/, ''),
        cut() {
          down = true
          for (const s of sockets) s.destroy()
        },
        restore() {
          down = false
        },
        close: () => new Promise((r) => server.close(() => r())),
      })
    })
  })
}

before(async () => {
  env = await startEnv()
  await env.db.query('CREATE TABLE link (id int8 PRIMARY KEY, at int8 NOT NULL)')
  worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url })
  await enableTable(env, 'link')
  proxy = await tcpProxy(env.nats_url)
  cut = await startProcess(env, 'ws-front', [], { NATS_URL: proxy.url })
  direct = await startProcess(env, 'ws-front', [], { NATS_URL: env.nats_url })
})
after(async () => {
  for (const rt of clients) await rt.disconnect()
  await cut?.stop()
  await direct?.stop()
  await worker?.stop()
  await proxy?.close()
  await env?.stop()
})

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

async function listen(front) {
  const rt = client(front, { logger: () => {} })
  clients.push(rt)
  const rows = collector('rows')
  const system = collector('system')
  await subscribed(
    rt
      .channel(uniq('link'))
      .on('system', {}, system)
      .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'link' }, (p) => rows(p.new.id)),
  )
  return { rows, system }
}

test('a front whose NATS link is cut for 3 s and for 1 s delivers every row once, in order, or says so', async () => {
  const onCut = await listen(cut)
  const onDirect = await listen(direct)
  const total = 600
  const writer = (async () => {
    for (let id = 1; id <= total; id++) {
      await env.db.query('INSERT INTO link VALUES ($1, $2)', [id, Date.now()])
      await sleep(20)
    }
  })()
  await sleep(3000)
  proxy.cut()
  await sleep(3000)
  proxy.restore()
  await sleep(3000)
  proxy.cut()
  await sleep(1000)
  proxy.restore()
  await writer
  const expected = Array.from({ length: total }, (_, i) => i + 1)
  await until('the direct front got every row', () => onDirect.rows.items.length >= total, 30000)
  assert.deepEqual(onDirect.rows.items, expected, 'the control front: every row once, in order')
  const errors = () => onCut.system.items.filter((s) => s.status === 'error')
  await until(
    'the cut front delivered every row or told its channel',
    () => onCut.rows.items.length >= total || errors().length > 0,
    30000,
  )
  const got = onCut.rows.items
  const inOrder = got.every((id, i) => i === 0 || id > got[i - 1])
  assert.ok(inOrder, `rows in order and once: ${JSON.stringify(got).slice(0, 400)}`)
  if (got.length < total) {
    assert.ok(errors().length > 0, `${total - got.length} rows missing and no system error`)
  } else {
    assert.deepEqual(got, expected)
  }
  const health = await cut.health()
  const front = health.front ?? health
  assert.equal(front.bus_disconnected_recently, true, JSON.stringify(health).slice(0, 400))
  console.log(
    `cut front: ${got.length}/${total} rows, system errors: ${JSON.stringify(errors().map((e) => e.message))}; direct front: ${onDirect.rows.items.length}/${total}`,
  )
})
