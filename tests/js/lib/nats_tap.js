// A minimal NATS subscriber speaking the client protocol over TCP (no dependency): it
// subscribes to one subject pattern and records every message with its headers and
// arrival time, so tests can check on the bus itself who published what, and when.
import net from 'node:net'

const CRLF = Buffer.from('\r\n')

/** Parse `NATS/1.0\r\nName: value\r\n…` into an object with lower-case names. */
function parseHeaders(buf) {
  const headers = {}
  for (const line of buf.toString('utf8').split('\r\n').slice(1)) {
    const i = line.indexOf(':')
    if (i > 0) headers[line.slice(0, i).trim().toLowerCase()] = line.slice(i + 1).trim()
  }
  return headers
}

/**
 * Subscribe to `subject` on the server at `url` (nats://host:port). Resolves once the
 * server confirmed the subscription (a PING answered after the SUB). `tap.messages` holds
 * `{ subject, headers, payload, at }` in arrival order (`at`: `performance.now()`).
 */
export async function natsTap(url, subject) {
  const { hostname, port } = new URL(url)
  const socket = net.connect(Number(port), hostname)
  const messages = []
  const errors = []
  let buf = Buffer.alloc(0)
  let pongs = 0
  const waiters = []
  const onPong = () => {
    pongs += 1
    while (waiters.length && waiters[0].n <= pongs) waiters.shift().resolve()
  }
  // One protocol operation at a time from the front of `buf`; false when incomplete.
  const step = () => {
    const eol = buf.indexOf(CRLF)
    if (eol < 0) return false
    const line = buf.subarray(0, eol).toString('utf8')
    const [op, ...args] = line.split(' ')
    if (op === 'MSG' || op === 'HMSG') {
      const total = Number(args[args.length - 1])
      const hdr = op === 'HMSG' ? Number(args[args.length - 2]) : 0
      const start = eol + 2
      if (buf.length < start + total + 2) return false
      const body = buf.subarray(start, start + total)
      messages.push({
        subject: args[0],
        headers: hdr ? parseHeaders(body.subarray(0, hdr)) : {},
        payload: Buffer.from(body.subarray(hdr)),
        at: performance.now(),
      })
      buf = buf.subarray(start + total + 2)
      return true
    }
    buf = buf.subarray(eol + 2)
    if (op === 'PING') socket.write('PONG\r\n')
    else if (op === 'PONG') onPong()
    else if (op === '-ERR') errors.push(line)
    return true
  }
  socket.on('data', (d) => {
    buf = Buffer.concat([buf, d])
    while (step()) {
      // keep parsing
    }
  })
  await new Promise((resolve, reject) => {
    socket.once('connect', resolve)
    socket.once('error', reject)
  })
  socket.on('error', () => {})
  const connect = { verbose: false, pedantic: false, headers: true, no_responders: false, protocol: 1, name: 'walcast-js-tap' }
  socket.write(`CONNECT ${JSON.stringify(connect)}\r\nSUB ${subject} 1\r\n`)
  const flush = () =>
    new Promise((resolve, reject) => {
      const t = setTimeout(() => reject(new Error('nats tap: no PONG within 10 s')), 10000)
      waiters.push({
        n: pongs + waiters.length + 1,
        resolve: () => {
          clearTimeout(t)
          resolve()
        },
      })
      socket.write('PING\r\n')
    })
  await flush()
  if (errors.length) throw new Error(`nats tap: ${errors.join('; ')}`)
  return {
    messages,
    errors,
    /** A round trip to the server (the subscription is in place once it resolves). */
    flush,
    close() {
      socket.destroy()
    },
  }
}
