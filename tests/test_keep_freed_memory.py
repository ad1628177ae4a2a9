"""keep_freed_memory: glibc's malloc keeps what tensors free, so the next
batch's tensors reuse it without page faults. The settings it asks for,
where it asks, and the page faults it saves, counted by the kernel."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

import annotated_transformer_tools as tools

REPO = Path(__file__).resolve().parent.parent


class FakeLibc:
    """A C library whose mallopt records its calls and returns `answer`."""

    def __init__(self, answer=1):
        self.calls, self.answer = [], answer

    def mallopt(self, option, value):
        self.calls.append((option, value))
        return self.answer


def test_on_linux_it_sets_the_mmap_and_trim_thresholds():
    libc = FakeLibc()
    assert tools.keep_freed_memory(libc, system="Linux") is True
    assert libc.calls == [(-3, 32 * 2**20), (-1, 2**30)]  # glibc's numbers


def test_a_refused_setting_reports_false():
    assert tools.keep_freed_memory(FakeLibc(answer=0), system="Linux") is False


@pytest.mark.parametrize("system", ["Darwin", "Windows"])
def test_elsewhere_nothing_is_called(system):
    libc = FakeLibc()
    assert tools.keep_freed_memory(libc, system=system) is False
    assert libc.calls == []


def test_a_c_library_without_mallopt_is_left_alone():
    assert tools.keep_freed_memory(object(), system="Linux") is False


FAULTS = """
import ctypes, resource, sys, torch
import annotated_transformer_tools as tools
if sys.argv[1] == "keep":
    assert tools.keep_freed_memory()
else:  # "map": every block over 128 KiB mapped anew, a fixed threshold
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(tools.M_MMAP_THRESHOLD, 128 * 1024)
def batch():  # four 8 MB tensors, written, then freed
    tensors = [torch.ones(2_000_000) for _ in range(4)]
    del tensors
batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    batch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode):
    """Minor page faults of ten batches after the first, in a new process."""
    run = subprocess.run(
        [sys.executable, "-c", FAULTS, mode],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc only",
)
def test_freed_memory_is_reused_without_page_faults():
    """Mapped anew, each batch faults its 32 MB in, 4 KiB a fault: about
    78,000 faults in ten batches. Kept, the batches reuse the heap: here
    about 2,000 in all, one tensor's growth. (glibc's default lies in
    between, as its threshold moves: 78,000 or 9,500 here, run to run.)"""
    mapped, kept = page_faults("map"), page_faults("keep")
    assert mapped > 10 * 4 * 1000  # at least half of 32 MB a batch
    assert kept < 4 * 2_000_000 * 4 / 4096  # at most one batch's pages


def test_train_sets_both_before_anything_else(monkeypatch):
    """keep_freed_memory, then keep_built_kernels (its neighbour in the
    appendix, tests/test_keep_built_kernels.py), before the config."""
    calls = []

    def record(name):
        return lambda: calls.append(name)

    monkeypatch.setattr(tools, "keep_freed_memory", record("freed"))
    monkeypatch.setattr(tools, "keep_built_kernels", record("built"))

    def config_from_args(args):
        calls.append("config")
        raise tools.UserError("stop here")

    monkeypatch.setattr(tools, "config_from_args", config_from_args)
    with pytest.raises(tools.UserError):
        tools.command_train(None)
    assert calls == ["freed", "built", "config"]


def test_lesson_03_asks_for_it_before_its_reference_run():
    """The notebook trains in its own process, not through `train`: its
    training cell asks for the same setting first."""
    source = (REPO / "notebooks" / "03_multi30k.py").read_text()
    cells = source.split("# %%")
    (training,) = [cell for cell in cells if "tools.train_model(" in cell]
    asked = training.find("tools.keep_freed_memory()")
    assert 0 <= asked < training.find("tools.train_model(")
