"""The helpers of bench/gpu_check.sh, run on the CPU: what they can show
without a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def run(args, **kwargs):
    return subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=600, **kwargs
    )


def as_t4(script, scales):
    """Run `script` through bench/gpu_as_t4.py, writing the scales."""
    helper = ["bench/gpu_as_t4.py", "--scales", str(scales), str(script)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return run([sys.executable, *helper], env=env)


def test_as_t4_makes_the_cuda_precision_a_t4s(tmp_path):
    # choose_precision asks torch for the GPU's compute capability, which
    # the helper makes 7.5: float16 with a GradScaler, as on a T4.
    script = tmp_path / "precision.py"
    script.write_text(
        "import annotated_transformer_tools as tools\n"
        "print(tools.choose_precision('cuda'))\n"
    )
    scales = tmp_path / "scales.json"
    done = as_t4(script, scales)
    assert done.returncode == 0, done.stderr
    assert "Precision(dtype=torch.float16, scaler=True)" in done.stdout
    assert "GradScaler: 0 updates, 0 skipped steps" in done.stdout
    assert json.loads(scales.read_text())["updates"] == 0


def test_as_t4_counts_the_steps_a_scaler_skips(tmp_path):
    # A GradScaler halves its scale when a step had inf gradients: that
    # step is skipped. Two good steps and one overflow: one skipped.
    script = tmp_path / "steps.py"
    script.write_text(
        "import torch\n"
        "w = torch.nn.Parameter(torch.ones(1))\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "scaler = torch.amp.GradScaler('cpu')\n"
        "for bad in (False, True, False):\n"
        "    loss = (w * (float('inf') if bad else 1.0)).sum()\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
        "    opt.zero_grad()\n"
    )
    scales = tmp_path / "scales.json"
    done = as_t4(script, scales)
    assert done.returncode == 0, done.stderr
    record = json.loads(scales.read_text())
    assert record["updates"] == 3 and record["skipped_steps"] == 1
    assert record["scales"][1] == record["scales"][0] / 2


def test_ddp_one_rank_joins_a_process_group_of_one(tmp_path, local_multi30k):
    torchrun = Path(sys.executable).parent / "torchrun"
    done = run(
        [
            str(torchrun),
            "--standalone",
            "--nproc_per_node=1",
            "bench/gpu_ddp_one_rank.py",
            str(tmp_path / "ck"),
        ],
        env={**os.environ, "MULTI30K_DIR": local_multi30k},
    )
    assert done.returncode == 0, done.stderr
    # the script's own choice: NCCL on a GPU machine, gloo elsewhere
    if torch.cuda.is_available():
        joined = "process groups joined: ['nccl'] device: cuda:0"
    else:
        joined = "process groups joined: ['gloo'] device: cpu"
    assert joined in done.stdout
    assert "ranks_in_sync: True" in done.stdout
