// The ten kb_* tool definitions. Each one validates its arguments (the registry checks types first), builds an
// engine payload without undefined fields, runs it through `kb.call`, and returns the engine's answer as its
// canonical value; `output.render` turns that value into the Markdown the model reads.

import path from 'node:path'
import { defineTool } from '@deepseek-ai/dsh-tools'
import { clean, compact } from './json.js'
import {
  buildSourcesView, renderClear, renderDedup, renderFetch, renderIngest, renderScope, renderSourcesMarkdown, renderStats,
  renderStatus, renderZotero,
} from './render.js'
import { SCOPES, sessionKey } from './scope.js'

const OBJECT = { type: 'object', additionalProperties: true }
const MINUTE = 60_000
export const MAX_TOP_K = 50
export const MAX_RENDERINGS = 4

const FILTERS = {
  type: 'object',
  additionalProperties: false,
  description: 'Metadata filters, combined with AND. Text filters match case-insensitive substrings; collection and tag match whole names.',
  properties: {
    authors: { type: 'string', description: 'Author name or part of it, e.g. "chen"' },
    title: { type: 'string', description: 'Part of the document title' },
    journal: { type: 'string', description: 'Part of the journal name (often unknown outside Zotero imports)' },
    year: { oneOf: [{ type: 'integer' }, { type: 'string' }], description: 'A year (2019) or an inclusive range "2015-2020"' },
    section: { type: 'string', description: 'Part of the section label, e.g. "Methods"' },
    doi: { type: 'string', description: 'Part of the DOI' },
    kind: { type: 'string', enum: ['pdf', 'docx', 'txt', 'md'], description: 'File kind' },
    path: { type: 'string', description: 'Part of the file path' },
    collection: { type: 'string', description: 'A Zotero collection, by its whole name or path ("Graphene", "Materials/Graphene"); a collection covers its sub-collections' },
    tag: { type: 'string', description: 'A whole Zotero tag (any case)' },
  },
}

function retrievalParameters(defaultTopK, defaultDepth) {
  return {
    query: { type: 'string', required: true, description: "The question as the user asked it, or 3-12 technical terms (material/system, method, property), in the user's language" },
    queries: { type: 'array', items: { type: 'string' }, description: '1-4 renderings of the same question in the language most of the library is written in (usually English) when the user asked in another; searched alongside query, each passage keeps its best match' },
    top_k: { type: 'integer', description: `Number of passages, 1-${MAX_TOP_K} (default ${defaultTopK})` },
    mode: { type: 'string', enum: ['hybrid', 'keyword', 'vector'], description: 'Ranking: hybrid (default) fuses keyword and vector search' },
    depth: { type: 'string', enum: ['quick', 'deep'], description: `quick skips reranking and citation linking; deep reranks and resolves citations (default ${defaultDepth})` },
    filters: FILTERS,
  }
}

function fail(message) {
  throw new Error(message)
}

function checkQuery(args) {
  if (typeof args.query !== 'string' || !args.query.trim()) fail('query must be a non-empty string of search terms')
  if (args.top_k !== undefined && (args.top_k < 1 || args.top_k > MAX_TOP_K)) fail(`top_k must be between 1 and ${MAX_TOP_K}`)
  if (args.queries !== undefined && args.queries !== null) {
    if (!Array.isArray(args.queries) || !args.queries.every((q) => typeof q === 'string')) fail('queries must be a list of strings')
    if (args.queries.length > MAX_RENDERINGS) fail(`queries takes at most ${MAX_RENDERINGS} renderings`)
  }
}

function retrievalPayload(args) {
  return compact({
    query: args.query.trim(),
    queries: Array.isArray(args.queries) && args.queries.some((q) => q.trim()) ? args.queries.map((q) => q.trim()).filter(Boolean) : undefined,
    top_k: args.top_k,
    mode: args.mode,
    depth: args.depth,
    filters: args.filters && Object.keys(args.filters).length ? compact(args.filters) : undefined,
  })
}

/**
 * @param {object} kb
 * @param {(exec: object, command: string, payload: object) => Promise<object>} kb.call  run an engine command
 * @param {(exec: object) => Promise<void>} kb.ready  resolves when the engine can run (dependency gate)
 * @param {(exec: object) => string} kb.workspace  the call's workspace
 * @param {import('./scope.js').ScopeStore} kb.scope
 * @param {{debug: Function}} kb.log
 */
export function createTools(kb) {
  async function sessionInfo(exec, key) {
    const state = await kb.scope.ensure(key, exec)
    const notices = []
    if (kb.scope.firstStaleMention(key)) {
      try {
        const stats = await kb.call(exec, 'stats', {})
        if (stats.stale_docs > 0) {
          notices.push(`${stats.stale_docs} document(s) were indexed by an older parser, so their pages, citations or metadata may be incomplete. ` +
            'Tell the user once; kb_ingest with metadata_only: true refreshes metadata quickly, rebuild: true re-parses them.')
        }
      } catch (error) {
        if (exec.signal?.aborted) throw error
        kb.log.debug('stale check failed: %s', error.message)
      }
    }
    return { scope: state.scope, strict: state.strict, scope_source: state.source, notices }
  }

  function retrievalTool(name, command, description, defaultTopK, defaultDepth) {
    return defineTool({
      name,
      description,
      parameters: retrievalParameters(defaultTopK, defaultDepth),
      timeoutMs: 10 * MINUTE,
      output: {
        schema: OBJECT,
        render: (_args, value) => [{ type: 'text', text: renderSourcesMarkdown(buildSourcesView(name, value)) }],
        presentationMeta: (_args, value) => buildSourcesView(name, value),
      },
      async execute(args, exec) {
        checkQuery(args)
        await kb.ready(exec) // a missing dependency is reported before the user is asked anything
        const key = sessionKey(exec, kb.workspace(exec))
        const session = await sessionInfo(exec, key)
        const response = await kb.call(exec, command, retrievalPayload(args))
        return clean({ ...response, session })
      },
    })
  }

  return [
    defineTool({
      name: 'kb_ingest',
      description: 'Add papers (PDF, DOCX, TXT, Markdown files or folders) to the local knowledge base, or refresh documents already in it. Large batches run as a background job: follow it with kb_status.',
      parameters: {
        paths: { type: 'array', items: { type: 'string' }, description: 'Files or folders; relative paths are taken from the workspace. Required unless metadata_only or rebuild is set' },
        force: { type: 'boolean', description: 'Re-read files even when unchanged' },
        metadata_only: { type: 'boolean', description: 'Only refresh title, authors, year, journal and DOI of documents already indexed' },
        rebuild: { type: 'boolean', description: 'Re-parse documents already indexed (after an engine upgrade)' },
        verify_metadata: { type: 'boolean', description: 'Also check the title, authors, year and DOI of each document at Crossref (sends only its DOI, or its title when it has none). Off by default: use it only when the user asks for it' },
      },
      timeoutMs: 30 * MINUTE,
      output: { schema: OBJECT, render: (_args, value) => [{ type: 'text', text: renderIngest(value) }] },
      async execute(args, exec) {
        const paths = (args.paths ?? []).map((p) => p.trim()).filter(Boolean)
        if (args.metadata_only && args.rebuild) fail('metadata_only and rebuild cannot be combined: choose one')
        if (!paths.length && !args.metadata_only && !args.rebuild) fail('paths is required: give at least one file or folder to ingest')
        const payload = compact({
          paths: paths.length ? paths : undefined,
          force: args.force,
          metadata_only: args.metadata_only,
          rebuild: args.rebuild,
          verify_metadata: args.verify_metadata,
        })
        return clean(await kb.call(exec, 'ingest', payload))
      },
    }),

    defineTool({
      name: 'kb_zotero',
      description: 'Import the user\'s Zotero library (attachments with metadata, annotations, collections and tags) into the knowledge base. Large imports run as a background job: follow it with kb_status.',
      parameters: {
        zotero_db: { type: 'string', description: 'Path of zotero.sqlite or its folder (default: found in the usual places)' },
        base_dir: { type: 'string', description: 'Zotero\'s linked attachment base directory, when linked files use one' },
        dry_run: { type: 'boolean', description: 'Only list what would be imported' },
        force: { type: 'boolean', description: 'Re-parse every attachment even when unchanged' },
        limit: { type: 'integer', description: 'Import only the first N attachments (0 = all)' },
      },
      timeoutMs: 30 * MINUTE,
      output: { schema: OBJECT, render: (_args, value) => [{ type: 'text', text: renderZotero(value) }] },
      async execute(args, exec) {
        if (args.limit !== undefined && args.limit < 0) fail('limit must be 0 (all) or a positive number')
        const payload = compact({ zotero_db: args.zotero_db, base_dir: args.base_dir, dry_run: args.dry_run, force: args.force, limit: args.limit })
        return clean(await kb.call(exec, 'zotero', payload))
      },
    }),

    retrievalTool('kb_search', 'search',
      'Search the local paper library for passages (fast hybrid keyword and vector search). Returns verbatim snippets with title, authors, year, section, page and DOI.',
      10, 'quick'),

    retrievalTool('kb_rag', 'rag',
      'Gather evidence from the local paper library to answer a question: reranked passages with the works they cite, related papers and answering guidance. Slower than kb_search; use it for in-depth answers.',
      3, 'deep'),

    defineTool({
      name: 'kb_scope',
      description: 'Show or change where answers come from in this session: kb (the library), both (library and web) or web, and whether strict library-only answering is on.',
      parameters: {
        scope: { type: 'string', enum: SCOPES, description: 'kb, both or web; leave out to keep the current one' },
        strict: { type: 'boolean', description: 'Answer only from the library, saying so when it has nothing' },
      },
      output: { schema: OBJECT, render: (_args, value) => [{ type: 'text', text: renderScope(value) }] },
      async execute(args, exec) {
        const key = sessionKey(exec, kb.workspace(exec))
        let state
        if (args.scope !== undefined || args.strict !== undefined) state = kb.scope.set(key, { scope: args.scope, strict: args.strict }, 'tool')
        else state = kb.scope.get(key) ?? { scope: 'kb', strict: false, source: 'default' }
        return clean({ scope: state.scope, strict: state.strict, source: state.source })
      },
    }),

    defineTool({
      name: 'kb_dedup',
      description: 'Find documents in the library that are copies of one work (same DOI, or same title and year). With apply: true keep one per group; only when the user agrees.',
      parameters: {
        apply: { type: 'boolean', description: 'Keep one document per group and mark the others as duplicates' },
      },
      output: { schema: OBJECT, render: (_args, value) => [{ type: 'text', text: renderDedup(value) }] },
      async execute(args, exec) {
        return clean(await kb.call(exec, 'dedup', compact({ apply: args.apply })))
      },
    }),

    defineTool({
      name: 'kb_clear',
      description: 'Remove every document from the knowledge base index (the files themselves are kept). Only when the user explicitly asks for it.',
      parameters: {
        confirm: { type: 'boolean', required: true, description: 'Must be true: the user asked to clear the library' },
      },
      output: { schema: OBJECT, render: (_args, value) => [{ type: 'text', text: renderClear(value) }] },
      async execute(args, exec) {
        if (args.confirm !== true) fail('nothing was cleared: kb_clear needs confirm: true, and only after the user explicitly asked to empty the library')
        return clean(await kb.call(exec, 'clear', { confirm: true }))
      },
    }),

    defineTool({
      name: 'kb_stats',
      description: 'Summarise the knowledge base: documents, passages, vectors, languages, models, and documents that need a refresh.',
      parameters: {},
      output: { schema: OBJECT, render: (_args, value) => [{ type: 'text', text: renderStats(value) }] },
      async execute(_args, exec) {
        return clean(await kb.call(exec, 'stats', {}))
      },
    }),

    defineTool({
      name: 'kb_fetch',
      description: 'Download a paper by DOI, arXiv id or URL (publisher PDF first, open-access copy as fallback), save it in the library\'s papers folder and index it.',
      parameters: {
        identifier: { type: 'string', required: true, description: 'DOI (10.1234/abc), arXiv id (2301.05883) or http(s) URL of the paper' },
        dest: { type: 'string', description: 'Folder to save the PDF in; relative paths are taken from the workspace (default: the library\'s papers folder)' },
      },
      timeoutMs: 5 * MINUTE,
      output: { schema: OBJECT, render: (_args, value) => [{ type: 'text', text: renderFetch(value) }] },
      async execute(args, exec) {
        const identifier = args.identifier.trim()
        if (!identifier) fail('identifier must be a DOI, an arXiv id or an http(s) URL')
        const dest = args.dest?.trim() ? path.resolve(kb.workspace(exec), args.dest.trim()) : undefined
        return clean(await kb.call(exec, 'fetch', compact({ identifier, dest })))
      },
    }),

    defineTool({
      name: 'kb_status',
      description: 'Check the background jobs started by kb_ingest or kb_zotero: state, progress, result and errors. Give job_id for one job; cancel: true stops it.',
      parameters: {
        job_id: { type: 'string', description: 'The job_id returned by kb_ingest or kb_zotero; leave out to list recent jobs' },
        cancel: { type: 'boolean', description: 'Ask the job to stop after the file in flight (needs job_id)' },
      },
      output: { schema: OBJECT, render: (_args, value) => [{ type: 'text', text: renderStatus(value) }] },
      async execute(args, exec) {
        if (args.cancel && !args.job_id) fail('cancel needs the job_id of the job to stop')
        return clean(await kb.call(exec, 'status', compact({ job_id: args.job_id?.trim() || undefined, cancel: args.cancel })))
      },
    }),
  ]
}

/** Cross-tool guidance, one system-prompt section (its text is part of the cached prompt prefix: keep it stable). */
export const GUIDANCE_SECTION = [
  '## Local paper library (kb_* tools)',
  '- kb_search is the quick lookup; kb_rag gathers reranked evidence for a full answer. Both return verbatim passages with title, authors, year, section, page and DOI.',
  '- Keyword matching cannot cross languages and most libraries are in English: when the user asks in another language, pass the question as query and an English rendering (technical terms) in queries; answer in the language the user asked in. Put years, authors, sections and Zotero collections in filters, not in the query.',
  '- Cite each statement taken from the library as (first author, year, section, p. N) with its DOI link when there is one. Never cite a passage you were not given.',
  '- Follow the session scope printed with the results: kb answers from the library, both allows web sources marked as such, web prefers the web. In strict mode say plainly when the library does not answer. Change it with kb_scope only when the user asks.',
  '- kb_fetch downloads a paper by DOI, arXiv id or URL into the library and indexes it; use it when the user wants a paper added that is not in the library.',
  '- kb_ingest and kb_zotero may return a job_id: follow it with kb_status until it is done before relying on the new documents.',
  '- kb_clear and kb_dedup with apply change the library: use them only when the user asks.',
].join('\n')
