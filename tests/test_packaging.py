"""`pip install .` gives a fresh virtual environment, outside the clone,
the module and the `annotated-transformer` command."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run(args, cwd, timeout=600):
    proc = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    run([base, "-m", "venv", venv], tmp_path)
    python = venv / "bin" / "python"
    # The same torch as here, so that no CUDA build is downloaded.
    torch_pin = "torch==" + torch.__version__.split("+")[0]
    run([python, "-m", "pip", "install", "-q", torch_pin], tmp_path)
    run([python, "-m", "pip", "install", "-q", ROOT], tmp_path)
    where = run(
        [
            python,
            "-c",
            "import the_annotated_transformer as tat; print(tat.__file__)",
        ],
        tmp_path,
    )
    assert Path(where.strip()).is_relative_to(venv)
    helptext = run(
        [venv / "bin" / "annotated-transformer", "--help"], tmp_path
    )
    assert "translate" in helptext and "train" in helptext
