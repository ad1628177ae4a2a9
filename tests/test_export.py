"""The generated module's layout: hoisted imports, sections that point back
at the notebooks, an honest ``__all__``, lessons that never reach forward,
and notebooks that keep to the lesson targets."""

import ast
import re
import subprocess
import symtable
import sys
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import export  # noqa: E402
import lesson_stats  # noqa: E402

MODULE = ROOT / "the_annotated_transformer.py"


def module_tree():
    return ast.parse(MODULE.read_text())


def defined_names(code):
    """Names bound at the top level of a piece of code."""
    names = set()
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(
                (a.asname or a.name).split(".")[0] for a in node.names
            )
        else:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(
                    sub.ctx, ast.Store
                ):
                    names.add(sub.id)
    return names


def global_references(code):
    """Global names that any scope of the code reads."""
    seen = set()

    def walk(table):
        for sym in table.get_symbols():
            if sym.is_referenced() and (
                sym.is_global() or table.get_type() == "module"
            ):
                seen.add(sym.get_name())
        for child in table.get_children():
            walk(child)

    walk(symtable.symtable(code, "<export>", "exec"))
    return seen


def export_code(path):
    return "\n\n".join(
        block
        for section in export.export_sections(path)
        for block in section.blocks
    )


def test_no_lesson_uses_a_name_from_a_later_notebook():
    paths = export.notebook_sources()
    codes = [export_code(p) for p in paths]
    defined = [defined_names(c) for c in codes]
    problems = []
    for i, (path, code) in enumerate(zip(paths, codes)):
        earlier = set().union(*defined[: i + 1])
        later = set().union(*defined[i + 1 :]) - earlier
        for name in sorted(global_references(code) & later):
            problems.append(f"{path.name} uses {name}")
    assert not problems, problems


def test_the_forward_reference_check_can_fail():
    # A function that calls a name the code never binds is reported.
    refs = global_references("def f():\n    return later_thing(1)\n")
    assert "later_thing" in refs
    assert "x" not in global_references("def f(x):\n    return x\n")


def test_imports_are_hoisted_to_the_top():
    body = module_tree().body
    if isinstance(body[1], ast.If):  # the script's Ctrl-C guard
        body = body[:1] + body[2:]
    kinds = [isinstance(n, (ast.Import, ast.ImportFrom)) for n in body]
    first_other = kinds.index(False, 1)  # after the docstring
    assert any(kinds[:first_other])
    assert not any(kinds[first_other:]), "an import below the top block"


def test_split_imports_moves_only_top_level_imports():
    imports = export.Imports()
    block = (
        "import math\nfrom torch import nn\n\n\n"
        "def f():\n    import altair\n    return math.pi\n"
    )
    rest = export.split_imports(block, imports)
    assert rest.startswith("def f():") and "import altair" in rest
    assert export.Imports.render(imports) == (
        "import math\n\nfrom torch import nn"
    )


def test_all_lists_exactly_the_public_top_level_names():
    import the_annotated_transformer as tat

    tree = module_tree()
    public = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            public.add(node.name)
        elif isinstance(node, ast.Assign):
            public.update(
                t.id for t in node.targets if isinstance(t, ast.Name)
            )
    public = {n for n in public if not n.startswith("_")} - {"main"}
    assert set(tat.__all__) == public
    assert len(tat.__all__) == len(set(tat.__all__))
    for name in ("make_model", "run_epoch", "Batch", "greedy_decode"):
        assert name in tat.__all__


def test_every_section_points_at_a_real_heading():
    lines = MODULE.read_text().splitlines()
    pattern = re.compile(r"# Explained in (notebooks/\S+\.py), same heading")
    found = 0
    for i, line in enumerate(lines):
        match = pattern.match(line)
        if not match:
            continue
        found += 1
        title = []
        j = i - 1
        while not lines[j].startswith("# ---"):
            title.insert(0, lines[j][2:])
            j -= 1
        heading = " ".join(title)
        nb = jupytext.read(ROOT / match.group(1))
        headings = [
            line[3:].strip()
            for cell in nb.cells
            if cell.cell_type == "markdown"
            for line in cell.source.splitlines()
            if line.startswith("## ")
        ]
        assert heading in headings, (match.group(1), heading)
    assert found >= 10


def test_part_1_comes_first_and_holds_no_plumbing():
    text = MODULE.read_text()
    parts = re.findall(r"^# (notebooks/\d\d_\w+\.py)$", text, re.M)
    assert parts[0] == "notebooks/01_model.py"
    assert parts == sorted(parts)
    part1 = text.split("# notebooks/02_")[0].split("# notebooks/01_")[1]
    for word in ("altair", "argparse", "urllib", "socket", "chart"):
        assert word not in part1, word


def test_lessons_keep_to_their_targets():
    stats = [
        lesson_stats.measure(p)
        for p in sorted((ROOT / "notebooks").glob("0[1-5]_*.py"))
    ]
    assert len(stats) == 5
    missed = {s.name: lesson_stats.problems(s) for s in stats}
    assert not any(missed.values()), missed


@pytest.mark.parametrize(
    "source, problem",
    [
        ("# %% [markdown]\n# x\n\n# %%\n" + "a = 1\n" * 41, "41-line"),
        ("# %% [markdown]\n# x\n\n# %%\n" + "a = 1\n" * 30, "prose/code"),
    ],
)
def test_lesson_stats_reports_a_miss(tmp_path, source, problem):
    path = tmp_path / "01_x.py"
    path.write_text(source)
    found = lesson_stats.problems(lesson_stats.measure(path))
    assert any(problem in p for p in found), found


def test_lesson_stats_command_runs():
    proc = subprocess.run(
        [sys.executable, "tools/lesson_stats.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| 01_model |" in proc.stdout


def test_readme_table_lists_every_notebook_as_measured():
    paths = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    stats = [lesson_stats.measure(p) for p in paths]
    readme = (ROOT / "README.md").read_text()
    fresh = lesson_stats.with_readme_table(readme, stats)
    assert fresh == readme, "README's notebook table is stale: make export"
    for s in stats:
        row = f"| [{s.name}](notebooks/{s.name}.ipynb) | {s.title} | "
        assert row + f"{s.lines} | {s.ratio:.2f} |" in readme


def test_readme_table_notices_a_changed_notebook(tmp_path):
    path = tmp_path / "01_x.py"
    path.write_text("# %% [markdown]\n# # Part 1\n\n# %%\na = 1\n")
    stats = [lesson_stats.measure(path)]
    readme = lesson_stats.with_readme_table(
        f"intro\n{lesson_stats.START}\n{lesson_stats.END}\nrest\n", stats
    )
    assert "| Part 1 | 5 | 1.00 |" in readme and readme.endswith("rest\n")
    path.write_text(path.read_text() + "b = 2\n")
    stats = [lesson_stats.measure(path)]
    assert lesson_stats.with_readme_table(readme, stats) != readme


def local_links(markdown):
    """Paths that Markdown links and <img> tags point at in the repo."""
    targets = re.findall(r"\]\(([^)\s]+)\)", markdown)
    targets += re.findall(r"<img src=\"([^\"]+)\"", markdown)
    return [t for t in targets if not re.match(r"[a-z]+:|#", t)]


def test_every_file_the_readme_shows_or_links_exists():
    links = local_links((ROOT / "README.md").read_text())
    assert "docs/trained_attention.png" in links
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert missing == [], missing
    assert local_links('[a](gone.md) <img src="x.svg">') == [
        "gone.md",
        "x.svg",
    ]
