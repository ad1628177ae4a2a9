"""Generate the flat module and the .ipynb pairs from notebooks/NN_*.py.

    python tools/export.py           # rewrite the_annotated_transformer.py
                                     # and every notebooks/NN_*.ipynb
    python tools/export.py --check   # exit 1 when anything is out of sync

Only code cells whose first line is ``#| export`` reach the module, in
notebook order, each block preceded by a comment naming its notebook.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
MODULE = ROOT / "the_annotated_transformer.py"
EXPORT_MARKER = "#| export"

BANNER = '''\
# =====================================================================
# GENERATED FILE: edit the notebooks, not this file.
# Source: notebooks/NN_*.py (cells starting with "#| export").
# Regenerate with `make export`; `make check-sync` fails on drift.
# =====================================================================
"""The Annotated Transformer, done right: the notebooks' code as a module.

Importing it has no side effects and needs only torch. Run
``python the_annotated_transformer.py --help`` for the command line.
"""
'''

FOOTER = """

# ---------------------------------------------------------------------
# Command line entry point (added by tools/export.py).
if __name__ == "__main__":
    raise SystemExit(main())
"""


def notebook_sources() -> list[Path]:
    """The percent-format notebooks, in reading order."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def export_cells(path: Path) -> list[str]:
    """The sources of a notebook's export cells, marker line removed."""
    nb = jupytext.read(path)
    blocks = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        lines = cell.source.splitlines()
        if lines and lines[0].strip() == EXPORT_MARKER:
            blocks.append("\n".join(lines[1:]).strip("\n"))
    return blocks


def render_module() -> str:
    """The whole text of the generated module."""
    parts = [BANNER]
    has_main = False
    for path in notebook_sources():
        rel = path.relative_to(ROOT).as_posix()
        for block in export_cells(path):
            parts.append(f"\n\n# --- from {rel} ---\n{block}\n")
            has_main = has_main or "\ndef main(" in "\n" + block
    text = "".join(parts)
    if has_main:
        text += FOOTER
    return text


def render_ipynb(path: Path) -> str:
    """The .ipynb text that the percent file generates (no outputs)."""
    nb = jupytext.read(path)
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
