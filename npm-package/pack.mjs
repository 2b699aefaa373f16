#!/usr/bin/env node
// Builds the published dsh-kb-rag tarball from the files' single sources in the repository; nothing here is a
// second copy. A temporary folder gets:
//
//   package.json, README.md, install.mjs   from npm-package/
//   src/, client/, cordis.patch.yml        from plugin/
//   kb_engine.py, LICENSE                  from the repository root (byte-identical, checked after packing)
//   host-contract.json                     from the repository root (the engine's tool table, loaded by src/)
//   scripts/install.sh, install.ps1        from scripts/
//
// then `npm pack` runs there with a fixed argv (no shell). The result is checked: every file listed in
// package.json is in the tarball, the engine inside it hashes like the repository's, and package.json declares
// no lifecycle scripts at all (so installing the package never runs code).
//
//   node npm-package/pack.mjs [--out <dir>]     prints the absolute path of the .tgz on the last stdout line
//
// Also importable: `packBundle({ outDir, log })` returns { tarball, engineSha256, files }.

import { execFileSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import { chmodSync, cpSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

const HERE = path.dirname(fileURLToPath(import.meta.url))
export const REPO_ROOT = path.resolve(HERE, '..')
export const ENGINE = path.join(REPO_ROOT, 'kb_engine.py')

/** Staged path -> source path (relative to the repository root). */
export const SOURCES = Object.freeze({
  'package.json': 'npm-package/package.json',
  'README.md': 'npm-package/README.md',
  'install.mjs': 'npm-package/install.mjs',
  src: 'plugin/src',
  client: 'plugin/client',
  'cordis.patch.yml': 'plugin/cordis.patch.yml',
  'kb_engine.py': 'kb_engine.py',
  'host-contract.json': 'host-contract.json',
  LICENSE: 'LICENSE',
  'scripts/install.sh': 'scripts/install.sh',
  'scripts/install.ps1': 'scripts/install.ps1',
})

/** npm runs these on install, publish or pack; the package must declare none of them. */
export const LIFECYCLE_SCRIPTS = ['preinstall', 'install', 'postinstall', 'prepublish', 'preprepare', 'prepare',
  'postprepare', 'prepack', 'postpack', 'prepublishOnly', 'publish', 'postpublish', 'dependencies']

/** npm's own CLI script run by this node (no npm.cmd shim, which Windows cannot spawn without a shell). */
function npmArgv(args) {
  const candidates = [
    path.join(path.dirname(process.execPath), 'node_modules', 'npm', 'bin', 'npm-cli.js'),
    path.join(path.dirname(process.execPath), '..', 'lib', 'node_modules', 'npm', 'bin', 'npm-cli.js'),
  ]
  const cli = candidates.find((c) => existsSync(c))
  return cli ? [process.execPath, [cli, ...args]] : ['npm', args]
}

export const sha256 = (file) => createHash('sha256').update(readFileSync(file)).digest('hex')

function engineVersion() {
  const match = /^__version__ = "([^"]+)"$/m.exec(readFileSync(ENGINE, 'utf8'))
  if (!match) throw new Error(`no __version__ line in ${ENGINE}`)
  return match[1]
}

/** The manifest's own rules, checked before packing. */
export function checkManifest(pkg) {
  const problems = []
  if (pkg.name !== 'dsh-kb-rag') problems.push(`name is ${pkg.name}`)
  if (pkg.version !== engineVersion()) problems.push(`version ${pkg.version} differs from kb_engine.py's ${engineVersion()}`)
  const lifecycle = Object.keys(pkg.scripts ?? {}).filter((s) => LIFECYCLE_SCRIPTS.includes(s))
  if (lifecycle.length) problems.push(`lifecycle scripts declared: ${lifecycle.join(', ')}`)
  if (pkg.dsh?.bundle?.patch !== './cordis.patch.yml') problems.push('dsh.bundle.patch is not ./cordis.patch.yml')
  if (!pkg.bin?.['dsh-kb-rag-install']) problems.push('no dsh-kb-rag-install bin')
  for (const entry of pkg.files ?? []) {
    if (!Object.keys(SOURCES).includes(entry)) problems.push(`files lists ${entry}, which has no source`)
  }
  if (problems.length) throw new Error(`npm-package/package.json: ${problems.join('; ')}`)
}

export function packBundle({ outDir, log = (line) => process.stderr.write(`[pack] ${line}\n`) } = {}) {
  const pkg = JSON.parse(readFileSync(path.join(HERE, 'package.json'), 'utf8'))
  checkManifest(pkg)
  const out = path.resolve(outDir ?? mkdtempSync(path.join(os.tmpdir(), 'kb-rag-pack-out-')))
  mkdirSync(out, { recursive: true })
  const stage = mkdtempSync(path.join(os.tmpdir(), 'kb-rag-pack-'))
  try {
    for (const [staged, source] of Object.entries(SOURCES)) {
      const from = path.join(REPO_ROOT, source)
      if (!existsSync(from)) throw new Error(`${source} is missing`)
      cpSync(from, path.join(stage, staged), { recursive: true })
    }
    chmodSync(path.join(stage, 'install.mjs'), 0o755)
    chmodSync(path.join(stage, 'scripts', 'install.sh'), 0o755)
    log(`staged ${Object.keys(SOURCES).join(', ')} in ${stage}`)

    const argv = ['pack', '--json', '--pack-destination', out]
    log(`npm ${argv.join(' ')} (cwd ${stage})`)
    const [program, programArgs] = npmArgv(argv)
    const raw = execFileSync(program, programArgs, { cwd: stage, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] })
    const info = JSON.parse(raw)[0]
    const tarball = path.join(out, info.filename)
    const listed = info.files.map((f) => f.path)
    for (const entry of pkg.files) {
      if (!listed.some((f) => f === entry || f.startsWith(`${entry}/`))) throw new Error(`${entry} missing from the tarball`)
    }

    const check = mkdtempSync(path.join(os.tmpdir(), 'kb-rag-pack-check-'))
    try {
      execFileSync('tar', ['-xzf', tarball, '-C', check, 'package/kb_engine.py'], { stdio: ['ignore', 'pipe', 'pipe'] })
      const packed = sha256(path.join(check, 'package', 'kb_engine.py'))
      const repo = sha256(ENGINE)
      if (packed !== repo) throw new Error(`kb_engine.py in the tarball differs from the repository (${packed} != ${repo})`)
      log(`${info.filename}: ${listed.length} files, ${info.size} bytes; kb_engine.py sha256 ${repo.slice(0, 16)}... identical`)
      return { tarball, engineSha256: repo, files: listed }
    } finally {
      rmSync(check, { recursive: true, force: true })
    }
  } finally {
    rmSync(stage, { recursive: true, force: true })
  }
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const args = process.argv.slice(2)
  const i = args.indexOf('--out')
  const outDir = i >= 0 ? args[i + 1] : undefined
  try {
    const { tarball } = packBundle({ outDir })
    process.stdout.write(`${tarball}\n`)
  } catch (error) {
    process.stderr.write(`[pack] FAILED: ${error.stack ?? error}\n`)
    if (error.stderr) process.stderr.write(String(error.stderr))
    process.exit(1)
  }
}
