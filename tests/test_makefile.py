"""`make notebook`, the README's first command, run on a probe notebook."""

import json
import os
import shutil
import subprocess
import sys
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


VENV_PYTHON = """\
#!/bin/sh
# .venv's python, faked: new enough; tools/torch_index.py prints
# $CHOSEN_INDEX; pip records what it was asked to install.
case "$*" in
  *version_info*) exit 0 ;;
  tools/torch_index.py) echo "$CHOSEN_INDEX"; echo chose >> asked ;;
  "-m pip install"*) echo "$*" >> asked ;;
esac
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(
    "extra, chosen, expected",
    [
        ([], "https://cpu.example", "--index-url https://cpu.example "),
        ([], "", ""),  # tools/torch_index.py keeps pip's own
        (["TORCH_INDEX="], "https://cpu.example", ""),  # not asked
        (
            ["TORCH_INDEX=https://x.example"],
            "",
            "--index-url https://x.example ",
        ),
    ],
)
def test_setup_installs_torch_from_the_index_chosen(
    tmp_path, extra, chosen, expected
):
    """setup's recipe with a fake .venv: the torch line it runs."""
    venv_python = tmp_path / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(VENV_PYTHON)
    venv_python.chmod(0o755)
    env = {**os.environ, "CHOSEN_INDEX": chosen}
    done = make_in(tmp_path, env, "setup", f"PYTHON={sys.executable}", *extra)
    assert done.returncode == 0, done.stderr
    asked = (tmp_path / "asked").read_text().splitlines()
    asks_the_script = "TORCH_INDEX" not in " ".join(extra)
    assert asked == ["chose"] * asks_the_script + [
        f"-m pip install --quiet {expected}torch==2.13.0",
        "-m pip install --quiet -r requirements.txt",
    ]


OLD_PYTHON = """\
#!/bin/sh
# A Python 3.9, as a Mac's python3 often is: too old for this project.
case "$*" in
  *version_info*) exit 1 ;;
esac
echo "Python 3.9.6"
"""
NAMES = ["python3", "python3.10", "python3.11", "python3.12", "python3.13"]


def fake_pythons(folder, real=()):
    """A folder that puts a 3.9 first on the PATH under every name the
    Makefile tries, except `real`, which run this interpreter."""
    folder.mkdir()
    for name in NAMES:
        path = folder / name
        if name in real:
            path.symlink_to(sys.executable)
        else:
            path.write_text(OLD_PYTHON)
            path.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}


def make_in(folder, env, *args):
    """make, with this repository's Makefile, run in `folder`."""
    shutil.copy(ROOT / "requirements.txt", folder)
    return subprocess.run(
        ["make", "-s", "-f", str(ROOT / "Makefile"), *args],
        cwd=folder, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_setup_takes_a_new_enough_python_when_python3_is_old(tmp_path):
    env = fake_pythons(tmp_path / "bin", real={"python3.12"})
    done = make_in(tmp_path, env, "--eval", "show: ; @echo $(PYTHON)", "show")
    assert done.stdout.strip() == "python3.12"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_setup_without_a_new_enough_python_says_so(tmp_path):
    env = fake_pythons(tmp_path / "bin")
    done = make_in(tmp_path, env, "setup")
    assert done.returncode == 2
    assert "no Python 3.10 or later on the PATH" in done.stderr
    assert "python3 is Python 3.9.6" in done.stderr
    assert not (tmp_path / ".venv").exists()  # nothing half made


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_setup_refuses_a_venv_made_by_an_old_python(tmp_path):
    env = fake_pythons(tmp_path / "bin", real={"python3"})
    venv_python = tmp_path / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(OLD_PYTHON)
    venv_python.chmod(0o755)
    done = make_in(tmp_path, env, "setup")
    assert done.returncode == 2
    assert "make: .venv has Python 3.9.6, older than 3.10" in done.stderr
    assert "rm -rf .venv" in done.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_setup_refuses_an_old_python_named_in_python(tmp_path):
    """PYTHON= (from the command line or the environment) is checked too."""
    env = fake_pythons(tmp_path / "bin", real={"python3"})
    done = make_in(tmp_path, env, "setup", f"PYTHON={tmp_path}/bin/python3.10")
    assert done.returncode == 2
    assert "no Python 3.10 or later" in done.stderr
    assert not (tmp_path / ".venv").exists()
