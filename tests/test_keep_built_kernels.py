"""keep_built_kernels: oneDNN keeps more of the matrix-product kernels it
builds, so that a later epoch's batches, whose shapes it has met, do not
build them again. The setting, and the rebuilds it saves, counted by
oneDNN itself. (That `train` asks for it first is tested beside
keep_freed_memory, in tests/test_keep_freed_memory.py.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import annotated_transformer_tools as tools

REPO = Path(__file__).resolve().parent.parent


def test_it_sets_oneDNNs_cache_capacity():
    environ = {}
    assert tools.keep_built_kernels(environ=environ) == "8192"
    assert environ == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8192"}


def test_a_capacity_already_set_wins():
    environ = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
    assert tools.keep_built_kernels(environ=environ) == "64"
    assert environ == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


SHAPES = 150  # distinct products a round: over 100, under 200 and 1,024
ROUNDS = """
import sys, torch
import annotated_transformer_tools as tools
tools.keep_built_kernels(capacity=100)  # after importing torch, as train
torch.set_num_threads(1)
for round in range(2):
    for rows in range(32, 32 + SHAPES):  # one new shape each
        x = torch.ones(rows, 16, dtype=torch.bfloat16)
        x @ torch.ones(16, 16, dtype=torch.bfloat16)
    print("end of round", round, flush=True)
""".replace("SHAPES", str(SHAPES))


def kernels_built(capacity_already_set=None):
    """oneDNN's kernel builds (cache misses) in each of two rounds of the
    same SHAPES bf16 products, in a new process."""
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create"}
    env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    if capacity_already_set:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(capacity_already_set)
    run = subprocess.run(
        [sys.executable, "-c", ROUNDS],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env=env,
    )
    built, rounds = 0, []
    for line in run.stdout.splitlines():
        built += "create:cache_miss" in line
        if line.startswith("end of round"):
            rounds.append(built)
            built = 0
    return rounds


def test_the_capacity_asked_for_is_the_one_oneDNN_uses():
    """The subprocess asks for 100, fewer than its 150 shapes, after
    importing torch: oneDNN drops the least recently used first, so the
    second round builds every kernel again (with oneDNN's default, 1,024,
    it would build none). Where the environment already says 200, that
    wins: all 150 are kept, and the second round builds none."""
    asked = kernels_built()
    if asked[0] == 0:
        pytest.skip("this CPU's bf16 products do not go through oneDNN")
    assert asked[0] >= SHAPES  # a kernel for each new shape
    assert asked[1] >= SHAPES  # 100 kept: each built again
    assert kernels_built(capacity_already_set=200)[1] == 0
