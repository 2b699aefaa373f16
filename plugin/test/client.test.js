// The client bundle: it registers through the page's module loader, puts one keyed toolview on kb_search and
// kb_rag, renders source cards from block.meta (the host's presentationMeta) and falls back to the Markdown text.

import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import path from 'node:path'
import { test } from 'node:test'
import vm from 'node:vm'
import { cardView } from '../src/render.js'
import { PLUGIN_DIR, consoleCalls, engineRendered } from '../testlib/helpers.js'

/** A minimal React stand-in: elements are plain objects, function components are expanded on the spot. */
const React = {
  createElement(type, props, ...children) {
    const all = { ...(props || {}), children: children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false) }
    return typeof type === 'function' ? type(all) : { type, props: all }
  },
}

function load() {
  const registered = []
  const sandbox = { window: { __ModuleLoader__: { load: (entry) => registered.push(entry) } } }
  vm.runInNewContext(readFileSync(path.join(PLUGIN_DIR, 'client', 'index.js'), 'utf8'), sandbox)
  assert.equal(registered.length, 1)
  assert.equal(registered[0].id, 'dsh-kb-rag')
  const required = []
  const exports = registered[0].factory((id) => {
    required.push(id)
    if (id === 'react') return React
    throw new Error(`unexpected require ${id}`)
  })
  return { exports, required }
}

function text(node) {
  if (node === null || node === undefined) return ''
  if (typeof node !== 'object') return String(node)
  return (node.props.children || []).map(text).join('')
}

function find(node, predicate, out = []) {
  if (!node || typeof node !== 'object') return out
  if (predicate(node)) out.push(node)
  for (const child of node.props.children || []) find(child, predicate, out)
  return out
}

const value = {
  query: 'graphene nucleation', mode: 'hybrid', depth: 'deep',
  evidence: [
    { chunk_id: 1, doc_id: 1, title: 'Graphene on copper', authors: ['A. Smith'], year: 2021, journal: 'Carbon', doi: '10.1000/x', section: 'Results', page: 4, page_end: 4, page_label: null, file: 'a.pdf', path: '/lib/a.pdf', snippet: 'domains nucleate', citations: [{ marker: '[3]', ref: 3, text: 'Wu 2010', doi: null, title: 'Wu paper', in_library: { doc_id: 2, title: 'Wu paper', doi: null, path: '/lib/wu.pdf' } }], citations_more: 2 },
    { chunk_id: 2, doc_id: 3, title: 'No DOI paper', authors: [], year: null, journal: null, doi: null, section: '', page: null, page_end: null, page_label: null, file: 'b.md', path: '/lib/b.md', snippet: 'text' },
  ],
}
// The card draws the view the engine makes of this answer, with the session's scope added by the plugin.
const meta = cardView({ ...engineRendered('rag', value), session: { scope: 'both', strict: false, notices: [] } })

test('the bundle registers a factory that needs only react, and a plugin that fills the keyed toolview', () => {
  const { exports, required } = load()
  assert.deepEqual(required, ['react'])
  assert.deepEqual([...exports.inject], ['slots']) // (the bundle runs in its own realm: compare by value)
  const slots = []
  exports.apply({ slots: { register: (seat, view) => slots.push([seat, view]) } })
  assert.deepEqual(slots.map(([seat]) => ({ ...seat })), [{ name: 'tool.call.toolview', key: 'kb_search' }, { name: 'tool.call.toolview', key: 'kb_rag' }, { name: 'tool.call.toolview', key: 'kb_show' }])
  assert.equal(slots[0][1], exports.SourcesView)
  assert.equal(slots[2][1], exports.PictureView)
})

// a 1x1 PNG stands in for the engine's picture: the card only carries it through
const PNG = 'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4AAAAAElFTkSuQmCC'
const picture = { page: 4, width: 640, height: 180, dpi: 150, clip: [50, 100, 300, 170], marks: [[10, 20, 600, 40]], media_type: 'image/png', data: PNG }

test('a source with a picture shows its thumbnail, which opens to the full picture on click', () => {
  const { exports } = load()
  const pictured = cardView({ ...engineRendered('rag', { ...value, evidence: [{ ...value.evidence[0], picture }, value.evidence[1]] }), session: {} })
  const tree = exports.SourcesView({ block: { kind: 'tool-result', call: {}, content: [], isError: false, meta: pictured } })
  const cards = find(tree, (n) => n.props.className === 'kb-card')
  const images = find(cards[0], (n) => n.type === 'img')
  assert.equal(images.length, 2)
  assert.equal(images[0].props.className, 'kb-card-thumb')
  assert.equal(images[0].props.src, `data:image/png;base64,${PNG}`)
  assert.match(images[0].props.alt, /Graphene on copper: the passage highlighted \(p\. 4\)/)
  assert.equal(find(cards[0], (n) => n.type === 'details').length, 1, 'a click on the summary opens the full picture')
  assert.equal(find(cards[1], (n) => n.type === 'img').length, 0)
})

test('kb_show draws its pictures with the title, pages and snippet', () => {
  const { exports } = load()
  const shown = { doc_id: 1, title: 'Graphene on copper', file: 'a.pdf', path: '/lib/a.pdf', snippet: 'domains nucleate', highlighted: true, images: [{ ...picture }] }
  const tree = exports.PictureView({ block: { kind: 'tool-result', call: {}, content: [], isError: false, meta: cardView(engineRendered('show', shown)) } })
  assert.match(text(tree), /Graphene on copper · p\. 4domains nucleate/)
  assert.equal(find(tree, (n) => n.type === 'img')[0].props.src, `data:image/png;base64,${PNG}`)
  const fallback = exports.PictureView({ block: { kind: 'tool-result', call: {}, content: [{ type: 'text', text: 'kb_show failed' }], isError: true } })
  assert.equal(text(fallback), 'kb_show failed')
})

test('a settled result renders one card per source from block.meta', () => {
  const { exports } = load()
  const opened = []
  const tree = exports.SourcesView({ callId: 'c1', toolName: 'kb_rag', block: { kind: 'tool-result', call: {}, content: [{ type: 'text', text: 'md' }], isError: false, meta }, openFile: (p) => opened.push(p) })
  const cards = find(tree, (n) => n.props.className === 'kb-card')
  assert.equal(cards.length, 2)
  const link = find(cards[0], (n) => n.type === 'a')[0]
  assert.equal(link.props.href, 'https://doi.org/10.1000/x')
  assert.match(text(cards[0]), /A\. Smith · 2021 · Carbon · Results · p\.4/)
  assert.match(text(cards[0]), /domains nucleate/)
  assert.match(text(cards[0]), /\[3\] Wu paper ✓ in library/)
  assert.match(text(cards[0]), /and 2 more/)
  assert.match(text(tree), /2 sources for “graphene nucleation” · scope both/)
  const file = find(cards[1], (n) => n.type === 'button')[0]
  file.props.onClick()
  assert.deepEqual(opened, ['/lib/b.md'])
})

test('running calls, errors and results without meta fall back to the Markdown text', () => {
  const { exports } = load()
  const running = exports.SourcesView({ callId: 'c', toolName: 'kb_search', block: { callId: 'c', name: 'kb_search', argsRaw: '{}' } })
  assert.match(text(running), /kb_search: searching the library/)
  const failed = exports.SourcesView({ block: { kind: 'tool-result', call: {}, content: [{ type: 'text', text: 'Error: boom' }], isError: true, meta: cardView(engineRendered('search', {})) } })
  assert.equal(text(failed), 'Error: boom')
  const old = exports.SourcesView({ block: { kind: 'tool-result', call: {}, content: [{ type: 'text', text: '**Knowledge base**' }], isError: false } })
  assert.equal(text(old), '**Knowledge base**')
})

test('no console output', () => {
  assert.deepEqual(consoleCalls, [])
})
