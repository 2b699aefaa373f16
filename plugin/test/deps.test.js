// The dependency gate through the real registry: an interpreter without the engine's modules gives one
// actionable error listing all of them with the exact fix, autoPip tries pip with a fixed argv, and a missing
// interpreter is named. No engine process is started in any of these cases. What counts as required comes from
// the engine itself (`kb_engine.py requirements`), here as in the gate.

import assert from 'node:assert/strict'
import { execFileSync } from 'node:child_process'
import { chmodSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { after, before, test } from 'node:test'
import { DependencyError, DependencyGate, describeProblem, pipArgv, probe, quoteArg } from '../src/deps.js'
import { ENGINE, PYTHON, cleanup, consoleCalls, enginePids, startHost, tempDir, textOf } from '../testlib/helpers.js'

/** The engine's requirements table, as the engine prints it for the test interpreter. */
const REQUIREMENTS = JSON.parse(execFileSync(PYTHON, [ENGINE, 'requirements', '--json', '--with-docx'], { encoding: 'utf8' }))

let venv
let bare // a Python without the engine's modules (and without pip)
let cwd
let fakes // fake interpreters: shell scripts that print what the probe would

before(() => {
  fakes = tempDir('kbrag-fakepy-')
  venv = tempDir('kbrag-venv-')
  cwd = tempDir('kbrag-deps-')
  execFileSync(PYTHON, ['-m', 'venv', '--without-pip', venv], { stdio: 'ignore' })
  bare = path.join(venv, process.platform === 'win32' ? 'Scripts\\python.exe' : 'bin/python')
})
after(() => cleanup(venv, cwd, fakes))

/**
 * An executable that stands in for python. Given the probe's argv (`-c <script> <engine>`) it prints `lines`
 * (each a JSON value or raw text); any other argv fails, naming what it got.
 */
function fakePython(name, lines) {
  const file = path.join(fakes, name)
  const text = lines.map((l) => (typeof l === 'string' ? l : JSON.stringify(l)))
  writeFileSync(file, [
    '#!/bin/sh',
    `if [ "$#" -ne 3 ] || [ "$1" != "-c" ] || [ "$3" != '${ENGINE}' ]; then echo "unexpected argv: $*" >&2; exit 2; fi`,
    "cat <<'EOF'",
    ...text,
    'EOF',
    '',
  ].join('\n'))
  chmodSync(file, 0o755)
  return file
}

test('missing modules: one error lists all of them with the exact fix commands', async () => {
  const host = await startHost({ python: bare })
  try {
    const r = await host.call('kb_search', { query: 'graphene' }, { cwd })
    assert.equal(r.isError, true)
    const text = textOf(r)
    const required = REQUIREMENTS.filter((m) => !m.optional)
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

test('a missing module is reported with the engine\'s pip requirement (fake interpreter)', async () => {
  const torch = REQUIREMENTS.find((m) => m.module === 'torch')
  assert.equal(torch.pip, 'torch>=2.1,<2.14')
  const python = fakePython('python-no-torch', [
    { version: [3, 12, 1], executable: '/opt/fake/bin/python3.12' },
    [{ ...torch, present: false }],
  ])
  const gate = new DependencyGate({ python, engine: ENGINE, autoPip: false })
  const error = await gate.check().then(() => null, (e) => e)
  assert.ok(error instanceof DependencyError, String(error))
  assert.equal(error.details.problem, null)
  assert.deepEqual(error.details.missing, [{ module: 'torch', pip: torch.pip, purpose: torch.purpose, optional: false }])
  assert.deepEqual(error.details.optionalMissing, [])
  assert.match(error.message, /"\/opt\/fake\/bin\/python3\.12" \(3\.12\.1\) lacks 1 required module\(s\): torch \(model inference\)/)
  assert.ok(error.message.includes(`1. Install them: ${pipArgv(python, [torch.pip]).map(quoteArg).join(' ')}`), error.message)
  assert.ok(error.message.includes('"torch>=2.1,<2.14"'), error.message)
  assert.match(error.message, /CPU-only torch/)
})

test('an interpreter that is too old is named as such, whatever the engine part printed (fake interpreter)', async () => {
  const python = fakePython('python-3.8', [
    { version: [3, 8, 10], executable: '/opt/old/bin/python3.8' },
    'SyntaxError: invalid syntax (garbage, not JSON)',
  ])
  const state = await probe(python, { engine: ENGINE })
  assert.equal(state.problem, 'too_old')
  assert.equal(state.ok, false)
  assert.deepEqual(state.version, [3, 8, 10])
  const error = await new DependencyGate({ python, engine: ENGINE, autoPip: true }).check().then(() => null, (e) => e)
  assert.ok(error instanceof DependencyError)
  assert.match(error.message, /needs Python 3\.10\+, but ".*python-3\.8" is Python 3\.8\.10/)
})

test('a probe without usable output fails with its output, and a missing engine file is named', async () => {
  const garbage = await probe(fakePython('python-garbage', ['not json', 'still not json']), { engine: ENGINE })
  assert.equal(garbage.problem, 'probe_failed')
  assert.match(garbage.output, /still not json/)
  const missing = path.join(fakes, 'nowhere', 'kb_engine.py')
  const noEngine = await probe(PYTHON, { engine: missing })
  assert.equal(noEngine.problem, 'probe_failed')
  assert.ok(noEngine.output.includes(`"${missing}"`), noEngine.output)
  assert.ok(describeProblem(noEngine).includes(missing))
})

test('the real interpreter passes a real probe: nothing required is missing', async () => {
  const state = await probe(PYTHON, { engine: ENGINE })
  assert.equal(state.problem, null, JSON.stringify(state))
  assert.deepEqual(state.missing, [])
  assert.equal(state.ok, true)
  assert.ok(Array.isArray(state.version) && state.version.length === 3)
  await new DependencyGate({ python: PYTHON, engine: ENGINE, autoPip: false }).check()
})

test('describeProblem covers an interpreter that is too old', () => {
  const text = describeProblem({ python: 'python3', version: [3, 8, 10], problem: 'too_old', missing: [], optionalMissing: [] })
  assert.match(text, /needs Python 3\.10\+, but "python3" is Python 3\.8\.10/)
})

test('no console output', () => {
  assert.deepEqual(consoleCalls, [])
})
