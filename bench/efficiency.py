"""Training efficiency: tokens/s, MFU against the measured matmul peak, and
our model against torch.nn.Transformer, all in one run.

For each preset (`paper`, `cpu`) it trains on the same bucketed batches of
real Multi30k sentences with

* ours: `make_model(...)`, the tutorial's model;
* peer: `torch.nn.Transformer(norm_first=True, batch_first=True)` with the
  same sizes, wrapped in the same `Embeddings`, `PositionalEncoding` and
  `Generator`, and trained with the same loss and optimizer;
* ours, before: our model with the explained paths that the fast ones
  replaced (LayerNorm written as its formula, label smoothing through a
  full target matrix), for a before/after in the same run;

and prints, for every run and as medians: real target tokens per second,
achieved model FLOP/s and its fraction of the matmul peak measured in this
same run (MFU), and the ratio ours/peer.

Model FLOPs are counted analytically (`training_flops`): forward plus
backward (3x the forward matmuls), the encoder on source tokens, the
decoder and generator on target tokens, attention scores included; layer
norms, softmax and the loss are left out, as is usual. MFU counts the FLOPs
of the real (non-pad) tokens only, so padding shows up as lost efficiency.

    python bench/efficiency.py --threads 2 --runs 3 --profile 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402

PEAK_SIZES = (256, 512, 1024, 2048)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--presets",
        nargs="+",
        default=["paper", "cpu"],
        help="model sizes to measure (default: paper cpu)",
    )
    parser.add_argument(
        "--sentences",
        type=int,
        default=512,
        help="training pairs per run (default 512)",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: all)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="also print the top operators over STEPS training steps",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="token budget per batch (default: the preset's)",
    )
    return parser.parse_args(argv)


# --- the machine's limit --------------------------------------------------


def matmul_peak(dtype=torch.float32, sizes=PEAK_SIZES, repeats=5):
    """Best FLOP/s of square matmuls at the sizes the models use."""
    best = {}
    for n in sizes:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        a @ b  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        best[n] = 2 * n**3 / min(times)
    return best


# --- counting FLOPs -------------------------------------------------------


def forward_flops(B, S, T, N, d_model, d_ff, vocab):
    """Matmul FLOPs of one forward pass on (B, S) sources, (B, T) targets."""
    d = d_model
    encoder = B * S * (8 * d * d + 4 * d * d_ff) + 4 * B * S * S * d
    decoder = (
        B * T * (12 * d * d + 4 * d * d_ff)  # self q,k,v,o; cross q,o; FFN
        + B * S * 4 * d * d  # cross-attention keys and values of the memory
        + 4 * B * T * T * d  # self-attention scores and weighted sum
        + 4 * B * T * S * d  # cross-attention scores and weighted sum
    )
    generator = 2 * B * T * d * vocab
    return N * (encoder + decoder) + generator


def training_flops(B, S, T, N, d_model, d_ff, vocab):
    """Forward plus backward: the backward pass costs two forwards."""
    return 3 * forward_flops(B, S, T, N, d_model, d_ff, vocab)


def real_token_flops(data, config, vocab):
    """Training FLOPs of the sentences alone, without any padding."""
    return sum(
        training_flops(
            1,
            len(src),
            len(tgt) - 1,
            config.N,
            config.d_model,
            config.d_ff,
            vocab,
        )
        for src, tgt in data
    )


# --- the two models -------------------------------------------------------


class TorchPeer(nn.Module):
    """torch.nn.Transformer inside our embeddings and generator."""

    def __init__(self, src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout):
        super().__init__()
        self.src_embed = nn.Sequential(
            tat.Embeddings(d_model, src_vocab),
            tat.PositionalEncoding(d_model, dropout),
        )
        self.tgt_embed = nn.Sequential(
            tat.Embeddings(d_model, tgt_vocab),
            tat.PositionalEncoding(d_model, dropout),
        )
        warnings.filterwarnings("ignore", "enable_nested_tensor")
        self.transformer = nn.Transformer(
            d_model,
            h,
            N,
            N,
            d_ff,
            dropout,
            batch_first=True,
            norm_first=True,
        )
        self.generator = tat.Generator(d_model, tgt_vocab)

    def forward(self, batch):
        """Decoder states (B, T, d_model) for a tat.Batch."""
        src_pad = batch.src == tat.PAD  # (B, S), True where padding
        tgt_pad = batch.tgt == tat.PAD  # (B, T)
        T = batch.tgt.size(1)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True: hidden
        return self.transformer(
            self.src_embed(batch.src),
            self.tgt_embed(batch.tgt),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )


class Ours(nn.Module):
    """The tutorial's model behind the same one-argument forward."""

    keep_targets = False  # LabelSmoothing's closed form (the fast path)

    def __init__(self, src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout):
        super().__init__()
        self.model = tat.make_model(
            src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout
        )
        self.generator = self.model.generator

    def forward(self, batch):
        return self.model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)


def layer_norm_by_hand(self, x):
    """LayerNorm as the formula reads, one elementwise op at a time."""
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)
    return self.a_2 * (x - mean) / torch.sqrt(var + self.eps) + self.b_2


class OursBefore(Ours):
    """Ours with the explained paths the fast ones replaced: LayerNorm as
    the formula reads and label smoothing through its target matrix."""

    keep_targets = True

    def __init__(self, *args):
        super().__init__(*args)
        for module in self.modules():
            if isinstance(module, tat.LayerNorm):
                module.forward = layer_norm_by_hand.__get__(module)


# --- timing ---------------------------------------------------------------


def train_pass(model_cls, batches, sizes, config, seed, profile=0):
    """Real target tokens and seconds for one training pass."""
    torch.manual_seed(seed)
    model = model_cls(
        *sizes, config.N, config.d_model, config.d_ff, config.h, 0.1
    )
    keep = getattr(model_cls, "keep_targets", False)
    criterion = tat.LabelSmoothing(sizes[1], tat.PAD, 0.1, keep_targets=keep)
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9
    )
    model.train()

    def step(batch):
        logp = model.generator(model(batch))  # (B, T, V)
        loss = criterion(
            logp.reshape(-1, logp.size(-1)), batch.tgt_y.reshape(-1)
        )
        (loss / batch.ntokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(batches[0])  # untimed: Adam's state, first-touch memory
    if profile:
        return profile_steps(step, batches[:profile])
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    seconds = time.perf_counter() - start
    return sum(b.ntokens for b in batches), seconds


def profile_steps(step, batches, rows=12):
    """Top operators by their own CPU time over a few training steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            step(batch)
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=rows
    )
    print(table)
    return table


def bucketed(data, max_tokens, seed):
    """tat.Batch objects cut by TokenBatchSampler from encoded pairs."""
    sampler = tat.TokenBatchSampler(
        [(len(s), len(t)) for s, t in data], max_tokens, seed=seed
    )
    return [
        tat.Batch(*tat.collate_batch([data[i] for i in idx]), pad=tat.PAD)
        for idx in sampler
    ]


def load_sentences(count, seed):
    """Encoded (source ids, target ids) pairs of Multi30k training data."""
    spacy_de, spacy_en = tat.load_tokenizers()
    vocab_src, vocab_tgt = tools.load_vocab(spacy_de, spacy_en)
    pairs = random.Random(seed).sample(tat.read_multi30k("train"), count)
    data = tat.encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en)
    return data, (len(vocab_src), len(vocab_tgt))


def measure_preset(name, data, sizes, peak, args):
    """Print every run and the medians for one preset; return them."""
    config = tools.get_config(name)
    max_tokens = args.max_tokens or config.max_tokens
    batches = bucketed(data, max_tokens, args.seed)
    model_flops = real_token_flops(data, config, sizes[1])
    print(
        f"\n{name}: N={config.N} d_model={config.d_model} "
        f"d_ff={config.d_ff} h={config.h}; {len(batches)} batches of "
        f"<= {max_tokens} tokens; {model_flops / 1e12:.2f} TFLOP of "
        "model work per pass"
    )
    contestants = {
        "ours": Ours,
        "nn.Transformer": TorchPeer,
        "ours, before": OursBefore,
    }
    rates = {label: [] for label in contestants}
    for run in range(args.runs):  # interleaved, so drift hits all alike
        for label, cls in contestants.items():
            tokens, seconds = train_pass(cls, batches, sizes, config, run)
            rates[label].append((tokens / seconds, model_flops / seconds))
            tok_s, flop_s = rates[label][-1]
            print(
                f"  run {run} {label:14s} {tok_s:8.1f} tok/s "
                f"{flop_s / 1e9:7.1f} GFLOP/s  MFU {flop_s / peak:5.1%}"
            )
    medians = {}
    for label, values in rates.items():
        tok_s = statistics.median(v[0] for v in values)
        flop_s = statistics.median(v[1] for v in values)
        medians[label] = (tok_s, flop_s)
        print(
            f"  median {label:14s} {tok_s:8.1f} tok/s "
            f"{flop_s / 1e9:7.1f} GFLOP/s  MFU {flop_s / peak:5.1%}"
        )
    ratio = medians["ours"][0] / medians["nn.Transformer"][0]
    gain = medians["ours"][0] / medians["ours, before"][0]
    print(f"  ours / nn.Transformer (tok/s): {ratio:.2f}")
    print(f"  ours / ours before the fast paths (tok/s): {gain:.2f}")
    if args.profile:
        for label, cls in (("ours", Ours), ("ours, before", OursBefore)):
            print(f"  top operators, {label}, {args.profile} steps:")
            train_pass(cls, batches, sizes, config, 0, args.profile)
    return medians, ratio


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {tools.hardware_summary()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    peaks = matmul_peak()
    peak = max(peaks.values())
    print(
        "fp32 matmul peak: "
        + ", ".join(f"{n}: {f / 1e9:.1f}" for n, f in peaks.items())
        + f" GFLOP/s; using the best, {peak / 1e9:.1f}"
    )
    if tools.cpu_has_native_bf16():
        bf16 = max(matmul_peak(torch.bfloat16).values())
        print(f"bf16 matmul peak: {bf16 / 1e9:.1f} GFLOP/s")
    else:
        print("bf16: no native bf16 matmul on this CPU, fp32 only")
    data, sizes = load_sentences(args.sentences, args.seed)
    print(f"{args.sentences} Multi30k training pairs, vocabularies {sizes}")
    for name in args.presets:
        measure_preset(name, data, sizes, peak, args)


if __name__ == "__main__":
    main()
