# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Appendix: the machinery
#
# The lessons teach the model, its training and its decoding. Around them
# sits code that a working program needs but a reader need not study:
# downloading and verifying the data, the training presets, a description
# of the hardware, starting several processes, and the command line.
# It lives here, after the lessons, and is exported into a second module,
# `annotated_transformer_tools.py`, which the `annotated-transformer`
# command runs. Code in this appendix may use anything the lessons defined
# (the tools module imports it from `the_annotated_transformer.py`); no
# lesson's exported code uses the appendix.

# %% [markdown]
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/annotated-transformer/done-right/blob/main/notebooks/06_tools.ipynb)

# %%
# Setup. On Colab: clone the repository, then install what the notebooks
# need. Elsewhere: use the checkout this notebook sits in.
import os
import subprocess
import sys

REPO = "https://github.com/annotated-transformer/done-right"
CLONE = REPO.rsplit("/", 1)[-1]  # the folder `git clone` makes
if "COLAB_RELEASE_TAG" in os.environ and not os.path.isdir(CLONE):
    no_prompt = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}  # no password
    git = ["git", "clone", "-q", "--depth=1", REPO, CLONE]
    if subprocess.run(git, env=no_prompt).returncode != 0:
        raise SystemExit(f"could not clone {REPO}; nothing else will run")
    pip = ["pip", "install", "-q", "-e", f"./{CLONE}[notebooks]"]
    subprocess.run([sys.executable, "-m", *pip], check=True)
ROOT = os.path.abspath(CLONE if os.path.isdir(CLONE) else "..")
sys.path.insert(0, ROOT)
AT_SIZE = os.environ.get("AT_SIZE", "full")  # "ci": minutes, not hours

# %%
#| export
import argparse
import functools
import hashlib
import http.client
import itertools
import json
import os
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import NamedTuple

import torch

# %% [markdown]
# The appendix calls functions of every lesson. Here they come from the
# lessons' module; `tools/export.py` writes the same import, generated
# from the names the exported code uses, into the tools module.
# %%
from the_annotated_transformer import BOS, EOS, MULTI30K_ENV, PAD
from the_annotated_transformer import VOCAB_LOADERS, BpeVocab, DatasetError
from the_annotated_transformer import TrainConfig, UserError, Vocab
from the_annotated_transformer import build_vocabulary, cached_greedy_decode
from the_annotated_transformer import collate_batch, data_dir, encode_text
from the_annotated_transformer import load_bpe, load_checkpoint
from the_annotated_transformer import load_tokenizers, load_trained_model
from the_annotated_transformer import load_translator, read_multi30k
from the_annotated_transformer import strip_specials, tokenize
from the_annotated_transformer import Batch, LabelSmoothing, SimpleLossCompute
from the_annotated_transformer import TrainState, make_optimizer, run_epoch
from the_annotated_transformer import create_dataloaders, model_from_config
from the_annotated_transformer import pick_device, resume_run, save_epoch
from the_annotated_transformer import rate, save_run
from the_annotated_transformer import UNK, record_attention, subsequent_mask
from the_annotated_transformer import attention_maps, make_model

# %% [markdown]
# ## Downloading Multi30k
#
# Part 3 reads Multi30k from six gzip files: `train`, `val` and
# `test_2016_flickr`, each in German and English. They come from the
# `data/task1/raw/` folder of the multi30k/dataset repository on GitHub.
# Each file's SHA-256 sum is pinned here, so a changed or truncated file is
# never used.

# %%
#| export
MULTI30K_BASE_URL = (
    "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
)
MULTI30K_SHA256 = {
    "train.de.gz": (
        "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6"
    ),
    "train.en.gz": (
        "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f"
    ),
    "val.de.gz": (
        "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a"
    ),
    "val.en.gz": (
        "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28"
    ),
    "test_2016_flickr.de.gz": (
        "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8"
    ),
    "test_2016_flickr.en.gz": (
        "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9"
    ),
}


# %% [markdown]
# Three helpers: the SHA-256 sum of a file, a copy loop that computes it
# while showing progress, and the advice every download error ends with.


# %%
#| export
def sha256_of(path):
    """Hex SHA-256 digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stream(response, out, name):
    """Copy a download into `out` with a progress bar; its SHA-256."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    size = int(response.headers.get("Content-Length") or 0) or None
    with tqdm(total=size, unit="B", unit_scale=True, desc=name) as bar:
        while chunk := response.read(1 << 16):
            out.write(chunk)
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _offline_hint(folder):
    """What to do when the files cannot be fetched."""
    return (
        f"The files belong in {folder}. Without internet access, copy the "
        "six Multi30k files (train, val and test_2016_flickr, each .de.gz "
        f"and .en.gz) there yourself, or set {MULTI30K_ENV} to a folder "
        "that holds them."
    )


# %% [markdown]
# A download goes to a temporary file next to its final place, with a
# progress bar, and is renamed only once its sum matches: an interrupted or
# corrupted download never leaves a file that looks valid. Every failure is
# a `DatasetError` whose message says what to do.


# %%
#| export
def _fetch(url, path, expected, timeout):
    """Download `url` to `path`, keeping it only if its SHA-256 matches."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=".part", dir=path.parent
        )
        with (
            os.fdopen(fd, "wb") as out,
            urllib.request.urlopen(url, timeout=timeout) as response,
        ):
            digest = _stream(response, out, path.name)
        if digest != expected:
            raise DatasetError(
                f"{url} has SHA-256 {digest}, expected "
                f"{expected}; the file was not kept.\n"
                + _offline_hint(path.parent)
            )
        os.replace(tmp, path)
        tmp = None
    except (OSError, http.client.HTTPException) as error:
        url_error = type(error) is urllib.error.URLError
        reason = error.reason if url_error else error
        raise DatasetError(
            f"Could not download {url} ({reason}).\n"
            + _offline_hint(path.parent)
        ) from error
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


# %% [markdown]
# `download_multi30k` returns the folder that holds the verified files.
# When `MULTI30K_DIR` is set (a machine without internet access, or CI),
# that folder is checked and never written to (a relative path counts from
# the working directory, and an error names the absolute path it tried);
# otherwise the files are cached in `data/multi30k/` (or `root`) and
# fetched only when missing or wrong.


# %%
#| export
def _check_folder(folder, sums):
    """`folder` if it holds every file with the right SHA-256."""
    problems = []
    for name, expected in sorted(sums.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_of(path) != expected:
            problems.append(f"{name} has the wrong SHA-256")
    if problems:
        raise DatasetError(
            f"{MULTI30K_ENV}={folder} does not hold Multi30k: "
            + "; ".join(problems)
            + f".\nPut the six files from {MULTI30K_BASE_URL} into {folder}, "
            f"or unset {MULTI30K_ENV} to download them into "
            f"{data_dir() / 'multi30k'}."
        )
    return folder


def download_multi30k(
    root=None, base_url=MULTI30K_BASE_URL, sha256=None, timeout=30.0
):
    """Folder holding the verified Multi30k files, downloaded if needed."""
    sums = MULTI30K_SHA256 if sha256 is None else sha256
    if root is None and os.environ.get(MULTI30K_ENV):
        given = os.environ[MULTI30K_ENV]
        folder = Path(given).absolute()  # relative: to the working directory
        if not folder.is_dir():
            raise DatasetError(f"{MULTI30K_ENV}={given}: no folder {folder}")
        return _check_folder(folder, sums)
    folder = Path(root) if root is not None else data_dir() / "multi30k"
    for name, expected in sums.items():
        path = folder / name
        if not (path.is_file() and sha256_of(path) == expected):
            url = base_url.rstrip("/") + "/" + name
            _fetch(url, path, expected, timeout)
    return folder


# %% [markdown]
# Check: every pinned sum matches the file the lessons read.

# %%
folder = download_multi30k()
assert read_multi30k("val", folder) == read_multi30k("val")
assert all(sha256_of(folder / n) == s for n, s in MULTI30K_SHA256.items())
print(f"{len(MULTI30K_SHA256)} files verified in {folder}")

# %% [markdown]
# ## Presets
#
# A preset is a `TrainConfig` (Part 3) with a name. `cpu` is the
# dataclass's defaults, and the recipe whose BLEU has been measured here
# (`results/multi30k_cpu.json`); it is the default on GPUs too. `paper` is
# the paper's base model, sized for a GPU, and **not measured for BLEU**:
# it has never been trained to the end in this repository. `ci` is a tiny
# model on 1,000 sentence pairs for two epochs, so that tests and the
# CI-sized notebooks finish in seconds. Each has a BPE twin (Part 5),
# with one subword vocabulary and tied embeddings.
#
# `quick` is a candidate for a model that translates after minutes, not
# hours: the `cpu` model for two epochs, with a short warm-up, a linear
# schedule down to zero at its last step, and no dropout (a run this
# short is far from overfitting: its validation loss falls to the end).
# Its settings did best in `results/recipe_sweep.md`, on the validation
# split, with a budget of 480 steps of 1,500 tokens: 20.9 greedy BLEU on
# test2016 after 15 minutes on 2 shared threads, far from the goal of 35
# (`results/recipe_quick.json`). Two epochs are 610 steps, and that run
# is not measured yet (`bench/time_to_bleu.py --preset quick` does it).

# %%
#| export
PRESETS = {
    "paper": TrainConfig(
        preset="paper",
        N=6,
        d_model=512,
        d_ff=2048,
        h=8,
        max_tokens=8000,
        epochs=40,
        checkpoint_dir="checkpoints/paper",
    ),
    "cpu": TrainConfig(),
    "quick": TrainConfig(
        preset="quick",
        max_tokens=1500,
        epochs=2,
        schedule="linear",
        warmup=150,
        factor=0.5,
        dropout=0.0,
        checkpoint_dir="checkpoints/quick",
    ),
    "ci": TrainConfig(
        preset="ci",
        N=1,
        d_model=64,
        d_ff=128,
        h=2,
        dropout=0.0,
        max_tokens=1500,
        epochs=2,
        warmup=20,
        factor=2.0,
        max_train_pairs=1000,
        precision="fp32",
        checkpoint_dir="checkpoints/ci",
    ),
}

# %% [markdown]
# The BPE twins, and `get_config`, which returns a preset with some fields
# replaced (the command line's `--epochs`, for instance).

# %%
#| export
PRESETS |= {  # the same with one BPE vocabulary and tied embeddings
    f"{name}-bpe": replace(
        PRESETS[name],
        preset=f"{name}-bpe",
        tokenization="bpe",
        tie_embeddings=True,
        checkpoint_dir=f"checkpoints/{name}-bpe",
    )
    for name in ("cpu", "ci")
}


def get_config(preset="cpu", **overrides):
    """A preset's TrainConfig with some fields replaced."""
    if preset not in PRESETS:
        raise UserError(
            f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}"
        )
    return replace(PRESETS[preset], **overrides)


# %% [markdown]
# ## Vocabularies
#
# Building the word vocabularies (Part 3) takes a few seconds, so
# `load_vocab` caches them in `data/vocab.json`, keyed by `min_freq` and the
# spaCy version, and writes the file atomically so that processes starting
# together never read half of it.


# %%
#| export
def load_vocab(spacy_de, spacy_en, path=None, min_freq=2):
    """The word vocabularies, cached as JSON in `path` (data/vocab.json)."""
    import spacy

    path = Path(path) if path is not None else data_dir() / "vocab.json"
    key = {"min_freq": min_freq, "spacy": spacy.__version__}
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("key") == key:
            return Vocab(saved["src"]), Vocab(saved["tgt"])
    vocab_src, vocab_tgt = build_vocabulary(spacy_de, spacy_en, min_freq)
    saved = {"key": key, "src": vocab_src.get_itos()}
    saved["tgt"] = vocab_tgt.get_itos()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.write_text(json.dumps(saved, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)  # atomic: parallel ranks never read half a file
    return vocab_src, vocab_tgt


# %% [markdown]
# A preset names its tokenization, and `load_vocabularies` turns that name
# into vocabularies for training: word vocabularies (Part 3), or one BPE
# vocabulary (Part 5) for both languages. `bpe_vocabularies` rebuilds the
# BPE vocabulary that a checkpoint stores as JSON text; adding it to Part
# 3's `VOCAB_LOADERS` lets `load_trained_model` open BPE checkpoints.


# %%
#| export
def load_vocabularies(config, spacy_de, spacy_en):
    """(vocab_src, vocab_tgt) for a config: words, or one BPE for both."""
    if config.tokenization == "bpe":
        bpe = load_bpe()
        return bpe, bpe
    return load_vocab(spacy_de, spacy_en)


def bpe_vocabularies(ckpt):
    """The BPE vocabulary of a checkpoint, for both sides."""
    bpe = BpeVocab.from_str(ckpt["bpe"])
    return bpe, bpe


VOCAB_LOADERS["bpe"] = bpe_vocabularies

# %% [markdown]
# Check: the cache gives back the vocabularies that Part 3 builds.

# %%
tokenizers = load_tokenizers()
vocabs = load_vocab(*tokenizers)
assert vocabs == build_vocabulary(*tokenizers)


# %% [markdown]
# ## Hardware
#
# Every result file records where it was measured: the CPU model, the
# number of threads torch uses, the torch version and any GPUs.


# %%
#| export
def hardware_summary():
    """A short description of the CPU or GPU this process runs on."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpus"] = [
            torch.cuda.get_device_name(i)
            for i in range(torch.cuda.device_count())
        ]
    return info


# %%
summary = hardware_summary()
assert summary["cpu_threads"] == torch.get_num_threads()
print(summary)

# %% [markdown]
# ### Which precision
#
# Part 3's `pick_device` chooses a CUDA GPU, then Apple's MPS, then the
# CPU. How to compute there is decided by one function, `choose_precision`,
# from what the hardware does natively:
#
# * **bfloat16 autocast** where bf16 matrix products are native: CUDA GPUs
#   of compute capability 8.0 or more (A100, L4, H100, RTX 30xx and later)
#   and CPUs with AVX512-BF16 or AMX. bf16 has the range of float32, so no
#   loss scaling is needed.
# * **float16 autocast with a `GradScaler`** on older CUDA GPUs, such as
#   Colab's T4. `torch.cuda.is_bf16_supported()` answers yes on a T4, but
#   it counts emulation, which is slower than float32. float16 is native
#   there, but its range is small: the scaler multiplies the loss before
#   the backward pass so that small gradients do not round to zero, divides
#   the gradients again before the step, and skips a step whose gradients
#   overflowed.
# * **float32** everywhere else: on MPS, and on CPUs without native bf16.
#
# A config's `precision="fp32"` turns autocast off everywhere. The CPU's
# flags come from `/proc/cpuinfo` (Linux): torch's public
# `torch.backends.cpu.get_cpu_capability()` names the vector width
# ("AVX512") but not bf16 support.


# %%
#| export
class Precision(NamedTuple):
    """How to compute: the autocast dtype (None: float32), and scaling."""

    dtype: torch.dtype | None
    scaler: bool


def cpu_has_native_bf16(cpuinfo="/proc/cpuinfo"):
    """True when the CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:  # not Linux: assume not
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def choose_precision(device, precision="bf16"):
    """The Precision for training on `device` ("fp32": no autocast)."""
    device = torch.device(device)
    if precision == "fp32":
        return Precision(None, False)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 8:  # Ampere and later: native bf16
            return Precision(torch.bfloat16, False)
        return Precision(torch.float16, True)  # e.g. a T4
    if device.type == "cpu" and cpu_has_native_bf16():
        return Precision(torch.bfloat16, False)
    return Precision(None, False)  # MPS, and CPUs without native bf16


def autocast_for(device, dtype):
    """A function returning a fresh autocast context (or a null one)."""
    if dtype is None:
        return nullcontext
    device_type = torch.device(device).type
    return lambda: torch.autocast(device_type, dtype)


def describe_device(device, precision):
    """One line: the device, its name, and how it computes."""
    device = torch.device(device)
    name = "CPU"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = "Apple GPU"
    dtype = precision.dtype
    how = "float32" if dtype is None else f"{str(dtype)[6:]} autocast"
    if precision.scaler:
        how += " with a GradScaler"
    return f"device: {device} ({name}), {how}"


# %% [markdown]
# Check, on this machine: the decision matches what the CPU's flags say,
# `fp32` always means no autocast, and the line names the device. The
# decisions for GPUs and Macs are tested in `tests/test_devices.py` on
# simulated machines.

# %%
here = pick_device()
decided = choose_precision(here)
print(describe_device(here, decided))
if here.type == "cpu":
    native = cpu_has_native_bf16()
    assert decided.dtype == (torch.bfloat16 if native else None)
assert choose_precision(here, "fp32") == Precision(None, False)

# %% [markdown]
# ## Starting processes
#
# `train_worker` (next section) trains in one process. To use several,
# the processes need a rendezvous: `free_port` asks the operating system
# for a TCP port nobody listens on, and `train_distributed_model` starts
# one process per GPU (or `world_size` CPU processes) with
# `torch.multiprocessing.spawn`. With fewer GPUs than processes it stops
# with a `ValueError` that says so, before starting anything, or, with
# `cpu_fallback=True`, runs every process on the CPU and says that. A new
# process imports the module, not the notebook that started it, so only
# plain data crosses over: vocabularies as token lists (or BPE JSON text)
# and the config as a dict, which `_spawned_worker` turns back into
# objects before it calls `train_worker`. Under `torchrun` none of this is
# needed: it starts the processes and sets the rendezvous address itself.


# %%
#| export
def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker(
    rank, world_size, vocabs, tokenizers, config, port, resume, device
):
    """train_worker in a new process, from plain data."""
    vocabs = [
        BpeVocab.from_str(v) if isinstance(v, str) else Vocab(v)
        for v in vocabs
    ]
    config = TrainConfig(**config)
    if device == "cuda":  # one GPU per process, by rank
        device = f"cuda:{rank}"
    train_worker(
        rank,
        world_size,
        *vocabs,
        *tokenizers,
        config,
        is_distributed=True,
        port=port,
        resume=resume,
        device=device,
    )


def train_distributed_model(
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    config,
    world_size=None,
    resume=False,
    cpu_fallback=False,
):
    """Train with one process per GPU (or world_size CPU processes)."""
    import torch.multiprocessing as mp

    world_size = world_size or max(cuda_count(), 1)
    device = process_device(0, world_size, cpu_fallback).type  # may raise
    how = "one per GPU, with nccl"
    if device != "cuda":  # gloo cannot send MPS tensors
        device, how = "cpu", "on the CPU, with gloo"
        if cuda_count():
            how += f" (NCCL needs a GPU per process; {cuda_count()} here)"
    print(f"{world_size} processes {how}")
    plain = lambda v: v.to_str() if hasattr(v, "to_str") else v.get_itos()
    vocabs = [plain(vocab_src), plain(vocab_tgt)]
    data = (vocabs, (spacy_de, spacy_en), asdict(config), free_port())
    args = (world_size, *data, resume, device)
    mp.spawn(_spawned_worker, args, nprocs=world_size)


# %% [markdown]
# `train_model` chooses between one process and several.


# %%
#| export
def train_model(
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    config,
    distributed=False,
    world_size=None,
    resume=False,
):
    """Train in this process, or in several when `distributed`."""
    args = (vocab_src, vocab_tgt, spacy_de, spacy_en, config)
    if distributed:
        return train_distributed_model(*args, world_size, resume)
    return train_worker(0, 1, *args, resume=resume)


# %% [markdown]
# Check: a port from `free_port` can be bound right away.

# %%
with socket.socket() as s:
    s.bind(("127.0.0.1", free_port()))

# %% [markdown]
# ## Training runs: devices and processes
#
# Part 3's `train_one_process` is the whole training loop in one process.
# `train_worker` runs the same loop, on the same pieces, and adds what a
# long run needs:
#
# * **Checkpoint files**, written after every epoch (see "Checkpoint
#   files"), and resuming from them.
# * **Lower precision** where the hardware computes it natively, as
#   `choose_precision` (see "Hardware") decides.
# * **Several processes.** With $n$ processes, `DistributedDataParallel`
#   (DDP) keeps a copy of the model in each. Every process computes
#   gradients on its own share of the batches, and DDP averages them
#   across processes before each optimizer step, so the copies stay equal.
#   The processes talk through `torch.distributed`: the NCCL backend
#   between GPUs, gloo between CPU processes.
# * **No waiting on the GPU.** Batches are copied from pinned memory, so
#   the copy overlaps the computation, and their masks are made on the
#   GPU. The loss stays on the GPU until the end of the epoch (Part 2's
#   `run_epoch`).
#
# `tests/test_devices.py` checks that `train_worker` and
# `train_one_process` end with the same weights and losses.
#
# ### One device per process
#
# `process_device` gives each process its device. With CUDA, each process
# gets a GPU of its own, numbered by its *local* rank, its rank among the
# processes of this machine (`torchrun` sets `LOCAL_RANK`; the global
# `RANK` counts the processes of every machine). NCCL refuses two
# processes on one GPU, so with fewer GPUs than processes there are two
# honest answers: an error that says so, or, when the caller allows it,
# all processes on the CPU with gloo. Without CUDA, one process gets
# `pick_device`'s choice (Apple's GPU, or the CPU), and several processes
# use the CPU: gloo cannot send MPS tensors.


# %%
#| export
def cuda_count():
    """How many CUDA GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def process_device(local_rank=0, local_world_size=1, cpu_fallback=False):
    """The device of one process: pick_device's, its own GPU, or the CPU."""
    gpus = cuda_count()
    if gpus >= local_world_size:
        return torch.device("cuda", local_rank)
    if local_world_size == 1:  # no GPU: Apple's, or the CPU
        return pick_device()
    if gpus and not cpu_fallback:
        raise ValueError(
            f"{local_world_size} processes need a GPU each, and this "
            f"machine has {gpus}; use at most {gpus} processes"
        )
    return torch.device("cpu")


def backend_for(device):
    """The torch.distributed backend for processes on this device type."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# %% [markdown]
# ### A run, in pieces
#
# `train_worker` is what each process runs, and we build it from a few
# pieces. The first, `TrainingRun`, sets up a run: it selects its device
# (`torch.cuda.set_device`, so that NCCL and new tensors use this
# process's GPU), joins the process group if there are several processes,
# seeds, builds the model and wraps it in DDP, and makes the loss,
# optimizer and schedule, and a `GradScaler` where the precision needs
# one. `module` is the bare model, whose weights checkpoints store, and
# `model` is what we call, DDP-wrapped when distributed. `params_in_sync`
# checks at the end that all copies agree.


# %%
#| export
class TrainingRun:
    """One process's model, loss, optimizer, schedule and history."""

    def __init__(
        self, rank, world_size, sizes, c, distributed, port=None, device=None
    ):
        self.config, self.rank = c, rank
        if device is None:
            device = process_device(rank, world_size if distributed else 1)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif world_size > 1:  # processes share the CPU cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if distributed:  # env:// under torchrun, else a port on this machine
            url = None if port is None else f"tcp://127.0.0.1:{port}"
            torch.distributed.init_process_group(
                backend_for(self.device),
                url,
                rank=rank,
                world_size=world_size,
            )
        torch.manual_seed(c.seed)
        self.model = self.module = model_from_config(c, *sizes).to(self.device)
        if distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            DDP = torch.nn.parallel.DistributedDataParallel
            self.model = DDP(self.module, device_ids=ids)
        self.criterion = LabelSmoothing(sizes[1], PAD, c.label_smoothing)
        self.optimizer, self.scheduler = make_optimizer(
            self.module, c.d_model, c.factor, c.warmup
        )
        self.precision = choose_precision(self.device, c.precision)
        self.autocast = autocast_for(self.device, self.precision.dtype)
        self.scaler = None
        if self.precision.scaler:
            self.scaler = torch.amp.GradScaler(self.device.type)
        self.state, self.history = TrainState(), []


def params_in_sync(module):
    """True when every process holds exactly the same parameters."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


# %% [markdown]
# Two details of bigger runs wrap each micro-batch, which is why Part 2's
# `run_epoch` runs it through `micro_step`:
#
# * **Gradient accumulation under DDP.** Every backward pass of a
#   DDP-wrapped model averages gradients across processes; micro-batches
#   that do not step skip that inside `model.no_sync()`.
# * **Autocast.** `autocast` is a function returning a context, entered
#   afresh around each micro-batch's forward pass and loss. One region
#   around a whole epoch would be a silent bug: autocast caches its
#   low-precision weight copies until the region ends, so later steps
#   would compute with stale weights. With float16, `run_epoch` also takes
#   the `GradScaler`.
#
# `device_batch` builds a `Batch` with its masks made on the device: it
# copies the two id tensors (asynchronously, from pinned memory) and
# counts the target tokens on the CPU first, because counting them on
# the GPU would make the CPU wait for it. `all_reduce_loss` turns each
# process's mean loss into the mean over all processes' tokens, so that
# the validation loss covers the whole validation set.


# %%
#| export
def device_batch(src, tgt, device, pad=PAD):
    """Batch(src, tgt, pad) on `device`, its masks made there."""
    ntokens = int(tgt[:, 1:].ne(pad).sum())  # on the CPU: no GPU sync
    src = src.to(device, non_blocking=True)  # (B, S)
    tgt = tgt.to(device, non_blocking=True)  # (B, T + 1)
    batch = Batch(src, None, pad)  # the source mask, made on `device`
    batch.tgt, batch.tgt_y = tgt[:, :-1], tgt[:, 1:]  # (B, T) each
    batch.tgt_mask = Batch.make_std_mask(batch.tgt, pad)  # (B, T, T)
    batch.ntokens = ntokens
    return batch


def counted(batches, tally):
    """Yield the batches, adding their target tokens to tally[0]."""
    for batch in batches:
        tally[0] += batch.ntokens
        yield batch


def all_reduce_loss(loss, tokens, device):
    """The loss per token over every process (this one's alone if one)."""
    if not torch.distributed.is_initialized():
        return loss
    totals = torch.tensor([loss * tokens, tokens], device=device)
    torch.distributed.all_reduce(totals)  # sums over processes
    return (totals[0] / totals[1].clamp(min=1)).item()


# %% [markdown]
# `train_epoch` runs one epoch: a training pass, then a validation pass,
# both through Part 2's `run_epoch`, and it records both losses, each
# averaged over all processes. Only rank 0 prints: a tqdm bar over the
# batches, once an epoch has taken more than three seconds, then both
# losses, with the peak GPU memory from `torch.cuda`'s own statistics.


# %%
#| export
def train_epoch(run, epoch, train_loader, valid_loader, show=True):
    """Train for one epoch, then validate; returns the history entry."""
    loss = SimpleLossCompute(run.module.generator, run.criterion)
    train_loader.batch_sampler.set_epoch(epoch)
    if show and run.rank == 0:  # a bar, once an epoch takes over 3 s
        from tqdm.auto import tqdm  # here: the module needs only torch

        train_loader = tqdm(train_loader, f"epoch {epoch}", delay=3)
    train_tokens, val_tokens = [0], [0]
    batches = (device_batch(s, t, run.device) for s, t in train_loader)
    run.model.train()
    train_loss, run.state = run_epoch(
        counted(batches, train_tokens),
        run.model,
        loss,
        run.optimizer,
        run.scheduler,
        accum_iter=run.config.accum_iter,
        train_state=run.state,
        autocast=run.autocast,
        scaler=run.scaler,
    )
    run.model.eval()
    batches = (device_batch(s, t, run.device) for s, t in valid_loader)
    val_loss, _ = run_epoch(
        counted(batches, val_tokens),
        run.model,
        loss,
        mode="eval",
        autocast=run.autocast,
    )
    train_loss = all_reduce_loss(train_loss, train_tokens[0], run.device)
    val_loss = all_reduce_loss(val_loss, val_tokens[0], run.device)
    entry = {"epoch": epoch, "train_loss": train_loss, "val_loss": val_loss}
    run.history.append(entry | {"steps": run.state.accum_step})
    if show and run.rank == 0:
        report = f"epoch {epoch}: train {train_loss:.3f}, val {val_loss:.3f}"
        if run.device.type == "cuda":
            gib = torch.cuda.max_memory_allocated(run.device) / 2**30
            report += f" (GPU memory {gib:.1f} GiB)"
        print(report)
    return run.history[-1]


# %% [markdown]
# ### A schedule for a known budget
#
# Part 2's schedule decays as $1/\sqrt{\text{step}}$ and never reaches
# zero: it suits a run of unknown length. When the number of steps is
# known in advance, a run can instead warm up quickly and then lower the
# rate in a straight line, to reach zero as its last step ends
# (`schedule="linear"` in a `TrainConfig`), a common choice for short
# runs; `bench/recipe_sweep.py` measures it. Its peak is the peak of Part
# 2's schedule, so that `factor`, `d_model` and `warmup` keep their
# meaning. `set_schedule` swaps it in once the loader has said how many
# steps an epoch takes.


# %%
#| export
def warmup_then_linear(step, peak, warmup, total):
    """Linear warm-up to `peak`, then a straight line to zero at `total`."""
    step = max(step, 1)
    if step < warmup:
        return peak * step / warmup
    return peak * max(0, total - step) / max(1, total - warmup)


def set_schedule(run, steps_per_epoch, total=None):
    """Give `run` the schedule its config names, for its step budget.

    `total` replaces the budget of `epochs` whole epochs, for a run that
    stops part of the way through an epoch.
    """
    c = run.config
    if c.schedule not in ("noam", "linear"):
        raise ValueError(f"unknown schedule {c.schedule!r}: noam or linear")
    if c.schedule == "noam":  # Part 2's, already made by TrainingRun
        return
    if total is None:
        total = steps_per_epoch * c.epochs // c.accum_iter
    peak = rate(c.warmup, c.d_model, c.factor, c.warmup)
    run.optimizer, run.scheduler = make_optimizer(
        run.module,
        c.d_model,
        schedule=lambda step: warmup_then_linear(step, peak, c.warmup, total),
    )


# %% [markdown]
# Check: the rate rises to Part 2's peak at the end of the warm-up, then
# falls by the same amount at every step and is zero at the last one.

# %%
peak = rate(100, 256, 1.0, 100)
lrs = [warmup_then_linear(s, peak, 100, 1000) for s in range(1, 1001)]
assert abs(max(lrs) - peak) < 1e-12 and lrs[99] == peak and lrs[-1] == 0
steps_down = [a - b for a, b in zip(lrs[99:], lrs[100:])]
assert max(steps_down) - min(steps_down) < 1e-12


# %% [markdown]
# `train_worker` composes the pieces with the checkpoint files. Rank 0
# says in one line where it trains, writes the files after every epoch,
# and, after the last epoch, checks that all ranks ended with the same
# weights and writes `final.pt`. Whatever happens, a process leaves its
# process group on the way out (`finally`), so that a failed run does not
# leave the others waiting.


# %%
#| export
def train_worker(
    rank,
    world_size,
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    config,
    is_distributed=False,
    port=None,
    resume=False,
    show_progress=True,
    device=None,
):
    """Train on Multi30k in one process; returns the history of losses."""
    sizes = (len(vocab_src), len(vocab_tgt))
    try:
        run = TrainingRun(
            rank, world_size, sizes, config, is_distributed, port, device
        )
        if show_progress and rank == 0:
            print(describe_device(run.device, run.precision))
        loaders = create_dataloaders(
            vocab_src,
            vocab_tgt,
            spacy_de,
            spacy_en,
            max_tokens=config.max_tokens,
            max_len=config.max_len,
            rank=rank,
            world_size=world_size,
            seed=config.seed,
            num_workers=config.num_workers,
            max_train_pairs=config.max_train_pairs,
            pin_memory=run.device.type == "cuda",
        )
        set_schedule(run, len(loaders[0]))
        for epoch in range(resume_run(run) if resume else 0, config.epochs):
            train_epoch(run, epoch, *loaders, show=show_progress)
            if rank == 0:
                save_epoch(run, epoch, vocab_src, vocab_tgt)
        in_sync = params_in_sync(run.module) if is_distributed else True
        if rank == 0:
            last = {"epoch": config.epochs - 1, "ranks_in_sync": in_sync}
            save_run(run, "final.pt", vocab_src, vocab_tgt, **last)
        return run.history
    finally:
        if is_distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# %% [markdown]
# ### The notebooks' choices
#
# Part 3's training cell asks `lesson_training_plan` what to do, so that
# the choices can be tested on simulated machines. In a CI-sized run it
# trains the tiny `ci` preset. Otherwise it uses the `cpu` preset on every
# device, GPUs included: it is the recipe whose BLEU this repository has
# measured (`paper` has never been trained to a BLEU score here), and it
# trains only when its `final.pt` does not exist yet.


# %%
#| export
class TrainingPlan(NamedTuple):
    """What a notebook trains, where, how, and whether it must."""

    preset: str
    config: TrainConfig
    device: torch.device
    precision: Precision
    train: bool
    line: str


def lesson_training_plan(size="full", root="."):
    """Part 3's choices: preset, device, precision, and whether to train."""
    preset = "ci" if size == "ci" else "cpu"
    folder = Path(root, "checkpoints", preset)
    config = get_config(preset, checkpoint_dir=str(folder))
    device = pick_device()
    precision = choose_precision(device, config.precision)
    train = preset == "ci" or not Path(folder, "final.pt").is_file()
    what = "training" if train else "found its final.pt"
    line = f"{describe_device(device, precision)}; preset {preset}: {what}"
    return TrainingPlan(preset, config, device, precision, train, line)


# %% [markdown]
# Check: the tiny `ci` preset, for one epoch, in two processes started by
# `train_distributed_model` (from a terminal: `torchrun
# --nproc_per_node=2 the_annotated_transformer.py train`). On a machine
# with two GPUs or more each process gets one; elsewhere both run on the
# CPU with gloo (`cpu_fallback=True`), and the first line printed says
# which. Each process sees half of the batches. Both ranks must end with
# identical weights. A spawned process imports the module, not this
# notebook, so the cell calls the module's `train_distributed_model`.

# %%
import annotated_transformer_tools as tools

with tempfile.TemporaryDirectory() as tmp:
    ddp = get_config("ci", epochs=1, checkpoint_dir=tmp)
    tools.train_distributed_model(
        *vocabs, *tokenizers, ddp, world_size=2, cpu_fallback=True
    )
    assert load_checkpoint(f"{tmp}/final.pt")["ranks_in_sync"]


# %% [markdown]
# ## Translating for users
#
# Three greedy decoders exist, and each has a reason to. `greedy_decode`
# (Part 2) is the original tutorial's, one sentence at a time, kept for its
# API. `batch_greedy_decode` (Part 3) is the readable batched version that
# a lesson can explain in one cell, and the reference that the cached
# decoder is tested against. `cached_greedy_decode` (Part 5) gives the same
# outputs, much faster, with a key/value cache, and it is the one default
# of everything a user calls: `translate_batch`, `translate`, and the
# command line (`--beam K` switches to beam search).
#
# The model writes spaCy tokens, while BLEU is computed by sacreBLEU on
# plain text against untouched references, so the tokens are joined back
# into a sentence. `detokenize` undoes what spaCy's English tokenizer
# splits off: punctuation, clitics such as `'s` and `n't`, and hyphens
# inside words. A vocabulary with its own `decode` (Part 5) needs none of
# this.


# %%
#| export
_NO_SPACE_BEFORE = set(
    ". , ! ? ; : ) ] } % 's 're 've 'll 'm 'd n't '".split()
)
_NO_SPACE_AFTER = ("(", "[", "{", "$", "#")


def detokenize(tokens):
    """Join English spaCy tokens into a plain sentence."""
    out, quote_open = "", False
    for i, tok in enumerate(tokens):
        hyphen = out.endswith("-") and i > 1 and tokens[i - 1] == "-"
        glue = (
            i == 0
            or tok.lower() in _NO_SPACE_BEFORE
            or out.endswith(_NO_SPACE_AFTER)
            or tok == "-"
            or (hyphen and tokens[i - 2] not in {",", ".", "-"})
        )
        if tok == '"':
            glue = i == 0 or quote_open
            quote_open = not quote_open
        elif out.endswith('"') and quote_open:
            glue = True
        out += tok if glue else " " + tok
    return out


def decode_text(ids, vocab):
    """Plain text of output ids (without `<s>` and `</s>`)."""
    if hasattr(vocab, "decode"):  # a vocabulary that writes text (Part 5)
        return vocab.decode(ids)
    return detokenize(vocab.lookup_tokens(ids))


# %% [markdown]
# ### Unknown words
#
# A word vocabulary writes `<unk>` for every English word it does not know,
# and the trained `cpu` model does so, often where the German has a name,
# a number or a rare noun that could simply be copied. Unknown-word
# replacement (Luong et al., 2015; Jean et al., 2015, who used the
# attention weights as we do) copies, for each `<unk>`, the German word
# that the decoder attended to most when it wrote the `<unk>`. We read the
# source attention (Part 4) averaged over every head of every decoder
# layer. The last layer alone, whose output the generator turns into the
# word, is the obvious choice but a worse aligner: on the validation set
# the `cpu` model's unknown English words came from a German word outside
# the vocabulary 47% of the time with the last layer and 66% with the
# mean (`results/unk_replacement.md`).
#
# The decoders do not keep their attention, so `source_alignment` runs the
# decoder once more over the finished output, teacher-forced, inside Part
# 4's `record_attention`. The decoder is causal, so each row sees the same
# prefix as when that token was written, and the weights are the same up
# to rounding; one batched pass serves greedy and beam search alike. Row
# $t$ reads the decoder input $t$ and wrote output token $t+1$ (the `<s>`
# offset). The argmax runs over the source's words only, never over `<s>`,
# `</s>` or padding. `replace_unknowns` then takes the words from spaCy's
# tokens of the German text, not from the ids: a German word outside the
# vocabulary is itself an `<unk>` there. A BPE vocabulary spells every
# word from pieces and is left alone.


# %%
#| export
@torch.no_grad()
def source_alignment(model, src, src_mask, out, layers=None):
    """(B, L-1): the source position each output token after <s> read most.

    `layers` picks the decoder layers to average (default: all)."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    ys = out[:, :-1]  # (B, T): decoder inputs; row t wrote out[:, t + 1]
    tgt_mask = subsequent_mask(ys.size(1)).to(src.device)  # (1, T, T)
    decoder = model.decoder.layers
    chosen = range(len(decoder)) if layers is None else layers
    with record_attention(model):
        model.decode(memory, src_mask, ys, tgt_mask)
        weights = [decoder[i].src_attn.attn for i in chosen]  # (B, h, T, S)
    attn = torch.stack(weights).mean(dim=(0, 2))  # (B, T, S): layers, heads
    words = src_mask & ((src != BOS) & (src != EOS)).unsqueeze(1)  # (B, 1, S)
    return attn.masked_fill(~words, -1.0).argmax(dim=-1)


def replace_unknowns(ids, aligned, src_words, vocab_tgt):
    """Output tokens, each <unk> replaced by the source word it read most."""
    tokens = vocab_tgt.lookup_tokens(ids)
    for k, token_id in enumerate(ids):
        j = aligned[k] if token_id == UNK else 0  # 0 is <s>: no word
        if 0 < j <= len(src_words):  # source position j is word j - 1
            tokens[k] = src_words[j - 1]
    return tokens


# %% [markdown]
# **See, it matches.** For a small random model and three sentences of
# different lengths decoded as one padded batch, the alignment equals the
# argmax of Part 4's `attention_maps` (averaged over layers and heads),
# computed for each sentence alone and without padding, over its words.

# %%
torch.manual_seed(0)
toy = make_model(20, 20, N=2, d_model=32, d_ff=64, h=4).eval()
rows = [[BOS, *range(4, 4 + n), EOS] for n in (7, 3, 5)]
src, _ = collate_batch([(r, []) for r in rows])  # (B, S)
src_mask = (src != PAD).unsqueeze(-2)  # (B, 1, S)
out = cached_greedy_decode(toy, src, src_mask, 8)  # (B, L)
aligned = source_alignment(toy, src, src_mask, out)  # (B, L - 1)
for ids, row, at in zip(rows, out.tolist(), aligned.tolist(), strict=True):
    maps = attention_maps(toy, ids, [BOS, *strip_specials(row), EOS])
    mean = maps.decoder_src.mean(dim=(0, 1))  # (T, S): layers and heads
    words = mean[:, 1 : len(ids) - 1]  # (T, words)
    alone = (words.argmax(-1) + 1).tolist()  # back to source positions
    m = min(len(alone), len(at))  # rows up to </s>
    assert at[:m] == alone[:m] and all(1 <= j < len(ids) - 1 for j in at)


# %% [markdown]
# `translate_batch` sorts the sentences by length so that a batch wastes
# little on padding, decodes up to the source length + 50 tokens (the
# paper's limit), replaces unknown words (unless `replace_unk=False`), and
# returns the outputs in the input order. `decode_fn` can be any decoder
# with the signature of the greedy ones.


# %%
#| export
def translate_batch(
    model, sentences, spacy_de, vocab_src, vocab_tgt, device=None,
    batch_size=128, max_extra=50, decode_fn=cached_greedy_decode,
    replace_unk=True,
):  # fmt: skip
    """German sentences to detokenized English, in input order."""
    decode_fn = decode_fn or cached_greedy_decode
    if device is None:  # wherever the model is
        device = next(model.parameters()).device
    model.eval()
    if hasattr(vocab_src, "encode") or hasattr(vocab_tgt, "decode"):
        replace_unk = False  # BPE: no <unk> to replace
    if replace_unk:  # keep the German words: an <unk> id has lost its word
        german = [tokenize(s, spacy_de) for s in sentences]
        encoded = [[BOS, *vocab_src(w), EOS] for w in german]
    else:
        encoded = [
            [BOS, *encode_text(s, spacy_de, vocab_src), EOS] for s in sentences
        ]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    results = [None] * len(encoded)
    for k in range(0, len(order), batch_size):
        idx = order[k : k + batch_size]
        src, _ = collate_batch([(encoded[i], []) for i in idx])
        src = src.to(device)  # (B, S)
        mask = (src != PAD).unsqueeze(-2)  # (B, 1, S)
        out = decode_fn(model, src, mask, src.size(1) + max_extra)  # (B, L)
        aligned = [None] * len(idx)
        if replace_unk and (out == UNK).any():  # one more decoder pass
            aligned = source_alignment(model, src, mask, out).tolist()
        for i, row, at in zip(idx, out.tolist(), aligned, strict=True):
            # Stop at this sentence's own limit, whatever its batch-mates.
            ids = strip_specials(row[: len(encoded[i]) + max_extra])
            if at is None:
                results[i] = decode_text(ids, vocab_tgt)
            else:
                tokens = replace_unknowns(ids, at, german[i], vocab_tgt)
                results[i] = detokenize(tokens)
    return results


def compute_bleu(hypotheses, references):
    """Cased corpus BLEU (sacreBLEU, 13a tokenization) of plain text."""
    import sacrebleu

    return sacrebleu.corpus_bleu(hypotheses, [references])


# %% [markdown]
# `translate` is the shortest way to use a trained model.


# %%
#| export
def translate(
    sentences, checkpoint="checkpoints/cpu/final.pt", beam=1, average=0,
    replace_unk=True, device="auto",
):  # fmt: skip
    """English translations of German sentences, with a trained model."""
    if device in (None, "auto"):
        device = pick_device()
    model, vocab_src, vocab_tgt, decode_fn = load_translator(
        checkpoint, device, beam, average
    )
    spacy_de, _ = load_tokenizers()
    return translate_batch(
        model, sentences, spacy_de, vocab_src, vocab_tgt, decode_fn=decode_fn,
        replace_unk=replace_unk,
    )  # fmt: skip


# %% [markdown]
# `check_outputs` and `run_model_example` keep the original tutorial's
# names for printing a few validation translations.


# %%
#| export
def check_outputs(model, pairs, spacy_de, vocab_src, vocab_tgt, n_examples=5):
    """Print source, reference and model output for some pairs."""
    pairs = list(pairs)[:n_examples]
    hyps = translate_batch(
        model, [de for de, _ in pairs], spacy_de, vocab_src, vocab_tgt
    )
    for i, ((de, en), hyp) in enumerate(zip(pairs, hyps, strict=True)):
        print(f"example {i}\n  source: {de}\n  reference: {en}")
        print(f"  model: {hyp}")
    return hyps


def run_model_example(checkpoint="checkpoints/cpu/final.pt", n_examples=5):
    """Load a trained model and show some validation translations."""
    model, vocab_src, vocab_tgt, _ = load_trained_model(checkpoint)
    spacy_de, _ = load_tokenizers()
    pairs = read_multi30k("val")
    return check_outputs(
        model, pairs, spacy_de, vocab_src, vocab_tgt, n_examples
    )


# %% [markdown]
# ## Checkpoints from older versions
#
# Part 1 names every weight for what it is: an attention layer's four
# projections are `w_q`, `w_k`, `w_v` and `w_o`, and a layer's residual
# blocks are `self_attn_block`, `src_attn_block` and `ff_block`. Earlier
# versions of this project kept the 2022 names: a list `linears` of four
# projections, in that order, and a list `sublayer` of residual blocks,
# in the order the layer applies them. `rename_old_keys` maps a state dict
# with the old names to the new ones; keys already new pass unchanged, in
# their order. (2022 checkpoint files themselves cannot be used: their
# vocabularies are pickled torchtext objects.)


# %%
#| export
OLD_PROJECTIONS = {"0": "w_q", "1": "w_k", "2": "w_v", "3": "w_o"}
OLD_BLOCKS = {
    "encoder": {"0": "self_attn_block", "1": "ff_block"},
    "decoder": {
        "0": "self_attn_block",
        "1": "src_attn_block",
        "2": "ff_block",
    },
}


def rename_old_key(key):
    """One state-dict key with the old list names replaced by new names."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        following = parts[i + 1]
        if part == "linears" and following in OLD_PROJECTIONS:
            parts[i : i + 2] = [OLD_PROJECTIONS[following]]
            break
        if part == "sublayer" and parts[0] in OLD_BLOCKS:
            blocks = OLD_BLOCKS[parts[0]]  # encoder or decoder layer
            if following in blocks:
                parts[i : i + 2] = [blocks[following]]
                break
    return ".".join(parts)


def rename_old_keys(state_dict):
    """A state dict (old or new names) with the names Part 1 uses now."""
    return {rename_old_key(key): value for key, value in state_dict.items()}


# %% [markdown]
# **See, it matches.** Old keys from each kind of place land on keys that
# a new model has. (`tests/test_model.py` loads a whole model saved with
# the old names and checks that it computes the same outputs.)

# %%
model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
old_keys = [
    "encoder.layers.0.self_attn.linears.0.weight",
    "encoder.layers.0.sublayer.1.norm.a_2",
    "decoder.layers.0.src_attn.linears.3.bias",
    "decoder.layers.0.sublayer.1.norm.b_2",
]
for key in old_keys:
    print(f"{key:45s} -> {rename_old_key(key)}")
    assert rename_old_key(key) in model.state_dict()


# %% [markdown]
# ## Which model is this?
#
# A translation, an attention map or a BLEU score means little without
# the model behind it. `describe_checkpoint` names a checkpoint in one
# line: its preset and sizes, its vocabulary and how long it trained. The
# notebooks print it as `model: ...` whenever they load one, and the
# website puts those lines at the top of each page.


# %%
#| export
def describe_checkpoint(path):
    """One line: a checkpoint's file, preset, sizes and training."""
    ckpt = load_checkpoint(path)
    c, history = ckpt["config"], ckpt.get("history") or []
    pairs = c.get("max_train_pairs") or 0
    data = f"{pairs:,d} training pairs" if pairs else "all training pairs"
    trained = f"{len(history)} epochs on {data}"
    if history:
        trained += f", validation loss {history[-1]['val_loss']:.2f}"
    name = f"{Path(path).parent.name}/{Path(path).name}"
    return (
        f"{name}, preset {c.get('preset', '?')} (N={c['N']}, "
        f"d_model={c['d_model']}, h={c['h']}, "
        f"{c.get('tokenization', 'word')} vocabulary), {trained}"
    )


# %% [markdown]
# ## A trained model, or a small one trained now
#
# Parts 4 and 5 show a trained model's attention and translations.
# `find_or_train` returns the `final.pt` of the first preset that `make
# train` has already trained. When there is none, or in a CI-sized run,
# it trains a small stand-in there and then, in seconds, so every
# notebook runs on a fresh clone and CI checks the training code rather
# than a leftover file.


# %%
#| export
def find_or_train(
    presets, stand_in, vocabs, tokenizers, root=".", size="full"
):
    """final.pt of the first trained preset, else train `stand_in` now."""
    for preset in presets if size != "ci" else ():
        final = Path(root, get_config(preset).checkpoint_dir, "final.pt")
        if final.is_file():
            return str(final)
    train_worker(0, 1, *vocabs, *tokenizers, stand_in, show_progress=False)
    return str(Path(stand_in.checkpoint_dir, "final.pt"))


# %% [markdown]
# Check: the first call trains (there is nothing to find), the second
# finds that model and leaves it untouched, and a CI-sized call trains
# again.

# %%
with tempfile.TemporaryDirectory() as tmp:
    folder = f"{tmp}/{get_config('ci').checkpoint_dir}"
    small = get_config(
        "ci", epochs=1, max_train_pairs=200, checkpoint_dir=folder
    )
    found = find_or_train(["ci"], small, vocabs, tokenizers, root=tmp)
    written = os.stat(found).st_mtime_ns
    assert find_or_train(["ci"], small, vocabs, tokenizers, tmp) == found
    assert os.stat(found).st_mtime_ns == written
    find_or_train(["ci"], small, vocabs, tokenizers, tmp, size="ci")
    assert os.stat(found).st_mtime_ns != written


# %% [markdown]
# ## Reading text files
#
# `iter_lines` reads the text to translate or score one line at a time:
# a plain file, a gzipped one, or standard input for `-`. It decodes each
# line by itself, so a file that is not UTF-8 is refused with the number
# of its first bad line, as a `UserError` rather than a traceback.
# `read_lines` reads a whole file.


# %%
#| export
def iter_lines(path):
    """Lines of a UTF-8 text file (plain, .gz, or "-": stdin), lazily."""
    import gzip
    from contextlib import nullcontext

    stdin = str(path) == "-"
    name, number = "standard input" if stdin else Path(path), 0
    try:
        if stdin:
            opened = nullcontext(sys.stdin.buffer)
        elif not name.is_file():
            raise UserError(f"no such file: {name}")
        else:
            opened = (gzip.open if name.suffix == ".gz" else open)(name, "rb")
        with opened as f:
            for line in f:
                number += 1
                yield line.rstrip(b"\r\n").decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{name} is not UTF-8 text (line {number})") from None
    except (OSError, EOFError) as err:  # not gzip, truncated, unreadable
        raise UserError(f"cannot read {name}: {err}") from None


def read_lines(path):
    """Lines of a plain or gzipped UTF-8 text file, without newlines."""
    return list(iter_lines(path))


# %% [markdown]
# `evaluate_files` scores a model on any pair of line-by-line translations.
# `read_parallel` reads the pair first and refuses files of different
# lengths, or empty ones, with a message, not a traceback.
# `write_results` scores test2016 after a training run and writes a JSON
# summary with the command, the config, the hardware and the losses.


# %%
#| export
def read_parallel(src_path, ref_path):
    """(sources, references): two files of line-by-line translations."""
    sources, references = read_lines(src_path), read_lines(ref_path)
    if len(sources) != len(references):
        raise UserError(
            f"{src_path} has {len(sources)} lines but {ref_path} has "
            f"{len(references)}; they must be line-by-line translations"
        )
    if not sources:
        raise UserError(f"{src_path} is empty")
    return sources, references


def evaluate_files(
    model,
    src_path,
    ref_path,
    spacy_de,
    vocab_src,
    vocab_tgt,
    device="cpu",
    batch_size=128,
    decode_fn=cached_greedy_decode,
    replace_unk=True,
):
    """(BLEU, hypotheses) of a model on a parallel pair of text files."""
    sources, references = read_parallel(src_path, ref_path)
    hyps = translate_batch(
        model,
        sources,
        spacy_de,
        vocab_src,
        vocab_tgt,
        device,
        batch_size,
        decode_fn=decode_fn,
        replace_unk=replace_unk,
    )
    return compute_bleu(hyps, references), hyps


# %%
#| export
def write_results(path, checkpoint, wall_time):
    """Score test2016 and write a JSON summary of the training run."""
    sources, references = zip(*read_multi30k("test"), strict=True)
    kept = translate(list(sources), checkpoint, replace_unk=False)
    bleu = compute_bleu(translate(list(sources), checkpoint), references)
    kept_bleu = compute_bleu(kept, references)  # <unk> left in the output
    ckpt = load_checkpoint(checkpoint)
    summary = {
        "command": "python " + " ".join(sys.argv),
        "config": ckpt["config"],
        "hardware": hardware_summary(),
        "wall_time_s": round(wall_time, 1),
        "epochs": len(ckpt["history"]),
        "history": ckpt["history"],
        "test2016_bleu_greedy": round(bleu.score, 2),
        "bleu": str(bleu),
        "test2016_bleu_greedy_without_unk_replacement": round(
            kept_bleu.score, 2
        ),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"test2016 BLEU (greedy): {bleu.score:.2f}; summary in {path}")


# %% [markdown]
# ## The command line
#
# The exported module doubles as a program with four sub-commands. After
# `pip install ".[cli]"` the same program is also on the path as
# `annotated-transformer`.
#
# ```
# python annotated_transformer_tools.py download
# python annotated_transformer_tools.py train --preset cpu --epochs 18
# torchrun --nproc_per_node=2 annotated_transformer_tools.py train
# python annotated_transformer_tools.py evaluate --beam 4 --average 5
# python annotated_transformer_tools.py translate "Ein Hund." "Zwei Katzen."
# python annotated_transformer_tools.py translate < sentences.de > out.en
# ```
#
# A program for people should answer every mistake with one line that
# says what is wrong, and exit status 2, never with a traceback: a bad
# number or device, a missing, damaged or unsafe checkpoint, a file that
# is not UTF-8. Mistakes in the arguments are argparse's to catch. Its
# `type` functions refuse a count below 1 and a device this machine does
# not have, and `OneLineParser` shortens argparse's own complaint (the
# usage, then the error) to a single line.


# %%
#| export
def positive_int(text, least=1):
    """argparse type: a whole number of at least 1 (or `least`)."""
    try:
        number = int(text)
    except ValueError:
        number = None
    if number is None or number < least:
        raise argparse.ArgumentTypeError(
            f"expected a number >= {least}, not {text}"
        )
    return number


def count_or_zero(text):
    """argparse type: a whole number of at least 0."""
    return positive_int(text, least=0)


def existing_device(name):
    """argparse type: a torch device that this machine has, or "auto"."""
    if name == "auto":  # the fastest here, chosen by pick_device
        return str(pick_device())
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{name!r} is not a device; try cpu, cuda or cuda:1"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count()  # 0 without CUDA
        if (device.index or 0) >= count:
            raise argparse.ArgumentTypeError(
                f"no {name} here: this machine has {count} CUDA devices"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError("no mps (Apple GPU) here")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{name} is not supported here")
    return str(device)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors take one line of stderr."""

    def error(self, message):
        """Print `prog: error: message` on one line; exit with status 2."""
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# %%
#| export
def add_train_parser(sub):
    """`train`: its options."""
    train = sub.add_parser("train", help="train a model on Multi30k")
    train.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="cpu",
        help="cpu (default, on GPUs too: the measured recipe); "
        "paper: not measured for BLEU",
    )
    train.add_argument("--epochs", type=positive_int, help="epochs to train")
    train.add_argument("--max-tokens", type=positive_int, help="batch size")
    train.add_argument("--checkpoint-dir", help="where checkpoints go")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from last.pt, the newest training state",
    )
    train.add_argument(
        "--keep-last",
        type=count_or_zero,
        metavar="K",
        help="keep the newest K epoch checkpoints, for --average "
        f"(default {TrainConfig.keep_last}; 0: all)",
    )
    train.add_argument(
        "--world-size",
        type=positive_int,
        default=1,
        help="processes to spawn (torchrun sets its own)",
    )
    train.add_argument(
        "--results", help="write a JSON summary here, including test BLEU"
    )
    train.add_argument(
        "--threads", type=positive_int, help="CPU threads per process"
    )


# %%
#| export
def add_decoding_options(parser):
    """Options shared by `evaluate` and `translate`."""
    parser.add_argument("--checkpoint", default="checkpoints/cpu/final.pt")
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=128,
        help="sentences decoded together",
    )
    parser.add_argument(
        "--device",
        type=existing_device,
        default="auto",
        help="auto (default: CUDA, else mps, else cpu), cpu, cuda:0, mps",
    )
    parser.add_argument(
        "--beam",
        type=positive_int,
        default=1,
        metavar="K",
        help="beam size (1: greedy)",
    )
    parser.add_argument(
        "--average",
        type=positive_int,
        metavar="K",
        help="average the last K epoch checkpoints next to the checkpoint",
    )
    parser.add_argument(
        "--no-replace-unk",
        dest="replace_unk",
        action="store_false",
        help="keep <unk> in the output (default: copy the attended source "
        "word; word vocabularies only)",
    )


# %%
#| export
def add_evaluate_parser(sub):
    """`evaluate`: its options."""
    evaluate = sub.add_parser("evaluate", help="BLEU on a pair of files")
    add_decoding_options(evaluate)
    evaluate.add_argument(
        "--src",
        help="German sources, one per line "
        "(.gz is fine; default: Multi30k test2016)",
    )
    evaluate.add_argument("--ref", help="English references, one per line")
    evaluate.add_argument("--out", help="also write the translations here")


def add_translate_parser(sub):
    """`translate`: its options."""
    translate = sub.add_parser("translate", help="translate German text")
    add_decoding_options(translate)
    translate.add_argument(
        "sentence",
        nargs="*",
        help="German sentences, one per argument (none, or -: read "
        "standard input, one sentence per line)",
    )
    translate.add_argument(
        "--input",
        metavar="FILE",
        help="translate FILE line by line (.gz is fine; -: standard input)",
    )


def build_parser():
    """The argparse parser of the command line."""
    prog = os.path.basename(sys.argv[0] or "")
    if prog != "annotated-transformer":  # the installed console script
        prog = "annotated_transformer_tools.py"
    parser = OneLineParser(
        prog=prog,
        description="Train, evaluate and use the Annotated Transformer on "
        "Multi30k German→English.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("download", help="download and verify Multi30k")
    add_train_parser(sub)
    add_evaluate_parser(sub)
    add_translate_parser(sub)
    return parser


# %% [markdown]
# `train` builds the config from the preset and the flags, makes the
# vocabularies, and trains: in this process, in `--world-size` spawned
# ones, or as one of the processes that `torchrun` started (it sets
# `RANK` and `WORLD_SIZE`).


# %%
#| export
def command_train(args):
    """`train`: run training, then optionally score and summarize."""
    overrides = {
        k: v
        for k, v in (
            ("epochs", args.epochs),
            ("max_tokens", args.max_tokens),
            ("checkpoint_dir", args.checkpoint_dir),
            ("keep_last", args.keep_last),
        )
        if v is not None
    }
    config = get_config(args.preset, **overrides)
    torchrun = "LOCAL_RANK" in os.environ
    if args.world_size > 1 and not torchrun:  # fail now, not in NCCL
        try:
            process_device(0, args.world_size)
        except ValueError as err:
            message = f"--world-size {args.world_size}: {err}"
            raise UserError(message) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    download_multi30k()
    tokenizers = load_tokenizers()
    data = (*load_vocabularies(config, *tokenizers), *tokenizers, config)
    start = time.time()
    if torchrun:  # started by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        try:
            device = process_device(local_rank, local_world)
        except ValueError as err:
            raise UserError(f"torchrun: {err}") from None
        train_worker(
            rank, world, *data, world > 1, resume=args.resume, device=device
        )
        if rank != 0:
            return 0
    else:
        train_model(
            *data,
            distributed=args.world_size > 1,
            world_size=args.world_size,
            resume=args.resume,
        )
    final = Path(config.checkpoint_dir) / "final.pt"
    print(f"trained in {time.time() - start:.0f} s; model in {final}")
    if args.results:
        write_results(args.results, final, time.time() - start)
    return 0


# %% [markdown]
# `evaluate` and `translate` read and check their input before they load
# anything, so that a mistake there costs no waiting. `load_for_decoding`
# then loads the model through `load_translator` (cached greedy decoding,
# or beam search with `--beam`) and refuses a beam wider than the target
# vocabulary, which could never fill it.


# %%
#| export
def load_for_decoding(args):
    """`load_translator` for the command line, refusing a too-wide beam."""
    model, vocab_src, vocab_tgt, decode_fn = load_translator(
        args.checkpoint, args.device, args.beam, args.average
    )
    if args.beam > len(vocab_tgt):
        raise UserError(
            f"--beam {args.beam} is wider than the {len(vocab_tgt)} tokens "
            f"of the target vocabulary of {args.checkpoint}"
        )
    return model, vocab_src, vocab_tgt, decode_fn


def command_evaluate(args):
    """`evaluate`: BLEU of a checkpoint on a pair of files."""
    if (args.src is None) != (args.ref is None):
        raise UserError("give both --src and --ref, or neither")
    if args.src is None:
        folder = download_multi30k()
        args.src = folder / "test_2016_flickr.de.gz"
        args.ref = folder / "test_2016_flickr.en.gz"
    sources, references = read_parallel(args.src, args.ref)
    model, vocab_src, vocab_tgt, decode_fn = load_for_decoding(args)
    spacy_de, _ = load_tokenizers()
    hyps = translate_batch(
        model, sources, spacy_de, vocab_src, vocab_tgt, args.device,
        args.batch_size, decode_fn=decode_fn, replace_unk=args.replace_unk,
    )  # fmt: skip
    if args.out:
        try:
            Path(args.out).write_text("\n".join(hyps) + "\n", "utf-8")
        except OSError as err:
            raise UserError(f"cannot write {args.out}: {err}") from err
    print(compute_bleu(hyps, references))
    return 0


# %% [markdown]
# `translate` prints one line for each sentence it is given, in order.
# Given no sentence, or `-`, it reads standard input, one sentence per
# line, and with `--input FILE` a file, as Unix filters and sacreBLEU do.
# `translate_lines` streams such input: it reads `chunk` lines (eight
# batches' worth), decodes them together in length-sorted batches, prints
# their translations and reads on, so a long file never waits in memory
# and never goes through the model one sentence at a time. An empty line
# gets an empty line back, so that line $n$ of the output always
# translates line $n$ of the input. Only a person typing at a terminal
# gets each line translated as soon as it is typed.


# %%
#| export
def translate_lines(lines, translate_fn, chunk=1024):
    """Translations of `lines`, one list per `chunk` lines read."""
    lines = iter(lines)
    while batch := list(itertools.islice(lines, chunk)):
        todo = [line for line in batch if line.strip()]
        hyps = iter(translate_fn(todo) if todo else [])
        yield [next(hyps) if line.strip() else "" for line in batch]


def sentences_to_translate(args):
    """What `translate` reads: its arguments, a file or standard input."""
    if args.input is not None and args.sentence:
        raise UserError("give sentences or --input FILE, not both")
    if args.input is None and args.sentence in ([], ["-"]):
        args.input = "-"
    if args.input is not None:
        return iter_lines(args.input)
    for number, sentence in enumerate(args.sentence, 1):
        if sentence == "-":
            raise UserError("- (standard input) cannot mix with sentences")
        if not sentence.strip():
            raise UserError(f"sentence {number} is empty: no German to read")
    return iter(args.sentence)


# %% [markdown]
# For sentences given as arguments, `translate` also names, on stderr, the
# German words that a word vocabulary does not know and reads as `<unk>`.
# It does not for a file or a stream, where such notes would pile up.


# %%
#| export
def warn_unknown_words(sentences, spacy_de, vocab_src):
    """Name, on stderr, the words a word vocabulary reads as `<unk>`."""
    if isinstance(vocab_src, Vocab):  # (BPE can spell any known letters)
        words = [tokenize(s, spacy_de) for s in sentences]
        unknown = {w: 1 for ws in words for w in ws if w not in vocab_src}
        if unknown:
            print(
                "note: not in the vocabulary, read as <unk>: "
                + ", ".join(unknown),
                file=sys.stderr,
            )


def command_translate(args):
    """`translate`: one line of English per German sentence, in order."""
    lines = sentences_to_translate(args)
    typing = args.input == "-" and sys.stdin.isatty()
    chunk = 1 if typing else 8 * args.batch_size
    first = list(itertools.islice(lines, chunk))  # input errors come first
    if not first:
        where = "standard input" if args.input == "-" else args.input
        raise UserError(f"nothing to translate: {where} is empty")
    model, vocab_src, vocab_tgt, decode_fn = load_for_decoding(args)
    spacy_de, _ = load_tokenizers()
    if args.input is None:
        warn_unknown_words(args.sentence, spacy_de, vocab_src)
    translate_fn = functools.partial(
        translate_batch, model, spacy_de=spacy_de, vocab_src=vocab_src,
        vocab_tgt=vocab_tgt, device=args.device, batch_size=args.batch_size,
        decode_fn=decode_fn, replace_unk=args.replace_unk,
    )  # fmt: skip
    stream = itertools.chain(first, lines)
    for hyps in translate_lines(stream, translate_fn, chunk):
        print(*hyps, sep="\n", flush=True)
    return 0


def command_download(args):
    """`download`: fetch and verify Multi30k, print where it is."""
    print(download_multi30k())
    return 0


# %% [markdown]
# `main` runs a sub-command and turns every `UserError` and `DatasetError`
# into `error: ...` on one line (a message of several lines is joined)
# and exit status 2. It also hides the warning torch prints before it
# refuses an old-style pickle, which would be a second line.


# %%
#| export
def main(argv=None):
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    commands = {
        "download": command_download,
        "train": command_train,
        "evaluate": command_evaluate,
        "translate": command_translate,
    }
    try:
        with warnings.catch_warnings():  # torch's note on an old pickle
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            return commands[args.command](args)
    except (UserError, DatasetError) as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left early: `translate | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


# %% [markdown]
# Check, without loading a model: the parser knows every sub-command;
# `translate_lines` keeps empty lines in place and decodes each chunk in
# one call; a count of 0 and a file that is not UTF-8 are refused with one
# line on stderr and status 2; and `--epochs` reaches the config.

# %%
import contextlib
import io

parser = build_parser()
for command in ("download", "train", "evaluate", "translate"):
    assert command in parser.format_help()
calls = []
upper = lambda batch: calls.append(batch) or [s.upper() for s in batch]
out = list(translate_lines(["a", "", "b", "c"], upper, chunk=2))
assert out == [["A", ""], ["B", "C"]] and calls == [["a"], ["b", "c"]]
with tempfile.TemporaryDirectory() as tmp:
    Path(tmp, "de.txt").write_bytes("Gut.\nSch\xf6n.\n".encode("latin-1"))
    for argv in (
        ["translate", "--beam", "0", "Hallo"],
        ["translate", "--input", f"{tmp}/de.txt"],
    ):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                status = main(argv)
            except SystemExit as stop:  # argparse's own errors
                status = stop.code
        print(err.getvalue(), end="")
        assert status == 2 and err.getvalue().count("\n") == 1
assert "line 2" in err.getvalue()
args = parser.parse_args(["train", "--preset", "ci", "--epochs", "3"])
assert get_config(args.preset, epochs=args.epochs).epochs == 3
