"""The first cell of every notebook: on Colab it clones the repository
named once in pyproject.toml, installs what the notebooks need at run time,
and stops with a clear message when the clone fails."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import export  # noqa: E402

NOTEBOOKS = export.notebook_sources()


def setup_cell(path):
    """The source of a notebook's first code cell."""
    nb = jupytext.read(path)
    return next(c.source for c in nb.cells if c.cell_type == "code")


def test_pyproject_names_the_repository_once():
    repo = export.repository()
    assert repo.startswith("https://github.com/")
    assert (ROOT / "pyproject.toml").read_text().count(repo) == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_badge_and_clone_line_agree_with_pyproject(path):
    repo = export.repository()
    text = path.read_text()
    assert re.findall(r'^REPO = "(.*)"$', setup_cell(path), re.M) == [repo]
    badges = re.findall(r"\]\((https://colab[^)]*\.ipynb)\)", text)
    assert badges == [export.colab_link(repo, path.stem)]
    assert badges[0].endswith(f"/blob/main/notebooks/{path.stem}.ipynb")
    path_in_repo = repo.removeprefix("https://github.com/")
    assert f"/github/{path_in_repo}/blob/" in badges[0]


def test_export_rewrites_both_from_a_new_address():
    text = NOTEBOOKS[0].read_text()
    new = export.with_repository(text, "01_x", "https://github.com/me/fork")
    assert 'REPO = "https://github.com/me/fork"' in new
    assert (
        "(https://colab.research.google.com/github/me/fork/blob/main/"
        "notebooks/01_x.ipynb)" in new
    )
    assert "annotated-transformer/done-right" not in new
    with pytest.raises(SystemExit):
        export.with_repository("no setup cell here", "01_x", "https://x")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_setup_installs_runtime_needs_only_and_never_prompts(path):
    cell = setup_cell(path)
    assert "requirements.txt" not in cell  # the development tools
    assert "[notebooks]" in cell
    assert '"GIT_TERMINAL_PROMPT": "0"' in cell
    extras = (ROOT / "pyproject.toml").read_text()
    runtime = extras.split("notebooks = [", 1)[1].split("]\n", 1)[0]
    for tool in ("pytest", "ruff", "playwright", "nbmake", "jupyter"):
        assert tool not in runtime, tool


def test_a_failed_clone_stops_the_cell_with_a_clear_message(tmp_path):
    cell = setup_cell(NOTEBOOKS[0])
    missing = (tmp_path / "nowhere" / "done-right").as_uri()
    cell = re.sub(r'^REPO = ".*"$', f'REPO = "{missing}"', cell, flags=re.M)
    env = {**os.environ, "COLAB_RELEASE_TAG": "test"}
    proc = subprocess.run(
        [sys.executable, "-c", cell],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert f"could not clone {missing}:\nfatal:" in proc.stderr  # git's why
    assert not (tmp_path / "done-right").exists()


# What reads Multi30k from disk: a lesson opened on a fresh runtime (Colab
# gives each notebook its own) must fetch the data before its first read.
READS_DATA = re.compile(r"\b(read_multi30k|load_vocab|build_vocabulary)\(")


def lesson_code(path):
    """The code cells a reader runs: not `#| export` definitions."""
    nb = jupytext.read(path)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    return [c for c in cells if not c.startswith("#| export")]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_lesson_downloads_multi30k_before_reading_it(path):
    code = "\n".join(lesson_code(path))
    first_read = READS_DATA.search(code)
    if first_read is None:
        pytest.skip("reads no Multi30k file")
    download = code.find("download_multi30k()")
    assert 0 <= download < first_read.start(), (
        f"{path.name} reads Multi30k ({first_read.group(0)}) before"
        " calling download_multi30k()"
    )


@pytest.mark.parametrize("where", ["notebooks", ".", "runs/notebooks"])
def test_root_is_the_repository_from_its_notebooks_folder_or_itself(where):
    """Jupyter starts in notebooks/; `python notebooks/01_model.py` in the
    repository root starts there; the copies that `make notebook` writes
    to runs/notebooks/ start there when opened in Jupyter."""
    (ROOT / where).mkdir(parents=True, exist_ok=True)  # runs/ is ignored
    cell = setup_cell(NOTEBOOKS[0])
    env = {k: v for k, v in os.environ.items() if k != "COLAB_RELEASE_TAG"}
    proc = subprocess.run(
        [sys.executable, "-c", cell + "\nprint(ROOT)"],
        cwd=ROOT / where,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(ROOT)


def run_colab_cell(cwd):
    """The first notebook's setup cell, as on Colab, in `cwd`."""
    env = {**os.environ, "COLAB_RELEASE_TAG": "test"}
    return subprocess.run(
        [sys.executable, "-c", setup_cell(NOTEBOOKS[0])],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_failed_install_is_tried_again_when_the_cell_reruns(tmp_path):
    """The clone was made but pip failed (a dropped connection): the cell,
    run again, installs again instead of skipping to the lesson."""
    clone = tmp_path / "done-right"
    clone.mkdir()  # a clone with nothing pip can install
    for attempt in range(2):
        proc = run_colab_cell(tmp_path)
        assert proc.returncode != 0, attempt  # pip tried, and failed
        said = proc.stderr.split("pip could not install:\n", 1)[1]
        assert "ERROR" in said  # pip's own reason, shown on Colab too
        assert not (clone / ".installed").exists()
    (clone / ".installed").touch()  # as after an install that finished
    proc = run_colab_cell(tmp_path)
    assert proc.returncode == 0, proc.stderr


def device_cell():
    """Notebook 03's cell that picks the training device."""
    nb = jupytext.read(ROOT / "notebooks" / "03_multi30k.py")
    (cell,) = [
        c.source
        for c in nb.cells
        if c.cell_type == "code" and c.source.startswith("device = ")
    ]
    return cell


@pytest.mark.parametrize(
    "colab, device, named, warned",
    [
        (True, "cpu", "", True),
        (True, "cuda", "", False),
        (False, "cpu", "", False),
        (True, "cpu", "cpu", False),  # the reader asked for the CPU
    ],
)
def test_notebook_03_says_when_colab_gave_no_gpu(
    colab, device, named, warned, monkeypatch, capsys
):
    """Colab's runtime is a CPU unless one asks for a GPU: training there
    would take a quarter of an hour or more without a word. With
    AT_DEVICE=cpu on a GPU runtime, the warning would be wrong."""
    import torch

    if colab:
        monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    else:
        monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    monkeypatch.setenv("AT_DEVICE", named)
    names = {"os": os, "torch": torch}
    names["pick_device"] = lambda: torch.device(device)
    exec(device_cell(), names)
    out = capsys.readouterr().out
    assert out.startswith(f"device: {device}\n")
    assert ("Runtime → Change runtime type" in out) is warned


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_that_train_ask_colab_for_a_gpu(source):
    """Colab opens a notebook on the runtime its metadata asks for. Parts
    3 to 5 train on a GPU when there is one; without the metadata, a
    reader who missed the note ran them for a quarter of an hour on a CPU
    runtime, or changed the runtime after the clone and lost it."""
    import json

    twin = source.with_suffix(".ipynb")
    metadata = json.loads(twin.read_text())["metadata"]
    trains = source.stem[:2] in ("03", "04", "05")
    assert (metadata.get("accelerator") == "GPU") is trains
    assert (metadata.get("colab", {}).get("gpuType") == "T4") is trains


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_colab_folds_the_setup_cell_into_a_titled_form(source):
    """The setup cell is plumbing, some forty lines at the top of every
    lesson. Colab shows a cell whose metadata says `cellView: form`, and
    whose first line is `# @title ... { display-mode: "form" }`, as its
    title and a run button, with the code folded away."""
    import json

    twin = source.with_suffix(".ipynb")
    cells = json.loads(twin.read_text())["cells"]
    first = next(c for c in cells if c["cell_type"] == "code")
    assert first["metadata"].get("cellView") == "form"
    title = first["source"][0]
    assert re.fullmatch(r'# @title [^{]+ \{ display-mode: "form" \}\n', title)
    assert "REPO = " in "".join(first["source"])  # the setup cell itself
