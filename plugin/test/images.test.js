// Pictures to the model (modelImages: 'auto'): kb_show's PNGs, and the pictures a model asks kb_search for, are
// saved as DSH image attachments and follow the text as image blocks, but only when the active model reads
// images (asked as DSH's read_image tool asks it). A text-only model, no attachment service, or a search that
// asked for no pictures gets text alone; the cards keep their thumbnails either way.

import assert from 'node:assert/strict'
import { test } from 'node:test'
import { createTools } from '../src/tools.js'

const PNG = 'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4AAAAAElFTkSuQmCC'
const picture = (page) => ({ page, width: 1, height: 1, dpi: 72, clip: [0, 0, 1, 1], marks: [], media_type: 'image/png', data: PNG })

function setup({ vision = true, service = true } = {}) {
  const saved = []
  const asked = []
  const attachments = { saveImage: async (image) => { saved.push(image); return { attachmentId: `a${saved.length}`, mediaType: image.mediaType, bytes: image.data.length, width: 1, height: 1 } } }
  const llm = { resolveModelInfo: async (provider, model) => { asked.push([provider, model]); return { inputModalities: vision ? ['text', 'image'] : ['text'] } } }
  const answers = {
    show: { doc_id: 1, title: 'T', images: [picture(6)], markdown: '**T** · p. 6 · "x"' },
    search: { query: 'q', results: [{ kind: 'pdf', picture: picture(2) }, { kind: 'pdf', picture: picture(3) }], markdown: '**Knowledge base**' },
  }
  const sent = []
  const tools = createTools({
    call: async (_exec, command, payload) => { sent.push([command, payload]); return structuredClone(answers[command]) },
    ready: async () => {},
    workspace: () => '/tmp',
    scope: { ensure: async () => ({ scope: 'kb', strict: false, source: 'default' }), firstStaleMention: () => false,
      sinceLastRetrieval: () => null },
    log: { debug() {} },
    images: { attachments: () => (service ? attachments : undefined), llm: () => llm },
  })
  const exec = { agent: { options: { provider: 'deepseek', model: 'vision-model' }, session: { header: { cwd: '/tmp' } } } }
  const run = async (name, args) => {
    const tool = tools.find((t) => t.name === name)
    const value = await tool.execute(args, exec)
    return { value, blocks: tool.output.render(args, value) }
  }
  return { run, saved, asked, sent }
}

test('kb_show sends its picture to a model that reads images, after the text', async () => {
  const { run, saved, asked, sent } = setup()
  const { blocks } = await run('kb_show', { doc_id: 1, page: 6, char_start: 0, char_end: 10, page_end: 6 })
  assert.equal(sent[0][1].inline, true, 'the contract\'s fixed field asks the engine for inline pictures')
  assert.deepEqual(asked, [['deepseek', 'vision-model']])
  assert.equal(saved.length, 1)
  assert.equal(saved[0].mediaType, 'image/png')
  assert.deepEqual([...saved[0].data.subarray(0, 4)], [0x89, 0x50, 0x4e, 0x47])
  assert.deepEqual(blocks.map((b) => b.type), ['text', 'image'])
  assert.equal(blocks[1].attachment.attachmentId, 'a1')
})

test('a text-only model, or no attachment service, gets the text alone', async () => {
  for (const options of [{ vision: false }, { service: false }]) {
    const { run, saved } = setup(options)
    const { blocks } = await run('kb_show', { doc_id: 1, page: 6 })
    assert.deepEqual(blocks.map((b) => b.type), ['text'])
    assert.equal(saved.length, 0)
  }
})

test('kb_search sends as many pictures as the model asked for; the cards always get three', async () => {
  const asked = setup()
  const one = await asked.run('kb_search', { query: 'q', pictures: 1 })
  assert.equal(asked.sent[0][1].pictures, 3)
  assert.deepEqual(one.blocks.map((b) => b.type), ['text', 'image'])
  const none = setup()
  const plain = await none.run('kb_search', { query: 'q' })
  assert.deepEqual(plain.blocks.map((b) => b.type), ['text'])
  assert.equal(none.saved.length, 0)
})
