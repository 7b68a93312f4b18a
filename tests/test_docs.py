"""The docs site builds with ``mkdocs build --strict``, and its pages open in a real browser.

A headless Chromium (Debian's ``chromium-headless-shell`` or ``chromium``; ``scripts/test.sh`` installs it)
loads the built Quickstart and Benchmarks pages from a local HTTP server: their screenshots must be real
pictures (not blank), and the Benchmarks page's rendered DOM must hold its tables and images. Without a
browser these tests fail, unless ``REFIT_DOCS_NO_BROWSER=1`` says to skip them on this machine.
Also here: the README's length and no development-history labels in the docs or in names under docs/, bench/.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
HISTORY_LABELS = [re.compile(p, re.IGNORECASE) for p in (r"\bstop \d+", r"\bcall\d+", r"\bround (one|two|\d+)\b")]
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser")
SHOT_SIZE = (1280, 1600)


def test_readme_fits_two_screens():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, more than {README_MAX_LINES}"


def _label_hits(text: str) -> list[str]:
    return [m.group(0) for rx in HISTORY_LABELS for m in rx.finditer(text)]


def test_history_label_check_catches_labels():
    """The regexes find what they are for, and leave ordinary words alone."""
    assert _label_hits("see stop 38 and call3, in round two or Round 4") == ["stop 38", "call3", "round two", "Round 4"]
    assert _label_hits("200 rounds; stops 3; recall 5; round-trip; callback; around 4") == []


def test_no_history_labels_in_docs_or_names():
    """Docs describe the project as it is: no step, call or round numbers in the text or in file names."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{p.relative_to(ROOT)}: {hit!r}" for p in texts for hit in _label_hits(p.read_text())]
    names = [p for top in ("docs", "bench") for p in (ROOT / top).rglob("*") if "__pycache__" not in p.parts]
    found += [f"file name {p.relative_to(ROOT)}" for p in names if _label_hits(p.name.replace("_", " "))]
    assert not found, "development-history labels:\n" + "\n".join(found)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mkdocs build --strict`` into a temp dir: any warning (a broken link, a missing image, a docstring
    mkdocstrings cannot read, a page outside the nav) fails it."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about MkDocs 2.0, not about this site
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed ({done.returncode}):\n{log[-6000:]}"
    assert "WARNING" not in log, f"mkdocs build printed warnings:\n{log[-6000:]}"
    return out


def test_site_builds_strict(site: Path):
    for page in ("index.html", "quickstart/index.html", "benchmarks/index.html", "api/refit/index.html"):
        assert (site / page).is_file(), f"the built site has no {page}"
    api = (site / "api/refit/index.html").read_text()
    assert "TransferConfig" in api and "Peer" in api, "the API page does not render refit's docstrings"


def test_benchmarks_page_has_tables_and_images(site: Path):
    html = (site / "benchmarks/index.html").read_text()
    assert "<table>" in html, "the built Benchmarks page has no table"
    srcs = re.findall(r'<img[^>]*\ssrc="([^"]+)"', html)
    assert srcs, "the built Benchmarks page has no image"
    missing = [s for s in srcs if not (site / "benchmarks" / s).resolve().is_file()]
    assert not missing, f"images the Benchmarks page shows but the site lacks: {missing}"


@pytest.fixture(scope="module")
def browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("REFIT_DOCS_NO_BROWSER") == "1":
        pytest.skip("no Chromium here and REFIT_DOCS_NO_BROWSER=1")
    raise AssertionError(f"none of {BROWSERS} is on PATH (scripts/test.sh installs chromium-headless-shell)")


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1 (a free port), as a reader's browser would get it."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def _chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def _pixel_spread(png: Path) -> tuple[tuple[int, int], float, int]:
    """The picture's size, the variance of its grey levels and its number of distinct colours."""
    from PIL import Image

    with Image.open(png) as im:
        im.load()
        rgb = im.convert("RGB")
    grey = rgb.convert("L").tobytes()
    mean = sum(grey) / len(grey)
    variance = sum((g - mean) ** 2 for g in grey) / len(grey)
    colours = len(rgb.getcolors(maxcolors=1 << 24) or ())
    return rgb.size, variance, colours


@pytest.mark.parametrize("page", ["quickstart", "benchmarks"])
def test_page_screenshot_in_chromium(browser: str, served: str, page: str, tmp_path: Path):
    shot = tmp_path / f"{page}.png"
    done = _chromium(
        browser,
        tmp_path / "profile",
        f"--window-size={SHOT_SIZE[0]},{SHOT_SIZE[1]}",
        f"--screenshot={shot}",
        f"{served}/{page}/",
    )
    assert shot.is_file(), f"Chromium wrote no screenshot of {page} (exit {done.returncode}):\n{done.stderr[-3000:]}"
    assert shot.stat().st_size > 20_000, f"the {page} screenshot is only {shot.stat().st_size} bytes"
    size, variance, colours = _pixel_spread(shot)
    assert size == SHOT_SIZE, f"the {page} screenshot is {size}, asked for {SHOT_SIZE}"
    assert variance > 100 and colours > 50, f"the {page} screenshot looks blank: variance {variance}, {colours} colours"


def test_benchmarks_dom_in_chromium(browser: str, served: str, tmp_path: Path):
    """The page as Chromium renders it (after its scripts ran) still holds the tables and images."""
    done = _chromium(browser, tmp_path / "profile", "--dump-dom", f"{served}/benchmarks/")
    dom = done.stdout
    assert done.returncode == 0 and "</html>" in dom, (
        f"no DOM from Chromium ({done.returncode}):\n{done.stderr[-3000:]}"
    )
    tables, imgs = dom.count("<table"), re.findall(r'<img[^>]*\ssrc="([^"]+)"', dom)
    assert tables >= 1, "the rendered Benchmarks page has no table"
    assert imgs, "the rendered Benchmarks page has no image"
