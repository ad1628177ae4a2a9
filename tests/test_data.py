"""Tests of the Multi30k data pipeline (notebooks/03_multi30k.py)."""

import functools
import gzip
import hashlib
import http.server
import importlib.util
import random
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- download
def test_pinned_sums_match_the_shared_checksum_file(multi30k_dir):
    sums_file = multi30k_dir / "SHA256SUMS"  # beside the local copy
    if not sums_file.is_file():
        pytest.skip(f"no {sums_file}")
    pinned = dict(
        reversed(line.split()) for line in sums_file.read_text().splitlines()
    )
    assert tools.MULTI30K_SHA256 == pinned


@pytest.fixture
def server(tmp_path):
    """A local HTTP server over a folder of small gzip files."""
    served = tmp_path / "served"
    served.mkdir()
    sums = {}
    for name in ("train.de.gz", "train.en.gz"):
        data = gzip.compress(f"{name} line 1\n{name} line 2\n".encode())
        (served / name).write_bytes(data)
        sums[name] = hashlib.sha256(data).hexdigest()
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append(self.path)

    handler = functools.partial(Handler, directory=str(served))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    yield url, served, sums, requests
    httpd.shutdown()
    httpd.server_close()


def test_download_writes_verified_files_and_then_uses_the_cache(
    server, tmp_path, monkeypatch
):
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    url, served, sums, requests = server
    cache = tmp_path / "cache"
    folder = tools.download_multi30k(cache, base_url=url, sha256=sums)
    assert folder == cache
    assert sorted(p.name for p in cache.iterdir()) == sorted(sums)
    for name in sums:
        assert (cache / name).read_bytes() == (served / name).read_bytes()
    assert len(requests) == 2
    tools.download_multi30k(cache, base_url=url, sha256=sums)
    assert len(requests) == 2  # verified files are not fetched again


def test_checksum_mismatch_raises_and_leaves_no_file(
    server, tmp_path, monkeypatch
):
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    url, _, sums, _ = server
    sums = dict(sums, **{"train.en.gz": "0" * 64})
    cache = tmp_path / "cache"
    with pytest.raises(tat.DatasetError) as info:
        tools.download_multi30k(cache, base_url=url, sha256=sums)
    message = str(info.value)
    assert url + "train.en.gz" in message and str(cache) in message
    assert "MULTI30K_DIR" in message
    assert [p.name for p in cache.iterdir()] == ["train.de.gz"]  # no .part


def test_missing_file_on_server_raises(server, tmp_path, monkeypatch):
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    url, _, sums, _ = server
    cache = tmp_path / "cache"
    with pytest.raises(tat.DatasetError, match="404"):
        tools.download_multi30k(
            cache, base_url=url, sha256={"val.de.gz": "0" * 64}
        )
    assert not cache.exists()


def test_unreachable_server_raises_a_readable_error(tmp_path, monkeypatch):
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    with socket.socket() as sock:  # find a port, then close it again
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    cache = tmp_path / "cache"
    with pytest.raises(tat.DatasetError) as info:
        tools.download_multi30k(
            cache, base_url=url, sha256={"val.de.gz": "0" * 64}, timeout=5
        )
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert f"Could not download {url}val.de.gz" in message
    assert str(cache) in message and "MULTI30K_DIR" in message
    assert "Traceback" not in message
    assert not cache.exists()  # made for the download, removed with it


def test_a_python_without_certificates_is_told_what_to_run(
    tmp_path, monkeypatch
):
    """python.org's Python on a Mac verifies no HTTPS certificate until
    its Install Certificates.command has run."""
    monkeypatch.delenv("MULTI30K_DIR", raising=False)

    def unverified(url, timeout=None):
        error = ssl.SSLCertVerificationError("certificate verify failed")
        raise urllib.error.URLError(error)

    monkeypatch.setattr(urllib.request, "urlopen", unverified)
    with pytest.raises(tat.DatasetError) as info:
        tools.download_multi30k(
            tmp_path / "cache", sha256={"val.de.gz": "0" * 64}
        )
    message = str(info.value)
    assert "certificate verify failed" in message
    assert "Install Certificates.command" in message
    assert "MULTI30K_DIR" in message  # the offline way stays


def test_a_failed_download_keeps_what_was_there(tmp_path, monkeypatch):
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    data = tmp_path / "data"
    (data / "kept").mkdir(parents=True)
    url = "http://127.0.0.1:9/"  # the discard port: nothing answers there
    for cache in (data / "multi30k", data / "a" / "b"):
        with pytest.raises(tat.DatasetError):
            tools.download_multi30k(cache, base_url=url, timeout=5)
    assert sorted(p.name for p in data.iterdir()) == ["kept"]
    cache.mkdir(parents=True)
    with pytest.raises(tat.DatasetError):
        tools.download_multi30k(cache, base_url=url, timeout=5)
    assert cache.is_dir()  # it was there before the call


def test_multi30k_dir_is_verified_and_used(multi30k_dir, monkeypatch):
    monkeypatch.setenv("MULTI30K_DIR", str(multi30k_dir))
    assert tools.download_multi30k() == multi30k_dir


def test_multi30k_dir_without_files_explains_where_they_go(
    tmp_path, monkeypatch
):
    (tmp_path / "train.de.gz").write_bytes(b"not the real file")
    monkeypatch.setenv("MULTI30K_DIR", str(tmp_path))
    with pytest.raises(tat.DatasetError) as info:
        tools.download_multi30k()
    message = str(info.value)
    assert str(tmp_path) in message and "MULTI30K_DIR" in message
    assert "train.de.gz has the wrong SHA-256" in message
    assert "val.en.gz is missing" in message


@pytest.mark.parametrize(
    "split, lines", [("train", 29000), ("val", 1014), ("test", 1000)]
)
def test_read_multi30k_line_counts(split, lines, multi30k_dir, monkeypatch):
    monkeypatch.setenv("MULTI30K_DIR", str(multi30k_dir))
    pairs = tat.read_multi30k(split)
    assert len(pairs) == lines
    stem = tat.MULTI30K_SPLITS[split]
    with gzip.open(
        multi30k_dir / f"{stem}.en.gz", "rt", encoding="utf-8"
    ) as f:
        first_en = f.readline()
    assert pairs[0][1] == first_en.strip()
    assert all(isinstance(de, str) and de for de, _ in pairs)


# ------------------------------------------------------ where data lives
def test_data_dir_inside_a_repository_is_its_data(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "the_annotated_transformer.py").touch()
    monkeypatch.chdir(repo / "notebooks")
    monkeypatch.setattr(tat, "MODULE_DIR", tmp_path / "elsewhere")
    assert tat.data_dir() == repo / "data"


def test_data_dir_outside_falls_back_to_the_modules_checkout(
    tmp_path, monkeypatch
):
    # Colab: the clone is /content/done-right, the working directory
    # /content, and the module is installed with `pip install -e`.
    clone = tmp_path / "done-right"
    clone.mkdir()
    (clone / "the_annotated_transformer.py").touch()
    (clone / "pyproject.toml").touch()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tat, "MODULE_DIR", clone)
    assert tat.data_dir() == clone / "data"
    assert tools.data_dir() == clone / "data"  # the appendix's downloads


def test_data_dir_outside_with_an_installed_module_is_the_cwds(
    tmp_path, monkeypatch
):
    installed = tmp_path / "site-packages"  # no pyproject.toml there
    installed.mkdir()
    (installed / "the_annotated_transformer.py").touch()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tat, "MODULE_DIR", installed)
    assert tat.data_dir() == work / "data"


def test_module_dir_is_the_folder_of_the_imported_module():
    assert tat.MODULE_DIR == Path(tat.__file__).parent


def test_module_folder_in_a_notebook_asks_the_import_system(monkeypatch):
    expected = Path(tat.__file__).resolve().parent
    # A notebook cell has no __file__: take it away from the module.
    monkeypatch.delitem(vars(tat), "__file__")
    assert tat.module_folder() == expected


@pytest.mark.parametrize("answer", ["none", "no spec"])
def test_module_folder_nowhere_is_none(answer, monkeypatch):
    monkeypatch.delitem(vars(tat), "__file__")

    def find_spec(name):
        if answer == "none":
            return None  # not importable
        raise ValueError(f"{name}.__spec__ is None")  # imported oddly

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert tat.module_folder() is None


def test_data_dir_without_a_module_folder_is_the_cwds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tat, "MODULE_DIR", None)
    assert tat.data_dir() == tmp_path / "data"


# -------------------------------------------------------------- vocabulary
def test_vocab_specials_order_min_freq_and_unknowns():
    sentences = [["b", "z", "c"], ["z", "b", "d"], ["z", "a", "a"]]
    vocab = tat.Vocab.build(sentences, min_freq=2)
    # z: 3, then a: 2 and b: 2 (ties alphabetical); c and d seen once.
    assert vocab.get_itos() == ["<s>", "</s>", "<blank>", "<unk>", *"zab"]
    assert (tat.BOS, tat.EOS, tat.PAD, tat.UNK) == (0, 1, 2, 3)
    assert len(vocab) == 7
    assert vocab["z"] == 4 and vocab["b"] == 6
    assert vocab["c"] == vocab["never seen"] == tat.UNK
    assert vocab(["b", "zz", "<s>"]) == [6, 3, 0]
    assert vocab.lookup_tokens(torch.tensor([0, 4, 1])) == ["<s>", "z", "</s>"]
    assert "z" in vocab and "c" not in vocab
    assert tat.Vocab.build(sentences, min_freq=1)["c"] != tat.UNK


def test_vocab_rebuilt_from_its_itos_is_equal():
    vocab = tat.Vocab.build([["Straße", "ein", "ein", "Straße", "x"]], 2)
    again = tat.Vocab(vocab.get_itos())  # how the appendix reads vocab.json
    assert again == vocab
    assert again["Straße"] == vocab["Straße"] != tat.UNK


class WordList:
    """Not a Vocab: another class with the same get_itos, as the lesson's
    notebook defines its own Vocab beside the module's."""

    def __init__(self, itos):
        self.itos = list(itos)

    def get_itos(self):
        return list(self.itos)


class SubwordList(WordList):
    """A vocabulary that encodes raw text itself, as Part 5's BpeVocab."""

    def encode(self, text):
        return []


def test_vocab_equality_goes_by_the_token_list_not_the_class():
    itos = [*tat.SPECIALS, "Hund", "ein"]
    vocab = tat.Vocab(itos)
    assert vocab == WordList(itos)
    assert WordList(itos) == vocab
    assert vocab != WordList([*tat.SPECIALS, "ein", "Hund"])  # other ids
    assert vocab != WordList(itos[:-1])
    assert vocab != SubwordList(itos)  # cuts text its own way
    assert vocab != object()  # not a vocabulary
    assert vocab != itos  # a list, not a vocabulary
    assert vocab.__eq__(object()) is NotImplemented


def test_vocabulary_is_built_from_train_only(tmp_path, monkeypatch):
    corpus = {
        "train": [("ein Hund", "a dog"), ("ein Hund", "a dog")],
        "val": [("Katze Katze", "cat cat")] * 3,
        "test": [("Pferd Pferd", "horse horse")] * 3,
    }
    asked = []

    def fake_read(split, root=None):
        asked.append(split)
        return corpus[split]

    monkeypatch.setattr(tat, "read_multi30k", fake_read)
    monkeypatch.setattr(tools, "read_multi30k", fake_read)
    spacy_de, spacy_en = tat.load_tokenizers()
    vocab_src, vocab_tgt = tools.load_vocab(
        spacy_de, spacy_en, path=tmp_path / "vocab.json"
    )
    assert asked == ["train"]
    assert vocab_src.get_itos()[4:] == ["Hund", "ein"]
    assert vocab_tgt["dog"] != tat.UNK
    assert vocab_src["Pferd"] == vocab_tgt["horse"] == tat.UNK
    assert vocab_src["Katze"] == vocab_tgt["cat"] == tat.UNK
    again = tools.load_vocab(spacy_de, spacy_en, path=tmp_path / "vocab.json")
    assert asked == ["train"]  # the second call reads the JSON cache
    assert again == (vocab_src, vocab_tgt)


def test_tokenize_splits_punctuation_and_skips_spaces():
    spacy_de, spacy_en = tat.load_tokenizers()
    assert tat.tokenize("Ein Hund  läuft.", spacy_de) == [
        "Ein",
        "Hund",
        "läuft",
        ".",
    ]
    assert tat.tokenize("A dog's toy.", spacy_en) == [
        "A",
        "dog",
        "'s",
        "toy",
        ".",
    ]


# ---------------------------------------------------------------- batching
def test_collate_pads_to_the_batch_maximum_on_the_cpu():
    batch = [([0, 5, 6, 1], [0, 7, 1]), ([0, 8, 1], [0, 9, 9, 9, 9, 1])]
    src, tgt = tat.collate_batch(batch)
    expected_src = [[0, 5, 6, 1], [0, 8, 1, 2]]
    expected_tgt = [[0, 7, 1, 2, 2, 2], [0, 9, 9, 9, 9, 1]]
    assert src.tolist() == expected_src and tgt.tolist() == expected_tgt
    assert src.dtype == tgt.dtype == torch.long
    assert src.device.type == tgt.device.type == "cpu"
    for row, (s, _) in zip(src, batch, strict=True):
        real = row[row != tat.PAD]
        assert real[-1].item() == tat.EOS and len(real) == len(s)
    assert tat.collate_batch(batch, pad_id=-1)[0][1, 3].item() == -1


def test_encode_pairs_wraps_ids_in_bos_and_eos():
    spacy_de, spacy_en = tat.load_tokenizers()
    vocab = tat.Vocab([*tat.SPECIALS, "Hund", "dog"])
    [(src, tgt)] = tat.encode_pairs(
        [("Hund Katze", "dog")], vocab, vocab, spacy_de, spacy_en
    )
    assert src == [tat.BOS, 4, tat.UNK, tat.EOS]
    assert tgt == [tat.BOS, 5, tat.EOS]


def random_lengths(n=600, seed=1):
    rng = random.Random(seed)
    return [(rng.randint(3, 40), rng.randint(3, 40)) for _ in range(n)]


def epoch_batches(lengths, world, epoch, **kwargs):
    sampler = tat.TokenBatchSampler(lengths, **kwargs)
    samplers = [
        tools.ShardedBatchSampler(sampler, world, r) for r in range(world)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers], samplers


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sampler_covers_every_kept_example_once_across_ranks(world):
    lengths = random_lengths()
    lengths[10] = (50, 3)
    lengths[20] = (4, 31)
    per_rank, samplers = epoch_batches(
        lengths, world, epoch=0, max_tokens=300, max_len=30
    )
    long_ones = {i for i, (s, t) in enumerate(lengths) if max(s, t) > 30}
    assert 10 in long_ones and 20 in long_ones
    assert set(samplers[0].sampler.dropped) == long_ones  # counted, not cut
    seen = [i for batches in per_rank for b in batches for i in b]
    assert Counter(seen) == Counter(set(range(len(lengths))) - long_ones)
    ids_by_rank = [{i for b in batches for i in b} for batches in per_rank]
    for a in range(world):
        for b in range(a + 1, world):
            assert not ids_by_rank[a] & ids_by_rank[b]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1
    assert counts == {len(s) for s in samplers}


def test_sampler_splits_batches_so_every_rank_gets_as_many():
    lengths = [(10, 10)] * 5  # budget 20: batches of 2, 2 and 1
    assert len(tat.TokenBatchSampler(lengths, 20)) == 3
    per_rank, _ = epoch_batches(lengths, 2, epoch=0, max_tokens=20)
    assert [len(batches) for batches in per_rank] == [2, 2]
    seen = sorted(i for batches in per_rank for b in batches for i in b)
    assert seen == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="too few"):
        one = tat.TokenBatchSampler(lengths[:1], 20)
        list(tools.ShardedBatchSampler(one, 2, 0))


def test_sampler_respects_the_token_budget_and_buckets_lengths():
    lengths = random_lengths()
    (batches,), _ = epoch_batches(lengths, 1, epoch=3, max_tokens=400)
    for batch in batches:
        width = max(max(lengths[i]) for i in batch)
        assert len(batch) * width <= 400

    # Bucketing: far less padding than random batches of the same count.
    def padded(groups):
        return sum(len(g) * max(max(lengths[i]) for i in g) for g in groups)

    rng = random.Random(0)
    order = rng.sample(range(len(lengths)), len(lengths))
    size = len(lengths) // len(batches) + 1
    rand = [order[i : i + size] for i in range(0, len(order), size)]
    assert padded(batches) < 0.8 * padded(rand)


def test_sampler_order_is_reproducible_per_epoch():
    lengths = random_lengths()
    kwargs = dict(max_tokens=300, seed=7)
    first, _ = epoch_batches(lengths, 2, epoch=1, **kwargs)
    again, _ = epoch_batches(lengths, 2, epoch=1, **kwargs)
    other, _ = epoch_batches(lengths, 2, epoch=2, **kwargs)
    assert first == again
    assert first != other
    assert sorted(map(sorted, sum(first, []))) != sorted(
        map(sorted, sum(other, []))
    )  # different batch contents, not only a different order


def test_sampler_without_shuffle_is_sorted_and_fixed():
    lengths = random_lengths(100)
    sampler = tat.TokenBatchSampler(lengths, 200, shuffle=False)
    first = list(sampler)
    sampler.set_epoch(5)
    assert list(sampler) == first
    widths = [max(lengths[i]) for b in first for i in b]
    assert widths == sorted(widths)


def test_sampler_rejects_impossible_settings():
    with pytest.raises(ValueError):
        tat.TokenBatchSampler([(3, 3)], max_tokens=10, max_len=20)
    with pytest.raises(ValueError):
        tools.ShardedBatchSampler(tat.TokenBatchSampler([(3, 3)], 10), 2, 2)


@pytest.mark.parametrize("max_len", [None, 0])
def test_sampler_without_max_len_limits_by_the_budget(max_len):
    sampler = tat.TokenBatchSampler([(3, 3), (12, 4)], 10, max_len=max_len)
    assert sampler.max_len == 10 and sampler.kept == [0]
    assert sampler.dropped == [1]


def test_shard_loader_splits_a_loader_among_ranks():
    data = [
        ([tat.BOS] + [7] * n + [tat.EOS], [tat.BOS] + [8] * n)
        for n in range(1, 60)
    ]
    lengths = [(len(s), len(t)) for s, t in data]
    loader = torch.utils.data.DataLoader(
        data,
        batch_sampler=tat.TokenBatchSampler(lengths, 120, seed=3),
        collate_fn=tat.collate_batch,
    )
    loader.batch_sampler.set_epoch(2)
    alone = [src for src, _ in tools.shard_loader(loader, 1, 0)]
    assert [src.tolist() for src in alone] == [s.tolist() for s, _ in loader]
    shards = [tools.shard_loader(loader, 3, r) for r in range(3)]
    rows = [row for d in shards for src, _ in d for row in src]
    sizes = sorted(int((row != tat.PAD).sum()) for row in rows)
    assert sizes == sorted(len(s) for s, _ in data)  # every pair, once
    assert len({len(d) for d in shards}) == 1  # as many steps each


def test_create_dataloaders_on_multi30k(multi30k_dir, monkeypatch):
    monkeypatch.setenv("MULTI30K_DIR", str(multi30k_dir))
    spacy_de, spacy_en = tat.load_tokenizers()
    vocab = tat.Vocab(tat.SPECIALS)  # everything <unk>: fast and enough
    loaders = tat.create_dataloaders(
        vocab, vocab, spacy_de, spacy_en, max_tokens=2000
    )
    for loader, n in zip(loaders, (29000, 1014), strict=True):
        src, tgt = next(iter(loader))
        assert src.shape[0] == tgt.shape[0] and src.dtype == torch.long
        assert (src[:, 0] == tat.BOS).all() and (tgt[:, 0] == tat.BOS).all()
        assert src.numel() <= 2000 and tgt.numel() <= 2000
        assert loader.batch_sampler.dropped == []
        assert len(loader.batch_sampler.kept) == n


def test_a_split_with_no_pair_that_fits_is_an_error(multi30k_dir, monkeypatch):
    """Not an epoch of zero batches that reports a loss of 0."""
    monkeypatch.setenv("MULTI30K_DIR", str(multi30k_dir))
    spacy_de, spacy_en = tat.load_tokenizers()
    vocab = tat.Vocab(tat.SPECIALS)
    with pytest.raises(
        tat.DatasetError,
        match="the train split has no pair of at most 4 tokens .of 20 pairs.",
    ):
        tat.create_dataloaders(
            vocab,
            vocab,
            spacy_de,
            spacy_en,
            max_tokens=4,
            max_len=4,
            max_train_pairs=20,
        )


def test_pairs_left_out_are_a_warning_at_the_callers_line(
    multi30k_dir, monkeypatch
):
    monkeypatch.setenv("MULTI30K_DIR", str(multi30k_dir))
    spacy_de, spacy_en = tat.load_tokenizers()
    vocab = tat.Vocab(tat.SPECIALS)
    with pytest.warns(UserWarning, match=r"train: left out \d+ pairs") as w:
        loader, _ = tat.create_dataloaders(
            vocab, vocab, spacy_de, spacy_en, max_tokens=100, max_len=12
        )
    dropped = len(loader.batch_sampler.dropped)
    assert dropped > 0 and f"left out {dropped} pairs" in str(w[0].message)
    assert w[0].filename == __file__  # this test's line, not the library's


# ------------------------------------------------- bench/batching.py sides
def test_batching_benchmark_feeds_both_sides_the_same_sentences():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "batching.py"
    spec = importlib.util.spec_from_file_location("batching", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    rng = random.Random(4)
    data = [
        (
            [
                tat.BOS,
                *rng.choices(range(4, 50), k=rng.randint(1, 30)),
                tat.EOS,
            ],
            [
                tat.BOS,
                *rng.choices(range(4, 50), k=rng.randint(1, 30)),
                tat.EOS,
            ],
        )
        for _ in range(100)
    ]

    def unpadded(batches):
        return sorted(
            (
                tuple(x for x in s.tolist() if x != tat.PAD),
                tuple(x for x in t.tolist() if x != tat.PAD),
            )
            for src, tgt in batches
            for s, t in zip(src, tgt, strict=True)
        )

    padded = list(bench.padded_batches(data))
    bucketed = list(bench.bucketed_batches(data, 32 * 72, seed=0))
    assert (
        unpadded(padded)
        == unpadded(bucketed)
        == sorted((tuple(s), tuple(t)) for s, t in data)
    )
    assert all(s.size(1) == t.size(1) == 72 for s, t in padded)
    assert all(s.size(0) <= 32 for s, _ in padded)
    real = sum(len(s) + len(t) for s, t in data)
    assert bench.padded_positions(padded) == len(data) * 2 * 72
    assert (
        real
        < bench.padded_positions(bucketed)
        < 0.5 * (bench.padded_positions(padded))
    )
