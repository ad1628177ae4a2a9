"""Print each notebook's length, prose-to-code ratio and longest code cell.

    python tools/lesson_stats.py    # a Markdown table, for maintainers

Prose is every line of the markdown cells; code is every non-blank line of
the code cells. The numbers are information, not targets: a lesson is as
long as its teaching needs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Stats:
    """What one notebook measures."""

    name: str
    lines: int
    prose: int
    code: int
    longest_cell: int
    title: str

    @property
    def ratio(self) -> float:
        return self.prose / max(self.code, 1)


def measure(path: Path) -> Stats:
    """Count the lines of one percent-format notebook."""
    text = path.read_text()
    nb = jupytext.reads(text, fmt="py:percent")
    prose = code = longest = 0
    title = ""
    for cell in nb.cells:
        lines = cell.source.splitlines()
        if cell.cell_type == "markdown":
            prose += len(lines)
            title = title or next(
                (s.lstrip("# ") for s in lines if s.startswith("# ")), ""
            )
        elif cell.cell_type == "code":
            code += sum(1 for s in lines if s.strip())
            longest = max(longest, len(lines))
    return Stats(
        path.stem, len(text.splitlines()), prose, code, longest, title
    )


def table(stats: list[Stats]) -> str:
    """A Markdown table of the measurements."""
    rows = [
        "| notebook | lines | prose : code | longest code cell | teaches |",
        "|---|---:|---:|---:|---|",
    ]
    for s in stats:
        rows.append(
            f"| {s.name} | {s.lines} | {s.prose} : {s.code} = {s.ratio:.2f}"
            f" | {s.longest_cell} | {s.title} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    paths = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    print(table([measure(p) for p in paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
