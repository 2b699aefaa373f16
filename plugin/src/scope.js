// Per-session retrieval scope: where answers should come from (kb = the library, both = library and web,
// web = web first) and whether the library is the only allowed source (strict). The user is asked once per
// session, at the first retrieval, through the optional userQuestions service; without a UI (headless, a
// subagent, no live caller), on error and on timeout the scope is `kb`, not strict.

import { TOOLS_BY_NAME } from './contract.js'

/** The scopes kb_scope accepts, as the host contract lists them. */
export const SCOPES = TOOLS_BY_NAME.kb_scope.input_schema.properties.scope.enum
export const DEFAULT_ASK_TIMEOUT_MS = 120_000
const MAX_SESSIONS = 500

const SCOPE_OPTIONS = [
  { label: 'kb', description: 'Answer from the local library of papers' },
  { label: 'both', description: 'Use the library first, the web as well' },
  { label: 'web', description: 'Prefer web sources; the library is a supplement' },
]
const STRICT_OPTIONS = [
  { label: 'strict', description: 'Only the library: say so when it has no answer' },
  { label: 'flexible', description: 'The model may add general knowledge, marked as such' },
]

/** The session a tool call belongs to; calls without an agent share one key per workspace. */
export function sessionKey(exec, workspace) {
  const session = exec?.agent?.session
  const id = session?.header?.id ?? session?.id
  return id !== undefined && id !== null ? `session:${String(id)}` : `workspace:${workspace}`
}

function abortError(signal) {
  const reason = signal?.reason
  return reason instanceof Error ? reason : new Error('the call was cancelled')
}

export class ScopeStore {
  /**
   * @param {object} options
   * @param {() => any} options.questions  returns the userQuestions service or undefined
   * @param {number} [options.askTimeoutMs]
   * @param {{debug: Function}} [options.log]
   */
  constructor({ questions, askTimeoutMs = DEFAULT_ASK_TIMEOUT_MS, log }) {
    this.questions = questions
    this.askTimeoutMs = askTimeoutMs
    this.log = log ?? { debug() {} }
    this.sessions = new Map()
  }

  _entry(key) {
    let entry = this.sessions.get(key)
    if (!entry) {
      entry = { state: null, asking: null, staleMentioned: false }
      this.sessions.set(key, entry)
      if (this.sessions.size > MAX_SESSIONS) this.sessions.delete(this.sessions.keys().next().value)
    }
    return entry
  }

  /** The session's scope, or null when none was chosen yet. */
  get(key) {
    return this.sessions.get(key)?.state ?? null
  }

  /** Set the scope explicitly (kb_scope); later retrievals do not ask. */
  set(key, { scope, strict }, source = 'tool') {
    const entry = this._entry(key)
    const current = entry.state ?? { scope: 'kb', strict: false }
    entry.state = {
      scope: SCOPES.includes(scope) ? scope : current.scope,
      strict: typeof strict === 'boolean' ? strict : current.strict,
      source,
    }
    return entry.state
  }

  /** When the session's previous retrieval was (Unix seconds; null for its first), remembering `now` as the last:
   * the sync notice counts what watched folders changed in between. */
  sinceLastRetrieval(key, now) {
    const entry = this._entry(key)
    const before = entry.lastRetrieval ?? null
    entry.lastRetrieval = now
    return before
  }

  /** True the first time it is called for a session (the stale-documents notice is given once). */
  firstStaleMention(key) {
    const entry = this._entry(key)
    if (entry.staleMentioned) return false
    entry.staleMentioned = true
    return true
  }

  /** The session's scope, asking the user the first time. Never throws except when `exec.signal` aborts. */
  async ensure(key, exec) {
    const entry = this._entry(key)
    if (entry.state) return entry.state
    if (!entry.asking) {
      entry.asking = this._ask(exec).then((answer) => {
        entry.asking = null
        // A question withdrawn because its call was cancelled is asked again at the next retrieval.
        if (answer.source === 'cancelled') return { scope: 'kb', strict: false, source: 'default' }
        entry.state ??= answer
        return entry.state
      })
    }
    const signal = exec?.signal
    if (!signal) return entry.asking
    if (signal.aborted) throw abortError(signal)
    return await new Promise((resolve, reject) => {
      const onAbort = () => reject(abortError(signal))
      signal.addEventListener('abort', onAbort, { once: true })
      entry.asking.then((state) => {
        signal.removeEventListener('abort', onAbort)
        resolve(state)
      })
    })
  }

  async _ask(exec) {
    const fallback = (why) => {
      this.log.debug('scope defaults to kb (%s)', why)
      return { scope: 'kb', strict: false, source: 'default' }
    }
    const service = this.questions()
    if (!service || typeof service.ask !== 'function') return fallback('no question service')
    if (!exec?.agent) return fallback('no live caller')
    const controller = new AbortController()
    const onAbort = () => controller.abort(exec.signal?.reason)
    exec.signal?.addEventListener('abort', onAbort, { once: true })
    let timer
    const timeout = new Promise((resolve) => {
      timer = setTimeout(() => {
        controller.abort(new Error('no answer in time'))
        resolve('timeout')
      }, this.askTimeoutMs)
    })
    try {
      const asked = Promise.resolve().then(() => service.ask({
        questions: [
          {
            id: 'kb-scope',
            header: 'Knowledge base',
            question: 'Where should answers in this session come from?',
            options: SCOPE_OPTIONS,
          },
          {
            id: 'kb-strict',
            header: 'Strict mode',
            question: 'Should answers stick strictly to the library?',
            options: STRICT_OPTIONS,
          },
        ],
        agent: exec.agent,
        signal: controller.signal,
      }))
      const answer = await Promise.race([asked, timeout])
      if (answer === 'timeout') return fallback('timeout')
      const pick = (id) => {
        const item = answer?.answers?.find?.((a) => a?.id === id)
        return [...(item?.selected ?? []), item?.custom].filter((x) => typeof x === 'string').map((x) => x.trim().toLowerCase())
      }
      const scope = pick('kb-scope').find((x) => SCOPES.includes(x)) ?? 'kb'
      const strict = pick('kb-strict').includes('strict')
      return { scope, strict, source: 'user' }
    } catch (error) {
      if (exec.signal?.aborted) return { scope: 'kb', strict: false, source: 'cancelled' }
      return fallback(error?.code ?? error?.message ?? 'ask failed')
    } finally {
      clearTimeout(timer)
      exec.signal?.removeEventListener('abort', onAbort)
    }
  }
}
