"""Print each notebook's length, prose-to-code ratio and longest code cell.

    python tools/lesson_stats.py             # a Markdown table
    python tools/lesson_stats.py --check     # exit 1 when a lesson is over
                                             # its targets (see LIMITS) or
                                             # README's table is out of date
    python tools/lesson_stats.py --readme    # rewrite README's table

Prose is every line of the markdown cells; code is every non-blank line of
the code cells. The lessons are notebooks 01-05; the appendix (06) is
reported but held to no target.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START, END = "<!-- notebooks: start -->", "<!-- notebooks: end -->"
COLAB = (
    "https://colab.research.google.com/github/annotated-transformer/"
    "done-right/blob/main/notebooks/"
)
BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
LESSONS = ("01", "02", "03", "04", "05")
LIMITS = {"lines": 900, "min_ratio": 0.45, "cell": 40, "mentions_2022": 3}


@dataclass
class Stats:
    """What one notebook measures."""

    name: str
    lines: int
    prose: int
    code: int
    longest_cell: int
    mentions_2022: int
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
        path.stem,
        len(text.splitlines()),
        prose,
        code,
        longest,
        text.count("2022"),
        title,
    )


def problems(s: Stats) -> list[str]:
    """The targets a lesson misses (none for the appendix)."""
    if s.name[:2] not in LESSONS:
        return []
    out = []
    if s.lines > LIMITS["lines"]:
        out.append(f"{s.lines} lines > {LIMITS['lines']}")
    if s.ratio < LIMITS["min_ratio"]:
        out.append(f"prose/code {s.ratio:.2f} < {LIMITS['min_ratio']}")
    if s.longest_cell > LIMITS["cell"]:
        out.append(f"a {s.longest_cell}-line code cell > {LIMITS['cell']}")
    if s.mentions_2022 > LIMITS["mentions_2022"]:
        out.append(f"'2022' {s.mentions_2022} times")
    return out


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


def readme_table(stats: list[Stats]) -> str:
    """README's table: each notebook, what it teaches, its size, Colab."""
    rows = [
        START,
        "| notebook | teaches | lines | prose : code | |",
        "|---|---|---:|---:|---|",
    ]
    for s in stats:
        link = f"[{s.name}](notebooks/{s.name}.ipynb)"
        colab = f"[![Open in Colab]({BADGE})]({COLAB}{s.name}.ipynb)"
        rows.append(
            f"| {link} | {s.title} | {s.lines} | {s.ratio:.2f} | {colab} |"
        )
    return "\n".join([*rows, END])


def with_readme_table(readme: str, stats: list[Stats]) -> str:
    """The README text with its notebook table replaced by a fresh one."""
    head, found, rest = readme.partition(START)
    _, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise SystemExit(f"README.md lacks the markers {START} ... {END}")
    return head + readme_table(stats) + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a lesson misses or README's table is stale",
    )
    parser.add_argument(
        "--readme", action="store_true", help="rewrite README's table"
    )
    args = parser.parse_args(argv)
    paths = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    stats = [measure(p) for p in paths]
    print(table(stats))
    failed = [(s.name, p) for s in stats for p in problems(s)]
    readme = README.read_text()
    fresh = with_readme_table(readme, stats)
    if args.readme and fresh != readme:
        README.write_text(fresh)
    elif fresh != readme:
        failed.append(("README.md", "table out of date (make export)"))
    for name, p in failed:
        print(f"{name}: {p}", file=sys.stderr)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
