"""Text analysis: normalisation, tokens, Porter stemmer, CJK grams.

May import: no module of the package.
"""

from __future__ import annotations

import functools
import re
import unicodedata

# Index terms are produced here and nowhere else: the same analyser feeds the
# FTS5 table, the query and the snippet locator, so they always agree.

STOPWORDS = frozenset(
    """
a about above after again against all also am an and any are aren as at be because been before being below
between both but by can cannot could did do does doing don down during each few for from further had has have
having he her here hers herself him himself his how i if in into is isn it its itself just let me more most my
myself no nor not now of off on once only or other ought our ours ourselves out over own same she should so
some such than that the their theirs them themselves then there these they this those through to too under
until up very was we were what when where which while who whom why will with would you your yours yourself
yourselves s t d ll m re ve via thus whether
""".split()
)
CJK_STOP_CHARS = frozenset("的了是在和与及或之其")

_CJK_RANGES = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3040-\u30ff"
_CJK_CHAR = re.compile(f"[{_CJK_RANGES}]")
_CJK_RUN_OR_WORD = re.compile(f"[{_CJK_RANGES}]+|[^\\W_{_CJK_RANGES}]+")
_INVISIBLES = dict.fromkeys(map(ord, "\u00ad\u200b\u200c\u200d\u2060\ufeff"), None)


# C0 and C1 controls (tab and newline excepted), private-use glyphs and replacement characters: what a broken font
# map leaves in extracted text. They never reach a stored or returned field.
_CONTROL_RESIDUE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ue000-\uf8ff\ufffd\U000f0000-\U0010ffff]")


def strip_controls(text: str) -> str:
    return _CONTROL_RESIDUE.sub("", text) if text else text


def clean_field(text: str | None) -> str:
    """A one-line metadata value: no control residue, invisible characters or runs of whitespace."""
    if not text:
        return ""
    return re.sub(r"\s+", " ", strip_controls(normalize_text(str(text)))).strip()


def normalize_text(text: str) -> str:
    """NFKC (folds ligatures and full-width forms) without invisible characters."""
    return unicodedata.normalize("NFKC", text).translate(_INVISIBLES)


# Spacing accents that TeX fonts draw as separate glyphs ("Fern´andez", "Gonc¸alo"), with the combining mark each
# stands for. Marks set above a letter usually precede it in the text stream; marks set below follow it.
_SPACING_ACCENTS = {
    "\u00b4": "\u0301",
    "`": "\u0300",
    "\u00a8": "\u0308",
    "\u02c6": "\u0302",
    "\u02dc": "\u0303",
    "\u00af": "\u0304",
    "\u02d8": "\u0306",
    "\u02c7": "\u030c",
    "\u02d9": "\u0307",
    "\u02da": "\u030a",
    "\u02dd": "\u030b",
    "\u00b8": "\u0327",
    "\u02db": "\u0328",
}
_MARKS_BELOW = frozenset("\u0327\u0328")


def _composed(letter: str, mark: str) -> str | None:
    letter = {"\u0131": "i", "\u0237": "j"}.get(letter, letter)  # dotless i/j carry the accent in TeX
    joined = unicodedata.normalize("NFC", letter + mark)
    return joined if len(joined) == 1 else None


def compose_spacing_accents(text: str) -> str:
    """Put a separately drawn accent onto its letter ("Andr´e" -> "André"); leave it where no letter takes it."""
    if not any(ch in _SPACING_ACCENTS for ch in text):
        return text
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        mark = _SPACING_ACCENTS.get(ch)
        if mark is None:
            out.append(ch)
            i += 1
            continue
        before = out[-1] if out and out[-1].isalpha() else ""
        after = text[i + 1] if i + 1 < len(text) and text[i + 1].isalpha() else ""
        tries = [("before", before), ("after", after)]
        if mark not in _MARKS_BELOW:
            tries.reverse()
        for side, letter in tries:
            joined = _composed(letter, mark) if letter else None
            if joined and side == "before":
                out[-1] = joined
                i += 1
                break
            if joined and side == "after":
                out.append(joined)
                i += 2
                break
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _strip_diacritics(word: str) -> str:
    if word.isascii():
        return word
    decomposed = unicodedata.normalize("NFKD", word)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch))


def is_cjk(ch: str) -> bool:
    return bool(_CJK_CHAR.match(ch))


def cjk_ratio(text: str) -> float:
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return 0.0
    return sum(1 for ch in letters if is_cjk(ch)) / len(letters)


# -- which language a text is written in ------------------------------------------------------------------------
# CJK and Hangul by script (kana marks Japanese); Latin-script languages by the share of their most frequent
# function words, each list kept to words the other languages here do not use alike. Good enough to tell a
# Portuguese thesis from an English paper, and never a claim about a text too short to judge.

_KANA = re.compile("[\u3040-\u30ff]")
_HANGUL = re.compile("[\uac00-\ud7af\u1100-\u11ff\u3130-\u318f]")
FUNCTION_WORDS = {
    "en": frozenset("the of and to is that for with are this by which be from was were have has been".split()),
    "pt": frozenset("não são uma para com pelo pela das dos também foi ao nos está entre ser pode".split()),
    "es": frozenset("el los las del una para con por también fue es son entre puede este esta como".split()),
    "fr": frozenset("le les des du une dans pour sur avec sont cette qui ont être au aux pas nous".split()),
    "de": frozenset("der die das und ist nicht mit von den zu auf eine für sich dem wird werden".split()),
    "it": frozenset("il di che della delle degli nel per con una sono anche gli alla questo".split()),
    "nl": frozenset("het een van en dat op met voor niet zijn wordt deze bij ook naar".split()),
}
LANGUAGE_NAMES = {
    "en": "English",
    "zh": "Chinese",
    "ja": "Japanese",
    "ko": "Korean",
    "pt": "Portuguese",
    "es": "Spanish",
    "fr": "French",
    "de": "German",
    "it": "Italian",
    "nl": "Dutch",
}


def text_language(text: str, least_words: int = 2) -> str:
    """ISO 639-1 code of the language ``text`` is mostly written in; "en" when the text cannot tell (a Latin-script
    language needs ``least_words`` hits of its function words, and more of them than English)."""
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return "en"
    hangul = sum(1 for ch in letters if _HANGUL.match(ch))
    cjk = sum(1 for ch in letters if is_cjk(ch))
    if hangul > 0.3 * len(letters):
        return "ko"
    if cjk > 0.3 * len(letters):
        return "ja" if sum(1 for ch in letters if _KANA.match(ch)) > 0.1 * cjk else "zh"
    words = re.findall(r"[^\W\d_]+", text.lower())
    hits = {lang: sum(1 for w in words if w in vocabulary) for lang, vocabulary in FUNCTION_WORDS.items()}
    best = max(hits, key=hits.__getitem__)
    return best if hits[best] >= least_words and hits[best] > hits["en"] else "en"


class PorterStemmer:
    """The classic Porter (1980) suffix stripper, for lower-case ASCII words."""

    _STEP2 = (
        ("ational", "ate"),
        ("tional", "tion"),
        ("enci", "ence"),
        ("anci", "ance"),
        ("izer", "ize"),
        ("bli", "ble"),
        ("alli", "al"),
        ("entli", "ent"),
        ("eli", "e"),
        ("ousli", "ous"),
        ("ization", "ize"),
        ("ation", "ate"),
        ("ator", "ate"),
        ("alism", "al"),
        ("iveness", "ive"),
        ("fulness", "ful"),
        ("ousness", "ous"),
        ("aliti", "al"),
        ("iviti", "ive"),
        ("biliti", "ble"),
        ("logi", "log"),
    )
    _STEP3 = (
        ("icate", "ic"),
        ("ative", ""),
        ("alize", "al"),
        ("iciti", "ic"),
        ("ical", "ic"),
        ("ful", ""),
        ("ness", ""),
    )
    _STEP4 = (
        "al",
        "ance",
        "ence",
        "er",
        "ic",
        "able",
        "ible",
        "ant",
        "ement",
        "ment",
        "ent",
        "ion",
        "ou",
        "ism",
        "ate",
        "iti",
        "ous",
        "ive",
        "ize",
    )

    @staticmethod
    def _is_consonant(word: str, i: int) -> bool:
        ch = word[i]
        if ch in "aeiou":
            return False
        if ch == "y":
            return i == 0 or not PorterStemmer._is_consonant(word, i - 1)
        return True

    def _measure(self, stem: str) -> int:
        """Number of vowel-consonant sequences in the stem."""
        pattern = "".join("c" if self._is_consonant(stem, i) else "v" for i in range(len(stem)))
        return len(re.findall("v+c+", pattern))

    def _has_vowel(self, stem: str) -> bool:
        return any(not self._is_consonant(stem, i) for i in range(len(stem)))

    def _double_consonant(self, word: str) -> bool:
        return len(word) >= 2 and word[-1] == word[-2] and self._is_consonant(word, len(word) - 1)

    def _cvc(self, word: str) -> bool:
        if len(word) < 3:
            return False
        n = len(word)
        shape = (self._is_consonant(word, n - 3), self._is_consonant(word, n - 2), self._is_consonant(word, n - 1))
        return shape == (True, False, True) and word[-1] not in "wxy"

    def _replace(self, word: str, rules, min_measure: int) -> str:
        for suffix, replacement in rules:
            if word.endswith(suffix):
                stem = word[: len(word) - len(suffix)]
                return stem + replacement if self._measure(stem) > min_measure else word
        return word

    def stem(self, word: str) -> str:
        if len(word) <= 2:
            return word
        word = self._step1(word)
        word = self._replace(word, self._STEP2, 0)
        word = self._replace(word, self._STEP3, 0)
        word = self._step4(word)
        return self._step5(word)

    def _step1(self, word: str) -> str:
        if word.endswith("sses") or word.endswith("ies"):
            word = word[:-2]
        elif word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        extra_step = False
        if word.endswith("eed"):
            if self._measure(word[:-3]) > 0:
                word = word[:-1]
        elif word.endswith("ed") and self._has_vowel(word[:-2]):
            word, extra_step = word[:-2], True
        elif word.endswith("ing") and self._has_vowel(word[:-3]):
            word, extra_step = word[:-3], True
        if extra_step:
            if word.endswith(("at", "bl", "iz")):
                word += "e"
            elif self._double_consonant(word) and word[-1] not in "lsz":
                word = word[:-1]
            elif self._measure(word) == 1 and self._cvc(word):
                word += "e"
        if word.endswith("y") and self._has_vowel(word[:-1]):
            word = word[:-1] + "i"
        return word

    def _step4(self, word: str) -> str:
        for suffix in self._STEP4:
            if word.endswith(suffix):
                stem = word[: len(word) - len(suffix)]
                if self._measure(stem) > 1 and (suffix != "ion" or stem.endswith(("s", "t"))):
                    return stem
                return word
        return word

    def _step5(self, word: str) -> str:
        if word.endswith("e"):
            stem = word[:-1]
            m = self._measure(stem)
            if m > 1 or (m == 1 and not self._cvc(stem)):
                word = stem
        if word.endswith("ll") and self._measure(word[:-1]) > 1:
            word = word[:-1]
        return word


_STEMMER = PorterStemmer()


@functools.lru_cache(maxsize=200_000)
def index_term(word: str) -> str | None:
    """Map one lower-cased non-CJK word to its index term (None for a stopword)."""
    word = _strip_diacritics(word)
    if word in STOPWORDS or not word:
        return None
    if word.isascii() and word.isalpha():
        return _STEMMER.stem(word)
    return word


def analyze(text: str, with_offsets: bool = False) -> list:
    """Index terms of ``text``: stemmed words, and CJK unigrams plus bigrams.

    With ``with_offsets`` each item is ``(term, start, end)`` in ``text``.
    """
    out: list = []
    lowered = text.lower()
    if len(lowered) != len(text):  # a rare case-fold that changes length: keep offsets honest
        lowered = "".join(ch.lower() if len(ch.lower()) == 1 else ch for ch in text)
    for match in _CJK_RUN_OR_WORD.finditer(lowered):
        run, start = match.group(), match.start()
        if is_cjk(run[0]):
            for i, ch in enumerate(run):
                if ch not in CJK_STOP_CHARS:
                    out.append((ch, start + i, start + i + 1) if with_offsets else ch)
                if i + 1 < len(run):
                    gram = run[i : i + 2]
                    out.append((gram, start + i, start + i + 2) if with_offsets else gram)
            continue
        term = index_term(run)
        if term:
            out.append((term, start, match.end()) if with_offsets else term)
    return out


def analyzed_string(text: str) -> str:
    return " ".join(analyze(text))


def query_terms(query: str) -> list[str]:
    """Distinct index terms of a query, in first-seen order."""
    seen: dict[str, None] = {}
    for term in analyze(normalize_text(query)):
        seen.setdefault(term, None)
    return list(seen)
