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
# It lives here, after the lessons, and is exported into
# `the_annotated_transformer.py` like the rest. Code in this appendix may
# use anything the lessons defined; no lesson's exported code uses it.

# %%
# Setup: on Colab, clone the repository and install its requirements.
# !test -n "$COLAB_RELEASE_TAG" -a ! -d done-right && git clone -q --depth=1 https://github.com/annotated-transformer/done-right && pip install -q -r done-right/requirements.txt  # noqa: E501
import os
import sys

ROOT = os.path.abspath("done-right" if os.path.isdir("done-right") else "..")
sys.path.insert(0, ROOT)
AT_SIZE = os.environ.get("AT_SIZE", "full")  # "ci": minutes, not hours

# %%
#| export
import argparse
import contextlib
import functools
import hashlib
import http.client
import itertools
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
import unicodedata
import urllib.error
import urllib.request
import warnings
import zipfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

# %% [markdown]
# The appendix calls functions of every lesson. In the notebook they come
# from the module; in the module they are simply defined above.
# %%
from the_annotated_transformer import BOS, EOS, MULTI30K_ENV, PAD
from the_annotated_transformer import BpeVocab, DatasetError, TrainState
from the_annotated_transformer import TrainConfig, Vocab, model_from_config
from the_annotated_transformer import build_vocabulary, cached_greedy_decode
from the_annotated_transformer import collate_batch, data_dir, encode_text
from the_annotated_transformer import load_bpe
from the_annotated_transformer import load_tokenizers, load_trained_model
from the_annotated_transformer import load_translator, read_multi30k
from the_annotated_transformer import strip_specials, tokenize, train_worker
from the_annotated_transformer import UNK, record_attention, subsequent_mask
from the_annotated_transformer import attention_maps, make_model

# %% [markdown]
# ## Files written whole
#
# Every file the program writes (downloads, vocabularies, checkpoints,
# translations, summaries) goes through `atomic_write`. It writes a
# temporary file `.NAME.PID.part` in the same folder, flushes it to the
# disk, and only then renames it to `NAME`. A rename within a folder is
# atomic: a reader sees the old file or the new one, never half of
# either, and a full disk, a crash or Ctrl-C in the middle of a write
# leaves the old file as it was.
#
# A process killed outright (SIGKILL, a power cut) cannot remove its
# `.part` file. The process id in the name says whose it is, so
# `atomic_write` first removes, from the folder it writes to, the `.part`
# files of processes that no longer run.


# %%
#| export
def process_alive(pid):
    """True if a process with this id runs on this machine."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # someone else's, or no pid
        return True
    return True


def clean_partial_files(folder):
    """Remove the `.part` files that dead processes left in `folder`."""
    for part in Path(folder).glob(".*.part"):
        pid = part.name.split(".")[-2]  # .NAME.PID.part
        if pid.isdigit() and int(pid) != os.getpid():
            if not process_alive(int(pid)):
                part.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """A file to write that replaces `path` only once it is complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_partial_files(path.parent)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    encoding = None if "b" in mode else "utf-8"
    try:
        with open(part, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # on the disk before it gets the name
        os.replace(part, path)
    except OSError as err:  # name the file, e.g. on a full disk
        if err.filename is not None or err.errno is None:  # not a write's
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err
    finally:
        part.unlink(missing_ok=True)  # gone already, unless it failed


# %% [markdown]
# Check: a write that fails halfway leaves the old file and no `.part`
# file, and a `.part` file of a process that has ended is removed by the
# next write to its folder.

# %%
import subprocess
import tempfile

with tempfile.TemporaryDirectory() as tmp:
    kept = Path(tmp, "kept.txt")
    kept.write_text("old")
    try:
        with atomic_write(kept, "w") as f:
            f.write("half of the new")
            raise KeyboardInterrupt  # as if Ctrl-C came in the middle
    except KeyboardInterrupt:
        pass
    assert kept.read_text() == "old" and len(os.listdir(tmp)) == 1
    ended = subprocess.Popen(["true"])  # a process that ends at once
    ended.wait()
    Path(tmp, f".kept.txt.{ended.pid}.part").write_text("left behind")
    with atomic_write(Path(tmp, "other.txt"), "w") as f:
        f.write("new")
    assert sorted(os.listdir(tmp)) == ["kept.txt", "other.txt"]

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
# A download goes through `atomic_write`, with a progress bar, and is
# renamed only once its sum matches: an interrupted or corrupted download
# never leaves a file that looks valid. Every failure is a `DatasetError`
# whose message says what to do.


# %%
#| export
def _fetch(url, path, expected, timeout):
    """Download `url` to `path`, keeping it only if its SHA-256 matches."""
    try:
        with (
            atomic_write(path) as out,
            urllib.request.urlopen(url, timeout=timeout) as response,
        ):
            digest = _stream(response, out, path.name)
            if digest != expected:  # raised inside: the file is not kept
                raise DatasetError(
                    f"{url} has SHA-256 {digest}, expected "
                    f"{expected}; the file was not kept.\n"
                    + _offline_hint(path.parent)
                )
    except (OSError, http.client.HTTPException) as error:
        url_error = type(error) is urllib.error.URLError
        reason = error.reason if url_error else error
        raise DatasetError(
            f"Could not download {url} ({reason}).\n"
            + _offline_hint(path.parent)
        ) from error


# %% [markdown]
# `download_multi30k` returns the folder that holds the verified files.
# When `MULTI30K_DIR` is set (a machine without internet access, or CI),
# that folder is checked and never written to (a relative path counts from
# the working directory, and an error names the absolute path it tried);
# otherwise the files are cached in `data/multi30k/` (or `root`) and
# fetched only when missing or wrong. When a cached file is damaged and no
# fresh copy can be fetched, the error names the damaged file.


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
        if path.is_file() and sha256_of(path) == expected:
            continue
        damaged = path.is_file()  # in the cache, but not the right bytes
        try:
            _fetch(base_url.rstrip("/") + "/" + name, path, expected, timeout)
        except DatasetError as error:
            if not damaged:
                raise
            raise DatasetError(
                f"{path} in the data cache is damaged (wrong SHA-256), and "
                f"a fresh copy could not be fetched: {error}"
            ) from error
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
# dataclass's defaults; `paper` is the paper's base model, for a GPU; `ci`
# is a tiny model on 1,000 sentence pairs for two epochs, so that tests and
# the CI-sized notebooks finish in seconds. Each has a BPE twin (Part 5),
# with one subword vocabulary and tied embeddings.

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
        raise ValueError(
            f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}"
        )
    return replace(PRESETS[preset], **overrides)


# %% [markdown]
# ## Vocabularies
#
# Building the word vocabularies (Part 3) takes a few seconds, so
# `load_vocab` caches them in `data/vocab.json`, keyed by `min_freq` and the
# spaCy version, and writes the file with `atomic_write` so that processes
# starting together never read half of it.


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
    with atomic_write(path, "w") as f:  # ranks never read half a file
        f.write(json.dumps(saved, ensure_ascii=False))
    return vocab_src, vocab_tgt


# %% [markdown]
# A preset names its tokenization, and `load_vocabularies` turns that name
# into vocabularies for training: word vocabularies (Part 3), or one BPE
# vocabulary (Part 5) for both languages.


# %%
#| export
def load_vocabularies(config, spacy_de, spacy_en):
    """(vocab_src, vocab_tgt) for a config: words, or one BPE for both."""
    if config.tokenization == "bpe":
        bpe = load_bpe()
        return bpe, bpe
    return load_vocab(spacy_de, spacy_en)


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
# ## Starting processes
#
# Part 3's `train_worker` trains in one process. To use several, the
# processes need a rendezvous: `free_port` asks the operating system for a
# TCP port nobody listens on, and `train_distributed_model` starts one
# process per GPU (or `world_size` CPU processes) with
# `torch.multiprocessing.spawn`. A new process imports the module, not the
# notebook that started it, so only plain data crosses over: vocabularies
# as token lists (or BPE JSON text) and the config as a dict, which
# `_spawned_worker` turns back into objects before it calls `train_worker`.
# Under `torchrun` none of this is needed: it starts the processes and
# sets the rendezvous address itself.


# %%
#| export
def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker(rank, world_size, vocabs, tokenizers, config, *options):
    """train_worker in a new process, from plain data."""
    vocabs = [
        BpeVocab.from_str(v) if isinstance(v, str) else Vocab(v)
        for v in vocabs
    ]
    config = TrainConfig(**config)
    train_worker(
        rank, world_size, *vocabs, *tokenizers, config, True, *options
    )


def train_distributed_model(
    vocab_src, vocab_tgt, spacy_de, spacy_en, config, world_size=None,
    resume=False,
):  # fmt: skip
    """Train with one process per GPU (or world_size CPU processes)."""
    import torch.multiprocessing as mp

    world_size = world_size or max(torch.cuda.device_count(), 1)
    plain = lambda v: v.to_str() if hasattr(v, "to_str") else v.get_itos()
    vocabs = [plain(vocab_src), plain(vocab_tgt)]
    data = (vocabs, (spacy_de, spacy_en), asdict(config), free_port(), resume)
    mp.spawn(_spawned_worker, (world_size, *data), nprocs=world_size)


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
    model, sentences, spacy_de, vocab_src, vocab_tgt, device="cpu",
    batch_size=128, max_extra=50, decode_fn=cached_greedy_decode,
    replace_unk=True,
):  # fmt: skip
    """German sentences to detokenized English, in input order."""
    decode_fn = decode_fn or cached_greedy_decode
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
    replace_unk=True,
):  # fmt: skip
    """English translations of German sentences, with a trained model."""
    model, vocab_src, vocab_tgt, decode_fn = load_translator(
        checkpoint, "cpu", beam, average
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
# ## Checkpoint files
#
# A checkpoint holds only tensors and plain Python types, so it loads with
# `torch.load(..., weights_only=True)`, which refuses to run code hidden
# in a file. It is written with `atomic_write`, so a crash, a full disk
# or Ctrl-C mid-write never leaves half a checkpoint. torch reports a
# failed write as a `RuntimeError` about stream positions; `save_checkpoint`
# hands the file a small wrapper that keeps the operating system's own
# error (such as "No space left on device") and raises that instead.
#
# `load_checkpoint` says what is true about a file it cannot use: a missing
# file is a `FileNotFoundError`, and an empty file, a file that is neither
# a zip archive (what `torch.save` writes) nor a pickle (what older torch
# wrote), a damaged or cut-short one, and one whose pickle would build
# other objects (torch names an "unsupported global") are each a
# `CheckpointError` with its own message.


# %%
#| export
class CheckpointError(ValueError):
    """A file that is not a checkpoint this code can use."""


class _KeepsWriteError:
    """A file wrapper that remembers the first OSError of a write."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        """Write to the file; remember an OSError before raising it."""
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self):
        """Flush the file."""
        self.f.flush()


def save_checkpoint(path, **fields):
    """Write a dict of tensors and plain types atomically."""
    with atomic_write(path) as f:
        wrapped = _KeepsWriteError(f)
        try:
            torch.save(fields, wrapped)
        except RuntimeError:
            if wrapped.error is None:
                raise
            raise wrapped.error from None  # e.g. no space left on device


def load_checkpoint(path, device="cpu"):
    """Read a checkpoint safely (weights_only) onto `device`."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; train one first")
    with open(path, "rb") as f:
        head = f.read(2)
    if not head:
        raise CheckpointError(f"{path} is empty (0 bytes), not a checkpoint")
    if head != b"PK" and head[:1] != b"\x80":  # neither zip nor pickle
        raise CheckpointError(f"{path} is not a checkpoint")
    damaged = f"{path} is not a readable checkpoint (damaged or cut short)"
    if head == b"PK" and not zipfile.is_zipfile(path):
        raise CheckpointError(f"{damaged}: not a whole zip archive")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:  # it would build other objects?
        if head == b"PK" and "Unsupported global" not in str(err):
            raise CheckpointError(f"{damaged}: its pickle is broken") from err
        why = "holds more than tensors, so it is not loaded, for safety"
        raise CheckpointError(f"{path} {why}") from err
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        first = str(err).strip().splitlines()[0][:200] if str(err) else ""
        raise CheckpointError(
            f"{damaged}: {first or type(err).__name__}"
        ) from err
    if not isinstance(ckpt, dict):
        raise CheckpointError(
            f"{path} holds a {type(ckpt).__name__}, not a checkpoint"
        )
    return ckpt


def epoch_checkpoints(folder):
    """The epoch checkpoints in a folder, oldest first."""
    return sorted(Path(folder).glob("epoch_*.pt"))


# %% [markdown]
# A checkpoint stores its config as a dict, and vocabularies as plain
# data: the token lists of a word vocabulary (Part 3), or the JSON text of
# a BPE vocabulary (Part 5). `checkpoint_config` rebuilds the config (two
# fields had other names in older runs), `checkpoint_vocabularies` picks
# the vocabularies by the config's `tokenization`, and `save_run` writes
# them. `load_weights` compares every tensor's size before it loads, so a
# file of another model is named with the first size that differs, in one
# short line rather than PyTorch's list of every difference.


# %%
#| export
LEGACY_CONFIG_NAMES = {"num_epochs": "epochs", "amp": "precision"}


def checkpoint_config(ckpt, path="checkpoint"):
    """The TrainConfig a checkpoint was trained with."""
    try:
        saved = ckpt["config"].items()
        return TrainConfig(
            **{LEGACY_CONFIG_NAMES.get(k, k): v for k, v in saved}
        )
    except (KeyError, TypeError, AttributeError) as err:
        why = f"no {err}" if isinstance(err, KeyError) else err
        raise CheckpointError(
            f"{path} does not match this code's Multi30k model: {why}"
        ) from err


def checkpoint_vocabularies(ckpt, path="checkpoint"):
    """(vocab_src, vocab_tgt) stored in a checkpoint: words or BPE."""
    tokenization = ckpt.get("config", {}).get("tokenization", "word")
    try:
        if tokenization == "bpe":  # one subword vocabulary for both sides
            bpe = BpeVocab.from_str(ckpt["bpe"])
            return bpe, bpe
        if tokenization == "word":
            return Vocab(ckpt["vocab_src"]), Vocab(ckpt["vocab_tgt"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"{path} does not match this code's Multi30k model: "
            f"no readable {tokenization} vocabularies ({err})"
        ) from err
    raise CheckpointError(f"{path}: unknown tokenization {tokenization!r}")


def size_mismatch(expected, saved):
    """How two state dicts differ, in a few words; "" if they fit."""
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    if missing or unexpected:
        example = (missing or unexpected)[0]
        return (
            f"{len(missing)} tensors missing and {len(unexpected)} "
            f"unexpected, such as {example}"
        )
    size = lambda t: "×".join(map(str, t.shape)) or "a scalar"
    for name, tensor in expected.items():
        if saved[name].shape != tensor.shape:
            return (
                f"{name} is {size(saved[name])} in the file but "
                f"{size(tensor)} here"
            )
    return ""


def load_weights(model, ckpt, path="checkpoint"):
    """Load a checkpoint's weights into `model`, or say how they differ."""
    state = ckpt.get("model")
    problem = "it holds no weights" if not isinstance(state, dict) else ""
    problem = problem or size_mismatch(model.state_dict(), state)
    if problem:
        raise CheckpointError(
            f"{path} does not match this code's Multi30k model: {problem}"
        )
    model.load_state_dict(state)


def save_run(run, name, vocab_src, vocab_tgt, **extra):
    """Write the weights, config, vocabularies and losses, and `extra`."""
    fields = {"model": run.module.state_dict(), "config": asdict(run.config)}
    fields |= {"vocab_src": vocab_src.get_itos(), "history": run.history}
    fields["vocab_tgt"] = vocab_tgt.get_itos()
    if hasattr(vocab_tgt, "to_str"):  # Part 5's BPE: its merges, as JSON
        fields["bpe"] = vocab_tgt.to_str()
    save_checkpoint(Path(run.config.checkpoint_dir, name), **fields, **extra)


# %% [markdown]
# Each epoch, rank 0 writes a lean `epoch_NNN.pt` with the weights Part 5
# averages, keeping the newest `keep_last`, and `last.pt`, which adds the
# optimizer (Adam keeps two averages per weight, so it triples the size),
# the schedule, the counters and the random states: the CPU's, and every
# GPU's when the run uses CUDA. A crash between the two writes only
# repeats the epoch. `resume_run` restores `last.pt` (or an older run's
# newest epoch file, which then held the whole state) exactly as an
# uninterrupted run would continue. It reads the file onto the CPU
# whatever the run's device: `torch.set_rng_state` takes only a CPU
# tensor, and `load_state_dict` moves weights and optimizer state to
# where the model lives.


# %%
#| export
def save_epoch(run, epoch, vocab_src, vocab_tgt):
    """Write a lean epoch_NNN.pt, then last.pt; keep `keep_last` epochs."""
    save_run(run, f"epoch_{epoch:03d}.pt", vocab_src, vocab_tgt, epoch=epoch)
    resume = {"epoch": epoch, "train_state": asdict(run.state)}
    resume |= {"optimizer": run.optimizer.state_dict()}
    resume |= {"scheduler": run.scheduler.state_dict()}
    resume |= {"rng_state": torch.get_rng_state()}
    if run.device.type == "cuda":  # dropout on the GPU draws from these
        resume["cuda_rng_states"] = torch.cuda.get_rng_state_all()
    save_run(run, "last.pt", vocab_src, vocab_tgt, **resume)
    keep, folder = run.config.keep_last, run.config.checkpoint_dir
    for old in epoch_checkpoints(folder)[:-keep] if keep > 0 else []:
        old.unlink()


def resume_point(folder):
    """The file a run in `folder` resumes from, or None."""
    paths = [Path(folder, "last.pt"), *epoch_checkpoints(folder)[-1:]]
    for path in paths:
        if path.is_file() and "optimizer" in load_checkpoint(path):
            return path
    return None


def resume_run(run):
    """Restore the newest training state; returns the next epoch."""
    path = resume_point(run.config.checkpoint_dir)
    if path is None:  # nothing to resume from: start afresh
        return 0
    ckpt = load_checkpoint(path, "cpu")  # random states must be on the CPU
    load_weights(run.module, ckpt, path)
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.scheduler.load_state_dict(ckpt["scheduler"])
    run.state, run.history = TrainState(**ckpt["train_state"]), ckpt["history"]
    torch.set_rng_state(ckpt["rng_state"])
    if "cuda_rng_states" in ckpt and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["cuda_rng_states"])
    return ckpt["epoch"] + 1


# %% [markdown]
# Before a run starts, `check_resume` makes sure that `--resume` means
# what it says. It refuses a folder that holds epoch files but no
# training state to resume from, since starting afresh would overwrite
# them, and a checkpoint of another model, naming the first size that
# differs; it builds the run's model on the `meta` device, which has
# shapes but no memory. It returns the file to resume from, or None for a
# folder with no checkpoints, where the run starts afresh.


# %%
#| export
def check_resume(config, vocab_src, vocab_tgt):
    """The checkpoint a run would resume from (None: none), checked."""
    folder = config.checkpoint_dir
    path = resume_point(folder)
    if path is None and epoch_checkpoints(folder):
        raise CheckpointError(
            f"nothing to resume in {folder}: its epoch files lack the "
            "training state (no last.pt), and starting afresh would "
            "overwrite them; move them away or choose another "
            "--checkpoint-dir"
        )
    if path is not None:
        with torch.device("meta"):  # shapes only, no memory
            model = model_from_config(config, len(vocab_src), len(vocab_tgt))
        problem = size_mismatch(
            model.state_dict(), load_checkpoint(path)["model"]
        )
        if problem:
            raise CheckpointError(
                f"cannot resume from {path}, another model: {problem}"
            )
    return path


# %% [markdown]
# Two runs that write into the same folder would overwrite each other's
# files, so a run holds `folder_lock` on its checkpoint folder while it
# trains. The lock is `fcntl.flock` on a file `.lock` in the folder,
# which holds the process id of the run that has it. The kernel releases
# a `flock` when its process ends, however it ends, so the lock of a
# killed run is never stale: its `.lock` file stays, but the next run
# takes it over. We use `fcntl` from the standard library rather than
# the `filelock` package, which takes the same `flock` on Unix but does
# not record who holds it, and whose timeouts we do not need. `fcntl`
# exists on Linux and macOS, not on Windows, and `flock` is not reliable
# on some network file systems.


# %%
#| export
class FolderInUseError(RuntimeError):
    """Another process trains into the same checkpoint folder."""


@contextlib.contextmanager
def folder_lock(folder):
    """Hold the lock on a checkpoint folder while the block runs."""
    import fcntl  # Unix only

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise FolderInUseError(
                f"{folder} is in use by another training run (process "
                f"{holder}); wait for it, or choose another --checkpoint-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield folder
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


# %% [markdown]
# Check: a checkpoint round-trips; random bytes, an empty file and a file
# of another model are each refused with their own message; and a second
# lock on a held folder names the holder.

# %%
with tempfile.TemporaryDirectory() as tmp:
    weights = {"w": torch.arange(6.0).view(2, 3)}
    save_checkpoint(f"{tmp}/a.pt", model=weights, config={})
    assert torch.equal(
        load_checkpoint(f"{tmp}/a.pt")["model"]["w"], weights["w"]
    )
    Path(tmp, "noise.pt").write_bytes(bytes(range(7, 250)))
    Path(tmp, "empty.pt").write_bytes(b"")
    for name, message in [("noise", "not a checkpoint"), ("empty", "0 bytes")]:
        try:
            load_checkpoint(f"{tmp}/{name}.pt")
            raise AssertionError(f"{name}.pt was loaded")
        except CheckpointError as err:
            assert message in str(err), err
    other = {"w": torch.zeros(3, 3)}
    assert size_mismatch(weights, other) == "w is 3×3 in the file but 2×3 here"
    with folder_lock(tmp):
        try:
            with folder_lock(tmp):
                raise AssertionError("a held folder was locked twice")
        except FolderInUseError as err:
            assert f"process {os.getpid()}" in str(err)


# %% [markdown]
# ## Reading text files
#
# `iter_lines` reads the text to translate or score one line at a time:
# a plain file, a gzipped one, or standard input for `-`, and also a
# named pipe, a `<(...)` substitution or `/dev/null`. It reads text the
# way editors write it: it drops a UTF-8 byte-order mark at the start,
# and takes `\n`, `\r\n` and a lone `\r` (old Macs) as line ends. From each
# line it drops control characters other than tab, which no sentence
# holds and which the tokenizers would read as words. It decodes each line
# by itself, so a file that is not UTF-8 is refused with the number of its
# first bad line. Its errors are a `TextFileError`, which the command line
# prints as one line. `read_lines` reads a whole file.


# %%
#| export
class TextFileError(ValueError):
    """A text file that cannot be read line by line as UTF-8."""


def clean_line(text):
    """A line without control characters other than tab."""
    keep = lambda c: c == "\t" or unicodedata.category(c) != "Cc"
    return "".join(c for c in text if keep(c))


def _split_lines(f):
    """Byte lines of a binary file, ended by \n, \r\n or a lone \r."""
    for line in f:  # ends at \n; a lone \r ends a line, too
        pieces = line.rstrip(b"\n").split(b"\r")
        if len(pieces) > 1 and pieces[-1] == b"":  # \r\n: one line end
            pieces.pop()
        yield from pieces


def iter_lines(path):
    """Lines of a UTF-8 text file (plain, .gz, or "-": stdin), lazily."""
    import gzip
    from contextlib import nullcontext

    stdin = str(path) == "-"
    name, number = "standard input" if stdin else Path(path), 0
    try:
        if stdin and sys.stdin is None:  # started with `<&-`
            raise TextFileError("standard input is closed")
        if stdin:
            opened = nullcontext(sys.stdin.buffer)
        elif name.is_dir():
            raise TextFileError(f"{name} is a folder, not a file")
        else:
            opened = (gzip.open if name.suffix == ".gz" else open)(name, "rb")
        with opened as f:
            for line in _split_lines(f):
                number += 1
                if number == 1:
                    line = line.removeprefix(b"\xef\xbb\xbf")  # the BOM
                yield clean_line(line.decode("utf-8"))
    except FileNotFoundError:
        raise TextFileError(f"no such file: {name}") from None
    except UnicodeDecodeError:
        raise TextFileError(
            f"{name} is not UTF-8 text (line {number})"
        ) from None
    except (OSError, EOFError) as err:  # not gzip, truncated, unreadable
        raise TextFileError(f"cannot read {name}: {err}") from None


def read_lines(path):
    """Lines of a plain or gzipped UTF-8 text file, without newlines."""
    return list(iter_lines(path))


# %% [markdown]
# `read_parallel` reads a pair of line-by-line translations and refuses
# files of different lengths, or empty ones, with a message, not a
# traceback. `write_results` scores test2016 after a training run and
# writes a JSON summary with the command, the config, the hardware and the
# losses.


# %%
#| export
def read_parallel(src_path, ref_path):
    """(sources, references): two files of line-by-line translations."""
    sources, references = read_lines(src_path), read_lines(ref_path)
    if len(sources) != len(references):
        raise TextFileError(
            f"{src_path} has {len(sources)} lines but {ref_path} has "
            f"{len(references)}; they must be line-by-line translations"
        )
    if not sources:
        raise TextFileError(f"{src_path} is empty")
    return sources, references


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
    with atomic_write(path, "w") as f:
        f.write(json.dumps(summary, indent=2) + "\n")
    print(f"test2016 BLEU (greedy): {bleu.score:.2f}; summary in {path}")


# %% [markdown]
# ## The command line
#
# The exported module doubles as a program with four sub-commands. After
# `pip install ".[cli]"` the same program is also on the path as
# `annotated-transformer`.
#
# ```
# python the_annotated_transformer.py download
# python the_annotated_transformer.py train --preset cpu --epochs 18
# torchrun --nproc_per_node=2 the_annotated_transformer.py train
# python the_annotated_transformer.py evaluate --beam 4 --average 5
# python the_annotated_transformer.py translate "Ein Hund." "Zwei Katzen."
# python the_annotated_transformer.py translate < sentences.de > out.en
# ```
#
# A program for people should answer every mistake with one line that
# says what is wrong, and exit status 2, never with a traceback: a bad
# number or device, a missing, damaged or unsafe checkpoint, a file that
# is not UTF-8. The library raises ordinary exceptions (`ValueError`s
# such as `CheckpointError` and `TextFileError`, `FileNotFoundError`,
# Part 3's `DatasetError`); the command line's own checks raise
# `UserError`, and only `main` turns them into messages.
# `docs/guarantees.md` lists every exit status.
#
# Mistakes in the arguments are argparse's to catch. Its `type` functions
# refuse a count outside its range (every count has a sensible maximum,
# so that a number of twenty digits is refused rather than reaching the
# code) and a device this machine does not have, and `OneLineParser`
# shortens argparse's own complaint (the usage, then the error) to a
# single line.


# %%
#| export
class UserError(Exception):
    """A problem with the user's input, reported without a traceback."""


def say(*lines):
    """Print lines to stdout now; an error there names standard output."""
    try:
        print(*lines, sep="\n", flush=True)
    except OSError as err:  # a full disk, a broken pipe, ...
        raise OSError(err.errno, err.strerror, "standard output") from err


def positive_int(text, least=1, most=10**6):
    """argparse type: a whole number from `least` (1) to `most`."""
    try:
        number = int(text)
    except ValueError:
        number = None
    if number is None or not least <= number <= most:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from {least} to {most:,d}, not {text}"
        )
    return number


def count(least=1, most=10**6):
    """An argparse type: a whole number from `least` to `most`."""
    check = functools.partial(positive_int, least=least, most=most)
    check.__name__ = "count"
    return check


def existing_device(name):
    """argparse type: a torch device that this machine has."""
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
    train.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    train.add_argument(
        "--epochs", type=count(most=10_000), help="epochs to train"
    )
    train.add_argument(
        "--max-tokens", type=count(most=10**7), help="tokens in a batch"
    )
    train.add_argument("--checkpoint-dir", help="where checkpoints go")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from last.pt, the newest training state",
    )
    train.add_argument(
        "--keep-last",
        type=count(least=0, most=10_000),
        metavar="K",
        help="keep the newest K epoch checkpoints, for --average "
        f"(default {TrainConfig.keep_last}; 0: all)",
    )
    train.add_argument(
        "--world-size",
        type=count(most=1024),
        default=1,
        help="processes to spawn (torchrun sets its own)",
    )
    train.add_argument(
        "--results", help="write a JSON summary here, including test BLEU"
    )
    train.add_argument(
        "--threads", type=count(most=4096), help="CPU threads per process"
    )


# %%
#| export
def add_decoding_options(parser):
    """Options shared by `evaluate` and `translate`."""
    parser.add_argument("--checkpoint", default="checkpoints/cpu/final.pt")
    parser.add_argument(
        "--batch-size",
        type=count(most=100_000),
        default=128,
        help="sentences decoded together",
    )
    parser.add_argument(
        "--device", type=existing_device, default="cpu", help="cpu, cuda:0…"
    )
    parser.add_argument(
        "--beam",
        type=count(most=1000),
        default=1,
        metavar="K",
        help="beam size (1: greedy)",
    )
    parser.add_argument(
        "--average",
        type=count(most=10_000),
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
        prog = "the_annotated_transformer.py"
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
# `train` builds the config from the preset and the flags, takes the lock
# on the checkpoint folder (so that a second run into it stops at once),
# checks what `--resume` would resume, makes the vocabularies, and
# trains: in this process, in `--world-size` spawned ones, or as one of
# the processes that `torchrun` started (it sets `RANK` and
# `WORLD_SIZE`; rank 0 takes the lock for all of them).


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
    rank = int(os.environ.get("RANK", "0"))
    lock = folder_lock(config.checkpoint_dir) if rank == 0 else None
    with lock or contextlib.nullcontext():
        return train_locked(args, config)


def train_locked(args, config):
    """`train`, once the checkpoint folder is ours."""
    if args.threads:
        torch.set_num_threads(args.threads)
    download_multi30k()
    tokenizers = load_tokenizers()
    vocabs = load_vocabularies(config, *tokenizers)
    if args.resume and check_resume(config, *vocabs) is None:
        print(
            f"note: nothing to resume in {config.checkpoint_dir} (no "
            "checkpoints there); training from the first epoch",
            file=sys.stderr,
        )
    data = (*vocabs, *tokenizers, config)
    start = time.time()
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        train_worker(rank, world, *data, world > 1, resume=args.resume)
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
    say(f"trained in {time.time() - start:.0f} s; model in {final}")
    if args.results:
        write_results(args.results, final, time.time() - start)
    return 0


# %% [markdown]
# `evaluate` and `translate` read and check their input before they load
# anything, so that a mistake there costs no waiting; `evaluate` also
# checks `--out` first: it must not name an input, which it would
# overwrite, and its folder must exist and be writable. Then
# `load_for_decoding` loads the model through `load_translator` (cached
# greedy decoding, or beam search with `--beam`), turns the library's
# complaints about the checkpoint into `UserError`s, and refuses a beam
# wider than the target vocabulary, which could never fill it.


# %%
#| export
def check_out(out, *inputs):
    """Refuse an output file that is an input or cannot be written."""
    out = Path(out).absolute()
    for given in inputs:
        given = Path(given).absolute()
        same = out.exists() and given.exists() and out.samefile(given)
        if same or out.resolve() == given.resolve():
            raise UserError(
                f"--out {out} is also an input, which it would overwrite"
            )
    if out.is_dir():
        raise UserError(f"--out {out} is a folder")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: there is no folder {out.parent}")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: cannot write in {out.parent}")


def load_for_decoding(args):
    """`load_translator` for the command line, refusing a too-wide beam."""
    try:
        model, vocab_src, vocab_tgt, decode_fn = load_translator(
            args.checkpoint, args.device, args.beam, args.average
        )
    except (FileNotFoundError, ValueError) as err:  # CheckpointError, ...
        raise UserError(str(err)) from err
    if args.beam > len(vocab_tgt):
        raise UserError(
            f"--beam {args.beam} is wider than the {len(vocab_tgt)} tokens "
            f"of the target vocabulary of {args.checkpoint}"
        )
    return model, vocab_src, vocab_tgt, decode_fn


# %% [markdown]
# A line can be longer than the model can read: the positional encoding
# (Part 1) has 5,000 positions, and decoding may run 50 tokens past the
# source's length. `fit_to_model` cuts such a line to the tokens that fit
# and says so on stderr, once per line, with its number: the line is
# still translated, from its beginning, and every other line keeps its
# place in the output. We chose truncation with a warning over refusing
# the whole input, because one stray line should not cost the other
# translations.


# %%
#| export
def position_limit(model, max_extra=50):
    """How many source tokens (without <s>, </s>) a model can translate."""
    positions = min(
        model.src_embed[1].pe.size(1), model.tgt_embed[1].pe.size(1)
    )
    return positions - max_extra - 2


def fit_to_model(line, number, spacy_de, vocab_src, limit, what="line"):
    """`line`, cut to its first `limit` tokens, with a warning if cut."""
    if hasattr(vocab_src, "encode"):  # BPE: its own tokens and offsets
        starts = [a for a, _ in vocab_src.tokenizer.encode(line).offsets]
    else:
        tokens = spacy_de.tokenizer(line)
        starts = [tok.idx for tok in tokens if not tok.is_space]
    if len(starts) <= limit:
        return line
    print(
        f"warning: {what} {number} has {len(starts):,d} tokens; the model "
        f"reads {limit:,d}, so only they were translated",
        file=sys.stderr,
    )
    return line[: starts[limit]]


def command_evaluate(args):
    """`evaluate`: BLEU of a checkpoint on a pair of files."""
    if (args.src is None) != (args.ref is None):
        raise UserError("give both --src and --ref, or neither")
    if args.out:
        inputs = [args.checkpoint, *filter(None, [args.src, args.ref])]
        check_out(args.out, *inputs)
    if args.src is None:
        folder = download_multi30k()
        args.src = folder / "test_2016_flickr.de.gz"
        args.ref = folder / "test_2016_flickr.en.gz"
    sources, references = read_parallel(args.src, args.ref)
    model, vocab_src, vocab_tgt, decode_fn = load_for_decoding(args)
    spacy_de, _ = load_tokenizers()
    limit = position_limit(model)
    sources = [
        fit_to_model(s, n, spacy_de, vocab_src, limit)
        for n, s in enumerate(sources, 1)
    ]
    hyps = translate_batch(
        model,
        sources,
        spacy_de,
        vocab_src,
        vocab_tgt,
        device=args.device,
        batch_size=args.batch_size,
        decode_fn=decode_fn,
        replace_unk=args.replace_unk,
    )
    if args.out:
        with atomic_write(args.out, "w") as f:
            f.write("\n".join(hyps) + "\n")
    say(compute_bleu(hyps, references))
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
        if not clean_line(sentence).strip():
            raise UserError(f"sentence {number} is empty: no German to read")
    return iter(map(clean_line, args.sentence))


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
    typing = args.input == "-" and sys.stdin and sys.stdin.isatty()
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
        translate_batch,
        model,
        spacy_de=spacy_de,
        vocab_src=vocab_src,
        vocab_tgt=vocab_tgt,
        device=args.device,
        batch_size=args.batch_size,
        decode_fn=decode_fn,
        replace_unk=args.replace_unk,
    )
    what = "line" if args.input is not None else "sentence"
    fit = functools.partial(
        fit_to_model,
        spacy_de=spacy_de,
        vocab_src=vocab_src,
        limit=position_limit(model),
        what=what,
    )
    stream = itertools.chain(first, lines)
    fitted = (fit(line, n) for n, line in enumerate(stream, 1))
    for hyps in translate_lines(fitted, translate_fn, chunk):
        say(*hyps)
    return 0


def command_download(args):
    """`download`: fetch and verify Multi30k, print where it is."""
    say(download_multi30k())
    return 0


# %% [markdown]
# `main` runs a sub-command and turns every error the user can fix into
# `error: ...` on one line (a message of several lines is joined) and exit
# status 2: the command line's `UserError`, and the library's
# `CheckpointError`, `TextFileError`, `DatasetError`, `FolderInUseError`
# and `FileNotFoundError`. Faults of the machine are one line, too, with
# their own status: a full disk or another error of the operating system
# is 74 (`EX_IOERR` of BSD's `sysexits.h`), and so is a standard output
# that is closed or cannot take the text; Ctrl-C is 130, as the shell
# reports a program that SIGINT ended. (While torch loads, before `main`
# runs, a few lines at the top of the generated module give the same line
# and status when it runs as a script.) A reader that leaves early
# (`translate ... | head -1`) is no error of ours: the program stops
# quietly, with 141, the status of a program that SIGPIPE ended. `main`
# also hides the warning torch prints before it refuses an old-style
# pickle, which would be a second line.


# %%
#| export
EXIT_USAGE, EXIT_IO, EXIT_PIPE, EXIT_INTERRUPTED = 2, 74, 141, 130
USER_ERRORS = (
    UserError,
    CheckpointError,
    TextFileError,
    DatasetError,
    FolderInUseError,
    FileNotFoundError,
)


def stdout_fault():
    """Flush stdout; on failure, send what it holds nowhere; the error."""
    try:
        sys.stdout.flush()
    except OSError as err:  # full, closed or a broken pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return err
    return None


def one_line(err):
    """An exception's message on one line."""
    return " ".join(str(err).split()) or type(err).__name__


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C
    if sys.stdout is None:  # started with stdout closed: `>&-`
        print("error: standard output is closed", file=sys.stderr)
        return EXIT_IO
    try:
        args = build_parser().parse_args(argv)
        commands = {
            "download": command_download,
            "train": command_train,
            "evaluate": command_evaluate,
            "translate": command_translate,
        }
        with warnings.catch_warnings():  # torch's note on an old pickle
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            status = commands[args.command](args)
        sys.stdout.flush()  # a full disk shows here, not at exit
        return status
    except USER_ERRORS as err:
        print("error: " + one_line(err), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        stdout_fault()
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:  # full disk, closed stdout, broken pipe, ...
        fault = stdout_fault()
        if isinstance(err, BrokenPipeError) or isinstance(
            fault, BrokenPipeError
        ):
            return EXIT_PIPE  # the reader left: nothing to report
        if err.filename is not None:
            err = f"{err.filename}: {err.strerror}"
        elif fault is not None:  # the error was writing to stdout
            err = f"standard output: {fault.strerror or one_line(fault)}"
        print("error: " + one_line(err), file=sys.stderr)
        return EXIT_IO
