// ESLint over the plugin's JavaScript (`npm run lint`; `make lint` and the plugin's pytest wrapper run it too):
// ESLint's recommended rules, which catch undefined names, unused variables and bindings, unreachable code,
// duplicate keys and the like, with each file's real globals. Development only: neither package.json's "files"
// nor npm-package/pack.mjs ships this file.

import js from '@eslint/js'
import globals from 'globals'

export default [
  js.configs.recommended,
  {
    linterOptions: { reportUnusedDisableDirectives: 'error' },
    rules: {
      // `const { index, ...rest } = item` leaves out a key on purpose: the named sibling is not an unused binding.
      'no-unused-vars': ['error', { ignoreRestSiblings: true }],
    },
  },
  {
    // The host half, its tests and the end-to-end driver: ES modules (.cjs: CommonJS) run by Node.
    files: ['src/**', 'test/**', 'testlib/**', 'e2e/**', '*.js'],
    languageOptions: { globals: globals.node },
  },
  {
    // The client half is a classic browser script in the DSH client-bundle format, not a module, and has no Node.
    files: ['client/**'],
    languageOptions: { sourceType: 'script', globals: globals.browser },
  },
]
