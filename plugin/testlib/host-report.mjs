// What the DSH host makes of the host contract, as JSON on stdout, for tests/test_mcp_server.py to hold against
// the MCP server: `node host-report.mjs` loads the plugin into a real tool registry and system prompt and prints
// the schemas and guidance the model sees.

import { startHost } from './helpers.js'

const host = await startHost()
const schemas = host.ctx.tools.schemas()
const assembly = await host.ctx.systemPrompt.assemble()
const guidance = assembly.sections.filter((s) => s.name.startsWith('tool:kb')).map((s) => s.text)
await host.dispose()
process.stdout.write(JSON.stringify({ schemas, guidance }))
