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

/** Whether the model this call runs on reads images, asked as DSH's own read_image tool asks it. */
async function modelReadsImages(llm, exec) {
  if (typeof llm?.resolveModelInfo !== 'function') return false
  const routed = exec?.agent?.session?.requestHeader?.()?.config
  const provider = routed?.provider ?? exec?.agent?.options?.provider
  const model = routed?.model ?? exec?.agent?.options?.model
  try {
    const info = await llm.resolveModelInfo(provider, model, exec?.signal)
    return Array.isArray(info?.inputModalities) && info.inputModalities.includes('image')
  } catch {
    return false
  }
}

/** The pictures of an answer the model is to see: kb_show's images, or the first `wanted` hits' pictures. */
function picturesFor(tool, value, wanted) {
  if (tool.name === 'kb_show') return (value.images ?? []).filter((i) => typeof i?.data === 'string')
  const hits = value.results ?? value.evidence ?? []
  return hits.map((h) => h?.picture).filter((p) => typeof p?.data === 'string').slice(0, wanted)
}

/**
 * @param {object} kb
 * @param {(exec: object, command: string, payload: object) => Promise<object>} kb.call  run an engine command
 * @param {(exec: object) => Promise<void>} kb.ready  resolves when the engine can run (dependency gate)
 * @param {(exec: object) => string} kb.workspace  the call's workspace
 * @param {import('./scope.js').ScopeStore} kb.scope
 * @param {{debug: Function}} kb.log
 * @param {{attachments: () => any, llm: () => any} | null} [kb.images]  where pictures go to the model as images
 *   (`modelImages: 'auto'`); null keeps them on the cards
 */
export function createTools(kb) {
  /**
   * The session's scope, and what it asks the engine to say about the library beside this answer: the
   * stale-documents notice on the session's first search, what the watched folders changed since its last one.
   * The engine words the notices (the same words the MCP server shows); this host only asks and shows.
   */
  async function sessionInfo(exec, key) {
    const state = await kb.scope.ensure(key, exec)
    const notices = {}
    if (kb.scope.firstStaleMention(key)) notices.stale_notice = true
    const since = kb.scope.sinceLastRetrieval(key, Date.now() / 1000)
    if (since !== null) notices.notices_since = since
    return { session: { scope: state.scope, strict: state.strict, scope_source: state.source }, notices }
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
    const { session, notices } = await sessionInfo(exec, sessionKey(exec, kb.workspace(exec)))
    const budget = engineBudget(sessionLines(session)) // the session's lines share the result's budget
    const pictures = Math.max(payload.pictures ?? 0, CARD_PICTURES)
    const request = { ...payload, ...notices, pictures, render: 'markdown', render_budget: budget }
    return { ...(await kb.call(exec, tool.command, request)), session }
  }

  /** The answer's pictures saved as DSH image attachments when the model reads images; [] otherwise. */
  async function modelImages(tool, value, args, exec) {
    const wanted = tool.name === 'kb_show' ? Infinity : (args.pictures ?? 0)
    const attachments = kb.images?.attachments?.()
    if (!wanted || typeof attachments?.saveImage !== 'function') return []
    const pictures = picturesFor(tool, value, wanted)
    if (!pictures.length || !(await modelReadsImages(kb.images.llm?.(), exec))) return []
    const refs = []
    for (const picture of pictures) {
      refs.push(await attachments.saveImage({ data: Buffer.from(picture.data, 'base64'), mediaType: picture.media_type || 'image/png', name: `kb-passage-p${picture.page}.png` }))
    }
    return refs
  }

  function output(tool) {
    if (tool.command === null) return { schema: OBJECT, render: (_args, value) => [{ type: 'text', text: renderScope(value) }] }
    // after the text, the pictures the model was given (image attachments; none for a text-only model)
    const render = (_args, value) => [{ type: 'text', text: renderResult(value) },
      ...(Array.isArray(value?.model_images) ? value.model_images : []).map((attachment) => ({ type: 'image', attachment }))]
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
      const value = RETRIEVAL_TOOLS.has(tool.name)
        ? await runRetrieval(tool, payload, exec)
        : await kb.call(exec, tool.command, { ...payload, render: 'markdown' })
      if (CARD_TOOLS.has(tool.name)) {
        const images = await modelImages(tool, value, args, exec)
        if (images.length) value.model_images = images
      }
      return clean(value)
    },
  }))
}

/** Cross-tool guidance, one system-prompt section (its text is part of the cached prompt prefix: keep it stable). */
export const GUIDANCE_SECTION = guidanceText(CONTRACT.tools.map((tool) => tool.name))
