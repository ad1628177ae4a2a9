"""Import time of the_annotated_transformer on top of an imported torch.

Starts a fresh interpreter per run, imports torch first (its own cost is
not ours), then times `import the_annotated_transformer`, and prints the
median and the slowest run in seconds. A wall-clock figure depends on how
busy the machine is, so it lives here and not in the tests; the tests
check what the import does (prints nothing, writes nothing, loads no
plotting or data library).

    python bench/import_time.py --runs 5
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMED = (
    "import time, torch\n"
    "t = time.perf_counter()\n"
    "import the_annotated_transformer\n"
    "print(time.perf_counter() - t)\n"
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser.parse_args(argv)


def time_one_import():
    """Seconds one fresh interpreter spends importing the module."""
    proc = subprocess.run(
        [sys.executable, "-c", TIMED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the import failed:\n{proc.stderr}")
    return float(proc.stdout)


def main(argv=None):
    args = parse_args(argv)
    times = [time_one_import() for _ in range(args.runs)]
    result = {
        "runs": args.runs,
        "median_s": statistics.median(times),
        "max_s": max(times),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"import after torch: median {result['median_s']:.3f} s, "
            f"slowest {result['max_s']:.3f} s over {args.runs} runs"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
