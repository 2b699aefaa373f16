// Dependency gate: before the first engine call, one Python process reports the interpreter's version and every
// module the engine needs that it lacks, so the user gets the complete list in one actionable tool error with the
// exact commands that fix it; with autoPip (or KB_AUTO_PIP=1) the plugin runs pip itself, with a fixed argv, and
// probes again.
// The list of requirements is the engine's (`kb_engine.py requirements`), not a copy kept here: a copy drifts, and
// then the gate either blocks on a module the engine no longer needs or lets through one it does. The version is
// printed before the engine is compiled, so an interpreter too old to parse the engine is still named as such.

import { spawn } from 'node:child_process'
import { existsSync } from 'node:fs'

export const MIN_PYTHON = [3, 10]
const PROBE_TIMEOUT_MS = 60_000
const PIP_TIMEOUT_MS = 30 * 60_000
const OUTPUT_TAIL = 2000

// argv[1] is the engine. Line 1: the interpreter's version and path, flushed before the engine is read (old
// Pythons included: no f-strings, no print(flush=)). Then the engine's own `requirements` command runs in this
// process, its sys.path as when run as a script; its last line is the JSON list of what is missing.
const PROBE_SCRIPT = [
  'import json, os, runpy, sys',
  'sys.stdout.write(json.dumps({"version": list(sys.version_info[:3]), "executable": sys.executable}) + "\\n")',
  'sys.stdout.flush()',
  'engine = sys.argv[1]',
  'sys.argv = [engine, "requirements", "--missing", "--with-docx", "--json"]',
  'sys.path[:] = [os.path.dirname(os.path.abspath(engine))] + [p for p in sys.path if p != ""]',
  'runpy.run_path(engine, run_name="__main__")',
].join('\n')

export class DependencyError extends Error {
  constructor(message, details) {
    super(message)
    this.name = 'DependencyError'
    this.details = details
  }
}

/** Quote one argument for display in a shell command (POSIX and Windows shells both accept double quotes). */
export function quoteArg(arg) {
  return /^[A-Za-z0-9_./:@%+=-]+$/.test(arg) ? arg : `"${arg.replace(/(["\\$`])/g, '\\$1')}"`
}

/** The argv that installs the given requirements with `python -m pip`. */
export function pipArgv(python, requirements) {
  return [python, '-m', 'pip', 'install', ...requirements]
}

/** Run a fixed argv, collect its output. Never throws: `{ code, signal, stdout, stderr, error }`. */
export function runArgv(argv, { timeoutMs, signal, env, cwd } = {}) {
  return new Promise((resolve) => {
    let child
    try {
      child = spawn(argv[0], argv.slice(1), { stdio: ['ignore', 'pipe', 'pipe'], env: env ?? process.env, cwd, windowsHide: true })
    } catch (error) {
      resolve({ code: null, signal: null, stdout: '', stderr: '', error })
      return
    }
    let stdout = ''
    let stderr = ''
    let error = null
    child.stdout.setEncoding('utf8').on('data', (c) => { stdout = (stdout + c).slice(-64_000) })
    child.stderr.setEncoding('utf8').on('data', (c) => { stderr = (stderr + c).slice(-64_000) })
    child.once('error', (e) => { error = e })
    const kill = () => { try { child.kill('SIGKILL') } catch { /* gone */ } }
    const timer = timeoutMs ? setTimeout(() => { error ??= new Error(`timed out after ${Math.round(timeoutMs / 1000)} s`); kill() }, timeoutMs) : null
    const onAbort = () => { error ??= new Error('cancelled'); kill() }
    signal?.addEventListener('abort', onAbort, { once: true })
    child.once('close', (code, sig) => {
      if (timer) clearTimeout(timer)
      signal?.removeEventListener('abort', onAbort)
      resolve({ code, signal: sig, stdout, stderr, error })
    })
  })
}

/** One JSON value from one line of output, or null. */
function parseLine(line) {
  try {
    return JSON.parse(line)
  } catch {
    return null
  }
}

/** A missing-requirement entry of the engine's list, with the fields the messages use. */
function requirementOf(item) {
  if (!item || typeof item.module !== 'string' || typeof item.pip !== 'string' || item.present === true) return null
  return { module: item.module, pip: item.pip, purpose: typeof item.purpose === 'string' ? item.purpose : '', optional: item.optional === true }
}

/**
 * Probe `python` for every module the engine `engine` (the path of kb_engine.py) requires.
 * @returns {Promise<{ok: boolean, python: string, version: number[]|null, executable: string|null,
 *   missing: object[], optionalMissing: object[], problem: string|null, output?: string}>} `output`, what went
 *   wrong in words, comes with `problem: 'probe_failed'`
 */
export async function probe(python, { engine, signal, env } = {}) {
  const base = { python, version: null, executable: null, missing: [], optionalMissing: [], problem: null }
  if (!engine || !existsSync(engine)) {
    return { ...base, ok: false, problem: 'probe_failed', output: `kb_engine.py was not found at "${engine ?? ''}" (set the kb-rag plugin option \`engine\` to its path, or reinstall the plugin)` }
  }
  const result = await runArgv([python, '-c', PROBE_SCRIPT, engine], { timeoutMs: PROBE_TIMEOUT_MS, signal, env })
  if (result.error && result.error.code === 'ENOENT') {
    return { ...base, ok: false, problem: 'not_found' }
  }
  const lines = result.stdout.split('\n').map((l) => l.trim()).filter(Boolean)
  // The first line is the version line (unless something the interpreter loads at startup printed before it).
  const head = lines.map(parseLine).find((v) => v && !Array.isArray(v) && Array.isArray(v.version)) ?? null
  const version = head && head.version.length >= 2 && head.version.every(Number.isInteger) ? head.version : null
  const executable = typeof head?.executable === 'string' ? head.executable : null
  const tooOld = version && (version[0] < MIN_PYTHON[0] || (version[0] === MIN_PYTHON[0] && version[1] < MIN_PYTHON[1]))
  if (tooOld) {
    // Whatever the engine part printed: an interpreter this old is the problem to report.
    return { ...base, version, executable, ok: false, problem: 'too_old' }
  }
  const listed = lines.length ? parseLine(lines[lines.length - 1]) : null
  if (!Array.isArray(listed)) {
    const why = result.error?.message ?? `exit status ${result.code}`
    return { ...base, ok: false, problem: 'probe_failed', output: `${why}; ${(result.stderr || result.stdout).trim().slice(-OUTPUT_TAIL)}` }
  }
  const missing = listed.map(requirementOf).filter(Boolean)
  return {
    ...base,
    version,
    executable,
    missing: missing.filter((m) => !m.optional),
    optionalMissing: missing.filter((m) => m.optional),
    problem: null,
    ok: !missing.some((m) => !m.optional),
  }
}

/** The readable, actionable message for a failed probe (and, when it ran, a failed pip install). */
export function describeProblem(state, { pip } = {}) {
  const py = quoteArg(state.python)
  const lines = []
  if (state.problem === 'not_found') {
    lines.push(`The kb-rag engine needs Python ${MIN_PYTHON.join('.')}+, but no Python interpreter was found at "${state.python}".`,
      'Fix: install Python, or set the kb-rag plugin option `python` to the full path of an interpreter (for example /usr/bin/python3 or C:\\Python312\\python.exe), then restart DSH.')
    return lines.join('\n')
  }
  if (state.problem === 'probe_failed') {
    lines.push(`The kb-rag engine could not check its Python modules with "${state.python}": ${state.output ?? 'unknown error'}.`,
      'Fix: make sure that interpreter runs (`' + py + ' --version`), or set the plugin option `python` to another one.')
    return lines.join('\n')
  }
  if (state.problem === 'too_old') {
    lines.push(`The kb-rag engine needs Python ${MIN_PYTHON.join('.')}+, but "${state.python}" is Python ${state.version.join('.')}.`,
      'Fix: install a newer Python and set the kb-rag plugin option `python` to it, then restart DSH.')
    return lines.join('\n')
  }
  const names = state.missing.map((m) => `${m.module} (${m.purpose})`).join(', ')
  const requirements = state.missing.map((m) => m.pip)
  const install = pipArgv(state.python, requirements).map(quoteArg).join(' ')
  lines.push(`The kb-rag engine cannot run: the Python at "${state.executable ?? state.python}" (${state.version ? state.version.join('.') : 'unknown version'}) lacks ${state.missing.length} required module(s): ${names}.`)
  if (pip) {
    lines.push(`Automatic install was tried (\`${pip.command}\`) and did not succeed: ${pip.summary}`)
  }
  lines.push(
    'Tell the user, and suggest one of these fixes (then retry the tool):',
    `1. Install them: ${install}`,
  )
  if (state.missing.some((m) => m.module === 'torch')) {
    lines.push(`   (a CPU-only torch is much smaller: ${[state.python, '-m', 'pip', 'install', 'torch', '--index-url', 'https://download.pytorch.org/whl/cpu'].map(quoteArg).join(' ')} first)`)
  }
  let n = 2
  if (!pip) lines.push(`${n++}. Let the plugin install them: set the kb-rag plugin option \`autoPip: true\` (or start DSH with KB_AUTO_PIP=1) and restart DSH.`)
  lines.push(`${n}. Use another interpreter that has them: set the kb-rag plugin option \`python\` to its path.`)
  if (state.optionalMissing.length) {
    lines.push(`Optional, not required: ${state.optionalMissing.map((m) => `${m.pip} (${m.purpose})`).join(', ')}.`)
  }
  return lines.join('\n')
}

export class DependencyGate {
  /**
   * @param {object} options
   * @param {string} options.python
   * @param {string} options.engine  the path of kb_engine.py, whose `requirements` command lists what it needs
   * @param {boolean} options.autoPip
   * @param {Record<string,string>} [options.env]
   * @param {{debug: Function, info: Function, warn: Function}} [options.log]
   */
  constructor({ python, engine, autoPip, env, log }) {
    this.python = python
    this.engine = engine
    this.autoPip = autoPip
    this.env = env
    this.log = log ?? { debug() {}, info() {}, warn() {} }
    this.ok = false
    this.pipTried = null
    this.inflight = null
    this.last = null
  }

  /** Resolve when the engine's modules are present; otherwise throw a DependencyError. */
  async check({ signal } = {}) {
    if (this.ok) return
    this.inflight ??= this._check().finally(() => { this.inflight = null })
    const state = await this.inflight
    if (signal?.aborted) throw signal.reason instanceof Error ? signal.reason : new Error('cancelled')
    if (!state.ok) throw new DependencyError(describeProblem(state, { pip: this.pipTried }), state)
  }

  async _check() {
    let state = await probe(this.python, { engine: this.engine, env: this.env })
    if (!state.ok && state.missing.length && !state.problem && this.autoPip && !this.pipTried) {
      const argv = pipArgv(this.python, state.missing.map((m) => m.pip))
      this.log.info('installing missing Python modules: %s', argv.join(' '))
      const result = await runArgv(argv, { timeoutMs: PIP_TIMEOUT_MS, env: this.env })
      const output = (result.stderr || result.stdout).trim().split('\n').slice(-6).join(' | ')
      this.pipTried = {
        command: argv.map(quoteArg).join(' '),
        ok: result.code === 0 && !result.error,
        summary: result.error ? `${result.error.message}` : `pip exited with status ${result.code}${output ? `: ${output.slice(-600)}` : ''}`,
      }
      state = await probe(this.python, { engine: this.engine, env: this.env })
      if (!state.ok && this.pipTried.ok) this.pipTried.summary = 'pip reported success, but the modules are still not importable by this interpreter'
    }
    if (state.ok) {
      this.ok = true
      if (state.optionalMissing.length) this.log.debug('optional Python modules missing: %s', state.optionalMissing.map((m) => m.pip).join(', '))
    } else {
      this.log.debug('dependency probe failed: %s', state.problem ?? state.missing.map((m) => m.module).join(', '))
    }
    this.last = state
    return state
  }
}
