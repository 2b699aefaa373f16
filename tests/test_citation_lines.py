"""The shapes of the lines a paper prints about where it appeared, read one at a time (issue 52): what each number
is, the name before it, and the lines that hold numbers but are no journal line. Made-up venues throughout."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.internals  # the reader's own functions, below the protocol


@pytest.fixture(scope="module")
def kb(kb_engine):
    return kb_engine


@pytest.mark.parametrize(
    ("line", "venue", "volume", "issue", "pages", "year"),
    [
        ("Journal of Rural Field Methods (2011), 18:3, 211–219", "Journal of Rural Field Methods", "18", "3",
         "211-219", 2011),
        ("Condensed Matter Express | Vol 81 | 3 March 2015 | 402", "Condensed Matter Express", "81", None, "402", 2015),
        ("JOURNAL OF INTERFACE LETTERS  JIL 44, 081203 (2012)  week ending 3 MAY 2012",
         "JOURNAL OF INTERFACE LETTERS", "44", None, "081203", 2012),
        ("Okafor et al. Journal of Community Midwifery 2016, 9:42", "Journal of Community Midwifery", "9", None, "42",
         2016),
        ("Annals of Underground Physics 27 (2018) 301–318", "Annals of Underground Physics", "27", None, "301-318",
         2018),
        ("Soil Science Quarterly, 20, 273-297 (1995)", "Soil Science Quarterly", "20", None, "273-297", 1995),
        ("Ann Rural Med. 2014;26(1):147-54", "Ann Rural Med.", "26", "1", "147-154", 2014),
        ("FIELD ROBOTICS LETTERS, VOL. 26, NO. 1, JANUARY 2004", "FIELD ROBOTICS LETTERS", "26", "1", None, 2004),
        ("4 8 4 | F I E L D  N O T E S | V O L 5 2 9 | 2 8 J A N U A R Y 2 0 1 6", "FIELD NOTES", "529", None, "484",
         2016),
        ("148 Proceedings of the Acoustic Society | Vol. 104, No. 1, January 2016",
         "Proceedings of the Acoustic Society", "104", "1", "148", 2016),
        ("Workshop Notes on Sensing: Vol. 23 (2012) 39.1–39.26", "Workshop Notes on Sensing", "23", None,
         "39.1-39.26", 2012),
        ("环境工程科学学报  第12卷第3期  2008年6月", "环境工程科学学报", "12", "3", None, 2008),
        ("第12卷第3期        环境工程科学学报        2008年6月", "环境工程科学学报", "12", "3", None, 2008),
        ("Proceedings of the 12th Workshop on Lexical Semantics, pages 88–97, Lisbon, Portugal, May 2011.",
         "Proceedings of the 12th Workshop on Lexical Semantics", None, None, "88-97", 2011),
    ],
)
def test_a_journal_line_gives_each_number_its_role(kb, line, venue, volume, issue, pages, year):
    found = kb.read_numbers(line)
    assert found is not None, line
    assert (found.venue, found.volume, found.issue, found.pages, found.year) == (venue, volume, issue, pages, year)


@pytest.mark.parametrize(
    "line",
    [
        "Received 12 March 2014; accepted 3 June 2014",
        "Algorithm 1 converges in 256 steps",
        "Funded by the Northmere Trust (grant 2019-1234), 2019",
        "1 A. Lindqvist, B. Moreau, Annals of Underground Physics 65, 115323 (2002)",
        "Departamento de Física, Apartado Postal 14-740, 07000 Ciudad, 2009",
        "Track listing: Slow Train 5:02, Quiet Harbour 5:00",
        "ORCID 0000-0002-7133-8397, version 2021",
        "盈利预测与投资建议：预计公司2022年营收12亿元",
    ],
)
def test_lines_with_numbers_that_are_no_journal_line(kb, line):
    assert kb.read_numbers(line) is None, kb.read_numbers(line)


def test_cost_codes_and_chinese_article_numbers(kb):
    code = kb.read_cost_code("1234-5678/12/44(8)/081203(4)")
    assert (code.volume, code.issue, code.pages) == ("44", "8", "081203")
    code = kb.read_cost_code("0042-1234/95/12(3)/417(9)")
    assert (code.volume, code.issue, code.pages) == ("12", "3", "417-425")
    article = kb.read_cost_code("文章编号：1001-9081(2019)04-0123-06")
    assert (article.issue, article.pages, article.year) == ("4", "123-128", 2019)


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("Technical Report NMRL-TR-2019-07", "NMRL-TR-2019-07"),
        ("CMU-CS-96-177", "CMU-CS-96-177"),
        ("GAO-23-106826", "GAO-23-106826"),
        ("DFPD-2015/TH/20", "DFPD-2015/TH/20"),
        ("Working Paper No. 1217", "1217"),
        ("a COVID-19 cohort", None),
        ("SARS-CoV-2 spike", None),
        ("GPT-4 and IEEE-754 numbers", None),
    ],
)
def test_report_numbers_by_their_shape(kb, text, number):
    assert kb.report_number(text) == number


def test_a_title_pages_form(kb):
    form = kb.read_form(["论文题目：滨海湿地植被恢复的遥感监测方法", "学生姓名", "韩雪松", "指导教师", "王立平",
                         "提交日期    2020 年 5 月 26 日"])
    assert form == {"title": "滨海湿地植被恢复的遥感监测方法", "author": "韩雪松", "date": "2020 年 5 月 26 日"}
    assert kb.form_year("二〇二〇年五月") == 2020 and kb.form_year("May 2017") == 2017


def test_the_printed_page_span(kb):
    # a journal's pages 233-236, the first unnumbered; the volume (12) and year on every page never vote
    pages = [[12, 2008], [12, 2008, 234], [12, 2008, 235], [12, 2008, 236]]
    assert kb.printed_page_span(pages) == (233, 236)
    assert kb.printed_page_span([[12, 2008], [12, 2008], [12, 2008]]) is None  # nothing advances with the page
    assert kb.printed_page_span([[1], [2], [3], [4]]) == (1, 4)  # a preprint's own 1..N (the reader keeps no range)
