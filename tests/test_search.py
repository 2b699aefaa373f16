"""search: ranking, snippets and their provenance, sections, filters, normalisation."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import RESULT_KEYS, check_hit_provenance, compact, err_code, norm, phrase_in, sp, words

ALL_REF_TOKENS = (sp.GRAPHENE_REF_TOKENS + sp.PROTEIN_REF_TOKENS + sp.BATTERY_REF_TOKENS + sp.LIGATURE_REF_TOKENS
                  + sp.CHINESE_REF_TOKENS + sp.DOCX_REF_TOKENS + sp.MD_REF_TOKENS + sp.TXT_REF_TOKENS)

PROVENANCE_QUERIES = [
    "graphene nucleation on copper", "molten globule ribosome exit tunnel", "electrochemical stability window",
    "efficiency photocatalyst", "钙钛矿 稳定性", "coral bleaching heatwave", "sparse attention retrieval",
    "水稻 耐盐", "Raman mapping grain boundaries", "arctic terns", "lithium fluoride interphase",
    "cotranslational folding misfolding domains", "coalescence fewer grain boundaries", "quantum efficiency",
]


def hits_of(resp, file):
    return [r for r in resp["results"] if r["file"] == file]


def first_hit(resp, file):
    hits = hits_of(resp, file)
    assert hits, f"no hit from {file}; got {[(r['file'], r['snippet'][:60]) for r in resp['results']]}"
    return hits[0]


def section_has(hit, *options):
    sec = (hit.get("section") or "").casefold()
    assert any(o.casefold() in sec for o in options), f"section {hit.get('section')!r} is none of {options}"


# ---------------------------------------------------------------------------
# basics

def test_graphene_query_finds_passage(search):
    resp = search("graphene nucleation on copper")
    assert resp["count"] == len(resp["results"]) > 0
    top = resp["results"][0]
    assert top["file"] == "graphene_cvd_copper.pdf"
    assert "nucleation" in norm(top["snippet"])
    assert set(top) >= RESULT_KEYS, RESULT_KEYS - set(top)
    scores = [r["score"] for r in resp["results"]]
    assert scores == sorted(scores, reverse=True)
    assert top["title"] == sp.GRAPHENE_TITLE and top["kind"] == "pdf" and top["year"] == sp.GRAPHENE_YEAR
    assert isinstance(top["authors"], list)
    assert Path(top["path"]).name == top["file"]


@pytest.mark.parametrize("query,file", [
    ("lithium metal anodes electrolyte", "battery_electrolytes.pdf"),
    ("protein folding ribosome", "protein_folding_2col.pdf"),
    ("photocatalytic water splitting strontium titanate", "photocatalysis_ligatures.pdf"),
    ("coral bleaching symbionts", "coral_heatwaves.docx"),
    ("block-sparse attention long documents", "sparse_attention.md"),
])
def test_topic_queries_rank_the_right_paper_first(search, query, file):
    assert search(query)["results"][0]["file"] == file


def test_top_k_and_snippet_length(search):
    resp = search("graphene copper", top_k=2)
    assert 0 < len(resp["results"]) <= 2
    resp = search("graphene copper", top_k=50)
    assert len(resp["results"]) > 2
    resp = search("graphene copper nucleation", snippet=120)
    for r in resp["results"]:
        assert len(r["snippet"]) <= 122, (len(r["snippet"]), r["snippet"])
    default = search("the graphene domains coalesce")
    assert max(len(r["snippet"]) for r in default["results"]) <= 302


def test_stopword_only_query(search):
    resp = search("the of and")
    assert resp["results"] == [] and resp["count"] == 0
    assert isinstance(resp.get("note"), str) and resp["note"].strip()


def test_unknown_words_find_nothing(search):
    assert search("xylophonequasar")["results"] == []


# ---------------------------------------------------------------------------
# provenance: every snippet stands on the pages it names

@pytest.mark.parametrize("query", PROVENANCE_QUERIES)
def test_snippets_stand_on_their_pages(search, kb_engine, query):
    resp = search(query, top_k=20)
    assert resp["results"], query
    for hit in resp["results"]:
        check_hit_provenance(hit, kb_engine)


def test_long_snippets_stand_on_their_pages(search, kb_engine):
    for query in ("graphene domains coalescence", "ribosome tunnel folding", "钙钛矿 封装"):
        for hit in search(query, top_k=20, snippet=1500)["results"]:
            check_hit_provenance(hit, kb_engine)


def test_page_texts_cover_every_page(kb_engine, sample_dir):
    texts = kb_engine.page_texts(str(sample_dir / "graphene_cvd_copper.pdf"))
    assert len(texts) == 3 and all(isinstance(t, str) and t.strip() for t in texts)
    assert "nucleation" in norm(texts[0]) and "references" not in norm(texts[0])
    lig = kb_engine.page_texts(str(sample_dir / "photocatalysis_ligatures.pdf"))
    assert "efficiency" in norm(lig[0])
    docx_text = kb_engine.page_texts(str(sample_dir / "coral_heatwaves.docx"))
    assert len(docx_text) == 1 and "fore-reef" in docx_text[0]


# ---------------------------------------------------------------------------
# text normalisation

def test_ligature_text_found_by_plain_query(search):
    for query in ("efficiency", "coefficient", "sufficiently fast"):
        hit = first_hit(search(query, top_k=20), "photocatalysis_ligatures.pdf")
        assert compact(query.split()[0]) in compact(hit["snippet"]), hit["snippet"]


def test_ligature_in_query_is_normalised(search):
    plain = search("quantum efficiency", top_k=20)
    liga = search("quantum e\ufb03ciency", top_k=20)
    assert hits_of(liga, "photocatalysis_ligatures.pdf")
    assert [r["chunk_id"] for r in liga["results"]] == [r["chunk_id"] for r in plain["results"]]


def test_hyphenated_line_breaks_are_joined(search):
    for query in ("electrochemical stability window", "desolvation", "interphase lithium fluoride"):
        resp = search(query, top_k=20)
        hit = first_hit(resp, "battery_electrolytes.pdf")
        assert compact(query.split()[0]) in compact(hit["snippet"])
    # the engine's own text has the joined word
    hit = first_hit(search("electrochemical", top_k=20), "battery_electrolytes.pdf")
    assert "electrochemical" in words(hit["snippet"]), hit["snippet"]


def test_chinese_queries(search):
    for query in ("钙钛矿", "湿热稳定性", "封装方案", "钙钛矿太阳能电池"):
        resp = search(query)
        assert resp["results"] and resp["results"][0]["file"] == "perovskite_stability_zh.pdf", query
    hit = first_hit(search("耐盐"), "rice_salt_tolerance_gb18030.txt")
    assert hit["kind"] == "txt" and "耐盐" in hit["snippet"] and hit["page"] is None


def test_case_and_whitespace_insensitive(search):
    a = search("Graphene   NUCLEATION")
    b = search("graphene nucleation")
    assert [r["chunk_id"] for r in a["results"]] == [r["chunk_id"] for r in b["results"]]


def test_whole_token_matching(search):
    # "graph" must not match "graphene" (whole-token matching, not substrings)
    resp = search("graph")
    assert not hits_of(resp, "graphene_cvd_copper.pdf"), [r["snippet"][:80] for r in resp["results"]]


def test_fts_syntax_in_query_is_harmless(search):
    for query in ('"graphene', "graphene AND", "NEAR(copper", "graphene*", "title:graphene", "a OR", "(((",
                  "copper -graphene", "^graphene", "graphene + copper", "'; DROP TABLE docs; --"):
        resp = search(query)
        assert isinstance(resp["results"], list), query
    assert search("graphene")["results"]


# ---------------------------------------------------------------------------
# references and sections

@pytest.mark.parametrize("token", ALL_REF_TOKENS)
def test_reference_entries_are_never_returned(search, token):
    resp = search(token, top_k=50)
    assert resp["results"] == [], [(r["file"], r["section"], r["snippet"][:80]) for r in resp["results"]]


def test_no_hit_from_references_sections(search):
    for query in ("Raman fingerprints grain boundaries", "Hall mobility across domain boundaries",
                  "fluorinated ethers diluents", "cryo-EM folding intermediates vestibule", "赵磊 光伏器件封装技术"):
        for r in search(query, top_k=50)["results"]:
            sec = (r.get("section") or "").casefold()
            assert "reference" not in sec and "参考文献" not in sec, r
            assert "fingerprints" not in norm(r["snippet"]) and "赵磊" not in r["snippet"], r


@pytest.mark.parametrize("query,file,sections", [
    ("widely used route large-area monolayer graphene", "graphene_cvd_copper.pdf", ("abstract",)),
    ("acetic acid native oxide dried nitrogen", "graphene_cvd_copper.pdf", ("sample preparation", "method")),
    ("hexagonal straight edges attachment", "graphene_cvd_copper.pdf", ("results",)),
    ("impurity particles energy barrier capture carbon", "graphene_cvd_copper.pdf", ("discussion",)),
    ("test tube emerges one residue at a time", "protein_folding_2col.pdf", ("introduction",)),
    ("arrest peptides force-profile analysis", "protein_folding_2col.pdf", ("related work",)),
    ("3200 fixed beads cryo-EM map", "protein_folding_2col.pdf", ("coarse-grained model", "method")),
    ("rare codons translational pauses", "protein_folding_2col.pdf", ("results",)),
    ("argon glovebox NMC811 areal loading", "battery_electrolytes.pdf", ("experimental",)),
    ("average Coulombic efficiency 300 cycles", "battery_electrolytes.pdf", ("results",)),
    ("一步旋涂法", "perovskite_stability_zh.pdf", ("方法",)),
    ("侧向扩散", "perovskite_stability_zh.pdf", ("结果",)),
    ("可溶液加工", "perovskite_stability_zh.pdf", ("引言",)),
    ("加速老化试验", "perovskite_stability_zh.pdf", ("摘要",)),
    ("fore-reef slopes loggers", "coral_heatwaves.docx", ("field sites", "methods")),
    ("symbiosis coral host photosynthetic algae", "coral_heatwaves.docx", ("introduction",)),
    ("recall truncated inputs 20000 full-text", "sparse_attention.md", ("experiments",)),
    ("each token attends own block neighbouring blocks", "sparse_attention.md", ("block-sparse", "method")),
    ("全球约有五分之一的灌溉农田", "rice_salt_tolerance_gb18030.txt", ("引言",)),
])
def test_sections_of_hits(search, query, file, sections):
    section_has(first_hit(search(query, top_k=20), file), *sections)


def test_figure_caption_is_searchable(search):
    hit = first_hit(search("hot-wall CVD reactor quartz boat"), "graphene_cvd_copper.pdf")
    assert "quartz boat" in norm(hit["snippet"])
    assert hit["page"] == 1


# ---------------------------------------------------------------------------
# layout: page breaks and columns

def _gap_sequence(ws, first, second, max_gap=2) -> bool:
    """first (word list) is followed by second within max_gap extra tokens."""
    n = len(first)
    for i in range(len(ws) - n + 1):
        if ws[i:i + n] == first:
            rest = ws[i + n:i + n + max_gap + len(second)]
            for g in range(max_gap + 1):
                if rest[g:g + len(second)] == second:
                    return True
    return False


def test_paragraph_across_page_break(search, sample_dir):
    last, first = sp.page_break_lines(sample_dir / "graphene_cvd_copper.pdf")
    tail, head = words(last)[-4:], words(first)[:3]
    resp = search(" ".join(tail[-2:] + head), top_k=20, snippet=2000)
    hits = [h for h in hits_of(resp, "graphene_cvd_copper.pdf") if _gap_sequence(words(h["snippet"]), tail, head)]
    assert hits, f"no passage joins {' '.join(tail)!r} + {' '.join(head)!r}: " \
                 f"{[h['snippet'][:100] for h in hits_of(resp, 'graphene_cvd_copper.pdf')]}"
    assert hits[0]["page"] == 1 and hits[0]["page_end"] == 2, (hits[0]["page"], hits[0]["page_end"])


def test_two_column_reading_order(search, sample_dir):
    left, right = sp.two_column_break(sample_dir / "protein_folding_2col.pdf")
    sentence = ("During the pauses between residue additions the chain relaxes, and we observe that the emerging "
                "domain first collapses into a compact molten globule state that is stabilised by transient "
                "contacts with the ribosomal surface")
    assert left.split()[-1] in sentence and right.split()[0] in sentence
    resp = search("residue additions chain relaxes emerging domain collapses molten globule", top_k=10, snippet=2000)
    hit = first_hit(resp, "protein_folding_2col.pdf")
    assert phrase_in(sentence, hit["snippet"]), hit["snippet"]
    assert hit["page"] == 1 and hit["page_end"] == 1
    section_has(hit, "introduction")


def test_two_column_columns_not_interleaved(search):
    # a left-column sentence must not be glued to a right-column line of the same height
    hit = first_hit(search("Multidomain proteins particularly prone misfolding in vitro", snippet=2000),
                    "protein_folding_2col.pdf")
    assert phrase_in("Multidomain proteins are particularly prone to misfolding in vitro because segments of "
                     "neighbouring domains can pair with each other", hit["snippet"]), hit["snippet"]


def _column_lines(page, x: float, y: float, lines: list[str], size: float = 10.5) -> None:
    for n, line in enumerate(lines):
        page.insert_text((x, y + n * size * 1.5), line, fontname="china-s", fontsize=size)


def test_chinese_columns_below_a_figure_are_read_left_then_right(kb_engine, tmp_path):
    # A Chinese journal page: a full-width figure caption, then the left column's last line of a paragraph carried
    # over from the page before and a new paragraph, beside a right column set as one block. Eight lines of CJK
    # fill a column as 400 letters would; read by rows, the right column came between the two left paragraphs.
    pymupdf = pytest.importorskip("pymupdf")
    carried = "后再进入下一轮的干旱胁迫处理。"
    left = ["2) 根系取样。每个处理随机选取六株幼苗，用",
            "清水冲洗根系表面的土壤颗粒，再用吸水纸吸干表",
            "面水分，随后将主根与侧根分开称量鲜重。侧根按",
            "照直径分为三级，分别置于烘箱中以八十度烘干至",
            "恒重，记录干重并计算根冠比。同一批样品另取一",
            "部分用于测定可溶性糖和脯氨酸的含量，测定前在",
            "液氮中研磨成粉末，保存于零下八十度的冰箱中备",
            "用，全部测定均重复三"]
    right = ["次，取平均值作为该处理的结果。统计分析采用单",
             "因素方差分析，显著性水平设为百分之五，多重比",
             "较采用最小显著差数法。作图使用开源软件完成，",
             "图中误差线表示标准误。为了检验干旱胁迫对根系",
             "形态的影响是否随品种而变化，我们在方差分析中",
             "加入品种与处理的交互项，并对交互作用显著的指",
             "标逐一进行简单效应检验，结果汇总于表二之中，",
             "供后文讨论根系可塑性时参考，不再单独列出。"]
    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    page.insert_text((230, 560), "图1 试验小区的布置与取样位置", fontname="china-s", fontsize=9)
    _column_lines(page, 57, 600, [carried])
    _column_lines(page, 57, 616, left)
    _column_lines(page, 308, 600, right)
    path = tmp_path / "journal_page.pdf"
    doc.save(path)
    text = kb_engine.page_texts(str(path))[0].replace("\n", "")
    at = [text.find(part) for part in ("图1", carried, "根系取样", "取平均值作为", "不再单独列出")]
    assert -1 not in at and at == sorted(at), (at, text)


# ---------------------------------------------------------------------------
# filters

def test_filter_authors(search):
    resp = search("graphene copper", filters={"authors": "Verma"})
    assert resp["results"] and {r["file"] for r in resp["results"]} == {"graphene_cvd_copper.pdf"}
    assert search("graphene copper", filters={"authors": "Watanabe"})["results"] == []
    resp = search("folding", filters={"authors": "watanabe"})
    assert resp["results"] and {r["file"] for r in resp["results"]} == {"protein_folding_2col.pdf"}


def test_filter_title(search):
    resp = search("efficiency", filters={"title": "Strontium Titanate"})
    assert resp["results"] and {r["file"] for r in resp["results"]} == {"photocatalysis_ligatures.pdf"}
    assert search("efficiency", filters={"title": "no such title words"})["results"] == []


def test_filter_kind(search):
    resp = search("bleaching corals heat", filters={"kind": "docx"})
    assert resp["results"] and {r["kind"] for r in resp["results"]} == {"docx"}
    assert not hits_of(search("bleaching corals heat", filters={"kind": "pdf"}), "coral_heatwaves.docx")
    for query, kind in (("attention", "md"), ("耐盐", "txt")):
        resp = search(query, filters={"kind": ["md", "txt"]}, top_k=50)
        assert resp["results"] and {r["kind"] for r in resp["results"]} == {kind}, query


def test_filter_year_value_and_ranges(search):
    resp = search("graphene copper", filters={"year": sp.GRAPHENE_YEAR})
    assert resp["results"] and all(r["year"] == sp.GRAPHENE_YEAR for r in resp["results"])
    assert search("graphene copper", filters={"year": 2005})["results"] == []
    resp = search("efficiency", filters={"year": [2020, 2022]}, top_k=50)
    files = {r["file"] for r in resp["results"]}
    assert {"photocatalysis_ligatures.pdf", "battery_electrolytes.pdf"} <= files, files
    assert all(2020 <= r["year"] <= 2022 for r in resp["results"])
    resp = search("folding domains", filters={"year": {"from": 2021, "to": 2021}})
    assert resp["results"] and {r["file"] for r in resp["results"]} == {"protein_folding_2col.pdf"}


def test_filter_section(search):
    resp = search("nucleation density", filters={"section": "Results"}, top_k=50)
    assert resp["results"], resp
    for r in resp["results"]:
        section_has(r, "results")
    resp = search("钙钛矿", filters={"section": "引言"}, top_k=50)
    assert resp["results"] and all("引言" in (r["section"] or "") for r in resp["results"])


def test_filters_combine(search):
    resp = search("efficiency", filters={"year": [2019, 2023], "kind": "pdf", "authors": "Becker"}, top_k=50)
    assert resp["results"] and {r["file"] for r in resp["results"]} == {"battery_electrolytes.pdf"}


def test_bad_search_payloads(engine, kb_engine, indexed):
    root, _ = indexed
    for payload in ({"query": {"x": 1}}, {"query": "graphene", "top_k": "ten"},
                    {"query": "graphene", "filters": "year=2019"}, {"query": "graphene", "snippet": "long"},
                    {"query": "graphene", "filters": {"year": "recent"}}, {}):
        with pytest.raises(kb_engine.KBError) as info:
            engine.execute("search", {"kb_root": str(root), **payload})
        assert err_code(info.value) == "bad_request", (payload, info.value)


def test_unknown_command_raises(engine, kb_engine, indexed):
    with pytest.raises(kb_engine.KBError) as info:
        engine.execute("summarise", {"kb_root": str(indexed[0])})
    assert err_code(info.value) == "unknown_command"


def test_result_kind_matches_file(search):
    resp = search("attention graphene coral 耐盐 folding", top_k=50)
    ext = {"pdf": ".pdf", "docx": ".docx", "txt": ".txt", "md": ".md"}
    for r in resp["results"]:
        assert Path(r["path"]).suffix == ext[r["kind"]], r
        assert re.fullmatch(r".+", r["file"]) and r["file"] == Path(r["path"]).name


def test_page_labels(engine, tmp_path, kb_engine):
    paper = sp.make_page_labels_paper(tmp_path / "lib")
    kb = tmp_path / "kb"
    engine.execute("ingest", {"paths": [str(paper)], "kb_root": str(kb)})
    for pno, (_label, sentence) in sp.LABELS_PAGES.items():
        query = " ".join(sentence.split()[:8])
        resp = engine.execute("search", {"query": query, "kb_root": str(kb), "top_k": 3})
        top = resp["results"][0]
        assert top["page"] <= pno <= top["page_end"], (pno, top["page"], top["page_end"], top["snippet"][:80])
        # the label belongs to the page the snippet starts on
        assert top["page_label"] == sp.LABELS_PAGES[top["page"]][0], (pno, top["page"], top["page_label"])
        check_hit_provenance(top, kb_engine)
        labels = {r["page"]: r["page_label"] for r in resp["results"]}
        assert all(sp.LABELS_PAGES[p][0] == lab for p, lab in labels.items()), labels


def test_pdf_without_labels_has_null_or_numeric_label(search):
    for r in search("graphene nucleation copper", top_k=20)["results"]:
        assert r["page_label"] in (None, str(r["page"])), r["page_label"]


def test_filters_take_the_lists_the_schema_offers(search):
    """Every text filter and kind accept a list (any value may match), as both hosts' schemas now say."""
    one = search("graphene", mode="keyword", filters={"kind": "pdf"})["results"]
    both = search("graphene", mode="keyword", filters={"kind": ["pdf", "docx"]})["results"]
    assert one and {hit["kind"] for hit in one} == {"pdf"}
    assert {hit["kind"] for hit in both} <= {"pdf", "docx"} and len(both) >= len(one)
    titled = search("graphene", mode="keyword", filters={"title": ["no such title", one[0]["title"][:12]]})
    assert titled["results"] and all(hit["title"].startswith(one[0]["title"][:12]) for hit in titled["results"])
