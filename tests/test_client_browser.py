"""The DSH client bundle in a real browser (issue 31): headless Chromium draws a kb_search source card with its
thumbnail, and the screenshot shows the passage in marker yellow.

The card's meta is the engine's own view: generated papers are ingested, searched with ``pictures`` (and drawn by
``show`` for the kb_show toolview), and the view is wrapped as plugin/src/render.js's ``cardView`` wraps it. A
harness page loads plugin/client/index.js as the DSH web UI does (a classic script that registers a factory with
``window.__ModuleLoader__``) and mounts ``SourcesView`` (and ``PictureView``) with that meta.

React: the DSH runtime supplies the real React, but the bundle needs only ``createElement`` from it (its components
use no hooks, state or context), so the harness gives it a small stand-in that builds real DOM nodes at once
(tests/browser/react-standin.js). tests/browser/drive.mjs drives Chromium with playwright-core and reports what it
measured; the assertions are here, and the screenshot's pixels are read with PyMuPDF and numpy.

Needs Chromium (Debian's ``chromium``; another with ``KB_CHROMIUM``), Node.js 18+ and playwright-core: from
``KB_PLAYWRIGHT_DIR`` (a folder with node_modules/playwright-core, as .ci/run prepares it), else installed with npm
into a temporary folder. Playwright's own browser download is never used. Skips, with the reason, when one of them
cannot be had.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pymupdf = pytest.importorskip("pymupdf")
np = pytest.importorskip("numpy")

from helpers import ROOT, sp  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.node]

BROWSER = Path(__file__).resolve().parent / "browser"
BUNDLE = ROOT / "plugin" / "client" / "index.js"
PLAYWRIGHT = "playwright-core@1"
QUERY = "photocatalyst quantum efficiency"
SPAN_KEYS = ("doc_id", "page", "char_start", "char_end", "page_end")


def is_marker(rgb: np.ndarray) -> np.ndarray:
    """Marker yellow, RGB (255, 214, 10), multiplied over white paper (a little blur from scaling allowed)."""
    r, g, b = (rgb[..., i].astype(int) for i in range(3))
    return (r > 230) & (g > 190) & (g < 235) & (b < 80)


def pixels(png: Path) -> np.ndarray:
    pix = pymupdf.Pixmap(png.read_bytes())
    return np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.width, pix.n)[:, :, :3]


def region(shot: np.ndarray, box: dict, scale: float) -> np.ndarray:
    """The screenshot's pixels inside a CSS-pixel box (page coordinates)."""
    x0, y0 = int(round(box["x"] * scale)), int(round(box["y"] * scale))
    x1, y1 = int(round((box["x"] + box["width"]) * scale)), int(round((box["y"] + box["height"]) * scale))
    return shot[y0:y1, x0:x1]


# ---------------------------------------------------------------------------
# the tools: each one missing is a skip, not an error

def chromium_path() -> str:
    for candidate in (os.environ.get("KB_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("headless Chromium is not installed (apt-get install chromium, or set KB_CHROMIUM)")


def node_path() -> str:
    node = shutil.which("node")
    if not node:
        pytest.skip("Node.js is not installed: the browser test drives Chromium with playwright-core")
    try:
        version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=20).stdout.strip()
        major = int(version.lstrip("v").split(".")[0])
    except (OSError, ValueError, subprocess.SubprocessError):
        pytest.skip("Node.js does not answer `node --version`")
    if major < 18:
        pytest.skip(f"Node.js {version} is too old for playwright-core (18 or later)")
    return node


def has_playwright(folder: Path) -> bool:
    return (folder / "node_modules" / "playwright-core" / "package.json").is_file()


def playwright_dir(tmp_path_factory) -> Path:
    """A folder with node_modules/playwright-core: KB_PLAYWRIGHT_DIR, else npm installs it into a temporary one."""
    given = os.environ.get("KB_PLAYWRIGHT_DIR")
    if given and has_playwright(Path(given)):
        return Path(given)
    npm = shutil.which("npm")
    if not npm:
        pytest.skip("npm is not installed: playwright-core cannot be had (or set KB_PLAYWRIGHT_DIR)")
    folder = tmp_path_factory.mktemp("playwright")
    try:
        run = subprocess.run([npm, "install", "--no-save", "--no-package-lock", "--no-audit", "--no-fund",
                              "--ignore-scripts", "--fetch-retries=1", "--fetch-timeout=30000",
                              "--prefix", str(folder), PLAYWRIGHT],
                             capture_output=True, text=True, timeout=120, cwd=folder)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"npm could not install {PLAYWRIGHT} ({type(exc).__name__}): set KB_PLAYWRIGHT_DIR")
    if run.returncode != 0 or not has_playwright(folder):
        lines = [line for line in (run.stderr + run.stdout).splitlines()
                 if line.strip() and "complete log" not in line]
        pytest.skip(f"npm could not install {PLAYWRIGHT} (offline?): {(lines or ['no output'])[0][:160]}")
    return folder


# ---------------------------------------------------------------------------
# the engine's views and the harness pages

def harness(path: Path, view: str, block: dict, tool: str) -> str:
    """A page that loads the bundle as the DSH web UI does and mounts one toolview with ``block``."""
    data = json.dumps(block).replace("</", "<\\/")
    path.write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kb-rag {view}</title>
<style>body {{ margin: 16px; background: #fff; color: #000; font: 14px sans-serif; }}</style></head>
<body><div id="root"></div>
<script src="{(BROWSER / 'react-standin.js').as_uri()}"></script>
<script>
window.__KB_REGISTERED__ = []
window.__ModuleLoader__ = {{ load: (entry) => window.__KB_REGISTERED__.push(entry) }}
</script>
<script src="{BUNDLE.as_uri()}"></script>
<script>window.__KB_BLOCK__ = {data}</script>
<script>
const entry = window.__KB_REGISTERED__[0]
const views = entry.factory((id) => {{
  if (id === 'react') return window.React
  throw new Error('unexpected require ' + id)
}})
document.getElementById('root').append(views.{view}({{ block: window.__KB_BLOCK__, toolName: '{tool}' }}))
window.__KB_MOUNTED__ = true
</script></body></html>
""", encoding="utf-8")
    return path.as_uri()


def block(meta: dict) -> dict:
    return {"kind": "tool-result", "call": {}, "content": [{"type": "text", "text": "markdown"}], "isError": False,
            "meta": meta}


def card_view(view: dict) -> dict:
    """plugin/src/render.js cardView: the engine's view with the session's scope added."""
    return {**view, "scope": "kb", "strict": False, "notices": []}


@pytest.fixture(scope="module")
def browser(tmp_path_factory, kb_engine):
    chromium = chromium_path()
    node = node_path()
    playwright = playwright_dir(tmp_path_factory)

    work = tmp_path_factory.mktemp("browser")
    folder = work / "papers"
    folder.mkdir()
    sp.make_ligature_paper(folder)
    sp.make_onecolumn_paper(folder)
    kb_root = str(work / ".kb")
    engine = kb_engine.Engine()
    try:
        engine.execute("ingest", {"paths": [str(folder)], "kb_root": kb_root})
        found = engine.execute("search", {"query": QUERY, "kb_root": kb_root, "mode": "keyword", "pictures": 2,
                                          "render": "markdown"})
        hit = next(h for h in found["results"] if h.get("kind") == "pdf" and h.get("char_start") is not None)
        shown = engine.execute("show", {**{k: hit[k] for k in SPAN_KEYS}, "kb_root": kb_root, "inline": True,
                                        "render": "markdown"})
    finally:
        engine.close()
    sources, picture = card_view(found["view"]), card_view(shown["view"])
    assert sources["kind"] == "kb-sources" and picture["kind"] == "kb-picture"

    shots = work / "shots"
    shots.mkdir()
    config = {"playwright": str(playwright), "chromium": chromium, "out": str(shots), "pages": [
        {"name": "sources", "url": harness(work / "sources.html", "SourcesView", block(sources), "kb_search")},
        {"name": "show", "url": harness(work / "show.html", "PictureView", block(picture), "kb_show")},
    ]}
    (work / "config.json").write_text(json.dumps(config), encoding="utf-8")
    try:
        run = subprocess.run([node, str(BROWSER / "drive.mjs"), str(work / "config.json")], capture_output=True,
                             text=True, timeout=90, cwd=work)
    except subprocess.TimeoutExpired:
        pytest.fail("headless Chromium did not finish in 90 s")
    if run.returncode == 3:  # drive.mjs: the browser did not start
        pytest.skip(f"Chromium at {chromium} does not start headless: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    return {"result": result, "sources": sources, "show": picture, "pages": result["pages"]}


def first_picture(view: dict) -> dict:
    return next(s["picture"] for s in view["sources"] if s.get("picture"))


# ---------------------------------------------------------------------------
# the source card

def test_the_card_renders_with_the_engine_view(browser):
    page, view = browser["pages"]["sources"], browser["sources"]
    assert not page["errors"], page["errors"]
    before = page["before"]
    assert before["cards"] == len(view["sources"]) > 0
    assert before["pictures"] == sum(1 for s in view["sources"] if s.get("picture")) > 0
    assert f"for “{QUERY}”" in before["head"] and "scope kb" in before["head"]


def test_the_thumbnail_loads_at_the_picture_size(browser):
    page, picture = browser["pages"]["sources"], first_picture(browser["sources"])
    thumb = page["before"]["thumb"]
    assert thumb["complete"] and thumb["naturalWidth"] > 0, thumb
    assert (thumb["naturalWidth"], thumb["naturalHeight"]) == (picture["width"], picture["height"])
    assert thumb["src_prefix"] == "data:image/png;base64,"
    assert thumb["alt"].endswith(f": the passage highlighted (p. {picture['page']})")
    box = thumb["box"]
    assert 0 < box["width"] <= 220.5 and 0 < box["height"] <= 110.5, box  # the card's thumbnail size


def test_a_click_on_the_thumbnail_opens_the_full_picture(browser):
    page, picture = browser["pages"]["sources"], first_picture(browser["sources"])
    before, after = page["before"], page["after"]
    # hidden while closed (newer Chromium lays the closed <details> content out but does not paint it: the
    # screenshot test checks that no yellow shows outside the thumbnails before the click)
    assert before["open"] is False and not before["full_visible"]
    assert after["open"] is True and after["full_visible"]
    full, thumb = after["full_bounding_box"], after["thumb_bounding_box"]
    assert full["width"] > thumb["width"] and full["height"] > thumb["height"], (full, thumb)
    assert full["width"] * full["height"] > 2 * thumb["width"] * thumb["height"]
    assert after["full"]["naturalWidth"] == picture["width"]
    assert abs(full["width"] - picture["width"]) <= 1  # drawn at its own size (the page is wide enough)


def test_the_screenshot_shows_the_passage_in_marker_yellow(browser):
    page, picture = browser["pages"]["sources"], first_picture(browser["sources"])
    scale = page["scale"]
    shot_before, shot_after = (pixels(Path(page["screenshots"][k])) for k in ("before", "after"))
    thumb = page["before"]["thumb"]["box"]

    inside = is_marker(region(shot_before, thumb, scale))
    assert inside.sum() > 200, f"only {inside.sum()} marker-yellow pixels in the thumbnail"
    # the yellow lies on the passage's rows: within the marks, scaled as the thumbnail is scaled
    rows = np.nonzero(inside.any(axis=1))[0] / (thumb["width"] * scale) * picture["width"]
    top, bottom = min(m[1] for m in picture["marks"]), max(m[3] for m in picture["marks"])
    assert top - 3 <= rows.min() and rows.max() <= bottom + 3, (rows.min(), rows.max(), top, bottom)
    # before the click, every yellow pixel of the page lies in a thumbnail (nothing else on the page is yellow)
    rest = is_marker(shot_before)
    for box in page["before"]["thumbs"]:
        pad = {"x": box["x"] - 1, "y": box["y"] - 1, "width": box["width"] + 2, "height": box["height"] + 2}
        region(rest, pad, scale)[...] = False
    assert rest.sum() == 0, f"{rest.sum()} marker-yellow pixels outside the thumbnails"

    full = page["after"]["full"]["box"]
    opened = is_marker(region(shot_after, full, scale))
    assert opened.sum() > inside.sum(), (int(opened.sum()), int(inside.sum()))
    assert is_marker(shot_after).sum() > is_marker(shot_before).sum()
    rows = np.nonzero(opened.any(axis=1))[0] / (full["width"] * scale) * picture["width"]
    assert top - 3 <= rows.min() and rows.max() <= bottom + 3, (rows.min(), rows.max(), top, bottom)


# ---------------------------------------------------------------------------
# kb_show's picture

def test_the_show_picture_loads_and_opens(browser):
    page, view = browser["pages"]["show"], browser["show"]
    image = view["images"][0]
    assert not page["errors"], page["errors"]
    before, after = page["before"], page["after"]
    assert view["title"] in before["head"] and f"p. {image['page']}" in before["head"]
    thumb = before["thumb"]
    assert thumb["complete"] and thumb["naturalWidth"] == image["width"] > 0, thumb
    assert thumb["naturalHeight"] == image["height"]
    assert after["full_visible"] and after["full"]["naturalWidth"] == image["width"]
    shot = pixels(Path(page["screenshots"]["after"]))
    assert is_marker(region(shot, after["full"]["box"], page["scale"])).sum() > 200
