"""BLEU on test2016 (or validation) for the decoding options of notebook 05.

    python bench/bleu_table.py                       # checkpoints/cpu{,-bpe}
    python bench/bleu_table.py --word DIR --bpe DIR --average 5 --n 100

For each checkpoint folder, word-level (--word) and BPE + tied embeddings
(--bpe), it scores greedy decoding, beam search, and beam search on the
average of the last K epoch checkpoints for each K of --average; with
several --beam sizes or --alpha values (the beam's length penalty),
every beam row is scored with each. A folder that does not exist is
skipped with a note. BLEU is sacreBLEU's cased corpus BLEU on
detokenized text. Writes OUT.json (every number, the command and the
hardware) and OUT.md (a Markdown table).
"""

import argparse
import functools
import inspect
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402


def parse_args(argv=None):
    """The command-line options."""
    parser = tools.OneLineParser(
        prog="bleu_table.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument(
        "--word",
        default="checkpoints/cpu",
        help="folder of a word-level run (final.pt, epoch_*.pt)",
    )
    parser.add_argument(
        "--bpe",
        default="checkpoints/cpu-bpe",
        help="folder of a BPE + tied-embeddings run",
    )
    parser.add_argument(
        "--beam",
        type=tools.whole_number,
        nargs="+",
        default=[4],
        help="beam size; several give one row each (default 4)",
    )
    parser.add_argument(
        "--average",
        type=tools.count(least=0, most=1000),
        nargs="+",
        default=[5],
        metavar="K",
        help="average the last K epoch checkpoints (fewer if fewer exist);"
        " several K give one row each (0: no averaged row)",
    )
    parser.add_argument(
        "--alpha",
        type=tools.number_from(0.0, 10.0),
        nargs="+",
        default=[ALPHA],
        help=f"the beam's length penalty; several give one row each"
        f" (default {ALPHA})",
    )
    parser.add_argument(
        "--greedy-average",
        action="store_true",
        help="also decode each averaged model greedily (one row per K)",
    )
    parser.add_argument(
        "--split",
        choices=["test", "val"],
        default="test",
        help="test2016 (default), or val to compare candidates: choose on"
        " val, then score test once",
    )
    parser.add_argument(
        "--n",
        type=tools.count(least=0),
        default=0,
        help="first N sentences (0: all)",
    )
    parser.add_argument(
        "--batch-size", type=tools.count(most=100_000), default=128
    )
    parser.add_argument(
        "--threads", type=tools.count(most=1024), help="torch CPU threads"
    )
    parser.add_argument(
        "--out",
        default="results/beyond",
        help="write OUT.json and OUT.md (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    check_out_prefix(parser, args.out)
    return args


def summary_paths(out):
    """OUT.json and OUT.md. The suffixes are appended, not swapped in, so
    a dot inside the name stays ("alpha1.8_val" is not cut to "alpha1");
    an OUT given as NAME.json or NAME.md means NAME."""
    out = Path(out)
    if out.suffix in (".json", ".md"):
        out = out.with_suffix("")
    return (
        out.with_name(out.name + ".json"),
        out.with_name(out.name + ".md"),
    )


def check_out_prefix(parser, out):
    """Refuse an --out whose OUT.json and OUT.md cannot be written."""
    for path in summary_paths(out):
        try:
            tools.check_out(path)
        except tools.UserError as err:
            parser.error(str(err))


ALPHA = inspect.signature(tat.beam_search).parameters["alpha"].default


def beam_label(beam, alpha):
    """ "beam 4", with its length penalty when it is not the default."""
    return f"beam {beam}" + ("" if alpha == ALPHA else f" (alpha {alpha})")


def averages(args, folder):
    """The distinct K of --average that this folder has epoch files for."""
    found = len(tools.epoch_checkpoints(folder))
    return sorted({min(k, found) for k in args.average} - {0})


def setups(args):
    """(label, folder, beam, average, alpha) of every row to compute."""
    rows = []
    for kind, folder in (("word", args.word), ("BPE + tied", args.bpe)):
        folder = Path(folder)
        if not (folder / "final.pt").is_file():
            print(f"skipping {kind}: no {folder / 'final.pt'}")
            continue
        rows.append((f"{kind}, greedy", folder, 1, 0, ALPHA))
        for k in [0, *averages(args, folder)]:
            if k and args.greedy_average:
                what = f"{kind}, greedy + average of last {k}"
                rows.append((what, folder, 1, k, ALPHA))
            for beam in args.beam:
                for alpha in args.alpha:
                    what = beam_label(beam, alpha)
                    if k:
                        what += f" + average of last {k}"
                    rows.append((f"{kind}, {what}", folder, beam, k, alpha))
    return rows


def score(folder, beam, average, alpha, pairs, spacy_de, batch_size):
    """BLEU and timing of one setup."""
    checkpoint = folder / "final.pt"
    model, vocab_src, vocab_tgt, decode_fn = tools.load_translator(
        checkpoint, beam=beam, average_last=average
    )
    if beam > 1:
        decode_fn = functools.partial(decode_fn, alpha=alpha)
    start = time.perf_counter()
    hyps = tools.translate_batch(
        model,
        [de for de, _ in pairs],
        spacy_de,
        vocab_src,
        vocab_tgt,
        batch_size=batch_size,
        decode_fn=decode_fn,
    )
    seconds = time.perf_counter() - start
    bleu = tools.compute_bleu(hyps, [en for _, en in pairs])
    used = [p.name for p in tools.epoch_checkpoints(folder)[-average:]]
    return {
        "checkpoints": used if average else ["final.pt"],
        "bleu": round(bleu.score, 2),
        "bleu_full": str(bleu),
        "decode_seconds": round(seconds, 1),
        "example": hyps[0],
    }


def markdown(summary):
    """The summary as a Markdown table with its provenance."""
    lines = [
        f"# Beyond the paper: BLEU on Multi30k {summary['split']}",
        "",
        f"- command: `{summary['command']}`",
        f"- hardware: {summary['hardware_line']}",
        f"- date: {summary['date']}",
        f"- data: {summary['data']}",
        "- BLEU: sacreBLEU corpus BLEU, cased, 13a tokenization, on "
        "detokenized output",
        "",
        "| setup | run | checkpoints | BLEU | decoding time (s) |",
        "|---|---|---|---:|---:|",
    ]
    for row in summary["rows"]:
        ckpts = ", ".join(row["checkpoints"])
        lines.append(
            f"| {row['setup']} | `{row['folder']}` ({row['preset']}) | "
            f"{ckpts} | {row['bleu']:.2f} | {row['decode_seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def sentence_pairs(args):
    """The --split pairs, the first --n of them (0: all)."""
    pairs = tat.read_multi30k(args.split)
    return pairs[: args.n] if args.n else pairs


def summary_head(script, split, pairs):
    """A results summary's provenance: command, hardware, date, data."""
    split = "test2016" if split == "test" else "validation"
    hardware = tools.hardware_summary()
    return {
        "command": f"python bench/{script} " + " ".join(sys.argv[1:]),
        "hardware": hardware,
        "hardware_line": f"{hardware['cpu']}, {hardware['cpu_threads']} "
        f"torch thread(s), torch {hardware['torch']}"
        + (f", GPUs: {hardware['gpus']}" if "gpus" in hardware else ""),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "split": split,
        "data": f"Multi30k {split}, {len(pairs)} sentences",
        "rows": [],
    }


def write_summary(summary, out, markdown):
    """OUT.json (every number) and OUT.md (the table), each written whole."""
    json_path, md_path = summary_paths(out)
    with tools.atomic_write(json_path, "w") as f:
        f.write(json.dumps(summary, indent=2) + "\n")
    with tools.atomic_write(md_path, "w") as f:
        f.write(markdown(summary))
    print(f"wrote {json_path} and {md_path}")


def main(argv=None):
    """Compute every row and write the JSON and Markdown files."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = list(setups(args))
    if not plan:  # nothing to score: leave the recorded tables alone
        print(
            f"bleu_table.py: error: nothing to score: no final.pt in --word"
            f" {args.word} or --bpe {args.bpe}",
            file=sys.stderr,
        )
        return 2
    pairs = sentence_pairs(args)
    summary = summary_head("bleu_table.py", args.split, pairs)
    spacy_de, _ = tat.load_tokenizers()
    for label, folder, beam, average, alpha in plan:
        config = tools.load_checkpoint(folder / "final.pt")["config"]
        row = {"setup": label, "folder": str(folder)}
        row |= {"preset": config["preset"], "beam": beam, "average": average}
        row["alpha"] = alpha if beam > 1 else None
        row |= score(
            folder, beam, average, alpha, pairs, spacy_de, args.batch_size
        )
        summary["rows"].append(row)
        print(
            f"{label:36s} BLEU {row['bleu']:6.2f}  "
            f"({row['decode_seconds']:.1f} s)"
        )
    write_summary(summary, args.out, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
