// Resident engine processes: one `kb_engine.py serve` per workspace.
//
// Each EngineDaemon owns one child process started with a fixed argv (no shell). Requests go out one JSON line
// at a time through a serial queue; replies come back line by line and are matched by request id. Progress lines
// (`event: "progress"`) are handed to the caller's onProgress callback and never taken for a reply. When the
// process dies, the request in flight fails with a readable message and the next request starts a new process.
// An aborted request kills the process (its channel can no longer be trusted) and the next one starts afresh.

import { spawn } from 'node:child_process'

const STDERR_TAIL = 4000
// The longest reply line read. The engine never writes one over 48 MiB (it answers reply_too_large instead), so a
// longer line comes from an engine of another version or a broken one: its request fails, the channel goes on.
export const LINE_LIMIT = 64 * 1024 * 1024
const REPLY_ID = /^\s*\{\s*"id"\s*:\s*(-?\d+)\s*[,}]/
const KILL_WAIT_MS = 3000
const STOP_GRACE_MS = 2000
const posix = process.platform !== 'win32'

/** The engine answered `ok: false`. */
export class EngineError extends Error {
  constructor(message, code, command) {
    super(message)
    this.name = 'EngineError'
    this.code = code ?? 'internal'
    this.command = command
  }
}

/** The engine process could not be started or ended while a request was in flight. */
export class DaemonError extends Error {
  constructor(message) {
    super(message)
    this.name = 'DaemonError'
  }
}

/** The caller's signal aborted the request. */
export class AbortedError extends Error {
  constructor(message) {
    super(message)
    this.name = 'AbortError'
  }
}

function describeExit(code, signal) {
  if (signal) return `was killed by ${signal}`
  if (code === null || code === undefined) return 'ended'
  return `exited with status ${code}`
}

/**
 * Splits a byte stream into lines, calling `onLine(text)` for each and `onOversized(head)` for one longer than
 * `limit` bytes, whose bytes are skipped up to its newline without being kept: memory stays bounded by the limit.
 */
export class LineSplitter {
  constructor(limit, onLine, onOversized) {
    this.limit = limit
    this.onLine = onLine
    this.onOversized = onOversized
    this.parts = []
    this.size = 0
    this.skipping = false
  }

  push(chunk) {
    let start = 0
    while (start < chunk.length) {
      const end = chunk.indexOf(10, start)
      const stop = end < 0 ? chunk.length : end + 1
      if (this.skipping) {
        if (end >= 0) this.skipping = false
      } else {
        this.parts.push(chunk.subarray(start, end < 0 ? stop : end))
        this.size += stop - start
        if (this.size > this.limit) {
          this.onOversized(Buffer.concat(this.parts).subarray(0, 256).toString('utf8'))
          this._clear()
          this.skipping = end < 0
        } else if (end >= 0) {
          const line = Buffer.concat(this.parts).toString('utf8')
          this._clear()
          this.onLine(line)
        }
      }
      start = stop
    }
  }

  end() {
    if (this.parts.length && !this.skipping) this.onLine(Buffer.concat(this.parts).toString('utf8'))
    this._clear()
  }

  _clear() {
    this.parts = []
    this.size = 0
  }
}

/** Resolves with `promise`, or rejects with an AbortedError as soon as `signal` aborts. */
function untilAborted(promise, signal, command) {
  if (!signal) return promise
  return new Promise((resolve, reject) => {
    const onAbort = () => reject(new AbortedError(`kb engine call "${command}" was cancelled while waiting for an earlier call`))
    if (signal.aborted) return onAbort()
    signal.addEventListener('abort', onAbort, { once: true })
    promise.then(() => {
      signal.removeEventListener('abort', onAbort)
      resolve()
    })
  })
}

export class EngineDaemon {
  /**
   * @param {object} options
   * @param {string} options.python   interpreter
   * @param {string} options.engine   absolute path of kb_engine.py
   * @param {string} options.cwd      working directory (the workspace)
   * @param {Record<string,string>} [options.env]
   * @param {{debug: Function, warn: Function}} [options.log]
   * @param {number} [options.lineLimit]   the longest reply line read (bytes)
   */
  constructor({ python, engine, cwd, env, log, lineLimit = LINE_LIMIT }) {
    this.python = python
    this.lineLimit = lineLimit
    this.engine = engine
    this.cwd = cwd
    this.env = env ?? process.env
    this.log = log ?? { debug() {}, warn() {}, info() {} }
    this.child = null
    this.closed = null // promise that settles when the current child has fully closed
    this.nextId = 1
    this.pending = new Map()
    this.stderrTail = ''
    this.tail = Promise.resolve()
    this.busy = 0
    this.starts = 0
    this.lastUsed = Date.now()
    this.stopped = false
  }

  get pid() {
    return this.child?.pid ?? null
  }

  get running() {
    return this.child !== null
  }

  get idle() {
    return this.busy === 0
  }

  /**
   * Send one command and resolve with its `response`. Requests run strictly one after another.
   * @param {string} command
   * @param {object} payload
   * @param {{signal?: AbortSignal, onProgress?: (event: object) => void}} [options]
   */
  request(command, payload, options = {}) {
    this.busy++
    this.lastUsed = Date.now()
    const previous = this.tail
    // A request still waiting for its turn owns no work: an abort settles it at once.
    const run = untilAborted(previous, options.signal, command).then(() => this._run(command, payload, options))
    this.tail = Promise.allSettled([previous, run]).then(() => {})
    return run.finally(() => {
      this.busy--
      this.lastUsed = Date.now()
    })
  }

  async _run(command, payload, { signal, onProgress }) {
    if (this.stopped) throw new DaemonError('the kb engine was shut down (the plugin is stopping)')
    if (signal?.aborted) throw new AbortedError(`kb engine call "${command}" was cancelled before it started`)
    const id = this.nextId++
    const line = JSON.stringify({ id, command, payload }) + '\n'

    return await new Promise((resolve, reject) => {
      let settled = false
      const finish = (fn, value) => {
        if (settled) return
        settled = true
        this.pending.delete(id)
        signal?.removeEventListener('abort', onAbort)
        fn(value)
      }
      const onAbort = () => {
        if (settled) return
        this.log.debug('request %s (%s) aborted: restarting the engine', id, command)
        // The serial channel now holds a request nobody waits for: kill the process (and its workers) and
        // settle only once it is gone, so that no owned work outlives the call. The entry leaves the pending
        // map first, so the exit handler does not report the kill as a crash.
        this.pending.delete(id)
        this._kill().then(() => {
          finish(reject, new AbortedError(`kb engine call "${command}" was cancelled; the engine process was stopped and will restart on the next call`))
        })
      }
      const entry = {
        command,
        onProgress,
        resends: 0,
        resolve: (value) => finish(resolve, value),
        reject: (error) => finish(reject, error),
        // A process that had already died when the line was written never saw it (the write fails with
        // EPIPE): such a request is sent again, once, to a fresh process instead of being reported as a crash.
        send: () => {
          if (settled) return
          this._ensureStarted()
          const child = this.child
          entry.delivery = 'writing'
          entry.child = child
          try {
            child.stdin.write(line, (error) => {
              entry.delivery = error ? 'failed' : 'written'
              if (error) this.log.debug('write to engine failed: %s', error.message)
              if (entry.closedEarly) {
                entry.closedEarly = false
                this._afterClose(entry)
              }
            })
          } catch (error) {
            entry.delivery = 'failed'
            this.log.debug('write to engine failed: %s', error.message)
          }
        },
      }
      this.pending.set(id, entry)
      signal?.addEventListener('abort', onAbort, { once: true })
      entry.send()
    })
  }

  /** The process of a pending request closed without replying: resend it or report the crash. */
  _afterClose(entry) {
    if (entry.delivery === 'writing') {
      // The outcome of the write is not known yet: decide when it is (or assume it arrived).
      entry.closedEarly = true
      setTimeout(() => {
        if (!entry.closedEarly) return
        entry.closedEarly = false
        entry.delivery = 'written'
        this._afterClose(entry)
      }, 100).unref?.()
      return
    }
    if (entry.delivery === 'failed' && entry.resends < 1 && !this.stopped) {
      entry.resends++
      this.log.debug('request "%s" reached a dead engine: sending it to a fresh one', entry.command)
      entry.send()
      return
    }
    entry.reject(new DaemonError(entry.crashMessage ?? `the kb engine process ended while running "${entry.command}". The next kb_* call starts a fresh engine.`))
  }

  _ensureStarted() {
    if (this.child) return
    this.starts++
    this.stderrTail = ''
    const argv = [this.engine, 'serve']
    this.log.debug('starting %s %s in %s', this.python, argv.join(' '), this.cwd)
    const child = spawn(this.python, argv, {
      cwd: this.cwd,
      env: this.env,
      stdio: ['pipe', 'pipe', 'pipe'],
      // Own process group on POSIX, so that a kill also reaches the engine's reader workers.
      detached: posix,
      windowsHide: true,
    })
    this.child = child
    let spawnError = null
    this.closed = new Promise((resolve) => {
      child.once('close', (code, signal) => {
        if (this.child === child) this.child = null
        const why = spawnError
          ? `could not be started (${spawnError.code ?? spawnError.message}); check the plugin's python option ("${this.python}") and that the workspace ${this.cwd} exists`
          : describeExit(code, signal)
        const stderr = this.stderrTail.trim()
        for (const entry of [...this.pending.values()]) {
          if (entry.child !== child) continue
          entry.crashMessage = `the kb engine process ${why} while running "${entry.command}"` +
            (stderr ? `; its last output: ${stderr.slice(-800)}` : '') +
            '. The next kb_* call starts a fresh engine.'
          this._afterClose(entry)
        }
        this.log.debug('engine process %s %s', child.pid ?? '?', why)
        resolve()
      })
    })
    child.once('error', (error) => {
      spawnError = error
      this.log.debug('engine process error: %s', error.message)
    })
    child.stdin.on('error', (error) => this.log.debug('engine stdin: %s', error.message))
    child.stderr.setEncoding('utf8')
    child.stderr.on('data', (chunk) => {
      this.stderrTail = (this.stderrTail + chunk).slice(-STDERR_TAIL)
    })
    const lines = new LineSplitter(this.lineLimit, (text) => this._onLine(text), (head) => this._onOversized(head))
    child.stdout.on('data', (chunk) => lines.push(chunk))
    child.stdout.on('end', () => lines.end())
  }

  /**
   * A reply line too long to read fails the request it answers (every pending one when its id cannot be read: the
   * channel is serial, so that is the one in flight) with a clear error, instead of leaving it waiting.
   */
  _onOversized(head) {
    const match = REPLY_ID.exec(head)
    const entry = match ? this.pending.get(Number(match[1])) : undefined
    const targets = entry ? [entry] : [...this.pending.values()]
    for (const target of targets) {
      target.reject(new EngineError(`the engine's reply is longer than the ${Math.round(this.lineLimit / 1048576)} MiB this client reads, ` +
        'so it was dropped; ask for less at a time (a smaller top_k or snippet)', 'reply_too_large', target.command))
    }
  }

  _onLine(text) {
    const trimmed = text.trim()
    if (!trimmed) return
    let message
    try {
      message = JSON.parse(trimmed)
    } catch {
      this.log.debug('ignoring a non-JSON line from the engine: %s', trimmed.slice(0, 200))
      return
    }
    if (message === null || typeof message !== 'object' || Array.isArray(message)) return
    // A reply whose id could not be read (null) belongs to the one request in flight: requests are serial.
    let entry = this.pending.get(message.id)
    if (!entry && message.id === null && this.pending.size === 1) entry = [...this.pending.values()][0]
    if (!entry) {
      this.log.debug('ignoring an engine line for unknown id %o', message.id)
      return
    }
    if (message.event !== undefined && message.event !== null) {
      if (message.event === 'progress' && entry.onProgress) {
        try {
          entry.onProgress(message)
        } catch (error) {
          this.log.debug('progress handler failed: %s', error.message)
        }
      }
      return
    }
    const response = message.response !== null && typeof message.response === 'object' && !Array.isArray(message.response) ? message.response : {}
    if (message.ok === true) entry.resolve(response)
    else entry.reject(new EngineError(String(message.error ?? 'the engine reported an error'), message.code, entry.command))
  }

  /** Kill the process (and its process group) now; resolves once it has closed. */
  async _kill() {
    const child = this.child
    if (!child) return
    try {
      if (posix && child.pid) process.kill(-child.pid, 'SIGKILL')
      else child.kill('SIGKILL')
    } catch {
      try { child.kill('SIGKILL') } catch { /* already gone */ }
    }
    await Promise.race([this.closed, new Promise((r) => setTimeout(r, KILL_WAIT_MS).unref?.())])
  }

  /** Close stdin (the engine exits at EOF), wait a little, then kill. No new request is accepted after this. */
  async stop({ final = true } = {}) {
    if (final) this.stopped = true
    const child = this.child
    if (!child) return
    try { child.stdin.end() } catch { /* ignore */ }
    const timer = new Promise((r) => setTimeout(() => r('timeout'), STOP_GRACE_MS).unref?.())
    const outcome = await Promise.race([this.closed.then(() => 'closed'), timer])
    if (outcome !== 'closed') await this._kill()
  }
}

/**
 * One daemon per workspace, at most `max` of them, each stopped after `idleMs` without a request.
 */
export class DaemonPool {
  /**
   * `keep(workspace, daemon)`: asked when a daemon has been idle for `idleMs`; a promise of true keeps it running
   * for another spell (its library has watched sources, which only a running engine keeps in step).
   */
  constructor({ create, max = 4, idleMs = 30 * 60_000, log, keep = null }) {
    this.create = create
    this.max = max
    this.idleMs = idleMs
    this.keep = keep
    this.log = log ?? { debug() {} }
    this.daemons = new Map()
    this.timers = new Map()
    this.closing = false
  }

  get size() {
    return this.daemons.size
  }

  /** The daemon for a workspace, created when missing. */
  get(workspace) {
    if (this.closing) throw new DaemonError('the kb-rag plugin is shutting down')
    let daemon = this.daemons.get(workspace)
    if (!daemon) {
      this._evict()
      daemon = this.create(workspace)
      this.daemons.set(workspace, daemon)
    }
    this._clearTimer(workspace)
    return daemon
  }

  /** Run one request on the workspace's daemon, then arm its idle timer. */
  async request(workspace, command, payload, options) {
    const daemon = this.get(workspace)
    try {
      return await daemon.request(command, payload, options)
    } finally {
      this._arm(workspace, daemon)
    }
  }

  _arm(workspace, daemon) {
    if (!(this.idleMs > 0) || !daemon.idle || this.daemons.get(workspace) !== daemon) return
    this._clearTimer(workspace)
    const timer = setTimeout(async () => {
      this.timers.delete(workspace)
      if (this.closing || !daemon.idle || this.daemons.get(workspace) !== daemon) return
      if (this.keep && await this.keep(workspace, daemon).catch(() => false)) {
        this._arm(workspace, daemon)
        return
      }
      if (this.closing || !daemon.idle || this.daemons.get(workspace) !== daemon) return     // a call came meanwhile
      this.daemons.delete(workspace)
      this.log.debug('stopping the idle engine of %s', workspace)
      daemon.stop().catch(() => {})
    }, this.idleMs)
    timer.unref?.()
    this.timers.set(workspace, timer)
  }

  _clearTimer(workspace) {
    const timer = this.timers.get(workspace)
    if (timer) clearTimeout(timer)
    this.timers.delete(workspace)
  }

  /** Stop a workspace's daemon if it is idle (one started for nothing); true when it was stopped. */
  release(workspace) {
    const daemon = this.daemons.get(workspace)
    if (!daemon || !daemon.idle) return false
    this._clearTimer(workspace)
    this.daemons.delete(workspace)
    daemon.stop().catch(() => {})
    return true
  }

  /** Make room for one more daemon: stop the least recently used idle one. */
  _evict() {
    while (this.daemons.size >= this.max) {
      const idle = [...this.daemons.entries()].filter(([, d]) => d.idle).sort((a, b) => a[1].lastUsed - b[1].lastUsed)
      if (!idle.length) return // every daemon is busy: allow one over the cap rather than fail a call
      const [workspace, daemon] = idle[0]
      this._clearTimer(workspace)
      this.daemons.delete(workspace)
      this.log.debug('stopping the engine of %s to stay within %d daemons', workspace, this.max)
      daemon.stop().catch(() => {})
    }
  }

  /** Stop every daemon (plugin disposal). */
  async closeAll() {
    this.closing = true
    for (const workspace of [...this.timers.keys()]) this._clearTimer(workspace)
    const all = [...this.daemons.values()]
    this.daemons.clear()
    await Promise.allSettled(all.map((d) => d.stop()))
  }
}
