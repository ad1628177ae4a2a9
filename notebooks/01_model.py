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
# You Need* (2017), one component per cell, in the order the data flows
# through it. Every cell marked `#| export` is also copied into
# `the_annotated_transformer.py`, so the code you read here is the code you
# import later.
#
# Where this version departs from the paper or from the 2022 Annotated
# Transformer, a one-sentence note says so and why.

# %%
# Setup: find the repository (and fetch it when running on Colab).
import os
import subprocess
import sys
from pathlib import Path

REPO_URL = "https://github.com/annotated-transformer/done-right"
if "google.colab" in sys.modules and not Path("done-right").exists():
    subprocess.run(["git", "clone", "--depth=1", REPO_URL], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "-r",
            "done-right/requirements.txt",
        ],
        check=True,
    )
    os.chdir("done-right/notebooks")
ROOT = next(
    p
    for p in [Path.cwd(), *Path.cwd().parents]
    if (p / "the_annotated_transformer.py").exists()
)
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT)
AT_SIZE = os.environ.get("AT_SIZE", "full")  # "ci" runs in seconds

# %%
#| export
import copy
import math
from pathlib import Path

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
# `EncoderDecoder` only wires the five parts together; each part is defined
# below.


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
        return self.encoder(self.src_embed(src), src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        """Target prefix ids (B, T) to hidden states (B, T, d_model)."""
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)


# %% [markdown]
# The decoder's hidden states become next-token probabilities through one
# linear map to the vocabulary and a log-softmax. We return
# log-probabilities because the loss and beam search both add them up.


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
# The encoder is a stack of $N = 6$ identical layers. `clones` makes $N$
# independent deep copies of one module, so that every layer gets its own
# weights.


# %%
#| export
def clones(module, N):
    """N independent deep copies of a module, in a ModuleList."""
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


# %%
#| export
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
# **Our choice.** The 2022 tutorial used the *unbiased* standard deviation
# (dividing by $d-1$) and added $\epsilon$ to the standard deviation rather
# than to the variance. We use the standard form above, which is what
# `torch.nn.LayerNorm` computes, so that a test can compare the two
# directly. The parameter names `a_2` and `b_2` stay as they were, so
# checkpoints from the 2022 code still load (their outputs differ by well
# under 1%, from the $d/(d-1)$ factor).


# %%
#| export
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


# %% [markdown]
# ### Residual connections, pre-norm
#
# Every sub-layer (attention or feed-forward) sits inside a residual
# connection. The paper applies the norm *after* the addition
# ("post-norm"): $\mathrm{LayerNorm}(x + \mathrm{Sublayer}(x))$. Like the
# 2022 tutorial, we apply it *before* the sub-layer and leave the residual
# path untouched ("pre-norm"): $x + \mathrm{Dropout}(\mathrm{Sublayer}(
# \mathrm{LayerNorm}(x)))$. Pre-norm keeps an identity path from the input
# to the output of the whole stack, so gradients reach the lower layers
# undiminished and training is stable with less careful warm-up (Xiong et
# al., 2020). The cost is one extra norm at the top of each stack, which is
# why `Encoder` and `Decoder` end with a `LayerNorm`.


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
# An encoder layer has two sub-layers: self-attention over the source, then
# a position-wise feed-forward network.


# %%
#| export
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


# %% [markdown]
# ## Decoder
#
# The decoder is also a stack of $N$ layers. Each has a third sub-layer
# between the two the encoder has: attention from the target positions to
# the encoder's memory ("source attention").


# %%
#| export
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


# %%
#| export
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


# %% [markdown]
# ### The subsequent mask
#
# During training the decoder sees the whole target sentence at once, so
# position $t$ must be kept from attending to positions after $t$;
# otherwise it could read the answer it is asked to predict. The mask is
# lower-triangular: row $t$ (the query) may look at columns $0 \dots t$.
# Throughout this project a mask is boolean and **`True` means "may
# attend"**, the same convention as `torch.nn.functional.
# scaled_dot_product_attention`.


# %%
#| export
def subsequent_mask(size):
    """(1, size, size) bool mask, True where key position <= query."""
    upper = torch.triu(torch.ones(1, size, size, dtype=torch.bool), 1)
    return ~upper


# %%
#| export
def save_chart(chart, name, folder="figures"):
    """Show a chart, and also write it as static SVG and PNG files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chart.save(str(folder / f"{name}.svg"))
    chart.save(str(folder / f"{name}.png"), scale_factor=1.5)
    return chart


# %%
def mask_chart(size=20):
    """Altair heat map of subsequent_mask(size)."""
    import altair as alt
    import pandas as pd

    mask = subsequent_mask(size)[0]
    df = pd.DataFrame(
        [
            {"query (row)": i, "key (column)": j, "allowed": bool(mask[i, j])}
            for i in range(size)
            for j in range(size)
        ]
    )
    return (
        alt.Chart(df)
        .mark_rect()
        .encode(
            x="key (column):O",
            y="query (row):O",
            color=alt.Color(
                "allowed:N",
                scale=alt.Scale(
                    domain=[False, True], range=["#f2f2f2", "#3b6ea8"]
                ),
            ),
            tooltip=["query (row)", "key (column)", "allowed"],
        )
        .properties(title="subsequent_mask(20)", width=260, height=260)
    )


save_chart(mask_chart(), "01_subsequent_mask", ROOT / "figures")

# %% [markdown]
# Blue cells are the pairs the decoder may use: the first position sees only
# itself, the last sees the whole prefix. Every chart in this project is
# also saved as SVG and PNG in `figures/`, rendered offline by
# vl-convert, so it can be checked without a browser.

# %% [markdown]
# ## Attention
#
# An attention function maps a *query* and a set of *key*–*value* pairs to
# a weighted sum of the values, with weights given by how well the query
# matches each key. The Transformer uses *scaled dot-product attention*:
#
# $$\mathrm{Attention}(Q, K, V) = \mathrm{softmax}\!\left(
# \frac{QK^\top}{\sqrt{d_k}}\right) V .$$
#
# Dividing by $\sqrt{d_k}$ keeps the dot products from growing with the
# dimension: for unit-variance entries, $q \cdot k$ has variance $d_k$, and
# large logits would push the softmax into regions where its gradient
# vanishes.
#
# Masked positions get the most negative number the score's dtype can hold,
# rather than the 2022 tutorial's `-1e9`, which is not representable in
# float16 (its range ends at ±65504) and so turned into `-inf` and NaN under
# mixed precision.


# %%
#| export
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


# %% [markdown]
# ### Multi-head attention
#
# One attention function would average everything a position wants to look
# at into a single weighted sum. Multi-head attention runs $h$ of them in
# parallel, each on its own learned projection to $d_k = d_{\text{model}}
# / h$ dimensions, and concatenates the results:
#
# $$\mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head}_1, \dots,
# \mathrm{head}_h) W^O, \quad \mathrm{head}_i = \mathrm{Attention}(QW_i^Q,
# KW_i^K, VW_i^V).$$
#
# With $h = 8$ and $d_k = 64$ the total cost is about that of one head at
# full width. The four projections $W^Q, W^K, W^V, W^O$ are the four
# `linears`; the $h$ per-head projections live side by side inside each.
#
# Two differences from 2022: during training we call PyTorch's fused
# `scaled_dot_product_attention`, which computes the same thing faster and
# with less memory but does not hand back the weights; and the weights are
# kept in `self.attn` only when you ask for them by setting
# `store_attention = True` (notebook 04 does), instead of on every forward
# pass.


# %%
#| export
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


# %% [markdown]
# ### Shape walkthrough
#
# To see every reshape, push one concrete batch through a fresh
# `MultiHeadedAttention` by hand: $B=2$ sentences, $T=5$ query positions,
# $S=7$ key positions, $d_{\text{model}}=512$, $h=8$. Letters follow one
# scheme across the project: `B` batch, `h` heads, `T` target or query
# length, `S` source or key length, `d_k` per-head width.

# %%
torch.manual_seed(0)
B, T, S, d_model, h = 2, 5, 7, 512, 8
mha = MultiHeadedAttention(h, d_model, dropout=0.0).eval()
query = torch.randn(B, T, d_model)
memory = torch.randn(B, S, d_model)
src_mask = torch.ones(B, 1, S, dtype=torch.bool)
src_mask[1, 0, 5:] = False  # the second sentence has two pad positions

q = mha.split_heads(query, mha.linears[0])
k = mha.split_heads(memory, mha.linears[1])
v = mha.split_heads(memory, mha.linears[2])
scores = q @ k.transpose(-2, -1) / math.sqrt(mha.d_k)
out, weights = attention(q, k, v, mask=src_mask.unsqueeze(1))
concat = out.transpose(1, 2).reshape(B, T, h * mha.d_k)
final = mha.linears[3](concat)
for name, t, tag in [
    ("query", query, "(B, T, d_model)"),
    ("memory", memory, "(B, S, d_model)"),
    ("src_mask", src_mask, "(B, 1, S)"),
    ("q = split_heads(query)", q, "(B, h, T, d_k)"),
    ("k = split_heads(memory)", k, "(B, h, S, d_k)"),
    ("v = split_heads(memory)", v, "(B, h, S, d_k)"),
    ("scores = q k^T / sqrt(d_k)", scores, "(B, h, T, S)"),
    ("weights = softmax(scores)", weights, "(B, h, T, S)"),
    ("out = weights @ v", out, "(B, h, T, d_k)"),
    ("concat heads", concat, "(B, T, h * d_k)"),
    ("final = W^O concat", final, "(B, T, d_model)"),
]:
    print(f"{name:28s} {str(tuple(t.shape)):18s} {tag}")

# %% [markdown]
# The walkthrough and the module agree, and the two pad positions of the
# second sentence get exactly zero weight:

# %%
print(
    "module output matches:",
    torch.allclose(mha(query, memory, memory, src_mask), final, atol=1e-5),
)
print("weight on pad keys:", weights[1, :, :, 5:].abs().max().item())

# %% [markdown]
# ### Where attention is used
#
# The model uses multi-head attention in three places:
#
# 1. **Encoder self-attention**: queries, keys and values all come from the
#    previous encoder layer, so each source position can look at every
#    other source position (pad positions excepted).
# 2. **Decoder self-attention**: the same within the target prefix, with
#    the subsequent mask so that no position looks ahead.
# 3. **Source attention** in the decoder: queries come from the decoder,
#    keys and values from the encoder's memory. This is where the
#    translation reads the source.

# %% [markdown]
# ## Position-wise feed-forward networks
#
# After attention mixes information *across* positions, each layer applies
# the same two-layer network to every position separately:
#
# $$\mathrm{FFN}(x) = \max(0, xW_1 + b_1) W_2 + b_2 ,$$
#
# with inner width $d_{ff} = 2048$ for $d_{\text{model}} = 512$.


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
# ## Embeddings
#
# Token ids become $d_{\text{model}}$-dimensional vectors through a learned
# table. The paper multiplies the embedding by $\sqrt{d_{\text{model}}}$,
# which brings Xavier-initialized rows (entries of size about
# $1/\sqrt{d_{\text{model}}}$) up to the scale of the positional encoding
# added next. The paper also shares one matrix between the two embeddings
# and the generator; `make_model(..., tie_embeddings=True)` below does that
# when both languages use one vocabulary (notebook 05 trains such a model).


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
# ## Positional encoding
#
# Attention by itself ignores order: permuting the source permutes the
# memory the same way. The model learns word order from a fixed signal
# added to each embedding, a set of sinusoids with wavelengths in a
# geometric progression from $2\pi$ to $10000 \cdot 2\pi$:
#
# $$PE_{(pos, 2i)} = \sin\!\left(pos / 10000^{2i/d_{\text{model}}}\right),
# \qquad PE_{(pos, 2i+1)} = \cos\!\left(pos / 10000^{2i/d_{\text{model}}}
# \right).$$
#
# For any fixed offset $k$, $PE_{pos+k}$ is a linear function (a rotation
# in each sin/cos pair) of $PE_{pos}$, which the paper offers as the reason
# relative positions should be easy to learn. Dropout (0.1) is applied to
# the sum of embedding and encoding.


# %%
#| export
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


# %%
def positional_chart(d_model=20, length=100, dims=(4, 5, 6, 7)):
    """Line chart of a few dimensions of the positional encoding."""
    import altair as alt
    import pandas as pd

    pe = PositionalEncoding(d_model, dropout=0.0).pe[0, :length]
    df = pd.DataFrame(
        [
            {"position": p, "value": float(pe[p, d]), "dimension": f"dim {d}"}
            for d in dims
            for p in range(length)
        ]
    )
    return (
        alt.Chart(df)
        .mark_line()
        .encode(
            x="position:Q",
            y="value:Q",
            color="dimension:N",
            tooltip=["dimension", "position", "value"],
        )
        .properties(title="Positional encoding, d_model = 20", width=480)
    )


save_chart(positional_chart(), "01_positional_encoding", ROOT / "figures")

# %% [markdown]
# Dimensions 4 and 5 are a sine and a cosine of the same frequency, a
# quarter period apart; dimensions 6 and 7 oscillate more slowly. Each
# position is thus marked by a unique mix of phases.

# %% [markdown]
# ## The full model
#
# `make_model` assembles everything from hyperparameters. The defaults are
# the paper's base model: $N=6$, $d_{\text{model}}=512$, $d_{ff}=2048$,
# $h=8$, dropout $0.1$. Weights with two or more dimensions start from
# Xavier/Glorot uniform initialization, as in the 2022 tutorial.
#
# `tie_embeddings=True` makes the source embedding, the target embedding and
# the generator's projection share one matrix (paper, section 3.4). It
# needs one vocabulary for both languages.


# %%
#| export
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


# %% [markdown]
# ## Counting parameters
#
# Each block's size has a closed form in $d = d_{\text{model}}$ (with
# $d_{ff} = 4d$), counting weights and biases:
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
# d + V_{tgt}$. With one shared vocabulary of size $V$ and three-way tying,
# the total is $168d^2 + 196d + Vd + V$; for $d = 512$ that is
# $44{,}140{,}544 + 513\,V$. The table below is computed from real models
# and checked against these formulas.


# %%
#| export
def count_parameters(module):
    """Number of distinct trainable parameters (shared ones once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


# %%
def closed_form_counts(d, V_src, V_tgt, N=6, tied=False):
    """Parameter counts predicted by the formulas above (d_ff = 4d)."""
    stacks = N * (12 * d * d + 13 * d) + N * (16 * d * d + 19 * d) + 4 * d
    if tied:
        return stacks + V_tgt * d + V_tgt
    return stacks + V_src * d + 2 * V_tgt * d + V_tgt


def parameter_table(V_src=8000, V_tgt=6000, V_shared=10000):
    """Real and closed-form counts for the base model's parts."""
    import pandas as pd

    d = 512
    base = make_model(V_src, V_tgt)
    tied = make_model(V_shared, V_shared, tie_embeddings=True)
    rows = [
        (
            "one multi-head attention",
            base.encoder.layers[0].self_attn,
            4 * (d * d + d),
        ),
        (
            "one feed-forward network",
            base.encoder.layers[0].feed_forward,
            8 * d * d + 5 * d,
        ),
        ("one layer norm", base.encoder.norm, 2 * d),
        ("one encoder layer", base.encoder.layers[0], 12 * d * d + 13 * d),
        ("one decoder layer", base.decoder.layers[0], 16 * d * d + 19 * d),
        (
            "encoder + decoder stacks",
            nn.ModuleList([base.encoder, base.decoder]),
            168 * d * d + 196 * d,
        ),
        (
            f"whole model, untied (V_src={V_src}, V_tgt={V_tgt})",
            base,
            closed_form_counts(d, V_src, V_tgt),
        ),
        (
            f"whole model, tied (V={V_shared})",
            tied,
            closed_form_counts(d, V_shared, V_shared, tied=True),
        ),
    ]
    return pd.DataFrame(
        [
            {"part": name, "counted": count_parameters(m), "formula": f}
            for name, m, f in rows
        ]
    ).assign(match=lambda df: df.counted == df.formula)


parameter_table()

# %% [markdown]
# Every row matches. With tying, one 10,000-row vocabulary costs 5.1M
# parameters instead of the 15.4M that three separate matrices would.

# %% [markdown]
# ## Inference with an untrained model
#
# A quick end-to-end check: build a small model, encode a source sentence of
# ten token ids, and let the decoder pick the most likely next token nine
# times, feeding each choice back in. An untrained model's output is
# arbitrary (it tends to repeat one token) but the plumbing, masks and
# shapes all work. The seed makes the printed ids the same on every run.


# %%
def untrained_inference_example(seed):
    """Greedy-decode 9 tokens from a random small model."""
    torch.manual_seed(seed)
    model = make_model(11, 11, N=2).eval()
    src = torch.arange(1, 11).unsqueeze(0)  # (1, 10)
    src_mask = torch.ones(1, 1, 10, dtype=torch.bool)
    with torch.no_grad():
        memory = model.encode(src, src_mask)  # (1, 10, d_model)
        ys = torch.zeros(1, 1, dtype=torch.long)  # start symbol 0
        for _ in range(9):
            tgt_mask = subsequent_mask(ys.size(1))
            out = model.decode(memory, src_mask, ys, tgt_mask)
            next_word = model.generator(out[:, -1]).argmax(dim=-1)  # (1,)
            ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)
    return ys[0].tolist()


for seed in range(3):
    print(f"seed {seed}: {untrained_inference_example(seed)}")

# %% [markdown]
# Next, in `02_training.py`: batches and masks, the optimizer schedule,
# label smoothing, and a first model that learns to copy its input.
