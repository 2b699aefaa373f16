#!/usr/bin/env python3
"""Metadata accuracy of kb_engine against the hand-checked table benchmarks/metadata_truth.tsv.

The corpus (default: $KB_CORPUS_DIR, else ../shared/corpus beside the repository) is ingested into a fresh
temporary kb_root with KB_EMBED_MODEL=none (no model is loaded), every document's metadata is read back with
the `docs` command, and each row of the truth table is compared with what the engine stored:

- DOI: exact match after lower-casing and stripping surrounding whitespace and trailing punctuation; the
  accuracy is over rows whose truth has a DOI. "False DOIs" are rows where the engine gives a DOI and the
  truth has none (spurious) or a different one (wrong).
- title: both sides normalised (NFKC, invisible format characters such as soft hyphens removed, casefold,
  whitespace collapsed, whitespace next to CJK characters dropped, punctuation and symbols stripped at both
  ends); strict = equal, lenient = one contains the other and the shorter is >= 80% of the longer. Over rows
  whose truth has a title (fragments without a title block have an empty truth title).
- year: equal, over rows whose truth has a year.

A file the engine has no usable record for (missing, error, skipped) counts as wrong for every field the
truth fills. A recorded duplicate (same bytes as another file) is judged by the metadata of its original.

    python benchmarks/eval_metadata.py [--corpus DIR] [--truth TSV] [--kb-root DIR] [--keep] [--out eval.json]

--kb-root reuses an existing library instead of ingesting (handy while iterating on the truth table).
Exit status: 0 when the evaluation ran, 1 when the engine raised an error, 2 when the corpus or truth
table is missing.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import sqlite3
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_corpus, engine, record  # noqa: E402

DEFAULT_TRUTH = Path(__file__).resolve().parent / "metadata_truth.tsv"
LENIENT_RATIO = 0.8
TRAILING_DOI_PUNCT = ".,;:)]}>'\"/"


# -- truth table ----------------------------------------------------------------------------------------

def load_truth(path: Path) -> list[dict]:
    """Rows of the truth TSV (comment lines start with '#'; the first other line is the header)."""
    with path.open(encoding="utf-8", newline="") as fh:
        lines = [line for line in fh if line.strip() and not line.startswith("#")]
    reader = csv.DictReader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
    missing = {"path", "doi", "title", "year"} - set(reader.fieldnames or [])
    if missing:
        raise ValueError(f"{path}: header lacks column(s) {sorted(missing)}")
    rows = []
    for rec in reader:
        rows.append({k: (rec.get(k) or "").strip() for k in ("path", "doi", "title", "year", "authors", "notes")})
    return rows


# -- normalisation --------------------------------------------------------------------------------------

def norm_doi(value) -> str:
    if value is None:
        return ""
    return str(value).strip().lower().rstrip(TRAILING_DOI_PUNCT).strip()


def _is_cjk(ch: str) -> bool:
    o = ord(ch)
    return (0x3040 <= o <= 0x30FF or 0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF or 0xAC00 <= o <= 0xD7AF
            or 0xF900 <= o <= 0xFAFF or 0x3000 <= o <= 0x303F or 0xFF00 <= o <= 0xFFEF)


def _edge_char(ch: str) -> bool:
    cat = unicodedata.category(ch)
    return ch.isspace() or cat[0] in "PS"


def norm_title(value) -> str:
    if not value:
        return ""
    s = unicodedata.normalize("NFKC", str(value))
    s = "".join(ch for ch in s if unicodedata.category(ch) != "Cf")     # soft hyphen, zero-width marks
    s = re.sub(r"\s+", " ", s.casefold()).strip()
    # CJK typesetting puts font spacing (which extractors turn into spaces) around Latin runs: drop it
    out = []
    for i, ch in enumerate(s):
        if ch == " " and ((i > 0 and _is_cjk(s[i - 1])) or (i + 1 < len(s) and _is_cjk(s[i + 1]))):
            continue
        out.append(ch)
    s = "".join(out)
    start, end = 0, len(s)
    while start < end and _edge_char(s[start]):
        start += 1
    while end > start and _edge_char(s[end - 1]):
        end -= 1
    return s[start:end]


def title_match(truth: str, engine) -> tuple[bool, bool]:
    """(strict, lenient) match of two titles after normalisation."""
    a, b = norm_title(truth), norm_title(engine)
    if not a or not b:
        return False, False
    if a == b:
        return True, True
    short, long_ = sorted((a, b), key=len)
    lenient = short in long_ and len(short) / len(long_) >= LENIENT_RATIO
    return False, lenient


def _name_key(name: str) -> tuple[str, str]:
    """(family name, first initial) of a printed name, diacritics and case folded; a collaboration or a name
    without spaces (Chinese) is compared whole."""
    s = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", name or ""))
    s = "".join(ch for ch in s if not unicodedata.combining(ch)).casefold()
    s = re.sub(r"[^\w\s]", " ", s.replace("\u2019", "'")).strip()
    words = [w for w in s.split() if w not in ("jr", "sr", "ii", "iii")]
    if not words:
        return "", ""
    if len(words) == 1 or "collaboration" in s or "collaborations" in s:
        return " ".join(words), ""
    return words[-1], words[0][0]


def names_match(truth: str, engine: str) -> bool:
    return bool(truth) and _name_key(truth) == _name_key(engine)


def split_truth_authors(value: str) -> list[str]:
    return [a.strip() for a in (value or "").split(";") if a.strip()]


def has_control(value) -> bool:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    return any(unicodedata.category(ch) in ("Cc", "Co") or ch == "\ufffd" for ch in text)


def doc_class(row: dict) -> str:
    """The kind of document a row is, for the per-class table."""
    path = row["path"].lower()
    if path.endswith(".docx"):
        return "DOCX"
    if not row["title"]:
        return "fragment (no title block)"
    if re.search(r"thesis|dis_|redp|report|progression", path):
        return "thesis / report"
    if norm_doi(row["doi"]).startswith("10.48550/"):
        return "arXiv preprint"
    return "journal / proceedings"


def norm_year(value) -> str:
    if value is None:
        return ""
    m = re.search(r"\d{4}", str(value))
    return m.group(0) if m else ""


# -- engine ---------------------------------------------------------------------------------------------

def ingest_and_read(kb_engine, corpus: Path, kb_root: Path, ingest: bool) -> tuple[dict, list[dict]]:
    eng = kb_engine.Engine()
    try:
        ingest_resp = {}
        if ingest:
            ingest_resp = eng.execute("ingest", {"paths": [str(corpus)], "kb_root": str(kb_root)})
        docs = eng.execute("docs", {"limit": 100000, "kb_root": str(kb_root)})["docs"]
        return ingest_resp, docs
    finally:
        close = getattr(eng, "close", None)
        if close:
            close()


def relative_to_corpus(path: str, corpus: Path) -> str | None:
    try:
        return Path(path).resolve().relative_to(corpus.resolve()).as_posix()
    except ValueError:
        return None


def engine_records(docs: list[dict], corpus: Path) -> dict[str, dict]:
    """Corpus-relative path -> the record whose metadata counts (a duplicate's original stands in for it)."""
    by_id = {d["doc_id"]: d for d in docs}
    out = {}
    for d in docs:
        rel = relative_to_corpus(d["path"], corpus)
        if rel is None:
            continue
        rec = dict(d)
        if d.get("status") == "duplicate" and d.get("duplicate_of") in by_id:
            orig = by_id[d["duplicate_of"]]
            for key in ("title", "doi", "year", "authors", "journal"):
                rec[key] = orig.get(key)
            rec["judged_as"] = relative_to_corpus(orig["path"], corpus) or orig["path"]
        out[rel] = rec
    return out


def usable(rec: dict | None) -> bool:
    return rec is not None and rec.get("status") in ("indexed", "duplicate")


# -- comparison -----------------------------------------------------------------------------------------

def evaluate(truth: list[dict], records: dict[str, dict]) -> dict:  # noqa: C901
    fields = {name: {"correct": 0, "total": 0} for name in ("doi", "title", "title_lenient", "year",
                                                           "first_author", "authors")}
    classes: dict[str, dict] = {}
    false_dois = {"spurious": 0, "wrong": 0, "rows": 0}
    extra_years = 0
    mismatches = {"doi": [], "title": [], "year": [], "false_doi": [], "authors": []}
    control_fields = []
    no_record = []
    for row in truth:
        rec = records.get(row["path"])
        ok = usable(rec)
        if not ok:
            no_record.append({"path": row["path"], "status": rec.get("status") if rec else "missing",
                              "reason": rec.get("reason") if rec else None})
        status_note = "" if ok else f"(no usable record: {rec.get('status') if rec else 'missing'})"
        e_doi = norm_doi(rec.get("doi")) if ok else ""
        e_title = (rec.get("title") or "") if ok else ""
        e_year = norm_year(rec.get("year")) if ok else ""

        t_doi = norm_doi(row["doi"])
        if t_doi:
            fields["doi"]["total"] += 1
            if e_doi == t_doi:
                fields["doi"]["correct"] += 1
            else:
                mismatches["doi"].append({"path": row["path"], "truth": t_doi, "engine": e_doi or status_note or None})
        false_dois["rows"] += 1
        if e_doi and e_doi != t_doi:
            kind = "wrong" if t_doi else "spurious"
            false_dois[kind] += 1
            mismatches["false_doi"].append({"path": row["path"], "truth": t_doi or None, "engine": e_doi,
                                            "kind": kind})

        if row["title"]:
            fields["title"]["total"] += 1
            fields["title_lenient"]["total"] += 1
            strict, lenient = title_match(row["title"], e_title)
            fields["title"]["correct"] += strict
            fields["title_lenient"]["correct"] += lenient
            if not strict:
                mismatches["title"].append({"path": row["path"], "truth": row["title"],
                                            "engine": e_title or status_note or None, "lenient_ok": lenient})

        t_year = norm_year(row["year"])
        if t_year:
            fields["year"]["total"] += 1
            if e_year == t_year:
                fields["year"]["correct"] += 1
            else:
                mismatches["year"].append({"path": row["path"], "truth": t_year,
                                           "engine": e_year or status_note or None})
        elif e_year:
            extra_years += 1

        t_authors = split_truth_authors(row.get("authors", ""))
        e_authors = list(rec.get("authors") or []) if ok else []
        first_ok = full_ok = None
        if t_authors:
            fields["first_author"]["total"] += 1
            fields["authors"]["total"] += 1
            first_ok = bool(e_authors) and names_match(t_authors[0], e_authors[0])
            full_ok = len(e_authors) == len(t_authors) and all(map(names_match, t_authors, e_authors))
            fields["first_author"]["correct"] += first_ok
            fields["authors"]["correct"] += full_ok
            if not full_ok:
                mismatches["authors"].append({"path": row["path"], "truth": "; ".join(t_authors),
                                              "engine": "; ".join(e_authors) or status_note or None})
        if ok:
            bad = [k for k in ("title", "authors", "journal", "doi") if rec.get(k) and has_control(rec.get(k))]
            if bad:
                control_fields.append({"path": row["path"], "fields": bad})

        per_class = classes.setdefault(doc_class(row), {k: [0, 0] for k in
                                                        ("doi", "title", "year", "first_author", "authors")})
        per_class.setdefault("rows", [0, 0])[1] += 1
        for key, truth_value, correct in (("doi", t_doi, e_doi == t_doi), ("title", row["title"], None),
                                          ("year", t_year, e_year == t_year), ("first_author", t_authors, first_ok),
                                          ("authors", t_authors, full_ok)):
            if not truth_value:
                continue
            if key == "title":
                correct = title_match(row["title"], e_title)[0]
            per_class[key][0] += bool(correct)
            per_class[key][1] += 1

    for f in fields.values():
        f["pct"] = round(100.0 * f["correct"] / f["total"], 1) if f["total"] else None
    return {"fields": fields, "false_dois": false_dois, "years_where_truth_has_none": extra_years,
            "no_usable_record": no_record, "mismatches": mismatches, "classes": classes,
            "control_characters": control_fields}


# -- citation linking -----------------------------------------------------------------------------------
# Provisional measure, read straight from the library database: for papers with numbered citations, how
# many bracket markers ("[3]", "[2-4]", "[1, 5]") stand in the stored chunk text, and how many of those
# (chunk, marker) pairs have a row in chunk_cites, i.e. were linked to a parsed reference entry. Nature-style
# superscripts count once the parser has rewritten them as "[n]" in the stored text.
# TODO(lead): the hand-checked sample of superscript false positives (footnotes, exponents, affiliations)
# and the in_library checks belong here too; they need a documented sample rather than a count.

CITATION_PAPERS = ("papermage/2302.07302v1.pdf", "paperqa/paper.pdf", "refextract/")
MARKER_RE = re.compile(r"\[(\d{1,3}(?:\s*[,\u2013\u2014-]\s*\d{1,3})*)\]")


def citation_linking(kb_root: Path, records: dict[str, dict], db_filename: str) -> dict:
    db = kb_root / db_filename
    if not db.exists():
        return {"available": False, "why": f"no database at {db}"}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        have_links = {"refs", "chunk_cites"} <= tables
        per_doc, tot_markers, tot_linked = [], 0, 0
        for rel, rec in sorted(records.items()):
            if not any(rel == p or (p.endswith("/") and rel.startswith(p) and rel.endswith(".pdf"))
                       for p in CITATION_PAPERS):
                continue
            if rec.get("status") != "indexed":
                continue
            markers, linked = set(), set()
            for chunk_id, text in conn.execute("SELECT id, text FROM chunks WHERE doc_id = ?", (rec["doc_id"],)):
                for m in MARKER_RE.finditer(text):
                    markers.add((chunk_id, m.group(0)))
            refs = 0
            if have_links:
                refs = conn.execute("SELECT COUNT(*) FROM refs WHERE doc_id = ?", (rec["doc_id"],)).fetchone()[0]
                for chunk_id, marker in conn.execute(
                        "SELECT cc.chunk_id, cc.marker FROM chunk_cites cc JOIN chunks c ON c.id = cc.chunk_id "
                        "WHERE c.doc_id = ?", (rec["doc_id"],)):
                    linked.add((chunk_id, marker))
            hit = len(markers & linked)
            tot_markers += len(markers)
            tot_linked += hit
            per_doc.append({"path": rel, "refs": refs, "markers": len(markers), "linked": hit,
                            "pct": round(100.0 * hit / len(markers), 1) if markers else None})
        return {"available": True, "link_tables": have_links, "docs": per_doc, "markers": tot_markers,
                "linked": tot_linked,
                "pct": round(100.0 * tot_linked / tot_markers, 1) if tot_markers else None}
    finally:
        conn.close()


# -- report ---------------------------------------------------------------------------------------------

def _fmt_pct(p) -> str:
    return "   n/a" if p is None else f"{p:5.1f}%"


def print_report(result: dict, cites: dict | None) -> None:
    f = result["fields"]
    print()
    print(f"{'field':<26} {'correct':>7} {'total':>6} {'percent':>8}")
    labels = (("doi", "DOI (rows with a DOI)"), ("title", "title (strict)"),
              ("title_lenient", "title (lenient >=0.8)"), ("year", "year (rows with a year)"),
              ("first_author", "first author"), ("authors", "complete author list"))
    for key, label in labels:
        print(f"{label:<26} {f[key]['correct']:>7} {f[key]['total']:>6} {_fmt_pct(f[key]['pct']):>8}")
    fd = result["false_dois"]
    print(f"{'false DOIs (all rows)':<26} {fd['spurious'] + fd['wrong']:>7} {fd['rows']:>6}"
          f"   ({fd['spurious']} where truth has none, {fd['wrong']} different)")
    print(f"{'years where truth has none':<26} {result['years_where_truth_has_none']:>7}   (information only)")
    print(f"{'fields with control chars':<26} {len(result['control_characters']):>7}   "
          f"{', '.join(c['path'] + ':' + '/'.join(c['fields']) for c in result['control_characters'])}")
    print(f"\n{'class':<27} {'rows':>4}  {'DOI':>7}  {'title':>7}  {'year':>7}  {'1st auth':>8}  {'authors':>7}")
    for name, counts in sorted(result["classes"].items()):
        cells = [f"{c}/{t}" if t else "-" for c, t in (counts[k] for k in ("doi", "title", "year", "first_author",
                                                                           "authors"))]
        print(f"{name:<27} {counts['rows'][1]:>4}  {cells[0]:>7}  {cells[1]:>7}  {cells[2]:>7}  {cells[3]:>8}  "
              f"{cells[4]:>7}")
    if result["no_usable_record"]:
        print(f"\nrows without a usable engine record: {len(result['no_usable_record'])}")
        for r in result["no_usable_record"]:
            print(f"  {r['path']}: {r['status']}{'/' + r['reason'] if r.get('reason') else ''}")
    mm = result["mismatches"]
    for key, head in (("doi", "DOI mismatches"), ("false_doi", "false DOIs"), ("title", "title mismatches"),
                      ("year", "year mismatches"), ("authors", "author list mismatches")):
        rows = mm[key]
        print(f"\n{head}: {len(rows)}")
        for r in rows:
            extra = ""
            if key == "title" and r.get("lenient_ok"):
                extra = "  [lenient ok]"
            if key == "false_doi":
                extra = f"  [{r['kind']}]"
            print(f"  {r['path']}{extra}\n      truth:  {r['truth']!s}\n      engine: {r['engine']!s}")
    if cites is not None:
        print("\ncitation linking (provisional: bracket markers in stored chunks linked via chunk_cites)")
        if not cites.get("available"):
            print(f"  not available: {cites.get('why')}")
        else:
            if not cites["link_tables"]:
                print("  the library has no refs/chunk_cites tables: markers counted, none can be linked")
            for d in cites["docs"]:
                print(f"  {d['path']:<44} refs {d['refs']:4}  markers {d['markers']:4}  linked {d['linked']:4}"
                      f"  {_fmt_pct(d['pct'])}")
            print(f"  {'all':<44} {'':9}  markers {cites['markers']:4}  linked {cites['linked']:4}"
                  f"  {_fmt_pct(cites['pct'])}")


def main(argv=None) -> int:
    default_dir = default_corpus()
    ap = argparse.ArgumentParser(description="Metadata accuracy (DOI, title, year) against a hand-checked table.")
    ap.add_argument("--corpus", default=default_dir, help=f"corpus folder (default {default_dir})")
    ap.add_argument("--truth", default=str(DEFAULT_TRUTH), help="truth TSV (default benchmarks/metadata_truth.tsv)")
    ap.add_argument("--kb-root", default=None, help="use this existing library instead of ingesting into a temp one")
    ap.add_argument("--keep", action="store_true", help="keep the temporary kb_root and print where it is")
    ap.add_argument("--out", default=None, help="write the figures and mismatches as JSON here")
    ap.add_argument("--no-record", action="store_true",
                    help="record nothing (by default the figures go to benchmarks/results/metadata.json)")
    args = ap.parse_args(argv)

    corpus = Path(args.corpus)
    if not corpus.is_dir():
        print(f"error: corpus not found: {corpus} (set KB_CORPUS_DIR or pass --corpus)", file=sys.stderr)
        return 2
    truth_path = Path(args.truth)
    if not truth_path.is_file():
        print(f"error: truth table not found: {truth_path}", file=sys.stderr)
        return 2
    truth = load_truth(truth_path)

    os.environ["KB_EMBED_MODEL"] = "none"       # metadata only: never load an embedding model
    kb_engine = engine()

    tmp = None
    if args.kb_root:
        kb_root, ingest = Path(args.kb_root), False
    else:
        tmp = Path(tempfile.mkdtemp(prefix="kb-eval-meta-"))
        kb_root, ingest = tmp / ".kb", True
    report = {"engine": getattr(kb_engine, "__version__", None),
              "parser_revision": getattr(kb_engine, "PARSER_REVISION", None),
              "corpus": str(corpus), "truth": str(truth_path), "truth_rows": len(truth)}
    rc = 0
    try:
        t0 = time.perf_counter()
        try:
            ingest_resp, docs = ingest_and_read(kb_engine, corpus, kb_root, ingest)
        except Exception as exc:  # KBError or a crash inside the engine
            code = getattr(exc, "code", None)
            print(f"error: engine failed: {type(exc).__name__}{f'[{code}]' if code else ''}: {exc}", file=sys.stderr)
            report["error"] = str(exc)
            rc = 1
        else:
            report["ingest_seconds"] = round(time.perf_counter() - t0, 2) if ingest else None
            report["ingest_totals"] = ingest_resp.get("totals") if ingest else None
            records = engine_records(docs, corpus)
            result = evaluate(truth, records)
            cites = citation_linking(kb_root, records, getattr(kb_engine, "DB_FILENAME", "kb.sqlite"))
            report.update(result)
            report["citation_linking"] = cites
            print(f"engine {report['engine']} (parser revision {report['parser_revision']}); corpus {corpus}")
            print(f"truth rows {len(truth)}; engine records {len(docs)}"
                  + (f"; ingest {report['ingest_seconds']} s" if ingest else f"; library {kb_root}"))
            print_report(result, cites)
    finally:
        if tmp is not None:
            if args.keep:
                print(f"kept kb_root: {kb_root}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    if rc == 0 and not args.no_record and not args.kb_root:
        figures = {"documents": report["truth_rows"], "fields": report["fields"], "false_dois": report["false_dois"]}
        print(f"recorded {record('metadata', figures, model=None, argv=sys.argv)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
