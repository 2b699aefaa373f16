// kb-rag client half for the DSH web UI: source cards for kb_search and kb_rag results (with a thumbnail of the
// passage highlighted on its page, opened on click), and the picture kb_show draws.
//
// A classic script in the DSH client-bundle format: executing it only registers a factory with the page's
// module loader; the factory receives `require` (react and the other shared modules) when the UI first needs
// it. The cards are built from block.meta, the presentationMeta the host computed (see src/render.js); a call
// still running, an error, or a result without that meta falls back to the host's Markdown text.
;(function register(root) {
  function factory(require) {
    const React = require('react')
    const h = React.createElement

    /** The view model of a settled result, or null when the fallback applies. */
    function sourcesOf(block) {
      if (!block || !('kind' in block) || block.isError) return null
      const meta = block.meta
      return meta && meta.kind === 'kb-sources' && Array.isArray(meta.sources) ? meta : null
    }

    function contentText(block) {
      if (!block || !('kind' in block)) return ''
      return (block.content || []).map((c) => (c && c.type === 'text' ? c.text : '')).join('\n')
    }

    function authorsLine(authors) {
      if (!Array.isArray(authors) || !authors.length) return ''
      return authors.slice(0, 3).join(', ') + (authors.length > 3 ? ' et al.' : '')
    }

    function byline(s) {
      return [authorsLine(s.authors), s.year, s.journal, s.section, s.location]
        .filter((x) => x !== null && x !== undefined && x !== '')
        .join(' · ')
    }

    function Title({ source, openFile }) {
      if (source.url) {
        return h('a', { className: 'kb-card-title', href: source.url, target: '_blank', rel: 'noreferrer' }, source.title)
      }
      const file = source.file
        ? h('button', { className: 'kb-card-file', type: 'button', onClick: () => openFile && source.path && openFile(source.path) }, source.file)
        : null
      return h('span', { className: 'kb-card-title' }, h('strong', null, source.title), file ? ' ' : null, file)
    }

    function Citations({ source }) {
      const list = source.citations || []
      if (!list.length && !source.citations_more) return null
      return h('ul', { className: 'kb-card-citations' },
        list.map((c, i) => h('li', { key: i },
          c.marker ? `${c.marker} ` : '',
          c.url ? h('a', { href: c.url, target: '_blank', rel: 'noreferrer' }, c.title || c.text || c.doi) : (c.title || c.text || ''),
          c.in_library ? h('span', { className: 'kb-card-inlib', title: c.in_library.path || '' }, ' ✓ in library') : null,
        )),
        source.citations_more ? h('li', { key: 'more' }, `and ${source.citations_more} more`) : null,
      )
    }

    /** A highlighted-passage picture: a thumbnail that opens, on click, to the picture at its own size (a
     *  <details> element, so the card needs no state of its own). */
    function Picture({ picture, alt }) {
      if (!picture || typeof picture.data !== 'string') return null
      const src = `data:${picture.media_type || 'image/png'};base64,${picture.data}`
      const label = `${alt} (p. ${picture.page})`
      return h('details', { className: 'kb-card-picture' },
        h('summary', { title: 'Show the passage on its page' },
          h('img', { className: 'kb-card-thumb', src, alt: label, style: { maxWidth: '220px', maxHeight: '110px', objectFit: 'cover', objectPosition: 'top', cursor: 'zoom-in' } })),
        h('img', { className: 'kb-card-picture-full', src, alt: label, width: picture.width, height: picture.height, style: { maxWidth: '100%', height: 'auto' } }))
    }

    function Card({ source, openFile }) {
      return h('li', { className: 'kb-card' },
        h(Title, { source, openFile }),
        h('div', { className: 'kb-card-byline' }, byline(source)),
        source.snippet ? h('blockquote', { className: 'kb-card-snippet' }, source.snippet) : null,
        source.picture ? h(Picture, { picture: source.picture, alt: `${source.title}: the passage highlighted` }) : null,
        h(Citations, { source }),
        source.zotero_link ? h('a', { className: 'kb-card-zotero', href: source.zotero_link }, 'Open in Zotero') : null,
      )
    }

    /** The keyed toolview for kb_search and kb_rag. */
    function SourcesView(props) {
      const view = sourcesOf(props.block)
      if (!view) {
        const text = contentText(props.block)
        return h('div', { className: 'kb-sources kb-sources-fallback', style: { whiteSpace: 'pre-wrap' } },
          text || `${props.toolName || 'kb'}: searching the library…`)
      }
      const notes = [].concat(view.notes || [], view.lang_note ? [view.lang_note] : [], view.notices || [])
      return h('div', { className: 'kb-sources' },
        h('div', { className: 'kb-sources-head' },
          view.total ? `${view.total} source${view.total === 1 ? '' : 's'} for “${view.query}”` : `No passage found for “${view.query}”`,
          view.scope ? h('span', { className: 'kb-sources-scope' }, ` · scope ${view.scope}${view.strict ? ' (strict)' : ''}`) : null),
        notes.length ? h('ul', { className: 'kb-sources-notes' }, notes.map((n, i) => h('li', { key: i }, n))) : null,
        h('ol', { className: 'kb-cards' }, view.sources.map((s) => h(Card, { key: `${s.rank}-${s.chunk_id}`, source: s, openFile: props.openFile }))),
        view.omitted ? h('div', { className: 'kb-sources-omitted' }, `${view.omitted} more not shown`) : null,
        view.related && view.related.length
          ? h('div', { className: 'kb-related' }, h('strong', null, 'Related work'),
            h('ul', null, view.related.map((r, i) => h('li', { key: i },
              r.url ? h('a', { href: r.url, target: '_blank', rel: 'noreferrer' }, r.title) : r.title,
              r.year ? ` · ${r.year}` : '', r.reason ? ` · ${r.reason}` : ''))))
          : null,
      )
    }

    /** The toolview for kb_show: the passage (or figure) on its page, each page one picture. */
    function PictureView(props) {
      const block = props.block
      const meta = block && 'kind' in block && !block.isError ? block.meta : null
      if (!meta || meta.kind !== 'kb-picture' || !Array.isArray(meta.images)) {
        const text = contentText(block)
        return h('div', { className: 'kb-picture kb-sources-fallback', style: { whiteSpace: 'pre-wrap' } },
          text || `${props.toolName || 'kb_show'}: drawing the page…`)
      }
      const where = meta.images.map((i) => i.page).filter((p, i, all) => all.indexOf(p) === i).join(', ')
      return h('div', { className: 'kb-picture' },
        h('div', { className: 'kb-sources-head' }, h('strong', null, meta.title || meta.file || 'Untitled'),
          meta.figure ? ` · ${meta.figure}` : '', where ? ` · p. ${where}` : ''),
        meta.snippet ? h('blockquote', { className: 'kb-card-snippet' }, meta.snippet) : null,
        meta.note ? h('div', { className: 'kb-sources-notes' }, meta.note) : null,
        meta.images.map((image, i) => h(Picture, { key: i, picture: image, alt: `${meta.title || meta.file}` })),
      )
    }

    const TOOLS = ['kb_search', 'kb_rag']
    return {
      name: 'kb-rag-client',
      inject: ['slots'],
      apply(ctx) {
        for (const key of TOOLS) ctx.slots.register({ name: 'tool.call.toolview', key }, SourcesView)
        ctx.slots.register({ name: 'tool.call.toolview', key: 'kb_show' }, PictureView)
      },
      SourcesView,
      PictureView,
      sourcesOf,
    }
  }

  root.__ModuleLoader__.load({ id: 'dsh-kb-rag', factory })
})(typeof window !== 'undefined' ? window : globalThis)
