# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Part 1: The model architecture
#
# This notebook builds the Transformer of Vaswani et al., *Attention Is All
# You Need* (2017), one component per cell, top down: from the whole model
# to its parts. It follows harvardnlp's *The Annotated Transformer* (2018,
# updated 2022; "the 2022 tutorial" below) and keeps most of its names.
# Every cell marked `#| export` is also copied into
# `the_annotated_transformer.py`, so the code you read here is the code you
# import later. The command `make export` (it runs `tools/export.py`) does
# the copying. After most definitions a short cell checks the new piece
# against a PyTorch built-in, a closed form, or a property the paper
# promises. Where we depart from the paper, one sentence says so and why.
#

# %% [markdown]
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/annotated-transformer/done-right/blob/main/notebooks/01_model.ipynb)

# %% cellView="form"
# @title Setup (on Colab: clone, install) { display-mode: "form" }
# Setup only; nothing to learn here. Part 1 runs on a CPU in seconds, so on
# Colab it needs no GPU runtime. On Colab: clone the repository, then
# install what the notebooks need. Elsewhere: use this checkout. Either
# way, ROOT is the repository's folder.
import os
import subprocess
import sys

REPO = "https://github.com/annotated-transformer/done-right"
CLONE = REPO.rsplit("/", 1)[-1]  # the folder `git clone` makes
if "COLAB_RELEASE_TAG" in os.environ:
    if not os.path.isdir(CLONE):
        no_prompt = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}  # no password
        git = ["git", "clone", "-q", "--depth=1", REPO, CLONE]
        # Output captured and shown on failure: Colab shows nothing that
        # a subprocess prints by itself.
        run = subprocess.run(
            git, env=no_prompt, capture_output=True, text=True
        )
        if run.returncode != 0:
            raise SystemExit(f"could not clone {REPO}:\n{run.stderr}")
    installed = os.path.join(CLONE, ".installed")  # pip finished, once
    if not os.path.isfile(installed):  # again after a failed install
        print("installing what the notebooks need (a few minutes)...")
        pip = ["pip", "install", "-q", "-e", f"./{CLONE}[notebooks]"]
        run = subprocess.run(
            [sys.executable, "-m", *pip], capture_output=True, text=True
        )
        if run.returncode != 0:  # pip's last lines say why
            raise SystemExit(f"pip could not install:\n{run.stderr[-3000:]}")
        open(installed, "w").close()
# The repository: the clone on Colab; else the nearest folder holding the
# library: the working directory, or the one above it (from notebooks/),
# or the one above that (from runs/notebooks/, where `make notebook`
# writes the executed copies).
UP = [".", "..", "../.."]
MODULE = "the_annotated_transformer.py"
HERE = next((d for d in UP if os.path.isfile(f"{d}/{MODULE}")), "..")
ROOT = os.path.abspath(CLONE if os.path.isdir(CLONE) else HERE)
sys.path.insert(0, ROOT)

# %%
#| export
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

# %% [markdown]
# ## The encoder–decoder frame
#
# A translation model reads a source sentence $x = (x_1, \dots, x_n)$ and
# writes a target sentence $y = (y_1, \dots, y_m)$ one token at a time. The
# **encoder** turns the source into a sequence of vectors, the *memory*
# $z = (z_1, \dots, z_n)$. The **decoder** reads the memory and the target
# prefix $y_{<t}$ and predicts a distribution over $y_t$. The model is
# *auto-regressive*: each new token is fed back in as input for the next.
#
# The pieces, in three sentences. *Attention* lets each position take a
# weighted average of other positions' vectors, and a *mask* says which
# positions it may read. An encoder layer is attention followed by a
# small network applied to each position on its own, each of the two
# wrapped as $x + f(\mathrm{norm}(x))$, where norm rescales each
# position's vector (layer normalization, below) and adding $x$ back is
# a *residual connection*. (The paper normalizes after the addition
# instead, $\mathrm{norm}(x + f(x))$; "Residual connections, pre-norm"
# says why we do not.) A decoder layer adds a second attention, over the
# encoder's output. The sections below build each piece, top down, so
# some names appear before their definitions.
#
# `EncoderDecoder` holds five parts and says how data moves between them:
# source ids are embedded and encoded once; target ids are embedded and
# decoded against that memory. Each part is defined further down. Both
# the encoder and the decoder also take a mask saying which positions may
# be read; the Masks section, after the decoder, explains them. `forward`
# stops at the decoder's hidden states: it never calls the fifth part, the
# `generator`. The loss (Part 2) and the decoding loops (Parts 2, 3 and 5)
# call it themselves, on the positions they need.
#
# Comments such as `# (B, S, d_model)` give a tensor's shape, with the
# same letters throughout the project: `B` sentences in a batch, `S`
# source positions, `T` target positions (in attention: `T` queries, `S`
# keys; in self-attention both are the same sequence), `d_model` the
# width of each position's vector (512 in the paper), `h` attention
# heads, and `d_k = d_model / h` features per head.
#
# ![The Transformer, as this notebook builds it](attachment:transformer.svg)
#
# Read it bottom up: each box names the code that implements it, and some
# also give their output shape. Dashed frames repeat $N$ times. Each (+)
# is a residual connection, which adds a block's input to its output:
# $x + f(x)$. "Shifted right": the decoder's input is the target
# sentence with a start token in front, so the input at position $t$ is
# word $t - 1$, and the model must predict word $t$ (Part 2 builds
# this).


# %%
#| export
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


# %% [markdown]
# `Generator` maps decoder states to next-token log-probabilities: a
# linear map to one score per vocabulary word, then log-softmax.


# %%
#| export
class Generator(nn.Module):
    """Linear projection to the vocabulary, then log-softmax."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        """(B, T, d_model) hidden states to (B, T, vocab) log-probs."""
        return F.log_softmax(self.proj(x), dim=-1)


# %% [markdown]
# ## Encoder
#
# The encoder is a stack of $N = 6$ layers, identical in shape but each
# with its own weights. It runs them in turn and ends with a `LayerNorm`
# (the next section defines it, and "Residual connections, pre-norm" says
# why the stack needs one at its end). The `mask` hides the source's
# padding tokens (filler that makes the sentences of a batch equally
# long).
#
# The copies come from `clones`, which deep-copies one module $N$ times:
# every copy gets its own tensors, holding the same values at first.
# `make_model` re-initializes them (see "The full model").


# %%
#| export
def clones(module, N):
    """N independent deep copies of a module, in a ModuleList."""
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


# %% [markdown]
# Two clones hold the same numbers in separate memory, so training one
# leaves the other alone:

# %%
pair = clones(nn.Linear(4, 4), 2)
assert torch.equal(pair[0].weight, pair[1].weight)  # equal values
assert pair[0].weight.data_ptr() != pair[1].weight.data_ptr()  # own memory

# %% [markdown]
# `Encoder` applies its $N$ clones in turn and normalizes the result.
# `layer.size` is $d_{\text{model}}$, which each layer stores (see
# `EncoderLayer`, below).


# %%
#| export
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


# %% [markdown]
# ### Layer normalization
#
# Layer normalization (Ba et al., 2016) rescales each position's vector to
# zero mean and unit variance over its $d_{\text{model}}$ features, then
# applies a learned gain $a$ and bias $b$:
#
# $$\mathrm{LayerNorm}(x) = a \odot \frac{x - \mu}{\sqrt{\sigma^2 +
# \epsilon}} + b, \qquad \sigma^2 = \frac{1}{d}\sum_i (x_i - \mu)^2 .$$
#
# This is the standard form, the same as `torch.nn.LayerNorm`. We keep a
# small class of our own only so that the gain $a$ and the bias $b$ keep
# the 2022 tutorial's names, `a_2` and `b_2`, for code written against
# it.
#
# `forward` hands the whole formula to PyTorch's `F.layer_norm`, which
# computes it in one pass; the cell after the class writes the formula out
# and checks that the two agree.


# %%
#| export
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


# %% [markdown]
# The formula, written out, gives the same numbers as `F.layer_norm`,
# a fused kernel (one routine that computes the whole formula at once).
# The gain and bias are random, so that the check tests them and not just
# 1 and 0; the input has mean 1 and standard deviation 3, so that the
# normalization has something to undo.

# %%
torch.manual_seed(0)
norm = LayerNorm(24)
nn.init.normal_(norm.a_2)
nn.init.normal_(norm.b_2)
x = torch.randn(4, 5, 24) * 3 + 1  # mean 1, standard deviation 3
mean, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
by_hand = norm.a_2 * (x - mean) / torch.sqrt(var + norm.eps) + norm.b_2
assert torch.allclose(norm(x), by_hand, atol=1e-5)

# %% [markdown]
# ### Residual connections, pre-norm
#
# Every sub-layer (attention or feed-forward) sits inside a residual
# connection. The paper applies the norm *after* the addition
# ("post-norm"): $\mathrm{LayerNorm}(x +
# \mathrm{Dropout}(\mathrm{Sublayer}(x)))$. We apply it *before* the
# sub-layer and leave the residual path untouched ("pre-norm"): $x +
# \mathrm{Dropout}(\mathrm{Sublayer}(\mathrm{LayerNorm}(x)))$.
#
# Pre-norm leaves an untouched path from each block's input to its output,
# so the gradient flows straight down the stack, however many blocks are
# stacked, and deep stacks train more stably (Xiong et al., 2020).
#
# Because pre-norm never normalizes the residual stream itself, the last
# block's output can have any scale; so each stack ends with one extra
# `LayerNorm`, in `Encoder` and `Decoder`.
#
# ![Pre-norm and post-norm residual blocks](attachment:residual.svg)


# %%
#| export
class SublayerConnection(nn.Module):
    """Pre-norm residual block: x + dropout(sublayer(norm(x)))."""

    def __init__(self, size, dropout):
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        """Apply a same-shape sublayer to (B, T, d_model) with a residual."""
        return x + self.dropout(sublayer(self.norm(x)))


# %% [markdown]
# The untouched path is easy to see with a sub-layer that outputs zeros.
# In pre-norm the block then returns its input unchanged, and in the
# backward pass it passes the gradient down unchanged too: whatever
# gradient `upstream` arrives at the block's output is the gradient that
# reaches its input.

# %%
torch.manual_seed(0)
x = torch.randn(4, 5, 24) * 3 + 1  # mean 1, standard deviation 3
upstream = torch.randn(4, 5, 24)  # a gradient arriving from above
block = SublayerConnection(24, dropout=0.0)


def zero_sublayer(y):
    """A sub-layer whose output is always 0."""
    return 0 * y  # kept in the graph: the backward pass goes through it


assert torch.equal(block(x, zero_sublayer), x)  # the input, unchanged
x_in = x.clone().requires_grad_()
block(x_in, zero_sublayer).backward(upstream)
assert torch.equal(x_in.grad, upstream)  # passed down unchanged

# %% [markdown]
# Post-norm has no such path. The same zero sub-layer returns
# $\mathrm{LayerNorm}(x + 0)$, which moves each position's vector to mean
# 0 and standard deviation 1. This $x$ was drawn with mean 1 and
# standard deviation 3, and its 20 positions, 24 numbers each, scatter
# around those. The cell prints the range of the positions' means and
# standard deviations, before and after.


# %%
def post_norm_block(y):
    """Post-norm with the zero sub-layer: LayerNorm(y + 0)."""
    return LayerNorm(24)(y + zero_sublayer(y))


post_norm = post_norm_block(x)  # (4, 5, 24)
for name, tensor in [("x", x), ("post-norm output", post_norm)]:
    means = tensor.mean(-1)  # (4, 5): one per position
    stds = tensor.std(-1, unbiased=False)  # (4, 5), biased, as LayerNorm
    print(
        f"{name:>16}: means {means.min():.2f} to {means.max():.2f},",
        f"standard deviations {stds.min():.2f} to {stds.max():.2f}",
    )
assert torch.allclose(post_norm.mean(-1), torch.zeros(4, 5), atol=1e-5)
position_std = post_norm.std(-1, unbiased=False)
assert torch.allclose(position_std, torch.ones(4, 5), atol=1e-4)

# %% [markdown]
# Nor does the gradient pass through unchanged: it goes back through the
# norm, which among other things divides it by each position's standard
# deviation (about 3 here). What reaches $x$ is about a third the size of
# `upstream`:

# %%
x_in = x.clone().requires_grad_()
post_norm_block(x_in).backward(upstream)
size_ratio = (x_in.grad.norm() / upstream.norm()).item()
print(f"size of the gradient at x / size of upstream: {size_ratio:.2f}")
assert not torch.allclose(x_in.grad, upstream, atol=0.1)
assert 0.2 < size_ratio < 0.45

# %% [markdown]
# An encoder layer has two sub-layers: self-attention over the source, then
# a position-wise feed-forward network. Each sits in its own residual
# block, named for the sub-layer it wraps: `self_attn_block` and
# `ff_block`. Attention takes queries, keys, values and a mask; the
# Attention section below explains them. In self-attention all three come
# from the same sequence, hence `self_attn(y, y, y, mask)`. The `lambda`
# fixes the mask, so that the residual block can call the sub-layer with
# one argument.


# %%
#| export
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


# %% [markdown]
# ## Decoder
#
# The decoder is also a stack of $N$ layers. Each has a third sub-layer
# between the two the encoder has: attention from the target positions to
# the encoder's memory ("source attention"). The paper calls it
# encoder-decoder attention; it is also often called cross-attention.
# Queries come from the target; keys and values come from the memory.
# Self-attention uses the target mask, source attention the source mask;
# the next section explains both.


# %%
#| export
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


# %% [markdown]
# A decoder layer wraps each of its three sub-layers in a
# `SublayerConnection`, as the encoder layer does with its two: masked
# self-attention over the target (with `tgt_mask`), source attention from
# the target to the memory (with `src_mask`), then the feed-forward
# network.


# %%
#| export
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


# %% [markdown]
# ### Masks
#
# A mask says which keys each query may read. Throughout this project a
# mask is boolean and **`True` means "may attend"**, the same convention as
# `torch.nn.functional.scaled_dot_product_attention`. The model takes
# two:
#
# * the **source mask**, shape $(B, 1, S)$: `True` at the real source
#   tokens, `False` at padding. The middle 1 broadcasts over the queries:
#   every query may read the same keys.
# * the **target mask**, shape $(B, T, T)$: query $t$ may read key $u$
#   only if $u \le t$ and $u$ is not padding. It is the *subsequent mask*
#   below combined (`&`) with the target's padding; Part 2 builds both
#   masks from a batch of token ids. A mask that is the same for every
#   sentence may have a leading 1 instead of $B$, which broadcasts over
#   the batch.
#
# The subsequent mask is needed because during training the decoder sees
# the whole target sentence at once, so position $t$ must be kept from
# attending to positions after $t$; otherwise it could read the answer it
# is asked to predict. It is lower-triangular: row $t$ (the query) may look
# at columns $0 \dots t$. It is named for what it hides, the later
# positions; its `True` entries are the ones a query may read.


# %%
#| export
def subsequent_mask(size, device=None):
    """(1, size, size) bool mask, True where key position <= query."""
    # Made on `device` itself: a copy from the CPU would stall a GPU.
    return torch.ones(1, size, size, dtype=torch.bool, device=device).tril()


# %% [markdown]
# For five positions (1 = may attend). The mask's shape is $(1, 5, 5)$;
# `[0]` drops the leading 1 so that it prints as a plain square:

# %%
print(subsequent_mask(5)[0].int())

# %% [markdown]
# It matches the rule written out, key position $u \le$ query position
# $t$:

# %%
position = torch.arange(20)
query_t, key_u = position[:, None], position[None, :]  # (20, 1), (1, 20)
assert torch.equal(subsequent_mask(20)[0], key_u <= query_t)

# %% [markdown]
# The appendix (notebook 06_tools, imported as
# `annotated_transformer_tools`) holds the plotting code; you need not read
# it. `mask_chart` draws the mask it is given, here the one for 20
# positions, and `save_chart` also writes it to `figures/`. Blue cells
# are the pairs the decoder may use: the first position sees only
# itself, the last sees the whole prefix.

# %%
from pathlib import Path

from annotated_transformer_tools import mask_chart, save_chart

chart = mask_chart(subsequent_mask(20)[0])  # (20, 20)
save_chart(chart, "01_subsequent_mask", Path(ROOT, "figures"))

# %% [markdown]
# ## Attention
#
# Attention lets each position read from other positions. The position
# that reads brings a *query* vector; each position it may read offers a
# *key*, to be compared with that query, and a *value*, to hand over. The
# result is an average of the values, weighted by how well the query
# agrees with each key. The Transformer measures agreement with a scaled
# dot product:
#
# $$\mathrm{Attention}(Q, K, V) = \mathrm{softmax}\!\left(
# \frac{QK^\top}{\sqrt{d_k}}\right) V .$$
#
# ![Scaled dot-product attention, step by step](attachment:attention.svg)
#
# Where do $Q$, $K$ and $V$ come from? Each position's vector is turned
# into a query, a key and a value by three learned linear maps (the
# Multi-head attention section below). For now take them as given: one row
# per position.
#
# In code it is a few lines. `mask` is the boolean mask above; a masked
# score gets a weight of zero (the end of this section says how).
#
# A departure from the paper: `attention` can apply dropout to the
# weights themselves. It is inherited from the 2022 tutorial; the paper
# (section 5.4) mentions dropout only on each sub-layer's output and on
# the sums of embeddings and positional encodings, and this project has
# not tested what the weights' dropout changes.


# %%
#| export
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


# %% [markdown]
# PyTorch ships the same function, fused, as `scaled_dot_product_attention`.
# With a causal mask, the two agree:

# %%
torch.manual_seed(0)
B, h, T, d_k = 2, 4, 6, 8
q = torch.randn(B, h, T, d_k)
k = torch.randn(B, h, T, d_k)
v = torch.randn(B, h, T, d_k)
out, weights = attention(q, k, v, mask=subsequent_mask(T))
reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
assert torch.allclose(out, reference, atol=1e-6)
assert (weights.triu(1) == 0).all()  # no weight on future keys

# %% [markdown]
# Why divide by $\sqrt{d_k}$? If the entries of $q$ and $k$ are
# independent, with mean 0 and variance 1, then $q \cdot k$ has
# variance $d_k$: at the paper's $d_k = 64$ ($= 512 / 8$: eight heads, each
# 64 wide; see Multi-head attention) the raw scores have a standard
# deviation of 8, and the softmax tends to put most of the weight on one
# key. Its weights then move less when the scores change: the gradient
# of the weights with respect to the scores, which training needs in
# order to move them, is smaller (about half, in the cell below). The
# division brings the variance back to 1.
#
# That gradient is a matrix for each query, one entry per (weight,
# score) pair; we measure one row of it. The helper below asks autograd
# for the gradient of each query's largest weight with respect to that
# query's scores, and averages its size over the queries. We pick the
# largest weight because a saturated softmax pins it near 1, where a
# small change of the scores barely moves it (the weights near 0 are
# pinned likewise).


# %%
def softmax_gradient_size(scores):
    """scores: (queries, keys). Mean size of the gradient of each row's
    largest softmax weight with respect to the row's scores."""
    scores = scores.clone().requires_grad_()
    largest = scores.softmax(dim=-1).max(dim=-1).values  # (queries,)
    largest.sum().backward()  # each row's gradient lands in its own row
    return scores.grad.norm(dim=-1).mean().item()


# %% [markdown]
# Now 1,000 random queries, each against 10 random keys. For raw and
# scaled scores the cell prints the scores' standard deviation, the
# largest weight (averaged over the queries) and the gradient size; the
# asserts check what the paragraph above says. Expect a standard
# deviation near 8 against 1, a largest weight near 0.9 (almost all on
# one key) against 0.3, and about half the gradient.

# %%
torch.manual_seed(0)
q = torch.randn(1000, 1, 64)  # 1,000 queries, d_k = 64
k = torch.randn(1000, 10, 64)  # 10 keys for each query
raw = (q @ k.transpose(-2, -1)).squeeze(1)  # (1000, 1, 10) to (1000, 10)
scaled = raw / math.sqrt(64)
raw_weights = raw.softmax(dim=-1)
scaled_weights = scaled.softmax(dim=-1)
raw_gradient = softmax_gradient_size(raw)
scaled_gradient = softmax_gradient_size(scaled)
for name, scores, weights, gradient in [
    ("raw", raw, raw_weights, raw_gradient),
    ("scaled", scaled, scaled_weights, scaled_gradient),
]:
    print(
        f"{name:>6}: std {scores.std():.2f},",
        f"largest weight {weights.max(-1).values.mean():.2f} on average,",
        f"gradient size {gradient:.2f}",
    )
print(f"gradient ratio, raw / scaled: {raw_gradient / scaled_gradient:.2f}")
assert 7.5 < raw.std() < 8.5  # sqrt(64) = 8
assert raw_weights.max(-1).values.mean() > 0.8  # mostly on one key
assert scaled_weights.max(-1).values.mean() < 0.5
assert raw_gradient < 0.6 * scaled_gradient  # saturated: small gradient

# %% [markdown]
# A masked position gets `torch.finfo(dtype).min`, the most negative
# number the scores' dtype holds, so its weight after the softmax is
# exactly zero (as long as the row keeps at least one key; our masks
# always do). A fixed $-10^9$ (the 2022 tutorial's choice) does not fit
# every dtype: float16 ends at $\pm 65504$. GPU training often computes
# in float16 (half precision) to save memory and time (06_tools, "Which
# precision"), so the mask value must fit in it. On float16 scores,
# `masked_fill` with $-10^9$ raises an overflow error, while
# `torch.finfo(torch.float16).min` gives the masked key a weight of
# exactly zero:

# %%
scores = torch.zeros(1, 3, dtype=torch.float16)
keep = torch.tensor([[True, True, False]])  # the last key is masked
try:
    scores.masked_fill(~keep, -1e9)
except RuntimeError as error:
    print("masked_fill with -1e9:", error)
else:
    raise AssertionError("-1e9 fitted into float16")
lowest = torch.finfo(torch.float16).min  # -65504
weights = scores.masked_fill(~keep, lowest).softmax(dim=-1)
print("weights with finfo.min:", weights)
assert weights[0, 2] == 0

# %% [markdown]
# ### Multi-head attention
#
# One attention function gives each query a single set of weights, so a
# position must compromise between what it wants to read: say, the
# previous word and the sentence's subject. Multi-head attention runs $h$
# of them in parallel, each on its own learned projection to $d_k =
# d_{\text{model}} / h$ dimensions, so that each head can weigh the
# positions its own way, and concatenates the results:
#
# $$\mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head}_1, \dots,
# \mathrm{head}_h) W^O, \quad \mathrm{head}_i = \mathrm{Attention}(QW_i^Q,
# KW_i^K, VW_i^V).$$
#
# With $h = 8$ and $d_k = 64$ the total cost is about that of one head at
# full width, because $8 \times 64 = 512$: the projections are the same
# $512 \times 512$ matrices as for one full-width head, only cut into
# eight blocks. The four projections $W^Q, W^K, W^V, W^O$ are the layers
# `w_q`, `w_k`, `w_v` and `w_o`. In `w_q`, `w_k` and `w_v` the $h$
# per-head projections sit side by side ($h$ blocks of $d_k$ output
# features); `w_o` reads the concatenated heads ($h$ blocks of $d_k$
# *input* features) and mixes them. The method `split_heads` applies one
# of the first three, then cuts its output into those $h$ blocks, one per
# head.
#
# ![Multi-head attention](attachment:multihead.svg)
#
# `forward` follows the formula. At its core it is:
#
# ```python
# q = self.split_heads(query, self.w_q)  # (B, h, T, d_k)
# k = self.split_heads(key, self.w_k)  # (B, h, S, d_k)
# v = self.split_heads(value, self.w_v)  # (B, h, S, d_k)
# x, weights = attention(q, k, v, mask=mask, dropout=self.dropout)
# x = x.transpose(1, 2).reshape(B, T, h * d_k)  # concatenate the heads
# return self.w_o(x)  # (B, T, d_model)
# ```
#
# The class adds two things: its `if` chooses between two ways of
# computing the same attention (on a first read, follow the `else`
# branch, which calls the `attention` function above), and `heads_mask`
# gives the mask its heads' axis. Both are explained right after the
# class.


# %%
#| export
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


# %% [markdown]
# #### Two details of `forward`, which a first read can skip
#
# A choice of ours, which the 2022 tutorial did not make: `forward`
# usually calls PyTorch's `scaled_dot_product_attention`, one call for
# the whole formula, for which PyTorch picks a fused kernel suited to the
# device; it returns no weights. `forward` calls `attention` above
# instead in two cases, and both paths compute the same formula (the
# checks after the shape walkthrough compare them):
#
# - with `store_attention = True`, to keep the weights in `self.attn`
#   (Part 4 sets it, to draw them);
# - when training with dropout on a CPU. PyTorch's fused CPU kernel takes
#   no dropout, so its routine then falls back to a plain version with
#   the same steps as `attention` (`bench/RESULTS_efficiency.md`,
#   "Attention's dropout outside the fused kernel"). Calling `attention`
#   ourselves lets the dropout be the module's own `self.dropout`, which
#   the appendix swaps for cheaper ones ("A cheaper dropout mask", and
#   "A dropout kernel in C++, on the CPU").
#
# (The fused routine is a plain function, so `.eval()` cannot switch its
# dropout off: `forward` passes `dropout_p=0` when the module is not
# training.)
#
# Every head uses the same mask: `(B, 1, S)` over a source, `(B, T, T)`
# or `(1, T, T)` over a target. `heads_mask` adds the heads' axis. It
# also refuses two masks that the fused routine would take without an
# error and get wrong:
#
# - **A mask without its middle axis**, `(B, S)`. Adding the heads' axis
#   to it, as `heads_mask` does with `unsqueeze(1)`, would give
#   `(B, 1, S)`, which broadcasting reads as `(1, B, 1, S)` against the
#   scores' `(B, h, T, S)`: its sentences would line up against the
#   heads. With 8 sentences and 8 heads, sentence $i$'s mask would
#   silently apply to head $i$ of every sentence. With other sizes it
#   fails with a message about sizes (with one sentence it happens to
#   work).
#   `heads_mask` refuses it, saying which shapes a mask has.
# - **A mask that is not boolean.** The fused routine adds a float mask
#   to the scores instead of hiding positions, so a mask of 0s and 1s
#   would hide nothing. `heads_mask` reads such a mask as the 2022
#   tutorial did, whose examples pass them (`torch.ones(1, 1, 10)`): 0
#   hides, 1 may be attended to. Any other value is refused, such as
#   PyTorch's additive masks of 0 and $-\infty$, which mean the opposite.


# %%
#| export
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


# %% [markdown]
# The cost argument at the start of this section ($8 \times 64 = 512$),
# in numbers: the scores $QK^\top$ take
# $h \cdot T \cdot S \cdot d_k = T \cdot S \cdot d_{\text{model}}$
# multiply-adds whatever $h$ is, and the parameters are the same four
# $d_{\text{model}} \times d_{\text{model}}$ maps. The cell checks the
# parameter half: eight heads and one have equal counts.

# %%
heads_8 = sum(p.numel() for p in MultiHeadedAttention(8, 512).parameters())
heads_1 = sum(p.numel() for p in MultiHeadedAttention(1, 512).parameters())
print(f"h = 8: {heads_8:,} parameters; h = 1: {heads_1:,}")
assert heads_8 == heads_1
assert heads_1 == 4 * (512 * 512 + 512)  # four weights and four biases

# %% [markdown]
# ### Shape walkthrough
#
# To see every reshape, push one batch through a `MultiHeadedAttention` by
# hand: $B=2$ sentences, $T=5$ queries, $S=7$ keys, $d_{\text{model}}=512$,
# $h=8$, so $d_k = 64$. The letters are those of the list at the top of
# this notebook. The cell prints every intermediate shape, and the asserts
# check them.

# %%
torch.manual_seed(0)
B, T, S, d_model, h = 2, 5, 7, 512, 8
mha = MultiHeadedAttention(h, d_model, dropout=0.0).eval()
d_k = mha.d_k
query = torch.randn(B, T, d_model)
memory = torch.randn(B, S, d_model)
src_mask = torch.ones(B, 1, S, dtype=torch.bool)
src_mask[1, 0, 5:] = False  # the second sentence has two pad positions

q = mha.split_heads(query, mha.w_q)  # (B, h, T, d_k)
k = mha.split_heads(memory, mha.w_k)  # (B, h, S, d_k)
v = mha.split_heads(memory, mha.w_v)  # (B, h, S, d_k)
mask = heads_mask(src_mask)  # (B, 1, 1, S): one mask for every head
out, weights = attention(q, k, v, mask=mask)
concat = out.transpose(1, 2).reshape(B, T, h * d_k)  # (B, T, h * d_k)
final = mha.w_o(concat)  # (B, T, d_model)

named = [
    ("q", q),
    ("k", k),
    ("v", v),
    ("weights", weights),
    ("out", out),
    ("concat", concat),
    ("final", final),
]
for name, tensor in named:
    print(f"{name:>7}: {tuple(tensor.shape)}")
assert q.shape == (B, h, T, d_k)
assert k.shape == v.shape == (B, h, S, d_k)
assert weights.shape == (B, h, T, S)
assert out.shape == (B, h, T, d_k)
assert concat.shape == (B, T, h * d_k)
assert final.shape == (B, T, d_model)

# %% [markdown]
# Why does `split_heads` view the projection as $(B, T, h, d_k)$ and then
# transpose, instead of viewing it as $(B, h, T, d_k)$ at once? A small
# example: $T = 3$ positions of $h = 2$ heads with $d_k = 2$ features
# each, numbered so that position $t$ holds $4t, \dots, 4t + 3$. Head 0
# should get the first two features of every position.

# %%
numbered = torch.arange(12).view(1, 3, 4)  # (B, T, h * d_k) = (1, 3, 4)
split = numbered.view(1, 3, 2, 2).transpose(1, 2)  # (B, h, T, d_k)
straight = numbered.view(1, 2, 3, 2)  # (B, h, T, d_k) by a view alone
print("head 0, split as split_heads does:", split[0, 0].tolist())
print("head 0, viewed straight:", straight[0, 0].tolist())
first_two = numbered[0, :, :2]  # (T, d_k): every position's head 0
assert torch.equal(split[0, 0], first_two)
assert not torch.equal(straight[0, 0], first_two)
# The straight view's second "position" of head 0 is position 0's head 1
assert torch.equal(straight[0, 0, 1], numbered[0, 0, 2:])

# %% [markdown]
# And why `forward` joins the heads with `reshape`, not `view`: a
# transpose moves no numbers, it only changes which index reads which
# place in memory. After it, the numbers no longer lie in memory in the
# order of the new shape: the tensor is not *contiguous*. `view` only
# relabels memory, so it refuses such a tensor; `reshape` copies the
# numbers into the new order when it must.

# %%
heads_last = out.transpose(1, 2)  # (B, T, h, d_k), memory still (B, h, T)
assert not heads_last.is_contiguous()
try:
    heads_last.view(B, T, h * d_k)
except RuntimeError as error:
    print("view:", str(error).split(".")[0])
else:
    raise AssertionError("view accepted a tensor that is not contiguous")
joined = heads_last.reshape(B, T, h * d_k)  # (B, T, d_model), a copy
assert joined.is_contiguous()

# %% [markdown]
# The walkthrough, which called `attention`, and the module agree, by
# both of the module's paths: the fused one it takes by default, and the
# one through `attention` it takes when asked to store the weights. The
# two pad positions of the second sentence get exactly zero weight:

# %%
fused_output = mha(query, memory, memory, src_mask)  # (B, T, d_model)
mha.store_attention = True  # now forward calls `attention`
plain_output = mha(query, memory, memory, src_mask)
mha.store_attention = False
assert torch.allclose(fused_output, final, atol=1e-5)
assert torch.allclose(plain_output, final, atol=1e-5)
assert torch.allclose(mha.attn, weights, atol=1e-7)  # the weights kept
assert (weights[1, :, :, 5:] == 0).all()

# %% [markdown]
# `heads_mask` at work: the same padding mask written in float 0s and 1s
# gives the boolean mask's output, and a mask without its middle axis is
# refused with a one-line message.

# %%
float_mask = src_mask.float()  # 1.0 where True, 0.0 at the two pads
out_float = mha(query, memory, memory, float_mask)
assert torch.allclose(out_float, final, atol=1e-5)
try:
    mha(query, memory, memory, src_mask[:, 0])  # (B, S): no middle axis
except ValueError as error:
    print("a (B, S) mask:", error)
else:
    raise AssertionError("a (B, S) mask was accepted")

# %% [markdown]
# ### Where attention is used
#
# The model attends in three places. In **encoder self-attention**,
# queries, keys and values all come from the previous encoder layer, so
# every source position can look at every other (padding excepted).
# **Decoder self-attention** does the same within the target prefix, with
# the subsequent mask so that no position looks ahead. In **source
# attention**, queries come from the decoder and keys and values from the
# encoder's memory: this is where the translation reads the source.

# %% [markdown]
# ## Position-wise feed-forward networks
#
# After attention mixes information *across* positions, each layer applies
# the same two-layer network to every position separately:
#
# $$\mathrm{FFN}(x) = \max(0, xW_1 + b_1) W_2 + b_2 ,$$
#
# with inner width $d_{ff} = 2048$ for $d_{\text{model}} = 512$. In code,
# $W_1, b_1$ and $W_2, b_2$ are the layers `w_1` and `w_2` (this $b_2$ is
# not LayerNorm's `b_2`). Ours also applies dropout between the two
# layers, which the formula leaves out: another departure inherited from
# the 2022 tutorial, like the dropout on attention weights.


# %%
#| export
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


# %% [markdown]
# "Position-wise" means that no position sees another: shuffling the
# positions shuffles the output in the same way.

# %%
torch.manual_seed(0)
ffn = PositionwiseFeedForward(16, 64, dropout=0.0)
x = torch.randn(2, 9, 16)
shuffle = torch.randperm(9)
assert torch.allclose(ffn(x)[:, shuffle], ffn(x[:, shuffle]), atol=1e-6)

# %% [markdown]
# ## Embeddings
#
# Token ids become $d_{\text{model}}$-dimensional vectors through a learned
# table, whose output the paper multiplies by $\sqrt{d_{\text{model}}}$
# (section 3.4, with no reason given; we keep the factor, and "The full
# model" shows what it does to the scale). The paper also
# shares one matrix between the two embeddings and the generator; that
# needs one vocabulary for both languages, which Part 5 builds.


# %%
#| export
class Embeddings(nn.Module):
    """Token embedding table scaled by sqrt(d_model)."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        """(B, T) ids to (B, T, d_model) vectors."""
        return self.lut(x) * math.sqrt(self.d_model)


# %% [markdown]
# A lookup in the table is the same as multiplying a one-hot vector by the
# table's weight matrix; the check computes it that way, scale included:

# %%
emb = Embeddings(16, 11)  # d_model = 16, a vocabulary of 11
ids = torch.randint(0, 11, (2, 5))  # (B, T)
one_hot = F.one_hot(ids, num_classes=11).float()  # (B, T, vocab)
by_matmul = one_hot @ emb.lut.weight * 4  # sqrt(16) = 4
assert torch.allclose(emb(ids), by_matmul)

# %% [markdown]
# ## Positional encoding
#
# Attention by itself ignores order: permute the positions of an encoder
# layer's input, and its output comes out permuted the same way, so no
# position knows where it stands. The cell below checks it for one fresh
# encoder layer, with dropout off and every position visible; a stack of
# such layers behaves the same.

# %%
torch.manual_seed(0)
layer = EncoderLayer(
    16,
    MultiHeadedAttention(4, 16, dropout=0.0),
    PositionwiseFeedForward(16, 32, dropout=0.0),
    dropout=0.0,
).eval()
x = torch.randn(2, 9, 16)  # (B, S, d_model)
everywhere = torch.ones(2, 1, 9, dtype=torch.bool)  # (B, 1, S), no padding
shuffle = torch.randperm(9)
out = layer(x, everywhere)  # (B, S, d_model)
out_of_shuffled = layer(x[:, shuffle], everywhere)
assert torch.allclose(out[:, shuffle], out_of_shuffled, atol=1e-5)

# %% [markdown]
# Word order must therefore come from outside: a fixed signal added to each
# embedding. Dimensions $2i$ and $2i + 1$ hold the sine and the cosine of
# the same angle, which grows with the position $pos$:
#
# $$PE_{(pos, 2i)} = \sin\!\left(pos / 10000^{2i/d_{\text{model}}}\right),
# \qquad PE_{(pos, 2i+1)} = \cos\!\left(pos / 10000^{2i/d_{\text{model}}}
# \right).$$
#
# The first pair ($i = 0$) repeats every $2\pi$ positions, and each next
# pair is slower by the factor $10000^{2/d_{\text{model}}}$. The slowest
# pair, $i = d_{\text{model}}/2 - 1$, repeats every $2\pi \cdot
# 10000^{(d_{\text{model}} - 2)/d_{\text{model}}}$ positions. For
# $d_{\text{model}} = 512$ the factor is about 1.037 and the slowest period
# about 60,600 positions, far more than the 5,000 positions of the table
# below, so even the slowest pair never repeats within it.
#
# We compute the table once, for up to `max_len` = 5,000 positions (`L` in
# the shape tags; far longer than any sentence here). It is kept as a
# buffer: saved with the model, moved with it to a device, but never
# trained.
#
# The angles $pos / 10000^{2i/d_{\text{model}}}$ reach almost 5,000
# radians. There neighbouring float32 numbers are $2^{-11} \approx 0.0005$
# apart, about three decimals. So the angles are computed in float64 and
# rounded to float32 after the sine and cosine.
#
# In the table, sines land in the even columns and cosines in the odd
# ones. `forward` adds the table's first rows to the embeddings and
# applies dropout (0.1 in the paper) to the sum.


# %%
#| export
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


# %% [markdown]
# The float64 detour matters for long inputs only: the error grows with
# the position, and at the lengths of our sentences (under 128 tokens)
# it stays below $10^{-5}$, so you may skip the next cell. Take the
# second sine column (pair $i = 1$) at positions 4,000 to 4,999: sines
# computed from float32 angles are off by more than $10^{-4}$, while the
# stored buffer is off by less than $10^{-7}$; over positions 0 to 127 the
# float32 angles stay within $10^{-5}$.

# %%
table_512 = PositionalEncoding(512, dropout=0.0).pe[0]  # (L, 512)
# Pair i = 1, not i = 0: the angles of i = 0 are the positions themselves,
# whole numbers that float32 stores exactly.
pos = torch.arange(4000, 5000, dtype=torch.float64)  # late positions
slowdown = 10000 ** (2 / 512)  # divides the positions in pair i = 1
exact = torch.sin(pos / slowdown)  # float64 angles
rough = torch.sin(pos.float() / slowdown)  # float32 angles
stored = table_512[4000:5000, 2]  # column 2i = 2: the sine of pair 1
rough_error = (rough.double() - exact).abs().max().item()
stored_error = (stored.double() - exact).abs().max().item()
print(f"largest error with float32 angles: {rough_error:.1e}")
print(f"largest error of the stored buffer: {stored_error:.1e}")
assert rough_error > 1e-4
assert stored_error < 1e-7
short = torch.arange(128, dtype=torch.float64)  # our sentences' positions
short_rough = torch.sin(short.float() / slowdown).double()
short_error = (short_rough - torch.sin(short / slowdown)).abs().max().item()
print(f"the same error under 128 tokens: {short_error:.1e}")
assert short_error < 1e-5

# %% [markdown]
# The paper picks sinusoids because, for any fixed offset $k$,
# $PE_{pos+k}$ is a linear function of $PE_{pos}$: each (sin, cos) pair is
# rotated by the angle $k / 10000^{2i/d}$, whatever $pos$ is. That should
# make relative positions easy to learn. We check it by writing that
# linear function out as one matrix, the same for every position: a
# $2 \times 2$ rotation block for each pair, zeros elsewhere. By the
# angle-addition formulas, the row $(\sin a, \cos a)$ times the block
# $\begin{pmatrix} \cos b & -\sin b \\ \sin b & \cos b \end{pmatrix}$
# is $(\sin(a + b), \cos(a + b))$.

# %%
width, offset = 20, 7  # a 20-dimensional encoding, 7 positions further
table = PositionalEncoding(width, dropout=0.0).pe[0].double()  # (L, 20)
rotation = torch.zeros(width, width, dtype=torch.float64)  # (20, 20)
for i in range(width // 2):  # pair i: columns 2i (sine) and 2i + 1
    b = offset / 10000 ** (2 * i / width)  # the angle pair i turns by
    block = [[math.cos(b), -math.sin(b)], [math.sin(b), math.cos(b)]]
    pair = torch.tensor(block, dtype=torch.float64)  # (2, 2)
    rotation[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = pair
rotated = table[:100] @ rotation  # positions 0..99, (100, 20)
assert torch.allclose(rotated, table[offset : 100 + offset], atol=1e-5)


# %% [markdown]
# Four dimensions of the 20-dimensional table over the first 100
# positions, drawn by `positional_chart` from the appendix.

# %%
from annotated_transformer_tools import positional_chart

table_20 = PositionalEncoding(20, dropout=0.0).pe[0]  # (5000, 20)
chart = positional_chart(table_20[:100], dims=(4, 5, 6, 7))
save_chart(chart, "01_positional_encoding", Path(ROOT, "figures"))

# %% [markdown]
# Dimensions 4 and 5 are a sine and a cosine of the same frequency, a
# quarter period apart; dimensions 6 and 7 oscillate more slowly. With
# every pair turning at its own speed, each position gets its own pattern
# of values.

# %% [markdown]
# ## The full model
#
# `make_model` assembles everything from hyperparameters. The defaults
# are the paper's base model: $N=6$, $d_{\text{model}}=512$, $d_{ff}=2048$,
# $h=8$, dropout $0.1$.
#
# 1. One attention module, one feed-forward network and one positional
#    encoding serve as *prototypes*; `clones` gives every place that needs
#    one its own deep copy, named after the place, so that no two places
#    share weights. The positional encoding has no weights (its table is
#    fixed), so one shared module would compute the same; it is copied
#    anyway, as in the 2022 tutorial, so that the source and target sides
#    each own theirs.
# 2. One encoder layer and one decoder layer are built from those copies;
#    `Encoder` and `Decoder` clone each $N$ times.
# 3. Each language gets an embedding and a positional encoding; the
#    generator maps back to the target vocabulary.
# 4. Every weight matrix, the embedding tables included, is reset with
#    Xavier/Glorot uniform initialization: uniform, in a range set by the
#    matrix's two sizes. The range is chosen so that each layer's output
#    keeps about the scale of its input. The one-dimensional parameters
#    (biases, the norms' gains and biases) keep the values they were made
#    with.


# %%
#| export
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


# %% [markdown]
# Now the factor $\sqrt{d_{\text{model}}}$ of `Embeddings`. `make_model`
# fills each embedding table with Xavier's uniform initialization (step
# 4 above), whose standard deviation for a table of $V$ words is
# $\sqrt{2 / (V + d_{\text{model}})}$. The cell makes the source
# embedding of a base-size model with 8,000 source words, initializes it
# as `make_model` does, and prints three standard deviations: of its
# table, of its output (the table times the factor), and of the
# positional encoding that the output is added to.

# %%
torch.manual_seed(0)
embed = Embeddings(512, 8000)  # d_model = 512, 8,000 source words
nn.init.xavier_uniform_(embed.lut.weight)  # as make_model does
table_std = embed.lut.weight.std().item()
every_word = torch.arange(8000)  # each id once
scaled_std = embed(every_word).std().item()  # the table times sqrt(512)
pe_table = PositionalEncoding(512, dropout=0.0).pe[0]  # (5000, 512)
pe_std = pe_table.std().item()
pe_std_128 = pe_table[:128].std().item()  # where our sentences lie
print(f"embedding table:           std {table_std:.3f}")
print(f"embedding output:          std {scaled_std:.3f}")
print(f"positional encoding table: std {pe_std:.3f}")
print(f"  its first 128 positions: std {pe_std_128:.2f}")
print(f"encoding / table: {pe_std / table_std:.0f}")
print(f"encoding / output: {pe_std / scaled_std:.1f}")
print(f"first 128 positions / output: {pe_std_128 / scaled_std:.1f}")
# Against the closed form: Xavier's std, and that times sqrt(512)
assert abs(table_std - math.sqrt(2 / 8512)) < 1e-4
assert abs(scaled_std - math.sqrt(2 / 8512) * math.sqrt(512)) < 1e-3
# The numbers the paragraph below quotes
assert round(pe_std / table_std) == 45
assert (round(scaled_std, 3), round(pe_std, 3)) == (0.347, 0.695)
assert round(pe_std_128, 2) == 0.62
assert round(pe_std / scaled_std, 1) == 2.0
assert round(pe_std_128 / scaled_std, 1) == 1.8

# %% [markdown]
# Without the factor, the embeddings would be about 45 times smaller than
# the encoding, and their sum would be almost all position. With it, they
# are about half the encoding's scale (0.347 against 0.695): of the same
# order, though not equal. Over the first 128 positions, where our
# sentences lie, the encoding's spread is a little smaller (0.62), so the
# embeddings are a little more than half its scale there (a ratio of 1.8
# instead of 2.0). Xavier's scale depends on the vocabulary size, so
# these ratios do too.


# %% [markdown]
# ### Checking one encoder layer against PyTorch
#
# PyTorch has its own encoder layer, `nn.TransformerEncoderLayer`, which
# is pre-norm with `norm_first=True`. Given our encoder layer's weights,
# it should compute the same. The weights move like this:
# $W^Q, W^K, W^V$ stacked into `in_proj_weight` and `in_proj_bias`,
# $W^O$ into `out_proj`, `w_1`, `w_2` into `linear1`, `linear2`, and the
# norms' `a_2`, `b_2` into `norm1`, `norm2`.
#
# First the two layers. `batch_first=True` makes PyTorch's take
# $(B, S, d_{\text{model}})$ like ours (its default is $(S, B,
# d_{\text{model}})$), and `layer_norm_eps=1e-6` matches our `LayerNorm`
# (PyTorch's default is $10^{-5}$).

# %%
torch.manual_seed(0)
tiny = make_model(11, 11, N=1, d_model=32, d_ff=64, h=4)
our_layer = tiny.encoder.layers[0]
torch_layer = nn.TransformerEncoderLayer(
    d_model=32,
    nhead=4,
    dim_feedforward=64,
    dropout=0.0,
    batch_first=True,
    norm_first=True,
    layer_norm_eps=1e-6,
)

# %% [markdown]
# Then our weights, copied into theirs:

# %%
our_attn = our_layer.self_attn
our_ff = our_layer.feed_forward
with torch.no_grad():
    qkv = [our_attn.w_q, our_attn.w_k, our_attn.w_v]
    in_weight = torch.cat([w.weight for w in qkv])  # (3 d_model, d_model)
    in_bias = torch.cat([w.bias for w in qkv])  # (3 d_model,)
    torch_layer.self_attn.in_proj_weight.copy_(in_weight)
    torch_layer.self_attn.in_proj_bias.copy_(in_bias)
    pairs = [
        (our_attn.w_o, torch_layer.self_attn.out_proj),
        (our_ff.w_1, torch_layer.linear1),
        (our_ff.w_2, torch_layer.linear2),
    ]
    for our_linear, torch_linear in pairs:
        torch_linear.load_state_dict(our_linear.state_dict())
    norms = [
        (our_layer.self_attn_block.norm, torch_layer.norm1),
        (our_layer.ff_block.norm, torch_layer.norm2),
    ]
    for our_norm, torch_norm in norms:
        state = {"weight": our_norm.a_2, "bias": our_norm.b_2}
        torch_norm.load_state_dict(state)

# %% [markdown]
# The second sentence ends in two pad positions. PyTorch takes the padding
# as `src_key_padding_mask`, with the opposite convention (`True` means
# "padding"). Only the real tokens' outputs are compared: nothing ever
# reads the outputs at pad positions, and PyTorch does not promise what it
# puts there. `tests/test_reference.py` makes the same comparison, in
# float64, for the decoder layer (against `nn.TransformerDecoderLayer`)
# and for the whole model (against `nn.Transformer`).

# %%
x = torch.randn(2, 6, 32)  # (B, S, d_model)
real = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])  # (B, S)
our_layer.eval()  # no dropout in either layer
torch_layer.eval()
ours = our_layer(x, real.unsqueeze(1))  # source mask (B, 1, S)
theirs = torch_layer(x, src_key_padding_mask=~real)
assert torch.allclose(ours[real], theirs[real], atol=1e-5)

# %% [markdown]
# ## Counting parameters
#
# Each block's size has a closed form in $d = d_{\text{model}}$ (with
# $d_{ff} = 4d$, as in the paper's $2048 = 4 \times 512$), counting
# weights and biases:
#
# | block | parameters |
# |---|---|
# | multi-head attention: four $d \times d$ maps with biases | $4(d^2 + d)$ |
# | feed-forward: $d \to 4d \to d$ with biases | $8d^2 + 5d$ |
# | layer norm: gain and bias | $2d$ |
# | encoder layer: 1 attention, 1 FFN, 2 norms | $12d^2 + 13d$ |
# | decoder layer: 2 attentions, 1 FFN, 3 norms | $16d^2 + 19d$ |
#
# Six of each plus the two final norms give $168d^2 + 196d$ for the
# stacks. Embeddings add $V_{src} d + V_{tgt} d$, and the generator $V_{tgt}
# d + V_{tgt}$. `count_parameters` counts a shared matrix once (Part 5
# shares one). The table counts a base-size model built on the `meta`
# device (shapes only, no memory) and compares every row with its formula.
# The vocabulary sizes, 8,000 source and 6,000 target words, are round
# numbers close to Part 3's.


# %%
#| export
def count_parameters(module):
    """Number of distinct trainable parameters (shared ones once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


# %%
def closed_form_counts(d, V_src, V_tgt, N=6):
    """Parameter counts predicted by the formulas above (d_ff = 4d)."""
    stacks = N * (12 * d * d + 13 * d) + N * (16 * d * d + 19 * d) + 4 * d
    return stacks + V_src * d + 2 * V_tgt * d + V_tgt


d, V_src, V_tgt = 512, 8000, 6000
with torch.device("meta"):  # shapes only, no memory
    base = make_model(V_src, V_tgt, d_model=d, d_ff=4 * d)
enc = base.encoder.layers[0]
both_stacks = nn.ModuleList([base.encoder, base.decoder])
rows = [  # (part, module, formula)
    ("one multi-head attention", enc.self_attn, 4 * (d * d + d)),
    ("one feed-forward network", enc.feed_forward, 8 * d * d + 5 * d),
    ("one layer norm", base.encoder.norm, 2 * d),
    ("one encoder layer", enc, 12 * d * d + 13 * d),
    ("one decoder layer", base.decoder.layers[0], 16 * d * d + 19 * d),
    ("both stacks", both_stacks, 168 * d * d + 196 * d),
    ("whole model", base, closed_form_counts(d, V_src, V_tgt)),
]
print(f"{'':26}{'counted':>12}{'formula':>12}")
for part, module, formula in rows:
    counted = count_parameters(module)
    # `:>12,` right-aligns in 12 columns with thousands separators, as
    # in the "both stacks" row's 44,140,544
    print(f"{part:26}{counted:>12,}{formula:>12,}")
    assert counted == formula, part

# %% [markdown]
# Every row of the table matches its formula (the loop asserts it).
#
# The paper's setup instead has one shared vocabulary of 37,000 tokens and
# one matrix shared by both embeddings and the generator (as Part 5
# does). The stacks' 44.1M plus $37{,}000 \cdot 512$ for the matrix plus
# the generator's 37,000 biases make about 63.1M. The paper reports 65M
# for its base model; we cannot account for the other 1.9M from what
# the paper says. Check our count:

# %%
with torch.device("meta"):  # shapes only
    paper_setup = make_model(37_000, 37_000)
# src_embed is nn.Sequential(Embeddings, PositionalEncoding), which
# indexes like a list: [0] is the Embeddings, .lut its table.
shared = paper_setup.src_embed[0].lut.weight
paper_setup.tgt_embed[0].lut.weight = shared
paper_setup.generator.proj.weight = shared
assert round(count_parameters(paper_setup) / 1e6, 1) == 63.1

# %% [markdown]
# ## The whole model, end to end
#
# A last check runs a small untrained model on a batch. Its predictions
# are arbitrary, but two promises must already hold: the output is a
# distribution over the vocabulary at every target position, and, thanks
# to the subsequent mask, rewriting the last two target tokens changes
# nothing at the positions before them. (It does change the outputs at
# the last two positions, which read the new tokens.)

# %%
torch.manual_seed(0)
model = make_model(11, 11, N=2, d_model=64, d_ff=128, h=4).eval()
# Ids from 1: in Part 2's copy task, which uses this vocabulary of 11,
# id 0 is the padding token. There is no padding here. The target's ids
# stop at 9, so that adding 1 below gives another id of the vocabulary.
src = torch.randint(1, 11, (2, 7))  # (B, S): ids 1 to 10
tgt = torch.randint(1, 10, (2, 6))  # (B, T): ids 1 to 9
src_mask = torch.ones(2, 1, 7, dtype=torch.bool)  # (B, 1, S)
tgt_mask = subsequent_mask(6)  # (1, T, T), shared by the batch
hidden = model(src, tgt, src_mask, tgt_mask)  # (B, T, d_model)
logp = model.generator(hidden)  # (B, T, vocab)
edited = tgt.clone()
edited[:, 4:] = tgt[:, 4:] + 1  # every id from position 4 on changes
logp_edited = model.generator(model(src, edited, src_mask, tgt_mask))
assert torch.allclose(logp.exp().sum(-1), torch.ones(2, 6))
assert torch.allclose(logp[:, :4], logp_edited[:, :4], atol=1e-5)
assert not torch.allclose(logp[:, 4:], logp_edited[:, 4:])

# %% [markdown]
# Next, in Part 2: batches and masks, the optimizer schedule, label
# smoothing, and a first model that learns to copy its input.
