"""Tests of the generated module itself: quiet and light to import, in
sync with the notebooks, and still callable the way the 2022 API was."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import the_annotated_transformer as tat

ROOT = Path(__file__).resolve().parent.parent


def test_import_is_silent_writes_nothing_and_needs_only_torch(tmp_path):
    # Import from an empty folder: nothing printed, no file written, and
    # every module the import adds on top of torch is either ours or part
    # of the standard library. (Import time is measured by
    # bench/import_time.py: a wall-clock bound would flake on a busy
    # machine.)
    code = (
        "import sys, json, torch\n"
        "before = set(sys.modules)\n"
        "import the_annotated_transformer\n"
        "added = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(json.dumps(sorted(added - sys.stdlib_module_names)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    # The only output is our own line: the import itself printed nothing.
    assert proc.stdout == '["the_annotated_transformer"]\n'
    assert list(tmp_path.iterdir()) == []


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


def test_notebooks_are_numbered_in_reading_order_without_gaps():
    numbers = [int(p.name[:2]) for p in NOTEBOOKS]
    assert numbers == list(range(1, len(NOTEBOOKS) + 1)), numbers
    assert len(NOTEBOOKS) >= 5  # Parts 1 to 5 at least


# The 2022 public API, written out by hand from the 2022 tutorial: each
# name with its parameters in order, a bare name for a required one and
# (name, default) for one with a default. Code written against it must
# still run: same names in the same places, same defaults, and anything
# new added at the end with a default.
API_2022 = {
    # Part 1
    "EncoderDecoder": [
        "encoder",
        "decoder",
        "src_embed",
        "tgt_embed",
        "generator",
    ],
    "Generator": ["d_model", "vocab"],
    "clones": ["module", "N"],
    "Encoder": ["layer", "N"],
    "LayerNorm": ["features", ("eps", 1e-6)],
    "SublayerConnection": ["size", "dropout"],
    "EncoderLayer": ["size", "self_attn", "feed_forward", "dropout"],
    "Decoder": ["layer", "N"],
    "DecoderLayer": [
        "size",
        "self_attn",
        "src_attn",
        "feed_forward",
        "dropout",
    ],
    "subsequent_mask": ["size"],
    "attention": [
        "query",
        "key",
        "value",
        ("mask", None),
        ("dropout", None),
    ],
    "MultiHeadedAttention": ["h", "d_model", ("dropout", 0.1)],
    "PositionwiseFeedForward": ["d_model", "d_ff", ("dropout", 0.1)],
    "Embeddings": ["d_model", "vocab"],
    "PositionalEncoding": ["d_model", "dropout", ("max_len", 5000)],
    "make_model": [
        "src_vocab",
        "tgt_vocab",
        ("N", 6),
        ("d_model", 512),
        ("d_ff", 2048),
        ("h", 8),
        ("dropout", 0.1),
    ],
    # Part 2
    "Batch": ["src", ("tgt", None), ("pad", 2)],
    "TrainState": [],
    "run_epoch": [
        "data_iter",
        "model",
        "loss_compute",
        "optimizer",
        "scheduler",
        ("mode", "train"),
        ("accum_iter", 1),
        "train_state",  # 2022: a shared TrainState(); we take None
    ],
    "rate": ["step", "model_size", "factor", "warmup"],
    "LabelSmoothing": ["size", "padding_idx", ("smoothing", 0.0)],
    "data_gen": ["V", "batch_size", "nbatches"],
    "SimpleLossCompute": ["generator", "criterion"],
    "greedy_decode": [
        "model",
        "src",
        "src_mask",
        "max_len",
        "start_symbol",
    ],
}


@pytest.mark.parametrize("name", API_2022)
def test_2022_calls_still_bind(name):
    assert name in tat.__all__
    params = list(inspect.signature(getattr(tat, name)).parameters.values())
    old = API_2022[name]
    assert len(params) >= len(old)
    for param, spec in zip(params, old):
        want, default = spec if isinstance(spec, tuple) else (spec, None)
        assert param.name == want
        assert param.kind is param.POSITIONAL_OR_KEYWORD
        if isinstance(spec, tuple):
            assert param.default == default, f"{want}: default changed"
    for param in params[len(old) :]:
        assert param.default is not param.empty, f"new {param.name} needs one"
