// Session scope (kb / both / web + strict): asked once per session through userQuestions, kb by default when
// there is no UI, on errors and on timeout; kb_scope reads and sets it. The stale-documents notice is given once
// per session.

import assert from 'node:assert/strict'
import { execFileSync } from 'node:child_process'
import path from 'node:path'
import { after, before, test } from 'node:test'
import { ScopeStore } from '../src/scope.js'
import { PYTHON, agentFor, cleanup, consoleCalls, samplePapers, startHost, tempDir, textOf } from '../testlib/helpers.js'

let cwd
before(async () => {
  cwd = tempDir('kbrag-scope-')
  samplePapers(path.join(cwd, 'papers'))
  const host = await startHost()
  const r = await host.call('kb_ingest', { paths: ['papers'] }, { cwd })
  assert.equal(r.isError, false, textOf(r))
  await host.dispose()
})
after(() => cleanup(cwd))

/** A plugin that provides a scripted userQuestions service and records each request. */
function questionsPlugin(answer) {
  const requests = []
  return {
    requests,
    plugin: {
      name: 'fake-questions',
      apply(ctx) {
        ctx.provide('userQuestions', {
          async ask(request) {
            requests.push(request)
            return typeof answer === 'function' ? answer(request) : answer
          },
        })
      },
    },
  }
}

test('headless (no userQuestions service): scope is kb, not strict, and no question blocks the call', async () => {
  const host = await startHost()
  try {
    const r = await host.call('kb_search', { query: 'graphene' }, { cwd })
    assert.equal(r.isError, false, textOf(r))
    assert.deepEqual({ scope: r.value.session.scope, strict: r.value.session.strict, source: r.value.session.scope_source },
      { scope: 'kb', strict: false, source: 'default' })
    assert.match(textOf(r), /_Scope: library only: answer from these passages and cite them\._/)
  } finally {
    await host.dispose()
  }
})

test('the user is asked once per session, and the answer shapes every retrieval of that session', async () => {
  const fake = questionsPlugin({ answers: [{ id: 'kb-scope', selected: ['both'] }, { id: 'kb-strict', selected: ['strict'] }] })
  const host = await startHost({}, { before: [fake.plugin] })
  try {
    const agent = agentFor(cwd, 'session-1')
    const first = await host.call('kb_search', { query: 'graphene' }, { agent })
    assert.equal(first.isError, false, textOf(first))
    assert.equal(first.value.session.scope, 'both')
    assert.equal(first.value.session.strict, true)
    assert.match(textOf(first), /_Scope: library and web.*strict/)
    assert.equal(first.meta.scope, 'both')
    assert.equal(first.meta.strict, true)

    const rag = await host.call('kb_rag', { query: 'graphene' }, { agent })
    assert.equal(rag.value.session.scope, 'both')
    assert.equal(fake.requests.length, 1, 'asked more than once in one session')

    const request = fake.requests[0]
    assert.equal(request.agent, agent)
    assert.ok(request.signal instanceof AbortSignal)
    assert.deepEqual(request.questions.map((q) => q.id), ['kb-scope', 'kb-strict'])
    assert.deepEqual(request.questions[0].options.map((o) => o.label), ['kb', 'both', 'web'])

    const scope = await host.call('kb_scope', {}, { agent })
    assert.deepEqual(scope.value, { scope: 'both', strict: true, source: 'user' })

    // Another session is asked again.
    await host.call('kb_search', { query: 'graphene' }, { agent: agentFor(cwd, 'session-2') })
    assert.equal(fake.requests.length, 2)
  } finally {
    await host.dispose()
  }
})

test('a failing question service (e.g. NO_PROVIDER) falls back to kb', async () => {
  const fake = questionsPlugin(() => {
    const error = new Error('no UI is connected')
    error.code = 'NO_PROVIDER'
    throw error
  })
  const host = await startHost({}, { before: [fake.plugin] })
  try {
    const agent = agentFor(cwd, 'session-np')
    const r = await host.call('kb_search', { query: 'graphene' }, { agent })
    assert.equal(r.isError, false, textOf(r))
    assert.equal(r.value.session.scope, 'kb')
    assert.equal(r.value.session.strict, false)
    await host.call('kb_search', { query: 'copper' }, { agent })
    assert.equal(fake.requests.length, 1, 'a failed question is not asked again in the session')
  } finally {
    await host.dispose()
  }
})

test('kb_scope sets the scope; later retrievals do not ask', async () => {
  const fake = questionsPlugin({ answers: [] })
  const host = await startHost({}, { before: [fake.plugin] })
  try {
    const agent = agentFor(cwd, 'session-set')
    const set = await host.call('kb_scope', { scope: 'web' }, { agent })
    assert.deepEqual(set.value, { scope: 'web', strict: false, source: 'tool' })
    assert.match(textOf(set), /scope for this session: \*\*web\*\*/)
    const strict = await host.call('kb_scope', { strict: true }, { agent })
    assert.deepEqual(strict.value, { scope: 'web', strict: true, source: 'tool' })
    const r = await host.call('kb_search', { query: 'graphene' }, { agent })
    assert.equal(r.value.session.scope, 'web')
    assert.match(textOf(r), /_Scope: web first/)
    assert.equal(fake.requests.length, 0)
  } finally {
    await host.dispose()
  }
})

test('an unanswered question times out to kb and is withdrawn', async () => {
  let seen
  const store = new ScopeStore({
    askTimeoutMs: 150,
    questions: () => ({
      ask(request) {
        seen = request
        return new Promise(() => {}) // never answered
      },
    }),
  })
  const t0 = Date.now()
  const state = await store.ensure('s', { agent: {}, signal: new AbortController().signal })
  assert.deepEqual(state, { scope: 'kb', strict: false, source: 'default' })
  assert.ok(Date.now() - t0 < 2000)
  assert.equal(seen.signal.aborted, true, 'the pending question was not withdrawn')
  assert.deepEqual(store.get('s'), state)
})

test('stale documents are mentioned once per session', async () => {
  // Mark the library as written by an older parser revision.
  execFileSync(PYTHON, ['-c', 'import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute("UPDATE docs SET indexed_with = 1"); c.commit()',
    path.join(cwd, '.kb', 'kb.sqlite')])
  const host = await startHost()
  try {
    const agent = agentFor(cwd, 'session-stale')
    const first = await host.call('kb_search', { query: 'graphene' }, { agent })
    assert.equal(first.isError, false, textOf(first))
    assert.equal(first.value.notices.length, 1)
    assert.match(textOf(first), /_Library: 5 document\(s\) were indexed by an older parser.*metadata\\_only: true.*rebuild: true/)
    const second = await host.call('kb_rag', { query: 'graphene' }, { agent })
    assert.deepEqual(second.value.notices, [])
    assert.doesNotMatch(textOf(second), /older parser/)
    const other = await host.call('kb_search', { query: 'graphene' }, { agent: agentFor(cwd, 'session-stale-2') })
    assert.equal(other.value.notices.length, 1)

    const stats = await host.call('kb_stats', {}, { agent })
    assert.equal(stats.value.stale_docs, 5)
    assert.match(textOf(stats), /5 document\(s\) were indexed by an older parser/)
  } finally {
    await host.dispose()
  }
})

test('no console output', () => {
  assert.deepEqual(consoleCalls, [])
})
