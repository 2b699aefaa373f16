// This host's own lines in a result. The engine renders every answer (kb_rag/rendering.py; the
// Markdown a model reads and, for kb_search / kb_rag, the view a card draws), the same text the MCP server shows;
// the plugin adds only what it alone knows: the session's answering scope, placed after the result's first line
// (the library's notices, which the plugin asks for once per session or since its last search, come in the engine's
// Markdown and view), and kb_scope's answer. Everything here is pure (no I/O, no clock), as DSH requires of
// presenters.

import { CONTRACT } from './contract.js'

/** Search and rag results aim at this many characters in all (DSH trims older results above ~8 KB). */
export const RENDER_BUDGET = CONTRACT.rendering.budget
const MIN_BUDGET = CONTRACT.rendering.min_budget

const SCOPE_LINES = {
  kb: 'library only: answer from these passages and cite them',
  both: 'library and web: prefer these passages, and mark anything taken from the web as such',
  web: 'web first: the user prefers web sources; treat these passages as a supplement',
}
const STRICT_LINE = 'strict: use nothing but the library, and say so when it does not answer'

/** Text that Markdown would otherwise read as markup, escaped (a scope the plugin does not know is plain text). */
export function escapeMd(text) {
  return String(text ?? '').replace(/\s+/g, ' ').trim().replace(/[\\`*_[\]<]/g, '\\$&')
}

/** The line this host adds to a kb_search / kb_rag result: the session's scope. */
export function sessionLines(session) {
  if (!session || typeof session !== 'object' || !session.scope) return []
  return [`_Scope: ${SCOPE_LINES[session.scope] ?? escapeMd(session.scope)}${session.strict ? `; ${STRICT_LINE}` : ''}._`]
}

/** The characters left to the engine's Markdown once the host's lines are in. */
export function engineBudget(lines) {
  const taken = lines.reduce((sum, line) => sum + line.length + 1, 0)
  return Math.max(MIN_BUDGET, RENDER_BUDGET - taken)
}

/** The engine's Markdown with the host's lines after its first line (the header naming the query). */
export function withHostLines(markdown, lines) {
  const text = String(markdown ?? '')
  if (!lines.length) return text
  const [head, ...rest] = text.split('\n')
  return [head, ...lines, ...rest].join('\n')
}

/** The Markdown the model reads for an engine-backed tool's value. */
export function renderResult(value) {
  if (typeof value?.markdown !== 'string') return 'The kb engine sent no Markdown for this answer: reinstall the kb-rag plugin so that its kb_engine.py matches it.'
  return withHostLines(value.markdown, sessionLines(value.session))
}

/** presentationMeta of a kb_search / kb_rag value: the engine's view (its notices included) with the session's scope. */
export function cardView(value) {
  const session = value?.session ?? {}
  const view = value?.view ?? { kind: 'kb-sources', sources: [] }
  return {
    ...view,
    scope: session.scope ?? null,
    strict: session.strict ?? null,
    notices: Array.isArray(view.notices) ? view.notices : [],
  }
}

/** kb_scope's answer: a tool only this host has (the scope lives in its session). */
export function renderScope(value) {
  const source = { user: 'chosen by the user', tool: 'set with kb_scope', default: 'default' }[value.source] ?? value.source
  const meaning = SCOPE_LINES[value.scope]
  return [
    `Knowledge-base scope for this session: **${value.scope}**${value.strict ? ', strict' : ''} (${source}).`,
    meaning ? `Meaning: ${meaning}${value.strict ? '; strict: answer only from the library and say so when it has nothing' : ''}.` : null,
  ].filter((line) => line !== null).join('\n')
}
