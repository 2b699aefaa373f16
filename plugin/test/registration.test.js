// Registration: module shape, Config defaults, every tool and its schema exactly as the model sees it, the one
// system-prompt section, argument validation in the real registry, and source hygiene.

import assert from 'node:assert/strict'
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { after, before, test } from 'node:test'
import * as plugin from '../src/index.js'
import { PLUGIN_DIR, cleanup, consoleCalls, enginePids, startHost, tempDir, textOf } from '../testlib/helpers.js'

const TOOLS = ['kb_clear', 'kb_dedup', 'kb_fetch', 'kb_ingest', 'kb_rag', 'kb_scope', 'kb_search', 'kb_show', 'kb_stats', 'kb_status', 'kb_watch', 'kb_zotero']
const SNAPSHOT = path.join(PLUGIN_DIR, 'test', 'fixtures', 'tool-schemas.json')

let host
let cwd
before(async () => {
  cwd = tempDir('kbrag-reg-')
  host = await startHost()
})
after(async () => {
  await host?.dispose()
  cleanup(cwd)
})

test('the module has the named exports DSH loads and no default export', () => {
  assert.equal(plugin.name, 'kb-rag')
  assert.deepEqual(plugin.inject, ['tools', 'systemPrompt'])
  assert.equal(typeof plugin.apply, 'function')
  assert.equal(typeof plugin.Config, 'function')
  assert.equal('default' in plugin, false)
})

test('Config fills the documented defaults and rejects wrong types', () => {
  const config = plugin.Config({})
  assert.deepEqual(config, {
    python: '',
    kbRoot: '.kb',
    embedModel: '',
    rerankModel: '',
    autoPip: false,
    idleMinutes: 30,
    engine: '',
    modelImages: 'off',
  })
  assert.throws(() => plugin.Config({ modelImages: 'always' }))
  assert.throws(() => plugin.Config({ idleMinutes: 'soon' }))
  assert.throws(() => plugin.Config({ idleMinutes: -1 }))
  assert.throws(() => plugin.Config({ autoPip: 'yes' }))
})

test('the interpreter: configured, else KB_PYTHON, else the installer record (when it exists), else python3', () => {
  const home = mkdtempSync(path.join(os.tmpdir(), 'kb-rag-home-'))
  try {
    const fallback = process.platform === 'win32' ? 'python' : 'python3'
    const env = { KB_RAG_HOME: home }
    assert.equal(plugin.installerPythonRecord(env), path.join(home, 'python-path'))
    assert.equal(plugin.resolvePython('', env), fallback)
    const venvPython = path.join(home, 'venv-python')
    writeFileSync(path.join(home, 'python-path'), `${venvPython}\n`)
    assert.equal(plugin.resolvePython('', env), fallback, 'a record naming a missing interpreter is ignored')
    writeFileSync(venvPython, '')
    assert.equal(plugin.resolvePython('', env), venvPython)
    assert.equal(plugin.resolvePython('', { ...env, KB_PYTHON: '/opt/py/bin/python3' }), '/opt/py/bin/python3')
    assert.equal(plugin.resolvePython('/usr/bin/python3.12', { ...env, KB_PYTHON: '/x' }), '/usr/bin/python3.12')
  } finally {
    rmSync(home, { recursive: true, force: true })
  }
})

test('all twelve tools register', () => {
  const names = host.ctx.tools.schemas().map((s) => s.name).sort()
  assert.deepEqual(names, TOOLS)
})

function walk(node, at, visit) {
  if (!node || typeof node !== 'object') return
  visit(node, at)
  for (const [key, value] of Object.entries(node.properties ?? {})) walk(value, `${at}.${key}`, visit)
  if (node.items) walk(node.items, `${at}[]`, visit)
  for (const [i, branch] of (node.oneOf ?? []).entries()) walk(branch, `${at}|${i}`, visit)
}

test('schemas as the model sees them: stable, English, short, explicit nested objects', () => {
  const schemas = host.ctx.tools.schemas().slice().sort((a, b) => a.name.localeCompare(b.name))
  for (const schema of schemas) {
    assert.match(schema.description, /^[\x20-\x7e]+$/, `${schema.name}: description must be plain English ASCII`)
    assert.ok(schema.description.length <= 260, `${schema.name}: description too long (${schema.description.length})`)
    assert.equal(schema.parameters.type, 'object')
    walk(schema.parameters, schema.name, (node, at) => {
      if (node.description) assert.match(node.description, /^[\x20-\x7e]+$/, `${at}: description must be ASCII`)
      if (node.type === 'object' && at !== schema.name) {
        assert.equal(typeof node.additionalProperties, 'boolean', `${at}: nested object without additionalProperties`)
      }
    })
  }
  const byName = Object.fromEntries(schemas.map((s) => [s.name, s]))
  assert.deepEqual(byName.kb_search.parameters.required, ['query'])
  assert.deepEqual(byName.kb_rag.parameters.required, ['query'])
  assert.deepEqual(byName.kb_clear.parameters.required, ['confirm'])
  assert.deepEqual(byName.kb_fetch.parameters.required, ['identifier'])
  assert.equal(byName.kb_search.parameters.properties.filters.additionalProperties, false)
  assert.deepEqual(byName.kb_search.parameters.properties.mode.enum, ['hybrid', 'keyword', 'vector'])
  assert.deepEqual(byName.kb_scope.parameters.properties.scope.enum, ['kb', 'both', 'web'])

  // The exact schemas are part of the prompt-cache prefix: any change must be deliberate
  // (refresh the snapshot with KB_UPDATE_SNAPSHOT=1 npm test).
  const text = JSON.stringify(schemas, null, 2) + '\n'
  if (process.env.KB_UPDATE_SNAPSHOT === '1') writeFileSync(SNAPSHOT, text)
  assert.ok(existsSync(SNAPSHOT), 'no schema snapshot: create it with KB_UPDATE_SNAPSHOT=1 npm test')
  assert.equal(text, readFileSync(SNAPSHOT, 'utf8'), 'tool schemas changed: review, then refresh the snapshot')
})

test('one system-prompt section carries the cross-tool guidance', async () => {
  const assembly = await host.ctx.systemPrompt.assemble()
  const ours = assembly.sections.filter((s) => s.name.startsWith('tool:kb'))
  assert.equal(ours.length, 1)
  assert.match(ours[0].text, /kb_search/)
  assert.match(ours[0].text, /kb_rag/)
  assert.match(ours[0].text, /kb_status/)
  assert.match(ours[0].text, /in queries, one sentence stating the answer the way the paper would/)
  assert.match(ours[0].text, /\(first author, year, section, p\. N\)/)
  assert.match(ours[0].text, /^[\x20-\x7e\n]+$/)
})

async function rejected(name, args, pattern) {
  const r = await host.call(name, args, { cwd })
  assert.equal(r.isError, true, `${name} ${JSON.stringify(args)} should fail`)
  assert.match(textOf(r), pattern)
  return r
}

test('invalid arguments are rejected before any engine starts', async () => {
  await rejected('kb_search', {}, /missing required property "query"/)
  await rejected('kb_search', { query: 'x', top_k: 2.5 }, /"top_k" must be an integer/)
  await rejected('kb_search', { query: 'x', mode: 'fuzzy' }, /mode/)
  await rejected('kb_search', { query: 'x', filters: { colour: 'red' } }, /"filters\.colour" is not a declared property/)
  await rejected('kb_search', { query: 'x', filters: { year: true } }, /year/)
  await rejected('kb_rag', { query: 'x', depth: 'medium' }, /depth/)
  await rejected('kb_ingest', { paths: 'papers' }, /"paths" must be an array/)
  await rejected('kb_clear', {}, /missing required property "confirm"/)
  await rejected('kb_scope', { scope: 'everything' }, /scope/)
  // Checks of the plugin itself (ranges, combinations), still before the engine.
  await rejected('kb_search', { query: '   ' }, /query must be a non-empty string/)
  await rejected('kb_search', { query: 'x', top_k: 0 }, /top_k must be between 1 and 50/)
  await rejected('kb_rag', { query: 'x', top_k: 51 }, /top_k must be between 1 and 50/)
  await rejected('kb_search', { query: 'x', queries: 'y' }, /"queries" must be an array/)
  await rejected('kb_rag', { query: 'x', queries: ['a', 'b', 'c', 'd', 'e'] }, /queries takes at most 4 renderings/)
  await rejected('kb_ingest', {}, /paths is required/)
  await rejected('kb_ingest', { metadata_only: true, rebuild: true }, /cannot be combined/)
  await rejected('kb_clear', { confirm: false }, /needs `confirm: true`/)
  await rejected('kb_status', { cancel: true }, /cancel needs the job_id/)
  await rejected('kb_zotero', { limit: -1 }, /limit must be/)
  assert.deepEqual(enginePids(), [])
})

test('kb_fetch checks its identifier before any engine starts', async () => {
  await rejected('kb_fetch', {}, /missing required property "identifier"/)
  await rejected('kb_fetch', { identifier: '   ' }, /identifier must be a DOI, an arXiv id or an http\(s\) URL/)
  assert.deepEqual(enginePids(), [])
})

test('an engine path that does not exist is reported as such', async () => {
  const other = await startHost({ engine: path.join(cwd, 'missing', 'kb_engine.py') })
  try {
    const r = await other.call('kb_stats', {}, { cwd })
    assert.equal(r.isError, true)
    assert.match(textOf(r), /kb_engine\.py was not found at ".*missing\/kb_engine\.py": set the kb-rag plugin option `engine`/)
    assert.deepEqual(enginePids(), [])
  } finally {
    await other.dispose()
  }
})

test('the plugin sources never use console.*', () => {
  const dir = path.join(PLUGIN_DIR, 'src')
  for (const file of readdirSync(dir)) {
    const text = readFileSync(path.join(dir, file), 'utf8')
    assert.doesNotMatch(text, /\bconsole\s*\./, `${file} uses console`)
  }
})

test('package.json: private ESM dev package without install scripts, peer @deepseek-ai deps', () => {
  const pkg = JSON.parse(readFileSync(path.join(PLUGIN_DIR, 'package.json'), 'utf8'))
  assert.equal(pkg.type, 'module')
  assert.equal(pkg.scripts.test, 'node --test')
  for (const script of ['preinstall', 'install', 'postinstall', 'prepare']) assert.equal(pkg.scripts[script], undefined)
  for (const dep of ['@deepseek-ai/cordis', '@deepseek-ai/dsh-tools', '@deepseek-ai/schemastery']) {
    assert.ok(pkg.peerDependencies[dep], `${dep} must be a peer dependency`)
    assert.ok(pkg.devDependencies[dep], `${dep} must be a dev dependency for the tests`)
    assert.equal(pkg.dependencies?.[dep], undefined, `${dep} must not be bundled`)
  }
  for (const [dep, version] of Object.entries(pkg.devDependencies)) {
    assert.match(version, /^\d+\.\d+\.\d+(-[\w.]+)?$/, `${dep} must be pinned to an exact version`)
  }
})

test('package.json: `npm run lint` is ESLint, a development tool the package never ships', () => {
  const pkg = JSON.parse(readFileSync(path.join(PLUGIN_DIR, 'package.json'), 'utf8'))
  assert.match(pkg.scripts.lint, /^eslint /)
  assert.ok(existsSync(path.join(PLUGIN_DIR, 'eslint.config.js')))
  for (const dep of ['eslint', '@eslint/js', 'globals']) {
    assert.ok(pkg.devDependencies[dep], `${dep} must be a dev dependency`)
    assert.equal(pkg.dependencies?.[dep], undefined, `${dep} must not be a runtime dependency`)
    assert.equal(pkg.peerDependencies?.[dep], undefined, `${dep} must not be asked of the host`)
  }
  assert.deepEqual(pkg.files.filter((entry) => /eslint|test|e2e/.test(entry)), [], 'files lists no lint or test paths')
})

test('no console output', () => {
  assert.deepEqual(consoleCalls, [])
})
