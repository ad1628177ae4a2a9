"""Generate the flat module and the .ipynb pairs from notebooks/NN_*.py.

    python tools/export.py           # rewrite the_annotated_transformer.py
                                     # and every notebooks/NN_*.ipynb
    python tools/export.py --check   # exit 1 when anything is out of sync

Only code cells whose first line is ``#| export`` reach the module, in
notebook order. Their top-level import statements are hoisted, merged and
sorted into one block at the top; an ``__all__`` lists every public
top-level name; and each notebook ``## `` section that exports code gets one
heading that names the notebook and section it came from.
"""

from __future__ import annotations

import argparse
import ast
import base64
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
MODULE = ROOT / "the_annotated_transformer.py"
EXPORT_MARKER = "#| export"
WIDTH = 79

BANNER = '''\
# =============================================================================
# GENERATED FILE: edit the notebooks, not this file.
# Source: notebooks/NN_*.py (cells starting with "#| export").
# Regenerate with `make export`; `make check-sync` fails on drift.
# =============================================================================
"""The Annotated Transformer, done right: the notebooks' code as a module.

Importing it has no side effects and needs only torch. Each section below
names the notebook and heading that explain it. Run
``python the_annotated_transformer.py --help`` for the command line.
"""

if __name__ == "__main__":  # Ctrl-C while torch loads: one line, no traceback
    import os
    import signal

    def _interrupted(signum, frame):
        os.write(2, b"interrupted\\n")
        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted)
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


@dataclass
class Imports:
    """Every module-level import of the export cells, merged."""

    plain: set[tuple[str, str | None]] = field(default_factory=set)
    names: dict[str, set[tuple[str, str | None]]] = field(default_factory=dict)

    def add(self, node: ast.Import | ast.ImportFrom) -> None:
        """Record one import statement."""
        if isinstance(node, ast.Import):
            self.plain.update((a.name, a.asname) for a in node.names)
        else:
            module = "." * node.level + (node.module or "")
            self.names.setdefault(module, set()).update(
                (a.name, a.asname) for a in node.names
            )

    def render(self) -> str:
        """isort-style blocks: standard library, then third party."""
        groups = {True: [], False: []}
        for module, alias in sorted(self.plain, key=_module_key):
            text = f"import {module}" + (f" as {alias}" if alias else "")
            groups[_is_stdlib(module)].append((module, 0, text))
        for module, names in self.names.items():
            text = _from_import(module, sorted(names, key=_name_key))
            groups[_is_stdlib(module)].append((module, 1, text))
        blocks = []
        for stdlib in (True, False):
            rows = sorted(groups[stdlib], key=lambda r: (r[1], _mkey(r[0])))
            if rows:
                blocks.append("\n".join(text for _, _, text in rows))
        return "\n\n".join(blocks)


def _is_stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names | {"__future__"}


def _mkey(module: str) -> str:
    return module.lower()


def _module_key(item: tuple[str, str | None]) -> tuple[str, str]:
    return (item[0].lower(), item[1] or "")


def _name_key(item: tuple[str, str | None]) -> tuple[int, str]:
    """isort's order by type: CONSTANTS, then Classes, then functions."""
    name = item[0]
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return (kind, name.lower() if kind == 2 else name)


def _from_import(module: str, names: list[tuple[str, str | None]]) -> str:
    """One ``from`` statement, wrapped in parentheses when too long."""
    parts = [n + (f" as {a}" if a else "") for n, a in names]
    line = f"from {module} import {', '.join(parts)}"
    if len(line) <= WIDTH:
        return line
    inner = "".join(f"    {p},\n" for p in parts)
    return f"from {module} import (\n{inner})"


def split_imports(block: str, imports: Imports) -> str:
    """Move a block's top-level imports into ``imports``; return the rest."""
    tree = ast.parse(block)
    lines = block.splitlines()
    drop = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.add(node)
            drop.update(range(node.lineno - 1, node.end_lineno))
    kept = [line for i, line in enumerate(lines) if i not in drop]
    return "\n".join(kept).strip("\n")


def public_names(code: str) -> list[str]:
    """Top-level functions, classes and constants not starting with _."""
    names = []
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = getattr(node, "targets", [getattr(node, "target", None)])
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_") and n != "main"]


# --- the module ---------------------------------------------------------


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


def render_module() -> str:
    """The whole text of the generated module."""
    imports = Imports()
    body, all_names, part = [], [], None
    for path in notebook_sources():
        for section in export_sections(path):
            code = [split_imports(b, imports) for b in section.blocks]
            code = "\n\n\n".join(c for c in code if c)
            if not code:
                continue
            all_names += public_names(code)
            body.append(section_header(section, section.part != part))
            body.append(code)
            part = section.part
    listing = "".join(f'    "{n}",\n' for n in all_names)
    text = f"{BANNER}\n{imports.render()}\n\n__all__ = [\n{listing}]"
    text += "\n\n\n" + "\n\n\n".join(_pairs(body)) + "\n"
    if "main" in _top_level_functions(text):
        text += FOOTER
    return text


def _pairs(body: list[str]) -> list[str]:
    """Join each section header to the code below it."""
    return [f"{body[i]}\n{body[i + 1]}" for i in range(0, len(body), 2)]


def _top_level_functions(text: str) -> set[str]:
    return {
        n.name for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)
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


def render_ipynb(path: Path) -> str:
    """The .ipynb text that the percent file generates (no outputs)."""
    nb = jupytext.read(path)
    attach_diagrams(nb, path.parent)
    nb.metadata.setdefault("jupytext", {})["formats"] = "ipynb,py:percent"
    for i, cell in enumerate(nb.cells):  # jupytext draws random ids
        cell.id = f"cell-{i:03d}"
    return jupytext.writes(nb, fmt="ipynb")


def targets() -> dict[Path, str]:
    """Every generated file with the text it should hold."""
    out = {MODULE: render_module()}
    for path in notebook_sources():
        out[path.with_suffix(".ipynb")] = render_ipynb(path)
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
