// kb-rag host module for DSH: registers the kb_* tools, one system-prompt section, and runs one resident
// `kb_engine.py serve` process per workspace. Named exports only (name, inject, Config, apply): the DSH loader
// prefers a default export and would then drop inject and Config.

import { existsSync, readFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import Schema from '@deepseek-ai/schemastery'
import { AbortedError, DaemonPool, EngineDaemon, EngineError } from './daemon.js'
import { DependencyGate } from './deps.js'
import { ScopeStore } from './scope.js'
import { GUIDANCE_SECTION, createTools } from './tools.js'

export const name = 'kb-rag'
export const inject = ['tools', 'systemPrompt']

const MAX_DAEMONS = 4

export const Config = Schema.object({
  python: Schema.string().default('')
    .description('Python interpreter (3.10+) that runs kb_engine.py; empty: $KB_PYTHON, else the one the kb-rag installer set up, else python3 (python on Windows).'),
  kbRoot: Schema.string().default('.kb')
    .description('Library folder; a relative path is taken from the session workspace.'),
  embedModel: Schema.string().default('')
    .description('Embedding model (hub name or local folder) passed as KB_EMBED_MODEL; "none" switches vectors off; empty keeps the engine default.'),
  rerankModel: Schema.string().default('')
    .description('Cross-encoder for deep search passed as KB_RERANK_MODEL; empty keeps the engine default.'),
  autoPip: Schema.boolean().default(false)
    .description('Install missing Python modules with pip automatically (also enabled by KB_AUTO_PIP=1).'),
  idleMinutes: Schema.number().min(0).default(30)
    .description('Stop a workspace engine after this many idle minutes (0: keep it running).'),
  engine: Schema.string().default('')
    .description('Path of kb_engine.py; empty: the copy shipped with the plugin or the repository.'),
  modelImages: Schema.union(['off', 'auto']).default('off')
    .description('"auto": kb_show pictures, and the pictures a model asks kb_search / kb_rag for, also go to the model as images when the active model reads images. Off by default: DSH 0.1.0-rc.8 keeps images in the session history and fails later requests if the session switches to a text-only model.'),
})

/** kb_engine.py: the configured path, else one next to the package, else the repository root above it. */
export function resolveEnginePath(configured) {
  if (configured) return path.resolve(configured)
  const here = path.dirname(fileURLToPath(import.meta.url))
  const candidates = [path.resolve(here, '..', 'kb_engine.py'), path.resolve(here, '..', '..', 'kb_engine.py')]
  return candidates.find((p) => existsSync(p)) ?? candidates[candidates.length - 1]
}

/** Where the installers record the interpreter they installed the engine's modules into. */
export function installerPythonRecord(env = process.env) {
  return path.join(env.KB_RAG_HOME || path.join(os.homedir(), '.kb-rag'), 'python-path')
}

/**
 * The interpreter that runs the engine: the configured one, else $KB_PYTHON, else the one recorded by
 * scripts/install.sh or install.ps1 (when that file still exists), else python3 (python on Windows).
 */
export function resolvePython(configured, env = process.env) {
  if (configured) return configured
  if (env.KB_PYTHON) return env.KB_PYTHON
  try {
    const recorded = readFileSync(installerPythonRecord(env), 'utf8').split(/\r?\n/)[0].trim()
    if (recorded && existsSync(recorded)) return recorded
  } catch { /* no installer record */ }
  return process.platform === 'win32' ? 'python' : 'python3'
}

const HINTS = {
  job_running: 'A background job is writing to this library: follow it with kb_status and retry when it is done.',
  needs_migration: 'The library was written by an older kb-rag: run kb_ingest with rebuild: true (it migrates and re-parses) and retry.',
  schema_too_new: 'The library was written by a newer kb-rag: update the plugin; nothing was changed.',
  busy: 'Another process holds the library locked: retry in a moment.',
  storage_error: 'kb.sqlite is damaged or not a database: tell the user; kb_clear would start an empty library.',
  not_found: 'Check the path or id and retry.',
  zotero_unreadable: 'Zotero\'s database could not be copied or read: check the zotero_db path.',
  zotero_busy: 'Zotero is writing its database without a pause: retry in a moment (a watched Zotero library retries by itself).',
  model_unavailable: 'The embedding model is not available: check the embedModel option or the network.',
  reply_too_large: 'Ask for less at a time: a smaller top_k or shorter snippets.',
}

function toToolError(error, command) {
  if (error instanceof AbortedError) return error
  if (error instanceof EngineError) {
    const hint = HINTS[error.code]
    return new Error(`kb engine refused "${command}" (${error.code}): ${error.message}${hint ? `. ${hint}` : ''}`)
  }
  return error
}

export function apply(ctx, config) {
  const log = ctx.logger('kb-rag')
  const engine = resolveEnginePath(config.engine)
  const autoPip = config.autoPip || process.env.KB_AUTO_PIP === '1'

  const engineEnv = () => {
    const env = { ...process.env, PYTHONIOENCODING: 'utf-8', PYTHONUNBUFFERED: '1' }
    if (config.embedModel) env.KB_EMBED_MODEL = config.embedModel
    if (config.rerankModel) env.KB_RERANK_MODEL = config.rerankModel
    return env
  }

  const python = resolvePython(config.python)
  log.debug('engine interpreter: %s', python)
  const gate = new DependencyGate({ python, engine, autoPip, env: process.env, log })
  // how this host chose the library, in its words: an answer read from no library says so (`kb_root_from`)
  const chosen = `the kb-rag plugin's kbRoot setting ("${config.kbRoot}" in the workspace; ` +
    'kb-engine finds the same library from any folder inside it); change kbRoot to open another'
  const library = (ws) => ({ kb_root: path.resolve(ws, config.kbRoot), kb_root_from: chosen })
  // Only a running engine keeps watched folders and Zotero libraries in step: one whose library watches any is
  // not stopped for idleness (asked again each time its idle spell ends, since any host may change the list).
  const watches = async (ws, daemon) => {
    const listed = await daemon.request('watch', library(ws))
    return Array.isArray(listed?.sources) && listed.sources.length > 0
  }
  const pool = new DaemonPool({
    max: MAX_DAEMONS,
    idleMs: config.idleMinutes * 60_000,
    log,
    create: (workspace) => new EngineDaemon({ python, engine, cwd: workspace, env: engineEnv(), log }),
    keep: watches,
  })
  const scope = new ScopeStore({ questions: () => ctx.get('userQuestions'), log })

  const workspace = (exec) => {
    const cwd = exec?.agent?.session?.header?.cwd
    if (typeof cwd === 'string' && cwd) return path.resolve(cwd)
    const root = ctx.get('sandboxPolicy')?.workspaceRoot
    if (typeof root === 'string' && root) return path.resolve(root)
    return process.cwd()
  }

  const ready = async (exec) => {
    if (!existsSync(engine)) {
      throw new Error(`kb_engine.py was not found at "${engine}": set the kb-rag plugin option \`engine\` to its path, or reinstall the plugin.`)
    }
    await gate.check({ signal: exec.signal })
  }

  const call = async (exec, command, payload) => {
    await ready(exec)
    const ws = workspace(exec)
    const onProgress = (event) => {
      log.debug('%s progress: %s %s/%s %s', command, event.phase ?? '', event.done ?? '', event.total ?? '', event.path ?? '')
    }
    try {
      return await pool.request(ws, command, { ...payload, ...library(ws) }, { signal: exec.signal, onProgress })
    } catch (error) {
      throw toToolError(error, command)
    }
  }

  ctx.systemPrompt.section({ name: 'tool:kb', order: 160, text: GUIDANCE_SECTION })
  const images = config.modelImages === 'auto' ? { attachments: () => ctx.get('attachments'), llm: () => ctx.get('llm') } : null
  for (const tool of createTools({ call, ready, workspace, scope, log, images })) ctx.tools.register(tool)

  // A library with watched sources is kept in step from the moment the host starts, not from the first kb_* call:
  // the engine of the host's own workspace is started now when its library exists, and let go at once when the
  // library watches nothing.
  const starting = new AbortController()
  const watchFromStart = async () => {
    const ws = workspace(null)
    if (!existsSync(path.join(library(ws).kb_root, 'kb.sqlite')) || !existsSync(engine)) return
    try {
      await gate.check({ signal: starting.signal })
      if (starting.signal.aborted) return
      const listed = await pool.request(ws, 'watch', library(ws), { signal: starting.signal })
      const count = Array.isArray(listed?.sources) ? listed.sources.length : 0
      if (count) log.debug('keeping %d watched source(s) of %s in step', count, library(ws).kb_root)
      else pool.release(ws)
    } catch (error) {
      log.debug('the engine was not started for watched sources: %s', error?.message ?? error)
    }
  }
  watchFromStart()

  ctx.effect(() => () => {
    starting.abort()
    return pool.closeAll()
  })
}
