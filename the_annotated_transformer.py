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

if __name__ == "__main__":  # Ctrl-C while torch loads: one line, no traceback
    import os
    import signal

    def _interrupted(signum, frame):
        os.write(2, b"interrupted\n")
        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted)

import argparse
import contextlib
import copy
import functools
import gzip
import hashlib
import http.client
import itertools
import json
import math
import os
import pickle
import random
import signal
import socket
import sys
import threading
import time
import unicodedata
import urllib.error
import urllib.request
import warnings
import zipfile
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "EncoderDecoder",
    "Generator",
    "clones",
    "LayerStack",
    "Encoder",
    "LayerNorm",
    "SublayerConnection",
    "residual_blocks",
    "sublayer_property",
    "EncoderLayer",
    "Decoder",
    "DecoderLayer",
    "subsequent_mask",
    "attention",
    "MultiHeadedAttention",
    "PositionwiseFeedForward",
    "Embeddings",
    "PositionalEncoding",
    "make_model",
    "count_parameters",
    "Batch",
    "data_gen",
    "LabelSmoothing",
    "smoothed_kl",
    "save_chart",
    "line_chart",
    "label_smoothing_penalty_rows",
    "label_smoothing_penalty_chart",
    "SimpleLossCompute",
    "TrainState",
    "with_last_flag",
    "optimizer_step",
    "micro_step",
    "print_progress",
    "run_epoch",
    "rate",
    "make_optimizer",
    "learning_rate_chart",
    "greedy_decode",
    "copy_accuracy",
    "copy_accuracy_teacher_forced",
    "CopyLossCompute",
    "greedy_check",
    "warmup_linear_decay",
    "CopyTaskConfig",
    "native_bf16",
    "copy_task_setup",
    "epoch_summary",
    "train_copy_task",
    "copy_progress_chart",
    "MULTI30K_ENV",
    "MULTI30K_SPLITS",
    "DatasetError",
    "data_dir",
    "read_multi30k",
    "load_tokenizers",
    "tokenize",
    "SPECIALS",
    "Vocab",
    "build_vocabulary",
    "encode_text",
    "encode_pairs",
    "collate_batch",
    "bucket",
    "split_evenly",
    "TokenBatchSampler",
    "create_dataloaders",
    "TrainConfig",
    "model_from_config",
    "TrainingRun",
    "params_in_sync",
    "train_epoch",
    "train_worker",
    "load_trained_model",
    "batch_greedy_decode",
    "strip_specials",
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
    "Beams",
    "advance_beams",
    "keep_best",
    "beam_search_steps",
    "beam_search",
    "BpeVocab",
    "BPE_VOCAB_SIZE",
    "train_bpe",
    "load_bpe",
    "average",
    "average_checkpoints",
    "load_translator",
    "process_alive",
    "clean_partial_files",
    "atomic_write",
    "MULTI30K_BASE_URL",
    "MULTI30K_SHA256",
    "sha256_of",
    "download_multi30k",
    "PRESETS",
    "get_config",
    "load_vocab",
    "load_vocabularies",
    "hardware_summary",
    "free_port",
    "train_distributed_model",
    "train_model",
    "detokenize",
    "decode_text",
    "source_alignment",
    "replace_unknowns",
    "translate_batch",
    "compute_bleu",
    "translate",
    "check_outputs",
    "run_model_example",
    "describe_checkpoint",
    "find_or_train",
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "epoch_checkpoints",
    "LEGACY_CONFIG_NAMES",
    "checkpoint_config",
    "checkpoint_vocabularies",
    "size_mismatch",
    "load_weights",
    "save_run",
    "save_epoch",
    "resume_point",
    "resume_run",
    "check_resume",
    "FolderInUseError",
    "folder_lock",
    "TextFileError",
    "clean_line",
    "iter_lines",
    "read_lines",
    "read_parallel",
    "write_results",
    "UserError",
    "say",
    "positive_int",
    "count",
    "existing_device",
    "OneLineParser",
    "add_train_parser",
    "add_decoding_options",
    "add_evaluate_parser",
    "add_translate_parser",
    "build_parser",
    "command_train",
    "train_locked",
    "check_out",
    "load_for_decoding",
    "position_limit",
    "fit_to_model",
    "command_evaluate",
    "translate_lines",
    "sentences_to_translate",
    "warn_unknown_words",
    "command_translate",
    "command_download",
    "USER_ERRORS",
    "stdout_fault",
    "one_line",
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
        self.encoder, self.decoder = encoder, decoder
        self.src_embed, self.tgt_embed = src_embed, tgt_embed
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


class LayerStack(nn.Module):
    """N copies of one layer, applied in turn, then a final layer norm."""

    def __init__(self, layer, N):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def run(self, x, *context):
        """Pass (B, T, d_model) through every layer, then normalize."""
        for layer in self.layers:
            x = layer(x, *context)
        return self.norm(x)


class Encoder(LayerStack):
    """The encoder: N EncoderLayers and a final layer norm."""

    def forward(self, x, mask):
        """(B, S, d_model) source vectors with a (B, 1, S) padding mask."""
        return self.run(x, mask)


class LayerNorm(nn.Module):
    """Layer norm over the last dimension: a_2 * (x - mean) / std + b_2."""

    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        """Normalize (..., features) with the biased variance."""
        # One fused kernel; the cell below checks it against the formula.
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


def residual_blocks(size, dropout, n):
    """n fresh SublayerConnections, one per sub-layer of a layer."""
    return nn.ModuleList(SublayerConnection(size, dropout) for _ in range(n))


def sublayer_property(i, doc):
    """A read-only property that names the block self.sublayer[i]."""
    return property(lambda self: self.sublayer[i], doc=doc)


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in a residual block."""

    def __init__(self, size, self_attn, feed_forward, dropout):
        super().__init__()
        self.size = size  # d_model, read by LayerStack
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = residual_blocks(size, dropout, 2)

    self_attn_block = sublayer_property(0, "Block around self-attention.")
    ff_block = sublayer_property(1, "Block around the feed-forward net.")

    def forward(self, x, mask):
        """(B, S, d_model) with a (B, 1, S) padding mask."""
        x = self.self_attn_block(x, lambda y: self.self_attn(y, y, y, mask))
        return self.ff_block(x, self.feed_forward)


# -----------------------------------------------------------------------------
# Decoder
# Explained in notebooks/01_model.py, same heading.
# -----------------------------------------------------------------------------
class Decoder(LayerStack):
    """The decoder: N DecoderLayers and a final layer norm."""

    def forward(self, x, memory, src_mask, tgt_mask):
        """Run (B, T, d_model) through every layer against the memory."""
        return self.run(x, memory, src_mask, tgt_mask)


class DecoderLayer(nn.Module):
    """Masked self-attention, source attention, then feed-forward."""

    def __init__(self, size, self_attn, src_attn, feed_forward, dropout):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = residual_blocks(size, dropout, 3)

    self_attn_block = sublayer_property(0, "Block around self-attention.")
    src_attn_block = sublayer_property(1, "Block around source attention.")
    ff_block = sublayer_property(2, "Block around the feed-forward net.")

    def forward(self, x, memory, src_mask, tgt_mask):
        """(B, T, d_model) target states; memory is (B, S, d_model)."""
        x = self.self_attn_block(
            x, lambda y: self.self_attn(y, y, y, tgt_mask)
        )
        x = self.src_attn_block(
            x, lambda y: self.src_attn(y, memory, memory, src_mask)
        )
        return self.ff_block(x, self.feed_forward)


def subsequent_mask(size):
    """(1, size, size) bool mask, True where key position <= query."""
    upper = torch.triu(torch.ones(1, size, size, dtype=torch.bool), 1)
    return ~upper


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
        if d_model % h:
            raise ValueError(f"d_model={d_model} is not divisible by h={h}")
        self.h, self.d_k = h, d_model // h
        # W^Q, W^K, W^V and W^O, named by the properties below.
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.dropout = nn.Dropout(p=dropout)
        self.store_attention = False  # keep the weights in self.attn?
        self.attn = None  # (B, h, T, S) when store_attention is True

    w_q = property(lambda self: self.linears[0], doc="Query projection.")
    w_k = property(lambda self: self.linears[1], doc="Key projection.")
    w_v = property(lambda self: self.linears[2], doc="Value projection.")
    w_o = property(lambda self: self.linears[3], doc="Output projection.")

    def split_heads(self, x, linear):
        """Project (B, T, d_model) and split to (B, h, T, d_k)."""
        return linear(x).view(x.size(0), -1, self.h, self.d_k).transpose(1, 2)

    def forward(self, query, key, value, mask=None):
        """Attend from query (B, T, d) to key/value (B, S, d)."""
        if mask is not None:
            mask = mask.unsqueeze(1)  # one mask for every head: (B, 1, *, S)
        q = self.split_heads(query, self.w_q)  # (B, h, T, d_k)
        k = self.split_heads(key, self.w_k)  # (B, h, S, d_k)
        v = self.split_heads(value, self.w_v)  # (B, h, S, d_k)
        if self.store_attention:
            x, self.attn = attention(q, k, v, mask=mask, dropout=self.dropout)
        else:
            p = self.dropout.p if self.training else 0.0
            x = F.scaled_dot_product_attention(q, k, v, mask, dropout_p=p)
        x = x.transpose(1, 2).reshape(query.size(0), -1, self.h * self.d_k)
        return self.w_o(x)  # (B, T, d_model)


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
        pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (L, 1)
        two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d/2,)
        angles = pos / 10000 ** (two_i / d_model)  # (L, d/2)
        waves = torch.stack([angles.sin(), angles.cos()], -1)  # (L, d/2, 2)
        pe = waves.flatten(1)[:, :d_model].float()  # (L, d): sin, cos, ...
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
    encoder, decoder = Encoder(enc_layer, N), Decoder(dec_layer, N)
    model = EncoderDecoder(encoder, decoder, src_embed, tgt_embed, generator)

    for weight in [p for p in model.parameters() if p.dim() > 1]:
        nn.init.xavier_uniform_(weight)
    if tie_embeddings:
        shared = src_embed[0].lut.weight
        tgt_embed[0].lut.weight = generator.proj.weight = shared
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

    def __init__(self, src, tgt=None, pad=2):  # 2: <blank> in Part 3
        self.src = src  # (B, S)
        self.src_mask = (src != pad).unsqueeze(-2)  # (B, 1, S)
        if tgt is None:
            return  # a source-only batch, to decode from
        decoder_input, expected = tgt[:, :-1], tgt[:, 1:]  # (B, T) each
        self.tgt, self.tgt_y = decoder_input, expected
        self.tgt_mask = self.make_std_mask(decoder_input, pad)  # (B, T, T)
        self.ntokens = int(expected.ne(pad).sum())

    @staticmethod
    def make_std_mask(tgt, pad):
        """Hide padding and future positions: (B, T) to (B, T, T)."""
        real = (tgt != pad).unsqueeze(-2)  # (B, 1, T)
        return real & subsequent_mask(tgt.size(-1)).to(tgt.device)

    def to(self, device):
        """Move every tensor of the batch to a device, in place."""
        for name, value in vars(self).items():
            if torch.is_tensor(value):
                setattr(self, name, value.to(device, non_blocking=True))
        return self


COPY_PAD, COPY_START = 0, 1


def data_gen(V, batch_size, nbatches, seq_len=10, generator=None):
    """Yield `nbatches` random copy-task batches over V tokens."""
    for _ in range(nbatches):
        data = torch.randint(2, V, (batch_size, seq_len), generator=generator)
        data[:, 0] = COPY_START
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
        self.keep_targets = keep_targets  # build (N, size) targets, slower
        self.true_dist = None  # the latest smoothed targets, if kept

    def smoothed_targets(self, target, dtype=torch.float32):
        """(N,) target ids to the (N, size) smoothed distribution."""
        fill = self.smoothing / (self.size - 2)  # for every other token
        dist = target.new_full((len(target), self.size), fill, dtype=dtype)
        dist.scatter_(1, target.unsqueeze(1), self.confidence)
        dist[:, self.padding_idx] = 0
        dist[target == self.padding_idx] = 0
        return dist

    def forward(self, x, target):
        """Summed KL loss of (N, size) log-probs against (N,) targets."""
        assert x.size(1) == self.size
        if not self.keep_targets:
            return smoothed_kl(x, target, self.padding_idx, self.smoothing)
        self.true_dist = self.smoothed_targets(target, x.dtype)
        return self.criterion(x, self.true_dist)


def smoothed_kl(x, target, padding_idx, smoothing):
    """LabelSmoothing's loss in closed form: no (N, V) target matrix."""
    c, f = 1.0 - smoothing, smoothing / (x.size(1) - 2)
    picked = x.gather(1, target.unsqueeze(1)).squeeze(1)  # (N,)
    rest = x.sum(1) - picked - x[:, padding_idx]  # (N,)
    plogp = sum(p * math.log(q) for p, q in ((c, c), (smoothing, f)) if p)
    per_row = plogp - c * picked - f * rest  # (N,)
    return per_row.masked_fill(target == padding_idx, 0).sum()


def save_chart(chart, name, folder="figures"):
    """Show a chart, and also write it as static SVG and PNG files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chart.save(str(folder / f"{name}.svg"))
    chart.save(str(folder / f"{name}.png"), scale_factor=1.5)
    return chart


def line_chart(rows, x, y, color=None, title="", point=False):
    """An altair line chart of a list of dicts, one line per `color`."""
    import altair as alt
    import pandas as pd

    lines = {"color": f"{color}:N"} if color else {}
    chart = alt.Chart(pd.DataFrame(rows)).mark_line(point=point)
    chart = chart.encode(x=f"{x}:Q", y=f"{y}:Q", tooltip=[x, y], **lines)
    return chart.properties(title=title, width=480)


def label_smoothing_penalty_rows(margins=range(0, 25), smoothing=0.1):
    """Loss of one prediction against its margin, with and without LS."""
    rows = []
    for eps in (0.0, smoothing):
        crit = LabelSmoothing(6, padding_idx=0, smoothing=eps)
        for m in margins:
            logits = torch.tensor([[-1e4, 0.0, float(m), 0.0, 0.0, 0.0]])
            loss = crit(logits.log_softmax(-1), torch.tensor([2]))
            rows.append(dict(margin=m, loss=float(loss), smoothing=eps))
    return rows


def label_smoothing_penalty_chart(smoothing=0.1):
    """Line chart of label_smoothing_penalty_rows."""
    rows = label_smoothing_penalty_rows(smoothing=smoothing)
    title = "Loss against confidence"
    return line_chart(rows, "margin", "loss", "smoothing", title, point=True)


class SimpleLossCompute:
    """Generator + criterion, normalized by the token count."""

    def __init__(self, generator, criterion):
        self.generator = generator
        self.criterion = criterion

    def __call__(self, x, y, norm):
        """Return (summed loss as float, mean loss per token as tensor)."""
        logp = self.generator(x)  # (B, T, vocab)
        flat = logp.reshape(-1, logp.size(-1))  # (B * T, vocab)
        sloss = self.criterion(flat, y.reshape(-1)) / norm
        return sloss.item() * norm, sloss


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


def micro_step(model, batch, loss_compute, accum_iter, hold_sync, autocast):
    """One micro-batch's loss, and its gradient when autograd is on."""
    hold = hold_sync and hasattr(model, "no_sync")
    with model.no_sync() if hold else nullcontext():  # DDP: no all-reduce
        with autocast():
            out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
            loss, loss_node = loss_compute(out, batch.tgt_y, batch.ntokens)
        if torch.is_grad_enabled():
            (loss_node / accum_iter).backward()
    return loss, loss_node


def print_progress(i, state, loss_node, speed, optimizer):
    """One log line of run_epoch's "train+log" mode."""
    lr = optimizer.param_groups[0]["lr"]
    print(
        f"step {i:5d} | accum step {state.accum_step:5d} | loss "
        f"{loss_node.item():6.3f} | {speed:7.1f} tok/s | lr {lr:6.1e}"
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
):
    """One pass over data_iter; returns (loss per token, train_state)."""
    train = mode.startswith("train")
    state = TrainState() if train_state is None else train_state
    total_loss, total_tokens, window = 0.0, 0, 0
    start, tokens_before = time.time(), state.tokens
    with torch.set_grad_enabled(train):
        for i, (batch, is_last) in enumerate(with_last_flag(data_iter)):
            steps_now = train and (window + 1 == accum_iter or is_last)
            hold = train and not steps_now  # accumulate without syncing
            loss, loss_node = micro_step(
                model, batch, loss_compute, accum_iter, hold, autocast
            )
            total_loss += loss
            total_tokens += batch.ntokens
            if not train:
                continue
            state.count(batch)
            window += 1
            if steps_now:
                scale = accum_iter / window  # 1 unless the window is short
                optimizer_step(optimizer, scheduler, model.parameters(), scale)
                state.accum_step, window = state.accum_step + 1, 0
            if mode == "train+log" and i % log_every == 1:
                speed = (state.tokens - tokens_before) / (time.time() - start)
                print_progress(i, state, loss_node, speed, optimizer)
    return total_loss / max(total_tokens, 1), state


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
    """Adam and a LambdaLR running `rate`, or `schedule` when given."""
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
    rows = []
    for d, f, w in settings:
        name = f"d_model={d}, warmup={w}"
        for s in range(1, steps + 1, 20):
            rows.append(dict(step=s, lr=rate(s, d, f, w), setting=name))
    title = "Learning-rate schedule"
    return line_chart(rows, "step", "lr", "setting", title)


# -----------------------------------------------------------------------------
# A first example: the copy task
# Explained in notebooks/02_training.py, same heading.
# -----------------------------------------------------------------------------
def greedy_decode(model, src, src_mask, max_len, start_symbol):
    """Most-probable-token decoding: (B, S) source to (B, max_len) ids."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    ys = src.new_full((src.size(0), 1), start_symbol)  # (B, 1)
    for _ in range(max_len - 1):
        mask = subsequent_mask(ys.size(1)).to(src.device)  # (1, t, t)
        out = model.decode(memory, src_mask, ys, mask)  # (B, t, d_model)
        next_word = model.generator(out[:, -1]).argmax(dim=-1)  # (B,)
        ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)
    return ys


def copy_accuracy(model, n, V=11, seq_len=10, generator=None):
    """Fraction of n fresh random sequences greedy decoding copies exactly."""
    model.eval()
    b = next(data_gen(V, n, 1, seq_len, generator=generator))
    with torch.no_grad():
        out = greedy_decode(model, b.src, b.src_mask, seq_len, COPY_START)
    return (out == b.src).all(dim=1).float().mean().item()


def copy_accuracy_teacher_forced(model, n, V=11, seq_len=10, generator=None):
    """The same fraction from one teacher-forced forward pass."""
    model.eval()
    b = next(data_gen(V, n, 1, seq_len, generator=generator))
    with torch.no_grad():
        out = model(b.src, b.tgt, b.src_mask, b.tgt_mask)  # (n, T, d_model)
        pred = model.generator(out).argmax(dim=-1)  # (n, T)
    return (pred == b.tgt_y).all(dim=1).float().mean().item()


class CopyLossCompute(SimpleLossCompute):
    """SimpleLossCompute that also counts exactly predicted sequences."""

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


def greedy_check(model, loss_compute, check_size, V, generator):
    """Greedy-copy check once the streak is long enough, else None."""
    if loss_compute.streak < check_size:
        return None
    checked = copy_accuracy(model, check_size, V, generator=generator)
    if checked < 1.0:
        loss_compute.streak = 0  # earn another streak first
    return checked


def warmup_linear_decay(step, peak, warmup, total, floor=0.02):
    """Linear warm-up to `peak`, then linear decay to `floor * peak`."""
    ramp = (step + 1) / warmup
    decay = max(floor, 1 - step / total)
    return peak * min(ramp, decay)


@dataclass
class CopyTaskConfig:
    """Hyperparameters of the copy task; `for_size` picks a preset."""

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

    @classmethod
    def for_size(cls, size="full", **changes):
        """The "full" preset, or the seconds-long "ci" one, with changes."""
        if size not in ("full", "ci"):
            raise ValueError(f'size is "full" or "ci", not {size!r}')
        small = dict(N=1, d_model=64, d_ff=256, h=4, lr=3e-3, bf16=False)
        return cls(**{**(small if size == "ci" else {}), **changes})


def native_bf16(device_type="cpu"):
    """True where bfloat16 matmuls run natively on this device type."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:  # CPUs with AVX512-BF16 or AMX
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def copy_task_setup(cfg):
    """(model, loss_compute, optimizer, scheduler, autocast) for a run."""
    torch.manual_seed(cfg.seed)
    sizes = dict(N=cfg.N, d_model=cfg.d_model, d_ff=cfg.d_ff, h=cfg.h)
    model = make_model(cfg.V, cfg.V, dropout=cfg.dropout, **sizes)
    criterion = LabelSmoothing(cfg.V, padding_idx=COPY_PAD, smoothing=0.0)
    loss_compute = CopyLossCompute(model.generator, criterion)
    schedule = lambda step: warmup_linear_decay(
        step, cfg.lr, cfg.warmup, cfg.decay_steps
    )
    optimizer, scheduler = make_optimizer(
        model, cfg.d_model, betas=(0.9, cfg.beta2), schedule=schedule
    )
    use_bf16 = cfg.bf16 and native_bf16("cpu")
    autocast = lambda: torch.autocast("cpu", torch.bfloat16, enabled=use_bf16)
    return model, loss_compute, optimizer, scheduler, autocast


def epoch_summary(r):
    """One log line for an epoch record of train_copy_task."""
    check = r["exact_copy"]
    greedy = "" if check is None else f" | greedy check {check:6.1%}"
    return (
        f"epoch {r['epoch']:2d} | step {r['steps']:4d} | loss "
        f"{r['train_loss']:.4f} | exact while training "
        f"{r['train_exact']:6.1%}{greedy} | {r['seconds']:5.1f} s"
    )


def train_copy_task(cfg=None, log=print):
    """Train until exact copy; returns (model, list of epoch records)."""
    cfg = cfg or CopyTaskConfig()
    model, loss_compute, optimizer, scheduler, autocast = copy_task_setup(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    state, history, start = TrainState(), [], time.time()
    for epoch in range(cfg.max_epochs):
        model.train()
        seen, exact = loss_compute.sequences, loss_compute.exact
        data = data_gen(cfg.V, cfg.batch_size, cfg.nbatches, generator=gen)
        args = (data, model, loss_compute, optimizer, scheduler)
        loss, state = run_epoch(*args, train_state=state, autocast=autocast)
        new = loss_compute.sequences - seen
        train_exact = (loss_compute.exact - exact) / new
        checked = greedy_check(model, loss_compute, cfg.check_size, cfg.V, gen)
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
        log(epoch_summary(history[-1]))
        if checked == 1.0:
            break
    return model, history


def copy_progress_chart(history):
    """Line chart: share of training sequences copied exactly, by step."""
    title = "Learning to copy"
    return line_chart(history, "steps", "train_exact", None, title, True)


# =============================================================================
# Part 3: A real task, Multi30k German → English
# notebooks/03_multi30k.py
# =============================================================================


# -----------------------------------------------------------------------------
# The data
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
MULTI30K_ENV = "MULTI30K_DIR"
MULTI30K_SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}


class DatasetError(RuntimeError):
    """Multi30k could not be found, downloaded or verified."""


def data_dir():
    """`data/` in the repository root, or in the working directory."""
    for folder in (Path.cwd(), *Path.cwd().parents):
        if (folder / "the_annotated_transformer.py").exists():
            return folder / "data"
    return Path.cwd() / "data"


def read_multi30k(split, root=None):
    """The (German, English) sentence pairs of "train", "val" or "test"."""
    folder = root or os.environ.get(MULTI30K_ENV) or data_dir() / "multi30k"
    sides = []
    for lang in ("de", "en"):
        path = Path(folder, f"{MULTI30K_SPLITS[split]}.{lang}.gz")
        if not path.is_file():
            hint = "run `python the_annotated_transformer.py download`"
            raise DatasetError(f"no {path}: {hint} or set {MULTI30K_ENV}")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            sides.append([line.strip() for line in f])  # some end in " "
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
class _TokenTable:
    """Token ↔ id maps over a list of distinct tokens."""

    def __init__(self, itos):
        self._itos = list(itos)
        self._stoi = {token: i for i, token in enumerate(self._itos)}
        if len(self._stoi) != len(self._itos):
            raise ValueError("a vocabulary cannot repeat a token")

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


SPECIALS = ("<s>", "</s>", "<blank>", "<unk>")
BOS, EOS, PAD, UNK = 0, 1, 2, 3


class Vocab(_TokenTable):
    """Token ↔ id maps; the specials come first and unknowns map to UNK."""

    def __init__(self, itos):
        super().__init__(itos)
        if tuple(self._itos[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary must start with {SPECIALS}")

    @classmethod
    def build(cls, sentences, min_freq=2):
        """Vocabulary of tokens seen at least `min_freq` times."""
        counts = Counter(token for tokens in sentences for token in tokens)
        kept = {t for t, n in counts.items() if n >= min_freq} - {*SPECIALS}
        return cls([*SPECIALS, *sorted(kept, key=lambda t: (-counts[t], t))])

    def __eq__(self, other):
        return isinstance(other, Vocab) and self._itos == other._itos

    __hash__ = None

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
    de = (tokenize(de, spacy_de) for de, _ in train)
    en = (tokenize(en, spacy_en) for _, en in train)
    return Vocab.build(de, min_freq), Vocab.build(en, min_freq)


# -----------------------------------------------------------------------------
# From text to batches
# Explained in notebooks/03_multi30k.py, same heading.
# -----------------------------------------------------------------------------
def encode_text(text, tokenizer, vocab):
    """Ids of one sentence, without `<s>` and `</s>`."""
    if hasattr(vocab, "encode"):  # a vocabulary that reads text (Part 5)
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
    sides = [[torch.tensor(ids) for ids in side] for side in zip(*batch)]
    return tuple(pad(s, True, pad_id) for s in sides)  # (B, S), (B, T)


def bucket(order, sizes, max_tokens):
    """Cut indices, sorted by size, into batches within a token budget."""
    batches, batch = [], []
    for i in order:  # sizes ascend, so sizes[i] is the batch's width
        if batch and (len(batch) + 1) * sizes[i] > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    return batches + [batch] if batch else batches


def split_evenly(batches, n):
    """Halve the largest batches until their number divides by n."""
    while len(batches) % n:
        k = max(range(len(batches)), key=lambda b: len(batches[b]))
        if len(batches[k]) < 2:
            raise ValueError("too few examples to give every rank a batch")
        half = len(batches[k]) // 2
        batches[k : k + 1] = [batches[k][:half], batches[k][half:]]
    return batches


class TokenBatchSampler(torch.utils.data.Sampler):
    """Length-bucketed batches within a token budget, split across ranks."""

    def __init__(
        self, lengths, max_tokens, max_len=None, num_replicas=1, rank=0,
        shuffle=True, seed=0,
    ):  # fmt: skip
        self.max_len = max_len = max_len or max_tokens
        if max_len > max_tokens:
            raise ValueError("max_len must not exceed max_tokens")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        self.sizes = [max(s, t) for s, t in lengths]  # padded width per pair
        self.kept = [i for i, n in enumerate(self.sizes) if n <= max_len]
        self.dropped = [i for i, n in enumerate(self.sizes) if n > max_len]
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self.num_replicas, self.rank, self.epoch = num_replicas, rank, 0

    def set_epoch(self, epoch):
        """Reshuffle for `epoch` (the same on every rank)."""
        self.epoch = epoch

    def all_batches(self):
        """The batches of every rank for the current epoch."""
        rng, kept = random.Random(f"{self.seed}/{self.epoch}"), self.kept
        order = rng.sample(kept, len(kept)) if self.shuffle else kept
        order = sorted(order, key=self.sizes.__getitem__)  # stable sort
        batches = bucket(order, self.sizes, self.max_tokens)
        batches = split_evenly(batches, self.num_replicas)
        return rng.sample(batches, len(batches)) if self.shuffle else batches

    def __iter__(self):
        yield from self.all_batches()[self.rank :: self.num_replicas]

    def __len__(self):
        return len(self.all_batches()) // self.num_replicas


def create_dataloaders(
    vocab_src, vocab_tgt, spacy_de, spacy_en, max_tokens=4000, max_len=128,
    rank=0, world_size=1, seed=0, num_workers=0, max_train_pairs=0,
):  # fmt: skip
    """Train and validation DataLoaders of padded (src, tgt) CPU tensors."""
    loaders = []
    for split, n in ("train", max_train_pairs), ("val", max_train_pairs // 4):
        pairs = read_multi30k(split)[: n or None]
        data = encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en)
        lengths, train = [(len(s), len(t)) for s, t in data], split == "train"
        limit = max_len if train else None
        options = (limit, world_size, rank, train, seed)
        sampler = TokenBatchSampler(lengths, max_tokens, *options)
        if sampler.dropped:
            n = f"{len(sampler.dropped)} pairs longer than {sampler.max_len}"
            warnings.warn(f"{split}: left out {n} tokens", stacklevel=2)
        options = {"batch_sampler": sampler, "collate_fn": collate_batch}
        options |= {"num_workers": num_workers}
        loaders.append(torch.utils.data.DataLoader(data, **options))
    return tuple(loaders)


# -----------------------------------------------------------------------------
# Training
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
    epochs: int = 20
    factor: float = 1.0
    warmup: int = 800
    max_len: int = 128
    max_train_pairs: int = 0  # 0 means all 29,000
    seed: int = 0
    precision: str = "bf16"  # "bf16": autocast where native; or "fp32"
    checkpoint_dir: str = "checkpoints/cpu"
    num_workers: int = 0
    tokenization: str = "word"  # or "bpe": one subword vocabulary (Part 5)
    tie_embeddings: bool = False  # share embeddings and generator (Part 5)
    keep_last: int = 5  # epoch files kept, for averaging (0: all)


def model_from_config(c, n_src, n_tgt, dropout=None):
    """The model a TrainConfig describes, for the given vocabulary sizes."""
    dims = {"N": c.N, "d_model": c.d_model, "d_ff": c.d_ff, "h": c.h}
    dims |= {"dropout": c.dropout if dropout is None else dropout}
    return make_model(n_src, n_tgt, **dims, tie_embeddings=c.tie_embeddings)


class TrainingRun:
    """One process's model, loss, optimizer, schedule and history."""

    def __init__(self, rank, world_size, sizes, c, distributed, port=None):
        if distributed:  # env:// under torchrun, else a port on this machine
            url = None if port is None else f"tcp://127.0.0.1:{port}"
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist = {"rank": rank, "world_size": world_size}
            torch.distributed.init_process_group(backend, url, **dist)
        self.config, self.rank, self.device = c, rank, torch.device("cpu")
        if torch.cuda.is_available():
            gpu = rank % torch.cuda.device_count()
            self.device = torch.device("cuda", gpu)
        elif world_size > 1:  # processes share the CPU cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        torch.manual_seed(c.seed)
        self.model = self.module = model_from_config(c, *sizes).to(self.device)
        if distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            DDP = torch.nn.parallel.DistributedDataParallel
            self.model = DDP(self.module, device_ids=ids)
        self.criterion = LabelSmoothing(sizes[1], PAD, c.label_smoothing)
        schedule = (c.d_model, c.factor, c.warmup)
        self.optimizer, self.scheduler = make_optimizer(self.module, *schedule)
        self.state, self.history = TrainState(), []


def params_in_sync(module):
    """True when every process holds exactly the same parameters."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def train_epoch(run, epoch, train_loader, valid_loader, show=True):
    """Train for one epoch, then validate; returns the history entry."""
    loss = SimpleLossCompute(run.module.generator, run.criterion)
    bf16 = run.config.precision == "bf16" and native_bf16(run.device.type)
    amp = lambda: torch.autocast(run.device.type, torch.bfloat16, enabled=bf16)
    train_loader.batch_sampler.set_epoch(epoch)
    if show and run.rank == 0:  # a bar, once an epoch takes over 3 s
        from tqdm.auto import tqdm  # here: the module needs only torch

        train_loader = tqdm(train_loader, f"epoch {epoch}", delay=3)
    batches = (Batch(s, t, PAD).to(run.device) for s, t in train_loader)
    step = {"optimizer": run.optimizer, "scheduler": run.scheduler}
    step |= {"accum_iter": run.config.accum_iter, "train_state": run.state}
    run.model.train()
    train_loss, run.state = run_epoch(
        batches, run.model, loss, **step, autocast=amp
    )
    run.model.eval()
    val = (Batch(s, t, PAD).to(run.device) for s, t in valid_loader)
    val_loss, _ = run_epoch(val, run.model, loss, mode="eval", autocast=amp)
    entry = {"epoch": epoch, "train_loss": train_loss, "val_loss": val_loss}
    run.history.append(entry | {"steps": run.state.accum_step})
    if show and run.rank == 0:
        gpu = run.device.type == "cuda"
        gib = torch.cuda.max_memory_allocated(run.device) / 2**30 if gpu else 0
        report = f"epoch {epoch}: train {train_loss:.3f}, val {val_loss:.3f}"
        print(report + f" (GPU memory {gib:.1f} GiB)" * gpu)
    return run.history[-1]


def train_worker(
    rank, world_size, vocab_src, vocab_tgt, spacy_de, spacy_en, config,
    is_distributed=False, port=None, resume=False, show_progress=True,
):  # fmt: skip
    """Train on Multi30k in one process; returns the history of losses."""
    sizes = (len(vocab_src), len(vocab_tgt))
    run = TrainingRun(rank, world_size, sizes, config, is_distributed, port)
    names = ("max_tokens", "max_len", "seed", "num_workers", "max_train_pairs")
    options = {name: getattr(config, name) for name in names}
    options |= {"rank": rank, "world_size": world_size}
    loaders = create_dataloaders(
        vocab_src, vocab_tgt, spacy_de, spacy_en, **options
    )
    for epoch in range(resume_run(run) if resume else 0, config.epochs):
        train_epoch(run, epoch, *loaders, show=show_progress)
        if rank == 0:
            save_epoch(run, epoch, vocab_src, vocab_tgt)
    in_sync = params_in_sync(run.module) if is_distributed else True
    if rank == 0:
        last = {"epoch": config.epochs - 1, "ranks_in_sync": in_sync}
        save_run(run, "final.pt", vocab_src, vocab_tgt, **last)
    if is_distributed:
        torch.distributed.destroy_process_group()
    return run.history


def load_trained_model(path, device="cpu"):
    """(model in eval mode, vocab_src, vocab_tgt, config) from a checkpoint."""
    ckpt = load_checkpoint(path, device)
    config = checkpoint_config(ckpt, path)
    vocab_src, vocab_tgt = checkpoint_vocabularies(ckpt, path)
    sizes = (len(vocab_src), len(vocab_tgt))
    model = model_from_config(config, *sizes, dropout=0.0)
    load_weights(model, ckpt, path)
    return model.to(device).eval(), vocab_src, vocab_tgt, config


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
    ys = torch.full_like(src[:, :1], start_symbol)  # (B, 1)
    done = torch.zeros_like(ys[:, 0], dtype=torch.bool)  # (B,)
    for _ in range(max_len - 1):
        tgt_mask = subsequent_mask(ys.size(1)).to(src.device)  # (1, t, t)
        out = model.decode(memory, src_mask, ys, tgt_mask)  # (B, t, d_model)
        next_word = model.generator(out[:, -1]).argmax(dim=-1)  # (B,)
        next_word = next_word.masked_fill(done, PAD)
        ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)  # (B, t + 1)
        done |= next_word == end_symbol
        if done.all():
            break
    return ys  # (B, <= max_len)


def strip_specials(ids, end_symbol=EOS):
    """Token ids after <s> and before the first </s>."""
    ids = list(ids)[1:]
    return ids[: ids.index(end_symbol)] if end_symbol in ids else ids


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
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"kind must be one of {list(ATTENTION_KINDS)}")
        src = (self.src_tokens, self.src_ids != self.pad, self.src_ids)
        tgt = (self.tgt_tokens, self.tgt_ids != self.pad, self.tgt_ids)
        (rows, row_keep, _), (cols, col_keep, col_ids) = {
            "encoder self": (src, src),
            "decoder self": (tgt, tgt),
            "decoder source": (tgt, src),
        }[kind]  # (queries, keys), each (labels, keep, ids)
        allowed = col_keep.expand(len(row_keep), len(col_keep))  # (R, C)
        if kind == "decoder self":
            allowed = allowed & subsequent_mask(len(col_keep))[0]
        weights = getattr(self, ATTENTION_KINDS[kind])  # (N, h, R, C)
        return AttentionView(
            weights, allowed, rows, cols, row_keep, col_keep, col_ids
        )


def _recorded_weights(model, src, src_mask, tgt_in, pad):
    """One forward pass; each kind's weights stacked to (N, h, R, C)."""
    tgt_mask = Batch.make_std_mask(tgt_in, pad)  # (1, T, T)
    with record_attention(model):
        model(src, tgt_in, src_mask, tgt_mask)
        enc = [layer.self_attn.attn[0] for layer in model.encoder.layers]
        dec = [layer.self_attn.attn[0] for layer in model.decoder.layers]
        crs = [layer.src_attn.attn[0] for layer in model.decoder.layers]
    return [torch.stack(w).float().cpu() for w in (enc, dec, crs)]


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
        weights = _recorded_weights(core, src, src_mask, tgt[:, :-1], pad)
    finally:
        core.train(training)
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
# Drawing the maps
# Explained in notebooks/04_attention.py, same heading.
# -----------------------------------------------------------------------------
def attention_frame(maps, kind):
    """One kind of attention as a long pandas table, padding left out."""
    import pandas as pd

    v = maps.view(kind)
    rows = v.row_keep.nonzero()[:, 0]  # (R',) positions of real tokens
    cols = v.col_keep.nonzero()[:, 0]  # (C',)
    w = v.weights[:, :, rows][:, :, :, cols]  # (N, h, R', C')
    grid = torch.meshgrid(*(torch.arange(s) for s in w.shape), indexing="ij")
    n, a, i, j = (g.flatten() for g in grid)
    columns = {"layer": n + 1, "head": a + 1, "row": rows[i], "col": cols[j]}
    frame = pd.DataFrame({k: c.numpy() for k, c in columns.items()})
    frame["weight"] = w.flatten().double().numpy()
    frame["query"] = [v.rows[r] for r in frame["row"]]
    frame["key"] = [v.cols[c] for c in frame["col"]]
    if kind != "encoder self":
        frame["next"] = [maps.next_tokens[r] for r in frame["row"]]
    return frame


def _layer_picker(kind, N, layer=None):
    """A drop-down menu that selects one of the N layers (default: last)."""
    import altair as alt

    return alt.param(
        name="pick_layer",
        value=N if layer is None else layer,
        bind=alt.binding_select(
            options=list(range(1, N + 1)), name=f"{kind} attention, layer "
        ),
    )


def _token_axis(labels, title, angle=0):
    """An axis over positions that shows the token at each position."""
    import altair as alt

    return alt.Axis(
        title=title,
        labelAngle=angle,
        labelExpr=f"{json.dumps(labels)}[datum.value]",
    )


def _token_lookups(maps, v, frame):
    """Vega expressions that turn a cell's row or column into its token."""
    fields = {"query": (v.rows, "row"), "key": (v.cols, "col")}
    if "next" in frame:
        fields["next"] = (maps.next_tokens, "row")
    return {
        f: f"{json.dumps(labels)}[datum.{index}]"
        for f, (labels, index) in fields.items()
    }


def _heat_map(frame, v, lookups, pick, cell):
    """One head's weights as coloured squares, filtered to the picked layer."""
    import altair as alt

    numbers = frame[["layer", "head", "row", "col", "weight"]]
    tooltip = [alt.Tooltip(f"{f}:N") for f in lookups]  # tokens
    tooltip += [alt.Tooltip("weight:Q", format=".3f"), "layer:O", "head:O"]
    scale = alt.Scale(
        domainMin=0, range=["#ffffff", "#08306b"], interpolate="lab"
    )
    return (
        alt.Chart(alt.Data(values=numbers.to_dict("records")))
        .transform_filter(alt.datum.layer == pick)
        .transform_calculate(**lookups)
        .mark_rect()
        .encode(
            x=alt.X("col:O", axis=_token_axis(v.cols, "key", -60)),
            y=alt.Y("row:O", axis=_token_axis(v.rows, "query")),
            color=alt.Color("weight:Q", scale=scale),
            tooltip=tooltip,
        )
        .properties(
            width=cell * frame["col"].nunique(),
            height=cell * frame["row"].nunique(),
        )
    )


def attention_chart(maps, kind, layer=None, columns=4, cell=18):
    """Heat maps of one kind, one per head, with a menu to pick the layer."""
    import altair as alt

    frame = attention_frame(maps, kind).round({"weight": 5})
    v = maps.view(kind)
    N, h = v.weights.shape[:2]
    pick = _layer_picker(kind, N, layer)
    heat = _heat_map(frame, v, _token_lookups(maps, v, frame), pick, cell)
    title = f"'{kind} attention, layer ' + pick_layer + ' of {N} ({h} heads)'"
    return heat.add_params(pick).facet(
        facet=alt.Facet(
            "head:O",
            header=alt.Header(labelExpr="'head ' + datum.value", title=None),
        ),
        columns=min(columns, h),
        title=alt.TitleParams(alt.expr(title)),  # follows the layer menu
    )


# -----------------------------------------------------------------------------
# What the heads do, measured
# Explained in notebooks/04_attention.py, same heading.
# -----------------------------------------------------------------------------
def _mean(x, keep):
    """Mean of (N, h, R) over the rows where keep (R,) is True; 0 if none."""
    return x[..., keep].mean(-1) if keep.any() else x.sum(-1) * 0


def _diagonal(v, kind):
    """Query and key positions (R, 1) and (1, C); the diagonal is j == i."""
    R, C = v.allowed.shape
    i = torch.arange(R, dtype=torch.float64)[:, None]  # (R, 1)
    j = torch.arange(C, dtype=torch.float64)[None, :]  # (1, C)
    if kind == "decoder source":  # proportional: j = i (S-1) / (T-1)
        rows, cols = int(v.row_keep.sum()), int(v.col_keep.sum())
        i = i * (cols - 1) / max(rows - 1, 1)
    return i, j


def _head_statistics(v, kind, specials):
    """Each statistic of one kind as an (N, h) tensor, over real rows."""
    w = v.weights.double()  # (N, h, R, C)
    i, j = _diagonal(v, kind)
    offset = j - i.round()  # (R, C)
    n = v.allowed.sum(-1)  # (R,) keys each query may see
    H = -torch.special.xlogy(w, w).sum(-1)  # (N, h, R)
    special = torch.isin(v.col_ids, torch.tensor(specials))  # (C,)
    sums = {
        "distance": (w * (j - i).abs()).sum(-1),  # each (N, h, R)
        "previous": (w * (offset == -1)).sum(-1),
        "same": (w * (offset == 0)).sum(-1),
        "next": (w * (offset == 1)).sum(-1),
        "specials": w[..., special].sum(-1),
    }
    entropy = _mean(H / n.clamp(min=2).log(), v.row_keep & (n > 1))
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


def _metric_chart(frame, metric, title, width):
    """Dots per head and a line through their mean, by layer and kind."""
    import altair as alt

    base = alt.Chart(frame).encode(
        x=alt.X("layer:O", title="layer", axis=alt.Axis(labelAngle=0))
    )
    tooltip = [
        "kind",
        "layer",
        "head",
        alt.Tooltip(f"{metric}:Q", format=".3f"),
    ]
    dots = base.mark_circle(size=60, opacity=0.8).encode(
        xOffset="head:N",
        y=alt.Y(f"{metric}:Q", title=title),
        color=alt.Color("head:N", title="head"),
        tooltip=tooltip,
    )
    mean = base.mark_line(color="#444").encode(y=f"mean({metric}):Q")
    kinds = alt.Column("kind:N", sort=list(ATTENTION_KINDS), title=None)
    return (
        alt.layer(dots, mean, data=frame)
        .properties(width=width, height=150)
        .facet(column=kinds)
    )


def attention_summary_chart(summary, width=170):
    """Entropy and diagonal distance per layer and head, for each kind."""
    import altair as alt
    import pandas as pd

    frame = pd.DataFrame(summary)
    return alt.vconcat(
        _metric_chart(
            frame, "entropy", "entropy (fraction of uniform)", width
        ),
        _metric_chart(
            frame, "distance", "distance from diagonal (tokens)", width
        ),
    ).properties(
        title="Attention heads by layer, averaged over validation sentences"
    )


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

    def __init__(self, model, memory, src_mask, group=1):
        self.group = group  # rows (hypotheses) per sentence
        self.src_mask = src_mask.unsqueeze(1)  # (B, 1, 1, S)
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
    q = attn.split_heads(x.reshape(B, -1, x.size(-1)), attn.w_q)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
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
        tokens = torch.full((B, k, max_len), PAD, dtype=torch.long)
        tokens = tokens.to(device)
        tokens[:, :, 0] = start_symbol  # (B, k, max_len)
        logp_sum = torch.full((B, k), -math.inf, device=device)
        logp_sum[:, 0] = 0.0
        lengths = torch.zeros(B, k, dtype=torch.long, device=device)
        sent = torch.arange(B, device=device)
        return cls(sent, tokens, logp_sum, lengths, lengths.bool())


def advance_beams(beams, logp, t, alpha, end_symbol):
    """Extend every hypothesis by one token and keep the k best."""
    k = beams.logp_sum.size(1)
    score, cand, words, cand_len = beam_candidates(
        logp, beams.logp_sum, beams.lengths, beams.finished, alpha
    )  # (A, k * c), c candidates per hypothesis
    score, idx = score.topk(k, dim=1)  # (A, k)
    parent, word = idx // (words.size(1) // k), words.gather(1, idx)
    was_finished = beams.finished.gather(1, parent)
    finished = was_finished | (word == end_symbol)
    tokens = beams.tokens.gather(
        1, parent.unsqueeze(-1).expand_as(beams.tokens)
    )  # (A, k, max_len): the parents' tokens
    tokens[:, :, t] = word
    lengths = cand_len.gather(1, parent)
    new = Beams(beams.sent, tokens, cand.gather(1, idx), lengths, finished)
    ended = torch.where(finished & ~was_finished, score, -math.inf)
    return new, parent, ended  # ended: (A, k) scores, -inf if not new


def keep_best(out, best, beams, score):
    """Where a hypothesis (score (A, k)) beats its sentence's best, keep it."""
    top, j = score.max(dim=1)  # (A,)
    better = top > best[beams.sent]
    best[beams.sent[better]] = top[better]
    out[beams.sent[better]] = beams.tokens[better, j[better]]


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
    beams = Beams.start(B, k, max_len, start_symbol, device)
    t = 0
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
        rows = torch.arange(A, device=device).unsqueeze(1) * k + parent
        select(rows[keep].view(-1))  # (A' * k,) parents of the survivors
        beams = Beams(*(x[keep] for x in beams))
    running = beams.logp_sum / length_penalty(beams.lengths, alpha)
    keep_best(out, best, beams, running.masked_fill(beams.finished, -math.inf))
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
    step = lambda ys: decode_step(model, ys, cache)  # (B*k, 1) -> (B*k, V)
    args = (beam_size, alpha, start_symbol, end_symbol, src.device)
    return beam_search_steps(step, cache.select, src.size(0), max_len, *args)


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
        raise ValueError("no checkpoints to average")
    model, vocab_src, vocab_tgt, config = load_trained_model(paths[0], device)
    params, buffers = dict(model.named_parameters()), model.named_buffers()
    buffers = dict(buffers)  # e.g. the positional encoding's `pe`
    sums = {
        n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()
    }
    for path in paths:
        state = load_checkpoint(path, device)["model"]
        shapes = {n: state[n].shape for n in sums if n in state}
        if shapes != {n: s.shape for n, s in sums.items()}:
            raise ValueError(f"{path} is not the same model as {paths[0]}")
        for name in sums:
            sums[name] += state[name].double()
        for name, b in buffers.items():
            if not torch.equal(state[name], b):
                raise ValueError(f"{path}: buffer {name} differs")
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
            raise ValueError(
                f"--average {average} needs {average} epoch checkpoints "
                f"next to {checkpoint}; found {len(paths)} (training keeps "
                "the newest --keep-last)"
            )
        model, vocab_src, vocab_tgt, _ = average_checkpoints(paths, device)
    else:
        model, vocab_src, vocab_tgt, _ = load_trained_model(checkpoint, device)
    decode_fn = cached_greedy_decode
    if beam > 1:
        decode_fn = functools.partial(beam_search, beam_size=beam)
    return model, vocab_src, vocab_tgt, decode_fn


# =============================================================================
# Appendix: the machinery
# notebooks/06_tools.py
# =============================================================================


# -----------------------------------------------------------------------------
# Files written whole
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
def process_alive(pid):
    """True if a process with this id runs on this machine."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # someone else's, or no pid
        return True
    return True


def clean_partial_files(folder):
    """Remove the `.part` files that dead processes left in `folder`."""
    for part in Path(folder).glob(".*.part"):
        pid = part.name.split(".")[-2]  # .NAME.PID.part
        if pid.isdigit() and int(pid) != os.getpid():
            if not process_alive(int(pid)):
                part.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """A file to write that replaces `path` only once it is complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_partial_files(path.parent)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    encoding = None if "b" in mode else "utf-8"
    try:
        with open(part, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # on the disk before it gets the name
        os.replace(part, path)
    except OSError as err:  # name the file, e.g. on a full disk
        if err.filename is not None or err.errno is None:  # not a write's
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err
    finally:
        part.unlink(missing_ok=True)  # gone already, unless it failed


# -----------------------------------------------------------------------------
# Downloading Multi30k
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
MULTI30K_BASE_URL = (
    "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
)
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


def sha256_of(path):
    """Hex SHA-256 digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stream(response, out, name):
    """Copy a download into `out` with a progress bar; its SHA-256."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    size = int(response.headers.get("Content-Length") or 0) or None
    with tqdm(total=size, unit="B", unit_scale=True, desc=name) as bar:
        while chunk := response.read(1 << 16):
            out.write(chunk)
            digest.update(chunk)
            bar.update(len(chunk))
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
    try:
        with (
            atomic_write(path) as out,
            urllib.request.urlopen(url, timeout=timeout) as response,
        ):
            digest = _stream(response, out, path.name)
            if digest != expected:  # raised inside: the file is not kept
                raise DatasetError(
                    f"{url} has SHA-256 {digest}, expected "
                    f"{expected}; the file was not kept.\n"
                    + _offline_hint(path.parent)
                )
    except (OSError, http.client.HTTPException) as error:
        url_error = type(error) is urllib.error.URLError
        reason = error.reason if url_error else error
        raise DatasetError(
            f"Could not download {url} ({reason}).\n"
            + _offline_hint(path.parent)
        ) from error


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
        given = os.environ[MULTI30K_ENV]
        folder = Path(given).absolute()  # relative: to the working directory
        if not folder.is_dir():
            raise DatasetError(f"{MULTI30K_ENV}={given}: no folder {folder}")
        return _check_folder(folder, sums)
    folder = Path(root) if root is not None else data_dir() / "multi30k"
    for name, expected in sums.items():
        path = folder / name
        if path.is_file() and sha256_of(path) == expected:
            continue
        damaged = path.is_file()  # in the cache, but not the right bytes
        try:
            _fetch(base_url.rstrip("/") + "/" + name, path, expected, timeout)
        except DatasetError as error:
            if not damaged:
                raise
            raise DatasetError(
                f"{path} in the data cache is damaged (wrong SHA-256), and "
                f"a fresh copy could not be fetched: {error}"
            ) from error
    return folder


# -----------------------------------------------------------------------------
# Presets
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
PRESETS = {
    "paper": TrainConfig(
        preset="paper",
        N=6,
        d_model=512,
        d_ff=2048,
        h=8,
        max_tokens=8000,
        epochs=40,
        checkpoint_dir="checkpoints/paper",
    ),
    "cpu": TrainConfig(),
    "ci": TrainConfig(
        preset="ci",
        N=1,
        d_model=64,
        d_ff=128,
        h=2,
        dropout=0.0,
        max_tokens=1500,
        epochs=2,
        warmup=20,
        factor=2.0,
        max_train_pairs=1000,
        precision="fp32",
        checkpoint_dir="checkpoints/ci",
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
    for name in ("cpu", "ci")
}


def get_config(preset="cpu", **overrides):
    """A preset's TrainConfig with some fields replaced."""
    if preset not in PRESETS:
        raise ValueError(
            f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}"
        )
    return replace(PRESETS[preset], **overrides)


# -----------------------------------------------------------------------------
# Vocabularies
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
def load_vocab(spacy_de, spacy_en, path=None, min_freq=2):
    """The word vocabularies, cached as JSON in `path` (data/vocab.json)."""
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
    with atomic_write(path, "w") as f:  # ranks never read half a file
        f.write(json.dumps(saved, ensure_ascii=False))
    return vocab_src, vocab_tgt


def load_vocabularies(config, spacy_de, spacy_en):
    """(vocab_src, vocab_tgt) for a config: words, or one BPE for both."""
    if config.tokenization == "bpe":
        bpe = load_bpe()
        return bpe, bpe
    return load_vocab(spacy_de, spacy_en)


# -----------------------------------------------------------------------------
# Hardware
# Explained in notebooks/06_tools.py, same heading.
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


# -----------------------------------------------------------------------------
# Starting processes
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker(rank, world_size, vocabs, tokenizers, config, *options):
    """train_worker in a new process, from plain data."""
    vocabs = [
        BpeVocab.from_str(v) if isinstance(v, str) else Vocab(v)
        for v in vocabs
    ]
    config = TrainConfig(**config)
    train_worker(
        rank, world_size, *vocabs, *tokenizers, config, True, *options
    )


def train_distributed_model(
    vocab_src, vocab_tgt, spacy_de, spacy_en, config, world_size=None,
    resume=False,
):  # fmt: skip
    """Train with one process per GPU (or world_size CPU processes)."""
    import torch.multiprocessing as mp

    world_size = world_size or max(torch.cuda.device_count(), 1)
    plain = lambda v: v.to_str() if hasattr(v, "to_str") else v.get_itos()
    vocabs = [plain(vocab_src), plain(vocab_tgt)]
    data = (vocabs, (spacy_de, spacy_en), asdict(config), free_port(), resume)
    mp.spawn(_spawned_worker, (world_size, *data), nprocs=world_size)


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
    args = (vocab_src, vocab_tgt, spacy_de, spacy_en, config)
    if distributed:
        return train_distributed_model(*args, world_size, resume)
    return train_worker(0, 1, *args, resume=resume)


# -----------------------------------------------------------------------------
# Translating for users
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
_NO_SPACE_BEFORE = set(
    ". , ! ? ; : ) ] } % 's 're 've 'll 'm 'd n't '".split()
)
_NO_SPACE_AFTER = ("(", "[", "{", "$", "#")


def detokenize(tokens):
    """Join English spaCy tokens into a plain sentence."""
    out, quote_open = "", False
    for i, tok in enumerate(tokens):
        hyphen = out.endswith("-") and i > 1 and tokens[i - 1] == "-"
        glue = (
            i == 0
            or tok.lower() in _NO_SPACE_BEFORE
            or out.endswith(_NO_SPACE_AFTER)
            or tok == "-"
            or (hyphen and tokens[i - 2] not in {",", ".", "-"})
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
    if hasattr(vocab, "decode"):  # a vocabulary that writes text (Part 5)
        return vocab.decode(ids)
    return detokenize(vocab.lookup_tokens(ids))


@torch.no_grad()
def source_alignment(model, src, src_mask, out, layers=None):
    """(B, L-1): the source position each output token after <s> read most.

    `layers` picks the decoder layers to average (default: all)."""
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    ys = out[:, :-1]  # (B, T): decoder inputs; row t wrote out[:, t + 1]
    tgt_mask = subsequent_mask(ys.size(1)).to(src.device)  # (1, T, T)
    decoder = model.decoder.layers
    chosen = range(len(decoder)) if layers is None else layers
    with record_attention(model):
        model.decode(memory, src_mask, ys, tgt_mask)
        weights = [decoder[i].src_attn.attn for i in chosen]  # (B, h, T, S)
    attn = torch.stack(weights).mean(dim=(0, 2))  # (B, T, S): layers, heads
    words = src_mask & ((src != BOS) & (src != EOS)).unsqueeze(1)  # (B, 1, S)
    return attn.masked_fill(~words, -1.0).argmax(dim=-1)


def replace_unknowns(ids, aligned, src_words, vocab_tgt):
    """Output tokens, each <unk> replaced by the source word it read most."""
    tokens = vocab_tgt.lookup_tokens(ids)
    for k, token_id in enumerate(ids):
        j = aligned[k] if token_id == UNK else 0  # 0 is <s>: no word
        if 0 < j <= len(src_words):  # source position j is word j - 1
            tokens[k] = src_words[j - 1]
    return tokens


def translate_batch(
    model, sentences, spacy_de, vocab_src, vocab_tgt, device="cpu",
    batch_size=128, max_extra=50, decode_fn=cached_greedy_decode,
    replace_unk=True,
):  # fmt: skip
    """German sentences to detokenized English, in input order."""
    decode_fn = decode_fn or cached_greedy_decode
    model.eval()
    if hasattr(vocab_src, "encode") or hasattr(vocab_tgt, "decode"):
        replace_unk = False  # BPE: no <unk> to replace
    if replace_unk:  # keep the German words: an <unk> id has lost its word
        german = [tokenize(s, spacy_de) for s in sentences]
        encoded = [[BOS, *vocab_src(w), EOS] for w in german]
    else:
        encoded = [
            [BOS, *encode_text(s, spacy_de, vocab_src), EOS] for s in sentences
        ]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    results = [None] * len(encoded)
    for k in range(0, len(order), batch_size):
        idx = order[k : k + batch_size]
        src, _ = collate_batch([(encoded[i], []) for i in idx])
        src = src.to(device)  # (B, S)
        mask = (src != PAD).unsqueeze(-2)  # (B, 1, S)
        out = decode_fn(model, src, mask, src.size(1) + max_extra)  # (B, L)
        aligned = [None] * len(idx)
        if replace_unk and (out == UNK).any():  # one more decoder pass
            aligned = source_alignment(model, src, mask, out).tolist()
        for i, row, at in zip(idx, out.tolist(), aligned, strict=True):
            # Stop at this sentence's own limit, whatever its batch-mates.
            ids = strip_specials(row[: len(encoded[i]) + max_extra])
            if at is None:
                results[i] = decode_text(ids, vocab_tgt)
            else:
                tokens = replace_unknowns(ids, at, german[i], vocab_tgt)
                results[i] = detokenize(tokens)
    return results


def compute_bleu(hypotheses, references):
    """Cased corpus BLEU (sacreBLEU, 13a tokenization) of plain text."""
    import sacrebleu

    return sacrebleu.corpus_bleu(hypotheses, [references])


def translate(
    sentences, checkpoint="checkpoints/cpu/final.pt", beam=1, average=0,
    replace_unk=True,
):  # fmt: skip
    """English translations of German sentences, with a trained model."""
    model, vocab_src, vocab_tgt, decode_fn = load_translator(
        checkpoint, "cpu", beam, average
    )
    spacy_de, _ = load_tokenizers()
    return translate_batch(
        model, sentences, spacy_de, vocab_src, vocab_tgt, decode_fn=decode_fn,
        replace_unk=replace_unk,
    )  # fmt: skip


def check_outputs(model, pairs, spacy_de, vocab_src, vocab_tgt, n_examples=5):
    """Print source, reference and model output for some pairs."""
    pairs = list(pairs)[:n_examples]
    hyps = translate_batch(
        model, [de for de, _ in pairs], spacy_de, vocab_src, vocab_tgt
    )
    for i, ((de, en), hyp) in enumerate(zip(pairs, hyps, strict=True)):
        print(f"example {i}\n  source: {de}\n  reference: {en}")
        print(f"  model: {hyp}")
    return hyps


def run_model_example(checkpoint="checkpoints/cpu/final.pt", n_examples=5):
    """Load a trained model and show some validation translations."""
    model, vocab_src, vocab_tgt, _ = load_trained_model(checkpoint)
    spacy_de, _ = load_tokenizers()
    pairs = read_multi30k("val")
    return check_outputs(
        model, pairs, spacy_de, vocab_src, vocab_tgt, n_examples
    )


# -----------------------------------------------------------------------------
# Which model is this?
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
def describe_checkpoint(path):
    """One line: a checkpoint's file, preset, sizes and training."""
    ckpt = load_checkpoint(path)
    c, history = ckpt["config"], ckpt.get("history") or []
    pairs = c.get("max_train_pairs") or 0
    data = f"{pairs:,d} training pairs" if pairs else "all training pairs"
    trained = f"{len(history)} epochs on {data}"
    if history:
        trained += f", validation loss {history[-1]['val_loss']:.2f}"
    name = f"{Path(path).parent.name}/{Path(path).name}"
    return (
        f"{name}, preset {c.get('preset', '?')} (N={c['N']}, "
        f"d_model={c['d_model']}, h={c['h']}, "
        f"{c.get('tokenization', 'word')} vocabulary), {trained}"
    )


# -----------------------------------------------------------------------------
# A trained model, or a small one trained now
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
def find_or_train(
    presets, stand_in, vocabs, tokenizers, root=".", size="full"
):
    """final.pt of the first trained preset, else train `stand_in` now."""
    for preset in presets if size != "ci" else ():
        final = Path(root, get_config(preset).checkpoint_dir, "final.pt")
        if final.is_file():
            return str(final)
    train_worker(0, 1, *vocabs, *tokenizers, stand_in, show_progress=False)
    return str(Path(stand_in.checkpoint_dir, "final.pt"))


# -----------------------------------------------------------------------------
# Checkpoint files
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
class CheckpointError(ValueError):
    """A file that is not a checkpoint this code can use."""


class _KeepsWriteError:
    """A file wrapper that remembers the first OSError of a write."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        """Write to the file; remember an OSError before raising it."""
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self):
        """Flush the file."""
        self.f.flush()


def save_checkpoint(path, **fields):
    """Write a dict of tensors and plain types atomically."""
    with atomic_write(path) as f:
        wrapped = _KeepsWriteError(f)
        try:
            torch.save(fields, wrapped)
        except RuntimeError:
            if wrapped.error is None:
                raise
            raise wrapped.error from None  # e.g. no space left on device


def load_checkpoint(path, device="cpu"):
    """Read a checkpoint safely (weights_only) onto `device`."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; train one first")
    with open(path, "rb") as f:
        head = f.read(2)
    if not head:
        raise CheckpointError(f"{path} is empty (0 bytes), not a checkpoint")
    if head != b"PK" and head[:1] != b"\x80":  # neither zip nor pickle
        raise CheckpointError(f"{path} is not a checkpoint")
    damaged = f"{path} is not a readable checkpoint (damaged or cut short)"
    if head == b"PK" and not zipfile.is_zipfile(path):
        raise CheckpointError(f"{damaged}: not a whole zip archive")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:  # it would build other objects?
        if head == b"PK" and "Unsupported global" not in str(err):
            raise CheckpointError(f"{damaged}: its pickle is broken") from err
        why = "holds more than tensors, so it is not loaded, for safety"
        raise CheckpointError(f"{path} {why}") from err
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        first = str(err).strip().splitlines()[0][:200] if str(err) else ""
        raise CheckpointError(
            f"{damaged}: {first or type(err).__name__}"
        ) from err
    if not isinstance(ckpt, dict):
        raise CheckpointError(
            f"{path} holds a {type(ckpt).__name__}, not a checkpoint"
        )
    return ckpt


def epoch_checkpoints(folder):
    """The epoch checkpoints in a folder, oldest first."""
    return sorted(Path(folder).glob("epoch_*.pt"))


LEGACY_CONFIG_NAMES = {"num_epochs": "epochs", "amp": "precision"}


def checkpoint_config(ckpt, path="checkpoint"):
    """The TrainConfig a checkpoint was trained with."""
    try:
        saved = ckpt["config"].items()
        return TrainConfig(
            **{LEGACY_CONFIG_NAMES.get(k, k): v for k, v in saved}
        )
    except (KeyError, TypeError, AttributeError) as err:
        why = f"no {err}" if isinstance(err, KeyError) else err
        raise CheckpointError(
            f"{path} does not match this code's Multi30k model: {why}"
        ) from err


def checkpoint_vocabularies(ckpt, path="checkpoint"):
    """(vocab_src, vocab_tgt) stored in a checkpoint: words or BPE."""
    tokenization = ckpt.get("config", {}).get("tokenization", "word")
    try:
        if tokenization == "bpe":  # one subword vocabulary for both sides
            bpe = BpeVocab.from_str(ckpt["bpe"])
            return bpe, bpe
        if tokenization == "word":
            return Vocab(ckpt["vocab_src"]), Vocab(ckpt["vocab_tgt"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"{path} does not match this code's Multi30k model: "
            f"no readable {tokenization} vocabularies ({err})"
        ) from err
    raise CheckpointError(f"{path}: unknown tokenization {tokenization!r}")


def size_mismatch(expected, saved):
    """How two state dicts differ, in a few words; "" if they fit."""
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    if missing or unexpected:
        example = (missing or unexpected)[0]
        return (
            f"{len(missing)} tensors missing and {len(unexpected)} "
            f"unexpected, such as {example}"
        )
    size = lambda t: "×".join(map(str, t.shape)) or "a scalar"
    for name, tensor in expected.items():
        if saved[name].shape != tensor.shape:
            return (
                f"{name} is {size(saved[name])} in the file but "
                f"{size(tensor)} here"
            )
    return ""


def load_weights(model, ckpt, path="checkpoint"):
    """Load a checkpoint's weights into `model`, or say how they differ."""
    state = ckpt.get("model")
    problem = "it holds no weights" if not isinstance(state, dict) else ""
    problem = problem or size_mismatch(model.state_dict(), state)
    if problem:
        raise CheckpointError(
            f"{path} does not match this code's Multi30k model: {problem}"
        )
    model.load_state_dict(state)


def save_run(run, name, vocab_src, vocab_tgt, **extra):
    """Write the weights, config, vocabularies and losses, and `extra`."""
    fields = {"model": run.module.state_dict(), "config": asdict(run.config)}
    fields |= {"vocab_src": vocab_src.get_itos(), "history": run.history}
    fields["vocab_tgt"] = vocab_tgt.get_itos()
    if hasattr(vocab_tgt, "to_str"):  # Part 5's BPE: its merges, as JSON
        fields["bpe"] = vocab_tgt.to_str()
    save_checkpoint(Path(run.config.checkpoint_dir, name), **fields, **extra)


def save_epoch(run, epoch, vocab_src, vocab_tgt):
    """Write a lean epoch_NNN.pt, then last.pt; keep `keep_last` epochs."""
    save_run(run, f"epoch_{epoch:03d}.pt", vocab_src, vocab_tgt, epoch=epoch)
    resume = {"epoch": epoch, "train_state": asdict(run.state)}
    resume |= {"optimizer": run.optimizer.state_dict()}
    resume |= {"scheduler": run.scheduler.state_dict()}
    resume |= {"rng_state": torch.get_rng_state()}
    if run.device.type == "cuda":  # dropout on the GPU draws from these
        resume["cuda_rng_states"] = torch.cuda.get_rng_state_all()
    save_run(run, "last.pt", vocab_src, vocab_tgt, **resume)
    keep, folder = run.config.keep_last, run.config.checkpoint_dir
    for old in epoch_checkpoints(folder)[:-keep] if keep > 0 else []:
        old.unlink()


def resume_point(folder):
    """The file a run in `folder` resumes from, or None."""
    paths = [Path(folder, "last.pt"), *epoch_checkpoints(folder)[-1:]]
    for path in paths:
        if path.is_file() and "optimizer" in load_checkpoint(path):
            return path
    return None


def resume_run(run):
    """Restore the newest training state; returns the next epoch."""
    path = resume_point(run.config.checkpoint_dir)
    if path is None:  # nothing to resume from: start afresh
        return 0
    ckpt = load_checkpoint(path, "cpu")  # random states must be on the CPU
    load_weights(run.module, ckpt, path)
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.scheduler.load_state_dict(ckpt["scheduler"])
    run.state, run.history = TrainState(**ckpt["train_state"]), ckpt["history"]
    torch.set_rng_state(ckpt["rng_state"])
    if "cuda_rng_states" in ckpt and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["cuda_rng_states"])
    return ckpt["epoch"] + 1


def check_resume(config, vocab_src, vocab_tgt):
    """The checkpoint a run would resume from (None: none), checked."""
    folder = config.checkpoint_dir
    path = resume_point(folder)
    if path is None and epoch_checkpoints(folder):
        raise CheckpointError(
            f"nothing to resume in {folder}: its epoch files lack the "
            "training state (no last.pt), and starting afresh would "
            "overwrite them; move them away or choose another "
            "--checkpoint-dir"
        )
    if path is not None:
        with torch.device("meta"):  # shapes only, no memory
            model = model_from_config(config, len(vocab_src), len(vocab_tgt))
        problem = size_mismatch(
            model.state_dict(), load_checkpoint(path)["model"]
        )
        if problem:
            raise CheckpointError(
                f"cannot resume from {path}, another model: {problem}"
            )
    return path


class FolderInUseError(RuntimeError):
    """Another process trains into the same checkpoint folder."""


@contextlib.contextmanager
def folder_lock(folder):
    """Hold the lock on a checkpoint folder while the block runs."""
    import fcntl  # Unix only

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise FolderInUseError(
                f"{folder} is in use by another training run (process "
                f"{holder}); wait for it, or choose another --checkpoint-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield folder
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


# -----------------------------------------------------------------------------
# Reading text files
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
class TextFileError(ValueError):
    """A text file that cannot be read line by line as UTF-8."""


def clean_line(text):
    """A line without control characters other than tab."""
    keep = lambda c: c == "\t" or unicodedata.category(c) != "Cc"
    return "".join(c for c in text if keep(c))


def _split_lines(f):
    """Byte lines of a binary file, ended by \n, \r\n or a lone \r."""
    for line in f:  # ends at \n; a lone \r ends a line, too
        pieces = line.rstrip(b"\n").split(b"\r")
        if len(pieces) > 1 and pieces[-1] == b"":  # \r\n: one line end
            pieces.pop()
        yield from pieces


def iter_lines(path):
    """Lines of a UTF-8 text file (plain, .gz, or "-": stdin), lazily."""
    import gzip
    from contextlib import nullcontext

    stdin = str(path) == "-"
    name, number = "standard input" if stdin else Path(path), 0
    try:
        if stdin and sys.stdin is None:  # started with `<&-`
            raise TextFileError("standard input is closed")
        if stdin:
            opened = nullcontext(sys.stdin.buffer)
        elif name.is_dir():
            raise TextFileError(f"{name} is a folder, not a file")
        else:
            opened = (gzip.open if name.suffix == ".gz" else open)(name, "rb")
        with opened as f:
            for line in _split_lines(f):
                number += 1
                if number == 1:
                    line = line.removeprefix(b"\xef\xbb\xbf")  # the BOM
                yield clean_line(line.decode("utf-8"))
    except FileNotFoundError:
        raise TextFileError(f"no such file: {name}") from None
    except UnicodeDecodeError:
        raise TextFileError(
            f"{name} is not UTF-8 text (line {number})"
        ) from None
    except (OSError, EOFError) as err:  # not gzip, truncated, unreadable
        raise TextFileError(f"cannot read {name}: {err}") from None


def read_lines(path):
    """Lines of a plain or gzipped UTF-8 text file, without newlines."""
    return list(iter_lines(path))


def read_parallel(src_path, ref_path):
    """(sources, references): two files of line-by-line translations."""
    sources, references = read_lines(src_path), read_lines(ref_path)
    if len(sources) != len(references):
        raise TextFileError(
            f"{src_path} has {len(sources)} lines but {ref_path} has "
            f"{len(references)}; they must be line-by-line translations"
        )
    if not sources:
        raise TextFileError(f"{src_path} is empty")
    return sources, references


def write_results(path, checkpoint, wall_time):
    """Score test2016 and write a JSON summary of the training run."""
    sources, references = zip(*read_multi30k("test"), strict=True)
    kept = translate(list(sources), checkpoint, replace_unk=False)
    bleu = compute_bleu(translate(list(sources), checkpoint), references)
    kept_bleu = compute_bleu(kept, references)  # <unk> left in the output
    ckpt = load_checkpoint(checkpoint)
    summary = {
        "command": "python " + " ".join(sys.argv),
        "config": ckpt["config"],
        "hardware": hardware_summary(),
        "wall_time_s": round(wall_time, 1),
        "epochs": len(ckpt["history"]),
        "history": ckpt["history"],
        "test2016_bleu_greedy": round(bleu.score, 2),
        "bleu": str(bleu),
        "test2016_bleu_greedy_without_unk_replacement": round(
            kept_bleu.score, 2
        ),
    }
    with atomic_write(path, "w") as f:
        f.write(json.dumps(summary, indent=2) + "\n")
    print(f"test2016 BLEU (greedy): {bleu.score:.2f}; summary in {path}")


# -----------------------------------------------------------------------------
# The command line
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
class UserError(Exception):
    """A problem with the user's input, reported without a traceback."""


def say(*lines):
    """Print lines to stdout now; an error there names standard output."""
    try:
        print(*lines, sep="\n", flush=True)
    except OSError as err:  # a full disk, a broken pipe, ...
        raise OSError(err.errno, err.strerror, "standard output") from err


def positive_int(text, least=1, most=10**6):
    """argparse type: a whole number from `least` (1) to `most`."""
    try:
        number = int(text)
    except ValueError:
        number = None
    if number is None or not least <= number <= most:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from {least} to {most:,d}, not {text}"
        )
    return number


def count(least=1, most=10**6):
    """An argparse type: a whole number from `least` to `most`."""
    check = functools.partial(positive_int, least=least, most=most)
    check.__name__ = "count"
    return check


def existing_device(name):
    """argparse type: a torch device that this machine has."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{name!r} is not a device; try cpu, cuda or cuda:1"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count()  # 0 without CUDA
        if (device.index or 0) >= count:
            raise argparse.ArgumentTypeError(
                f"no {name} here: this machine has {count} CUDA devices"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError("no mps (Apple GPU) here")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{name} is not supported here")
    return str(device)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors take one line of stderr."""

    def error(self, message):
        """Print `prog: error: message` on one line; exit with status 2."""
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_train_parser(sub):
    """`train`: its options."""
    train = sub.add_parser("train", help="train a model on Multi30k")
    train.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    train.add_argument(
        "--epochs", type=count(most=10_000), help="epochs to train"
    )
    train.add_argument(
        "--max-tokens", type=count(most=10**7), help="tokens in a batch"
    )
    train.add_argument("--checkpoint-dir", help="where checkpoints go")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from last.pt, the newest training state",
    )
    train.add_argument(
        "--keep-last",
        type=count(least=0, most=10_000),
        metavar="K",
        help="keep the newest K epoch checkpoints, for --average "
        f"(default {TrainConfig.keep_last}; 0: all)",
    )
    train.add_argument(
        "--world-size",
        type=count(most=1024),
        default=1,
        help="processes to spawn (torchrun sets its own)",
    )
    train.add_argument(
        "--results", help="write a JSON summary here, including test BLEU"
    )
    train.add_argument(
        "--threads", type=count(most=4096), help="CPU threads per process"
    )


def add_decoding_options(parser):
    """Options shared by `evaluate` and `translate`."""
    parser.add_argument("--checkpoint", default="checkpoints/cpu/final.pt")
    parser.add_argument(
        "--batch-size",
        type=count(most=100_000),
        default=128,
        help="sentences decoded together",
    )
    parser.add_argument(
        "--device", type=existing_device, default="cpu", help="cpu, cuda:0…"
    )
    parser.add_argument(
        "--beam",
        type=count(most=1000),
        default=1,
        metavar="K",
        help="beam size (1: greedy)",
    )
    parser.add_argument(
        "--average",
        type=count(most=10_000),
        metavar="K",
        help="average the last K epoch checkpoints next to the checkpoint",
    )
    parser.add_argument(
        "--no-replace-unk",
        dest="replace_unk",
        action="store_false",
        help="keep <unk> in the output (default: copy the attended source "
        "word; word vocabularies only)",
    )


def add_evaluate_parser(sub):
    """`evaluate`: its options."""
    evaluate = sub.add_parser("evaluate", help="BLEU on a pair of files")
    add_decoding_options(evaluate)
    evaluate.add_argument(
        "--src",
        help="German sources, one per line "
        "(.gz is fine; default: Multi30k test2016)",
    )
    evaluate.add_argument("--ref", help="English references, one per line")
    evaluate.add_argument("--out", help="also write the translations here")


def add_translate_parser(sub):
    """`translate`: its options."""
    translate = sub.add_parser("translate", help="translate German text")
    add_decoding_options(translate)
    translate.add_argument(
        "sentence",
        nargs="*",
        help="German sentences, one per argument (none, or -: read "
        "standard input, one sentence per line)",
    )
    translate.add_argument(
        "--input",
        metavar="FILE",
        help="translate FILE line by line (.gz is fine; -: standard input)",
    )


def build_parser():
    """The argparse parser of the command line."""
    prog = os.path.basename(sys.argv[0] or "")
    if prog != "annotated-transformer":  # the installed console script
        prog = "the_annotated_transformer.py"
    parser = OneLineParser(
        prog=prog,
        description="Train, evaluate and use the Annotated Transformer on "
        "Multi30k German→English.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("download", help="download and verify Multi30k")
    add_train_parser(sub)
    add_evaluate_parser(sub)
    add_translate_parser(sub)
    return parser


def command_train(args):
    """`train`: run training, then optionally score and summarize."""
    overrides = {
        k: v
        for k, v in (
            ("epochs", args.epochs),
            ("max_tokens", args.max_tokens),
            ("checkpoint_dir", args.checkpoint_dir),
            ("keep_last", args.keep_last),
        )
        if v is not None
    }
    config = get_config(args.preset, **overrides)
    rank = int(os.environ.get("RANK", "0"))
    lock = folder_lock(config.checkpoint_dir) if rank == 0 else None
    with lock or contextlib.nullcontext():
        return train_locked(args, config)


def train_locked(args, config):
    """`train`, once the checkpoint folder is ours."""
    if args.threads:
        torch.set_num_threads(args.threads)
    download_multi30k()
    tokenizers = load_tokenizers()
    vocabs = load_vocabularies(config, *tokenizers)
    if args.resume and check_resume(config, *vocabs) is None:
        print(
            f"note: nothing to resume in {config.checkpoint_dir} (no "
            "checkpoints there); training from the first epoch",
            file=sys.stderr,
        )
    data = (*vocabs, *tokenizers, config)
    start = time.time()
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        train_worker(rank, world, *data, world > 1, resume=args.resume)
        if rank != 0:
            return 0
    else:
        train_model(
            *data,
            distributed=args.world_size > 1,
            world_size=args.world_size,
            resume=args.resume,
        )
    final = Path(config.checkpoint_dir) / "final.pt"
    say(f"trained in {time.time() - start:.0f} s; model in {final}")
    if args.results:
        write_results(args.results, final, time.time() - start)
    return 0


def check_out(out, *inputs):
    """Refuse an output file that is an input or cannot be written."""
    out = Path(out).absolute()
    for given in inputs:
        given = Path(given).absolute()
        same = out.exists() and given.exists() and out.samefile(given)
        if same or out.resolve() == given.resolve():
            raise UserError(
                f"--out {out} is also an input, which it would overwrite"
            )
    if out.is_dir():
        raise UserError(f"--out {out} is a folder")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: there is no folder {out.parent}")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: cannot write in {out.parent}")


def load_for_decoding(args):
    """`load_translator` for the command line, refusing a too-wide beam."""
    try:
        model, vocab_src, vocab_tgt, decode_fn = load_translator(
            args.checkpoint, args.device, args.beam, args.average
        )
    except (FileNotFoundError, ValueError) as err:  # CheckpointError, ...
        raise UserError(str(err)) from err
    if args.beam > len(vocab_tgt):
        raise UserError(
            f"--beam {args.beam} is wider than the {len(vocab_tgt)} tokens "
            f"of the target vocabulary of {args.checkpoint}"
        )
    return model, vocab_src, vocab_tgt, decode_fn


def position_limit(model, max_extra=50):
    """How many source tokens (without <s>, </s>) a model can translate."""
    positions = min(
        model.src_embed[1].pe.size(1), model.tgt_embed[1].pe.size(1)
    )
    return positions - max_extra - 2


def fit_to_model(line, number, spacy_de, vocab_src, limit, what="line"):
    """`line`, cut to its first `limit` tokens, with a warning if cut."""
    if hasattr(vocab_src, "encode"):  # BPE: its own tokens and offsets
        starts = [a for a, _ in vocab_src.tokenizer.encode(line).offsets]
    else:
        tokens = spacy_de.tokenizer(line)
        starts = [tok.idx for tok in tokens if not tok.is_space]
    if len(starts) <= limit:
        return line
    print(
        f"warning: {what} {number} has {len(starts):,d} tokens; the model "
        f"reads {limit:,d}, so only they were translated",
        file=sys.stderr,
    )
    return line[: starts[limit]]


def command_evaluate(args):
    """`evaluate`: BLEU of a checkpoint on a pair of files."""
    if (args.src is None) != (args.ref is None):
        raise UserError("give both --src and --ref, or neither")
    if args.out:
        inputs = [args.checkpoint, *filter(None, [args.src, args.ref])]
        check_out(args.out, *inputs)
    if args.src is None:
        folder = download_multi30k()
        args.src = folder / "test_2016_flickr.de.gz"
        args.ref = folder / "test_2016_flickr.en.gz"
    sources, references = read_parallel(args.src, args.ref)
    model, vocab_src, vocab_tgt, decode_fn = load_for_decoding(args)
    spacy_de, _ = load_tokenizers()
    limit = position_limit(model)
    sources = [
        fit_to_model(s, n, spacy_de, vocab_src, limit)
        for n, s in enumerate(sources, 1)
    ]
    hyps = translate_batch(
        model,
        sources,
        spacy_de,
        vocab_src,
        vocab_tgt,
        device=args.device,
        batch_size=args.batch_size,
        decode_fn=decode_fn,
        replace_unk=args.replace_unk,
    )
    if args.out:
        with atomic_write(args.out, "w") as f:
            f.write("\n".join(hyps) + "\n")
    say(compute_bleu(hyps, references))
    return 0


def translate_lines(lines, translate_fn, chunk=1024):
    """Translations of `lines`, one list per `chunk` lines read."""
    lines = iter(lines)
    while batch := list(itertools.islice(lines, chunk)):
        todo = [line for line in batch if line.strip()]
        hyps = iter(translate_fn(todo) if todo else [])
        yield [next(hyps) if line.strip() else "" for line in batch]


def sentences_to_translate(args):
    """What `translate` reads: its arguments, a file or standard input."""
    if args.input is not None and args.sentence:
        raise UserError("give sentences or --input FILE, not both")
    if args.input is None and args.sentence in ([], ["-"]):
        args.input = "-"
    if args.input is not None:
        return iter_lines(args.input)
    for number, sentence in enumerate(args.sentence, 1):
        if sentence == "-":
            raise UserError("- (standard input) cannot mix with sentences")
        if not clean_line(sentence).strip():
            raise UserError(f"sentence {number} is empty: no German to read")
    return iter(map(clean_line, args.sentence))


def warn_unknown_words(sentences, spacy_de, vocab_src):
    """Name, on stderr, the words a word vocabulary reads as `<unk>`."""
    if isinstance(vocab_src, Vocab):  # (BPE can spell any known letters)
        words = [tokenize(s, spacy_de) for s in sentences]
        unknown = {w: 1 for ws in words for w in ws if w not in vocab_src}
        if unknown:
            print(
                "note: not in the vocabulary, read as <unk>: "
                + ", ".join(unknown),
                file=sys.stderr,
            )


def command_translate(args):
    """`translate`: one line of English per German sentence, in order."""
    lines = sentences_to_translate(args)
    typing = args.input == "-" and sys.stdin and sys.stdin.isatty()
    chunk = 1 if typing else 8 * args.batch_size
    first = list(itertools.islice(lines, chunk))  # input errors come first
    if not first:
        where = "standard input" if args.input == "-" else args.input
        raise UserError(f"nothing to translate: {where} is empty")
    model, vocab_src, vocab_tgt, decode_fn = load_for_decoding(args)
    spacy_de, _ = load_tokenizers()
    if args.input is None:
        warn_unknown_words(args.sentence, spacy_de, vocab_src)
    translate_fn = functools.partial(
        translate_batch,
        model,
        spacy_de=spacy_de,
        vocab_src=vocab_src,
        vocab_tgt=vocab_tgt,
        device=args.device,
        batch_size=args.batch_size,
        decode_fn=decode_fn,
        replace_unk=args.replace_unk,
    )
    what = "line" if args.input is not None else "sentence"
    fit = functools.partial(
        fit_to_model,
        spacy_de=spacy_de,
        vocab_src=vocab_src,
        limit=position_limit(model),
        what=what,
    )
    stream = itertools.chain(first, lines)
    fitted = (fit(line, n) for n, line in enumerate(stream, 1))
    for hyps in translate_lines(fitted, translate_fn, chunk):
        say(*hyps)
    return 0


def command_download(args):
    """`download`: fetch and verify Multi30k, print where it is."""
    say(download_multi30k())
    return 0


EXIT_USAGE, EXIT_IO, EXIT_PIPE, EXIT_INTERRUPTED = 2, 74, 141, 130
USER_ERRORS = (
    UserError,
    CheckpointError,
    TextFileError,
    DatasetError,
    FolderInUseError,
    FileNotFoundError,
)


def stdout_fault():
    """Flush stdout; on failure, send what it holds nowhere; the error."""
    try:
        sys.stdout.flush()
    except OSError as err:  # full, closed or a broken pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return err
    return None


def one_line(err):
    """An exception's message on one line."""
    return " ".join(str(err).split()) or type(err).__name__


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C
    if sys.stdout is None:  # started with stdout closed: `>&-`
        print("error: standard output is closed", file=sys.stderr)
        return EXIT_IO
    try:
        args = build_parser().parse_args(argv)
        commands = {
            "download": command_download,
            "train": command_train,
            "evaluate": command_evaluate,
            "translate": command_translate,
        }
        with warnings.catch_warnings():  # torch's note on an old pickle
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            status = commands[args.command](args)
        sys.stdout.flush()  # a full disk shows here, not at exit
        return status
    except USER_ERRORS as err:
        print("error: " + one_line(err), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        stdout_fault()
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:  # full disk, closed stdout, broken pipe, ...
        fault = stdout_fault()
        if isinstance(err, BrokenPipeError) or isinstance(
            fault, BrokenPipeError
        ):
            return EXIT_PIPE  # the reader left: nothing to report
        if err.filename is not None:
            err = f"{err.filename}: {err.strerror}"
        elif fault is not None:  # the error was writing to stdout
            err = f"standard output: {fault.strerror or one_line(fault)}"
        print("error: " + one_line(err), file=sys.stderr)
        return EXIT_IO


if __name__ == "__main__":
    raise SystemExit(main())
