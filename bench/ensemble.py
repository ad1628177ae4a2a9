"""BLEU of several trained models decoding together (an ensemble).

At every step of beam search each model gives its log-probabilities of
the next token; the ensemble takes the log of their mean probability.
Each model may first be the average of its last K epoch files, as in
Part 5. Choose on the validation split (the default); score test2016
once, for the choice.

    python bench/ensemble.py --run runs/recipe_sweep/cpu-d02-e18:5 \\
        --run runs/recipe_sweep/cpu-e18:3 --beam 1 4 --alpha 1.0

Rows: each model alone, then all of them together, for every beam size.
Writes OUT.json (every number, the command and the hardware) and OUT.md.
"""

import argparse
import functools
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bleu_table import (  # noqa: E402
    check_out_prefix,
    sentence_pairs,
    summary_head,
    write_summary,  # noqa: E402
)

import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402


@torch.no_grad()
def ensemble_beam_search(
    models, src, src_mask, max_len, beam_size=4, alpha=0.6
):
    """Part 5's beam search, stepping every model and averaging their
    probabilities; one model gives exactly `beam_search`."""
    caches = [
        tat.BeamCache(m, m.encode(src, src_mask), src_mask, group=beam_size)
        for m in models
    ]

    def step(ys):  # (R, 1) -> (R, V): log of the mean probability
        logps = [tat.decode_step(m, ys, c) for m, c in zip(models, caches)]
        return torch.logsumexp(torch.stack(logps), 0) - math.log(len(models))

    def select(index):
        for cache in caches:
            cache.select(index)

    return tat.beam_search_steps(
        step,
        select,
        batch_size=src.size(0),
        max_len=max_len,
        beam_size=beam_size,
        alpha=alpha,
        start_symbol=tat.BOS,
        end_symbol=tat.EOS,
        device=src.device,
    )


def member_name(folder, k):
    """How a table names a member: its run and what it decodes with."""
    decodes_with = f"last {k}" if k else "final.pt"
    return f"{folder.name} ({decodes_with})"


def run_spec(text):
    """argparse type: FOLDER:K, a run and how many epoch files to average."""
    folder, _, k = text.rpartition(":")
    if not folder or not k.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected FOLDER:K")
    if not Path(folder, "final.pt").is_file():
        raise argparse.ArgumentTypeError(f"no {folder}/final.pt")
    found = len(tools.epoch_checkpoints(folder))
    if int(k) > found:
        raise argparse.ArgumentTypeError(
            f"{text}: {folder} has {found} epoch files, not {int(k)}"
        )
    return Path(folder), int(k)


def add_run_option(parser, what="a word-level run"):
    """--run FOLDER:K, repeated: the models that decode together."""
    parser.add_argument(
        "--run",
        type=run_spec,
        action="append",
        required=True,
        metavar="FOLDER:K",
        help=f"{what}, averaged over its last K epoch files (0: final.pt);"
        " repeat for each model",
    )


def parse_args(argv=None):
    parser = tools.OneLineParser(
        prog="ensemble.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_option(parser)
    parser.add_argument(
        "--beam", type=tools.count(most=1000), nargs="+", default=[4]
    )
    parser.add_argument(
        "--alpha", type=tools.number_from(0.0, 10.0), default=1.0
    )
    parser.add_argument("--split", choices=["val", "test"], default="val")
    parser.add_argument(
        "--n", type=tools.count(least=0), default=0, help="first N (0: all)"
    )
    parser.add_argument("--threads", type=tools.count(most=1024))
    parser.add_argument("--out", default="results/ensemble_val")
    args = parser.parse_args(argv)
    check_out_prefix(parser, args.out)
    return args


def load(folder, k):
    """(model, vocab_src, vocab_tgt): final.pt, or its last K averaged."""
    model, vocab_src, vocab_tgt, _ = tools.load_translator(
        folder / "final.pt", "cpu", 1, k
    )
    return model.eval(), vocab_src, vocab_tgt


def load_members(runs):
    """(models, vocab_src, vocab_tgt) of runs that share vocabularies."""
    loaded = [load(folder, k) for folder, k in runs]
    _, vocab_src, vocab_tgt = loaded[0]
    for _, src, tgt in loaded[1:]:
        if src != vocab_src or tgt != vocab_tgt:
            raise tools.UserError("the runs' vocabularies differ")
    return [model for model, _, _ in loaded], vocab_src, vocab_tgt


def ensemble_decoder(models, beam, alpha):
    """translate_batch's decode_fn for the models decoding together."""
    decode = functools.partial(
        ensemble_beam_search, models, beam_size=beam, alpha=alpha
    )
    return lambda _model, *args: decode(*args)


def score(models, vocabs, beam, alpha, pairs, spacy_de):
    """(BLEU, seconds) of the models decoding together."""
    began = time.perf_counter()
    hypotheses = tools.translate_batch(
        models[0],
        [de for de, _ in pairs],
        spacy_de,
        *vocabs,
        decode_fn=ensemble_decoder(models, beam, alpha),
    )
    bleu = tools.compute_bleu(hypotheses, [en for _, en in pairs]).score
    return round(bleu, 2), round(time.perf_counter() - began, 1)


def markdown(summary):
    lines = [
        f"# Ensembles: BLEU on Multi30k {summary['split']}\n",
        f"- command: `{summary['command']}`",
        f"- hardware: {summary['hardware_line']}",
        f"- date: {summary['date']}",
        f"- data: {summary['data']}",
        "- BLEU: sacreBLEU corpus BLEU, cased, 13a, on detokenized output,"
        " `<unk>` replaced\n",
        "| models | beam | alpha | BLEU | decoding time (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in summary["rows"]:
        names = " + ".join(row["models"])
        alpha = row["alpha"] if row["beam"] > 1 else ""
        lines.append(
            f"| {names} | {row['beam']} | {alpha} | {row['bleu']:.2f}"
            f" | {row['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = sentence_pairs(args)
    try:
        models, *vocabs = load_members(args.run)
    except tools.UserError as err:
        raise SystemExit(f"ensemble.py: error: {err}") from None
    names = [member_name(folder, k) for folder, k in args.run]
    summary = summary_head("ensemble.py", args.split, pairs)
    spacy_de, _ = tat.load_tokenizers()
    groups = [[i] for i in range(len(models))]
    groups += [list(range(len(models)))] if len(models) > 1 else []
    for beam in args.beam:
        for group in groups:
            chosen = [models[i] for i in group]
            bleu, seconds = score(
                chosen, vocabs, beam, args.alpha, pairs, spacy_de
            )
            row = {"models": [names[i] for i in group], "beam": beam}
            row |= {"alpha": args.alpha, "bleu": bleu, "seconds": seconds}
            summary["rows"].append(row)
            print(f"{' + '.join(row['models'])}, beam {beam}: BLEU {bleu}")
    write_summary(summary, args.out, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
