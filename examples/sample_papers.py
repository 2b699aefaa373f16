#!/usr/bin/env python3
"""Small, realistic sample papers for kb-rag demos and tests.

Every generator writes one file into a folder and returns its path. The content
is fixed (no randomness except where a seed is given), so the same call always
produces the same text. Layout is done here with PyMuPDF: text is wrapped with
real font metrics and written line by line, so the PDFs have ordinary text
layers with headings, paragraphs, page numbers, columns and page breaks.

    python examples/sample_papers.py OUTDIR          # the Quick Start set (5 papers)
    python examples/sample_papers.py OUTDIR --all    # every fixture, broken ones too
    python examples/sample_papers.py OUTDIR --all --verify

All people, institutions, journals and results in these papers are invented.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import random
import re
import sys
from pathlib import Path

import pymupdf

# ---------------------------------------------------------------------------
# fonts

FONT_DIRS = [Path("/usr/share/fonts/truetype/dejavu"), Path("/usr/share/fonts/dejavu"),
             Path("/usr/local/share/fonts"), Path.home() / ".fonts"]
_FONTS: dict[str, pymupdf.Font] = {}


def dejavu_path(name: str = "DejaVuSerif.ttf") -> Path:
    """Path of a DejaVu font file (needed for the ligature paper)."""
    for folder in FONT_DIRS:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{name} not found; install fonts-dejavu (looked in {FONT_DIRS})")


def _font(key: str) -> pymupdf.Font:
    """'tiro'/'tibo'/'helv'/'china-s' are PyMuPDF built-ins; '*.ttf' is a DejaVu file."""
    if key not in _FONTS:
        if key.endswith(".ttf"):
            _FONTS[key] = pymupdf.Font(fontfile=str(dejavu_path(key)))
        else:
            _FONTS[key] = pymupdf.Font(key)
    return _FONTS[key]


_ADVANCE: dict[tuple[str, str], float] = {}


def _width(font: str, text: str, size: float) -> float:
    """Text width in points from cached glyph advances (what TextWriter uses)."""
    total = 0.0
    for ch in text:
        adv = _ADVANCE.get((font, ch))
        if adv is None:
            adv = _ADVANCE[(font, ch)] = _font(font).text_length(ch, 1.0)
        total += adv
    return total * size


# ---------------------------------------------------------------------------
# a tiny flowing layout: regions (columns) on pages, lines placed top to bottom

A4 = (595.0, 842.0)
LETTER = (612.0, 792.0)
_CJK = "\u3000-\u303f\u3400-\u9fff\uff00-\uffef"
_TOKEN = re.compile(rf"[{_CJK}]|[^\s{_CJK}]+\s*|\s+")


class Flow:
    """Places lines of text into column regions, page after page.

    Nothing is drawn until save(); every placed line is kept as an item with its
    page, column and position, so the order in which text is written into the
    PDF content stream can be chosen independently of the reading order.
    """

    def __init__(self, page_size=A4, margins=(66, 66, 64, 72), columns=1, gutter=20,
                 page_numbers=True):
        self.w, self.h = page_size
        self.ml, self.mr, self.mt, self.mb = margins
        self.columns, self.gutter = columns, gutter
        self.page_numbers = page_numbers
        self.footer_labels: list[str] | None = None  # printed numbers, when not 1, 2, 3...
        self.items: list[dict] = []
        self.page = -1
        self.new_page()

    # regions --------------------------------------------------------------
    def new_page(self, columns: int | None = None):
        self.page += 1
        self._split(self.mt, columns or self.columns)

    def _split(self, top: float, n: int):
        width = (self.w - self.ml - self.mr - (n - 1) * self.gutter) / n
        self._pending = [(self.ml + i * (width + self.gutter), self.ml + i * (width + self.gutter) + width,
                          top, self.h - self.mb, i, n) for i in range(n)]
        self._take_region()

    def _take_region(self):
        self.region = self._pending.pop(0)
        self.y = self.region[2]

    def columns_from_here(self, n: int, gap: float = 6):
        """Split the rest of the current page into n columns."""
        self._split(self.y + gap, n)

    def advance(self):
        """Continue in the next column, or on a new page."""
        if self._pending:
            self._take_region()
        else:
            self.new_page()

    @property
    def width(self) -> float:
        return self.region[1] - self.region[0]

    def room(self) -> float:
        return self.region[3] - self.y

    # placing --------------------------------------------------------------
    def space(self, dy: float):
        self.y += dy
        if self.y >= self.region[3]:
            self.advance()

    def _place(self, text: str, font: str, size: float, leading: float, align: str, indent: float):
        step = size * leading
        if self.y + step > self.region[3] + 0.01:
            self.advance()
        x0, x1 = self.region[0], self.region[1]
        length = _width(font, text, size)
        if length > (x1 - x0 - indent) + 0.5:
            raise ValueError(f"line too wide for its column ({length:.0f} pt): {text!r}")
        x = x0 + (x1 - x0 - length) / 2 if align == "center" else x0 + indent
        self.items.append(dict(kind="text", page=self.page, col=self.region[4], ncols=self.region[5],
                               x=x, y=self.y + size, text=text, font=font, size=size))
        self.y += step

    def line(self, text, font="tiro", size=10.5, leading=1.3, align="left", indent=0.0):
        self._place(text, font, size, leading, align, indent)

    def paragraph(self, text, font="tiro", size=10.5, leading=1.3, indent=0.0, after=None,
                  align="left"):
        """Wrap text to the current column width (word-wise; CJK character-wise)."""
        tokens = _TOKEN.findall(" ".join(text.split()) if not re.search(f"[{_CJK}]", text) else text)
        first = True
        while tokens:
            step = size * leading
            if self.y + step > self.region[3] + 0.01:
                self.advance()
            avail = self.width - (indent if first else 0)
            line = ""
            while tokens:
                cand = line + tokens[0]
                if line and _width(font, cand.rstrip(), size) > avail:
                    break
                line = cand
                tokens.pop(0)
            while tokens and not tokens[0].strip():
                tokens.pop(0)
            self._place(line.rstrip(), font, size, leading, align, indent if first else 0.0)
            first = False
        self.space(size * 0.55 if after is None else after)

    def lines(self, lines, font="tiro", size=10.5, leading=1.3, after=None):
        """Place pre-broken lines exactly as given (for hyphenated line ends)."""
        for text in lines:
            self._place(text, font, size, leading, "left", 0.0)
        self.space(size * 0.55 if after is None else after)

    def table_row(self, cells, offsets, font="tiro", size=7.5, leading=1.35):
        """One row of a table: each cell at its offset from the column's left edge, all on one baseline."""
        step = size * leading
        if self.y + step > self.region[3] + 0.01:
            self.advance()
        for cell, dx in zip(cells, offsets):
            self.items.append(dict(kind="text", page=self.page, col=self.region[4], ncols=self.region[5],
                                   x=self.region[0] + dx, y=self.y + size, text=cell, font=font, size=size))
        self.y += step

    def heading(self, text, font="tibo", size=12.0, before=8.0, after=3.0, align="left"):
        """A heading is never left alone at the bottom of a column."""
        if self.y > self.region[2] + 1:
            self.space(before)
        if self.room() < size * 1.3 + 3 * 10.5 * 1.3:
            self.advance()
        self._place(text, font, size, 1.3, align, 0.0)
        self.space(after)

    def lines_needed(self, text, font="tiro", size=10.5) -> int:
        n, line = 1, ""
        for tok in _TOKEN.findall(" ".join(text.split())):
            cand = line + tok
            if line and _width(font, cand.rstrip(), size) > self.width:
                n, line = n + 1, tok.lstrip()
            else:
                line = cand
        return n

    def figure(self, height: float, caption: str, font="tiro", size=9.5):
        """A drawn figure (boxes and a curve, no text) with a caption paragraph below."""
        if self.room() < height + 3 * size * 1.3:
            self.advance()
        x0, x1 = self.region[0], self.region[1]
        self.items.append(dict(kind="figure", page=self.page, col=self.region[4], ncols=self.region[5],
                               rect=(x0 + 30, self.y + 4, x1 - 30, self.y + height - 4)))
        self.y += height
        self.paragraph(caption, font=font, size=size, leading=1.25, after=8)

    def figure_leaving(self, body_lines: int, caption: str, size=10.5, leading=1.3, cap_size=9.5):
        """Draw a figure that fills the column so that exactly `body_lines` lines of
        body text fit below its caption: the next paragraph then breaks across the
        page (or column) after that many lines."""
        cap_h = self.lines_needed(caption, size=cap_size) * cap_size * 1.25 + 8
        body_h = body_lines * size * leading + 0.5 * size * leading  # less than body_lines + 1 lines
        height = self.room() - cap_h - body_h
        if height < 60:
            raise ValueError("not enough room on the page for the figure")
        self.figure(height, caption, size=cap_size)

    # output ---------------------------------------------------------------
    def save(self, path, metadata: dict | None = None, stream_order: str = "reading",
             page_labels: list[dict] | None = None, **save_options) -> Path:
        """Write the PDF. stream_order='right-first' writes, on every page, the
        full-width text first and then the columns from right to left, so that
        the content stream order differs from the reading order. page_labels are
        PyMuPDF label rules (printed page numbers such as i, ii, 1, 2)."""
        doc = pymupdf.open()
        for pno in range(self.page + 1):
            page = doc.new_page(width=self.w, height=self.h)
            items = [it for it in self.items if it["page"] == pno]
            if stream_order == "right-first":
                items.sort(key=lambda it: (it["ncols"] > 1, -it["col"]))
            writer = pymupdf.TextWriter(page.rect)
            for it in items:
                if it["kind"] == "text":
                    writer.append((it["x"], it["y"]), it["text"], font=_font(it["font"]), fontsize=it["size"])
                else:
                    _draw_figure(page, pymupdf.Rect(it["rect"]))
            if self.page_numbers:
                label = self.footer_labels[pno] if self.footer_labels else str(pno + 1)
                x = (self.w - _width("tiro", label, 9)) / 2
                writer.append((x, self.h - self.mb / 2), label, font=_font("tiro"), fontsize=9)
            writer.write_text(page)
        if metadata:
            doc.set_metadata(metadata)
        if page_labels:
            doc.set_page_labels(page_labels)
        return _save(doc, path, **save_options)


def _draw_figure(page, rect):
    shape = page.new_shape()
    shape.draw_rect(rect)
    shape.finish(color=(0.3, 0.3, 0.3), width=0.8)
    left, bottom = rect.x0 + 20, rect.y1 - 15
    shape.draw_line((left, rect.y0 + 10), (left, bottom))
    shape.draw_line((left, bottom), (rect.x1 - 10, bottom))
    shape.finish(color=(0, 0, 0), width=0.6, closePath=False)
    pts, n = [], 24
    for i in range(n + 1):
        t = i / n
        pts.append(pymupdf.Point(left + t * (rect.width - 40), bottom - (rect.height - 35) * (t ** 0.5) * (1.1 - t)))
    shape.draw_polyline(pts)
    shape.finish(color=(0.1, 0.2, 0.7), width=1.2, closePath=False)
    shape.commit()


def _save(doc, path, encryption=None, owner_pw=None, user_pw=None, permissions=None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc.subset_fonts()
    opts = dict(garbage=3, deflate=True, no_new_id=True)
    if encryption is not None:
        opts.update(encryption=encryption, owner_pw=owner_pw or "", user_pw=user_pw or "")
        if permissions is not None:
            opts["permissions"] = permissions
    doc.save(str(path), **opts)
    doc.close()
    return path


def _meta(title, authors, year, subject="", keywords=""):
    stamp = f"D:{year}0315093000Z"
    return {"title": title, "author": "; ".join(authors), "subject": subject, "keywords": keywords,
            "creator": "kb-rag examples/sample_papers.py", "producer": "PyMuPDF",
            "creationDate": stamp, "modDate": stamp}


# ---------------------------------------------------------------------------
# 1. one-column paper: graphene CVD growth on copper

GRAPHENE_TITLE = "Oxygen Pre-Treatment Suppresses Graphene Nucleation on Copper Foils"
GRAPHENE_AUTHORS = ["Alice M. Chen", "Rahul Verma", "Sofia Lindqvist"]
GRAPHENE_YEAR = 2019
GRAPHENE_REF_TOKENS = ["zebrafishreference", "quokkacitation", "narwhalbibliography"]

_GRAPHENE_ABSTRACT = (
    "Chemical vapour deposition (CVD) on copper foils is the most widely used route to large-area "
    "monolayer graphene, but the density of nuclei that form in the first minutes of growth limits the "
    "final domain size. We show that a brief exposure of the copper foil to oxygen before the hydrogen "
    "anneal lowers the graphene nucleation density on copper by two orders of magnitude, from 1200 to "
    "about 9 nuclei per square millimetre. Single-crystal domains grow to 2.3 mm within 6 h at 1035 C "
    "and coalesce into continuous films with a hole mobility of 8200 cm2/Vs at room temperature.")

_GRAPHENE_INTRO = [
    "Graphene grown by chemical vapour deposition has moved from laboratory curiosity to an industrial "
    "material within a decade [1]. Copper is the preferred catalyst because carbon is almost insoluble in "
    "it, so growth is limited to the surface and stops once the first layer is complete. The films are "
    "polycrystalline, however, and the grain boundaries between domains scatter charge carriers and act "
    "as weak points during transfer.",
    "Larger domains require fewer nuclei. Earlier work reduced the nucleation density by polishing the "
    "foil, by enclosing it in a copper pocket, or by lowering the methane partial pressure to a value at "
    "which only a few clusters exceed the critical size [2, 3]. Each of these measures slows growth, and "
    "none of them addresses the chemical nature of the sites at which nuclei form.",
]
_GRAPHENE_FIGURE = (
    "Figure 1. Schematic of the hot-wall CVD reactor. The copper foil rests on a quartz boat in the "
    "centre of a 25 mm tube; oxygen, hydrogen and methane are admitted through separate mass-flow "
    "controllers and the pressure is held at 1.5 Torr during growth.")
# this paragraph is placed so that it breaks across the bottom of page 1
_GRAPHENE_SPLIT = (
    "In this work we show that a short exposure of the copper foil to oxygen before the hydrogen anneal "
    "passivates the active surface sites. Carbon adatoms then have to diffuse much further before a stable "
    "cluster can form, so the domains that do nucleate grow larger and the continuous film that forms after "
    "coalescence contains far fewer grain boundaries. We confirm the reduced boundary density by Raman "
    "mapping and by electrical measurements on devices that span many domains, and we discuss how the "
    "oxygen coverage evolves during the anneal.")
_GRAPHENE_METHODS = [
    ("2.1 Sample preparation",
     "Copper foils (25 um thick, 99.8 percent purity) were cut into 2 x 4 cm pieces, rinsed in acetic acid "
     "to dissolve the native oxide and dried in nitrogen. For the oxygen pre-treatment the foils were held "
     "at 1035 C in 0.1 Torr of oxygen for 5 min, after which the oxygen was pumped out and 10 sccm of "
     "hydrogen was admitted for a 30 min anneal. Reference foils received the same anneal without oxygen."),
    ("2.2 Growth and transfer",
     "Growth was started by adding 0.3 sccm of dilute methane (1 percent in argon) to the hydrogen flow. "
     "Samples were removed after 10 min to count nuclei and after 6 h for fully coalesced films. Films were "
     "transferred onto SiO2/Si wafers with a PMMA support layer and an ammonium persulfate etch."),
    ("2.3 Characterisation",
     "Nucleation density was counted on optical micrographs of partially grown films after mild oxidation "
     "of the copper, which makes bare copper appear darker than copper covered by graphene. Raman maps were "
     "recorded with a 532 nm laser and a step of 1 um. Hall bars were patterned by electron-beam lithography."),
]
_GRAPHENE_RESULTS = [
    "The oxygen pre-treatment changes the nucleation density dramatically. On untreated foils we counted "
    "1200 nuclei per square millimetre after 10 min of growth, whereas oxygen-treated foils carried only "
    "9 nuclei per square millimetre under identical conditions. The domains on the treated foils are "
    "hexagonal with straight edges, which indicates that their growth is limited by the attachment of "
    "carbon at the domain edge rather than by surface diffusion.",
    "Raman maps of coalesced films show a D peak only along narrow lines where domains meet. The mean "
    "intensity ratio of the D and G peaks over a 200 x 200 um area is 0.02 for films grown on treated "
    "foils and 0.11 for films grown on untreated foils. Hall bars that span several domain boundaries show a "
    "hole mobility of 8200 cm2/Vs, close to the value measured within a single domain.",
]
_GRAPHENE_DISCUSSION = [
    "Why does a monolayer of oxygen suppress nucleation? Nuclei form preferentially at step edges and "
    "impurity particles where carbon binds more strongly. Oxygen adsorbs on the same sites and raises the "
    "energy barrier for the capture of carbon, so that the critical cluster can only form where the local "
    "supersaturation is highest. During the anneal in hydrogen the oxygen is slowly removed, but the "
    "residual coverage is sufficient to keep the density of active sites low during the first minutes of growth.",
    "The pre-treatment is simple and compatible with roll-to-roll reactors, because it requires only a "
    "short oxygen pulse before the usual anneal. Combining it with a copper pocket should push the domain "
    "size towards the centimetre scale.",
]
_GRAPHENE_CONCLUSION = (
    "A five-minute oxygen exposure before the hydrogen anneal lowers the graphene nucleation density on "
    "copper foils by two orders of magnitude and yields millimetre-sized single-crystal domains whose "
    "coalesced films approach single-domain mobility.")
_GRAPHENE_REFERENCES = [
    "[1] P. Lindgren and T. Okoro, Zebrafishreference scaling of graphene production, Carbon Reviews 3 (2015) 1-22.",
    "[2] M. Haddad, Quokkacitation pockets and low-pressure growth of graphene, Surf. Sci. Lett. 41 (2016) 88-95.",
    "[3] R. Ito and J. Park, Narwhalbibliography of critical nuclei on copper, Phys. Chem. Notes 12 (2017) 301-310.",
    "[4] A. Moreau, Raman fingerprints of grain boundaries, J. Raman Stud. 7 (2018) 55-61.",
    "[5] K. Svensson, Hall mobility across domain boundaries, Appl. Electron. 19 (2018) 144-150.",
]


def make_onecolumn_paper(outdir, name="graphene_cvd_copper.pdf") -> Path:
    """Multi-page one-column paper with numbered headings, a figure caption, a
    paragraph that breaks across pages 1-2, and a References section whose
    entries hold unique tokens (GRAPHENE_REF_TOKENS) that search must never return."""
    f = Flow(A4)
    f.paragraph(GRAPHENE_TITLE, font="tibo", size=17, leading=1.25, after=8)
    f.line(", ".join(GRAPHENE_AUTHORS[:-1]) + " and " + GRAPHENE_AUTHORS[-1], size=11)
    f.line("Department of Materials Science, Northfield Institute of Technology, Leeds, UK", size=9.5)
    f.line(f"Journal of Carbon Materials 14 ({GRAPHENE_YEAR}) 211-219. Received 12 March {GRAPHENE_YEAR}",
           size=9.5)
    f.heading("Abstract", size=12, before=12)
    f.paragraph(_GRAPHENE_ABSTRACT, size=10)
    f.heading("1 Introduction", size=12)
    for text in _GRAPHENE_INTRO:
        f.paragraph(text)
    f.figure_leaving(3, _GRAPHENE_FIGURE)
    f.paragraph(_GRAPHENE_SPLIT)
    f.heading("2 Methods")
    for head, text in _GRAPHENE_METHODS:
        f.heading(head, size=11, before=4)
        f.paragraph(text)
    f.heading("3 Results")
    for text in _GRAPHENE_RESULTS:
        f.paragraph(text)
    f.heading("4 Discussion")
    for text in _GRAPHENE_DISCUSSION:
        f.paragraph(text)
    f.heading("5 Conclusions")
    f.paragraph(_GRAPHENE_CONCLUSION)
    f.heading("References")
    for ref in _GRAPHENE_REFERENCES:
        f.paragraph(ref, size=9.5, after=2)
    meta = _meta(GRAPHENE_TITLE, GRAPHENE_AUTHORS, GRAPHENE_YEAR, "Journal of Carbon Materials",
                 "graphene; chemical vapour deposition; copper; nucleation")
    return f.save(Path(outdir) / name, meta)


# ---------------------------------------------------------------------------
# 2. two-column arXiv-like paper: cotranslational protein folding

PROTEIN_TITLE = "Cotranslational Folding of a Two-Domain Protein in Coarse-Grained Ribosome Simulations"
PROTEIN_AUTHORS = ["Kenji Watanabe", "Maria Gonzalez", "David Okafor"]
PROTEIN_YEAR = 2021
PROTEIN_REF_TOKENS = ["axolotlcitation", "pangolinreference"]

_PROTEIN_ABSTRACT = (
    "Abstract - Many proteins begin to fold while they are still being synthesised, and the ribosome exit "
    "tunnel restricts which conformations the nascent chain can adopt. We simulate the translation of a "
    "two-domain protein with a coarse-grained model of the ribosome and compare cotranslational folding "
    "with refolding of the full-length chain in solution. Vectorial synthesis lets the N-terminal domain "
    "fold before the C-terminal domain emerges, which suppresses the interdomain misfolded states that trap "
    "a quarter of the refolding trajectories.")
_PROTEIN_INTRO = [
    "Protein folding in the cell differs from folding in a test tube in one important respect: the chain "
    "emerges from the ribosome one residue at a time. The rate of translation, a few residues per second "
    "in bacteria, is slow compared with the folding of small domains, so an N-terminal domain can reach "
    "its native structure long before the rest of the chain has been made.",
    "Multidomain proteins are particularly prone to misfolding in vitro because segments of neighbouring "
    "domains can pair with each other. Vectorial synthesis has been proposed as a mechanism that avoids "
    "such interdomain contacts, but direct structural evidence is scarce because the nascent chain is "
    "difficult to observe inside the exit tunnel [1].",
]
_PROTEIN_FIGURE1 = ("Fig. 1. Cut through the coarse-grained ribosome with a nascent chain of 180 residues; "
                    "the exit tunnel is shaded.")
# placed after Fig. 1 so that it runs from the bottom of the left column to the top of the right one
_PROTEIN_SPLIT = (
    "Here we use molecular simulations in which the ribosome is represented by a rigid shell of beads and "
    "the nascent chain by one bead per residue. During the pauses between residue additions the chain "
    "relaxes, and we observe that the emerging domain first collapses into a compact molten globule state "
    "that is stabilised by transient contacts with the ribosomal surface before the final tertiary "
    "contacts form near the exit port. The model is simple enough to simulate hundreds of complete "
    "translation events, yet it retains the geometry of the tunnel.")
_PROTEIN_SECTIONS = [
    ("II. RELATED WORK", [
        "Coarse-grained structure-based models have reproduced the folding mechanisms of many small proteins, "
        "and several groups have attached such models to a static ribosome to study force generation by "
        "folding near the tunnel exit [2]. Continuous synthesis was modelled by adding residues at a fixed "
        "rate while the existing chain evolved under Langevin dynamics.",
        "Experimental studies with arrest peptides and force-profile analysis support this picture, and "
        "cryo-electron microscopy has shown small domains folding inside the vestibule of the tunnel [3]. "
        "Single-molecule force spectroscopy on stalled ribosome complexes further showed that the ribosomal "
        "surface destabilises partially folded intermediates close to the exit.",
    ]),
    ("III. METHODS", [
        ("A. Coarse-grained model",
         "The nascent chain is modelled with a structure-based potential in which native contacts attract and "
         "all other pairs repel. The ribosome is a shell of 3200 fixed beads taken from a cryo-EM map, with a "
         "tunnel of 100 A length and 15 A mean radius."),
        ("B. Translation protocol",
         "Residues are added at the peptidyl transferase centre every 2 microseconds of simulated time. For "
         "each of 400 independent runs we recorded the fraction of native contacts within each domain and "
         "between the domains. Refolding simulations of the released full-length chain started from "
         "extended conformations at the same temperature."),
    ]),
    ("IV. RESULTS", [
        "In solution, 26 percent of the refolding trajectories were trapped for the whole simulation in "
        "states where the C-terminal strand of the first domain paired with the second domain. During "
        "cotranslational folding such states appeared in only 3 percent of the runs. The first domain "
        "folded on average 40 residues after its last residue left the tunnel, well before the second "
        "domain emerged.",
        ("FIGURE", "Fig. 2. Fraction of native contacts of the first domain as a function of chain length "
                   "during synthesis (blue) and the distribution of folding times in solution."),
        "Slowing translation at a cluster of rare codons between the domains further reduced misfolding, in "
        "agreement with the view that translational pauses give the preceding domain time to fold. Removing "
        "the attractive interactions between the chain and the ribosomal surface made misfolding three times "
        "more frequent, which shows that the surface acts as a chaperone as well as a steric barrier.",
        "The molten globule intermediate observed at the tunnel exit had a radius of gyration 20 percent "
        "larger than the native domain and contained about half of the native contacts, mainly those "
        "between the central strands of the sheet.",
    ]),
    ("V. CONCLUSION", [
        "Vectorial synthesis on the ribosome separates the folding of neighbouring domains in time and "
        "suppresses interdomain misfolding. Coarse-grained ribosome simulations are a practical tool to "
        "test how codon usage shapes cotranslational folding.",
    ]),
]
_PROTEIN_REFERENCES = [
    "[1] L. Brandt, Axolotlcitation of nascent chains in the exit tunnel, Mol. Cell Rep. 9 (2016) 12-19.",
    "[2] H. Kim and S. Patel, Pangolinreference forces at the ribosome tunnel exit, Biophys. Lett. 33 (2018) 70-77.",
    "[3] E. Novak, Cryo-EM of folding intermediates in the vestibule, Struct. Notes 5 (2019) 201-208.",
]


def make_twocolumn_paper(outdir, name="protein_folding_2col.pdf", stream_order="right-first") -> Path:
    """arXiv-like paper: full-width title and abstract, then two columns with
    bold ALL-CAPS headings ('I. INTRODUCTION'). A paragraph of II. RELATED WORK
    runs from the bottom of the left column to the top of the right column on
    page 1. By default the content stream holds the right column before the
    left one, so reading order can only be recovered from the geometry."""
    f = Flow(LETTER, margins=(54, 54, 60, 66), columns=1, gutter=18)
    f.line("arXiv:2104.01234v2 [q-bio.BM] 7 Apr 2021", size=8, align="left")
    f.space(6)
    f.paragraph(PROTEIN_TITLE, font="tibo", size=18, leading=1.2, align="center", after=8)
    f.line(", ".join(PROTEIN_AUTHORS[:-1]) + ", and " + PROTEIN_AUTHORS[-1], size=11, align="center")
    f.line("Graduate School of Biophysics, Kanto University, Tokyo, Japan", size=9, align="center")
    f.space(8)
    f.paragraph(_PROTEIN_ABSTRACT, font="tibo", size=9.5, leading=1.25)
    f.columns_from_here(2)
    body = dict(size=10, leading=1.25, indent=10, after=2)
    f.heading("I. INTRODUCTION", size=10, before=6, after=2, align="center")
    for text in _PROTEIN_INTRO:
        f.paragraph(text, **body)
    f.figure_leaving(4, _PROTEIN_FIGURE1, size=10, leading=1.25, cap_size=8.5)
    f.paragraph(_PROTEIN_SPLIT, **body)
    for head, paras in _PROTEIN_SECTIONS:
        f.heading(head, size=10, before=6, after=2, align="center")
        for item in paras:
            if isinstance(item, tuple) and item[0] == "FIGURE":
                f.figure(150, item[1], size=8.5)
            elif isinstance(item, tuple):
                f.heading(item[0], size=10, before=3, after=1)
                f.paragraph(item[1], **body)
            else:
                f.paragraph(item, **body)
    f.heading("REFERENCES", size=10, before=6, after=2, align="center")
    for ref in _PROTEIN_REFERENCES:
        f.paragraph(ref, size=8.5, leading=1.2, after=2)
    meta = _meta(PROTEIN_TITLE, PROTEIN_AUTHORS, PROTEIN_YEAR, "arXiv q-bio.BM",
                 "protein folding; ribosome; coarse-grained simulation")
    return f.save(Path(outdir) / name, meta, stream_order=stream_order)


# ---------------------------------------------------------------------------
# 3. hyphenated line ends: battery electrolytes

BATTERY_TITLE = "Localized High-Concentration Electrolytes Stabilise Lithium Metal Anodes"
BATTERY_AUTHORS = ["Olusegun Adeyemi", "Hannah Becker"]
BATTERY_YEAR = 2022
BATTERY_REF_TOKENS = ["pelicanreference"]

# lines broken by hand: "electro-" / "chemical", "de-" / "solvation", "inter-" / "phase"
_BATTERY_HYPHEN_LINES = [
    "Lithium metal is the anode of choice for the next generation of rechargeable cells, but its",
    "reactivity towards conventional carbonate solvents limits the Coulombic efficiency. We exam-",
    "ine localized high-concentration electrolytes in which lithium bis(fluorosulfonyl)imide is dis-",
    "solved at 1.2 M in dimethoxyethane and diluted with a fluorinated ether. The electro-",
    "chemical stability window of this mixture extends to 4.9 V against lithium, and the de-",
    "solvation of lithium ions at the electrode is fast because most anions remain in contact",
    "ion pairs. The solid electrolyte inter-",
    "phase formed in the diluted electrolyte is thin, rich in lithium fluoride and mechanically robust.",
]
_BATTERY_SECTIONS = [
    ("1 Introduction", [
        "Rechargeable batteries with lithium metal anodes could store nearly twice the energy of today's "
        "lithium-ion cells. Their cycle life is short, however, because lithium deposits as dendrites and "
        "continuously consumes electrolyte. High salt concentrations suppress these reactions but make the "
        "electrolyte viscous and expensive [1].",
    ]),
    ("2 Experimental", [
        "Electrolytes were prepared in an argon glovebox with less than 0.1 ppm water. Lithium copper "
        "half cells were cycled at 0.5 mA per square centimetre with a capacity of 1 mAh per square "
        "centimetre, and full cells used NMC811 cathodes with an areal loading of 2.5 mAh per square centimetre.",
    ]),
    ("3 Results and Discussion", [
        "The average Coulombic efficiency over 300 cycles reached 99.3 percent in the diluted electrolyte, "
        "compared with 97.1 percent in a conventional carbonate electrolyte. Cells with NMC811 cathodes "
        "retained 86 percent of their capacity after 400 cycles. X-ray photoelectron spectroscopy shows that "
        "the protective layer consists mainly of lithium fluoride and lithium oxide.",
    ]),
    ("4 Conclusions", [
        "Diluting a concentrated electrolyte with a non-solvating fluorinated ether keeps the favourable "
        "solvation structure while lowering viscosity and cost, and enables long cycling of lithium metal anodes.",
    ]),
]
_BATTERY_REFERENCES = [
    "[1] Y. Tanaka, Pelicanreference electrolytes for lithium metal, Energy Mater. Lett. 4 (2019) 10-18.",
    "[2] G. Rossi, Fluorinated ethers as diluents, Electrochem. Notes 11 (2020) 55-60.",
]


def make_hyphenated_paper(outdir, name="battery_electrolytes.pdf") -> Path:
    """One-column paper whose abstract has words hyphenated at line ends
    ('electro-' / 'chemical', 'de-' / 'solvation', 'inter-' / 'phase')."""
    f = Flow(A4)
    f.paragraph(BATTERY_TITLE, font="tibo", size=17, leading=1.25, after=8)
    f.line(" and ".join(BATTERY_AUTHORS), size=11)
    f.line(f"Institute for Electrochemical Energy Storage, Rhine Valley University. Published {BATTERY_YEAR}",
           size=9.5)
    f.heading("Abstract", before=12)
    f.lines(_BATTERY_HYPHEN_LINES)
    for head, paras in _BATTERY_SECTIONS:
        f.heading(head)
        for text in paras:
            f.paragraph(text)
    f.heading("References")
    for ref in _BATTERY_REFERENCES:
        f.paragraph(ref, size=9.5, after=2)
    meta = _meta(BATTERY_TITLE, BATTERY_AUTHORS, BATTERY_YEAR, "Energy Materials Letters",
                 "lithium metal; electrolyte; solid electrolyte interphase")
    return f.save(Path(outdir) / name, meta)


# ---------------------------------------------------------------------------
# 4. ligatures in the text layer: photocatalysis

LIGATURE_TITLE = "Apparent Quantum Efficiency of Photocatalytic Water Splitting on Doped Strontium Titanate"
LIGATURE_AUTHORS = ["Pierre Dubois", "Ingrid Solberg"]
LIGATURE_YEAR = 2020
LIGATURE_REF_TOKENS = ["wombatreference"]
FFI, FI, FL = "\ufb03", "\ufb01", "\ufb02"

_LIGATURE_SECTIONS = [
    ("Abstract", [
        f"The e{FFI}ciency of the photocatalyst determines whether solar water splitting can compete with "
        f"electrolysis. We report an apparent quantum e{FFI}ciency of 56 percent at 365 nm for aluminium-doped "
        f"strontium titanate loaded with rhodium and chromium oxide cocatalysts, measured in a {FL}ow reactor.",
    ]),
    ("1 Introduction", [
        f"Particulate photocatalysts are attractive because they can be spread over large areas at low cost, "
        f"but their e{FFI}ciency has long remained below one percent. Doping with aluminium suppresses the "
        f"recombination centres associated with reduced titanium, and selective cocatalysts make the transfer "
        f"of electrons and holes to the surface su{FFI}ciently fast [1].",
    ]),
    ("2 Methods", [
        f"Strontium titanate was {FI}rst calcined with aluminium oxide in a strontium chloride {FL}ux at 1100 C. "
        f"Cocatalysts were photodeposited from rhodium and chromium salts. The absorption coe{FFI}cient of the "
        f"suspension was measured so that the number of absorbed photons could be calculated for each "
        f"wavelength, and a thin {FI}lm of the powder was used for reflectance spectra.",
    ]),
    ("3 Results", [
        f"Hydrogen and oxygen evolved in a stoichiometric ratio of two to one for more than 100 hours. "
        f"The quantum e{FFI}ciency decreased only slightly at 420 nm, which shows that the e{FFI}cient charge "
        f"separation is retained near the absorption edge.",
    ]),
]
_LIGATURE_REFERENCES = [
    "[1] T. Hoshino, Wombatreference of doped titanate photocatalysts, Catal. Today Lett. 8 (2018) 1-9.",
]


def make_ligature_paper(outdir, name="photocatalysis_ligatures.pdf") -> Path:
    """One-column paper set in DejaVu Serif whose text layer holds the ligature
    characters U+FB03 (ffi), U+FB01 (fi) and U+FB02 (fl): 'The eﬃciency of the ...'."""
    body, bold = "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf"
    f = Flow(A4)
    title = LIGATURE_TITLE.replace("Efficiency", f"E{FFI}ciency")
    f.paragraph(title, font=bold, size=16, leading=1.25, after=8)
    f.line(" and ".join(LIGATURE_AUTHORS), font=body, size=10.5)
    f.line(f"Laboratoire de Photochimie, Universite de Lyon. Catalysis Letters Today, {LIGATURE_YEAR}",
           font=body, size=9)
    for head, paras in _LIGATURE_SECTIONS:
        f.heading(head, font=bold, size=11.5)
        for text in paras:
            f.paragraph(text, font=body, size=10)
    f.heading("References", font=bold, size=11.5)
    for ref in _LIGATURE_REFERENCES:
        f.paragraph(ref, font=body, size=9)
    meta = _meta(LIGATURE_TITLE, LIGATURE_AUTHORS, LIGATURE_YEAR, "Catalysis Letters Today",
                 "photocatalysis; water splitting; quantum efficiency")
    return f.save(Path(outdir) / name, meta)


# ---------------------------------------------------------------------------
# 5. Chinese paper: perovskite solar cells

CHINESE_TITLE = "钙钛矿太阳能电池在湿热环境下的稳定性研究"
CHINESE_AUTHORS = ["王晓明", "李静", "陈志强"]
CHINESE_YEAR = 2023
CHINESE_REF_TOKENS = ["麒麟"]

_CHINESE_SECTIONS = [
    ("摘要", [
        "金属卤化物钙钛矿太阳能电池的光电转换效率已经超过百分之二十五，但器件在湿热环境下的稳定性仍然是产业化的主要障碍。"
        "本文比较了三种封装方案，并在八十五摄氏度、相对湿度百分之八十五的条件下进行了一千小时的加速老化试验。"
        "结果表明，采用原子层沉积氧化铝阻挡层与丁基橡胶边缘密封相结合的器件保持了初始效率的百分之九十二。",
    ]),
    ("一、引言", [
        "钙钛矿材料具有吸收系数高、载流子扩散长度长以及可溶液加工等优点，因此受到广泛关注。"
        "然而，水分子会与有机阳离子发生反应，使钙钛矿分解为碘化铅，从而导致器件性能迅速衰减。"
        "已有研究主要关注材料组分的优化，对封装结构在湿热条件下的作用缺乏系统比较。",
        "本研究制备了相同结构的器件，分别采用玻璃盖板封装、聚合物薄膜封装以及氧化铝阻挡层加边缘密封三种方案，"
        "并利用电流电压曲线和光致发光成像跟踪其老化过程。",
    ]),
    ("二、方法", [
        "器件结构为氧化铟锡玻璃、氧化锡电子传输层、钙钛矿吸收层、空穴传输层和金电极。"
        "钙钛矿薄膜采用一步旋涂法制备，并在一百摄氏度下退火十分钟。"
        "氧化铝阻挡层通过原子层沉积在八十摄氏度下生长，厚度为三十纳米。",
    ]),
    ("三、结果与讨论", [
        "玻璃盖板封装的器件在五百小时后效率下降到初始值的百分之六十一，聚合物薄膜封装的器件下降更快。"
        "光致发光成像显示，衰减首先出现在电池边缘，说明水汽主要沿侧向扩散进入器件。"
        "氧化铝阻挡层与边缘密封相结合，有效阻止了侧向水汽渗透，是提高湿热稳定性的关键。",
    ]),
    ("四、结论", [
        "合理的封装设计可以显著提高钙钛矿太阳能电池的湿热稳定性，其中边缘密封对抑制侧向水汽渗透尤为重要。",
    ]),
]
_CHINESE_REFERENCES = [
    "[1] 张伟，刘洋．麒麟型钙钛矿薄膜的制备与表征．化学学报，2019，77（3）：201-208．",
    "[2] 赵磊．光伏器件封装技术综述．材料导报，2021，35（6）：60-66．",
]


def make_chinese_paper(outdir, name="perovskite_stability_zh.pdf") -> Path:
    """Chinese paper set in PyMuPDF's built-in 'china-s' font, with the headings
    摘要, 一、引言, 二、方法, 三、结果与讨论, 四、结论 and 参考文献."""
    cjk = "china-s"
    f = Flow(A4)
    f.paragraph(CHINESE_TITLE, font=cjk, size=18, leading=1.3, align="center", after=8)
    f.line("，".join(CHINESE_AUTHORS), font=cjk, size=11, align="center")
    f.line(f"华东理工大学材料科学与工程学院，上海，{CHINESE_YEAR}年", font=cjk, size=9.5, align="center")
    f.space(8)
    for head, paras in _CHINESE_SECTIONS:
        f.heading(head, font=cjk, size=14)
        for text in paras:
            f.paragraph(text, font=cjk, size=10.5, leading=1.5, indent=21)
    f.heading("参考文献", font=cjk, size=14)
    for ref in _CHINESE_REFERENCES:
        f.paragraph(ref, font=cjk, size=9.5, leading=1.4)
    meta = _meta(CHINESE_TITLE, CHINESE_AUTHORS, CHINESE_YEAR, "材料导报", "钙钛矿；太阳能电池；稳定性")
    return f.save(Path(outdir) / name, meta)


# ---------------------------------------------------------------------------
# 6. encrypted and owner-password-only PDFs

ENCRYPTED_USER_PW = "kb-user-secret"
ENCRYPTED_OWNER_PW = "kb-owner-secret"


def _short_paper(title, authors, year, paragraphs, font="tiro", bold="tibo") -> Flow:
    f = Flow(A4)
    f.paragraph(title, font=bold, size=16, after=6)
    f.line(", ".join(authors), font=font, size=11)
    f.line(f"Proceedings of the Workshop on Sample Documents, {year}", font=font, size=9.5)
    for head, text in paragraphs:
        f.heading(head, font=bold)
        f.paragraph(text, font=font)
    return f


def make_encrypted_pdf(outdir, name="encrypted_user_password.pdf") -> Path:
    """AES-256 encrypted PDF that needs a user password to open."""
    f = _short_paper("Confidential Notes on Glacier Mass Balance", ["Erik Halvorsen"], 2017, [
        ("Abstract", "Glacier mass balance in the southern fjords was negative in each of the last ten years, "
                     "with the strongest losses below 900 metres of altitude."),
    ])
    return f.save(Path(outdir) / name, _meta("Confidential Notes on Glacier Mass Balance", ["Erik Halvorsen"], 2017),
                  encryption=pymupdf.PDF_ENCRYPT_AES_256, owner_pw=ENCRYPTED_OWNER_PW, user_pw=ENCRYPTED_USER_PW)


OWNER_ONLY_TITLE = "Seasonal Migration of Arctic Terns Tracked with Geolocators"


def make_owner_only_pdf(outdir, name="owner_password_only.pdf") -> Path:
    """AES-256 encrypted PDF with an owner password only (empty user password,
    copying not permitted): any reader opens it without a password."""
    f = _short_paper(OWNER_ONLY_TITLE, ["Freya Nilsen", "Oskar Berg"], 2016, [
        ("Abstract", "Light-level geolocators attached to forty arctic terns recorded a round-trip migration of "
                     "about 71000 kilometres between the breeding colony and the Weddell Sea."),
        ("1 Introduction", "Arctic terns undertake the longest known annual migration of any animal. Tracking "
                           "devices light enough for these small seabirds became available only recently."),
    ])
    return f.save(Path(outdir) / name, _meta(OWNER_ONLY_TITLE, ["Freya Nilsen", "Oskar Berg"], 2016),
                  encryption=pymupdf.PDF_ENCRYPT_AES_256, owner_pw=ENCRYPTED_OWNER_PW, user_pw="",
                  permissions=pymupdf.PDF_PERM_PRINT | pymupdf.PDF_PERM_ACCESSIBILITY)


# ---------------------------------------------------------------------------
# 7. broken and textless PDFs

def make_empty_pdf(outdir, name="empty.pdf") -> Path:
    """A zero-byte file with a .pdf name."""
    path = Path(outdir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def make_corrupt_pdf(outdir, name="corrupt.pdf", seed=1234) -> Path:
    """A %PDF header followed by random bytes: no usable page."""
    rng = random.Random(seed)
    junk = bytes(rng.randrange(256) for _ in range(4096))
    path = Path(outdir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n" + junk.replace(b"obj", b"xbj").replace(b"trailer", b"xxxxxxx"))
    return path


def make_scanned_pdf(outdir, name="scanned_no_text.pdf") -> Path:
    """Image-only PDF: a page of text is rendered to a bitmap and that bitmap is
    the only content of the output page, so there is no text layer."""
    src = _short_paper("Field Notes on Alpine Lichen Growth", ["Nora Keller"], 2015, [
        ("Abstract", "Lichen thalli on granite boulders above 2400 metres grew by less than one millimetre per "
                     "year over two decades of repeated photography."),
    ])
    tmp = Path(outdir) / ".scan_source.pdf"
    src.save(tmp)
    with pymupdf.open(tmp) as sdoc:
        pix = sdoc[0].get_pixmap(dpi=110, colorspace=pymupdf.csGRAY)
    tmp.unlink()
    doc = pymupdf.open()
    page = doc.new_page(width=A4[0], height=A4[1])
    page.insert_image(page.rect, pixmap=pix)
    doc.set_metadata({"creator": "kb-rag sample scanner", "producer": "PyMuPDF"})
    return _save(doc, Path(outdir) / name)


# ---------------------------------------------------------------------------
# 8. DOCX, TXT (gb18030) and Markdown

DOCX_TITLE = "Thermal Tolerance of Reef-Building Corals During Marine Heatwaves"
DOCX_AUTHORS = ["Laura Schmidt", "Tomas Novak"]
DOCX_YEAR = 2018
DOCX_REF_TOKENS = ["manateereference"]


def make_docx(outdir, name="coral_heatwaves.docx") -> Path:
    """Word document with Title, Heading 1 and Heading 2 styles and core properties."""
    import docx  # python-docx

    d = docx.Document()
    d.core_properties.title = DOCX_TITLE
    d.core_properties.author = "; ".join(DOCX_AUTHORS)
    d.core_properties.created = _dt.datetime(DOCX_YEAR, 6, 1, 12, 0, 0)
    d.core_properties.modified = _dt.datetime(DOCX_YEAR, 6, 1, 12, 0, 0)
    d.add_heading(DOCX_TITLE, level=0)
    d.add_paragraph(", ".join(DOCX_AUTHORS) + f" - Marine Ecology Reports, {DOCX_YEAR}")
    d.add_heading("Abstract", level=1)
    d.add_paragraph(
        "Marine heatwaves have caused repeated mass bleaching of reef-building corals. We surveyed 48 reef "
        "sites before and after the 2016 heatwave and found that colonies with a history of moderate heat "
        "exposure bleached less severely and recovered their symbionts within six months.")
    d.add_heading("Introduction", level=1)
    d.add_paragraph(
        "Coral bleaching occurs when the symbiosis between the coral host and its photosynthetic algae breaks "
        "down under thermal stress. Whether corals can acclimatise to warmer water within a few years is "
        "central to predictions of reef persistence.")
    d.add_heading("Methods", level=1)
    d.add_heading("Field sites", level=2)
    d.add_paragraph(
        "The field sites were 48 fore-reef slopes between 3 and 12 metres depth along a gradient of summer "
        "temperature variability. Loggers recorded water temperature every 30 minutes.")
    d.add_heading("Bleaching surveys", level=2)
    d.add_paragraph(
        "Divers photographed fixed quadrats and scored each colony as healthy, pale, bleached or dead. "
        "Symbiont density was measured in tissue cores from tagged colonies.")
    d.add_heading("Results", level=1)
    d.add_paragraph(
        "Sites with high prior temperature variability showed 35 percent less bleaching at the same degree "
        "heating weeks. Recovery of symbiont density was complete after six months at those sites.")
    d.add_heading("Discussion", level=1)
    d.add_paragraph(
        "Prior exposure to variable temperatures appears to prime the corals for heat stress, which suggests "
        "that thermally variable reefs may act as refuges during future heatwaves.")
    d.add_heading("References", level=1)
    d.add_paragraph("[1] R. Alvarez, Manateereference of bleaching thresholds, Coral Sci. 2 (2014) 1-10.")
    path = Path(outdir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    d.save(str(path))
    return path


TXT_REF_TOKENS = ["貔貅"]
TXT_TEXT = """水稻耐盐性的遗传基础研究进展

作者：周建国，孙丽

摘要

土壤盐渍化是限制水稻产量的重要非生物胁迫之一。本文综述了水稻耐盐相关基因的定位与克隆进展，重点讨论了离子转运蛋白在维持细胞钠钾平衡中的作用。

一、引言

全球约有五分之一的灌溉农田受到盐渍化影响。水稻对盐胁迫较为敏感，尤其在苗期和生殖生长期。培育耐盐水稻品种是利用盐碱地的有效途径。

二、耐盐基因

高亲和钾转运蛋白基因能够将钠离子从木质部中卸载，从而降低地上部的钠含量。多个数量性状位点已被精细定位，为分子标记辅助育种提供了基础。

参考文献

[1] 吴强．貔貅品种耐盐性鉴定方法．作物学报，2012，38（5）：1-9．
"""


def make_gb18030_txt(outdir, name="rice_salt_tolerance_gb18030.txt") -> Path:
    """Chinese plain text encoded in GB18030 (not UTF-8)."""
    path = Path(outdir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(TXT_TEXT.encode("gb18030"))
    return path


MD_TITLE = "Sparse Attention Improves Long-Document Retrieval"
MD_REF_TOKENS = ["ocelotreference"]
MD_TEXT = """# Sparse Attention Improves Long-Document Retrieval

Priya Raman, Jonas Weber (2024)

## Abstract

Transformer encoders struggle with documents longer than a few thousand tokens because the cost of full
attention grows quadratically. We show that block-sparse attention with a few global tokens retrieves long
scientific articles as accurately as full attention at a fifth of the memory.

## 1 Introduction

Dense retrievers usually truncate documents to 512 tokens, which discards most of a scientific article.
Sparse attention patterns make longer inputs affordable, but their effect on retrieval quality is unclear.

## 2 Method

### 2.1 Block-sparse attention

Each token attends to its own block of 64 tokens, to the neighbouring blocks and to 16 global tokens that
summarise the section headings of the article.

## 3 Experiments

On a benchmark of 20000 full-text articles, recall at 10 improved from 0.61 with truncated inputs to 0.74
with sparse attention over the complete text.

## References

1. A. Smith, Ocelotreference of efficient transformers, Machine Learning Notes 3 (2021) 1-12.
"""


def make_markdown(outdir, name="sparse_attention.md") -> Path:
    """Markdown paper with # / ## / ### headings."""
    path = Path(outdir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(MD_TEXT, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# 8b. printed page labels (roman front matter, arabic body)

LABELS_TITLE = "Winter Plumage Moult in Rock Ptarmigan"
LABELS_PAGES = {  # physical page -> (printed label, sentence unique to that page)
    1: ("i", "This report on rock ptarmigan was prepared for the alpine wildlife survey committee."),
    2: ("ii", "The preface thanks the volunteer observers who counted ptarmigan flocks on snowfields."),
    3: ("1", "Ptarmigan replace their brown summer feathers with white winter plumage in October."),
    4: ("2", "Moult timing shifted by nine days earlier at sites where snow arrived later in autumn."),
}


def make_page_labels_paper(outdir, name="ptarmigan_page_labels.pdf") -> Path:
    """Four pages whose printed labels are i, ii, 1, 2 (PDF page labels)."""
    f = Flow(A4)
    f.footer_labels = [label for label, _ in LABELS_PAGES.values()]
    for pno, (_label, sentence) in LABELS_PAGES.items():
        if pno > 1:
            f.new_page()
        if pno == 1:
            f.paragraph(LABELS_TITLE, font="tibo", size=16, after=6)
            f.line("Greta Halvorsen", size=11)
        f.heading({1: "Abstract", 2: "Preface", 3: "1 Introduction", 4: "2 Results"}[pno])
        f.paragraph(sentence + " " + " ".join([sentence] * 2))
    labels = [{"startpage": 0, "prefix": "", "style": "r", "firstpagenum": 1},
              {"startpage": 2, "prefix": "", "style": "D", "firstpagenum": 1}]
    return f.save(Path(outdir) / name, _meta(LABELS_TITLE, ["Greta Halvorsen"], 2012), page_labels=labels)


# ---------------------------------------------------------------------------
# 9. filler papers: many distinct multi-page documents (for bulk / crash tests)

_FILLER_TOPICS = ["soil nitrogen cycling", "wind turbine wakes", "bird song learning", "concrete carbonation",
                  "exoplanet transits", "tea plant genetics", "river sediment transport", "enzyme kinetics",
                  "sea ice albedo", "bacterial biofilms", "quantum dot emitters", "urban heat islands",
                  "honeybee navigation", "steel fatigue", "peatland methane", "volcanic ash dispersal"]
_FILLER_SUBJECTS = ["The measured rate", "Our model", "The control group", "Each sample", "The field campaign",
                    "A second experiment", "The simulation", "The annual mean", "This correlation", "The sensor array"]
_FILLER_VERBS = ["increased with", "depended weakly on", "was insensitive to", "scaled linearly with",
                 "decreased sharply with", "remained stable under", "was dominated by", "responded quickly to"]
_FILLER_OBJECTS = ["temperature", "the sampling depth", "seasonal forcing", "the applied load", "moisture content",
                   "the grain size", "light intensity", "the initial concentration", "wind speed",
                   "the pH of the medium"]
_FILLER_TAILS = ["in all replicates", "within the measurement uncertainty", "at the northern sites",
                 "after the first week", "for the larger specimens", "during the night-time measurements",
                 "across the whole range studied", "in agreement with earlier reports"]


def make_filler_paper(outdir, index: int, pages: int = 3, name: str | None = None) -> Path:
    """A distinct, deterministic multi-page paper (seeded by index) with
    headings, paragraphs and references; its unique word is f'specimen{index:03d}'."""
    rng = random.Random(1000 + index)
    topic = _FILLER_TOPICS[index % len(_FILLER_TOPICS)]
    token = f"specimen{index:03d}"
    title = f"Observations on {topic.title()}: Study {index}"
    authors = [f"{rng.choice(['Ana', 'Ben', 'Chloe', 'Dev', 'Eli', 'Fay'])} "
               f"{rng.choice(['Ortega', 'Meyer', 'Kowalski', 'Ng', 'Sato', 'Haas'])}" for _ in range(2)]
    year = 2000 + index % 24

    def sentence():
        return (f"{rng.choice(_FILLER_SUBJECTS)} for {topic} {rng.choice(_FILLER_VERBS)} "
                f"{rng.choice(_FILLER_OBJECTS)} {rng.choice(_FILLER_TAILS)}.")

    def para(k=6):
        return " ".join(sentence() for _ in range(k))

    f = Flow(A4)
    f.paragraph(title, font="tibo", size=16, after=6)
    f.line(" and ".join(authors), size=11)
    f.line(f"Bulletin of Sample Sciences {index} ({year})", size=9.5)
    f.heading("Abstract")
    f.paragraph(f"We report {token} measurements on {topic}. " + para(4))
    sections = ["1 Introduction", "2 Methods", "3 Results", "4 Discussion"]
    per_section = max(2, pages * 2)
    for head in sections:
        f.heading(head)
        for _ in range(per_section):
            f.paragraph(para())
    f.heading("References")
    for i in range(1, 4):
        f.paragraph(f"[{i}] {rng.choice(authors)}, Earlier notes on {topic}, Sample Lett. {i} ({year - i}) "
                    f"{i}-{i + 9}.",
                    size=9.5, after=2)
    return f.save(Path(outdir) / (name or f"filler_{index:03d}.pdf"), _meta(title, authors, year))


# ---------------------------------------------------------------------------
# 10. provenance papers: known DOIs, titles, authors, references and citation markers
#
# Used by tests/test_provenance.py. Each constant below is what the paper prints,
# so a test can compare the engine's metadata and citation links against it.

def _rich_runs(text: str) -> list[list[tuple[str, bool]]]:
    """Words of text, each a list of (piece, raised): 'graphene^{1,2}' is [('graphene', False), ('1,2', True)]."""
    words = []
    for word in text.split():
        pieces = [(m.group(1), True) if m.group(1) is not None else (m.group(2), False)
                  for m in re.finditer(r"\^\{([^}]*)\}|([^^]+)", word)]
        words.append(pieces)
    return words


def rich_paragraph(f: Flow, text: str, font="tiro", size=10.5, leading=1.3, sup_size=6.0, rise=3.0,
                   after=None, align="left"):
    """A wrapped paragraph in which '^{...}' is set as raised, smaller text (superscript digits
    as journals set citations, exponents and affiliation marks): size sup_size, baseline raised by rise."""
    words = _rich_runs(text)
    space = _width(font, " ", size)

    def word_width(pieces):
        return sum(_width(font, t, sup_size if up else size) for t, up in pieces)

    while words:
        line, used = [], 0.0
        while words:
            w = word_width(words[0]) + (space if line else 0.0)
            if line and used + w > f.width:
                break
            line.append(words.pop(0))
            used += w
        step = size * leading
        if f.y + step > f.region[3] + 0.01:
            f.advance()
        runs: list[list] = []          # [text, raised] with the spaces inside the normal runs
        for i, pieces in enumerate(line):
            for j, (piece, up) in enumerate(pieces):
                piece = (" " if i and j == 0 else "") + piece
                if up and piece.startswith(" "):
                    runs.append([" ", False])
                    piece = piece[1:]
                if runs and runs[-1][1] == up:
                    runs[-1][0] += piece
                else:
                    runs.append([piece, up])
        x = f.region[0] + ((f.width - used) / 2 if align == "center" else 0.0)
        baseline = f.y + size
        for piece, up in runs:
            fs = sup_size if up else size
            f.items.append(dict(kind="text", page=f.page, col=f.region[4], ncols=f.region[5], x=x,
                                y=baseline - (rise if up else 0.0), text=piece, font=font, size=fs))
            x += _width(font, piece, fs)
        f.y += step
    f.space(size * 0.55 if after is None else after)


def _plain_meta(creation_year: int | None = None, **fields) -> dict:
    """PDF metadata with only what is given (no title or author unless passed)."""
    meta = {"creator": "kb-rag examples/sample_papers.py", "producer": "PyMuPDF"}
    if creation_year:
        meta["creationDate"] = meta["modDate"] = f"D:{creation_year}0601120000Z"
    meta.update(fields)
    return meta


# -- paper A cites paper B (reference [2]) ----------------------------------------

CITING_TITLE = "Citation Graphs of Sample Libraries Reveal Hidden Provenance Chains"
CITING_AUTHORS = ["Alice M. Chen", "Rahul Verma"]
CITING_DOI = "10.5555/kbrag.2024.001"
CITING_YEAR = 2024
CITING_TOKEN_1 = "lemurprovenance"       # only in the passage citing [1]
CITING_TOKEN_23 = "marmosetlineage"      # only in the passage citing [2,3]
CITING_TOKEN_456 = "tapirgenealogy"      # only in the passage citing [4–6]
CITING_REF_TOKEN = "capybarareference"   # only in reference entry [5]

CITED_TITLE = "Reference Parsing for Scholarly Sample Libraries"
CITED_AUTHORS = ["Bola Okafor", "Lucia Santos"]
CITED_DOI = "10.5555/kbrag.2023.042"
CITED_YEAR = 2023

ARXIV_TITLE = "Tokenizer Drift in Multilingual Sample Corpora"
ARXIV_AUTHORS = ["Daniel Novak", "Mei Tanaka"]
ARXIV_ID = "2301.01234"
ARXIV_STAMP = f"arXiv:{ARXIV_ID}v2 [cs.CL] 5 Jan 2023"
ARXIV_DOI = f"10.48550/arxiv.{ARXIV_ID}"
ARXIV_YEAR = 2023

# [6] cites the journal-banner paper below by its authors and year only (APS style, no title, no DOI)
BANNER_INITIALS = ["I. Solberg", "P. Dubois"]

CITING_REFERENCES = [
    "[1] P. Lindgren, \u201cProvenance records in digital archives,\u201d Arch. Sci. Rev. 4, 1 (2012).",
    f"[2] B. Okafor and L. Santos, \u201c{CITED_TITLE},\u201d J. Test. Libr. 5, 10 (2023), "
    f"https://doi.org/{CITED_DOI}.",
    "[3] R. Ito and J. Park, \u201cCritical nodes of citation networks,\u201d Phys. Chem. Notes 12, 301 (2017), "
    "doi:10.5555/notinlibrary.2017.301.",
    f"[4] D. Novak and M. Tanaka, \u201c{ARXIV_TITLE},\u201d arXiv preprint (2023).",
    f"[5] K. Svensson, \u201cThe {CITING_REF_TOKEN.capitalize()} of library catalogues,\u201d "
    "Libr. Hist. 19, 144 (2018).",
    f"[6] {BANNER_INITIALS[0]} and {BANNER_INITIALS[1]}, Metrologia Notes 59, 12 (2022).",
]


def make_citing_paper(outdir, name="citing_paper_a.pdf") -> Path:
    """Paper A: bold title, author line, a DOI and dates on page 1, bracket markers [1], [2,3] and
    [4\u20136] in the body and a References section of six numbered entries; [2] is paper B (by DOI and
    title), [4] is the arXiv paper (by title, no DOI), [6] the journal-banner paper (by first author and
    year only), [3] has a DOI that no library paper carries."""
    f = Flow(A4)
    f.paragraph(CITING_TITLE, font="tibo", size=17, leading=1.25, after=8)
    f.line(", ".join(CITING_AUTHORS), size=11)
    f.line("Department of Information Science, Northfield Institute of Technology, Leeds, UK", size=9.5)
    f.line(f"https://doi.org/{CITING_DOI}", size=9.5)
    f.line("Received 3 March 2024; published 12 June 2024", size=9.5)
    f.heading("Abstract", before=12)
    f.paragraph("Reference lists connect every paper to the works it builds on, yet most personal libraries "
                "store papers as isolated files. We link the citation markers inside each passage to the "
                "entries of the reference list and mark the cited works that the library already holds.",
                size=10)
    f.heading("1 Introduction")
    f.paragraph(f"Provenance tracking in digital archives has a long history, and the {CITING_TOKEN_1} "
                "records kept by early archivists already listed the sources of every catalogue entry [1]. "
                "Modern libraries lost much of this information when catalogues moved to databases.")
    f.paragraph(f"Citation graphs built from parsed reference lists connect each {CITING_TOKEN_23} claim to its "
                "sources, and the parsers that build them have become accurate enough for personal "
                "collections of a few thousand papers [2,3]. Errors remain where reference styles mix.")
    f.heading("2 Methods")
    f.paragraph(f"We follow the {CITING_TOKEN_456} approach of earlier tokenizer and catalogue studies, "
                "in which every marker is resolved against the numbered list before it is stored, and "
                "shelf marks are kept as printed [4\u20136]. Ranges are expanded into their members.")
    f.heading("3 Results")
    f.paragraph("Across the test collection, nine out of ten markers resolved to a parsed reference entry, "
                "and the cited works found in the library were matched by their identifiers or titles.")
    f.heading("References")
    for ref in CITING_REFERENCES:
        f.paragraph(ref, size=9.5, after=2)
    return f.save(Path(outdir) / name, _plain_meta(CITING_YEAR))


def make_cited_paper(outdir, name="cited_paper_b.pdf") -> Path:
    """Paper B: the work that paper A cites as [2] (same title and DOI)."""
    f = Flow(A4)
    f.paragraph(CITED_TITLE, font="tibo", size=17, leading=1.25, after=8)
    f.line(", ".join(CITED_AUTHORS), size=11)
    f.line("School of Computing, Southbridge University, Bristol, UK", size=9.5)
    f.line(f"https://doi.org/{CITED_DOI}", size=9.5)
    f.line("Received 2 January 2023; published 20 May 2023", size=9.5)
    f.heading("Abstract", before=12)
    f.paragraph("We describe a lenient parser for the reference lists of scholarly papers that reads numbered, "
                "author-year and superscript styles and extracts the identifiers of each cited work.", size=10)
    f.heading("1 Introduction")
    f.paragraph("Reference lists are written in hundreds of styles. A parser for a personal library must "
                "accept all of them and fail gracefully on the rest, because a wrong link is worse than none.")
    f.heading("2 Evaluation")
    f.paragraph("On a hand-labelled sample of two hundred entries the parser found the identifier of "
                "ninety-six percent of the entries that print one, and the title of nine entries in ten.")
    return f.save(Path(outdir) / name, _plain_meta(CITED_YEAR))


def make_arxiv_only_paper(outdir, name="tokenizer_drift.pdf") -> Path:
    """A preprint whose only identifier is the arXiv stamp on page 1 (no DOI printed); the file's
    creation date (2024) is later than the arXiv year (2023)."""
    f = Flow(LETTER, margins=(54, 54, 60, 66))
    f.line(ARXIV_STAMP, size=8)
    f.space(6)
    f.paragraph(ARXIV_TITLE, font="tibo", size=17, leading=1.25, after=8, align="center")
    f.line(", ".join(ARXIV_AUTHORS), size=11, align="center")
    f.line("Institute for Language Data, Eastfield University, Graz, Austria", size=9, align="center")
    f.heading("Abstract", before=12)
    f.paragraph("Subword vocabularies trained on one language mixture drift when the mixture changes. We "
                "measure the drift on multilingual sample corpora and show how it affects retrieval.", size=10)
    f.heading("1 Introduction")
    f.paragraph("Tokenizers are trained once and used for years, while the corpora they segment keep "
                "changing. The resulting drift lengthens sequences and harms rare languages most.")
    f.heading("2 Results")
    f.paragraph("Sequence length grew by eleven percent for the three rarest languages of the sample corpus "
                "and by less than two percent for the common ones over two years of new data.")
    return f.save(Path(outdir) / name, _plain_meta(2024))


# -- metadata ladder edge cases ------------------------------------------------------

JUNK_META_TITLE = "Microsoft Word - draft3.docx"
JUNK_PAGE_TITLE = "Seasonal Variation of Sample Humidity in Reading Rooms"


def make_junk_metadata_paper(outdir, name="junk_metadata.pdf", page_title: bool = True) -> Path:
    """PDF metadata title 'Microsoft Word - draft3.docx'. With page_title, page 1 prints a bold title
    (JUNK_PAGE_TITLE); without it, every line of page 1 is set in the body font and size."""
    f = Flow(A4)
    if page_title:
        f.paragraph(JUNK_PAGE_TITLE, font="tibo", size=16, after=6)
        f.line("Greta Halvorsen, Tomas Berg", size=11)
    f.heading("Abstract", before=8)
    f.paragraph("Relative humidity in the reading rooms of three libraries followed the outdoor dew point "
                "with a lag of about two days and stayed within the conservation range in every season.")
    f.heading("1 Introduction")
    f.paragraph("Paper and parchment respond to humidity by swelling and shrinking, and repeated cycles "
                "damage bindings. Reading rooms are harder to control than closed stacks because of visitors.")
    f.heading("2 Measurements")
    f.paragraph("Loggers recorded temperature and relative humidity every ten minutes for two years at "
                "desk height in each room, and outdoor values were taken from the nearest weather station.")
    return f.save(Path(outdir) / name, _plain_meta(2020, title=JUNK_META_TITLE, author="jsmith"))


BANNER_TEXT = "Journal of Applied Sample Physics"
BANNER_LINE = f"{BANNER_TEXT} 12 (2022) 101\u2013110"
BANNER_PAPER_TITLE = "Thermal Drift of Reference Weights in Calibration Laboratories"
BANNER_AUTHORS = ["Ingrid Solberg", "Pierre Dubois"]
BANNER_YEAR = 2022


def make_banner_paper(outdir, name="journal_banner.pdf") -> Path:
    """The journal's name is set in the top margin of page 1 in a larger font than the title
    (no title in the PDF metadata); the volume line below it prints the year."""
    f = Flow(A4, margins=(66, 66, 90, 72))
    x = (f.w - _width("tibo", BANNER_TEXT, 19)) / 2
    f.items.append(dict(kind="text", page=0, col=0, ncols=1, x=x, y=42, text=BANNER_TEXT, font="tibo", size=19))
    x = (f.w - _width("tiro", BANNER_LINE, 8.5)) / 2
    f.items.append(dict(kind="text", page=0, col=0, ncols=1, x=x, y=58, text=BANNER_LINE, font="tiro", size=8.5))
    f.paragraph(BANNER_PAPER_TITLE, font="tibo", size=16, after=6)
    f.line(", ".join(BANNER_AUTHORS), size=11)
    f.line("National Metrology Office, Oslo, Norway", size=9.5)
    f.heading("Abstract", before=8)
    f.paragraph("Stainless steel reference weights gained up to three micrograms per year through surface "
                "contamination, and the gain depended on the laboratory air more than on handling.")
    f.heading("1 Introduction")
    f.paragraph("Mass calibration relies on reference weights whose values must be stable between "
                "recalibrations. Surface layers of water and hydrocarbons change the mass measurably.")
    f.heading("2 Results")
    f.paragraph("Weights stored in laboratories with filtered air drifted by less than one microgram per year, "
                "while weights in rooms without filtration gained three micrograms per year.")
    return f.save(Path(outdir) / name, _plain_meta(2023))


ZH_TITLE = "基于引文网络的样本文献溯源方法研究"
ZH_AUTHORS = ["王晓明", "李静", "陈志强"]
ZH_YEAR = 2022
ZH_JOURNAL_LINE = "情报学报 2022年 第41卷 第5期"


def make_chinese_meta_paper(outdir, name="citation_tracing_zh.pdf") -> Path:
    """Chinese paper: a journal line, a large title and an author line (names separated by '，'),
    body sections with [1] markers, and a 参考文献 list; the PDF metadata holds no title or author."""
    cjk = "china-s"
    f = Flow(A4)
    f.line(ZH_JOURNAL_LINE, font=cjk, size=9)
    f.space(6)
    f.paragraph(ZH_TITLE, font=cjk, size=18, leading=1.3, align="center", after=8)
    f.line("，".join(ZH_AUTHORS), font=cjk, size=11, align="center")
    f.line("华东理工大学信息科学与工程学院，上海 200237", font=cjk, size=9.5, align="center")
    f.space(8)
    sections = [
        ("摘要", "文献溯源要求把论文中的每一处引用标注与参考文献表中的条目对应起来。本文提出一种基于引文网络的方法，"
                 "在个人文献库中自动识别引用标注并标记库中已有的被引文献。"),
        ("一、引言", "个人文献库通常只保存孤立的文件，论文之间的引用关系没有被记录[1]。"
                    "当研究人员需要核对某个结论的来源时，只能手工查找参考文献。"),
        ("二、方法", "我们首先解析参考文献表，得到每个条目的编号、作者、题名和年份，"
                    "然后在正文中识别方括号形式的引用标注，"
                    "并把标注与条目相连[2]。"),
    ]
    for head, text in sections:
        f.heading(head, font=cjk, size=14)
        f.paragraph(text, font=cjk, size=10.5, leading=1.5, indent=21)
    f.heading("参考文献", font=cjk, size=14)
    for ref in ("[1] 张伟，刘洋．个人文献库的组织与管理．图书情报工作，2019，63（3）：20-28．",
                "[2] 赵磊．参考文献自动解析技术综述．情报学报，2021，40（6）：60-66．",
                "[3] 孙丽．引文网络分析方法．情报科学，2020，38（2）：11-17．"):
        f.paragraph(ref, font=cjk, size=9.5, leading=1.4)
    return f.save(Path(outdir) / name, _plain_meta(2023))


# -- superscript citations (Nature style) -------------------------------------------------

SUPER_TITLE = "Twisted Bilayer Graphene Hosts Correlated Sample States"
SUPER_AUTHORS = ["Alice M. Chen", "Rahul Verma"]
SUPER_TOKEN = "okapisuperlattice"      # only in the passage with graphene^{1,2}
SUPER_EXP_TOKEN = "dugongdensity"      # only in the passage with 10^{5} and cm^{2}
SUPER_REFERENCES = [
    "1. Lindgren, P. & Okoro, T. Scaling of graphene production. Carbon Rev. 3, 1\u201322 (2015).",
    "2. Haddad, M. Low-pressure growth of graphene. Surf. Sci. Lett. 41, 88\u201395 (2016).",
    "3. Ito, R. & Park, J. Twisted bilayers near the magic angle. Phys. Chem. Notes 12, 301\u2013310 (2017).",
    "4. Moreau, A. Raman fingerprints of grain boundaries. J. Raman Stud. 7, 55\u201361 (2018).",
    "5. Svensson, K. Hall mobility across domain boundaries. Appl. Electron. 19, 144\u2013150 (2018).",
    "6. Kim, H. Correlated states in moire superlattices. Quantum Mater. Lett. 2, 9\u201318 (2020).",
]


def make_superscript_paper(outdir, name="superscript_citations.pdf", references: bool = True) -> Path:
    """Nature-style paper whose citations are raised, smaller digits after words ('graphene^1,2'),
    with raised affiliation marks after the author names, an exponent ('10^5') and a unit power
    ('cm^2') that are not citations. references=False leaves out the numbered reference list."""
    f = Flow(A4)
    f.paragraph(SUPER_TITLE, font="tibo", size=17, leading=1.25, after=8)
    rich_paragraph(f, f"{SUPER_AUTHORS[0]}^{{1}}, {SUPER_AUTHORS[1]}^{{2}}", size=11, after=2)
    rich_paragraph(f, "^{1}Department of Physics, Northfield Institute of Technology, Leeds, UK", size=9, after=1)
    rich_paragraph(f, "^{2}School of Engineering, Southbridge University, Bristol, UK", size=9, after=8)
    f.heading("Abstract")
    f.paragraph("Two graphene layers stacked with a small twist form a moire superlattice whose flat bands "
                "favour correlated electronic states. We grow such bilayers directly on copper and map "
                "their correlated states by transport measurements at low temperature.", size=10)
    f.heading("Introduction")
    rich_paragraph(f, f"Large-area graphene^{{1,2}} is now grown routinely on copper foils, and the {SUPER_TOKEN} "
                      "of twisted bilayers^{3} has become a model system for correlated electrons. Grain "
                      "boundaries^{4\u20136} limit the size of the devices that can be made from grown films.")
    rich_paragraph(f, f"In our films the {SUPER_EXP_TOKEN} of nuclei fell from 10^{{5}} to 10^{{3}} per cm^{{2}} "
                      "after a short oxygen anneal, so that single domains spanned whole devices and every "
                      "device could be measured without a grain boundary in its channel.")
    f.heading("Results")
    f.paragraph("Resistance peaks appeared at half filling of the flat bands in four of the five devices, "
                "and their temperature dependence followed an activated law with a gap of about one meV.")
    if references:
        f.heading("References")
        for ref in SUPER_REFERENCES:
            f.paragraph(ref, size=9, after=2)
    return f.save(Path(outdir) / name, _plain_meta(2021))


# -- headingless reference list (APS style) --------------------------------------------------

APS_TITLE = "Spin Relaxation in Sample Quantum Wells at Low Temperature"
APS_BODY_TOKEN = "ibexquantum"          # only in the passage citing [1] and [2,3]
APS_REF_TOKEN = "wolverinecitation"     # only in reference entry [3]
APS_REFERENCES = [
    "[1] A. Mahler and B. Roth, Phys. Rev. B 61, 3456 (2000).",
    "[2] C. Ferreira, J. Appl. Phys. 95, 1122 (2004).",
    f"[3] D. Lund, {APS_REF_TOKEN.capitalize()} of spin echoes, Phys. Rev. Lett. 99, 207201 (2007).",
    "[4] E. Varga and F. Sousa, Appl. Phys. Lett. 88, 042101 (2006).",
    "[5] G. Brandt, Phys. Rev. B 80, 125310 (2009).",
]


def make_aps_paper(outdir, name="aps_headingless.pdf") -> Path:
    """APS-style paper: numbered [1] ... [5] entries at the end with no References heading."""
    f = Flow(A4)
    f.paragraph(APS_TITLE, font="tibo", size=16, after=6)
    f.line("Karl Weber and Nina Holm", size=11)
    f.line("Physics Department, Westbrook University, Aarhus, Denmark", size=9.5)
    f.heading("Abstract", before=8)
    f.paragraph("We measure the spin relaxation time of electrons in sample quantum wells between two and "
                "forty kelvin and find that it is limited by the Dyakonov-Perel mechanism above ten kelvin.")
    f.heading("I. INTRODUCTION")
    f.paragraph(f"Spin relaxation in semiconductor quantum wells has been studied for decades [1]. The "
                f"{APS_BODY_TOKEN} experiments on narrow wells showed that the relaxation slows down when the "
                "confinement increases [2,3], but the role of the interface roughness remained open.")
    f.paragraph("Optical orientation allows one to prepare a spin population and to follow its decay in "
                "time with a delayed probe pulse, which we use here on a set of wells of different widths [4].")
    f.heading("II. RESULTS")
    f.paragraph("The relaxation time fell from two nanoseconds at two kelvin to a few hundred picoseconds at "
                "forty kelvin, in agreement with the motional narrowing expected above ten kelvin [5].")
    f.paragraph("The dependence on the well width followed the cube of the confinement energy, which "
                "identifies the Dyakonov-Perel mechanism as the dominant relaxation channel in all samples.")
    f.space(10)
    for ref in APS_REFERENCES:
        f.paragraph(ref, size=9, after=1)
    return f.save(Path(outdir) / name, _plain_meta(2010))


# -- author-year citations ------------------------------------------------------------------

AUTHOR_YEAR_TITLE = "Reading Habits and Catalogue Use in Sample Libraries"
AUTHOR_YEAR_TOKEN = "lynxcatalogue"     # only in the passage with both citations
AUTHOR_YEAR_REFERENCES = [
    "Adams, R. (2008). Catalogues in transition. Library Quarterly, 12, 45\u201360.",
    "Brown, A., & Clark, D. (2015). Shelf order and browsing. Journal of Reading Studies, 4, 1\u20139.",
    "Brown, C., & Davis, E. (2015). Browsing without shelves. Information Review, 9, 88\u201397.",
    "Smith, J. A., Jones, B., & Lee, C. (2010). Reading habits of library users. "
    "Library Science Review, 7, 10\u201325.",
]
AUTHOR_YEAR_SMITH = 4      # position of the Smith 2010 entry in the list
AUTHOR_YEAR_SECOND_SMITH = ("Smith, K., & Young, T. (2010). Quiet rooms and loud shelves. "
                            "Reading Research, 2, 5\u201319.")


def make_author_year_paper(outdir, name="author_year.pdf", ambiguous: bool = False) -> Path:
    """Author-year citations: '(Smith et al., 2010)' matches one entry, '(Brown et al., 2015)' two.
    ambiguous=True adds a second Smith 2010 entry, so that the Smith citation matches two entries too."""
    f = Flow(A4)
    f.paragraph(AUTHOR_YEAR_TITLE, font="tibo", size=16, after=6)
    f.line("Helena Fischer, Marco Rossi", size=11)
    f.line("Faculty of Library Science, Lakeside University, Zurich, Switzerland", size=9.5)
    f.heading("Abstract", before=8)
    f.paragraph("We observed how readers in three libraries find books and compare it with what earlier "
                "surveys reported about the role of the catalogue.")
    f.heading("1 Introduction")
    f.paragraph(f"Earlier surveys of reading habits (Smith et al., 2010) and of shelf order (Brown et al., 2015) "
                f"disagree about the role of the catalogue in {AUTHOR_YEAR_TOKEN} studies, and neither "
                "observed readers directly in the reading rooms.")
    f.heading("2 Observations")
    f.paragraph("Two thirds of the readers went to the shelves without consulting the catalogue, and most of "
                "them browsed neighbouring books before choosing one to borrow.")
    f.heading("References")
    refs = AUTHOR_YEAR_REFERENCES + ([AUTHOR_YEAR_SECOND_SMITH] if ambiguous else [])
    for ref in refs:
        f.paragraph(ref, size=9.5, after=3)
    return f.save(Path(outdir) / name, _plain_meta(2019))


# -- many citations in one passage ---------------------------------------------------------

MANY_TOKEN = "quetzalsurvey"
MANY_REFERENCE_COUNT = 11


def make_many_citations_paper(outdir, name="many_citations.pdf") -> Path:
    """One passage cites [1\u201311]: more works than a hit lists."""
    f = Flow(A4)
    f.paragraph("A Survey of Sample Reference Managers and Their Formats", font="tibo", size=16, after=6)
    f.line("Oskar Lind, Freya Berg", size=11)
    f.heading("1 Introduction", before=8)
    f.paragraph(f"The {MANY_TOKEN} covers every reference manager released in the last two decades, from "
                "desktop tools to web services, and compares their import and export formats [1\u201311].")
    f.paragraph("Most managers read BibTeX and RIS, fewer read CSL-JSON, and only a handful keep the "
                "identifiers of the cited works when a library is moved between tools.")
    f.heading("References")
    for i in range(1, MANY_REFERENCE_COUNT + 1):
        f.paragraph(f"[{i}] Author{chr(64 + i)} Person, \u201cReference manager number {i} and its export "
                    f"formats,\u201d Softw. Notes {i}, {10 * i} ({2000 + i}).", size=9.5, after=2)
    return f.save(Path(outdir) / name, _plain_meta(2022))


# -- a paper re-typeset with a corrected title (same path) --------------------------------

RETITLE_OLD = "Preliminary Notes on Sample Drift in Archives"
RETITLE_NEW = "Corrected Notes on Sample Drift in Archive Storage"
RETITLE_OLD_TOKEN = "wapitiversion"
RETITLE_NEW_TOKEN = "muntjacversion"


def make_retitled_paper(outdir, name="retitled.pdf", corrected: bool = False) -> Path:
    """The same paper before (corrected=False) and after (corrected=True) its title was corrected;
    the body also changes one word (RETITLE_OLD_TOKEN -> RETITLE_NEW_TOKEN)."""
    title, token = (RETITLE_NEW, RETITLE_NEW_TOKEN) if corrected else (RETITLE_OLD, RETITLE_OLD_TOKEN)
    f = Flow(A4)
    f.paragraph(title, font="tibo", size=16, after=6)
    f.line("Erik Halvorsen, Nora Keller", size=11)
    f.heading("Abstract", before=8)
    f.paragraph(f"Boxes of archival paper in the {token} study gained moisture in summer and lost it in "
                "winter, with a seasonal amplitude of one percent of their dry mass.")
    f.heading("1 Introduction")
    f.paragraph("Archival storage aims at stable conditions, but the buildings that house archives respond "
                "to the seasons, and the materials inside respond to the buildings.")
    return f.save(Path(outdir) / name, _plain_meta(2018))


PROVENANCE_PAPERS = [make_citing_paper, make_cited_paper, make_arxiv_only_paper, make_junk_metadata_paper,
                     make_banner_paper, make_chinese_meta_paper, make_superscript_paper, make_aps_paper,
                     make_author_year_paper, make_many_citations_paper]


def write_provenance(outdir) -> list[Path]:
    """The papers of tests/test_provenance.py that share one library: PROVENANCE_PAPERS plus the
    variants superscript_no_references.pdf, junk_metadata_plain.pdf and author_year_ambiguous.pdf."""
    return [make(outdir) for make in PROVENANCE_PAPERS] + [
        make_superscript_paper(outdir, "superscript_no_references.pdf", references=False),
        make_junk_metadata_paper(outdir, "junk_metadata_plain.pdf", page_title=False),
        make_author_year_paper(outdir, "author_year_ambiguous.pdf", ambiguous=True),
    ]


# ---------------------------------------------------------------------------
# sets and verification

QUICKSTART = [make_onecolumn_paper, make_twocolumn_paper, make_hyphenated_paper,
              make_ligature_paper, make_chinese_paper]
OTHER_KINDS = [make_docx, make_gb18030_txt, make_markdown]
SPECIAL_PDFS = [make_encrypted_pdf, make_owner_only_pdf, make_empty_pdf, make_corrupt_pdf, make_scanned_pdf]


def write_quickstart(outdir) -> list[Path]:
    """The five papers used by the README Quick Start."""
    return [make(outdir) for make in QUICKSTART]


def write_all(outdir) -> list[Path]:
    """Every fixture: the Quick Start papers, DOCX/TXT/MD, and the special PDFs."""
    return [make(outdir) for make in QUICKSTART + OTHER_KINDS + SPECIAL_PDFS]


def _pdf_text(path) -> list[str]:
    with pymupdf.open(path) as doc:
        return [page.get_text() for page in doc]


def verify(path) -> str:  # noqa: C901
    """Check one generated file with PyMuPDF (or by decoding it); return a short
    description, raise AssertionError when it is not what it should be."""
    path = Path(path)
    name = path.name
    if name.startswith("encrypted"):
        with pymupdf.open(path) as doc:
            assert doc.needs_pass and doc.is_encrypted, "should need a password"
            assert doc.authenticate(ENCRYPTED_USER_PW), "user password must open it"
            assert "Glacier" in doc[0].get_text()
        return "encrypted, needs user password"
    if name.startswith("owner_password"):
        with pymupdf.open(path) as doc:
            assert doc.metadata.get("encryption") and not doc.needs_pass, "should be encrypted yet open"
            assert "arctic terns" in doc[0].get_text()
        return "encrypted with owner password only, opens"
    if name == "empty.pdf":
        assert path.stat().st_size == 0
        return "zero bytes"
    if name.startswith("corrupt"):
        try:
            with pymupdf.open(path) as doc:
                assert doc.page_count == 0, "corrupt PDF unexpectedly has pages"
        except (pymupdf.FileDataError, RuntimeError):
            pass
        return "corrupt, does not open"
    if name.startswith("scanned"):
        with pymupdf.open(path) as doc:
            assert doc.page_count == 1 and not doc[0].get_text().strip(), "scan must have no text layer"
            assert doc[0].get_images(), "scan must hold an image"
        return "image only, no text layer"
    if path.suffix == ".docx":
        import docx
        d = docx.Document(str(path))
        styles = {p.style.name for p in d.paragraphs}
        assert {"Heading 1", "Heading 2"} <= styles, styles
        return "docx with Heading 1/2"
    if path.suffix == ".txt":
        raw = path.read_bytes()
        try:
            raw.decode("utf-8")
            raise AssertionError("gb18030 text must not be valid UTF-8")
        except UnicodeDecodeError:
            pass
        assert "耐盐" in raw.decode("gb18030")
        return "gb18030 text"
    if path.suffix == ".md":
        assert path.read_text(encoding="utf-8").startswith("# ")
        return "markdown"
    pages = _pdf_text(path)
    text = "\n".join(pages)
    assert text.strip(), f"{name}: no text layer"
    if name.startswith("graphene"):
        assert len(pages) >= 2 and "1 Introduction" in text and "References" in text
        for tok in GRAPHENE_REF_TOKENS:
            assert tok.capitalize() in text
        first, second = _last_body_line(path, 0), _first_body_line(path, 1)
        assert not first.rstrip().endswith("."), f"page 1 should end mid-sentence: {first!r}"
        assert second[:1].islower(), f"page 2 should continue the sentence: {second!r}"
        assert "Figure 1." in text
    elif name.startswith("protein"):
        assert "I. INTRODUCTION" in text and "II. RELATED WORK" in text
        left, right = two_column_break(path)
        assert not left.endswith("."), f"left column should end mid-sentence: {left!r}"
    elif name.startswith("battery"):
        assert "electro-\nchemical" in text and "de-\nsolvation" in text, "hyphen must end a line"
    elif name.startswith("photocatalysis"):
        assert FFI in text and FI in text, "ligature characters must be in the text layer"
    elif name.startswith("ptarmigan"):
        with pymupdf.open(path) as doc:
            assert [p.get_label() for p in doc] == [lab for lab, _ in LABELS_PAGES.values()]
    elif name.startswith("perovskite"):
        for head in ("摘要", "一、引言", "二、方法", "参考文献"):
            assert head in text, head
    return f"{len(pages)} page(s), {len(text)} chars"


def _body_lines(path, pno):
    """(y, x, text) of the text lines of a page, without the page-number footer."""
    with pymupdf.open(path) as doc:
        page = doc[pno]
        out = []
        for block in page.get_text("dict")["blocks"]:
            for line in block.get("lines", []):
                text = "".join(s["text"] for s in line["spans"]).strip()
                if text and not (text.isdigit() and line["bbox"][1] > page.rect.height - 60):
                    out.append((line["bbox"][1], line["bbox"][0], text))
        return sorted(out)


def _last_body_line(path, pno) -> str:
    return _body_lines(path, pno)[-1][2]


def _first_body_line(path, pno) -> str:
    return _body_lines(path, pno)[0][2]


def page_break_lines(path=None, outdir=None) -> tuple[str, str]:
    """(last body line of page 1, first body line of page 2) of the one-column paper."""
    path = path or make_onecolumn_paper(outdir)
    return _last_body_line(path, 0), _first_body_line(path, 1)


def two_column_break(path) -> tuple[str, str]:
    """(last line of the left column, first line of the right column) on page 1
    of the two-column paper."""
    with pymupdf.open(path) as doc:
        mid = doc[0].rect.width / 2
    lines = _body_lines(path, 0)
    left = [ln for ln in lines if ln[1] < mid - 40 and ln[1] > 0]
    right = [ln for ln in lines if ln[1] > mid]
    # body lines of the left column lie below the full-width header: they share
    # the y range of the right column
    top_right = min(ln[0] for ln in right)
    left = [ln for ln in left if ln[0] >= top_right - 2]
    return max(left)[2], min(right)[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write sample scientific papers for kb-rag.")
    ap.add_argument("outdir", help="folder to write into (created if missing)")
    ap.add_argument("--all", action="store_true",
                    help="also write DOCX/TXT/MD and the encrypted, empty, corrupt and scanned PDFs")
    ap.add_argument("--verify", action="store_true", help="check every written file with PyMuPDF")
    args = ap.parse_args(argv)
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = write_all(out) if args.all else write_quickstart(out)
    for path in paths:
        note = verify(path) if args.verify else ""
        print(f"{path}" + (f"  [{note}]" if note else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
