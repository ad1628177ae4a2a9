"""Tests of the command line: translate, evaluate, and every bad input."""

import argparse
import copy
import errno
import gzip
import hashlib
import io
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

SCRIPT = Path(tools.__file__).resolve()
ROOT = Path(__file__).resolve().parent.parent

# A model that learns these five pairs by heart in a second gives each
# sentence its own translation, so a test can tell the lines apart.
PAIRS = [
    ("Ein Mann fährt mit dem Fahrrad.", "A man rides a bicycle."),
    ("Zwei Kinder spielen im Schnee.", "Two children play in the snow."),
    ("Eine Frau liest ein Buch.", "A woman reads a book."),
    ("Ein Hund rennt über die Wiese.", "A dog runs across the meadow."),
    ("Drei Männer sitzen an einem Tisch.", "Three men sit at a table."),
]
GERMAN = [de for de, _ in PAIRS]


class Bar(list):
    """What a recording tqdm returns: the items, and whether closed."""

    closed = False

    def close(self):
        self.closed = True


def save_tiny(path, model, config, vocab_src, vocab_tgt, **changes):
    """A checkpoint in the layout train_worker writes, with `changes`."""
    fields = {"model": model.state_dict(), "config": asdict(config)}
    fields |= {"vocab_src": vocab_src.get_itos(), "history": []}
    fields |= {"vocab_tgt": vocab_tgt.get_itos(), **changes}
    tools.save_checkpoint(path, **fields)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizers):
    """(checkpoint path, model, vocab_src, vocab_tgt): PAIRS learned."""
    spacy_de, spacy_en = tokenizers
    vocab_src = tat.Vocab.build((tat.tokenize(s, spacy_de) for s in GERMAN), 1)
    vocab_tgt = tat.Vocab.build(
        (tat.tokenize(en, spacy_en) for _, en in PAIRS), 1
    )
    config = tools.get_config("ci", N=1, d_model=32, d_ff=64, h=2, dropout=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on a shared machine
    torch.manual_seed(0)
    model = tat.model_from_config(config, len(vocab_src), len(vocab_tgt))
    encoded = tat.encode_pairs(PAIRS, vocab_src, vocab_tgt, *tokenizers)
    batch = tat.Batch(*tat.collate_batch(encoded), tat.PAD)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        logp = model.generator(out).flatten(0, 1)  # (B * T, V)
        loss = F.nll_loss(logp, batch.tgt_y.flatten(), ignore_index=tat.PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    model.eval()
    path = tmp_path_factory.mktemp("tiny") / "final.pt"
    save_tiny(path, model, config, vocab_src, vocab_tgt)
    return path, model, vocab_src, vocab_tgt


def reference(tiny, tokenizers, sentences, **options):
    """The library's translations of `sentences`, in this process."""
    _, model, vocab_src, vocab_tgt = tiny
    return tools.translate_batch(
        model, sentences, tokenizers[0], vocab_src, vocab_tgt, **options
    )


def run_script(*argv, cwd, stdin=b"", env=None, script=SCRIPT):
    """Run the real program in a new process: (status, stdout, stderr)."""
    done = subprocess.run(
        [sys.executable, str(script), *map(str, argv)],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def run_cli(capsys, *argv):
    """Run main() in this process: (status, stdout, stderr)."""
    status = tools.main(list(map(str, argv)))
    out = capsys.readouterr()
    return status, out.out, out.err


# --- translating: one line per sentence, from arguments, stdin or files --


def test_each_argument_is_one_sentence(tiny, tokenizers, tmp_path):
    sentences = [GERMAN[1], GERMAN[0], GERMAN[3]]
    status, out, err = run_script(
        "translate", "--checkpoint", tiny[0], *sentences, cwd=tmp_path
    )
    expected = reference(tiny, tokenizers, sentences)
    assert len(set(expected)) == 3, "the model must tell them apart"
    assert status == 0 and out == "".join(e + "\n" for e in expected), err


def test_stdin_and_a_gz_file_give_the_lines_arguments_give(
    tiny, tokenizers, tmp_path
):
    lines = [GERMAN[2], "", GERMAN[0], "   ", GERMAN[4]]
    texts = [s for s in lines if s.strip()]
    hyps = iter(reference(tiny, tokenizers, texts))
    # An empty or blank line gets an empty line back: line n stays line n.
    expected = "".join((next(hyps) if s.strip() else "") + "\n" for s in lines)
    data = "".join(s + "\n" for s in lines).encode()
    status, out, err = run_script(
        "translate", "--checkpoint", tiny[0], "-", cwd=tmp_path, stdin=data
    )
    assert status == 0 and out == expected, err
    with gzip.open(tmp_path / "de.txt.gz", "wb") as f:
        f.write(data.replace(b"\n", b"\r\n"))  # Windows line ends, too
    status, out, err = run_script(
        "translate", "--checkpoint", tiny[0], "--input", "de.txt.gz",
        cwd=tmp_path,
    )  # fmt: skip
    assert status == 0 and out == expected, err


class FakeStdin:
    """Standard input that is a pipe, not a terminal."""

    def __init__(self, data):
        self.buffer = io.BytesIO(data)

    def isatty(self):
        return False


def test_stdin_is_decoded_in_chunks_never_one_line_at_a_time(
    tiny, tokenizers, capsys, monkeypatch
):
    lines = [GERMAN[i % 5] for i in range(11)]
    data = "".join(s + "\n" for s in lines).encode()
    monkeypatch.setattr(sys, "stdin", FakeStdin(data))
    calls, translate_batch = [], tools.translate_batch

    def counting(model, sentences, *args, **kwargs):
        calls.append(len(sentences))
        return translate_batch(model, sentences, *args, **kwargs)

    monkeypatch.setattr(tools, "translate_batch", counting)
    args = ["translate", "--checkpoint", tiny[0], "--batch-size", "1"]
    status, out, err = run_cli(capsys, *args)
    # --batch-size 1 reads 8 lines at a time: two calls for 11 lines.
    assert status == 0 and calls == [8, 3], err
    monkeypatch.undo()
    assert out.splitlines() == reference(tiny, tokenizers, lines)


def test_cli_translate(tiny, tokenizers, capsys):
    ckpt = tiny[0]
    sentence = GERMAN[0]
    status, out, err = run_cli(
        capsys, "translate", "--checkpoint", ckpt, sentence
    )
    # The reference: the tutorial's one-sentence greedy_decode, by hand.
    model, vocab_src, vocab_tgt, _ = tools.load_trained_model(ckpt, "cpu")
    ids = [tat.BOS, *tat.encode_text(sentence, tokenizers[0], vocab_src)]
    src = torch.tensor([ids + [tat.EOS]])  # (1, S)
    src_mask = torch.ones(1, 1, src.size(1), dtype=torch.bool)
    with torch.no_grad():
        ys = tat.greedy_decode(model, src, src_mask, src.size(1) + 50, tat.BOS)
    expected = tools.decode_text(tat.strip_specials(ys[0].tolist()), vocab_tgt)
    assert status == 0 and expected and out == expected + "\n"
    status, out, err = run_cli(
        capsys, "translate", "--checkpoint", ckpt, "Ein Quuxblorf."
    )
    assert status == 0 and "Quuxblorf" in err and len(out.splitlines()) == 1


def test_cli_evaluate_files(tiny, tmp_path, capsys):
    ckpt = tiny[0]
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("".join(de + "\n" for de, _ in PAIRS))
    ref.write_text("".join(en + "\n" for _, en in PAIRS[::-1]))
    out = tmp_path / "hyp.en"
    args = ["evaluate", "--checkpoint", ckpt, "--src", src, "--ref", ref]
    status, stdout, err = run_cli(capsys, *args, "--out", out)
    hyps = out.read_text().splitlines()
    assert status == 0 and len(hyps) == len(PAIRS)
    assert err.splitlines()[0] == f"scoring {ckpt} (greedy) on {src}: 5 lines"
    # The printed score is sacreBLEU's on the written hypotheses.
    import sacrebleu

    refs = [en for _, en in PAIRS[::-1]]
    expected = sacrebleu.corpus_bleu(hyps, [refs]).score
    assert stdout.startswith(f"BLEU = {expected:.2f} ")
    # Scored against themselves, the hypotheses get 100.
    args = ["evaluate", "--checkpoint", ckpt, "--src", src, "--ref", out]
    status, stdout, _ = run_cli(capsys, *args)
    assert status == 0 and stdout.startswith("BLEU = 100.00 ")
    ref.write_text("".join(en + "\n" for _, en in PAIRS[:2]))
    args = ["evaluate", "--checkpoint", ckpt, "--src", src, "--ref", ref]
    status, _, err = run_cli(capsys, *args)
    assert status == 2 and "5 lines" in err and "has 2" in err


def test_evaluate_answers_an_empty_line_with_an_empty_line(
    tiny, tokenizers, tmp_path, capsys
):
    """As `translate` does: a blank source line is not sent to the model,
    which would make up a sentence for it."""
    sources = [GERMAN[0], "", GERMAN[1], "   "]
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("".join(s + "\n" for s in sources))
    ref.write_text("a\n\nb\n\n")
    out = tmp_path / "hyp.en"
    args = ["evaluate", "--checkpoint", tiny[0], "--src", src, "--ref", ref]
    status, _, _ = run_cli(capsys, *args, "--out", out)
    words = reference(tiny, tokenizers, [GERMAN[0], GERMAN[1]])
    assert status == 0
    assert out.read_text().split("\n") == [words[0], "", words[1], "", ""]


def test_evaluate_shows_a_bar_that_changes_nothing(
    tiny, tmp_path, capsys, monkeypatch
):
    """A quick-sized model took 42 s on test2016 with nothing printed."""
    import tqdm.auto

    ckpt = tiny[0]
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("".join(de + "\n" for de, _ in PAIRS))
    ref.write_text("".join(en + "\n" for _, en in PAIRS))
    bars = []

    def recording_tqdm(iterable, desc, **options):
        bars.append((desc, options, len(iterable)))
        return Bar(iterable)

    monkeypatch.setattr(tqdm.auto, "tqdm", recording_tqdm)
    outs = []
    for batch_size in (2, 128):
        out = tmp_path / f"hyp{batch_size}.en"
        status, _, _ = run_cli(
            capsys, "evaluate", "--checkpoint", ckpt, "--src", src,
            "--ref", ref, "--out", out, "--batch-size", batch_size,
        )  # fmt: skip
        assert status == 0
        outs.append(out.read_text())
    assert [(d, n) for d, _, n in bars] == [("decoding", 3), ("decoding", 1)]
    assert all(options["delay"] > 0 for _, options, _ in bars)
    assert outs[0] == outs[1]  # batched as before


def test_what_ctrl_c_in_train_says_it_left(tmp_path):
    assert tools.interrupted_message(tmp_path) == "interrupted"
    (tmp_path / "last.pt").touch()
    assert "last.pt holds the last epoch saved: train with --resume" in (
        tools.interrupted_message(tmp_path)
    )
    (tmp_path / "final.pt").touch()  # written after: training had ended
    os.utime(tmp_path / "last.pt", (1, 1))
    assert tools.interrupted_message(tmp_path) == (
        f"interrupted; {tmp_path / 'final.pt'} holds the trained model"
    )
    # a new run stopped before its first epoch ended left an earlier
    # run's files: its final.pt is not this run's trained model
    later = (tmp_path / "final.pt").stat().st_mtime + 60
    assert tools.interrupted_message(tmp_path, started=later) == (
        "interrupted before this run saved an epoch; the files in"
        f" {tmp_path} are as they were"
    )
    # a resumed run's files are its own: the --resume hint stays
    os.utime(tmp_path / "final.pt", (1, 1))
    os.utime(tmp_path / "last.pt", (2, 2))
    resumed = tools.interrupted_message(tmp_path, later, resumed=True)
    assert "holds the last epoch saved: train with --resume" in resumed


def test_long_messages_are_cut_at_a_word():
    """A damaged zip's message was cut mid-word ("... Thi")."""
    text = "This is an internal miniz error. " * 10
    cut = tools.shortened(text)
    assert len(cut) <= 204 and cut.endswith(" ...")
    assert text.startswith(cut.removesuffix(" ..."))
    assert cut.removesuffix(" ...").split()[-1] in text.split()
    assert tools.shortened("short") == "short"


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"h": 0}, "h=0 is not a whole number above 0"),
        ({"d_model": -4}, "d_model=-4 is not a whole number above 0"),
        ({"N": "two"}, "N='two' is not a whole number above 0"),
        ({"h": 3}, "d_model=32 is not divisible by h=3"),
        ({"dropout": 1.5}, "dropout=1.5 is not in [0, 1)"),
    ],
)
def test_a_checkpoint_with_damaged_sizes_is_one_line(
    change, problem, tiny, tmp_path, capsys
):
    """h=0 ended in a ZeroDivisionError's traceback, d_model=-4 in a
    RuntimeError's."""
    path, model, vocab_src, vocab_tgt = tiny
    config = replace(tools.checkpoint_config(torch.load(path)), **change)
    damaged = save_tiny(
        tmp_path / "damaged.pt", model, config, vocab_src, vocab_tgt
    )
    status, out, err = run_cli(
        capsys, "translate", "--checkpoint", damaged, GERMAN[0]
    )
    assert status == 2 and out == ""
    assert err == (
        f"error: {damaged} does not match this code's Multi30k model: "
        f"{problem}\n"
    )


def test_a_checkpoint_whose_training_blew_up_is_refused(
    tiny, tmp_path, capsys
):
    """Weights holding nan (a float16 run gone wrong, say) translated into
    a line of `<s>` without a word; now one line says why."""
    path, model, vocab_src, vocab_tgt = tiny
    config = tools.checkpoint_config(torch.load(path))
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.generator.proj.weight[3, 5] = float("nan")
    blown = save_tiny(
        tmp_path / "nan.pt", broken, config, vocab_src, vocab_tgt
    )
    status, out, err = run_cli(
        capsys, "translate", "--checkpoint", blown, GERMAN[0]
    )
    assert status == 2 and out == ""
    assert err.splitlines() == [
        f"error: {blown}: its weight generator.proj.weight holds nan or inf,"
        " so its training went wrong; train it again (in float32, if it"
        " trained in float16: docs/gpu.md)"
    ]


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_an_output_may_not_replace_multi30k_or_a_checkpoint(
    command, tiny, tmp_path, capsys, multi30k_dir, monkeypatch
):
    """train's --results or evaluate's --out over a Multi30k file (the
    test references, read by default, or the training data) or over
    another run's model: refused before any work, and nothing changes.
    (--results over the references once trained, then wrote JSON there.)"""
    copy = tmp_path / "multi30k"
    shutil.copytree(multi30k_dir, copy)
    monkeypatch.setenv("MULTI30K_DIR", str(copy))
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    model = tmp_path / "model.pt"
    shutil.copy(tiny[0], model)
    ck = tmp_path / "ck"
    for output, message in (
        (copy / "test_2016_flickr.en.gz", "is also an input"),
        (copy / "train.de.gz", "is also an input"),
        (model, "is a checkpoint, which it would overwrite"),
    ):
        if command == "train":
            argv = ["train", "--preset", "ci", "--checkpoint-dir", ck]
            argv += ["--results", output]
        else:
            argv = ["evaluate", "--checkpoint", tiny[0], "--out", output]
        status, stdout, err = run_cli(capsys, *argv)
        assert status == 2 and stdout == ""
        assert message in err and len(err.splitlines()) == 1
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
    assert model.read_bytes() == Path(tiny[0]).read_bytes()
    assert not ck.exists()


def test_train_interrupted_says_how_to_go_on(
    tmp_path, capsys, multi30k_dir, monkeypatch
):
    """Ctrl-C after a saved epoch: one line, after the bar, that says
    where the run stands; the bar is closed first."""
    import tqdm.auto

    monkeypatch.setenv("MULTI30K_DIR", str(multi30k_dir))
    bars = []
    monkeypatch.setattr(
        tqdm.auto, "tqdm", lambda it, *a, **k: bars.append(Bar(it)) or bars[-1]
    )
    real_pass = tools.train_pass

    def stopped_in_the_second(run, *args, **kwargs):
        if len(bars) == 2:
            raise KeyboardInterrupt
        return real_pass(run, *args, **kwargs)

    monkeypatch.setattr(tools, "train_pass", stopped_in_the_second)
    ck = tmp_path / "ck"
    status, _, err = run_cli(
        capsys, "train", "--preset", "ci", "--checkpoint-dir", ck
    )
    assert status == 130
    assert err.splitlines()[-1] == (
        f"interrupted; {ck / 'last.pt'} holds the last epoch saved: train"
        " with --resume to go on from it"
    )
    assert len(bars) == 2 and all(bar.closed for bar in bars)


@pytest.mark.parametrize("command", ["train", "evaluate", "translate"])
def test_cli_help(command, capsys):
    status = tools.main([command, "--help"])
    assert status == 0
    assert capsys.readouterr().out.startswith("usage:")


def pyproject_version():
    """pyproject.toml's version, read with a TOML parser."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["project"]["version"]


@pytest.mark.parametrize("installed", [True, False])
def test_cli_version_names_the_package_and_torch(
    installed, capsys, monkeypatch
):
    """--version: the installed version, else the checkout's pyproject's."""
    import importlib.metadata

    # An installed package's metadata wins over the checkout's file.
    expected = "9.9.9" if installed else pyproject_version()
    real = importlib.metadata.version

    def version(name):
        if name != "the-annotated-transformer":
            return real(name)
        if installed:
            return "9.9.9"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    status = tools.main(["--version"])
    assert status == 0
    out = capsys.readouterr().out.strip()
    assert out.endswith(f" {expected}, torch {torch.__version__}"), out


def test_cli_defaults_fit_together(tmp_path, monkeypatch):
    # With no options, evaluate and translate read the checkpoint that
    # train writes with no options; once `make train` has written the
    # longer `cpu` run, they prefer that one.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tat, "MODULE_DIR", None)  # not this repository
    parser = tools.build_parser()
    preset = parser.parse_args(["train"]).preset
    assert preset == "quick"
    written = Path(tools.get_config(preset).checkpoint_dir) / "final.pt"
    for argv in (["evaluate"], ["translate", "Hallo"]):
        args = parser.parse_args(argv)
        assert args.checkpoint is None, argv  # main() fills it in
        assert args.beam == 1 and args.average is None  # plain greedy
    assert Path(tools.default_checkpoint()) == written  # named in the error
    written.parent.mkdir(parents=True)
    written.touch()
    assert Path(tools.default_checkpoint()) == written
    longer = Path(tools.get_config("cpu").checkpoint_dir) / "final.pt"
    longer.parent.mkdir(parents=True)
    longer.touch()
    assert Path(tools.default_checkpoint()) == longer


def test_translate_without_a_model_names_the_quick_one(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tat, "MODULE_DIR", None)  # not this repository
    status = tools.main(["translate", "Hallo"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert "checkpoints/quick/final.pt" in err


# --- bad input: one line on stderr, exit status 2, no traceback ---------


class RunsCode:
    """Unpickled, this creates a file: what a hostile checkpoint can do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny, vocabs):
    """A folder of files that the command line must refuse."""
    folder = tmp_path_factory.mktemp("bad")
    (folder / "latin1.de").write_bytes("Schöne Grüße.\n".encode("latin-1"))
    (folder / "three.de").write_text("Ein Hund.\nEine Katze.\nHallo.\n")
    (folder / "two.en").write_text("A dog.\nA cat.\n")
    (folder / "three.en").write_text("A dog.\nA cat.\nHello.\n")
    (folder / "empty.pt").write_bytes(b"")
    (folder / "empty.de").write_text("")
    (folder / "empty.en").write_text("")
    rng = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (4096,), generator=rng, dtype=torch.uint8)
    (folder / "random.pt").write_bytes(bytes(noise.tolist()))
    torch.save({"model": RunsCode(folder / "ran.zip")}, folder / "code.pt")
    with open(folder / "code.pkl", "wb") as f:  # the old, bare pickle
        pickle.dump({"model": RunsCode(folder / "ran.pkl")}, f, protocol=4)
    _, model, vocab_src, vocab_tgt = tiny
    config = tools.load_trained_model(tiny[0])[3]
    bigger = tat.Vocab([*vocab_tgt.get_itos(), "zebra", "giraffe"])
    save_tiny(folder / "other.pt", model, config, vocab_src, bigger)
    # A training state of another (tiny) model, and lean epoch files only.
    resume = {"optimizer": {}, "scheduler": {}, "epoch": 0}
    other = (model, config, vocab_src, vocab_tgt)
    save_tiny(folder / "resume_other/last.pt", *other, **resume)
    save_tiny(folder / "resume_lean/epoch_000.pt", *other)
    # The ci model's training state, trained with another dropout.
    ci = tools.get_config("ci")
    same_shape = tat.model_from_config(ci, *map(len, vocabs))
    settings = (same_shape, replace(ci, dropout=0.3), *vocabs)
    save_tiny(folder / "resume_settings/last.pt", *settings, **resume)
    os.mkfifo(folder / "pipe.pt")  # reading it would wait for a writer
    (folder / "dangling.pt").symlink_to(folder / "gone.pt")
    return folder


BAD_INPUTS = {  # name: (argv, a part of the message, extra environment)
    "empty sentence": (
        ["translate", "--checkpoint", "{ckpt}", ""],
        "sentence 1 is empty",
    ),
    "blank sentence": (
        ["translate", "--checkpoint", "{ckpt}", "Ein Hund.", " \t "],
        "sentence 2 is empty",
    ),
    "file not UTF-8": (
        ["translate", "--checkpoint", "{ckpt}", "--input", "latin1.de"],
        "latin1.de is not UTF-8 text (line 1)",
    ),
    "sources not UTF-8": (
        ["evaluate", "--src", "latin1.de", "--ref", "two.en"],
        "not UTF-8",
    ),
    "unequal files": (
        ["evaluate", "--checkpoint", "{ckpt}", "--src", "three.de"]
        + ["--ref", "two.en"],
        "three.de has 3 lines but two.en has 2",
    ),
    "empty files": (
        ["evaluate", "--src", "empty.de", "--ref", "empty.en"],
        "empty.de is empty",
    ),
    "empty input": (["translate", "--input", "empty.de"], "is empty"),
    "missing checkpoint": (["translate", "Hallo"], "no checkpoint"),
    "random bytes": (
        ["translate", "--checkpoint", "random.pt", "Ja"],
        "random.pt is not a checkpoint: torch.save writes a zip archive",
    ),
    "zero-byte checkpoint": (
        ["translate", "--checkpoint", "empty.pt", "Ja"],
        "empty.pt is empty (0 bytes)",
    ),
    "pickle with code": (
        ["translate", "--checkpoint", "code.pt", "Ja"],
        "holds more than tensors, so it is not loaded, for safety",
    ),
    "plain pickle with code": (  # pickle.dump's, not torch.save's
        ["translate", "--checkpoint", "code.pkl", "Ja"],
        "code.pkl is not a readable checkpoint (damaged, or not written by",
    ),
    "another vocabulary": (  # one short line, not a state-dict diff
        ["translate", "--checkpoint", "other.pt", "Ja"],
        "other.pt does not match this code's Multi30k model: "
        "tgt_embed.0.lut.weight is",
    ),
    "beam wider than vocabulary": (
        ["translate", "--checkpoint", "{ckpt}", "--beam", "999", "Ja"],
        "--beam 999 is wider than the",
    ),
    "no such GPU": (["translate", "--device", "cuda:99", "Ja"], "cuda:99"),
    "--beam 0": (["translate", "--beam", "0", "Ja"], "--beam"),
    "--average -1": (["evaluate", "--average", "-1"], "--average"),
    "--batch-size 0": (["translate", "--batch-size", "0", "Ja"], "--batch"),
    "--threads -4": (["train", "--threads", "-4"], "--threads"),
    "--epochs 0": (["train", "--epochs", "0"], "--epochs"),
    "--max-tokens -1": (["train", "--max-tokens", "-1"], "--max-tokens"),
    "--world-size 0": (["train", "--world-size", "0"], "--world-size"),
    "unknown preset": (["train", "--preset", "huge"], "'huge'"),
    "--out is the sources": (
        ["evaluate", "--checkpoint", "{ckpt}", "--src", "three.de"]
        + ["--ref", "three.en", "--out", "three.de"],
        "three.de is also an input",
    ),
    "--out is the references": (
        ["evaluate", "--checkpoint", "{ckpt}", "--src", "three.de"]
        + ["--ref", "three.en", "--out", "./three.en"],
        "three.en is also an input",
    ),
    "--out checked before anything": (
        ["evaluate", "--checkpoint", "nowhere.pt", "--src", "three.de"]
        + ["--ref", "three.en", "--out", "no/such/hyp.en"],
        "there is no folder",
    ),
    "input is /dev/null": (
        ["translate", "--checkpoint", "{ckpt}", "--input", "/dev/null"],
        "/dev/null is empty",
    ),
    "input is a folder": (
        ["translate", "--checkpoint", "{ckpt}", "--input", "."],
        "is a folder",
    ),
    "huge --batch-size": (
        ["translate", "--checkpoint", "{ckpt}"]
        + ["--batch-size", "10000000000000000000", "Ja"],
        "--batch-size",
    ),
    "huge --beam": (["translate", "--beam", "1000000000", "Ja"], "--beam"),
    "huge --average": (
        ["evaluate", "--average", "99999999"],
        "argument --average: expected a whole number from 1 to 10,000",
    ),
    "huge --epochs": (
        ["train", "--epochs", "99999999999"],
        "--epochs",
        {"MULTI30K_DIR": "nowhere"},
    ),
    "huge --max-tokens": (
        ["train", "--max-tokens", "1" + "0" * 30],
        "--max-tokens",
        {"MULTI30K_DIR": "nowhere"},
    ),
    "huge --keep-last": (
        ["train", "--keep-last", "12345678901"],
        "--keep-last",
        {"MULTI30K_DIR": "nowhere"},
    ),
    "huge --world-size": (
        ["train", "--world-size", "100000"],
        "--world-size",
        {"MULTI30K_DIR": "nowhere"},
    ),
    "huge --threads": (
        ["train", "--threads", "100000"],
        "--threads",
        {"MULTI30K_DIR": "nowhere"},
    ),
    "resume from another model": (
        ["train", "--preset", "ci", "--checkpoint-dir", "resume_other"]
        + ["--resume"],
        "cannot resume from resume_other/last.pt, another model: ",
        {"MULTI30K_DIR": "{multi30k}"},
    ),
    "resume with other settings": (
        ["train", "--preset", "ci", "--checkpoint-dir", "resume_settings"]
        + ["--resume"],
        "cannot resume from resume_settings/last.pt with other training"
        " settings: dropout 0.3 there, 0.0 here; train with the same ones",
        {"MULTI30K_DIR": "{multi30k}"},
    ),
    "resume with nothing resumable": (
        ["train", "--preset", "ci", "--checkpoint-dir", "resume_lean"]
        + ["--resume"],
        "nothing to resume in resume_lean",
        {"MULTI30K_DIR": "{multi30k}"},
    ),
    "a folder as --checkpoint": (
        ["evaluate", "--checkpoint", "resume_lean", "--src", "three.de"]
        + ["--ref", "three.en"],
        "resume_lean is a folder; give a checkpoint file such as"
        " resume_lean/final.pt",
    ),
    "--results in a missing folder": (
        ["train", "--preset", "ci", "--checkpoint-dir", "never_made"]
        + ["--results", "no/such/results.json"],
        "--results {folder}/no/such/results.json: there is no folder",
        {"MULTI30K_DIR": "{multi30k}"},
    ),
    "--out -": (
        ["evaluate", "--checkpoint", "{ckpt}", "--src", "three.de"]
        + ["--ref", "three.en", "--out", "-"],
        "--out - : name a file; the score goes to stdout",
    ),
    "--src - and --ref -": (
        ["evaluate", "--checkpoint", "{ckpt}", "--src", "-", "--ref", "-"],
        "--src and --ref cannot both read standard input",
    ),
    "a pipe as --checkpoint": (
        ["translate", "--checkpoint", "pipe.pt", "Hallo"],
        "pipe.pt is not a file, so not a checkpoint",
    ),
    "a link to nothing as --checkpoint": (
        ["translate", "--checkpoint", "dangling.pt", "Hallo"],
        "dangling.pt is a link to nothing",
    ),
    "--threads with --world-size": (
        ["train", "--world-size", "2", "--threads", "1"],
        "--threads sets the threads of a one-process run",
        {"MULTI30K_DIR": "nowhere"},
    ),
    "relative MULTI30K_DIR": (
        ["download"],
        "{folder}/no/multi30k",
        {"MULTI30K_DIR": "no/multi30k"},
    ),
}


def test_results_dash_is_refused_before_the_download(
    tmp_path, monkeypatch, capsys
):
    """`--results -` was refused only after Multi30k's download."""
    downloads = []
    monkeypatch.setattr(
        tools, "download_multi30k", lambda: downloads.append(1) or tmp_path
    )
    folder = ["--checkpoint-dir", str(tmp_path / "ck")]
    argv = ["train", "--preset", "ci", *folder, "--results", "-"]
    assert tools.main(argv) == 2
    assert capsys.readouterr().err == "error: --results - : name a file\n"
    assert downloads == [] and not (tmp_path / "ck").exists()


def test_train_without_the_data_leaves_no_checkpoint_folder(tmp_path):
    """The folder and its lock file used to be made before the data check."""
    status, _, err = run_script(
        "train",
        "--preset",
        "ci",
        "--checkpoint-dir",
        "ck",
        cwd=tmp_path,
        env={"MULTI30K_DIR": str(tmp_path / "nowhere")},
    )
    assert status == 2 and "nowhere" in err, err
    assert not (tmp_path / "ck").exists()


@pytest.fixture(scope="module")
def installed_copy(tmp_path_factory):
    """The program's two files in a folder of their own, as pip installs
    them: a checkpoint in this checkout (`make notebook`'s) is not found."""
    folder = tmp_path_factory.mktemp("installed")
    for name in ("the_annotated_transformer.py", SCRIPT.name):
        shutil.copy(ROOT / name, folder)
    return folder / SCRIPT.name


@pytest.mark.parametrize("case", BAD_INPUTS, ids=str)
def test_bad_input_gets_one_line_and_status_2(
    case, bad_files, tiny, multi30k_dir, installed_copy
):
    argv, message, *env = BAD_INPUTS[case]
    names = {"ckpt": tiny[0], "folder": bad_files, "multi30k": multi30k_dir}
    argv = [arg.format(**names) for arg in argv]
    env = {k: v.format(**names) for k, v in (env or [{}])[0].items()}
    script = installed_copy if case == "missing checkpoint" else SCRIPT
    status, out, err = run_script(*argv, cwd=bad_files, env=env, script=script)
    assert status == 2, (status, err)
    assert len(err.splitlines()) == 1 and err.strip(), err
    assert len(err) < 300, "a short line: " + err[:300]
    assert "Traceback" not in err and "weights_only" not in err
    assert message.format(**names) in err, err
    assert not (bad_files / "ran.zip").exists()  # the pickles' code
    assert not (bad_files / "ran.pkl").exists()  # never ran


def test_the_hostile_pickles_do_run_code_when_loaded_unsafely(tmp_path):
    """The files above are real threats: an unsafe load runs them."""
    torch.save({"model": RunsCode(tmp_path / "ran.zip")}, tmp_path / "a.pt")
    torch.load(tmp_path / "a.pt", weights_only=False)
    pickle.loads(pickle.dumps(RunsCode(tmp_path / "ran.pkl"), protocol=4))
    assert (tmp_path / "ran.zip").exists() and (tmp_path / "ran.pkl").exists()


@pytest.mark.parametrize(
    "option", ["--beam", "--average", "--batch-size", "--device"]
)
@pytest.mark.parametrize("value", ["0", "-3", "2.5", "many"])
def test_decoding_options_refuse_bad_values(option, value, capsys):
    status = tools.main(["translate", option, value, "Hallo"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.splitlines()) == 1
    assert option in err and "(see --help)" in err


@pytest.mark.parametrize(
    "option", ["--epochs", "--max-tokens", "--threads", "--world-size"]
)
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_train_options_refuse_bad_values(option, value, capsys):
    status = tools.main(["train", option, value])
    err = capsys.readouterr().err
    assert status == 2 and len(err.splitlines()) == 1
    assert option in err


@pytest.mark.parametrize(
    "argv",
    [
        ["translate", "--alpha", value, "Hallo"]
        for value in ("-0.1", "11", "nan", "inf", "many")
    ]
    + [["train", "--dropout", value] for value in ("-0.1", "1", "nan", "x")]
    + [["train", "--weight-decay", value] for value in ("-1", "1.5", "nan")]
    + [["train", "--seed", value] for value in ("-1", "x", "1.5")]
    + [["train", "--schedule", "cosine"]]
    + [["train", "--device", value] for value in ("tpu", "cuda:99")],
)
def test_number_choice_and_device_options_refuse_bad_values(argv, capsys):
    status = tools.main(argv)
    err = capsys.readouterr().err
    assert status == 2 and len(err.splitlines()) == 1
    assert argv[1] in err and "(see --help)" in err


def test_alpha_reaches_beam_search(tiny, tmp_path, capsys):
    ckpt, *_ = tiny
    for alpha in (0.0, 1.0):
        *_, decode_fn = tools.load_translator(ckpt, beam=3, alpha=alpha)
        assert decode_fn.keywords == {"beam_size": 3, "alpha": alpha}
    # Without --alpha, beam search gets the paper's 0.6.
    args = tools.build_parser().parse_args(
        ["translate", "--checkpoint", str(ckpt), "--beam", "3", "x"]
    )
    *_, decode_fn = tools.load_for_decoding(args)
    assert decode_fn.keywords == {"beam_size": 3, "alpha": 0.6}
    # The command line and the library, both with alpha 1.0, agree.
    sentences = [de for de, _ in PAIRS]
    source = tmp_path / "in.de"
    source.write_text("\n".join(sentences) + "\n")
    argv = ["translate", "--checkpoint", str(ckpt), "--beam", "3"]
    argv += ["--device", "cpu", "--alpha", "1.0", "--input", str(source)]
    assert tools.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    expected = tools.translate(
        sentences, str(ckpt), beam=3, alpha=1.0, device="cpu"
    )
    assert printed == expected


def test_alpha_without_a_beam_is_one_line(tiny, capsys):
    """Greedy decoding has no length penalty: --alpha was ignored."""
    status, out, err = run_cli(
        capsys, "translate", "--checkpoint", tiny[0], "--alpha", "1", "x"
    )
    assert status == 2 and out == "" and len(err.splitlines()) == 1
    assert "alpha 1 is beam search's length penalty" in err
    assert "greedy decoding (beam 1) has none" in err


def test_the_library_refuses_alpha_without_a_beam_before_reading(tmp_path):
    """translate() and load_translator() ignored alpha with beam 1."""
    missing = tmp_path / "no such checkpoint.pt"
    for beam in (1, 0):  # not a beam of 2 or more
        with pytest.raises(ValueError, match="greedy decoding"):
            tools.translate(
                ["Hallo"], str(missing), beam=beam, alpha=1.0, device="cpu"
            )
    with pytest.raises(FileNotFoundError):  # alpha None: read, then fail
        tools.load_translator(missing, beam=1)
    with pytest.raises(FileNotFoundError):  # a beam takes an alpha
        tools.load_translator(missing, beam=4, alpha=1.0)


def test_one_string_gives_one_translation_not_one_per_letter(tiny):
    """translate("Ein Hund.") once translated each letter as a sentence."""
    ckpt, model, vocab_src, vocab_tgt = tiny
    sentences = [de for de, _ in PAIRS]
    together = tools.translate(sentences, ckpt, device="cpu")
    alone = tools.translate(sentences[0], ckpt, device="cpu")
    assert isinstance(alone, str) and alone == together[0]
    spacy_de, _ = tat.load_tokenizers()
    with pytest.raises(TypeError, match="list of sentences"):
        tools.translate_batch(
            model, sentences[0], spacy_de, vocab_src, vocab_tgt
        )


@pytest.mark.parametrize(
    "argv, command",
    [
        (["--beam", "4", "translate", "x"], "translate"),
        (["--checkpoint", "some.pt", "evaluate"], "evaluate"),
        (["--preset", "ci", "train"], "train"),
    ],
)
def test_options_before_the_sub_command_are_named_as_the_mistake(
    capsys, argv, command
):
    """argparse said "invalid choice: 'some.pt'", or that a command was
    missing, for an option put before the sub-command."""
    status, out, err = run_cli(capsys, *argv)
    assert status == 2 and out == "" and len(err.splitlines()) == 1
    assert "options go after the sub-command" in err
    assert f" {command} {argv[0]} ..." in err


@pytest.mark.parametrize(
    "argv, unknown, hint",
    [
        (["translate", "--bogus", "x"], "--bogus", ""),
        (["train", "--epochs", "2", "--bogus"], "--bogus", ""),
        (["evaluate", "--beam", "2", "-z"], "-z", ""),
        (["translate", "--be", "2", "Hallo"], "--be", "--beam"),
        (["evaluate", "--be", "2"], "--be 2", "--beam"),
        (["train", "--epoch", "2"], "--epoch 2", "--epochs"),
        (["translate", "--bema", "4", "x"], "--bema", "--beam"),
        (["train", "--drop-out=0.2"], "--drop-out=0.2", "--dropout"),
        (["download", "extra"], "extra", ""),
    ],
)
def test_an_unknown_option_is_named_by_its_sub_command(
    capsys, argv, unknown, hint
):
    """The top-level parser reported it, and its --help lists only the
    sub-commands, not the options that were mistyped; an option close to
    one the sub-command has is suggested."""
    status, out, err = run_cli(capsys, *argv)
    assert status == 2 and out == ""
    prog = tools.build_parser().prog
    suggested = f"; did you mean {hint}?" if hint else ""
    assert err == (
        f"{prog} {argv[0]}: error: unrecognized arguments: {unknown}"
        f"{suggested} (see --help)\n"
    )


def test_whole_number_and_existing_device():
    assert tools.whole_number("3") == 3
    assert tools.whole_number("0", least=0) == 0  # --keep-last 0: keep all
    for bad in ("0", "1.5", "x", str(10**6 + 1)):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number"):
            tools.whole_number(bad)
    # int() takes these; a count on the command line does not.
    for loose in (" 3", "3 ", "1_000", "\u0663", "+3"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number"):
            tools.whole_number(loose)
    assert tools.existing_device("cpu") == "cpu"
    gpus = torch.cuda.device_count()
    if gpus:
        assert tools.existing_device(f"cuda:{gpus - 1}") == f"cuda:{gpus - 1}"
    for bad in (f"cuda:{gpus}", "tpu:0", "gpu", "", "meta"):
        with pytest.raises(argparse.ArgumentTypeError):
            tools.existing_device(bad)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["translate", "  "], "empty"),
        (["translate", "Ein Hund.", "-"], "standard input"),
        (["translate", "--input", "x.de", "Hallo"], "not both"),
        (
            ["translate", "--checkpoint", "nowhere.pt", "Hallo"],
            "no checkpoint",
        ),
    ],
)
def test_cli_bad_input_gets_a_message(argv, message, capsys):
    status, out, err = run_cli(capsys, *argv)
    assert status == 2 and message in err and "Traceback" not in err


def test_cli_rejects_a_foreign_checkpoint(tmp_path, capsys):
    bogus = tmp_path / "other.pt"
    torch.save({"model": {"w": torch.zeros(1)}}, bogus)
    status, _, err = run_cli(
        capsys, "translate", "--checkpoint", str(bogus), "Hallo"
    )
    assert status == 2 and "does not match" in err
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(bogus.read_bytes()[:100])
    status, _, err = run_cli(
        capsys, "translate", "--checkpoint", str(truncated), "Hallo"
    )
    assert status == 2 and "not a readable checkpoint" in err
    assert len(err.splitlines()) == 1


def refused_translation(capsys, checkpoint):
    """stderr of `translate` with a checkpoint it must refuse: one line,
    status 2, nothing on stdout."""
    status, out, err = run_cli(
        capsys, "translate", "--checkpoint", checkpoint, "Hallo"
    )
    assert status == 2 and out == "" and len(err.splitlines()) == 1
    return err


def test_a_checkpoint_with_a_changed_byte_is_refused(tiny, tmp_path, capsys):
    """torch.load reads a tensor's bytes without checking them: one byte
    flipped inside the weights loaded silently, as other weights."""
    data = bytearray(Path(tiny[0]).read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the weights
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(data)
    torch.load(damaged, weights_only=True)  # what torch alone does
    with pytest.raises(tools.CheckpointError, match="fails its checksum"):
        tools.load_checkpoint(damaged)
    err = refused_translation(capsys, damaged)
    assert "not a readable checkpoint (damaged or cut short)" in err
    tools.load_checkpoint(tiny[0])  # the intact file still loads


def test_a_damaged_zip_directory_is_one_line(tiny, tmp_path, capsys):
    """A changed byte in the archive's directory makes zipfile raise
    other errors than BadZipFile (here NotImplementedError)."""
    data = bytearray(Path(tiny[0]).read_bytes())
    entry = data.index(b"PK\x01\x02")  # the first directory entry
    data[entry + 10] = 99  # its compression method: none that exists
    damaged = tmp_path / "method.pt"
    damaged.write_bytes(data)
    with pytest.raises(tools.CheckpointError, match="not a readable"):
        tools.load_checkpoint(damaged)
    err = refused_translation(capsys, damaged)
    assert "compression method" in err


@pytest.mark.parametrize("keep", [30, 200])
def test_an_old_format_checkpoint_cut_short_is_one_line(tmp_path, keep):
    """torch.save's format before torch 1.6, a pickle: cut at 30 bytes,
    torch.load raised struct.error, which no clause caught."""
    old = tmp_path / "old.pt"
    torch.save(
        {"w": torch.ones(50)}, old, _use_new_zipfile_serialization=False
    )
    cut = tmp_path / "cut.pt"
    cut.write_bytes(old.read_bytes()[:keep])
    with pytest.raises(tools.CheckpointError, match="not a readable"):
        tools.load_checkpoint(cut)


def test_averaging_with_a_run_needs_epoch_file_names(tiny):
    with pytest.raises(ValueError, match="not named as an epoch file"):
        tools.average_checkpoints([tiny[0]], history=[])


def test_epoch_files_are_named_as_training_names_them(tmp_path):
    """Other files that start with epoch_ are the user's; epochs sort by
    number, so --keep-last keeps epoch_1000.pt over epoch_999.pt."""
    names = ["epoch_999.pt", "epoch_1000.pt", "epoch_001.pt"]
    names += ["epoch_best.pt", "epoch_001_backup.pt", "epoch_01.pt"]
    for name in names:
        (tmp_path / name).touch()
    found = [p.name for p in tools.epoch_checkpoints(tmp_path)]
    assert found == ["epoch_001.pt", "epoch_999.pt", "epoch_1000.pt"]
    (tmp_path / "last.pt").touch()
    (tmp_path / "final.pt").touch()
    removed = tools.clear_earlier_run(tmp_path)
    assert removed == [*found, "last.pt", "final.pt"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["epoch_001_backup.pt", "epoch_01.pt", "epoch_best.pt"]


def test_the_note_on_an_earlier_run_says_what_is_there(tmp_path, capsys):
    tools.note_earlier_run(tmp_path)  # an empty folder: nothing to say
    assert capsys.readouterr().err == ""
    (tmp_path / "final.pt").touch()  # no training state: no --resume hint
    tools.note_earlier_run(tmp_path)
    err = capsys.readouterr().err
    assert err == (
        f"note: {tmp_path} holds an earlier run, which training afresh"
        " replaces: saving the first epoch removes its final.pt\n"
    )
    (tmp_path / "epoch_000.pt").touch()
    tools.note_earlier_run(tmp_path)
    err = capsys.readouterr().err
    assert "removes its epoch files, final.pt" in err
    assert "--resume" not in err
    (tmp_path / "last.pt").touch()
    tools.note_earlier_run(tmp_path)
    err = capsys.readouterr().err
    assert "removes its epoch files, last.pt, final.pt" in err
    assert "stop now and train with --resume" in err


def test_a_diverged_runs_losses_match_themselves():
    history = [{"epoch": 0, "val_loss": float("nan")}]
    assert tools.same_run([dict(history[0])], history)
    assert tools.same_run(tuple(history), history + [{"epoch": 1}])
    assert not tools.same_run([{"epoch": 0, "val_loss": 1.0}], history)


def test_evaluate_out_may_not_name_an_epoch_file_it_averages(
    tiny, tmp_path, capsys
):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("final.pt", "epoch_000.pt"):
        shutil.copy(tiny[0], run / name)
    before = (run / "epoch_000.pt").read_bytes()
    argv = ["evaluate", "--checkpoint", run / "final.pt", "--average", "1"]
    status, out, err = run_cli(capsys, *argv, "--out", run / "epoch_000.pt")
    assert status == 2 and "is also an input" in err
    assert (run / "epoch_000.pt").read_bytes() == before


def train_with_results(capsys, folder, results):
    """`train --preset ci` into `folder`, with `--results results`."""
    argv = ["train", "--preset", "ci", "--checkpoint-dir", folder]
    return run_cli(capsys, *argv, "--results", results)


@pytest.mark.parametrize("name", ["final.pt", "last.pt", "epoch_003.pt"])
def test_train_results_may_not_name_a_file_training_writes(
    tmp_path, capsys, name
):
    folder = tmp_path / "ck"
    status, out, err = train_with_results(capsys, folder, folder / name)
    assert status == 2 and len(err.splitlines()) == 1
    assert "is a file that training writes" in err and not folder.exists()
    assert not tools.training_writes(tmp_path / "results.json", folder)
    assert tools.training_writes(folder / ".." / "ck" / name, folder)


def test_train_results_may_go_into_the_checkpoint_folder_it_makes(
    tmp_path, capsys, monkeypatch
):
    """The lock makes the folder before training; the results file
    there is written after it: no 'there is no folder'."""
    reached = []
    monkeypatch.setattr(tools, "download_multi30k", lambda: None)
    folder = tmp_path / "new"

    def train_locked(args, config, ranks):
        reached.append(1)
        (folder / "epoch_000.pt").touch()  # else the lock removes it again

    monkeypatch.setattr(tools, "train_locked", train_locked)
    status, out, err = train_with_results(
        capsys, folder, folder / "summary.json"
    )
    assert err == "" and reached == [1] and folder.is_dir()
    elsewhere = tmp_path / "other" / "summary.json"  # a missing folder
    status, out, err = train_with_results(capsys, folder, elsewhere)
    assert status == 2 and "there is no folder" in err


def test_a_warning_on_the_command_line_is_one_line(capsys):
    tools.warning_line(
        UserWarning("train: left out 3\npairs"), UserWarning, "x.py", 1
    )
    assert capsys.readouterr().err == "warning: train: left out 3 pairs\n"


def test_non_utf8_lines_are_named(tmp_path):
    path = tmp_path / "mixed.de.gz"
    with gzip.open(path, "wb") as f:
        f.write("Gut.\nNoch gut.\n".encode() + "Übel.\n".encode("latin-1"))
    lines = tools.iter_lines(path)
    assert next(lines) == "Gut." and next(lines) == "Noch gut."
    with pytest.raises(tools.TextFileError, match="line 3"):
        next(lines)


def test_relative_multi30k_dir_counts_from_the_working_directory(
    multi30k_dir, monkeypatch
):
    monkeypatch.chdir(multi30k_dir.parent)
    monkeypatch.setenv("MULTI30K_DIR", multi30k_dir.name)
    assert tools.download_multi30k() == multi30k_dir.resolve()


def test_translations_do_not_depend_on_their_batch(tiny, tokenizers):
    """A sentence that never ends stops at its own length limit."""
    _, _, vocab_src, vocab_tgt = tiny
    torch.manual_seed(0)
    model = tat.make_model(len(vocab_src), len(vocab_tgt), N=1, d_model=32)
    with torch.no_grad():  # never </s>: every sentence runs to its limit
        model.generator.proj.bias[tat.EOS] = -1e4
    sentences = ["Ein Hund .", "Zwei Kinder spielen im Schnee ."]
    options = dict(max_extra=3, replace_unk=False)
    together = tools.translate_batch(
        model, sentences, tokenizers[0], vocab_src, vocab_tgt, **options
    )
    alone = [
        tools.translate_batch(
            model, [s], tokenizers[0], vocab_src, vocab_tgt, **options
        )[0]
        for s in sentences
    ]
    assert together == alone
    assert len(alone[0].split()) < len(alone[1].split())


# --- text read the way editors write it ----------------------------------

EDITOR_FILES = {  # name: how the three lines of the file are written
    "byte-order mark": lambda lines: "\ufeff" + "\n".join(lines) + "\n",
    "CRLF line ends": lambda lines: "\r\n".join(lines) + "\r\n",
    "CR-only line ends": lambda lines: "\r".join(lines) + "\r",
    "control characters": lambda lines: "\n".join(
        "\x1b" + line.replace(" ", " \x00", 1) + "\x7f\x0c" for line in lines
    ),
}


@pytest.mark.parametrize("layout", EDITOR_FILES, ids=str)
def test_text_is_read_as_editors_write_it(layout, tiny, tokenizers, tmp_path):
    lines = [GERMAN[0], GERMAN[3], GERMAN[1]]
    (tmp_path / "de.txt").write_bytes(EDITOR_FILES[layout](lines).encode())
    argv = ["translate", "--checkpoint", tiny[0], "--input", "de.txt"]
    status, out, err = run_script(*argv, cwd=tmp_path)
    expected = reference(tiny, tokenizers, lines)
    assert status == 0 and out.splitlines() == expected, err


@pytest.mark.parametrize("layout", EDITOR_FILES, ids=str)
def test_lines_are_read_as_editors_write_them(layout, tmp_path):
    lines = [GERMAN[0], "", GERMAN[3], "\tEin Hund."]
    text = EDITOR_FILES[layout](lines)
    (tmp_path / "de.txt").write_bytes(text.encode())
    assert tools.read_lines(tmp_path / "de.txt") == lines


def test_a_byte_order_mark_does_not_change_bleu(
    tiny, tokenizers, tmp_path, capsys
):
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("".join(de + "\n" for de in GERMAN))
    hyps = reference(tiny, tokenizers, GERMAN)  # references that score 100
    ref.write_text("".join(hyp + "\n" for hyp in hyps))
    args = ["evaluate", "--checkpoint", tiny[0], "--src", src, "--ref", ref]
    status, plain, _ = run_cli(capsys, *args)
    assert status == 0 and plain.startswith("BLEU = 100.00 ")
    src.write_text("\ufeff" + src.read_text())
    ref.write_text("\ufeff" + ref.read_text())
    status, with_bom, _ = run_cli(capsys, *args)
    assert status == 0 and with_bom == plain


def test_a_named_pipe_is_read_like_a_file(tiny, tokenizers, tmp_path):
    fifo = tmp_path / "de.fifo"
    os.mkfifo(fifo)
    program = subprocess.Popen(
        [sys.executable, SCRIPT, "translate", "--checkpoint", tiny[0]]
        + ["--input", fifo],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    writer = None
    while writer is None and program.poll() is None:
        try:  # succeeds once the program has opened the pipe to read
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader yet
            time.sleep(0.1)
    if writer is not None:
        os.set_blocking(writer, True)
        with os.fdopen(writer, "w") as f:
            f.write(GERMAN[2] + "\n" + GERMAN[4] + "\n")
    out, err = program.communicate(timeout=300)
    expected = reference(tiny, tokenizers, [GERMAN[2], GERMAN[4]])
    assert program.returncode == 0, err
    assert out.decode().splitlines() == expected


# --- lines longer than the model can read ---------------------------------


def test_an_overlong_line_is_cut_with_a_warning(tiny, tokenizers, tmp_path):
    long = " ".join(["Hund"] * 6000)
    lines = [GERMAN[0], long, GERMAN[1]]
    (tmp_path / "de.txt").write_text("\n".join(lines) + "\n")
    argv = ["translate", "--checkpoint", tiny[0], "--input", "de.txt"]
    status, out, err = run_script(*argv, cwd=tmp_path)
    assert status == 0, err
    assert err.splitlines() == [
        "warning: line 2 has 6,000 tokens; the model reads 4,948, so only "
        "the first 4,948 were translated"
    ]
    out = out.splitlines()
    cut = " ".join(["Hund"] * 4948)
    assert out == reference(tiny, tokenizers, [GERMAN[0], cut, GERMAN[1]])


def test_decoding_stops_at_the_last_position(tiny, tokenizers):
    """A model that never writes </s> stops where its positions end."""
    _, _, vocab_src, vocab_tgt = tiny
    torch.manual_seed(0)
    model = tat.make_model(len(vocab_src), len(vocab_tgt), N=1, d_model=32)
    with torch.no_grad():  # never </s>
        model.generator.proj.bias[tat.EOS] = -1e4
    for embed in (model.src_embed, model.tgt_embed):  # only 60 positions
        embed[1].pe = embed[1].pe[:, :60]
    limit = tools.position_limit(model)
    assert limit == 60 - 50 - 2
    sentence = " ".join(["Hund"] * 20)
    fitted = tools.fit_to_model(sentence, 1, tokenizers[0], vocab_src, limit)
    assert fitted.split() == ["Hund"] * limit
    out = tools.translate_batch(
        model, [fitted], tokenizers[0], vocab_src, vocab_tgt, replace_unk=False
    )
    # The source is <s>, 8 words, </s>: 10 positions, plus 50 more.
    assert 0 < len(out[0].split()) <= 59


# --- faults: one line, a meaningful status, nothing lost -----------------


def test_two_runs_into_one_folder(tmp_path):
    """A second train into a held folder stops at once, naming the holder."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, tmp_path / "ck"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        status, out, err = run_script(
            "train", "--preset", "ci", "--checkpoint-dir", "ck", cwd=tmp_path
        )
        assert status == 2 and len(err.splitlines()) == 1, err
        assert err.startswith("error: ck is in use by another training run")
        assert f"(process {holder.pid})" in err
        assert not list((tmp_path / "ck").glob("*.pt"))
    finally:
        holder.kill()
        holder.wait()
    # Killed, it holds the lock no more: the next run takes it over.
    with tools.folder_lock(tmp_path / "ck"):
        text = (tmp_path / "ck" / ".lock").read_text()
        assert text == f"{os.getpid()}\n"


def test_a_folder_the_lock_made_goes_when_nothing_else_landed(tmp_path):
    """Ctrl-C before the first epoch left a folder holding only .lock."""
    made = tmp_path / "new" / "ck"
    with pytest.raises(KeyboardInterrupt):
        with tools.folder_lock(made):
            raise KeyboardInterrupt
    assert not (tmp_path / "new").exists()  # made for the run, like ck
    with tools.folder_lock(made):  # a run that saved something stays
        (made / "epoch_000.pt").touch()
    assert sorted(p.name for p in made.iterdir()) == [".lock", "epoch_000.pt"]
    (made / "epoch_000.pt").unlink()
    with tools.folder_lock(made):  # a folder that was there stays
        pass
    assert made.is_dir()


@pytest.mark.parametrize("world, cores, warned", [(3, 2, True), (2, 2, False)])
def test_more_processes_than_cores_is_a_warning(
    world, cores, warned, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(tools, "usable_cores", lambda: cores)
    monkeypatch.setattr(tools, "cuda_count", lambda: 0)
    monkeypatch.setenv("MULTI30K_DIR", str(tmp_path / "nowhere"))
    status, _, err = run_cli(
        capsys, "train", "--world-size", world, "--checkpoint-dir",
        tmp_path / "ck",
    )  # fmt: skip
    assert status == 2  # no data here: it stops after the checks
    warning = f"warning: --world-size {world} on {cores} CPU cores"
    assert (warning in err) is warned


@pytest.mark.parametrize("subword, warned", [(True, True), (False, False)])
def test_no_replace_unk_with_a_bpe_model_is_a_warning(
    subword, warned, capsys, monkeypatch
):
    vocab = type("V", (), {"__len__": lambda self: 100})()
    if subword:
        vocab.encode = lambda text: []  # what is_subword looks for
    monkeypatch.setattr(
        tools, "load_translator", lambda *a, **k: (None, vocab, vocab, None)
    )
    args = tools.build_parser().parse_args(
        ["translate", "--no-replace-unk", "Hallo"]
    )
    tools.load_for_decoding(args)
    err = capsys.readouterr().err
    assert ("--no-replace-unk changes nothing here" in err) is warned


HOLD_LOCK = """
import sys, time
import annotated_transformer_tools as tools
with tools.folder_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(300)
"""


def test_a_stale_lock_file_is_taken_over(tmp_path):
    ended = subprocess.Popen(["true"])
    ended.wait()
    (tmp_path / ".lock").write_text(f"{ended.pid}\n")
    with tools.folder_lock(tmp_path):
        with pytest.raises(tools.FolderInUseError, match=str(os.getpid())):
            with tools.folder_lock(tmp_path):
                pass


WRITE_SLOWLY = """
import sys, time
import annotated_transformer_tools as tools
with tools.atomic_write(sys.argv[1]) as f:
    f.write(b"new" * 1000)
    f.flush()
    print("writing", flush=True)
    time.sleep(300)
"""


def test_a_writer_killed_mid_write_loses_nothing(tmp_path):
    target = tmp_path / "final.pt"
    target.write_bytes(b"old")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITE_SLOWLY, target],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline() == "writing\n"
    writer.kill()  # SIGKILL: no cleanup can run
    writer.wait()
    part = tmp_path / f".final.pt.{writer.pid}.part"
    assert target.read_bytes() == b"old" and part.exists()
    # The next write to the folder removes what the dead process left.
    tools.save_checkpoint(tmp_path / "other.pt", weights=torch.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["final.pt", "other.pt"]


def limit_file_size(size):
    """For preexec_fn: files this process writes stop at `size` bytes."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def test_a_full_disk_keeps_the_old_output(tiny, tmp_path):
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("".join(GERMAN[i % 5] + "\n" for i in range(100)))
    ref.write_text("".join(PAIRS[i % 5][1] + "\n" for i in range(100)))
    (tmp_path / "hyp.en").write_text("the old translations\n")
    done = subprocess.run(
        [sys.executable, SCRIPT, "evaluate", "--checkpoint", tiny[0]]
        + ["--src", src, "--ref", ref, "--out", tmp_path / "hyp.en"],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size(1024),  # as `ulimit -f 1`
        timeout=300,
    )
    # What evaluate scores (said before it decodes), then one error line.
    said, error = done.stderr.splitlines()
    assert done.returncode == 74 and said.startswith("scoring ")
    assert error.startswith("error: ") and "large" in error
    assert (tmp_path / "hyp.en").read_text() == "the old translations\n"
    assert sorted(os.listdir(tmp_path)) == ["hyp.en", "ref.en", "src.de"]


def test_a_full_disk_while_training(tmp_path, multi30k_dir):
    """One line, status 74, and no .part file; --resume with nothing to
    resume says that it starts afresh."""
    done = subprocess.run(
        [sys.executable, SCRIPT, "train", "--preset", "ci", "--epochs", "1"]
        + ["--checkpoint-dir", "ck", "--resume"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "MULTI30K_DIR": str(multi30k_dir)},
        preexec_fn=limit_file_size(2**20),  # vocab.json fits, a model not
        timeout=300,
    )
    lines = [x for x in done.stderr.splitlines() if x and "epoch 0" not in x]
    assert done.returncode == 74, done.stderr
    assert lines[0] == (
        "note: nothing to resume in ck (no checkpoints there); training "
        "from the first epoch"
    )
    assert lines[1:] == ["error: ck/epoch_000.pt: File too large"]
    assert not (tmp_path / "ck").exists()  # made by the run, left empty


def test_a_disk_too_full_for_the_lock_is_named_and_leaves_no_folder(
    tmp_path, multi30k_dir
):
    done = subprocess.run(
        [sys.executable, SCRIPT, "train", "--preset", "ci"]
        + ["--checkpoint-dir", "new/ck"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "MULTI30K_DIR": str(multi30k_dir)},
        preexec_fn=limit_file_size(0),  # not even the lock's process id
        timeout=300,
    )
    assert done.returncode == 74, done.stderr
    assert done.stderr.splitlines() == ["error: new/ck/.lock: File too large"]
    assert not (tmp_path / "new").exists()  # both folders made, both gone


@pytest.mark.parametrize("answer", ["--help", "--version"])
def test_help_into_a_full_disk_is_an_error(answer):
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, SCRIPT, answer],
            stdout=full,
            stderr=subprocess.PIPE,
        )
    assert done.returncode == 74
    assert done.stderr.decode() == (
        "error: standard output: No space left on device\n"
    )


def test_standard_output_full_closed_or_gone(tiny, tmp_path):
    argv = [sys.executable, SCRIPT, "translate", "--checkpoint", tiny[0]]
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [*argv, GERMAN[0]], stdout=full, stderr=subprocess.PIPE
        )
    assert done.returncode == 74
    assert done.stderr.decode() == (
        "error: standard output: No space left on device\n"
    )
    base = " ".join(map(shlex.quote, map(str, argv)))
    closed = f"{base} {shlex.quote(GERMAN[0])} >&-"
    done = subprocess.run(["sh", "-c", closed], capture_output=True, text=True)
    assert done.returncode == 74
    assert done.stderr == "error: standard output is closed\n"
    done = subprocess.run(["sh", "-c", f"{base} <&-"], capture_output=True)
    assert done.returncode == 2
    assert done.stderr == b"error: standard input is closed\n"
    # A reader that leaves early: no message, the status of SIGPIPE.
    lines = "".join(GERMAN[i % 5] + "\n" for i in range(200))
    pipe = f"{base} --batch-size 1 | head -1; echo ${{PIPESTATUS[0]}} >&2"
    done = subprocess.run(
        ["bash", "-c", pipe], input=lines, capture_output=True, text=True
    )
    assert done.stdout.count("\n") == 1 and done.stderr == "141\n"


@pytest.mark.parametrize(
    "moment", [0.5, 8.0], ids=["while torch loads", "while it waits"]
)
def test_ctrl_c_is_one_line(moment, tiny, tmp_path):
    program = subprocess.Popen(
        [sys.executable, SCRIPT, "translate", "--checkpoint", tiny[0], "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    program.stdin.write((GERMAN[0] + "\n").encode())
    program.stdin.flush()  # stdin stays open: the program waits for more
    time.sleep(moment)
    program.send_signal(signal.SIGINT)
    out, err = program.communicate(timeout=60)
    assert program.returncode == 130 and err == b"interrupted\n"


def test_ctrl_c_while_the_installed_command_loads(tmp_path):
    """pip's `annotated-transformer` imports the module, then calls main:
    the guard must be on before torch loads there too."""
    command = tmp_path / "annotated-transformer"  # what pip writes
    command.write_text(
        "import sys\n"
        "from annotated_transformer_tools import main\n"
        "sys.exit(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent)}
    program = subprocess.Popen(
        [sys.executable, command, "--help"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    time.sleep(0.3)  # still importing torch
    program.send_signal(signal.SIGINT)
    out, err = program.communicate(timeout=60)
    assert program.returncode == 130 and err == b"interrupted\n"


class Training(NamedTuple):
    """A `train` run in a session of its own, its output in files."""

    program: subprocess.Popen
    out: Path
    err: Path

    def wait(self, timeout=60):
        """(exit status, stderr), killing the group if it does not end."""
        try:
            self.program.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.program.pid, signal.SIGKILL)
            raise AssertionError(f"still running {timeout} s on") from None
        return self.program.returncode, self.err.read_text()


def start_training(tmp_path, *extra):
    """`train --preset ci` of many epochs on the CPU, GPUs hidden (on a
    one-GPU machine `--world-size 2` is refused), as a terminal's job (a
    session of its own), writing to files: a pipe left unread could
    fill."""
    folder = tmp_path / "run"
    argv = [sys.executable, SCRIPT, "train", "--preset", "ci"]
    argv += ["--epochs", "200", "--checkpoint-dir", str(folder), *extra]
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        program = subprocess.Popen(
            argv,
            stdout=stdout,
            stderr=stderr,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "CUDA_VISIBLE_DEVICES": "",
            },
            start_new_session=True,
        )
    return Training(program, out, err)


def wait_for(training, ready, what):
    """Poll until `ready()`, failing if train ends or 120 s pass."""
    deadline = time.time() + 120
    while not ready():
        assert training.program.poll() is None, training.err.read_text()
        assert time.time() < deadline, f"no {what} in 120 s"
        time.sleep(0.1)


def saved_an_epoch(training, tmp_path):
    """Wait until the run has saved an epoch: training runs."""
    last = tmp_path / "run" / "last.pt"  # written after an epoch
    wait_for(training, last.exists, "epoch saved")


def group_is_gone(pgid):
    """Whether no process of the group `pgid` is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def group_ends(pgid, timeout=60):
    """Whether the group `pgid` ends within `timeout` s; if not, kill it.
    (multiprocessing's resource tracker outlives the parent briefly.)"""
    deadline = time.time() + timeout
    while not group_is_gone(pgid) and time.time() < deadline:
        time.sleep(0.2)
    if group_is_gone(pgid):
        return True
    os.killpg(pgid, signal.SIGKILL)
    return False


def test_ctrl_c_stops_every_process_of_a_multi_process_train(
    tmp_path, local_multi30k
):
    """Ctrl-C reaches the whole group: the parent once waited forever for
    a worker, and the workers printed tracebacks."""
    training = start_training(tmp_path, "--world-size", "2")
    saved_an_epoch(training, tmp_path)
    os.killpg(training.program.pid, signal.SIGINT)  # a terminal's Ctrl-C
    status, err = training.wait()
    assert status == 130, err
    assert err.startswith("interrupted") and "Traceback" not in err, err


def test_ctrl_c_while_the_workers_start_waits_for_them(
    tmp_path, local_multi30k
):
    """Pressed while the workers load torch: a worker once died with a
    traceback, reading half of what it was sent."""
    training = start_training(tmp_path, "--world-size", "2")
    starting = lambda: "2 processes" in training.out.read_text()
    wait_for(training, starting, "start of the processes")
    # A second on, the first worker is loading torch (which takes longer),
    # the case that printed tracebacks.
    time.sleep(1.0)
    os.killpg(training.program.pid, signal.SIGINT)
    status, err = training.wait()
    assert status == 130, err
    assert err.startswith("interrupted") and "Traceback" not in err, err
    assert group_ends(training.program.pid)


def test_the_workers_end_when_their_parent_is_killed(tmp_path, local_multi30k):
    """The workers ignore Ctrl-C, so Linux's signal to a worker whose
    parent died (SIGINT, as torch asked) would not stop them."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    training = start_training(tmp_path, "--world-size", "2")
    saved_an_epoch(training, tmp_path)
    training.program.kill()  # SIGKILL: no clean-up of its own
    training.program.wait(60)
    assert group_ends(training.program.pid), "workers outlived the parent"


def test_sigterm_stops_train_as_ctrl_c_does(tmp_path, local_multi30k):
    """`kill` or `timeout`: the same report and status as Ctrl-C."""
    training = start_training(tmp_path)
    saved_an_epoch(training, tmp_path)
    training.program.send_signal(signal.SIGTERM)
    status, err = training.wait()
    assert status == 130, err
    assert err.startswith("interrupted") and "Traceback" not in err, err
    assert "--resume" in err  # where to go on from, as after Ctrl-C


def test_main_puts_the_signal_handlers_back(capsys):
    """A notebook or test calling main keeps its own handlers after."""
    stops = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.getsignal(s) for s in stops}
    assert run_cli(capsys, "--version")[0] == 0
    assert {s: signal.getsignal(s) for s in stops} == before


def report_sigint_disposition(queue):
    """In a new process: what it does with Ctrl-C."""
    queue.put(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)


def test_new_processes_ignore_ctrl_c_and_the_parent_gets_it_afterwards():
    context = torch.multiprocessing.get_context("spawn")
    queue = context.Queue()
    handler = signal.getsignal(signal.SIGINT)
    kept_inside = False
    with pytest.raises(KeyboardInterrupt):
        with tools.stop_signals_kept(), tools.new_processes_ignore_ctrl_c():
            worker = context.Process(
                target=report_sigint_disposition, args=(queue,)
            )
            worker.start()
            os.kill(os.getpid(), signal.SIGINT)  # kept, not raised here
            time.sleep(0.1)
            kept_inside = True
    assert kept_inside  # raised on leaving, not where it came
    assert queue.get(timeout=60) is True  # the worker ignores Ctrl-C
    worker.join(60)
    assert signal.getsignal(signal.SIGINT) is handler  # as before


def test_an_unreadable_checkpoint_is_the_users_error(
    tiny, capsys, monkeypatch
):
    """A file without read permission said so with the machine's status
    74, as if the disk had failed."""
    real_open = open

    def no_permission(path, *args, **kwargs):
        if str(path) == str(tiny[0]):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(tools, "open", no_permission, raising=False)
    status, out, err = run_cli(
        capsys, "translate", "--checkpoint", tiny[0], "x"
    )
    assert status == 2 and out == ""
    assert err == f"error: {tiny[0]}: no permission to read it\n"


def calls_a_function():
    """What a hostile checkpoint's pickle would run (here, harmlessly)."""
    return (os.getcwd, ())


class Hostile:
    __reduce__ = staticmethod(calls_a_function)


def test_a_checkpoint_that_would_call_a_function_is_refused_for_safety(
    tmp_path,
):
    """It was called "damaged", which it is not."""
    path = tmp_path / "hostile.pt"
    torch.save({"model": Hostile()}, path)
    with pytest.raises(tools.CheckpointError, match="for safety"):
        tools.load_checkpoint(path)


def test_the_default_checkpoint_is_found_from_any_folder_of_the_checkout(
    tmp_path, monkeypatch
):
    """From docs/, translate said there was no model, though `make
    notebook` had trained one in the repository."""
    (tmp_path / "the_annotated_transformer.py").write_text("")
    quick = tmp_path / "checkpoints" / "quick" / "final.pt"
    quick.parent.mkdir(parents=True)
    quick.write_bytes(b"")
    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path / "docs")
    assert tools.default_checkpoint() == str(quick)
    # One in the working directory comes first, as before.
    here = Path("checkpoints/quick/final.pt")
    here.parent.mkdir(parents=True)
    here.write_bytes(b"")
    assert tools.default_checkpoint() == str(here)


def test_the_default_checkpoint_is_found_in_the_programs_own_checkout(
    tmp_path, monkeypatch
):
    """`cd /tmp && python ~/done-right/annotated_transformer_tools.py
    translate ...` said "train one first", with a model beside it."""
    clone = tmp_path / "done-right"
    quick = clone / "checkpoints" / "quick" / "final.pt"
    quick.parent.mkdir(parents=True)
    quick.write_bytes(b"")
    (clone / "pyproject.toml").write_text("")  # a checkout, not installed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(tat, "MODULE_DIR", clone)
    assert tools.default_checkpoint() == str(quick)
    (clone / "pyproject.toml").unlink()  # an installed copy: not looked in
    assert tools.default_checkpoint() == "checkpoints/quick/final.pt"


# --- resuming ----------------------------------------------------------------


def test_resume_restores_random_states_from_cpu_tensors(tmp_path, vocabs):
    config = tools.get_config("ci", checkpoint_dir=str(tmp_path), N=1)
    sizes = (len(vocabs[0]), len(vocabs[1]))
    run = tools.TrainingRun(0, 1, sizes, config, False)
    torch.manual_seed(7)
    saved = torch.get_rng_state()
    tools.save_epoch(run, 0, *vocabs)
    torch.manual_seed(8)
    resumed = tools.TrainingRun(0, 1, sizes, config, False)
    resumed.device = torch.device("meta")  # as if the run were elsewhere
    assert tools.resume_run(resumed) == 1
    assert torch.equal(torch.get_rng_state(), saved)


def test_a_resumed_run_steps_with_this_machines_adam(tmp_path, vocabs):
    """Adam's load_state_dict copied the saved `fused`: a run saved on a
    CPU or a CUDA GPU, resumed on a Mac, stepped fused Adam on MPS."""
    config = tools.get_config("ci", checkpoint_dir=str(tmp_path), N=1)
    sizes = (len(vocabs[0]), len(vocabs[1]))
    run = tools.TrainingRun(0, 1, sizes, config, False, device="cpu")
    assert run.optimizer.param_groups[0]["fused"]  # the CPU's choice
    tools.save_epoch(run, 0, *vocabs)
    last = tmp_path / "last.pt"
    saved = torch.load(last, weights_only=True)
    for group in saved["optimizer"]["param_groups"]:  # as MPS saves it
        group["fused"] = False
    torch.save(saved, last)
    resumed = tools.TrainingRun(0, 1, sizes, config, False, device="cpu")
    assert tools.resume_run(resumed) == 1
    assert resumed.optimizer.param_groups[0]["fused"]  # still the CPU's
    lr = resumed.optimizer.param_groups[0]["lr"]
    assert lr == saved["optimizer"]["param_groups"][0]["lr"]  # restored


def test_the_gpus_random_state_is_saved_and_restored(
    tmp_path, vocabs, monkeypatch
):
    """Saved for the run's own GPU, restored onto the resuming run's,
    so that a run saved on cuda:1 of two GPUs resumes on a one-GPU
    machine (set_rng_state_all raised IndexError there)."""
    config = tools.get_config("ci", checkpoint_dir=str(tmp_path), N=1)
    sizes = (len(vocabs[0]), len(vocabs[1]))
    run = tools.TrainingRun(0, 1, sizes, config, False)
    run.device = torch.device("cuda", 1)  # only its name: no GPU here
    states = {0: torch.arange(16).byte(), 1: torch.ones(16).byte()}
    asked = []

    def get_rng_state(device):
        asked.append(torch.device(device))
        return states[torch.device(device).index]

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    tools.save_epoch(run, 0, *vocabs)
    assert asked == [torch.device("cuda", 1)]
    resumed = tools.TrainingRun(0, 1, sizes, config, False)
    resumed.device = torch.device("cuda", 0)  # the one GPU of another machine
    restored = []
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda s, d: restored.append((s, d))
    )
    tools.resume_run(resumed)
    ((state, device),) = restored
    assert torch.equal(state, states[1]) and device == resumed.device


@pytest.mark.parametrize("index, expected", [(0, 0), (1, 1), (2, None)])
def test_an_older_checkpoint_restores_this_gpus_state(index, expected):
    """Older last.pt files held every GPU's state (get_rng_state_all)."""
    states = [torch.arange(16).byte(), torch.ones(16).byte()]
    run = SimpleNamespace(device=torch.device("cuda", index), scaler=None)
    restored = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            torch.cuda, "set_rng_state", lambda s, d: restored.append(s)
        )
        tools.restore_device_states(run, {"cuda_rng_states": states})
    if expected is None:  # a GPU the saving run did not have: left alone
        assert restored == []
    else:
        assert len(restored) == 1
        assert torch.equal(restored[0], states[expected])


def test_apples_random_state_is_saved_and_restored(monkeypatch):
    state = torch.arange(8).byte()
    restored = []
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: state)
    monkeypatch.setattr(torch.mps, "set_rng_state", restored.append)
    run = SimpleNamespace(device=torch.device("mps"), scaler=None)
    saved = tools.device_states(run)
    assert list(saved) == ["mps_rng_state"]
    tools.restore_device_states(run, saved)
    assert restored == [state]
    cpu_run = SimpleNamespace(device=torch.device("cpu"), scaler=None)
    assert tools.device_states(cpu_run) == {}


def test_the_grad_scalers_scale_is_saved_and_restored():
    """A T4 trains in float16 with a GradScaler: a resumed run must go on
    at the scale it had reached, not start again at 65,536."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler.update(new_scale=512.0)
    saved = tools.device_states(
        SimpleNamespace(device=torch.device("cpu"), scaler=scaler)
    )
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    tools.restore_device_states(
        SimpleNamespace(device=torch.device("cpu"), scaler=fresh), saved
    )
    assert fresh.get_scale() == 512.0


def test_a_damaged_cached_file_is_named_offline(tmp_path, monkeypatch):
    (tmp_path / "val.de.gz").write_bytes(b"half a download")
    good = hashlib.sha256(b"the real file").hexdigest()

    def offline(url, timeout):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(tat.DatasetError) as info:
        tools.download_multi30k(root=tmp_path, sha256={"val.de.gz": good})
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'val.de.gz'} in the data cache")
    assert "damaged" in message and "no network" in message
    assert (tmp_path / "val.de.gz").read_bytes() == b"half a download"


def test_epochs_reach_the_config():
    args = tools.build_parser().parse_args(["train", "--epochs", "3"])
    assert tools.get_config(args.preset, epochs=args.epochs).epochs == 3
    assert "download" in tools.build_parser().format_help()


def test_a_checkpoint_cut_anywhere_is_one_line(tiny, tmp_path, capsys):
    whole = Path(tiny[0]).read_bytes()
    for cut in (1, 2, 50, 500, len(whole) // 3, len(whole) // 2, -10):
        path = tmp_path / f"cut_{cut}.pt"
        path.write_bytes(whole[:cut])
        status, _, err = run_cli(
            capsys, "translate", "--checkpoint", path, "Ja"
        )
        assert status == 2 and len(err.splitlines()) == 1, (cut, err)
        assert f"{path} is not a" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--checkpoint-dir", ""],
        ["train", "--results", ""],
        ["train", "--data", ""],
        ["evaluate", "--out", ""],
        ["evaluate", "--src", ""],
        ["translate", "--checkpoint", "", "Hallo"],
        ["translate", "--input", ""],
    ],
)
def test_an_empty_path_is_refused_in_one_line(argv, capsys):
    # An empty path would mean the working directory, or be skipped.
    status = tools.main(argv)
    err = capsys.readouterr().err
    assert status == 2
    assert len(err.splitlines()) == 1
    assert argv[1] in err


def test_max_tokens_below_max_len_is_one_line(tmp_path, capsys):
    folder = tmp_path / "ck"
    argv = ["train", "--preset", "ci", "--max-tokens", "127"]
    status, out, err = run_cli(capsys, *argv, "--checkpoint-dir", folder)
    assert status == 2
    assert len(err.splitlines()) == 1
    assert "--max-tokens 127" in err
    assert not folder.exists()  # refused before anything was written


def test_out_must_be_an_ordinary_file(tmp_path):
    target = tmp_path / "kept.txt"
    target.write_text("old\n")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for special in (link, pipe, Path(os.devnull)):
        with pytest.raises(tools.UserError, match="link, device or pipe"):
            tools.check_out(special)
    tools.check_out(target)  # an ordinary file may be replaced
    tools.check_out(tmp_path / "new.txt")  # and a new one written
    assert target.read_text() == "old\n"


def test_a_sentence_argument_that_is_not_utf8_is_one_line(tmp_path):
    # The shell passes the bytes; Python decodes \xff as a lone surrogate.
    argv = [sys.executable, str(SCRIPT), "translate", b"Ein \xff Mann."]
    argv += ["--checkpoint", str(tmp_path / "unused.pt")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: sentence 1 is not UTF-8 text"]


def test_a_checkpoint_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    argv = ["train", "--preset", "ci", "--checkpoint-dir", file]
    status, out, err = run_cli(capsys, *argv)
    assert status == 2
    assert err.splitlines() == [
        f"error: --checkpoint-dir {file} is a file, not a folder"
    ]
    assert file.read_text() == "mine\n"  # left as it was
    # A file where a folder above it should be: a mistake (2), not an
    # operating-system fault (74), and the file is named.
    status, out, err = run_cli(capsys, *argv[:-1], file / "run")
    assert status == 2
    assert err.splitlines() == [
        f"error: --checkpoint-dir {file / 'run'}: {file} is a file, not a"
        " folder"
    ]


@pytest.mark.parametrize("option", ["--out", "--results"])
def test_an_output_under_a_file_or_ending_in_a_slash_is_refused(
    option, tmp_path, capsys
):
    """Path() drops a last slash, so `--out o.txt/` would have replaced
    o.txt; and under a file there is no folder to write in."""
    file = tmp_path / "o.txt"
    file.write_text("mine\n")
    for value, message in (
        (f"{file}/", "names a folder; name a file"),
        (f"{file}/x.txt", f"{file} is a file, not a folder"),
    ):
        if option == "--out":
            argv = ["evaluate", "--checkpoint", "unused.pt", "--src"]
            argv += ["s.de", "--ref", "r.en", "--out", value]
        else:
            argv = ["train", "--preset", "ci", "--results", value]
            argv += ["--checkpoint-dir", tmp_path / "ck"]
        status, _, err = run_cli(capsys, *argv)
        assert status == 2 and message in err, err
        assert len(err.splitlines()) == 1
    assert file.read_text() == "mine\n"


@pytest.mark.parametrize(
    "argv, warning",
    [
        (["--threads", "3"], "warning: --threads 3 on 2 CPU cores"),
        (["--threads", "2"], None),
        (["--rdrop", "2.5"], "warning: --rdrop 2.5 with dropout 0"),
        (["--rdrop", "2.5", "--dropout", "0.1"], None),
    ],
)
def test_settings_that_only_cost_time_are_a_warning(
    argv, warning, tmp_path, capsys, monkeypatch
):
    """--threads 4096 ran 17 times slower without a word, and R-Drop
    without dropout compares two identical passes."""
    monkeypatch.setattr(tools, "usable_cores", lambda: 2)
    monkeypatch.setenv("MULTI30K_DIR", str(tmp_path / "nowhere"))
    status, _, err = run_cli(
        capsys, "train", "--preset", "ci", *argv, "--checkpoint-dir",
        tmp_path / "ck",
    )  # fmt: skip
    assert status == 2  # no data here: it stops after the checks
    warnings_given = [line for line in err.splitlines() if "warning" in line]
    if warning is None:
        assert warnings_given == []
    else:
        assert len(warnings_given) == 1
        assert warnings_given[0].startswith(warning)


@pytest.mark.parametrize("name", ["last.pt", "final.pt", "epoch_000.pt"])
def test_a_folder_where_training_writes_a_file_is_refused_first(
    name, tmp_path, capsys, monkeypatch
):
    """It trained the whole run, then failed on the hidden .part file."""
    folder = tmp_path / "ck"
    (folder / name).mkdir(parents=True)
    monkeypatch.setenv("MULTI30K_DIR", str(tmp_path / "nowhere"))
    status, _, err = run_cli(
        capsys, "train", "--preset", "ci", "--checkpoint-dir", folder
    )
    assert status == 2
    assert err == (
        f"error: --checkpoint-dir {folder}: {name} is a folder, and"
        " training writes a file of that name; move it away\n"
    )


def test_a_write_that_fails_names_the_file_not_its_part(tmp_path):
    """os.replace's error named `.final.pt.PID.part`."""
    target = tmp_path / "final.pt"
    target.mkdir()
    with pytest.raises(IsADirectoryError) as caught:
        with tools.atomic_write(target) as f:
            f.write(b"weights")
    assert caught.value.filename == str(target)
    assert os.listdir(tmp_path) == ["final.pt"]  # no .part file left


def test_a_full_disk_names_the_file_and_a_network_error_passes(tmp_path):
    """A reset connection in a download's `with` body was reported as if
    it were about the local file: "Connection reset by peer: 'x.gz'"."""
    target = tmp_path / "x.gz"
    with pytest.raises(OSError) as caught:
        with tools.atomic_write(target):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.filename == str(target)
    reset = ConnectionResetError(errno.ECONNRESET, "Connection reset")
    with pytest.raises(ConnectionResetError) as caught:
        with tools.atomic_write(target):
            raise reset
    assert caught.value is reset and caught.value.filename is None
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "error, command, advice",
    [
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator:"
                " can't allocate memory: you tried to allocate 5464064000"
                " bytes. Error code 12 (Cannot allocate memory)"
            ),
            "translate",
            "a smaller --batch-size or --beam",
        ),
        (
            torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to ..."),
            "evaluate",
            "a smaller --batch-size or --beam",
        ),
        (MemoryError(), "train", "a smaller --max-tokens"),
    ],
)
def test_running_out_of_memory_is_one_line(
    error, command, advice, capsys, monkeypatch
):
    """It printed torch's traceback, 91 lines ending in the allocator's."""

    def out_of_memory(args):
        raise error

    monkeypatch.setattr(tools, f"command_{command}", out_of_memory)
    argv = {"train": [], "evaluate": [], "translate": ["Hallo"]}[command]
    status, out, err = run_cli(capsys, command, *argv)
    assert (status, out) == (74, "")
    assert err == f"error: out of memory; try {advice}\n"


def test_any_other_runtime_error_keeps_its_traceback(capsys, monkeypatch):
    """A bug is not memory: hiding its traceback would hide where."""

    def bug(args):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(tools, "command_translate", bug)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        tools.main(["translate", "Hallo"])


@pytest.mark.parametrize(
    "text", ["1_0", " 0.5", "0.5 ", "+0.5", "\u0660.5", "1e", "nan", ""]
)
def test_a_real_number_option_takes_plain_decimals_only(text):
    """float() took "1_0" as 10 for --alpha."""
    check = tools.number_from(0.0, 20.0)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a number"):
        check(text)


@pytest.mark.parametrize(
    "text, value",
    [("0.5", 0.5), ("2", 2.0), ("2.", 2.0), (".25", 0.25), ("1e-4", 1e-4)],
)
def test_a_real_number_option_takes_what_people_write(text, value):
    assert tools.number_from(0.0, 20.0)(text) == value


def test_an_empty_number_is_named(capsys):
    status, _, err = run_cli(capsys, "translate", "--alpha", "", "Hallo")
    assert status == 2 and err.endswith("not nothing (see --help)\n")


def test_out_with_gz_is_refused(tiny, tmp_path, capsys):
    """--out o.gz wrote plain text, which --input o.gz could not read."""
    out = tmp_path / "o.gz"
    (tmp_path / "s.de").write_text("Hallo.\n")
    (tmp_path / "r.en").write_text("Hello.\n")
    status, _, err = run_cli(
        capsys, "evaluate", "--checkpoint", tiny[0], "--src",
        tmp_path / "s.de", "--ref", tmp_path / "r.en", "--out", out,
    )  # fmt: skip
    assert status == 2 and not out.exists()
    assert "written as plain text; name a file without .gz" in err


def test_parallel_files_name_standard_input(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"")))
    ref = tmp_path / "ref.en"
    ref.write_text("A dog.\n")
    with pytest.raises(tools.TextFileError, match="^standard input has 0"):
        tools.read_parallel("-", ref)


def test_train_help_lists_what_each_preset_sets(capsys):
    """Options said "default: the preset's", and --help showed none."""
    assert tools.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    header = "what each preset sets (layers x d_model, then the options):\n"
    presets = out.split(header)[1]
    rows = {line.split()[0]: line for line in presets.splitlines()}
    assert sorted(rows) == sorted(tools.PRESETS)
    for name, row in rows.items():
        c = tools.get_config(name)
        assert row.split()[1] == f"{c.N}x{c.d_model}"
        fields = dict(cell.split("=") for cell in row.split()[2:])
        assert int(fields["epochs"]) == c.epochs
        assert int(fields["max-tokens"]) == c.max_tokens
        assert float(fields["dropout"]) == c.dropout
        assert fields["schedule"] == c.schedule
        assert (fields["tied"] == "yes") == c.tie_embeddings
    # The description is still wrapped, not one line of 200 characters.
    description = out.split("\n\n")[1]
    assert description.startswith("Train a model on Multi30k")
    assert max(map(len, description.splitlines())) <= 80


@pytest.mark.parametrize(
    "last_line, oom",
    [
        ("RuntimeError: DefaultCPUAllocator: can't allocate memory", True),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to ...", True),
        ("MemoryError", True),
        ("RuntimeError: shape mismatch", False),
        ("ValueError: out of range", False),
    ],
)
def test_a_worker_that_ran_out_of_memory_is_told_apart(last_line, oom):
    """With --world-size, a worker's error arrives as its traceback's text,
    which main printed whole."""
    text = "\n\n-- Process 1 terminated with the following error:\n"
    err = Exception(text + "Traceback (most recent call last):\n  ...\n")
    err = Exception(str(err) + last_line)
    assert tools.worker_out_of_memory(err) is oom


@pytest.mark.parametrize(
    "preset, flag, precision",
    [
        ("quick", None, "auto"),
        ("quick", "fp32", "fp32"),
        ("ci", "auto", "auto"),
    ],
)
def test_train_precision_reaches_the_config(
    preset, flag, precision, tmp_path, capsys, monkeypatch
):
    """A T4 whose float16 training gave nan had no way to train in float32
    from the command line."""
    chosen = []
    monkeypatch.setattr(tools, "download_multi30k", lambda: None)

    def train_locked(args, config, ranks):
        chosen.append(config.precision)
        (tmp_path / "ck" / "epoch_000.pt").touch()

    monkeypatch.setattr(tools, "train_locked", train_locked)
    argv = ["train", "--preset", preset, "--checkpoint-dir", tmp_path / "ck"]
    status, _, err = run_cli(
        capsys, *argv, *(["--precision", flag] if flag else [])
    )
    assert chosen == [precision], err
    status, _, err = run_cli(capsys, "train", "--precision", "fp16")
    assert status == 2 and "invalid choice: 'fp16'" in err


# --- found by a probe of the command line with bad inputs ------------------


def test_a_wrong_at_precision_is_one_line(monkeypatch, capsys, tmp_path):
    """AT_PRECISION=fp16 gave a traceback and status 1."""
    monkeypatch.setenv("AT_PRECISION", "fp16")
    folder = tmp_path / "ck"
    status, _, err = run_cli(
        capsys, "train", "--preset", "ci", "--checkpoint-dir", folder
    )
    assert status == 2
    assert err == (
        "error: AT_PRECISION='fp16': only fp32 (float32, no 16-bit"
        " arithmetic) can be set this way\n"
    )
    assert not folder.exists()


def test_evaluate_refuses_to_replace_a_checkpoint_folders_lock(
    tiny, tmp_path, capsys
):
    """`evaluate --out ck/.lock` replaced the lock, and a second `train`
    into ck then started beside the first."""
    src, ref = tmp_path / "s.de", tmp_path / "s.en"
    src.write_text(GERMAN[0] + "\n")
    ref.write_text(PAIRS[0][1] + "\n")
    lock = tmp_path / "ck" / ".lock"
    lock.parent.mkdir()
    lock.write_text("4867\n")
    status, _, err = run_cli(
        capsys, "evaluate", "--checkpoint", tiny[0], "--src", src,
        "--ref", ref, "--out", lock,
    )  # fmt: skip
    assert status == 2 and "a checkpoint folder's lock" in err
    assert lock.read_text() == "4867\n"


@pytest.mark.parametrize(
    "lines, message",
    [("", "is empty"), ("\n\n  \n", "holds only blank lines")],
)
def test_input_without_a_sentence_is_refused(
    tiny, tmp_path, capsys, lines, message
):
    """A file of blank lines gave blank lines back, status 0, and
    `evaluate` a BLEU of 0.00 over nothing."""
    src = tmp_path / "blank.de"
    src.write_text(lines)
    status, out, err = run_cli(
        capsys, "translate", "--checkpoint", tiny[0], "--input", src
    )
    assert (status, out) == (2, "")
    assert err == f"error: nothing to translate: {src} {message}\n"
    if lines:
        ref = tmp_path / "blank.en"
        ref.write_text(lines)
        status, out, err = run_cli(
            capsys, "evaluate", "--checkpoint", tiny[0], "--src", src,
            "--ref", ref,
        )  # fmt: skip
        assert (status, out) == (2, "")
        assert err == (
            f"error: nothing to translate: {src} holds only blank lines\n"
        )


def test_blank_lines_past_the_first_chunk_are_read_through(
    tiny, tokenizers, tmp_path, capsys
):
    """Only blank lines that fit in the first chunk were refused: with
    --batch-size 1 a chunk is 8 lines, and 20 blank lines came back as
    20 blank lines, status 0."""
    src = tmp_path / "blank.de"
    src.write_text("\n" * 20)
    options = ["--checkpoint", tiny[0], "--batch-size", 1, "--input", src]
    status, out, err = run_cli(capsys, "translate", *options)
    assert (status, out) == (2, "")
    assert err.endswith("holds only blank lines\n")
    src.write_text("\n" * 20 + GERMAN[0] + "\n")  # then a sentence
    status, out, _ = run_cli(capsys, "translate", *options)
    assert status == 0
    assert out.split("\n")[:21] == [""] * 20 + reference(
        tiny, tokenizers, [GERMAN[0]]
    )


def test_gzipped_standard_input_says_to_decompress_it(tiny, tmp_path):
    data = gzip.compress(GERMAN[0].encode() + b"\n")
    status, out, err = run_script(
        "translate", "--checkpoint", tiny[0], cwd=tmp_path, stdin=data
    )
    assert (status, out) == (2, "")
    assert err == (
        "error: standard input is not UTF-8 text (line 1), but"
        " gzip-compressed: decompress it first (zcat)\n"
    )


def test_a_gzipped_file_without_gz_says_so(tiny, tmp_path, capsys):
    packed = tmp_path / "sentences"  # gzip inside, no .gz on the name
    packed.write_bytes(gzip.compress(GERMAN[0].encode() + b"\n"))
    status, _, err = run_cli(
        capsys, "translate", "--checkpoint", tiny[0], "--input", packed
    )
    assert status == 2
    assert err == (
        f"error: {packed} is not UTF-8 text (line 1), but gzip-compressed:"
        " name it *.gz\n"
    )


def python_blocks(markdown):
    """The ```python code blocks of a markdown text."""
    return re.findall(r"^```python\n(.*?)^```", markdown, re.M | re.S)


def test_the_python_examples_of_docs_cli_run_as_written(tiny, tmp_path):
    blocks = python_blocks((ROOT / "docs" / "cli.md").read_text())
    assert len(blocks) == 2  # the model alone; translating with a checkpoint
    quick = tmp_path / "checkpoints" / "quick"
    quick.mkdir(parents=True)
    shutil.copy(tiny[0], quick / "final.pt")  # where `make notebook` saves
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    printed = []
    for block in blocks:
        done = subprocess.run(
            [sys.executable, "-c", block],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        printed.append(done.stdout.splitlines())
    model_alone, translated = printed
    ids = re.fullmatch(r"tensor\(\[\[(.*)\]\]\)", model_alone[0]).group(1)
    assert [int(i) for i in ids.split(",")][0] == 0  # from the start symbol
    assert len(ids.split(",")) == 10  # max_len
    assert translated == [
        "['A man rides a bicycle.']",
        "['Two children play in the snow.']",
    ]


@pytest.mark.parametrize(
    "options, decoding",
    [
        ([], "greedy"),
        (["--beam", "4"], "beam 4"),
        (["--beam", "4", "--alpha", "1.0"], "beam 4, alpha 1.0"),
        (["--average", "1"], "greedy, the last 1 epoch averaged"),
    ],
)
def test_evaluate_says_what_it_scores(options, decoding):
    """Without --checkpoint and --src, evaluate chose a model and the test
    set silently and printed a bare score."""
    args = tools.build_parser().parse_args(["evaluate", *options])
    args.checkpoint = "checkpoints/quick/final.pt"  # as main fills it in
    line = tools.evaluation_line(args, "test2016", 1000)
    assert line == (
        f"scoring checkpoints/quick/final.pt ({decoding}) on test2016:"
        " 1000 lines"
    )
