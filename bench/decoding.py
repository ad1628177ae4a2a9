"""Decoding speed: the 2022 tutorial's greedy_decode against the KV cache.

    python bench/decoding.py                     # 1000 test2016 sentences
    python bench/decoding.py --n 200 --runs 3    # a shorter run

Translates the first --n German sentences of Multi30k test2016 with

1. the tutorial's ``greedy_decode``, one sentence at a time, recomputing
   the whole prefix at every step, for a fixed ``source length + 50``
   tokens (it has no notion of ``</s>``, so it never stops early);
2. ``batch_greedy_decode`` of notebook 03: batched, stops at ``</s>``, but
   still recomputes the prefix (for reference);
3. ``cached_greedy_decode`` of notebook 05: batched, stops at ``</s>``,
   with a key/value cache;
4. ``beam_search`` (beam 4, alpha 0.6) with the same cache.

Batched decoders get length-sorted batches of --batch-size sentences, as
``translate_batch`` makes them. Only decoding is timed: the sentences are
tokenized once beforehand. Each timing is the median of --runs runs. The
outputs of 1 and 3 are compared up to the first ``</s>``, and must agree.
"""

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402

CANDIDATES = ("checkpoints/cpu/final.pt", "checkpoints/ci/final.pt")


def parse_args(argv=None):
    """The command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument(
        "--n", type=int, default=1000, help="test2016 sentences (max 1000)"
    )
    parser.add_argument(
        "--checkpoint",
        help="model to decode with (default: the first of "
        + ", ".join(CANDIDATES)
        + " that exists; otherwise the ci preset is trained)",
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--beam", type=int, default=4, help="beam size")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads"
    )
    parser.add_argument(
        "--out", help="also write the results as Markdown to this file"
    )
    parser.add_argument(
        "--note", default="", help="a line to add to the Markdown file"
    )
    return parser.parse_args(argv)


def find_checkpoint(path):
    """The checkpoint to use, training the ci preset if there is none."""
    if path:
        return Path(path)
    for candidate in CANDIDATES:
        if (ROOT / candidate).is_file():
            return ROOT / candidate
    print("no trained checkpoint found: training the ci preset")
    spacy_de, spacy_en = tat.load_tokenizers()
    vocabs = tools.load_vocab(spacy_de, spacy_en)
    config = tools.get_config(
        "ci", checkpoint_dir=str(ROOT / "checkpoints/ci")
    )
    tools.train_worker(0, 1, *vocabs, spacy_de, spacy_en, config)
    return ROOT / CANDIDATES[1]


def median_time(fn, runs):
    """(median seconds, all seconds, last result) of `runs` calls."""
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, result


def tutorial(model, encoded):
    """The 2022 way: one sentence at a time, fixed length, no cache."""
    outputs = []
    with torch.no_grad():
        for ids in encoded:
            src = torch.tensor([ids])  # (1, S)
            mask = torch.ones(1, 1, len(ids), dtype=torch.bool)
            out = tat.greedy_decode(model, src, mask, len(ids) + 50, tat.BOS)
            outputs.append(tat.strip_specials(out[0].tolist()))
    return outputs


def agree(tutorial_ids, cached_ids, max_len):
    """Whether two outputs match. A batch decodes up to its longest source
    + 50, so where the tutorial ran into its own limit without </s>, only
    its length is compared."""
    if len(tutorial_ids) == max_len - 1:  # no </s> before the limit
        return cached_ids[: len(tutorial_ids)] == tutorial_ids
    return cached_ids == tutorial_ids


def batched(decode_fn, model, encoded, batch_size):
    """Length-sorted batches through decode_fn, outputs in input order."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    outputs = [None] * len(encoded)
    with torch.no_grad():
        for k in range(0, len(order), batch_size):
            idx = order[k : k + batch_size]
            src = torch.nn.utils.rnn.pad_sequence(
                [torch.tensor(encoded[i]) for i in idx],
                batch_first=True,
                padding_value=tat.PAD,
            )  # (B, S)
            mask = (src != tat.PAD).unsqueeze(-2)  # (B, 1, S)
            out = decode_fn(model, src, mask, src.size(1) + 50)
            for i, row in zip(idx, out.tolist(), strict=True):
                outputs[i] = tat.strip_specials(row)
    return outputs


def machine():
    """One line about this machine."""
    info = tools.hardware_summary()
    return (
        f"{info['cpu']}, {info['cpu_threads']} torch thread(s), "
        f"torch {info['torch']}, Python {platform.python_version()}"
    )


def main(argv=None):
    """Run the benchmark and print (and optionally write) the results."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = find_checkpoint(args.checkpoint)
    model, vocab_src, _, config = tools.load_trained_model(checkpoint, "cpu")
    spacy_de, _ = tat.load_tokenizers()
    pairs = tat.read_multi30k("test")[: args.n]
    encoded = [
        [tat.BOS, *tat.encode_text(de, spacy_de, vocab_src), tat.EOS]
        for de, _ in pairs
    ]
    n = len(encoded)
    print(f"machine:    {machine()}")
    print(f"checkpoint: {checkpoint} (preset {config.preset!r})")
    print(f"sentences:  {n} of test2016, {args.runs} runs, median shown")
    beam = functools.partial(tat.beam_search, beam_size=args.beam)
    methods = {
        "tutorial greedy_decode, one at a time, fixed length": (
            lambda: tutorial(model, encoded)
        ),
        "batch_greedy_decode, no cache": (
            lambda: batched(
                tat.batch_greedy_decode, model, encoded, args.batch_size
            )
        ),
        "cached_greedy_decode": (
            lambda: batched(
                tat.cached_greedy_decode, model, encoded, args.batch_size
            )
        ),
        f"beam_search, beam {args.beam}, cached": (
            lambda: batched(beam, model, encoded, args.batch_size)
        ),
    }
    rows, outputs = [], {}
    for name, fn in methods.items():
        median, times, outputs[name] = median_time(fn, args.runs)
        rows.append((name, median, n / median, times))
        print(
            f"{name:52s} {median:8.2f} s {n / median:8.1f} sentences/s  "
            f"(runs: {', '.join(f'{t:.2f}' for t in times)})"
        )
    names = list(methods)
    same = sum(
        agree(a, b, len(ids) + 50)
        for a, b, ids in zip(
            outputs[names[0]], outputs[names[2]], encoded, strict=True
        )
    )
    speedup = rows[0][1] / rows[2][1]
    beam_cost = rows[3][1] / rows[2][1]
    print(f"identical outputs, tutorial vs cached: {same} of {n}")
    print(
        f"speed-up of cached batched greedy over the tutorial: {speedup:.1f}x"
    )
    print(f"beam {args.beam} takes {beam_cost:.2f}x the time of cached greedy")
    if args.out:
        write_markdown(
            args, checkpoint, config, rows, same, n, speedup, beam_cost
        )
    return 0 if same == n else 1


def write_markdown(
    args, checkpoint, config, rows, same, n, speedup, beam_cost
):
    """Write the results table to args.out."""
    command = "python bench/decoding.py " + " ".join(sys.argv[1:])
    lines = [
        "# Decoding speed",
        "",
        f"- command: `{command.strip()}`",
        f"- machine: {machine()}",
        f"- checkpoint: `{os.path.relpath(checkpoint, ROOT)}` "
        f"(preset `{config.preset}`, N={config.N}, "
        f"d_model={config.d_model})",
        f"- data: the first {n} sentences of Multi30k test2016; "
        f"{args.runs} runs, median; batches of {args.batch_size}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
    ]
    if args.note:
        lines.append(f"- note: {args.note}")
    lines += [
        "",
        "| method | median s | sentences/s | runs (s) |",
        "|---|---:|---:|---|",
    ]
    for name, median, rate, times in rows:
        runs = ", ".join(f"{t:.2f}" for t in times)
        lines.append(f"| {name} | {median:.2f} | {rate:.1f} | {runs} |")
    lines += [
        "",
        f"- cached batched greedy is **{speedup:.1f}x** faster than the "
        "tutorial's one-at-a-time greedy_decode",
        f"- identical outputs (up to `</s>`): {same} of {n}",
        f"- beam {args.beam} costs {beam_cost:.2f}x cached greedy",
        "",
    ]
    Path(args.out).write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
