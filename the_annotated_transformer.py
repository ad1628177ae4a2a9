# =====================================================================
# GENERATED FILE: edit the notebooks, not this file.
# Source: notebooks/NN_*.py (cells starting with "#| export").
# Regenerate with `make export`; `make check-sync` fails on drift.
# =====================================================================
"""The Annotated Transformer, done right: the notebooks' code as a module.

Importing it has no side effects and needs only torch. Run
``python the_annotated_transformer.py --help`` for the command line.
"""


# --- from notebooks/01_model.py ---
import copy
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


# --- from notebooks/01_model.py ---
class EncoderDecoder(nn.Module):
    """Encoder, decoder, the two embeddings and the output generator."""

    def __init__(self, encoder, decoder, src_embed, tgt_embed, generator):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.generator = generator

    def forward(self, src, tgt, src_mask, tgt_mask):
        """Encode the source, then decode the target prefix against it."""
        memory = self.encode(src, src_mask)  # (B, S, d_model)
        return self.decode(memory, src_mask, tgt, tgt_mask)

    def encode(self, src, src_mask):
        """Source token ids (B, S) to memory (B, S, d_model)."""
        return self.encoder(self.src_embed(src), src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        """Target prefix ids (B, T) to hidden states (B, T, d_model)."""
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)


# --- from notebooks/01_model.py ---
class Generator(nn.Module):
    """Linear projection to the vocabulary, then log-softmax."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        """(B, T, d_model) hidden states to (B, T, vocab) log-probs."""
        return F.log_softmax(self.proj(x), dim=-1)


# --- from notebooks/01_model.py ---
def clones(module, N):
    """N independent deep copies of a module, in a ModuleList."""
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


# --- from notebooks/01_model.py ---
class Encoder(nn.Module):
    """N encoder layers followed by a final layer norm."""

    def __init__(self, layer, N):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def forward(self, x, mask):
        """Run (B, S, d_model) through every layer in turn."""
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


# --- from notebooks/01_model.py ---
class LayerNorm(nn.Module):
    """Layer norm over the last dimension: a_2 * (x - mean) / std + b_2."""

    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        """Normalize (..., features) with the biased variance."""
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return self.a_2 * (x - mean) / torch.sqrt(var + self.eps) + self.b_2


# --- from notebooks/01_model.py ---
class SublayerConnection(nn.Module):
    """Pre-norm residual block: x + dropout(sublayer(norm(x)))."""

    def __init__(self, size, dropout):
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        """Apply a same-shape sublayer to (B, T, d_model) with a residual."""
        return x + self.dropout(sublayer(self.norm(x)))


# --- from notebooks/01_model.py ---
class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in a residual block."""

    def __init__(self, size, self_attn, feed_forward, dropout):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 2)
        self.size = size

    def forward(self, x, mask):
        """(B, S, d_model) with a (B, 1, S) padding mask."""
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, mask))
        return self.sublayer[1](x, self.feed_forward)


# --- from notebooks/01_model.py ---
class Decoder(nn.Module):
    """N decoder layers followed by a final layer norm."""

    def __init__(self, layer, N):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def forward(self, x, memory, src_mask, tgt_mask):
        """Run (B, T, d_model) through every layer against the memory."""
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


# --- from notebooks/01_model.py ---
class DecoderLayer(nn.Module):
    """Masked self-attention, source attention, then feed-forward."""

    def __init__(self, size, self_attn, src_attn, feed_forward, dropout):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 3)

    def forward(self, x, memory, src_mask, tgt_mask):
        """(B, T, d_model) target states; memory is (B, S, d_model)."""
        m = memory
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, tgt_mask))
        x = self.sublayer[1](x, lambda x: self.src_attn(x, m, m, src_mask))
        return self.sublayer[2](x, self.feed_forward)


# --- from notebooks/01_model.py ---
def subsequent_mask(size):
    """(1, size, size) bool mask, True where key position <= query."""
    upper = torch.triu(torch.ones(1, size, size, dtype=torch.bool), 1)
    return ~upper


# --- from notebooks/01_model.py ---
def save_chart(chart, name, folder="figures"):
    """Show a chart, and also write it as static SVG and PNG files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chart.save(str(folder / f"{name}.svg"))
    chart.save(str(folder / f"{name}.png"), scale_factor=1.5)
    return chart


# --- from notebooks/01_model.py ---
def attention(query, key, value, mask=None, dropout=None):
    """Scaled dot-product attention; returns (output, weights)."""
    d_k = query.size(-1)
    scores = query @ key.transpose(-2, -1) / math.sqrt(d_k)  # (B, h, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return p_attn @ value, p_attn  # (B, h, T, d_k), (B, h, T, S)


# --- from notebooks/01_model.py ---
class MultiHeadedAttention(nn.Module):
    """h parallel attention heads over d_model / h dimensions each."""

    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0, "d_model must be divisible by h"
        self.d_k = d_model // h
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.attn = None
        self.store_attention = False
        self.dropout = nn.Dropout(p=dropout)

    def split_heads(self, x, linear):
        """Project (B, T, d_model) and split to (B, h, T, d_k)."""
        B = x.size(0)
        return linear(x).view(B, -1, self.h, self.d_k).transpose(1, 2)

    def forward(self, query, key, value, mask=None):
        """Attend from query (B, T, d) to key/value (B, S, d)."""
        if mask is not None:
            mask = mask.unsqueeze(1)  # same mask for every head: (B, 1, *, S)
        q, k, v = (
            self.split_heads(x, lin)
            for x, lin in zip((query, key, value), self.linears)
        )  # each (B, h, T or S, d_k)
        if self.store_attention:
            x, self.attn = attention(q, k, v, mask=mask, dropout=self.dropout)
        else:
            p = self.dropout.p if self.training else 0.0
            x = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p
            )  # (B, h, T, d_k)
        x = x.transpose(1, 2).reshape(query.size(0), -1, self.h * self.d_k)
        return self.linears[-1](x)  # (B, T, d_model)


# --- from notebooks/01_model.py ---
class PositionwiseFeedForward(nn.Module):
    """Two linear maps with a ReLU between, applied at every position."""

    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        """(B, T, d_model) to (B, T, d_model) through (B, T, d_ff)."""
        return self.w_2(self.dropout(self.w_1(x).relu()))


# --- from notebooks/01_model.py ---
class Embeddings(nn.Module):
    """Token embedding table scaled by sqrt(d_model)."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        """(B, T) ids to (B, T, d_model) vectors."""
        return self.lut(x) * math.sqrt(self.d_model)


# --- from notebooks/01_model.py ---
class PositionalEncoding(nn.Module):
    """Add the fixed sinusoidal position signal, then dropout."""

    def __init__(self, d_model, dropout, max_len=5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(max_len).unsqueeze(1)  # (max_len, 1)
        div_term = torch.exp(
            torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model)
        )  # (d_model / 2,)
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))  # (1, max_len, d_model)

    def forward(self, x):
        """Add PE to (B, T, d_model) embeddings."""
        return self.dropout(x + self.pe[:, : x.size(1)])


# --- from notebooks/01_model.py ---
def make_model(
    src_vocab,
    tgt_vocab,
    N=6,
    d_model=512,
    d_ff=2048,
    h=8,
    dropout=0.1,
    tie_embeddings=False,
):
    """Build an EncoderDecoder Transformer from hyperparameters."""
    if tie_embeddings and src_vocab != tgt_vocab:
        raise ValueError(
            "tie_embeddings needs one shared vocabulary, got "
            f"src_vocab={src_vocab} and tgt_vocab={tgt_vocab}"
        )
    c = copy.deepcopy
    attn = MultiHeadedAttention(h, d_model, dropout)
    ff = PositionwiseFeedForward(d_model, d_ff, dropout)
    position = PositionalEncoding(d_model, dropout)
    model = EncoderDecoder(
        Encoder(EncoderLayer(d_model, c(attn), c(ff), dropout), N),
        Decoder(DecoderLayer(d_model, c(attn), c(attn), c(ff), dropout), N),
        nn.Sequential(Embeddings(d_model, src_vocab), c(position)),
        nn.Sequential(Embeddings(d_model, tgt_vocab), c(position)),
        Generator(d_model, tgt_vocab),
    )
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    if tie_embeddings:
        shared = model.src_embed[0].lut.weight
        model.tgt_embed[0].lut.weight = shared
        model.generator.proj.weight = shared
    return model


# --- from notebooks/01_model.py ---
def count_parameters(module):
    """Number of distinct trainable parameters (shared ones once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


# --- from notebooks/02_training.py ---
import time
from contextlib import nullcontext
from dataclasses import dataclass


# --- from notebooks/02_training.py ---
class Batch:
    """Source and target ids with their masks, for teacher forcing."""

    def __init__(self, src, tgt=None, pad=2):
        self.src = src  # (B, S)
        self.src_mask = (src != pad).unsqueeze(-2)  # (B, 1, S)
        if tgt is not None:
            self.tgt = tgt[:, :-1]  # decoder input (B, T)
            self.tgt_y = tgt[:, 1:]  # what it must predict (B, T)
            self.tgt_mask = self.make_std_mask(self.tgt, pad)  # (B, T, T)
            self.ntokens = int((self.tgt_y != pad).sum())

    @staticmethod
    def make_std_mask(tgt, pad):
        """Hide padding and future positions: (B, T) to (B, T, T)."""
        tgt_mask = (tgt != pad).unsqueeze(-2)  # (B, 1, T)
        return tgt_mask & subsequent_mask(tgt.size(-1)).to(tgt.device)

    def to(self, device):
        """Move every tensor of the batch to a device, in place."""
        for name, value in vars(self).items():
            if torch.is_tensor(value):
                setattr(self, name, value.to(device, non_blocking=True))
        return self


# --- from notebooks/02_training.py ---
@dataclass
class TrainState:
    """Counters that persist across epochs."""

    step: int = 0  # micro-batches trained on
    accum_step: int = 0  # optimizer steps taken
    samples: int = 0  # sentences seen
    tokens: int = 0  # target tokens seen


def with_last_flag(iterable):
    """Yield (item, is_last) pairs, looking one item ahead."""
    iterator = iter(iterable)
    try:
        item = next(iterator)
    except StopIteration:
        return
    for upcoming in iterator:
        yield item, False
        item = upcoming
    yield item, True


def optimizer_step(optimizer, scheduler, parameters, scale=1.0):
    """Rescale gradients if asked, step, zero grads, step the schedule."""
    if scale != 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(scale)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()


# --- from notebooks/02_training.py ---
def run_epoch(
    data_iter,
    model,
    loss_compute,
    optimizer=None,
    scheduler=None,
    mode="train",
    accum_iter=1,
    train_state=None,
    log_every=40,
):
    """One pass over data_iter; returns (loss per token, train_state)."""
    train = mode.startswith("train")
    train_state = TrainState() if train_state is None else train_state
    total_loss, total_tokens, window = 0.0, 0, 0
    start, tokens_since_log = time.time(), 0
    with torch.set_grad_enabled(train):
        for i, (batch, is_last) in enumerate(with_last_flag(data_iter)):
            steps_now = train and (window + 1 == accum_iter or is_last)
            sync = nullcontext()
            if train and not steps_now and hasattr(model, "no_sync"):
                sync = model.no_sync()  # DDP: skip the all-reduce for now
            with sync:
                out = model(batch.src, batch.tgt, batch.src_mask,
                            batch.tgt_mask)  # (B, T, d_model)
                loss, loss_node = loss_compute(out, batch.tgt_y,
                                               batch.ntokens)
                if train:
                    (loss_node / accum_iter).backward()
            total_loss += loss
            total_tokens += batch.ntokens
            tokens_since_log += batch.ntokens
            if not train:
                continue
            window += 1
            train_state.step += 1
            train_state.samples += batch.src.size(0)
            train_state.tokens += batch.ntokens
            if steps_now:
                optimizer_step(optimizer, scheduler, model.parameters(),
                               scale=accum_iter / window)
                train_state.accum_step += 1
                window = 0
            if mode == "train+log" and i % log_every == 1:
                lr = optimizer.param_groups[0]["lr"]
                rate = tokens_since_log / (time.time() - start)
                print(f"step {i:5d} | accum step {train_state.accum_step:5d}"
                      f" | loss {loss_node.item():6.3f} | {rate:7.1f} tok/s"
                      f" | lr {lr:6.1e}")
                start, tokens_since_log = time.time(), 0
    return total_loss / max(total_tokens, 1), train_state


# --- from notebooks/02_training.py ---
def rate(step, model_size, factor, warmup):
    """Warm-up then inverse-square-root learning rate (paper eq. 3)."""
    step = max(step, 1)
    return factor * model_size**-0.5 * min(step**-0.5, step * warmup**-1.5)


def make_optimizer(model, d_model, factor=1.0, warmup=4000):
    """Adam with the paper's betas and a LambdaLR running `rate`."""
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: rate(step, d_model, factor, warmup)
    )
    return optimizer, scheduler


# --- from notebooks/02_training.py ---
def learning_rate_chart(
    settings=((512, 1.0, 4000), (512, 1.0, 8000), (256, 1.0, 4000)),
    steps=20000,
):
    """Altair line chart of `rate` for several (d_model, factor, warmup)."""
    import altair as alt
    import pandas as pd

    rows = [
        {
            "step": step,
            "learning rate": rate(step, d, f, w),
            "setting": f"d_model={d}, warmup={w}",
        }
        for d, f, w in settings
        for step in range(1, steps + 1, 20)
    ]
    return (
        alt.Chart(pd.DataFrame(rows))
        .mark_line()
        .encode(
            x="step:Q",
            y="learning rate:Q",
            color="setting:N",
            tooltip=["setting", "step", "learning rate"],
        )
        .properties(title="Learning-rate schedule", width=480)
    )


# --- from notebooks/02_training.py ---
class LabelSmoothing(nn.Module):
    """KL-divergence loss against label-smoothed targets; pad ignored."""

    def __init__(self, size, padding_idx, smoothing=0.0):
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.padding_idx = padding_idx
        self.confidence = 1.0 - smoothing
        self.smoothing = smoothing
        self.size = size
        self.true_dist = None

    def smoothed_targets(self, target, dtype=torch.float32):
        """(N,) target ids to the (N, size) smoothed distribution."""
        dist = torch.full(
            (target.size(0), self.size),
            self.smoothing / (self.size - 2),
            dtype=dtype,
            device=target.device,
        )
        dist.scatter_(1, target.unsqueeze(1), self.confidence)
        dist[:, self.padding_idx] = 0
        dist[target == self.padding_idx] = 0
        return dist

    def forward(self, x, target):
        """Summed KL loss of (N, size) log-probs against (N,) targets."""
        assert x.size(1) == self.size
        self.true_dist = self.smoothed_targets(target, x.dtype)
        return self.criterion(x, self.true_dist)


# --- from notebooks/02_training.py ---
def label_smoothing_chart(smoothing=0.4):
    """Heat map of the smoothed target distribution for 5 examples."""
    import altair as alt
    import pandas as pd

    crit = LabelSmoothing(5, padding_idx=0, smoothing=smoothing)
    dist = crit.smoothed_targets(torch.tensor([2, 1, 3, 3, 0]))
    rows = [
        {"example": i, "token": j, "target probability": float(dist[i, j])}
        for i in range(dist.size(0))
        for j in range(dist.size(1))
    ]
    return (
        alt.Chart(pd.DataFrame(rows))
        .mark_rect()
        .encode(
            x="token:O",
            y="example:O",
            color=alt.Color("target probability:Q",
                            scale=alt.Scale(scheme="viridis")),
            tooltip=["example", "token", "target probability"],
        )
        .properties(title="Smoothed targets", width=240, height=240)
    )


# --- from notebooks/02_training.py ---
def label_smoothing_penalty_rows(margins=range(0, 25), smoothing=0.1):
    """Loss of one prediction against its margin, with and without LS."""
    rows = []
    for eps in (0.0, smoothing):
        crit = LabelSmoothing(6, padding_idx=0, smoothing=eps)
        for m in margins:
            logits = torch.tensor([[-1e4, 0.0, float(m), 0.0, 0.0, 0.0]])
            loss = crit(logits.log_softmax(-1), torch.tensor([2]))
            rows.append({"margin": m, "loss": float(loss),
                         "smoothing": f"smoothing={eps}"})
    return rows


def label_smoothing_penalty_chart(smoothing=0.1):
    """Line chart of label_smoothing_penalty_rows."""
    import altair as alt
    import pandas as pd

    df = pd.DataFrame(label_smoothing_penalty_rows(smoothing=smoothing))
    return (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(x="margin:Q", y="loss:Q", color="smoothing:N",
                tooltip=["smoothing", "margin", "loss"])
        .properties(title="Loss against confidence", width=480)
    )


# --- from notebooks/02_training.py ---
COPY_PAD, COPY_START = 0, 1


def data_gen(V, batch_size, nbatches, seq_len=10, generator=None):
    """Yield `nbatches` random copy-task batches over V tokens."""
    for _ in range(nbatches):
        data = torch.randint(2, V, (batch_size, seq_len), generator=generator)
        data[:, 0] = COPY_START
        yield Batch(data, data.clone(), pad=COPY_PAD)


# --- from notebooks/02_training.py ---
class SimpleLossCompute:
    """Generator + criterion, normalized by the token count."""

    def __init__(self, generator, criterion):
        self.generator = generator
        self.criterion = criterion

    def __call__(self, x, y, norm):
        """Return (summed loss as float, mean loss per token as tensor)."""
        logp = self.generator(x)  # (B, T, vocab)
        sloss = self.criterion(
            logp.reshape(-1, logp.size(-1)), y.reshape(-1)
        ) / norm
        return sloss.item() * norm, sloss


# --- from notebooks/02_training.py ---
def greedy_decode(model, src, src_mask, max_len, start_symbol):
    """Most-probable-token decoding: (B, S) source to (B, max_len) ids."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    ys = torch.full((src.size(0), 1), start_symbol, dtype=src.dtype,
                    device=src.device)  # (B, 1)
    for _ in range(max_len - 1):
        out = model.decode(memory, src_mask, ys,
                           subsequent_mask(ys.size(1)).to(src.device))
        next_word = model.generator(out[:, -1]).argmax(dim=-1)  # (B,)
        ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)
    return ys


# --- from notebooks/02_training.py ---
@dataclass
class CopyTaskConfig:
    """Hyperparameters of the copy task (N=2, d_model=512 as in 2022)."""

    V: int = 11
    N: int = 2
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8
    dropout: float = 0.0
    batch_size: int = 80
    nbatches: int = 20
    max_epochs: int = 20
    factor: float = 1.0
    warmup: int = 100
    check_size: int = 200
    seed: int = 0


def copy_accuracy(model, n, V=11, seq_len=10, generator=None):
    """Fraction of n fresh random sequences the model copies exactly."""
    model.eval()
    batch = next(data_gen(V, n, 1, seq_len, generator=generator))
    with torch.no_grad():
        out = greedy_decode(model, batch.src, batch.src_mask, seq_len,
                            COPY_START)
    return (out == batch.src).all(dim=1).float().mean().item()


def train_copy_task(cfg=None, log=print):
    """Train until exact copy; returns (model, list of epoch records)."""
    cfg = cfg or CopyTaskConfig()
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = make_model(cfg.V, cfg.V, N=cfg.N, d_model=cfg.d_model,
                       d_ff=cfg.d_ff, h=cfg.h, dropout=cfg.dropout)
    criterion = LabelSmoothing(cfg.V, padding_idx=COPY_PAD, smoothing=0.0)
    loss_compute = SimpleLossCompute(model.generator, criterion)
    optimizer, scheduler = make_optimizer(model, cfg.d_model, cfg.factor,
                                          cfg.warmup)
    state, history, start = TrainState(), [], time.time()
    for epoch in range(cfg.max_epochs):
        model.train()
        loss, state = run_epoch(
            data_gen(cfg.V, cfg.batch_size, cfg.nbatches, generator=gen),
            model, loss_compute, optimizer, scheduler, train_state=state)
        acc = copy_accuracy(model, cfg.check_size, cfg.V, generator=gen)
        history.append({"epoch": epoch, "train_loss": loss,
                        "exact_copy": acc, "seconds": time.time() - start})
        log(f"epoch {epoch:2d} | loss {loss:.4f} | exact copies {acc:6.1%}"
            f" | {time.time() - start:5.1f} s")
        if acc == 1.0:
            break
    return model, history


# --- from notebooks/03_multi30k.py ---
import gzip
import hashlib
import http.client
import json
import os
import random
import tempfile
import urllib.error
import urllib.request
import warnings
from collections import Counter
from pathlib import Path

import torch


# --- from notebooks/03_multi30k.py ---
MULTI30K_BASE_URL = (
    "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
)
MULTI30K_ENV = "MULTI30K_DIR"
MULTI30K_SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
MULTI30K_SHA256 = {
    "train.de.gz": (
        "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6"
    ),
    "train.en.gz": (
        "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f"
    ),
    "val.de.gz": (
        "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a"
    ),
    "val.en.gz": (
        "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28"
    ),
    "test_2016_flickr.de.gz": (
        "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8"
    ),
    "test_2016_flickr.en.gz": (
        "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9"
    ),
}


class DatasetError(RuntimeError):
    """Multi30k could not be found, downloaded or verified."""


def data_dir():
    """`data/` in the repository root, or in the working directory."""
    cwd = Path.cwd()
    for folder in (cwd, *cwd.parents):
        if (folder / "the_annotated_transformer.py").exists():
            return folder / "data"
    return cwd / "data"


def sha256_of(path):
    """Hex SHA-256 digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --- from notebooks/03_multi30k.py ---
def _offline_hint(folder, names):
    """What to do when the files cannot be fetched."""
    return (
        f"The files belong in {folder}. Without internet access, copy "
        f"{', '.join(sorted(names))} there yourself, or set {MULTI30K_ENV} "
        "to a folder that holds them."
    )


def _fetch(url, path, expected, timeout):
    """Download `url` to `path`, keeping it only if its SHA-256 matches."""
    from tqdm import tqdm

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=".part", dir=path.parent
        )
        digest = hashlib.sha256()
        with (
            os.fdopen(fd, "wb") as out,
            urllib.request.urlopen(url, timeout=timeout) as response,
        ):
            size = int(response.headers.get("Content-Length") or 0)
            with tqdm(
                total=size or None, unit="B", unit_scale=True, desc=path.name
            ) as bar:
                while chunk := response.read(1 << 16):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        if digest.hexdigest() != expected:
            raise DatasetError(
                f"{url} has SHA-256 {digest.hexdigest()}, expected "
                f"{expected}; the file was not kept.\n"
                + _offline_hint(path.parent, [path.name])
            )
        os.replace(tmp, path)
        tmp = None
    except (OSError, http.client.HTTPException) as error:
        reason = error
        if type(error) is urllib.error.URLError:
            reason = error.reason
        raise DatasetError(
            f"Could not download {url} ({reason}).\n"
            + _offline_hint(path.parent, [path.name])
        ) from error
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _check_folder(folder, sums):
    """`folder` if it holds every file with the right SHA-256."""
    problems = []
    for name, expected in sorted(sums.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_of(path) != expected:
            problems.append(f"{name} has the wrong SHA-256")
    if problems:
        raise DatasetError(
            f"{MULTI30K_ENV}={folder} does not hold Multi30k: "
            + "; ".join(problems)
            + f".\nPut the six files from {MULTI30K_BASE_URL} into {folder}, "
            f"or unset {MULTI30K_ENV} to download them into "
            f"{data_dir() / 'multi30k'}."
        )
    return folder


def download_multi30k(
    root=None, base_url=MULTI30K_BASE_URL, sha256=None, timeout=30.0
):
    """Folder holding the verified Multi30k files, downloaded if needed."""
    sums = MULTI30K_SHA256 if sha256 is None else sha256
    if root is None and os.environ.get(MULTI30K_ENV):
        return _check_folder(Path(os.environ[MULTI30K_ENV]), sums)
    folder = Path(root) if root is not None else data_dir() / "multi30k"
    for name, expected in sums.items():
        path = folder / name
        if not (path.is_file() and sha256_of(path) == expected):
            url = base_url.rstrip("/") + "/" + name
            _fetch(url, path, expected, timeout)
    return folder


# --- from notebooks/03_multi30k.py ---
def read_multi30k(split, root=None):
    """The (German, English) sentence pairs of "train", "val" or "test"."""
    if split not in MULTI30K_SPLITS:
        raise ValueError(f"split must be one of {list(MULTI30K_SPLITS)}")
    folder = download_multi30k(root)
    sides = []
    for lang in ("de", "en"):
        name = f"{MULTI30K_SPLITS[split]}.{lang}.gz"
        with gzip.open(folder / name, "rt", encoding="utf-8") as f:
            sides.append([line.strip() for line in f])
    if len(sides[0]) != len(sides[1]):
        raise DatasetError(f"{split}: German and English differ in length")
    return list(zip(*sides, strict=True))


# --- from notebooks/03_multi30k.py ---
def load_tokenizers():
    """Rule-based German and English spaCy tokenizers (no download)."""
    import spacy

    return spacy.blank("de"), spacy.blank("en")


def tokenize(text, tokenizer):
    """The token strings of one sentence."""
    return [tok.text for tok in tokenizer.tokenizer(text) if not tok.is_space]


# --- from notebooks/03_multi30k.py ---
SPECIALS = ("<s>", "</s>", "<blank>", "<unk>")
BOS, EOS, PAD, UNK = 0, 1, 2, 3


class Vocab:
    """Token ↔ id maps; the specials come first and unknowns map to UNK."""

    def __init__(self, itos):
        itos = list(itos)
        if tuple(itos[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary must start with {SPECIALS}")
        if len(set(itos)) != len(itos):
            raise ValueError("a vocabulary cannot repeat a token")
        self._itos = itos
        self._stoi = {token: i for i, token in enumerate(itos)}

    @classmethod
    def build(cls, sentences, min_freq=2):
        """Vocabulary of tokens seen at least `min_freq` times."""
        counts = Counter(token for tokens in sentences for token in tokens)
        kept = [t for t, n in counts.items() if n >= min_freq]
        kept = [t for t in kept if t not in SPECIALS]
        kept.sort(key=lambda t: (-counts[t], t))
        return cls([*SPECIALS, *kept])

    def __len__(self):
        return len(self._itos)

    def __contains__(self, token):
        return token in self._stoi

    def __getitem__(self, token):
        return self._stoi.get(token, UNK)

    def __call__(self, tokens):
        return [self._stoi.get(token, UNK) for token in tokens]

    def __eq__(self, other):
        return isinstance(other, Vocab) and self._itos == other._itos

    __hash__ = None

    def lookup_token(self, index):
        return self._itos[int(index)]

    def lookup_tokens(self, indices):
        return [self._itos[int(i)] for i in indices]

    def get_stoi(self):
        return dict(self._stoi)

    def get_itos(self):
        return list(self._itos)

    def save(self, path):
        """Write the vocabulary as a JSON list of tokens."""
        text = json.dumps({"itos": self._itos}, ensure_ascii=False)
        Path(path).write_text(text, encoding="utf-8")

    @classmethod
    def load(cls, path):
        """Read a vocabulary written by `save`."""
        return cls(json.loads(Path(path).read_text(encoding="utf-8"))["itos"])


# --- from notebooks/03_multi30k.py ---
def build_vocabulary(spacy_de, spacy_en, min_freq=2):
    """Source (German) and target (English) vocabularies of train."""
    train = read_multi30k("train")
    vocab_src = Vocab.build(
        (tokenize(de, spacy_de) for de, _ in train), min_freq
    )
    vocab_tgt = Vocab.build(
        (tokenize(en, spacy_en) for _, en in train), min_freq
    )
    return vocab_src, vocab_tgt


def load_vocab(spacy_de, spacy_en, path=None, min_freq=2):
    """The vocabularies, cached as JSON in `path` (data/vocab.json)."""
    import spacy

    path = Path(path) if path is not None else data_dir() / "vocab.json"
    key = {"min_freq": min_freq, "spacy": spacy.__version__}
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("key") == key:
            return Vocab(saved["src"]), Vocab(saved["tgt"])
    vocab_src, vocab_tgt = build_vocabulary(spacy_de, spacy_en, min_freq)
    saved = {"key": key, "src": vocab_src.get_itos()}
    saved["tgt"] = vocab_tgt.get_itos()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.write_text(json.dumps(saved, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)  # atomic: parallel ranks never read half a file
    return vocab_src, vocab_tgt


# --- from notebooks/03_multi30k.py ---
def encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en):
    """Each (de, en) pair as two id lists, `<s> ... </s>`."""
    return [
        (
            [BOS, *vocab_src(tokenize(de, spacy_de)), EOS],
            [BOS, *vocab_tgt(tokenize(en, spacy_en)), EOS],
        )
        for de, en in pairs
    ]


def collate_batch(batch, pad_id=PAD):
    """Pad encoded (src, tgt) id lists to the longest in this batch."""
    pad = torch.nn.utils.rnn.pad_sequence
    src = pad(
        [torch.tensor(s, dtype=torch.long) for s, _ in batch],
        batch_first=True,
        padding_value=pad_id,
    )  # (B, S)
    tgt = pad(
        [torch.tensor(t, dtype=torch.long) for _, t in batch],
        batch_first=True,
        padding_value=pad_id,
    )  # (B, T)
    return src, tgt


# --- from notebooks/03_multi30k.py ---
class TokenBatchSampler(torch.utils.data.Sampler):
    """Length-bucketed batches within a token budget, split across ranks."""

    def __init__(
        self,
        lengths,
        max_tokens,
        max_len=None,
        num_replicas=1,
        rank=0,
        shuffle=True,
        seed=0,
    ):
        max_len = max_tokens if max_len is None else max_len
        if max_len > max_tokens:
            raise ValueError("max_len must not exceed max_tokens")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        self.sizes = [max(s, t) for s, t in lengths]  # padded width per pair
        self.kept = [i for i, n in enumerate(self.sizes) if n <= max_len]
        self.dropped = [i for i, n in enumerate(self.sizes) if n > max_len]
        self.max_tokens, self.max_len = max_tokens, max_len
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self._cache = None

    def set_epoch(self, epoch):
        """Reshuffle for `epoch` (the same on every rank)."""
        self.epoch = epoch

    def all_batches(self):
        """The batches of every rank for the current epoch."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        rng = random.Random(f"{self.seed}/{self.epoch}")
        order = list(self.kept)
        if self.shuffle:
            rng.shuffle(order)
        order.sort(key=self.sizes.__getitem__)  # stable: ties stay shuffled
        batches, batch = [], []
        for i in order:  # sizes ascend, so sizes[i] is the batch's width
            if batch and (len(batch) + 1) * self.sizes[i] > self.max_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        batches += [batch] if batch else []
        while len(batches) % self.num_replicas:
            k = max(range(len(batches)), key=lambda b: len(batches[b]))
            if len(batches[k]) < 2:
                raise ValueError("too few examples to give every rank a batch")
            half = len(batches[k]) // 2
            batches[k : k + 1] = [batches[k][:half], batches[k][half:]]
        if self.shuffle:
            rng.shuffle(batches)
        self._cache = (self.epoch, batches)
        return batches

    def __iter__(self):
        yield from self.all_batches()[self.rank :: self.num_replicas]

    def __len__(self):
        return len(self.all_batches()) // self.num_replicas


# --- from notebooks/03_multi30k.py ---
def create_dataloaders(
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    max_tokens=4000,
    max_len=128,
    rank=0,
    world_size=1,
    seed=0,
    num_workers=0,
):
    """Train and validation DataLoaders of padded (src, tgt) CPU tensors."""
    loaders = []
    for split, shuffle, limit in (
        ("train", True, max_len),
        ("val", False, None),
    ):
        data = encode_pairs(
            read_multi30k(split), vocab_src, vocab_tgt, spacy_de, spacy_en
        )
        sampler = TokenBatchSampler(
            [(len(s), len(t)) for s, t in data],
            max_tokens,
            max_len=limit,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
        )
        if sampler.dropped:
            warnings.warn(
                f"{split}: left out {len(sampler.dropped)} of {len(data)} "
                f"pairs longer than {sampler.max_len} tokens",
                stacklevel=2,
            )
        loaders.append(
            torch.utils.data.DataLoader(
                data,
                batch_sampler=sampler,
                collate_fn=collate_batch,
                num_workers=num_workers,
            )
        )
    return tuple(loaders)
