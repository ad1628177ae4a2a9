"""bench/distill.py: an ensemble's translations as a student's training set,
and recipe_sweep.py's trials that train on them."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_beyond import train_ci
from test_time_to_bleu import bench_script

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

distill = bench_script("distill")
recipe_sweep = bench_script("recipe_sweep")

pytestmark = pytest.mark.usefixtures("local_multi30k")


@pytest.fixture(scope="module")
def word_run(tmp_path_factory, vocabs, tokenizers):
    """A ci run (2 epochs, 200 pairs) with word vocabularies."""
    return train_ci(tmp_path_factory.mktemp("teacher"), *vocabs, tokenizers)


def beam_translations(run, sentences, tokenizers, beam, alpha):
    """The reference: one model's Part 5 beam search, as `evaluate` runs it."""
    model, vocab_src, vocab_tgt, _ = tools.load_translator(
        run / "final.pt", "cpu", beam, 0, alpha
    )
    decode = lambda m, src, mask, max_len: tat.beam_search(  # noqa: E731
        m, src, mask, max_len, beam_size=beam, alpha=alpha
    )
    return tools.translate_batch(
        model, sentences, tokenizers[0], vocab_src, vocab_tgt, decode_fn=decode
    )


def test_one_teacher_writes_its_beam_search_english(
    word_run, vocabs, tokenizers, tmp_path, monkeypatch
):
    monkeypatch.setattr(distill, "CHUNK", 4)  # 10 sentences: 3 chunks
    monkeypatch.setattr(tools, "load_vocab", lambda *args: vocabs)
    out, mixed = tmp_path / "kd", tmp_path / "kd-mix"
    argv = ["--run", f"{word_run}:0", "--n", "10", "--beam", "3"]
    argv += ["--alpha", "0.6", "--out", str(out), "--mix-out", str(mixed)]
    assert distill.main(argv) == 0

    original = tat.read_multi30k("train")[:10]
    german = [de for de, _ in original]
    english = beam_translations(word_run, german, tokenizers, 3, 0.6)
    assert english != [en for _, en in original]  # a real change
    distilled = list(zip(german, english))
    assert tat.read_multi30k("train", root=out) == distilled
    assert tat.read_multi30k("train", root=mixed) == distilled + original
    for split in ("val", "test"):  # the human references, unchanged
        assert tat.read_multi30k(split, root=out) == tat.read_multi30k(split)
    record = json.loads((out / "distill.json").read_text())
    assert record["pairs"] == 10 and record["runs"] == [f"{word_run}:0"]
    assert record["folder"] == str(out)
    record = json.loads((mixed / "distill.json").read_text())
    assert record["pairs"] == 20 and record["sentences_translated"] == 10


def test_teachers_whose_vocabulary_a_student_lacks_are_refused(
    word_run, vocabs, tmp_path, monkeypatch, capsys
):
    vocab_src, vocab_tgt = vocabs
    shorter = tat.Vocab(vocab_tgt.get_itos()[:-1])
    monkeypatch.setattr(
        tools, "load_vocab", lambda *args: (vocab_src, shorter)
    )
    out = tmp_path / "kd"
    with pytest.raises(SystemExit) as stop:
        distill.main(["--run", f"{word_run}:0", "--n", "2", "--out", str(out)])
    assert "data/vocab.json" in str(stop.value)
    assert len(str(stop.value).splitlines()) == 1
    assert not out.exists()  # nothing written


def test_the_original_data_is_never_written_over(
    word_run, local_multi30k, tmp_path, monkeypatch
):
    source = tmp_path / "multi30k"  # a copy: a failure harms nothing shared
    shutil.copytree(local_multi30k, source)
    monkeypatch.setenv(tat.MULTI30K_ENV, str(source))
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    for option in ("--out", "--mix-out"):
        argv = ["--run", f"{word_run}:0", "--n", "2", option, str(source)]
        with pytest.raises(SystemExit) as stop:
            distill.main(argv)
        assert "holds the original Multi30k" in str(stop.value)
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before


def test_an_earlier_training_set_is_not_written_over(
    word_run, tmp_path, monkeypatch
):
    monkeypatch.setattr(tools, "load_vocab", lambda *args: None)
    out = tmp_path / "kd"
    out.mkdir()
    (out / "train.en.gz").write_bytes(b"hours of work")
    with pytest.raises(SystemExit) as stop:
        distill.main(["--run", f"{word_run}:0", "--n", "2", "--out", str(out)])
    assert "holds a training set already" in str(stop.value)
    assert (out / "train.en.gz").read_bytes() == b"hours of work"


def test_one_folder_for_both_outputs_is_refused(word_run, tmp_path, capsys):
    argv = ["--run", f"{word_run}:0", "--out", str(tmp_path / "a")]
    with pytest.raises(SystemExit):
        distill.parse_args([*argv, "--mix-out", str(tmp_path / "a")])
    assert "another folder than --out" in capsys.readouterr().err


def test_an_out_that_is_a_file_is_one_line(word_run, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    with pytest.raises(SystemExit) as stop:
        distill.parse_args(["--run", f"{word_run}:0", "--mix-out", str(afile)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a folder" in err
    assert afile.read_text() == "keep me"


def fake_trial(calls):
    """subprocess.run for run_trial: records the command, writes JSON."""

    def run(command, **kwargs):
        calls.append(command)
        out = command[command.index("--out") + 1]
        with open(out, "w") as f:
            json.dump({"command": " ".join(command), "points": []}, f)
        return subprocess.CompletedProcess(command, 0, "", "")

    return run


def test_a_trial_with_data_trains_on_that_folder(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(recipe_sweep.subprocess, "run", fake_trial(calls))
    args = recipe_sweep.tools.OneLineParser().parse_args([])
    args.out_dir, args.minutes, args.threads = tmp_path, 1.0, 1
    name = "cpu-d02-lin18-wd02-tie-s1-kd"
    setting = recipe_sweep.SETTINGS[name]
    result, failure = recipe_sweep.run_trial(name, setting, args)
    assert failure == "" and "--data data/distilled-tie4" in result["command"]
    assert calls[0][-2:] == ["--data", "data/distilled-tie4"]
    assert "(data: data/distilled-tie4)" in recipe_sweep.describe(setting)
    plain = recipe_sweep.SETTINGS["cpu-d02-lin18-wd02-tie-s1"]
    recipe_sweep.run_trial("plain", plain, args)
    assert "--data" not in calls[1]


def student_folder(source, folder, n=1000):
    """A Multi30k folder whose English training side is upper-cased."""
    folder.mkdir()
    for split in ("val", "test"):
        for lang in ("de", "en"):
            path = tat.split_file(source, split, lang)
            shutil.copyfile(path, folder / path.name)
    pairs = tat.read_multi30k("train", root=source)[:n]
    distill.write_lines(folder / "train.de.gz", [de for de, _ in pairs])
    distill.write_lines(
        folder / "train.en.gz", [en.upper() for _, en in pairs]
    )
    return folder


@pytest.fixture
def reads(monkeypatch):
    """Every read_multi30k call: (split, the folder it read)."""
    calls, read = [], tat.read_multi30k

    def spy(split, root=None):
        calls.append((split, str(root or tat.multi30k_folder())))
        return read(split, root)

    monkeypatch.setattr(tat, "read_multi30k", spy)
    return calls


def test_train_data_trains_on_the_folder_with_multi30k_vocabularies(
    local_multi30k, tokenizers, tmp_path, monkeypatch, reads, capsys
):
    monkeypatch.setenv(tat.MULTI30K_ENV, local_multi30k)  # restored after
    monkeypatch.setattr(tools, "data_dir", lambda: tmp_path / "data")
    student = student_folder(Path(local_multi30k), tmp_path / "student")
    ck = tmp_path / "ck"
    argv = ["train", "--preset", "ci", "--epochs", "1", "--threads", "1"]
    status = tools.main(
        [*argv, "--checkpoint-dir", str(ck), "--data", str(student)]
    )
    assert status == 0, capsys.readouterr().err
    assert ("train", local_multi30k) in reads  # the vocabularies
    assert ("train", str(student)) in reads and ("val", str(student)) in reads
    assert reads.index(("train", local_multi30k)) < reads.index(
        ("train", str(student))
    )
    _, vocab_src, vocab_tgt, _ = tools.load_translator(ck / "final.pt")
    assert os.environ[tat.MULTI30K_ENV] == local_multi30k  # put back
    original = tools.load_vocab(*tokenizers, path=tmp_path / "v.json")
    assert (vocab_src, vocab_tgt) == original  # not the upper-cased English
    saved = tools.load_checkpoint(ck / "final.pt")["config"]
    digest = tools.pairs_digest(student)
    assert saved["data"] == digest and digest.startswith("sha256:")
    assert digest != tools.pairs_digest(local_multi30k)
    capsys.readouterr()
    resume = [*argv[:4], "2", "--threads", "1", "--checkpoint-dir", str(ck)]
    status = tools.main([*resume, "--resume"])  # on Multi30k's own pairs
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"data {digest!r} there, '' here" in err, err
    assert len(err.strip().splitlines()) == 1
    moved = student.rename(tmp_path / "moved")  # same pairs, elsewhere
    status = tools.main([*resume, "--resume", "--data", str(moved)])
    assert status == 0, capsys.readouterr().err
    assert tools.load_checkpoint(ck / "final.pt")["epoch"] == 1


def test_train_worker_refuses_a_data_digest_it_does_not_read(
    local_multi30k, vocabs, tokenizers, tmp_path, monkeypatch
):
    # A Python caller that sets `data` by hand, without multi30k_from,
    # would train on Multi30k's pairs under another pairs' name.
    monkeypatch.setenv(tat.MULTI30K_ENV, local_multi30k)
    student = student_folder(Path(local_multi30k), tmp_path / "student")
    config = tools.get_config(
        "ci",
        checkpoint_dir=str(tmp_path / "ck"),
        epochs=1,
        max_train_pairs=100,
        data=tools.pairs_digest(student),
    )
    args = (0, 1, *vocabs, *tokenizers, config)
    found = tools.short_digest(tools.pairs_digest(local_multi30k))
    with pytest.raises(ValueError, match=f"are {found}: read the folder"):
        tools.train_worker(*args, show_progress=False, device="cpu")
    assert not (tmp_path / "ck" / "final.pt").exists()
    with tools.multi30k_from(student):  # the pairs it names: trains
        tools.train_worker(*args, show_progress=False, device="cpu")
    assert (tmp_path / "ck" / "final.pt").exists()


def test_multi30k_from_puts_the_folder_back_even_after_an_error(
    monkeypatch,
):
    monkeypatch.setenv(tat.MULTI30K_ENV, "before")
    with pytest.raises(RuntimeError), tools.multi30k_from("student"):
        assert os.environ[tat.MULTI30K_ENV] == "student"
        raise RuntimeError("training failed")
    assert os.environ[tat.MULTI30K_ENV] == "before"
    with tools.multi30k_from(None):  # no --data: nothing changes
        assert os.environ[tat.MULTI30K_ENV] == "before"
    monkeypatch.delenv(tat.MULTI30K_ENV)
    with tools.multi30k_from("student"):
        assert os.environ[tat.MULTI30K_ENV] == "student"
    assert tat.MULTI30K_ENV not in os.environ


@pytest.mark.parametrize(
    "damage, words",
    [
        ("val.en.gz", "val.en.gz has the wrong SHA-256"),  # another set
        ("train.de.gz", "train.de.gz is missing"),
        ("train.en.gz", "train.en.gz is not a file"),  # a folder
        ("test_2016_flickr.de.gz", "test_2016_flickr.de.gz is not a file"),
    ],
)
def test_train_data_refuses_a_folder_without_multi30k_references(
    local_multi30k, tmp_path, monkeypatch, damage, words, capsys
):
    monkeypatch.setenv(tat.MULTI30K_ENV, local_multi30k)
    student = student_folder(Path(local_multi30k), tmp_path / "student", 10)
    if damage == "val.en.gz":
        distill.write_lines(student / damage, ["A dog."])
    elif damage == "train.de.gz":
        (student / damage).unlink()
    else:  # a folder where the file should be
        (student / damage).unlink()
        (student / damage).mkdir()
    ck = tmp_path / "ck"
    argv = ["train", "--preset", "ci", "--checkpoint-dir", str(ck)]
    status = tools.main([*argv, "--data", str(student)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "--data" in err and words in err, err
    assert len(err.splitlines()) == 1 and not ck.exists()


def gzip_bytes(data):
    import gzip

    return gzip.compress(data)


@pytest.mark.parametrize(
    "damage, words",
    [
        ({"train.en.gz": gzip_bytes(b"A dog.\n")}, "has 10 lines but"),
        ({"train.de.gz": gzip_bytes(b"\xff\xfe\n" * 10)}, "is not UTF-8"),
        ({"train.de.gz": b"plain, not gzip\n"}, "cannot read"),
        ({"train.en.gz": gzip_bytes(b"A dog.\n" * 10)[:-9]}, "cannot read"),
        (
            {"train.de.gz": gzip_bytes(b""), "train.en.gz": gzip_bytes(b"")},
            "train.de.gz is empty",
        ),
        (
            {
                "train.de.gz": gzip_bytes(b"\n" * 10),
                "train.en.gz": gzip_bytes(b"A dog.\n" * 9 + b"  \n"),
            },
            "no training pair has text on both sides",
        ),
    ],
    ids=[
        "line counts",
        "not UTF-8",
        "not gzip",
        "cut short",
        "empty",
        "blank",
    ],
)
def test_train_data_refuses_training_files_it_cannot_train_on(
    local_multi30k, tmp_path, monkeypatch, damage, words, capsys
):
    """One line, status 2, nothing written: not a traceback in training,
    nor a run that trains on nothing and succeeds."""
    monkeypatch.setenv(tat.MULTI30K_ENV, local_multi30k)
    student = student_folder(Path(local_multi30k), tmp_path / "student", 10)
    for name, data in damage.items():
        (student / name).write_bytes(data)
    ck = tmp_path / "ck"
    argv = ["train", "--preset", "ci", "--checkpoint-dir", str(ck)]
    status = tools.main([*argv, "--data", str(student)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and f"--data {student}:" in err and words in err, err
    assert len(err.splitlines()) == 1 and not ck.exists()


def test_train_data_naming_a_file_says_so(tmp_path, capsys):
    a_file = tmp_path / "pairs.gz"
    a_file.write_bytes(b"")
    argv = ["train", "--preset", "ci", "--checkpoint-dir", str(tmp_path)]
    status = tools.main([*argv + ["--data", str(a_file)]])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.endswith("pairs.gz: a file, not a folder")


def test_time_to_bleu_data_trains_on_the_folder_and_records_it(
    local_multi30k, tmp_path, monkeypatch, reads
):
    monkeypatch.setenv(tat.MULTI30K_ENV, local_multi30k)
    monkeypatch.setattr(tools, "data_dir", lambda: tmp_path / "data")
    student = student_folder(Path(local_multi30k), tmp_path / "student", 200)
    argv = ["--preset", "ci", "--epochs", "1", "--val-pairs", "10"]
    argv += ["--threads", "1", "--data", str(student)]
    argv += ["--out", str(tmp_path / "run.json")]
    result = bench_script("time_to_bleu").main(
        [*argv, "--checkpoint-dir", str(tmp_path / "ck")]
    )
    assert result["data"] == str(student)
    assert result["config"]["data"] == tools.pairs_digest(student)
    saved = tools.load_checkpoint(tmp_path / "ck" / "final.pt")["config"]
    assert saved["data"] == tools.pairs_digest(student)
    assert ("train", str(student)) in reads
    assert ("train", local_multi30k) in reads  # the vocabularies
    assert os.environ[tat.MULTI30K_ENV] == local_multi30k  # put back
