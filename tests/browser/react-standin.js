// A DOM-building stand-in for React, for tests/test_client_browser.py.
//
// The DSH runtime hands the client bundle (plugin/client/index.js) the real React. The bundle's components use no
// hooks, no state and no context: they only call React.createElement. So this is enough to draw them in a real
// browser: createElement makes real DOM nodes at once (function components are called on the spot), props become
// the attributes the bundle uses (className, a style object, onClick, src, alt, width, height, title, href, ...),
// and children are flattened, with null, undefined and booleans dropped as React drops them.
/* global window, document */
;(function install(root) {
  function append(el, child) {
    if (child === null || child === undefined || child === false || child === true) return
    if (Array.isArray(child)) {
      for (const c of child) append(el, c)
      return
    }
    el.append(child instanceof root.Node ? child : document.createTextNode(String(child)))
  }

  function createElement(type, props, ...children) {
    const all = { ...(props || {}) }
    if (typeof type === 'function') return type({ ...all, children: children.flat(Infinity) })
    const el = document.createElement(type)
    for (const [name, value] of Object.entries(all)) {
      if (name === 'key' || name === 'children' || value === null || value === undefined || value === false) continue
      if (name === 'className') el.className = value
      else if (name === 'style') Object.assign(el.style, value)
      else if (name === 'onClick') el.addEventListener('click', value)
      else el.setAttribute(name, value === true ? '' : String(value))
    }
    append(el, children)
    return el
  }

  root.React = { createElement }
})(window)
