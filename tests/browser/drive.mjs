// Drives headless Chromium for tests/test_client_browser.py: `node drive.mjs CONFIG.json`.
//
// CONFIG: { playwright: folder holding node_modules/playwright-core, chromium: the browser's executable,
//           out: a folder for the screenshots, pages: [{ name, url }] }.
// For each page (a harness that mounts one kb-rag toolview) it waits for the pictures to load, measures the first
// card picture's thumbnail and its full picture, screenshots the page, clicks the thumbnail's <summary>, measures
// and screenshots again. It prints one JSON object with the measurements; the test makes the assertions.
// Exit status 3: Chromium did not start.
import { readFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import path from 'node:path'

const config = JSON.parse(readFileSync(process.argv[2], 'utf8'))
const require = createRequire(path.join(config.playwright, 'node_modules', 'noop.js'))
const { chromium } = require('playwright-core')

async function measure(page) {
  return page.evaluate(() => {
    const box = (el) => {
      if (!el) return null
      const r = el.getBoundingClientRect()
      return { x: r.x + window.scrollX, y: r.y + window.scrollY, width: r.width, height: r.height }
    }
    const image = (el) => el && {
      complete: el.complete, naturalWidth: el.naturalWidth, naturalHeight: el.naturalHeight, box: box(el),
      alt: el.alt, src_prefix: el.src.slice(0, 22),
    }
    const details = document.querySelector('details.kb-card-picture')
    return {
      cards: document.querySelectorAll('.kb-card').length,
      pictures: document.querySelectorAll('details.kb-card-picture').length,
      open: details ? details.open : null,
      head: (document.querySelector('.kb-sources-head') || {}).textContent || null,
      thumb: image(document.querySelector('img.kb-card-thumb')),
      thumbs: [...document.querySelectorAll('img.kb-card-thumb')].map(box),
      full: image(document.querySelector('img.kb-card-picture-full')),
    }
  })
}

let browser
try {
  browser = await chromium.launch({ executablePath: config.chromium, args: ['--no-sandbox'], timeout: 30000 })
} catch (e) {
  // exit 3: the browser did not start (the test skips); any other failure is the test's to report
  process.stderr.write(String(e.message || e).split('\n').filter((l) => l.trim())[0] || 'launch failed')
  process.exit(3)
}
const result = { version: browser.version(), pages: {} }
try {
  for (const { name, url } of config.pages) {
    const page = await browser.newPage({ viewport: { width: 1000, height: 700 }, deviceScaleFactor: 2 })
    const errors = []
    page.on('pageerror', (e) => errors.push(String(e)))
    page.on('console', (m) => { if (m.type() === 'error') errors.push(m.text()) })
    await page.goto(url, { waitUntil: 'load' })
    await page.waitForFunction(() => window.__KB_MOUNTED__ === true && [...document.images].every((i) => i.complete),
      null, { timeout: 10000 })
    const full = page.locator('img.kb-card-picture-full').first()
    const before = await measure(page)
    before.full_visible = await full.isVisible()
    before.full_bounding_box = await full.boundingBox()
    before.thumb_bounding_box = await page.locator('img.kb-card-thumb').first().boundingBox()
    const shotBefore = path.join(config.out, `${name}-before.png`)
    await page.screenshot({ path: shotBefore, fullPage: true })
    await page.locator('details.kb-card-picture > summary').first().click()
    await full.waitFor({ state: 'visible', timeout: 5000 })
    const after = await measure(page)
    after.full_visible = await full.isVisible()
    after.full_bounding_box = await full.boundingBox()
    after.thumb_bounding_box = await page.locator('img.kb-card-thumb').first().boundingBox()
    const shotAfter = path.join(config.out, `${name}-after.png`)
    await page.screenshot({ path: shotAfter, fullPage: true })
    result.pages[name] = { before, after, errors, scale: 2, screenshots: { before: shotBefore, after: shotAfter } }
    await page.close()
  }
} finally {
  await browser.close()
}
process.stdout.write(JSON.stringify(result))
