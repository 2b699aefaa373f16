// kb_fetch round trip through the real registry and the real engine, against a local HTTP server on 127.0.0.1
// that plays arXiv (`/pdf/<id>`): the PDF is saved in the library's papers folder, indexed and found by
// kb_search; a 404 becomes a tool error naming fetch_failed and the URL. Nothing leaves the machine.

import assert from 'node:assert/strict'
import { existsSync, readFileSync } from 'node:fs'
import { createServer } from 'node:http'
import path from 'node:path'
import { after, before, test } from 'node:test'
import { cleanup, consoleCalls, samplePapers, startHost, tempDir, textOf } from '../testlib/helpers.js'

let host
let cwd
let server
let base
let pdf
const hits = []

before(async () => {
  cwd = tempDir('kbrag-fetch-')
  const papers = samplePapers(path.join(cwd, 'source'))
  pdf = readFileSync(papers.find((p) => p.endsWith('graphene_cvd_copper.pdf')))
  server = createServer((req, res) => {
    hits.push(req.url)
    if (req.url === '/pdf/2301.05883') {
      res.writeHead(200, { 'Content-Type': 'application/pdf', 'Content-Length': pdf.length })
      res.end(pdf)
      return
    }
    const body = '<html><head><title>404 Not Found</title></head></html>'
    res.writeHead(404, { 'Content-Type': 'text/html', 'Content-Length': Buffer.byteLength(body) })
    res.end(body)
  })
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve))
  base = `http://127.0.0.1:${server.address().port}`
  // The engine daemon takes its environment from process.env when it starts: set it before the first call.
  process.env.KB_ARXIV_URL = base
  process.env.KB_FETCH_TIMEOUT = '10'
  host = await startHost()
})
after(async () => {
  await host?.dispose()
  await new Promise((resolve) => (server ? server.close(resolve) : resolve()))
  delete process.env.KB_ARXIV_URL
  delete process.env.KB_FETCH_TIMEOUT
  cleanup(cwd)
})

test('kb_fetch downloads an arXiv paper from the local server, saves it in the papers folder and indexes it', async () => {
  const r = await host.call('kb_fetch', { identifier: 'arXiv:2301.05883' }, { cwd })
  assert.equal(r.isError, false, textOf(r))
  const saved = path.join(cwd, '.kb', 'papers', 'arXiv_2301.05883.pdf')
  assert.deepEqual(r.value.fetched, {
    identifier: 'arXiv:2301.05883',
    kind: 'arxiv',
    source: 'arxiv',
    url: `${base}/pdf/2301.05883`,
    path: saved,
    bytes: pdf.length,
    doi: '10.48550/arxiv.2301.05883',
  })
  assert.ok(existsSync(saved))
  assert.deepEqual(readFileSync(saved), pdf)
  assert.equal(r.value.totals.added, 1)
  assert.equal(r.value.files[0].status, 'added')
  assert.deepEqual(JSON.parse(JSON.stringify(r.value)), r.value)
  assert.ok(hits.includes('/pdf/2301.05883'))

  const text = textOf(r)
  assert.match(text, /^\*\*Fetched `arXiv:2301\.05883`\*\* from arXiv \(\d+ KiB\)\./)
  assert.ok(text.includes(`Saved as: \`${saved}\``), text)
  assert.match(text, /arXiv_2301\.05883\.pdf/)
  assert.match(text, /Indexed: \*\*Oxygen Pre-Treatment Suppresses Graphene Nucleation on Copper Foils\*\*, added/)
  assert.match(text, /DOI: \[10\.48550\/arxiv\.2301\.05883\]\(https:\/\/doi\.org\/10\.48550\/arxiv\.2301\.05883\)/)
  assert.ok(text.includes(`${base}/pdf/2301.05883`))

  const s = await host.call('kb_search', { query: 'graphene nucleation copper', top_k: 3 }, { cwd })
  assert.equal(s.isError, false, textOf(s))
  assert.match(s.value.results[0].title, /Graphene Nucleation on Copper/)
  assert.equal(s.value.results[0].path, saved)
  assert.match(textOf(s), /Oxygen Pre-Treatment Suppresses Graphene Nucleation on Copper Foils/)

  // Fetching the same identifier again is an unchanged ingest, never a duplicate.
  const again = await host.call('kb_fetch', { identifier: '2301.05883' }, { cwd })
  assert.equal(again.isError, false, textOf(again))
  assert.equal(again.value.totals.added, 0)
  assert.match(textOf(again), /Indexed: .*skipped \(unchanged\)/)
})

test('kb_fetch saves into dest, taken relative to the workspace', async () => {
  const r = await host.call('kb_fetch', { identifier: `${base}/pdf/2301.05883`, dest: 'downloads' }, { cwd })
  assert.equal(r.isError, false, textOf(r))
  assert.equal(r.value.fetched.kind, 'url')
  assert.equal(r.value.fetched.source, 'direct')
  assert.equal(path.dirname(r.value.fetched.path), path.join(cwd, 'downloads'))
  assert.ok(existsSync(r.value.fetched.path))
  assert.match(textOf(r), /from the URL/)
})

test('a 404 from the server is a tool error naming fetch_failed and the URL', async () => {
  const r = await host.call('kb_fetch', { identifier: 'arXiv:2301.99999' }, { cwd })
  assert.equal(r.isError, true)
  const text = textOf(r)
  assert.match(text, /fetch_failed/)
  assert.match(text, /404/)
  assert.ok(text.includes(`${base}/pdf/2301.99999`), text)
  assert.equal(existsSync(path.join(cwd, '.kb', 'papers', 'arXiv_2301.99999.pdf')), false)
})

test('an identifier the engine cannot read is a tool error naming bad_request', async () => {
  const r = await host.call('kb_fetch', { identifier: 'not a paper' }, { cwd })
  assert.equal(r.isError, true)
  assert.match(textOf(r), /bad_request/)
})

test('nothing was written through console', () => {
  assert.deepEqual(consoleCalls, [])
})
