// The host contract: every kb_* tool's name, description, schema, argument checks and hints, the guidance text and
// the rendering budget, shared with the MCP server. It is the engine's table (`kb_engine.py contract --json`)
// saved as host-contract.json beside kb_engine.py, so both hosts offer the same tools with the engine's limits;
// this module only interprets it.

import { existsSync, readFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

const SUPPORTED_CONTRACT = 1

/** host-contract.json: beside the package's kb_engine.py (npm bundle), else at the repository root. */
export function contractPath() {
  const here = path.dirname(fileURLToPath(import.meta.url))
  const candidates = [path.resolve(here, '..', 'host-contract.json'), path.resolve(here, '..', '..', 'host-contract.json')]
  return candidates.find((p) => existsSync(p)) ?? candidates[candidates.length - 1]
}

export function loadContract(file = contractPath()) {
  const contract = JSON.parse(readFileSync(file, 'utf8'))
  if (contract.contract !== SUPPORTED_CONTRACT) {
    throw new Error(`${file}: host contract version ${contract.contract}, this plugin reads version ${SUPPORTED_CONTRACT}`)
  }
  return contract
}

export const CONTRACT = loadContract()
export const TOOLS_BY_NAME = Object.fromEntries(CONTRACT.tools.map((tool) => [tool.name, tool]))

/** The tool's JSON Schema in DSH's parameter form: the root's properties, each required one marked in place. */
export function toParameters(tool) {
  const required = new Set(tool.input_schema.required ?? [])
  return Object.fromEntries(Object.entries(tool.input_schema.properties)
    .map(([name, schema]) => [name, required.has(name) ? { ...schema, required: true } : schema]))
}

/** Whether an argument was really given: not absent, false, blank, or a list of nothing but blanks. */
export function given(value) {
  if (value === undefined || value === null || value === false) return false
  if (typeof value === 'string') return value.trim() !== ''
  if (Array.isArray(value)) return value.some(given)
  return true
}

const isNumber = (value) => typeof value === 'number' && Number.isFinite(value)

/** Each check rule: true when the arguments pass. Mirrors the rules of mcp-server/server.py (same contract). */
const RULES = {
  not_blank: (args, check) => typeof args[check.field] === 'string' && args[check.field].trim() !== '',
  range: (args, check) => {
    const value = args[check.field]
    return !isNumber(value) || ((check.min === undefined || value >= check.min) && (check.max === undefined || value <= check.max))
  },
  max_items: (args, check) => !Array.isArray(args[check.field]) || args[check.field].length <= check.max,
  exclusive: (args, check) => !check.fields.every((field) => given(args[field])),
  any_of: (args, check) => check.fields.some((field) => given(args[field])),
  needs: (args, check) => !given(args[check.field]) || given(args[check.needs]),
  is_true: (args, check) => args[check.field] === true,
}

/** Throw the first failed check's message (the model reads it), or return. */
export function checkArguments(tool, args) {
  for (const check of tool.checks) {
    const rule = RULES[check.rule]
    if (!rule) throw new Error(`host contract: unknown check rule "${check.rule}" in ${tool.name}`)
    if (!rule(args, check)) throw new Error(check.message)
  }
}

function cleanValue(value) {
  if (typeof value === 'string') return value.trim() || undefined
  if (Array.isArray(value)) {
    const items = value.map((item) => (typeof item === 'string' ? item.trim() : item)).filter((item) => given(item))
    return items.length ? items : undefined
  }
  if (value && typeof value === 'object') {
    const entries = Object.entries(value).filter(([, item]) => item !== undefined && item !== null)
    return entries.length ? Object.fromEntries(entries) : undefined
  }
  return value ?? undefined
}

/**
 * `p` as the engine gets it: a leading `~` (alone or before a separator) is the home folder, a relative path is
 * taken from `base`, and `.`, `..` and repeated separators are folded, without looking at the disk.
 */
export function resolvedPath(base, p, home) {
  const separators = path.sep === '/' ? ['/'] : ['/', path.sep]
  const expanded = p === '~' || (p.startsWith('~') && separators.includes(p[1])) ? home + p.slice(1) : p
  return path.resolve(base, expanded)
}

/**
 * The engine payload: declared arguments only, strings trimmed, blanks left out, relative paths taken from
 * `base` (the workspace) and `~` from `home`.
 */
export function buildPayload(tool, args, base, home = os.homedir()) {
  const payload = {}
  for (const name of Object.keys(tool.input_schema.properties)) {
    let value = cleanValue(Object.hasOwn(args, name) ? args[name] : undefined)
    if (value === undefined) continue
    if (tool.path_fields.includes(name)) {
      value = Array.isArray(value) ? value.map((p) => resolvedPath(base, p, home)) : resolvedPath(base, value, home)
    }
    payload[name] = value
  }
  return payload
}

/** The guidance section for a host offering `toolNames`: lines that need a tool the host lacks are left out. */
export function guidanceText(toolNames) {
  const offered = new Set(toolNames)
  const lines = CONTRACT.guidance.lines.filter((line) => !line.needs || offered.has(line.needs))
  return [CONTRACT.guidance.heading, ...lines.map((line) => `- ${line.text}`)].join('\n')
}
