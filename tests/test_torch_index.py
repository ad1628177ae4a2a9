"""tools/torch_index.py: where `make setup` installs torch from."""

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "torch_index", ROOT / "tools" / "torch_index.py"
)
torch_index = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_index)
CPU = "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize(
    "system, nvidia_smi, configured, expected",
    [
        ("Linux", False, False, CPU),  # a laptop: the CPU build
        ("Linux", True, False, ""),  # a GPU: PyPI's CUDA build
        ("Linux", False, True, ""),  # pip's own sources win
        ("Darwin", False, False, ""),  # a Mac: PyPI's build has no CUDA
        ("Windows", False, False, ""),
    ],
)
def test_only_linux_without_a_gpu_takes_the_cpu_index(
    system, nvidia_smi, configured, expected
):
    index, why = torch_index.torch_index(system, nvidia_smi, configured)
    assert index == expected
    if system == "Linux" and not nvidia_smi:  # said, in one line
        assert why.startswith("make: no NVIDIA GPU found")
        assert "\n" not in why
        assert ("TORCH_INDEX=" in why) == (index == CPU)
    else:
        assert why is None


PIP_VARIABLES = ["PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"]


@pytest.mark.parametrize("variable", [None, *PIP_VARIABLES])
def test_pip_sources_are_read_from_pip_itself(variable, monkeypatch):
    """pip's own `config list`, with no configuration file read
    (PIP_CONFIG_FILE=os.devnull) and only `variable` set."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in PIP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if variable:
        monkeypatch.setenv(variable, "file:///somewhere")
    assert torch_index.pip_has_own_sources() == (variable is not None)
