#!/usr/bin/env node
// `npx dsh-kb-rag-install`: runs the installer that ships in the dsh-kb-rag package (its install.mjs), with the
// same options. This package only exists so the short command works; it has no install-time scripts either.

import { main } from 'dsh-kb-rag/install'

process.exitCode = main(process.argv.slice(2))
