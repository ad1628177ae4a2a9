"""encode_pairs_cached: Part 3's encode_pairs, kept on disk between runs
under a name that changes with the pairs, the vocabularies and spaCy."""

import os

import pytest

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

PAIRS = [
    ("Ein Mann fährt Fahrrad.", "A man rides a bike."),
    ("Zwei Hunde spielen im Schnee.", "Two dogs play in the snow."),
    ("Ein Kind lacht.", "A child laughs."),
]


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """data/ in tmp_path, and a count of the calls of encode_pairs."""
    monkeypatch.setattr(tools, "data_dir", lambda: tmp_path / "data")
    calls = []

    def encode(*args):
        calls.append(1)
        return tat.encode_pairs(*args)

    monkeypatch.setattr(tools, "encode_pairs", encode)
    return calls


def test_the_second_run_reads_what_the_first_wrote(
    counted, vocabs, tokenizers, tmp_path
):
    expected = tat.encode_pairs(PAIRS, *vocabs, *tokenizers)
    first = tools.encode_pairs_cached(PAIRS, *vocabs, *tokenizers)
    second = tools.encode_pairs_cached(PAIRS, *vocabs, *tokenizers)
    assert first == second == expected
    assert counted == [1]  # the second came from the file
    files = list((tmp_path / "data" / "encoded").iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"


def test_other_pairs_or_another_vocabulary_get_a_file_of_their_own(
    counted, vocabs, tokenizers, tmp_path
):
    tools.encode_pairs_cached(PAIRS, *vocabs, *tokenizers)
    tools.encode_pairs_cached(PAIRS[:2], *vocabs, *tokenizers)
    smaller = tat.Vocab(vocabs[0].get_itos()[:50])
    got = tools.encode_pairs_cached(PAIRS, smaller, vocabs[1], *tokenizers)
    assert got == tat.encode_pairs(PAIRS, smaller, vocabs[1], *tokenizers)
    assert counted == [1, 1, 1]
    assert len(list((tmp_path / "data" / "encoded").iterdir())) == 3


def test_a_damaged_file_is_encoded_again(
    counted, vocabs, tokenizers, tmp_path
):
    tools.encode_pairs_cached(PAIRS, *vocabs, *tokenizers)
    (path,) = (tmp_path / "data" / "encoded").iterdir()
    path.write_text("[[1, 2], [3")  # cut short
    got = tools.encode_pairs_cached(PAIRS, *vocabs, *tokenizers)
    assert got == tat.encode_pairs(PAIRS, *vocabs, *tokenizers)
    assert counted == [1, 1]
    assert tools.encode_pairs_cached(PAIRS, *vocabs, *tokenizers) == got
    assert counted == [1, 1]  # mended on disk


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_folder_that_cannot_be_written_only_costs_the_time(
    counted, vocabs, tokenizers, tmp_path
):
    (tmp_path / "data").mkdir()
    (tmp_path / "data").chmod(0o500)
    got = tools.encode_pairs_cached(PAIRS, *vocabs, *tokenizers)
    assert got == tat.encode_pairs(PAIRS, *vocabs, *tokenizers)


def test_a_file_where_the_folder_should_be_only_costs_the_time(
    counted, vocabs, tokenizers, tmp_path
):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "encoded").write_text("not a folder")
    got = tools.encode_pairs_cached(PAIRS, *vocabs, *tokenizers)
    assert got == tat.encode_pairs(PAIRS, *vocabs, *tokenizers)
    assert counted == [1]


def test_subwords_are_not_kept(counted, tokenizers, tmp_path):
    bpe = tat.train_bpe((s for pair in PAIRS for s in pair), 300)
    got = tools.encode_pairs_cached(PAIRS, bpe, bpe, *tokenizers)
    assert got == tat.encode_pairs(PAIRS, bpe, bpe, *tokenizers)
    assert not (tmp_path / "data" / "encoded").exists()


def test_the_command_line_s_training_encodes_through_the_cache(
    monkeypatch, vocabs, tokenizers
):
    """train_worker hands create_dataloaders the cached encoder."""
    seen = {}

    def stop(*args, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt  # stop before any training

    monkeypatch.setattr(tools, "create_dataloaders", stop)
    config = tools.get_config("ci", max_train_pairs=40)
    with pytest.raises(KeyboardInterrupt):
        tools.train_worker(0, 1, *vocabs, *tokenizers, config)
    assert seen["encode"] is tools.encode_pairs_cached
