"""The rendered website (`make html`) opened in a real headless Chromium.

Serves site/ on 127.0.0.1 and opens every page in Debian's chromium
through Playwright. Each page must log no console error, fetch nothing from
another host, draw every chart and typeset its math. Screenshots go to
test-output/screenshots-site/. With AT_SITE=site-full it checks the
full-size build of `make site` instead. Without Chromium or without a
built site the tests skip locally and fail under CI (CI=true).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
# AT_SITE=site-full checks the full-size build of `make site` instead.
SITE = ROOT / os.environ.get("AT_SITE", "site")
SHOTS = ROOT / "test-output" / f"screenshots-{SITE.name}"
CHROMIUM = Path(os.environ.get("AT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
]
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
PAGES = sorted(p.name for p in SITE.glob("*.html"))
# A script, stylesheet, image or frame fetched from another host.
REMOTE = re.compile(
    r"<(?:script|link|img|iframe|source)\b[^>]*?\b(?:src|href)\s*=\s*"
    r"[\"']?(?:https?:)?//|@import\s+(?:url\()?[\"']?https?:",
    re.IGNORECASE,
)
CHART_SIZES = """() => Array.from(document.querySelectorAll("div.at-chart"))
  .map((el) => {
    const g = el.querySelector("svg, canvas");
    const r = g ? g.getBoundingClientRect() : { width: 0, height: 0 };
    return { id: el.id, width: r.width, height: r.height };
  })"""
# Markdown text outside KaTeX's output that still holds a math delimiter.
RAW_MATH = """() => Array.from(document.querySelectorAll(".jp-MarkdownOutput"))
  .map((el) => {
    const copy = el.cloneNode(true);
    copy.querySelectorAll(".katex").forEach((k) => k.remove());
    return copy.textContent;
  })
  .filter((t) => /\\$\\$|\\\\[([]|\\\\begin\\{/.test(t))"""


def unavailable(reason: str) -> None:
    """Skip locally; fail under CI, where everything must be present."""
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


def require_site() -> None:
    """Stop the test when site/ was not built."""
    if not (SITE / "index.html").is_file():
        unavailable("site/ is not built: run `make html` first")


def meta(page, name: str) -> int:
    """An integer <meta> that tools/build_site.py wrote into the page."""
    value = page.get_attribute(f'meta[name="{name}"]', "content")
    return int(value or 0)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """A static file handler that keeps its request log to itself."""

    def log_message(self, format, *args):
        """Log nothing."""


@pytest.fixture(scope="module")
def server():
    """site/ served over http on 127.0.0.1; yields the base URL."""
    require_site()
    handler = functools.partial(QuietHandler, directory=str(SITE))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium, driven by Playwright."""
    if not CHROMIUM.exists():
        unavailable(f"no Chromium at {CHROMIUM}: run `make browser`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed: run `make setup`")
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS
        )
        yield chromium
        chromium.close()


def test_index_lists_every_notebook():
    """The index links every notebook's page once, in reading order, and
    every page it links was written."""
    require_site()
    index = (SITE / "index.html").read_text(encoding="utf-8")
    links = re.findall(r'<a href="(\d\d_[^"]+)\.html"', index)
    notebooks = sorted(p.stem for p in ROOT.glob("notebooks/[0-9][0-9]_*.py"))
    assert links == notebooks, "stale site: run `make html` again"
    missing = [
        f"{n}.html" for n in links if not (SITE / f"{n}.html").is_file()
    ]
    assert not missing, f"index links pages that were not built: {missing}"


@pytest.mark.parametrize("name", PAGES)
def test_page_fetches_nothing_remote(name):
    """No <script>, <link> or <img> points at http(s): no CDN at view time."""
    text = (SITE / name).read_text(encoding="utf-8")
    match = REMOTE.search(text)
    if match:
        near = text[max(match.start() - 80, 0) : match.end() + 80]
        pytest.fail(f"{name} fetches from another host near: {near!r}")


@pytest.mark.parametrize("name", PAGES)
def test_page_in_chromium(name, server, browser):
    """The page renders without errors, with its charts and math."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors, remote = [], []
    page.on(
        "console",
        lambda m: errors.append(m.text) if m.type == "error" else None,
    )
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.on(
        "response",
        lambda r: (
            errors.append(f"HTTP {r.status}: {r.url}")
            if r.status >= 400
            else None
        ),
    )
    page.on(
        "requestfailed",
        lambda r: errors.append(f"request failed: {r.url} {r.failure}"),
    )

    def local_only(route):
        """Let requests to 127.0.0.1 through; record and abort the rest."""
        if urlparse(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            remote.append(route.request.url)
            route.abort()

    page.route("**/*", local_only)
    try:
        page.goto(server + name, wait_until="load")
        if name != "index.html":
            page.wait_for_function(
                "document.body.dataset.siteReady === 'true'", timeout=60_000
            )
        page.evaluate("document.fonts.ready.then(() => true)")
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=SHOTS / f"{name[:-5]}.png", full_page=True)

        assert not remote, f"requests left the machine: {remote}"
        assert not errors, f"console errors: {errors}"
        if name == "index.html":
            return
        charts = page.evaluate(CHART_SIZES)
        assert len(charts) == meta(page, "at-charts")
        empty = [c["id"] for c in charts if not (c["width"] and c["height"])]
        assert not empty, f"charts drawn with no <svg>/<canvas>: {empty}"
        if meta(page, "at-math"):
            assert page.locator(".katex").count() > 0, "no math typeset"
        assert page.locator(".katex-error").count() == 0, "KaTeX errors"
        raw = page.evaluate(RAW_MATH)
        assert not raw, f"math left untypeset: {raw[:3]}"
    finally:
        context.close()
