// Per-project rates and sizes across fronts, through the unmodified realtime-js
// client: one cdc-worker and two ws-fronts started with small defaults, a noisy project
// driven over each limit and a quiet project on the same fronts at the same moment.
// Each limit: the noisy client gets Supabase's text as realtime-js surfaces it (the
// subscribe callback's CHANNEL_ERROR and its error, `on('system')` then CLOSED, send()'s
// 'error', httpSend()'s rejection), the quiet client is unaffected. Messages/s, bytes/s,
// joins/s and presence events/s are shown to be limited ACROSS the fronts: the front that
// refuses is below the limit on its own (its inspector says so) and is pushed over by
// what the other front announced in its beacon. Also: channels per socket, payload size
// (socket and REST 413), REST 429, REST 403 for a private-only project (made so through
// the management API), and the rate series of `/metrics/projects`.
// Loads are paced (never caught up in bursts) and waits are bounded polls, so that a
// loaded machine slows the loads without making a front exceed a limit on its own.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { startEnv, startProcess, client, subscribe, subscribed, subscribeTracked, collector, uniq, until } from './lib/harness.js'
import { createProject } from './lib/tenants.js'

const JOINS = 30
const CHANNELS = 5
const EVENTS = 150
const BYTES = 40000
const PRESENCE = 25
const PAYLOAD = 1024
const OPERATOR = 'walcast-js-rates-operator-key-0123456789abcdef'
const asOperator = { headers: { authorization: `Bearer ${OPERATOR}` } }
const TOO_MANY_MESSAGES = 'Too many messages per second'

let env, worker, front1, front2, noisy, quiet
const clients = []

before(async () => {
  env = await startEnv()
  worker = await startProcess(env, 'cdc-worker', [], { NATS_URL: env.nats_url })
  noisy = await createProject(env, 'rates-noisy')
  quiet = await createProject(env, 'rates-quiet')
  const limits = {
    NATS_URL: env.nats_url,
    MANAGEMENT_API_KEY: OPERATOR,
    PROJECT_MAX_JOINS_PER_SECOND: String(JOINS),
    MAX_CHANNELS_PER_SOCKET: String(CHANNELS),
    PROJECT_MAX_EVENTS_PER_SECOND: String(EVENTS),
    PROJECT_MAX_BYTES_PER_SECOND: String(BYTES),
    PROJECT_MAX_PRESENCE_EVENTS_PER_SECOND: String(PRESENCE),
    PROJECT_MAX_PAYLOAD_KB: String(PAYLOAD / 1024),
  }
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

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/** A realtime-js client of `project` on `front`; `rt.replies` records every reply it receives. */
function newClient(front, project) {
  const replies = []
  const logger = (kind, _msg, data) => {
    if (kind === 'receive' && data && typeof data === 'object' && 'status' in data) replies.push(data)
  }
  const rt = client(front, { apikey: project.anon_key, logger })
  rt.replies = replies
  clients.push(rt)
  return rt
}

/** The `reason`s of the error replies `rt` received. */
const errorReasons = (rt) => rt.replies.filter((r) => r.status === 'error').map((r) => r.response?.reason)

/**
 * A channel of `rt` on `topic` recording its `system` messages, broadcasts and statuses;
 * `first` resolves with its first subscribe status.
 */
function watch(rt, topic, config = {}) {
  const sys = collector('system')
  const got = collector('broadcast')
  const ch = rt.channel(topic, { config }).on('system', {}, sys).on('broadcast', { event: '*' }, got)
  const { first, statuses } = subscribeTracked(ch)
  return { rt, topic, ch, sys, got, first, statuses }
}

async function watched(rt, topic, config) {
  const w = watch(rt, topic, config)
  const { status, err } = await w.first
  assert.equal(status, 'SUBSCRIBED', `${topic}: ${err?.message}`)
  return w
}

/** The channel got the `system` error `message`, then was closed (and stays closed). */
async function shutWith(w, message, ms = 20000) {
  await until(`system "${message}" on ${w.ch.topic} (got ${JSON.stringify(w.sys.items)})`, () =>
    w.sys.items.some((m) => m.status === 'error' && m.message === message), ms)
  await until(`${w.ch.topic} CLOSED (statuses ${JSON.stringify(w.statuses.map((s) => s.status))})`, () =>
    w.statuses.some((s) => s.status === 'CLOSED'))
  assert.equal(w.ch.state, 'closed')
}

/** No `system` error, still joined. */
function unaffected(w, what) {
  assert.deepEqual(w.sys.items.filter((m) => m.status === 'error'), [], `${what}: no system error`)
  assert.equal(w.ch.state, 'joined', `${what}: still joined`)
}

const RATE_KEYS = ['joins', 'events', 'bytes', 'presence']
const zero = () => Object.fromEntries(RATE_KEYS.map((k) => [k, 0]))

/**
 * `project`'s rates as `front` sees them (its inspector, asked with the project's key):
 * `here` (its own, over the last second) and `heard` (the other fronts' last beacons).
 */
async function rates(front, project) {
  const body = await (await fetch(`${front.url}/inspector/api/health?apikey=${project.anon_key}`)).json()
  const own = body.projects?.[project.id]?.here?.rates ?? {}
  const here = zero()
  const heard = zero()
  for (const k of RATE_KEYS) here[k] = own[k] ?? 0
  for (const p of body.processes ?? []) {
    const r = p.process !== body.front && p.front?.project_rates?.[project.id]
    if (r) for (const k of RATE_KEYS) heard[k] += r[k] ?? 0
  }
  return { here, heard }
}

/** Wait until neither front counts anything of `project` (its own rates and the heard ones). */
async function settle(project) {
  await until(`project ${project.id}'s rates back to zero on both fronts`, async () => {
    for (const f of [front1, front2]) {
      const { here, heard } = await rates(f, project)
      if (RATE_KEYS.some((k) => here[k] || heard[k])) return false
    }
    return true
  }, 15000)
}

/** Poll `front`'s view of `project` every 150 ms until stopped; the maxima seen. */
function sampleRates(front, project) {
  const max = { here: zero(), total: zero() }
  let stopped = false
  const done = (async () => {
    while (!stopped) {
      const { here, heard } = await rates(front, project).catch(() => ({ here: zero(), heard: zero() }))
      for (const k of RATE_KEYS) {
        max.here[k] = Math.max(max.here[k], here[k])
        max.total[k] = Math.max(max.total[k], here[k] + heard[k])
      }
      await sleep(150)
    }
  })()
  return {
    max,
    /** Stop, after one last look (the beacon that made a front refuse is still there). */
    async stop() {
      stopped = true
      await done
      const { here, heard } = await rates(front, project)
      for (const k of RATE_KEYS) {
        max.here[k] = Math.max(max.here[k], here[k])
        max.total[k] = Math.max(max.total[k], here[k] + heard[k])
      }
      return max
    },
  }
}

/**
 * Call `fn(i)` `rate` times a second (not awaited) until stopped. A late tick is not caught
 * up with a burst: on a loaded machine the rate drops, it never rises above `rate`.
 */
function paced(rate, fn) {
  let stopped = false
  let n = 0
  const period = 1000 / rate
  const done = (async () => {
    let next = Date.now()
    while (!stopped) {
      fn(n++)
      next += period
      const now = Date.now()
      if (next < now) next = now
      await sleep(next - now)
    }
  })()
  return {
    get n() {
      return n
    },
    async stop() {
      stopped = true
      await done
    },
  }
}

/** A `/metrics/projects` series of `front` for `project` (undefined when absent). */
async function projectMetric(front, name, project) {
  const text = await (await fetch(`${front.url}/metrics/projects`, asOperator)).text()
  const m = text.match(new RegExp(`^${name}\\{project="${project.id}"\\} (\\S+)`, 'm'))
  return m ? Number(m[1]) : undefined
}

/**
 * A sender on front1 broadcasting `payload(i)` at `rate`/s to `listeners` members on
 * front2: the sender alone stays below the project's limits, what front2 delivers pushes
 * the project over; front1 hears it in front2's beacon and shuts the sender's channel.
 * A quiet project's sender and listener on the same fronts go on.
 */
async function shutAcrossFronts({ rate, listeners, payload }) {
  await settle(noisy)
  const topic = uniq('fanout')
  const members = await Promise.all(Array.from({ length: listeners }, () => watched(newClient(front2, noisy), topic)))
  const sender = await watched(newClient(front1, noisy), topic)
  const quietTopic = uniq('quiet-fanout')
  const quietListener = await watched(newClient(front2, quiet), quietTopic)
  const quietSender = await watched(newClient(front1, quiet), quietTopic)
  // The relay to front2 is in place: a first message reaches every member.
  await sender.ch.send({ type: 'broadcast', event: 'warm', payload: {} })
  for (const m of members) await m.got.wait(1, 'the warm-up broadcast')

  const seen1 = sampleRates(front1, noisy)
  let sent = 0
  const load = paced(rate, (i) => {
    if (sender.ch.state !== 'joined') return
    sent += 1
    sender.ch.send({ type: 'broadcast', event: 'm', payload: payload(i) })
  })
  const quietLoad = paced(rate, (i) => {
    quietSender.ch.send({ type: 'broadcast', event: 'q', payload: { i } })
  })
  let series
  try {
    await shutWith(sender, TOO_MANY_MESSAGES)
    series = await projectMetric(front2, 'walcast_project_events_per_second', noisy)
  } finally {
    await load.stop()
  }
  const max = await seen1.stop()
  // The quiet project, at the same moment: its sender still joined, its messages still
  // delivered.
  const before = quietListener.got.items.length
  await quietListener.got.wait(before + 3, 'quiet broadcasts after the noisy sender was shut')
  await quietLoad.stop()
  unaffected(quietSender, 'the quiet sender')
  unaffected(quietListener, 'the quiet listener')
  // The noisy listeners keep their streams (what is delivered is never refused).
  for (const m of members) unaffected(m, 'a noisy listener')
  assert.ok(members[0].got.items.length > 1, 'the listeners received the load')
  assert.ok(series > 0, `front2's walcast_project_events_per_second{project="${noisy.id}"} is ${series}`)
  return { max, sent }
}

test('events/s across fronts: a sender below the limit on its own is shut by what the other front delivers', async (t) => {
  const { max, sent } = await shutAcrossFronts({ rate: 30, listeners: 20, payload: (i) => ({ i }) })
  t.diagnostic(`front1 at most: own ${JSON.stringify(max.here)}, with front2's ${JSON.stringify(max.total)}; ${sent} sent`)
  assert.ok(max.here.events < EVENTS, `front1's own events/s stayed below ${EVENTS}: ${max.here.events}`)
  // Sampled around the refusal: what front1 judged by may have faded a little since.
  assert.ok(max.total.events >= 0.9 * EVENTS, `front1 saw the project at ${EVENTS} events/s: ${max.total.events}`)
  assert.ok(max.total.bytes < BYTES, `it was the events, not the bytes: ${max.total.bytes} bytes/s`)
  assert.ok(sent > 0)
})

test('bytes/s across fronts: large messages delivered on the other front shut the sender', async (t) => {
  const data = 'b'.repeat(PAYLOAD - 40)
  const { max, sent } = await shutAcrossFronts({ rate: 20, listeners: 4, payload: (i) => ({ i, data }) })
  t.diagnostic(`front1 at most: own ${JSON.stringify(max.here)}, with front2's ${JSON.stringify(max.total)}; ${sent} sent`)
  assert.ok(max.here.bytes < BYTES, `front1's own bytes/s stayed below ${BYTES}: ${max.here.bytes}`)
  assert.ok(max.total.bytes >= 0.9 * BYTES, `front1 saw the project at ${BYTES} bytes/s: ${max.total.bytes}`)
  assert.ok(max.total.events < EVENTS, `it was the bytes, not the events: ${max.total.events} events/s`)
})

test('joins/s across fronts: steady joins on front1 make a join on front2 refused', async (t) => {
  await settle(noisy)
  // Load on front1: 24 joins a second (each channel left once joined) over four sockets,
  // each holding one channel so that it stays connected.
  const sockets = []
  for (let i = 0; i < 4; i++) {
    const rt = newClient(front1, noisy)
    await subscribed(rt.channel(uniq('anchor')))
    sockets.push(rt)
  }
  const quietRt = newClient(front2, quiet)
  const quietAnchor = await watched(quietRt, uniq('quiet-anchor'))
  const inflight = new Set()
  const load = paced(24, (i) => {
    const rt = sockets[i % sockets.length]
    const ch = rt.channel(uniq('churn'))
    const p = subscribe(ch)
      .catch(() => {})
      .then(() => rt.removeChannel(ch))
      .catch(() => {})
      .finally(() => inflight.delete(p))
    inflight.add(p)
  })
  let refused, hereJoins
  const quietJoins = []
  try {
    await until('front2 heard front1 joining', async () => (await rates(front2, noisy)).heard.joins >= 18)
    // On front2: sixteen joins at once (below the limit on their own), over four sockets.
    const burst = []
    for (let s = 0; s < 4; s++) {
      const rt = newClient(front2, noisy)
      for (let c = 0; c < 4; c++) burst.push(subscribe(rt.channel(uniq('burst'))).then((r) => ({ ...r, rt })))
    }
    // The quiet project joins on the same front at the same moment.
    for (let c = 0; c < 3; c++) quietJoins.push(subscribe(quietRt.channel(uniq('quiet-join'))))
    const results = await Promise.all(burst)
    hereJoins = (await rates(front2, noisy)).here.joins
    refused = results.filter((r) => r.status === 'CHANNEL_ERROR')
    for (const r of results) await r.rt.removeAllChannels()
    assert.ok(
      results.every((r) => r.status === 'SUBSCRIBED' || r.status === 'CHANNEL_ERROR'),
      JSON.stringify(results.map((r) => r.status)),
    )
  } finally {
    await load.stop()
    await Promise.all([...inflight])
  }
  t.diagnostic(`front2: ${refused.length} of 16 refused, its own joins/s ${hereJoins}; front1 made ${load.n} joins`)
  assert.ok(refused.length >= 1, 'at least one of the sixteen joins on front2 was refused')
  for (const r of refused) assert.equal(r.err?.message, 'ClientJoinRateLimitReached: Too many joins per second')
  assert.ok(hereJoins < JOINS, `front2's own joins/s stayed below ${JOINS}: ${hereJoins}`)
  for (const q of await Promise.all(quietJoins)) assert.equal(q.status, 'SUBSCRIBED', q.err?.message)
  unaffected(quietAnchor, 'the quiet channel')
})

test('channels per socket: the sixth channel is refused; the socket keeps its five, others join', async () => {
  await settle(noisy)
  const rt = newClient(front1, noisy)
  const five = []
  for (let i = 0; i < CHANNELS; i++) five.push(await watched(rt, uniq('five')))
  const sixth = rt.channel(uniq('sixth'))
  const { status, err } = await subscribe(sixth)
  assert.equal(status, 'CHANNEL_ERROR')
  assert.equal(err?.message, 'ChannelRateLimitReached: Too many channels')
  await rt.removeChannel(sixth)

  // The five still work: a broadcast from another socket of the project reaches them.
  const other = newClient(front1, noisy)
  const peer = await watched(other, five[0].topic)
  await peer.ch.send({ type: 'broadcast', event: 'hello', payload: { n: 1 } })
  await five[0].got.wait(1, 'a broadcast on one of the five channels')
  for (const w of five) unaffected(w, 'one of the five')
  // The quiet project on the same front opens five channels on one socket.
  const q = newClient(front1, quiet)
  for (let i = 0; i < CHANNELS; i++) await subscribed(q.channel(uniq('quiet-five')))
  // Leaving one frees a place.
  await rt.removeChannel(five[4].ch)
  await subscribed(rt.channel(uniq('again')))
})

test('payload size: a broadcast over the project limit is refused (send() resolves "error"), not delivered; the channel stays', async () => {
  await settle(noisy)
  const topic = uniq('payload')
  const listener = await watched(newClient(front1, noisy), topic)
  const rt = newClient(front2, noisy)
  const sender = await watched(rt, topic, { broadcast: { ack: true } })
  const big = { data: 'x'.repeat(PAYLOAD + 100) }
  assert.equal(await sender.ch.send({ type: 'broadcast', event: 'big', payload: big }), 'error')
  const size = JSON.stringify(big).length
  assert.deepEqual(errorReasons(rt), [`PayloadSizeExceeded: Payload size exceeded: ${size} bytes, at most ${PAYLOAD}`])
  // Just below the limit goes through, and is the only one delivered.
  const fits = { data: 'y'.repeat(PAYLOAD - 20) }
  assert.ok(JSON.stringify(fits).length <= PAYLOAD)
  assert.equal(await sender.ch.send({ type: 'broadcast', event: 'fits', payload: fits }), 'ok')
  await listener.got.wait(1, 'the broadcast within the limit')
  await sleep(200)
  assert.deepEqual(listener.got.items.map((m) => m.event), ['fits'])
  unaffected(sender, 'the sender')
  // The quiet project at the same moment.
  const qTopic = uniq('quiet-payload')
  const qListener = await watched(newClient(front1, quiet), qTopic)
  const qSender = await watched(newClient(front2, quiet), qTopic, { broadcast: { ack: true } })
  assert.equal(await qSender.ch.send({ type: 'broadcast', event: 'fits', payload: fits }), 'ok')
  await qListener.got.wait(1, 'the quiet broadcast')
})

test('REST payload size: httpSend() over the project limit is refused with 413 and its text', async () => {
  const rt = newClient(front1, noisy)
  const topic = uniq('rest-big')
  const listener = await watched(newClient(front2, noisy), topic)
  const ch = rt.channel(topic)
  const big = { data: 'x'.repeat(PAYLOAD + 100) }
  const size = JSON.stringify(big).length
  await assert.rejects(ch.httpSend('big', big), { message: `Payload size exceeded: ${size} bytes, at most ${PAYLOAD}` })
  const r = await fetch(`${front1.url}/realtime/v1/api/broadcast/${topic}/events/big`, {
    method: 'POST',
    headers: { apikey: noisy.anon_key, 'content-type': 'application/json' },
    body: JSON.stringify(big),
  })
  assert.equal(r.status, 413)
  // send() on a channel not subscribed falls back to the batch endpoint: 'error'.
  assert.equal(await ch.send({ type: 'broadcast', event: 'big', payload: big }), 'error')
  assert.deepEqual(await ch.httpSend('fits', { data: 'y' }), { success: true })
  await listener.got.wait(1, 'the REST broadcast within the limit')
  await sleep(200)
  assert.deepEqual(listener.got.items.map((m) => m.event), ['fits'])
  const q = newClient(front1, quiet).channel(uniq('quiet-rest'))
  assert.deepEqual(await q.httpSend('fits', { data: 'y'.repeat(PAYLOAD - 20) }), { success: true })
})

test('REST messages/s: httpSend() over the project rate gets 429 "Too many messages per second"; the quiet project is served', async (t) => {
  await settle(noisy)
  const topic = uniq('rest-rate')
  const ch = newClient(front1, noisy).channel(topic)
  const qTopic = uniq('quiet-rest-rate')
  const qListener = await watched(newClient(front2, quiet), qTopic)
  const qch = newClient(front1, quiet).channel(qTopic)
  // The project kept over its messages/s by small batches, 10 messages forty times a
  // second (the batch endpoint realtime-js' send() falls back to): each takes what the
  // limit has left, so the single sends below find it spent, whatever the machine's speed
  // (a batch larger than what is left would be refused whole and spend nothing).
  const codes = []
  const batch = () =>
    fetch(`${front1.url}/realtime/v1/api/broadcast`, {
      method: 'POST',
      headers: { apikey: noisy.anon_key, 'content-type': 'application/json' },
      body: JSON.stringify({ messages: Array.from({ length: 10 }, (_, i) => ({ topic, event: 'flood', payload: { i } })) }),
    })
      .then(async (r) => codes.push([r.status, await r.text()]))
      .catch(() => {})
  const flood = paced(40, batch)
  let accepted = 0
  const refusals = []
  let fallback
  try {
    await until('an httpSend() refused', async () => {
      await ch.httpSend('m', { x: 1 }).then(
        () => (accepted += 1),
        (e) => refusals.push(e.message),
      )
      return refusals.length > 0
    }, 60000)
    await until("send()'s REST fallback refused", async () =>
      (fallback = await ch.send({ type: 'broadcast', event: 'm', payload: {} })) === 'error')
    // The quiet project, at the same moment, is served.
    assert.deepEqual(await qch.httpSend('q', { ok: true }), { success: true })
    // The single sends may take the window's last places before a batch finds too few
    // left: the flood goes on (four times the limit) until one does.
    await until('a batch refused', () => codes.some(([code]) => code !== 202), 10000)
  } finally {
    await flood.stop()
  }
  t.diagnostic(`httpSend: ${accepted} accepted before the refusal; batches: ${codes.map((c) => c[0]).join(' ')}`)
  assert.deepEqual(refusals, [TOO_MANY_MESSAGES])
  assert.equal(fallback, 'error')
  const refused = codes.filter(([code]) => code !== 202)
  assert.ok(refused.length > 0, 'batches were refused')
  for (const [code, body] of refused) assert.deepEqual([code, JSON.parse(body)], [429, { error: TOO_MANY_MESSAGES }])
  await qListener.got.wait(1, 'the quiet REST broadcast')
})

test('REST to a public topic of a private-only project (made so through the management API): 403 PrivateOnly', async () => {
  const r = await fetch(`${front1.url}/management/v1/projects`, {
    method: 'POST',
    headers: { authorization: `Bearer ${OPERATOR}`, 'content-type': 'application/json' },
    body: JSON.stringify({ name: 'rates-private', private_only: true }),
  })
  assert.equal(r.status, 201)
  const priv = await r.json()
  const rt = newClient(front2, priv)
  const pub = rt.channel(uniq('public'))
  await assert.rejects(pub.httpSend('m', { a: 1 }), { message: 'PrivateOnly: This project only allows private channels' })
  assert.equal(await pub.send({ type: 'broadcast', event: 'm', payload: {} }), 'error')
  // A private topic of the same project is not refused for being public.
  const privCh = rt.channel(uniq('private'), { config: { private: true } })
  assert.deepEqual(await privCh.httpSend('m', { a: 1 }), { success: true })
  // The quiet project's public topic is served.
  assert.deepEqual(await newClient(front2, quiet).channel(uniq('public')).httpSend('m', { a: 1 }), { success: true })
})

const presenceConfig = () => ({ presence: { key: uniq('who') } })

test('presence events/s across fronts: tracks below the limit on each front shut a tracking channel', async (t) => {
  await settle(noisy)
  // Four sockets per front, each tracking on its own topic 5 times a second: 20/s per
  // front (below the limit), 40/s for the project.
  const trackers = []
  for (const front of [front1, front2, front1, front2, front1, front2, front1, front2]) {
    trackers.push({ front, w: await watched(newClient(front, noisy), uniq('track'), presenceConfig()) })
  }
  const q = await watched(newClient(front1, quiet), uniq('quiet-track'), presenceConfig())
  const loads = trackers.map(({ w }) =>
    paced(5, (i) => {
      if (w.ch.state === 'joined') w.ch.track({ i }, { timeout: 3000 }).catch(() => {})
    }),
  )
  const quietLoad = paced(4, (i) => q.ch.track({ i }, { timeout: 3000 }).catch(() => {}))
  const samples = [sampleRates(front1, noisy), sampleRates(front2, noisy)]
  let shut
  try {
    await until('a tracking channel shut', () => trackers.some(({ w }) => w.sys.items.length > 0), 20000)
    shut = trackers.find(({ w }) => w.sys.items.length > 0)
    await shutWith(shut.w, 'Too many presence messages per second')
  } finally {
    await Promise.all(loads.map((l) => l.stop()))
  }
  const max = await Promise.all(samples.map((s) => s.stop()))
  await sleep(300)
  await quietLoad.stop()
  t.diagnostic(`presence/s at most, own and with the other front's: ${max.map((m) => `${m.here.presence}/${m.total.presence}`).join(', ')}`)
  for (const [i, m] of max.entries()) {
    assert.ok(m.here.presence < PRESENCE, `front${i + 1}'s own presence events/s stayed below ${PRESENCE}: ${m.here.presence}`)
  }
  // Whoever was shut was shut for the project's presence rate, nothing else.
  for (const { w } of trackers) {
    for (const m of w.sys.items) assert.equal(m.message, 'Too many presence messages per second')
  }
  unaffected(q, 'the quiet tracker')
  assert.equal(await q.ch.track({ last: true }), 'ok')
})

test('presence per socket: past a burst of 20, the tracking channel is shut "Client presence rate limit exceeded"', async () => {
  await settle(noisy)
  const w = await watched(newClient(front1, noisy), uniq('burst-track'), presenceConfig())
  const neighbour = await watched(newClient(front1, noisy), uniq('neighbour-track'), presenceConfig())
  const q = await watched(newClient(front1, quiet), uniq('quiet-burst'), presenceConfig())
  for (let i = 0; i < 30; i++) w.ch.track({ i }, { timeout: 3000 }).catch(() => {})
  await shutWith(w, 'Client presence rate limit exceeded')
  // Another socket of the project, and the quiet project, track at the same moment.
  assert.equal(await neighbour.ch.track({ here: true }), 'ok')
  assert.equal(await q.ch.track({ here: true }), 'ok')
  unaffected(neighbour, 'the other socket')
  unaffected(q, 'the quiet tracker')
})

test('presence payload size: a track over the project limit shuts the channel "Track message size exceeded"', async () => {
  await settle(noisy)
  const topic = uniq('big-track')
  const w = await watched(newClient(front2, noisy), topic, presenceConfig())
  const peer = await watched(newClient(front2, noisy), topic, presenceConfig())
  const q = await watched(newClient(front2, quiet), uniq('quiet-track'), presenceConfig())
  w.ch.track({ data: 'x'.repeat(PAYLOAD + 100) }, { timeout: 3000 }).catch(() => {})
  await shutWith(w, 'Track message size exceeded')
  assert.deepEqual(peer.ch.presenceState(), {}, 'nothing was tracked')
  const fits = { data: 'y'.repeat(PAYLOAD - 40) }
  assert.equal(await peer.ch.track(fits), 'ok')
  assert.equal(await q.ch.track(fits), 'ok')
  unaffected(peer, 'the other member')
  unaffected(q, 'the quiet tracker')
})

test('/metrics/projects: per-project rate series on both fronts; only the noisy project was refused', async () => {
  for (const front of [front1, front2]) {
    const text = await (await fetch(`${front.url}/metrics/projects`, asOperator)).text()
    for (const name of ['joins', 'events', 'bytes', 'presence_events']) {
      assert.match(text, new RegExp(`# TYPE walcast_project_${name}_per_second gauge`))
      for (const p of [noisy, quiet]) assert.match(text, new RegExp(`^walcast_project_${name}_per_second\\{project="${p.id}"\\} \\d+$`, 'm'))
    }
    assert.ok((await projectMetric(front, 'walcast_project_refused_total', noisy)) > 0, `front ${front.port}: noisy refused`)
    assert.equal(await projectMetric(front, 'walcast_project_refused_total', quiet), 0, `front ${front.port}: quiet never refused`)
  }
  // While the noisy project is busy, its rate is on the series.
  const rt = newClient(front1, noisy)
  const w = await watched(rt, uniq('metric'))
  const load = paced(20, (i) => w.ch.send({ type: 'broadcast', event: 'm', payload: { i } }))
  try {
    await until('walcast_project_events_per_second of the noisy project > 0', async () =>
      (await projectMetric(front1, 'walcast_project_events_per_second', noisy)) > 0)
    await until('walcast_project_bytes_per_second of the noisy project > 0', async () =>
      (await projectMetric(front1, 'walcast_project_bytes_per_second', noisy)) > 0)
  } finally {
    await load.stop()
  }
  const limits = (await Promise.all([front1, front2].map(async (f) => (await fetch(`${f.url}/metrics`, f.figures)).text()))).join('\n')
  for (const kind of ['project_messages', 'project_joins', 'channels', 'payload_size', 'presence_events', 'project_presence']) {
    assert.match(limits, new RegExp(`^walcast_front_limit_rejections_total\\{[^}]*limit="${kind}"[^}]*\\} [1-9]`, 'm'), kind)
  }
})
