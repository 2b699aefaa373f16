// Presentation of search and rag results: one view model, rendered as Markdown for the model and handed to UIs
// unchanged as presentationMeta. Everything here is pure (no I/O, no clock), as DSH requires of presenters.

import { CONTRACT } from './contract.js'
import { clean } from './json.js'

/** Rendered results aim to stay below this many characters (older results are trimmed at ~8 KB). */
export const RENDER_BUDGET = CONTRACT.rendering.budget

// Ways to shorten a result, gentlest first: [snippet length (null: as the engine gave it), citations per source].
const FIT_STEPS = CONTRACT.rendering.fit_steps

const SCOPE_LINES = {
  kb: 'library only: answer from these passages and cite them',
  both: 'library and web: prefer these passages, and mark anything taken from the web as such',
  web: 'web first: the user prefers web sources; treat these passages as a supplement',
}

/** Escape the characters that Markdown would otherwise interpret inside running text. */
export function escapeMd(text) {
  return String(text ?? '').replace(/\s+/g, ' ').trim().replace(/[\\`*_[\]<]/g, '\\$&')
}

/** https://doi.org/ link for a DOI, with the characters that break a Markdown link target encoded. */
export function doiUrl(doi) {
  if (!doi) return null
  const bare = String(doi).trim().replace(/^https?:\/\/(dx\.)?doi\.org\//i, '')
  if (!bare) return null
  return 'https://doi.org/' + encodeURI(bare).replace(/[()]/g, (c) => '%' + c.charCodeAt(0).toString(16).toUpperCase())
}

function baseName(path) {
  if (!path) return null
  const parts = String(path).split(/[\\/]/)
  return parts[parts.length - 1] || null
}

function cut(text, limit) {
  const s = String(text ?? '').replace(/\s+/g, ' ').trim()
  if (limit === null || s.length <= limit) return s
  const head = s.slice(0, limit)
  const space = head.lastIndexOf(' ')
  return (space > limit * 0.6 ? head.slice(0, space) : head).replace(/[\s…]+$/, '') + '…'
}

function authorLine(authors) {
  if (!Array.isArray(authors) || !authors.length) return ''
  const names = authors.slice(0, 3).map((a) => String(a))
  return names.join(', ') + (authors.length > 3 ? ' et al.' : '')
}

export function pageLabel(page, pageEnd, label) {
  if (page === null || page === undefined) return ''
  let text = pageEnd !== null && pageEnd !== undefined && pageEnd !== page ? `pp.${page}–${pageEnd}` : `p.${page}`
  if (label !== null && label !== undefined && label !== '' && String(label) !== String(page)) text += ` (${label})`
  return text
}

function citationView(c) {
  const lib = c.in_library
  return {
    marker: c.marker ?? (c.ref !== null && c.ref !== undefined ? `[${c.ref}]` : ''),
    ref: c.ref ?? null,
    title: c.title ?? null,
    text: c.text ?? null,
    doi: c.doi ?? null,
    url: doiUrl(c.doi),
    in_library: lib
      ? {
          doc_id: lib.doc_id ?? null,
          title: lib.title ?? null,
          doi: lib.doi ?? null,
          url: doiUrl(lib.doi),
          file: baseName(lib.path),
          path: lib.path ?? null,
        }
      : null,
  }
}

function sourceView(hit, rank) {
  const citations = Array.isArray(hit.citations) ? hit.citations.map(citationView) : null
  return {
    rank,
    doc_id: hit.doc_id ?? null,
    chunk_id: hit.chunk_id ?? null,
    title: hit.title || hit.file || baseName(hit.path) || 'Untitled',
    url: doiUrl(hit.doi),
    doi: hit.doi ?? null,
    file: hit.file ?? baseName(hit.path),
    path: hit.path ?? null,
    authors: Array.isArray(hit.authors) ? hit.authors : [],
    year: hit.year ?? null,
    journal: hit.journal ?? null,
    kind: hit.kind ?? null,
    section: hit.section ?? '',
    page: hit.page ?? null,
    page_end: hit.page_end ?? null,
    page_label: hit.page_label ?? null,
    location: pageLabel(hit.page, hit.page_end, hit.page_label),
    score: typeof hit.score === 'number' && Number.isFinite(hit.score) ? hit.score : null,
    snippet: String(hit.snippet ?? ''),
    citations,
    citations_more: citations ? (hit.citations_more ?? 0) : null,
    zotero_link: hit.zotero_link ?? null,
  }
}

function relatedView(r) {
  return {
    doc_id: r.doc_id ?? null,
    title: r.title || baseName(r.path) || 'Untitled',
    url: doiUrl(r.doi),
    doi: r.doi ?? null,
    file: baseName(r.path),
    authors: Array.isArray(r.authors) ? r.authors : [],
    year: r.year ?? null,
    reason: r.reason ?? null,
    similarity: typeof r.similarity === 'number' && Number.isFinite(r.similarity) ? r.similarity : null,
  }
}

/** The complete view of a search or rag value, before it is fitted into the budget. */
function fullView(tool, value) {
  const hits = (tool === 'kb_rag' ? value.evidence : value.results) ?? []
  const session = value.session ?? {}
  const notes = Array.isArray(value.notes) ? value.notes.slice() : value.note ? [value.note] : []
  return {
    kind: 'kb-sources',
    tool,
    query: value.query ?? '',
    mode: value.mode ?? null,
    depth: value.depth ?? null,
    score_kind: value.score_kind ?? null,
    reranker: value.reranker ?? null,
    cached: value.cached === true,
    notes,
    lang_note: value.lang_note ?? null,
    scope: session.scope ?? null,
    strict: session.strict ?? null,
    notices: Array.isArray(session.notices) ? session.notices : [],
    total: hits.length,
    sources: hits.map((hit, i) => sourceView(hit, i + 1)),
    related: Array.isArray(value.related) ? value.related.map(relatedView) : [],
    guidance: value.guidance ?? null,
    omitted: 0,
    snippet_limit: null,
  }
}

function fitted(view, snippetLimit, citationLimit, count) {
  const sources = view.sources.slice(0, count).map((s) => {
    const out = { ...s, snippet: cut(s.snippet, snippetLimit) }
    if (s.citations) {
      out.citations = s.citations.slice(0, citationLimit)
      out.citations_more = s.citations_more + (s.citations.length - out.citations.length)
    }
    return out
  })
  return { ...view, sources, omitted: view.sources.length - sources.length, snippet_limit: snippetLimit }
}

/**
 * The view model of a kb_search / kb_rag value, shortened (snippets, then citations, then trailing sources)
 * until its Markdown fits RENDER_BUDGET. Both the Markdown and presentationMeta come from this object.
 */
export function buildSourcesView(tool, value) {
  const view = fullView(tool, value ?? {})
  let best = null
  for (const [snippetLimit, citationLimit] of FIT_STEPS) {
    best = fitted(view, snippetLimit, citationLimit, view.sources.length)
    if (renderSourcesMarkdown(best).length <= RENDER_BUDGET) return clean(best)
  }
  // Still too long at the shortest settings: drop sources from the end.
  const [snippetLimit, citationLimit] = FIT_STEPS[FIT_STEPS.length - 1]
  let count = view.sources.length
  while (count > 1) {
    count--
    best = fitted(view, snippetLimit, citationLimit, count)
    if (renderSourcesMarkdown(best).length <= RENDER_BUDGET) break
  }
  return clean(best)
}

function titleLine(s) {
  const title = escapeMd(s.title)
  if (s.url) return `[${title}](${s.url})`
  return `**${title}**` + (s.file ? ` \`${String(s.file).replace(/`/g, "'")}\`` : '')
}

function citationLines(s) {
  if (!s.citations || (!s.citations.length && !s.citations_more)) return []
  const lines = ['   Cited in this passage:']
  const inLib = s.citations.filter((c) => c.in_library)
  const others = s.citations.filter((c) => !c.in_library)
  for (const c of inLib) {
    const lib = c.in_library
    const name = escapeMd(c.title || lib.title || c.text || '')
    const url = c.url || lib.url
    const where = lib.file ? ` \`${String(lib.file).replace(/`/g, "'")}\`` : ''
    lines.push(`   - ${escapeMd(c.marker)} ${url ? `[${name}](${url})` : name} ✓ in library (doc ${lib.doc_id}${where ? ',' + where : ''})`)
  }
  for (const c of others) {
    const name = escapeMd(cut(c.title || c.text || '', 140))
    lines.push(`   - ${escapeMd(c.marker)} ${c.url ? `[${name}](${c.url})` : name}`)
  }
  if (s.citations_more > 0) lines.push(`   - and ${s.citations_more} more cited work${s.citations_more === 1 ? '' : 's'}`)
  return lines
}

function sourceLines(s) {
  const byline = [authorLine(s.authors), s.year, s.journal, s.section, s.location]
    .filter((x) => x !== null && x !== undefined && x !== '')
    .map((x) => escapeMd(x))
    .join(' · ')
  const lines = [`${s.rank}. ${titleLine(s)}` + (byline ? '\\' : '')]
  if (byline) lines.push(`   ${byline}`)
  if (s.snippet) lines.push(`   > ${escapeMd(s.snippet)}`)
  lines.push(...citationLines(s))
  if (s.zotero_link) lines.push(`   [open in Zotero](${s.zotero_link})`)
  return lines
}

function headerLine(view) {
  const what = view.tool === 'kb_rag' ? 'evidence passage' : 'passage'
  const n = view.total
  const parts = [view.mode, view.depth, view.score_kind ? `scores: ${view.score_kind}` : null,
    view.reranker ? `reranked by ${view.reranker}` : null, view.cached ? 'cached' : null].filter(Boolean)
  const count = n === 0 ? `no ${what} found` : `${n} ${what}${n === 1 ? '' : 's'}`
  return `**Knowledge base: ${count}** for "${escapeMd(view.query)}"` + (parts.length ? ` (${parts.map(escapeMd).join(' · ')})` : '')
}

/** The Markdown the model reads for a kb_search / kb_rag result. */
export function renderSourcesMarkdown(view) {
  const out = [headerLine(view)]
  if (view.scope) out.push(`_Scope: ${SCOPE_LINES[view.scope] ?? view.scope}${view.strict ? '; strict: use nothing but the library, and say so when it does not answer' : ''}._`)
  for (const note of view.notes) out.push(`_Note: ${escapeMd(note)}_`)
  if (view.lang_note) out.push(`_Language: ${escapeMd(view.lang_note)}_`)
  for (const notice of view.notices) out.push(`_Library: ${escapeMd(notice)}_`)
  if (!view.sources.length) {
    out.push('', 'Try adding to queries one English sentence stating the answer as a paper would, move years or authors into filters, or check kb_stats that the library holds documents.')
  } else {
    out.push('')
    if (view.tool === 'kb_rag') out.push('**Evidence**')
    for (const s of view.sources) out.push(...sourceLines(s), '')
    if (view.omitted > 0) out.push(`_${view.omitted} more result${view.omitted === 1 ? '' : 's'} left out to keep this short; lower top_k or narrow the query._`, '')
  }
  if (view.related.length) {
    out.push('**Related work in the library** (pointers, not evidence)')
    for (const r of view.related) {
      const title = r.url ? `[${escapeMd(r.title)}](${r.url})` : `**${escapeMd(r.title)}**` + (r.file ? ` \`${String(r.file).replace(/`/g, "'")}\`` : '')
      const bits = [authorLine(r.authors), r.year, r.reason, r.similarity !== null ? r.similarity.toFixed(2) : null]
        .filter((x) => x !== null && x !== undefined && x !== '').map((x) => escapeMd(x))
      out.push(`- ${title}${bits.length ? ' · ' + bits.join(' · ') : ''}`)
    }
    out.push('')
  }
  if (view.guidance) out.push('**How to answer**', escapeMd(view.guidance))
  return out.join('\n').replace(/\n{3,}/g, '\n\n').trim()
}

// ---------------------------------------------------------------------------------------------------------------
// Other tools: short Markdown summaries of the engine's answers.

function bullet(label, value) {
  return value === null || value === undefined || value === '' ? null : `- ${label}: ${value}`
}

function lines(...items) {
  return items.flat().filter((x) => x !== null && x !== undefined).join('\n')
}

function limitList(items, max, render, restLabel) {
  const out = items.slice(0, max).map(render)
  if (items.length > max) out.push(`- … and ${items.length - max} more ${restLabel}`)
  return out
}

function totalsLine(totals) {
  if (!totals || typeof totals !== 'object') return null
  return Object.entries(totals)
    .filter(([, v]) => typeof v === 'number' && v !== 0)
    .map(([k, v]) => `${k} ${v}`)
    .join(', ') || 'nothing to do'
}

function jobStarted(value, what) {
  return lines(
    `**${what} started as background job \`${value.job_id}\`** (${value.pending ?? '?'} item(s) need work).`,
    value.note ? `_${escapeMd(value.note)}_` : null,
    `Call kb_status with {"job_id": "${value.job_id}"} to follow it; repeat until its state is done, failed or cancelled. Do not start another ingest or Zotero import of this library meanwhile.`,
  )
}

function verificationLine(check) {
  if (!check || typeof check !== 'object') return null
  const counts = ['verified', 'no_match', 'not_found', 'skipped', 'failed']
    .filter((k) => check[k]).map((k) => `${check[k]} ${k.replace('_', ' ')}`).join(', ')
  return `Metadata checked at Crossref (${check.checked ?? 0} document(s)${counts ? `: ${counts}` : ''}).` +
    (check.note ? ` _${escapeMd(check.note)}_` : '')
}

export function renderIngest(value) {
  if (value.job_id) return jobStarted(value, 'Ingest')
  const files = Array.isArray(value.files) ? value.files : []
  const problems = files.filter((f) => f.status === 'error' || (f.status === 'skipped' && f.reason !== 'unchanged') || (f.status === 'skipped' && f.error))
  const head = value.metadata_only ? 'Metadata refreshed' : 'Ingest finished'
  return lines(
    `**${head}** (${files.length} file(s)): ${totalsLine(value.totals)}.`,
    value.note ? `_Note: ${escapeMd(value.note)}_` : null,
    verificationLine(value.metadata_verification),
    problems.length ? 'Files not indexed:' : null,
    limitList(problems, 15, (f) => `- \`${baseName(f.path)}\`: ${f.status}${f.reason ? ` (${f.reason})` : ''}${f.error ? ` — ${escapeMd(cut(f.error, 160))}` : ''}`, 'files'),
    value.kb_root ? `Library: \`${value.kb_root}\`` : null,
  )
}

const FETCH_SOURCES = { arxiv: 'arXiv', publisher: 'the publisher', unpaywall: 'an open-access copy (Unpaywall)', direct: 'the URL' }

export function renderFetch(value) {
  const fetched = value.fetched && typeof value.fetched === 'object' ? value.fetched : {}
  const files = Array.isArray(value.files) ? value.files : []
  const entry = files.find((f) => f.path === fetched.path) ?? files[0] ?? null
  const size = typeof fetched.bytes === 'number' ? ` (${Math.max(1, Math.round(fetched.bytes / 1024))} KiB)` : ''
  const from = FETCH_SOURCES[fetched.source] ?? fetched.source ?? 'the web'
  const link = doiUrl(fetched.doi)
  return lines(
    `**Fetched \`${String(fetched.identifier ?? '?').replace(/`/g, "'")}\`** from ${from}${size}.`,
    bullet('Source URL', fetched.url ? `<${String(fetched.url).replace(/[<>\s]/g, encodeURIComponent)}>` : null),
    bullet('Saved as', fetched.path ? `\`${fetched.path}\`` : null),
    entry ? bullet('Indexed', `${entry.title ? `**${escapeMd(cut(entry.title, 160))}**, ` : ''}${entry.status}${entry.reason ? ` (${entry.reason})` : ''}` +
      `${entry.error ? ` — ${escapeMd(cut(entry.error, 160))}` : ''}`) : null,
    bullet('DOI', fetched.doi ? (link ? `[${escapeMd(fetched.doi)}](${link})` : escapeMd(fetched.doi)) : null),
    value.note ? `_Note: ${escapeMd(value.note)}_` : null,
    fetchOutcome(entry),
    value.kb_root ? `Library: \`${value.kb_root}\`` : null,
  )
}

/** What the fetched file's ingest means for the next step. */
function fetchOutcome(entry) {
  if (!entry?.status) return null
  if (entry.status === 'duplicate') return 'The library already held a copy of it: kb_search and kb_rag find that one.'
  const indexed = ['added', 'updated', 'moved'].includes(entry.status) ||
    (entry.status === 'skipped' && entry.reason === 'unchanged' && !entry.previous)
  return indexed ? 'It is in the library now: kb_search and kb_rag can find it.' : 'The PDF was saved but not indexed; see why above.'
}

export function renderZotero(value) {
  if (value.job_id) return jobStarted(value, 'Zotero import')
  const items = Array.isArray(value.items) ? value.items : []
  const missing = items.filter((i) => i.status === 'missing' || i.status === 'error')
  return lines(
    `**Zotero ${value.dry_run ? 'dry run' : 'import'}** (${items.length} attachment(s)): ${totalsLine(value.totals)}.`,
    value.note ? `_Note: ${escapeMd(value.note)}_` : null,
    missing.length ? 'Attachments not imported:' : null,
    limitList(missing, 15, (i) => `- ${escapeMd(cut(i.title ?? i.attachment_key ?? '?', 80))}: ${i.status}${i.reason ? ` (${i.reason})` : ''}`, 'attachments'),
    value.zotero_db ? `Zotero database: \`${value.zotero_db}\`` : null,
  )
}

function jobLine(job) {
  const progress = typeof job.total === 'number' ? ` ${job.done ?? 0}/${job.total}` : ''
  const phase = job.phase && job.state === 'running' ? ` (${job.phase}${typeof job.phase_total === 'number' ? ` ${job.phase_done ?? 0}/${job.phase_total}` : ''})` : ''
  return `\`${job.job_id}\` ${job.command ?? ''}: **${job.state}**${progress}${phase}${job.reason ? ` — ${escapeMd(job.reason)}` : ''}`
}

export function renderStatus(value) {
  if (value.job) {
    const job = value.job
    const active = job.state === 'queued' || job.state === 'running'
    const errors = Array.isArray(job.errors) ? job.errors : []
    return lines(
      `Job ${jobLine(job)}`,
      value.cancel_requested ? 'Cancellation requested: the job stops after the item in flight.' : null,
      job.result?.totals ? `Result: ${totalsLine(job.result.totals)}.` : null,
      job.result?.note ? `_Note: ${escapeMd(job.result.note)}_` : null,
      errors.length ? 'Items that failed:' : null,
      limitList(errors, 10, (e) => `- ${escapeMd(cut(e, 200))}`, 'items'),
      active ? 'Still working: call kb_status again later with the same job_id.' : null,
    )
  }
  const jobs = Array.isArray(value.jobs) ? value.jobs : []
  if (!jobs.length) return 'No background jobs for this library in the last hour.'
  return lines('Background jobs:', limitList(jobs, 20, (j) => `- ${jobLine(j)}`, 'jobs'))
}

export function renderStats(value) {
  if (value.exists === false) {
    return lines('**The knowledge base is empty**: no library exists yet.', value.kb_root ? `Library folder: \`${value.kb_root}\`` : null,
      value.kb_root_from ? `Chosen as ${escapeMd(value.kb_root_from)}.` : null,
      'Add papers with kb_ingest (files or folders) or kb_zotero.')
  }
  const obj = (o) => (o && typeof o === 'object' && Object.keys(o).length ? Object.entries(o).map(([k, v]) => `${k} ${v}`).join(', ') : null)
  const stale = value.stale_docs > 0
    ? `${value.stale_docs} document(s) were indexed by an older parser: kb_ingest with metadata_only: true refreshes their metadata, rebuild: true re-parses them.`
    : null
  return lines(
    '**Knowledge base**',
    bullet('documents', `${value.indexed_docs ?? 0} indexed of ${value.docs ?? 0} recorded` + (obj(value.by_status) ? ` (${obj(value.by_status)})` : '')),
    bullet('kinds', obj(value.by_kind)),
    bullet('languages', obj(value.languages)),
    bullet('passages', value.chunks),
    bullet('vectors', `${value.vectors ?? 0}, missing ${value.vectors_missing ?? 0}` + (value.embedding_model ? ` (${value.embedding_model})` : '')),
    bullet('models', value.models ? obj(value.models) : null),
    bullet('stale documents', value.stale_docs),
    bullet('library', value.kb_root ? `\`${value.kb_root}\`` : null),
    stale,
  )
}

export function renderDedup(value) {
  const groups = Array.isArray(value.groups) ? value.groups : []
  if (!groups.length) return 'No duplicate documents found.'
  return lines(
    `**${groups.length} group(s) of copies of one work**` + (value.applied ? `: ${value.removed} document(s) turned into duplicate records.` : ' (nothing changed).'),
    limitList(groups, 15, (g) => {
      const docs = (g.docs ?? []).map((d) => `${d.doc_id === g.keep ? 'keep ' : ''}#${d.doc_id} \`${baseName(d.path)}\``).join(', ')
      return `- ${g.reason}: ${docs}`
    }, 'groups'),
    value.applied ? null : 'To keep one document per group, call kb_dedup with apply: true (only if the user agrees).',
  )
}

export function renderClear(value) {
  const c = value.cleared ?? {}
  return `**Library cleared**: ${c.docs ?? 0} document(s) and ${c.chunks ?? 0} passage(s) removed from \`${value.kb_root ?? '?'}\`. The files themselves were not touched.`
}

export function renderScope(value) {
  const source = { user: 'chosen by the user', tool: 'set with kb_scope', default: 'default' }[value.source] ?? value.source
  return lines(
    `Knowledge-base scope for this session: **${value.scope}**${value.strict ? ', strict' : ''} (${source}).`,
    SCOPE_LINES[value.scope] ? `Meaning: ${SCOPE_LINES[value.scope]}${value.strict ? '; strict: answer only from the library and say so when it has nothing' : ''}.` : null,
  )
}
