"""Train a final recipe once, through the command line, and record it.

Runs `annotated_transformer_tools.py train --preset PRESET --results ...`
in a fresh process, which trains and then scores test2016 once, and
writes `results/recipe_NAME.json` with what the issue asks of a recipe:
the command, the threads, the hardware, `train_seconds` (from the moment
the process starts to the moment `final.pt` is written, setup included),
and the greedy test2016 BLEU, with and without `<unk>` replacement.

This is for a recipe already chosen on the validation split
(`bench/recipe_sweep.py`); it reads test2016, so run it once per recipe.

    MULTI30K_DIR=/work/shared/multi30k python bench/record_recipe.py \\
        quick --threads 2
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as at  # noqa: E402


def train_args(preset, threads):
    """The `train` options that define the recipe's run."""
    return ["train", "--preset", preset, "--threads", str(threads)]


def train_command(preset, threads, checkpoint_dir, results):
    """The command line that trains the recipe and scores test2016."""
    script = str(ROOT / "annotated_transformer_tools.py")
    return [
        sys.executable,
        script,
        *train_args(preset, threads),
        "--checkpoint-dir",
        str(checkpoint_dir),
        "--results",
        str(results),
    ]


GOALS = {  # issue 18's goals, per recipe: (text, test passed?)
    "quick": (
        "test2016 greedy BLEU >= 35 after <= 15 minutes of training,"
        " 2 threads",
        lambda r: (
            r["test2016_bleu_greedy"] >= 35 and r["train_seconds"] <= 15 * 60
        ),
    ),
}


def validation_curve(checkpoint_dir, began):
    """Greedy validation BLEU of every epoch file, against its minute.

    Scored after training, from the epoch checkpoints the run wrote, so
    the scoring takes none of the training's time; an epoch's minute is
    when its file was written. Plain greedy decoding, `<unk>` kept, as
    Part 3 decodes. Validation only: choosing nothing, this draws the
    run's curve.
    """
    sources, references = zip(*at.read_multi30k("val"), strict=True)
    points = []
    for path in tools.epoch_checkpoints(checkpoint_dir):
        hyps = tools.translate(
            list(sources), str(path), replace_unk=False, device="cpu"
        )
        bleu = tools.compute_bleu(hyps, references).score
        epoch = tools.load_checkpoint(path)["epoch"]
        minutes = (path.stat().st_mtime - began) / 60
        points.append(
            {
                "epoch": epoch,
                "minutes": round(minutes, 2),
                "val_bleu": round(bleu, 2),
            }
        )
        print(f"epoch {epoch}: {minutes:.1f} min, val BLEU {bleu:.2f}")
    return points


def record(preset, threads, checkpoint_dir, run, began):
    """The recipe's record, from the train command's own summary."""
    final = Path(checkpoint_dir, "final.pt")
    config = run["config"]
    steps = run["history"][-1]["steps"]
    hardware = tools.hardware_summary()
    hardware["native_bf16"] = tools.cpu_has_native_bf16()
    return {
        "recipe": preset,
        "command": shlex.join(
            [
                "python",
                "bench/record_recipe.py",
                preset,
                "--threads",
                str(threads),
            ]
        ),
        "train_command": shlex.join(
            [
                "python",
                "annotated_transformer_tools.py",
                *train_args(preset, threads),
            ]
        ),
        "machine": platform.node(),
        "threads": threads,
        "hardware": hardware,
        "precision": (
            "bfloat16"
            if hardware["native_bf16"] and config["precision"] != "fp32"
            else "float32"
        ),
        "precision_note": "config.precision 'auto' (older name 'bf16')"
        " means 16-bit autocast only where the hardware computes it"
        " natively (hardware.native_bf16 on a CPU)",
        "config": config,
        "epochs": run["epochs"],
        "steps": steps,
        "train_seconds": round(final.stat().st_mtime - began, 1),
        "train_seconds_means": "from the start of the training process to"
        " the moment final.pt was written: setup, every epoch's validation"
        " loss and the checkpoint files included",
        "training_loop_seconds": run["wall_time_s"],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "test2016_bleu_greedy": run["test2016_bleu_greedy"],
        "test2016_bleu_greedy_without_unk_replacement": run[
            "test2016_bleu_greedy_without_unk_replacement"
        ],
        "test2016_sacrebleu": run["bleu"],
        "decoding": "greedy (cached), <unk> replaced by the attended German"
        " word; the other score keeps <unk>, as Part 3 decodes",
        "history": run["history"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="record_recipe.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("preset", help="the recipe's preset, e.g. quick")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="default: results/recipe_PRESET.json")
    args = parser.parse_args(argv)
    out = Path(args.out or ROOT / "results" / f"recipe_{args.preset}.json")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint_dir = Path(ROOT, "runs", "recipes", args.preset)
        summary = Path(tmp, "summary.json")
        command = train_command(
            args.preset, args.threads, checkpoint_dir, summary
        )
        print(shlex.join(command), flush=True)
        began = time.time()
        done = subprocess.run(command, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(
                f"record_recipe: training exited {done.returncode}"
            )
        run = json.loads(summary.read_text())
        result = record(args.preset, args.threads, checkpoint_dir, run, began)
        result["validation_curve"] = validation_curve(checkpoint_dir, began)
    if args.preset in GOALS:
        text, met = GOALS[args.preset]
        result["goal"], result["goal_met"] = text, met(result)
    out.write_text(json.dumps(result, indent=1) + "\n")
    minutes = result["train_seconds"] / 60
    print(
        f"{args.preset}: {minutes:.1f} min of training, test2016 greedy"
        f" BLEU {result['test2016_bleu_greedy']:.2f}; wrote {out}"
    )


if __name__ == "__main__":
    main()
