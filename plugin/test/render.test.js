// The plugin's part of a result: the engine renders the Markdown and the card's view (tests/test_rendering.py
// holds them); the plugin adds the session's scope and notices after the first line, inside the same budget, and
// answers kb_scope itself. Checked on engine renderings of engine-shaped values.

import assert from 'node:assert/strict'
import { test } from 'node:test'
import { RENDER_BUDGET, cardView, engineBudget, renderResult, renderScope, sessionLines, withHostLines } from '../src/render.js'
import { consoleCalls, engineRendered } from '../testlib/helpers.js'

function hit(overrides = {}) {
  return {
    chunk_id: 11, doc_id: 3, path: '/lib/papers/smith2021.pdf', file: 'smith2021.pdf',
    title: 'Graphene growth on copper', authors: ['A. Smith', 'B. Jones', 'C. Wu', 'D. Roe'], year: 2021,
    journal: 'Carbon', doi: '10.1000/abc(2021)01', kind: 'pdf', section: 'Results > Growth', page: 4, page_end: 5,
    page_label: '1187', char_start: 10, char_end: 300, score: 0.93,
    snippet: 'domains nucleate at copper grain boundaries [12] and coalesce within *minutes*',
    ...overrides,
  }
}

function ragValue(n = 3) {
  return {
    query: 'graphene nucleation', mode: 'hybrid', depth: 'deep', cached: false, score_kind: 'rerank',
    evidence: Array.from({ length: n }, (_, i) => hit({ chunk_id: i + 1 })),
    guidance: 'Answer only from the evidence below.', related: [],
    notes: ['not reranked (test)'], lang_note: 'the query is Chinese but 90% of the library is English',
  }
}

const SESSION = { scope: 'kb', strict: true }
const NOTICES = [{ kind: 'stale_documents', text: '2 document(s) were indexed by an older parser' },
  { kind: 'synced', text: 'a *second* notice' }]

test('the session lines go after the engine\'s first line; the rest is the engine\'s text unchanged', () => {
  const engine = engineRendered('rag', { ...ragValue(1), notices: NOTICES })
  const md = renderResult({ ...engine, session: SESSION })
  const lines = md.split('\n')
  const own = engine.markdown.split('\n')
  assert.match(lines[0], /^\*\*Knowledge base: 1 evidence passage\*\* for "graphene nucleation"/)
  assert.equal(lines[0], own[0])
  assert.equal(lines[1], '_Scope: library only: answer from these passages and cite them; strict: use nothing but the library, and say so when it does not answer._')
  assert.equal(lines[2], '_Library: 2 document(s) were indexed by an older parser_')   // the engine's notices
  assert.equal(lines[3], '_Library: a \\*second\\* notice_')
  assert.deepEqual(lines.slice(2), own.slice(1))
  assert.match(md, /_Note: not reranked \(test\)_\n_Language: the query is Chinese/)
  assert.equal(renderResult(engine), engine.markdown, 'without a session nothing is added')
  assert.equal(withHostLines('one line', ['added']), 'one line\nadded')
})

test('the session lines share the budget: the whole result stays inside it', () => {
  const lines = sessionLines(SESSION)
  const budget = engineBudget(lines)
  assert.equal(budget, RENDER_BUDGET - lines.reduce((n, l) => n + l.length + 1, 0))
  const long = 'graphene '.repeat(70).trim()
  for (const n of [3, 25, 50]) {
    const value = ragValue(n)
    for (const e of value.evidence) e.snippet = long
    const md = renderResult({ ...engineRendered('rag', value, budget), session: SESSION })
    assert.ok(md.length <= RENDER_BUDGET, `${n} results rendered to ${md.length} characters`)
  }
  assert.ok(engineBudget(Array(400).fill('x'.repeat(100))) >= 500, 'never below the contract\'s least budget')
})

test('the card shows the engine\'s view, its notices included, with the session\'s scope', () => {
  const engine = engineRendered('rag', { ...ragValue(2), notices: NOTICES })
  const view = cardView({ ...engine, session: SESSION })
  assert.equal(view.kind, 'kb-sources')
  assert.equal(view.tool, 'kb_rag')
  assert.equal(view.sources.length, 2)
  assert.equal(view.sources[0].url, 'https://doi.org/10.1000/abc%282021%2901')
  assert.equal(view.sources[0].location, 'pp.4–5 (1187)')
  assert.equal(view.scope, 'kb')
  assert.equal(view.strict, true)
  assert.deepEqual(view.notices, NOTICES.map((n) => n.text))
  assert.deepEqual(JSON.parse(JSON.stringify(view)), view, 'view is not lossless JSON')
  assert.deepEqual(cardView({}), { kind: 'kb-sources', sources: [], scope: null, strict: null, notices: [] })
})

test('an answer without the engine\'s Markdown says what to do; kb_scope is the plugin\'s own', () => {
  assert.match(renderResult({ results: [] }), /reinstall the kb-rag plugin/)
  assert.equal(renderScope({ scope: 'both', strict: false, source: 'tool' }),
    'Knowledge-base scope for this session: **both** (set with kb_scope).\nMeaning: library and web: prefer these passages, and mark anything taken from the web as such.')
  assert.match(renderScope({ scope: 'kb', strict: true, source: 'user' }), /\*\*kb\*\*, strict \(chosen by the user\)[\s\S]*strict: answer only from the library/)
})

test('no console output', () => {
  assert.deepEqual(consoleCalls, [])
})
