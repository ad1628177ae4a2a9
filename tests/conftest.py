"""Fixtures and paths shared by the tests."""

import os
from pathlib import Path

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

ROOT = Path(__file__).resolve().parent.parent
# The local copy of Multi30k: $MULTI30K_DIR, else the workspace's shared/.
MULTI30K = Path(
    os.environ.get("MULTI30K_DIR") or ROOT.parent / "shared" / "multi30k"
)


@pytest.fixture(autouse=True)
def no_device_overrides(monkeypatch):
    """Tests decide devices and precisions themselves: a reader's
    AT_DEVICE or AT_PRECISION (docs/gpu.md) must not change them, nor
    reach the programs they start."""
    monkeypatch.delenv("AT_DEVICE", raising=False)
    monkeypatch.delenv("AT_PRECISION", raising=False)


@pytest.fixture
def one_thread():
    """Run on one thread: these tensors are tiny, and on a shared, busy
    machine every parallel op would wait for a thread that is not
    running."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def multi30k_dir():
    """The local Multi30k folder; skips the test when there is none."""
    if not (MULTI30K / "train.de.gz").is_file():
        pytest.skip(f"no local Multi30k copy in {MULTI30K} (MULTI30K_DIR)")
    return MULTI30K


@pytest.fixture(scope="module")
def local_multi30k(multi30k_dir):
    """Point the downloader at the local copy of Multi30k for one module."""
    old = os.environ.get("MULTI30K_DIR")
    os.environ["MULTI30K_DIR"] = str(multi30k_dir)
    yield str(multi30k_dir)
    if old is None:
        os.environ.pop("MULTI30K_DIR", None)
    else:
        os.environ["MULTI30K_DIR"] = old


@pytest.fixture(scope="module")
def tokenizers():
    """The German and English spaCy tokenizers."""
    return tat.load_tokenizers()


@pytest.fixture(scope="module")
def vocabs(local_multi30k, tokenizers, tmp_path_factory):
    """Word vocabularies built from the training split."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.json"
    return tools.load_vocab(*tokenizers, path=path)
