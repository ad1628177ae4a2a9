"""Tests of Part 3's training, checkpoints, DDP and decoding."""

import io
import json
import os
import shlex
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

pytestmark = pytest.mark.usefixtures("local_multi30k")


def ci_config(tmp_path, **overrides):
    """The ci preset, writing into tmp_path, with some changes."""
    return tools.get_config("ci", checkpoint_dir=str(tmp_path), **overrides)


def train(cfg, vocabs, tokenizers, **kwargs):
    """One process on the CPU, also beside a GPU: the checks compare its
    weights and files with CPU runs."""
    kwargs.setdefault("device", "cpu")
    return tools.train_worker(
        0, 1, *vocabs, *tokenizers, cfg, show_progress=False, **kwargs
    )


def final_weights(cfg):
    path = Path(cfg.checkpoint_dir) / "final.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same_weights(a, b, atol=0.0, skip=()):
    assert a.keys() == b.keys()
    for key in a:
        if key.endswith(skip):
            continue
        gap = (a[key].float() - b[key].float()).abs().max().item()
        assert gap <= atol, f"{key}: weights differ by {gap:.2e}"


class Bar(list):
    """What a recording tqdm returns: the items, and whether closed."""

    closed = False

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory, vocabs, tokenizers):
    """One trained ci model, shared by several tests; keeps 2 epoch files."""
    cfg = ci_config(tmp_path_factory.mktemp("ci"), epochs=3, keep_last=2)
    history = train(cfg, vocabs, tokenizers)
    return cfg, history


def test_ci_training_lowers_the_loss(ci_run):
    _, history = ci_run
    losses = [h["val_loss"] for h in history]
    assert len(losses) == 3
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.95 * losses[0], losses


def test_describe_checkpoint_names_the_model_and_its_training(ci_run):
    cfg, history = ci_run
    path = Path(cfg.checkpoint_dir) / "final.pt"
    line = tools.describe_checkpoint(path)
    folder = Path(cfg.checkpoint_dir).name
    assert line.startswith(f"{folder}/final.pt, preset ci (N={cfg.N}, ")
    assert f"d_model={cfg.d_model}, h={cfg.h}, word vocabulary" in line
    assert (
        f"{len(history)} epochs on {cfg.max_train_pairs:,d} training" in line
    )
    assert line.endswith(f"validation loss {history[-1]['val_loss']:.2f}")


def test_describe_checkpoint_counts_one_epoch_in_the_singular(
    ci_run, tmp_path
):
    """A checkpoint of one epoch was described as "1 epochs"."""
    cfg, history = ci_run
    ckpt = torch.load(
        Path(cfg.checkpoint_dir) / "final.pt",
        map_location="cpu",
        weights_only=False,
    )
    ckpt["history"] = history[:1]
    torch.save(ckpt, tmp_path / "final.pt")
    line = tools.describe_checkpoint(tmp_path / "final.pt")
    assert f", 1 epoch on {cfg.max_train_pairs:,d} training pairs" in line


def test_describe_checkpoint_names_the_data_pairs(ci_run, tmp_path):
    cfg, _ = ci_run
    path = Path(cfg.checkpoint_dir) / "final.pt"
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    ckpt["config"]["data"] = "sha256:" + "ab" * 32  # as `train --data` sets
    torch.save(ckpt, tmp_path / "final.pt")
    line = tools.describe_checkpoint(tmp_path / "final.pt")
    pairs = f"the first {cfg.max_train_pairs:,d}"  # the ci preset's cap
    assert f"on the --data pairs sha256:abababababab, {pairs}, val" in line


def test_write_results_scores_with_and_without_unk_replacement(
    ci_run, tmp_path, monkeypatch
):
    cfg, history = ci_run
    final = Path(cfg.checkpoint_dir) / "final.pt"
    pairs = tat.read_multi30k("test")[:40]
    monkeypatch.setattr(tat, "read_multi30k", lambda split: pairs)
    monkeypatch.setattr(tools, "read_multi30k", lambda split: pairs)
    argv = ["annotated_transformer_tools.py", "train", "--results", "a b"]
    monkeypatch.setattr(sys, "argv", argv)
    tools.write_results(tmp_path / "r.json", final, wall_time=12.34)
    summary = json.loads((tmp_path / "r.json").read_text())
    assert shlex.split(summary["command"]) == ["python", *argv]
    sources, refs = [de for de, _ in pairs], [en for _, en in pairs]
    for key, swap in (
        ("test2016_bleu_greedy", True),
        ("test2016_bleu_greedy_without_unk_replacement", False),
    ):
        hyps = tools.translate(sources, final, replace_unk=swap)
        assert summary[key] == round(tools.compute_bleu(hyps, refs).score, 2)
    assert summary["history"] == history and summary["wall_time_s"] == 12.3
    assert summary["config"]["preset"] == "ci"


@pytest.mark.parametrize(
    "argv, ranks, expected",
    [
        (  # the module's file: python runs it
            ["annotated_transformer_tools.py", "train", "--data", "a b"],
            None,
            "python annotated_transformer_tools.py train --data 'a b'",
        ),
        (  # the installed command: no python before it
            ["/venv/bin/annotated-transformer", "train", "--epochs", "2"],
            None,
            "/venv/bin/annotated-transformer train --epochs 2",
        ),
        (  # torchrun, two processes on one machine
            ["annotated_transformer_tools.py", "train"],
            tools.TorchrunRanks(rank=0, world=2, local_rank=0, local_world=2),
            "torchrun --nproc_per_node=2 annotated_transformer_tools.py train",
        ),
        (  # torchrun on two machines of four processes, the command
            ["/venv/bin/annotated-transformer", "train"],
            tools.TorchrunRanks(rank=0, world=8, local_rank=0, local_world=4),
            "torchrun --nproc_per_node=4 --nnodes=2 --no-python"
            " /venv/bin/annotated-transformer train",
        ),
    ],
)
def test_results_record_the_command_as_a_shell_takes_it(argv, ranks, expected):
    """The summary wrote "python " + " ".join(sys.argv): wrong for the
    installed command and torchrun, and unquoted."""
    command = tools.run_command(argv, ranks)
    assert command == expected
    words = shlex.split(command)
    assert words[words.index(argv[0]) :] == argv  # quoted: read back whole


def test_one_greedy_decoding_gives_both_unk_treatments(ci_run):
    """write_results' single decoding against translate_batch's two."""
    cfg, _ = ci_run
    model, vocab_src, vocab_tgt, _ = tools.load_trained_model(
        Path(cfg.checkpoint_dir) / "final.pt", "cpu"
    )
    with torch.no_grad():  # make <unk> likely, so that the two differ
        model.generator.proj.bias[tat.UNK] += 3.0
    sources = [de for de, _ in tat.read_multi30k("val")[:30]]
    spacy_de, _ = tools.load_tokenizers()
    args = (model, sources, spacy_de, vocab_src, vocab_tgt)
    replaced, kept = tools.greedy_with_and_without_unk(*args)
    assert replaced == tools.translate_batch(*args, replace_unk=True)
    assert kept == tools.translate_batch(*args, replace_unk=False)
    assert replaced != kept and any("<unk>" in hyp for hyp in kept)
    # the batch size changes how sentences are grouped, not the output
    small = tools.greedy_with_and_without_unk(*args, batch_size=4)
    assert small == (replaced, kept)


def test_run_model_example_prints_what_translate_gives(ci_run, capsys):
    cfg, _ = ci_run
    final = str(Path(cfg.checkpoint_dir) / "final.pt")
    hyps = tools.run_model_example(final, n_examples=3)
    pairs = tat.read_multi30k("val")[:3]
    assert hyps == tools.translate([de for de, _ in pairs], final)
    printed = capsys.readouterr().out
    for i, ((de, en), hyp) in enumerate(zip(pairs, hyps)):
        assert f"example {i}\n  source: {de}\n  reference: {en}" in printed
        assert f"  model: {hyp}\n" in printed
    assert "example 3" not in printed


RESUME_KEYS = ("optimizer", "scheduler", "train_state", "rng_state")


def test_checkpoints_load_with_weights_only(ci_run):
    cfg, _ = ci_run
    folder = Path(cfg.checkpoint_dir)
    epochs = tools.epoch_checkpoints(folder)
    assert [p.name for p in epochs] == ["epoch_001.pt", "epoch_002.pt"]
    for path in (*epochs, folder / "last.pt", folder / "final.pt"):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        for key in ("model", "config", "vocab_src", "vocab_tgt", "epoch"):
            assert key in ckpt, (path.name, key)
    assert not list(folder.glob(".*part"))


def test_only_last_pt_keeps_the_training_state(ci_run):
    cfg, _ = ci_run
    folder = Path(cfg.checkpoint_dir)
    states = []
    for path in tools.epoch_checkpoints(folder):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        assert not set(RESUME_KEYS) & ckpt.keys(), path.name
        assert ckpt["epoch"] == int(path.stem[-3:])
        states.append(ckpt["model"])
    # last.pt: the newest weights, with the state that resuming needs
    last = torch.load(
        folder / "last.pt", map_location="cpu", weights_only=True
    )
    assert set(RESUME_KEYS) <= last.keys() and last["epoch"] == 2
    assert last["optimizer"]["state"], "Adam's moments are saved"
    assert_same_weights(last["model"], states[-1])
    assert_same_weights(final_weights(cfg), states[-1])
    # and the lean files still average: against a mean taken by hand
    model, *_ = tools.load_translator(folder / "final.pt", average_last=2)
    by_hand = {k: (states[0][k] + states[1][k]) / 2 for k in states[0]}
    assert_same_weights(model.state_dict(), by_hand, atol=1e-6)
    with pytest.raises(ValueError, match="--keep-last"):
        tools.load_translator(folder / "final.pt", average_last=3)


def test_average_takes_the_named_checkpoints_own_epochs(ci_run):
    """--average K counts back from the checkpoint named, not from the
    newest file in its folder."""
    cfg, _ = ci_run
    folder = Path(cfg.checkpoint_dir)
    model, *_ = tools.load_translator(folder / "epoch_001.pt", average_last=1)
    saved = torch.load(folder / "epoch_001.pt", weights_only=True)["model"]
    assert_same_weights(model.state_dict(), saved)
    newest = torch.load(folder / "epoch_002.pt", weights_only=True)["model"]
    with pytest.raises(AssertionError, match="weights differ"):
        assert_same_weights(model.state_dict(), newest)
    with pytest.raises(ValueError, match="needs 3 epochs; .* trained for 2"):
        tools.load_translator(folder / "epoch_001.pt", average_last=3)


def test_average_refuses_an_epoch_file_of_another_run(ci_run, tmp_path):
    """An epoch file whose losses are not the start of the checkpoint's
    is another run's, left in the same folder: refused, not averaged."""
    cfg, _ = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)
    stale = torch.load(folder / "epoch_001.pt", weights_only=True)
    stale["history"][0]["val_loss"] += 0.5
    torch.save(stale, folder / "epoch_001.pt")
    with pytest.raises(ValueError, match="epoch_001.pt is from another"):
        tools.load_translator(folder / "final.pt", average_last=2)
    model, *_ = tools.load_translator(folder / "final.pt", average_last=1)
    assert_same_weights(model.state_dict(), final_weights(cfg))


def test_training_afresh_clears_an_earlier_runs_epoch_files(
    ci_run, tmp_path, vocabs, tokenizers, capsys
):
    """Else the earlier run's newer-numbered files would be the ones kept
    (the new run's own pruned in their place) and averaged."""
    cfg, _ = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)  # epochs 1, 2, last, final
    again = replace(cfg, checkpoint_dir=str(folder), epochs=1, seed=7)
    train(again, vocabs, tokenizers)
    names = sorted(p.name for p in folder.glob("*.pt"))
    assert names == ["epoch_000.pt", "final.pt", "last.pt"]
    note = f"note: {folder} holds an earlier run, which training afresh"
    err = capsys.readouterr().err
    assert err.count(note) == 1 and "stop now and train with --resume" in err
    assert "removes its epoch files, last.pt, final.pt" in err
    model, *_ = tools.load_translator(folder / "final.pt", average_last=1)
    assert_same_weights(model.state_dict(), final_weights(again))
    empty = tmp_path / "empty"
    train(replace(again, checkpoint_dir=str(empty)), vocabs, tokenizers)
    assert note.replace(str(folder), str(empty)) not in capsys.readouterr().err


def test_a_retrain_stopped_in_its_first_epoch_leaves_the_earlier_run(
    ci_run, tmp_path, vocabs, tokenizers, monkeypatch
):
    """Forgetting --resume and pressing Ctrl-C at once costs nothing."""
    cfg, _ = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)
    before = {p.name: p.read_bytes() for p in folder.glob("*.pt")}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tools, "train_epoch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(replace(cfg, checkpoint_dir=str(folder)), vocabs, tokenizers)
    after = {p.name: p.read_bytes() for p in folder.glob("*.pt")}
    assert after == before
    assert tools.resume_point(folder) == folder / "last.pt"


def test_a_retrain_stopped_later_leaves_no_earlier_final_pt(
    ci_run, tmp_path, vocabs, tokenizers, monkeypatch
):
    """Stopped after its first epoch, a retrain left the earlier run's
    final.pt, which translate reads by default, beside its own epochs."""
    cfg, _ = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)
    real_epoch = tools.train_epoch

    def stopped_in_the_second(run, epoch, *args, **kwargs):
        if epoch == 1:
            raise KeyboardInterrupt
        return real_epoch(run, epoch, *args, **kwargs)

    monkeypatch.setattr(tools, "train_epoch", stopped_in_the_second)
    again = replace(cfg, checkpoint_dir=str(folder), seed=7)
    with pytest.raises(KeyboardInterrupt):
        train(again, vocabs, tokenizers)
    names = sorted(p.name for p in folder.glob("*.pt"))
    assert names == ["epoch_000.pt", "last.pt"]  # the new run's alone
    assert tools.resume_point(folder) == folder / "last.pt"


def test_average_through_a_link_reads_the_runs_folder(ci_run, tmp_path):
    cfg, _ = ci_run
    link = tmp_path / "best.pt"
    link.symlink_to(Path(cfg.checkpoint_dir, "final.pt"))
    model, *_ = tools.load_translator(link, average_last=2)
    by_link = model.state_dict()
    model, *_ = tools.load_translator(
        Path(cfg.checkpoint_dir, "final.pt"), average_last=2
    )
    assert_same_weights(by_link, model.state_dict())


def test_average_refuses_a_copied_or_renamed_epoch_file(ci_run, tmp_path):
    """A file's own epoch must be the one its name says."""
    cfg, _ = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)
    shutil.copy(folder / "epoch_001.pt", folder / "epoch_002.pt")
    with pytest.raises(ValueError, match="holds epoch 1, not 2: a copied"):
        tools.load_translator(folder / "final.pt", average_last=2)
    shutil.copy(folder / "final.pt", folder / "epoch_001.pt")
    with pytest.raises(ValueError, match="holds epoch 2, not 1"):
        tools.load_translator(folder / "final.pt", average_last=2)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"epoch": "2"}, "does not record its epoch and losses"),
        ({"epoch": 2.0}, "does not record its epoch and losses"),
        ({"history": None}, "does not record its epoch and losses"),
    ],
)
def test_average_needs_a_checkpoint_that_records_its_run(
    ci_run, tmp_path, change, words
):
    cfg, _ = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)
    final = torch.load(folder / "final.pt", weights_only=True)
    torch.save(final | change, folder / "final.pt")
    with pytest.raises(ValueError, match=words):
        tools.load_translator(folder / "final.pt", average_last=2)


def test_average_refuses_an_epoch_file_without_weights(ci_run, tmp_path):
    cfg, _ = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)
    lean = torch.load(folder / "epoch_002.pt", weights_only=True)
    del lean["model"]
    torch.save(lean, folder / "epoch_002.pt")
    with pytest.raises(ValueError, match="epoch_002.pt holds no model"):
        tools.load_translator(folder / "final.pt", average_last=2)
    buffers = torch.load(folder / "epoch_001.pt", weights_only=True)
    buffers["model"] = {
        k: v for k, v in buffers["model"].items() if not k.endswith(".pe")
    }
    torch.save(buffers, folder / "epoch_001.pt")
    with pytest.raises(ValueError, match="not the same model.* missing"):
        tools.average_checkpoints(
            [folder / "final.pt", folder / "epoch_001.pt"]
        )


def test_resume_refuses_a_folder_with_only_a_final_model(
    ci_run, tmp_path, vocabs
):
    """Starting afresh would replace the model without a word."""
    cfg, _ = ci_run
    shutil.copy(Path(cfg.checkpoint_dir, "final.pt"), tmp_path / "final.pt")
    alone = replace(cfg, checkpoint_dir=str(tmp_path), epochs=1)
    with pytest.raises(tools.CheckpointError, match="lack the training"):
        tools.check_resume(alone, *vocabs)


def test_resume_refuses_other_training_settings(
    ci_run, tmp_path, vocabs, tokenizers
):
    """Resuming with another dropout or warm-up would be neither run."""
    cfg, _ = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)
    other = replace(cfg, checkpoint_dir=str(folder), dropout=0.3, warmup=7)
    expected = "dropout 0.0 there, 0.3 here; warmup 20 there, 7 here;"
    with pytest.raises(tools.CheckpointError, match=expected):
        tools.check_resume(other, *vocabs)
    with pytest.raises(tools.CheckpointError, match=expected):
        tools.train_model(*vocabs, *tokenizers, other, resume=True)
    # more epochs, fewer epoch files kept, another folder and preset name
    more = replace(other, dropout=0.0, warmup=20, epochs=4, keep_last=1)
    more = replace(more, preset="renamed")
    assert tools.check_resume(more, *vocabs) == (folder / "last.pt", 3)
    # the same number of epochs: nothing left, nothing refused
    last = (folder / "last.pt", 3)
    assert tools.check_resume(replace(more, epochs=3), *vocabs) == last
    # fewer epochs than it has trained would save a final.pt that says so
    fewer = replace(more, epochs=2)
    with pytest.raises(tools.CheckpointError, match="for 2 epochs in all"):
        tools.check_resume(fewer, *vocabs)
    one = "for 1 epoch in all: it has trained 3 epochs already"  # not 1 epochs
    with pytest.raises(tools.CheckpointError, match=one):
        tools.check_resume(replace(more, epochs=1), *vocabs)


def test_resume_in_an_empty_folder_says_it_starts_afresh(
    ci_run, tmp_path, vocabs, capsys
):
    """A library user gets the command line's note; a real run, none."""
    cfg, _ = ci_run
    empty = replace(cfg, checkpoint_dir=str(tmp_path / "empty"))
    tools.check_resume_and_say(empty, *vocabs)
    assert capsys.readouterr().err == (
        f"note: nothing to resume in {empty.checkpoint_dir} (no checkpoints"
        " there); training from the first epoch\n"
    )
    more = replace(cfg, epochs=cfg.epochs + 1)  # a run to resume
    tools.check_resume_and_say(more, *vocabs)
    assert capsys.readouterr().err == ""


def test_resuming_a_finished_run_says_so_and_rewrites_nothing(
    ci_run, tmp_path, vocabs, tokenizers, capsys, local_multi30k
):
    """It printed "trained in 2 s" and wrote final.pt again."""
    cfg, _ = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)
    same = replace(cfg, checkpoint_dir=str(folder))
    before = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.pt")}
    tools.check_resume_and_say(same, *vocabs)
    err = capsys.readouterr().err
    assert f"has trained all {cfg.epochs} epochs; nothing left" in err
    train(same, vocabs, tokenizers, resume=True)
    after = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.pt")}
    assert after == before
    argv = ["train", "--preset", "ci", "--checkpoint-dir", str(folder)]
    argv += ["--epochs", str(cfg.epochs), "--keep-last", "2", "--resume"]
    assert tools.main(argv) == 0
    out = capsys.readouterr().out
    last_line = out.splitlines()[-1]  # after the device's line
    assert last_line == f"nothing trained; model in {folder / 'final.pt'}"
    assert "trained in" not in out
    after = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.pt")}
    assert after == before


def test_resuming_beside_another_runs_final_pt_writes_this_ones(
    ci_run, tmp_path, vocabs, tokenizers
):
    """A final.pt that is not this run's (older code left one beside a
    stopped retrain) is not taken for this run's end."""
    cfg, history = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)
    final = folder / "final.pt"
    other = torch.load(final, weights_only=True)
    other["history"] = [dict(h, val_loss=9.0) for h in other["history"]]
    torch.save(other, final)
    train(replace(cfg, checkpoint_dir=str(folder)), vocabs, tokenizers,
          resume=True)  # fmt: skip
    saved = torch.load(final, weights_only=True)["history"]
    assert repr(saved) == repr(history)


def test_a_damaged_last_pt_says_what_can_be_done(ci_run, tmp_path, vocabs):
    cfg, _ = ci_run
    folder = tmp_path / "copy"
    shutil.copytree(cfg.checkpoint_dir, folder)
    last = folder / "last.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    damaged = replace(cfg, checkpoint_dir=str(folder))
    with pytest.raises(tools.CheckpointError) as info:
        tools.check_resume(damaged, *vocabs)
    message = str(info.value)
    assert message.startswith(f"{last} is not a readable checkpoint")
    assert "cannot be resumed: train without --resume to start" in message


def test_resume_reads_an_older_full_epoch_file(ci_run, tmp_path, vocabs):
    """Runs from before last.pt kept the whole state in each epoch file."""
    cfg, _ = ci_run
    folder = Path(cfg.checkpoint_dir)
    old = replace(cfg, checkpoint_dir=str(tmp_path))
    sizes = (len(vocabs[0]), len(vocabs[1]))
    # only a lean epoch file (a crash before the first last.pt): start over
    shutil.copy(folder / "epoch_001.pt", tmp_path / "epoch_001.pt")
    run = tools.TrainingRun(0, 1, sizes, old, False, device="cpu")
    fresh = {k: v.clone() for k, v in run.module.state_dict().items()}
    assert tools.resume_run(run) == 0
    assert_same_weights(run.module.state_dict(), fresh)
    # the old layout: the newest epoch file holds the whole state
    shutil.copy(folder / "last.pt", tmp_path / "epoch_002.pt")
    saved = torch.load(
        tmp_path / "epoch_002.pt", map_location="cpu", weights_only=True
    )
    run = tools.TrainingRun(0, 1, sizes, old, False, device="cpu")
    assert tools.resume_run(run) == 3
    assert_same_weights(run.module.state_dict(), saved["model"])
    moments = run.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moments, saved["optimizer"]["state"][0]["exp_avg"])
    assert asdict(run.state) == saved["train_state"]
    assert run.history == saved["history"]


def test_resumed_run_matches_uninterrupted_run(tmp_path, vocabs, tokenizers):
    kw = dict(dropout=0.1, max_train_pairs=300)
    whole = ci_config(tmp_path / "whole", epochs=2, **kw)
    train(whole, vocabs, tokenizers)
    split = ci_config(tmp_path / "split", epochs=1, **kw)
    train(split, vocabs, tokenizers)
    train(replace(split, epochs=2), vocabs, tokenizers, resume=True)
    assert_same_weights(final_weights(whole), final_weights(split))
    # and it really trained on after resuming, rather than stopping
    first = torch.load(
        Path(split.checkpoint_dir) / "epoch_000.pt",
        map_location="cpu",
        weights_only=True,
    )["model"]
    changed = final_weights(split)["generator.proj.weight"]
    assert not torch.equal(first["generator.proj.weight"], changed)


def test_two_processes_match_one_process_with_accumulation(
    tmp_path, vocabs, tokenizers
):
    """DDP over 2 ranks averages the grads of 2 batches: accum_iter=2."""
    base = ci_config(tmp_path / "one", epochs=1, max_train_pairs=400)
    # The sampler deals batch k to rank k % 2; one process sees them in
    # the same order, so accumulating pairs of batches is the same update
    # provided the number of batches is even (no batch gets split).
    loader, _ = tat.create_dataloaders(
        *vocabs,
        *tokenizers,
        max_tokens=base.max_tokens,
        max_len=base.max_len,
        max_train_pairs=base.max_train_pairs,
    )
    assert len(loader) % 2 == 0, "choose max_train_pairs for an even count"
    train(replace(base, accum_iter=2), vocabs, tokenizers)
    two = replace(base, checkpoint_dir=str(tmp_path / "two"))
    tools.train_distributed_model(
        *vocabs, *tokenizers, two, world_size=2, cpu_fallback=True
    )  # two CPU processes, also beside one GPU
    ckpt = torch.load(
        Path(two.checkpoint_dir) / "final.pt",
        map_location="cpu",
        weights_only=True,
    )
    assert ckpt["ranks_in_sync"] is True
    # Summing gradients across processes reorders float additions; Adam
    # turns such rounding into weight gaps of about 1e-4 over this run,
    # where the learning rate moves weights by about 5e-2 a step. A
    # missing or doubled batch would show up as gaps of that size. The key
    # biases are left out: their gradient is rounding alone
    # (test_model.py), which Adam scales up to steps of its own size (gaps
    # of 1e-3 on an Intel Xeon).
    assert_same_weights(
        final_weights(base), ckpt["model"], atol=5e-4, skip=("w_k.bias",)
    )


def test_batch_greedy_matches_one_sentence_at_a_time(ci_run, tokenizers):
    cfg, _ = ci_run
    model, vsrc, vtgt, _ = tools.load_trained_model(
        Path(cfg.checkpoint_dir) / "final.pt", "cpu"
    )
    sentences = [de for de, _ in tat.read_multi30k("val")[:12]]
    encoded = [
        [tat.BOS, *vsrc(tat.tokenize(s, tokenizers[0])), tat.EOS]
        for s in sentences
    ]
    src = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(e) for e in encoded],
        batch_first=True,
        padding_value=tat.PAD,
    )
    batched = tat.batch_greedy_decode(
        model, src, (src != tat.PAD).unsqueeze(-2), 20
    )
    for row, ids in zip(batched.tolist(), encoded):
        one = torch.tensor([ids])
        with torch.no_grad():
            alone = tat.greedy_decode(
                model,
                one,
                torch.ones(1, 1, len(ids), dtype=torch.bool),
                20,
                tat.BOS,
            )
        assert tat.strip_specials(row) == tat.strip_specials(alone[0])


def test_detokenize_restores_most_references(tokenizers):
    _, spacy_en = tokenizers
    refs = [en for _, en in tat.read_multi30k("val")]
    restored = [tools.detokenize(tat.tokenize(r, spacy_en)) for r in refs]
    exact = sum(a == b.strip() for a, b in zip(restored, refs)) / len(refs)
    assert exact > 0.95, exact


def test_bleu_is_cased_and_perfect_on_references():
    refs = ["A man rides a bike .".replace(" .", "."), "Two dogs play."]
    assert tools.compute_bleu(refs, refs).score == pytest.approx(100.0)
    lowered = [r.lower() for r in refs]
    assert tools.compute_bleu(lowered, refs).score < 100.0


def test_run_epoch_enters_autocast_once_per_micro_batch():
    """One autocast region per micro-batch, never one per epoch."""
    entries = []

    @contextmanager
    def counting_autocast():
        entries.append(torch.is_grad_enabled())
        yield

    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=32, d_ff=64, h=2)
    loss_compute = tat.SimpleLossCompute(
        model.generator, tat.LabelSmoothing(11, tat.COPY_PAD)
    )
    optimizer, scheduler = tat.make_optimizer(model, 32, 1.0, 10)
    tat.run_epoch(
        tat.data_gen(11, 4, 5),
        model,
        loss_compute,
        optimizer,
        scheduler,
        autocast=counting_autocast,
    )
    assert entries == [True] * 5


@pytest.mark.skipif(
    not tools.cpu_has_native_bf16(),
    reason="this CPU has no native bfloat16",
)
def test_bf16_training_matches_float32(tmp_path, vocabs, tokenizers):
    """Mixed precision must train the same model, up to rounding."""
    losses = {}
    for precision in ("fp32", "auto"):
        cfg = ci_config(
            tmp_path / precision, epochs=1, max_train_pairs=400,
            precision=precision,
        )  # fmt: skip
        losses[precision] = train(cfg, vocabs, tokenizers)[-1]["val_loss"]
    assert losses["auto"] == pytest.approx(losses["fp32"], rel=0.03)


def test_torchrun_trains_with_two_processes(tmp_path, local_multi30k):
    """The CLI under torchrun: env:// rendezvous, gloo, ranks in sync."""
    import subprocess
    import sys

    root = Path(tat.__file__).resolve().parent
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={tools.free_port()}",
        str(root / "annotated_transformer_tools.py"),
        "train",
        "--preset",
        "ci",
        "--epochs",
        "1",
        "--checkpoint-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "MULTI30K_DIR": local_multi30k}
    env["CUDA_VISIBLE_DEVICES"] = ""  # two CPU processes, even beside a GPU
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = torch.load(
        tmp_path / "final.pt", map_location="cpu", weights_only=True
    )
    assert ckpt["ranks_in_sync"] is True


def test_find_or_train_finds_a_trained_preset(
    ci_run, tmp_path, vocabs, monkeypatch
):
    cfg, _ = ci_run  # stands for a preset that `make train` has trained
    root, name = Path(cfg.checkpoint_dir).parent, Path(cfg.checkpoint_dir).name
    monkeypatch.setitem(
        tools.PRESETS, "trained", replace(cfg, checkpoint_dir=name)
    )
    empty = replace(cfg, checkpoint_dir="never-trained")
    monkeypatch.setitem(tools.PRESETS, "untrained", empty)
    stand_in = ci_config(tmp_path / "stand-in")
    presets = ["untrained", "trained"]
    found = tools.find_or_train(presets, stand_in, vocabs, None, root=root)
    assert found == str(Path(cfg.checkpoint_dir) / "final.pt")
    assert not (tmp_path / "stand-in").exists()  # nothing was trained


def test_find_or_train_trains_the_stand_in(
    tmp_path, vocabs, tokenizers, monkeypatch, capsys
):
    trained = ci_config(tmp_path / "trained", epochs=1, max_train_pairs=100)
    train(trained, vocabs, tokenizers)
    found_here = replace(trained, checkpoint_dir="trained")
    monkeypatch.setitem(tools.PRESETS, "trained", found_here)
    empty = replace(trained, checkpoint_dir="never-trained")
    monkeypatch.setitem(tools.PRESETS, "untrained", empty)
    stand_in = ci_config(tmp_path / "stand-in", epochs=1, max_train_pairs=100)
    # a CI-sized run ignores what is there; a full one finds nothing
    for presets, size in ((["trained"], "ci"), (["untrained"], "full")):
        found = tools.find_or_train(
            presets, stand_in, vocabs, tokenizers, tmp_path, size
        )
        assert found == str(tmp_path / "stand-in" / "final.pt")
        assert Path(found).is_file()
    # the second replaced the first's scratch model without a note that
    # it would ("stop now and train with --resume")
    assert "holds an earlier run" not in capsys.readouterr().err
    names = sorted(p.name for p in (tmp_path / "stand-in").glob("*.pt"))
    assert names == ["epoch_000.pt", "final.pt", "last.pt"]


def test_progress_bar_wraps_the_batches_and_changes_nothing(
    tmp_path, vocabs, tokenizers, monkeypatch
):
    import tqdm.auto

    bars = []

    def recording_tqdm(iterable, desc, **options):
        bars.append((desc, options))
        return Bar(iterable)

    monkeypatch.setattr(tqdm.auto, "tqdm", recording_tqdm)
    weights = []
    for show in (False, True):
        cfg = ci_config(tmp_path / str(show), epochs=2, max_train_pairs=100)
        tools.train_worker(0, 1, *vocabs, *tokenizers, cfg, show_progress=show)
        weights.append(final_weights(cfg))
    assert [desc for desc, _ in bars] == ["epoch 0", "epoch 1"]
    assert bars[0][1]["delay"] > 0  # quick runs print no bar
    assert_same_weights(*weights)


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self):
        return True


def bar_draws(monkeypatch, stderr):
    """How many times a bar over 40 batches of 20 ms is drawn on `stderr`
    (tqdm's default, at most every 0.1 s, draws it about 8 times)."""
    monkeypatch.setattr(sys, "stderr", stderr)
    with tools.progress_bar(range(40), "epoch 0", delay=0) as batches:
        for _ in batches:
            time.sleep(0.02)
    return stderr.getvalue().count("epoch 0")


def test_a_bar_drawn_into_a_file_is_drawn_seldom(monkeypatch):
    """A log keeps every redraw of a bar, one per batch; into a file the
    bar is drawn once a minute (and when it closes), on a terminal as
    often as tqdm likes."""
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    into_a_file = bar_draws(monkeypatch, io.StringIO())
    on_a_terminal = bar_draws(monkeypatch, Terminal())
    assert 1 <= into_a_file <= 2 < on_a_terminal


def test_a_run_saved_with_the_older_precision_name_resumes():
    """`precision="bf16"` was the name of what is "auto" now: resuming a
    run saved with it must not be refused as another setting."""
    config = tools.get_config("quick")
    older = asdict(config) | {"precision": "bf16"}
    assert tools.changed_settings(older, config) == []
    asked_by_its_older_name = replace(config, precision="bf16")
    assert (
        tools.changed_settings(asdict(config), asked_by_its_older_name) == []
    )
    other = asdict(config) | {"precision": "fp32"}
    assert tools.changed_settings(other, config) == [
        "precision 'fp32' there, 'auto' here"
    ]


def test_an_older_config_is_read_with_todays_names():
    old = asdict(tools.get_config("ci"))
    old["num_epochs"] = old.pop("epochs")
    del old["precision"]
    old["amp"] = "none"  # autocast off, in the old name's values
    config = tools.checkpoint_config({"config": old})
    assert config.epochs == 2 and config.precision == "fp32"
    old["amp"] = "bf16"  # then the name of what is "auto" now
    assert tools.checkpoint_config({"config": old}).precision == "auto"
    del old["amp"]
    old["precision"] = "bf16"
    assert tools.checkpoint_config({"config": old}).precision == "auto"


@pytest.mark.parametrize(
    "cuda, presets, size, expected",
    [
        (True, ["cpu", "quick"], "full", "quick"),  # Colab's GPU
        (False, ["cpu", "quick"], "full", "stand-in"),  # a CPU: seconds
        (True, ["cpu", "quick"], "ci", "stand-in"),  # CI, even on a GPU
        (True, ["cpu-bpe"], "full", "stand-in"),  # quick not asked for
    ],
)
def test_find_or_train_trains_quick_only_on_a_cuda_gpu(
    tmp_path, monkeypatch, cuda, presets, size, expected
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    calls = []

    def fake_train_worker(*args, show_progress):
        calls.append((args[-1], show_progress))

    monkeypatch.setattr(tools, "train_worker", fake_train_worker)
    stand_in = ci_config(tmp_path / "stand-in")
    found = tools.find_or_train(
        presets, stand_in, (None, None), (None, None), tmp_path, size
    )
    [(config, shown)] = calls
    if expected == "quick":
        folder = tmp_path / "checkpoints" / "quick"
        assert config.preset == "quick"
        assert config == tools.get_config("quick", checkpoint_dir=str(folder))
        assert found == str(folder / "final.pt")
        assert shown  # minutes of training: progress is shown
    else:
        assert config is stand_in and not shown
        assert found == str(tmp_path / "stand-in" / "final.pt")


def test_resuming_reads_the_checkpoint_once_per_step(
    ci_run, vocabs, monkeypatch
):
    """The check before a run and the restore in it each read last.pt
    once (a checkpoint with Adam's state is three times the weights)."""
    cfg, _ = ci_run
    reads = []
    real_load = tools.load_checkpoint

    def counting_load(path, *args, **kwargs):
        reads.append(Path(path).name)
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(tools, "load_checkpoint", counting_load)
    path, _ = tools.check_resume(cfg, *vocabs)
    assert path == Path(cfg.checkpoint_dir, "last.pt")
    assert reads == ["last.pt"]
    reads.clear()
    sizes = (len(vocabs[0]), len(vocabs[1]))
    run = tools.TrainingRun(0, 1, sizes, cfg, False, device="cpu")
    assert tools.resume_run(run) == cfg.epochs
    assert reads == ["last.pt"]
