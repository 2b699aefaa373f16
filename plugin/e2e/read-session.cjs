// Prints a DSH session log (session.jsonl.zstd) as plain JSONL. Run with Node >= 22.15 (zlib zstd):
//   node read-session.cjs <file>
// DSH appends one zstd frame per write, and zlib decodes only the first frame of a buffer, so the file is split
// at frame magic numbers; a piece that does not decode on its own (a magic number inside compressed data) is
// joined with the next one.
'use strict'
const fs = require('node:fs')
const zlib = require('node:zlib')

const MAGIC = Buffer.from([0x28, 0xb5, 0x2f, 0xfd])
const data = fs.readFileSync(process.argv[2])
const starts = []
for (let i = data.indexOf(MAGIC); i >= 0; i = data.indexOf(MAGIC, i + 1)) starts.push(i)
if (starts[0] !== 0) throw new Error('not a zstd file')
starts.push(data.length)
let from = 0
for (let k = 1; k < starts.length; k += 1) {
  try {
    process.stdout.write(zlib.zstdDecompressSync(data.subarray(from, starts[k])))
    from = starts[k]
  } catch (error) {
    if (k === starts.length - 1) throw error
  }
}
