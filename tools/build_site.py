"""Execute every notebook CI-sized and render the tutorial into site/.

    python tools/build_site.py                # execute, then render site/
    python tools/build_site.py --no-execute   # re-render from runs/site/
    make html                                 # the same as the first line

Each ``notebooks/NN_*.py`` is read with jupytext and executed once with
nbclient, from ``notebooks/`` and with ``AT_SIZE=ci``, as nbmake does.
The executed copies go to ``runs/site/`` and the pages to ``site/``:
``index.html`` lists the notebooks in reading order, titled by each
notebook's first markdown heading. The site loads nothing from the
internet; open it with ``python -m http.server -d site``.

Decisions:

* Charts. Before a notebook's first cell, the kernel silently registers
  and enables an altair renderer that emits the bare Vega-Lite JSON
  (``application/vnd.vegalite.vN+json``); altair's default renderer emits
  HTML that loads Vega from a CDN, and altair 6's own "mimetype" renderer
  uses a MIME type (``.v6.json``) that nbformat rejects. This script
  replaces each Vega-Lite output with a ``<div class="at-chart">`` and its
  spec, and ``static/vega/vega-bundle.js`` (Vega, Vega-Lite and
  vega-embed, bundled offline by ``vl_convert.javascript_bundle``) draws
  them in the browser as SVG. Notebooks need do nothing: a chart is the
  last expression of a cell, or is passed to ``display``. They must not
  enable an altair renderer themselves.
* Math. KaTeX, from the npm package pinned in ``tools/web/package.json``
  (installed with ``npm ci``), is copied into ``static/katex``; its
  auto-render typesets ``$..$``, ``$$..$$`` and ``\\begin{equation}``
  (or align, gather) in markdown cells. Write ``\\\\(..\\\\)`` rather than
  ``\\(..\\)``: markdown reads ``\\(`` as an escaped parenthesis, here as in
  Jupyter.
* Pages. nbconvert's lab template, which highlights code with pygments,
  without its CDN scripts (require.js, MathJax, mermaid, widgets).
  Widget outputs, such as tqdm.auto's bars, are dropped: they need a
  widget manager from a CDN. A page that still points at http(s) script
  or stylesheet stops the build.
"""

from __future__ import annotations

import argparse
import copy
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import jupytext
import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export import attach_diagrams  # noqa: E402  (tools/export.py)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SITE = ROOT / "site"
RUNS = ROOT / "runs" / "site"
ASSETS = Path(__file__).resolve().parent / "web"
SITE_TITLE = "The Annotated Transformer, done right"

ALTAIR_SETUP = """\
try:
    import altair as _alt
except ImportError:
    pass
else:
    def _at_site_renderer(
        spec,
        _mime="application/vnd.vegalite.v%s+json"
        % _alt.SCHEMA_VERSION.lstrip("v").split(".")[0],
        **metadata,
    ):
        return {_mime: spec, "text/plain": "<altair chart>"}

    _alt.renderers.register("at_site", _at_site_renderer)
    _alt.renderers.enable("at_site")
    del _alt, _at_site_renderer
"""
VEGALITE_MIME = re.compile(r"application/vnd\.vegalite\.v\d+[.+]json")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
MATH = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$|\\\(|\\\[|\\begin\{", re.DOTALL)
# A script, stylesheet, image or frame fetched from another host.
REMOTE = re.compile(
    r"<(?:script|link|img|iframe|source)\b[^>]*?\b(?:src|href)\s*=\s*"
    r"[\"']?(?:https?:)?//|@import\s+(?:url\()?[\"']?https?:",
    re.IGNORECASE,
)

PAGE_TEMPLATE = """\
{%- extends 'index.html.j2' -%}
{% block html_head_js_requirejs %}{% endblock %}
{% block jupyter_widgets %}{% endblock %}
{% block html_head_js_mermaidjs %}{% endblock %}
{% block html_head_js_mathjax %}
<link rel="icon" href="data:,">
<meta name="at-math" content="{{ resources.site.math }}">
<meta name="at-charts" content="{{ resources.site.charts }}">
<link rel="stylesheet" href="static/katex/katex.min.css">
<link rel="stylesheet" href="static/site.css">
<script defer src="static/katex/katex.min.js"></script>
<script defer src="static/katex/contrib/auto-render.min.js"></script>
{% if resources.site.charts %}
<script defer src="static/vega/vega-bundle.js"></script>
{% endif %}
<script defer src="static/site.js"></script>
{% endblock %}
{% block body_header %}
{{ super() }}
{{ resources.site.nav }}
<p class="at-provenance">{{ resources.site.provenance }}</p>
{% endblock %}
{% block body_footer %}
{{ resources.site.nav }}
{{ super() }}
{% endblock %}
"""

INDEX_TEMPLATE = """\
<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>{title}</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="static/site.css">
</head>
<body class="at-index">
<main>
<h1>{title}</h1>
<p>The notebooks, in reading order, executed with {size}.</p>
<ol class="at-toc">
{items}
</ol>
</main>
</body>
</html>
"""

SITE_CSS = """\
.at-nav { display: flex; gap: 1.5em; justify-content: center;
  padding: 0.6em; font: 15px system-ui, sans-serif;
  border-bottom: 1px solid #ddd; background: #fafafa; }
.at-nav a { text-decoration: none; color: #1a5fb4; }
.at-nav a:hover { text-decoration: underline; }
main + .at-nav { border-top: 1px solid #ddd; border-bottom: none; }
.at-index main { max-width: 46em; margin: 3em auto; padding: 0 1em;
  font: 17px/1.5 system-ui, sans-serif; }
.at-toc li { margin: 0.4em 0; }
.at-toc a { color: #1a5fb4; text-decoration: none; }
.at-toc .at-file { color: #777; font-size: 0.85em; margin-left: 0.5em; }
.at-provenance { background: #f4f6fa; border-left: 3px solid #1a5fb4;
  padding: 0.4em 0.8em; font-size: 0.9em; }
.at-chart { min-height: 1em; }
"""

SITE_JS = """\
// Typeset math, then draw charts; mark <body data-site-ready> when done.
(function () {
  "use strict";
  var envs = ["equation", "equation*", "align", "align*", "alignat",
              "alignat*", "gather", "gather*", "CD"];
  var delimiters = [
    { left: "$$", right: "$$", display: true },
    { left: "\\\\[", right: "\\\\]", display: true },
    { left: "$", right: "$", display: false },
    { left: "\\\\(", right: "\\\\)", display: false },
  ].concat(envs.map(function (env) {
    return { left: "\\\\begin{" + env + "}",
             right: "\\\\end{" + env + "}", display: true };
  }));
  function renderMath() {
    if (!window.renderMathInElement) {
      return;
    }
    var cells = document.querySelectorAll(".jp-MarkdownOutput");
    cells.forEach(function (el) {
      window.renderMathInElement(el, {
        delimiters: delimiters,
        throwOnError: false,
      });
    });
  }
  function drawCharts() {
    var charts = document.querySelectorAll("div.at-chart");
    var done = Array.prototype.map.call(charts, function (el) {
      var spec = JSON.parse(
        document.getElementById(el.id + "-spec").textContent
      );
      return window
        .vegaEmbed(el, spec, {
          renderer: "svg",
          actions: { export: true, source: false, compiled: false,
                     editor: false },
        })
        .then(function () {
          el.dataset.rendered = "true";
        })
        .catch(function (err) {
          el.dataset.rendered = "error";
          console.error("chart " + el.id + " failed: " + err);
        });
    });
    return Promise.all(done);
  }
  function main() {
    try {
      renderMath();
    } catch (err) {
      console.error("math failed: " + err);
    }
    drawCharts().then(function () {
      document.body.dataset.siteReady = "true";
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", main);
  } else {
    main();
  }
})();
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line options."""
    p = argparse.ArgumentParser(
        description="Execute the notebooks and render them into a static "
        "website that works offline.",
    )
    p.add_argument(
        "--notebooks",
        type=Path,
        default=NOTEBOOKS,
        help="folder of NN_*.py notebooks (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=SITE,
        help="site folder to write (default: %(default)s)",
    )
    p.add_argument(
        "--runs",
        type=Path,
        default=RUNS,
        help="folder for executed .ipynb (default: %(default)s)",
    )
    p.add_argument(
        "--size",
        default="ci",
        help="AT_SIZE for the notebooks (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=int,
        default=1500,
        help="seconds per cell, as nbmake (default: %(default)s)",
    )
    p.add_argument(
        "--no-execute",
        action="store_true",
        help="render the executed copies under --runs again",
    )
    return p.parse_args(argv)


def notebook_sources(folder: Path) -> list[Path]:
    """The percent-format notebooks, in reading order."""
    return sorted(folder.glob("[0-9][0-9]_*.py"))


def execute(source: Path, runs: Path, timeout: int) -> nbformat.NotebookNode:
    """Run a notebook from its folder; save and return the executed copy."""
    from nbclient import NotebookClient
    from nbclient.exceptions import (
        CellExecutionError,
        CellTimeoutError,
        DeadKernelError,
    )

    nb = jupytext.read(source)
    attach_diagrams(nb, source.parent)
    client = NotebookClient(nb, timeout=timeout, record_timing=True)

    async def enable_json_charts(notebook):
        """Make altair emit Vega-Lite JSON rather than CDN-loading HTML."""
        reply = await client.kc.execute_interactive(
            ALTAIR_SETUP, silent=True, store_history=False, timeout=120
        )
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"chart setup failed: {reply['content']}")

    client.on_notebook_start = enable_json_charts
    out = runs / f"{source.stem}.ipynb"
    runs.mkdir(parents=True, exist_ok=True)
    try:
        client.execute(cwd=str(source.parent))
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
        nbformat.write(nb, out)
        sys.exit(
            f"{source.name}: {failed_cell(nb)} failed "
            f"(partial run in {out}):\n{err}"
        )
    nbformat.write(nb, out)
    return nb


def failed_cell(nb: nbformat.NotebookNode) -> str:
    """Name the code cell that raised: its number and first line."""
    number = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        number += 1
        if any(o.get("output_type") == "error" for o in cell.outputs):
            first = cell.source.strip().splitlines()[0][:60]
            return f"code cell {number} ({first!r})"
    return "a cell (timeout or dead kernel)"


def first_heading(nb: nbformat.NotebookNode, default: str) -> str:
    """The text of the notebook's first markdown heading, minus * and `."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            match = HEADING.search(cell.source)
            if match:
                return re.sub(r"[*`]", "", match.group(1)).strip()
    return default


def math_count(nb: nbformat.NotebookNode) -> int:
    """How many formulas the markdown cells hold (roughly)."""
    return sum(
        len(MATH.findall(cell.source))
        for cell in nb.cells
        if cell.cell_type == "markdown"
    )


def chart_html(spec: dict, chart_id: str) -> str:
    """A placeholder div and the spec that static/site.js draws into it."""
    data = json.dumps(spec, separators=(",", ":"))
    for char, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
    ):
        data = data.replace(char, escaped)
    return (
        f'<div class="at-chart" id="{chart_id}"></div>\n'
        f'<script type="application/json" id="{chart_id}-spec">'
        f"{data}</script>\n"
    )


def embed_charts(nb: nbformat.NotebookNode) -> list[str]:
    """Swap Vega-Lite outputs for chart placeholders; return the schemas."""
    schemas = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            key = next((k for k in data if VEGALITE_MIME.fullmatch(k)), None)
            if key is None:
                continue
            spec = data[key]
            if isinstance(spec, str):
                spec = json.loads(spec)
            schemas.append(spec.get("$schema", ""))
            output["data"] = {
                "text/html": chart_html(spec, f"at-chart-{len(schemas)}")
            }
    return schemas


def drop_colab_badge(nb: nbformat.NotebookNode) -> None:
    """Remove the "Open in Colab" badge cell: its image is on another host,
    and a reader of the site is not in Colab."""
    nb.cells = [
        c
        for c in nb.cells
        if not (
            c.cell_type == "markdown"
            and "colab.research.google.com" in c.source
        )
    ]


def drop_widgets(nb: nbformat.NotebookNode) -> None:
    """Remove widget outputs and state: they need a CDN widget manager."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if "outputs" in cell:
            cell.outputs = [
                o for o in cell.outputs if WIDGET_MIME not in o.get("data", {})
            ]


def vegalite_version(schemas: list[str]) -> str | None:
    """The bundled Vega-Lite version closest to the newest schema used."""
    import vl_convert as vlc

    wanted = []
    for schema in schemas:
        match = re.search(r"/v(\d+)\.(\d+)", schema)
        if match:
            wanted.append((int(match[1]), int(match[2])))
    if not wanted:
        return None
    major, minor = max(wanted)
    have = [tuple(map(int, v.split("."))) for v in vlc.get_vegalite_versions()]
    same = [v for v in have if v[0] == major]
    older = [v for v in same if v[1] <= minor]
    best = max(older or same or have)
    return f"{best[0]}.{best[1]}"


def write_vega_bundle(static: Path, version: str | None) -> None:
    """Write Vega, Vega-Lite and vega-embed as one classic script."""
    import vl_convert as vlc

    bundle = vlc.javascript_bundle(vl_version=version)
    (static / "vega").mkdir(parents=True, exist_ok=True)
    text = f"// Vega-Lite {version or 'latest'} via vl-convert\n(() => {{\n"
    (static / "vega" / "vega-bundle.js").write_text(
        text + bundle + "\n})();\n", encoding="utf-8"
    )


def katex_dist() -> Path:
    """KaTeX's dist folder, installed with `npm ci` when missing."""
    dist = ASSETS / "node_modules" / "katex" / "dist"
    if not dist.is_dir():
        npm = shutil.which("npm")
        if npm is None:
            sys.exit("npm not found: it installs KaTeX for the site's math")
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=ASSETS,
            check=True,
        )
    return dist


def write_static(static: Path) -> None:
    """Copy KaTeX and write the site's own CSS and JavaScript."""
    dist = katex_dist()
    katex = static / "katex"
    katex.mkdir(parents=True, exist_ok=True)
    for name in ("katex.min.js", "katex.min.css"):
        shutil.copy2(dist / name, katex / name)
    (katex / "contrib").mkdir(exist_ok=True)
    shutil.copy2(
        dist / "contrib" / "auto-render.min.js",
        katex / "contrib" / "auto-render.min.js",
    )
    shutil.copytree(dist / "fonts", katex / "fonts", dirs_exist_ok=True)
    (static / "site.css").write_text(SITE_CSS, encoding="utf-8")
    (static / "site.js").write_text(SITE_JS, encoding="utf-8")


def nav_html(pages: list[tuple[str, str]], i: int) -> str:
    """Links to the previous page, the contents and the next page."""
    links = []
    if i > 0:
        name, title = pages[i - 1]
        links.append(f'<a href="{name}.html">&larr; {html.escape(title)}</a>')
    links.append('<a href="index.html">Contents</a>')
    if i + 1 < len(pages):
        name, title = pages[i + 1]
        links.append(f'<a href="{name}.html">{html.escape(title)} &rarr;</a>')
    return f'<nav class="at-nav">{" ".join(links)}</nav>'


def exporter():
    """nbconvert's lab HTML exporter with this site's head and navigation."""
    from nbconvert import HTMLExporter

    loader = jinja2.DictLoader({"at_site.html.j2": PAGE_TEMPLATE})
    return HTMLExporter(
        template_name="lab",
        template_file="at_site.html.j2",
        extra_loaders=[loader],
        embed_images=True,
    )


def check_offline(page: str, name: str) -> None:
    """Stop the build when a page fetches anything from another host."""
    match = REMOTE.search(page)
    if match:
        start = max(match.start() - 80, 0)
        sys.exit(
            f"{name} loads from the internet near: "
            f"{page[start : match.end() + 80]!r}\n"
            "Display altair charts without enabling a renderer."
        )


SIZES = {
    "ci": "AT_SIZE=ci (small models, trained in minutes)",
    "full": "AT_SIZE=full (full-size models)",
}
# How a notebook names a checkpoint it loaded: print("model:", describe_...)
MODEL_LINE, MODEL_MARK = "model: ", ".pt, preset "


def models_used(nb) -> list[str]:
    """The `model: ...` lines a notebook printed, in order, once each."""
    found = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") != "stream":
                continue
            for line in output.get("text", "").splitlines():
                named = line.startswith(MODEL_LINE) and MODEL_MARK in line
                if named and line not in found:
                    found.append(line)
    return [line.removeprefix(MODEL_LINE) for line in found]


def provenance(nb, size: str) -> str:
    """One sentence for the top of a page: what produced its outputs."""
    where = html.escape(SIZES.get(size, f"AT_SIZE={size}"))
    models = models_used(nb)
    if not models:
        return (
            f"Outputs on this page were computed with {where}; it loads no "
            "checkpoint: every model on it is built or trained right here."
        )
    listed = "; ".join(html.escape(m) for m in models)
    return f"Outputs on this page were computed with {where}, by: {listed}."


def render_pages(notebooks, sources, out: Path, size="ci") -> list[str]:
    """Write one page per notebook; return the Vega-Lite schemas used."""
    pages = [
        (s.stem, first_heading(nb, s.stem))
        for s, nb in zip(sources, notebooks, strict=True)
    ]
    export, schemas = exporter(), []
    for i, (nb, source) in enumerate(zip(notebooks, sources, strict=True)):
        nb = copy.deepcopy(nb)
        drop_widgets(nb)
        drop_colab_badge(nb)
        charts = embed_charts(nb)
        schemas += charts
        nb.metadata["title"] = pages[i][1]
        site = {
            "nav": nav_html(pages, i),
            "math": math_count(nb),
            "charts": len(charts),
            "provenance": provenance(nb, size),
        }
        resources = {"site": site, "metadata": {"path": str(source.parent)}}
        body, _ = export.from_notebook_node(nb, resources=resources)
        check_offline(body, source.stem)
        body = body.replace('src="../docs/', 'src="docs/')  # main() copies
        (out / f"{source.stem}.html").write_text(body, encoding="utf-8")
        print(
            f"  {source.stem}.html: {pages[i][1]!r}, "
            f"{len(charts)} charts, {site['math']} formulas"
        )
    items = "\n".join(
        f'<li><a href="{name}.html">{html.escape(title)}</a>'
        f'<span class="at-file">{name}</span></li>'
        for name, title in pages
    )
    index = INDEX_TEMPLATE.format(
        title=SITE_TITLE,
        items=items,
        size=html.escape(SIZES.get(size, f"AT_SIZE={size}")),
    )
    (out / "index.html").write_text(index, encoding="utf-8")
    return schemas


def clean(out: Path) -> None:
    """Remove the pages and static files of an earlier build."""
    out.mkdir(parents=True, exist_ok=True)
    for page in out.glob("*.html"):
        page.unlink()
    shutil.rmtree(out / "static", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Build the site."""
    args = parse_args(argv)
    os.environ["AT_SIZE"] = args.size
    sources = notebook_sources(args.notebooks)
    if not sources:
        sys.exit(f"no NN_*.py notebooks in {args.notebooks}")
    notebooks = []
    for source in sources:
        if args.no_execute:
            notebooks.append(
                nbformat.read(args.runs / f"{source.stem}.ipynb", as_version=4)
            )
        else:
            print(f"executing {source.name} (AT_SIZE={args.size})", flush=True)
            start = time.perf_counter()
            notebooks.append(execute(source, args.runs, args.timeout))
            print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
    clean(args.out)
    print(f"rendering {len(notebooks)} pages into {args.out}")
    schemas = render_pages(notebooks, sources, args.out, args.size)
    static = args.out / "static"
    write_static(static)
    images = args.out / "docs"  # pictures a lesson shows from ../docs/
    images.mkdir(exist_ok=True)
    for picture in (ROOT / "docs").glob("*.png"):
        shutil.copy2(picture, images / picture.name)
    if schemas:
        write_vega_bundle(static, vegalite_version(schemas))
    print(f"open it with: python -m http.server -d {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
