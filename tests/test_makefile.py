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


# Notebook 03's stand-in: it saves two epoch files where the real
# training does (the notebook runs in notebooks/), then fails if asked.
TRAINING_PROBE = """\
import os
import time

os.makedirs("../checkpoints/quick", exist_ok=True)
for epoch in range(2):
    time.sleep(0.5)
    open(f"../checkpoints/quick/epoch_{epoch:03d}.pt", "wb").close()
if os.path.exists("../fail"):
    raise RuntimeError("the probe failed on purpose")
"""


def watchers_in(folder):
    """Ids of the watch_epochs.py processes started in `folder`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
            cwd = os.readlink(proc / "cwd")
        except OSError:  # ended, or not ours to read
            continue
        if b"watch_epochs.py" in cmdline and cwd == str(folder):
            found.append(int(proc.name))
    return found


def make_notebook_03(folder, *, trained=False, fail=False):
    """`make notebook` at full size, in a copy of the repository's
    plumbing under `folder`, on a stand-in for notebook 03."""
    (folder / "notebooks").mkdir()
    (folder / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "watch_epochs.py", folder / "tools")
    (folder / ".venv").symlink_to(ROOT / ".venv")
    shutil.copy(ROOT / "requirements.txt", folder)
    os.utime(folder / "requirements.txt", (0, 0))  # no setup: .venv is made
    cell = {"cell_type": "code", "metadata": {}, "execution_count": None,
            "outputs": [], "source": TRAINING_PROBE}  # fmt: skip
    kernel = {"name": "python3", "display_name": "Python 3"}
    nb = {"cells": [cell], "metadata": {"kernelspec": kernel},
          "nbformat": 4, "nbformat_minor": 5}  # fmt: skip
    (folder / "notebooks" / "03_multi30k.ipynb").write_text(json.dumps(nb))
    if trained:
        (folder / "checkpoints" / "quick").mkdir(parents=True)
        (folder / "checkpoints" / "quick" / "final.pt").write_bytes(b"")
    if fail:
        (folder / "fail").write_text("")
    return subprocess.run(
        ["make", "-s", "-f", str(ROOT / "Makefile"), "notebook",
         "NOTEBOOKS=notebooks/03_multi30k.py", "AT_SIZE=full"],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


needs_make_and_venv = pytest.mark.skipif(
    shutil.which("make") is None
    or not (ROOT / ".venv" / ".installed").exists()
    or not Path("/proc/self/cwd").exists(),
    reason="needs make, a .venv made by make setup, and /proc",
)


@needs_make_and_venv
def test_make_notebook_prints_each_epoch_saved_while_03_trains(tmp_path):
    done = make_notebook_03(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[1] == "notebooks/03_multi30k.ipynb: running..."
    assert lines[2].startswith("  it trains the translator: 7 to 22")
    assert lines[3].startswith("  epoch 1 of 5 saved (")
    assert lines[4].startswith("  epoch 2 of 5 saved (")
    assert lines[5].startswith("notebooks/03_multi30k.ipynb: ")
    assert len(lines) == 6
    assert "Terminated" not in done.stderr  # the watcher exits quietly
    assert watchers_in(tmp_path) == []  # make waited for it


@needs_make_and_venv
def test_make_notebook_starts_no_watcher_when_03_finds_a_model(tmp_path):
    done = make_notebook_03(tmp_path, trained=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "it trains" not in done.stdout
    assert "saved" not in done.stdout


@needs_make_and_venv
def test_make_notebook_stops_the_watcher_when_03_fails(tmp_path):
    done = make_notebook_03(tmp_path, fail=True)
    assert done.returncode == 2
    assert "the probe failed on purpose" in done.stdout  # its log, shown
    assert "notebooks/03_multi30k.ipynb failed (log: " in done.stdout
    assert watchers_in(tmp_path) == []
