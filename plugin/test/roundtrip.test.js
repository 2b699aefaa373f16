// Round trip through the real registry and the real engine: ingest generated papers, search, rag, render,
// presentationMeta, the other engine-backed tools, background jobs and the library location.

import assert from 'node:assert/strict'
import path from 'node:path'
import { after, before, test } from 'node:test'
import { cleanup, consoleCalls, samplePapers, startHost, tempDir, textOf, waitFor } from '../testlib/helpers.js'

let host
let cwd
const dirs = []

before(async () => {
  cwd = tempDir('kbrag-rt-')
  dirs.push(cwd)
  samplePapers(path.join(cwd, 'papers'))
  host = await startHost()
})
after(async () => {
  await host?.dispose()
  cleanup(...dirs)
})

/** The value must survive a JSON round trip unchanged: no undefined, NaN or Infinity anywhere. */
function assertLossless(value) {
  assert.deepEqual(JSON.parse(JSON.stringify(value)), value)
}

test('kb_ingest indexes the generated papers (relative paths, progress lines relayed)', async () => {
  const r = await host.call('kb_ingest', { paths: ['papers'] }, { cwd })
  assert.equal(r.isError, false, textOf(r))
  assert.equal(r.value.totals.added, 5)
  assert.equal(r.value.totals.error, 0)
  assert.equal(r.value.kb_root, path.join(cwd, '.kb'))
  assertLossless(r.value)
  assert.match(textOf(r), /Ingest finished.*added 5/)
  const progress = host.logs.filter((m) => m.args.some((a) => String(a).includes('progress')))
  assert.ok(progress.length >= 5, 'progress events were not relayed to the logger')

  const again = await host.call('kb_ingest', { paths: ['papers'] }, { cwd })
  assert.equal(again.value.totals.skipped, 5)
})

test('kb_search finds the passage and renders a sourced Markdown list', async () => {
  const r = await host.call('kb_search', { query: 'graphene nucleation copper', top_k: 3 }, { cwd })
  assert.equal(r.isError, false, textOf(r))
  assertLossless(r.value)
  const top = r.value.results[0]
  assert.match(top.title, /Graphene Nucleation on Copper/)
  const text = textOf(r)
  assert.match(text, /^\*\*Knowledge base: 3 passages\*\* for "graphene nucleation copper"/)
  assert.match(text, /1\. \*\*Oxygen Pre-Treatment Suppresses Graphene Nucleation on Copper Foils\*\* `graphene_cvd_copper\.pdf`\\/)
  assert.match(text, /Alice M\. Chen, Rahul Verma, Sofia Lindqvist · 2019 · Journal of Carbon Materials · Abstract · p\.1/)
  assert.match(text, /\n {3}> .*nucleation/)
  assert.match(text, /_Scope: library only/)
  assert.match(text, /_Note: vector search unavailable/)
  assert.ok(text.length <= 8000)

  // presentationMeta is the same view the Markdown was made from.
  assert.equal(r.meta.kind, 'kb-sources')
  assert.equal(r.meta.tool, 'kb_search')
  assert.equal(r.meta.sources.length, 3)
  assert.equal(r.meta.sources[0].title, top.title)
  assert.equal(r.meta.sources[0].location, `p.${top.page}`)
  assert.equal(r.meta.sources[0].file, 'graphene_cvd_copper.pdf')
  assertLossless(r.meta)
  assert.deepEqual(r.meta, { ...r.value.view, scope: 'kb', strict: false, notices: [] })
  assert.ok(text.startsWith(r.value.markdown.split('\n')[0] + '\n_Scope: library only'), 'the engine\'s Markdown, with the session line')
})

test('kb_search with filters narrows the results', async () => {
  const r = await host.call('kb_search', { query: 'stability', filters: { year: '2000-2100', section: 'Abstract' } }, { cwd })
  assert.equal(r.isError, false, textOf(r))
  assert.ok(r.value.results.length > 0)
  for (const hit of r.value.results) assert.match(hit.section, /Abstract/)
  const none = await host.call('kb_search', { query: 'graphene', filters: { year: 1800 } }, { cwd })
  assert.equal(none.value.results.length, 0)
  assert.match(textOf(none), /no passage found/)
})

test('kb_rag returns evidence, guidance and renders them', async () => {
  const r = await host.call('kb_rag', { query: 'graphene nucleation density copper oxygen' }, { cwd })
  assert.equal(r.isError, false, textOf(r))
  assertLossless(r.value)
  assert.equal(r.value.depth, 'deep')
  assert.ok(r.value.evidence.length >= 1 && r.value.evidence.length <= 3)
  assert.ok(Array.isArray(r.value.evidence[0].citations))
  const text = textOf(r)
  assert.match(text, /evidence passage/)
  assert.match(text, /\*\*Evidence\*\*/)
  assert.match(text, /\*\*How to answer\*\*\nAnswer only from the evidence/)
  assert.equal(r.meta.tool, 'kb_rag')
  assert.match(r.meta.guidance, /Answer only from the evidence/)
  assert.equal(text.split('\n').filter((line) => !line.startsWith('_Scope:')).join('\n'), r.value.markdown)
})

test('kb_stats, kb_dedup and kb_status report on the library', async () => {
  const stats = await host.call('kb_stats', {}, { cwd })
  assert.equal(stats.isError, false, textOf(stats))
  assert.equal(stats.value.indexed_docs, 5)
  assert.match(textOf(stats), /documents: 5 indexed of 5 recorded/)
  assertLossless(stats.value)

  const dedup = await host.call('kb_dedup', {}, { cwd })
  assert.equal(dedup.isError, false, textOf(dedup))
  assert.deepEqual(dedup.value.groups, [])
  assert.match(textOf(dedup), /No duplicate documents/)

  const status = await host.call('kb_status', {}, { cwd })
  assert.equal(status.isError, false, textOf(status))
  assert.deepEqual(status.value.jobs, [])

  const unknown = await host.call('kb_status', { job_id: 'abcdef123456' }, { cwd })
  assert.equal(unknown.isError, true)
  assert.match(textOf(unknown), /kb engine refused "status" \(not_found\)/)
})

test('large ingests run as engine background jobs that kb_status follows', async () => {
  const ws = tempDir('kbrag-job-')
  dirs.push(ws)
  samplePapers(path.join(ws, 'papers'))
  const saved = process.env.KB_ASYNC_THRESHOLD
  process.env.KB_ASYNC_THRESHOLD = '2' // read when the workspace's engine starts
  try {
    const r = await host.call('kb_ingest', { paths: ['papers'] }, { cwd: ws })
    assert.equal(r.isError, false, textOf(r))
    assert.match(r.value.job_id, /^[0-9a-f]+$/)
    const text = textOf(r)
    assert.match(text, /background job/)
    assert.ok(text.includes(`kb_status with {"job_id": "${r.value.job_id}"}`))

    let last
    const done = await waitFor(async () => {
      last = await host.call('kb_status', { job_id: r.value.job_id }, { cwd: ws })
      return ['done', 'failed', 'cancelled'].includes(last.value?.job?.state)
    }, { timeoutMs: 60_000, stepMs: 300 })
    assert.ok(done, `job did not finish: ${textOf(last)}`)
    assert.equal(last.value.job.state, 'done', textOf(last))
    assert.match(textOf(last), /\*\*done\*\*/)
    assert.match(textOf(last), /Result: .*added 5/)

    const search = await host.call('kb_search', { query: 'lithium electrolyte' }, { cwd: ws })
    assert.ok(search.value.results.length > 0)
  } finally {
    if (saved === undefined) delete process.env.KB_ASYNC_THRESHOLD
    else process.env.KB_ASYNC_THRESHOLD = saved
  }
})

test('kbRoot is taken relative to the session workspace', async () => {
  const ws = tempDir('kbrag-root-')
  dirs.push(ws)
  const other = await startHost({ kbRoot: 'library/kb' })
  try {
    const r = await other.call('kb_stats', {}, { cwd: ws })
    assert.equal(r.value.kb_root, path.join(ws, 'library', 'kb'))
    // an answer read from no library says how this host chose it and how to open another, in the plugin's words
    assert.match(r.value.kb_root_from, /the kb-rag plugin's kbRoot setting \("library\/kb" in the workspace/)
    assert.match(textOf(r), /Chosen as the kb-rag plugin's kbRoot setting .*change kbRoot to open another/)
    const search = await other.call('kb_search', { query: 'graphene' }, { cwd: ws })
    assert.equal(search.value.note, `the library at ${path.join(ws, 'library', 'kb')} is empty (${search.value.kb_root_from}): ` +
      'ingest documents first, or open another library')
    assert.doesNotMatch(search.value.note, /named by/)
  } finally {
    await other.dispose()
  }
})

test('kb_clear needs confirm: true, then empties the library', async () => {
  const r = await host.call('kb_clear', { confirm: true }, { cwd })
  assert.equal(r.isError, false, textOf(r))
  assert.equal(r.value.cleared.docs, 5)
  assert.match(textOf(r), /Library cleared.*5 document/)
  const stats = await host.call('kb_stats', {}, { cwd })
  assert.equal(stats.value.docs, 0)
  const search = await host.call('kb_search', { query: 'graphene' }, { cwd })
  assert.equal(search.value.results.length, 0)
})

test('no console output', () => {
  assert.deepEqual(consoleCalls, [])
})
