// What the DSH host makes of the host contract, as JSON on stdout, for tests/test_contract.py to hold against the
// MCP server: `node host-report.mjs` loads the plugin into a real tool registry and system prompt and prints the
// schemas and guidance the model sees; `node host-report.mjs --checks` reads [{tool, args}] on stdin and prints,
// for each, the message of the first failed check (or null) and the payload built with the workspace "/ws".

import { readFileSync } from 'node:fs'
import { TOOLS_BY_NAME, buildPayload, checkArguments } from '../src/contract.js'
import { startHost } from './helpers.js'

function checked({ tool, args }) {
  const spec = TOOLS_BY_NAME[tool]
  try {
    checkArguments(spec, args)
  } catch (error) {
    return { failed: error.message, payload: null }
  }
  return { failed: null, payload: buildPayload(spec, args, '/ws') }
}

if (process.argv.includes('--checks')) {
  const cases = JSON.parse(readFileSync(0, 'utf8'))
  process.stdout.write(JSON.stringify(cases.map(checked)))
} else {
  const host = await startHost()
  const schemas = host.ctx.tools.schemas()
  const assembly = await host.ctx.systemPrompt.assemble()
  const guidance = assembly.sections.filter((s) => s.name.startsWith('tool:kb')).map((s) => s.text)
  await host.dispose()
  process.stdout.write(JSON.stringify({ schemas, guidance }))
}
