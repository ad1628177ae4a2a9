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
# # Part 3: A real task, Multi30k German → English
#
# The toy copy task showed that the model and the training loop work. Now we
# train on real sentences: Multi30k (Elliott et al., 2016), about 31,000
# image captions written in English and translated into German. It is tiny
# next to the WMT 2014 data of the paper (4.5 million sentence pairs), but
# it is large enough to learn a usable translator in minutes on one GPU.
#
# This first half of the notebook prepares the data: download and verify the
# files, split sentences into tokens, build the vocabularies, and group
# sentences of similar length into batches.

# %%
# Setup: find the repository (and fetch it when running on Colab).
import os
import subprocess
import sys
from pathlib import Path

REPO_URL = "https://github.com/annotated-transformer/done-right"
if "google.colab" in sys.modules and not Path("done-right").exists():
    subprocess.run(["git", "clone", "--depth=1", REPO_URL], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "-r",
            "done-right/requirements.txt",
        ],
        check=True,
    )
    os.chdir("done-right/notebooks")
ROOT = next(
    p
    for p in [Path.cwd(), *Path.cwd().parents]
    if (p / "the_annotated_transformer.py").exists()
)
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT)
AT_SIZE = os.environ.get("AT_SIZE", "full")  # "ci" runs in seconds

# %%
#| export
import gzip
import hashlib
import http.client
import json
import os
import random
import tempfile
import urllib.error
import urllib.request
import warnings
from collections import Counter
from pathlib import Path

import torch

# %% [markdown]
# ## Downloading Multi30k
#
# The dataset lives as six gzip files in the `data/task1/raw/` folder of the
# multi30k/dataset repository on GitHub: `train`, `val` and
# `test_2016_flickr`, each in German (`.de.gz`) and English (`.en.gz`). Line
# *i* of a German file translates line *i* of the English one. The URLs the
# 2022 tutorial relied on (through torchtext) are dead, so we fetch these
# files directly.
#
# We pin each file's SHA-256 sum. A download is written to a temporary file
# next to its final place and renamed only once its sum matches, so an
# interrupted or corrupted download never leaves a file that looks valid.
# On a machine without internet access, set `MULTI30K_DIR` to a folder that
# already holds the six files; they are then checked, never downloaded.
# Errors are raised as `DatasetError`, whose message says what to do, so a
# command line can print it without a traceback.

# %%
#| export
MULTI30K_BASE_URL = (
    "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
)
MULTI30K_ENV = "MULTI30K_DIR"
MULTI30K_SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
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


class DatasetError(RuntimeError):
    """Multi30k could not be found, downloaded or verified."""


def data_dir():
    """`data/` in the repository root, or in the working directory."""
    cwd = Path.cwd()
    for folder in (cwd, *cwd.parents):
        if (folder / "the_annotated_transformer.py").exists():
            return folder / "data"
    return cwd / "data"


def sha256_of(path):
    """Hex SHA-256 digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# %% [markdown]
# `download_multi30k` is the single entry point. It returns the folder with
# the verified files: the `MULTI30K_DIR` folder when that variable is set,
# otherwise a cache in `data/multi30k/` (or `root`), filled on first use.


# %%
#| export
def _offline_hint(folder):
    """What to do when the files cannot be fetched."""
    return (
        f"The files belong in {folder}. Without internet access, copy the "
        "six Multi30k files (train, val and test_2016_flickr, each .de.gz "
        f"and .en.gz) there yourself, or set {MULTI30K_ENV} to a folder "
        "that holds them."
    )


def _fetch(url, path, expected, timeout):
    """Download `url` to `path`, keeping it only if its SHA-256 matches."""
    from tqdm import tqdm

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=".part", dir=path.parent
        )
        digest = hashlib.sha256()
        with (
            os.fdopen(fd, "wb") as out,
            urllib.request.urlopen(url, timeout=timeout) as response,
        ):
            size = int(response.headers.get("Content-Length") or 0)
            with tqdm(
                total=size or None, unit="B", unit_scale=True, desc=path.name
            ) as bar:
                while chunk := response.read(1 << 16):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        if digest.hexdigest() != expected:
            raise DatasetError(
                f"{url} has SHA-256 {digest.hexdigest()}, expected "
                f"{expected}; the file was not kept.\n"
                + _offline_hint(path.parent)
            )
        os.replace(tmp, path)
        tmp = None
    except (OSError, http.client.HTTPException) as error:
        reason = error
        if type(error) is urllib.error.URLError:
            reason = error.reason
        raise DatasetError(
            f"Could not download {url} ({reason}).\n"
            + _offline_hint(path.parent)
        ) from error
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


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
        return _check_folder(Path(os.environ[MULTI30K_ENV]), sums)
    folder = Path(root) if root is not None else data_dir() / "multi30k"
    for name, expected in sums.items():
        path = folder / name
        if not (path.is_file() and sha256_of(path) == expected):
            url = base_url.rstrip("/") + "/" + name
            _fetch(url, path, expected, timeout)
    return folder


# %% [markdown]
# Reading a split is then a matter of decompressing two files and pairing
# their lines. We strip surrounding whitespace: about 40 German training
# lines end in a stray space.


# %%
#| export
def read_multi30k(split, root=None):
    """The (German, English) sentence pairs of "train", "val" or "test"."""
    if split not in MULTI30K_SPLITS:
        raise ValueError(f"split must be one of {list(MULTI30K_SPLITS)}")
    folder = download_multi30k(root)
    sides = []
    for lang in ("de", "en"):
        name = f"{MULTI30K_SPLITS[split]}.{lang}.gz"
        with gzip.open(folder / name, "rt", encoding="utf-8") as f:
            sides.append([line.strip() for line in f])
    if len(sides[0]) != len(sides[1]):
        raise DatasetError(f"{split}: German and English differ in length")
    return list(zip(*sides, strict=True))


# %%
folder = download_multi30k()
for name in sorted(MULTI30K_SHA256):
    size = (folder / name).stat().st_size
    print(f"{name:24s} {size:>8,d} bytes  sha256 ok")

splits = {split: read_multi30k(split) for split in MULTI30K_SPLITS}
for split, pairs in splits.items():
    print(f"{split:5s} {len(pairs):6,d} sentence pairs")
for de, en in splits["train"][:3]:
    print(f"\nde: {de}\nen: {en}")

# %% [markdown]
# ## Tokenizers
#
# A model reads integer ids, so each sentence is first cut into tokens: words
# and punctuation marks. spaCy's rule-based tokenizers know each language's
# quirks (German "z.B.", English "don't"). The 2022 tutorial loaded the full
# `de_core_news_sm` and `en_core_web_sm` pipelines, which are not on PyPI and
# need a separate download, only to use their tokenizers. `spacy.blank` gives
# the same tokenizers with nothing to download. We drop the whitespace tokens
# that spaCy keeps for runs of several spaces.


# %%
#| export
def load_tokenizers():
    """Rule-based German and English spaCy tokenizers (no download)."""
    import spacy

    return spacy.blank("de"), spacy.blank("en")


def tokenize(text, tokenizer):
    """The token strings of one sentence."""
    return [tok.text for tok in tokenizer.tokenizer(text) if not tok.is_space]


# %%
spacy_de, spacy_en = load_tokenizers()
de, en = splits["train"][0]
print(tokenize(de, spacy_de))
print(tokenize(en, spacy_en))

# %% [markdown]
# ## Vocabulary
#
# A vocabulary maps each token to an id and back. Four special tokens come
# first, at fixed ids: `<s>` starts a sentence, `</s>` ends it, `<blank>`
# pads a short sentence up to the length of its batch, and `<unk>` stands for
# any token the vocabulary does not know. Then come the tokens seen at least
# `min_freq = 2` times, most frequent first, ties in alphabetical order, so
# the same data always gives the same ids.
#
# torchtext, whose vocabulary the 2022 tutorial used, no longer installs with
# current PyTorch, so `Vocab` is a small replacement with the same method
# names. It is saved as JSON, not pickled, so that any later version can read
# it back.

# %%
#| export
SPECIALS = ("<s>", "</s>", "<blank>", "<unk>")
BOS, EOS, PAD, UNK = 0, 1, 2, 3


class Vocab:
    """Token ↔ id maps; the specials come first and unknowns map to UNK."""

    def __init__(self, itos):
        itos = list(itos)
        if tuple(itos[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary must start with {SPECIALS}")
        if len(set(itos)) != len(itos):
            raise ValueError("a vocabulary cannot repeat a token")
        self._itos = itos
        self._stoi = {token: i for i, token in enumerate(itos)}

    @classmethod
    def build(cls, sentences, min_freq=2):
        """Vocabulary of tokens seen at least `min_freq` times."""
        counts = Counter(token for tokens in sentences for token in tokens)
        kept = [t for t, n in counts.items() if n >= min_freq]
        kept = [t for t in kept if t not in SPECIALS]
        kept.sort(key=lambda t: (-counts[t], t))
        return cls([*SPECIALS, *kept])

    def __len__(self):
        return len(self._itos)

    def __contains__(self, token):
        return token in self._stoi

    def __getitem__(self, token):
        return self._stoi.get(token, UNK)

    def __call__(self, tokens):
        return [self._stoi.get(token, UNK) for token in tokens]

    def __eq__(self, other):
        return isinstance(other, Vocab) and self._itos == other._itos

    __hash__ = None

    def lookup_token(self, index):
        """The token with id `index`."""
        return self._itos[int(index)]

    def lookup_tokens(self, indices):
        """The tokens of a sequence of ids."""
        return [self._itos[int(i)] for i in indices]

    def get_stoi(self):
        """A copy of the token → id dict."""
        return dict(self._stoi)

    def get_itos(self):
        """A copy of the id → token list."""
        return list(self._itos)

    def save(self, path):
        """Write the vocabulary as a JSON list of tokens."""
        text = json.dumps({"itos": self._itos}, ensure_ascii=False)
        Path(path).write_text(text, encoding="utf-8")

    @classmethod
    def load(cls, path):
        """Read a vocabulary written by `save`."""
        return cls(json.loads(Path(path).read_text(encoding="utf-8"))["itos"])


# %% [markdown]
# The vocabularies are built from the **training split only**. The 2022
# tutorial counted the validation and test sentences too, which leaks the
# test set: a word seen only in the test data got its own id, and the model
# looked better on unseen words than it is. Here such a word is `<unk>`.
#
# `load_vocab` builds both vocabularies once and caches them in
# `data/vocab.json`; delete that file to rebuild.


# %%
#| export
def build_vocabulary(spacy_de, spacy_en, min_freq=2):
    """Source (German) and target (English) vocabularies of train."""
    train = read_multi30k("train")
    vocab_src = Vocab.build(
        (tokenize(de, spacy_de) for de, _ in train), min_freq
    )
    vocab_tgt = Vocab.build(
        (tokenize(en, spacy_en) for _, en in train), min_freq
    )
    return vocab_src, vocab_tgt


def load_vocab(spacy_de, spacy_en, path=None, min_freq=2):
    """The vocabularies, cached as JSON in `path` (data/vocab.json)."""
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


# %%
vocab_src, vocab_tgt = load_vocab(spacy_de, spacy_en)
print(f"German vocabulary:  {len(vocab_src):,d} tokens")
print(f"English vocabulary: {len(vocab_tgt):,d} tokens")
print("first ids:", vocab_tgt.lookup_tokens(range(12)))


def unknown_rate(pairs, side, vocab, tokenizer):
    """Fraction of tokens in one side of `pairs` that map to <unk>."""
    ids = [i for p in pairs for i in vocab(tokenize(p[side], tokenizer))]
    return sum(i == UNK for i in ids) / len(ids)


for split in ("train", "val", "test"):
    de_rate = unknown_rate(splits[split], 0, vocab_src, spacy_de)
    en_rate = unknown_rate(splits[split], 1, vocab_tgt, spacy_en)
    print(f"<unk> rate in {split:5s}: de {de_rate:.2%}  en {en_rate:.2%}")

# %% [markdown]
# Even in train some tokens are `<unk>`: those seen only once. On validation
# and test the rate is a little higher, which is the honest price of not
# peeking at them.
#
# ## Batching
#
# Each sentence becomes `<s>`, its token ids, then `</s>`. A batch stacks
# several sentences into one `(B, S)` tensor, padding the shorter ones with
# `<blank>` (id 2), which the masks will hide from attention and the loss.
#
# The 2022 tutorial padded every sentence to a fixed `max_padding = 72`, and
# cut longer ones to 72, dropping their `</s>`. Here a batch is padded only
# to its own longest sentence. For long sentences the policy is explicit:
# a training pair whose source or target has more than `max_len` tokens
# (specials included; 128 by default, far above Multi30k's longest) is left
# out of the training batches and counted, never cut. Validation is not
# limited by `max_len`.
#
# `collate_batch` returns CPU tensors. Moving them to the GPU is the training
# loop's job (`Batch(src, tgt, pad=PAD).to(device)`), which lets `DataLoader`
# workers prepare batches in other processes.


# %%
#| export
def encode_text(text, tokenizer, vocab):
    """Ids of one sentence, without `<s>` and `</s>`."""
    if isinstance(vocab, Vocab):
        return vocab(tokenize(text, tokenizer))
    return vocab.encode(text)  # a BPE vocabulary reads raw text (Part 5)


def encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en):
    """Each (de, en) pair as two id lists, `<s> ... </s>`."""
    return [
        (
            [BOS, *encode_text(de, spacy_de, vocab_src), EOS],
            [BOS, *encode_text(en, spacy_en, vocab_tgt), EOS],
        )
        for de, en in pairs
    ]


def collate_batch(batch, pad_id=PAD):
    """Pad encoded (src, tgt) id lists to the longest in this batch."""
    pad = torch.nn.utils.rnn.pad_sequence
    src = pad(
        [torch.tensor(s, dtype=torch.long) for s, _ in batch],
        batch_first=True,
        padding_value=pad_id,
    )  # (B, S)
    tgt = pad(
        [torch.tensor(t, dtype=torch.long) for _, t in batch],
        batch_first=True,
        padding_value=pad_id,
    )  # (B, T)
    return src, tgt


# %%
train_ids = encode_pairs(
    splits["train"], vocab_src, vocab_tgt, spacy_de, spacy_en
)
src, tgt = collate_batch(train_ids[:3])
print(src)
print(vocab_tgt.lookup_tokens(tgt[0]))

# %% [markdown]
# ### Batches by token count
#
# Padding is wasted work, and it is smallest when a batch holds sentences of
# similar length. The paper grouped sentence pairs by approximate length and
# filled each batch with about 25,000 source and 25,000 target tokens, so a
# batch of short sentences holds more of them than a batch of long ones.
#
# `TokenBatchSampler` does the same. Each epoch it shuffles the examples with
# a seed derived from `(seed, epoch)`, sorts them by length (the sort is
# stable, so equal lengths stay shuffled), and cuts the sorted list into
# batches whose padded size, `B * max(S, T)`, stays within `max_tokens`. Then
# it shuffles the order of the batches.
#
# With data-parallel training (`num_replicas` processes), every rank computes
# the same list of batches and takes every `num_replicas`-th one, so ranks
# never share an example. All ranks must run the same number of steps, or
# the gradient synchronisation hangs. When the batch count does not divide
# evenly, we halve the largest batches until it does: no example is dropped
# or repeated, and a halved batch is still within the budget. Call
# `set_epoch(epoch)` before each epoch, as with `DistributedSampler`.


# %%
#| export
class TokenBatchSampler(torch.utils.data.Sampler):
    """Length-bucketed batches within a token budget, split across ranks."""

    def __init__(
        self,
        lengths,
        max_tokens,
        max_len=None,
        num_replicas=1,
        rank=0,
        shuffle=True,
        seed=0,
    ):
        max_len = max_tokens if max_len is None else max_len
        if max_len > max_tokens:
            raise ValueError("max_len must not exceed max_tokens")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        self.sizes = [max(s, t) for s, t in lengths]  # padded width per pair
        self.kept = [i for i, n in enumerate(self.sizes) if n <= max_len]
        self.dropped = [i for i, n in enumerate(self.sizes) if n > max_len]
        self.max_tokens, self.max_len = max_tokens, max_len
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self._cache = None

    def set_epoch(self, epoch):
        """Reshuffle for `epoch` (the same on every rank)."""
        self.epoch = epoch

    def all_batches(self):
        """The batches of every rank for the current epoch."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        rng = random.Random(f"{self.seed}/{self.epoch}")
        order = list(self.kept)
        if self.shuffle:
            rng.shuffle(order)
        order.sort(key=self.sizes.__getitem__)  # stable: ties stay shuffled
        batches, batch = [], []
        for i in order:  # sizes ascend, so sizes[i] is the batch's width
            if batch and (len(batch) + 1) * self.sizes[i] > self.max_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        batches += [batch] if batch else []
        while len(batches) % self.num_replicas:
            k = max(range(len(batches)), key=lambda b: len(batches[b]))
            if len(batches[k]) < 2:
                raise ValueError("too few examples to give every rank a batch")
            half = len(batches[k]) // 2
            batches[k : k + 1] = [batches[k][:half], batches[k][half:]]
        if self.shuffle:
            rng.shuffle(batches)
        self._cache = (self.epoch, batches)
        return batches

    def __iter__(self):
        yield from self.all_batches()[self.rank :: self.num_replicas]

    def __len__(self):
        return len(self.all_batches()) // self.num_replicas


# %% [markdown]
# How much does it save? `bench/batching.py` trains the `paper` model on
# the same 1,024 training pairs both ways. Padded to 72 tokens in batches
# of 32, as in 2022, only 20% of the positions the model computes are real
# tokens; in token-budget buckets of the same size, 89% are. On the 2-core
# development CPU that made training 4.96 times faster in real target
# tokens per second (median of three runs; `bench/RESULTS_batching.md`).
# The cell below shows the same proportion on the validation split.


# %%
val_pairs = encode_pairs(
    splits["val"], vocab_src, vocab_tgt, spacy_de, spacy_en
)
val_sampler = TokenBatchSampler(
    [(len(s), len(t)) for s, t in val_pairs], max_tokens=32 * 72
)
real = sum(len(s) + len(t) for s, t in val_pairs)
bucketed = sum(  # positions of each batch as collate_batch pads it
    src.numel() + tgt.numel()
    for src, tgt in (
        collate_batch([val_pairs[i] for i in batch]) for batch in val_sampler
    )
)
padded = len(val_pairs) * 2 * 72
print(
    f"real tokens: {real / padded:.0%} of positions padded to 72, "
    f"{real / bucketed:.0%} of positions in buckets"
)

# %% [markdown]
# `create_dataloaders` puts the pieces together. Unlike the 2022 version it
# takes no `device`: batches stay on the CPU until the training loop moves
# them. Validation batches are not shuffled and are also split across ranks.
# The indices of left-out training pairs are in
# `train_dataloader.batch_sampler.dropped`, and a warning reports their
# number. `max_train_pairs` keeps only the first pairs of the training
# set (and a quarter as many of validation), for quick runs and tests.
# Encoding the 29,000 training pairs takes a few seconds.


# %%
#| export
def create_dataloaders(
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    max_tokens=4000,
    max_len=128,
    rank=0,
    world_size=1,
    seed=0,
    num_workers=0,
    max_train_pairs=0,
):
    """Train and validation DataLoaders of padded (src, tgt) CPU tensors."""
    loaders = []
    for split, shuffle, limit, n_pairs in (
        ("train", True, max_len, max_train_pairs),
        ("val", False, None, max_train_pairs // 4),
    ):
        pairs = read_multi30k(split)
        pairs = pairs[:n_pairs] if n_pairs else pairs
        data = encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en)
        sampler = TokenBatchSampler(
            [(len(s), len(t)) for s, t in data],
            max_tokens,
            max_len=limit,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
        )
        if sampler.dropped:
            warnings.warn(
                f"{split}: left out {len(sampler.dropped)} of {len(data)} "
                f"pairs longer than {sampler.max_len} tokens",
                stacklevel=2,
            )
        loaders.append(
            torch.utils.data.DataLoader(
                data,
                batch_sampler=sampler,
                collate_fn=collate_batch,
                num_workers=num_workers,
            )
        )
    return tuple(loaders)


# %% [markdown]
# How much padding does this save? We compare three ways to batch the
# training set: every sentence padded to 72 as in 2022, random batches of 32
# pairs padded to their own longest sentence, and the length-bucketed batches
# of 4,000 tokens. Each row gives the share of computed positions (source
# plus target) that are padding.


# %%
def padding_fraction(batches, data, width=None):
    """Share of padded positions, source and target together."""
    real = padded = 0
    for batch in batches:
        src = [len(data[i][0]) for i in batch]
        tgt = [len(data[i][1]) for i in batch]
        real += sum(src) + sum(tgt)
        padded += len(batch) * (width or max(src)) + len(batch) * (
            width or max(tgt)
        )
    return 1 - real / padded


lengths = [(len(s), len(t)) for s, t in train_ids]
sampler = TokenBatchSampler(lengths, max_tokens=4000, max_len=128)
shuffled = random.Random(0).sample(range(len(train_ids)), len(train_ids))
random_batches = [shuffled[i : i + 32] for i in range(0, len(shuffled), 32)]
print(f"longest pair: {max(map(max, lengths))} tokens (with <s> and </s>)")
print(f"pairs left out by max_len=128: {len(sampler.dropped)}")
fractions = {
    "fixed width 72": padding_fraction(random_batches, train_ids, 72),
    "random batches of 32": padding_fraction(random_batches, train_ids),
    "bucketed by length": padding_fraction(sampler, train_ids),
}
for name, fraction in fractions.items():
    print(f"padding, {name:21s} {fraction:6.1%}")
print(f"({len(random_batches)} random batches, {len(sampler)} bucketed)")

# %% [markdown]
# Padding every sentence to 72 positions, as the 2022 version did, wastes
# about four computed positions in five. Padding to the batch's own maximum
# helps, and grouping by length brings the waste down to a few percent, so
# the same compute now goes into real tokens.
#
# The same sampler on two ranks: both get the same number of batches, and no
# pair is seen twice.

# %%
ranks = [
    TokenBatchSampler(lengths, 4000, max_len=128, num_replicas=2, rank=r)
    for r in range(2)
]
seen = [[i for batch in r for i in batch] for r in ranks]
print("batches per rank:", [len(r) for r in ranks])
print("pairs per rank:  ", [len(s) for s in seen])
print("shared pairs:    ", len(set(seen[0]) & set(seen[1])))
print(
    "pairs covered:   ", len(set(seen[0]) | set(seen[1])), "of", len(lengths)
)

# %% [markdown]
# Finally, the distribution of sentence lengths, counted in ids with `<s>`
# and `</s>`. About 85% of the captions have between 10 and 20 tokens.
# English sentences come out slightly longer on average (15.1 against 14.4
# tokens), partly because German writes compounds as one word.

# %%
import altair as alt
import pandas as pd

from the_annotated_transformer import save_chart

lengths_df = pd.concat(
    [
        pd.Series([s for s, _ in lengths]).value_counts().rename("German"),
        pd.Series([t for _, t in lengths]).value_counts().rename("English"),
    ],
    axis=1,
).fillna(0)
lengths_df = lengths_df.rename_axis("tokens").reset_index()
lengths_df = lengths_df.melt("tokens", var_name="language", value_name="n")
chart = (
    alt.Chart(lengths_df)
    .mark_bar()
    .encode(
        x=alt.X("tokens:O", title="tokens per sentence, with <s> and </s>"),
        xOffset="language:N",
        y=alt.Y("n:Q", title="sentences"),
        color="language:N",
    )
    .properties(width=500, height=220, title="Multi30k train lengths")
)
save_chart(chart, "03_multi30k_lengths", ROOT / "figures")

# %% [markdown]
# ## Training on Multi30k
#
# The pieces from Part 2 (`Batch`, `run_epoch`, `LabelSmoothing`, the
# optimizer and its schedule) now meet real data.

# %%
#| export
import argparse
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from functools import partial

# %%
from the_annotated_transformer import (
    Batch,
    LabelSmoothing,
    SimpleLossCompute,
    TrainState,
    make_model,
    make_optimizer,
    native_bf16,
    run_epoch,
    subsequent_mask,
)

# %% [markdown]
# ### Presets
#
# Three sizes of the same recipe, each a small dataclass:
#
# * `paper`: the paper's base model ($N=6$, $d_{\text{model}}=512$,
#   $h=8$, $d_{ff}=2048$, dropout and label smoothing 0.1). The paper's
#   4,000 warm-up steps were 4% of a 100,000-step run over 4.5 million
#   sentence pairs; Multi30k has 29,000, and one epoch of 8,000-token
#   batches is about 60 steps, so we warm up for 800 steps (about 13 epochs'
#   worth of the 40) instead. Meant for a GPU.
# * `cpu`: $N=3$, $d_{\text{model}}=256$, $h=4$, $d_{ff}=1024$, sized to
#   reach a useful BLEU in about an hour and a half on a 2-core laptop CPU.
# * `smoke`: a tiny model on 1,000 sentence pairs for two epochs, so that
#   tests and the CI-sized notebook run in seconds while still exercising
#   every line, with a loss that visibly falls.
#
# `cpu-bpe` and `smoke-bpe` are `cpu` and `smoke` with one BPE vocabulary
# for both languages and tied embeddings; Part 5 explains them.


# %%
#| export
@dataclass
class TrainConfig:
    """Everything that defines a Multi30k training run."""

    preset: str = "cpu"
    N: int = 3
    d_model: int = 256
    d_ff: int = 1024
    h: int = 4
    dropout: float = 0.1
    label_smoothing: float = 0.1
    max_tokens: int = 3000  # token budget of one batch, per process
    accum_iter: int = 1
    num_epochs: int = 20
    factor: float = 1.0
    warmup: int = 800
    max_len: int = 128
    max_train_pairs: int = 0  # 0 means all 29,000
    seed: int = 0
    amp: str = "bf16"  # "bf16" autocast where native, or "none"
    checkpoint_dir: str = "checkpoints/cpu"
    num_workers: int = 0
    tokenization: str = "word"  # or "bpe": one subword vocabulary (Part 5)
    tie_embeddings: bool = False  # share embeddings and generator (Part 5)


PRESETS = {
    "paper": TrainConfig(
        preset="paper",
        N=6,
        d_model=512,
        d_ff=2048,
        h=8,
        max_tokens=8000,
        num_epochs=40,
        warmup=800,
        checkpoint_dir="checkpoints/paper",
    ),
    "cpu": TrainConfig(),
    "smoke": TrainConfig(
        preset="smoke",
        N=1,
        d_model=64,
        d_ff=128,
        h=2,
        dropout=0.0,
        max_tokens=1500,
        num_epochs=2,
        warmup=20,
        factor=2.0,
        max_train_pairs=1000,
        amp="none",
        checkpoint_dir="checkpoints/smoke",
    ),
}
PRESETS |= {  # the same with one BPE vocabulary and tied embeddings
    f"{name}-bpe": replace(
        PRESETS[name],
        preset=f"{name}-bpe",
        tokenization="bpe",
        tie_embeddings=True,
        checkpoint_dir=f"checkpoints/{name}-bpe",
    )
    for name in ("cpu", "smoke")
}


def get_config(preset="cpu", **overrides):
    """A preset's TrainConfig with some fields replaced."""
    if preset not in PRESETS:
        raise UserError(
            f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}"
        )
    return replace(PRESETS[preset], **overrides)


class UserError(Exception):
    """A problem with the user's input, reported without a traceback."""


# %% [markdown]
# ### Devices, processes and mixed precision
#
# One code path serves a laptop CPU, one GPU and several: process `rank`
# uses GPU number `rank` when CUDA is available and the CPU otherwise.
# Processes talk through `torch.distributed`, with the NCCL backend between
# GPUs and gloo on the CPU. The 2022 tutorial hard-coded port 12356; we ask
# the operating system for a free one.
#
# The forward pass runs under bfloat16 autocast wherever the hardware does
# bfloat16 arithmetic natively: recent GPUs, and CPUs with AVX512-BF16 or
# AMX, where it roughly halves the time of a training step (measured on
# this project's 2-core AMD EPYC machine). Weights, optimizer state and the
# loss stay in float32, and bfloat16 has float32's range, so no loss
# scaling is needed (float16 would need it, and our masks are safe there
# too). Elsewhere everything runs in float32. The `smoke` preset turns
# autocast off, so that tests can compare runs exactly.


# %%
#| export
def pick_device(rank=0):
    """cuda:rank when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autocast_context(device, amp="bf16"):
    """bf16 autocast where the hardware runs it natively, else a no-op."""
    if amp == "bf16" and native_bf16(device.type):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def init_distributed(rank, world_size, port=None):
    """Join the process group (env:// under torchrun, tcp otherwise)."""
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if port is None:  # torchrun sets MASTER_ADDR and MASTER_PORT
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )


# %% [markdown]
# ### Checkpoints
#
# A checkpoint holds everything needed to resume: model, optimizer and
# scheduler states, the `TrainState` counters, the random-number state, the
# config and both vocabularies (as token lists, plus the JSON of a BPE
# model, Part 5), and the validation losses so far. It contains only
# tensors and plain Python types, so it loads with
# `torch.load(..., weights_only=True)`, the default since PyTorch 2.6 (the
# 2022 version pickled whole objects, which that default refuses). It is
# written to a temporary file and renamed, so a crash mid-write never leaves
# half a checkpoint, and `map_location` lets a CPU open a GPU checkpoint.


# %%
#| export
def save_checkpoint(path, **fields):
    """Write a dict of tensors and plain types atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    torch.save(fields, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, device="cpu"):
    """Read a checkpoint safely (weights_only) onto `device`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"no checkpoint at {path}; train one first with "
            "`python the_annotated_transformer.py train`"
        )
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # truncated file, not a checkpoint, ...
        raise UserError(f"{path} is not a readable checkpoint: {err}") from err


def epoch_checkpoints(folder):
    """The epoch checkpoints in a folder, oldest first."""
    return sorted(Path(folder).glob("epoch_*.pt"))


def vocab_state(vocab):
    """A vocabulary as plain data: its tokens, or a BPE model's JSON."""
    return vocab.to_str() if hasattr(vocab, "to_str") else vocab.get_itos()


def as_vocab(state):
    """The vocabulary that `vocab_state` gave (or a vocabulary itself)."""
    if isinstance(state, str):
        return BpeVocab.from_str(state)  # noqa: F821 (Part 5)
    return Vocab(state) if isinstance(state, (list, tuple)) else state


def vocab_fields(vocab_src, vocab_tgt):
    """Checkpoint entries from which both vocabularies can be rebuilt."""
    fields = {
        "vocab_src": vocab_src.get_itos(),
        "vocab_tgt": vocab_tgt.get_itos(),
    }
    if not isinstance(vocab_tgt, Vocab):  # BPE: also its merges, as JSON
        fields["bpe"] = vocab_state(vocab_tgt)
    return fields


# %% [markdown]
# ### The training worker
#
# `train_worker` is what each process runs. It builds the model and the
# data loaders for its rank, wraps the model in `DistributedDataParallel`
# when there are several processes, and alternates training and validation
# epochs, saving a checkpoint after each. With `resume=True` it continues
# from the newest checkpoint in `checkpoint_dir`. A progress bar shows the
# loss, the real target tokens per second and the learning rate; on a GPU
# it also shows the peak memory from `torch.cuda`'s own statistics (the
# 2022 tutorial used GPUtil, which no longer imports on Python 3.12).


# %%
#| export
class TrackedLossCompute(SimpleLossCompute):
    """SimpleLossCompute that also drives a tqdm progress bar."""

    def __init__(self, generator, criterion, bar=None, optimizer=None):
        super().__init__(generator, criterion)
        self.bar, self.optimizer = bar, optimizer
        self.start, self.tokens = time.time(), 0

    def __call__(self, x, y, norm):
        total, sloss = super().__call__(x, y, norm)
        if self.bar is not None:
            self.tokens += norm
            rate = self.tokens / (time.time() - self.start)
            postfix = {
                "loss": f"{total / max(norm, 1):.3f}",
                "tok/s": f"{rate:.0f}",
            }
            if self.optimizer is not None:
                postfix["lr"] = f"{self.optimizer.param_groups[0]['lr']:.2e}"
            if x.device.type == "cuda":
                gib = torch.cuda.max_memory_allocated(x.device) / 2**30
                postfix["mem"] = f"{gib:.1f}GiB"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        return total, sloss


def device_batches(loader, device):
    """Batches from a DataLoader of (src, tgt), moved to `device`."""
    for src, tgt in loader:
        yield Batch(src, tgt, pad=PAD).to(device)


def params_in_sync(module):
    """True when every process holds exactly the same parameters."""
    import torch.distributed as dist

    flat = torch.cat(
        [p.detach().float().reshape(-1) for p in module.parameters()]
    )
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


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
):
    """Train on Multi30k in one process; returns the val losses per epoch."""
    from tqdm import tqdm

    config = TrainConfig(**config) if isinstance(config, dict) else config
    vocab_src, vocab_tgt = (as_vocab(v) for v in (vocab_src, vocab_tgt))
    # (a spawned process receives plain token lists, or BPE JSON text)
    if spacy_de is None or spacy_en is None:
        spacy_de, spacy_en = load_tokenizers()
    if is_distributed:
        init_distributed(rank, world_size, port)
    device = pick_device(rank)
    if device.type == "cpu" and world_size > 1:  # share the cores, no spin
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    torch.manual_seed(config.seed)
    model = make_model(
        len(vocab_src),
        len(vocab_tgt),
        N=config.N,
        d_model=config.d_model,
        d_ff=config.d_ff,
        h=config.h,
        dropout=config.dropout,
        tie_embeddings=config.tie_embeddings,
    ).to(device)
    module = model
    if is_distributed:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=ids
        )
    train_loader, valid_loader = create_dataloaders(
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
    )
    criterion = LabelSmoothing(
        len(vocab_tgt), padding_idx=PAD, smoothing=config.label_smoothing
    )
    optimizer, scheduler = make_optimizer(
        module, config.d_model, config.factor, config.warmup
    )
    state, history, first_epoch = TrainState(), [], 0
    if resume and epoch_checkpoints(config.checkpoint_dir):
        ckpt = load_checkpoint(
            epoch_checkpoints(config.checkpoint_dir)[-1], device
        )
        module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        state, history = TrainState(**ckpt["train_state"]), ckpt["history"]
        torch.set_rng_state(ckpt["rng_state"])
        first_epoch = ckpt["epoch"] + 1
    show = show_progress and rank == 0
    amp = partial(autocast_context, device, config.amp)
    for epoch in range(first_epoch, config.num_epochs):
        train_loader.batch_sampler.set_epoch(epoch)
        model.train()
        with tqdm(
            total=len(train_loader),
            disable=not show,
            leave=False,
            desc=f"epoch {epoch} train",
        ) as bar:
            loss_compute = TrackedLossCompute(
                module.generator, criterion, bar, optimizer
            )
            train_loss, state = run_epoch(
                device_batches(train_loader, device),
                model,
                loss_compute,
                optimizer,
                scheduler,
                mode="train",
                accum_iter=config.accum_iter,
                train_state=state,
                autocast=amp,
            )
        model.eval()
        val_loss, _ = run_epoch(
            device_batches(valid_loader, device),
            model,
            SimpleLossCompute(module.generator, criterion),
            mode="eval",
            autocast=amp,
        )
        history.append(
            {
                "epoch": epoch,
                "train_loss": train_loss,
                "val_loss": val_loss,
                "steps": state.accum_step,
            }
        )
        if show:
            tqdm.write(
                f"epoch {epoch:3d} | train loss {train_loss:.3f} | "
                f"val loss {val_loss:.3f} | steps {state.accum_step}"
            )
        if rank == 0:
            save_checkpoint(
                Path(config.checkpoint_dir) / f"epoch_{epoch:03d}.pt",
                model=module.state_dict(),
                optimizer=optimizer.state_dict(),
                scheduler=scheduler.state_dict(),
                train_state=asdict(state),
                rng_state=torch.get_rng_state(),
                config=asdict(config),
                **vocab_fields(vocab_src, vocab_tgt),
                epoch=epoch,
                history=history,
            )
    in_sync = params_in_sync(module) if is_distributed else True
    if rank == 0:
        save_checkpoint(
            Path(config.checkpoint_dir) / "final.pt",
            model=module.state_dict(),
            config=asdict(config),
            **vocab_fields(vocab_src, vocab_tgt),
            epoch=config.num_epochs - 1,
            history=history,
            ranks_in_sync=in_sync,
        )
    if is_distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return history


# %% [markdown]
# `train_distributed_model` starts one process per GPU (or `world_size`
# CPU processes) with `torch.multiprocessing.spawn`. The processes import
# `train_worker` from the exported module, which is why it lives in a cell
# marked for export: a function defined only in a notebook cannot be found
# by a freshly started process, so the demonstration below calls the
# module's copy. `train_model` picks one process or several.


# %%
#| export
def train_distributed_model(
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    config,
    world_size=None,
    resume=False,
):
    """Train with one process per GPU (or world_size CPU processes)."""
    import torch.multiprocessing as mp

    world_size = world_size or max(torch.cuda.device_count(), 1)
    # Only plain data crosses to the new processes: token lists (or BPE
    # JSON text) and a dict (spaCy tokenizers are rebuilt there; they are
    # cheap to make).
    mp.spawn(
        train_worker,
        nprocs=world_size,
        args=(
            world_size,
            vocab_state(vocab_src),
            vocab_state(vocab_tgt),
            None,
            None,
            asdict(config),
            True,
            free_port(),
            resume,
        ),
    )


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
    if distributed:
        return train_distributed_model(
            vocab_src,
            vocab_tgt,
            spacy_de,
            spacy_en,
            config,
            world_size,
            resume,
        )
    return train_worker(
        0, 1, vocab_src, vocab_tgt, spacy_de, spacy_en, config, resume=resume
    )


# %% [markdown]
# ### Loading a trained model
#
# `load_trained_model` rebuilds the model, and both vocabularies, from a
# checkpoint alone.


# %%
#| export
def load_trained_model(path, device="cpu"):
    """(model in eval mode, vocab_src, vocab_tgt, config) from a checkpoint."""
    ckpt = load_checkpoint(path, device)
    try:
        config = TrainConfig(**ckpt["config"])
        if config.tokenization == "bpe":
            vocab_src = vocab_tgt = as_vocab(ckpt["bpe"])
        else:
            vocab_src, vocab_tgt = (
                Vocab(ckpt["vocab_src"]),
                Vocab(ckpt["vocab_tgt"]),
            )
        model = make_model(
            len(vocab_src),
            len(vocab_tgt),
            N=config.N,
            d_model=config.d_model,
            d_ff=config.d_ff,
            h=config.h,
            dropout=0.0,
            tie_embeddings=config.tie_embeddings,
        )
        model.load_state_dict(ckpt["model"])
    except (KeyError, TypeError, RuntimeError) as err:
        raise UserError(
            f"{path} does not match this code's Multi30k model: {err}"
        ) from err
    return model.to(device).eval(), vocab_src, vocab_tgt, config


# %% [markdown]
# ## Decoding and BLEU
#
# The tutorial's `greedy_decode` from Part 2 always generates `max_len`
# tokens, one sentence's worth of work per call. `batch_greedy_decode`
# decodes a whole batch, stops generating for a sentence once it has
# produced `</s>`, and stops altogether once every sentence has. (It still
# re-runs the decoder over the prefix at each step; notebook 05 removes
# that cost with a key/value cache.) Sentences are sorted by length before
# batching, so little work is spent on padding, and the outputs are put
# back in the input order.


# %%
#| export
@torch.no_grad()
def batch_greedy_decode(
    model, src, src_mask, max_len, start_symbol=BOS, end_symbol=EOS
):
    """Greedy decoding of a batch until every row has produced </s>."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    B = src.size(0)
    ys = torch.full(
        (B, 1), start_symbol, dtype=torch.long, device=src.device
    )  # (B, 1)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    for _ in range(max_len - 1):
        out = model.decode(
            memory, src_mask, ys, subsequent_mask(ys.size(1)).to(src.device)
        )
        next_word = model.generator(out[:, -1]).argmax(dim=-1)  # (B,)
        next_word = next_word.masked_fill(done, PAD)
        ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)
        done |= next_word == end_symbol
        if done.all():
            break
    return ys  # (B, <= max_len)


def strip_specials(ids, end_symbol=EOS):
    """Token ids after <s> and before the first </s>."""
    ids = list(ids)[1:]
    return ids[: ids.index(end_symbol)] if end_symbol in ids else ids


# %% [markdown]
# The model writes spaCy tokens; BLEU is computed by sacreBLEU on plain
# text against the untouched references, so the tokens are first joined
# back into a sentence. `detokenize` undoes what spaCy's English tokenizer
# splits off: punctuation, clitics like `'s` and `n't`, and hyphens inside
# words. A test checks that it restores the validation references exactly
# in almost every case.

# %%
#| export
_NO_SPACE_BEFORE = {
    ".",
    ",",
    "!",
    "?",
    ";",
    ":",
    ")",
    "]",
    "}",
    "%",
    "'s",
    "'re",
    "'ve",
    "'ll",
    "'m",
    "'d",
    "n't",
    "'",
}
_NO_SPACE_AFTER = {"(", "[", "{", "$", "#"}


def detokenize(tokens):
    """Join English spaCy tokens into a plain sentence."""
    out, quote_open = "", False
    for i, tok in enumerate(tokens):
        glue = (
            i == 0
            or tok.lower() in _NO_SPACE_BEFORE
            or out.endswith(tuple(_NO_SPACE_AFTER))
            or tok == "-"
            or out.endswith("-")
            and i > 1
            and tokens[i - 1] == "-"
            and tokens[i - 2] not in {",", ".", "-"}
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
    if isinstance(vocab, Vocab):
        return detokenize(vocab.lookup_tokens(ids))
    return vocab.decode(ids)  # a BPE vocabulary decodes itself (Part 5)


def translate_batch(
    model,
    sentences,
    spacy_de,
    vocab_src,
    vocab_tgt,
    device="cpu",
    batch_size=128,
    max_extra=50,
    decode_fn=None,
):
    """German sentences to detokenized English, in input order."""
    decode_fn = decode_fn or batch_greedy_decode
    model.eval()
    encoded = [
        [BOS, *encode_text(s, spacy_de, vocab_src), EOS] for s in sentences
    ]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    results = [None] * len(encoded)
    for k in range(0, len(order), batch_size):
        idx = order[k : k + batch_size]
        src = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(encoded[i]) for i in idx],
            batch_first=True,
            padding_value=PAD,
        ).to(device)  # (B, S)
        src_mask = (src != PAD).unsqueeze(-2)  # (B, 1, S)
        out = decode_fn(model, src, src_mask, src.size(1) + max_extra)
        for i, row in zip(idx, out.tolist(), strict=True):
            results[i] = decode_text(strip_specials(row), vocab_tgt)
    return results


def compute_bleu(hypotheses, references):
    """Cased corpus BLEU (sacreBLEU, 13a tokenization) of plain text."""
    import sacrebleu

    return sacrebleu.corpus_bleu(hypotheses, [references])


# %% [markdown]
# `check_outputs` prints a few validation examples side by side. Compared
# with 2022 it puts the model in `eval()` mode first (otherwise dropout is
# still active and the output is noisy), and decodes each example once.
# `run_model_example` loads a checkpoint and does the same.


# %%
#| export
def check_outputs(
    model, pairs, spacy_de, vocab_src, vocab_tgt, n_examples=5, device="cpu"
):
    """Print source, reference and model output for some pairs."""
    pairs = list(pairs)[:n_examples]
    hyps = translate_batch(
        model.eval(),
        [de for de, _ in pairs],
        spacy_de,
        vocab_src,
        vocab_tgt,
        device,
    )
    for i, ((de, en), hyp) in enumerate(zip(pairs, hyps)):
        print(
            f"example {i}\n  source:     {de}\n  reference:  {en}\n"
            f"  model:      {hyp}\n"
        )
    return hyps


def run_model_example(checkpoint="checkpoints/cpu/final.pt", n_examples=5):
    """Load a trained model and show some validation translations."""
    model, vocab_src, vocab_tgt, _ = load_trained_model(checkpoint)
    spacy_de, _ = load_tokenizers()
    return check_outputs(
        model, read_multi30k("val"), spacy_de, vocab_src, vocab_tgt, n_examples
    )


# %% [markdown]
# ### Training a model
#
# The next cell trains. Under the CI-sized run (`AT_SIZE=ci`) it uses the
# `smoke` preset, a few seconds of work. Otherwise it uses `paper` on a GPU
# and `cpu` on a CPU, and skips training when that preset's final
# checkpoint already exists (for instance after `make train`), because a
# full run takes about an hour on a laptop CPU.

# %%
preset = (
    "smoke"
    if AT_SIZE == "ci"
    else ("paper" if torch.cuda.is_available() else "cpu")
)
config = get_config(preset)
final_checkpoint = Path(ROOT) / config.checkpoint_dir / "final.pt"
config = replace(config, checkpoint_dir=str(final_checkpoint.parent))
if preset == "smoke" or not final_checkpoint.exists():
    history = train_model(vocab_src, vocab_tgt, spacy_de, spacy_en, config)
print(f"using {final_checkpoint.relative_to(ROOT)} (preset {preset!r})")

# %% [markdown]
# ### Several processes
#
# The same worker, two processes. On a machine with two GPUs each process
# drives one; here, without GPUs, both run on the CPU and talk through
# gloo. Each process sees half the batches and gradients are averaged
# before every step, so two processes do one epoch in about half the steps
# of one. This is a demonstration with the `smoke` preset; from a terminal,
# `torchrun --nproc_per_node=2 the_annotated_transformer.py train` does the
# same.

# %%
import the_annotated_transformer as tat  # what spawned processes import

ddp_config = replace(
    get_config("smoke"),
    num_epochs=1,
    checkpoint_dir=str(ROOT / "checkpoints" / "smoke-ddp"),
)
tat.train_distributed_model(
    vocab_src, vocab_tgt, spacy_de, spacy_en, ddp_config, world_size=2
)
ddp_ckpt = load_checkpoint(Path(ddp_config.checkpoint_dir) / "final.pt")
print(
    "two-process run, validation loss per epoch:",
    [round(h["val_loss"], 3) for h in ddp_ckpt["history"]],
)

# %% [markdown]
# ### Translations and BLEU
#
# A few validation sentences, then BLEU on the 1,000 sentences of the
# test2016 split, scored by sacreBLEU on detokenized, cased text. The
# smoke model of a CI run produces little more than common words; the
# committed result of the full `cpu` run is in `results/multi30k_cpu.json`
# and in the README.

# %%
model, vocab_src_ck, vocab_tgt_ck, trained_config = load_trained_model(
    final_checkpoint
)
_ = check_outputs(model, splits["val"], spacy_de, vocab_src_ck, vocab_tgt_ck)

# %%
test_pairs = splits["test"][:100] if AT_SIZE == "ci" else splits["test"]
hypotheses = translate_batch(
    model, [de for de, _ in test_pairs], spacy_de, vocab_src_ck, vocab_tgt_ck
)
print(compute_bleu(hypotheses, [en for _, en in test_pairs]))


# %% [markdown]
# ## The command line
#
# The exported module doubles as a program:
#
# ```
# python the_annotated_transformer.py train --preset cpu
# torchrun --nproc_per_node=2 the_annotated_transformer.py train --preset cpu
# python the_annotated_transformer.py evaluate --src t.de.gz --ref t.en.gz
# python the_annotated_transformer.py translate "Ein Mann fährt Fahrrad."
# ```
#
# Mistakes in the input (an empty sentence, a missing or foreign checkpoint,
# files of different lengths, no data and no network) end with a one-line
# message and exit status 2, not a traceback.


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


def read_lines(path):
    """Lines of a plain or gzipped UTF-8 text file, without newlines."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such file: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def evaluate_files(
    model,
    src_path,
    ref_path,
    spacy_de,
    vocab_src,
    vocab_tgt,
    device="cpu",
    batch_size=128,
    decode_fn=None,
):
    """(BLEU, hypotheses) of a model on a parallel pair of text files."""
    sources, references = read_lines(src_path), read_lines(ref_path)
    if len(sources) != len(references):
        raise UserError(
            f"{src_path} has {len(sources)} lines but {ref_path} has "
            f"{len(references)}; they must be line-by-line translations"
        )
    if not sources:
        raise UserError(f"{src_path} is empty")
    hyps = translate_batch(
        model,
        sources,
        spacy_de,
        vocab_src,
        vocab_tgt,
        device,
        batch_size,
        decode_fn=decode_fn,
    )
    return compute_bleu(hyps, references), hyps


# %%
#| export
def build_parser():
    """The argparse parser of the command line."""
    parser = argparse.ArgumentParser(
        prog="the_annotated_transformer.py",
        description="Train, evaluate and use the Annotated Transformer on "
        "Multi30k German→English.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model on Multi30k")
    train.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    train.add_argument("--epochs", type=int, help="override num_epochs")
    train.add_argument("--max-tokens", type=int, help="tokens per batch")
    train.add_argument("--checkpoint-dir", help="where checkpoints go")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest epoch checkpoint",
    )
    train.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="processes to spawn (torchrun sets its own)",
    )
    train.add_argument(
        "--results", help="write a JSON summary here, including test BLEU"
    )
    train.add_argument(
        "--threads",
        type=int,
        help="CPU threads per process (default: torch's)",
    )
    for name, text in (
        ("evaluate", "BLEU on a parallel pair of files"),
        ("translate", "translate German sentences"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--checkpoint", default="checkpoints/cpu/final.pt")
        p.add_argument("--batch-size", type=int, default=128)
        p.add_argument("--device", default="cpu")
        p.add_argument(
            "--beam",
            type=int,
            default=1,
            metavar="K",
            help="beam size (default 1: greedy)",
        )
        p.add_argument(
            "--average",
            type=int,
            default=0,
            metavar="K",
            help="average the last K epoch checkpoints in the "
            "checkpoint's folder",
        )
    evaluate, translate = sub.choices["evaluate"], sub.choices["translate"]
    evaluate.add_argument(
        "--src",
        help="German sources, one per line "
        "(.gz is fine; default: Multi30k test2016)",
    )
    evaluate.add_argument("--ref", help="English references, one per line")
    evaluate.add_argument("--out", help="also write the translations here")
    translate.add_argument("sentence", nargs="+", help="German text")
    return parser


def command_train(args):
    """`train`: run training, then optionally score and summarize."""
    overrides = {
        k: v
        for k, v in (
            ("num_epochs", args.epochs),
            ("max_tokens", args.max_tokens),
            ("checkpoint_dir", args.checkpoint_dir),
        )
        if v is not None
    }
    config = get_config(args.preset, **overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    spacy_de, spacy_en = load_tokenizers()
    if config.tokenization == "bpe":
        vocab_src = vocab_tgt = load_bpe()  # noqa: F821 (Part 5)
    else:
        vocab_src, vocab_tgt = load_vocab(spacy_de, spacy_en)
    start = time.time()
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        train_worker(
            rank,
            world,
            vocab_src,
            vocab_tgt,
            spacy_de,
            spacy_en,
            config,
            is_distributed=world > 1,
            resume=args.resume,
        )
        if rank != 0:
            return 0
    else:
        train_model(
            vocab_src,
            vocab_tgt,
            spacy_de,
            spacy_en,
            config,
            distributed=args.world_size > 1,
            world_size=args.world_size,
            resume=args.resume,
        )
    final = Path(config.checkpoint_dir) / "final.pt"
    print(f"trained in {time.time() - start:.0f} s; model in {final}")
    if args.results:
        write_results(args.results, final, time.time() - start)
    return 0


def write_results(path, checkpoint, wall_time):
    """Score test2016 greedily and write a JSON summary of the run."""
    model, vocab_src, vocab_tgt, config = load_trained_model(checkpoint)
    spacy_de, _ = load_tokenizers()
    test = read_multi30k("test")
    hyps = translate_batch(
        model, [de for de, _ in test], spacy_de, vocab_src, vocab_tgt
    )
    bleu = compute_bleu(hyps, [en for _, en in test])
    history = load_checkpoint(checkpoint)["history"]
    summary = {
        "command": "python " + " ".join(sys.argv),
        "config": asdict(config),
        "hardware": hardware_summary(),
        "wall_time_s": round(wall_time, 1),
        "epochs": len(history),
        "history": history,
        "test2016_bleu_greedy": round(bleu.score, 2),
        "bleu": str(bleu),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"test2016 BLEU (greedy): {bleu.score:.2f}; summary in {path}")


def command_evaluate(args):
    """`evaluate`: BLEU of a checkpoint on a pair of files."""
    model, vocab_src, vocab_tgt, decode_fn = load_translator(  # noqa: F821
        args.checkpoint, args.device, args.beam, args.average
    )  # (Part 5)
    spacy_de, _ = load_tokenizers()
    if (args.src is None) != (args.ref is None):
        raise UserError("give both --src and --ref, or neither")
    if args.src is None:
        folder = download_multi30k()
        args.src = folder / "test_2016_flickr.de.gz"
        args.ref = folder / "test_2016_flickr.en.gz"
    bleu, hyps = evaluate_files(
        model,
        args.src,
        args.ref,
        spacy_de,
        vocab_src,
        vocab_tgt,
        args.device,
        args.batch_size,
        decode_fn,
    )
    if args.out:
        Path(args.out).write_text("\n".join(hyps) + "\n", encoding="utf-8")
    print(bleu)
    return 0


def command_translate(args):
    """`translate`: print the English translation of German text."""
    text = " ".join(args.sentence).strip()
    if not text:
        raise UserError("nothing to translate: the sentence is empty")
    model, vocab_src, vocab_tgt, decode_fn = load_translator(  # noqa: F821
        args.checkpoint, args.device, args.beam, args.average
    )  # (Part 5)
    spacy_de, _ = load_tokenizers()
    unknown = []
    if isinstance(vocab_src, Vocab):  # (BPE can spell any known letters)
        unknown = [t for t in tokenize(text, spacy_de) if t not in vocab_src]
    if unknown:
        print(
            "note: not in the vocabulary, read as <unk>: "
            + ", ".join(unknown),
            file=sys.stderr,
        )
    print(
        translate_batch(
            model,
            [text],
            spacy_de,
            vocab_src,
            vocab_tgt,
            args.device,
            decode_fn=decode_fn,
        )[0]
    )
    return 0


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    commands = {
        "train": command_train,
        "evaluate": command_evaluate,
        "translate": command_translate,
    }
    try:
        return commands[args.command](args)
    except (UserError, DatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
