"""Print the package index that `make setup` installs torch from, or
nothing for pip's own.

On Linux, PyPI's torch is the CUDA build, a download of several GB that
a machine without an NVIDIA GPU cannot use. So on Linux with no
`nvidia-smi` on the PATH (the NVIDIA driver installs it, on WSL2 too),
`make setup` takes PyTorch's CPU index instead, the README's former
`make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu`. It does
not when pip already has an index or a wheel folder of its own (from
PIP_INDEX_URL, PIP_FIND_LINKS, a pip.conf, ...): whoever set that chose
where packages come from. The choice is said on stderr, in one line.

    python tools/torch_index.py    # in the Makefile: setup's recipe
"""

import platform
import shutil
import subprocess
import sys

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PIP_SOURCES = ("index-url", "find-links")  # extra-index-url included


def pip_has_own_sources():
    """Whether pip is configured with an index or wheel folder."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return any(source in listed for source in PIP_SOURCES)


def torch_index(system, has_nvidia_smi, pip_configured):
    """The index to install torch from ("" for pip's own), and why."""
    if system != "Linux":
        return "", None  # macOS, Windows: PyPI's torch has no CUDA inside
    if has_nvidia_smi:
        return "", None  # PyPI's CUDA build, for the GPU
    if pip_configured:
        return "", (
            "make: no NVIDIA GPU found, but pip has its own package"
            " sources configured: torch comes from them"
        )
    return CPU_INDEX, (
        "make: no NVIDIA GPU found (no nvidia-smi): installing torch's CPU"
        f" build from {CPU_INDEX} (for PyPI's: rm -rf .venv, then"
        " `make setup TORCH_INDEX=`)"
    )


def main():
    system = platform.system()
    has_nvidia_smi = shutil.which("nvidia-smi") is not None
    asks_pip = system == "Linux" and not has_nvidia_smi  # else not needed
    configured = asks_pip and pip_has_own_sources()
    index, why = torch_index(system, has_nvidia_smi, configured)
    if why:
        print(why, file=sys.stderr)
    print(index)


if __name__ == "__main__":
    main()
