"""`pip install .` gives a fresh virtual environment, outside the clone,
both modules and the `annotated-transformer` command (with this
environment's torch, so that nothing large is downloaded)."""

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
    # torch is lent from this environment through a .pth file, not
    # downloaded: on Linux, PyPI's torch is the CUDA build, several GB.
    # pip then finds the requirement met, and installs only the package.
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(run([python, "-c", where], tmp_path).strip())
    torch_site = Path(torch.__file__).resolve().parent.parent
    (site / "torch_from_here.pth").write_text(f"{torch_site}\n")
    run([python, "-m", "pip", "install", "-q", ROOT], tmp_path)
    assert not (site / "torch").exists()  # lent, not installed again
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
