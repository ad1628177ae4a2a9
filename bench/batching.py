"""Training throughput: fixed padding to 72 (2022) against bucketed batches.

Trains the `paper`-size model (N=6, d_model=512) on the same Multi30k
training sentences two ways and reports real (non-pad) target tokens per
second for each, the median of several runs, and their ratio:

* padded: batches of 32 sentences, every sentence padded to 72 tokens, as
  the 2022 tutorial's `collate_batch(max_padding=72)` did;
* bucketed: the same sentences cut into length-sorted batches within a
  token budget by `TokenBatchSampler`, each padded to its own longest.

Only the batching differs: same model code, optimizer and loss.

    python bench/batching.py --sentences 1024 --runs 3
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sentences",
        type=int,
        default=1024,
        help="training pairs per run (default 1024)",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (default: torch's choice)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32 * 72,
        help="bucketed budget; default = one padded batch",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def padded_batches(data, batch_size=32, width=72):
    """2022-style batches: every sentence padded (or cut) to `width`."""
    for k in range(0, len(data), batch_size):
        chunk = data[k : k + batch_size]
        src = torch.full((len(chunk), width), tat.PAD)
        tgt = torch.full((len(chunk), width), tat.PAD)
        for i, (s, t) in enumerate(chunk):
            src[i, : len(s)] = torch.tensor(s[:width])
            tgt[i, : len(t)] = torch.tensor(t[:width])
        yield src, tgt


def bucketed_batches(data, max_tokens, seed):
    """Length-bucketed batches from TokenBatchSampler."""
    sampler = tat.TokenBatchSampler(
        [(len(s), len(t)) for s, t in data], max_tokens, seed=seed
    )
    for idx in sampler:
        yield tat.collate_batch([data[i] for i in idx])


def padded_positions(batches):
    """Source plus target positions the model computes, padding included."""
    return sum(src.numel() + tgt.numel() for src, tgt in batches)


def train_throughput(batches, vocab_sizes, seed):
    """Real target tokens per second over one pass of training."""
    torch.manual_seed(seed)
    model = tat.make_model(*vocab_sizes)  # the paper's base model
    criterion = tat.LabelSmoothing(vocab_sizes[1], tat.PAD, 0.1)
    loss_compute = tat.SimpleLossCompute(model.generator, criterion)
    optimizer, scheduler = tat.make_optimizer(model, 512, 1.0, 4000)
    model.train()
    batches = [tat.Batch(src, tgt, pad=tat.PAD) for src, tgt in batches]
    # One untimed step first, so that one-off costs (allocating Adam's
    # state, first-touch memory) are not charged to either side.
    tat.run_epoch(batches[:1], model, loss_compute, optimizer, scheduler)
    start = time.perf_counter()
    tat.run_epoch(batches, model, loss_compute, optimizer, scheduler)
    seconds = time.perf_counter() - start
    return sum(b.ntokens for b in batches) / seconds


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spacy_de, spacy_en = tat.load_tokenizers()
    vocab_src, vocab_tgt = tools.load_vocab(spacy_de, spacy_en)
    pairs = random.Random(args.seed).sample(
        tat.read_multi30k("train"), args.sentences
    )
    data = tat.encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en)
    sizes = (len(vocab_src), len(vocab_tgt))
    print(f"machine: {tools.hardware_summary()}")
    print(f"{args.sentences} sentences, paper model, {args.runs} runs")
    positions = {
        "padded to 72": padded_positions(padded_batches(data)),
        "bucketed": padded_positions(
            bucketed_batches(data, args.max_tokens, args.seed)
        ),
    }
    real = sum(len(s) + len(t) for s, t in data)
    for name, count in positions.items():
        print(
            f"{name:13s} {count:7d} source + target positions, "
            f"{real / count:.0%} of them real tokens"
        )
    print(
        "work ratio (positions, padded / bucketed): "
        f"{positions['padded to 72'] / positions['bucketed']:.2f}"
    )
    results = {"padded to 72": [], "bucketed": []}
    for run in range(args.runs):  # interleaved, so drift hits both alike
        results["padded to 72"].append(
            train_throughput(padded_batches(data), sizes, args.seed)
        )
        results["bucketed"].append(
            train_throughput(
                bucketed_batches(data, args.max_tokens, args.seed + run),
                sizes,
                args.seed,
            )
        )
        print(
            f"run {run}: "
            + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in results.items())
        )
    medians = {k: statistics.median(v) for k, v in results.items()}
    for name, value in medians.items():
        print(f"median {name:13s} {value:8.1f} real target tokens/s")
    ratio = medians["bucketed"] / medians["padded to 72"]
    print(f"speed-up of bucketed over padded: {ratio:.2f}x")


if __name__ == "__main__":
    main()
