"""Unit tests of tools/build_site.py's pieces (no kernel, no browser)."""

from __future__ import annotations

import importlib.util
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import nbformat.v4 as v4
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "build_site", ROOT / "tools" / "build_site.py"
)
build_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_site)

SPEC = {
    "$schema": "https://vega.github.io/schema/vega-lite/v6.4.1.json",
    "mark": "point",
    "title": "a </script><b>tricky</b> & title",
    "data": {"values": [{"x": 1, "y": 2}]},
}


class Scripts(HTMLParser):
    """Collects the text of every <script> element, as a browser would."""

    def __init__(self):
        super().__init__()
        self.scripts, self._open = [], False

    def handle_starttag(self, tag, attrs):
        self._open = tag == "script"
        if self._open:
            self.scripts.append("")

    def handle_endtag(self, tag):
        self._open = False

    def handle_data(self, data):
        if self._open:
            self.scripts[-1] += data


def chart_output(mime: str) -> dict:
    """A display_data output as altair's renderer would send it."""
    return v4.new_output(
        "display_data", data={mime: SPEC, "text/plain": "<altair chart>"}
    )


def test_help_exits_cleanly(capsys):
    """--help prints the usage and exits 0."""
    with pytest.raises(SystemExit) as exc:
        build_site.parse_args(["--help"])
    assert exc.value.code == 0
    assert "--no-execute" in capsys.readouterr().out


def test_chart_html_keeps_the_spec_inside_its_script():
    """A spec holding </script> survives an HTML parser unchanged."""
    parser = Scripts()
    parser.feed(build_site.chart_html(SPEC, "at-chart-1"))
    assert len(parser.scripts) == 1
    assert json.loads(parser.scripts[0]) == SPEC


@pytest.mark.parametrize(
    "mime",
    ["application/vnd.vegalite.v5+json", "application/vnd.vegalite.v6+json"],
)
def test_embed_charts_replaces_vegalite_outputs(mime):
    """Vega-Lite outputs become placeholders; other outputs stay."""
    text = v4.new_output("stream", name="stdout", text="hi\n")
    cell = v4.new_code_cell("chart", outputs=[text, chart_output(mime)])
    nb = v4.new_notebook(cells=[cell])
    assert build_site.embed_charts(nb) == [SPEC["$schema"]]
    assert cell.outputs[0] == text
    assert list(cell.outputs[1].data) == ["text/html"]
    assert 'class="at-chart"' in cell.outputs[1].data["text/html"]


def test_drop_widgets_removes_widget_views_and_state():
    """Widget views and the notebook's widget state are removed."""
    widget = v4.new_output(
        "display_data",
        data={
            "application/vnd.jupyter.widget-view+json": {"model_id": "a"},
            "text/plain": "HBox()",
        },
    )
    text = v4.new_output("stream", name="stdout", text="done\n")
    nb = v4.new_notebook(cells=[v4.new_code_cell("x", outputs=[widget, text])])
    nb.metadata["widgets"] = {"state": {}}
    build_site.drop_widgets(nb)
    assert nb.cells[0].outputs == [text]
    assert "widgets" not in nb.metadata


def test_the_colab_badge_is_dropped_from_site_pages():
    """The badge's image lives on another host; the offline check would
    stop the build on it (as it did), so pages leave that cell out."""
    badge = (
        "[![Open in Colab](https://colab.research.google.com/assets/"
        "colab-badge.svg)](https://colab.research.google.com/github/x/y)"
    )
    nb = v4.new_notebook(
        cells=[v4.new_markdown_cell(badge), v4.new_markdown_cell("# Part")]
    )
    build_site.drop_colab_badge(nb)
    assert [c.source for c in nb.cells] == ["# Part"]


def test_first_heading_and_math_count():
    """The title is the first markdown heading; formulas are counted."""
    nb = v4.new_notebook(
        cells=[
            v4.new_code_cell("# not a heading"),
            v4.new_markdown_cell(
                "Intro, $d_k$ and\n\n## Multi-head *attention*"
            ),
            v4.new_markdown_cell("# Later\n$$QK^T$$ and \\\\(h\\\\)"),
        ]
    )
    assert build_site.first_heading(nb, "x") == "Multi-head attention"
    assert build_site.first_heading(v4.new_notebook(), "x") == "x"
    assert build_site.math_count(nb) == 3


@pytest.mark.parametrize(
    ("page", "remote"),
    [
        ('<script src="https://cdn.jsdelivr.net/npm/vega@6"></script>', True),
        ("<link rel=stylesheet href=//cdnjs.cloudflare.com/k.css>", True),
        ('<img alt="" src="http://example.org/x.png">', True),
        ("<style>@import url('https://fonts.example/x.css');</style>", True),
        ('<script src="static/site.js"></script>', False),
        ('<a href="https://arxiv.org/abs/1706.03762">paper</a>', False),
        ('<link rel="icon" href="data:,">', False),
    ],
)
def test_remote_pattern(page, remote):
    """Remote scripts, styles and images are caught; links are not."""
    assert bool(build_site.REMOTE.search(page)) is remote


def test_vegalite_version_matches_the_schema():
    """The bundle's Vega-Lite version follows the newest schema used."""
    import vl_convert as vlc

    have = vlc.get_vegalite_versions()
    url = "https://vega.github.io/schema/vega-lite/v{}.json"
    assert build_site.vegalite_version([]) is None
    newest5 = max(
        (v for v in have if v.startswith("5.")),
        key=lambda v: int(v.split(".")[1]),
    )
    assert build_site.vegalite_version([url.format("5.999.0")]) == newest5
    assert build_site.vegalite_version([url.format("5.8.0")]) == "5.8"
    got = build_site.vegalite_version(
        [url.format("5.8.0"), url.format("6.4.1")]
    )
    assert got.startswith("6.")


def test_page_template_is_offline_with_katex_and_navigation():
    """A rendered page links local KaTeX and nav, and nothing remote."""
    nb = v4.new_notebook(
        cells=[
            v4.new_markdown_cell("# Title\n$x$"),
            v4.new_code_cell(
                "1 + 1",
                outputs=[chart_output("application/vnd.vegalite.v6+json")],
            ),
        ]
    )
    build_site.embed_charts(nb)
    site = {"nav": '<nav class="at-nav">NAV</nav>', "math": 1, "charts": 1}
    body, _ = build_site.exporter().from_notebook_node(
        nb, resources={"site": site}
    )
    assert build_site.REMOTE.search(body) is None
    assert 'src="static/katex/katex.min.js"' in body
    assert 'src="static/vega/vega-bundle.js"' in body
    assert body.count('<nav class="at-nav">NAV</nav>') == 2
    assert re.search(r'<div class="at-chart" id="at-chart-1">', body)


def test_a_failing_cell_stops_the_build_naming_notebook_and_cell(tmp_path):
    source = tmp_path / "07_broken.py"
    source.write_text(
        "# %% [markdown]\n# # Broken\n\n# %%\nx = 1\n\n"
        "# %%\nraise ValueError('boom')\n\n# %%\nprint('never')\n"
    )
    with pytest.raises(SystemExit) as stop:
        build_site.execute(source, tmp_path / "runs", timeout=120)
    message = str(stop.value)
    assert message.startswith('07_broken.py: code cell 2 ("raise')
    assert "ValueError" in message and "boom" in message
    assert (tmp_path / "runs" / "07_broken.ipynb").exists()


def test_provenance_names_the_models_a_notebook_printed():
    nb = v4.new_notebook()
    stream = v4.new_output(
        "stream",
        name="stdout",
        text="model: checkpoints/cpu/final.pt, preset cpu\nloss 1.2\n"
        "model:  A dog runs.\n",
    )
    again = v4.new_output(
        "stream",
        name="stdout",
        text="model: checkpoints/cpu/final.pt, "
        "preset cpu\nmodel: checkpoints/cpu-bpe/final.pt, preset <b>\n",
    )
    nb.cells = [
        v4.new_code_cell("x", outputs=[stream]),
        v4.new_code_cell("y", outputs=[again]),
    ]
    assert build_site.models_used(nb) == [
        "checkpoints/cpu/final.pt, preset cpu",
        "checkpoints/cpu-bpe/final.pt, preset <b>",
    ]
    line = build_site.provenance(nb, "full")
    assert "AT_SIZE=full" in line and "preset cpu;" in line
    assert "&lt;b&gt;" in line and "<b>" not in line  # escaped
    empty = build_site.provenance(v4.new_notebook(), "ci")
    assert "AT_SIZE=ci" in empty and "loads no checkpoint" in empty
