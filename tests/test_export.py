"""The generated modules' layout: the lessons' module and the appendix's
tools module on top of it, hoisted imports, sections that point back at the
notebooks, an honest ``__all__`` at the end, and lessons that never reach
forward."""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import export  # noqa: E402

MODULE = ROOT / "the_annotated_transformer.py"
TOOLS = ROOT / "annotated_transformer_tools.py"
BOTH = [MODULE, TOOLS]


def module_tree(path=MODULE):
    return ast.parse(path.read_text())


def imported_modules(tree):
    """Every module an import statement anywhere in the tree names."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module)
    return found


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


global_references = export.global_references


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


def test_a_module_level_comprehension_variable_is_not_a_global_read():
    # Python 3.12 lists `name` in the module's own symbol table (PEP 709),
    # which made `make check-sync` fail there with "undefined names". This
    # can fail only on Python 3.12 and later; before, symtable kept the
    # comprehension's names in a table of its own.
    code = 'X = {f"{name}-b": 1 for name in ("a",)}\nY = [z for z in W]\n'
    assert global_references(code) == {"W"}
    inner = "def f():\n    return [v for v in V]\n"
    assert global_references(inner) == {"V"}


@pytest.mark.skipif(
    sys.version_info >= (3, 12),
    reason="3.12 merges a module-level comprehension's names into the module",
)
def test_a_real_read_of_a_comprehension_name_is_still_seen():
    # Before 3.12 the exemption is off: `n` read outside its comprehension
    # is an undefined global, and is reported.
    assert global_references("X = [n for n in R]\nprint(n)\n") >= {"n", "R"}


@pytest.mark.parametrize("path", BOTH, ids=lambda p: p.stem)
def test_imports_are_hoisted_to_the_top(path):
    body = module_tree(path).body
    if isinstance(body[1], ast.If):  # the script's Ctrl-C guard
        body = body[:1] + body[2:]
    kinds = [isinstance(n, (ast.Import, ast.ImportFrom)) for n in body]
    first_other = kinds.index(False, 1)  # after the docstring
    assert any(kinds[:first_other])
    assert not any(kinds[first_other:]), "an import below the top block"


def test_split_imports_moves_only_top_level_imports():
    imports = []
    block = (
        "import math\nfrom torch import nn\n\n\n"
        "def f():\n    import altair\n    return math.pi\n"
    )
    rest = export.split_imports(block, imports)
    assert rest.startswith("def f():") and "import altair" in rest
    assert imports == ["import math", "from torch import nn"]


def test_ruff_sorts_and_merges_the_hoisted_imports():
    text = (
        "import sys\nfrom torch import nn\n"
        "import os\nfrom torch import Tensor\n"
    )
    fixed = export.ruff_fix(text + "\nx = 1\n", TOOLS)
    assert (
        fixed
        == "import os\nimport sys\n\nfrom torch import Tensor, nn\n\nx = 1\n"
    )


def test_tools_module_imports_the_lesson_module_never_the_reverse():
    assert "the_annotated_transformer" in imported_modules(module_tree(TOOLS))
    lesson = imported_modules(module_tree(MODULE))
    assert "annotated_transformer_tools" not in lesson


def test_the_import_of_lesson_names_is_generated():
    lessons = export.Module(
        imports=["import math"], body=["A = 1\n\ndef f():\n    return 2"]
    )
    tools = export.Module(
        imports=["import os"],
        body=["def g():\n    return f() + A + math.pi + len(os.sep)"],
    )
    assert export.lesson_imports(tools, lessons) == [
        "import math",
        "from the_annotated_transformer import A, f",
    ]
    tools.body.append("def h():\n    return nowhere()")
    with pytest.raises(SystemExit, match="nowhere"):
        export.lesson_imports(tools, lessons)


def test_public_names_include_tuple_assigned_constants():
    code = "BOS, EOS = 0, 1\nX: int = 2\n_hidden = 3\nd = {}\nd['k'] = 4\n"
    assert export.public_names(code) == ["BOS", "EOS", "X", "d"]


def public_top_level_names(tree):
    public = set()
    for node in tree.body:
        public.update(export.bound_names(node))
    return {n for n in public if not n.startswith("_")} - {"main"}


@pytest.mark.parametrize("path", BOTH, ids=lambda p: p.stem)
def test_all_lists_exactly_the_public_top_level_names(path):
    module = importlib.import_module(path.stem)
    public = public_top_level_names(module_tree(path)) - {"__all__"}
    assert set(module.__all__) == public
    assert len(module.__all__) == len(set(module.__all__))


@pytest.mark.parametrize("path", BOTH, ids=lambda p: p.stem)
def test_all_sits_at_the_end(path):
    body = module_tree(path).body
    where = [
        i
        for i, node in enumerate(body)
        if "__all__" in export.bound_names(node)
    ]
    assert len(where) == 1
    after = body[where[0] + 1 :]
    assert all(isinstance(node, ast.If) for node in after), after  # __main__


def test_all_includes_the_names_and_constants_notebooks_import():
    import annotated_transformer_tools as tools
    import the_annotated_transformer as tat

    for name in ("make_model", "run_epoch", "Batch", "greedy_decode"):
        assert name in tat.__all__
    for name in ("BOS", "EOS", "PAD", "UNK", "COPY_PAD", "COPY_START"):
        assert name in tat.__all__, name
    assert "main" not in tools.__all__ and callable(tools.main)
    # every name a notebook's own cells import from either module is public
    pattern = re.compile(
        r"^from (the_annotated_transformer|annotated_transformer_tools) "
        r"import (\([^)]*\)|[^(\n]+)$",  # in parentheses, or on one line
        re.M,
    )
    checked = 0
    for path in export.notebook_sources():
        for module, names in pattern.findall(path.read_text()):
            names = re.sub(r"#[^\n]*", "", names).strip("()").split(",")
            listed = importlib.import_module(module).__all__
            for name in filter(None, (n.strip() for n in names)):
                assert name in listed, (path.name, module, name)
                checked += 1
    assert checked > 100  # 06_tools alone imports 48 in parentheses


def test_sync_check_covers_both_modules():
    assert {MODULE, TOOLS} <= set(export.targets())


@pytest.mark.parametrize("path", BOTH, ids=lambda p: p.stem)
def test_every_section_points_at_a_real_heading(path):
    lines = path.read_text().splitlines()
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
    assert found >= 5


def test_part_1_comes_first_and_holds_no_plumbing():
    text = MODULE.read_text()
    parts = re.findall(r"^# (notebooks/\d\d_\w+\.py)$", text, re.M)
    assert parts[0] == "notebooks/01_model.py"
    assert parts == sorted(parts)
    part1 = text.split("# notebooks/02_")[0].split("# notebooks/01_")[1]
    for word in ("altair", "argparse", "urllib", "socket", "chart"):
        assert word not in part1, word


def test_lesson_stats_command_runs():
    proc = subprocess.run(
        [sys.executable, "tools/lesson_stats.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| 01_model |" in proc.stdout
