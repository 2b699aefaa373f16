// Daemon lifecycle against the real engine: cancellation, crashes, one daemon per workspace, the cap, the idle
// timer, the serial queue and disposal.

import assert from 'node:assert/strict'
import { existsSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { after, test } from 'node:test'
import { alive, cleanup, consoleCalls, enginePids, PLUGIN_DIR, startHost, tempDir, textOf, waitFor } from '../testlib/helpers.js'

const HANGING_ENGINE = path.join(PLUGIN_DIR, 'testlib', 'hanging', 'kb_engine.py')

const dirs = []
after(() => cleanup(...dirs))

function workspace() {
  const dir = tempDir('kbrag-life-')
  dirs.push(dir)
  return dir
}

/** A file the test-only engine (testlib/hanging) never finishes ingesting: a request that stays in flight. */
function hangingFile(dir) {
  const file = path.join(dir, 'hang.txt')
  writeFileSync(file, 'a request that never ends\n')
  return file
}

async function inFlight(host, cwd, hang) {
  const before = new Set(enginePids())
  const controller = new AbortController()
  const pending = host.call('kb_ingest', { paths: [hang] }, { cwd, signal: controller.signal })
  // The engine is running once its process exists and it has started the ingest (it logs nothing, so wait
  // until the pid shows up and give it a moment to read the request line).
  assert.ok(await waitFor(() => enginePids().some((p) => !before.has(p))), 'engine process did not start')
  const pid = enginePids().find((p) => !before.has(p))
  await new Promise((r) => setTimeout(r, 700))
  return { pending, controller, pid }
}

test('an aborted call kills the engine and the next call restarts it', async () => {
  const cwd = workspace()
  const hang = hangingFile(cwd)
  const host = await startHost({ engine: HANGING_ENGINE })
  try {
    const { pending, controller, pid } = await inFlight(host, cwd, hang)
    assert.ok(alive(pid))
    const t0 = Date.now()
    controller.abort()
    const result = await pending
    assert.equal(result.isError, true)
    assert.match(textOf(result), /cancel|abort/i)
    assert.ok(Date.now() - t0 < 5000, 'abort took too long')
    assert.ok(await waitFor(() => !alive(pid)), 'the aborted engine is still running')
    assert.ok(!enginePids().includes(pid))

    const next = await host.call('kb_stats', {}, { cwd })
    assert.equal(next.isError, false, textOf(next))
    const pids = enginePids()
    assert.equal(pids.length, 1)
    assert.notEqual(pids[0], pid)
  } finally {
    await host.dispose()
  }
})

test('a call queued behind a hung one settles at once when aborted; the hung one keeps its place', async () => {
  const cwd = workspace()
  const hang = hangingFile(cwd)
  const host = await startHost({ engine: HANGING_ENGINE })
  try {
    const { pending, controller, pid } = await inFlight(host, cwd, hang)
    const queued = new AbortController()
    const waiting = host.call('kb_stats', {}, { cwd, signal: queued.signal })
    await new Promise((r) => setTimeout(r, 200))
    const t0 = Date.now()
    queued.abort()
    const r = await waiting
    assert.equal(r.isError, true)
    assert.ok(Date.now() - t0 < 1000, 'the queued call did not settle promptly')
    assert.ok(alive(pid), 'aborting a queued call must not touch the engine')
    controller.abort()
    assert.equal((await pending).isError, true)
  } finally {
    await host.dispose()
  }
})

test('an engine crash fails the call in flight with a clear message and the next call recovers', async () => {
  const cwd = workspace()
  const hang = hangingFile(cwd)
  const host = await startHost({ engine: HANGING_ENGINE })
  try {
    const { pending, pid } = await inFlight(host, cwd, hang)
    process.kill(-pid, 'SIGKILL') // the engine and its reader workers die at once
    const result = await pending
    assert.equal(result.isError, true)
    const text = textOf(result)
    assert.match(text, /kb engine process was killed by SIGKILL while running "ingest"/)
    assert.match(text, /next kb_\* call starts a fresh engine/)

    const next = await host.call('kb_stats', {}, { cwd })
    assert.equal(next.isError, false, textOf(next))
    assert.equal(next.value.docs, 0)
    const pids = enginePids()
    assert.equal(pids.length, 1)
    assert.notEqual(pids[0], pid)
  } finally {
    await host.dispose()
  }
})

test('an engine that died while idle is restarted by the next call', async () => {
  const cwd = workspace()
  const host = await startHost()
  try {
    assert.equal((await host.call('kb_stats', {}, { cwd })).isError, false)
    const [pid] = enginePids()
    process.kill(pid, 'SIGKILL')
    // Dead means reaped: the engine has threads (its watcher), and its main thread shows as a zombie while the
    // others still hold its stdin open, so a line written then is taken and lost with them, which the plugin
    // rightly reports as a call that met a crash. Once the process is gone, a write fails and is sent afresh.
    assert.ok(await waitFor(() => !existsSync(`/proc/${pid}`)), 'the killed engine was not reaped')
    const next = await host.call('kb_stats', {}, { cwd })
    assert.equal(next.isError, false, `${textOf(next)}\nplugin log:\n${host.logs.map((m) => JSON.stringify(m.args)).join('\n')}`)
    assert.deepEqual(enginePids().filter((p) => p === pid), [])
    assert.equal(enginePids().length, 1)
  } finally {
    await host.dispose()
  }
})

test('two workspaces get two daemons and two libraries', async () => {
  const a = workspace()
  const b = workspace()
  const host = await startHost()
  try {
    const ra = await host.call('kb_stats', {}, { cwd: a })
    const rb = await host.call('kb_stats', {}, { cwd: b })
    assert.equal(ra.value.kb_root, path.join(a, '.kb'))
    assert.equal(rb.value.kb_root, path.join(b, '.kb'))
    assert.equal(enginePids().length, 2)
    // Same workspace again: no third process.
    await host.call('kb_stats', {}, { cwd: a })
    assert.equal(enginePids().length, 2)
  } finally {
    await host.dispose()
  }
})

test('at most four daemons run at once; the least recently used idle one is stopped', async () => {
  const host = await startHost()
  try {
    const spaces = [workspace(), workspace(), workspace(), workspace(), workspace()]
    for (const cwd of spaces) assert.equal((await host.call('kb_stats', {}, { cwd })).isError, false)
    assert.ok(await waitFor(() => enginePids().length === 4), `expected 4 engines, saw ${enginePids().length}`)
  } finally {
    await host.dispose()
  }
})

test('requests on one daemon are serialised and matched to their callers', async () => {
  const cwd = workspace()
  const host = await startHost()
  try {
    const results = await Promise.all([
      host.call('kb_stats', {}, { cwd }),
      host.call('kb_search', { query: 'graphene' }, { cwd }),
      host.call('kb_status', {}, { cwd }),
      host.call('kb_dedup', {}, { cwd }),
    ])
    for (const r of results) assert.equal(r.isError, false, textOf(r))
    assert.equal(results[0].value.exists, false)
    assert.equal(results[1].value.query, 'graphene')
    assert.ok(Array.isArray(results[2].value.jobs))
    assert.ok(Array.isArray(results[3].value.groups))
    assert.equal(enginePids().length, 1)
  } finally {
    await host.dispose()
  }
})

test('an idle daemon is stopped after idleMinutes and restarted on demand', async () => {
  const cwd = workspace()
  const host = await startHost({ idleMinutes: 0.01 }) // 0.6 s
  try {
    assert.equal((await host.call('kb_stats', {}, { cwd })).isError, false)
    const [pid] = enginePids()
    assert.ok(pid)
    assert.ok(await waitFor(() => !alive(pid), { timeoutMs: 8000 }), 'idle engine was not stopped')
    assert.equal((await host.call('kb_stats', {}, { cwd })).isError, false)
    assert.equal(enginePids().length, 1)
  } finally {
    await host.dispose()
  }
})

test('disposing the plugin stops every daemon', async () => {
  const host = await startHost()
  const a = workspace()
  const b = workspace()
  await host.call('kb_stats', {}, { cwd: a })
  await host.call('kb_stats', {}, { cwd: b })
  const pids = enginePids()
  assert.equal(pids.length, 2)
  await host.dispose()
  assert.ok(await waitFor(() => pids.every((p) => !alive(p)), { timeoutMs: 6000 }), 'engines survived disposal')
  assert.equal(host.ctx.tools.get('kb_search'), undefined, 'tools stay registered after disposal')
})

test('no console output', () => {
  assert.deepEqual(consoleCalls, [])
})
