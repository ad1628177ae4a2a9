"""tools/watch_epochs.py: the lines `make notebook` prints while notebook
03 trains."""

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import watch_epochs  # noqa: E402

SCRIPT = ROOT / "tools" / "watch_epochs.py"


def touch(path, when):
    """An empty file at `path`, written at time `when` (seconds)."""
    path.write_bytes(b"")
    os.utime(path, (when, when))


def test_only_files_saved_since_the_start_and_not_reported(tmp_path):
    now = time.time()
    touch(tmp_path / "epoch_000.pt", now - 100)  # an earlier run's
    touch(tmp_path / "epoch_002.pt", now + 1)
    touch(tmp_path / "epoch_001.pt", now + 1)
    touch(tmp_path / ".epoch_003.pt.42.part", now + 1)  # still written
    touch(tmp_path / "last.pt", now + 1)
    found = watch_epochs.saved_since(tmp_path, now, reported={"epoch_002.pt"})
    assert [path.name for path in found] == ["epoch_001.pt"]


def test_epoch_files_count_from_zero(tmp_path):
    line = watch_epochs.epoch_line(tmp_path / "epoch_002.pt", epochs=5)
    assert line.startswith("  epoch 3 of 5 saved (")


def test_prints_a_line_per_new_epoch_file(tmp_path):
    touch(tmp_path / "epoch_000.pt", time.time() - 100)  # before the start
    watcher = subprocess.Popen(
        [sys.executable, SCRIPT, tmp_path, "--every", "0.05"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Saved "in a minute": after the watcher's start, however slowly
        # it starts
        touch(tmp_path / "epoch_001.pt", time.time() + 60)
        ready, _, _ = select.select([watcher.stdout], [], [], 20)
        line = watcher.stdout.readline() if ready else "no line in 20 s"
    finally:
        watcher.kill()
        watcher.wait()
    assert line.startswith("  epoch 2 of 5 saved")


def handles_sigterm(pid):
    """Whether process `pid` has installed a handler for SIGTERM (Linux:
    bit 15 of the SigCgt mask in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (15 - 1)))
    return False


def test_killed_it_takes_a_last_look_and_exits_quietly(tmp_path):
    if not Path("/proc").is_dir():
        pytest.skip("reads /proc: Linux only")
    watcher = subprocess.Popen(
        [sys.executable, SCRIPT, tmp_path, "--every", "600"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 20
        while not handles_sigterm(watcher.pid) and time.time() < deadline:
            time.sleep(0.05)
        # Saved after its last look, just before make kills it
        touch(tmp_path / "epoch_004.pt", time.time() + 60)
        watcher.terminate()  # SIGTERM, as make's `kill`
        out, _ = watcher.communicate(timeout=20)
    finally:
        watcher.kill()
    assert watcher.returncode == 0  # no "Terminated" from the shell
    assert out.startswith("  epoch 5 of 5 saved")


def has_ended(pid):
    """Whether process `pid` has exited (a zombie counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state


def test_stops_when_the_shell_that_started_it_ends(tmp_path):
    if not Path("/proc").is_dir():
        pytest.skip("reads /proc: Linux only")
    # sh starts the watcher in the background, prints its process id and
    # ends at once; $$ is the shell's own process id.
    watch = f'"{sys.executable}" "{SCRIPT}" "{tmp_path}" --every 0.05'
    start = f"{watch} --while-running $$ > /dev/null 2>&1 & echo $!"
    shell = subprocess.run(
        ["sh", "-c", start], capture_output=True, text=True, check=True
    )
    pid = int(shell.stdout)
    deadline = time.time() + 10
    while not has_ended(pid) and time.time() < deadline:
        time.sleep(0.05)
    ended = has_ended(pid)
    if not ended:
        os.kill(pid, signal.SIGKILL)  # leave no watcher behind
    assert ended
