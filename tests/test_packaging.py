"""`pip install .` gives a fresh virtual environment, outside the clone,
both modules and the `annotated-transformer` command."""

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
    code = (
        "import annotated_transformer_tools as tools\n"
        "import the_annotated_transformer as tat\n"
        "print(tat.__file__)\nprint(tools.__file__)\n"
    )
    where = run([python, "-c", code], tmp_path).split()
    assert [Path(w).name for w in where] == [
        "the_annotated_transformer.py",
        "annotated_transformer_tools.py",
    ]
    assert all(Path(w).is_relative_to(venv) for w in where)
    helptext = run(
        [venv / "bin" / "annotated-transformer", "--help"], tmp_path
    )
    assert "translate" in helptext and "train" in helptext
