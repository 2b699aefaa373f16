// The DSH plugin's twins of the MCP server's code meet the shared conformance cases (issue 30):
// tests/fixtures/host-conformance.json (made by tests/conformance_cases.py) holds tool arguments with the check
// message or engine payload each must give, and sessions with a scripted engine (tests/conformance_engine.py)
// with what a serve client must make of each answer. tests/static/test_conformance.py runs the same file against the MCP
// server's contract.py and engine_client.py.

import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import path from 'node:path'
import { after, test } from 'node:test'
import { TOOLS_BY_NAME, buildPayload, checkArguments } from '../src/contract.js'
import { DaemonError, EngineDaemon, EngineError } from '../src/daemon.js'
import { PYTHON, REPO_DIR, cleanup, consoleCalls, tempDir } from '../testlib/helpers.js'

const CASES = JSON.parse(readFileSync(path.join(REPO_DIR, 'tests', 'fixtures', 'host-conformance.json'), 'utf8'))
const FAKE_ENGINE = path.join(REPO_DIR, 'tests', 'conformance_engine.py')
const dirs = []
after(() => cleanup(...dirs))

function outcome({ tool, args }) {
  const spec = TOOLS_BY_NAME[tool]
  try {
    checkArguments(spec, args)
  } catch (error) {
    return { tool, args, failed: error.message }
  }
  return { tool, args, payload: buildPayload(spec, args, CASES.base, CASES.home) }
}

test('payloads and check messages', () => {
  const wrong = CASES.payload.map((c) => [c, outcome(c)]).filter(([c, got]) => {
    try {
      assert.deepStrictEqual(got, c)
      return false
    } catch {
      return true
    }
  })
  assert.equal(wrong.length, 0, `${wrong.length} cases differ, first: ${JSON.stringify(wrong[0])}`)
})

async function step(daemon, s) {
  const progress = []
  try {
    const response = await daemon.request(s.command, s.payload ?? {}, { onProgress: (event) => progress.push(event.done) })
    return { response, progress }
  } catch (error) {
    if (error instanceof EngineError) return { error: error.code, message: error.message }
    if (error instanceof DaemonError) return { crashed: error.message }
    throw error
  }
}

function meets(s, got) {
  if ('response' in s) assert.deepStrictEqual(got.response, s.response, JSON.stringify(got))
  if ('response_has' in s) {
    for (const [key, value] of Object.entries(s.response_has)) assert.deepStrictEqual(got.response?.[key], value, JSON.stringify(got))
  }
  if ('progress' in s) assert.deepStrictEqual(got.progress, s.progress)
  if ('error' in s) assert.equal(got.error, s.error, JSON.stringify(got))
  if ('crashed' in s) {
    assert.ok(got.crashed, JSON.stringify(got))
    for (const words of s.crashed) assert.ok(got.crashed.includes(words), `${got.crashed} lacks ${words}`)
  }
}

for (const c of CASES.client) {
  test(`serve client: ${c.name}`, async () => {
    const cwd = tempDir('kbrag-conf-')
    dirs.push(cwd)
    const daemon = new EngineDaemon({ python: PYTHON, engine: FAKE_ENGINE, cwd, lineLimit: c.line_limit })
    try {
      const results = c.concurrent
        ? await Promise.all(c.steps.map((s) => step(daemon, s)))
        : await c.steps.reduce(async (done, s) => [...(await done), await step(daemon, s)], Promise.resolve([]))
      c.steps.forEach((s, i) => meets(s, results[i]))
      assert.equal(daemon.starts, c.starts)
    } finally {
      await daemon.stop()
    }
  })
}

test('no console output', () => {
  assert.deepEqual(consoleCalls, [])
})
