"""PDFs whose first page trips naive metadata readers (title, authors, DOI, year).

Each builder writes one realistic paper into a folder and returns ``(path, expected)``: ``expected`` is the
metadata a correct reader must produce from the printed page (the PDFs carry no useful document-info metadata,
so the layout has to decide). Keys: ``title`` (str), ``authors`` (list of str), ``year`` (int), ``doi``
(lower-case str, or None where the paper prints none); ``authors_any_case`` lists names whose capitalisation is
ambiguous when they are printed in capitals ("MCALLISTER") and may be compared case-insensitively.

Every paper has a real page-1 header (journal line, title, byline, affiliations, abstract), then an
Introduction heading and body text running onto page 2, so the header is recognisable by layout. Each builder
asserts at build time that the PDF really shows its failure class (a banner in the same block as the title, a
DOI split over two lines, control characters in the extracted text ...).

All people, institutions, journals, DOIs and results are invented.
"""
from __future__ import annotations

import re
from pathlib import Path

import pymupdf

from helpers import sp

SERIF, SERIF_BOLD = "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf"
SANS, SANS_BOLD = "DejaVuSans.ttf", "DejaVuSans-Bold.ttf"
SUP_SCALE, SUP_RISE = 0.62, 0.38        # superscripts: 62 % of the line's size, raised 38 % of it


# ---------------------------------------------------------------------------
# layout helpers on top of examples/sample_papers.Flow

def _item(f: sp.Flow, x: float, baseline: float, text: str, font: str, size: float, page: int | None = None,
          kind: str = "text") -> None:
    f.items.append(dict(kind=kind, page=f.page if page is None else page, col=0, ncols=1, x=x, y=baseline,
                        text=text, font=font, size=size))


def _rule(f: sp.Flow, y: float, x0: float | None = None, x1: float | None = None, page: int | None = None) -> None:
    f.items.append(dict(kind="rule", page=f.page if page is None else page, col=0, ncols=1,
                        x0=f.ml if x0 is None else x0, x1=f.w - f.mr if x1 is None else x1, y=y))


def _width(runs) -> float:
    return sum(sp._width(font, text, size) for text, font, size, _ in runs)


def _rich(f: sp.Flow, runs, align: str = "left", leading: float = 1.35) -> None:
    """One line made of runs (text, font, size, rise): rise > 0 raises a run (superscript) above the baseline."""
    size = max(s for _, _, s, rise in runs if not rise)
    if f.y + size * leading > f.region[3]:
        f.advance()
    x0, x1 = f.region[0], f.region[1]
    x = {"left": x0, "center": x0 + (x1 - x0 - _width(runs)) / 2, "right": x1 - _width(runs)}[align]
    baseline = f.y + size
    for text, font, run_size, rise in runs:
        _item(f, x, baseline - rise, text, font, run_size)
        x += sp._width(font, text, run_size)
    f.y += size * leading


def _region(f: sp.Flow, x0: float, x1: float, y: float | None = None) -> None:
    """Write into the band x0..x1 from y (default: where the flow stands) down to the bottom margin."""
    f.region = (x0, x1, f.y if y is None else y, f.h - f.mb, 0, 1)
    f.y = f.region[2]
    f._pending = []


def _full_width(f: sp.Flow) -> None:
    _region(f, f.ml, f.w - f.mr)


def _byline(f: sp.Flow, people, font: str, size: float, align: str = "center", style: str = "after",
            conj: str = " and ", leading: float = 1.45) -> None:
    """Names with raised affiliation marks, wrapped to the current width.

    people: (name, marks) pairs. style 'after': "Ana Ruiz1,2, Ole Dahl3 and ..."; style 'aps': the comma comes
    before the marks ("Ana Ruiz,1,2 Ole Dahl,3 and ...")."""
    sup = size * SUP_SCALE
    rise = size * SUP_RISE
    units = []
    for i, (name, marks) in enumerate(people):
        last, before_last = i == len(people) - 1, i == len(people) - 2
        runs = [(name, font, size, 0)]
        if style == "aps":
            if not last and len(people) > 2:
                runs.append((",", font, size, 0))
            if marks:
                runs.append((marks, font, sup, rise))
            if not last:
                runs.append((" " + (conj.strip() + " " if before_last else ""), font, size, 0))
        else:
            if marks:
                runs.append((marks, font, sup, rise))
            if before_last:
                runs.append((conj, font, size, 0))
            elif not last:
                runs.append((", ", font, size, 0))
        units.append([r for r in runs if r[0]])
    line: list = []
    for unit in units:
        if line and _width(line + unit) - sp._width(font, unit[-1][0], size) * (unit[-1][0].isspace()) > f.width:
            _rich(f, _strip_trailing(line), align, leading)
            line = []
        line += unit
    if line:
        _rich(f, _strip_trailing(line), align, leading)


def _strip_trailing(runs):
    text, font, size, rise = runs[-1]
    return runs[:-1] + [(text.rstrip(), font, size, rise)] if text.rstrip() else runs[:-1]


def _marked(f: sp.Flow, marks: str, text: str, font: str, size: float, align: str = "left",
            leading: float = 1.3) -> None:
    """An affiliation line that starts with a raised mark: "1Department of ..."."""
    runs = ([(marks, font, size * SUP_SCALE, size * SUP_RISE)] if marks else []) + [(text, font, size, 0)]
    _rich(f, runs, align, leading)


def _footer(f: sp.Flow, lines, font: str = "tiro", size: float = 7.5, leading: float = 1.3,
            page: int | None = None, bottom: float | None = None) -> float:
    """Lines set from the bottom margin upwards (first-page footnotes); returns the top of the footer."""
    y = (f.h - f.mb if bottom is None else bottom) - size * leading * (len(lines) - 1)
    top = y - size * 1.2
    for text in lines:
        if isinstance(text, tuple):
            marks, text = text
            _item(f, f.ml, y - size * SUP_RISE, marks, font, size * SUP_SCALE, page)
            _item(f, f.ml + sp._width(font, marks, size * SUP_SCALE), y, text, font, size, page)
        else:
            _item(f, f.ml, y, text, font, size, page)
        y += size * leading
    return top


def _body(f: sp.Flow, intro, methods, font: str = "tiro", head: str = "tibo", size: float = 10.5,
          numbered: str = "{n} {name}", methods_name: str = "Methods", new_page: bool = False) -> None:
    """Introduction and Methods sections: the Methods start on a new page when new_page is set."""
    f.heading(numbered.format(n=1, name="Introduction"), font=head, size=size + 1.5)
    for text in intro:
        f.paragraph(text, font=font, size=size)
    if new_page:
        f.new_page()
    f.heading(numbered.format(n=2, name=methods_name), font=head, size=size + 1.5)
    for text in methods:
        f.paragraph(text, font=font, size=size)


def _render(f: sp.Flow, path: Path, metadata: dict | None = None, numbers_from: int = 1) -> Path:
    """Write the flow like Flow.save, plus rules and 'raw' runs (page.insert_text with a base-14 font, which
    keeps control characters as character codes). Items are written in their order, so raw runs stay on the
    line they belong to."""
    doc = pymupdf.open()
    for pno in range(f.page + 1):
        page = doc.new_page(width=f.w, height=f.h)
        writer = pymupdf.TextWriter(page.rect)
        for it in (it for it in f.items if it["page"] == pno):
            if it["kind"] == "text":
                writer.append((it["x"], it["y"]), it["text"], font=sp._font(it["font"]), fontsize=it["size"])
            elif it["kind"] == "rule":
                page.draw_line((it["x0"], it["y"]), (it["x1"], it["y"]), color=(0.2, 0.2, 0.2), width=0.6)
            elif it["kind"] == "raw":
                writer.write_text(page)
                writer = pymupdf.TextWriter(page.rect)
                page.insert_text((it["x"], it["y"]), it["text"], fontname=it["font"], fontsize=it["size"])
            elif it["kind"] == "dagger":        # the visible glyph of a marker whose text maps to a control code
                x, y, s = it["x"], it["y"], it["size"]
                page.draw_line((x + s * 0.22, y - s * 0.75), (x + s * 0.22, y + s * 0.15), color=(0, 0, 0), width=0.5)
                page.draw_line((x + s * 0.02, y - s * 0.5), (x + s * 0.42, y - s * 0.5), color=(0, 0, 0), width=0.5)
        if pno + 1 >= numbers_from:
            label = str(pno + 1 - numbers_from + 1)
            writer.append(((f.w - sp._width("tiro", label, 9)) / 2, f.h - f.mb / 2), label, font=sp._font("tiro"),
                          fontsize=9)
        writer.write_text(page)
    doc.set_metadata(metadata or {"producer": "", "creator": "", "title": "", "author": ""})
    return sp._save(doc, path)


# ---------------------------------------------------------------------------
# build-time checks: each PDF must really show what it is built to show

def page_text(path: Path, pno: int = 0) -> str:
    with pymupdf.open(path) as doc:
        return doc[pno].get_text()


def page_lines(path: Path, pno: int = 0) -> list[str]:
    """Extracted lines of a page as PyMuPDF's blocks give them (spans joined)."""
    with pymupdf.open(path) as doc:
        data = doc[pno].get_text("dict")
    return ["".join(s["text"] for s in line["spans"]) for block in data["blocks"] if block["type"] == 0
            for line in block["lines"]]


def page_blocks(path: Path, pno: int = 0) -> list[list[str]]:
    with pymupdf.open(path) as doc:
        data = doc[pno].get_text("dict")
    return [["".join(s["text"] for s in line["spans"]) for line in block["lines"]]
            for block in data["blocks"] if block["type"] == 0]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"fixture does not show its failure class: {message}")


def _max_size_text(path: Path, pno: int = 0) -> str:
    with pymupdf.open(path) as doc:
        spans = [s for b in doc[pno].get_text("dict")["blocks"] if b["type"] == 0 for l in b["lines"]
                 for s in l["spans"] if s["text"].strip()]
    top = max(s["size"] for s in spans)
    return " ".join(s["text"].strip() for s in spans if abs(s["size"] - top) < 0.05)


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


# ---------------------------------------------------------------------------
# a. a journal banner ("RESEARCH ARTICLE" / "Open Access") above the title (BMC-like)

BANNER_ABOVE_TITLE = {
    "title": "Travel distance and missed follow-up after hip fracture surgery in rural Norway: "
             "a registry-based cohort study",
    "authors": ["Ingrid Solberg", "Tomas Okafor", "Wei Zhang"],
    "year": 2021,
    "doi": "10.1186/s40621-021-00412-7",
}

_HIP_ABSTRACT = [
    "Background: Older patients who live far from the hospital that operated on their hip fracture may miss "
    "the planned follow-up visits, but the size of this effect has not been measured in a rural population.",
    "Methods: We linked the regional fracture registry with appointment records for 2,418 patients aged 65 "
    "years or more who were operated on between 2012 and 2019, and modelled missed visits against road distance.",
    "Results: Patients living more than 90 km from the hospital missed 23 percent of their visits, compared with "
    "7 percent among those living within 20 km; the odds ratio per 10 km was 1.14 after adjustment for age, sex "
    "and comorbidity.",
    "Conclusions: Travel distance is a strong and modifiable predictor of missed follow-up; video consultations "
    "or outreach clinics should be offered to patients who live far from the operating hospital.",
]
_HIP_INTRO = [
    "Hip fracture is among the most serious injuries of old age: one patient in four dies within a year, and "
    "many survivors never regain their former mobility. Structured follow-up after discharge detects failed "
    "fixation, anaemia and falling weight early, and it is the point at which secondary fracture prevention "
    "with bone-protective drugs is usually started.",
    "Follow-up is organised by the operating hospital. In sparsely populated regions this can mean a journey "
    "of several hours for a patient who walks with a frame and depends on relatives or a taxi service. "
    "Qualitative studies describe such journeys as a burden, but no study has measured how often patients "
    "simply do not come, or whether the distance they would have to travel explains it.",
    "We therefore asked whether the road distance between a patient's home and the operating hospital "
    "predicts missed follow-up visits after hip fracture surgery, and whether the association differs "
    "between patients who live at home and those who live in a nursing home.",
]
_HIP_METHODS = [
    "The Western Fjords Fracture Registry records every hip fracture operated on in the region's three "
    "hospitals. We included patients aged 65 years or more who were operated on between January 2012 and "
    "December 2019 and who were alive at the first planned follow-up visit six weeks after surgery.",
    "Road distances from the home address to the operating hospital were computed with the national road "
    "database, including ferry connections. A visit counted as missed when it was neither attended nor "
    "cancelled and rebooked by the patient or the municipal care service within fourteen days.",
]


def make_banner_above_title(outdir) -> tuple[Path, dict]:
    exp = BANNER_ABOVE_TITLE
    f = sp.Flow(sp.A4, margins=(56, 56, 40, 64))
    _rich(f, [("Solberg et al. Journal of Rural Health Services (2021) 18:412", SANS, 7.5, 0)], leading=1.3)
    _rich(f, [("https://doi.org/" + exp["doi"], SANS, 7.5, 0)], leading=1.3)
    f.space(14)
    _item(f, f.ml, f.y + 9, "RESEARCH ARTICLE", "hebo", 9)
    _item(f, f.w - f.mr - sp._width("helv", "Open Access", 9), f.y + 9, "Open Access", "helv", 9)
    f.y += 9 * 1.6
    _rule(f, f.y)
    f.space(14)
    f.paragraph(exp["title"], font=SANS_BOLD, size=17, leading=1.22, after=10)
    _byline(f, [("Ingrid Solberg", "1*"), ("Tomas Okafor", "2"), ("Wei Zhang", "1,3")], SANS, 11, align="left")
    f.space(10)
    f.heading("Abstract", font=SANS_BOLD, size=11, before=4)
    for text in _HIP_ABSTRACT:
        f.paragraph(text, font=SANS, size=9.2, leading=1.3, after=3)
    f.paragraph("Keywords: Hip fracture, Rural health, Follow-up, Travel distance, Registry study",
                font=SANS, size=9, after=8)
    _rule(f, f.y)
    bottom = _footer(f, [
        "* Correspondence: ingrid.solberg@nordfjord-hospital.example",
        ("1", "Department of Orthopaedic Surgery, Nordfjord Regional Hospital, Førde, Norway"),
        "Full list of author information is available at the end of the article",
        "© The Author(s). 2021 Open Access This article is licensed under a Creative Commons Attribution 4.0 "
        "International License.",
    ], font=SANS, size=7)
    f.region = f.region[:3] + (bottom - 6,) + f.region[4:]
    _body(f, _HIP_INTRO, _HIP_METHODS, new_page=True)
    path = _render(f, Path(outdir) / "banner_above_title.pdf")
    _check(_squash(_max_size_text(path)) == exp["title"], "the title is not the largest text")
    lines = page_lines(path)
    _check(any(l.startswith("RESEARCH ARTICLE") for l in lines), "no banner line")
    return path, exp


# ---------------------------------------------------------------------------
# b. "Research Article" set in the title's font and size, in the same block, on the line above (Hindawi-like)

BANNER_GLUED_TO_TITLE = {
    "title": "Patient Experiences of Remote Cardiac Rehabilitation after Myocardial Infarction: "
             "A Qualitative Interview Study",
    "authors": ["Hannah Whitcombe", "Samuel Adeyemi", "Ruth Kowalczyk"],
    "year": 2022,
    "doi": "10.1155/2022/6618402",
}

_CARDIAC_ABSTRACT = (
    "Remote cardiac rehabilitation replaced centre-based exercise classes for many patients during recent years, "
    "yet little is known about how patients themselves experience it. We interviewed 24 adults who completed a "
    "twelve-week remote programme after myocardial infarction. Three themes emerged: exercising at home felt "
    "safe once the first supervised video session had taken place; weekly telephone contact with a nurse "
    "replaced the informal peer support of the classes only in part; and patients with poor internet access "
    "felt left behind. Remote programmes should begin with a supervised session and offer a telephone route "
    "for patients without broadband.")
_CARDIAC_INTRO = [
    "Cardiac rehabilitation after myocardial infarction lowers cardiovascular mortality and readmission, but "
    "fewer than half of eligible patients attend a programme. Distance, work and caring duties are the reasons "
    "most often given for not attending. Remote rehabilitation, delivered by video, telephone and activity "
    "trackers, promises to remove these barriers.",
    "Trials show that remote programmes achieve similar gains in exercise capacity to centre-based classes. "
    "Trials measure outcomes, however, not experiences, and the features that keep patients engaged at home "
    "may differ from those that matter in a hospital gym.",
]
_CARDIAC_METHODS = [
    "We conducted semi-structured interviews with adults who had completed the remote programme of two "
    "hospitals in northern England between March 2020 and June 2021. Patients were sampled purposively by age, "
    "sex, deprivation score and digital literacy until no new themes arose.",
    "Interviews lasted 35 to 70 minutes, were held by telephone or video, and were recorded and transcribed "
    "verbatim. Two researchers coded the transcripts independently and developed the themes through reflexive "
    "thematic analysis.",
]


def make_banner_glued_to_title(outdir) -> tuple[Path, dict]:
    exp = BANNER_GLUED_TO_TITLE
    f = sp.Flow(sp.A4, margins=(56, 56, 44, 64))
    for text in ("Journal of Cardiac Nursing Research", "Volume 2022, Article ID 6618402, 11 pages",
                 "https://doi.org/" + exp["doi"]):
        _rich(f, [(text, SANS, 8.5, 0)], leading=1.3)
    f.space(20)
    # the label in the title's own font and size, one line above it: PyMuPDF puts both in one block
    f.line("Research Article", font=SANS_BOLD, size=16, leading=1.25)
    f.lines(["Patient Experiences of Remote Cardiac", "Rehabilitation after Myocardial Infarction:",
             "A Qualitative Interview Study"], font=SANS_BOLD, size=16, leading=1.25, after=12)
    _byline(f, [("Hannah Whitcombe", "1"), ("Samuel Adeyemi", "2"), ("Ruth Kowalczyk", "1")], SANS, 11,
            align="left", conj=", and ")
    f.space(6)
    _marked(f, "1", "School of Nursing and Midwifery, Westbrook University, Leeds LS2 9JT, UK", SANS, 8.5)
    _marked(f, "2", "Department of Cardiology, St Anselm's Hospital, Bristol BS2 8HW, UK", SANS, 8.5)
    f.space(6)
    f.paragraph("Correspondence should be addressed to Hannah Whitcombe; h.whitcombe@westbrook.example",
                font=SANS, size=8.5, after=4)
    f.paragraph("Received 4 January 2022; Revised 2 March 2022; Accepted 15 March 2022; Published 2 April 2022",
                font=SANS, size=8.5, after=4)
    f.paragraph("Academic Editor: Tomasz Nowicki", font=SANS, size=8.5, after=4)
    f.paragraph("Copyright © 2022 Hannah Whitcombe et al. This is an open access article distributed under the "
                "Creative Commons Attribution License, which permits unrestricted use, distribution, and "
                "reproduction in any medium, provided the original work is properly cited.",
                font=SANS, size=8.5, after=10)
    f.paragraph(_CARDIAC_ABSTRACT, font="tiro", size=10, after=6)
    _body(f, _CARDIAC_INTRO, _CARDIAC_METHODS, numbered="{n}. {name}", new_page=True)
    path = _render(f, Path(outdir) / "label_glued_to_title.pdf")
    glued = [b for b in page_blocks(path) if b and b[0].strip() == "Research Article"]
    _check(bool(glued) and len(glued[0]) >= 2 and glued[0][1].startswith("Patient Experiences"),
           f"the label is not in the title's block: {page_blocks(path)[:4]}")
    return path, exp


# ---------------------------------------------------------------------------
# c. a ResearchGate-style cover page; the paper starts on page 2

COVER_PAGE_FIRST = {
    "title": "Seasonal groundwater recharge estimated from chloride mass balance in a semi-arid karst aquifer",
    "authors": ["Elena Marqués", "Jorge Villanueva", "Clara Benítez"],
    "year": 2018,
    "doi": "10.1016/j.jkarst.2018.01.017",
}

_KARST_ABSTRACT = (
    "Recharge of karst aquifers in semi-arid climates is concentrated in a few wet months and is difficult to "
    "measure directly. We combined chloride concentrations in bulk deposition, collected monthly at seven "
    "stations between 2012 and 2016, with spring discharge and spring chloride to estimate recharge by "
    "chloride mass balance for each season. Mean annual recharge was 142 mm, or 31 percent of precipitation; "
    "autumn and winter together contributed 84 percent of it. Summer storms produced recharge only when daily "
    "rainfall exceeded 40 mm. The seasonal estimates agree within 12 percent with a soil water balance model.")
_KARST_INTRO = [
    "Karst aquifers supply drinking water to a quarter of the population of the Mediterranean basin. Their "
    "recharge is fast and localised: water enters through sinkholes, fractures and bare limestone, and the "
    "response of springs to rain can be measured in hours. This makes recharge hard to estimate with soil "
    "water balance models, which assume slow percolation through a soil profile.",
    "The chloride mass balance method avoids that assumption. Chloride reaches the land surface in rain and "
    "dust, is concentrated by evapotranspiration and leaves the catchment in groundwater; if no other source "
    "exists, the ratio of the chloride concentration in deposition to that in recharge gives the fraction of "
    "precipitation that recharges the aquifer.",
]
_KARST_METHODS = [
    "The Sierra de Albarracín aquifer covers 212 square kilometres of Jurassic limestone and drains to three "
    "perennial springs. Bulk deposition was sampled monthly with funnel collectors at seven stations between "
    "420 and 1780 m above sea level, and the springs were sampled fortnightly over the same period.",
    "Chloride was measured by ion chromatography with a detection limit of 0.05 mg/L. Spring discharge was "
    "recorded every fifteen minutes at gauging weirs and checked by monthly current-meter measurements.",
]


def make_cover_page_first(outdir) -> tuple[Path, dict]:
    exp = COVER_PAGE_FIRST
    f = sp.Flow(sp.A4, margins=(50, 50, 40, 56))
    # page 1: the download service's cover sheet
    f.paragraph("See discussions, stats, and author profiles for this publication at: "
                "https://www.researchgate.net/publication/329874112", font=SANS, size=8, after=6)
    _rule(f, f.y)
    f.space(12)
    f.paragraph(exp["title"], font=SANS_BOLD, size=13, leading=1.25, after=6)
    f.line("Article in Journal of Karst Hydrology · February 2018", font=SANS, size=8.5)
    f.line("DOI: " + exp["doi"], font=SANS, size=8.5)
    f.space(10)
    top = f.y
    _item(f, f.ml, top + 8, "CITATIONS", SANS, 7)
    _item(f, f.ml + 250, top + 8, "READS", SANS, 7)
    _item(f, f.ml, top + 26, "14", SANS_BOLD, 15)
    _item(f, f.ml + 250, top + 26, "1,203", SANS_BOLD, 15)
    f.y = top + 40
    f.line("3 authors:", font=SANS, size=8.5)
    f.space(6)
    boxes = [("Elena Marqués", "Instituto de Hidrogeología del Sur", "27 PUBLICATIONS   311 CITATIONS"),
             ("Jorge Villanueva", "Universidad de la Meseta Oriental", "48 PUBLICATIONS   902 CITATIONS"),
             ("Clara Benítez", "Instituto de Hidrogeología del Sur", "9 PUBLICATIONS   64 CITATIONS")]
    top = f.y
    for n, (name, place, counts) in enumerate(boxes):
        x, y = f.ml + (n % 2) * 250, top + (n // 2) * 70
        _item(f, x, y + 10, name, SANS_BOLD, 9)
        _item(f, x, y + 22, place, SANS, 7.5)
        _item(f, x, y + 34, counts, SANS, 7)
        _item(f, x, y + 48, "SEE PROFILE", SANS_BOLD, 7)
    f.y = top + 150
    f.line("Some of the authors of this publication are also working on these related projects:", font=SANS,
           size=8)
    f.line("Project   Recharge mapping in the Iberian Range  View project", font=SANS, size=8)
    f.line("Project   Spring chemistry monitoring network  View project", font=SANS, size=8)
    _footer(f, ["All content following this page was uploaded by Elena Marqués on 03 September 2020.",
                "The user has requested enhancement of the downloaded file."], font=SANS, size=7.5)
    # page 2: the article
    f.new_page()
    f.line("Journal of Karst Hydrology 559 (2018) 412–425", font="tiro", size=8.5, align="center")
    _rule(f, f.y + 2)
    f.space(16)
    f.paragraph(exp["title"], font="tibo", size=16, leading=1.25, after=8)
    _byline(f, [("Elena Marqués", "1,*"), ("Jorge Villanueva", "2"), ("Clara Benítez", "1")], SERIF, 10.5,
            align="left")
    f.space(4)
    _marked(f, "1", "Instituto de Hidrogeología del Sur, Avenida del Agua 14, 04120 Almería, Spain", "tiro", 8.5)
    _marked(f, "2", "Departamento de Geología, Universidad de la Meseta Oriental, 44002 Teruel, Spain", "tiro", 8.5)
    f.space(4)
    f.paragraph("Received 14 June 2017; Accepted 9 January 2018; Available online 20 January 2018",
                font="tiro", size=8.5, after=8)
    f.heading("Abstract", size=11)
    f.paragraph(_KARST_ABSTRACT, size=9.5)
    _footer(f, ["* Corresponding author. E-mail address: e.marques@ihs.example (E. Marqués).",
                "https://doi.org/" + exp["doi"],
                "© 2018 Elsevier B.V. All rights reserved."], font="tiro", size=7.5)
    f.region = f.region[:3] + (f.h - f.mb - 40,) + f.region[4:]
    _body(f, _KARST_INTRO, _KARST_METHODS, new_page=True)
    path = _render(f, Path(outdir) / "researchgate_cover.pdf", numbers_from=2)
    _check("researchgate.net/publication" in page_text(path) and "uploaded by" in page_text(path), "no cover")
    _check(page_text(path, 1).lstrip().startswith("Journal of Karst Hydrology"), "page 2 is not the article")
    return path, exp


# ---------------------------------------------------------------------------
# d. a letter-spaced journal banner and a "Selected for a Viewpoint" line above the title (APS-like)

LETTER_SPACED_BANNER = {
    "title": "Field-Tunable Magnon Bound States in a Frustrated Spin Ladder",
    "authors": ["Jonas Eriksen", "Mireille Dufour", "Kenji Watanabe"],
    "year": 2017,
    "doi": "10.1103/physrevlett.118.207201",
}
APS_BANNER = "P H Y S I C A L   R E V I E W   L E T T E R S"

_MAGNON_ABSTRACT = (
    "We report inelastic neutron scattering on the spin-1/2 ladder compound Cu2(pym)Cl4 in magnetic fields up to "
    "14 T. Above 6.2 T a sharp mode appears below the two-magnon continuum; its energy falls linearly with field "
    "and its intensity is concentrated near the zone boundary. Exact diagonalisation of a ladder with frustrating "
    "diagonal exchange reproduces both the dispersion and the intensity, identifying the mode as a bound state "
    "of two magnons stabilised by the frustration.")
_MAGNON_INTRO = [
    "Bound states of magnons are the magnetic analogue of molecules: two spin flips that attract each other "
    "form a composite excitation with its own dispersion. In one-dimensional magnets such states are expected "
    "whenever the exchange is frustrated, but they are usually hidden inside the continuum of free magnon "
    "pairs and are therefore difficult to observe.",
    "A magnetic field shifts the single-magnon branches and can pull a bound state out of the continuum. We "
    "show here that this happens in a frustrated ladder at an experimentally accessible field, and that the "
    "bound state carries a large part of the spectral weight at the zone boundary.",
]
_MAGNON_METHODS = [
    "Single crystals of 1.2 g total mass were co-aligned on an aluminium holder with the ladder axis "
    "horizontal. Spectra were recorded at 60 mK with an incident energy of 3.3 meV, giving a resolution of "
    "0.08 meV at the elastic line.",
    "Exact diagonalisation was carried out for ladders of up to 2 x 16 sites with periodic boundary "
    "conditions. The exchange constants were fixed by the zero-field dispersion and not adjusted afterwards.",
]


def make_letter_spaced_banner(outdir) -> tuple[Path, dict]:
    exp = LETTER_SPACED_BANNER
    f = sp.Flow(sp.LETTER, margins=(54, 54, 36, 60))
    base = f.y + 9
    _item(f, f.ml, base, "PRL 118, 207201 (2017)", "tiro", 8)
    _item(f, (f.w - sp._width("tibo", APS_BANNER, 9.5)) / 2, base, APS_BANNER, "tibo", 9.5)
    for n, text in enumerate(("week ending", "19 MAY 2017")):
        _item(f, f.w - f.mr - sp._width("tiro", text, 8), base - 4 + n * 9, text, "tiro", 8)
    f.y = base + 10
    _rule(f, f.y)
    f.space(12)
    f.line("Selected for a Viewpoint in Physics", font="tibo", size=8.5, align="left")
    f.space(6)
    f.line(exp["title"], font="tibo", size=12, align="center", leading=1.4)
    f.space(4)
    _byline(f, [("Jonas Eriksen", "1"), ("Mireille Dufour", "2,*"), ("Kenji Watanabe", "1")], "tiro", 10,
            style="aps")
    f.space(2)
    _marked(f, "1", "Department of Physics, Technical University of Øresund, 2800 Lyngby, Denmark", "tiit", 8,
            align="center")
    _marked(f, "2", "Laboratoire de Magnétisme Quantique, Université Rhône-Alpes, 38000 Grenoble, France",
            "tiit", 8, align="center")
    f.line("(Received 12 October 2016; published 17 May 2017)", font="tiro", size=8, align="center")
    f.space(6)
    _region(f, f.ml + 40, f.w - f.mr - 40)
    f.paragraph(_MAGNON_ABSTRACT, size=9, leading=1.25, after=4)
    f.line("DOI: 10.1103/PhysRevLett.118.207201", font="tiro", size=8)
    _full_width(f)
    f.space(8)
    f.columns_from_here(2)
    _body(f, _MAGNON_INTRO, _MAGNON_METHODS, size=10, numbered="{name}", methods_name="Experiment")
    f.new_page()
    f.paragraph("The field at which the bound state leaves the continuum follows from the zero-field exchange "
                "constants without adjustable parameters, which supports the identification of the mode.",
                size=10)
    path = _render(f, Path(outdir) / "aps_letter_spaced_banner.pdf")
    _check(any(APS_BANNER in l for l in page_lines(path)), "the banner does not extract letter-spaced")
    _check(_squash(_max_size_text(path)) == exp["title"], "the title is not the largest text")
    return path, exp


# ---------------------------------------------------------------------------
# e. one- and two-word titles

ONE_WORD_TITLE = {
    "title": "Photosynthesis",
    "authors": ["Margarethe Olsen", "David K. Mwangi"],
    "year": 2020,
    "doi": "10.1007/978-3-030-47112-6_12",
}
TWO_WORD_TITLE = {
    "title": "Deep learning",
    "authors": ["Priya Raman", "Lukas Hoffmann", "Aiko Tanaka"],
    "year": 2021,
    "doi": "10.1146/annurev-compsci-021921-104217",
}

_PHOTO_ABSTRACT = (
    "Photosynthesis converts light energy into chemical energy and supplies almost all of the organic carbon "
    "in the biosphere. This chapter describes the light reactions in the thylakoid membrane, the fixation of "
    "carbon dioxide by the Calvin-Benson cycle, and the carbon-concentrating mechanisms of C4 and CAM plants, "
    "and it discusses how photosynthesis responds to light, temperature and water supply in the field.")
_PHOTO_INTRO = [
    "Every year plants, algae and cyanobacteria fix about 120 billion tonnes of carbon from the atmosphere. The "
    "process takes place in two linked stages. In the light reactions, two photosystems drive electrons from "
    "water to NADP+, releasing oxygen and building a proton gradient that powers ATP synthesis. In the carbon "
    "reactions, ATP and NADPH are spent to reduce carbon dioxide to sugar phosphates.",
    "The efficiency of the whole process is low: under field conditions crops convert at most a few percent "
    "of incident sunlight into biomass. Understanding where the energy is lost has become a central goal of "
    "plant science, because raising photosynthetic efficiency is one of the few routes to higher yields that "
    "has not yet been exploited by breeding.",
]
_PHOTO_METHODS = [
    "Chloroplasts contain an inner membrane system of flattened sacs, the thylakoids, which are stacked into "
    "grana and connected by unstacked stroma lamellae. Photosystem II is concentrated in the grana, whereas "
    "photosystem I and the ATP synthase sit in membranes that face the stroma.",
    "Light is absorbed by chlorophyll and carotenoid molecules bound to antenna proteins. The excitation "
    "migrates within picoseconds to a reaction centre, where charge separation takes place with a quantum "
    "efficiency close to one.",
]
_DL_ABSTRACT = (
    "Deep learning methods learn layered representations of data directly from examples and have transformed "
    "image recognition, speech processing and the prediction of protein structure. We review the building "
    "blocks of modern networks, the optimisation methods that make very deep models trainable, and the "
    "practical questions of data, compute and evaluation that scientists face when they apply these methods "
    "to their own problems.")
_DL_INTRO = [
    "For most of its history machine learning relied on features designed by hand: an expert decided which "
    "properties of an image or a signal were relevant, and a comparatively simple model was trained on them. "
    "Deep networks replace this step by learning the features themselves, layer by layer, from raw inputs.",
    "Three developments made this practical: large labelled data sets, graphics processors that perform the "
    "required matrix products quickly, and a set of training methods, from better initialisation to residual "
    "connections and normalisation layers, that keep gradients well behaved in networks with many layers.",
]
_DL_METHODS = [
    "A feed-forward network computes a sequence of affine maps, each followed by a non-linear activation. "
    "Convolutional layers share their weights across positions, which builds translation invariance into the "
    "model and reduces the number of parameters by orders of magnitude.",
    "Attention layers compute, for every element of a sequence, a weighted average of all other elements. "
    "Stacked with feed-forward layers they form the transformer, now the dominant architecture for text.",
]


def _short_title_paper(outdir, name, exp, header, affiliations, abstract, intro, methods, methods_name,
                       copyright_line, junk_title) -> Path:
    f = sp.Flow(sp.A4)
    for text in header:
        f.line(text, font="tiro", size=8.5)
    _rule(f, f.y + 2)
    f.space(36)
    f.line(exp["title"], font="tibo", size=26, leading=1.3)
    f.space(8)
    _byline(f, [(a, "") for a in exp["authors"]], "tiro", 12, align="left", conj=" and ")
    f.space(4)
    for text in affiliations:
        f.line(text, font="tiit", size=9)
    f.space(6)
    f.line(copyright_line, font="tiro", size=8.5)
    f.heading("Abstract", size=11, before=14)
    f.paragraph(abstract, size=9.5)
    _body(f, intro, methods, new_page=True, methods_name=methods_name)
    return _render(f, Path(outdir) / name, metadata={"title": junk_title, "author": "", "creator": "Microsoft® Word",
                                                     "producer": "Microsoft® Word"})


def make_one_word_title(outdir) -> tuple[Path, dict]:
    exp = ONE_WORD_TITLE
    path = _short_title_paper(
        outdir, "one_word_title.pdf", exp,
        ["Handbook of Plant Biology, 2nd edition · Chapter 12 · pp. 287–318",
         "https://doi.org/" + exp["doi"]],
        ["Northern Plant Science Institute, 5007 Bergen, Norway", "Department of Botany, Rift Valley University, "
                                                                  "Nakuru, Kenya"],
        _PHOTO_ABSTRACT, _PHOTO_INTRO, _PHOTO_METHODS, "The thylakoid membrane",
        "© The Editor(s) and The Author(s) 2020",
        "Microsoft Word - ch12_final_v3.docx")
    _check(_max_size_text(path) == exp["title"], "the title is not the largest text")
    return path, exp


def make_two_word_title(outdir) -> tuple[Path, dict]:
    exp = TWO_WORD_TITLE
    path = _short_title_paper(
        outdir, "two_word_title.pdf", exp,
        ["Annual Review of Computational Science 2021. 4:117–142", "https://doi.org/" + exp["doi"]],
        ["Institute for Data Science, Lakeshore University, Chicago, Illinois 60611, USA",
         "Institute for Learning Systems, Neckar University, 72076 Tübingen, Germany"],
        _DL_ABSTRACT, _DL_INTRO, _DL_METHODS, "Network architectures",
        "Copyright © 2021 by the author(s). All rights reserved",
        "untitled")
    _check(_max_size_text(path) == exp["title"], "the title is not the largest text")
    return path, exp


# ---------------------------------------------------------------------------
# f. six authors in two columns under the title, each with raised letter and symbol marks
#
# Reading order: an author grid is read as text is, row by row and left to right within a row (the order
# ACL, ACM and IEEE conference templates give their authors in).

TWO_COLUMN_AUTHORS = {
    "title": "Thin-film composite membranes with graphene oxide interlayers for brackish water desalination",
    "authors": ["Laura Bianchi", "Oluwaseun Adebayo", "Pieter de Vries",
                "Sarah Goldberg", "Mei-Ling Chou", "Henrik Ström"],
    "year": 2020,
    "doi": "10.1016/j.jmst.2020.118402",
}
_TWO_COLUMNS = [[("Laura Bianchi", "a,*"), ("Pieter de Vries", "b"), ("Mei-Ling Chou", "a")],
                [("Oluwaseun Adebayo", "c,†"), ("Sarah Goldberg", "b"), ("Henrik Ström", "a")]]

_MEMBRANE_ABSTRACT = (
    "Thin-film composite membranes for reverse osmosis combine a dense polyamide layer with a porous support. "
    "We inserted a graphene oxide interlayer of 20 to 80 nm between the two and measured water flux and salt "
    "rejection with brackish feed water of 2,000 mg/L sodium chloride. A 40 nm interlayer raised the water "
    "permeance from 2.1 to 3.4 L m-2 h-1 bar-1 while the rejection stayed above 99.2 percent. Electron "
    "microscopy shows a thinner and more uniform polyamide layer on the interlayer.")
_MEMBRANE_INTRO = [
    "Brackish groundwater is an important source of drinking water in arid inland regions, and reverse osmosis "
    "is the most widely used technology to desalinate it. The energy required is set largely by the water "
    "permeance of the membrane, which in turn depends on the thickness and the structure of the polyamide "
    "selective layer formed by interfacial polymerisation.",
    "The support controls how the amine monomer is stored and released during polymerisation. Interlayers of "
    "nanomaterials between support and polyamide smooth the surface, hold the amine solution evenly and yield "
    "thinner selective layers, but most studies have tested them with seawater rather than brackish water.",
]
_MEMBRANE_METHODS = [
    "Graphene oxide was prepared by a modified Hummers method and deposited on polysulfone supports by vacuum "
    "filtration of dispersions containing 5 to 20 mg/L. The polyamide layer was formed by contacting the "
    "support with 2 percent m-phenylenediamine for 2 min and then with 0.1 percent trimesoyl chloride for 1 min.",
    "Water flux and salt rejection were measured in a cross-flow cell with an active area of 20 square "
    "centimetres at 15 bar and 25 C. Each membrane type was tested in triplicate.",
]


def make_two_column_author_block(outdir) -> tuple[Path, dict]:
    exp = TWO_COLUMN_AUTHORS
    f = sp.Flow(sp.A4)
    f.line("Journal of Membrane Science and Technology 612 (2020) 118402", font="tiro", size=8.5, align="center")
    _rule(f, f.y + 2)
    f.space(22)
    f.paragraph(exp["title"], font="tibo", size=15, leading=1.25, align="center", after=12)
    size, top = 10.5, f.y
    for col, people in enumerate(_TWO_COLUMNS):
        center = f.ml + (col + 0.5) * (f.w - f.ml - f.mr) / 2
        for row, (name, marks) in enumerate(people):
            runs = [(name, "tiro", size, 0), (marks, "tiro", size * SUP_SCALE, size * SUP_RISE)]
            x = center - _width(runs) / 2
            baseline = top + size + row * size * 1.6
            for text, font, run_size, rise in runs:
                _item(f, x, baseline - rise, text, font, run_size)
                x += sp._width(font, text, run_size)
    f.y = top + 3 * size * 1.6 + 8
    for marks, text in (("a", "Department of Chemical Engineering, Politecnico di Valmontone, 00038 Valmontone, Italy"),
                        ("b", "Water Technology Centre, Delta University of Applied Sciences, 2628 Delft, "
                              "The Netherlands"),
                        ("c", "Department of Civil Engineering, Lagos Institute of Technology, Lagos, Nigeria")):
        _marked(f, marks, " " + text, "tiit", 8.5, align="center")
    f.space(4)
    f.line("Received 3 February 2020; Received in revised form 2 May 2020; Accepted 18 May 2020",
           font="tiro", size=8.5, align="center")
    f.heading("Abstract", size=11, before=10)
    f.paragraph(_MEMBRANE_ABSTRACT, size=9.5)
    _footer(f, ["* Corresponding author. E-mail address: laura.bianchi@polival.example (L. Bianchi).",
                "† Present address: Coastal Water Authority, Accra, Ghana.",
                "https://doi.org/" + exp["doi"]], font="tiro", size=7.5)
    f.region = f.region[:3] + (f.h - f.mb - 34,) + f.region[4:]
    _body(f, _MEMBRANE_INTRO, _MEMBRANE_METHODS, new_page=True)
    path = _render(f, Path(outdir) / "two_column_authors.pdf")
    text = page_text(path)
    _check(all(name in text for col in _TWO_COLUMNS for name, _ in col), "a name is missing")
    _check("Bianchia" in text.replace(" ", "") or "Bianchi\na" in text, "the marks are not glued to the names")
    return path, exp


# ---------------------------------------------------------------------------
# g. an all-capitals byline (older journals)

ALL_CAPS_BYLINE = {
    "title": "Speckle reduction in fibre-coupled laser projectors using a rotating diffuser",
    "authors": ["Tobias E. Chang", "Maria Lopez-Garcia", "John McAllister"],
    "authors_any_case": ["John McAllister"],
    "year": 1997,
    "doi": None,
}

_SPECKLE_ABSTRACT = (
    "Laser projectors produce images with high colour saturation but suffer from speckle, the granular "
    "interference pattern that appears when coherent light is scattered by a rough screen. We reduce speckle "
    "contrast in a fibre-coupled projector from 0.41 to 0.07 by a diffuser that rotates at 3,000 rpm in an "
    "intermediate image plane, and we show that the residual contrast is set by the number of independent "
    "speckle patterns averaged within the integration time of the eye.")
_SPECKLE_INTRO = [
    "Semiconductor lasers have become attractive light sources for projection displays because of their "
    "efficiency, lifetime and saturated colours. Their coherence, however, causes speckle on every screen whose "
    "roughness exceeds the wavelength, and speckle contrast above a few percent is perceived as disturbing.",
    "Speckle can be reduced by averaging independent patterns in angle, wavelength or polarisation, or in "
    "time. Time averaging with a moving diffuser is simple but has been limited by the loss of light at the "
    "diffuser and by the small number of patterns obtained per frame.",
]
_SPECKLE_METHODS = [
    "Light from three laser diodes at 638, 520 and 450 nm was combined in a multimode fibre with a core "
    "diameter of 400 um. The fibre output was imaged onto a holographic diffuser with a scattering angle of "
    "10 degrees, mounted on a brushless motor.",
    "Speckle contrast was measured on a white matte screen with a camera whose aperture and exposure time "
    "matched those of the human eye, and it was averaged over 25 positions across the screen.",
]


def make_all_caps_byline(outdir) -> tuple[Path, dict]:
    exp = ALL_CAPS_BYLINE
    f = sp.Flow(sp.A4)
    f.line("Journal of Applied Optical Engineering, Vol. 36, No. 11, pp. 1411–1419, 1997", font="tiit", size=8.5)
    f.space(30)
    f.paragraph(exp["title"], font="tibo", size=14, leading=1.3, align="center", after=10)
    f.line("TOBIAS E. CHANG, MARIA LOPEZ-GARCIA AND JOHN MCALLISTER", font="tiro", size=10, align="center")
    f.space(4)
    f.line("Department of Physics and Astronomy, University of Kelvinside, Glasgow G12 8QQ, UK", font="tiit",
           size=9, align="center")
    f.space(4)
    f.line("(Received 12 May 1997; revised manuscript received 3 September 1997)", font="tiro", size=8.5,
           align="center")
    f.heading("Abstract", size=10.5, before=14, align="center")
    f.paragraph(_SPECKLE_ABSTRACT, size=9.5)
    f.paragraph("Key words: speckle, laser projection, diffuser, display", font="tiit", size=9)
    _body(f, _SPECKLE_INTRO, _SPECKLE_METHODS, numbered="{n}. {name}", methods_name="Experimental setup",
          new_page=True)
    path = _render(f, Path(outdir) / "all_caps_byline.pdf")
    _check("TOBIAS E. CHANG, MARIA LOPEZ-GARCIA AND JOHN MCALLISTER" in page_lines(path), "byline not one line")
    return path, exp


# ---------------------------------------------------------------------------
# h. sixty authors wrapped over many lines, each with raised digit marks

_SIXTY = [
    ("Anneke Vos", "1,2"), ("Mikael Lindström", "3"), ("Sigrid Halvorsen", "4"), ("Jukka Peltonen", "5"),
    ("Freya Thorsdóttir", "6"), ("Henrik Aas", "4"), ("Kaisa Mäkinen", "5"), ("Oskar Berglund", "3"),
    ("Ingeborg Nilsen", "4,7"), ("Rasmus Kjær", "8"), ("Elina Virtanen", "5"), ("Daniel Åberg", "3"),
    ("Marte Solheim", "4"), ("Tuomas Laine", "5,9"), ("Johanna Ek", "3"), ("Pål Rønning", "7"),
    ("Camilla Strand", "3"), ("Aleksi Heikkinen", "5"), ("Linnea Sjöberg", "3"), ("Thomas W. Holm", "8"),
    ("Birgitta Sandvik", "4"), ("Emil Karlsson", "3"), ("Hanna Lehtonen", "9"), ("Magnus Dahl", "4"),
    ("Sofie Winther", "8"), ("Jonas Nyberg", "3"), ("Maria Carlsson", "3"), ("Petteri Koskinen", "5"),
    ("Kristin Haug", "7"), ("Anders Møller", "8"), ("Eeva Salonen", "9"), ("Viktor Engström", "3"),
    ("Nora Fjeld", "4"), ("Mathias Lund", "8"), ("Riikka Järvinen", "5"), ("Erik Jansson", "3"),
    ("Siri Vik", "7"), ("Juho Rantanen", "9"), ("Ida Mortensen", "8"), ("Gustav Lindqvist", "3"),
    ("Laura Hämäläinen", "5"), ("Fredrik Strøm", "4"), ("Astrid Eriksen", "7"), ("Ville Nieminen", "5"),
    ("Ulrika Björk", "3"), ("Martin Sørensen", "8"), ("Helmi Korhonen", "9"), ("Sander van Leeuwen", "1"),
    ("Tove Engen", "4"), ("Olli Kallio", "5"), ("Karin M. Wallin", "3"), ("Jesper Kristensen", "8"),
    ("Paula Tuominen", "9"), ("Ragnar Hauge", "7"), ("Emma Lindgren", "3"), ("Niklas Forsberg", "3"),
    ("Heidi Aaltonen", "5"), ("Bjørn Olsen", "4"), ("Cecilia Nordin", "3"), ("Arnar Gunnarsson", "6,2"),
]
assert len(_SIXTY) == 60 and len({n for n, _ in _SIXTY}) == 60

SIXTY_AUTHORS = {
    "title": "Genome-wide association meta-analysis of resting heart rate in 412,000 individuals of Northern "
             "European ancestry",
    "authors": [name for name, _ in _SIXTY],
    "year": 2021,
    "doi": "10.1038/s41467-021-22718-3",
}

_HEART_ABSTRACT = (
    "Resting heart rate is a heritable trait that predicts cardiovascular mortality. We meta-analysed "
    "genome-wide association studies of resting heart rate in seven Nordic biobanks, comprising 412,000 "
    "individuals, and identified 186 independent loci, 71 of them new. The loci are enriched near genes "
    "expressed in the sinoatrial node and in cardiac neurons, and a polygenic score explains 6.8 percent of "
    "the variance in an independent cohort.")
_HEART_INTRO = [
    "A resting heart rate above 80 beats per minute is associated with higher cardiovascular and all-cause "
    "mortality, independently of blood pressure and physical activity. Twin studies estimate its heritability "
    "at 50 to 60 percent, and earlier association studies identified 64 loci, which together explain only a "
    "small part of this heritability.",
    "The Nordic biobanks link genotypes with decades of electrocardiograms recorded in routine care. Pooling "
    "them provides the statistical power to find variants of small effect and to study heart rate in "
    "subgroups defined by sex, age and medication.",
]
_HEART_METHODS = [
    "Seven biobanks contributed summary statistics for resting heart rate measured on the first available "
    "electrocardiogram without beta blockers. Genotypes were imputed to a common reference panel, and "
    "variants with a minor allele frequency below 0.5 percent or imputation quality below 0.6 were excluded.",
    "Fixed-effect meta-analysis was performed with inverse-variance weights, and independent signals were "
    "identified by conditional analysis within windows of 1 Mb.",
]


def make_sixty_authors(outdir) -> tuple[Path, dict]:
    exp = SIXTY_AUTHORS
    f = sp.Flow(sp.A4, margins=(50, 50, 44, 60))
    f.line("Nordic Communications in Genetics | (2021) 12:1984 | https://doi.org/" + exp["doi"],
           font="helv", size=7.5)
    f.space(18)
    f.paragraph(exp["title"], font="tibo", size=16, leading=1.22, after=10)
    _byline(f, _SIXTY, SERIF, 9, align="left", conj=" & ", leading=1.5)
    f.space(6)
    for marks, text in (("1", "Department of Epidemiology, University Medical Centre Noorderzijl, Groningen, "
                              "The Netherlands"),
                        ("2", "Centre for Population Genomics, Reykjanes Institute, Reykjavík, Iceland"),
                        ("3", "Department of Medical Sciences, Fyris University, Uppsala, Sweden"),
                        ("4", "Institute of Clinical Medicine, University of Nordmarka, Oslo, Norway"),
                        ("5", "Institute for Molecular Medicine, Biobank Unit, University of Helsingfors, Helsinki, "
                              "Finland"),
                        ("6", "Faculty of Medicine, University of the North Atlantic, Reykjavík, Iceland"),
                        ("7", "Department of Cardiology, Bergenhus Hospital, Bergen, Norway"),
                        ("8", "Novo Region Biobank, Department of Clinical Genetics, Aarhus, Denmark"),
                        ("9", "Research Unit of Population Health, Bothnia University, Oulu, Finland")):
        _marked(f, marks, text, "tiro", 7.5, leading=1.25)
    f.space(4)
    f.line("Received: 14 August 2020; Accepted: 2 March 2021; Published online: 30 March 2021", font="tiro",
           size=7.5)
    f.heading("Abstract", size=11, before=10)
    f.paragraph(_HEART_ABSTRACT, size=9.5)
    _body(f, _HEART_INTRO, _HEART_METHODS, new_page=True)
    path = _render(f, Path(outdir) / "sixty_authors.pdf")
    byline_lines = [l for l in page_lines(path) if any(name in l for name, _ in _SIXTY)]
    _check(len(byline_lines) >= 5, f"the byline is not wrapped over many lines: {byline_lines}")
    _check(all(name in page_text(path) for name, _ in _SIXTY), "a name is broken across lines")
    return path, exp


# ---------------------------------------------------------------------------
# i. the DOI broken across two lines of the first page's citation box (PLOS-like sidebar)

DOI_BROKEN = {
    "title": "Urban tree canopy and night-time heat exposure of older adults: a city-wide sensor study",
    "authors": ["Rebecca Haldane", "Matías Ortiz", "Yusuf Demir"],
    "year": 2018,
    "doi": "10.1371/journal.pone.0197919",
}
_SIDEBAR = [                   # the citation box, broken as the journal's typesetter broke it
    "Citation: Haldane R, Ortiz M, Demir Y (2018)",
    "Urban tree canopy and night-time heat",
    "exposure of older adults: a city-wide sensor",
    "study. PLoS ONE 13(6): e0197919. https://",
    "doi.org/10.1371/journal.",
    "pone.0197919",
]
_HEAT_ABSTRACT = (
    "Heat waves are most dangerous at night, when the bodies of older adults cannot recover from the heat of "
    "the day. We placed temperature loggers in the bedrooms of 214 residents aged 70 years or more and in "
    "the street outside their homes in one city for two summers, and we related night-time temperatures to "
    "the tree canopy cover within 100 m of each home. Each 10 percent of canopy cover lowered the mean "
    "bedroom temperature between midnight and 6 am by 0.3 C and the number of nights above 24 C by 2.1 per "
    "summer. The effect was largest in top-floor flats. Tree planting programmes should give priority to "
    "streets where many older adults live on upper floors.")
_HEAT_INTRO = [
    "Mortality rises steeply during heat waves, and most of the excess deaths occur among people aged 75 "
    "years or more who live alone. High night-time temperatures are a particular risk because they deny the "
    "body a period of recovery, and they are more common in cities, where buildings and paved surfaces "
    "release the heat they stored during the day.",
    "Street trees cool cities by shading and by evaporation. Their effect on air temperature in the street "
    "is well documented, but whether it reaches the bedrooms in which older adults spend the hottest nights "
    "has rarely been measured.",
]
_HEAT_METHODS = [
    "We recruited residents aged 70 years or more through the city's home care service and through general "
    "practices in twelve districts chosen to span the range of canopy cover. Participants gave written "
    "consent, and the study was approved by the regional ethics committee.",
    "Temperature loggers recorded at ten-minute intervals in the bedroom and in a radiation shield on the "
    "street facade. Canopy cover was measured from airborne laser scanning with a resolution of 1 m.",
]


def make_doi_broken_across_lines(outdir) -> tuple[Path, dict]:
    exp = DOI_BROKEN
    f = sp.Flow(sp.LETTER, margins=(40, 48, 40, 60))
    f.space(26)
    _item(f, f.ml, f.y - 14, "RESEARCH ARTICLE", "hebo", 9)
    f.paragraph(exp["title"], font=SANS_BOLD, size=17, leading=1.22, after=10)
    _byline(f, [("Rebecca Haldane", "1*"), ("Matías Ortiz", "2"), ("Yusuf Demir", "1")], SANS, 11, align="left")
    f.space(4)
    _marked(f, "1", "Department of Environmental Health, Riverside School of Public Health, Manchester, UK",
            SANS, 8)
    _marked(f, "2", "Centro de Estudios Urbanos, Universidad del Litoral Sur, Valparaíso, Chile", SANS, 8)
    _marked(f, "*", "r.haldane@riverside.example", SANS, 8)
    f.space(18)
    top = f.y
    _region(f, f.ml, f.ml + 150, top)
    f.line("OPEN ACCESS", font="hebo", size=9)
    f.space(8)
    f.lines(_SIDEBAR, font="helv", size=7.5, leading=1.35, after=8)
    for text in ("Editor: Hugo Lindahl, Nordic Institute of", "Public Health, SWEDEN", "",
                 "Received: January 22, 2018", "Accepted: May 21, 2018", "Published: June 7, 2018", "",
                 "Copyright: © 2018 Haldane et al. This is an", "open access article distributed under the",
                 "terms of the Creative Commons Attribution", "License."):
        if text:
            f.line(text, font="helv", size=7.5, leading=1.35)
        else:
            f.space(6)
    _region(f, f.ml + 175, f.w - f.mr, top)
    f.heading("Abstract", font=SANS_BOLD, size=13, before=0)
    f.paragraph(_HEAT_ABSTRACT, font="tiro", size=10)
    f.new_page()
    _body(f, _HEAT_INTRO, _HEAT_METHODS, numbered="{name}", methods_name="Materials and methods")
    path = _render(f, Path(outdir) / "plos_doi_broken.pdf")
    lines = [l.strip() for l in page_lines(path)]
    at = next((i for i, l in enumerate(lines) if l.endswith("doi.org/10.1371/journal.")), None)
    _check(at is not None and lines[at + 1].startswith("pone.0197919"), f"the DOI is not broken: {lines[:40]}")
    _check(all("journal.pone.0197919" not in page_text(path, n) for n in (0, 1)), "the DOI is printed whole")
    return path, exp



# ---------------------------------------------------------------------------
# j. the year in the journal line, a later year in a download/reprint notice on the same page

YEAR_JOURNAL_LINE = {
    "title": "Crystal structure and thermal expansion of the layered bismuth oxyhalide Bi4O5Br2",
    "authors": ["Klaus-Dieter Brenner", "Ute Hallstein", "Reinhard Vogt"],
    "year": 1994,
    "doi": None,
}

_BISMUTH_ABSTRACT = (
    "The crystal structure of Bi4O5Br2 was determined from single-crystal X-ray data at 293 K and refined by "
    "Rietveld analysis of powder data between 100 and 900 K. The compound crystallises in the monoclinic space "
    "group P21 with layers of [Bi4O5] separated by double layers of bromide ions. Thermal expansion is strongly "
    "anisotropic: the stacking axis expands three times faster than the axes within the layers.")
_BISMUTH_INTRO = [
    "Bismuth oxyhalides form a family of layered compounds in which fluorite-like bismuth oxide slabs "
    "alternate with halide layers. The ratio of oxide to halide determines the thickness of the slabs, and "
    "with it the optical band gap, which makes these compounds interesting as photocatalysts and pigments.",
    "Of the bromine-rich members, BiOBr has been studied in detail, whereas the structure of the oxygen-rich "
    "phase Bi4O5Br2 has so far been assumed to be isotypic with the corresponding iodide without proof.",
]
_BISMUTH_METHODS = [
    "Bi4O5Br2 was prepared by heating a stoichiometric mixture of Bi2O3 and BiOBr in an evacuated silica "
    "ampoule at 720 C for five days. Pale yellow platelets suitable for single-crystal diffraction grew on "
    "the cooler end of the ampoule.",
    "Single-crystal data were collected on a four-circle diffractometer with Mo K-alpha radiation. Powder "
    "patterns were recorded in steps of 0.02 degrees in a cryostat and a furnace under dry nitrogen.",
]


def make_year_in_journal_line_and_later_disclaimer(outdir) -> tuple[Path, dict]:
    exp = YEAR_JOURNAL_LINE
    f = sp.Flow(sp.A4)
    f.line("Annalen für Kristallchemie 49b, 272–276 (1994)", font="tiit", size=8.5)
    f.space(28)
    f.paragraph(exp["title"], font="tibo", size=14, leading=1.3, after=8)
    f.line("Klaus-Dieter Brenner, Ute Hallstein and Reinhard Vogt", font="tibo", size=10.5)
    f.line("Institut für Anorganische Chemie, Universität Oberrhein, Rheinstraße 21, D-76131 Karlsruhe",
           font="tiro", size=9)
    f.space(4)
    f.line("Annalen für Kristallchemie 49b, 272–276 (1994); received November 3, 1993", font="tiit", size=8.5)
    f.space(8)
    f.paragraph(_BISMUTH_ABSTRACT, size=9.5)
    f.paragraph("Key words: Bismuth Oxyhalide, Crystal Structure, Thermal Expansion, Layered Compounds",
                font="tiit", size=9)
    _footer(f, ["Reprint requests to Dr. K.-D. Brenner.",
                "This article was downloaded on 12 March 2008 from the Kristall Digital Archive. "
                "© 2008 Kristall reprint service;",
                "this electronic reprint is provided for private study only and may not be redistributed."],
            font="tiro", size=7)
    f.region = f.region[:3] + (f.h - f.mb - 36,) + f.region[4:]
    _body(f, _BISMUTH_INTRO, _BISMUTH_METHODS, numbered="{n}. {name}", methods_name="Experimental",
          new_page=True)
    path = _render(f, Path(outdir) / "journal_line_year_1994.pdf")
    text = page_text(path)
    _check("(1994)" in text and "downloaded on 12 March 2008" in text and "© 2008" in text, "years missing")
    return path, exp


# ---------------------------------------------------------------------------
# k. marker glyphs whose text maps to C0 control characters (a byline name followed by \x01, a DOI by \x04)

CONTROL_CHARACTERS = {
    "title": "Optical trapping of silica microspheres near a rough gold film: a finite-difference study",
    "authors": ["Pascal C. Marchetti", "Noémie Rahmani", "Guillaume Bérard"],
    "year": 2014,
    "doi": "10.1364/jcp.31.002214",
}

_TRAP_ABSTRACT = (
    "We compute the optical force on silica microspheres held by a focused beam at distances of 50 to 500 nm "
    "above a gold film whose surface roughness has a root-mean-square height of 2 to 12 nm. Roughness "
    "redistributes the near field into hot spots that pull the sphere sideways; above 8 nm the lateral "
    "stiffness of the trap falls by 40 percent and the equilibrium position becomes bistable.")
_TRAP_INTRO = [
    "Optical tweezers hold dielectric particles with the gradient force of a tightly focused laser beam. Near "
    "a metal surface the field is modified by reflection and by surface plasmons, which can strengthen the "
    "trap but also push particles against the surface.",
    "Real metal films are rough on the nanometre scale. Roughness scatters surface plasmons and creates "
    "localised hot spots, yet most models of trapping near metals assume a perfectly flat surface.",
]
_TRAP_METHODS = [
    "Maxwell's equations were solved with a finite-difference time-domain code on a non-uniform grid with a "
    "smallest cell of 1 nm near the gold surface. Rough surfaces were generated as Gaussian random fields with "
    "a correlation length of 40 nm.",
    "Forces were obtained by integrating the Maxwell stress tensor over a box enclosing the sphere, and each "
    "configuration was averaged over twenty realisations of the surface.",
]


def make_control_character_glyphs(outdir) -> tuple[Path, dict]:
    exp = CONTROL_CHARACTERS
    f = sp.Flow(sp.A4)
    f.line("Journal of Computational Photonics, Vol. 31, No. 10, October 2014, pp. 2214–2222", font="tiro",
           size=8.5)
    _rule(f, f.y + 2)
    f.space(24)
    f.paragraph(exp["title"], font="tibo", size=15, leading=1.25, align="center", after=10)
    # the byline: names in a real font, the marker glyphs (drawn as daggers) come out of a font whose character
    # codes 1 and 2 have no Unicode mapping, so the text layer holds U+0001 / U+0002 after the names
    size, sup = 11, 11 * SUP_SCALE
    runs = [("Pascal C. Marchetti", SERIF, size, 0), ("\x01", "helv", sup, size * SUP_RISE),
            (", Noémie Rahmani", SERIF, size, 0), ("\x02", "helv", sup, size * SUP_RISE),
            (", and Guillaume Bérard", SERIF, size, 0), ("\x01", "helv", sup, size * SUP_RISE)]
    x = f.ml + (f.w - f.ml - f.mr - _width(runs) - 3 * 4) / 2
    baseline = f.y + size
    for text, font, run_size, rise in runs:
        if font == "helv":
            f.items.append(dict(kind="dagger", page=f.page, col=0, ncols=1, x=x, y=baseline - rise, size=run_size))
            _item(f, x, baseline - rise, text, font, run_size, kind="raw")
            x += 3          # the marker's advance (a wider gap would make PyMuPDF insert a space)
        else:
            _item(f, x, baseline, text, font, run_size)
            x += sp._width(font, text, run_size)
    f.y += size * 1.5
    f.line("Institut Fresnel, Université d'Aix-Provence, Domaine Universitaire, 13397 Marseille, France",
           font="tiit", size=9, align="center")
    f.line("Received 2 June 2014; accepted 4 August 2014; posted 11 August 2014 (Doc. ID 213345)",
           font="tiro", size=8.5, align="center")
    f.space(4)
    line = "doi:10.1364/JCP.31.002214"
    x = (f.w - sp._width("tiro", line, 8.5)) / 2
    _item(f, x, f.y + 8.5, line, "tiro", 8.5)
    _item(f, x + sp._width("tiro", line, 8.5), f.y + 8.5, "\x04", "helv", 8.5, kind="raw")
    f.y += 8.5 * 1.4
    f.heading("Abstract", size=11, before=10)
    f.paragraph(_TRAP_ABSTRACT, size=9.5)
    _body(f, _TRAP_INTRO, _TRAP_METHODS, numbered="{n}. {name}", new_page=True)
    path = _render(f, Path(outdir) / "control_char_glyphs.pdf")
    text = page_text(path)
    _check("Marchetti\x01, Noémie Rahmani\x02, and" in text, f"no control character after the names: {text[:400]!r}")
    _check("JCP.31.002214\x04" in text, "no control character after the DOI")
    return path, exp


# ---------------------------------------------------------------------------

BUILDERS = {
    "banner_above_title": make_banner_above_title,
    "banner_glued_to_title": make_banner_glued_to_title,
    "cover_page_first": make_cover_page_first,
    "letter_spaced_banner": make_letter_spaced_banner,
    "one_word_title": make_one_word_title,
    "two_word_title": make_two_word_title,
    "two_column_author_block": make_two_column_author_block,
    "all_caps_byline": make_all_caps_byline,
    "sixty_authors": make_sixty_authors,
    "doi_broken_across_lines": make_doi_broken_across_lines,
    "year_in_journal_line_and_later_disclaimer": make_year_in_journal_line_and_later_disclaimer,
    "control_character_glyphs": make_control_character_glyphs,
}
EXPECTED = {
    "banner_above_title": BANNER_ABOVE_TITLE,
    "banner_glued_to_title": BANNER_GLUED_TO_TITLE,
    "cover_page_first": COVER_PAGE_FIRST,
    "letter_spaced_banner": LETTER_SPACED_BANNER,
    "one_word_title": ONE_WORD_TITLE,
    "two_word_title": TWO_WORD_TITLE,
    "two_column_author_block": TWO_COLUMN_AUTHORS,
    "all_caps_byline": ALL_CAPS_BYLINE,
    "sixty_authors": SIXTY_AUTHORS,
    "doi_broken_across_lines": DOI_BROKEN,
    "year_in_journal_line_and_later_disclaimer": YEAR_JOURNAL_LINE,
    "control_character_glyphs": CONTROL_CHARACTERS,
}


def build_all(outdir) -> dict[str, tuple[Path, dict]]:
    """Every paper, by case name: (path, expected)."""
    return {name: build(outdir) for name, build in BUILDERS.items()}


if __name__ == "__main__":      # python tests/metadata_pdfs.py OUTDIR: write every paper and print its expectation
    import sys
    for case, (pdf, expected) in build_all(Path(sys.argv[1] if len(sys.argv) > 1 else ".")).items():
        print(f"{case}: {pdf} {expected}")
