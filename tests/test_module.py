"""Tests of the generated module itself: quiet, light and fast to import,
in sync with the notebooks, and keeping the 2022 public names."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import the_annotated_transformer as at

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("altair", "pandas", "spacy", "sacrebleu", "tokenizers", "tqdm")


def run_python(code):
    """Run code in a fresh interpreter at the repository root."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_is_silent_and_needs_no_heavy_libraries():
    # torch itself imports tqdm (through torch.hub), so we check what the
    # module adds on top of torch, and that nothing at all is printed.
    code = (
        "import sys, json, torch\n"
        "before = set(sys.modules)\n"
        "import the_annotated_transformer\n"
        "added = set(sys.modules) - before\n"
        f"heavy = [m for m in {HEAVY!r} if m in added]\n"
        "print(json.dumps(heavy))\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    # The only output is our own line: the import itself printed nothing.
    assert proc.stdout == "[]\n"


def test_import_takes_under_two_seconds_after_torch():
    code = (
        "import time, torch\n"
        "t = time.perf_counter()\n"
        "import the_annotated_transformer\n"
        "print(time.perf_counter() - t)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) < 2.0


def test_module_is_in_sync_with_the_notebooks():
    proc = subprocess.run(
        [sys.executable, "tools/export.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_has_an_ipynb_without_outputs(source):
    ipynb = source.with_suffix(".ipynb")
    assert ipynb.is_file(), f"{ipynb.name} is missing"
    nb = json.loads(ipynb.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    for cell in code:
        assert cell.get("outputs", []) == []
        assert cell.get("execution_count") is None


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


PUBLIC_2022 = [
    # Part 1
    "EncoderDecoder",
    "Generator",
    "clones",
    "Encoder",
    "LayerNorm",
    "SublayerConnection",
    "EncoderLayer",
    "Decoder",
    "DecoderLayer",
    "subsequent_mask",
    "attention",
    "MultiHeadedAttention",
    "PositionwiseFeedForward",
    "Embeddings",
    "PositionalEncoding",
    "make_model",
    # Part 2
    "Batch",
    "TrainState",
    "run_epoch",
    "rate",
    "LabelSmoothing",
    "data_gen",
    "SimpleLossCompute",
    "greedy_decode",
]


@pytest.mark.parametrize("name", PUBLIC_2022)
def test_module_keeps_the_2022_public_names(name):
    assert hasattr(at, name)
    assert callable(getattr(at, name))
