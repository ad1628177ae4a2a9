"""Fixtures shared by the tests that need the Multi30k data."""

import os
from pathlib import Path

import pytest

import the_annotated_transformer as tat

SHARED = Path(__file__).resolve().parents[2] / "shared" / "multi30k"


@pytest.fixture(scope="module")
def local_multi30k():
    """Point the downloader at a local copy of Multi30k for one module."""
    folder = os.environ.get("MULTI30K_DIR") or (
        str(SHARED) if SHARED.is_dir() else None
    )
    if folder is None:
        pytest.skip("no local Multi30k copy (set MULTI30K_DIR)")
    old = os.environ.get("MULTI30K_DIR")
    os.environ["MULTI30K_DIR"] = folder
    yield folder
    if old is None:
        os.environ.pop("MULTI30K_DIR", None)


@pytest.fixture(scope="module")
def tokenizers():
    """The German and English spaCy tokenizers."""
    return tat.load_tokenizers()


@pytest.fixture(scope="module")
def vocabs(local_multi30k, tokenizers, tmp_path_factory):
    """Word vocabularies built from the training split."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.json"
    return tat.load_vocab(*tokenizers, path=path)
