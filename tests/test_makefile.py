"""`make notebook`, the README's first command, run on a probe notebook."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """\
import os
import sys

ROOT = os.path.abspath("done-right" if os.path.isdir("done-right") else "..")
sys.path.insert(0, ROOT)
import the_annotated_transformer

here = os.path.basename(os.getcwd())
print("ran in", here, "with AT_SIZE", os.environ["AT_SIZE"])
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_notebook_runs_each_notebook_from_the_notebooks_folder(tmp_path):
    cell = {"cell_type": "code", "metadata": {}, "execution_count": None,
            "outputs": [], "source": PROBE}  # fmt: skip
    kernel = {"name": "python3", "display_name": "Python 3"}
    nb = {"cells": [cell], "metadata": {"kernelspec": kernel},
          "nbformat": 4, "nbformat_minor": 5}  # fmt: skip
    probe = tmp_path / "99_probe.ipynb"
    probe.write_text(json.dumps(nb))
    out = ROOT / "runs" / "notebooks" / probe.name
    try:
        subprocess.run(
            ["make", "-s", "notebook", f"NOTEBOOKS={tmp_path}/99_probe.py",
             "AT_SIZE=ci"],  # fmt: skip
            cwd=ROOT, check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        printed = json.loads(out.read_text())["cells"][0]["outputs"][0]["text"]
    finally:
        out.unlink(missing_ok=True)
    assert "".join(printed).strip() == "ran in notebooks with AT_SIZE ci"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(
    "extra, expected",
    [
        ([], ["install", "--quiet", "torch==2.13.0"]),
        (
            ["TORCH_INDEX=https://download.pytorch.org/whl/cpu"],
            [
                "install",
                "--quiet",
                "--index-url",
                "https://download.pytorch.org/whl/cpu",
                "torch==2.13.0",
            ],
        ),  # fmt: skip
    ],
)
def test_setup_installs_torch_from_the_index_asked_for(extra, expected):
    """A dry run (-n) of setup's recipe: the torch line it would run."""
    done = subprocess.run(
        ["make", "-n", "-B", ".venv/.installed", *extra],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    commands = done.stdout.replace("\\\n", " ").splitlines()
    (torch_line,) = [c for c in commands if "torch==" in c]
    words = [w.strip('"') for w in torch_line.split()]
    assert words[words.index("install") :] == expected
