"""Title, authors, year and DOI are read from the printed page, the way a person reads a paper's header.

The papers come from tests/metadata_pdfs.py: one PDF per way a first page misleads a naive reader (a banner
above or glued to the title, a download cover sheet, a letter-spaced journal banner, one- and two-word titles,
a two-column author block, an all-capitals byline, sixty authors, a DOI broken across lines, a reprint year
later than the journal year, marker glyphs that extract as control characters). The PDFs carry no useful
document-info metadata, so only the layout can give the right answer. Plus a Markdown file and a DOCX with
two-word titles, a check that no metadata field holds control or private-use characters, and BibTeX export.

All files are built and ingested once, into one library (keyword-only: no model is loaded).
"""
from __future__ import annotations

import re
import unicodedata
from types import SimpleNamespace

import pytest

import metadata_pdfs as mp

MARKDOWN_FILE = "perovskite_note.md"
DOCX_FILE = "coral_report.docx"
BAD_CATEGORIES = ("Cc", "Cf", "Co")     # C0/C1 controls, format characters, private use

_PEROVSKITE_NOTE = """# Perovskite stability

Metal halide perovskite solar cells now convert more than a quarter of incident sunlight into electricity, yet
most laboratory devices lose a large part of their efficiency within a few hundred hours of operation. Moisture,
oxygen, heat and light all drive the decomposition of the absorber layer.

We compared encapsulated cells with and without a thin alumina barrier under damp heat at 85 C and 85 percent
relative humidity. Cells with the barrier kept 92 percent of their initial efficiency after 1000 hours, whereas
unprotected cells fell below half of it after 300 hours.

## Next steps

The next batch will test whether the barrier also slows the migration of iodide ions under illumination.
"""
_CORAL_PARAGRAPHS = [
    "Mass coral bleaching occurs when sea surface temperatures stay more than one degree above the summer maximum "
    "for several weeks. Corals expel their symbiotic algae, lose their colour and starve unless temperatures fall.",
    "We surveyed 48 reef sites along the northern shelf before and after the marine heatwave of last summer. "
    "Bleaching affected 61 percent of hard coral cover on inshore reefs and 34 percent on offshore reefs.",
]


def _build_docx(path) -> bool:
    try:
        import docx
    except ImportError:
        return False
    document = docx.Document()
    document.add_paragraph("Coral bleaching", style="Title")
    document.add_heading("Summary of the reef survey", level=1)
    for text in _CORAL_PARAGRAPHS:
        document.add_paragraph(text)
    document.save(str(path))
    return True


@pytest.fixture(scope="module")
def library(kb_engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("metadata_layout")
    papers = folder / "papers"
    papers.mkdir()
    built = mp.build_all(papers)
    files = [path for path, _ in built.values()]
    (papers / MARKDOWN_FILE).write_text(_PEROVSKITE_NOTE, encoding="utf-8")
    files.append(papers / MARKDOWN_FILE)
    if _build_docx(papers / DOCX_FILE):
        files.append(papers / DOCX_FILE)
    engine = kb_engine.Engine()
    kb = folder / ".kb"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KB_EMBED_MODEL", "none")
        ingest = engine.execute("ingest", {"paths": [str(p) for p in files], "kb_root": str(kb)})
        docs = engine.execute("docs", {"kb_root": str(kb), "limit": 1000})["docs"]
    yield SimpleNamespace(engine=engine, kb=kb, ingest=ingest, docs={d["file"]: d for d in docs},
                          files={case: path.name for case, (path, _) in built.items()})
    engine.close()


def doc_of(library, file: str) -> dict:
    doc = library.docs.get(file)
    assert doc is not None, f"{file} is not in the library: {library.ingest}"
    assert doc["status"] == "indexed", doc
    return doc


def squash(text) -> str:
    return " ".join(str(text or "").split())


def cases_with(field: str) -> list[str]:
    return [case for case, expected in mp.EXPECTED.items() if field in expected]


# -- the PDFs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", cases_with("title"))
def test_title(library, case):
    doc = doc_of(library, library.files[case])
    assert squash(doc["title"]) == mp.EXPECTED[case]["title"], f"got {doc['title']!r}"


@pytest.mark.parametrize("case", cases_with("authors"))
def test_authors(library, case):
    """Every name, in byline order, without affiliation marks; the two-column block is read as a grid, row by
    row."""
    expected = mp.EXPECTED[case]
    loose = {name.casefold() for name in expected.get("authors_any_case", ())}

    def norm(name):
        name = squash(name)
        return name.casefold() if name.casefold() in loose else name

    got = doc_of(library, library.files[case])["authors"]
    assert [norm(a) for a in got] == [norm(a) for a in expected["authors"]], f"got {got}"


@pytest.mark.parametrize("case", cases_with("year"))
def test_year(library, case):
    got = doc_of(library, library.files[case])["year"]
    assert got == mp.EXPECTED[case]["year"], f"got {got!r}"


@pytest.mark.parametrize("case", cases_with("doi"))
def test_doi(library, case):
    got = doc_of(library, library.files[case])["doi"]
    assert got == mp.EXPECTED[case]["doi"], f"got {got!r}"


# -- other formats -----------------------------------------------------------------------------------------

def test_markdown_heading_gives_a_two_word_title(library):
    title = doc_of(library, MARKDOWN_FILE)["title"]
    assert squash(title) == "Perovskite stability", f"got {title!r}"


def test_docx_title_style_gives_a_two_word_title(library):
    pytest.importorskip("docx")
    title = doc_of(library, DOCX_FILE)["title"]
    assert squash(title) == "Coral bleaching", f"got {title!r}"


# -- every document ----------------------------------------------------------------------------------------

def test_no_control_format_or_private_use_characters_in_metadata(library):
    bad = []
    for file, doc in library.docs.items():
        values = [("title", doc["title"]), ("journal", doc["journal"]), ("doi", doc["doi"])]
        values += [("author", name) for name in doc["authors"]]
        for field, value in values:
            chars = sorted({f"U+{ord(ch):04X}" for ch in str(value or "")
                            if unicodedata.category(ch) in BAD_CATEGORIES})
            if chars:
                bad.append(f"{file} {field}={value!r}: {', '.join(chars)}")
    assert not bad, "\n".join(bad)


# -- BibTeX ------------------------------------------------------------------------------------------------

def _family_key(name: str) -> str:
    """The first author's family name as a citation key starts: last word, ASCII, lower case, letters only."""
    family = name.split()[-1]
    ascii_only = unicodedata.normalize("NFKD", family).encode("ascii", "ignore").decode()
    return re.sub(r"[^a-z0-9]", "", ascii_only.lower())


def _parse_bibtex(bibtexparser, text: str) -> dict[str, dict]:
    """{key: {field: value}} with bibtexparser 2.x or 1.x; every block must parse."""
    if hasattr(bibtexparser, "parse_string"):          # 2.x
        parsed = bibtexparser.parse_string(text)
        assert not parsed.failed_blocks, [b.error for b in parsed.failed_blocks]
        return {e.key: {k.lower(): f.value for k, f in e.fields_dict.items()} for e in parsed.entries}
    parsed = bibtexparser.loads(text)                  # 1.x
    return {e["ID"]: {k.lower(): v for k, v in e.items()} for e in parsed.entries}


def test_bibtex_entries_parse_and_keys_start_with_first_author_family_name(library):
    """cite format=bibtex: keys are <family><year><title word> today; the key must start with the first
    author's family name, lower-cased, ASCII (no marks, no residue of control glyphs)."""
    bibtexparser = pytest.importorskip("bibtexparser")
    by_id = {doc_of(library, library.files[case])["doc_id"]: case for case in mp.EXPECTED}
    out = library.engine.execute("cite", {"kb_root": str(library.kb), "format": "bibtex", "doc_ids": list(by_id)})
    assert out["count"] == len(by_id) and not out["not_found"], out
    entries = _parse_bibtex(bibtexparser, out["text"])
    assert len(entries) == len(by_id), out["text"]
    problems = []
    for item in out["entries"]:
        key, case = item["key"], by_id[item["doc_id"]]
        fields = entries.get(key, {})
        missing = [name for name in ("author", "title", "year") if not str(fields.get(name, "")).strip()]
        family = _family_key(mp.EXPECTED[case]["authors"][0])
        if missing:
            problems.append(f"{case}: {key} lacks {', '.join(missing)}")
        if not (key.isascii() and key.startswith(family)):
            problems.append(f"{case}: key {key!r} does not start with {family!r}")
    assert not problems, "\n".join(problems)
