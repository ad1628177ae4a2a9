# =============================================================================
# GENERATED FILE: edit the notebooks, not this file.
# Source: notebooks/NN_*.py (cells starting with "#| export").
# Regenerate with `make export`; `make check-sync` fails on drift.
# =============================================================================
"""The Annotated Transformer, done right: the notebooks' code as a module.

Importing it has no side effects and needs only torch. Each section below
names the notebook and heading that explain it. Run
``python the_annotated_transformer.py --help`` for the command line.
"""

import argparse
import copy
import functools
import gzip
import hashlib
import http.client
import json
import math
import os
import random
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "EncoderDecoder",
    "Generator",
    "clones",
    "Encoder",
    "LayerNorm",
    "SublayerConnection",
    "EncoderLayer",
    "Decoder",
    "DecoderLayer",
    "subsequent_mask",
    "save_chart",
    "attention",
    "MultiHeadedAttention",
    "PositionwiseFeedForward",
    "Embeddings",
    "PositionalEncoding",
    "make_model",
    "count_parameters",
    "Batch",
    "TrainState",
    "with_last_flag",
    "optimizer_step",
    "run_epoch",
    "rate",
    "make_optimizer",
    "learning_rate_chart",
    "LabelSmoothing",
    "label_smoothing_chart",
    "label_smoothing_penalty_rows",
    "label_smoothing_penalty_chart",
    "data_gen",
    "SimpleLossCompute",
    "greedy_decode",
    "warmup_linear_decay",
    "CopyTaskConfig",
    "CopyTaskCIConfig",
    "native_bf16",
    "copy_accuracy",
    "copy_accuracy_teacher_forced",
    "CopyLossCompute",
    "train_copy_task",
    "copy_progress_chart",
    "MULTI30K_BASE_URL",
    "MULTI30K_ENV",
    "MULTI30K_SPLITS",
    "MULTI30K_SHA256",
    "DatasetError",
    "data_dir",
    "sha256_of",
    "download_multi30k",
    "read_multi30k",
    "load_tokenizers",
    "tokenize",
    "SPECIALS",
    "Vocab",
    "build_vocabulary",
    "load_vocab",
    "encode_text",
    "encode_pairs",
    "collate_batch",
    "TokenBatchSampler",
    "create_dataloaders",
    "TrainConfig",
    "PRESETS",
    "get_config",
    "UserError",
    "pick_device",
    "free_port",
    "autocast_context",
    "init_distributed",
    "save_checkpoint",
    "load_checkpoint",
    "epoch_checkpoints",
    "vocab_state",
    "as_vocab",
    "vocab_fields",
    "TrackedLossCompute",
    "device_batches",
    "params_in_sync",
    "train_worker",
    "train_distributed_model",
    "train_model",
    "load_trained_model",
    "batch_greedy_decode",
    "strip_specials",
    "detokenize",
    "decode_text",
    "translate_batch",
    "compute_bleu",
    "check_outputs",
    "run_model_example",
    "hardware_summary",
    "read_lines",
    "evaluate_files",
    "build_parser",
    "command_train",
    "write_results",
    "command_evaluate",
    "command_translate",
    "record_attention",
    "ATTENTION_KINDS",
    "AttentionView",
    "AttentionMaps",
    "attention_maps",
    "attention_frame",
    "attention_chart",
    "attention_statistics",
    "attention_summary",
    "attention_summary_chart",
    "DecoderCache",
    "attend_step",
    "cached_self_attention",
    "decoder_layer_step",
    "decode_step",
    "cached_greedy_decode",
    "length_penalty",
    "beam_candidates",
    "beam_search_steps",
    "beam_search",
    "BPE_VOCAB_SIZE",
    "BpeVocab",
    "train_bpe",
    "load_bpe",
    "average",
    "average_checkpoints",
    "load_translator",
]


# =============================================================================
# Part 1: The model architecture
# notebooks/01_model.py
# =============================================================================


# -----------------------------------------------------------------------------
# The encoder–decoder frame
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
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


class Generator(nn.Module):
    """Linear projection to the vocabulary, then log-softmax."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        """(B, T, d_model) hidden states to (B, T, vocab) log-probs."""
        return F.log_softmax(self.proj(x), dim=-1)


# -----------------------------------------------------------------------------
# Encoder
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
def clones(module, N):
    """N independent deep copies of a module, in a ModuleList."""
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


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


class SublayerConnection(nn.Module):
    """Pre-norm residual block: x + dropout(sublayer(norm(x)))."""

    def __init__(self, size, dropout):
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        """Apply a same-shape sublayer to (B, T, d_model) with a residual."""
        return x + self.dropout(sublayer(self.norm(x)))


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


# -----------------------------------------------------------------------------
# Decoder
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
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


def subsequent_mask(size):
    """(1, size, size) bool mask, True where key position <= query."""
    upper = torch.triu(torch.ones(1, size, size, dtype=torch.bool), 1)
    return ~upper


def save_chart(chart, name, folder="figures"):
    """Show a chart, and also write it as static SVG and PNG files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chart.save(str(folder / f"{name}.svg"))
    chart.save(str(folder / f"{name}.png"), scale_factor=1.5)
    return chart


# -----------------------------------------------------------------------------
# Attention
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
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


# -----------------------------------------------------------------------------
# Position-wise feed-forward networks
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
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


# -----------------------------------------------------------------------------
# Embeddings
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
class Embeddings(nn.Module):
    """Token embedding table scaled by sqrt(d_model)."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        """(B, T) ids to (B, T, d_model) vectors."""
        return self.lut(x) * math.sqrt(self.d_model)


# -----------------------------------------------------------------------------
# Positional encoding
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
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


# -----------------------------------------------------------------------------
# The full model
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
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


# -----------------------------------------------------------------------------
# Counting parameters
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
def count_parameters(module):
    """Number of distinct trainable parameters (shared ones once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


# =============================================================================
# Part 2: Training, and a first task: copying
# notebooks/02_training.py
# =============================================================================


# -----------------------------------------------------------------------------
# Batches and masks
# Explained in notebooks/02_training.py, same heading.
# -----------------------------------------------------------------------------
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


# -----------------------------------------------------------------------------
# The training loop
# Explained in notebooks/02_training.py, same heading.
# -----------------------------------------------------------------------------
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
    autocast=nullcontext,
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
                with autocast():  # entered afresh for every micro-batch
                    out = model(
                        batch.src, batch.tgt, batch.src_mask, batch.tgt_mask
                    )  # (B, T, d_model)
                    loss, loss_node = loss_compute(
                        out, batch.tgt_y, batch.ntokens
                    )
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
                optimizer_step(
                    optimizer,
                    scheduler,
                    model.parameters(),
                    scale=accum_iter / window,
                )
                train_state.accum_step += 1
                window = 0
            if mode == "train+log" and i % log_every == 1:
                lr = optimizer.param_groups[0]["lr"]
                rate = tokens_since_log / (time.time() - start)
                print(
                    f"step {i:5d} | accum step {train_state.accum_step:5d}"
                    f" | loss {loss_node.item():6.3f} | {rate:7.1f} tok/s"
                    f" | lr {lr:6.1e}"
                )
                start, tokens_since_log = time.time(), 0
    return total_loss / max(total_tokens, 1), train_state


# -----------------------------------------------------------------------------
# Optimizer and learning-rate schedule
# Explained in notebooks/02_training.py, same heading.
# -----------------------------------------------------------------------------
def rate(step, model_size, factor, warmup):
    """Warm-up then inverse-square-root learning rate (paper eq. 3)."""
    step = max(step, 1)
    return factor * model_size**-0.5 * min(step**-0.5, step * warmup**-1.5)


def make_optimizer(
    model, d_model, factor=1.0, warmup=4000, betas=(0.9, 0.98), schedule=None
):
    """Adam (paper's betas by default) and a LambdaLR running `rate`.

    `schedule`, a function of the step, replaces `rate` when given.
    """
    fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1.0, betas=betas, eps=1e-9, fused=fused
    )
    if schedule is None:
        schedule = lambda step: rate(step, d_model, factor, warmup)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return optimizer, scheduler


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


# -----------------------------------------------------------------------------
# Label smoothing
# Explained in notebooks/02_training.py, same heading.
# -----------------------------------------------------------------------------
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
            color=alt.Color(
                "target probability:Q", scale=alt.Scale(scheme="viridis")
            ),
            tooltip=["example", "token", "target probability"],
        )
        .properties(title="Smoothed targets", width=240, height=240)
    )


def label_smoothing_penalty_rows(margins=range(0, 25), smoothing=0.1):
    """Loss of one prediction against its margin, with and without LS."""
    rows = []
    for eps in (0.0, smoothing):
        crit = LabelSmoothing(6, padding_idx=0, smoothing=eps)
        for m in margins:
            logits = torch.tensor([[-1e4, 0.0, float(m), 0.0, 0.0, 0.0]])
            loss = crit(logits.log_softmax(-1), torch.tensor([2]))
            rows.append(
                {
                    "margin": m,
                    "loss": float(loss),
                    "smoothing": f"smoothing={eps}",
                }
            )
    return rows


def label_smoothing_penalty_chart(smoothing=0.1):
    """Line chart of label_smoothing_penalty_rows."""
    import altair as alt
    import pandas as pd

    df = pd.DataFrame(label_smoothing_penalty_rows(smoothing=smoothing))
    return (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(
            x="margin:Q",
            y="loss:Q",
            color="smoothing:N",
            tooltip=["smoothing", "margin", "loss"],
        )
        .properties(title="Loss against confidence", width=480)
    )


# -----------------------------------------------------------------------------
# A first example: the copy task
# Explained in notebooks/02_training.py, same heading.
# -----------------------------------------------------------------------------
COPY_PAD, COPY_START = 0, 1


def data_gen(V, batch_size, nbatches, seq_len=10, generator=None):
    """Yield `nbatches` random copy-task batches over V tokens."""
    for _ in range(nbatches):
        data = torch.randint(2, V, (batch_size, seq_len), generator=generator)
        data[:, 0] = COPY_START
        yield Batch(data, data.clone(), pad=COPY_PAD)


class SimpleLossCompute:
    """Generator + criterion, normalized by the token count."""

    def __init__(self, generator, criterion):
        self.generator = generator
        self.criterion = criterion

    def __call__(self, x, y, norm):
        """Return (summed loss as float, mean loss per token as tensor)."""
        logp = self.generator(x)  # (B, T, vocab)
        sloss = (
            self.criterion(logp.reshape(-1, logp.size(-1)), y.reshape(-1))
            / norm
        )
        return sloss.item() * norm, sloss


def greedy_decode(model, src, src_mask, max_len, start_symbol):
    """Most-probable-token decoding: (B, S) source to (B, max_len) ids."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    ys = torch.full(
        (src.size(0), 1), start_symbol, dtype=src.dtype, device=src.device
    )  # (B, 1)
    for _ in range(max_len - 1):
        out = model.decode(
            memory, src_mask, ys, subsequent_mask(ys.size(1)).to(src.device)
        )
        next_word = model.generator(out[:, -1]).argmax(dim=-1)  # (B,)
        ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)
    return ys


def warmup_linear_decay(step, peak, warmup, total, floor=0.02):
    """Linear warm-up to `peak`, then linear decay to `floor * peak`."""
    ramp = (step + 1) / warmup
    decay = max(floor, 1 - step / total)
    return peak * min(ramp, decay)


@dataclass
class CopyTaskConfig:
    """Hyperparameters of the copy task (N=2, d_model=512 as in 2022)."""

    V: int = 11
    N: int = 2
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8
    dropout: float = 0.0
    batch_size: int = 16
    nbatches: int = 20  # optimizer steps per epoch
    max_epochs: int = 100
    lr: float = 3e-4  # peak learning rate
    warmup: int = 20
    decay_steps: int = 300  # where the rate reaches its floor
    beta2: float = 0.999
    bf16: bool = True  # only where bf16 is native, see native_bf16
    check_size: int = 200
    seed: int = 0


@dataclass
class CopyTaskCIConfig(CopyTaskConfig):
    """A smaller model for CI: the same task and procedure, in seconds."""

    N: int = 1
    d_model: int = 64
    d_ff: int = 256
    h: int = 4
    lr: float = 3e-3
    bf16: bool = False


def native_bf16(device_type="cpu"):
    """True where bfloat16 matmuls run natively on this device type."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:  # CPUs with AVX512-BF16 or AMX
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def copy_accuracy(model, n, V=11, seq_len=10, generator=None):
    """Fraction of n fresh random sequences greedy decoding copies exactly."""
    model.eval()
    batch = next(data_gen(V, n, 1, seq_len, generator=generator))
    with torch.no_grad():
        out = greedy_decode(
            model, batch.src, batch.src_mask, seq_len, COPY_START
        )
    return (out == batch.src).all(dim=1).float().mean().item()


def copy_accuracy_teacher_forced(model, n, V=11, seq_len=10, generator=None):
    """The same fraction from one teacher-forced forward pass."""
    model.eval()
    b = next(data_gen(V, n, 1, seq_len, generator=generator))
    with torch.no_grad():
        out = model(b.src, b.tgt, b.src_mask, b.tgt_mask)  # (n, T, d_model)
        pred = model.generator(out).argmax(dim=-1)  # (n, T)
    return (pred == b.tgt_y).all(dim=1).float().mean().item()


class CopyLossCompute(SimpleLossCompute):
    """SimpleLossCompute that also counts exactly predicted sequences.

    `streak` is the number of sequences in a row, up to the latest batch,
    whose every target token was the most probable one; `sequences` and
    `exact` are running totals.
    """

    def __init__(self, generator, criterion, pad=COPY_PAD):
        super().__init__(generator, criterion)
        self.pad = pad
        self.streak = self.sequences = self.exact = 0

    def __call__(self, x, y, norm):
        result = super().__call__(x, y, norm)
        with torch.no_grad():
            right = self.generator(x.detach()).argmax(dim=-1) == y
            exact = (right | (y == self.pad)).all(dim=1)  # (B,)
        misses = (~exact).nonzero()
        if len(misses) == 0:
            self.streak += len(exact)
        else:
            self.streak = len(exact) - 1 - misses[-1].item()
        self.sequences += len(exact)
        self.exact += int(exact.sum())
        return result


def train_copy_task(cfg=None, log=print):
    """Train until exact copy; returns (model, list of epoch records)."""
    cfg = cfg or CopyTaskConfig()
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = make_model(
        cfg.V,
        cfg.V,
        N=cfg.N,
        d_model=cfg.d_model,
        d_ff=cfg.d_ff,
        h=cfg.h,
        dropout=cfg.dropout,
    )
    criterion = LabelSmoothing(cfg.V, padding_idx=COPY_PAD, smoothing=0.0)
    loss_compute = CopyLossCompute(model.generator, criterion)
    optimizer, scheduler = make_optimizer(
        model,
        cfg.d_model,
        betas=(0.9, cfg.beta2),
        schedule=lambda step: warmup_linear_decay(
            step, cfg.lr, cfg.warmup, cfg.decay_steps
        ),
    )
    use_bf16 = cfg.bf16 and native_bf16("cpu")
    amp = lambda: torch.autocast("cpu", torch.bfloat16, enabled=use_bf16)
    state, history, start = TrainState(), [], time.time()
    for epoch in range(cfg.max_epochs):
        model.train()
        seen, exact = loss_compute.sequences, loss_compute.exact
        loss, state = run_epoch(
            data_gen(cfg.V, cfg.batch_size, cfg.nbatches, generator=gen),
            model,
            loss_compute,
            optimizer,
            scheduler,
            train_state=state,
            autocast=amp,
        )
        train_exact = (loss_compute.exact - exact) / (
            loss_compute.sequences - seen
        )
        checked = None  # greedy check, only once the streak is long enough
        if loss_compute.streak >= cfg.check_size:
            checked = copy_accuracy(
                model, cfg.check_size, cfg.V, generator=gen
            )
            if checked < 1.0:
                loss_compute.streak = 0  # earn another streak first
        history.append(
            {
                "epoch": epoch,
                "steps": state.accum_step,
                "samples": state.samples,
                "train_loss": loss,
                "train_exact": train_exact,
                "exact_copy": checked,
                "seconds": time.time() - start,
            }
        )
        greedy = "" if checked is None else f" | greedy check {checked:6.1%}"
        log(
            f"epoch {epoch:2d} | step {state.accum_step:4d} | loss "
            f"{loss:.4f} | exact while training {train_exact:6.1%}{greedy}"
            f" | {time.time() - start:5.1f} s"
        )
        if checked == 1.0:
            break
    return model, history


def copy_progress_chart(history):
    """Altair chart: exactly copied training sequences per epoch."""
    import altair as alt
    import pandas as pd

    rows = pd.DataFrame(history)
    return (
        alt.Chart(rows)
        .mark_line(point=True)
        .encode(
            x=alt.X("steps:Q", title="optimizer steps"),
            y=alt.Y(
                "train_exact:Q",
                title="sequences copied exactly",
                axis=alt.Axis(format="%"),
                scale=alt.Scale(domain=[0, 1]),
            ),
            tooltip=["epoch", "steps", "train_loss", "train_exact"],
        )
        .properties(width=420, height=220, title="Learning to copy")
    )


# =============================================================================
# Part 3: A real task, Multi30k German → English
# notebooks/03_multi30k.py
# =============================================================================


# -----------------------------------------------------------------------------
# Downloading Multi30k
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
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


def _offline_hint(folder):
    """What to do when the files cannot be fetched."""
    return (
        f"The files belong in {folder}. Without internet access, copy the "
        "six Multi30k files (train, val and test_2016_flickr, each .de.gz "
        f"and .en.gz) there yourself, or set {MULTI30K_ENV} to a folder "
        "that holds them."
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
                + _offline_hint(path.parent)
            )
        os.replace(tmp, path)
        tmp = None
    except (OSError, http.client.HTTPException) as error:
        reason = error
        if type(error) is urllib.error.URLError:
            reason = error.reason
        raise DatasetError(
            f"Could not download {url} ({reason}).\n"
            + _offline_hint(path.parent)
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


# -----------------------------------------------------------------------------
# Tokenizers
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
def load_tokenizers():
    """Rule-based German and English spaCy tokenizers (no download)."""
    import spacy

    return spacy.blank("de"), spacy.blank("en")


def tokenize(text, tokenizer):
    """The token strings of one sentence."""
    return [tok.text for tok in tokenizer.tokenizer(text) if not tok.is_space]


# -----------------------------------------------------------------------------
# Vocabulary
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
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
        """The token with id `index`."""
        return self._itos[int(index)]

    def lookup_tokens(self, indices):
        """The tokens of a sequence of ids."""
        return [self._itos[int(i)] for i in indices]

    def get_stoi(self):
        """A copy of the token → id dict."""
        return dict(self._stoi)

    def get_itos(self):
        """A copy of the id → token list."""
        return list(self._itos)

    def save(self, path):
        """Write the vocabulary as a JSON list of tokens."""
        text = json.dumps({"itos": self._itos}, ensure_ascii=False)
        Path(path).write_text(text, encoding="utf-8")

    @classmethod
    def load(cls, path):
        """Read a vocabulary written by `save`."""
        return cls(json.loads(Path(path).read_text(encoding="utf-8"))["itos"])


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


# -----------------------------------------------------------------------------
# Batching
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
def encode_text(text, tokenizer, vocab):
    """Ids of one sentence, without `<s>` and `</s>`."""
    if isinstance(vocab, Vocab):
        return vocab(tokenize(text, tokenizer))
    return vocab.encode(text)  # a BPE vocabulary reads raw text (Part 5)


def encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en):
    """Each (de, en) pair as two id lists, `<s> ... </s>`."""
    return [
        (
            [BOS, *encode_text(de, spacy_de, vocab_src), EOS],
            [BOS, *encode_text(en, spacy_en, vocab_tgt), EOS],
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
    max_train_pairs=0,
):
    """Train and validation DataLoaders of padded (src, tgt) CPU tensors."""
    loaders = []
    for split, shuffle, limit, n_pairs in (
        ("train", True, max_len, max_train_pairs),
        ("val", False, None, max_train_pairs // 4),
    ):
        pairs = read_multi30k(split)
        pairs = pairs[:n_pairs] if n_pairs else pairs
        data = encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en)
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


# -----------------------------------------------------------------------------
# Training on Multi30k
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Everything that defines a Multi30k training run."""

    preset: str = "cpu"
    N: int = 3
    d_model: int = 256
    d_ff: int = 1024
    h: int = 4
    dropout: float = 0.1
    label_smoothing: float = 0.1
    max_tokens: int = 3000  # token budget of one batch, per process
    accum_iter: int = 1
    num_epochs: int = 20
    factor: float = 1.0
    warmup: int = 800
    max_len: int = 128
    max_train_pairs: int = 0  # 0 means all 29,000
    seed: int = 0
    amp: str = "bf16"  # "bf16" autocast where native, or "none"
    checkpoint_dir: str = "checkpoints/cpu"
    num_workers: int = 0
    tokenization: str = "word"  # or "bpe": one subword vocabulary (Part 5)
    tie_embeddings: bool = False  # share embeddings and generator (Part 5)


PRESETS = {
    "paper": TrainConfig(
        preset="paper",
        N=6,
        d_model=512,
        d_ff=2048,
        h=8,
        max_tokens=8000,
        num_epochs=40,
        warmup=800,
        checkpoint_dir="checkpoints/paper",
    ),
    "cpu": TrainConfig(),
    "smoke": TrainConfig(
        preset="smoke",
        N=1,
        d_model=64,
        d_ff=128,
        h=2,
        dropout=0.0,
        max_tokens=1500,
        num_epochs=2,
        warmup=20,
        factor=2.0,
        max_train_pairs=1000,
        amp="none",
        checkpoint_dir="checkpoints/smoke",
    ),
}
PRESETS |= {  # the same with one BPE vocabulary and tied embeddings
    f"{name}-bpe": replace(
        PRESETS[name],
        preset=f"{name}-bpe",
        tokenization="bpe",
        tie_embeddings=True,
        checkpoint_dir=f"checkpoints/{name}-bpe",
    )
    for name in ("cpu", "smoke")
}


def get_config(preset="cpu", **overrides):
    """A preset's TrainConfig with some fields replaced."""
    if preset not in PRESETS:
        raise UserError(
            f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}"
        )
    return replace(PRESETS[preset], **overrides)


class UserError(Exception):
    """A problem with the user's input, reported without a traceback."""


def pick_device(rank=0):
    """cuda:rank when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autocast_context(device, amp="bf16"):
    """bf16 autocast where the hardware runs it natively, else a no-op."""
    if amp == "bf16" and native_bf16(device.type):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def init_distributed(rank, world_size, port=None):
    """Join the process group (env:// under torchrun, tcp otherwise)."""
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if port is None:  # torchrun sets MASTER_ADDR and MASTER_PORT
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )


def save_checkpoint(path, **fields):
    """Write a dict of tensors and plain types atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    torch.save(fields, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, device="cpu"):
    """Read a checkpoint safely (weights_only) onto `device`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"no checkpoint at {path}; train one first with "
            "`python the_annotated_transformer.py train`"
        )
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # truncated file, not a checkpoint, ...
        raise UserError(f"{path} is not a readable checkpoint: {err}") from err


def epoch_checkpoints(folder):
    """The epoch checkpoints in a folder, oldest first."""
    return sorted(Path(folder).glob("epoch_*.pt"))


def vocab_state(vocab):
    """A vocabulary as plain data: its tokens, or a BPE model's JSON."""
    return vocab.to_str() if hasattr(vocab, "to_str") else vocab.get_itos()


def as_vocab(state):
    """The vocabulary that `vocab_state` gave (or a vocabulary itself)."""
    if isinstance(state, str):
        return BpeVocab.from_str(state)  # noqa: F821 (Part 5)
    return Vocab(state) if isinstance(state, (list, tuple)) else state


def vocab_fields(vocab_src, vocab_tgt):
    """Checkpoint entries from which both vocabularies can be rebuilt."""
    fields = {
        "vocab_src": vocab_src.get_itos(),
        "vocab_tgt": vocab_tgt.get_itos(),
    }
    if not isinstance(vocab_tgt, Vocab):  # BPE: also its merges, as JSON
        fields["bpe"] = vocab_state(vocab_tgt)
    return fields


class TrackedLossCompute(SimpleLossCompute):
    """SimpleLossCompute that also drives a tqdm progress bar."""

    def __init__(self, generator, criterion, bar=None, optimizer=None):
        super().__init__(generator, criterion)
        self.bar, self.optimizer = bar, optimizer
        self.start, self.tokens = time.time(), 0

    def __call__(self, x, y, norm):
        total, sloss = super().__call__(x, y, norm)
        if self.bar is not None:
            self.tokens += norm
            rate = self.tokens / (time.time() - self.start)
            postfix = {
                "loss": f"{total / max(norm, 1):.3f}",
                "tok/s": f"{rate:.0f}",
            }
            if self.optimizer is not None:
                postfix["lr"] = f"{self.optimizer.param_groups[0]['lr']:.2e}"
            if x.device.type == "cuda":
                gib = torch.cuda.max_memory_allocated(x.device) / 2**30
                postfix["mem"] = f"{gib:.1f}GiB"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        return total, sloss


def device_batches(loader, device):
    """Batches from a DataLoader of (src, tgt), moved to `device`."""
    for src, tgt in loader:
        yield Batch(src, tgt, pad=PAD).to(device)


def params_in_sync(module):
    """True when every process holds exactly the same parameters."""
    import torch.distributed as dist

    flat = torch.cat(
        [p.detach().float().reshape(-1) for p in module.parameters()]
    )
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def train_worker(
    rank,
    world_size,
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    config,
    is_distributed=False,
    port=None,
    resume=False,
    show_progress=True,
):
    """Train on Multi30k in one process; returns the val losses per epoch."""
    from tqdm import tqdm

    config = TrainConfig(**config) if isinstance(config, dict) else config
    vocab_src, vocab_tgt = (as_vocab(v) for v in (vocab_src, vocab_tgt))
    # (a spawned process receives plain token lists, or BPE JSON text)
    if spacy_de is None or spacy_en is None:
        spacy_de, spacy_en = load_tokenizers()
    if is_distributed:
        init_distributed(rank, world_size, port)
    device = pick_device(rank)
    if device.type == "cpu" and world_size > 1:  # share the cores, no spin
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    torch.manual_seed(config.seed)
    model = make_model(
        len(vocab_src),
        len(vocab_tgt),
        N=config.N,
        d_model=config.d_model,
        d_ff=config.d_ff,
        h=config.h,
        dropout=config.dropout,
        tie_embeddings=config.tie_embeddings,
    ).to(device)
    module = model
    if is_distributed:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=ids
        )
    train_loader, valid_loader = create_dataloaders(
        vocab_src,
        vocab_tgt,
        spacy_de,
        spacy_en,
        max_tokens=config.max_tokens,
        max_len=config.max_len,
        rank=rank,
        world_size=world_size,
        seed=config.seed,
        num_workers=config.num_workers,
        max_train_pairs=config.max_train_pairs,
    )
    criterion = LabelSmoothing(
        len(vocab_tgt), padding_idx=PAD, smoothing=config.label_smoothing
    )
    optimizer, scheduler = make_optimizer(
        module, config.d_model, config.factor, config.warmup
    )
    state, history, first_epoch = TrainState(), [], 0
    if resume and epoch_checkpoints(config.checkpoint_dir):
        ckpt = load_checkpoint(
            epoch_checkpoints(config.checkpoint_dir)[-1], device
        )
        module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        state, history = TrainState(**ckpt["train_state"]), ckpt["history"]
        torch.set_rng_state(ckpt["rng_state"])
        first_epoch = ckpt["epoch"] + 1
    show = show_progress and rank == 0
    amp = partial(autocast_context, device, config.amp)
    for epoch in range(first_epoch, config.num_epochs):
        train_loader.batch_sampler.set_epoch(epoch)
        model.train()
        with tqdm(
            total=len(train_loader),
            disable=not show,
            leave=False,
            desc=f"epoch {epoch} train",
        ) as bar:
            loss_compute = TrackedLossCompute(
                module.generator, criterion, bar, optimizer
            )
            train_loss, state = run_epoch(
                device_batches(train_loader, device),
                model,
                loss_compute,
                optimizer,
                scheduler,
                mode="train",
                accum_iter=config.accum_iter,
                train_state=state,
                autocast=amp,
            )
        model.eval()
        val_loss, _ = run_epoch(
            device_batches(valid_loader, device),
            model,
            SimpleLossCompute(module.generator, criterion),
            mode="eval",
            autocast=amp,
        )
        history.append(
            {
                "epoch": epoch,
                "train_loss": train_loss,
                "val_loss": val_loss,
                "steps": state.accum_step,
            }
        )
        if show:
            tqdm.write(
                f"epoch {epoch:3d} | train loss {train_loss:.3f} | "
                f"val loss {val_loss:.3f} | steps {state.accum_step}"
            )
        if rank == 0:
            save_checkpoint(
                Path(config.checkpoint_dir) / f"epoch_{epoch:03d}.pt",
                model=module.state_dict(),
                optimizer=optimizer.state_dict(),
                scheduler=scheduler.state_dict(),
                train_state=asdict(state),
                rng_state=torch.get_rng_state(),
                config=asdict(config),
                **vocab_fields(vocab_src, vocab_tgt),
                epoch=epoch,
                history=history,
            )
    in_sync = params_in_sync(module) if is_distributed else True
    if rank == 0:
        save_checkpoint(
            Path(config.checkpoint_dir) / "final.pt",
            model=module.state_dict(),
            config=asdict(config),
            **vocab_fields(vocab_src, vocab_tgt),
            epoch=config.num_epochs - 1,
            history=history,
            ranks_in_sync=in_sync,
        )
    if is_distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return history


def train_distributed_model(
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    config,
    world_size=None,
    resume=False,
):
    """Train with one process per GPU (or world_size CPU processes)."""
    import torch.multiprocessing as mp

    world_size = world_size or max(torch.cuda.device_count(), 1)
    # Only plain data crosses to the new processes: token lists (or BPE
    # JSON text) and a dict (spaCy tokenizers are rebuilt there; they are
    # cheap to make).
    mp.spawn(
        train_worker,
        nprocs=world_size,
        args=(
            world_size,
            vocab_state(vocab_src),
            vocab_state(vocab_tgt),
            None,
            None,
            asdict(config),
            True,
            free_port(),
            resume,
        ),
    )


def train_model(
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    config,
    distributed=False,
    world_size=None,
    resume=False,
):
    """Train in this process, or in several when `distributed`."""
    if distributed:
        return train_distributed_model(
            vocab_src,
            vocab_tgt,
            spacy_de,
            spacy_en,
            config,
            world_size,
            resume,
        )
    return train_worker(
        0, 1, vocab_src, vocab_tgt, spacy_de, spacy_en, config, resume=resume
    )


def load_trained_model(path, device="cpu"):
    """(model in eval mode, vocab_src, vocab_tgt, config) from a checkpoint."""
    ckpt = load_checkpoint(path, device)
    try:
        config = TrainConfig(**ckpt["config"])
        if config.tokenization == "bpe":
            vocab_src = vocab_tgt = as_vocab(ckpt["bpe"])
        else:
            vocab_src, vocab_tgt = (
                Vocab(ckpt["vocab_src"]),
                Vocab(ckpt["vocab_tgt"]),
            )
        model = make_model(
            len(vocab_src),
            len(vocab_tgt),
            N=config.N,
            d_model=config.d_model,
            d_ff=config.d_ff,
            h=config.h,
            dropout=0.0,
            tie_embeddings=config.tie_embeddings,
        )
        model.load_state_dict(ckpt["model"])
    except (KeyError, TypeError, RuntimeError) as err:
        raise UserError(
            f"{path} does not match this code's Multi30k model: {err}"
        ) from err
    return model.to(device).eval(), vocab_src, vocab_tgt, config


# -----------------------------------------------------------------------------
# Decoding and BLEU
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
@torch.no_grad()
def batch_greedy_decode(
    model, src, src_mask, max_len, start_symbol=BOS, end_symbol=EOS
):
    """Greedy decoding of a batch until every row has produced </s>."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    B = src.size(0)
    ys = torch.full(
        (B, 1), start_symbol, dtype=torch.long, device=src.device
    )  # (B, 1)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    for _ in range(max_len - 1):
        out = model.decode(
            memory, src_mask, ys, subsequent_mask(ys.size(1)).to(src.device)
        )
        next_word = model.generator(out[:, -1]).argmax(dim=-1)  # (B,)
        next_word = next_word.masked_fill(done, PAD)
        ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)
        done |= next_word == end_symbol
        if done.all():
            break
    return ys  # (B, <= max_len)


def strip_specials(ids, end_symbol=EOS):
    """Token ids after <s> and before the first </s>."""
    ids = list(ids)[1:]
    return ids[: ids.index(end_symbol)] if end_symbol in ids else ids


_NO_SPACE_BEFORE = {
    ".",
    ",",
    "!",
    "?",
    ";",
    ":",
    ")",
    "]",
    "}",
    "%",
    "'s",
    "'re",
    "'ve",
    "'ll",
    "'m",
    "'d",
    "n't",
    "'",
}
_NO_SPACE_AFTER = {"(", "[", "{", "$", "#"}


def detokenize(tokens):
    """Join English spaCy tokens into a plain sentence."""
    out, quote_open = "", False
    for i, tok in enumerate(tokens):
        glue = (
            i == 0
            or tok.lower() in _NO_SPACE_BEFORE
            or out.endswith(tuple(_NO_SPACE_AFTER))
            or tok == "-"
            or out.endswith("-")
            and i > 1
            and tokens[i - 1] == "-"
            and tokens[i - 2] not in {",", ".", "-"}
        )
        if tok == '"':
            glue = i == 0 or quote_open
            quote_open = not quote_open
        elif out.endswith('"') and quote_open:
            glue = True
        out += tok if glue else " " + tok
    return out


def decode_text(ids, vocab):
    """Plain text of output ids (without `<s>` and `</s>`)."""
    if isinstance(vocab, Vocab):
        return detokenize(vocab.lookup_tokens(ids))
    return vocab.decode(ids)  # a BPE vocabulary decodes itself (Part 5)


def translate_batch(
    model,
    sentences,
    spacy_de,
    vocab_src,
    vocab_tgt,
    device="cpu",
    batch_size=128,
    max_extra=50,
    decode_fn=None,
):
    """German sentences to detokenized English, in input order."""
    decode_fn = decode_fn or batch_greedy_decode
    model.eval()
    encoded = [
        [BOS, *encode_text(s, spacy_de, vocab_src), EOS] for s in sentences
    ]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    results = [None] * len(encoded)
    for k in range(0, len(order), batch_size):
        idx = order[k : k + batch_size]
        src = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(encoded[i]) for i in idx],
            batch_first=True,
            padding_value=PAD,
        ).to(device)  # (B, S)
        src_mask = (src != PAD).unsqueeze(-2)  # (B, 1, S)
        out = decode_fn(model, src, src_mask, src.size(1) + max_extra)
        for i, row in zip(idx, out.tolist(), strict=True):
            results[i] = decode_text(strip_specials(row), vocab_tgt)
    return results


def compute_bleu(hypotheses, references):
    """Cased corpus BLEU (sacreBLEU, 13a tokenization) of plain text."""
    import sacrebleu

    return sacrebleu.corpus_bleu(hypotheses, [references])


def check_outputs(
    model, pairs, spacy_de, vocab_src, vocab_tgt, n_examples=5, device="cpu"
):
    """Print source, reference and model output for some pairs."""
    pairs = list(pairs)[:n_examples]
    hyps = translate_batch(
        model.eval(),
        [de for de, _ in pairs],
        spacy_de,
        vocab_src,
        vocab_tgt,
        device,
    )
    for i, ((de, en), hyp) in enumerate(zip(pairs, hyps)):
        print(
            f"example {i}\n  source:     {de}\n  reference:  {en}\n"
            f"  model:      {hyp}\n"
        )
    return hyps


def run_model_example(checkpoint="checkpoints/cpu/final.pt", n_examples=5):
    """Load a trained model and show some validation translations."""
    model, vocab_src, vocab_tgt, _ = load_trained_model(checkpoint)
    spacy_de, _ = load_tokenizers()
    return check_outputs(
        model, read_multi30k("val"), spacy_de, vocab_src, vocab_tgt, n_examples
    )


# -----------------------------------------------------------------------------
# The command line
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
def hardware_summary():
    """A short description of the CPU or GPU this process runs on."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpus"] = [
            torch.cuda.get_device_name(i)
            for i in range(torch.cuda.device_count())
        ]
    return info


def read_lines(path):
    """Lines of a plain or gzipped UTF-8 text file, without newlines."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such file: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def evaluate_files(
    model,
    src_path,
    ref_path,
    spacy_de,
    vocab_src,
    vocab_tgt,
    device="cpu",
    batch_size=128,
    decode_fn=None,
):
    """(BLEU, hypotheses) of a model on a parallel pair of text files."""
    sources, references = read_lines(src_path), read_lines(ref_path)
    if len(sources) != len(references):
        raise UserError(
            f"{src_path} has {len(sources)} lines but {ref_path} has "
            f"{len(references)}; they must be line-by-line translations"
        )
    if not sources:
        raise UserError(f"{src_path} is empty")
    hyps = translate_batch(
        model,
        sources,
        spacy_de,
        vocab_src,
        vocab_tgt,
        device,
        batch_size,
        decode_fn=decode_fn,
    )
    return compute_bleu(hyps, references), hyps


def build_parser():
    """The argparse parser of the command line."""
    parser = argparse.ArgumentParser(
        prog="the_annotated_transformer.py",
        description="Train, evaluate and use the Annotated Transformer on "
        "Multi30k German→English.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model on Multi30k")
    train.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    train.add_argument("--epochs", type=int, help="override num_epochs")
    train.add_argument("--max-tokens", type=int, help="tokens per batch")
    train.add_argument("--checkpoint-dir", help="where checkpoints go")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest epoch checkpoint",
    )
    train.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="processes to spawn (torchrun sets its own)",
    )
    train.add_argument(
        "--results", help="write a JSON summary here, including test BLEU"
    )
    train.add_argument(
        "--threads",
        type=int,
        help="CPU threads per process (default: torch's)",
    )
    for name, text in (
        ("evaluate", "BLEU on a parallel pair of files"),
        ("translate", "translate German sentences"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--checkpoint", default="checkpoints/cpu/final.pt")
        p.add_argument("--batch-size", type=int, default=128)
        p.add_argument("--device", default="cpu")
        p.add_argument(
            "--beam",
            type=int,
            default=1,
            metavar="K",
            help="beam size (default 1: greedy)",
        )
        p.add_argument(
            "--average",
            type=int,
            default=0,
            metavar="K",
            help="average the last K epoch checkpoints in the "
            "checkpoint's folder",
        )
    evaluate, translate = sub.choices["evaluate"], sub.choices["translate"]
    evaluate.add_argument(
        "--src",
        help="German sources, one per line "
        "(.gz is fine; default: Multi30k test2016)",
    )
    evaluate.add_argument("--ref", help="English references, one per line")
    evaluate.add_argument("--out", help="also write the translations here")
    translate.add_argument("sentence", nargs="+", help="German text")
    return parser


def command_train(args):
    """`train`: run training, then optionally score and summarize."""
    overrides = {
        k: v
        for k, v in (
            ("num_epochs", args.epochs),
            ("max_tokens", args.max_tokens),
            ("checkpoint_dir", args.checkpoint_dir),
        )
        if v is not None
    }
    config = get_config(args.preset, **overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    spacy_de, spacy_en = load_tokenizers()
    if config.tokenization == "bpe":
        vocab_src = vocab_tgt = load_bpe()  # noqa: F821 (Part 5)
    else:
        vocab_src, vocab_tgt = load_vocab(spacy_de, spacy_en)
    start = time.time()
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        train_worker(
            rank,
            world,
            vocab_src,
            vocab_tgt,
            spacy_de,
            spacy_en,
            config,
            is_distributed=world > 1,
            resume=args.resume,
        )
        if rank != 0:
            return 0
    else:
        train_model(
            vocab_src,
            vocab_tgt,
            spacy_de,
            spacy_en,
            config,
            distributed=args.world_size > 1,
            world_size=args.world_size,
            resume=args.resume,
        )
    final = Path(config.checkpoint_dir) / "final.pt"
    print(f"trained in {time.time() - start:.0f} s; model in {final}")
    if args.results:
        write_results(args.results, final, time.time() - start)
    return 0


def write_results(path, checkpoint, wall_time):
    """Score test2016 greedily and write a JSON summary of the run."""
    model, vocab_src, vocab_tgt, config = load_trained_model(checkpoint)
    spacy_de, _ = load_tokenizers()
    test = read_multi30k("test")
    hyps = translate_batch(
        model, [de for de, _ in test], spacy_de, vocab_src, vocab_tgt
    )
    bleu = compute_bleu(hyps, [en for _, en in test])
    history = load_checkpoint(checkpoint)["history"]
    summary = {
        "command": "python " + " ".join(sys.argv),
        "config": asdict(config),
        "hardware": hardware_summary(),
        "wall_time_s": round(wall_time, 1),
        "epochs": len(history),
        "history": history,
        "test2016_bleu_greedy": round(bleu.score, 2),
        "bleu": str(bleu),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"test2016 BLEU (greedy): {bleu.score:.2f}; summary in {path}")


def command_evaluate(args):
    """`evaluate`: BLEU of a checkpoint on a pair of files."""
    model, vocab_src, vocab_tgt, decode_fn = load_translator(  # noqa: F821
        args.checkpoint, args.device, args.beam, args.average
    )  # (Part 5)
    spacy_de, _ = load_tokenizers()
    if (args.src is None) != (args.ref is None):
        raise UserError("give both --src and --ref, or neither")
    if args.src is None:
        folder = download_multi30k()
        args.src = folder / "test_2016_flickr.de.gz"
        args.ref = folder / "test_2016_flickr.en.gz"
    bleu, hyps = evaluate_files(
        model,
        args.src,
        args.ref,
        spacy_de,
        vocab_src,
        vocab_tgt,
        args.device,
        args.batch_size,
        decode_fn,
    )
    if args.out:
        Path(args.out).write_text("\n".join(hyps) + "\n", encoding="utf-8")
    print(bleu)
    return 0


def command_translate(args):
    """`translate`: print the English translation of German text."""
    text = " ".join(args.sentence).strip()
    if not text:
        raise UserError("nothing to translate: the sentence is empty")
    model, vocab_src, vocab_tgt, decode_fn = load_translator(  # noqa: F821
        args.checkpoint, args.device, args.beam, args.average
    )  # (Part 5)
    spacy_de, _ = load_tokenizers()
    unknown = []
    if isinstance(vocab_src, Vocab):  # (BPE can spell any known letters)
        unknown = [t for t in tokenize(text, spacy_de) if t not in vocab_src]
    if unknown:
        print(
            "note: not in the vocabulary, read as <unk>: "
            + ", ".join(unknown),
            file=sys.stderr,
        )
    print(
        translate_batch(
            model,
            [text],
            spacy_de,
            vocab_src,
            vocab_tgt,
            args.device,
            decode_fn=decode_fn,
        )[0]
    )
    return 0


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    commands = {
        "train": command_train,
        "evaluate": command_evaluate,
        "translate": command_translate,
    }
    try:
        return commands[args.command](args)
    except (UserError, DatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# =============================================================================
# Part 4: Looking inside attention
# notebooks/04_attention.py
# =============================================================================


# -----------------------------------------------------------------------------
# Recording the weights
# Explained in notebooks/04_attention.py, same heading.
# -----------------------------------------------------------------------------
@contextmanager
def record_attention(model):
    """Within the block, every attention layer keeps its weights in .attn."""
    layers = [
        m for m in model.modules() if isinstance(m, MultiHeadedAttention)
    ]
    flags = [m.store_attention for m in layers]
    try:
        for m in layers:
            m.store_attention, m.attn = True, None
        yield layers
    finally:
        for m, flag in zip(layers, flags, strict=True):
            m.store_attention, m.attn = flag, None


# -----------------------------------------------------------------------------
# One sentence, every map
# Explained in notebooks/04_attention.py, same heading.
# -----------------------------------------------------------------------------
ATTENTION_KINDS = {
    "encoder self": "encoder_self",
    "decoder self": "decoder_self",
    "decoder source": "decoder_src",
}


class AttentionView(NamedTuple):
    """One kind of attention with its labels and masks."""

    weights: torch.Tensor  # (N, h, R, C)
    allowed: torch.Tensor  # (R, C) bool, False where masked
    rows: list  # R query labels
    cols: list  # C key labels
    row_keep: torch.Tensor  # (R,) bool, False at padding
    col_keep: torch.Tensor  # (C,) bool, False at padding
    col_ids: torch.Tensor  # (C,) token ids of the keys


@dataclass
class AttentionMaps:
    """One sentence's attention weights, (N, h, rows, cols) for each kind."""

    encoder_self: torch.Tensor  # (N, h, S, S)
    decoder_self: torch.Tensor  # (N, h, T, T)
    decoder_src: torch.Tensor  # (N, h, T, S)
    src_ids: torch.Tensor  # (S,)
    tgt_ids: torch.Tensor  # (T,) decoder inputs, <s> first
    src_tokens: list  # S labels
    tgt_tokens: list  # T labels
    next_tokens: list  # T labels: what each decoder position predicts
    pad: int = PAD

    def view(self, kind):
        """The weights of one kind with its labels and masks."""
        src_keep, tgt_keep = self.src_ids != self.pad, self.tgt_ids != self.pad
        S, T = len(src_keep), len(tgt_keep)
        causal = subsequent_mask(T)[0]  # (T, T)
        if kind == "encoder self":
            return AttentionView(
                self.encoder_self,
                src_keep.expand(S, S),
                self.src_tokens,
                self.src_tokens,
                src_keep,
                src_keep,
                self.src_ids,
            )
        if kind == "decoder self":
            return AttentionView(
                self.decoder_self,
                tgt_keep & causal,
                self.tgt_tokens,
                self.tgt_tokens,
                tgt_keep,
                tgt_keep,
                self.tgt_ids,
            )
        if kind == "decoder source":
            return AttentionView(
                self.decoder_src,
                src_keep.expand(T, S),
                self.tgt_tokens,
                self.src_tokens,
                tgt_keep,
                src_keep,
                self.src_ids,
            )
        raise ValueError(f"kind must be one of {list(ATTENTION_KINDS)}")


def _labels(ids, vocab):
    """Token strings of ids, or the ids as strings without a vocabulary."""
    ids = ids.tolist()
    return vocab.lookup_tokens(ids) if vocab else [str(i) for i in ids]


@torch.no_grad()
def attention_maps(
    model, src, tgt=None, vocab_src=None, vocab_tgt=None, max_extra=50, pad=PAD
):
    """Every layer's attention weights for one sentence, in eval mode."""
    core = getattr(model, "module", model)  # unwrap DistributedDataParallel
    device = next(core.parameters()).device
    src = torch.as_tensor(src, device=device).reshape(1, -1)  # (1, S)
    src_mask = (src != pad).unsqueeze(-2)  # (1, 1, S)
    training = core.training
    core.eval()
    try:
        if tgt is None:
            tgt = batch_greedy_decode(
                core, src, src_mask, src.size(1) + max_extra
            )
        tgt = torch.as_tensor(tgt, device=device).reshape(1, -1)  # (1, T+1)
        if tgt.size(1) < 2:
            raise ValueError("tgt needs <s> and at least one more token")
        tgt_in = tgt[:, :-1]  # (1, T) decoder inputs
        tgt_mask = Batch.make_std_mask(tgt_in, pad)  # (1, T, T)
        with record_attention(core):
            core(src, tgt_in, src_mask, tgt_mask)
            enc = [layer.self_attn.attn[0] for layer in core.encoder.layers]
            dec = [layer.self_attn.attn[0] for layer in core.decoder.layers]
            crs = [layer.src_attn.attn[0] for layer in core.decoder.layers]
    finally:
        core.train(training)
    src, tgt = src[0].cpu(), tgt[0].cpu()
    return AttentionMaps(
        encoder_self=torch.stack(enc).float().cpu(),  # (N, h, S, S)
        decoder_self=torch.stack(dec).float().cpu(),  # (N, h, T, T)
        decoder_src=torch.stack(crs).float().cpu(),  # (N, h, T, S)
        src_ids=src,
        tgt_ids=tgt[:-1],
        src_tokens=_labels(src, vocab_src),
        tgt_tokens=_labels(tgt[:-1], vocab_tgt),
        next_tokens=_labels(tgt[1:], vocab_tgt),
        pad=pad,
    )


# -----------------------------------------------------------------------------
# Drawing the maps
# Explained in notebooks/04_attention.py, same heading.
# -----------------------------------------------------------------------------
def attention_frame(maps, kind):
    """One kind of attention as a long pandas table, padding left out."""
    import pandas as pd

    v = maps.view(kind)
    N, h, R, C = v.weights.shape
    rows = [i for i in range(R) if v.row_keep[i]]
    cols = [j for j in range(C) if v.col_keep[j]]
    w = v.weights[:, :, rows][:, :, :, cols]  # (N, h, R', C')
    n, a, i, j = torch.meshgrid(
        *(torch.arange(s) for s in w.shape), indexing="ij"
    )
    frame = pd.DataFrame(
        {
            "layer": n.flatten().numpy() + 1,
            "head": a.flatten().numpy() + 1,
            "row": [rows[r] for r in i.flatten().tolist()],
            "col": [cols[c] for c in j.flatten().tolist()],
            "weight": w.flatten().numpy().astype(float),
        }
    )
    frame["query"] = [v.rows[r] for r in frame["row"]]
    frame["key"] = [v.cols[c] for c in frame["col"]]
    if kind != "encoder self":
        frame["next"] = [maps.next_tokens[r] for r in frame["row"]]
    return frame


def attention_chart(maps, kind, layer=None, columns=4, cell=18):
    """Heat maps of one kind, one per head, with a menu to pick the layer."""
    import altair as alt

    frame = attention_frame(maps, kind).round({"weight": 5})
    v = maps.view(kind)
    N, h = v.weights.shape[:2]
    pick = alt.param(
        name="pick_layer",
        value=N if layer is None else layer,
        bind=alt.binding_select(
            options=list(range(1, N + 1)), name=f"{kind} attention, layer "
        ),
    )
    # Tokens travel once, as lists; each cell carries only numbers.
    fields = {"query": (v.rows, "row"), "key": (v.cols, "col")}
    if "next" in frame:
        fields["next"] = (maps.next_tokens, "row")
    lookups = {
        f: f"{json.dumps(labels)}[datum.{index}]"
        for f, (labels, index) in fields.items()
    }
    numbers = frame[["layer", "head", "row", "col", "weight"]]
    heat = (
        alt.Chart(alt.Data(values=numbers.to_dict("records")))
        .transform_filter(alt.datum.layer == pick)
        .transform_calculate(**lookups)
        .mark_rect()
        .encode(
            x=alt.X("col:O", axis=_token_axis(v.cols, "key", -60)),
            y=alt.Y("row:O", axis=_token_axis(v.rows, "query")),
            color=alt.Color(
                "weight:Q",
                scale=alt.Scale(
                    domainMin=0,
                    range=["#ffffff", "#08306b"],
                    interpolate="lab",
                ),
            ),
            tooltip=[
                alt.Tooltip(f"{f}:N", title=_TOOLTIP_TITLES[f]) for f in fields
            ]
            + [alt.Tooltip("weight:Q", format=".3f"), "layer:O", "head:O"],
        )
        .properties(
            width=cell * frame["col"].nunique(),
            height=cell * frame["row"].nunique(),
        )
    )
    return heat.add_params(pick).facet(
        facet=alt.Facet(
            "head:O",
            header=alt.Header(labelExpr="'head ' + datum.value", title=None),
        ),
        columns=min(columns, h),
        title=f"{kind} attention ({N} layers, {h} heads); pick a layer",
    )


_TOOLTIP_TITLES = {
    "query": "query (row)",
    "key": "key (column)",
    "next": "next token",
}


def _token_axis(labels, title, angle=0):
    """An axis over positions that shows the token at each position."""
    import altair as alt

    return alt.Axis(
        title=title,
        labelAngle=angle,
        labelExpr=f"{json.dumps(labels)}[datum.value]",
    )


# -----------------------------------------------------------------------------
# What the heads do, measured
# Explained in notebooks/04_attention.py, same heading.
# -----------------------------------------------------------------------------
def _mean(x, keep):
    """Mean of (N, h, R) over the rows where keep (R,) is True; 0 if none."""
    return x[..., keep].mean(-1) if keep.any() else x.sum(-1) * 0


def attention_statistics(maps, specials=(BOS, EOS)):
    """Per kind, layer and head: entropy, distance and where weight goes."""
    out = []
    for kind in ATTENTION_KINDS:
        v = maps.view(kind)
        w = v.weights.double()  # (N, h, R, C)
        R, C = v.allowed.shape
        i = torch.arange(R, dtype=torch.float64)[:, None]  # (R, 1)
        j = torch.arange(C, dtype=torch.float64)[None, :]  # (1, C)
        if kind == "decoder source":
            rows, cols = int(v.row_keep.sum()), int(v.col_keep.sum())
            i = i * (cols - 1) / max(rows - 1, 1)
        n = v.allowed.sum(-1)  # (R,) keys each query may see
        H = -torch.special.xlogy(w, w).sum(-1)  # (N, h, R)
        entropy = _mean(H / n.clamp(min=2).log(), v.row_keep & (n > 1))
        offset = j - i.round()  # (R, C)
        sums = {
            "entropy": entropy,
            "distance": (w * (j - i).abs()).sum(-1),
            "previous": (w * (offset == -1)).sum(-1),
            "same": (w * (offset == 0)).sum(-1),
            "next": (w * (offset == 1)).sum(-1),
            "specials": w[
                ..., torch.isin(v.col_ids, torch.tensor(specials))
            ].sum(-1),
        }
        stats = {
            k: s if k == "entropy" else _mean(s, v.row_keep)
            for k, s in sums.items()
        }  # each (N, h)
        for layer in range(w.size(0)):
            for head in range(w.size(1)):
                out.append(
                    {
                        "kind": kind,
                        "layer": layer + 1,
                        "head": head + 1,
                        **{k: float(s[layer, head]) for k, s in stats.items()},
                    }
                )
    return out


def attention_summary(model, pairs, spacy_de, spacy_en, vocab_src, vocab_tgt):
    """attention_statistics averaged over sentence pairs (de, en)."""
    totals = {}
    for de, en in pairs:
        src = [BOS, *vocab_src(tokenize(de, spacy_de)), EOS]
        tgt = [BOS, *vocab_tgt(tokenize(en, spacy_en)), EOS]
        for row in attention_statistics(attention_maps(model, src, tgt)):
            key = (row.pop("kind"), row.pop("layer"), row.pop("head"))
            total = totals.setdefault(key, dict.fromkeys(row, 0.0))
            for name, value in row.items():
                total[name] += value / len(pairs)
    return [
        {"kind": k, "layer": n, "head": a, **t}
        for (k, n, a), t in totals.items()
    ]


def attention_summary_chart(summary, width=170):
    """Entropy and diagonal distance per layer and head, for each kind."""
    import altair as alt
    import pandas as pd

    frame = pd.DataFrame(summary)
    titles = {
        "entropy": "entropy (fraction of uniform)",
        "distance": "distance from diagonal (tokens)",
    }
    charts = []
    for metric, title in titles.items():
        base = alt.Chart(frame).encode(
            x=alt.X("layer:O", title="layer", axis=alt.Axis(labelAngle=0))
        )
        dots = base.mark_circle(size=60, opacity=0.8).encode(
            xOffset="head:N",
            y=alt.Y(f"{metric}:Q", title=title),
            color=alt.Color("head:N", title="head"),
            tooltip=[
                "kind",
                "layer",
                "head",
                alt.Tooltip(f"{metric}:Q", format=".3f"),
            ],
        )
        mean = base.mark_line(color="#444").encode(y=f"mean({metric}):Q")
        charts.append(
            alt.layer(dots, mean, data=frame)
            .properties(width=width, height=150)
            .facet(
                column=alt.Column(
                    "kind:N", sort=list(ATTENTION_KINDS), title=None
                )
            )
        )
    return alt.vconcat(*charts).properties(
        title="Attention heads by layer, averaged over validation sentences"
    )


# =============================================================================
# Part 5: Beyond the paper: what the 2022 tutorial left out
# notebooks/05_beyond.py
# =============================================================================


# -----------------------------------------------------------------------------
# 1. Incremental decoding with a key/value cache
# Explained in notebooks/05_beyond.py, same heading.
# -----------------------------------------------------------------------------
class DecoderCache:
    """Per-layer keys and values that incremental decoding reuses."""

    def __init__(self, model, memory, src_mask, group=1):
        self.group = group  # rows (hypotheses) per sentence
        self.src_mask = src_mask.unsqueeze(1)  # (B, 1, 1, S)
        self.cross = [
            [
                layer.src_attn.split_heads(memory, layer.src_attn.linears[1]),
                layer.src_attn.split_heads(memory, layer.src_attn.linears[2]),
            ]
            for layer in model.decoder.layers
        ]  # per layer: keys and values, each (B, h, S, d_k)
        self.self_kv = [None] * len(model.decoder.layers)  # (R, h, t, d_k)
        self.length = 0  # target positions decoded so far

    def select(self, index):
        """Keep the rows `index` (R',) of every cached tensor, in order."""
        self.self_kv = [
            None if kv is None else [x.index_select(0, index) for x in kv]
            for kv in self.self_kv
        ]
        sentences = index[:: self.group] // self.group  # (R' / group,)
        same = torch.arange(self.src_mask.size(0), device=index.device)
        if not torch.equal(sentences, same):  # some sentences left
            self.src_mask = self.src_mask.index_select(0, sentences)
            self.cross = [
                [x.index_select(0, sentences) for x in kv] for kv in self.cross
            ]


def attend_step(attn, x, k, v, mask=None):
    """Attention of the new positions x (R, 1, d) to k, v (B, h, S, d_k)."""
    R, B = x.size(0), k.size(0)  # R = B * group
    q = attn.split_heads(x.reshape(B, -1, x.size(-1)), attn.linears[0])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = out.transpose(1, 2).reshape(R, 1, attn.h * attn.d_k)
    return attn.linears[-1](out)  # (R, 1, d_model)


def cached_self_attention(attn, x, cache, i):
    """Self-attention of layer i for the new position, growing its cache."""
    k = attn.split_heads(x, attn.linears[1])  # (R, h, 1, d_k)
    v = attn.split_heads(x, attn.linears[2])
    if cache.self_kv[i] is not None:
        k = torch.cat([cache.self_kv[i][0], k], dim=2)  # (R, h, t+1, d_k)
        v = torch.cat([cache.self_kv[i][1], v], dim=2)
    cache.self_kv[i] = [k, v]
    return attend_step(attn, x, k, v)


def decoder_layer_step(layer, x, cache, i):
    """One DecoderLayer applied to the newest position only."""
    k, v = cache.cross[i]  # (B, h, S, d_k)
    x = layer.sublayer[0](
        x, lambda y: cached_self_attention(layer.self_attn, y, cache, i)
    )
    x = layer.sublayer[1](
        x, lambda y: attend_step(layer.src_attn, y, k, v, cache.src_mask)
    )
    return layer.sublayer[2](x, layer.feed_forward)  # (R, 1, d_model)


def decode_step(model, ys_last, cache):
    """Log-probs (R, V) of the next token, given the newest ids (R, 1)."""
    embed, position = model.tgt_embed[0], model.tgt_embed[1]
    t = cache.length
    x = position.dropout(embed(ys_last) + position.pe[:, t : t + 1])
    for i, layer in enumerate(model.decoder.layers):
        x = decoder_layer_step(layer, x, cache, i)  # (R, 1, d_model)
    cache.length += 1
    return model.generator(model.decoder.norm(x))[:, -1]  # (R, V)


@torch.no_grad()
def cached_greedy_decode(
    model, src, src_mask, max_len, start_symbol=BOS, end_symbol=EOS
):
    """Greedy decoding with a key/value cache; same output as batched."""
    B = src.size(0)
    cache = DecoderCache(model, model.encode(src, src_mask), src_mask)
    out = torch.full((B, max_len), PAD, dtype=torch.long, device=src.device)
    out[:, 0] = start_symbol  # (B, max_len)
    rows = torch.arange(B, device=src.device)  # sentences still running
    t = 0
    for t in range(1, max_len):
        logp = decode_step(model, out[rows, t - 1 : t], cache)  # (R, V)
        word = logp.argmax(dim=-1)  # (R,)
        out[rows, t] = word
        running = word != end_symbol
        if not running.all():
            if not running.any():
                break
            rows = rows[running]
            cache.select(running.nonzero().squeeze(1))
    return out[:, : t + 1]  # (B, <= max_len)


# -----------------------------------------------------------------------------
# 2. Beam search
# Explained in notebooks/05_beyond.py, same heading.
# -----------------------------------------------------------------------------
def length_penalty(length, alpha=0.6):
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def beam_candidates(logp, logp_sum, lengths, finished, alpha):
    """The best extensions of each hypothesis: score, log P, token."""
    A, k, V = logp.shape  # (sentences, beams, vocabulary)
    logp, word = logp.topk(min(k, V), dim=-1)  # (A, k, c): all that can win
    done = finished.unsqueeze(-1)  # (A, k, 1)
    logp = logp.masked_fill(done, -math.inf)  # a finished hypothesis
    logp[..., :1] = logp[..., :1].masked_fill(done, 0.0)  # adds <blank>,
    word[..., :1] = word[..., :1].masked_fill(done, PAD)  # for free
    cand = logp_sum.unsqueeze(-1) + logp  # (A, k, c) log P of each
    cand_len = lengths + (~finished).long()  # (A, k)
    score = cand / length_penalty(cand_len, alpha).unsqueeze(-1)
    return score.view(A, -1), cand.view(A, -1), word.view(A, -1), cand_len


def beam_search_steps(
    step,
    select,
    batch_size,
    max_len,
    beam_size=4,
    alpha=0.6,
    start_symbol=BOS,
    end_symbol=EOS,
    device="cpu",
):
    """Beam search over step(ids (R, 1)) -> log-probs (R, V); (B, L) ids."""
    B, k = batch_size, beam_size
    out = torch.full((B, max_len), PAD, dtype=torch.long, device=device)
    out[:, 0] = start_symbol  # (B, max_len): the answers
    best = torch.full((B,), -math.inf, device=device)  # their scores
    tokens = out.unsqueeze(1).repeat(1, k, 1)  # (A, k, max_len)
    logp_sum = torch.full((B, k), -math.inf, device=device)  # (A, k)
    logp_sum[:, 0] = 0.0  # one real hypothesis to start from
    lengths = torch.zeros(B, k, dtype=torch.long, device=device)
    finished = torch.zeros(B, k, dtype=torch.bool, device=device)
    sent = torch.arange(B, device=device)  # (A,) sentences still searching
    t = 0
    for t in range(1, max_len):
        A = sent.numel()
        logp = step(tokens[:, :, t - 1].reshape(A * k, 1)).view(A, k, -1)
        score, cand, words, cand_len = beam_candidates(
            logp, logp_sum, lengths, finished, alpha
        )  # (A, k * c), c candidates per hypothesis
        score, idx = score.topk(k, dim=1)  # (A, k)
        parent, word = idx // (words.size(1) // k), words.gather(1, idx)
        was_finished = finished.gather(1, parent)
        logp_sum, lengths = cand.gather(1, idx), cand_len.gather(1, parent)
        finished = was_finished | (word == end_symbol)
        tokens = tokens.gather(1, parent.unsqueeze(-1).expand_as(tokens))
        tokens[:, :, t] = word
        new = torch.where(finished & ~was_finished, score, -math.inf)
        top, j = new.max(dim=1)  # the best hypothesis that ended now
        better = top > best[sent]
        best[sent[better]] = top[better]
        out[sent[better]] = tokens[better, j[better]]
        keep = ~finished.all(dim=1)  # (A,) sentences with beams running
        if t == max_len - 1 or not keep.any():
            break
        rows = torch.arange(A, device=device).unsqueeze(1) * k + parent
        select(rows[keep].view(-1))  # (A' * k,) parents of the survivors
        sent, tokens, logp_sum = sent[keep], tokens[keep], logp_sum[keep]
        lengths, finished = lengths[keep], finished[keep]
    running = logp_sum / length_penalty(lengths, alpha)  # at max_len
    top, j = running.masked_fill(finished, -math.inf).max(dim=1)
    better = top > best[sent]
    out[sent[better]] = tokens[better, j[better]]
    return out[:, : t + 1]  # (B, <= max_len)


@torch.no_grad()
def beam_search(
    model,
    src,
    src_mask,
    max_len,
    beam_size=4,
    alpha=0.6,
    start_symbol=BOS,
    end_symbol=EOS,
):
    """Batched beam search with a length penalty; (B, L) best ids."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    cache = DecoderCache(model, memory, src_mask, group=beam_size)
    return beam_search_steps(
        lambda ys: decode_step(model, ys, cache),  # (B*k, 1) -> (B*k, V)
        cache.select,
        src.size(0),
        max_len,
        beam_size,
        alpha,
        start_symbol,
        end_symbol,
        src.device,
    )


# -----------------------------------------------------------------------------
# 3. A shared subword vocabulary, and one matrix for three jobs
# Explained in notebooks/05_beyond.py, same heading.
# -----------------------------------------------------------------------------
BPE_VOCAB_SIZE = 10000


class BpeVocab:
    """One subword vocabulary for both languages (HF `tokenizers` BPE)."""

    def __init__(self, tokenizer):
        first = [tokenizer.id_to_token(i) for i in range(len(SPECIALS))]
        if tuple(first) != SPECIALS:
            raise ValueError(f"a vocabulary must start with {SPECIALS}")
        self.tokenizer = tokenizer

    @classmethod
    def from_str(cls, text):
        """Rebuild from the JSON text of `to_str`."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text))

    def to_str(self):
        """The whole tokenizer (merges included) as JSON text."""
        return self.tokenizer.to_str()

    def __len__(self):
        return self.tokenizer.get_vocab_size()

    def encode(self, text):
        """Subword ids of a sentence, without <s> and </s>."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids):
        """The plain text that subword ids spell (specials skipped)."""
        return self.tokenizer.decode([int(i) for i in ids])

    def lookup_tokens(self, ids):
        """The subword strings of some ids."""
        return [self.tokenizer.id_to_token(int(i)) for i in ids]

    def get_itos(self):
        """Every subword, in id order."""
        return self.lookup_tokens(range(len(self)))


def train_bpe(sentences, vocab_size=BPE_VOCAB_SIZE):
    """A BpeVocab learned from an iterable of sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIALS[UNK]))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sentences, trainer)
    return BpeVocab(tokenizer)


def load_bpe(path=None, vocab_size=BPE_VOCAB_SIZE):
    """Joint German+English BPE of the train split, cached as JSON."""
    path = Path(path) if path is not None else data_dir() / "bpe.json"
    if path.is_file():
        bpe = BpeVocab.from_str(path.read_text(encoding="utf-8"))
        if len(bpe) == vocab_size:
            return bpe
    train = read_multi30k("train")  # never val or test
    bpe = train_bpe((s for pair in train for s in pair), vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.write_text(bpe.to_str(), encoding="utf-8")
    os.replace(tmp, path)  # atomic, as for data/vocab.json
    return bpe


# -----------------------------------------------------------------------------
# 4. Checkpoint averaging
# Explained in notebooks/05_beyond.py, same heading.
# -----------------------------------------------------------------------------
@torch.no_grad()
def average(model, models):
    """Set model's parameters to the mean of those of `models`."""
    params = [dict(m.named_parameters()) for m in models]
    for name, p in model.named_parameters():
        p.copy_(torch.stack([ps[name] for ps in params]).mean(dim=0))
    return model


def average_checkpoints(paths, device="cpu"):
    """(model, vocab_src, vocab_tgt, config) with the mean of the weights."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise UserError("no checkpoints to average")
    model, vocab_src, vocab_tgt, config = load_trained_model(paths[0], device)
    params, buffers = dict(model.named_parameters()), model.named_buffers()
    buffers = dict(buffers)  # e.g. the positional encoding's `pe`
    sums = {
        n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()
    }
    for path in paths:
        state = load_checkpoint(path, device)["model"]
        for name in sums:
            sums[name] += state[name].double()
        for name, b in buffers.items():
            if not torch.equal(state[name], b):
                raise UserError(f"{path}: buffer {name} differs")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(sums[name] / len(paths))
    return model.eval(), vocab_src, vocab_tgt, config


# -----------------------------------------------------------------------------
# 5. From the command line, and the results
# Explained in notebooks/05_beyond.py, same heading.
# -----------------------------------------------------------------------------
def load_translator(checkpoint, device="cpu", beam=1, average=0):
    """(model, vocab_src, vocab_tgt, decode_fn) for greedy or beam search."""
    if average:
        paths = epoch_checkpoints(Path(checkpoint).parent)[-average:]
        if len(paths) < average:
            raise UserError(
                f"--average {average} needs {average} epoch checkpoints "
                f"next to {checkpoint}; found {len(paths)}"
            )
        model, vocab_src, vocab_tgt, _ = average_checkpoints(paths, device)
    else:
        model, vocab_src, vocab_tgt, _ = load_trained_model(checkpoint, device)
    decode_fn = cached_greedy_decode
    if beam > 1:
        decode_fn = functools.partial(beam_search, beam_size=beam)
    return model, vocab_src, vocab_tgt, decode_fn


if __name__ == "__main__":
    raise SystemExit(main())
