#!/usr/bin/env python3
"""Bibliographic records of kb_engine against a truth table read by hand from the papers' own pages.

A truth table (TSV, see benchmarks/bib_truth_*.tsv and their headers) gives, for each paper, what its pages print:
the kind of work, title, authors (and whether the byline is the whole list), year, venue, volume, issue, pages,
publisher, report number, arXiv id and DOI. The files it names (relative to ``--corpus``) are copied into a fresh
folder, ingested with KB_EMBED_MODEL=none (no model is loaded), every document's record is read back with ``docs``
and compared field by field:

- kind: equal to the engine's ``work_type``, over every row;
- venue: equal to one of the printed forms (``|``-separated) after folding case, accents, punctuation and a leading
  "The", over rows whose truth has a venue;
- volume, issue: equal as printed (leading zeros and blanks aside); pages: equal after one kind of dash;
- year: equal; authors: the same names in the same order (family name and first initial, as eval_metadata.py
  compares them) and ``authors_more`` set exactly where the truth says the byline is not the whole list;
- title, publisher, report number, arXiv id, DOI: reported beside them.

"Invented" counts values the engine gives where the pages print none (venue, volume, issue, pages, publisher,
report number, arXiv id): the acceptance asks for none.

    python benchmarks/eval_bib.py --truth benchmarks/bib_truth_heldout.tsv --corpus DIR [--record-as NAME]
                                  [--show-mismatches] [--keep DIR] [--engine OLD/kb_engine.py]

Exit status: 0 when it ran, 1 on an engine error, 2 when the truth table or the corpus is missing.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import sys
import tempfile
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import engine, record  # noqa: E402
from eval_metadata import names_match, norm_doi, title_match  # noqa: E402

COLUMNS = (
    "path", "kind", "title", "authors", "authors_complete", "year", "venue", "volume", "issue", "pages",
    "publisher", "number", "arxiv", "doi", "notes",
)
# the fields the acceptance holds to 0.95, then the others reported beside them
MAIN_FIELDS = ("kind", "venue", "volume", "issue", "pages", "year", "authors")
OTHER_FIELDS = ("title", "publisher", "number", "arxiv", "doi")
# truth column -> the engine's field, for the fields an engine could invent
INVENTED = {
    "venue": "journal", "volume": "volume", "issue": "issue", "pages": "page_range", "publisher": "publisher",
    "number": "report_number", "arxiv": "arxiv_id",
}


def load_truth(path: Path) -> list[dict]:
    with path.open(encoding="utf-8", newline="") as fh:
        lines = [line for line in fh if line.strip() and not line.startswith("#")]
    reader = csv.DictReader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
    missing = set(COLUMNS) - set(reader.fieldnames or [])
    if missing:
        raise ValueError(f"{path}: header lacks column(s) {sorted(missing)}")
    return [{k: (rec.get(k) or "").strip() for k in COLUMNS} for rec in reader]


def fold(text) -> str:
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", str(text or "")))
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).casefold().replace("&", " and ")
    text = re.sub(r"[^\w]+", " ", text).strip()
    return re.sub(r"^the ", "", text)


def venue_ok(truth: str, engine_value) -> bool:
    """The engine's venue is one of the printed forms; "Name (ACRONYM 2017)" counts when either part is."""
    if not engine_value:
        return False
    forms = {fold(v) for v in truth.split("|") if v.strip()}
    inner = re.match(r"^(.*?)\s*\(([^()]+)\)\s*$", str(engine_value))
    tried = [engine_value] + ([inner.group(1), inner.group(2)] if inner else [])
    return any(fold(value) in forms for value in tried)


def number_ok(truth: str, engine_value) -> bool:
    def norm(v) -> str:
        v = re.sub(r"\s+", "", unicodedata.normalize("NFKC", str(v or "")))
        v = re.sub("[\u2010-\u2015\u2212]", "-", v)
        return "-".join(part.lstrip("0") or "0" for part in v.split("-")).casefold()

    return bool(engine_value) and norm(truth) == norm(engine_value)


def authors_ok(row: dict, rec: dict) -> bool:
    truth = [a.strip() for a in row["authors"].split(";") if a.strip()]
    found = list(rec.get("authors") or [])
    more_truth = row["authors_complete"].lower() == "no"
    return (
        len(truth) == len(found)
        and all(map(names_match, truth, found))
        and bool(rec.get("authors_more")) == more_truth
    )


def work_type(rec: dict) -> str:
    """The engine's kind of work; for an engine from before kinds were stored, the kind its BibTeX entry had
    (a venue with proceedings words: a conference paper; another venue: a journal article; none: a document)."""
    if "work_type" in rec:
        return rec["work_type"]
    venue = rec.get("journal") or ""
    if not venue:
        return "document"
    proceedings = re.search(r"\b(?:proceedings|conference|workshop|symposium)\b", venue, re.IGNORECASE)
    return "conference-paper" if proceedings else "journal-article"


def judge(row: dict, rec: dict | None) -> dict:
    """field -> True / False for the fields this row's truth fills (kind always)."""
    out: dict[str, bool] = {}
    ok = rec is not None and rec.get("status") in ("indexed", "duplicate")
    rec = rec if ok else {}
    out["kind"] = ok and work_type(rec) == row["kind"]
    if row["venue"]:
        out["venue"] = venue_ok(row["venue"], rec.get("journal"))
    for name, field in (("volume", "volume"), ("issue", "issue"), ("pages", "page_range"),
                        ("publisher", None), ("number", "report_number"), ("arxiv", "arxiv_id")):
        if not row[name]:
            continue
        if name == "publisher":
            out[name] = bool(rec.get("publisher")) and fold(rec["publisher"]) == fold(row["publisher"])
        else:
            out[name] = number_ok(row[name], rec.get(field))
    if row["year"]:
        out["year"] = str(rec.get("year") or "") == row["year"]
    if row["authors"]:
        out["authors"] = ok and authors_ok(row, rec)
    if row["title"]:
        out["title"] = title_match(row["title"], rec.get("title") or "")[1]
    if row["doi"]:
        out["doi"] = norm_doi(rec.get("doi")) == norm_doi(row["doi"])
    return out


def invented(row: dict, rec: dict | None) -> list[str]:
    if rec is None:
        return []
    return [name for name, field in INVENTED.items() if not row[name] and rec.get(field)]


def evaluate(truth: list[dict], records: dict[str, dict]) -> dict:
    fields = {name: {"correct": 0, "total": 0} for name in MAIN_FIELDS + OTHER_FIELDS}
    mismatches, made_up = [], []
    for row in truth:
        rec = records.get(row["path"])
        verdict = judge(row, rec)
        for name, good in verdict.items():
            fields[name]["total"] += 1
            fields[name]["correct"] += bool(good)
        wrong = [name for name, good in verdict.items() if not good]
        extra = invented(row, rec)
        if extra:
            made_up.append({"path": row["path"], "fields": extra})
        if wrong or extra:
            mismatches.append({"path": row["path"], "wrong": wrong, "invented": extra})
    for f in fields.values():
        f["share"] = round(f["correct"] / f["total"], 3) if f["total"] else None
    main_correct = sum(fields[n]["correct"] for n in MAIN_FIELDS)
    main_total = sum(fields[n]["total"] for n in MAIN_FIELDS)
    return {
        "papers": len(truth),
        "fields": fields,
        "main": {"correct": main_correct, "total": main_total,
                 "share": round(main_correct / main_total, 3) if main_total else None},
        "invented": sum(len(m["fields"]) for m in made_up),
        "invented_rows": made_up,
        "mismatches": mismatches,
    }


def load_engine(path: str | None):
    """The repository's engine, or the kb_engine.py at ``path`` (an older engine checked out at a git ref)."""
    if not path:
        return engine()
    import importlib.util

    spec = importlib.util.spec_from_file_location("kb_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kb_engine"] = module
    spec.loader.exec_module(module)
    return module


def ingest(corpus: Path, truth: list[dict], work: Path, engine_file: str | None = None) -> dict[str, dict]:
    papers = work / "papers"
    for row in truth:
        source = corpus / row["path"]
        if not source.is_file():
            raise FileNotFoundError(f"{source} (named in the truth table) is missing")
        target = papers / row["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    os.environ["KB_EMBED_MODEL"] = "none"
    kb = load_engine(engine_file)
    eng = kb.Engine()
    try:
        eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(work / "kb")})
        docs = eng.execute("docs", {"limit": 100000, "kb_root": str(work / "kb")})["docs"]
    finally:
        getattr(eng, "close", lambda: None)()
    by_id = {d["doc_id"]: d for d in docs}
    out = {}
    for d in docs:
        rel = Path(d["path"]).resolve().relative_to(papers.resolve()).as_posix()
        if d.get("status") == "duplicate" and d.get("duplicate_of") in by_id:
            d = {**by_id[d["duplicate_of"]], "status": "duplicate"}
        out[rel] = d
    return out


def show(result: dict, records: dict[str, dict], truth: list[dict], detail: bool) -> None:
    print(f"papers: {result['papers']}")
    for name in MAIN_FIELDS + OTHER_FIELDS:
        f = result["fields"][name]
        share = "  n/a" if f["share"] is None else f"{f['share']:.3f}"
        print(f"  {name:10s} {f['correct']:4d} / {f['total']:<4d} {share}")
    main = result["main"]
    print(f"  main fields together: {main['correct']} / {main['total']} = {main['share']}")
    print(f"  invented values: {result['invented']}")
    if not detail:
        return
    rows = {r["path"]: r for r in truth}
    for miss in result["mismatches"]:
        row, rec = rows[miss["path"]], records.get(miss["path"]) or {}
        print(f"\n{miss['path']}  wrong={miss['wrong']} invented={miss['invented']}")
        engine_of = {"kind": "work_type", "venue": "journal", "pages": "page_range", "number": "report_number",
                     "arxiv": "arxiv_id"}
        for name in miss["wrong"] + miss["invented"]:
            if name == "authors":
                print(f"    authors  truth={row['authors']!r} complete={row['authors_complete']}")
                print(f"             engine={'; '.join(rec.get('authors') or [])!r} more={rec.get('authors_more')}")
            else:
                print(f"    {name:8s} truth={row[name]!r} engine={rec.get(engine_of.get(name, name))!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--truth", required=True, help="the truth table (TSV)")
    ap.add_argument("--corpus", required=True, help="the folder the truth table's paths are relative to")
    ap.add_argument("--record-as", default=None, help="record the figures as benchmarks/results/NAME.json")
    ap.add_argument("--show-mismatches", action="store_true", help="print each paper's wrong and invented fields")
    ap.add_argument("--engine", default=None, help="a kb_engine.py to measure instead of the repository's")
    ap.add_argument("--engine-label", default=None, help="how the recorded figures name that engine (a commit)")
    ap.add_argument("--keep", default=None, help="work in this folder and keep it (else a temporary one)")
    args = ap.parse_args(argv)
    truth_path, corpus = Path(args.truth), Path(args.corpus)
    if not truth_path.is_file() or not corpus.is_dir():
        print(f"missing: {truth_path if not truth_path.is_file() else corpus}", file=sys.stderr)
        return 2
    truth = load_truth(truth_path)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kb-bib-"))
    if args.keep and work.exists():
        shutil.rmtree(work)
    try:
        records = ingest(corpus, truth, work, args.engine)
    except FileNotFoundError as exc:
        print(f"missing: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result = evaluate(truth, records)
    show(result, records, truth, args.show_mismatches)
    if args.record_as:
        figures = {k: v for k, v in result.items() if k not in ("mismatches",)}
        figures["truth"] = truth_path.name
        if args.engine:  # an older engine measured for a before/after comparison: say which
            figures["measured_engine"] = args.engine_label or args.engine
        record(args.record_as, figures, model=None, argv=["benchmarks/eval_bib.py", *sys.argv[1:]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
