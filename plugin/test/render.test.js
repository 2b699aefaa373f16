// Rendering of search/rag values: the Markdown the model reads and the presentationMeta view, checked on engine-
// shaped values that exercise DOIs, page labels, citations, Zotero links, related work and the size budget, and
// through the real registry's render/presentationMeta pipeline.

import assert from 'node:assert/strict'
import { test } from 'node:test'
import { RENDER_BUDGET, buildSourcesView, doiUrl, escapeMd, pageLabel, renderIngest, renderSourcesMarkdown, renderStatus } from '../src/render.js'
import { consoleCalls } from '../testlib/helpers.js'

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

const citations = [
  { marker: '[12]', ref: 12, text: 'C. Wu et al., Nucleation on metals, Carbon 48 (2010)', doi: '10.1000/wu2010', title: 'Nucleation on metals',
    in_library: { doc_id: 7, title: 'Nucleation on metals', doi: '10.1000/wu2010', path: '/lib/papers/wu2010.pdf' } },
  { marker: '[13]', ref: 13, text: 'E. Doe, Another work, J. Ex. 1 (2001)', doi: null, title: null, in_library: null },
]

function ragValue(n = 3, extra = {}) {
  return {
    query: 'graphene nucleation', mode: 'hybrid', depth: 'deep', cached: false, score_kind: 'rerank', reranker: 'BAAI/bge-reranker-base',
    evidence: Array.from({ length: n }, (_, i) => hit({ chunk_id: i + 1, citations, citations_more: 3 })),
    guidance: 'Answer only from the evidence below.',
    related: [{ doc_id: 9, title: 'A related paper', authors: ['A. Smith'], year: 2020, doi: null, path: '/lib/papers/rel.pdf', similarity: 0.7132, reason: 'same author, related topic' }],
    notes: ['not reranked (test)'], note: 'not reranked (test)', lang_note: 'the query is Chinese but 90% of the library is English',
    session: { scope: 'kb', strict: true, notices: ['2 document(s) were indexed by an older parser'] },
    ...extra,
  }
}

test('helpers: DOI links, page labels, escaping', () => {
  assert.equal(doiUrl('10.1000/abc(2021)01'), 'https://doi.org/10.1000/abc%282021%2901')
  assert.equal(doiUrl('https://doi.org/10.1/x y'), 'https://doi.org/10.1/x%20y')
  assert.equal(doiUrl(null), null)
  assert.equal(pageLabel(4, 4, null), 'p.4')
  assert.equal(pageLabel(4, 5, '1187'), 'pp.4–5 (1187)')
  assert.equal(pageLabel(4, 4, '4'), 'p.4')
  assert.equal(pageLabel(null, null, null), '')
  assert.equal(escapeMd('a [1] *b* _c_ `d` <e>\n  f'), 'a \\[1\\] \\*b\\* \\_c\\_ \\`d\\` \\<e> f')
})

test('a deep result renders title link, byline, quote, citations with the in-library mark, related work, guidance', () => {
  const view = buildSourcesView('kb_rag', ragValue(1))
  const md = renderSourcesMarkdown(view)
  assert.match(md, /^\*\*Knowledge base: 1 evidence passage\*\* for "graphene nucleation" \(hybrid · deep · scores: rerank · reranked by BAAI\/bge-reranker-base\)/)
  assert.match(md, /_Scope: library only.*; strict: use nothing but the library/)
  assert.match(md, /_Note: not reranked \(test\)_/)
  assert.match(md, /_Language: the query is Chinese/)
  assert.match(md, /_Library: 2 document\(s\) were indexed by an older parser_/)
  assert.match(md, /1\. \[Graphene growth on copper\]\(https:\/\/doi\.org\/10\.1000\/abc%282021%2901\)\\\n {3}A\. Smith, B\. Jones, C\. Wu et al\. · 2021 · Carbon · Results > Growth · pp\.4–5 \(1187\)\n/)
  assert.match(md, /\n {3}> domains nucleate at copper grain boundaries \\\[12\\\] and coalesce within \\\*minutes\\\*\n/)
  assert.match(md, /- \\\[12\\\] \[Nucleation on metals\]\(https:\/\/doi\.org\/10\.1000\/wu2010\) ✓ in library \(doc 7, `wu2010\.pdf`\)/)
  assert.match(md, /- \\\[13\\\] E\. Doe, Another work/)
  assert.match(md, /- and 3 more cited works/)
  assert.match(md, /\*\*Related work in the library\*\* \(pointers, not evidence\)\n- \*\*A related paper\*\* `rel\.pdf` · A\. Smith · 2020 · same author, related topic · 0\.71/)
  assert.match(md, /\*\*How to answer\*\*\nAnswer only from the evidence below\./)

  const s = view.sources[0]
  assert.equal(s.url, 'https://doi.org/10.1000/abc%282021%2901')
  assert.equal(s.location, 'pp.4–5 (1187)')
  assert.equal(s.citations[0].in_library.file, 'wu2010.pdf')
  assert.equal(s.citations_more, 3)
})

test('without a DOI the title is bold and followed by the file name; Zotero hits get their link', () => {
  const value = { query: 'q', mode: 'keyword', depth: 'quick', results: [hit({ doi: null, zotero_key: 'ABCD1234', zotero_link: 'zotero://open-pdf/library/items/ABCD1234?page=4' })] }
  const md = renderSourcesMarkdown(buildSourcesView('kb_search', value))
  assert.match(md, /1\. \*\*Graphene growth on copper\*\* `smith2021\.pdf`\\/)
  assert.match(md, /\[open in Zotero\]\(zotero:\/\/open-pdf\/library\/items\/ABCD1234\?page=4\)/)
  assert.doesNotMatch(md, /Cited in this passage/) // quick results carry no citations
})

test('no results: a short, helpful answer', () => {
  const md = renderSourcesMarkdown(buildSourcesView('kb_search', { query: 'x', results: [], count: 0, note: 'the library is empty: ingest documents first' }))
  assert.match(md, /\*\*Knowledge base: no passage found\*\* for "x"/)
  assert.match(md, /_Note: the library is empty: ingest documents first_/)
  assert.match(md, /kb_stats/)
})

test('large results are cut down to the budget; Markdown and meta always describe the same sources', () => {
  const long = 'graphene '.repeat(70).trim()
  for (const n of [3, 10, 25, 50]) {
    const value = ragValue(n)
    for (const e of value.evidence) e.snippet = long
    const view = buildSourcesView('kb_rag', value)
    const md = renderSourcesMarkdown(view)
    assert.ok(md.length <= RENDER_BUDGET, `${n} results rendered to ${md.length} characters`)
    assert.equal(view.total, n)
    assert.equal(view.sources.length + view.omitted, n)
    if (view.omitted) assert.match(md, new RegExp(`_${view.omitted} more results? left out`))
    for (const s of view.sources) assert.ok(md.includes(`${s.rank}. [Graphene growth on copper]`))
    assert.deepEqual(JSON.parse(JSON.stringify(view)), view, 'view is not lossless JSON')
  }
  // Small results are left whole.
  const small = buildSourcesView('kb_rag', ragValue(1))
  assert.equal(small.snippet_limit, null)
  assert.equal(small.sources[0].snippet, hit().snippet)
})

test('presenters are pure and tolerate odd values', () => {
  const value = ragValue(2)
  assert.deepEqual(buildSourcesView('kb_rag', value), buildSourcesView('kb_rag', value))
  assert.equal(renderSourcesMarkdown(buildSourcesView('kb_rag', value)), renderSourcesMarkdown(buildSourcesView('kb_rag', value)))
  const odd = buildSourcesView('kb_search', { results: [{ title: null, path: '/x/y.md', authors: null, score: Number.NaN, page: null }] })
  assert.equal(odd.sources[0].title, 'y.md')
  assert.equal(odd.sources[0].score, null)
  assert.deepEqual(JSON.parse(JSON.stringify(odd)), odd)
  assert.doesNotThrow(() => renderSourcesMarkdown(buildSourcesView('kb_search', {})))
})

test('ingest and status summaries point the model at kb_status', () => {
  const started = renderIngest({ job_id: '0d26dab84817', state: 'queued', pending: 40, files: 52, note: '40 files need work' })
  assert.match(started, /background job `0d26dab84817`/)
  assert.match(started, /kb_status with \{"job_id": "0d26dab84817"\}/)
  const running = renderStatus({ job: { job_id: 'j1', command: 'ingest', state: 'running', done: 3, total: 40, phase: 'files', phase_done: 3, phase_total: 40, errors: [] } })
  assert.match(running, /`j1` ingest: \*\*running\*\* 3\/40/)
  assert.match(running, /call kb_status again later/)
  const finished = renderIngest({ files: [{ path: '/p/scan.pdf', status: 'skipped', reason: 'no_text_layer', error: 'no text layer' }], totals: { skipped: 1, files: 1 } })
  assert.match(finished, /`scan\.pdf`: skipped \(no_text_layer\)/)
})

test('no console output', () => {
  assert.deepEqual(consoleCalls, [])
})
