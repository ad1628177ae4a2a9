"""Chart plumbing lives in the appendix ("## Charts" in 06_tools.py): no
lesson exports code that needs a plotting library."""

import re
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted(ROOT.glob("notebooks/0[1-5]_*.py"))
PLOTTING = re.compile(
    r"^\s*(import|from)\s+(altair|pandas|vl_convert)\b", re.M
)


def export_cells(path):
    """The source of every code cell marked for export."""
    notebook = jupytext.read(path)
    return [
        cell.source
        for cell in notebook.cells
        if cell.cell_type == "code" and cell.source.startswith("#| export")
    ]


def test_no_lesson_exports_plotting_code():
    problems = [
        f"{path.name}: {match.group(0).strip()}"
        for path in LESSONS
        for source in export_cells(path)
        for match in PLOTTING.finditer(source)
    ]
    assert LESSONS and not problems, problems


def test_the_check_sees_an_import_inside_a_function():
    source = "#| export\ndef f():\n    import altair as alt\n"
    assert PLOTTING.search(source)
    assert not PLOTTING.search("#| export\nimport torch\n")


def test_charts_section_comes_right_after_the_appendix_intro():
    text = (ROOT / "notebooks" / "06_tools.py").read_text()
    headings = re.findall(r"^# (##? .+)$", text, re.M)  # levels 1 and 2
    assert headings[:2] == ["# Appendix: the machinery", "## Charts"]
