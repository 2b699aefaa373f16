// Shared fixtures for the tier-A tests: a real Cordis context with the real DSH tool registry and system-prompt
// service, the plugin loaded into it, and the real engine underneath.

import { execFileSync } from 'node:child_process'
import { mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { Context } from '@deepseek-ai/cordis'
import SystemPrompt from '@deepseek-ai/dsh-system-prompt'
import ToolRuntime from '@deepseek-ai/dsh-tools'
import * as plugin from '../src/index.js'

export const PLUGIN_DIR = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
export const REPO_DIR = path.resolve(PLUGIN_DIR, '..')
export const ENGINE = path.join(REPO_DIR, 'kb_engine.py')
export const PYTHON = process.env.KB_TEST_PYTHON || 'python3'

// Fast, offline engine for tests: no vectors, no model download.
process.env.HF_HUB_OFFLINE = '1'
process.env.KB_RERANK_FALLBACK = 'none'

// Any console output from the plugin would corrupt headless DSH's stdout: record every call.
export const consoleCalls = []
for (const method of ['log', 'info', 'warn', 'error', 'debug', 'trace', 'dir']) {
  const original = console[method]
  console[method] = (...args) => {
    consoleCalls.push({ method, args: args.map((a) => String(a)) })
    if (process.env.KB_TEST_SHOW_CONSOLE) original.apply(console, args)
  }
}

export function tempDir(prefix = 'kbrag-') {
  return mkdtempSync(path.join(tmpdir(), prefix))
}

/** Write the sample papers of examples/sample_papers.py into `dir` and return their paths. */
export function samplePapers(dir) {
  execFileSync(PYTHON, [path.join(REPO_DIR, 'examples', 'sample_papers.py'), dir], { stdio: 'ignore' })
  return readdirSync(dir).filter((f) => f.endsWith('.pdf')).map((f) => path.join(dir, f))
}

/** What the engine renders for `answer` as `command`'s answer ({markdown, view}): kb_engine.rendered, called once. */
export function engineRendered(command, answer, budget = null) {
  const script = 'import json, sys; sys.path.insert(0, sys.argv[1]); import kb_engine as k; ' +
    'print(json.dumps(k.rendered(sys.argv[2], json.load(sys.stdin), int(sys.argv[3]) or k.HOST_RENDER_BUDGET)))'
  const argv = ['-c', script, REPO_DIR, command, String(budget ?? 0)]
  return JSON.parse(execFileSync(PYTHON, argv, { input: JSON.stringify(answer), encoding: 'utf8' }))
}

/** A fake live agent whose session runs in `cwd`. */
export function agentFor(cwd, sessionId = `s-${cwd}`) {
  return { session: { id: sessionId, header: { id: sessionId, cwd } } }
}

/**
 * Boot a host: Cordis context + SystemPrompt + ToolRuntime + the plugin (+ optional extra plugins first).
 * Returns helpers to call tools exactly as the agent loop does.
 */
export async function startHost(config = {}, { before = [] } = {}) {
  const ctx = new Context()
  const logs = []
  ctx.logger.exporter({ levels: { default: 3 }, export: (message) => logs.push(message) })
  await ctx.plugin(SystemPrompt)
  await ctx.plugin(ToolRuntime)
  for (const extra of before) await ctx.plugin(extra)
  const fiber = ctx.plugin(plugin, { python: PYTHON, embedModel: 'none', ...config })
  await fiber
  let n = 0
  const call = (name, args = {}, { cwd, signal, agent, session } = {}) => ctx.tools.execute({
    callId: `c${++n}`,
    name,
    arguments: args,
    signal: signal ?? new AbortController().signal,
    ...(agent !== undefined ? (agent ? { agent } : {}) : cwd ? { agent: agentFor(cwd, session) } : {}),
  })
  return { ctx, fiber, call, logs, dispose: () => fiber.dispose() }
}

/** Process ids of the `kb_engine.py serve` children of this test process (Linux /proc). */
export function enginePids() {
  const pids = []
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue
    try {
      const stat = readFileSync(`/proc/${entry}/stat`, 'utf8')
      const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1])
      if (ppid !== process.pid) continue
      const cmd = readFileSync(`/proc/${entry}/cmdline`, 'utf8').split('\0')
      if (cmd.some((a) => a.endsWith('kb_engine.py')) && cmd.includes('serve')) pids.push(Number(entry))
    } catch { /* process ended meanwhile */ }
  }
  return pids.sort((a, b) => a - b)
}

export function alive(pid) {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8')
    return stat.slice(stat.lastIndexOf(')') + 2)[0] !== 'Z'
  } catch {
    return false
  }
}

export async function waitFor(predicate, { timeoutMs = 10_000, stepMs = 50 } = {}) {
  const end = Date.now() + timeoutMs
  while (Date.now() < end) {
    if (await predicate()) return true
    await new Promise((r) => setTimeout(r, stepMs))
  }
  return false
}

export function textOf(result) {
  return result.content.filter((b) => b.type === 'text').map((b) => b.text).join('\n')
}

export function cleanup(...dirs) {
  for (const d of dirs) rmSync(d, { recursive: true, force: true })
}
