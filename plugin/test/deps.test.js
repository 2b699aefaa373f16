// The dependency gate through the real registry: an interpreter without the engine's modules gives one
// actionable error listing all of them with the exact fix, autoPip tries pip with a fixed argv, and a missing
// interpreter is named. No engine process is started in any of these cases.

import assert from 'node:assert/strict'
import { execFileSync } from 'node:child_process'
import path from 'node:path'
import { after, before, test } from 'node:test'
import { MODULES, describeProblem, pipArgv, quoteArg } from '../src/deps.js'
import { PYTHON, cleanup, consoleCalls, enginePids, startHost, tempDir, textOf } from '../testlib/helpers.js'

let venv
let bare // a Python without the engine's modules (and without pip)
let cwd

before(() => {
  venv = tempDir('kbrag-venv-')
  cwd = tempDir('kbrag-deps-')
  execFileSync(PYTHON, ['-m', 'venv', '--without-pip', venv], { stdio: 'ignore' })
  bare = path.join(venv, process.platform === 'win32' ? 'Scripts\\python.exe' : 'bin/python')
})
after(() => cleanup(venv, cwd))

test('missing modules: one error lists all of them with the exact fix commands', async () => {
  const host = await startHost({ python: bare })
  try {
    const r = await host.call('kb_search', { query: 'graphene' }, { cwd })
    assert.equal(r.isError, true)
    const text = textOf(r)
    const required = MODULES.filter((m) => !m.optional)
    assert.match(text, new RegExp(`lacks ${required.length} required module\\(s\\)`))
    for (const m of required) assert.ok(text.includes(m.module), `${m.module} not named`)
    // The exact command, with each requirement quoted where a shell needs it.
    const command = pipArgv(bare, required.map((m) => m.pip)).map(quoteArg).join(' ')
    assert.ok(text.includes(`1. Install them: ${command}`), text)
    assert.match(command, /"torch>=2\.1,<2\.14"/)
    assert.match(text, /autoPip: true/)
    assert.match(text, /KB_AUTO_PIP=1/)
    assert.match(text, /option `python`/)
    assert.match(text, /Optional, not required: python-docx/)
    assert.deepEqual(enginePids(), [], 'an engine was started despite missing modules')

    // Every tool that needs the engine is gated, and the gate probes again (the user may have fixed it).
    const again = await host.call('kb_stats', {}, { cwd })
    assert.equal(again.isError, true)
    assert.ok(textOf(again).includes(command))
    assert.deepEqual(enginePids(), [])

    // kb_scope does not need the engine.
    const scope = await host.call('kb_scope', {}, { cwd })
    assert.equal(scope.isError, false)
  } finally {
    await host.dispose()
  }
})

test('a missing module is reported before the user is asked about the scope', async () => {
  const asked = []
  const questions = { name: 'fake-questions', apply: (ctx) => ctx.provide('userQuestions', { ask: async (r) => { asked.push(r); return { answers: [] } } }) }
  const host = await startHost({ python: bare }, { before: [questions] })
  try {
    const r = await host.call('kb_rag', { query: 'graphene' }, { cwd })
    assert.equal(r.isError, true)
    assert.match(textOf(r), /lacks \d+ required module/)
    assert.equal(asked.length, 0)
  } finally {
    await host.dispose()
  }
})

test('autoPip runs pip with a fixed argv, probes again and reports what happened', async () => {
  const host = await startHost({ python: bare, autoPip: true })
  try {
    const r = await host.call('kb_stats', {}, { cwd })
    assert.equal(r.isError, true)
    const text = textOf(r)
    assert.match(text, /Automatic install was tried \(`.+ -m pip install "pymupdf>=1\.24" /)
    assert.doesNotMatch(text, /set the kb-rag plugin option `autoPip: true`/)
    assert.match(text, /2\. Use another interpreter/)
    assert.match(text, /No module named pip/)
    assert.match(text, /1\. Install them:/)
    assert.deepEqual(enginePids(), [])
    assert.ok(host.logs.some((m) => m.type === 'info' && m.args.join(' ').includes('installing missing Python modules')))
  } finally {
    await host.dispose()
  }
})

test('a python option that names no interpreter gives an actionable error', async () => {
  const host = await startHost({ python: path.join(cwd, 'no-such-python') })
  try {
    const r = await host.call('kb_ingest', { paths: ['.'] }, { cwd })
    assert.equal(r.isError, true)
    assert.match(textOf(r), /no Python interpreter was found at ".*no-such-python"/)
    assert.match(textOf(r), /plugin option `python`/)
    assert.deepEqual(enginePids(), [])
  } finally {
    await host.dispose()
  }
})

test('the message for a complete environment is never produced: the real interpreter passes the gate', async () => {
  const host = await startHost()
  try {
    const r = await host.call('kb_stats', {}, { cwd })
    assert.equal(r.isError, false, textOf(r))
  } finally {
    await host.dispose()
  }
})

test('describeProblem covers an interpreter that is too old', () => {
  const text = describeProblem({ python: 'python3', version: [3, 8, 10], problem: 'too_old', missing: [], optionalMissing: [] })
  assert.match(text, /needs Python 3\.10\+, but "python3" is Python 3\.8\.10/)
})

test('no console output', () => {
  assert.deepEqual(consoleCalls, [])
})
