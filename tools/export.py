"""Generate the two modules and the .ipynb pairs from notebooks/NN_*.py.

    python tools/export.py           # rewrite the_annotated_transformer.py,
                                     # annotated_transformer_tools.py,
                                     # every notebooks/NN_*.ipynb and the
                                     # repository's address in NN_*.py
    python tools/export.py --check   # exit 1 when anything is out of sync

Only code cells whose first line is ``#| export`` reach a module, in
notebook order. The lessons (notebooks 01-05) make
``the_annotated_transformer.py``; the appendix (06) makes
``annotated_transformer_tools.py``, which imports from the lesson module
the names it uses (found here, never written by hand). In each module the
top-level imports are hoisted into one block, which ruff sorts; ``__all__``
at the end lists every public top-level name; and each notebook ``## ``
section that exports code gets one heading that names the notebook and
section it came from. The repository's address is written once, in
pyproject.toml's ``[project.urls]``; each notebook's Colab badge and
clone line are rewritten from it.
"""

from __future__ import annotations

import argparse
import ast
import base64
import builtins
import copy
import re
import subprocess
import symtable
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
MODULE = ROOT / "the_annotated_transformer.py"
TOOLS = ROOT / "annotated_transformer_tools.py"
LESSONS = ("01", "02", "03", "04", "05")  # the rest is the appendix
EXPORT_MARKER = "#| export"
WIDTH = 79

BANNER = '''\
# =============================================================================
# GENERATED FILE: edit the notebooks, not this file.
# Source: notebooks/01_*.py to 05_*.py (cells starting with "#| export").
# Regenerate with `make export`; `make check-sync` fails on drift.
# =============================================================================
"""The Annotated Transformer, done right: the lessons' code as a module.

The model comes first (Part 1), then its training (Parts 2 and 3), its
attention (Part 4) and what goes beyond the paper (Part 5). Importing it
has no side effects and needs only torch. Each section below names the
notebook and heading that explain it. The command line, downloads and
process launch live in ``annotated_transformer_tools.py``.
"""
'''

TOOLS_BANNER = '''\
# =============================================================================
# GENERATED FILE: edit the notebooks, not this file.
# Source: notebooks/06_tools.py (cells starting with "#| export").
# Regenerate with `make export`; `make check-sync` fails on drift.
# =============================================================================
"""The machinery around the lessons: the appendix's code as a module.

Downloads, presets, process launch, translation for users and the command
line. It imports the lesson module, ``the_annotated_transformer``; the
lesson module never imports it. Run
``python annotated_transformer_tools.py --help`` for the command line.
"""

# Ctrl-C or SIGTERM while torch loads: one line, no traceback; when run as
# a script or as the installed `annotated-transformer` command, never on
# import.
if __name__ == "__main__" or __import__("sys").argv[0].endswith(
    "annotated-transformer"
):
    import os
    import signal

    def _interrupted(signum, frame):
        os.write(2, b"interrupted\\n")
        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)
'''

FOOTER = """

if __name__ == "__main__":
    raise SystemExit(main())
"""


@dataclass
class Section:
    """The exported code under one ``## `` heading of one notebook."""

    notebook: str
    part: str
    heading: str
    blocks: list[str] = field(default_factory=list)


def notebook_sources() -> list[Path]:
    """The percent-format notebooks, in reading order."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def heading_of(markdown: str, level: str) -> str | None:
    """The first heading of the given level (``#`` or ``##``) in a cell."""
    for line in markdown.splitlines():
        if line.startswith(level + " "):
            return line[len(level) + 1 :].strip()
    return None


def export_sections(path: Path) -> list[Section]:
    """A notebook's export cells (marker removed), grouped by section."""
    nb = jupytext.read(path)
    rel = path.relative_to(ROOT).as_posix()
    part, heading = path.stem, "Imports"
    sections: list[Section] = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            part = heading_of(cell.source, "#") or part
            heading = heading_of(cell.source, "##") or heading
            continue
        lines = cell.source.splitlines()
        if cell.cell_type != "code" or not lines:
            continue
        if lines[0].strip() != EXPORT_MARKER:
            continue
        if not sections or sections[-1].heading != heading:
            sections.append(Section(rel, part, heading))
        sections[-1].blocks.append("\n".join(lines[1:]).strip("\n"))
    return sections


# --- hoisting imports ---------------------------------------------------


def split_imports(block: str, imports: list[str]) -> str:
    """Move a block's top-level imports into ``imports``; return the rest.

    The import statements are kept as written; ruff merges and sorts them
    when the module is rendered (see ``ruff_fix``).
    """
    tree = ast.parse(block)
    lines = block.splitlines()
    drop = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(ast.unparse(node))
            drop.update(range(node.lineno - 1, node.end_lineno))
    kept = [line for i, line in enumerate(lines) if i not in drop]
    return "\n".join(kept).strip("\n")


def bound_names(node: ast.stmt) -> list[str]:
    """The names a top-level statement binds (``a, b = ...`` included)."""
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    else:
        return []
    names = []
    for target in targets:
        elements = getattr(target, "elts", [target])  # a, b = ...
        names += [t.id for t in elements if isinstance(t, ast.Name)]
    return names


def public_names(code: str) -> list[str]:
    """Top-level functions, classes and constants not starting with _.

    Tuple assignments count: ``BOS, EOS, PAD, UNK = 0, 1, 2, 3`` binds
    four public constants.
    """
    names = []
    for node in ast.parse(code).body:
        for name in bound_names(node):
            if name not in names and not name.startswith("_"):
                names.append(name)
    return [n for n in names if n != "main"]


def imported_names(imports: list[str]) -> dict[str, str]:
    """Each name the import statements bind, with one statement for it."""
    out = {}
    for statement in imports:
        node = ast.parse(statement).body[0]
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            one = copy.copy(node)
            one.names = [alias]
            out.setdefault(bound, ast.unparse(one))
    return out


def global_references(code: str) -> set[str]:
    """Global names that any scope of the code reads.

    Python 3.12 inlines comprehensions (PEP 709): the loop variable of a
    comprehension at module level shows up in the module's own table, as
    a name read there. It is the comprehension's, so there it is left out
    (and a real read of the same name at module level goes unseen)."""
    seen = set()
    loop_names = set()
    if sys.version_info >= (3, 12):
        loop_names = module_comprehension_targets(ast.parse(code))

    def walk(table):
        module = table.get_type() == "module"
        for sym in table.get_symbols():
            name = sym.get_name()
            if module and name in loop_names:
                continue
            if sym.is_referenced() and (sym.is_global() or module):
                seen.add(name)
        for child in table.get_children():
            walk(child)

    walk(symtable.symtable(code, "<export>", "exec"))
    return seen


def module_comprehension_targets(tree: ast.AST) -> set[str]:
    """Names bound by comprehensions outside every function and class."""
    names = set()
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.comprehension):
            for target in ast.walk(node.target):
                if isinstance(target, ast.Name):
                    names.add(target.id)
        stack += [
            child
            for child in ast.iter_child_nodes(node)
            if not isinstance(child, scopes)
        ]
    return names


def ruff_fix(text: str, path: Path) -> str:
    """Sort the imports (ruff's isort rules) and format, as ruff would."""
    commands = [
        ["check", "--select", "I", "--fix-only", "--quiet"],
        ["format", "--quiet"],
    ]
    for command in commands:
        proc = subprocess.run(
            [sys.executable, "-m", "ruff", *command]
            + ["--stdin-filename", str(path), "-"],
            input=text,
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"ruff {command[0]} failed:\n{proc.stderr}")
        text = proc.stdout
    return text


# --- the modules --------------------------------------------------------


def rule(char: str) -> str:
    return "# " + char * (WIDTH - 2)


def section_header(section: Section, new_part: bool) -> str:
    """The comment lines that open a section (and a notebook)."""
    lines = []
    if new_part:
        lines += [rule("="), f"# {section.part}", rule("="), "", ""]
        lines[-3:-3] = [f"# {section.notebook}"]
    title = textwrap.wrap(section.heading, WIDTH - 2)
    lines += [rule("-"), *(f"# {t}" for t in title)]
    lines += [f"# Explained in {section.notebook}, same heading.", rule("-")]
    return "\n".join(lines)


@dataclass
class Module:
    """One generated module's parts before they are put together."""

    imports: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    @property
    def code(self) -> str:
        return "\n\n\n".join(self.body)


def collect(paths: list[Path]) -> Module:
    """The export cells of some notebooks, imports split off."""
    module, part = Module(), None
    for path in paths:
        for section in export_sections(path):
            code = [split_imports(b, module.imports) for b in section.blocks]
            code = "\n\n\n".join(c for c in code if c)
            if not code:
                continue
            module.names += public_names(code)
            header = section_header(section, section.part != part)
            module.body.append(f"{header}\n{code}")
            part = section.part
    return module


def lesson_imports(tools: Module, lessons: Module) -> list[str]:
    """What the tools module needs from the lesson module and its imports.

    Every global name that the appendix reads but neither defines nor
    imports itself must be a name of the lesson module (imported from it)
    or a name the lessons import (the same import is repeated).
    """
    lesson_tree = ast.parse(lessons.code)
    defined = {n for node in lesson_tree.body for n in bound_names(node)}
    own_tree = ast.parse(tools.code)
    own = {n for node in own_tree.body for n in bound_names(node)}
    own |= set(imported_names(tools.imports))
    wanted = global_references(tools.code) - own - set(dir(builtins))
    lesson_modules = imported_names(lessons.imports)
    out, names, unknown = [], [], []
    for name in sorted(wanted):
        if name in defined:
            names.append(name)
        elif name in lesson_modules:
            out.append(lesson_modules[name])
        else:
            unknown.append(name)
    if unknown:
        raise SystemExit(f"{TOOLS.name} uses undefined names: {unknown}")
    if names:
        out.append(f"from {MODULE.stem} import {', '.join(names)}")
    return out


def render(banner: str, module: Module, footer: str, path: Path) -> str:
    """The text of one generated module: imports, code, ``__all__``."""
    listing = "".join(f'    "{n}",\n' for n in module.names)
    text = f"{banner}\n" + "\n".join(sorted(set(module.imports)))
    text += "\n\n\n" + module.code + "\n\n\n"
    text += "# The public names, for `from ... import *` and the docs.\n"
    text += f"__all__ = [\n{listing}]\n" + footer
    return ruff_fix(text, path)


def is_lesson(path: Path) -> bool:
    return path.name[:2] in LESSONS


def render_modules() -> dict[Path, str]:
    """The text of both generated modules."""
    paths = notebook_sources()
    lessons = collect([p for p in paths if is_lesson(p)])
    tools = collect([p for p in paths if not is_lesson(p)])
    tools.imports += lesson_imports(tools, lessons)
    return {
        MODULE: render(BANNER, lessons, "", MODULE),
        TOOLS: render(TOOLS_BANNER, tools, FOOTER, TOOLS),
    }


ATTACHMENT = re.compile(r"\(attachment:([\w.-]+\.svg)\)")


def attach_diagrams(nb, folder: Path) -> None:
    """Embed each ``![..](attachment:NAME.svg)`` from ``folder/diagrams``.

    A markdown attachment travels inside the .ipynb, so Jupyter, Colab,
    GitHub and nbconvert all show the picture without the repository.
    """
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for name in ATTACHMENT.findall(cell.source):
            svg = (folder / "diagrams" / name).read_bytes()
            data = base64.b64encode(svg).decode("ascii")
            cell.setdefault("attachments", {})[name] = {"image/svg+xml": data}


def render_ipynb(path: Path, text: str) -> str:
    """The .ipynb text that the percent file generates (no outputs)."""
    nb = jupytext.reads(text, fmt="py:percent")
    attach_diagrams(nb, path.parent)
    nb.metadata.setdefault("jupytext", {})["formats"] = "ipynb,py:percent"
    for i, cell in enumerate(nb.cells):  # jupytext draws random ids
        cell.id = f"cell-{i:03d}"
    return jupytext.writes(nb, fmt="ipynb")


# --- the repository's address ------------------------------------------

PYPROJECT = ROOT / "pyproject.toml"
REPO_LINE = re.compile(r'^REPO = "[^"\n]*"$', re.M)
BADGE_LINE = re.compile(
    r"^# \[!\[Open in Colab\]\((?P<image>[^)\n]*)\)\]\([^)\n]*\)$", re.M
)


def repository() -> str:
    """The address in pyproject.toml's [project.urls], the only copy.

    (Read with a pattern: tomllib is not in Python 3.10's library.)
    """
    text = PYPROJECT.read_text()
    urls = text.split("[project.urls]", 1)[-1].split("\n[", 1)[0]
    found = re.findall(r'^Repository = "([^"]+)"$', urls, re.M)
    if len(found) != 1:
        raise SystemExit("pyproject.toml: no Repository in [project.urls]")
    return found[0]


def colab_link(repo: str, stem: str) -> str:
    """Colab's address for opening notebooks/<stem>.ipynb of the repo."""
    github = "https://github.com/"
    if not repo.startswith(github):
        raise SystemExit(f"Colab opens GitHub repositories only, not {repo}")
    path = repo.removeprefix(github).removesuffix(".git")
    return (
        f"https://colab.research.google.com/github/{path}/blob/main/"
        f"notebooks/{stem}.ipynb"
    )


def with_repository(text: str, stem: str, repo: str) -> str:
    """A notebook's source with its clone line and Colab badge on ``repo``.

    The setup cell's ``REPO = "..."`` line and the badge's markdown line
    are the two places that name the repository; each must occur once.
    """
    for pattern, what in ((REPO_LINE, "REPO = ..."), (BADGE_LINE, "badge")):
        if len(pattern.findall(text)) != 1:
            raise SystemExit(f"{stem}.py needs exactly one {what} line")
    text = REPO_LINE.sub(f'REPO = "{repo}"', text)
    link = colab_link(repo, stem)
    return BADGE_LINE.sub(
        lambda m: f"# [![Open in Colab]({m['image']})]({link})", text
    )


def targets() -> dict[Path, str]:
    """Every generated file with the text it should hold."""
    out = render_modules()
    repo = repository()
    for path in notebook_sources():
        text = with_repository(path.read_text(), path.stem, repo)
        out[path] = text
        out[path.with_suffix(".ipynb")] = render_ipynb(path, text)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare instead of writing; exit 1 on any difference",
    )
    args = parser.parse_args(argv)
    stale = []
    for path, text in targets().items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(path.relative_to(ROOT).as_posix())
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print("not in sync (run `make export`): " + ", ".join(stale))
        return 1
    if not args.check:
        print(f"updated: {', '.join(stale) if stale else 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
