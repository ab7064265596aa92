// Server logs of a test file. Every process `startProcess` starts (walcast, cdc-worker,
// ws-front) writes all it prints to a file of its own under this file's log directory,
// and when a test fails, the tail of each, with its warnings and errors counted by
// message, is printed after the failure: an intermittent failure then explains itself.
// Passing files print nothing and remove their directory on exit.
//
// `WALCAST_TEST_LOG_DIR`: where the directories go (default: the system's temp dir).
// `WALCAST_TEST_KEEP_LOGS=1`: keep them when every test passed too.
// `WALCAST_TEST_LOG_TAIL`: lines of each log printed on a failure (default 40).
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { afterEach } from 'node:test'

const TAIL = Number(process.env.WALCAST_TEST_LOG_TAIL) || 40
/** Longest line printed (a line may hold a whole change). */
const LINE_CHARS = 400
/** Distinct warning and error messages counted per log, at most. */
const TOP_MESSAGES = 12

let dir
let failed = false
let hookFailureShown = false
const logs = []

function logDir() {
  if (!dir) {
    const base = process.env.WALCAST_TEST_LOG_DIR || os.tmpdir()
    fs.mkdirSync(base, { recursive: true })
    const file = path.basename(process.argv[1] || 'test', '.js').replace(/[^\w.-]/g, '_')
    dir = fs.mkdtempSync(path.join(base, `walcast-js-${file}-`))
  }
  return dir
}

/**
 * Keep everything `child` prints: in memory (`text()`) and in a file of the log
 * directory (`file`), named after the process (`name`) and its order of start.
 */
export function serverLog(name, child) {
  const file = path.join(logDir(), `${String(logs.length + 1).padStart(2, '0')}-${name}.log`)
  const out = fs.createWriteStream(file)
  out.on('error', () => {})
  let text = ''
  const take = (d) => {
    text += d
    out.write(d)
  }
  child.stdout?.on('data', take)
  child.stderr?.on('data', take)
  child.on('exit', () => out.end())
  const log = { name: `${name} (${logs.length + 1})`, file, child, text: () => text }
  logs.push(log)
  return log
}

/** One line as `HH:MM:SS.mmm LEVEL message key=value …` (JSON lines), cut to a length. */
function render(line) {
  let shown = line
  try {
    const { timestamp, level, message, target, ...fields } = JSON.parse(line)
    const extra = Object.entries(fields).map(([k, v]) => `${k}=${typeof v === 'string' ? v : JSON.stringify(v)}`)
    shown = [String(timestamp ?? '').slice(11, 23), level, message, ...extra].join(' ')
  } catch {}
  return shown.length > LINE_CHARS ? `${shown.slice(0, LINE_CHARS)}…` : shown
}

/** Warnings and errors of a log, counted by message, most frequent first. */
function problems(lines) {
  const counts = new Map()
  for (const line of lines) {
    let level, message
    try {
      ;({ level, message } = JSON.parse(line))
    } catch {
      continue
    }
    if (level !== 'WARN' && level !== 'ERROR') continue
    const key = `${level} ${message}`
    const seen = counts.get(key)
    if (seen) seen.n += 1
    else counts.set(key, { n: 1, first: render(line) })
  }
  return [...counts.values()].sort((a, b) => b.n - a.n)
}

function state(child) {
  if (child.exitCode !== null) return `exited ${child.exitCode}`
  if (child.signalCode !== null) return `killed by ${child.signalCode}`
  return `pid ${child.pid}, running`
}

/** The servers' logs, for a failed test. */
export function report(title) {
  if (!logs.length) return
  const out = [`--- server logs after the failure of ${JSON.stringify(title)} (whole logs in ${dir}) ---`]
  for (const log of logs) {
    const lines = log.text().split('\n').filter((l) => l.trim())
    out.push(`=== ${log.name} (${state(log.child)}): ${lines.length} lines, ${path.basename(log.file)}`)
    const counted = problems(lines)
    if (counted.length) {
      out.push('  warnings and errors by message (count, first):')
      for (const { n, first } of counted.slice(0, TOP_MESSAGES)) out.push(`    ${n}× ${first}`)
      if (counted.length > TOP_MESSAGES) out.push(`    … and ${counted.length - TOP_MESSAGES} more messages`)
    }
    const tail = lines.slice(-TAIL)
    if (tail.length) out.push(`  last ${tail.length} lines:`, ...tail.map((l) => `    ${render(l)}`))
  }
  console.error(out.join('\n'))
}

// Registered when a test file imports the harness: at the top level of the file, so for
// every test in it (also those in `describe` blocks). A failed `before` hook fails each
// test with the same error: reported once.
afterEach((t) => {
  if (t.passed !== false) return
  failed = true
  const hook = t.error?.failureType === 'hookFailed'
  if (hook && hookFailureShown) return
  hookFailureShown ||= hook
  report(t.name)
})

process.on('exit', (code) => {
  if (!dir || failed || code !== 0 || process.env.WALCAST_TEST_KEEP_LOGS === '1') return
  try {
    fs.rmSync(dir, { recursive: true, force: true })
  } catch {}
})
