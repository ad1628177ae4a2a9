"""Tests of the command line: translate, evaluate, and every bad input."""

import argparse
import gzip
import io
import os
import pickle
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import the_annotated_transformer as tat

SCRIPT = Path(tat.__file__).resolve()

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


def save_tiny(path, model, config, vocab_src, vocab_tgt, **changes):
    """A checkpoint in the layout train_worker writes, with `changes`."""
    fields = {"model": model.state_dict(), "config": asdict(config)}
    fields |= {"vocab_src": vocab_src.get_itos(), "history": []}
    fields |= {"vocab_tgt": vocab_tgt.get_itos(), **changes}
    tat.save_checkpoint(path, **fields)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizers):
    """(checkpoint path, model, vocab_src, vocab_tgt): PAIRS learned."""
    spacy_de, spacy_en = tokenizers
    vocab_src = tat.Vocab.build((tat.tokenize(s, spacy_de) for s in GERMAN), 1)
    vocab_tgt = tat.Vocab.build(
        (tat.tokenize(en, spacy_en) for _, en in PAIRS), 1
    )
    config = tat.get_config("ci", N=1, d_model=32, d_ff=64, h=2, dropout=0.0)
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
    return tat.translate_batch(
        model, sentences, tokenizers[0], vocab_src, vocab_tgt, **options
    )


def run_script(*argv, cwd, stdin=b"", env=None):
    """Run the real program in a new process: (status, stdout, stderr)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, argv)],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def run_cli(capsys, *argv):
    """Run main() in this process: (status, stdout, stderr)."""
    status = tat.main(list(map(str, argv)))
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
    calls, translate_batch = [], tat.translate_batch

    def counting(model, sentences, *args, **kwargs):
        calls.append(len(sentences))
        return translate_batch(model, sentences, *args, **kwargs)

    monkeypatch.setattr(tat, "translate_batch", counting)
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
    model, vocab_src, vocab_tgt, _ = tat.load_trained_model(ckpt)
    ids = [tat.BOS, *tat.encode_text(sentence, tokenizers[0], vocab_src)]
    src = torch.tensor([ids + [tat.EOS]])  # (1, S)
    src_mask = torch.ones(1, 1, src.size(1), dtype=torch.bool)
    with torch.no_grad():
        ys = tat.greedy_decode(model, src, src_mask, src.size(1) + 50, tat.BOS)
    expected = tat.decode_text(tat.strip_specials(ys[0].tolist()), vocab_tgt)
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
    status, stdout, _ = run_cli(capsys, *args, "--out", out)
    hyps = out.read_text().splitlines()
    assert status == 0 and len(hyps) == len(PAIRS)
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


@pytest.mark.parametrize("command", ["train", "evaluate", "translate"])
def test_cli_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tat.main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_cli_defaults_fit_together():
    # With no options, evaluate and translate read the checkpoint that
    # train writes with no options.
    parser = tat.build_parser()
    preset = parser.parse_args(["train"]).preset
    written = Path(tat.get_config(preset).checkpoint_dir) / "final.pt"
    for argv in (["evaluate"], ["translate", "Hallo"]):
        args = parser.parse_args(argv)
        assert Path(args.checkpoint) == written, argv
        assert args.beam == 1 and args.average is None  # plain greedy


# --- bad input: one line on stderr, exit status 2, no traceback ---------


class RunsCode:
    """Unpickled, this creates a file: what a hostile checkpoint can do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny):
    """A folder of files that the command line must refuse."""
    folder = tmp_path_factory.mktemp("bad")
    (folder / "latin1.de").write_bytes("Schöne Grüße.\n".encode("latin-1"))
    (folder / "three.de").write_text("Ein Hund.\nEine Katze.\nHallo.\n")
    (folder / "two.en").write_text("A dog.\nA cat.\n")
    (folder / "empty.de").write_text("")
    (folder / "empty.en").write_text("")
    rng = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (4096,), generator=rng, dtype=torch.uint8)
    (folder / "random.pt").write_bytes(bytes(noise.tolist()))
    torch.save({"model": RunsCode(folder / "ran.zip")}, folder / "code.pt")
    with open(folder / "code.pkl", "wb") as f:  # the old, bare pickle
        pickle.dump({"model": RunsCode(folder / "ran.pkl")}, f, protocol=4)
    _, model, vocab_src, vocab_tgt = tiny
    config = tat.load_trained_model(tiny[0])[3]
    bigger = tat.Vocab([*vocab_tgt.get_itos(), "zebra", "giraffe"])
    save_tiny(folder / "other.pt", model, config, vocab_src, bigger)
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
        "random.pt",
    ),
    "pickle with code": (
        ["translate", "--checkpoint", "code.pt", "Ja"],
        "holds more than tensors, so it is not loaded, for safety",
    ),
    "old pickle with code": (
        ["translate", "--checkpoint", "code.pkl", "Ja"],
        "holds more than tensors",
    ),
    "another vocabulary": (
        ["translate", "--checkpoint", "other.pt", "Ja"],
        "other.pt does not match",
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
    "relative MULTI30K_DIR": (
        ["download"],
        "{folder}/no/multi30k",
        {"MULTI30K_DIR": "no/multi30k"},
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=str)
def test_bad_input_gets_one_line_and_status_2(case, bad_files, tiny):
    argv, message, *env = BAD_INPUTS[case]
    names = {"ckpt": tiny[0], "folder": bad_files}
    argv = [arg.format(**names) for arg in argv]
    status, out, err = run_script(*argv, cwd=bad_files, env=(env or [{}])[0])
    assert status == 2, (status, err)
    assert len(err.splitlines()) == 1 and err.strip(), err
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
    with pytest.raises(SystemExit) as stop:
        tat.main(["translate", option, value, "Hallo"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1
    assert option in err and "(see --help)" in err


@pytest.mark.parametrize(
    "option", ["--epochs", "--max-tokens", "--threads", "--world-size"]
)
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_train_options_refuse_bad_values(option, value, capsys):
    with pytest.raises(SystemExit) as stop:
        tat.main(["train", option, value])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1
    assert option in err


def test_positive_int_and_existing_device():
    assert tat.positive_int("3") == 3
    assert tat.existing_device("cpu") == "cpu"
    gpus = torch.cuda.device_count()
    if gpus:
        assert tat.existing_device(f"cuda:{gpus - 1}") == f"cuda:{gpus - 1}"
    for bad in (f"cuda:{gpus}", "tpu:0", "gpu", "", "meta"):
        with pytest.raises(argparse.ArgumentTypeError):
            tat.existing_device(bad)


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


def test_non_utf8_lines_are_named(tmp_path):
    path = tmp_path / "mixed.de.gz"
    with gzip.open(path, "wb") as f:
        f.write("Gut.\nNoch gut.\n".encode() + "Übel.\n".encode("latin-1"))
    lines = tat.iter_lines(path)
    assert next(lines) == "Gut." and next(lines) == "Noch gut."
    with pytest.raises(tat.TextFileError, match="line 3"):
        next(lines)


def test_relative_multi30k_dir_counts_from_the_working_directory(
    multi30k_dir, monkeypatch
):
    monkeypatch.chdir(multi30k_dir.parent)
    monkeypatch.setenv("MULTI30K_DIR", multi30k_dir.name)
    assert tat.download_multi30k() == multi30k_dir.resolve()


def test_translations_do_not_depend_on_their_batch(tiny, tokenizers):
    """A sentence that never ends stops at its own length limit."""
    _, _, vocab_src, vocab_tgt = tiny
    torch.manual_seed(0)
    model = tat.make_model(len(vocab_src), len(vocab_tgt), N=1, d_model=32)
    with torch.no_grad():  # never </s>: every sentence runs to its limit
        model.generator.proj.bias[tat.EOS] = -1e4
    sentences = ["Ein Hund .", "Zwei Kinder spielen im Schnee ."]
    options = dict(max_extra=3, replace_unk=False)
    together = tat.translate_batch(
        model, sentences, tokenizers[0], vocab_src, vocab_tgt, **options
    )
    alone = [
        tat.translate_batch(
            model, [s], tokenizers[0], vocab_src, vocab_tgt, **options
        )[0]
        for s in sentences
    ]
    assert together == alone
    assert len(alone[0].split()) < len(alone[1].split())
