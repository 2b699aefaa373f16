// The kb_* tools, made from the host contract (contract.js): each validates its arguments with the contract's
// checks (the registry checks types first), builds the engine payload, asks the engine to render its answer, and
// returns that answer as its canonical value; `output.render` hands the model the engine's Markdown (with this
// host's session lines in kb_search / kb_rag results) and `presentationMeta` hands the card the engine's view.

import { defineTool } from '@deepseek-ai/dsh-tools'
import { CONTRACT, buildPayload, checkArguments, guidanceText, toParameters } from './contract.js'
import { clean } from './json.js'
import { cardView, engineBudget, renderResult, renderScope, sessionLines } from './render.js'
import { sessionKey } from './scope.js'

const OBJECT = { type: 'object', additionalProperties: true }
const MINUTE = 60_000
const RETRIEVAL_TOOLS = new Set(['kb_search', 'kb_rag'])
const CARD_TOOLS = new Set([...RETRIEVAL_TOOLS, 'kb_show'])
// Source cards show a thumbnail of the first passages highlighted on their page (the engine draws them; each is a
// PNG of at most 640 pixels wide, kept with the card, not shown to the model).
export const CARD_PICTURES = 3

/**
 * @param {object} kb
 * @param {(exec: object, command: string, payload: object) => Promise<object>} kb.call  run an engine command
 * @param {(exec: object) => Promise<void>} kb.ready  resolves when the engine can run (dependency gate)
 * @param {(exec: object) => string} kb.workspace  the call's workspace
 * @param {import('./scope.js').ScopeStore} kb.scope
 * @param {{debug: Function}} kb.log
 */
export function createTools(kb) {
  async function sessionInfo(exec, key) {
    const state = await kb.scope.ensure(key, exec)
    const notices = []
    if (kb.scope.firstStaleMention(key)) {
      try {
        const stats = await kb.call(exec, 'stats', {})
        if (stats.stale_docs > 0) {
          notices.push(`${stats.stale_docs} document(s) were indexed by an older parser, so their pages, citations or metadata may be incomplete. ` +
            'Tell the user once; kb_ingest with metadata_only: true refreshes metadata quickly, rebuild: true re-parses them.')
        }
      } catch (error) {
        if (exec.signal?.aborted) throw error
        kb.log.debug('stale check failed: %s', error.message)
      }
    }
    return { scope: state.scope, strict: state.strict, scope_source: state.source, notices }
  }

  async function runScope(args, exec) {
    const key = sessionKey(exec, kb.workspace(exec))
    let state
    if (args.scope !== undefined || args.strict !== undefined) state = kb.scope.set(key, { scope: args.scope, strict: args.strict }, 'tool')
    else state = kb.scope.get(key) ?? { scope: 'kb', strict: false, source: 'default' }
    return { scope: state.scope, strict: state.strict, source: state.source }
  }

  async function runRetrieval(tool, payload, exec) {
    await kb.ready(exec) // a missing dependency is reported before the user is asked anything
    const session = await sessionInfo(exec, sessionKey(exec, kb.workspace(exec)))
    const budget = engineBudget(sessionLines(session)) // the session's lines share the result's budget
    const pictures = Math.max(payload.pictures ?? 0, CARD_PICTURES)
    return { ...(await kb.call(exec, tool.command, { ...payload, pictures, render: 'markdown', render_budget: budget })), session }
  }

  function output(tool) {
    if (tool.command === null) return { schema: OBJECT, render: (_args, value) => [{ type: 'text', text: renderScope(value) }] }
    const render = (_args, value) => [{ type: 'text', text: renderResult(value) }]
    if (CARD_TOOLS.has(tool.name)) return { schema: OBJECT, render, presentationMeta: (_args, value) => cardView(value) }
    return { schema: OBJECT, render }
  }

  return CONTRACT.tools.map((tool) => defineTool({
    name: tool.name,
    description: tool.description,
    parameters: toParameters(tool),
    ...(tool.timeout_minutes ? { timeoutMs: tool.timeout_minutes * MINUTE } : {}),
    output: output(tool),
    async execute(args, exec) {
      checkArguments(tool, args)
      if (tool.command === null) return clean(await runScope(args, exec))
      const payload = { ...buildPayload(tool, args, kb.workspace(exec)), ...(tool.fixed ?? {}) }
      if (RETRIEVAL_TOOLS.has(tool.name)) return clean(await runRetrieval(tool, payload, exec))
      return clean(await kb.call(exec, tool.command, { ...payload, render: 'markdown' }))
    },
  }))
}

/** Cross-tool guidance, one system-prompt section (its text is part of the cached prompt prefix: keep it stable). */
export const GUIDANCE_SECTION = guidanceText(CONTRACT.tools.map((tool) => tool.name))
