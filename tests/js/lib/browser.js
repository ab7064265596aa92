// Headless Chromium for the browser tests: Debian's `chromium` (or CHROMIUM_PATH), driven
// with puppeteer-core, which downloads no browser.
import fs from 'node:fs'
import puppeteer from 'puppeteer-core'

const CHROMIUM = process.env.CHROMIUM_PATH || '/usr/bin/chromium'

/** Launch headless Chromium; fails with the install command when there is none. */
export function launchBrowser() {
  if (!fs.existsSync(CHROMIUM)) {
    throw new Error(`no Chromium at ${CHROMIUM}: install it with \`apt-get install -y chromium\` (or set CHROMIUM_PATH)`)
  }
  return puppeteer.launch({
    executablePath: CHROMIUM,
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
  })
}
