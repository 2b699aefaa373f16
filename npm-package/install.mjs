#!/usr/bin/env node
// dsh-kb-rag-install: the npm entry of the kb-rag installer. It checks the options, then hands them to
// scripts/install.sh (bash: macOS, Linux) or scripts/install.ps1 (Windows PowerShell) with spawnSync and a fixed
// argv: no shell ever parses a command line here. On Windows the options are translated through one fixed
// table. It runs only when called (`npx dsh-kb-rag-install`): the package has no install-time scripts.
//
//   dsh-kb-rag-install [--profile NAME] [--mirror URL] [--models | --no-models] [--offline-model] [--with-docx] [--with-ocr]
//                      [--with-watch] [--with-mcp]
//                      [--python PATH] [--venv DIR | --no-venv] [--torch auto|cpu|gpu|skip] [--plugin SPEC]
//                      [--dry-run] [-y] [-h]

import { spawnSync } from 'node:child_process'
import { existsSync, realpathSync } from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

const HERE = path.dirname(fileURLToPath(import.meta.url))
export const SCRIPTS_DIR = path.join(HERE, 'scripts')

/** Every option: its PowerShell parameter and whether it takes a value. The only translation there is. */
export const OPTIONS = Object.freeze({
  '--profile': { ps: '-Profile', value: true },
  '--mirror': { ps: '-Mirror', value: true },
  '--models': { ps: '-Models', value: false },
  '--no-models': { ps: '-NoModels', value: false },
  '--offline-model': { ps: '-OfflineModel', value: false },
  '--with-docx': { ps: '-WithDocx', value: false },
  '--with-ocr': { ps: '-WithOcr', value: false },
  '--with-watch': { ps: '-WithWatch', value: false },
  '--with-mcp': { ps: '-WithMcp', value: false },
  '--python': { ps: '-Python', value: true },
  '--venv': { ps: '-Venv', value: true },
  '--no-venv': { ps: '-NoVenv', value: false },
  '--torch': { ps: '-Torch', value: true },
  '--plugin': { ps: '-Plugin', value: true },
  '--dry-run': { ps: '-DryRun', value: false },
  '--yes': { ps: '-Yes', value: false },
  '--help': { ps: '-Help', value: false },
})
const ALIASES = Object.freeze({ '-y': '--yes', '-h': '--help' })
const TORCH_MODES = ['auto', 'cpu', 'gpu', 'skip']

export class UsageError extends Error {}

/**
 * Check the options; returns them as [option, value?] pairs in their long form.
 * `--name=value` and `--name value` are both accepted; anything unknown is refused before a script runs.
 */
export function parseOptions(argv) {
  const parsed = []
  for (let i = 0; i < argv.length; i++) {
    let arg = argv[i]
    let inline = null
    const eq = arg.indexOf('=')
    if (arg.startsWith('--') && eq > 0) {
      inline = arg.slice(eq + 1)
      arg = arg.slice(0, eq)
    }
    const name = ALIASES[arg] ?? arg
    const spec = OPTIONS[name]
    if (!spec) throw new UsageError(`unknown option: ${argv[i]}`)
    if (!spec.value) {
      if (inline !== null) throw new UsageError(`${name} takes no value`)
      parsed.push([name])
      continue
    }
    const value = inline ?? argv[++i]
    if (value === undefined || value === '' || (inline === null && value.startsWith('--'))) {
      throw new UsageError(`${name} needs a value`)
    }
    if (name === '--torch' && !TORCH_MODES.includes(value)) {
      throw new UsageError(`--torch takes ${TORCH_MODES.join(', ')} (got: ${value})`)
    }
    parsed.push([name, value])
  }
  return parsed
}

/** The arguments for install.sh: the checked options, long form. */
export function bashArguments(options) {
  return options.flat()
}

/** The arguments for install.ps1: each option through the table, values as separate arguments. */
export function powershellArguments(options) {
  return options.flatMap(([name, ...value]) => [OPTIONS[name].ps, ...value])
}

/** The program and argv that run the platform's installer script. */
export function installerCommand(options, platform = process.platform) {
  if (platform === 'win32') {
    const script = path.join(SCRIPTS_DIR, 'install.ps1')
    return { file: 'powershell.exe', argv: ['-NoProfile', '-ExecutionPolicy', 'Bypass', '-File', script, ...powershellArguments(options)], script }
  }
  const script = path.join(SCRIPTS_DIR, 'install.sh')
  return { file: 'bash', argv: [script, ...bashArguments(options)], script }
}

export function main(argv = process.argv.slice(2)) {
  let options
  try {
    options = parseOptions(argv)
  } catch (error) {
    if (!(error instanceof UsageError)) throw error
    process.stderr.write(`dsh-kb-rag-install: ${error.message}\nRun dsh-kb-rag-install --help for the options.\n`)
    return 2
  }
  const { file, argv: args, script } = installerCommand(options)
  if (!existsSync(script)) {
    process.stderr.write(`dsh-kb-rag-install: ${script} is missing from this package; reinstall dsh-kb-rag\n`)
    return 1
  }
  const result = spawnSync(file, args, { stdio: 'inherit', windowsHide: false })
  if (result.error) {
    const fix = process.platform === 'win32'
      ? 'Windows PowerShell (powershell.exe) is part of Windows; check that it is on PATH'
      : 'install bash (on macOS and Linux it is normally present)'
    process.stderr.write(`dsh-kb-rag-install: could not start ${file} (${result.error.code ?? result.error.message}): ${fix}\n`)
    return 1
  }
  if (result.signal) return 1
  return result.status ?? 1
}

/** Run as a program (directly, or through npm's bin link, which is a symlink on POSIX), not imported. */
function invokedDirectly() {
  try {
    return Boolean(process.argv[1]) && realpathSync(process.argv[1]) === realpathSync(fileURLToPath(import.meta.url))
  } catch {
    return false
  }
}

if (invokedDirectly()) process.exitCode = main()
