// Watched folders through the plugin: kb_watch adds a folder in the workspace (relative paths are the workspace's),
// the resident engine syncs a paper copied into it, and the next retrieval carries the engine's notice saying so.

import assert from 'node:assert/strict'
import { copyFileSync, existsSync, mkdirSync, readdirSync, readFileSync } from 'node:fs'
import path from 'node:path'
import { after, before, test } from 'node:test'
import { alive, cleanup, enginePids, samplePapers, startHost, tempDir, textOf, waitFor } from '../testlib/helpers.js'

let cwd, staging
const saved = {}
before(() => {
  cwd = tempDir('kbrag-watch-')
  staging = tempDir('kbrag-watch-papers-')
  samplePapers(staging)
  mkdirSync(path.join(cwd, 'inbox'))
  // the daemon inherits these: files settle in a second, folders are scanned twice a second
  for (const [name, value] of [['KB_WATCH_SETTLE_S', '1'], ['KB_WATCH_SCAN_S', '0.5']]) {
    saved[name] = process.env[name]
    process.env[name] = value
  }
})
after(() => {
  for (const [name, value] of Object.entries(saved)) {
    if (value === undefined) delete process.env[name]
    else process.env[name] = value
  }
  cleanup(cwd)
  cleanup(staging)
})

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

test('a paper copied into a watched folder is found, and the next search says the library changed', async () => {
  const host = await startHost()
  try {
    const watched = await host.call('kb_watch', { add: ['inbox'] }, { cwd })
    assert.equal(watched.isError, false, textOf(watched))
    assert.deepEqual(watched.value.added, [path.join(cwd, 'inbox')])
    assert.match(textOf(watched), /Now watching: `.*inbox`/)

    const first = await host.call('kb_search', { query: 'graphene nucleation' }, { cwd })
    assert.equal(first.isError, false, textOf(first))
    assert.deepEqual(first.value.notices ?? [], [])

    copyFileSync(path.join(staging, 'graphene_cvd_copper.pdf'), path.join(cwd, 'inbox', 'graphene_cvd_copper.pdf'))
    let synced = null
    for (let i = 0; i < 100 && !synced; i++) {
      await sleep(200)
      const status = await host.call('kb_status', {}, { cwd })
      synced = (status.value.jobs ?? []).find((j) => j.command === 'sync' && j.state === 'done')
    }
    assert.ok(synced, 'no sync job ended within 20 s')

    const next = await host.call('kb_search', { query: 'graphene nucleation' }, { cwd })
    assert.equal(next.isError, false, textOf(next))
    assert.ok(next.value.results.some((hit) => hit.file === 'graphene_cvd_copper.pdf'))
    assert.deepEqual(next.value.notices.map((notice) => notice.text),
      ['Since the last search, the watched folders changed the library: 1 paper added. These results include them.'])
    assert.match(textOf(next), /_Library: Since the last search, the watched folders changed the library: 1 paper added/)
    const again = await host.call('kb_search', { query: 'graphene nucleation' }, { cwd })
    assert.deepEqual(again.value.notices, [])       // said once
  } finally {
    await host.dispose()
  }
})

/** The sync jobs of a library that ended, read from its jobs folder (no engine asked). */
function syncsDone(kbRoot) {
  const folder = path.join(kbRoot, '.kb-jobs')
  if (!existsSync(folder)) return []
  return readdirSync(folder).filter((name) => name.endsWith('.json') && name !== 'watcher.json')
    .map((name) => { try { return JSON.parse(readFileSync(path.join(folder, name), 'utf8')) } catch { return {} } })
    .filter((job) => job.command === 'sync' && job.state === 'done')
}

/** Start a host whose own workspace (the folder it was started in) is `dir`. */
async function hostStartedIn(dir, config = {}) {
  const previous = process.cwd()
  process.chdir(dir)
  try {
    return await startHost(config)
  } finally {
    process.chdir(previous)
  }
}

test('a library that watches a folder is kept in step from the start of the host, before any kb_* call', async () => {
  const ws = tempDir('kbrag-watch-start-')
  try {
    mkdirSync(path.join(ws, 'papers'))
    const first = await startHost()
    try {
      assert.equal((await first.call('kb_watch', { add: ['papers'] }, { cwd: ws })).isError, false)
    } finally {
      await first.dispose()
    }
    assert.ok(await waitFor(() => enginePids().length === 0, { timeoutMs: 6000 }), 'the first host left an engine')

    const host = await hostStartedIn(ws)
    try {
      assert.ok(await waitFor(() => enginePids().length === 1, { timeoutMs: 15_000 }), 'no engine was started')
      copyFileSync(path.join(staging, 'graphene_cvd_copper.pdf'), path.join(ws, 'papers', 'graphene_cvd_copper.pdf'))
      assert.ok(await waitFor(() => syncsDone(path.join(ws, '.kb')).some((job) => job.result?.totals?.added === 1),
        { timeoutMs: 30_000, stepMs: 200 }), 'the paper was not synced without a kb_* call')
    } finally {
      await host.dispose()
    }
  } finally {
    cleanup(ws)
  }
})

test('a host whose library watches nothing lets its engine go; an engine that watches is not stopped for idleness', async () => {
  const ws = tempDir('kbrag-watch-idle-')
  try {
    mkdirSync(path.join(ws, 'papers'))
    const host = await hostStartedIn(ws, { idleMinutes: 0.01 })       // an idle spell of 0.6 s
    try {
      assert.equal((await host.call('kb_stats', {}, { cwd: ws })).isError, false)
      const [plain] = enginePids()
      assert.ok(plain && await waitFor(() => !alive(plain), { timeoutMs: 8000 }), 'an engine watching nothing stayed')

      assert.equal((await host.call('kb_watch', { add: ['papers'] }, { cwd: ws })).isError, false)
      const [watching] = enginePids()
      await sleep(3000)                                       // five idle spells
      assert.ok(alive(watching), 'the engine of a library that watches a folder was stopped for idleness')
      assert.equal((await host.call('kb_watch', { remove: ['papers'] }, { cwd: ws })).isError, false)
      assert.ok(await waitFor(() => !alive(watching), { timeoutMs: 8000 }), 'the engine stayed after the last source went')
    } finally {
      await host.dispose()
    }
    // a host started where the library watches nothing starts no engine for good
    const again = await hostStartedIn(ws)
    try {
      await sleep(2500)
      assert.ok(await waitFor(() => enginePids().length === 0, { timeoutMs: 8000 }), 'an engine stayed for nothing')
    } finally {
      await again.dispose()
    }
  } finally {
    cleanup(ws)
  }
})
