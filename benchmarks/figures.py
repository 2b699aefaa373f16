"""The figure tables of README.md and docs/PERFORMANCE.md, printed from the recorded results.

Each table stands in its document between ``<!-- figures: NAME -->`` and ``<!-- /figures -->``; ``TABLES`` maps
NAME to the function that prints it from ``benchmarks/results/*.json`` (written by the benchmarks through
common.record). tests/static/test_figures.py fails when a document's table differs from what the results say;
``KB_UPDATE_DOCS=1`` rewrites it. ``python benchmarks/figures.py`` rewrites them too. Standard library only.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peer import TARGETS as PEER_TARGETS  # noqa: E402
from common import REPO_ROOT, RESULTS_DIR, recorded  # noqa: E402

BLOCK = re.compile(r"(<!-- figures: ([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)
DOCUMENTS = (REPO_ROOT / "README.md", REPO_ROOT / "docs" / "PERFORMANCE.md")
MODES = ("keyword", "vector", "hybrid")


def _need(name: str, results_dir: Path) -> dict:
    result = recorded(name, results_dir)
    if result is None:
        raise LookupError(f"benchmarks/results/{name}.json is missing: run the benchmark that records it")
    return result


def _source(result: dict) -> str:
    model = f", {result['model']}" if result.get("model") else ""
    return (f"{result['date']}, engine {result['engine']} (parser revision {result['parser_revision']}"
            f"{', ' + result['commit'] if result.get('commit') else ''}){model}")


def _pages_cell(figures: dict) -> str:
    modes = figures["modes"]
    hybrid = modes["hybrid"]["all"]
    others = ", ".join(f"{mode} {modes[mode]['all']['mrr@10']:.3f} / {modes[mode]['all']['hit@5']:.3f}"
                       for mode in MODES[:2] if mode in modes)
    return f"hybrid MRR@10 **{hybrid['mrr@10']:.3f}**, page-hit@5 **{hybrid['hit@5']:.3f}** ({others})"


def _sections_cell(figures: dict) -> str:
    return (f"heading recall **{figures['recall']:.3f}**, label precision **{figures['precision']:.3f}**, level "
            f"accuracy **{figures['level_accuracy']:.3f}** ({figures['headings']} printed headings)")


def _metadata_cell(figures: dict) -> str:
    fields = figures["fields"]
    shown = ", ".join(f"{label} {fields[key]['correct']}/{fields[key]['total']}"
                      for key, label in (("doi", "DOI"), ("title", "title"), ("year", "year"),
                                         ("authors", "complete author list")))
    false = figures["false_dois"]
    return f"{shown}; false DOIs {false['spurious'] + false['wrong']}"


def readme_quality(results_dir: Path = RESULTS_DIR) -> str:
    """README's table of quality on full papers."""
    main = _need("fulltext_questions", results_dir)
    held = _need("fulltext_heldout", results_dir)
    sections = _need("section_headings", results_dir)
    metadata = _need("metadata", results_dir)
    m, h = main["figures"], held["figures"]
    rows = [
        ("what", "result"), ("---", "---"),
        (f"full-text questions ({m['questions']} questions on {m['papers']} papers; a hit is the right paper and "
         "the answer's page)", _pages_cell(m)),
        (f"held-out full-text questions, written after tuning ({h['questions']} on {h['papers']} other documents, "
         f"{h['library_documents']} documents in the library)", _pages_cell(h)),
        (f"section labels ({sections['figures']['documents']} papers, the headings they print)",
         _sections_cell(sections["figures"])),
        (f"metadata ({metadata['figures']['documents']} documents read by a person)",
         _metadata_cell(metadata["figures"])),
    ]
    table = "\n".join(f"| {a} | {b} |" for a, b in rows)
    dates = sorted({r["date"] for r in (main, held, sections, metadata)})
    return (f"{table}\n\nRecorded in `benchmarks/results/` ({', '.join(dates)}; all-MiniLM-L6-v2 for the vector "
            "half, no reranker); `python benchmarks/figures.py` prints this table from them.\n")


def _pages_table(result: dict) -> str:
    figures = result["figures"]
    rows = ["| mode | page-hit@1 | @5 | @10 | MRR@10 | not in the abstract: @1 / @5 / MRR@10 | ms per question |",
            "|---|---|---|---|---|---|---|"]
    for mode, res in figures["modes"].items():
        a, b = res["all"], res["body_only"]
        strong = (lambda v: f"**{v:.3f}**") if mode == "hybrid" else (lambda v: f"{v:.3f}")
        rows.append(f"| {mode} | {strong(a['hit@1'])} | {strong(a['hit@5'])} | {a['hit@10']:.3f} | "
                    f"{strong(a['mrr@10'])} | {b['hit@1']:.3f} / {b['hit@5']:.3f} / {b['mrr@10']:.3f} | "
                    f"{res.get('ms_per_query', 0):.0f} |")
    cov = figures["coverage"]
    return ("\n".join(rows) + f"\n\n{figures['questions']} questions on {figures['papers']} documents, "
            f"{figures['library_documents']} documents in the library; body pages with a passage: "
            f"{cov['body_pages_with_chunks']} of {cov['body_pages']}. Recorded {_source(result)}.\n")


def performance_fulltext(results_dir: Path = RESULTS_DIR) -> str:
    return _pages_table(_need("fulltext_questions", results_dir))


def performance_heldout(results_dir: Path = RESULTS_DIR) -> str:
    return _pages_table(_need("fulltext_heldout", results_dir))


def performance_sections(results_dir: Path = RESULTS_DIR) -> str:
    rows = ["| set | papers | headings | heading recall (with the next page) | label precision | level accuracy |",
            "|---|---|---|---|---|---|"]
    dates = []
    for name, label in (("section_headings", "main"), ("section_headings_heldout", "held-out"),
                        ("section_headings_zh_journals", "Chinese journals"),
                        ("section_headings_zh_journals_ocr", "Chinese journals, scanned copies")):
        result = recorded(name, results_dir)
        if result is None:
            continue
        f = result["figures"]
        dates.append(_source(result))
        rows.append(f"| {label} | {f['documents']} | {f['headings']} | **{f['recall']:.3f}** "
                    f"({f['recall_next']:.3f}) | **{f['precision']:.3f}** ({f['real_labels']}/{f['labels']}) | "
                    f"**{f['level_accuracy']:.3f}** ({f['level_ok']}/{f['found']}) |")
    return "\n".join(rows) + f"\n\nRecorded {'; '.join(dict.fromkeys(dates))}.\n"


def performance_metadata(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("metadata", results_dir)
    fields = result["figures"]["fields"]
    rows = ["| field | correct | of | % |", "|---|---|---|---|"]
    for key, label in (("doi", "DOI"), ("title", "title"), ("title_lenient", "title, lenient"), ("year", "year"),
                       ("first_author", "first author"), ("authors", "complete author list")):
        f = fields[key]
        rows.append(f"| {label} | {f['correct']} | {f['total']} | {f['pct']} |")
    false = result["figures"]["false_dois"]
    return ("\n".join(rows) + f"\n\nFalse DOIs: {false['spurious']} where the document has none, {false['wrong']} "
            f"wrong. Recorded {_source(result)}.\n")


BIB_SETS = (
    ("bib_heldout_before", "held-out, engine before issue 52"),
    ("bib_heldout", "held-out (63 papers no rule was written on)"),
    ("bib_dev", "development, shared corpus"),
    ("bib_dev_fetched", "development, fetched"),
)
BIB_FIELDS = ("kind", "venue", "volume", "issue", "pages", "year", "authors")


def performance_bibliographic(results_dir: Path = RESULTS_DIR) -> str:
    """Per-field accuracy of the bibliographic records (eval_bib.py) on each truth table."""
    rows = [
        "| set | papers | " + " | ".join(BIB_FIELDS) + " | all seven | invented |",
        "|---|---|" + "---|" * len(BIB_FIELDS) + "---|---|",
    ]
    sources = []
    for name, label in BIB_SETS:
        result = _need(name, results_dir)
        figures = result["figures"]
        cells = []
        for key in BIB_FIELDS:
            f = figures["fields"][key]
            cells.append(f"{f['share']:.2f} ({f['correct']}/{f['total']})" if f["total"] else "-")
        main = figures["main"]
        rows.append(f"| {label} | {figures['papers']} | " + " | ".join(cells)
                    + f" | **{main['share']:.3f}** | {figures['invented']} |")
        engine = f" (measured: {figures['measured_engine']})" if figures.get("measured_engine") else ""
        sources.append(f"{label}: {_source(result)}{engine}")
    return "\n".join(rows) + "\n\nRecorded " + "; ".join(sources) + ".\n"


# -- abstracts (eval_beir.py), ingest (bench_ingest.py), scale (bench_scale.py), the peer (bench_peer.py) --------
# The published BM25 nDCG@10 range on SciFact (BEIR), reported on its 300 test claims: an outside reference.
BM25_SCIFACT = (0.665, 0.679)
BEIR_SETS = (("beir_scifact", "scifact", "SciFact, train claims ({documents:,} English abstracts)"),
             ("beir_csl", "csl-title", "CSL, title queries ({documents:,} Chinese abstracts)"),
             ("beir_csl", "csl-keywords", "CSL, keyword queries"))


def _beir(results_dir: Path, name: str, query_set: str) -> tuple[dict, dict]:
    result = _need(name, results_dir)
    return result, result["figures"]["sets"][query_set]


def _sizes(result: dict) -> list[dict]:
    return result["figures"]["sizes"]


def _readme_abstract_rows(results_dir: Path) -> list[tuple[str, str]]:
    _, sci = _beir(results_dir, "beir_scifact", "scifact")
    _, title = _beir(results_dir, "beir_csl", "csl-title")
    _, words = _beir(results_dir, "beir_csl", "csl-keywords")
    k, v, h = (sci["modes"][mode] for mode in MODES)
    above = sorted(round(100 * (k["ndcg@10"] / ref - 1)) for ref in BM25_SCIFACT)
    relation = f"{above[0]}–{above[1]}% above" if above[0] > 0 else f"{above[0]}–{above[1]}% against"
    csl_k = (title["modes"]["keyword"]["mrr@10"], words["modes"]["keyword"]["mrr@10"])
    csl_h = (title["modes"]["hybrid"]["mrr@10"], words["modes"]["hybrid"]["mrr@10"])
    hybrid_csl = (f"equals keyword (MRR@10 {csl_h[0]:.4f} / {csl_h[1]:.4f}): the engine skips vectors for queries "
                  "the model cannot read" if csl_h == csl_k else
                  f"MRR@10 {csl_h[0]:.4f} / {csl_h[1]:.4f} (keyword {csl_k[0]:.4f} / {csl_k[1]:.4f})")
    chunks = _need("beir_scifact", results_dir)["figures"]["chunks"]
    return [
        (f"keyword search, BEIR SciFact train ({sci['queries']} queries)",
         f"nDCG@10 **{k['ndcg@10']:.4f}**, Recall@100 **{k['recall@100']:.4f}**, MRR@10 **{k['mrr@10']:.4f}**; "
         f"{relation} the published BM25 nDCG@10 of {BM25_SCIFACT[0]}–{BM25_SCIFACT[1]} (reported on SciFact's "
         "test queries, so indicative)"),
        ("keyword search, CSL (Chinese)",
         f"MRR@10 **{csl_k[0]:.4f}** with title queries, **{csl_k[1]:.4f}** with keyword queries"),
        ("hybrid search, SciFact train",
         f"nDCG@10 **{h['ndcg@10']:.4f}** (keyword {k['ndcg@10']:.4f}, vector {v['ndcg@10']:.4f}), Recall@100 "
         f"**{h['recall@100']:.4f}**"),
        ("hybrid search, CSL with an English-only embedder", hybrid_csl),
        ("query latency (Python API)",
         f"keyword p50 about **{k['latency_ms_p50']:.0f} ms** over a library of {chunks:,} chunks"),
    ]


def _readme_speed_rows(results_dir: Path) -> list[tuple[str, str]]:
    rows = []
    scale = recorded("scale", results_dir)
    if scale:
        sizes = _sizes(scale)
        warm = "; ".join(f"{s['chunks']:,} chunks: keyword {s['modes']['keyword']['p50_ms']:.0f}, vector "
                         f"{s['modes']['vector']['p50_ms']:.0f}, hybrid **{s['modes']['hybrid']['p50_ms']:.0f}** ms"
                         for s in sizes)
        first = sorted(s["first_vector_ms"] / 1000 for s in sizes)
        rows.append(("serve-mode latency, warm p50 (synthetic libraries, random document vectors)",
                     f"{warm}; first vector query {first[0]:.1f}–{first[-1]:.1f} s (model and index load)"))
    peer = recorded("peer", results_dir)
    if peer:
        f = peer["figures"]
        ratios, ours, theirs = f["ratios"], f["ours"], f["peer"]
        rows.append((f"side by side with the public kb-rag engine ({f['papers']} generated papers, same model, "
                     "hybrid without rerank)",
                     f"first ingest **{ratios['first_ingest']:.2f}x** its time, unchanged re-ingest "
                     f"**{ratios['reingest']:.2f}x**, warm hybrid query **{ratios['warm_query_p50']:.2f}x**; a cold "
                     f"model load {ours['model_load_s']:.1f} s against {theirs['model_load_s']:.1f} s"))
    ingest = recorded("ingest_corpus", results_dir)
    if ingest:
        f = ingest["figures"]
        embedding = f"{ingest['model']}, {f['vectors']:,} vectors" if f["vectors"] else "no embedding model"
        rows.append((f"ingest of the shared test corpus ({f['files']} files, {embedding})",
                     f"first ingest **{f['first_seconds']:.1f} s** (about {f['first_seconds'] / f['files']:.2f} s per "
                     f"file); unchanged re-ingest **{f['reingest_seconds']:.2f} s**, {f['reingest_pct']:.1f}% of the "
                     "first (the goal is under 5%)"))
    return rows


def readme_abstracts(results_dir: Path = RESULTS_DIR) -> str:
    """README's table of quality on abstracts and of speed."""
    rows = [("what", "result"), ("---", "---"), *_readme_abstract_rows(results_dir), *_readme_speed_rows(results_dir)]
    names = ("beir_scifact", "beir_csl", "scale", "peer", "ingest_corpus")
    dates = sorted({r["date"] for r in (recorded(n, results_dir) for n in names) if r})
    return ("\n".join(f"| {a} | {b} |" for a, b in rows) + f"\n\nRecorded in `benchmarks/results/` "
            f"({', '.join(dates)}); `python benchmarks/figures.py` prints this table from them.\n")


def performance_beir_keyword(results_dir: Path = RESULTS_DIR) -> str:
    rows = ["| set | queries | nDCG@10 | Recall@100 | MRR@10 |", "|---|---|---|---|---|"]
    sources = []
    for name, query_set, label in BEIR_SETS:
        result, figures = _beir(results_dir, name, query_set)
        k = figures["modes"]["keyword"]
        rows.append(f"| {label.format(**result['figures'])} | {figures['queries']:,} | **{k['ndcg@10']:.4f}** | "
                    f"{k['recall@100']:.4f} | **{k['mrr@10']:.4f}** |")
        sources.append(_source({**result, "model": None}))
    return "\n".join(rows) + f"\n\nRecorded {'; '.join(dict.fromkeys(sources))}.\n"


def performance_beir_modes(results_dir: Path = RESULTS_DIR) -> str:
    rows = ["| set | mode | nDCG@10 | Recall@10 | Recall@100 | MRR@10 | p50 / p95 ms |",
            "|---|---|---|---|---|---|---|"]
    sources, ingests = [], []
    for name, query_set, label in BEIR_SETS:
        result, figures = _beir(results_dir, name, query_set)
        short = label.split(" (")[0]
        for mode, m in figures["modes"].items():
            strong = (lambda v: f"**{v:.4f}**") if mode == "hybrid" else (lambda v: f"{v:.4f}")
            rows.append(f"| {short} ({figures['queries']:,}) | {mode} | {strong(m['ndcg@10'])} | "
                        f"{strong(m['recall@10'])} | {strong(m['recall@100'])} | {strong(m['mrr@10'])} | "
                        f"{m['latency_ms_p50']:.0f} / {m['latency_ms_p95']:.0f} |")
        sources.append(_source(result))
        f = result["figures"]
        if f.get("ingest_seconds") and f.get("vectors") and result not in ingests:
            ingests.append(result)
    lines = [f"{r['figures']['chunks']:,} chunks ({r['figures']['documents']:,} documents) of "
             f"{r['benchmark'].removeprefix('beir_')} in {r['figures']['ingest_seconds']:.0f} s with vectors "
             f"({r['figures']['chunks'] / r['figures']['ingest_seconds']:.1f} chunks/s)" for r in ingests]
    ingest_line = f" First ingest: {'; '.join(lines)}." if lines else ""
    return "\n".join(rows) + f"\n\nRecorded {'; '.join(dict.fromkeys(sources))}.{ingest_line}\n"


def performance_ingest(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("ingest_corpus", results_dir)
    f = result["figures"]
    outcomes = ", ".join(f"{count} {status}" for status, count in f["outcomes"].items())
    rows = ["| corpus | first ingest | unchanged re-ingest | ratio |", "|---|---|---|---|",
            f"| shared test corpus: {f['files']} files | **{f['first_seconds']:.1f} s** (about "
            f"{f['first_seconds'] / f['files']:.2f} s per file) | **{f['reingest_seconds']:.2f} s** | "
            f"**{f['reingest_pct']:.1f}%** |"]
    return ("\n".join(rows) + f"\n\nEach ingest a fresh `kb_engine.py ingest` process (`--via {f['via']}`); outcomes "
            f"of the first: {outcomes}; {f['chunks']:,} chunks. Recorded {_source(result)}.\n")


def _mib(value: float) -> str:
    return f"{value:,.0f} MiB"


def performance_scale(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("scale", results_dir)
    rows = ["| chunks | kb.sqlite | cold daemon → first keyword answer | first vector query | keyword p50 / p95 | "
            "vector p50 / p95 | hybrid p50 / p95 | daemon memory (peak / resident) |",
            "|---|---|---|---|---|---|---|---|"]
    for s in _sizes(result):
        m = s["modes"]
        rows.append(f"| {s['chunks']:,} | {_mib(s['db_mb'])} | {s['cold_first_keyword_ms']:.0f} ms | "
                    f"{s['first_vector_ms'] / 1000:.1f} s | {m['keyword']['p50_ms']} / {m['keyword']['p95_ms']} ms | "
                    f"{m['vector']['p50_ms']} / {m['vector']['p95_ms']} ms | **{m['hybrid']['p50_ms']}** / "
                    f"{m['hybrid']['p95_ms']} ms | {s['daemon_peak_mb']:,} / {s['daemon_rss_mb']:,} MiB |")
    f = result["figures"]
    return ("\n".join(rows) + f"\n\n{f['queries_per_mode']} warm queries per mode; document vectors: {f['vectors']}. "
            f"Recorded {_source(result)}.\n")


def performance_faiss(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("scale", results_dir)
    rows = ["| vectors | exact float32 p50 | exact float16 p50 (recall@10) | IVF nprobe 8 p50 (recall@10) | "
            "IVF nprobe 32 p50 (recall@10) | IVF build |", "|---|---|---|---|---|---|"]
    for s in _sizes(result):
        f = s.get("faiss")
        if not f:
            continue
        ivf = [f"{f[key]['p50_ms']} ms ({f[key]['recall_at_10']:.3f})" if key in f else "not measured"
               for key in ("ivf_nprobe8", "ivf_nprobe32")]
        build = f"{f['ivf_build_s']} s" if "ivf_build_s" in f else "not measured"
        rows.append(f"| {s['chunks']:,} | {f['exact_p50_ms']} ms | {f['float16_p50_ms']} ms "
                    f"({f['float16_recall_at_10']:.3f}) | {ivf[0]} | {ivf[1]} | {build} |")
    return "\n".join(rows) + f"\n\nRecorded {_source(result)}.\n"


PEER_ROWS = (("first ingest (one process: start, imports, model load, extraction, embedding)", "first_ingest_s", "s",
              "first_ingest", PEER_TARGETS["first_ingest"]),
             ("unchanged re-ingest (one process)", "reingest_s", "s", "reingest", PEER_TARGETS["reingest"]),
             ("warm hybrid query, median (serve)", "warm_p50_ms", "ms", "warm_query_p50",
              PEER_TARGETS["warm_query_p50"]),
             ("warm hybrid query, p95", "warm_p95_ms", "ms", "warm_query_p95", None),
             ("first query in serve (model and index load)", "first_query_ms", "ms", None, None),
             ("model load alone, fresh process (engine's own loader)", "model_load_s", "s", None, None),
             ("ingest without embeddings (`KB_EMBED_MODEL=none`)", "no_model_ingest_s", "s", None, None),
             ("embedding floor: the engine's chunk texts through the loaded model", "embed_floor_s", "s", None, None),
             ("chunks (= vectors) in the library", "chunks", "", None, None),
             ("chunk characters", "chunk_chars", "", None, None))


def performance_peer(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("peer", results_dir)
    f = result["figures"]
    rows = ["| measure | kb-rag | peer | ratio | target |", "|---|---|---|---|---|"]
    for label, key, unit, ratio_key, target in PEER_ROWS:
        ours, theirs = f["ours"][key], f["peer"][key]
        ratio = f["ratios"][ratio_key] if ratio_key else (ours / theirs if theirs else None)
        shown = [f"{value:,.2f} {unit}" if unit == "s" else f"{value:,.1f} {unit}" if unit else f"{value:,}"
                 for value in (ours, theirs)]
        ratio_cell = "" if ratio is None else f"**{ratio:.3f}**" if target else f"{ratio:.3f}"
        goal = "" if target is None else f"< {target}, {'met' if ratio is not None and ratio < target else 'not met'}"
        rows.append(f"| {label} | {shown[0]} | {shown[1]} | {ratio_cell} | {goal} |")
    per_round = " / ".join(f"{v:.2f}" for v in f["ours"]["first_ingest_s_all"])
    peer_round = " / ".join(f"{v:.2f}" for v in f["peer"]["first_ingest_s_all"])
    return ("\n".join(rows) + f"\n\n{f['papers']} generated papers, {f['ours']['rounds']} rounds, "
            f"{f['ours']['queries']} warm queries per engine, top_k {f['top_k']}; first ingest per round: kb-rag "
            f"{per_round} s, peer {peer_round} s; load average {f['load_average'][0]} before, "
            f"{f['load_average'][1]} after. Peer {f['peer_url']} at `{(f['peer_commit'] or 'unknown')[:12]}`. "
            f"Recorded {_source(result)}.\n")


def performance_docx_bomb(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("docx_bomb", results_dir)
    rows = ["| case | file | expands to | verdict | paper beside it | seconds | peak memory |",
            "|---|---|---|---|---|---|---|"]
    for case in result["figures"]["cases"]:
        rows.append(f"| {case['case']} | {case['file_kb']:,} KB | {case['expands_mb']} MB | `{case['verdict']}` | "
                    f"{case['paper_beside']} | {case['seconds']:.2f} | {case['peak_mb']} MB |")
    return "\n".join(rows) + f"\n\nRecorded {_source(result)}.\n"


def performance_boxes(results_dir: Path = RESULTS_DIR) -> str:
    rows = ["| papers | questions | PDF hits | placed | box text differs | `show` highlight outside its boxes | "
            "boxes for 10 hits, p50 / p90 | one `show`, p50 / p90 |", "|---|---|---|---|---|---|---|---|"]
    sources = []
    for name, label in (("boxes_heldout", "held-out papers"), ("boxes_dev", "development papers")):
        result = _need(name, results_dir)
        f = result["figures"]
        rows.append(f"| {label}: {f['papers']} | {f['questions']} | {f['pdf_hits']} | **{f['placed_share']:.1%}** "
                    f"({f['placed']}) | {f['box_text_differs']} | {f['highlight_outside_boxes']} of {f['shows']} | "
                    f"{f['boxes_10_hits_ms_p50']} / {f['boxes_10_hits_ms_p90']} ms | {f['show_ms_p50']} / "
                    f"{f['show_ms_p90']} ms |")
        unplaced = ", ".join(f"{count} {why}" for why, count in sorted(f["unplaced"].items(), key=lambda kv: -kv[1]))
        sources.append(f"{label}: unplaced {unplaced or 'none'}; recorded {_source(result)}")
    return "\n".join(rows) + "\n\n" + ". ".join(sources) + ".\n"


def performance_embed(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("embed", results_dir)
    f = result["figures"]
    names = {"minilm": "all-MiniLM-L6-v2", "e5": "multilingual-e5-small"}
    rows = ["| model | backend | passages/s | vs torch | model only | GFLOP/s (share of peak) | cosine to torch, "
            "lowest / mean | first ingest | embedding alone | one-shot hybrid search |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for model, backends in f["models"].items():
        for r in backends.values():
            rows.append(f"| {names.get(model, model)} | {r['backend']} | {r['passages_per_s']} | "
                        f"**{r.get('speedup_vs_torch', 1.0):.2f}x** | {r['model_only_passages_per_s']} | "
                        f"{r['gflops']:.0f} "
                        f"({r['share_of_peak']:.0%}) | {r.get('lowest_cosine', 1.0)} / {r.get('mean_cosine', 1.0)} | "
                        f"{r['first_ingest_s']} s | {r['embedding_only_s']} s | {r['one_shot_hybrid_search_s']} s |")
    machine = ""
    if f.get("cpu"):
        machine = f" on {f['cpu']} ({'AMX' if f.get('amx') else 'no AMX'}, {'VNNI' if f.get('vnni') else 'no VNNI'})"
    return ("\n".join(rows) + f"\n\n{f['papers']} generated papers{machine}, "
            f"{next(iter(next(iter(f['models'].values())).values()))['passages']} passages; {f['threads']} runs at a "
            f"time; measured peak {f['peak_gflops']['fp32']} GFLOP/s float32, {f['peak_gflops']['int8']} GOP/s int8; "
            f"ingest with vectors off {f['ingest_without_vectors_s']} s; recorded {_source(result)}.\n")


def performance_ocr(results_dir: Path = RESULTS_DIR) -> str:
    """Scanned copies of the development and the held-out papers: similarity, seconds, page hits."""
    rows = ["| papers | language | copy | pages | mean similarity | lowest page | characters in common | s/page |",
            "|---|---|---|---|---|---|---|---|"]
    hits = ["| papers | questions | originals page-hit@1 / @5 | copies: page-hit@1 / @5 (share of the originals' @5) |",
            "|---|---|---|---|"]
    sources = []
    for name, label in (("ocr_heldout", "held-out"), ("ocr_zh_journals", "Chinese journals"), ("ocr", "development")):
        result = _need(name, results_dir)
        f = result["figures"]
        for key, summary in f["summary"].items():
            language, variant = key.split("/")
            language = "English" if language == "en" else "Chinese"
            rows.append(f"| {label} | {language} | {variant} | {summary['pages']} | "
                        f"**{summary['mean_similarity']:.3f}** | {summary['lowest_page']:.3f} | "
                        f"{summary['mean_characters_in_common']:.3f} | {summary['seconds_per_page']} |")
        page_hits = f["page_hits"]
        copies = ", ".join(f"{kind} {h['hit@1']:.2f} / {h['hit@5']:.2f} ({h['hit@5_share_of_original']:.2f})"
                           for kind, h in page_hits.items() if kind != "original")
        original = page_hits["original"]
        hits.append(f"| {label} | {f['questions']} | {original['hit@1']:.2f} / {original['hit@5']:.2f} | {copies} |")
        papers = ", ".join(paper["source"] for paper in f["papers"].values())
        sources.append(f"{label}: {papers}; recorded {_source(result)}")
    return "\n".join(rows) + "\n\n" + "\n".join(hits) + "\n\n" + ". ".join(sources) + ".\n"


def performance_ocr_memory(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("ocr_memory", results_dir)
    f = result["figures"]
    return (f"{f['pages']} image-only A4 pages ({f['ocr_pages']} OCR'd, {f['chunks']} passages) in "
            f"{f['seconds']:,} s, {f['seconds_per_page']} s a page on {f['cpus']} cores, embedding included; "
            f"peak resident memory **{f['peak_mb']:,} MB** (after the first tenth of the pages "
            f"{f['resident_mb_first_tenth']} MB, at the end {f['resident_mb_end']} MB). Recorded {_source(result)}.\n")


def performance_ocr_large_page(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("ocr_memory_large_page", results_dir)
    f = result["figures"]
    return (f"{f['pages']} image-only page{'s' if f['pages'] != 1 else ''} of {f['side_points']:,.0f} x "
            f"{f['side_points']:,.0f} points ({f['side_points'] / 72:.0f} inches a side), OCR'd at **{f['dpi']} dpi**, "
            f"{f['chunks']} passages, in {f['seconds']:,} s on {f['cpus']} cores, embedding model loaded; peak "
            f"resident memory **{f['peak_mb']:,} MB**. Recorded {_source(result)}.\n")


def performance_watch(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("watch", results_dir)
    f = result["figures"]
    rows = ["| file events | one look at the folder | idle CPU | landing to searchable: median | max | each |",
            "|---|---|---|---|---|---|"]
    for mode, label in (("events", "watchdog"), ("scans", "off (scans only)")):
        if mode in f:
            m = f[mode]
            rows.append(f"| {label} | {m['scan_ms']:,.0f} ms | {m['idle_cpu_s_per_min']} CPU s a minute "
                        f"({m['idle_seconds']:.0f} s measured) | **{m['delay_median_s']} s** | {m['delay_max_s']} s | "
                        f"{', '.join(str(d) for d in m['delays_s'])} |")
    return ("\n".join(rows) + f"\n\nA folder of {f['files']:,} files watched by `serve` on {f['cpus']} cores (ingested "
            f"first in {f['first_ingest_s']} s), settle time {f['settle_s']:g} s, keyword search. Recorded "
            f"{_source(result)}.\n")


def performance_zotero_sync(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("zotero_sync", results_dir)
    f = result["figures"]
    full = f["full_pass"]["seconds"]
    rows = ["| sync | time (median) | attachments in its entries | each |", "|---|---|---|---|"]
    for name, label in (("unchanged", "nothing changed"), ("one_item_saved", "one item saved by Zotero"),
                        ("collection_renamed", "a collection holding a third of the items renamed"),
                        ("full_pass", "full pass (`KB_ZOTERO_FULL_S=0`), every sync before this change")):
        m = f[name]
        share = f" ({m['seconds'] / full:.0%} of a full pass)" if name in ("unchanged", "one_item_saved") else ""
        rows.append(f"| {label} | **{m['seconds']:.3f} s**{share} | {m['entries']:,} | "
                    f"{', '.join(f'{s:.3f}' for s in m['each_s'])} |")
    return ("\n".join(rows) + f"\n\nA Zotero library of {f['items']:,} attachments ({f['database_mb']} MB database), "
            f"synced in process on {f['cpus']} cores after a first sync that imported everything in "
            f"{f['first_sync_s']} s; no embedding model. Recorded {_source(result)}.\n")


TABLES: dict[str, Callable[[Path], str]] = {
    "readme-quality": readme_quality,
    "performance-fulltext": performance_fulltext,
    "performance-heldout": performance_heldout,
    "performance-sections": performance_sections,
    "performance-metadata": performance_metadata,
    "performance-bibliographic": performance_bibliographic,
    "readme-abstracts": readme_abstracts,
    "performance-beir-keyword": performance_beir_keyword,
    "performance-beir-modes": performance_beir_modes,
    "performance-ingest": performance_ingest,
    "performance-scale": performance_scale,
    "performance-faiss": performance_faiss,
    "performance-peer": performance_peer,
    "performance-docx-bomb": performance_docx_bomb,
    "performance-boxes": performance_boxes,
    "performance-embed": performance_embed,
    "performance-ocr": performance_ocr,
    "performance-ocr-memory": performance_ocr_memory,
    "performance-ocr-large-page": performance_ocr_large_page,
    "performance-watch": performance_watch,
    "performance-zotero-sync": performance_zotero_sync,
}


def rendered(text: str, results_dir: Path = RESULTS_DIR) -> str:
    """``text`` with every figures block printed afresh from the results."""
    def table(match: re.Match) -> str:
        return match.group(1) + TABLES[match.group(2)](results_dir) + match.group(4)
    return BLOCK.sub(table, text)


def main() -> int:
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        wanted = rendered(text)
        if wanted != text:
            path.write_text(wanted, encoding="utf-8")
            print(f"rewrote the figures of {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
