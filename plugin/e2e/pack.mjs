#!/usr/bin/env node
// Packs the plugin as the npm tarball that `dsh plugin add` installs, with the repository's kb_engine.py inside.
//
// A temporary folder gets the plugin's published files (package.json, src/, client/, cordis.patch.yml,
// README.md) and a byte-identical copy of ../kb_engine.py next to package.json (where the plugin looks first),
// then `npm pack` runs there with a fixed argv (no shell). The staged package.json lists kb_engine.py in
// "files"; the checked-in one does not, because in the repository the engine lives one level up.
//
//   node plugin/e2e/pack.mjs [--out <dir>]     prints the absolute path of the .tgz on the last stdout line
//
// Also importable: `packPlugin({ outDir })` returns { tarball, stageDir, engineSha256 }.

import { execFileSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import { cpSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

const HERE = path.dirname(fileURLToPath(import.meta.url))
export const PLUGIN_DIR = path.resolve(HERE, '..')
export const REPO_ROOT = path.resolve(PLUGIN_DIR, '..')
export const ENGINE = path.join(REPO_ROOT, 'kb_engine.py')

const STAGED = ['package.json', 'src', 'client', 'cordis.patch.yml', 'README.md']

export const sha256 = (file) => createHash('sha256').update(readFileSync(file)).digest('hex')

export function packPlugin({ outDir, log = (line) => process.stderr.write(`[pack] ${line}\n`) } = {}) {
  if (!existsSync(ENGINE)) throw new Error(`kb_engine.py not found at ${ENGINE}`)
  const out = path.resolve(outDir ?? mkdtempSync(path.join(os.tmpdir(), 'kb-rag-pack-out-')))
  mkdirSync(out, { recursive: true })
  const stage = mkdtempSync(path.join(os.tmpdir(), 'kb-rag-pack-'))
  try {
    log(`staging ${STAGED.join(', ')} + kb_engine.py in ${stage}`)
    for (const entry of STAGED) cpSync(path.join(PLUGIN_DIR, entry), path.join(stage, entry), { recursive: true })
    cpSync(ENGINE, path.join(stage, 'kb_engine.py'))
    const pkgFile = path.join(stage, 'package.json')
    const pkg = JSON.parse(readFileSync(pkgFile, 'utf8'))
    pkg.files = [...new Set([...(pkg.files ?? []), 'kb_engine.py'])]
    delete pkg.devDependencies // not needed by an installed bundle; keeps pnpm from resolving them
    writeFileSync(pkgFile, `${JSON.stringify(pkg, null, 2)}\n`)

    const argv = ['pack', '--json', '--pack-destination', out]
    log(`npm ${argv.join(' ')} (cwd ${stage})`)
    const raw = execFileSync('npm', argv, { cwd: stage, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] })
    const info = JSON.parse(raw)[0]
    const tarball = path.join(out, info.filename)
    const listed = info.files.map((f) => f.path)
    if (!listed.includes('kb_engine.py')) throw new Error(`kb_engine.py missing from the tarball (files: ${listed.join(', ')})`)

    // Byte-identical check: unpack kb_engine.py from the tarball and compare hashes.
    const check = mkdtempSync(path.join(os.tmpdir(), 'kb-rag-pack-check-'))
    try {
      execFileSync('tar', ['-xzf', tarball, '-C', check, 'package/kb_engine.py'], { stdio: ['ignore', 'pipe', 'pipe'] })
      const packed = sha256(path.join(check, 'package', 'kb_engine.py'))
      const repo = sha256(ENGINE)
      if (packed !== repo) throw new Error(`kb_engine.py in the tarball differs from the repository (${packed} != ${repo})`)
      log(`${info.filename}: ${listed.length} files, ${info.size} bytes; kb_engine.py sha256 ${repo.slice(0, 16)}… identical`)
      return { tarball, stageDir: stage, engineSha256: repo, files: listed }
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
    const { tarball } = packPlugin({ outDir })
    process.stdout.write(`${tarball}\n`)
  } catch (error) {
    process.stderr.write(`[pack] FAILED: ${error.stack ?? error}\n`)
    if (error.stderr) process.stderr.write(String(error.stderr))
    process.exit(1)
  }
}
