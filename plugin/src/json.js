// Lossless-JSON helpers: the tool registry refuses any value holding `undefined`, NaN or Infinity.

/**
 * A copy of `value` that is plain, lossless JSON: keys whose value is undefined (or a function) are dropped,
 * undefined array items and non-finite numbers become null.
 */
export function clean(value) {
  if (value === null) return null
  switch (typeof value) {
    case 'string':
    case 'boolean':
      return value
    case 'number':
      return Number.isFinite(value) ? (Object.is(value, -0) ? 0 : value) : null
    case 'bigint':
      return Number(value)
    case 'object': {
      if (Array.isArray(value)) return Array.from(value, (item) => (item === undefined ? null : clean(item)))
      const out = {}
      for (const [key, item] of Object.entries(value)) {
        if (item === undefined || typeof item === 'function' || typeof item === 'symbol') continue
        out[key] = clean(item)
      }
      return out
    }
    default:
      return null
  }
}

/** `obj` without the keys whose value is undefined or null (for building engine payloads). */
export function compact(obj) {
  const out = {}
  for (const [key, value] of Object.entries(obj)) {
    if (value !== undefined && value !== null) out[key] = value
  }
  return out
}
