"""Names: what a person's name looks like where a paper prints it (name case, Chinese names, degrees and marks
around a name).

May import: reading.pdf, text.
"""

from __future__ import annotations

import re
import unicodedata

from ..reading.pdf import NAME_BREAK
from ..text import cjk_ratio, is_cjk

_NAME_SEPARATOR = re.compile(
    r"\s*(?:[,;&，、·•]|\band\b|\bund\b|\bet\b(?!\s*al)|\s{3,}|" + NAME_BREAK + r")\s*", re.IGNORECASE
)


# degrees and titles: a piece made only of these is dropped; the unambiguous ones are also cut out of a name
# ("MD" or "MA" inside a name may be initials written after the family name)
_DEGREE_PIECE = re.compile(
    r"^(?:(?:ph\.?\s?d|m\.?\s?d|m\.?\s?sc|b\.?\s?sc|m\.?\s?phil|m\.?\s?p\.?\s?h|mbbs|"
    r"dr\.?\s?p\.?\s?h|m\.?\s?a|m\.?\s?s|b\.?\s?a|b\.?\s?s|r\.?\s?n|dr|prof|professor|"
    r"(?:senior |life |student )?(?:fellow|member)|ieee|acm|frcp\w*|facs|mrcp)\b\.?\s*)+$",
    re.IGNORECASE,
)


_DEGREE_WORD = re.compile(
    r"(?:^|\s)(?:ph\.?\s?d|m\.?\s?sc|b\.?\s?sc|m\.?\s?phil|mbbs|dr|prof|frcp\w*|facs)\.?(?=\s|$)", re.IGNORECASE
)


_NAME_SUFFIX = re.compile(r"^(?:jr|sr|ii|iii|iv)\.?$", re.IGNORECASE)


_NAME_PARTICLES = frozenset("de van von der den da di do le la del della dos das du ten ter bin ibn al el e y".split())


# words of a thesis cover or an imprint that are never part of a name
_NOT_NAME_WORDS = re.compile(
    r"\b(?:thesis|dissertation|disserta\w*|these|tese|mestrado|doutorado|master|doctor\w*|"
    r"bachelor|orientador\w*|co-orientador\w*|supervisor|advisor|adviser|committee|"
    r"submitted|presented|degree|program\w*|gradua\w*|faculdade|facultad|abstract|"
    r"introduction|contents|chapter|volume|issue|edition|copyright|version|draft|"
    r"county|city|province|district|prefecture|region|state|street|strasse|road|avenue|"
    r"box|rua|calle|town|village|campus|independent|researcher|scholar|student|lecturer|"
    r"engineer|scientist|candidate|corresponding|equal contribution|contributed|"
    # words of titles, never of names ("Fifth-order Shallow Water-wave Models")
    r"analysis|study|studies|methods?|models?|solutions?|approach|theory|systems?|"
    r"learning|effects?|review|survey|evaluation|algorithms?|equations?|waves?|order|"
    r"dynamics|properties|structures?|towards?|using|based|via|novel)\b",
    re.IGNORECASE,
)


_MARKER_CHARS = frozenset("*†‡§¶#∗⋆★☆✉☯♢♦♠♣♥□■○●◆◇⊥‖^~_")


_CN_BYLINE_TAIL = re.compile(r"\s*(?:执笔|著|编著|撰)\s*$")


def name_case(name: str) -> str:
    """Capitals set as a name's typography ("DARRICK E. CHANG", "LIU Bingqian") in name case; initials kept."""

    def fix(word: str, shortest: int = 3) -> str:
        letters = [ch for ch in word if ch.isalpha()]
        if (
            len(letters) < shortest
            or not all(ch.isupper() for ch in letters)
            or _NAME_SUFFIX.match(word)
            or re.fullmatch(r"(?:[A-Z]\.)+", word)
        ):
            return word
        pieces = re.split(r"([-'\u2019])", word.lower())
        cased = "".join(p[:1].upper() + p[1:] if p[:1].isalpha() else p for p in pieces)
        return re.sub(r"^Mc([a-z])", lambda m: "Mc" + m.group(1).upper(), cased)

    if all(ch.isupper() for ch in name if ch.isalpha()) and sum(ch.isalpha() for ch in name) >= 3:
        return " ".join(fix(w, shortest=2) for w in name.split())  # all capitals: "LU" is a name too
    return " ".join(fix(w) for w in name.split())  # mixed: a two-letter "HA" is more likely initials


def _clean_name(piece: str) -> str:
    piece = "".join(
        " " if ch in _MARKER_CHARS or unicodedata.category(ch) in ("So", "Sm", "Sk", "Co", "Cc") else ch for ch in piece
    )
    # affiliation numbers set on the line; a longer number (a postal code) stays and marks an address
    piece = re.sub(r"(?<=[^\W\d_])\d{1,2}\b|\b\d{1,2}\b", " ", piece)
    piece = re.sub(r"\s+", " ", _CN_BYLINE_TAIL.sub("", piece)).strip(" .,:;-–—'\"")
    if _DEGREE_PIECE.match(piece):
        return ""
    return re.sub(r"\s+", " ", _DEGREE_WORD.sub(" ", piece)).strip(" .,:;-–—'\"()[]{}")


def _name_words(name: str) -> list[str]:
    return re.findall(r"[^\W\d_][^\s.]*\.?|(?<=\.)[^\W\d_]+", name)


# Common Chinese family names: a run of two to four characters is taken for a name only when it starts with one.
_CN_SURNAMES = frozenset(
    "王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹彭曾肖田董袁潘于蒋蔡余杜叶程苏魏吕丁任沈姚卢姜崔"
    "钟谭陆汪范金石廖贾夏韦付傅方白邹孟熊秦邱江尹薛闫段雷侯龙史陶黎贺顾毛郝龚邵万钱严覃武戴莫孔向汤常温康施文牛樊"
    "葛邢安齐易乔伍庞颜倪庄聂章鲁岳翟殷詹申欧耿关兰焦俞左柳甘祝包宁尚符舒阮柯纪梅童凌毕单季裴霍涂成苗谷盛曲翁冉骆"
    "蓝路游辛靳管柴蒙鲍华喻祁蒲房滕屈饶解牟艾尤阳时穆农司卓古吉缪简车项连芦麦褚娄窦戚岑景党宫费卜冷晏席卫米柏宗瞿"
    "桂全佟应臧闵苟邬边卞姬师和仇栾隋商刁沙荣巫寇桑郎甄丛仲虞敖巩明佘池查麻苑迟邝"
)


_CN_COMPOUND_SURNAMES = ("欧阳", "司马", "上官", "诸葛", "东方", "皇甫", "尉迟", "公孙", "慕容", "长孙", "令狐", "夏侯")


def _chinese_name(name: str) -> bool:
    name = name.replace(" ", "")
    return (
        2 <= len(name) <= 4
        and all(is_cjk(ch) for ch in name)
        and (name[0] in _CN_SURNAMES or name.startswith(_CN_COMPOUND_SURNAMES))
    )


def is_person_name(name: str) -> bool:
    if not name or len(name) > 60:
        return False
    if cjk_ratio(name) > 0.5:
        return _chinese_name(name)
    if (
        any(ch.isdigit() for ch in name)
        or ":" in name
        or _AFFILIATION_WORDS.search(name)
        or _ORGANISATION_WORDS.search(name)
        or _NOT_NAME_WORDS.search(name)
    ):
        return False
    words = _name_words(name)
    if not 2 <= len(words) <= 6 or len({w.casefold() for w in words}) < len(words):
        return False  # a name does not repeat a word: "Frozen Finetune Frozen Finetune" is a table header
    capitalised = [w for w in words if w.lower().strip(".") not in _NAME_PARTICLES]
    return (
        bool(capitalised)
        and all(w[0].isupper() for w in capitalised)
        and sum(len(w.strip(".")) > 1 for w in words) >= 1
    )


_AFFILIATION_WORDS = re.compile(
    r"\b(?:universit|department|dept\.|institut|laborator|school|college|centre|center|"
    r"faculty|hospital|academy|inc\.|ltd|gmbh|corporation|email|e-mail|@|"
    r"大学|学院|研究所|研究院|实验室|公司|医院)",
    re.IGNORECASE,
)


_ORGANISATION_WORDS = re.compile(
    r"\b(?:research|labs?|laboratories|group|foundation|team|project|consortium|"
    r"technology|technologies|consulting|software|"  # "PA Technology" is a firm
    r"society|council|agency|ministry|office|clinic|museum|observatory|network|"
    r"google|microsoft|facebook|meta ai|amazon|ibm|nvidia|deepmind|openai|"
    r"allen institute|press|publishing|journal|editor|avenue|street|road|"
    r"usa|u\.s\.a|china|japan|germany|france|korea|india|italy|spain|canada|brazil)\b",
    re.IGNORECASE,
)
