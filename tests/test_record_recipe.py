"""bench/record_recipe.py: the time it records, its goal test, and the
validation curve it scores from the epoch files, against references
computed here independently."""

import importlib.util
import os
import time
from pathlib import Path

import pytest
import sacrebleu

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "record_recipe", ROOT / "bench" / "record_recipe.py"
)
record_recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record_recipe)


def a_run(steps=765, bleu=37.0, precision="auto"):
    """What `train --results` writes, reduced to what `record` reads."""
    history = [
        {"epoch": 0, "train_loss": 2.0, "val_loss": 1.5, "steps": steps}
    ]
    return {
        "config": {"preset": "quick", "precision": precision},
        "history": history,
        "epochs": 1,
        "wall_time_s": 100.0,
        "test2016_bleu_greedy": bleu,
        "test2016_bleu_greedy_without_unk_replacement": bleu - 1.5,
        "bleu": f"BLEU = {bleu} ...",
    }


def test_train_seconds_run_from_the_start_to_final_pt(tmp_path):
    final = tmp_path / "final.pt"
    final.touch()
    began = time.time() - 1000
    os.utime(final, (began + 123.4, began + 123.4))
    result = record_recipe.record("quick", 2, tmp_path, a_run(), began)
    assert result["train_seconds"] == pytest.approx(123.4, abs=0.05)
    assert result["steps"] == 765 and result["threads"] == 2
    assert result["test2016_bleu_greedy"] == 37.0
    assert "--preset quick --threads 2" in result["train_command"]


@pytest.mark.parametrize(
    "native_bf16, asked, recorded",
    [
        (True, "auto", "bfloat16"),
        (False, "auto", "float32"),
        (True, "fp32", "float32"),
        (True, "bf16", "bfloat16"),  # the older name of "auto"
    ],
)
def test_the_precision_recorded_is_the_one_the_run_used(
    tmp_path, monkeypatch, native_bf16, asked, recorded
):
    """On a CPU with native bf16 the record read config["precision"],
    which this file's runs lacked: the test could not fail elsewhere."""
    monkeypatch.setattr(tools, "cpu_has_native_bf16", lambda: native_bf16)
    (tmp_path / "final.pt").touch()
    run = a_run(precision=asked)
    result = record_recipe.record("quick", 2, tmp_path, run, time.time())
    assert result["precision"] == recorded
    assert result["hardware"]["native_bf16"] is native_bf16


@pytest.mark.parametrize(
    "bleu, seconds, met",
    [(37.0, 836.0, True), (34.9, 836.0, False), (37.0, 901.0, False)],
)
def test_the_quick_goal_needs_both_the_score_and_the_time(bleu, seconds, met):
    _, goal_met = record_recipe.GOALS["quick"]
    result = {"test2016_bleu_greedy": bleu, "train_seconds": seconds}
    assert goal_met(result) is met


def test_the_curve_scores_every_epoch_file(
    local_multi30k, vocabs, tokenizers, tmp_path, one_thread, monkeypatch
):
    folder = tmp_path / "ck"
    config = tools.get_config(
        "ci", epochs=2, max_train_pairs=200, checkpoint_dir=str(folder)
    )
    began = time.time()
    tools.train_worker(0, 1, *vocabs, *tokenizers, config, show_progress=False)
    val = tat.read_multi30k("val")[:12]
    monkeypatch.setattr(record_recipe.at, "read_multi30k", lambda split: val)
    curve = record_recipe.validation_curve(folder, began)
    files = tools.epoch_checkpoints(folder)
    assert [p["epoch"] for p in curve] == [0, 1] and len(files) == 2
    sources, references = zip(*val, strict=True)
    for point, path in zip(curve, files, strict=True):
        # Independently: Part 3's batched greedy decoder, <unk> kept.
        model, vocab_src, vocab_tgt, _ = tools.load_trained_model(path, "cpu")
        hyps = tools.translate_batch(
            model,
            sources,
            tokenizers[0],
            vocab_src,
            vocab_tgt,
            decode_fn=tat.batch_greedy_decode,
            replace_unk=False,
        )
        expected = sacrebleu.corpus_bleu(hyps, [list(references)]).score
        assert point["val_bleu"] == pytest.approx(expected, abs=0.01)
        minutes = (path.stat().st_mtime - began) / 60
        assert point["minutes"] == pytest.approx(minutes, abs=0.01)
