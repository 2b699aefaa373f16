// The Markdown of real engine answers (tests/fixtures/markdown-cases.json, made by tests/markdown_cases.py) is
// the same in both hosts: this renderer and the MCP server's (tests/test_rendering.py) are held to the same
// expected text. A deliberate change of the rendering refreshes the expected text with KB_UPDATE_SNAPSHOT=1 npm test;
// the Python renderer must then follow.

import assert from 'node:assert/strict'
import { readFileSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { test } from 'node:test'
import {
  buildSourcesView, renderClear, renderDedup, renderFetch, renderIngest, renderSourcesMarkdown, renderStats, renderStatus,
  renderZotero,
} from '../src/render.js'
import { PLUGIN_DIR } from '../testlib/helpers.js'

const CASES = path.resolve(PLUGIN_DIR, '..', 'tests', 'fixtures', 'markdown-cases.json')
const sources = (tool) => (value) => renderSourcesMarkdown(buildSourcesView(tool, value))
const RENDER = {
  kb_search: sources('kb_search'),
  kb_rag: sources('kb_rag'),
  kb_ingest: renderIngest,
  kb_zotero: renderZotero,
  kb_stats: renderStats,
  kb_status: renderStatus,
  kb_dedup: renderDedup,
  kb_clear: renderClear,
  kb_fetch: renderFetch,
}

test('every engine answer renders to the expected Markdown', () => {
  const cases = JSON.parse(readFileSync(CASES, 'utf8'))
  assert.ok(cases.length >= 20)
  assert.deepEqual(new Set(cases.map((c) => c.tool)), new Set(Object.keys(RENDER)))
  const rendered = cases.map((c) => ({ ...c, markdown: RENDER[c.tool](c.value) }))
  if (process.env.KB_UPDATE_SNAPSHOT === '1') writeFileSync(CASES, JSON.stringify(rendered, null, 1) + '\n')
  for (const [i, c] of cases.entries()) {
    assert.equal(rendered[i].markdown, c.markdown, `${c.name}: the Markdown changed; review, then KB_UPDATE_SNAPSHOT=1 npm test`)
  }
})
