"""Record the best recipe: a sweep trial, its decoding chosen on validation,
and test2016 scored once.

The choice is made here from the validation table alone: of the rows
scoring the trial's own checkpoint folder, the one with the highest BLEU.
The test table's rows are all recorded, but only to be read; the score
of the recipe is the test BLEU of the row chosen on validation. Both
tables come from `bench/bleu_table.py`, run on the trial's checkpoint
folder with the same options, `--split val` then `--split test`:

    python bench/record_best.py results/recipe_sweep/best-d03-e14.json \\
        --val results/recipe_best_val.json \\
        --test results/recipe_best_test.json

A trial trained on an ensemble's translations (`bench/distill.py`; its
time_to_bleu JSON names the folder as "data") needs `--distill` too, the
distill.json of that folder: the record then says which models taught
it, and what the whole recipe costs, teachers' training included.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = "test2016 >= 42 with the best decoding, and greedy >= 39"


def goal_met(greedy, best):
    """Issue 18's goal for the best recipe."""
    return best >= 42 and greedy >= 39


def table(path, split, folder):
    """The rows of one bleu_table JSON that score `folder`, by setup."""
    summary = json.loads(Path(path).read_text())
    if summary["split"] != split:
        raise ValueError(f"{path} scores {summary['split']}, not {split}")
    rows = {r["setup"]: r for r in summary["rows"] if r["folder"] == folder}
    if not rows:
        raise ValueError(f"{path} has no row for {folder}")
    return summary, rows


def same_setups(val, val_rows, test, test_rows):
    """Refuse two tables that did not score the same decodings in full."""
    keys = ("beam", "average", "alpha", "checkpoints")
    for summary in (val, test):
        if "--n" in summary["command"].split():
            raise ValueError(f"{summary['command']!r} scores a subset")
    if set(val_rows) != set(test_rows) or any(
        val_rows[s].get(k) != test_rows[s].get(k)
        for s in val_rows
        for k in keys
    ):
        raise ValueError("the two tables score different setups")


def choose(val_rows):
    """The setup with the highest validation BLEU (first one on a tie)."""
    return max(val_rows.values(), key=lambda row: row["bleu"])["setup"]


def choose_greedy(val_rows):
    """The greedy setup with the highest validation BLEU: on final.pt,
    or on an average of the last epoch files (bleu_table --greedy-average)."""
    greedy = [
        setup
        for setup in val_rows
        if setup.endswith(", greedy") or ", greedy + average of" in setup
    ]
    if not greedy:
        raise ValueError("no greedy row")
    return max(greedy, key=lambda setup: val_rows[setup]["bleu"])


def record(trial, val_path, test_path):
    """The best recipe's record from the three files."""
    folder = str(Path(trial["checkpoint"]).parent)
    val, val_rows = table(val_path, "validation", folder)
    test, test_rows = table(test_path, "test2016", folder)
    same_setups(val, val_rows, test, test_rows)
    chosen = choose(val_rows)
    greedy = choose_greedy(val_rows)
    best = test_rows[chosen]["bleu"]
    greedy_bleu = test_rows[greedy]["bleu"]
    result = {
        "recipe": Path(folder).name,
        "command": trial["command"],
        "decoding_commands": [val["command"], test["command"]],
        "threads": trial["threads"],
        "hardware": trial["hardware"],
        "precision": trial["precision"],
        "config": trial["config"],
        "steps": trial["points"][-1]["steps"],
        "epochs": trial["points"][-1]["epoch"] + 1,
        "train_seconds": trial["wall_seconds"],
        "train_seconds_means": "wall time of time_to_bleu.py from after"
        " its imports to final.pt: setup, training, the checkpoint files,"
        " and every epoch's validation loss and greedy validation BLEU",
        "training_loop_seconds": trial["train_seconds"],
        "training_loop_seconds_means": "the same less setup and the"
        " validation BLEU scoring",
        "load_average_end": trial["load_average_end"],
        "test2016_bleu_greedy": greedy_bleu,
        "greedy_decoding": f"{greedy}; chosen on the validation split",
        "test2016_bleu_best": best,
        "best_decoding": f"{chosen}; chosen on the validation split",
        "validation_all_decodings": {
            s: r["bleu"] for s, r in val_rows.items()
        },
        "test2016_all_decodings": {s: r["bleu"] for s, r in test_rows.items()},
        "validation_curve": [
            {k: p[k] for k in ("epoch", "minutes", "val_loss", "val_bleu")}
            for p in trial["points"]
        ],
        "goal": GOAL,
        "goal_met": goal_met(greedy_bleu, best),
        "stopped": trial.get("stopped", "no: it ran to its end"),
    }
    return result | by_hand(trial)


def distillation(trial, distill, sweep_dir):
    """What a student's record adds: its data, its teachers and the time
    the whole recipe takes (each teacher's time from its sweep JSON)."""
    if "data" not in trial:
        raise ValueError("--distill is for a trial trained on --data")
    if Path(distill["folder"]).resolve() != Path(trial["data"]).resolve():
        raise ValueError(
            f"the distillation wrote {distill['folder']}, and the trial"
            f" trained on {trial['data']}"
        )
    teachers = [spec.rpartition(":")[0] for spec in distill["runs"]]
    seconds = []
    for folder in teachers:
        teacher = json.loads(
            Path(sweep_dir, f"{Path(folder).name}.json").read_text()
        )
        seconds.append(teacher["wall_seconds"])
    total = sum(seconds) + distill["seconds"] + trial["wall_seconds"]
    return {
        "training_data": f"{trial['data']}: the training German with the"
        " teachers' English (bench/distill.py); validation and test2016"
        " unchanged",
        "distillation": distill,
        "teachers_train_seconds": seconds,
        "distill_seconds": distill["seconds"],
        "recipe_seconds": round(total, 1),
        "recipe_seconds_means": "the teachers' train_seconds, the"
        " distillation's decoding and the student's train_seconds, added"
        " up as if run one after another",
    }


def by_hand(trial):
    """What a record of bench/stopped_trial.py says in place of
    time_to_bleu's timing: how its seconds were counted, and for a
    trial resumed from its training state, that command and the pause."""
    if "seconds_mean" not in trial:
        return {}
    fields = {
        "train_seconds_means": trial["seconds_mean"],
        "training_loop_seconds": None,
        "training_loop_seconds_means": "not measured apart for a trial"
        " recorded by bench/stopped_trial.py",
    }
    for key in ("resume_command", "paused_seconds"):
        if key in trial:
            fields[key] = trial[key]
    return fields


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="record_best.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("trial", help="the trial's time_to_bleu JSON")
    parser.add_argument("--val", required=True, help="bleu_table JSON, val")
    parser.add_argument("--test", required=True, help="bleu_table JSON, test")
    parser.add_argument(
        "--distill", help="distill.json of the folder a student trained on"
    )
    parser.add_argument("--out", default="results/recipe_best.json")
    args = parser.parse_args(argv)
    try:
        trial = json.loads(Path(args.trial).read_text())
        result = record(trial, args.val, args.test)
        if "data" in trial and not args.distill:
            raise ValueError(
                f"{args.trial} trained on {trial['data']}: give --distill"
            )
        if args.distill:
            distill = json.loads(Path(args.distill).read_text())
            sweep_dir = Path(args.trial).parent
            result |= distillation(trial, distill, sweep_dir)
    except (OSError, ValueError, KeyError) as err:
        print(f"record_best: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{result['recipe']}: greedy {result['test2016_bleu_greedy']:.2f},"
        f" {result['best_decoding']}: {result['test2016_bleu_best']:.2f};"
        f" goal met: {result['goal_met']}; wrote {args.out}"
    )
    return result


if __name__ == "__main__":
    main()
