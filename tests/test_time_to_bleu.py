"""bench/time_to_bleu.py on the tiny `ci` preset: the points it records
against counts made independently from the data, the step budget, the
linear schedule, and one-line errors."""

import importlib.util
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

ROOT = Path(__file__).resolve().parent.parent


def bench_script(name):
    """bench/NAME.py, imported as a module."""
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "bench" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


time_to_bleu = bench_script("time_to_bleu")

PAIRS = 200  # training pairs: a run takes seconds


def ci_config(tmp_path, **overrides):
    folder = str(tmp_path / "ck")
    fields = {"max_train_pairs": PAIRS, "checkpoint_dir": folder}
    return tools.get_config("ci", **fields | overrides)


def target_tokens_per_epoch(vocabs, tokenizers, config):
    """Real target tokens in one epoch, counted from the data itself."""
    pairs = tat.read_multi30k("train")[:PAIRS]
    data = tat.encode_pairs(pairs, *vocabs, *tokenizers)
    kept = [t for s, t in data if max(len(s), len(t)) <= config.max_len]
    return sum(len(t) - 1 for t in kept)  # the target less its <s>


def test_points_count_steps_and_tokens(
    local_multi30k, vocabs, tokenizers, tmp_path, one_thread
):
    config = ci_config(tmp_path, epochs=2)
    bench = time_to_bleu.Benchmark(config, 2, 20, 0, "cpu")
    bench.train()
    steps_per_epoch = len(bench.loaders[0])
    points = bench.points
    assert points[-1]["steps"] == 2 * steps_per_epoch
    per_epoch = target_tokens_per_epoch(vocabs, tokenizers, config)
    assert points[-1]["target_tokens"] == 2 * per_epoch
    # A point every 2 steps (one step late at most: run_epoch looks one
    # batch ahead), and one at the end of each epoch.
    steps = [p["steps"] for p in points]
    assert steps == sorted(set(steps))
    assert steps_per_epoch in steps and 2 * steps_per_epoch in steps
    gaps = [b - a for a, b in zip([0, *steps], steps)]
    assert max(gaps) <= 3 and len(points) >= steps_per_epoch
    seconds = [p["train_seconds"] for p in points]
    assert seconds == sorted(seconds) and seconds[0] >= 0
    assert all(0 <= p["val_bleu"] <= 100 for p in points)
    assert all(math.isfinite(p["val_loss"]) for p in points)


def test_step_budget_and_linear_schedule(
    local_multi30k, vocabs, tokenizers, tmp_path, one_thread
):
    config = ci_config(tmp_path, schedule="linear", warmup=3, epochs=1)
    bench = time_to_bleu.Benchmark(config, 0, 10, 0, "cpu", max_steps=7)
    assert len(bench.loaders[0]) < 7  # so the budget crosses an epoch
    bench.train()
    assert bench.run.state.accum_step == 7
    assert bench.points[-1]["steps"] == 7
    assert bench.run.optimizer.param_groups[0]["lr"] == 0  # at the end
    # Only whole epochs leave an epoch file (for averaging), each holding
    # the weights as they were at the end of its epoch.
    files = tools.epoch_checkpoints(tmp_path / "ck")
    whole = 7 // len(bench.loaders[0])
    assert [f.name for f in files] == [
        f"epoch_{e:03d}.pt" for e in range(whole)
    ]
    assert [tools.load_checkpoint(f)["epoch"] for f in files] == list(
        range(whole)
    )
    last = tools.load_checkpoint(tmp_path / "ck" / "last.pt")
    assert last["train_state"]["accum_step"] == whole * len(bench.loaders[0])
    newest = tools.load_checkpoint(files[-1])["model"]
    for name, weight in last["model"].items():
        assert torch.equal(weight, newest[name]), name


def test_linear_schedule_shape():
    peak = tat.rate(50, 64, 2.0, 50)
    lrs = [tat.warmup_then_linear(s, peak, 50, 300) for s in range(301)]
    assert lrs[50] == pytest.approx(peak) and max(lrs) == lrs[50]
    assert lrs[300] == 0 and lrs[175] == pytest.approx(peak / 2)
    assert lrs[25] == pytest.approx(peak / 2)


def learning_rates(config, steps_per_epoch, steps):
    model = torch.nn.Linear(2, 2)
    opt, sched = tat.make_run_optimizer(model, config, steps_per_epoch)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def paper_rate(step, d_model, factor, warmup):
    """The paper's formula (section 5.3), written out here; step 0 is
    taken as step 1, as the library does."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def test_make_run_optimizer_follows_the_config():
    linear = tools.get_config("ci", schedule="linear", epochs=2, warmup=3)
    lrs = learning_rates(linear, steps_per_epoch=5, steps=11)
    peak = paper_rate(3, linear.d_model, linear.factor, 3)
    assert lrs[3] == pytest.approx(peak) and max(lrs) == lrs[3]
    assert lrs[10] == 0 and lrs[0] == pytest.approx(peak / 3)
    # accum_iter=2 over 5 batches: run_epoch steps after batches 2, 4 and
    # 5 (a short last window), so 3 steps an epoch, 6 in all, not 5.
    accumulated = replace(linear, accum_iter=2)
    lrs = learning_rates(accumulated, steps_per_epoch=5, steps=7)
    assert lrs[5] > 0 and lrs[6] == 0
    noam = tools.get_config("ci", schedule="noam", warmup=3)
    lrs = learning_rates(noam, steps_per_epoch=5, steps=11)
    c = noam
    expected = [
        paper_rate(k, c.d_model, c.factor, c.warmup) for k in range(11)
    ]
    assert lrs == pytest.approx(expected)


def test_unknown_schedule_is_a_value_error(tmp_path):
    config = tools.get_config("ci", schedule="cosine")
    with pytest.raises(ValueError, match="cosine"):
        tools.TrainingRun(0, 1, (20, 20), config, False, None, "cpu", 10)


def test_a_linear_run_must_know_its_step_budget():
    config = tools.get_config("ci", schedule="linear")
    with pytest.raises(ValueError, match="batches_per_epoch"):
        tools.TrainingRun(0, 1, (20, 20), config, False, device="cpu")
    run = tools.TrainingRun(0, 1, (20, 20), config, False, None, "cpu", 10)
    steps = math.ceil(10 / config.accum_iter) * config.epochs
    lr = run.scheduler.lr_lambdas[0]  # the rate after a number of steps
    assert lr(steps - 1) > 0 and lr(steps) == 0  # zero at the budget's end


def test_command_line_writes_json_and_chart(local_multi30k, tmp_path):
    out = tmp_path / "run.json"
    threads = torch.get_num_threads()
    argv = ["--preset", "ci", "--set", f"max_train_pairs={PAIRS}"]
    argv += ["--epochs", "1", "--val-pairs", "10", "--threads", "1"]
    argv += ["--out", str(out), "--checkpoint-dir", str(tmp_path / "ck")]
    try:
        result = time_to_bleu.main(argv)
    finally:
        torch.set_num_threads(threads)
    saved = json.loads(out.read_text())
    assert saved["command"].endswith(" ".join(argv))
    assert saved["threads"] == 1 and saved["config"]["preset"] == "ci"
    assert saved["points"] == result["points"]
    assert (tmp_path / "ck" / "final.pt").is_file()
    # vl-convert-python is a requirement: the chart must be there.
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--set", "nosuch=1"], "no field 'nosuch'"),
        (["--set", "warmup=ten"], "expected an int"),
        (["--set", "warmup"], "KEY=VALUE"),
        (["--preset", "huge"], "unknown preset"),
        (["--device", "cuda:7"], "no cuda:7 here"),  # also on one GPU
        (["--device", "gpu"], "'gpu' is not a device"),
        (["--minutes", "-5"], "--minutes"),
        (["--chart", "."], "--chart . is a folder"),  # before any training
    ],
)
def test_errors_are_one_line(argv, words, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        time_to_bleu.main([*argv, "--out", str(tmp_path / "x.json")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_train_worker_follows_the_linear_schedule(
    local_multi30k, vocabs, tokenizers, tmp_path, one_thread
):
    config = ci_config(tmp_path, schedule="linear", warmup=2, epochs=2)
    tools.train_worker(0, 1, *vocabs, *tokenizers, config, device="cpu")
    last = tools.load_checkpoint(tmp_path / "ck" / "last.pt")
    assert last["optimizer"]["param_groups"][0]["lr"] == 0  # the last step
    noam = ci_config(tmp_path / "noam", warmup=2, epochs=2)
    tools.train_worker(0, 1, *vocabs, *tokenizers, noam, device="cpu")
    last = tools.load_checkpoint(tmp_path / "noam" / "ck" / "last.pt")
    assert last["optimizer"]["param_groups"][0]["lr"] > 0


def test_a_folder_with_epoch_files_is_refused(local_multi30k, tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "epoch_000.pt").write_bytes(b"an earlier run")
    with pytest.raises(ValueError, match="already holds epoch files"):
        time_to_bleu.Benchmark(ci_config(tmp_path), 0, 10, 0, "cpu")


def test_stopped_trial_rebuilds_the_curve_from_epoch_files(
    local_multi30k, tmp_path, one_thread, monkeypatch
):
    stopped_trial = bench_script("stopped_trial")
    config = ci_config(tmp_path, epochs=2)
    bench = time_to_bleu.Benchmark(config, 0, 10, 0, "cpu")
    started = time.time()
    bench.train()
    pairs = tat.read_multi30k("val")[:10]
    folder = tmp_path / "ck"
    # On a simulated CPU with native bf16, training would have used bf16
    # autocast, and the record says so.
    monkeypatch.setattr(tools, "cpu_has_native_bf16", lambda: True)
    result = stopped_trial.record("cpu-e18", folder, started, 1, pairs)
    assert result["precision"] == "torch.bfloat16"
    files = tools.epoch_checkpoints(folder)
    assert (folder / "final.pt").read_bytes() == files[-1].read_bytes()
    points = result["points"]
    assert [p["epoch"] for p in points] == [0, 1]
    # Independently: the BLEU and losses the live run scored at the end
    # of each epoch, on the same ten sentences.
    live = bench.points
    assert [p["val_bleu"] for p in points] == [p["val_bleu"] for p in live]
    assert [p["steps"] for p in points] == [p["steps"] for p in live]
    for ours, theirs in zip(points, live, strict=True):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], abs=1e-3)
    assert 0 <= points[0]["minutes"] <= points[1]["minutes"]
    assert "recipe_sweep/cpu-e18.json" in result["command"]


def test_stopped_trial_leaves_out_the_pause_before_a_resume(
    local_multi30k, tmp_path, one_thread
):
    import os

    stopped_trial = bench_script("stopped_trial")
    config = ci_config(tmp_path, epochs=2)
    time_to_bleu.Benchmark(config, 0, 10, 0, "cpu").train()
    folder = tmp_path / "ck"
    first, second = tools.epoch_checkpoints(folder)
    # Epoch 0 ends a minute after the start; the run is resumed 14
    # minutes later, and epoch 1 ends 2 minutes after the resume.
    started = 1_000_000.0
    os.utime(first, (started + 60, started + 60))
    os.utime(second, (started + 60 + 840 + 120,) * 2)
    resumed = started + 60 + 840
    pairs = tat.read_multi30k("val")[:4]
    result = stopped_trial.record(
        "cpu-e18-e14", folder, started, 1, pairs, resumed
    )
    assert [p["minutes"] for p in result["points"]] == [1.0, 3.0]
    assert result["train_seconds"] == 180.0
    assert result["paused_seconds"] == 840.0
    assert "--resume " in result["resume_command"]
    assert "recipe_sweep/cpu-e18.json" in result["command"]  # the origin
    with pytest.raises(ValueError, match="between two epoch files"):
        stopped_trial.record(
            "cpu-e18-e14", folder, started, 1, pairs, started + 5000
        )
    with pytest.raises(ValueError, match="not a resumed trial"):
        stopped_trial.record("cpu-e18", folder, started, 1, pairs, resumed)
    with pytest.raises(ValueError, match="give --resumed"):
        stopped_trial.record("cpu-e18-e14", folder, started, 1, pairs)


def test_recipe_sweep_refuses_trials_it_cannot_run(tmp_path, capsys):
    recipe_sweep = bench_script("recipe_sweep")
    out = ["--out-dir", str(tmp_path), "--table", str(tmp_path / "t.md")]
    for trial, words in (
        ("nope", "unknown setting"),
        ("cpu-e18-e14", "by hand"),
    ):
        with pytest.raises(SystemExit) as stop:
            recipe_sweep.main([trial, *out])
        assert stop.value.code == 2
        assert words in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for argv, words in (
        (["--out-dir", str(a_file)], "is not a folder"),
        (["--threads", "0", *out], "--threads"),
        (["--minutes", "-1", *out], "--minutes"),
    ):
        with pytest.raises(SystemExit) as stop:
            recipe_sweep.main(["q3000-d00", *argv])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "t.md").exists()  # nothing ran, nothing written


def test_stopped_trial_keeps_a_dot_in_the_trial_name():
    stopped_trial = bench_script("stopped_trial")
    default = stopped_trial.out_path("cpu-alpha1.8")
    assert default == Path("results/recipe_sweep/cpu-alpha1.8.json")
    assert stopped_trial.out_path("x", "elsewhere/y.json") == Path(
        "elsewhere/y.json"
    )
    assert stopped_trial.out_path("x", "elsewhere/y") == Path(
        "elsewhere/y.json"
    )


def test_set_data_is_refused_for_data():
    """A folder named by --set would skip --data's checks."""
    with pytest.raises(ValueError, match="--data FOLDER"):
        time_to_bleu.overrides_from(["data=elsewhere"])


@pytest.mark.parametrize("preset", ["cpu", "quick"])  # noam, linear
def test_run_schedule_is_the_rate_the_optimizer_follows(preset):
    config = tools.get_config(preset)
    schedule = tat.run_schedule(config, batches_per_epoch=153)
    lrs = learning_rates(config, steps_per_epoch=153, steps=30)
    assert lrs == pytest.approx([schedule(step) for step in range(30)])
    peak = paper_rate(
        config.warmup, config.d_model, config.factor, config.warmup
    )
    assert schedule(config.warmup) == pytest.approx(peak)
    if config.schedule == "linear":  # zero at the last step, counted here
        steps = math.ceil(153 / config.accum_iter) * config.epochs
        assert schedule(steps - 1) > 0 and schedule(steps) == 0
