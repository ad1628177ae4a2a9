"""Finish the record of a sweep trial that was stopped by hand.

A trial of `bench/recipe_sweep.py` writes its JSON only when it ends. One
stopped early (to stay inside a session, or because its validation loss
showed it would lose) leaves only its epoch files. This writes what
`time_to_bleu.py` would have: `final.pt`, a copy of the newest epoch
file, and `results/recipe_sweep/NAME.json`, whose curve is scored from
the epoch files (greedy validation BLEU, `<unk>` replaced, as
time_to_bleu scores), with each epoch's minute read from its file's
time, counted from --started.

A trial continued later from its training state (in a copy of its
folder, by the resume_command of its setting in recipe_sweep) gives
--resumed, the time the resumed run began: the pause between the last
epoch file before it and that time is not counted as training.

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


def paused_seconds(files, resumed):
    """The time between the last epoch file before `resumed` and it."""
    if resumed is None:
        return 0.0
    before = [p.stat().st_mtime for p in files if p.stat().st_mtime <= resumed]
    if not before or len(before) == len(files):
        raise ValueError("--resumed must fall between two epoch files")
    return resumed - max(before)


def training_clock(started, resumed, paused):
    """A function: seconds from `started` to a file's time, less any
    pause before `resumed`."""

    def seconds_to(path):
        moment = path.stat().st_mtime
        after_pause = resumed is not None and moment > resumed
        return moment - started - (paused if after_pause else 0.0)

    return seconds_to


def curve(folder, pairs, seconds_to):
    """One point per epoch file: minute, steps, losses, validation BLEU."""
    files = tools.epoch_checkpoints(folder)
    history = tools.load_checkpoint(files[-1])["history"]
    sources, references = zip(*pairs, strict=True)
    points = []
    for path in files:
        epoch = tools.load_checkpoint(path)["epoch"]
        hyps = tools.translate(list(sources), str(path), device="cpu")
        seconds = seconds_to(path)
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


def record(name, folder, started, threads, pairs, resumed=None):
    """The trial's JSON, in time_to_bleu.py's shape where it can be."""
    files = tools.epoch_checkpoints(folder)
    if not files:
        raise ValueError(f"{folder} has no epoch files")
    setting = recipe_sweep.SETTINGS[name]
    if (resumed is None) == ("resume_command" in setting):
        raise ValueError(
            f"{name} was resumed: give --resumed"
            if resumed is None
            else f"{name} is not a resumed trial (no resume_command)"
        )
    paused = paused_seconds(files, resumed)  # checked before scoring
    seconds_to = training_clock(started, resumed, paused)
    points = curve(folder, pairs, seconds_to)
    final = Path(folder, "final.pt")
    shutil.copyfile(files[-1], final)
    config = tools.load_checkpoint(final)["config"]
    args = argparse.Namespace(
        threads=threads, minutes=240.0, out_dir=Path("results/recipe_sweep")
    )
    origin = setting.get("resumes", name)  # the trial it continues
    command = recipe_sweep.command_for(
        origin, recipe_sweep.SETTINGS[origin], args
    )
    seconds = seconds_to(files[-1])
    result = {
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
    if "data" in setting:  # record_best then asks for its distillation
        result["data"] = setting["data"]
    if resumed is not None:
        result["resume_command"] = setting["resume_command"]
        result["paused_seconds"] = round(paused, 1)
        result["seconds_mean"] += ", less the pause before --resumed"
        result["stopped"] = (
            f"resumed by its resume_command and ended after epoch"
            f" {points[-1]['epoch']}; final.pt is a copy of its epoch file,"
            " and this file was written by bench/stopped_trial.py"
        )
    return result


def iso_seconds(parser, option, text):
    """An ISO time (UTC unless it says otherwise) as a Unix time."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        parser.error(f"{option} {text!r}: expected an ISO time")
    return moment.replace(tzinfo=moment.tzinfo or timezone.utc).timestamp()


def out_path(trial, out=None):
    """--out (.json added if it has no suffix), else
    results/recipe_sweep/TRIAL.json; a dot in TRIAL stays."""
    if out is None:
        return Path("results", "recipe_sweep", f"{trial}.json")
    out = Path(out)
    return out if out.suffix else out.with_name(out.name + ".json")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="stopped_trial.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("trial", help="the setting's name in recipe_sweep")
    parser.add_argument(
        "--started", required=True, help="when it started, ISO time, UTC"
    )
    parser.add_argument(
        "--resumed", help="when a resumed run began, ISO time, UTC"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="the threads the trial trained with: recorded, and used to"
        " score (default 2)",
    )
    parser.add_argument("--folder", help="default: runs/recipe_sweep/TRIAL")
    parser.add_argument(
        "--out", help="default: results/recipe_sweep/TRIAL.json"
    )
    parser.add_argument("--val-pairs", type=int, default=0, help="0: all")
    args = parser.parse_args(argv)
    if args.trial not in recipe_sweep.SETTINGS:
        parser.error(f"unknown setting {args.trial!r}; see recipe_sweep.py")
    started = iso_seconds(parser, "--started", args.started)
    resumed = None
    if args.resumed is not None:
        resumed = iso_seconds(parser, "--resumed", args.resumed)
    torch.set_num_threads(args.threads)
    # Relative, as recipe_sweep names them, so bleu_table's rows match.
    folder = Path(args.folder or Path("runs", "recipe_sweep", args.trial))
    out = out_path(args.trial, args.out)
    pairs = at.read_multi30k("val")
    pairs = pairs[: args.val_pairs] if args.val_pairs else pairs
    try:
        result = record(
            args.trial, folder, started, args.threads, pairs, resumed
        )
    except (OSError, ValueError) as err:
        print(f"stopped_trial: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} and {result['checkpoint']}")
    return result


if __name__ == "__main__":
    main()
