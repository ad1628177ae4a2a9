# =============================================================================
# GENERATED FILE: edit the notebooks, not this file.
# Source: notebooks/01_*.py to 05_*.py (cells starting with "#| export").
# Regenerate with `make export`; `make check-sync` fails on drift.
# =============================================================================
"""The Annotated Transformer, done right: the lessons' code as a module.

The model comes first (Part 1), then its training (Parts 2 and 3), its
attention (Part 4) and what goes beyond the paper (Part 5). Importing it
has no side effects and needs only torch. Each section below names the
notebook and heading that explain it. The command line, downloads and
process launch live in ``annotated_transformer_tools.py``.
"""

import copy
import gzip
import importlib.util
import math
import os
import random
import time
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

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
        vectors = self.src_embed(src)  # (B, S, d_model)
        return self.encoder(vectors, src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        """Target prefix ids (B, T) to hidden states (B, T, d_model)."""
        vectors = self.tgt_embed(tgt)  # (B, T, d_model)
        return self.decoder(vectors, memory, src_mask, tgt_mask)


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
    """The encoder: N EncoderLayers, then a final layer norm."""

    def __init__(self, layer, N):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def forward(self, x, mask):
        """(B, S, d_model) source vectors with a (B, 1, S) padding mask."""
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class LayerNorm(nn.Module):
    """Over the last dim: a_2 * (x - mean) / sqrt(var + eps) + b_2."""

    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        """Normalize (..., features); the variance divides by d."""
        return F.layer_norm(x, self.a_2.shape, self.a_2, self.b_2, self.eps)


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
        self.size = size  # d_model, read by Encoder
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.self_attn_block = SublayerConnection(size, dropout)
        self.ff_block = SublayerConnection(size, dropout)

    def forward(self, x, mask):
        """(B, S, d_model) with a (B, 1, S) padding mask."""
        x = self.self_attn_block(x, lambda y: self.self_attn(y, y, y, mask))
        return self.ff_block(x, self.feed_forward)


# -----------------------------------------------------------------------------
# Decoder
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
class Decoder(nn.Module):
    """The decoder: N DecoderLayers, then a final layer norm."""

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
        self.size = size  # d_model, read by Decoder
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.self_attn_block = SublayerConnection(size, dropout)
        self.src_attn_block = SublayerConnection(size, dropout)
        self.ff_block = SublayerConnection(size, dropout)

    def forward(self, x, memory, src_mask, tgt_mask):
        """(B, T, d_model) target states; memory is (B, S, d_model)."""
        x = self.self_attn_block(
            x, lambda y: self.self_attn(y, y, y, tgt_mask)
        )
        x = self.src_attn_block(
            x, lambda y: self.src_attn(y, memory, memory, src_mask)
        )
        return self.ff_block(x, self.feed_forward)


def subsequent_mask(size, device=None):
    """(1, size, size) bool mask, True where key position <= query."""
    # Made on `device` itself: a copy from the CPU would stall a GPU.
    return torch.ones(1, size, size, dtype=torch.bool, device=device).tril()


# -----------------------------------------------------------------------------
# Attention
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
def attention(query, key, value, mask=None, dropout=None):
    """Scaled dot-product attention; returns (output, weights)."""
    d_k = query.size(-1)
    # (..., T, S): in multi-head attention, below, (B, h, T, S)
    scores = query @ key.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        # Where the mask is 0 (False), the dtype's lowest value, not -1e9:
        # -1e9 overflows in float16.
        lowest = torch.finfo(scores.dtype).min
        scores = scores.masked_fill(mask == 0, lowest)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return p_attn @ value, p_attn  # (..., T, d_k), (..., T, S)


class MultiHeadedAttention(nn.Module):
    """h parallel attention heads over d_model / h dimensions each."""

    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        if d_model % h:
            raise ValueError(f"d_model={d_model} is not divisible by h={h}")
        self.h = h
        self.d_k = d_model // h
        self.w_q = nn.Linear(d_model, d_model)  # query projection, W^Q
        self.w_k = nn.Linear(d_model, d_model)  # key projection, W^K
        self.w_v = nn.Linear(d_model, d_model)  # value projection, W^V
        self.w_o = nn.Linear(d_model, d_model)  # output projection, W^O
        self.dropout = nn.Dropout(p=dropout)
        self.store_attention = False  # keep the weights in self.attn?
        self.attn = None  # (B, h, T, S) when store_attention is True

    def split_heads(self, x, linear):
        """Project (B, T, d_model) with `linear`, split to (B, h, T, d_k)."""
        B = x.size(0)
        x = linear(x)  # (B, T, d_model): one of W^Q, W^K, W^V
        # The heads are blocks of the feature axis, so split that axis
        # (the shape walkthrough shows what a view straight to
        # (B, h, T, d_k) would do instead).
        x = x.view(B, -1, self.h, self.d_k)  # (B, T, h, d_k)
        return x.transpose(1, 2)  # (B, h, T, d_k)

    def use_fused(self, q):
        """Fused, unless the weights must be kept (Part 4) or a CPU
        trains with dropout (where PyTorch's fused CPU kernel has none)."""
        cpu_dropout = self.training and self.dropout.p > 0 and q.is_cpu
        return not (self.store_attention or cpu_dropout)

    def forward(self, query, key, value, mask=None):
        """Attend from query (B, T, d_model) to key/value (B, S, d_model)."""
        if mask is not None:
            mask = heads_mask(mask)  # (B, 1, 1, S) or (B, 1, T, T)
        q = self.split_heads(query, self.w_q)  # (B, h, T, d_k)
        k = self.split_heads(key, self.w_k)  # (B, h, S, d_k)
        v = self.split_heads(value, self.w_v)  # (B, h, S, d_k)
        if self.use_fused(q):
            # A function, not a module: .eval() cannot turn its dropout
            # off, so we pass 0 ourselves when not training.
            p = self.dropout.p if self.training else 0.0
            x = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p
            )  # (B, h, T, d_k)
        else:
            x, weights = attention(q, k, v, mask=mask, dropout=self.dropout)
            if self.store_attention:
                self.attn = weights  # (B, h, T, S), after any dropout
        x = x.transpose(1, 2)  # (B, T, h, d_k)
        # reshape, not view: after the transpose, x's numbers usually no
        # longer lie in memory in (B, T, h, d_k) order ("not contiguous";
        # always so on the `attention` path), and view only relabels
        # memory, while reshape copies it when it must.
        x = x.reshape(query.size(0), -1, self.h * self.d_k)  # (B, T, d_model)
        return self.w_o(x)  # (B, T, d_model)


def heads_mask(mask):
    """A (B, 1, S) or (B, T, S) mask, as bool (B, 1, 1, S) or
    (B, 1, T, S): one mask for every head. True, or 1 in a mask of 0s and
    1s, may be attended to."""
    if mask.dim() != 3:
        raise ValueError(
            f"a mask is (B, 1, S) or (B, T, S), not {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:  # the fused routine would add it
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("a mask that is not bool must hold 0s and 1s")
        mask = mask != 0
    return mask.unsqueeze(1)


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
        # Device plumbing, which a first read can skip: the table is made
        # in float64 on the CPU (Apple's GPU has no float64), then moved
        # to the default device; model.to() moves it with the weights.
        f64 = {"dtype": torch.float64, "device": "cpu"}
        pos = torch.arange(max_len, **f64)[:, None]  # (L, 1)
        # (d_model/2,): the even dimensions 0, 2, 4, ...
        two_i = torch.arange(0, d_model, 2, **f64)
        angles = pos / 10000 ** (two_i / d_model)  # (L, d_model/2)
        pe = torch.zeros(max_len, d_model, **f64)
        pe[:, 0::2] = angles.sin()  # even columns
        # The odd columns; one fewer than the even ones if d_model is odd.
        pe[:, 1::2] = angles.cos()[:, : d_model // 2]
        # Rounded to float32 after the sine and cosine, then moved to
        # the default device: the one PyTorch makes a new tensor on when
        # none is named, here read off an empty tensor. It is the CPU
        # unless changed, e.g. by `with torch.device(...)`, which the
        # parameter count below uses.
        pe = pe.float().to(torch.empty(0).device)  # (L, d_model)
        self.dropout = nn.Dropout(p=dropout)
        self.register_buffer("pe", pe.unsqueeze(0))  # (1, max_len, d_model)

    def forward(self, x):
        """Add PE to (B, T, d_model) embeddings."""
        return self.dropout(x + self.pe[:, : x.size(1)])


# -----------------------------------------------------------------------------
# The full model
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
def make_model(
    src_vocab, tgt_vocab, N=6, d_model=512, d_ff=2048, h=8, dropout=0.1
):
    """Build an EncoderDecoder Transformer from hyperparameters."""
    attn = MultiHeadedAttention(h, d_model, dropout)
    ffn = PositionwiseFeedForward(d_model, d_ff, dropout)
    pe = PositionalEncoding(d_model, dropout)
    enc_self_attn, dec_self_attn, dec_src_attn = clones(attn, 3)
    enc_ffn, dec_ffn = clones(ffn, 2)
    src_pe, tgt_pe = clones(pe, 2)

    enc_layer = EncoderLayer(d_model, enc_self_attn, enc_ffn, dropout)
    dec_layer = DecoderLayer(
        d_model, dec_self_attn, dec_src_attn, dec_ffn, dropout
    )
    src_embed = nn.Sequential(Embeddings(d_model, src_vocab), src_pe)
    tgt_embed = nn.Sequential(Embeddings(d_model, tgt_vocab), tgt_pe)
    generator = Generator(d_model, tgt_vocab)
    encoder = Encoder(enc_layer, N)
    decoder = Decoder(dec_layer, N)
    model = EncoderDecoder(encoder, decoder, src_embed, tgt_embed, generator)

    for weight in model.parameters():
        if weight.dim() > 1:  # matrices; biases and norms keep theirs
            nn.init.xavier_uniform_(weight)
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
    """Source and target ids with their masks, for teacher forcing.

    `src` (B, S) and `tgt` (B, T + 1) are token ids; `pad` is the padding
    id. It keeps `src`, `src_mask` (B, 1, S), `tgt` (B, T): the target
    without its last token, which the decoder reads, `tgt_y` (B, T): the
    target without its first, to predict, `tgt_mask` (B, T, T) and
    `ntokens`, the number of real tokens in `tgt_y`.
    """

    def __init__(self, src, tgt=None, pad=2):  # 2: <blank> in Part 3
        self.src = src  # (B, S)
        self.src_mask = (src != pad).unsqueeze(-2)  # (B, 1, S)
        if tgt is None:
            return  # a source-only batch, to decode from
        self.tgt = tgt[:, :-1]  # (B, T): the decoder's input
        self.tgt_y = tgt[:, 1:]  # (B, T): the tokens to predict
        self.tgt_mask = self.make_std_mask(self.tgt, pad)  # (B, T, T)
        self.ntokens = int(self.tgt_y.ne(pad).sum())

    @staticmethod
    def make_std_mask(tgt, pad):
        """Hide padding and future positions: (B, T) to (B, T, T)."""
        real = (tgt != pad).unsqueeze(-2)  # (B, 1, T)
        return real & subsequent_mask(tgt.size(-1), tgt.device)

    def to(self, device):
        """Move every tensor of the batch to a device, in place."""
        # Asynchronous copies on CUDA only: on Apple's MPS they can be wrong.
        asynchronous = torch.device(device).type == "cuda"
        for name, value in vars(self).items():
            if torch.is_tensor(value):
                moved = value.to(device, non_blocking=asynchronous)
                setattr(self, name, moved)
        return self


COPY_PAD = 0
COPY_START = 1


def data_gen(V, batch_size, nbatches, seq_len=10, generator=None):
    """Yield `nbatches` random copy-task batches over V tokens."""
    for _ in range(nbatches):
        data = torch.randint(2, V, (batch_size, seq_len), generator=generator)
        data[:, 0] = COPY_START
        # Not Batch's default pad, 2: here 2 is a data token.
        yield Batch(data, data.clone(), pad=COPY_PAD)


# -----------------------------------------------------------------------------
# The loss: label smoothing
# Explained in notebooks/02_training.py, same heading.
# -----------------------------------------------------------------------------
class LabelSmoothing(nn.Module):
    """KL-divergence loss against label-smoothed targets; pad ignored."""

    def __init__(self, size, padding_idx, smoothing=0.0, keep_targets=False):
        super().__init__()
        self.size = size  # vocabulary size
        self.padding_idx = padding_idx
        self.smoothing = smoothing  # mass moved off the correct token
        self.confidence = 1.0 - smoothing  # mass the correct token keeps
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.keep_targets = keep_targets  # the direct way, for checks
        self.last_call = None  # (targets, dtype), for `true_dist` below

    def forward(self, x, target):
        """Summed KL loss of (N, size) log-probs against (N,) targets."""
        assert x.size(1) == self.size
        self.last_call = (target.detach(), x.dtype)
        if self.keep_targets:  # the direct way: build every row p
            p = self.smoothed_targets(target, x.dtype)
            # KLDivLoss(input=log q, target=p): sum of p (log p - log q)
            return self.criterion(x, p)
        return self.closed_form(x, target)  # the same number, see below

    def smoothed_targets(self, target, dtype=torch.float32):
        """(N,) target ids to the (N, size) smoothed distribution."""
        fill = self.smoothing / (self.size - 2)  # for every other token
        dist = target.new_full((len(target), self.size), fill, dtype=dtype)
        # Each row's target column gets the confidence:
        dist.scatter_(1, target.unsqueeze(1), self.confidence)
        dist[:, self.padding_idx] = 0  # padding is never a target
        dist[target == self.padding_idx] = 0  # rows whose target is padding
        return dist

    def closed_form(self, x, target):
        """The same loss without the (N, size) targets: see below."""
        return smoothed_kl(x, target, self.padding_idx, self.smoothing)

    # For code written against the 2022 Harvard Annotated Transformer,
    # which stored the latest call's smoothed targets as `true_dist`.
    @property
    def true_dist(self):
        """The (N, size) smoothed targets of the latest call, or None."""
        if self.last_call is None:
            return None
        return self.smoothed_targets(*self.last_call)


def smoothed_kl(x, target, padding_idx, smoothing):
    """LabelSmoothing's loss in closed form: no (N, V) target matrix."""
    c = 1.0 - smoothing  # probability of the target
    f = smoothing / (x.size(1) - 2)  # of each other non-padding class
    # Sums in float32 even if x is 16-bit: Part 3 can train in bfloat16,
    # whose 8 significant bits (2 to 3 decimal digits) are too few for a
    # sum over thousands of tokens. promote_types picks the wider type:
    # float32, or float64 if x is float64.
    acc = torch.promote_types(x.dtype, torch.float32)
    picked = x.gather(1, target.unsqueeze(1)).squeeze(1).to(acc)  # (N,)
    # The formula's last sum, over every j but y and padding: (N,)
    rest = x.sum(1, dtype=acc) - picked - x[:, padding_idx].to(acc)
    # The sum of p log p over a row's targets: c at the target, f at each
    # of the V - 2 others (together `smoothing`). 0 log 0 counts as 0.
    plogp = c * math.log(c) if c > 0 else 0.0
    if smoothing > 0:
        plogp += smoothing * math.log(f)
    per_row = plogp - c * picked - f * rest  # (N,)
    return per_row.masked_fill(target == padding_idx, 0).sum()


def label_smoothing_penalty_rows(margins=range(0, 25), smoothing=0.1):
    """Loss of one prediction against its margin, with and without LS."""
    rows = []
    for eps in (0.0, smoothing):
        crit = LabelSmoothing(6, padding_idx=0, smoothing=eps)
        for m in margins:
            # Token 0 is padding: a logit of -10,000 gives it probability 0.
            logits = torch.tensor([[-1e4, 0.0, float(m), 0.0, 0.0, 0.0]])
            loss = crit(logits.log_softmax(-1), torch.tensor([2]))
            rows.append(dict(margin=m, loss=float(loss), smoothing=eps))
    return rows


class SimpleLossCompute:
    """Generator + criterion, normalized by the token count."""

    def __init__(self, generator, criterion):
        self.generator = generator
        self.criterion = criterion

    def __call__(self, x, y, norm):
        """Decoder output x (B, T, d_model), targets y (B, T), and norm,
        the number of real target tokens (Batch.ntokens). Returns
        (loss_sum, loss_mean): the sum, detached, for the epoch's total,
        and the mean per token, for backward() and the log."""
        logp = self.generator(x)  # (B, T, vocab)
        flat = logp.reshape(-1, logp.size(-1))  # (B * T, vocab)
        loss_sum = self.criterion(flat, y.reshape(-1))  # summed over tokens
        return loss_sum.detach(), loss_sum / norm


# -----------------------------------------------------------------------------
# Optimizer and learning-rate schedule
# Explained in notebooks/02_training.py, same heading.
# -----------------------------------------------------------------------------
def rate(step, model_size, factor, warmup):
    """Warm-up then inverse-square-root learning rate (paper eq. 3)."""
    step = max(step, 1)
    return factor * model_size**-0.5 * min(step**-0.5, step * warmup**-1.5)


def make_optimizer(
    model,
    d_model=None,
    factor=1.0,
    warmup=4000,
    betas=(0.9, 0.98),
    schedule=None,
    weight_decay=0.0,
):
    """(optimizer, scheduler): Adam, or AdamW with a weight_decay, and a
    LambdaLR running `rate`, or `schedule` when given."""
    # schedule(step) is the learning rate itself: Adam's lr is 1.0, and
    # LambdaLR multiplies it by the schedule's value. Fused Adam only
    # where every parameter is on the CPU or a CUDA GPU (not Apple's MPS).
    fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
    adam = torch.optim.AdamW if weight_decay else torch.optim.Adam
    optimizer = adam(
        model.parameters(),
        lr=1.0,
        betas=betas,
        eps=1e-9,
        weight_decay=weight_decay,
        fused=fused,
    )
    if schedule is None:
        if d_model is None:
            raise ValueError("give d_model for the paper's schedule")

        def schedule(step):
            return rate(step, d_model, factor, warmup)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return optimizer, scheduler


# -----------------------------------------------------------------------------
# A first example: the copy task
# Explained in notebooks/02_training.py, same heading.
# -----------------------------------------------------------------------------
def greedy_decode(model, src, src_mask, max_len, start_symbol):
    """Most-probable-token decoding: (B, S) source to (B, max_len) ids.

    `src_mask` (B, 1, S) is True on real source tokens; the output starts
    with `start_symbol` and always runs to `max_len` (it does not stop at
    an end symbol). Call it in eval mode, under torch.no_grad()."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    ys = src.new_full((src.size(0), 1), start_symbol)  # (B, 1)
    for _ in range(max_len - 1):
        mask = subsequent_mask(ys.size(1), src.device)  # (1, t, t)
        out = model.decode(memory, src_mask, ys, mask)  # (B, t, d_model)
        next_word = model.generator(out[:, -1]).argmax(dim=-1)  # (B,)
        ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)
    return ys


def copy_accuracy(model, n, V=11, seq_len=10, generator=None):
    """Fraction of n fresh random sequences greedy decoding copies exactly."""
    was_training = model.training
    model.eval()
    b = next(data_gen(V, n, 1, seq_len, generator=generator))
    with torch.no_grad():
        out = greedy_decode(model, b.src, b.src_mask, seq_len, COPY_START)
    model.train(was_training)
    copied = (out == b.src).all(dim=1)  # (n,): True if all tokens match
    return copied.float().mean().item()  # the fraction of True


def warmup_linear_decay(step, peak, warmup, total, floor=0.02):
    """Linear warm-up to `peak`, then linear decay to `floor * peak`."""
    ramp = (step + 1) / warmup
    decay = max(floor, 1 - step / total)
    return peak * min(ramp, decay)


# -----------------------------------------------------------------------------
# Under the hood: `run_epoch`
# Explained in notebooks/02_training.py, same heading.
# -----------------------------------------------------------------------------
@dataclass
class TrainState:
    """Counters that persist across epochs."""

    step: int = 0  # micro-batches trained on (not optimizer steps)
    accum_step: int = 0  # optimizer steps taken
    samples: int = 0  # examples seen (sequences here, sentences in Part 3)
    tokens: int = 0  # target tokens seen

    def count(self, batch):
        """Record one trained micro-batch."""
        self.step += 1
        self.samples += batch.src.size(0)
        self.tokens += batch.ntokens


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


def optimizer_step(optimizer, scheduler, parameters, scale=1.0, scaler=None):
    """Rescale gradients if asked, step, zero grads, step the schedule."""
    if scale != 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(scale)
    if scaler is None:
        optimizer.step()
    else:  # fp16: skips the step if a gradient overflowed
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()


def micro_step(
    model,
    batch,
    loss_compute,
    accum_iter,
    hold_sync=False,
    autocast=nullcontext,
    scaler=None,
):
    """One micro-batch's loss, and its gradient when autograd is on."""
    hold = hold_sync and hasattr(model, "no_sync")  # only a DDP model has it
    # DDP's no_sync(): this backward keeps its gradients local (no
    # exchange between processes); otherwise, a context that does nothing.
    sync_context = model.no_sync() if hold else nullcontext()
    with sync_context:
        with autocast():
            out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
            loss_sum, loss_mean = loss_compute(out, batch.tgt_y, batch.ntokens)
        if torch.is_grad_enabled():
            scaled = loss_mean / accum_iter
            if scaler is not None:  # fp16: scaled up against underflow
                scaled = scaler.scale(scaled)
            scaled.backward()
    return loss_sum, loss_mean


def print_progress(i, state, loss_mean, speed, optimizer):
    """One log line of run_epoch's "train+log" mode."""
    lr = optimizer.param_groups[0]["lr"]
    print(
        f"batch {i:5d} | optimizer steps {state.accum_step:5d} | loss "
        f"{loss_mean.item():6.3f} | {speed:7.1f} tok/s | lr {lr:6.1e}"
    )


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
    scaler=None,
):
    """One pass over data_iter; returns (loss per token, train_state).

    `data_iter` yields Batch objects; `loss_compute(out, tgt_y, ntokens)`
    returns (summed loss, mean loss), as SimpleLossCompute does. `mode`
    is "train", "train+log" or "eval"; training needs `optimizer`."""
    if mode not in ("train", "train+log", "eval"):
        raise ValueError(f"mode is train, train+log or eval, not {mode!r}")
    train = mode != "eval"
    if train and optimizer is None:
        raise ValueError(f"mode={mode!r} needs an optimizer")
    state = TrainState() if train_state is None else train_state
    total_loss = 0.0
    total_tokens = 0
    window = 0  # micro-batches since the last optimizer step
    start = time.time()
    tokens_before = state.tokens
    with torch.set_grad_enabled(train):
        for i, (batch, is_last) in enumerate(with_last_flag(data_iter)):
            steps_now = train and (window + 1 == accum_iter or is_last)
            # Accumulate; with several processes (DDP, the appendix), do
            # not exchange gradients yet.
            hold = train and not steps_now
            loss_sum, loss_mean = micro_step(
                model,
                batch,
                loss_compute,
                accum_iter,
                hold_sync=hold,
                autocast=autocast,
                scaler=scaler,
            )
            total_loss += loss_sum
            total_tokens += batch.ntokens
            if not train:
                continue
            state.count(batch)
            window += 1
            if steps_now:
                scale = accum_iter / window  # 1 unless the window is short
                optimizer_step(
                    optimizer, scheduler, model.parameters(), scale, scaler
                )
                state.accum_step += 1
                window = 0
            if mode == "train+log" and (i - 1) % log_every == 0:
                speed = (state.tokens - tokens_before) / (time.time() - start)
                print_progress(i, state, loss_mean, speed, optimizer)
    return float(total_loss) / max(total_tokens, 1), state  # one sync


# =============================================================================
# Part 3: A real task, Multi30k German → English
# notebooks/03_multi30k.py
# =============================================================================


# -----------------------------------------------------------------------------
# The data
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
def read_multi30k(split, root=None):
    """The (German, English) sentence pairs of "train", "val" or "test"."""
    folder = multi30k_folder(root)
    sides = []
    for lang in ("de", "en"):
        path = split_file(folder, split, lang)
        with gzip.open(path, "rt", encoding="utf-8") as f:
            sides.append([line.strip() for line in f])  # some end in " "
    return list(zip(*sides, strict=True))  # line i of .de, line i of .en


# -----------------------------------------------------------------------------
# Tokenizers
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
def load_tokenizers():
    """Rule-based German and English spaCy tokenizers (no download)."""
    import spacy

    return spacy.blank("de"), spacy.blank("en")


def tokenize(text, nlp):
    """The token strings of one sentence; `nlp` is a spaCy `Language`."""
    return [tok.text for tok in nlp.tokenizer(text) if not tok.is_space]


# -----------------------------------------------------------------------------
# Vocabulary
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
SPECIALS = ("<s>", "</s>", "<blank>", "<unk>")
BOS, EOS, PAD, UNK = 0, 1, 2, 3


class Vocab:
    """Token ↔ id maps; the specials come first and unknowns map to UNK."""

    def __init__(self, itos):
        self._itos = list(itos)  # id → token
        self._stoi = {token: i for i, token in enumerate(self._itos)}
        if len(self._stoi) != len(self._itos):
            raise ValueError("a vocabulary cannot repeat a token")
        if tuple(self._itos[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary must start with {SPECIALS}")

    @classmethod
    def build(cls, sentences, min_freq=2):
        """Vocabulary of tokens seen at least `min_freq` times."""
        counts = Counter(token for tokens in sentences for token in tokens)
        kept = {t for t, n in counts.items() if n >= min_freq} - {*SPECIALS}
        return cls([*SPECIALS, *sorted(kept, key=lambda t: (-counts[t], t))])

    def __len__(self):
        return len(self._itos)

    def __contains__(self, token):
        return token in self._stoi

    def __getitem__(self, token):
        return self._stoi.get(token, UNK)

    def __call__(self, tokens):
        return [self[token] for token in tokens]

    def lookup_tokens(self, indices):
        """The tokens of a sequence of ids."""
        return [self._itos[int(i)] for i in indices]

    def get_itos(self):
        """A copy of the id → token list."""
        return list(self._itos)

    def __eq__(self, other):
        """Equal to a word vocabulary of any class with the same tokens:
        a vocabulary loaded from a checkpoint is the library's Vocab, not
        this notebook's class, and still equals the one built here."""
        # (Defining __eq__ makes Python drop __hash__: a Vocab cannot be
        # a dict key or a set member, which nothing here needs.)
        if not hasattr(other, "get_itos"):
            return NotImplemented  # not a vocabulary: Python says unequal
        if hasattr(other, "encode"):  # Part 5's subwords: never equal
            return False
        return self._itos == other.get_itos()


def build_vocabulary(spacy_de, spacy_en, min_freq=2):
    """Source (German) and target (English) vocabularies of train."""
    train = read_multi30k("train")
    de = (tokenize(de, spacy_de) for de, _ in train)
    en = (tokenize(en, spacy_en) for _, en in train)
    return Vocab.build(de, min_freq), Vocab.build(en, min_freq)


# -----------------------------------------------------------------------------
# From text to batches
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
def encode_text(text, tokenizer, vocab):
    """Ids of one sentence, without `<s>` and `</s>`."""
    if hasattr(vocab, "encode"):  # Part 5's subwords read raw text
        return vocab.encode(text)
    return vocab(tokenize(text, tokenizer))


def encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en):
    """Each (de, en) pair as two id lists, `<s> ... </s>`."""
    de = [[BOS, *encode_text(s, spacy_de, vocab_src), EOS] for s, _ in pairs]
    en = [[BOS, *encode_text(t, spacy_en, vocab_tgt), EOS] for _, t in pairs]
    return list(zip(de, en, strict=True))


def collate_batch(batch, pad_id=PAD):
    """Pad encoded (src, tgt) id lists to the longest in this batch."""
    pad = torch.nn.utils.rnn.pad_sequence
    sources = [torch.tensor(src) for src, _ in batch]
    targets = [torch.tensor(tgt) for _, tgt in batch]
    src = pad(sources, batch_first=True, padding_value=pad_id)  # (B, S)
    tgt = pad(targets, batch_first=True, padding_value=pad_id)  # (B, T)
    return src, tgt


def bucket(order, sizes, max_tokens):
    """Cut indices, sorted by size, into batches within a token budget."""
    batches, batch = [], []
    for i in order:  # sizes ascend, so sizes[i] is the batch's width
        if batch and (len(batch) + 1) * sizes[i] > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:  # the last, partly filled batch
        batches.append(batch)
    return batches


class TokenBatchSampler(torch.utils.data.Sampler):
    """Length-bucketed batches within a token budget, new each epoch."""

    def __init__(
        self, lengths, max_tokens, max_len=None, shuffle=True, seed=0
    ):
        if not max_len:  # None or 0: no limit but the batch's budget
            max_len = max_tokens
        if max_len > max_tokens:
            raise ValueError("max_len must not exceed max_tokens")
        self.max_len = max_len
        self.sizes = [max(s, t) for s, t in lengths]  # padded width per pair
        self.kept = [i for i, n in enumerate(self.sizes) if n <= max_len]
        self.dropped = [i for i, n in enumerate(self.sizes) if n > max_len]
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        """Reshuffle for `epoch`."""
        self.epoch = epoch

    def epoch_batches(self):
        """This epoch's batches, each a list of example indices."""
        # One random stream per (seed, epoch): Random accepts a string
        # as its seed, and the same string always gives the same stream.
        rng = random.Random(f"{self.seed}/{self.epoch}")
        kept = self.kept
        # rng.sample(x, len(x)) is a shuffled copy of x (random.shuffle
        # would shuffle in place, the list of the sampler itself).
        order = rng.sample(kept, len(kept)) if self.shuffle else kept
        # Stable: sentences of equal size keep their shuffled order.
        order = sorted(order, key=lambda i: self.sizes[i])
        batches = bucket(order, self.sizes, self.max_tokens)
        return rng.sample(batches, len(batches)) if self.shuffle else batches

    def __iter__(self):
        yield from self.epoch_batches()

    def __len__(self):  # the same every epoch: sorted sizes ignore shuffling
        return len(self.epoch_batches())


def create_dataloaders(
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    max_tokens=3000,
    max_len=128,
    seed=0,
    num_workers=0,
    max_train_pairs=0,
    encode=encode_pairs,
):
    """Train and validation DataLoaders of padded (src, tgt) CPU tensors."""
    loaders = []
    for split in ("train", "val"):
        train = split == "train"
        pairs = read_multi30k(split)
        n_pairs = max_train_pairs if train else max_train_pairs // 4
        if n_pairs:  # the tiny `ci` preset keeps only the first pairs
            pairs = pairs[:n_pairs]
        data = encode(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en)
        lengths = [(len(s), len(t)) for s, t in data]
        sampler = TokenBatchSampler(
            lengths,
            max_tokens,
            max_len=max_len if train else None,
            shuffle=train,
            seed=seed,
        )
        report_left_out(sampler, split)  # an error if none is left
        loader = torch.utils.data.DataLoader(
            data,
            batch_sampler=sampler,
            collate_fn=collate_batch,
            num_workers=num_workers,
        )
        loaders.append(loader)
    return tuple(loaders)


def report_left_out(sampler, split):
    """Warn about the pairs too long to use; an error if none is left
    (a data set of only long pairs, say)."""
    n_pairs = len(sampler.kept) + len(sampler.dropped)
    if not sampler.kept:
        raise DatasetError(
            f"the {split} split has no pair of at most {sampler.max_len}"
            f" tokens (of {n_pairs} pairs); nothing is left to use"
        )
    if sampler.dropped:
        n_dropped = len(sampler.dropped)
        too_long = f"pairs longer than {sampler.max_len} tokens"
        message = f"{split}: left out {n_dropped} {too_long}"
        warnings.warn(message, stacklevel=3)  # create_dataloaders' caller


# -----------------------------------------------------------------------------
# Training
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Everything that defines a Multi30k training run."""

    N: int = 3
    d_model: int = 256
    d_ff: int = 1024
    h: int = 4
    dropout: float = 0.1
    label_smoothing: float = 0.1
    max_tokens: int = 3000  # token budget of one batch
    accum_iter: int = 1
    epochs: int = 18
    factor: float = 1.0
    warmup: int = 800
    schedule: str = "noam"  # or "linear" (below): to zero at the end
    max_len: int = 128
    max_train_pairs: int = 0  # 0 means all 29,000
    seed: int = 0
    num_workers: int = 0  # processes that prepare batches (0: this one)
    # For the appendix and Part 5; at their defaults, no change here:
    preset: str = "cpu"
    precision: str = "auto"  # 16-bit where fast, else float32; or "fp32"
    checkpoint_dir: str = "checkpoints/cpu"
    tokenization: str = "word"  # or "bpe": one subword vocabulary
    tie_embeddings: bool = False  # the generator reuses an embedding
    keep_last: int = 5  # epoch files kept, for averaging (0: all)
    weight_decay: float = 0.0  # above 0: AdamW (Part 2's make_optimizer)
    rdrop: float = 0.0  # above 0: R-Drop's weight (the appendix)
    data: str = ""  # `train --data`'s pairs, by SHA-256 ("": Multi30k)


def model_from_config(c, n_src, n_tgt, dropout=None):
    """The model a TrainConfig describes, for the given vocabulary sizes."""
    if dropout is None:
        dropout = c.dropout
    model = make_model(
        n_src,
        n_tgt,
        N=c.N,
        d_model=c.d_model,
        d_ff=c.d_ff,
        h=c.h,
        dropout=dropout,
    )
    if c.tie_embeddings:  # Part 5
        if c.tokenization == "bpe":  # one vocabulary for both languages
            model.tgt_embed[0].lut.weight = model.src_embed[0].lut.weight
        model.generator.proj.weight = model.tgt_embed[0].lut.weight
    return model


def warmup_then_linear(step, peak, warmup, total):
    """Linear warm-up to `peak`, then a straight line to zero at `total`."""
    step = max(step, 1)  # LambdaLR's first step, 0, gets step 1's rate
    if step < warmup:
        return peak * step / warmup
    return peak * max(0, total - step) / max(1, total - warmup)


def run_schedule(config, batches_per_epoch, total=None):
    """The learning rate at each optimizer step, as `config` names it.

    `total` replaces the budget of `epochs` whole epochs, for a run that
    stops part of the way through an epoch.
    """
    c = config
    if c.schedule == "noam":  # Part 2's
        return lambda step: rate(step, c.d_model, c.factor, c.warmup)
    if c.schedule != "linear":
        raise ValueError(f"unknown schedule {c.schedule!r}: noam or linear")
    if total is None and batches_per_epoch is None:
        raise ValueError("a linear schedule needs batches_per_epoch")
    if total is None:  # a last, short accumulation window also steps
        total = math.ceil(batches_per_epoch / c.accum_iter) * c.epochs
    peak = rate(c.warmup, c.d_model, c.factor, c.warmup)
    return lambda step: warmup_then_linear(step, peak, c.warmup, total)


def make_run_optimizer(model, config, batches_per_epoch, total=None):
    """Adam and the run's schedule (`run_schedule`), as Part 2 pairs them."""
    schedule = run_schedule(config, batches_per_epoch, total)
    return make_optimizer(
        model,
        config.d_model,
        schedule=schedule,
        weight_decay=config.weight_decay,
    )


def pick_device():
    """The device the environment variable AT_DEVICE names, if set; else
    a CUDA GPU if there is one, else Apple's GPU (MPS), else the CPU."""
    named = os.environ.get("AT_DEVICE") or "auto"  # e.g. "cpu"
    if named != "auto":
        return device_named(named)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def train_one_process(
    vocab_src, vocab_tgt, spacy_de, spacy_en, config, device=None
):
    """Train on Multi30k in this process; returns (model, history)."""
    device = pick_device() if device is None else torch.device(device)
    torch.manual_seed(config.seed)
    model = model_from_config(config, len(vocab_src), len(vocab_tgt))
    model = model.to(device)
    criterion = LabelSmoothing(len(vocab_tgt), PAD, config.label_smoothing)
    loss_compute = SimpleLossCompute(model.generator, criterion)
    train_loader, valid_loader = create_dataloaders(
        vocab_src,
        vocab_tgt,
        spacy_de,
        spacy_en,
        max_tokens=config.max_tokens,
        max_len=config.max_len,
        seed=config.seed,
        num_workers=config.num_workers,
        max_train_pairs=config.max_train_pairs,
    )
    n_batches = len(train_loader)
    optimizer, scheduler = make_run_optimizer(model, config, n_batches)
    state, history = TrainState(), []
    for epoch in range(config.epochs):
        train_loader.batch_sampler.set_epoch(epoch)
        model.train()
        batches = (Batch(s, t, PAD).to(device) for s, t in train_loader)
        train_loss, state = run_epoch(
            batches,
            model,
            loss_compute,
            optimizer,
            scheduler,
            accum_iter=config.accum_iter,
            train_state=state,
        )
        model.eval()
        batches = (Batch(s, t, PAD).to(device) for s, t in valid_loader)
        val_loss, _ = run_epoch(batches, model, loss_compute, mode="eval")
        history.append(
            {
                "epoch": epoch,
                "train_loss": train_loss,
                "val_loss": val_loss,
                "steps": state.accum_step,
            }
        )
        print(f"epoch {epoch}: train {train_loss:.3f}, val {val_loss:.3f}")
    return model, history


# -----------------------------------------------------------------------------
# Decoding
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
@torch.no_grad()
def batch_greedy_decode(
    model, src, src_mask, max_len, start_symbol=BOS, end_symbol=EOS
):
    """Greedy decoding of a batch until every row has produced </s>."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    ys = src.new_full((src.size(0), 1), start_symbol)  # (B, 1), as Part 2
    done = torch.zeros_like(ys[:, 0], dtype=torch.bool)  # (B,)
    for _ in range(max_len - 1):
        tgt_mask = subsequent_mask(ys.size(1), src.device)  # (1, t, t)
        out = model.decode(memory, src_mask, ys, tgt_mask)  # (B, t, d_model)
        next_word = model.generator(out[:, -1]).argmax(dim=-1)  # (B,)
        next_word = next_word.masked_fill(done, PAD)  # finished: padding
        ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)  # (B, t + 1)
        done |= next_word == end_symbol
        if done.all():
            break
    return ys  # (B, <= max_len)


def strip_specials(ids, end_symbol=EOS):
    """Token ids after <s> and before the first </s>."""
    ids = list(ids)[1:]
    return ids[: ids.index(end_symbol)] if end_symbol in ids else ids


# -----------------------------------------------------------------------------
# Plumbing: where the files are
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
MULTI30K_ENV = "MULTI30K_DIR"
MULTI30K_SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}


class DatasetError(RuntimeError):
    """Multi30k could not be found, downloaded or verified, or a split
    (Multi30k's, or a `--data` folder's) has no pair left to use."""


def module_folder():
    """The folder of the library's file, the_annotated_transformer.py.

    In the module, that is the folder of its own file, __file__. A
    notebook cell has no __file__, so there Python's import system is
    asked where the library would be imported from. None if nowhere.
    """
    here = globals().get("__file__")
    if here:
        return Path(here).resolve().parent
    try:
        spec = importlib.util.find_spec("the_annotated_transformer")
    except ValueError:  # a module of that name without a spec
        return None
    return Path(spec.origin).parent if spec and spec.origin else None


MODULE_DIR = module_folder()  # None when the module cannot be found


def checkout_above():
    """The first folder, from the working directory up, that holds
    the_annotated_transformer.py (a checkout of the repository), or None."""
    for folder in (Path.cwd(), *Path.cwd().parents):
        if (folder / "the_annotated_transformer.py").exists():
            return folder
    return None


def data_dir():
    """The `data/` folder of the repository, where downloads are kept.

    The repository is the first folder, from the working directory up,
    that holds the_annotated_transformer.py. Failing that, it is the
    module's own folder when that is a checkout: it holds pyproject.toml,
    as after `pip install -e` (the notebooks' setup on Colab). Failing
    that too (an installed copy, not a checkout), it is the working
    directory.
    """
    checkout = checkout_above()
    if checkout is not None:
        return checkout / "data"
    if MODULE_DIR and (MODULE_DIR / "pyproject.toml").exists():
        return MODULE_DIR / "data"
    return Path.cwd() / "data"


def multi30k_folder(root=None):
    """`root`, else $MULTI30K_DIR, else data/multi30k in the repository."""
    return root or os.environ.get(MULTI30K_ENV) or data_dir() / "multi30k"


def split_file(folder, split, lang):
    """The path of one split's file in one language; it must exist."""
    path = Path(folder, f"{MULTI30K_SPLITS[split]}.{lang}.gz")
    if not path.is_file():
        hint = (
            "run `python annotated_transformer_tools.py download` in the"
            " repository (`annotated-transformer download` if installed)"
        )
        raise DatasetError(f"no {path}: {hint} or set {MULTI30K_ENV}")
    return path


def device_named(name):
    """The device that AT_DEVICE names, if this machine has it; else a
    one-line ValueError (rather than a CUDA error, cells later)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):  # torch lists 20 device types
        raise ValueError(
            f"AT_DEVICE={name!r} is not a device; try cpu, cuda or mps"
        ) from None
    why = why_missing(device)
    if why:
        raise ValueError(f"AT_DEVICE={name}: no {name} here: {why}")
    return device


def why_missing(device):
    """Why this machine lacks `device`, in a few words; "" if it has it."""
    if device.type == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) < gpus:
            return ""
        devices = "device" if gpus == 1 else "devices"
        return f"this machine has {gpus} CUDA {devices}"
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            return "this machine has no Apple GPU"
        return "a Mac has one Apple GPU, mps" if device.index else ""
    if device.type == "cpu":
        return "the CPU is one device, cpu" if device.index else ""
    return "only cpu, cuda and mps are supported"


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
            m.store_attention = True
            m.attn = None
        yield layers
    finally:
        for m, flag in zip(layers, flags, strict=True):
            m.store_attention = flag
            m.attn = None  # no stored weights outlive the block


# -----------------------------------------------------------------------------
# One sentence, every map
# Explained in notebooks/04_attention.py, same heading.
# -----------------------------------------------------------------------------
ATTENTION_KINDS = {
    "encoder self": "encoder_self",
    "decoder self": "decoder_self",
    "decoder source": "decoder_src",
}


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
        """One kind's weights with labels and masks: an AttentionView."""
        return attention_view(self, kind)  # in "Can we trust ..." below


def _recorded_weights(model, src, src_mask, tgt_in, pad):
    """One forward pass; each kind's weights stacked to (N, h, R, C)."""
    tgt_mask = Batch.make_std_mask(tgt_in, pad)  # (1, T, T)
    with record_attention(model):
        model(src, tgt_in, src_mask, tgt_mask)
        # attn[0]: the batch of one, so each is (h, R, C)
        enc = [layer.self_attn.attn[0] for layer in model.encoder.layers]
        dec = [layer.self_attn.attn[0] for layer in model.decoder.layers]
        cross = [layer.src_attn.attn[0] for layer in model.decoder.layers]
    # float32 on the CPU, whatever precision and device the model used
    return [torch.stack(w).float().cpu() for w in (enc, dec, cross)]


def _labels(ids, vocab):
    """Token strings of ids, or the ids as strings without a vocabulary."""
    ids = ids.tolist()
    return vocab.lookup_tokens(ids) if vocab else [str(i) for i in ids]


@torch.no_grad()
def attention_maps(
    model, src, tgt=None, vocab_src=None, vocab_tgt=None, max_extra=50, pad=PAD
):
    """Every layer's attention weights for one sentence, in eval mode."""
    device = next(model.parameters()).device
    src = torch.as_tensor(src, device=device).reshape(1, -1)  # (1, S)
    src_mask = (src != pad).unsqueeze(-2)  # (1, 1, S)
    training = model.training
    model.eval()
    try:
        if tgt is None:
            tgt = batch_greedy_decode(
                model, src, src_mask, src.size(1) + max_extra
            )
        tgt = torch.as_tensor(tgt, device=device).reshape(1, -1)  # (1, T+1)
        if tgt.size(1) < 2:
            raise ValueError("tgt needs <s> and at least one more token")
        weights = _recorded_weights(model, src, src_mask, tgt[:, :-1], pad)
    finally:
        model.train(training)
    src, tgt = src[0].cpu(), tgt[0].cpu()
    return AttentionMaps(
        *weights,  # encoder_self, decoder_self, decoder_src
        src_ids=src,
        tgt_ids=tgt[:-1],
        src_tokens=_labels(src, vocab_src),
        tgt_tokens=_labels(tgt[:-1], vocab_tgt),
        next_tokens=_labels(tgt[1:], vocab_tgt),
        pad=pad,
    )


# -----------------------------------------------------------------------------
# Can we trust these pictures?
# Explained in notebooks/04_attention.py, same heading.
# -----------------------------------------------------------------------------
class AttentionView(NamedTuple):
    """One kind of attention with its labels and masks."""

    weights: torch.Tensor  # (N, h, R, C)
    allowed: torch.Tensor  # (R, C) bool, False where masked
    rows: list  # R query labels
    cols: list  # C key labels
    row_keep: torch.Tensor  # (R,) bool, False at padding
    col_keep: torch.Tensor  # (C,) bool, False at padding
    col_ids: torch.Tensor  # (C,) token ids of the keys


def attention_view(maps, kind):
    """The weights of one kind with its labels and masks."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"kind must be one of {list(ATTENTION_KINDS)}")
    src_keep = maps.src_ids != maps.pad  # (S,)
    tgt_keep = maps.tgt_ids != maps.pad  # (T,)
    if kind == "encoder self":  # source reads source
        rows, row_keep = maps.src_tokens, src_keep
        cols, col_keep, col_ids = maps.src_tokens, src_keep, maps.src_ids
    elif kind == "decoder self":  # English reads English
        rows, row_keep = maps.tgt_tokens, tgt_keep
        cols, col_keep, col_ids = maps.tgt_tokens, tgt_keep, maps.tgt_ids
    else:  # "decoder source": English reads source
        rows, row_keep = maps.tgt_tokens, tgt_keep
        cols, col_keep, col_ids = maps.src_tokens, src_keep, maps.src_ids
    allowed = col_keep.expand(len(row_keep), len(col_keep))  # (R, C)
    if kind == "decoder self":
        future = subsequent_mask(len(col_keep), col_keep.device)[0]
        allowed = allowed & future  # (R, C)
    weights = getattr(maps, ATTENTION_KINDS[kind])  # (N, h, R, C)
    return AttentionView(
        weights, allowed, rows, cols, row_keep, col_keep, col_ids
    )


# -----------------------------------------------------------------------------
# What the heads do, measured
# Explained in notebooks/04_attention.py, same heading.
# -----------------------------------------------------------------------------
def _mean(x, keep):
    """Mean of (N, h, R) over the rows where keep (R,) is True; 0 if none."""
    if not keep.any():
        return x.new_zeros(x.shape[:-1])  # (N, h)
    return x[..., keep].mean(-1)


def _diagonal(v, kind):
    """Row positions (R, 1), in column units, and key positions (1, C).

    The diagonal is where j == i. For "decoder source", row i is rescaled
    to i (S-1) / (T-1), so they need not be whole numbers."""
    R, C = v.allowed.shape
    f64 = {"dtype": torch.float64, "device": v.weights.device}  # the CPU
    i = torch.arange(R, **f64)[:, None]  # (R, 1)
    j = torch.arange(C, **f64)[None, :]  # (1, C)
    if kind == "decoder source":  # proportional: j = i (S-1) / (T-1)
        rows, cols = int(v.row_keep.sum()), int(v.col_keep.sum())
        i = i * (cols - 1) / max(rows - 1, 1)
    return i, j


def _head_statistics(v, kind, specials):
    """Each statistic of one kind as an (N, h) tensor, over real rows."""
    w = v.weights.double()  # (N, h, R, C): float64, for exact sums
    i, j = _diagonal(v, kind)  # (R, 1) diagonal's column, (1, C) keys
    # How many columns each key lies after the diagonal's (rounded)
    # column: -1 is the key just before it, 0 on it, +1 just after.
    offset = j - i.round()  # (R, C)
    n = v.allowed.sum(-1)  # (R,) keys each query may see
    # Entropy of each row, -sum_j p log p. xlogy(p, p) is p log p, and
    # it is 0 where p = 0 (a plain p * log(p) would give 0 * -inf = NaN).
    H = -torch.special.xlogy(w, w).sum(-1)  # (N, h, R)
    specials = torch.tensor(specials, device=v.col_ids.device)
    # True at the key columns whose token is <s> or </s>
    special = torch.isin(v.col_ids, specials)  # (C,)
    # Each quantity per row, summed over the keys, each (N, h, R). A
    # boolean mask times the weights keeps the weights where it is True
    # (True counts as 1, False as 0): their sum is the row's share there.
    sums = {
        # weight times distance |j - i| from the exact diagonal
        "distance": (w * (j - i).abs()).sum(-1),
        "previous": (w * (offset == -1)).sum(-1),  # one column before
        "same": (w * (offset == 0)).sum(-1),  # on the diagonal
        "next": (w * (offset == 1)).sum(-1),  # one column after
        "specials": w[..., special].sum(-1),  # on <s> and </s>
    }
    # Entropy as a fraction of uniform: H / log n. A row with one key
    # (n == 1) has no choice: it is left out of the mean, and the clamp
    # keeps its 0 / log 1 = 0 / 0 from being a NaN before it is dropped.
    entropy = _mean(H / n.clamp(min=2).log(), v.row_keep & (n > 1))
    # Every other statistic: the mean over the real (not padding) rows
    means = {k: _mean(s, v.row_keep) for k, s in sums.items()}
    return {"entropy": entropy, **means}  # each (N, h)


def attention_statistics(maps, specials=(BOS, EOS)):
    """Per kind, layer and head: entropy, distance and where weight goes."""
    out = []
    for kind in ATTENTION_KINDS:
        stats = _head_statistics(maps.view(kind), kind, specials)
        N, h = stats["entropy"].shape
        for layer in range(N):
            for head in range(h):
                values = {k: float(s[layer, head]) for k, s in stats.items()}
                row = {"kind": kind, "layer": layer + 1, "head": head + 1}
                out.append({**row, **values})
    return out


def attention_summary(model, pairs, spacy_de, spacy_en, vocab_src, vocab_tgt):
    """attention_statistics averaged over sentence pairs (de, en)."""
    labels = ("kind", "layer", "head")  # which head a row describes
    sums = {}  # (kind, layer, head) -> {statistic: its sum over the pairs}
    for de, en in pairs:
        src = [BOS, *vocab_src(tokenize(de, spacy_de)), EOS]
        tgt = [BOS, *vocab_tgt(tokenize(en, spacy_en)), EOS]
        for row in attention_statistics(attention_maps(model, src, tgt)):
            key = tuple(row[label] for label in labels)
            if key not in sums:  # the first pair: start every sum at 0
                sums[key] = {k: 0.0 for k in row if k not in labels}
            for name in sums[key]:
                sums[key][name] += row[name]
    summary = []  # one row per head, in attention_statistics' order
    for key, total in sums.items():
        means = {name: value / len(pairs) for name, value in total.items()}
        summary.append({**dict(zip(labels, key)), **means})
    return summary


# -----------------------------------------------------------------------------
# Putting attention to work: unknown words
# Explained in notebooks/04_attention.py, same heading.
# -----------------------------------------------------------------------------
@torch.no_grad()
def source_alignment(model, src, src_mask, out, layers=None):
    """(B, T): the source position each output token after <s> read most.

    `layers` picks the decoder layers to average (default: all)."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    ys = out[:, :-1]  # (B, T): decoder inputs; row t wrote out[:, t + 1]
    # The causal mask alone, not training's make_std_mask: padding in `out`
    # only follows </s>, so no real row sees it, and padded rows are unread.
    tgt_mask = subsequent_mask(ys.size(1), src.device)  # (1, T, T)
    decoder = model.decoder.layers
    chosen = range(len(decoder)) if layers is None else layers
    with record_attention(model):
        model.decode(memory, src_mask, ys, tgt_mask)
        weights = [decoder[i].src_attn.attn for i in chosen]  # (B, h, T, S)
    # (layers, B, h, T, S) -> (B, T, S): the mean over layers and heads
    attn = torch.stack(weights).mean(dim=(0, 2))
    not_special = ((src != BOS) & (src != EOS)).unsqueeze(1)  # (B, 1, S)
    word_cols = src_mask & not_special  # (B, 1, S): the source's words
    return attn.masked_fill(~word_cols, -1.0).argmax(dim=-1)


def replace_unknowns(ids, aligned, src_words, vocab_tgt):
    """Output tokens, each <unk> replaced by the source word it read most.

    ids: the output's token ids after <s>; aligned: for each of them, the
    source position its row read most."""
    tokens = vocab_tgt.lookup_tokens(ids)
    for k, token_id in enumerate(ids):  # ids[k] is out[k + 1]: row k wrote it
        if token_id != UNK:
            continue
        j = aligned[k]  # source position: 0 is <s>, so word j - 1
        if 0 < j <= len(src_words):  # a word, not <s> or </s>
            tokens[k] = src_words[j - 1]
    return tokens


# =============================================================================
# Part 5: Beyond the paper's architecture: decoding, subwords, averaging
# notebooks/05_beyond.py
# =============================================================================


# -----------------------------------------------------------------------------
# 1. Incremental decoding with a key/value cache
# Explained in notebooks/05_beyond.py, same heading.
# -----------------------------------------------------------------------------
class DecoderCache:
    """Per-layer keys and values that incremental decoding reuses."""

    def __init__(self, model, memory, src_mask):
        self.src_mask = heads_mask(src_mask)  # (B, 1, 1, S)
        self.cross = [
            [
                layer.src_attn.split_heads(memory, layer.src_attn.w_k),
                layer.src_attn.split_heads(memory, layer.src_attn.w_v),
            ]
            for layer in model.decoder.layers
        ]  # per layer: keys and values, each (B, h, S, d_k)
        self.self_kv = [None] * len(model.decoder.layers)  # (R, h, t, d_k)
        self.length = 0  # target positions decoded so far

    def select(self, index):
        """Keep the rows `index` (R',) of every cached tensor, in order."""
        # Here a row is a sentence, so both steps keep `index`; section
        # 2's beam search needs them apart.
        self.keep_rows(index)
        self.keep_sentences(index)

    def keep_rows(self, index):
        """Keep the rows `index` (R',) of the self-attention cache."""
        self.self_kv = [
            None if kv is None else [x.index_select(0, index) for x in kv]
            for kv in self.self_kv
        ]

    def keep_sentences(self, sentences):
        """Keep the source side of the sentences `sentences` (B',)."""
        self.src_mask = self.src_mask.index_select(0, sentences)
        self.cross = [
            [x.index_select(0, sentences) for x in kv] for kv in self.cross
        ]


def attend_step(attn, x, k, v, mask=None):
    """Attention of new positions x (R, 1, d) to k, v (kv_rows, h, S, d_k).

    kv_rows is B (one per sentence) in source attention, R in self-attention.
    """
    R = x.size(0)
    kv_rows = k.size(0)
    group = R // kv_rows  # rows per set of keys and values
    queries = x.reshape(kv_rows, group, x.size(-1))  # (kv_rows, group, d)
    q = attn.split_heads(queries, attn.w_q)  # (kv_rows, h, group, d_k)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # Merge the heads, as in Part 1: (kv_rows, h, group, d_k) -> (R, 1, d)
    out = out.transpose(1, 2).reshape(R, 1, attn.h * attn.d_k)
    return attn.w_o(out)  # (R, 1, d_model)


def cached_self_attention(attn, x, cache, i):
    """Self-attention of layer i for the new position, growing its cache."""
    k = attn.split_heads(x, attn.w_k)  # (R, h, 1, d_k)
    v = attn.split_heads(x, attn.w_v)
    if cache.self_kv[i] is not None:
        k = torch.cat([cache.self_kv[i][0], k], dim=2)  # (R, h, t+1, d_k)
        v = torch.cat([cache.self_kv[i][1], v], dim=2)
    cache.self_kv[i] = [k, v]
    return attend_step(attn, x, k, v)


def decoder_layer_step(layer, x, cache, i):
    """One DecoderLayer applied to the newest position only."""
    k, v = cache.cross[i]  # (B, h, S, d_k)
    x = layer.self_attn_block(
        x, lambda y: cached_self_attention(layer.self_attn, y, cache, i)
    )
    x = layer.src_attn_block(
        x, lambda y: attend_step(layer.src_attn, y, k, v, cache.src_mask)
    )
    return layer.ff_block(x, layer.feed_forward)  # (R, 1, d_model)


def decode_step(model, ys_last, cache):
    """Log-probs (R, V) of the next token, given the newest ids (R, 1).

    Advances `cache` by one position: call it once per token."""
    embed = model.tgt_embed[0]  # Part 1's Embeddings
    position = model.tgt_embed[1]  # and PositionalEncoding
    pos = cache.length  # the position of the token fed
    # PositionalEncoding.forward for that position alone; its dropout does
    # nothing here, since decoding runs in eval mode.
    x = position.dropout(embed(ys_last) + position.pe[:, pos : pos + 1])
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
    # rows[r]: the row of `out` (0 to B - 1) that cache row r decodes.
    rows = torch.arange(B, device=src.device)  # (R,) indices into out
    t = 0  # for the return below when max_len == 1 and the loop never runs
    for t in range(1, max_len):
        logp = decode_step(model, out[rows, t - 1 : t], cache)  # (R, V)
        word = logp.argmax(dim=-1)  # (R,)
        out[rows, t] = word
        running = word != end_symbol  # (R,) one flag per cache row
        if not running.any():
            break  # every sentence has ended
        if not running.all():  # some ended: drop their rows
            rows = rows[running]  # still indices into out's B rows
            # The cache counts only its own R rows, 0 to R - 1: keep the
            # positions (cache rows) where `running` is True.
            cache.select(torch.where(running)[0])  # (R',) cache rows
    return out[:, : t + 1]  # (B, <= max_len)


# -----------------------------------------------------------------------------
# 2. Beam search
# Explained in notebooks/05_beyond.py, same heading.
# -----------------------------------------------------------------------------
class Beams(NamedTuple):
    """The k hypotheses of each sentence still searching."""

    sent: torch.Tensor  # (A,) index of each sentence in the batch
    tokens: torch.Tensor  # (A, k, max_len) ids so far, <s> first
    logp_sum: torch.Tensor  # (A, k) log P of each hypothesis
    lengths: torch.Tensor  # (A, k) tokens generated, </s> included
    finished: torch.Tensor  # (A, k) bool: has produced </s>

    @classmethod
    def start(cls, B, k, max_len, start_symbol, device):
        """k hypotheses per sentence, of which only the first is real."""
        shape = (B, k, max_len)
        tokens = torch.full(shape, PAD, dtype=torch.long, device=device)
        tokens[:, :, 0] = start_symbol
        logp_sum = torch.full((B, k), -math.inf, device=device)
        logp_sum[:, 0] = 0.0
        lengths = torch.zeros(B, k, dtype=torch.long, device=device)
        sent = torch.arange(B, device=device)
        finished = torch.zeros_like(lengths, dtype=torch.bool)  # (B, k)
        return cls(sent, tokens, logp_sum, lengths, finished)


def length_penalty(length, alpha=0.6):
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def beam_candidates(logp, logp_sum, lengths, finished, alpha):
    """The best extensions of each hypothesis.

    Returns the candidates' scores, log P and tokens, each (A, k * c),
    the hypotheses' lengths after this step, (A, k), and c."""
    A, k, V = logp.shape  # (sentences, beams, vocabulary)
    c = min(k, V)  # candidates kept per hypothesis: all that can win
    logp, word = logp.topk(c, dim=-1)  # (A, k, c)
    # A finished hypothesis has one candidate, its first, which appends
    # <blank> and adds 0 to its log P; its other candidates get -inf, so
    # they never win a place. Its c log-probs become [0, -inf, ...].
    if_finished = logp.new_full((c,), -math.inf)  # (c,)
    if_finished[0] = 0.0
    done = finished.unsqueeze(-1)  # (A, k, 1)
    logp = torch.where(done, if_finished, logp)  # (A, k, c)
    word = word.masked_fill(done, PAD)  # (A, k, c)
    cand_logp = logp_sum.unsqueeze(-1) + logp  # (A, k, c) log P of each
    cand_len = lengths + (~finished).long()  # (A, k)
    score = cand_logp / length_penalty(cand_len, alpha).unsqueeze(-1)
    return (
        score.view(A, -1),
        cand_logp.view(A, -1),
        word.view(A, -1),
        cand_len,
        c,
    )


def advance_beams(beams, logp, t, alpha, end_symbol):
    """Extend every hypothesis by one token and keep the k best."""
    k = beams.logp_sum.size(1)
    score, cand_logp, words, cand_len, c = beam_candidates(
        logp, beams.logp_sum, beams.lengths, beams.finished, alpha
    )  # (A, k * c), c candidates per hypothesis
    score, idx = score.topk(k, dim=1)  # (A, k) positions in the k * c
    # A sentence's k * c candidates are its k hypotheses' c each, one
    # after the other: idx = parent * c + m, for the m-th candidate of
    # hypothesis `parent`. So the division gives back the parent.
    parent = idx // c  # (A, k) which hypothesis each survivor extends
    word = words.gather(1, idx)  # (A, k) the token it appends
    was_finished = beams.finished.gather(1, parent)  # (A, k) the parent's
    finished = was_finished | (word == end_symbol)
    # tokens[a, j] = beams.tokens[a, parent[a, j]]: gather along dim 1
    # needs an index of the full output shape, one parent per position.
    parent_index = parent.unsqueeze(-1).expand_as(beams.tokens)
    tokens = beams.tokens.gather(1, parent_index)  # (A, k, max_len)
    tokens[:, :, t] = word
    lengths = cand_len.gather(1, parent)
    logp_sum = cand_logp.gather(1, idx)  # (A, k)
    new = Beams(beams.sent, tokens, logp_sum, lengths, finished)
    ended = torch.where(finished & ~was_finished, score, -math.inf)
    return new, parent, ended  # ended: (A, k) scores, -inf if not new


def keep_best(out, best, beams, score):
    """In place: record each sentence's best hypothesis if it beats `best`."""
    top, j = score.max(dim=1)  # (A,) best score, (A,) its hypothesis
    sentences = torch.arange(j.size(0), device=j.device)  # (A,)
    chosen = beams.tokens[sentences, j]  # (A, max_len) hypothesis j's tokens
    better = top > best[beams.sent]  # (A,) beats its sentence's record
    rows = beams.sent[better]  # (A',) their rows in `out` and `best`
    best[rows] = top[better]
    out[rows] = chosen[better]  # (A', max_len)


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
    B = batch_size
    k = beam_size
    out = torch.full((B, max_len), PAD, dtype=torch.long, device=device)
    out[:, 0] = start_symbol  # (B, max_len): the answers
    best = torch.full((B,), -math.inf, device=device)  # their scores
    beams = Beams.start(B, k, max_len, start_symbol, device)
    t = 0  # for the return below when max_len == 1 and the loop never runs
    for t in range(1, max_len):
        A = beams.sent.numel()
        logp = step(beams.tokens[:, :, t - 1].reshape(A * k, 1))  # (A*k, V)
        beams, parent, ended = advance_beams(
            beams, logp.view(A, k, -1), t, alpha, end_symbol
        )
        keep_best(out, best, beams, ended)
        keep = ~beams.finished.all(dim=1)  # (A,) sentences with beams running
        if t == max_len - 1 or not keep.any():
            break
        # Sentence b's hypotheses are rows b * k ... b * k + k - 1, so
        # hypothesis j's parent sits in row b * k + parent[b, j].
        first_row = torch.arange(A, device=device).unsqueeze(1) * k  # (A, 1)
        parent_rows = first_row + parent  # (A, k)
        select(parent_rows[keep].view(-1))  # (A' * k,) rows to keep
        beams = Beams(  # only the sentences still searching
            sent=beams.sent[keep],
            tokens=beams.tokens[keep],
            logp_sum=beams.logp_sum[keep],
            lengths=beams.lengths[keep],
            finished=beams.finished[keep],
        )
    # At the end, running hypotheses compete too; finished ones were
    # recorded when they ended.
    scores = beams.logp_sum / length_penalty(beams.lengths, alpha)  # (A, k)
    still_running = scores.masked_fill(beams.finished, -math.inf)
    keep_best(out, best, beams, still_running)
    return out[:, : t + 1]  # (B, <= max_len)


class BeamCache(DecoderCache):
    """A DecoderCache with `group` rows (hypotheses) per sentence."""

    def __init__(self, model, memory, src_mask, group):
        super().__init__(model, memory, src_mask)
        self.group = group  # rows per sentence

    def select(self, index):
        """Keep the rows `index` (R',), given in runs of `group` rows per
        sentence, and the source side of those sentences."""
        self.keep_rows(index)
        first_rows = index[:: self.group]  # (R' / group,)
        sentences = first_rows // self.group  # (R' / group,)
        everyone = torch.arange(self.src_mask.size(0), device=index.device)
        if not torch.equal(sentences, everyone):  # some sentences ended
            self.keep_sentences(sentences)


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
    cache = BeamCache(model, memory, src_mask, group=beam_size)
    step = lambda ys: decode_step(model, ys, cache)  # (B*k, 1) -> (B*k, V)
    return beam_search_steps(
        step,
        cache.select,
        batch_size=src.size(0),
        max_len=max_len,
        beam_size=beam_size,
        alpha=alpha,
        start_symbol=start_symbol,
        end_symbol=end_symbol,
        device=src.device,
    )


# -----------------------------------------------------------------------------
# 3. A shared subword vocabulary, and one matrix for three jobs
# Explained in notebooks/05_beyond.py, same heading.
# -----------------------------------------------------------------------------
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


BPE_VOCAB_SIZE = 10000


def train_bpe(sentences, vocab_size=BPE_VOCAB_SIZE):
    """A BpeVocab learned from an iterable of sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    # <unk>: for characters never seen in training
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIALS[UNK]))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        # added first, so they get ids 0-3, as BpeVocab requires
        special_tokens=list(SPECIALS),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sentences, trainer)
    return BpeVocab(tokenizer)


def tie_embeddings(model):
    """Share one matrix among both embeddings and the generator."""
    shared = model.src_embed[0].lut.weight  # (V, d_model)
    if model.tgt_embed[0].lut.weight.shape != shared.shape:
        raise ValueError(
            "tie_embeddings needs one shared vocabulary, got "
            f"{model.src_embed[0].lut.num_embeddings} source and "
            f"{model.tgt_embed[0].lut.num_embeddings} target units"
        )
    model.tgt_embed[0].lut.weight = shared
    model.generator.proj.weight = shared
    return model


# -----------------------------------------------------------------------------
# 4. Checkpoint averaging
# Explained in notebooks/05_beyond.py, same heading.
# -----------------------------------------------------------------------------
@torch.no_grad()
def average(model, models):
    """Set model's parameters to the mean of those of `models`."""
    params = [dict(m.named_parameters()) for m in models]
    for name, p in model.named_parameters():
        stacked = torch.stack([ps[name] for ps in params])  # (n, *p.shape)
        p.copy_(stacked.mean(dim=0))
    return model


# The public names, for `from ... import *` and the docs.
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
    "attention",
    "MultiHeadedAttention",
    "heads_mask",
    "PositionwiseFeedForward",
    "Embeddings",
    "PositionalEncoding",
    "make_model",
    "count_parameters",
    "Batch",
    "COPY_PAD",
    "COPY_START",
    "data_gen",
    "LabelSmoothing",
    "smoothed_kl",
    "label_smoothing_penalty_rows",
    "SimpleLossCompute",
    "rate",
    "make_optimizer",
    "greedy_decode",
    "copy_accuracy",
    "warmup_linear_decay",
    "TrainState",
    "with_last_flag",
    "optimizer_step",
    "micro_step",
    "print_progress",
    "run_epoch",
    "read_multi30k",
    "load_tokenizers",
    "tokenize",
    "SPECIALS",
    "BOS",
    "EOS",
    "PAD",
    "UNK",
    "Vocab",
    "build_vocabulary",
    "encode_text",
    "encode_pairs",
    "collate_batch",
    "bucket",
    "TokenBatchSampler",
    "create_dataloaders",
    "report_left_out",
    "TrainConfig",
    "model_from_config",
    "warmup_then_linear",
    "run_schedule",
    "make_run_optimizer",
    "pick_device",
    "train_one_process",
    "batch_greedy_decode",
    "strip_specials",
    "MULTI30K_ENV",
    "MULTI30K_SPLITS",
    "DatasetError",
    "module_folder",
    "MODULE_DIR",
    "checkout_above",
    "data_dir",
    "multi30k_folder",
    "split_file",
    "device_named",
    "why_missing",
    "record_attention",
    "ATTENTION_KINDS",
    "AttentionMaps",
    "attention_maps",
    "AttentionView",
    "attention_view",
    "attention_statistics",
    "attention_summary",
    "source_alignment",
    "replace_unknowns",
    "DecoderCache",
    "attend_step",
    "cached_self_attention",
    "decoder_layer_step",
    "decode_step",
    "cached_greedy_decode",
    "Beams",
    "length_penalty",
    "beam_candidates",
    "advance_beams",
    "keep_best",
    "beam_search_steps",
    "BeamCache",
    "beam_search",
    "BpeVocab",
    "BPE_VOCAB_SIZE",
    "train_bpe",
    "tie_embeddings",
    "average",
]
