"""The front page and docs/: every file they show or link exists, every
section they link to is there, and every score in their tables is found
in a results file they link."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def local_links(markdown):
    """Paths that Markdown links and <img> tags point at in the repo."""
    targets = re.findall(r"\]\(([^)\s]+)\)", markdown)
    targets += re.findall(r"<img src=\"([^\"]+)\"", markdown)
    return [t for t in targets if not re.match(r"[a-z]+:|#", t)]


def page_anchors(markdown):
    """GitHub's anchors for a page's headings (code blocks skipped)."""
    markdown = re.sub(r"```.*?```", "", markdown, flags=re.S)
    anchors = set()
    for title in re.findall(r"^#{1,6} (.+)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower())
        anchors.add(slug.replace(" ", "-"))
    return anchors


def relative(page):
    """A page's path in the repository (its name, outside it)."""
    try:
        return page.relative_to(ROOT).as_posix()
    except ValueError:
        return page.name


def broken_links(page):
    """Links of a page whose file, or whose #section, is missing."""
    problems = []
    for target in local_links(page.read_text()):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve()
        if not file.exists():
            try:
                name = file.relative_to(ROOT).as_posix()
            except ValueError:  # points outside the repository
                name = target
            problems.append(f"{relative(page)}: {name}")
        elif anchor and file.suffix == ".md":
            if anchor not in page_anchors(file.read_text()):
                problems.append(f"{relative(page)}: {target} (no section)")
    return problems


def table_scores(markdown):
    """Decimal numbers that fill a table cell on their own, bold or not."""
    cells = re.findall(r"(?<=\|) \**(\d+\.\d+)\** (?=\|)", markdown)
    return set(cells)


def unrecorded_scores(page):
    """Table numbers of a page that no results file it links contains."""
    text = page.read_text()
    records = ""
    for target in local_links(text):
        file = (page.parent / target.partition("#")[0]).resolve()
        if file.is_file() and file.parent.name in ("results", "bench"):
            records += file.read_text()
    return sorted(s for s in table_scores(text) if s not in records)


def test_the_pages_are_there():
    names = {relative(p) for p in PAGES}
    for name in (
        "README.md",
        "docs/cli.md",
        "docs/results.md",
        "docs/changes-since-2022.md",
    ):
        assert name in names


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_every_file_and_section_a_page_links_exists(page):
    assert broken_links(page) == []


def test_the_readme_shows_the_trained_model_and_links_every_doc():
    links = local_links((ROOT / "README.md").read_text())
    assert "docs/trained_attention.png" in links
    docs = {relative(p) for p in PAGES[1:]}
    assert docs <= {t.partition("#")[0] for t in links}


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_every_score_in_a_table_is_in_a_linked_results_file(page):
    assert unrecorded_scores(page) == []


def test_the_readme_library_example_runs():
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    # greedy_decode writes max_len=10 ids, the first the start symbol 0
    ids = [int(i) for i in re.findall(r"\d+", proc.stdout)]
    assert len(ids) == 10 and ids[0] == 0, proc.stdout


def unrendered_links(markdown):
    """Link or image syntax that CommonMark leaves as text: a reference
    whose definition it did not find, or a malformed inline link."""
    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark").render(markdown)
    html = re.sub(r"<(pre|code)>.*?</\1>", "", html, flags=re.S)
    return re.findall(r"!?\[[^\]<>]+\](?:\[[^\]]*\]|\([^)]*\))", html)


def markdown_cells(notebook):
    """The text of each markdown cell of an .ipynb."""
    cells = json.loads(notebook.read_text())["cells"]
    markdown = [c for c in cells if c["cell_type"] == "markdown"]
    return ["".join(c["source"]) for c in markdown]


@pytest.mark.parametrize("page", [*PAGES, *NOTEBOOKS], ids=relative)
def test_every_link_and_picture_renders(page):
    if page.suffix == ".ipynb":
        texts = markdown_cells(page)
    else:
        texts = [page.read_text()]
    left = [link for text in texts for link in unrendered_links(text)]
    assert not left, left


def test_the_readme_keeps_no_lesson_statistics():
    readme = (ROOT / "README.md").read_text()
    assert "prose : code" not in readme
    assert "| lines |" not in readme


def test_the_checks_can_fail(tmp_path):
    assert local_links('[a](gone.md) <img src="x.svg"> [b](#here)') == [
        "gone.md",
        "x.svg",
    ]
    assert page_anchors("# What `translate` does\n```\n# no\n```\n") == {
        "what-translate-does"
    }
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.md").write_text("BLEU 37.51\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[run](results/run.md) [x](results/run.md#nowhere) [y](gone.md)\n"
        "| a | **37.51** | 38.14 | 7 |\n"
    )
    assert unrecorded_scores(page) == ["38.14"]
    problems = broken_links(page)
    assert any("gone.md" in p for p in problems)
    assert any("#nowhere (no section)" in p for p in problems)
    broken = "![chart][c]\n\n[c]: a.png [g]:\nhttps://x.org/a.png\n"
    assert unrendered_links(broken) == ["![chart][c]"]
    fixed = "![chart][c]\n\n[c]: a.png\n[g]: https://x.org/a.png\n"
    assert unrendered_links(fixed + "`x[0][1]`") == []
