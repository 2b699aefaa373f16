// What the DSH host makes of the host contract, as JSON on stdout, for tests/test_mcp_server.py to hold against
// the MCP server: `node host-report.mjs` loads the plugin into a real tool registry and system prompt and prints
// the schemas and guidance the model sees; `node host-report.mjs --calls` reads {cwd, calls: [{tool, args}]} on
// stdin, runs each call through the registry in that workspace and prints [{text, isError}], the text the model
// reads.

import { readFileSync } from 'node:fs'
import { startHost, textOf } from './helpers.js'

const host = await startHost()
try {
  if (process.argv.includes('--calls')) {
    const { cwd, calls } = JSON.parse(readFileSync(0, 'utf8'))
    const out = []
    for (const { tool, args } of calls) {
      const result = await host.call(tool, args, { cwd })
      out.push({ text: textOf(result), isError: result.isError })
    }
    process.stdout.write(JSON.stringify(out))
  } else {
    const schemas = host.ctx.tools.schemas()
    const assembly = await host.ctx.systemPrompt.assemble()
    const guidance = assembly.sections.filter((s) => s.name.startsWith('tool:kb')).map((s) => s.text)
    process.stdout.write(JSON.stringify({ schemas, guidance }))
  }
} finally {
  await host.dispose()
}
