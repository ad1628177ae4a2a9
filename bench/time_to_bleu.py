"""Time to quality: train one preset, score validation BLEU as it trains.

Trains a preset with the appendix's training pieces (`TrainingRun`,
`train_epoch`) and, every `--eval-every` optimizer steps
and at the end of every epoch, decodes the validation split greedily and
scores it with sacreBLEU. Each point records the training time (the time
spent scoring BLEU is left out), the optimizer steps, the real target
tokens seen, the validation loss and the validation BLEU. The run is
written as one JSON file, and the curve (BLEU against minutes) as a chart.

Tune on the validation split only. `--score-test` decodes test2016 once,
at the very end, for a final recipe; never use it to choose a setting.

    MULTI30K_DIR=/work/shared/multi30k python bench/time_to_bleu.py \\
        --preset cpu --set schedule=linear --set warmup=200 --epochs 3
"""

import dataclasses
import itertools
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as at  # noqa: E402


class EveryKSteps:
    """A train loader that calls `hook()` every `k` optimizer steps.

    Part 2's `run_epoch` pulls a batch while it trains on the one before
    (it looks one ahead), and it trains on every batch it pulls. So when
    this loader is asked for a batch, the steps counted in `run.state`
    are finished, and the model can be scored between two batches.
    `hook` returns True to end the epoch early (a time budget ran out).
    The loader also ends the epoch once `max_batches` batches have been
    handed out over the whole run (0: no limit).
    """

    def __init__(self, loader, run, k, hook, max_batches=0, handed=0):
        self.loader, self.run, self.k, self.hook = loader, run, k, hook
        self.batch_sampler = loader.batch_sampler  # train_epoch reshuffles
        self.max_batches, self.handed = max_batches, handed
        self.handed_all = False  # True once every batch was handed out

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        next_score = (
            self.k * (self.run.state.accum_step // self.k + 1) if self.k else 0
        )
        for batch in self.loader:
            if self.max_batches and self.handed >= self.max_batches:
                return
            step = self.run.state.accum_step
            if self.k and step >= next_score:
                next_score = self.k * (step // self.k + 1)
                if self.hook():
                    return
            self.handed += 1
            yield batch
        self.handed_all = True


def parse_value(field, text):
    """`text` converted to the type of a TrainConfig field."""
    kind = {f.name: f.type for f in dataclasses.fields(at.TrainConfig)}
    if field not in kind:
        raise ValueError(f"TrainConfig has no field {field!r}")
    if field == "data":  # its folder is checked, and MULTI30K_DIR set
        raise ValueError("--set data=...: use --data FOLDER")
    kind = kind[field]
    if kind in (bool, "bool"):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{field}={text}: use true or false")
        return text.lower() in ("true", "1")
    for name, cast in (("an int", int), ("a float", float)):
        if kind in (cast, cast.__name__):
            try:
                return cast(text)
            except ValueError:
                raise ValueError(f"{field}={text}: expected {name}") from None
    return text


def overrides_from(settings):
    """A dict of TrainConfig fields from a list of KEY=VALUE strings."""
    overrides = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item}: expected KEY=VALUE")
        overrides[key] = parse_value(key, value)
    return overrides


def machine_line():
    """One line naming the CPU or GPU, the threads and the load."""
    info = tools.hardware_summary()
    gpus = ", ".join(info.get("gpus", []))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    where = f"GPU {gpus}" if gpus else f"CPU {info['cpu']}"
    cores = os.cpu_count()
    return (
        f"{where}; {info['cpu_threads']} threads of {cores} cores;"
        f" torch {info['torch']}; load average {load}"
    )


class Benchmark:
    """One training run, scored on the validation split as it goes."""

    def __init__(
        self, config, eval_every, val_pairs, minutes, device, max_steps=0
    ):
        if tools.epoch_checkpoints(config.checkpoint_dir):
            raise ValueError(
                f"{config.checkpoint_dir} already holds epoch files of an"
                " earlier run, which averaging would mix with this one's;"
                " give another --checkpoint-dir"
            )
        self.config, self.eval_every = config, eval_every
        self.minutes, self.max_steps = minutes, max_steps
        self.spacy_de, self.spacy_en = at.load_tokenizers()
        vocabs = tools.load_vocabularies(config, *self.tokenizers)
        self.vocab_src, self.vocab_tgt = vocabs
        self.vocabs = vocabs
        pairs = at.read_multi30k("val")
        self.val_pairs = pairs[:val_pairs] if val_pairs else pairs
        self.loaders = at.create_dataloaders(
            *vocabs,
            *self.tokenizers,
            max_tokens=config.max_tokens,
            max_len=config.max_len,
            seed=config.seed,
            num_workers=config.num_workers,
            max_train_pairs=config.max_train_pairs,
        )
        sizes = (len(self.vocab_src), len(self.vocab_tgt))
        total = max_steps if max_steps else None
        batches = len(self.loaders[0])
        self.run = tools.TrainingRun(
            0, 1, sizes, config, False, None, device, batches, total
        )
        self.points, self.scoring = [], 0.0
        self.out_of_time = False

    @property
    def tokenizers(self):
        return self.spacy_de, self.spacy_en

    def train_seconds(self):
        """Seconds since the start, less the time spent scoring BLEU."""
        return time.perf_counter() - self.start - self.scoring

    def bleu(self, pairs):
        """Greedy BLEU of the model on (German, English) pairs."""
        with torch.no_grad():
            hypotheses = tools.translate_batch(
                self.run.module,
                [de for de, _ in pairs],
                self.spacy_de,
                self.vocab_src,
                self.vocab_tgt,
            )
        return tools.compute_bleu(hypotheses, [en for _, en in pairs]).score

    def val_loss(self):
        """The validation loss per target token, dropout off."""
        loss = at.SimpleLossCompute(
            self.run.module.generator, self.run.criterion
        )
        batches = (
            tools.device_batch(s, t, self.run.device)
            for s, t in self.loaders[1]
        )
        self.run.model.eval()
        with torch.no_grad():
            value, _ = at.run_epoch(
                batches,
                self.run.model,
                loss,
                mode="eval",
                autocast=self.run.autocast,
            )
        return value

    def score(self, epoch):
        """Record one point of the curve; True when time is up."""
        seconds = self.train_seconds()
        began = time.perf_counter()
        was_training = self.run.model.training
        point = {
            "epoch": epoch,
            "train_seconds": round(seconds, 1),
            "minutes": round(seconds / 60, 2),
            "steps": self.run.state.accum_step,
            "target_tokens": self.run.state.tokens,
            "val_loss": round(self.val_loss(), 4),
            "val_bleu": round(self.bleu(self.val_pairs), 2),
        }
        self.run.model.train(was_training)
        self.scoring += time.perf_counter() - began
        point["score_seconds"] = round(time.perf_counter() - began, 1)
        point["load_average"] = round(os.getloadavg()[0], 2)
        self.points.append(point)
        print(
            f"{point['minutes']:6.2f} min  step {point['steps']:5d}  "
            f"val loss {point['val_loss']:.3f}  BLEU {point['val_bleu']:5.2f}",
            flush=True,
        )
        self.out_of_time = bool(self.minutes) and seconds > 60 * self.minutes
        return self.out_of_time

    def train(self):
        """Train every epoch, scoring every K steps and after each epoch."""
        self.start = time.perf_counter()
        train_loader, valid_loader = self.loaders
        max_batches = self.max_steps * self.config.accum_iter
        handed = 0
        epochs = (
            itertools.count() if max_batches else range(self.config.epochs)
        )
        for epoch in epochs:
            hook = lambda e=epoch: self.score(e)  # noqa: E731
            loader = EveryKSteps(
                train_loader,
                self.run,
                self.eval_every,
                hook,
                max_batches,
                handed,
            )
            tools.train_epoch(
                self.run, epoch, loader, valid_loader, show=False
            )
            handed = loader.handed
            if self.out_of_time:
                break
            if loader.handed_all:  # a whole epoch: keep it for averaging
                tools.save_epoch(self.run, epoch, *self.vocabs)
            last = self.points[-1]["steps"] if self.points else -1
            if last != self.run.state.accum_step and self.score(epoch):
                break
            if max_batches and handed >= max_batches:
                break
        return self.train_seconds()


def chart(points, path, title):
    """Write validation BLEU against training minutes as PNG or SVG."""
    line = tools.line_chart(
        points, "minutes", "val_bleu", title=title, point=True
    )
    if Path(path).suffix == ".png":
        line.save(str(path), scale_factor=1.5)
    else:
        line.save(str(path))


def build_parser():
    parser = tools.OneLineParser(
        prog="time_to_bleu.py",
        description="Train one preset; score validation BLEU as it trains.",
    )
    parser.add_argument("--preset", default="cpu", help="default: cpu")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="replace a TrainConfig field (repeatable): --set warmup=200",
    )
    parser.add_argument("--epochs", type=tools.whole_number, help="epochs")
    parser.add_argument(
        "--eval-every",
        type=tools.count(least=0, most=10**7),
        default=0,
        metavar="K",
        help="also score every K optimizer steps (default 0: epochs only)",
    )
    parser.add_argument(
        "--val-pairs",
        type=tools.count(least=0, most=10**7),
        default=0,
        help="score the first N validation pairs (default 0: all 1,014)",
    )
    parser.add_argument(
        "--max-steps",
        type=tools.count(least=0, most=10**7),
        default=0,
        help="stop after this many optimizer steps, however many epochs;"
        " a linear schedule reaches zero there (default 0: --epochs)",
    )
    parser.add_argument(
        "--minutes",
        type=tools.number_from(0.0, 100_000.0),
        default=0.0,
        help="stop at the first score after this much training (0: none)",
    )
    parser.add_argument(
        "--threads",
        type=tools.whole_number,
        default=None,
        help="torch threads (default: torch's choice)",
    )
    parser.add_argument(
        "--device",
        type=tools.existing_device,
        default="cpu",
        help="cpu (default), cuda, cuda:1, mps, or auto: the fastest here",
    )
    parser.add_argument(
        "--out",
        default="results/time_to_bleu/run.json",
        help="the JSON file (default results/time_to_bleu/run.json)",
    )
    parser.add_argument(
        "--chart",
        default=None,
        help="chart file, .png or .svg (default: --out with .png)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where final.pt goes (default: the preset's, under runs/)",
    )
    parser.add_argument(
        "--data",
        metavar="FOLDER",
        help="train on this folder's training pairs, as `train --data`"
        " (e.g. bench/distill.py's); validation stays Multi30k's own",
    )
    parser.add_argument(
        "--score-test",
        action="store_true",
        help="decode test2016 once at the end: final recipes only",
    )
    return parser


def config_from(args):
    """The preset's TrainConfig with the command line's replacements."""
    overrides = overrides_from(args.set)
    if args.epochs:
        overrides["epochs"] = args.epochs
    folder = args.checkpoint_dir or f"runs/time_to_bleu/{args.preset}"
    overrides.setdefault("checkpoint_dir", folder)
    return tools.get_config(args.preset, **overrides)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    for option, path in (("--out", args.out), ("--chart", args.chart)):
        if path and Path(path).is_dir():  # refused now, not after training
            parser.error(f"{option} {path} is a folder")
    try:
        config = config_from(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        command = shlex.join(["python", "bench/time_to_bleu.py", *argv])
        print(machine_line())
        print(command, flush=True)
        started = time.perf_counter()
        data = None
        if args.data:
            tools.download_multi30k()  # the vocabularies' source, checked
            data, config = tools.checked_data_folder(args.data, config)
        with tools.multi30k_from(data):
            bench = Benchmark(
                config,
                args.eval_every,
                args.val_pairs,
                args.minutes,
                args.device,
                args.max_steps,
            )
        print(tools.describe_device(bench.run.device, bench.run.precision))
        train_seconds = bench.train()
        extra = {"epoch": bench.points[-1]["epoch"]}
        tools.save_run(
            bench.run, "final.pt", bench.vocab_src, bench.vocab_tgt, **extra
        )
        result = {
            "command": command,
            "machine": platform.node(),
            "hardware": tools.hardware_summary(),
            "threads": torch.get_num_threads(),
            "precision": str(bench.run.precision.dtype or "float32"),
            "config": dataclasses.asdict(config),
            "steps_per_epoch": len(bench.loaders[0]) // config.accum_iter,
            "max_steps": args.max_steps,
            "train_seconds": round(train_seconds, 1),
            "wall_seconds": round(time.perf_counter() - started, 1),
            "stopped_by_time": bench.out_of_time,
            "final_val_bleu": bench.points[-1]["val_bleu"],
            "best_val_bleu": max(p["val_bleu"] for p in bench.points),
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "checkpoint": str(Path(config.checkpoint_dir, "final.pt")),
            "points": bench.points,
        }
        if data:  # record_best asks for the distillation's record
            result["data"] = args.data
        if args.score_test:
            test = at.read_multi30k("test")
            result["test2016_bleu_greedy"] = round(bench.bleu(test), 2)
            print(f"test2016 greedy BLEU {result['test2016_bleu_greedy']:.2f}")
        out = Path(args.out)
        with tools.atomic_write(out, "w") as f:  # makes the folder too
            f.write(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
        picture = args.chart or out.with_suffix(".png")
        try:
            title = f"{out.stem} ({config.preset}): validation BLEU"
            chart(bench.points, picture, title)
            print(f"wrote {picture}")
        except Exception as err:  # no vl-convert: the JSON still stands
            print(f"time_to_bleu: no chart ({err})", file=sys.stderr)
        return result
    except (tools.UserError, at.DatasetError, ValueError, OSError) as err:
        print(f"time_to_bleu: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
