// The quick start as a newcomer meets it: `./dev/up` (with the debug build these tests
// run) prints the stack's URLs and keys and writes them to `.env`, and every command it
// prints works as pasted into a new shell in the repository — no variable exported
// (`env -i`): the walcast commands take their settings from `.env`. So does every command
// of the README's `sh` blocks (the ones it shows to paste against this stack).
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn, spawnSync } from 'node:child_process'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { root, freePort, until } from './lib/harness.js'

let up
let envFile
let wroteRootEnv = false
after(async () => {
  if (up && up.exitCode === null) {
    process.kill(-up.pid, 'SIGINT')
    await new Promise((resolve) => up.once('exit', resolve))
  }
  if (wroteRootEnv) fs.rmSync(path.join(root, '.env'), { force: true })
})

/** Run `command` as pasted in a new shell in the repository; `ms` bounds it. */
function pasted(command, ms = 30000) {
  const shell = envFile === '.env' ? command : `set -a; . '${envFile}'; set +a; ${command}`
  const r = spawnSync('timeout', [String(ms / 1000), 'bash', '-c', shell], {
    cwd: root,
    env: { HOME: os.homedir(), PATH: process.env.PATH },
    encoding: 'utf8',
  })
  return { code: r.status, out: r.stdout, err: r.stderr }
}

test('./dev/up prints the stack and commands that work as pasted in a new shell', { timeout: 240000 }, async () => {
  const hadEnv = fs.existsSync(path.join(root, '.env'))
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'walcast-dev-up-'))
  fs.chmodSync(dir, 0o777)
  up = spawn(path.join(root, 'dev', 'up'), [], {
    cwd: root,
    detached: true,
    env: {
      ...process.env,
      WALCAST_DEV_DIR: dir,
      WALCAST_DEV_PG_PORT: String(await freePort()),
      WALCAST_DEV_NATS_PORT: String(await freePort()),
      PORT: String(await freePort()),
      WALCAST_DEV_PROFILE: 'debug',
      LOG_FORMAT: 'json',
    },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  let out = ''
  up.stdout.on('data', (d) => { out += d })
  up.stderr.on('data', (d) => { out += d })
  await until(`./dev/up's block (so far:\n${out})`, () => out.includes('Stop with Ctrl-C.') || up.exitCode !== null, 180000)
  assert.equal(up.exitCode, null, out)

  for (const label of ['API URL', 'WebSocket URL', 'anon key', 'service_role key', 'JWT secret', 'Database URL', 'NATS URL']) {
    assert.match(out, new RegExp(`^ *${label}: \\S+$`, 'm'), `${label} is printed`)
  }
  envFile = out.match(/The local stack \(also in (.+)\):/)[1]
  assert.equal(envFile, hadEnv ? `${dir}/.env` : '.env', 'a .env of its own goes to the state directory')
  wroteRootEnv = envFile === '.env'
  assert.doesNotMatch(out, /note: .* may not SELECT/, 'the demo table is granted before it is enabled')

  const block = out.slice(out.indexOf('Try, in another terminal'), out.indexOf('From JavaScript'))
  const commands = block.split('\n').filter((l) => /^ {2}[^ #]/.test(l)).map((l) => l.trim())
  assert.ok(commands.length >= 8, block)
  const apiUrl = out.match(/API URL: (\S+)/)[1]
  await until('the server answers', async () => (await fetch(`${apiUrl}/health`).catch(() => null))?.ok)
  for (const command of commands) {
    const streaming = /curl -N|walcast tail/.test(command)
    const r = pasted(command, streaming ? 3000 : 30000)
    if (streaming) {
      assert.equal(r.code, 124, `${command}: runs until stopped\n${r.err}`)
      assert.doesNotMatch(r.err, /error|required/i, `${command}\n${r.err}`)
    } else {
      assert.equal(r.code, 0, `${command}\nstdout: ${r.out}\nstderr: ${r.err}`)
    }
    if (command.startsWith('curl -N')) assert.match(r.out, /ready/, `${command}: ${r.out}`)
    if (command.includes('walcast tail')) assert.match(r.err, /^listening on walcast\.realtime\.> at nats:\/\/127\.0\.0\.1:\d+/m, r.err)
    if (command.includes('walcast key')) assert.match(r.out, /^ey[\w-]+\.[\w-]+\.[\w-]+\n$/, r.out)
    if (command.includes('realtime list')) assert.match(r.out, /todos/, r.out)
  }

  await readmeBlocksRun(path.resolve(root, path.dirname(commands.find((c) => c.includes('walcast tail')).split(' ')[0])), apiUrl)

  // `walcast tail --json`: a change as one object with its subject, headers and body.
  const walcast = commands.find((c) => c.includes('walcast tail')).split(' ')[0]
  const tail = spawn('bash', ['-c', `${envFile === '.env' ? '' : `set -a; . '${envFile}'; set +a; `}${walcast} tail --json --count 1`], {
    cwd: root, env: { HOME: os.homedir(), PATH: process.env.PATH }, stdio: ['ignore', 'pipe', 'pipe'],
  })
  let tailOut = ''
  let tailErr = ''
  tail.stdout.on('data', (d) => { tailOut += d })
  tail.stderr.on('data', (d) => { tailErr += d })
  await until(`tail listening (${tailErr})`, () => tailErr.includes('listening on'))
  const insert = commands.find((c) => c.startsWith('psql'))
  assert.equal(pasted(insert).code, 0)
  await until(`tail prints the change (${tailOut}${tailErr})`, () => tail.exitCode !== null, 20000)
  const event = JSON.parse(tailOut.trim())
  assert.equal(event.subject, 'walcast.realtime.default.public.todos')
  assert.ok(event.headers['Walcast-Term'], JSON.stringify(event.headers))
  assert.equal(event.body.record.title, 'hello walcast')
})

/** The README's `sh` blocks, each a list of its lines (comments kept: they are pasted too). */
function readmeBlocks() {
  const blocks = []
  let fenced = false
  let block = null
  for (const line of fs.readFileSync(path.join(root, 'README.md'), 'utf8').split('\n')) {
    if (line.startsWith('```')) {
      if (fenced && block) blocks.push(block)
      block = !fenced && line === '```sh' ? [] : null
      fenced = !fenced
    } else if (block) {
      block.push(line)
    }
  }
  return blocks
}

/**
 * Run each README `sh` block's commands, in order, each in a new shell with the block's
 * setup lines (`export`, `set -a; . ./.env; set +a`) before it. The test's own stack differs
 * from the README's only in its port, and in the build (debug, not release): those two
 * are put in. A command that streams (`curl -N`, `walcast tail`) must still be running
 * after 3 s; any other must succeed, and no answer may be a JSON error.
 */
async function readmeBlocksRun(binDir, apiUrl) {
  const blocks = readmeBlocks()
  assert.ok(blocks.length >= 8, `the README's sh blocks: ${blocks.length}`)
  const local = (line) => line
    .replaceAll('http://127.0.0.1:4000', apiUrl)
    .replaceAll('$PWD/target/release', binDir)
    .replaceAll('./.env', envFile === '.env' ? './.env' : envFile)
  for (const block of blocks) {
    const setup = block.filter((l) => /^(export |set -a)/.test(l)).map(local)
    for (const line of block.filter((l) => l.trim() && !/^(export |set -a|#)/.test(l))) {
      const command = [...setup, local(line)].join('\n')
      const streaming = /curl -N|walcast tail/.test(line)
      const r = pasted(command, streaming ? 3000 : 30000)
      if (streaming) {
        assert.equal(r.code, 124, `README: ${line}: runs until stopped\n${r.err}`)
        assert.doesNotMatch(r.err, /error|required/i, `README: ${line}\n${r.err}`)
      } else {
        assert.equal(r.code, 0, `README: ${line}\nstdout: ${r.out}\nstderr: ${r.err}`)
        assert.doesNotMatch(r.out, /^\{"error"/, `README: ${line}\n${r.out}`)
      }
    }
  }
}
