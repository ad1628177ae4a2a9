"""bench/gpu_explore.sh, dry-run on the CPU with one tiny trial."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_each_trial_gets_its_curve_and_a_validation_table(
    tmp_path, local_multi30k
):
    out, runs = tmp_path / "out", tmp_path / "runs"
    env = {
        **os.environ,
        "OUT": str(out),
        "RUNS": str(runs),
        "DEVICE": "cpu",
        "TRIALS": "ci",
        "VAL_N": "20",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["bash", "bench/gpu_explore.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    with tarfile.open(out / "explore.tar.gz") as archive:
        archive.extractall(tmp_path / "x", filter="data")
    folder = tmp_path / "x" / "explore"
    assert (folder / "trials.txt").read_text() == "c-ci|ci|2|dropout=0.1\n"
    curve = json.loads((folder / "c-ci.json").read_text())
    assert [p["epoch"] for p in curve["points"]] == [0, 1]
    assert curve["config"]["dropout"] == 0.1
    assert curve["config"]["keep_last"] == 0  # every epoch file, to average
    table = json.loads((folder / "c-ci_val.json").read_text())
    assert table["split"] == "validation"
    assert "--split val" in table["command"]
    rows = [(r["beam"], r["alpha"], r["average"]) for r in table["rows"]]
    assert rows == [(1, None, 0), (4, 1.0, 0), (4, 1.0, 2)], rows
    assert sorted(p.name for p in runs.joinpath("c-ci").glob("epoch_*")) == [
        "epoch_000.pt",
        "epoch_001.pt",
    ]
    assert not (out / "explore").exists()  # packed, then removed
