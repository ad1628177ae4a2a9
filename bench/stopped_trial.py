"""Finish the record of a sweep trial that was stopped by hand.

A trial of `bench/recipe_sweep.py` writes its JSON only when it ends. One
stopped early (to stay inside a session, or because its validation loss
showed it would lose) leaves only its epoch files. This writes what
`time_to_bleu.py` would have: `final.pt`, a copy of the newest epoch
file, and `results/recipe_sweep/NAME.json`, whose curve is scored from
the epoch files (greedy validation BLEU, `<unk>` replaced, as
time_to_bleu scores), with each epoch's minute read from its file's
time, counted from --started.

    python bench/stopped_trial.py cpu-e18 --started 2026-11-24T10:23:48 \\
        --threads 2
"""

import argparse
import json
import os
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import recipe_sweep  # noqa: E402

import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as at  # noqa: E402


def curve(folder, started, pairs):
    """One point per epoch file: minute, steps, losses, validation BLEU."""
    files = tools.epoch_checkpoints(folder)
    history = tools.load_checkpoint(files[-1])["history"]
    sources, references = zip(*pairs, strict=True)
    points = []
    for path in files:
        epoch = tools.load_checkpoint(path)["epoch"]
        hyps = tools.translate(list(sources), str(path), device="cpu")
        seconds = path.stat().st_mtime - started
        points.append(
            {
                "epoch": epoch,
                "minutes": round(seconds / 60, 2),
                "steps": history[epoch]["steps"],
                "train_loss": round(history[epoch]["train_loss"], 4),
                "val_loss": round(history[epoch]["val_loss"], 4),
                "val_bleu": round(
                    tools.compute_bleu(hyps, references).score, 2
                ),
            }
        )
        print(f"epoch {epoch}: val BLEU {points[-1]['val_bleu']:.2f}")
    return points


def record(name, folder, started, threads, pairs):
    """The trial's JSON, in time_to_bleu.py's shape where it can be."""
    files = tools.epoch_checkpoints(folder)
    if not files:
        raise ValueError(f"{folder} has no epoch files")
    points = curve(folder, started, pairs)
    final = Path(folder, "final.pt")
    shutil.copyfile(files[-1], final)
    config = tools.load_checkpoint(final)["config"]
    args = argparse.Namespace(
        threads=threads, minutes=240.0, out_dir=Path("results/recipe_sweep")
    )
    command = recipe_sweep.command_for(name, recipe_sweep.SETTINGS[name], args)
    seconds = files[-1].stat().st_mtime - started
    return {
        "command": " ".join(["python", *map(str, command[1:])]),
        "stopped": f"by hand after epoch {points[-1]['epoch']}; final.pt"
        " is a copy of its epoch file, and this file was written by"
        " bench/stopped_trial.py",
        "hardware": tools.hardware_summary(),
        "threads": threads,
        "precision": str(tools.choose_precision("cpu").dtype or "float32"),
        "config": config,
        "train_seconds": round(seconds, 1),
        "wall_seconds": round(seconds, 1),
        "seconds_mean": "from --started to the newest epoch file's time",
        "final_val_bleu": points[-1]["val_bleu"],
        "best_val_bleu": max(p["val_bleu"] for p in points),
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "checkpoint": str(final),
        "points": points,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="stopped_trial.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("trial", help="the setting's name in recipe_sweep")
    parser.add_argument(
        "--started", required=True, help="when it started, ISO time, UTC"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--folder", help="default: runs/recipe_sweep/TRIAL")
    parser.add_argument(
        "--out", help="default: results/recipe_sweep/TRIAL.json"
    )
    parser.add_argument("--val-pairs", type=int, default=0, help="0: all")
    args = parser.parse_args(argv)
    if args.trial not in recipe_sweep.SETTINGS:
        parser.error(f"unknown setting {args.trial!r}; see recipe_sweep.py")
    try:
        started = datetime.fromisoformat(args.started)
    except ValueError:
        parser.error(f"--started {args.started!r}: expected an ISO time")
    started = started.replace(tzinfo=started.tzinfo or timezone.utc)
    torch.set_num_threads(args.threads)
    # Relative, as recipe_sweep names them, so bleu_table's rows match.
    folder = Path(args.folder or Path("runs", "recipe_sweep", args.trial))
    out = Path(args.out or Path("results", "recipe_sweep", args.trial))
    out = out.with_suffix(".json")
    pairs = at.read_multi30k("val")
    pairs = pairs[: args.val_pairs] if args.val_pairs else pairs
    try:
        result = record(
            args.trial, folder, started.timestamp(), args.threads, pairs
        )
    except (OSError, ValueError) as err:
        print(f"stopped_trial: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} and {result['checkpoint']}")
    return result


if __name__ == "__main__":
    main()
