// walcast inspector. A Phoenix / Supabase Realtime client of its own (vsn 1.0.0 or 2.0.0,
// over the same WebSocket every app uses), so it sees exactly what the pasted key may
// see, plus a health panel fed by /inspector/api/health. No dependencies, no build step.
'use strict'

const $ = (id) => document.getElementById(id)
const el = (tag, props = {}, ...children) => {
  const e = document.createElement(tag)
  Object.assign(e, props)
  for (const c of children) e.append(c)
  return e
}
const SVG = 'http://www.w3.org/2000/svg'
const MAX_LOG = 1000 // messages kept (the oldest go first)
const HEARTBEAT_MS = 25000
const REPLY_MS = 15000
const HEALTH_MS = 1000

// ---- the Phoenix client ------------------------------------------------------------

class Phoenix {
  constructor(key, vsn, handlers) {
    this.key = key
    this.vsn = vsn
    this.h = handlers
    this.ref = 0
    this.replies = new Map()
  }

  open() {
    const scheme = location.protocol === 'https:' ? 'wss' : 'ws'
    const q = `apikey=${encodeURIComponent(this.key)}&vsn=${this.vsn}`
    this.ws = new WebSocket(`${scheme}://${location.host}/realtime/v1/websocket?${q}`)
    this.ws.binaryType = 'arraybuffer'
    this.ws.onopen = () => {
      this.beat = setInterval(() => this.push('phoenix', 'heartbeat', {}), HEARTBEAT_MS)
      this.h.open()
    }
    this.ws.onclose = (e) => {
      clearInterval(this.beat)
      for (const [, r] of this.replies) r.reject(new Error('connection closed'))
      this.replies.clear()
      this.h.close(e)
    }
    this.ws.onmessage = (e) => this.receive(e.data)
  }

  close() {
    this.ws?.close(1000)
  }

  nextRef() {
    this.ref += 1
    return String(this.ref)
  }

  /** Send a push; resolves with the reply's payload ({status, response}). */
  push(topic, event, payload, joinRef = null) {
    const ref = this.nextRef()
    const frame =
      this.vsn === '1.0.0'
        ? JSON.stringify({ topic, event, payload, ref, join_ref: joinRef })
        : JSON.stringify([joinRef, ref, topic, event, payload])
    return this.sendAwaiting(ref, frame)
  }

  sendAwaiting(ref, frame) {
    return new Promise((resolve, reject) => {
      const t = setTimeout(() => {
        this.replies.delete(ref)
        reject(new Error(`no reply within ${REPLY_MS / 1000} s`))
      }, REPLY_MS)
      this.replies.set(ref, {
        resolve: (p) => (clearTimeout(t), resolve(p)),
        reject: (e) => (clearTimeout(t), reject(e)),
      })
      this.ws.send(frame)
    })
  }

  /** A broadcast push: a binary kind 3 frame under 2.0.0 (as realtime-js sends it). */
  broadcast(topic, joinRef, event, payload) {
    if (this.vsn === '1.0.0') {
      this.push(topic, 'broadcast', { type: 'broadcast', event, payload }, joinRef).catch(() => {})
      return
    }
    const enc = new TextEncoder()
    const parts = [joinRef, this.nextRef(), topic, event, ''].map((s) => enc.encode(s))
    const body = enc.encode(JSON.stringify(payload))
    if (parts.some((p) => p.length > 255)) throw new Error('topic or event over 255 bytes')
    const head = [3, ...parts.map((p) => p.length), 1]
    const out = new Uint8Array(head.length + parts.reduce((n, p) => n + p.length, 0) + body.length)
    out.set(head, 0)
    let at = head.length
    for (const p of [...parts, body]) {
      out.set(p, at)
      at += p.length
    }
    this.ws.send(out)
  }

  receive(data) {
    const m = typeof data === 'string' ? decodeText(data, this.vsn) : decodeBinary(data)
    if (!m) return
    if (m.event === 'phx_reply' && this.replies.has(m.ref)) {
      const r = this.replies.get(m.ref)
      this.replies.delete(m.ref)
      r.resolve(m.payload)
      if (m.topic === 'phoenix') return
    }
    this.h.message(m)
  }
}

function decodeText(text, vsn) {
  const v = JSON.parse(text)
  if (vsn === '1.0.0' || !Array.isArray(v)) return v
  const [join_ref, ref, topic, event, payload] = v
  return { join_ref, ref, topic, event, payload }
}

/** A server broadcast, binary kind 4: kind, len(topic), len(event), len(meta), encoding. */
function decodeBinary(buf) {
  const b = new Uint8Array(buf)
  if (b[0] !== 4 || b.length < 5) return null
  const dec = new TextDecoder()
  let at = 5
  const take = (n) => b.subarray(at, (at += n))
  const topic = dec.decode(take(b[1]))
  const event = dec.decode(take(b[2]))
  const metaText = dec.decode(take(b[3]))
  const rest = b.subarray(at)
  const payload = b[4] === 1 ? JSON.parse(dec.decode(rest)) : { binary_bytes: rest.length }
  const meta = metaText ? JSON.parse(metaText) : undefined
  return { topic, event: 'broadcast', ref: null, join_ref: null, payload: { type: 'broadcast', event, payload, meta } }
}

// ---- state --------------------------------------------------------------------------

const state = {
  socket: null,
  key: '',
  channels: new Map(), // topic -> {topic, joinRef, status, reason, presence: Map, li}
  log: [],
  paused: false,
  unseen: 0,
  fresh: [], // logged, not drawn yet
  frame: 0,
}

// ---- connection ---------------------------------------------------------------------

async function connect() {
  const key = $('key').value.trim()
  $('conn-error').textContent = ''
  if (!key) return showConnError('Paste a key first.')
  // The upgrade's refusal is invisible to a browser's WebSocket: ask the health API,
  // which checks the key the same way, for the reason.
  const r = await fetch('/inspector/api/health', { headers: { apikey: key } }).catch((e) => e)
  if (r instanceof Error) return showConnError(`Cannot reach the server: ${r.message}`)
  if (!r.ok) {
    const body = await r.json().catch(() => ({}))
    return showConnError(`Key refused (HTTP ${r.status}): ${body.error ?? r.statusText}`)
  }
  state.key = key
  const s = new Phoenix(key, $('vsn').value, { open: onOpen, close: onClose, message: onMessage })
  state.socket = s
  setStatus('connecting', '')
  s.open()
}

function showConnError(text) {
  $('conn-error').textContent = text
  setStatus('refused', 'off')
}

function onOpen() {
  setStatus(`connected (vsn ${state.socket.vsn})`, 'on')
  for (const id of ['join-btn', 'disconnect-btn']) $(id).disabled = false
  $('connect-btn').disabled = true
  pollHealth()
}

function onClose(e) {
  setStatus(`disconnected${e.code !== 1000 ? ` (${e.code}${e.reason ? `: ${e.reason}` : ''})` : ''}`, 'off')
  for (const id of ['join-btn', 'disconnect-btn', 'bcast-btn', 'track-btn', 'untrack-btn']) $(id).disabled = true
  $('connect-btn').disabled = false
  state.socket = null
  for (const ch of state.channels.values()) setChannelStatus(ch, 'closed', '')
}

function setStatus(text, cls) {
  const s = $('conn-status')
  s.textContent = text
  s.className = `badge ${cls}`
}

// ---- channels -----------------------------------------------------------------------

function joinConfig() {
  const mode = document.querySelector('input[name=mode]:checked').value
  if (mode === 'table') {
    const binding = { event: $('event').value, schema: $('schema').value.trim() || 'public' }
    const table = $('table').value.trim()
    if (table) binding.table = table
    const filter = $('filter').value.trim()
    if (filter) binding.filter = filter
    const name = `inspector:${binding.schema}.${table || '*'}:${Math.random().toString(36).slice(2, 8)}`
    const config = { broadcast: { self: false }, presence: { enabled: false }, postgres_changes: [binding], private: false }
    return { topic: `realtime:${name}`, config }
  }
  const name = $('topic').value.trim()
  if (!name) throw new Error('Enter a topic.')
  const config = {
    broadcast: { self: true, ack: false },
    presence: { enabled: $('presence').checked, key: '' },
    postgres_changes: [],
    private: $('private').checked,
  }
  return { topic: `realtime:${name}`, config }
}

async function join() {
  let spec
  try {
    spec = joinConfig()
  } catch (e) {
    return addLog({ kind: 'refused', event: 'join', topic: '', summary: e.message })
  }
  const s = state.socket
  const ref = s.nextRef()
  const ch = { topic: spec.topic, joinRef: ref, status: 'joining', presence: new Map() }
  state.channels.set(spec.topic, ch)
  renderChannel(ch)
  const payload = { config: spec.config, access_token: state.key }
  const frame =
    s.vsn === '1.0.0'
      ? JSON.stringify({ topic: spec.topic, event: 'phx_join', payload, ref, join_ref: ref })
      : JSON.stringify([ref, ref, spec.topic, 'phx_join', payload])
  try {
    const reply = await s.sendAwaiting(ref, frame)
    if (reply.status === 'ok') {
      setChannelStatus(ch, 'joined', '')
      $('target').value = ch.topic // the channel just joined is the one to send on
      return renderPresence()
    }
    const reason = reply.response?.reason ?? JSON.stringify(reply.response)
    setChannelStatus(ch, 'refused', reason)
    addLog({ kind: 'refused', event: 'phx_join', topic: ch.topic, summary: reason, detail: reply })
  } catch (e) {
    setChannelStatus(ch, 'refused', e.message)
  }
}

async function leave(ch) {
  if (state.socket && ch.status !== 'closed') {
    await state.socket.push(ch.topic, 'phx_leave', {}, ch.joinRef).catch(() => {})
  }
  state.channels.delete(ch.topic)
  ch.li.remove()
  renderTargets()
}

function renderChannel(ch) {
  const status = el('span', { className: 'status' })
  const reason = el('span', { className: 'reason' })
  const btn = el('button', { textContent: 'Leave', onclick: () => leave(ch) })
  ch.li = el('li', {}, el('code', { textContent: ch.topic }), ' ', status, ' ', reason, ' ', btn)
  ch.li.dataset.topic = ch.topic
  $('channels').append(ch.li)
  setChannelStatus(ch, ch.status, '')
}

function setChannelStatus(ch, status, reason) {
  ch.status = status
  ch.reason = reason
  const [s, r] = [ch.li.querySelector('.status'), ch.li.querySelector('.reason')]
  s.textContent = status
  s.className = `status ${status === 'joined' || status === 'subscribed' ? 'ok' : status === 'joining' ? '' : 'error'}`
  ch.li.dataset.status = status
  r.textContent = reason
  renderTargets()
}

function renderTargets() {
  const sel = $('target')
  const was = sel.value
  sel.replaceChildren()
  for (const ch of state.channels.values()) {
    if (ch.status === 'joined' || ch.status === 'subscribed') sel.append(el('option', { value: ch.topic, textContent: ch.topic }))
  }
  if ([...sel.options].some((o) => o.value === was)) sel.value = was
  const none = sel.options.length === 0
  for (const id of ['bcast-btn', 'track-btn', 'untrack-btn']) $(id).disabled = none
  renderPresence()
}

function target() {
  return state.channels.get($('target').value)
}

function parseJson(id) {
  try {
    return JSON.parse($(id).value)
  } catch (e) {
    addLog({ kind: 'refused', event: 'input', topic: '', summary: `${id}: not JSON: ${e.message}` })
    return undefined
  }
}

function sendBroadcast() {
  const ch = target()
  const payload = parseJson('bcast-payload')
  if (!ch || payload === undefined) return
  state.socket.broadcast(ch.topic, ch.joinRef, $('bcast-event').value, payload)
}

async function track(event) {
  const ch = target()
  const payload = event === 'track' ? parseJson('presence-payload') : undefined
  if (!ch || (event === 'track' && payload === undefined)) return
  const body = event === 'track' ? { type: 'presence', event, payload } : { type: 'presence', event }
  const reply = await state.socket.push(ch.topic, 'presence', body, ch.joinRef).catch((e) => ({ status: 'error', response: { reason: e.message } }))
  if (reply.status !== 'ok') {
    addLog({ kind: 'refused', event: `presence ${event}`, topic: ch.topic, summary: reply.response?.reason ?? JSON.stringify(reply.response), detail: reply })
  }
}

// ---- incoming -----------------------------------------------------------------------

function onMessage(m) {
  const ch = state.channels.get(m.topic)
  if (!ch) return
  if (m.join_ref && m.join_ref !== ch.joinRef) return // an earlier join's
  const handler = HANDLERS[m.event]
  if (handler) handler(ch, m.payload, m)
  else addLog({ kind: m.event, event: m.event, topic: m.topic, summary: short(m.payload), detail: m.payload })
}

const HANDLERS = {
  postgres_changes(ch, p) {
    const d = p.data ?? {}
    const row = d.type === 'DELETE' ? d.old_record : d.record
    const summary = `${d.schema}.${d.table} ${short(row)}${d.errors ? `  errors: ${short(d.errors)}` : ''}`
    addLog({ kind: 'postgres_changes', event: d.type, topic: ch.topic, summary, detail: d })
  },
  broadcast(ch, p) {
    addLog({ kind: 'broadcast', event: p.event, topic: ch.topic, summary: short(p.payload), detail: p })
  },
  system(ch, p) {
    const failed = p.status === 'error'
    if (p.extension === 'postgres_changes') setChannelStatus(ch, failed ? 'refused' : 'subscribed', failed ? p.message : '')
    addLog({ kind: failed ? 'refused' : 'system', event: 'system', topic: ch.topic, summary: p.message ?? short(p), detail: p })
  },
  presence_state(ch, p) {
    ch.presence = new Map(Object.entries(p))
    renderPresence()
    addLog({ kind: 'presence', event: 'presence_state', topic: ch.topic, summary: `${ch.presence.size} present`, detail: p })
  },
  presence_diff(ch, p) {
    for (const [k, v] of Object.entries(p.leaves ?? {})) {
      const left = new Set(v.metas.map((x) => x.phx_ref))
      const metas = (ch.presence.get(k)?.metas ?? []).filter((x) => !left.has(x.phx_ref))
      if (metas.length) ch.presence.set(k, { metas })
      else ch.presence.delete(k)
    }
    for (const [k, v] of Object.entries(p.joins ?? {})) {
      ch.presence.set(k, { metas: [...(ch.presence.get(k)?.metas ?? []), ...v.metas] })
    }
    renderPresence()
    const joins = Object.keys(p.joins ?? {}).length
    const leaves = Object.keys(p.leaves ?? {}).length
    addLog({ kind: 'presence', event: 'presence_diff', topic: ch.topic, summary: `+${joins} −${leaves}`, detail: p })
  },
  phx_close(ch) {
    setChannelStatus(ch, 'closed', '')
    addLog({ kind: 'system', event: 'phx_close', topic: ch.topic, summary: 'channel closed by the server' })
  },
  phx_error(ch, p) {
    setChannelStatus(ch, 'error', short(p))
    addLog({ kind: 'refused', event: 'phx_error', topic: ch.topic, summary: short(p), detail: p })
  },
  phx_reply() {}, // replies to pushes already answered (heartbeats, leaves)
}

function renderPresence() {
  const ch = target()
  const items = ch ? [...ch.presence.entries()] : []
  $('present').replaceChildren(...items.map(([k, v]) => el('li', { textContent: `${k}: ${short(v.metas.map(({ phx_ref, ...rest }) => rest))}` })))
}

function short(v) {
  const s = JSON.stringify(v) ?? String(v)
  return s.length > 300 ? `${s.slice(0, 300)}…` : s
}

// ---- the message log ----------------------------------------------------------------

function addLog(entry) {
  entry.at = new Date()
  state.log.push(entry)
  if (state.log.length > MAX_LOG) state.log.shift()
  if (state.paused) {
    state.unseen += 1
    $('pause-btn').textContent = `Resume (${state.unseen} new)`
    return
  }
  // Drawn once per frame, only what arrived since: a busy table must not make the page
  // redraw a thousand rows per change.
  state.fresh.push(entry)
  if (!state.frame) state.frame = requestAnimationFrame(flushLog)
}

function flushLog() {
  state.frame = 0
  const fresh = state.fresh.splice(0).filter(visible)
  const log = $('log')
  log.prepend(...fresh.reverse().map(logItem))
  while (log.childElementCount > MAX_LOG) log.lastElementChild.remove()
  countLog()
}

function countLog() {
  $('msg-count').textContent = `${$('log').childElementCount} of ${state.log.length} messages`
}

function visible(entry) {
  const f = $('msg-filter').value.trim().toLowerCase()
  if (!f) return true
  return [entry.kind, entry.event].some((x) => String(x ?? '').toLowerCase().includes(f))
}

function renderLog() {
  state.fresh = []
  $('log').replaceChildren(...state.log.filter(visible).reverse().map(logItem))
  countLog()
}

function logItem(entry) {
  const time = entry.at.toISOString().slice(11, 23)
  const li = el('li', { className: entry.kind }, el('span', { className: 'kind', textContent: entry.event ?? entry.kind }), ` ${time} `, el('span', { className: 'topic', textContent: entry.topic }), ' ', el('span', { className: 'summary', textContent: entry.summary }))
  li.dataset.kind = entry.kind
  li.dataset.event = entry.event ?? ''
  li.title = 'click to expand'
  li.onclick = (e) => {
    if (e.target.tagName === 'PRE') return
    const open = li.querySelector('pre')
    if (open) open.remove()
    else li.append(el('pre', { textContent: JSON.stringify(entry.detail ?? entry.summary, null, 2) }))
  }
  return li
}

function togglePause() {
  state.paused = !state.paused
  state.unseen = 0
  $('pause-btn').textContent = state.paused ? 'Resume' : 'Pause'
  if (!state.paused) renderLog()
}

// ---- health -------------------------------------------------------------------------

async function pollHealth() {
  clearTimeout(state.healthTimer)
  if (!state.key) return
  try {
    const r = await fetch('/inspector/api/health', { headers: { apikey: state.key } })
    const body = await r.json()
    if (!r.ok) throw new Error(body.error ?? `HTTP ${r.status}`)
    $('health-error').textContent = ''
    renderHealth(body)
  } catch (e) {
    $('health-error').textContent = `health: ${e.message}`
  }
  state.healthTimer = setTimeout(pollHealth, HEALTH_MS)
}

function renderHealth(h) {
  const workers = h.processes.filter((p) => p.worker || p.sources?.length)
  const fronts = h.processes.filter((p) => p.front)
  $('pipelines').replaceChildren(...(workers.length ? workers.flatMap(pipelines) : [el('p', { className: 'hint', textContent: 'No pipeline heard from yet.' })]))
  $('fronts').tBodies[0].replaceChildren(...fronts.map((p) => frontRow(p, h.front)))
  $('projects').tBodies[0].replaceChildren(...Object.entries(h.projects ?? {}).map(([id, p]) => projectRow(id, p)))
}

/** A project's counts: its users on every front and its limit, this front's counters and rates (with the limits across the fronts). */
function projectRow(id, p) {
  const here = p.here
  const rates = here.rates ?? {}
  const limits = p.limits ?? {}
  const cells = [id, p.users, p.max_users, here.channels, here.joins, here.refused, `${here.messages_in} (${bytes(here.bytes_in)})`, `${here.messages_out} (${bytes(here.bytes_out)})`,
    `${rates.events ?? 0} (${limits.events_per_second ?? '–'})`, `${rates.joins ?? 0} (${limits.joins_per_second ?? '–'})`]
  const tr = el('tr', {}, ...cells.map((c) => el('td', { textContent: String(c) })))
  tr.dataset.project = id
  return tr
}

/** A worker's pipelines: the default source's (with its graphs), then each other source's (`sources`). */
function pipelines(p) {
  const own = p.worker ? [pipeline(p, p.worker, p.history)] : []
  return own.concat((p.sources ?? []).map((w) => pipeline(p, w, null)))
}

function pipeline(p, w, history) {
  const last = history?.at(-1)
  const facts = [
    ['process', p.process],
    ['source', w.source ?? 'default'],
    ['role', w.leader ? 'leader' : 'standby'],
    ['cdc_active', String(w.cdc_active)],
    ['slot', w.slot],
    ['slot lag', bytes(w.lag_bytes)],
    ['changes/s', last ? last.changes_per_s.toFixed(1) : '–'],
    ['skipped', String(w.skipped_changes_total)],
  ]
  if (w.last_error) facts.push(['last error', w.last_error])
  const dl = el('dl', {}, ...facts.flatMap(([k, v]) => [el('dt', { textContent: k }), el('dd', { textContent: v })]))
  const graphs = history ? [graph(history, 'lag_bytes', 'slot lag', bytes), graph(history, 'changes_per_s', 'changes/s', (v) => v.toFixed(0))] : []
  const div = el('div', { className: 'pipeline' }, dl, ...graphs)
  div.dataset.process = p.process
  div.dataset.source = w.source ?? 'default'
  div.dataset.cdcActive = String(w.cdc_active)
  div.dataset.leader = String(w.leader)
  return div
}

/** A sparkline of the last samples, scaled to its own maximum. */
function graph(samples, field, label, fmt) {
  const [w, hgt] = [240, 48]
  const values = samples.map((s) => s[field])
  const max = Math.max(1, ...values)
  const svg = document.createElementNS(SVG, 'svg')
  for (const [k, v] of Object.entries({ class: 'graph', width: w, height: hgt + 12, viewBox: `0 0 ${w} ${hgt + 12}` })) svg.setAttribute(k, v)
  const line = document.createElementNS(SVG, 'polyline')
  const step = values.length > 1 ? w / (values.length - 1) : w
  line.setAttribute('points', values.map((v, i) => `${(i * step).toFixed(1)},${(hgt - (v / max) * hgt + 1).toFixed(1)}`).join(' '))
  const text = document.createElementNS(SVG, 'text')
  text.setAttribute('x', 0)
  text.setAttribute('y', hgt + 11)
  text.textContent = `${label} (max ${fmt(max)}, last ${values.length} s)`
  svg.append(line, text)
  return svg
}

function frontRow(p, self) {
  const f = p.front
  const name = p.process === self ? `${p.process} (this one)` : p.process
  const cells = [name, f.connections, f.channels, f.sse_streams, f.subscriptions, f.draining ? 'draining' : 'serving']
  return el('tr', {}, ...cells.map((c) => el('td', { textContent: String(c) })))
}

function bytes(n) {
  if (n < 1024) return `${n} B`
  if (n < 1 << 20) return `${(n / 1024).toFixed(1)} KiB`
  return `${(n / (1 << 20)).toFixed(1)} MiB`
}

// ---- wiring -------------------------------------------------------------------------

function wire() {
  $('connect-btn').onclick = connect
  $('disconnect-btn').onclick = () => state.socket?.close()
  $('join-btn').onclick = join
  $('bcast-btn').onclick = sendBroadcast
  $('track-btn').onclick = () => track('track')
  $('untrack-btn').onclick = () => track('untrack')
  $('pause-btn').onclick = togglePause
  $('clear-btn').onclick = () => {
    state.log = []
    state.unseen = 0
    renderLog()
  }
  $('msg-filter').oninput = renderLog
  $('target').onchange = renderPresence
  for (const r of document.querySelectorAll('input[name=mode]')) {
    r.onchange = () => {
      const table = document.querySelector('input[name=mode]:checked').value === 'table'
      $('table-fields').hidden = !table
      $('channel-fields').hidden = table
    }
  }
  const fromHash = new URLSearchParams(location.hash.slice(1)).get('key')
  if (fromHash) $('key').value = fromHash
}

wire()
