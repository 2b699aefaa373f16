// Dependency gate: before the first engine call, one Python process checks every module the engine imports
// (importlib.util.find_spec, so nothing heavy is imported) and reports the complete list of what is missing.
// A missing module becomes one actionable tool error with the exact commands that fix it; with autoPip (or
// KB_AUTO_PIP=1) the plugin runs pip itself, with a fixed argv, and probes again.

import { spawn } from 'node:child_process'

/** Modules the engine imports, with the pip requirement that provides each: the engine's REQUIREMENTS table
 * (`kb_engine.py requirements --json`); tests/test_installer.py checks that the two agree. */
export const MODULES = [
  { module: 'pymupdf', pip: 'pymupdf>=1.24', purpose: 'PDF reading' },
  { module: 'numpy', pip: 'numpy>=1.24', purpose: 'vectors' },
  { module: 'faiss', pip: 'faiss-cpu>=1.7.4', purpose: 'vector index' },
  { module: 'sentence_transformers', pip: 'sentence-transformers>=2.7', purpose: 'embedding and reranking models' },
  { module: 'torch', pip: 'torch>=2.1,<2.14', purpose: 'model inference' },
  { module: 'docx', pip: 'python-docx>=1.1', purpose: 'DOCX reading', optional: true },
]

export const MIN_PYTHON = [3, 10]
const PROBE_TIMEOUT_MS = 60_000
const PIP_TIMEOUT_MS = 30 * 60_000
const OUTPUT_TAIL = 2000

// Reads the module names (JSON) from argv[1], prints one JSON line. No module is imported.
const PROBE_SCRIPT = [
  'import importlib.util, json, sys',
  'missing = []',
  'for name in json.loads(sys.argv[1]):',
  '    try:',
  '        found = importlib.util.find_spec(name) is not None',
  '    except Exception:',
  '        found = False',
  '    if not found:',
  '        missing.append(name)',
  'print(json.dumps({"version": list(sys.version_info[:3]), "executable": sys.executable, "missing": missing}))',
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

/**
 * Probe `python` for every module in MODULES.
 * @returns {Promise<{ok: boolean, python: string, version: number[]|null, executable: string|null,
 *   missing: object[], optionalMissing: object[], problem: string|null}>}
 */
export async function probe(python, { signal, env } = {}) {
  const names = MODULES.map((m) => m.module)
  const result = await runArgv([python, '-c', PROBE_SCRIPT, JSON.stringify(names)], { timeoutMs: PROBE_TIMEOUT_MS, signal, env })
  const base = { python, version: null, executable: null, missing: [], optionalMissing: [], problem: null }
  if (result.error && result.error.code === 'ENOENT') {
    return { ...base, ok: false, problem: 'not_found' }
  }
  let info = null
  try {
    info = JSON.parse(result.stdout.trim().split('\n').pop())
  } catch {
    info = null
  }
  if (!info || !Array.isArray(info.missing)) {
    const why = result.error?.message ?? `exit status ${result.code}`
    return { ...base, ok: false, problem: 'probe_failed', output: `${why}; ${(result.stderr || result.stdout).trim().slice(-OUTPUT_TAIL)}` }
  }
  const missing = MODULES.filter((m) => info.missing.includes(m.module))
  const version = Array.isArray(info.version) ? info.version : null
  const tooOld = version && (version[0] < MIN_PYTHON[0] || (version[0] === MIN_PYTHON[0] && version[1] < MIN_PYTHON[1]))
  return {
    ...base,
    version,
    executable: typeof info.executable === 'string' ? info.executable : null,
    missing: missing.filter((m) => !m.optional),
    optionalMissing: missing.filter((m) => m.optional),
    problem: tooOld ? 'too_old' : null,
    ok: !tooOld && !missing.some((m) => !m.optional),
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
   * @param {boolean} options.autoPip
   * @param {Record<string,string>} [options.env]
   * @param {{debug: Function, info: Function, warn: Function}} [options.log]
   */
  constructor({ python, autoPip, env, log }) {
    this.python = python
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
    let state = await probe(this.python, { env: this.env })
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
      state = await probe(this.python, { env: this.env })
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
