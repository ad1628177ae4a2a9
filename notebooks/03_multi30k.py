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
def _offline_hint(folder, names):
    """What to do when the files cannot be fetched."""
    return (
        f"The files belong in {folder}. Without internet access, copy "
        f"{', '.join(sorted(names))} there yourself, or set {MULTI30K_ENV} "
        "to a folder that holds them."
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
                + _offline_hint(path.parent, [path.name])
            )
        os.replace(tmp, path)
        tmp = None
    except (OSError, http.client.HTTPException) as error:
        reason = error
        if type(error) is urllib.error.URLError:
            reason = error.reason
        raise DatasetError(
            f"Could not download {url} ({reason}).\n"
            + _offline_hint(path.parent, [path.name])
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
        return self._itos[int(index)]

    def lookup_tokens(self, indices):
        return [self._itos[int(i)] for i in indices]

    def get_stoi(self):
        return dict(self._stoi)

    def get_itos(self):
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
def encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en):
    """Each (de, en) pair as two id lists, `<s> ... </s>`."""
    return [
        (
            [BOS, *vocab_src(tokenize(de, spacy_de)), EOS],
            [BOS, *vocab_tgt(tokenize(en, spacy_en)), EOS],
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
# `create_dataloaders` puts the pieces together. Unlike the 2022 version it
# takes no `device`: batches stay on the CPU until the training loop moves
# them. Validation batches are not shuffled and are also split across ranks.
# The indices of left-out training pairs are in
# `train_dataloader.batch_sampler.dropped`, and a warning reports their
# number. Encoding the 29,000 training pairs takes a few seconds.


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
):
    """Train and validation DataLoaders of padded (src, tgt) CPU tensors."""
    loaders = []
    for split, shuffle, limit in (
        ("train", True, max_len),
        ("val", False, None),
    ):
        data = encode_pairs(
            read_multi30k(split), vocab_src, vocab_tgt, spacy_de, spacy_en
        )
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
# The same sampler on two ranks: the ranks get the same number of batches,
# and no pair twice.

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
# Finally, the distribution of sentence lengths: most captions have between
# 10 and 20 tokens, and German ones run a little longer than English ones.

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
    .mark_bar(opacity=0.6)
    .encode(
        x=alt.X("tokens:O", title="tokens per sentence, with <s> and </s>"),
        xOffset="language:N",
        y=alt.Y("n:Q", title="sentences"),
        color="language:N",
    )
    .properties(width=500, height=220, title="Multi30k train lengths")
)
save_chart(chart, "03_multi30k_lengths", ROOT / "figures")
