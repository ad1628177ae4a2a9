# ---
# jupyter:
#   accelerator: GPU
#   colab:
#     gpuType: T4
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
# # Part 4: Looking inside attention
#
# Every attention layer of Part 1 computes, for each query position, a
# probability distribution over the key positions it may see:
# $\mathrm{softmax}(QK^\top / \sqrt{d_k})$. In a trained translator these
# distributions are where the model has learned to look, and they can be
# drawn. This part:
#
# * records the weights of one validation sentence and draws the three
#   kinds of attention, in every layer and every head: the encoder's
#   self-attention over the German source, the decoder's masked
#   self-attention over the English written so far, and the decoder's
#   attention to the source;
# * checks that the drawn weights are the ones the model uses;
# * describes each head, over many sentences, with a few numbers: how
#   spread out its attention is, how far from the diagonal it looks, and
#   where its weight goes;
# * puts the decoder's attention to the source to work: the German word
#   that an `<unk>` read most is copied in its place.
#
# The same code draws Part 3's model and the small stand-in that this
# page trains when it finds no trained model: it reads the number of
# layers and heads from the model.

# %% [markdown]
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/annotated-transformer/done-right/blob/main/notebooks/04_attention.ipynb)
#
# Colab opens this notebook on a GPU runtime (a T4), which it asks for;
# if none was free, choose one before going on: Runtime → Change
# runtime type.

# %% cellView="form"
# @title Setup (on Colab: clone, install) { display-mode: "form" }
# Setup only; nothing to learn here. On Colab: clone the repository, then
# install what the notebooks need. Elsewhere: use the checkout this
# notebook sits in.
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
# CI, the project's automated test run, sets AT_SIZE=ci to run everything
# small; otherwise the page runs at full size.
AT_SIZE = os.environ.get("AT_SIZE", "full")

# %%
#| export
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

# %%
import math

import pandas as pd

from the_annotated_transformer import BOS, EOS, PAD, UNK, Batch
from the_annotated_transformer import MultiHeadedAttention, batch_greedy_decode
from the_annotated_transformer import load_tokenizers
from the_annotated_transformer import make_model, read_multi30k
from the_annotated_transformer import subsequent_mask, tokenize

# From the appendix (notebook 06, the machinery behind the lessons):
# the data, the trained or stand-in model, the charts.
from annotated_transformer_tools import describe_checkpoint, find_or_train
from annotated_transformer_tools import download_multi30k, get_config
from annotated_transformer_tools import load_trained_model, load_vocab
from annotated_transformer_tools import translate_batch
from annotated_transformer_tools import (
    attention_chart,
    attention_summary_chart,
)
from annotated_transformer_tools import save_chart

FIGURES = os.path.join(ROOT, "figures")

# %% [markdown]
# ## Recording the weights
#
# Every `MultiHeadedAttention` of Part 1 has a `store_attention` flag,
# off by default. (Off, a layer usually calls PyTorch's fused
# `scaled_dot_product_attention`, one optimized call that never hands
# back the weights.) When it is on, the layer computes the softmax
# explicitly and keeps it in `self.attn`, shape `(B, h, T, S)`: one row
# per query position, one column per key position. `record_attention`
# turns the flag on for every attention layer of a model. When the block
# ends, normally or through an exception, it puts each flag back as it
# was and drops the stored tensors, so that no later forward pass keeps
# weights by accident.


# %%
#| export
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


# %% [markdown]
# ## One sentence, every map
#
# `attention_maps` runs one forward pass over a sentence pair and collects
# the weights of every layer into an `AttentionMaps`: three tensors of
# shape `(N, h, rows, cols)`, one per kind of attention. Here `N` is the
# number of layers (not the batch: there is one sentence), `h` the heads
# of each layer.
#
# | kind | queries (rows) | keys (columns) | shape |
# |---|---|---|---|
# | encoder self | source tokens | source tokens | `(N, h, S, S)` |
# | decoder self | decoder inputs | decoder inputs | `(N, h, T, T)` |
# | decoder source | decoder inputs | source tokens | `(N, h, T, S)` |
#
# A kind is one of these three strings everywhere below, and
# `ATTENTION_KINDS` maps each to the field of `AttentionMaps` (next cell
# but one) that holds its weights.


# %%
#| export
ATTENTION_KINDS = {
    "encoder self": "encoder_self",
    "decoder self": "decoder_self",
    "decoder source": "decoder_src",
}


# %% [markdown]
# `AttentionMaps` keeps the weights of one sentence with its token ids and
# labels.


# %%
#| export
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


# %% [markdown]
# The decoder runs with teacher forcing on a given target
# `<s> y_1 ... </s>`: its inputs are every token but the last, and row $t$
# is the position that predicts token $t+1$, kept in `next_tokens` for the
# tooltips. (Without a target, it first translates greedily and records
# that translation; this page always passes the reference.) The decoder
# is *causal*: each position sees only itself and the positions before it.
# So one pass over the finished translation gives the same weights, up to
# rounding, as it used while writing it one token at a time (checked
# below for the decoder–source weights, in "Can we trust these
# pictures?").
#
# The forward pass builds its masks exactly as training does
# (`Batch.make_std_mask` hides padding and the future) and runs the model
# once inside `record_attention`. Padding keys stay in the maps, as
# columns of exact zeros. `attention_maps` itself switches the
# model to `eval()` for the pass, without autograd, and restores its mode
# afterwards.


# %%
#| export
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


# %%
#| export
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


# %% [markdown]
# ## A trained model
#
# An untrained model's maps are nearly flat ("Over many sentences",
# below, measures it), so we read a translator of Part 3's shape: $N=3$
# layers, $d_{model}=256$, $h=4$ heads and word vocabularies. The page
# loads the `cpu` model that `make train` writes
# (`checkpoints/cpu/final.pt`), else the `quick` model that Part 3
# trains (`checkpoints/quick/final.pt`). If neither exists, the
# appendix's `find_or_train` trains one here: the `quick` model on an
# NVIDIA (CUDA) GPU (under two minutes on an H100, where all of
# notebook 03 took 88 s, `docs/gpu.md`; a T4 was not measured), else a
# small stand-in, in seconds. How long each takes on which machine is in
# Part 3's "The reference run" and in the appendix's (notebook 06) "A
# trained model, or a small one trained now".
#
# **On a Mac, or on a CPU, without a trained model**, this page trains
# the stand-in. It shows the machinery, not language: its charts will
# not match what the prose says about "brown", "black" and the two dogs,
# and every Check below prints "stand-in loaded: this claim is checked
# only with a trained model" instead of asserting. The picture on record
# (under "Decoder–source attention") shows what a trained model does. To
# get one, run Part 3 first (or `make notebook`), then this page again.
# On Colab, pick a GPU runtime first to get the `quick` model; each new
# runtime trains it again, unless you kept Part 3's model
# (`docs/gpu.md`, "Keeping a model on Colab").
#
# Three models appear on this page; keep them apart:
#
# - **on record**: the `cpu` preset (which `make train` trains for 18
#   epochs) stopped after 10 epochs, trained in float32 on a CPU
#   (`results/site_full.md`). It is behind the picture
#   `docs/trained_attention.png` and behind every number of the last
#   section, "Putting attention to work". A number the prose quotes is
#   this model's unless the prose names another.
# - **`quick` runs**: the model that Part 3 trains. The figures of the
#   parking Check below are what two runs, trained in bf16, printed
#   (`results/make_notebook.md`).
# - **the model loaded here**: the `cpu` or `quick` model this page
#   finds, else the stand-in. Every chart and every number that a cell
#   of this page prints is this model's, and may differ from both above.
#
# Words this page uses throughout:
#
# - **stand-in**: the small model trained here in seconds when no
#   trained one is found;
# - **Check**: a paragraph stating a claim about a trained model's heads;
#   its cell asserts it only when a `cpu` or `quick` model is loaded, and
#   with the stand-in prints that it did not check it. These claims assume
#   that the drawn weights are the ones the model uses; "Can we trust
#   these pictures?", after the charts, verifies that;
# - **See, ...**: a paragraph whose cell checks the code itself; its
#   asserts run with any model.
#
# `load_trained_model` rebuilds the model with dropout 0 and returns it
# in `eval()` mode, so every forward pass of it below, including the
# checks that call the model directly, runs without dropout. Its
# `device` argument is a PyTorch device, not a preset: we pass `"cpu"`
# whatever the machine, since one sentence at a time is quick there and
# every reader then runs the checks below in the same float32
# arithmetic.


# %%
download_multi30k()  # verifies the files, fetching them on first use
tokenizers = load_tokenizers()
spacy_de, spacy_en = tokenizers
folder = f"{ROOT}/checkpoints/ci-attention"
stand_in = get_config("ci", N=2, h=4, checkpoint_dir=folder)
vocabs = load_vocab(*tokenizers)
checkpoint = find_or_train(
    ["cpu", "quick"], stand_in, vocabs, tokenizers, ROOT, AT_SIZE
)
# device="cpu" names the device, not the preset; dropout 0, eval mode
loaded = load_trained_model(checkpoint, device="cpu")
model, vocab_src, vocab_tgt, config = loaded
N, h = len(model.encoder.layers), model.encoder.layers[0].self_attn.h
trained = config.preset in ("cpu", "quick")  # not the stand-in
SKIPPED = "stand-in loaded: this claim is checked only with a trained model"
print("model:", describe_checkpoint(checkpoint))
if not trained:
    print("a stand-in, trained here in seconds: the charts below show the")
    print("machinery, not language, and its translations are not English")

# %% [markdown]
# The sentence is validation pair 6 (counting from 0),
#
# > Ein brauner Hund rennt dem schwarzen Hund hinterher.
# >
# > A brown dog is running after the black dog.
#
# which has one word twice on each side ("Hund", "dog"), so we can see
# whether the two copies are told apart. The decoder reads the reference
# translation, as in training, so every chart has the same, correct
# English rows whatever the model; the model's own greedy translation is
# printed for comparison, with its `<unk>` tokens kept
# (`replace_unk=False`; the end of this page explains the replacement
# that `translate_batch` does by default).

# %%
val = read_multi30k("val")
de, en = val[6]
src = torch.tensor([BOS, *vocab_src(tokenize(de, spacy_de)), EOS])  # (S,)
tgt = torch.tensor([BOS, *vocab_tgt(tokenize(en, spacy_en)), EOS])  # (T+1,)
maps = attention_maps(model, src, tgt, vocab_src, vocab_tgt)
hypothesis = translate_batch(
    model, [de], spacy_de, vocab_src, vocab_tgt, replace_unk=False
)
print(f"source:     {de}\nreference:  {en}\nmodel:      {hypothesis[0]}\n")
print({k: tuple(getattr(maps, f).shape) for k, f in ATTENTION_KINDS.items()})

# %% [markdown]
# ## Drawing the maps
#
# `attention_chart` (from the appendix's "Charts" section) draws one kind of
# attention as one heat map per head, side by side, with a menu that picks the
# layer, the last one by default. Each row is a query position and each column
# a key position, labelled with their tokens; the darker a cell, the larger its
# weight, from white (0) to dark blue (1). Layers and heads are numbered from 1
# in the charts (layer 1 is the one nearest the embeddings), while the tensors
# index them from 0. Hovering over a cell shows its tokens and its weight.
# `save_chart` (appendix) shows each chart, and also saves it under `figures/`.


# %% [markdown]
# ### Encoder self-attention
#
# Rows and columns are both source positions. A dark diagonal is a head
# that keeps each token to itself; a dark band just off it looks at a
# neighbour; a dark column is a token that many positions read.

# %%
save_chart(attention_chart(maps, "encoder self"), "04_encoder_self", FIGURES)

# %% [markdown]
# ### Decoder self-attention
#
# **Here and in the next chart, each row is labelled with what the
# decoder reads, then the word it predicts:** "A → brown" is the position
# that reads "A" and must predict "brown". The hover tooltip shows the
# predicted word as `next` too.
#
# The upper triangle is empty: the subsequent mask keeps every position
# from seeing the words after it. The first row (`<s>`, row 0) can only
# look at itself.

# %%
save_chart(attention_chart(maps, "decoder self"), "04_decoder_self", FIGURES)

# %% [markdown]
# ### Decoder–source attention
#
# This is where the translation reads the German. As above, each row is
# labelled with what it reads and what it predicts: the row that
# predicts "brown" is "A → brown", the row that predicts `</s>` is ". →
# </s>", and the row that predicts "." is "dog → .", the second "dog".
#
# The chart on record below shows each head of the trained `cpu` model's
# last layer. In the row that predicts "brown" every head looks most at
# "brauner", and in the row that predicts "black" at "schwarzen": each
# looks at the German word it is about to translate. The row that
# predicts `</s>` has no German word left to translate. It puts more of
# its weight than the word rows do on the edges of the sentence, `<s>`
# and `</s>` (the parking Check below measures it). We call this
# *parking*: weight left on a token that carries no content, because a
# softmax row must put its weight somewhere. The stand-in has seen too
# little to do any of this.
#
# The chart opens on the last layer, and the three Checks below read the
# last layer too: its output is the one that becomes the next word. It
# is not the best aligner, though: for the model on record, the last
# section, "Putting attention to work", finds it the weakest aligner of
# its three layers. Pick the other layers in the chart's menu to compare.
#
# Here is that chart of the model on record, as the project's site
# build (`make site`) saved it.
# On Colab, where this picture does not load, open it
# [on GitHub][github]. In this older picture each
# row is labelled only with the word it reads; it predicts the next
# row's word (the row labelled "A" predicts "brown").
#
# ![The trained cpu model's decoder-source attention, last layer][chart]
#
# [chart]: ../docs/trained_attention.png
# [github]: https://github.com/annotated-transformer/done-right/blob/main/docs/trained_attention.png
#
# The cell below draws the same chart for the model loaded on this page,
# which is the stand-in unless a `cpu` or `quick` model exists.

# %%
save_chart(
    attention_chart(maps, "decoder source"), "04_decoder_source", FIGURES
)

# %% [markdown]
# **Check.** In the chart on record, each of the four heads of the last
# layer puts the most weight on "brauner" in the row that predicts
# "brown", and on "schwarzen" in the row that predicts "black". The cell
# prints, for each head of the model loaded here, the German word it
# reads most in those two rows. With a trained model, `cpu` or `quick`,
# which need not be the run on record, it asserts the claim a little more
# leniently: for the heads' mean rather than for each head.


# %%
def row_of(next_token):
    """The decoder position whose next token is `next_token`."""
    return maps.next_tokens.index(next_token)


def column_of(source_token):
    """The source position of `source_token`."""
    return maps.src_tokens.index(source_token)


last = maps.decoder_src[-1]  # (h, T, S): the last layer
brown = last[:, row_of("brown")].argmax(-1)  # (h,) most-read source position
black = last[:, row_of("black")].argmax(-1)  # (h,)
print("row predicting 'brown':", [maps.src_tokens[j] for j in brown])
print("row predicting 'black':", [maps.src_tokens[j] for j in black])
if trained:  # the heads' mean reads the right German word
    brown_mean = last[:, row_of("brown")].mean(0)  # (S,)
    black_mean = last[:, row_of("black")].mean(0)  # (S,)
    hint = "trained too little? see docs/gpu.md"
    assert brown_mean.argmax() == column_of("brauner"), hint
    assert black_mean.argmax() == column_of("schwarzen"), hint
else:
    print(SKIPPED)

# %% [markdown]
# **Check.** Then parking. For each row of the last layer, we measure
# the weight that the heads put on the edges of the German sentence: its
# `<s>` plus its `</s>`, averaged over the heads. We compare the row that
# predicts the English `</s>` with the rows that predict words (every
# other row but the one that predicts ".", so punctuation and `<unk>`
# count as words here). The claim is the one the chart on record shows:
# the `</s>` row, with no German word left to translate, parks more of
# its weight than the word rows do on average.
#
# The row that predicts "." ("dog → .") parks too: in the chart on
# record, heads 1 and 3 put much of its weight on `<s>` and `</s>`. It
# is left out of both sides of the comparison, since it predicts
# neither a word nor `</s>`, and the claim is about those two. The cells
# print its figure as well, without asserting anything about it.
#
# `parking` measures one sentence. The first cell below prints this
# sentence's figures and asserts nothing; the second asserts the claim
# averaged over many sentences, for the reason given between them.


# %%
def parking(maps, layer=-1):
    """Weight on the source's <s> plus </s> in one layer's decoder-source
    attention, mean over the heads: (the row that predicts </s>, the mean
    of the rows that predict words, the row that predicts '.' or nan)."""
    edges = [maps.src_tokens.index("<s>"), maps.src_tokens.index("</s>")]
    on_edges = maps.decoder_src[layer].mean(0)[:, edges].sum(-1)  # (T,)
    rows = maps.next_tokens  # what each row predicts
    word_rows = torch.tensor([t not in (".", "</s>") for t in rows])
    dot = on_edges[rows.index(".")] if "." in rows else float("nan")
    end = on_edges[rows.index("</s>")]
    return float(end), float(on_edges[word_rows].mean()), float(dot)


end_row, word_mean, dot_row = parking(maps)
print("weight on <s> and </s>, mean over the heads, this sentence:")
print(f"  the row that predicts </s>: {end_row:.2f}")
print(f"  the rows that predict words: {word_mean:.2f}")
print(f"  the row that predicts '.' (left out): {dot_row:.2f}")

# %% [markdown]
# On this one sentence, the result flips from run to run. One `quick`
# model trained in bf16 printed 0.17 for the `</s>` row against 0.02 for
# the word rows. Another, trained after a change to this project's
# kernels that rounds some bf16 results differently, printed the
# reverse: 0.02 against 0.06, with 0.16 on the "." row
# (`results/make_notebook.md`). So the cell below asserts the form of
# the claim that holds from run to run: averaged over the validation
# sentences (40 of them when CI-sized), each teacher-forced with its
# reference translation. It also prints in how many of them the `</s>`
# row parks more than the word rows. That second `quick` model printed
# 0.07 against 0.03 on average, and its `</s>` row parked more in 77% of
# the 1,014 sentences.


# %%
def pair_maps(de, en):
    """attention_maps of one (German, English) pair, teacher-forced."""
    src = torch.tensor([BOS, *vocab_src(tokenize(de, spacy_de)), EOS])
    tgt = torch.tensor([BOS, *vocab_tgt(tokenize(en, spacy_en)), EOS])
    return attention_maps(model, src, tgt, vocab_src, vocab_tgt)


pairs = val[:40] if AT_SIZE == "ci" else val  # used again below
per_sentence = [parking(pair_maps(de, en)) for de, en in pairs]
ends, word_means, dots = torch.tensor(per_sentence).T  # (len(pairs),) each
print(f"the same, averaged over {len(pairs):,} validation sentences:")
print(f"  the row that predicts </s>: {ends.mean():.2f}")
print(f"  the rows that predict words: {word_means.mean():.2f}")
print(f"  the row that predicts '.' (left out): {dots.nanmean():.2f}")
more = (ends > word_means).float().mean()
print(f"the </s> row parks more in {more:.0%} of the sentences")
if trained:
    hint = "the </s> row parks no more than the word rows; see docs/gpu.md"
    assert ends.mean() > word_means.mean(), hint
else:
    print(SKIPPED)

# %% [markdown]
# Back to the two dogs. For each layer, the cell prints a 2 × 2 table:
# rows `dog #1` and `dog #2`, the chart's two rows that predict "dog";
# one column per "Hund" (`Hund #1`, `Hund #2`); and in each cell the
# weight that row puts on that "Hund", averaged over the heads. $1/S$
# (the weight of a uniform spread) is printed for scale. A layer that
# tells the copies apart weights the first "Hund" more for the first
# "dog", and the second for the second, and prints `apart: True`.
#
# **Check.** In the chart on record, the last layer tells the two dogs
# apart. The cell asserts it when a trained model is loaded.

# %%
hund = [j for j, t in enumerate(maps.src_tokens) if t == "Hund"]
dogs = [i for i, t in enumerate(maps.next_tokens) if t == "dog"]
assert len(hund) == len(dogs) == 2  # the word twice on each side
print(f"uniform weight 1/S = {1 / len(maps.src_tokens):.2f}")
apart = []  # one answer per layer
for layer in range(N):
    w = maps.decoder_src[layer].mean(0)[dogs][:, hund]  # (2, 2)
    apart.append(bool(w[0, 0] > w[0, 1] and w[1, 1] > w[1, 0]))
    # rows: dog #1, #2; columns: Hund #1, #2
    dog_table = pd.DataFrame(
        w.numpy(),
        index=["dog #1", "dog #2"],
        columns=["Hund #1", "Hund #2"],
    )
    print(f"\nlayer {layer + 1}, apart: {apart[-1]}")
    print(dog_table.round(2))
if trained:
    hint = "the last layer does not tell the dogs apart; see docs/gpu.md"
    assert apart[-1], hint  # the last layer
else:
    print(SKIPPED)


# %% [markdown]
# ## Can we trust these pictures?
#
# The pictures above draw the weights that `attention_maps` records, so
# they are worth reading only if those are the weights the model uses.
# The cells below check that they are, with any model, the stand-in
# included: the rows are probability distributions, padding gets no
# weight, recording leaves the output unchanged, the weights match
# step-by-step decoding and a computation by hand, and `eval()` keeps
# dropout out of them.

# %% [markdown]
# ### Rows, padding and recording
#
# The checks below need each kind's masks. `AttentionMaps` has a method
# for them, `view(kind)`, defined with the class above: it calls
# `attention_view`, shown here, and returns an `AttentionView`. The checks
# use its weights and the `(R, C)` mask `allowed` of the keys each query
# may see. Its other fields, the row and column labels and three more,
# serve the appendix's charts and the statistics; those three are
# explained where the statistics use them ("What the heads do, measured").
# `attention_view` picks, for each kind, which side gives the queries and
# which the keys: the source for the encoder, the English for the
# decoder's own attention, and English queries with German keys for the
# decoder's look at the source.


# %%
#| export
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


# %% [markdown]
# **See, it adds up.**
#
# Each row is a probability distribution over the keys a query may see:
# it sums to 1 and no entry exceeds 1. The keys a query may see are the
# `allowed` mask that `view` returns, shape `(R, C)`: it is False at
# padding keys, in every kind, and in the decoder's self-attention also at
# the future positions, which Part 1's subsequent mask hides. Keys that
# are not allowed get exactly zero weight.

# %%
for kind in ATTENTION_KINDS:
    v = maps.view(kind)
    sums = v.weights.sum(-1)  # (N, h, R)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5), kind
    assert v.weights.max() <= 1
    # (N, h, R, C) indexed by an (R, C) mask: (N, h, masked cells)
    assert (v.weights[..., ~v.allowed] == 0).all()
    print(f"{kind:15s} {int((~v.allowed).sum())} masked cells, all 0")

# %% [markdown]
# Our sentence has no padding, so nothing above masks a padding key. The
# same pair with two padding tokens appended to the source has two: in
# both kinds that read the source, their columns are masked and get
# exactly 0.

# %%
padded_src = torch.cat([src, torch.tensor([PAD, PAD])])  # (S + 2,)
padded = attention_maps(model, padded_src, tgt)
for kind in ("encoder self", "decoder source"):
    v = padded.view(kind)
    assert not v.allowed[:, -2:].any(), kind  # the two padding keys
    assert (v.weights[..., -2:] == 0).all(), kind  # (N, h, R, 2)
print("the two padding keys: weight 0 in every layer and head")

# %% [markdown]
# And recording changes nothing about what the model computes: the
# output of the explicit path matches that of the fused path (the branch
# that calls PyTorch's `scaled_dot_product_attention`, which
# `MultiHeadedAttention` takes when it does not record), on the same
# inputs and masks.

# %%
src_in = src.unsqueeze(0)  # (1, S): a batch of one
src_mask = (src_in != PAD).unsqueeze(-2)  # (1, 1, S)
tgt_in = maps.tgt_ids.unsqueeze(0)  # (1, T)
tgt_mask = Batch.make_std_mask(tgt_in, PAD)  # (1, T, T)
with torch.no_grad():
    fused = model(src_in, tgt_in, src_mask, tgt_mask)  # (1, T, d_model)
with torch.no_grad(), record_attention(model):
    explicit = model(src_in, tgt_in, src_mask, tgt_mask)
gap = (fused - explicit).abs().max().item()
print(f"fused against recorded output: largest difference {gap:.1e}")
assert torch.allclose(fused, explicit, atol=1e-5)

# %% [markdown]
# **See, one pass matches step by step.** The section "One sentence,
# every map" said that one teacher-forced pass over a finished
# translation gives the decoder–source weights that the decoder used
# while writing it one token at a time. Here is greedy decoding written
# out step by step, keeping at each step the newest row of every layer's
# decoder–source weights (the row that picks the next token), against
# one pass of `attention_maps` over the tokens it wrote.

# %%
newest = []  # per step: (N, h, S), each layer's last row
with torch.no_grad(), record_attention(model):
    memory = model.encode(src_in, src_mask)  # (1, S, d_model)
    ys = torch.tensor([[BOS]])  # (1, t): the decoder inputs so far
    for _ in range(len(src) + 5):  # a few tokens past the source is plenty
        ys_mask = Batch.make_std_mask(ys, PAD)  # (1, t, t)
        out = model.decode(memory, src_mask, ys, ys_mask)  # (1, t, d_model)
        last_rows = [m.src_attn.attn[0, :, -1] for m in model.decoder.layers]
        newest.append(torch.stack(last_rows))  # (N, h, S)
        word = model.generator(out[:, -1]).argmax(-1, keepdim=True)  # (1, 1)
        ys = torch.cat([ys, word], dim=1)  # (1, t + 1)
        if word.item() == EOS:
            break
stepwise = torch.stack(newest, dim=2)  # (N, h, T, S)
forced = attention_maps(model, src, ys[0])  # one pass, teacher-forced
assert torch.allclose(forced.decoder_src, stepwise, atol=1e-5)
print(f"{len(newest)} steps, the same weights as one pass")

# %% [markdown]
# **See, by hand.** The first encoder layer's weights, recomputed from its
# parameters without Part 1's `attention` function: normalize the
# embedded source (`model.src_embed` is Part 1's scaled embedding lookup
# plus the positional encoding; Part 1's layers normalize before
# attending), project it with $W^Q$ and $W^K$, split the $h$ heads, and
# take a softmax of the scaled dot products. No mask is needed: the
# sentence has no padding, and the encoder hides no future positions.

# %%
with torch.no_grad():
    enc_layer = model.encoder.layers[0]
    embedded = model.src_embed(src_in)[0]  # (S, d_model): drop the batch
    x = enc_layer.self_attn_block.norm(embedded)  # (S, d_model)
    W_q = enc_layer.self_attn.w_q
    W_k = enc_layer.self_attn.w_k
    d_k = enc_layer.self_attn.d_k
    n_heads = enc_layer.self_attn.h  # this layer's own number of heads
    q = W_q(x).view(len(src), n_heads, d_k).transpose(0, 1)  # (h, S, d_k)
    k = W_k(x).view(len(src), n_heads, d_k).transpose(0, 1)  # (h, S, d_k)
    scores = q @ k.transpose(1, 2) / math.sqrt(d_k)  # (h, S, S)
    by_hand = torch.softmax(scores, dim=-1)
gap = (by_hand - maps.encoder_self[0]).abs().max().item()
print(f"by hand against recorded weights: largest difference {gap:.1e}")
assert torch.allclose(by_hand, maps.encoder_self[0], atol=1e-5)

# %% [markdown]
# ### Why `eval()` matters
#
# Recorded in `train()` mode, the weights come after dropout: each is
# zeroed or scaled by $1/0.9$, so the rows no longer sum to 1.
# `attention_maps` therefore records in `eval()` mode. The cell shows
# the difference on a fresh model with Part 1's default dropout of 0.1
# (the loaded one is rebuilt without dropout): the same recording in
# `eval()` mode, then with only the first encoder layer's attention
# dropout switched on, so that the two differ in that dropout alone.

# %%
torch.manual_seed(0)
demo = make_model(
    len(vocab_src), len(vocab_tgt), N=1, d_model=64, d_ff=128, h=4, dropout=0.1
).eval()
demo_src = src.unsqueeze(0)  # (1, S)
demo_mask = (demo_src != PAD).unsqueeze(-2)  # (1, 1, S)
demo_attn = demo.encoder.layers[0].self_attn
with torch.no_grad(), record_attention(demo):
    demo.encode(demo_src, demo_mask)
    clean = demo_attn.attn  # (1, h, S, S), eval mode
    demo_attn.dropout.train()  # dropout on these weights only
    demo.encode(demo_src, demo_mask)
    dropped = demo_attn.attn  # (1, h, S, S), with dropout
    demo_attn.dropout.eval()
kept = dropped != 0
for name, w in [("eval mode", clean), ("with dropout", dropped)]:
    sums = w.sum(-1)  # (1, h, S)
    print(
        f"{name:12s}: row sums {sums.min():.3f} to {sums.max():.3f},"
        f" largest weight {w.max():.3f}"
    )
print(f"{int((~kept).sum())} of {kept.numel()} weights zeroed by dropout")
ones = torch.ones_like(clean.sum(-1))  # (1, h, S)
assert torch.allclose(clean.sum(-1), ones, atol=1e-5)
assert torch.allclose(dropped[kept], clean[kept] / 0.9)  # the rest scaled
assert (~kept).any()
assert not torch.allclose(dropped.sum(-1), clean.sum(-1))

# %% [markdown]
# ## What the heads do, measured
#
# ### Two numbers per head
#
# Heat maps of one sentence invite stories. Two numbers per head, averaged
# over many sentences, keep the stories honest. For query row $i$ with
# weights $p_{ij}$ over the $n_i$ keys it may see:
#
# * **Entropy as a fraction of uniform**, $H_i / \log n_i$ with
#   $H_i = -\sum_j p_{ij} \log p_{ij}$. It is 0 when all the weight is on
#   one key, and 1 when it is spread evenly. (In decoder self-attention
#   the first row sees only `<s>` and has no choice, so it is left out.)
# * **Distance from the diagonal**, $\sum_j p_{ij}\,|j - i|$ in tokens:
#   how far from its own position a query looks.
#
# For decoder–source attention "the diagonal" needs a definition, since
# the two sentences can have different lengths: $T$ rows and $S$
# columns. We use the proportional one: row $i$ meets column
# $j = i\,(S-1)/(T-1)$, so that the first row (`<s>`) meets the German
# `<s>` and the last row meets the German `</s>`. Think of it as the
# word alignment (which German word each English word translates) of a
# translation that keeps the word order and stretches it evenly. A head
# that reads the German word being translated sits near this diagonal;
# "Where the weight goes", below, shows how near for each row of our
# sentence.
#
# `_diagonal` computes the diagonal's column for each row. $S$ and $T$
# count real tokens only: the view's `row_keep` and `col_keep`, shape
# `(R,)` and `(C,)`, are False at padding rows and columns.
#
# For scale: a head that always reads its neighbour scores a distance of
# 1, and one that spreads its weight evenly over all $S$ keys (as
# encoder self-attention may) about $S/3$.


# %%
#| export
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


# %% [markdown]
# ### Where the weight goes
#
# Besides the two headline numbers, `_head_statistics` records where the
# weight of each row goes: one position before the diagonal, on it, one
# position after it, and on the special tokens `<s>` and `</s>`, whose
# columns the view's `col_ids` (the keys' token ids) give away. Each
# statistic is computed per row and then averaged over the rows that are
# real tokens (`row_keep`), which leaves one number per layer and head.
# These are the table's columns `previous`, `same`, `next` and `specials`.
# (In decoder self-attention `next` is always 0: the mask hides the next
# position.)
#
# The shares overlap, and they need not sum to 1. `previous`, `same` and
# `next` never share a key, but `specials` can share one with each of
# them. In self-attention, for example, `<s>` is the previous position of
# row 1, and it is also a special token. Weight more than one position
# from the diagonal, on a word, is in no share at all.
#
# In decoder–source attention, `distance` uses the diagonal's exact,
# fractional column; the three shares round it to the nearest column
# first.
#
# In our sentence, here is where the word each row predicts lies against
# the diagonal. Both sides have 11 positions (`<s> A brown dog is running
# after the black dog .` against `<s> Ein brauner Hund rennt dem schwarzen
# Hund hinterher . </s>`), so the diagonal is simply $j = i$. The row
# "A → brown" ($i = 1$) predicts "brown", which aligns with "brauner"
# ($j = 2$): offset +1, counted in `next`. The row ". → </s>" ($i = 10$)
# predicts `</s>` and reads German `</s>` ($j = 10$): offset 0, counted in
# `same`, because the diagonal pins the last row to German `</s>`. So the
# word a row predicts sits one column after the diagonal in the first row
# and on it in the last; in between, where it sits depends on the two word
# orders.
#
# That is the word a row *predicts*. Where a head actually *looks* is
# another matter. The cell below prints, for each row, the diagonal's
# column (rounded, as the shares round it) and the source column that
# the last layer reads most, averaged over its heads, each with its
# word, and the offset between them: +1 counts in `next`, 0 in `same`,
# −1 in `previous`.

# %%
read = maps.decoder_src[-1].mean(0)  # (T, S): last layer, mean over heads
n_rows, n_cols = read.shape  # T, S: our sentence has no padding
offsets = []  # one entry per row
for i in range(n_rows):
    diag_col = round(i * (n_cols - 1) / (n_rows - 1))  # diagonal's column
    most = int(read[i].argmax())  # the column this row reads most
    offsets.append(
        {
            "row": f"{maps.tgt_tokens[i]} → {maps.next_tokens[i]}",
            "diagonal": f"{diag_col} {maps.src_tokens[diag_col]}",
            "read most": f"{most} {maps.src_tokens[most]}",
            "offset": most - diag_col,
        }
    )
pd.DataFrame(offsets)

# %% [markdown]
# Read the offsets column. Where the two sentences keep step, a row that
# reads the German word it is about to translate prints +1; where the
# German word order departs from the English ("hinterher", *after*,
# comes last in the German), the word being translated lies elsewhere,
# and the offset with it. So in decoder–source attention `next` is not
# always "reads the word being translated": where the word orders
# differ, that reading lands in `same` or `previous`, or in no share.
# Nothing here is asserted: each model prints its own offsets, and the
# stand-in's need not show any pattern.
#
# `_head_statistics` computes every statistic of one kind at once, for
# all layers and heads: first a sum over the keys of each row, then the
# mean over the rows that are real tokens.


# %%
#| export
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


# %% [markdown]
# **See, the statistics by hand.** The entropy and the distance of the
# first encoder head, recomputed from the formulas above with plain Python
# loops over the $S \times S$ weights of our sentence, which has no
# padding. `attention_statistics` returns one row per kind, layer and
# head; `statistics_of` picks one by those three labels.


# %%
stats = attention_statistics(maps)  # one dict per kind, layer and head


def statistics_of(kind, layer, head):
    """The statistics of one head; layers and heads count from 1."""
    labels = (kind, layer, head)
    found = [s for s in stats if (s["kind"], s["layer"], s["head"]) == labels]
    assert len(found) == 1, labels
    return found[0]


# %%
p = maps.encoder_self[0, 0].tolist()  # S rows of S weights
S = len(p)
# Sums over all S rows; every encoder row sees all S keys (n_i = S).
entropy_sum = sum(-x * math.log(x) for row in p for x in row if x > 0)
distance_sum = sum(
    x * abs(r - c) for r, row in enumerate(p) for c, x in enumerate(row)
)
head_stats = statistics_of("encoder self", layer=1, head=1)
# the mean over the S rows, as a fraction of a uniform row's log S
entropy_fraction = entropy_sum / S / math.log(S)
assert math.isclose(head_stats["entropy"], entropy_fraction, abs_tol=1e-5)
assert math.isclose(head_stats["distance"], distance_sum / S, abs_tol=1e-5)
print(
    f"entropy {head_stats['entropy']:.3f},"
    f" distance {head_stats['distance']:.3f}"
)

# %% [markdown]
# And one decoder–source share: the `next` share of the first layer's
# first head, the weight one column after the rounded diagonal, summed
# in a loop over the $T$ rows and averaged.

# %%
cross = maps.decoder_src[0, 0].tolist()  # T rows of S weights
T_cross, S_cross = len(cross), len(cross[0])
next_sum = 0.0
for r, row in enumerate(cross):
    diag_col = round(r * (S_cross - 1) / (T_cross - 1))  # diagonal's column
    if diag_col + 1 < S_cross:  # the last row has no column after it
        next_sum += row[diag_col + 1]
first_head = statistics_of("decoder source", layer=1, head=1)
assert math.isclose(first_head["next"], next_sum / T_cross, abs_tol=1e-5)
print(f"decoder source, layer 1, head 1: next {first_head['next']:.3f}")

# %% [markdown]
# ### Over many sentences
#
# `attention_summary` averages those numbers over many validation
# sentences, each teacher-forced with its reference translation.


# %%
#| export
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


# %% [markdown]
# `attention_summary_chart` (appendix, "Charts") draws the summary: for
# each kind and each of the two numbers, a dot per head above its layer
# and a line through the mean of the heads. Entropy is on top, distance
# from the diagonal below, one column per kind.
#
# How to read the chart and the table below, with the heat maps above:
#
# * A head whose entropy is far below 1 commits to a few keys per query.
#   In decoder–source attention such a head, if its `specials` share is
#   small (see the last bullet), is an *aligner*: for each
#   English word it reads the German word being translated. A small
#   distance from the diagonal means that it follows the word order of
#   the source.
# * In the two self-attentions, a head with a large share in the
#   `previous`, `same` or `next` column is *positional*: it reads a fixed
#   neighbour, or the token itself, whatever the sentence says. Its mean
#   distance can still exceed one token when the rest of its weight lands
#   far away.
# * In decoder–source attention the same shares say something else:
#   `next` and `same` are where an aligner of a translation that keeps
#   the word order looks, so there a large share means that the head
#   follows the source in order, not that it ignores the sentence.
# * A head with a large share in `specials` parks its weight on `<s>` and
#   `</s>`, tokens that every sentence has. One plausible reading, which
#   the rows that end the sentence above illustrate: a softmax must put
#   its weight somewhere, and such a token is a harmless place to leave it
#   when the head has nothing to add for that query.

# %%
# The parking Check's pairs, all 1,014 validation pairs (Part 3), twice
# (here and for the untrained model below): most of this page's run time.
summary = attention_summary(
    model, pairs, spacy_de, spacy_en, vocab_src, vocab_tgt
)
save_chart(attention_summary_chart(summary), "04_attention_summary", FIGURES)

# %% [markdown]
# The numbers behind the chart, one row per head:

# %%
table = pd.DataFrame(summary).set_index(["kind", "layer", "head"])
table.round(2)

# %% [markdown]
# What can they be compared with? An untrained model of the same shape
# spreads its attention nearly evenly: at initialization the scaled
# scores of a row are small and close to each other, and the softmax of
# nearly equal numbers is nearly flat. Training is what makes heads pick:
# the cells below summarize the untrained model on the same sentences,
# then print both models' mean entropy for each kind and, as a scale for
# the chart's lower row, their mean distance from the diagonal.

# %%
torch.manual_seed(0)
untrained = make_model(
    len(vocab_src),
    len(vocab_tgt),
    N=N,
    d_model=config.d_model,
    d_ff=config.d_ff,
    h=h,
).eval()
baseline = attention_summary(
    untrained, pairs, spacy_de, spacy_en, vocab_src, vocab_tgt
)
random_table = pd.DataFrame(baseline).set_index(["kind", "layer", "head"])


def mean_by_kind(column):
    """This model's and the untrained one's mean of a column, per kind."""
    return pd.DataFrame(
        {
            "this model": table[column].groupby(level="kind").mean(),
            "untrained": random_table[column].groupby(level="kind").mean(),
        }
    )


# %% [markdown]
# Mean entropy. The cell asserts that the untrained model's is above 0.9
# of uniform for every kind (0.9 is a margin we chose, not a derived
# value).
#
# **Check**, with the trained model: its decoder–source heads have a
# lower mean entropy than the untrained model's (in the decoder–source
# heat map on record, above, most rows of the last layer put most of
# their weight on one German word). The stand-in is not checked: after
# two short epochs on 1,000 sentence pairs, its heads may still be as
# even as an untrained model's, or focused without meaning much.

# %%
entropies = mean_by_kind("entropy")
print("mean entropy:", entropies.round(2), sep="\n")
assert (entropies["untrained"] > 0.9).all()
if trained:
    source = entropies.loc["decoder source"]
    hint = "decoder-source attention as even as untrained; see docs/gpu.md"
    assert source["this model"] < source["untrained"], hint
else:
    print(SKIPPED)

# %% [markdown]
# Mean distance from the diagonal, a scale for the chart's lower row.
# The untrained model spreads its weight nearly evenly (the entropies
# above), so its distances are a yardstick for the trained model's, not
# a check. For scale, the cell also prints what perfectly even spreading
# gives in encoder self-attention: over $S$ keys, the mean over the rows
# of $\frac{1}{S}\sum_j |j - i|$ is $(S^2 - 1)/(3S)$, about $S/3$,
# here averaged over the same sentences. Compare it with the untrained
# model's encoder self-attention distance.

# %%
print("mean distance from the diagonal:")
print(mean_by_kind("distance").round(2))
# S of each pair: its German tokens, plus <s> and </s>
lengths = [len(tokenize(german, spacy_de)) + 2 for german, _ in pairs]
even = sum((n * n - 1) / (3 * n) for n in lengths) / len(lengths)
print(f"even spreading over the S source keys, (S^2 - 1)/(3S): {even:.2f}")

# %% [markdown]
# The cell below points at the heads of each sort in the model loaded on
# this page: for each kind and each share, the head where that share is
# largest. A large `previous`, `same` or `next` share marks a positional
# head in the self-attentions (a head that follows the source in order in
# decoder–source attention); a large `specials` share, a parking head. It
# checks nothing: how large a share makes a head positional or parking is
# for you to judge from the numbers.

# %%
for kind in ATTENTION_KINDS:
    heads = table.loc[kind]  # one row per (layer, head)
    for share in ["previous", "same", "next", "specials"]:
        # In decoder self-attention the mask hides the next position, so
        # its `next` share is 0 in every head: nothing to point at.
        if kind == "decoder self" and share == "next":
            continue
        layer, head = heads[share].idxmax()
        print(
            f"{kind}, largest `{share}` share: layer {layer}, head {head},"
            f" {heads[share].max():.2f} of its weight"
        )


# %% [markdown]
# ## Putting attention to work: unknown words
#
# Part 3's word vocabulary keeps the words seen at least twice in
# training; every other English word is one token, `<unk>`. The trained
# `cpu` model on record wrote it 386 times, in 273 of the 1,000 sentences
# of the test set (test2016), with greedy decoding, some of them where
# the German has a name or a number that could simply be copied.
#
# Numbers in this section: the 10-epoch `cpu` model on record
# (`results/unk_replacement.md`), not recomputed here.
#
# Decoder–source attention says which German word the decoder was
# reading when it wrote each token. *Unknown-word replacement* copies,
# for each `<unk>`, the German word that got the most attention. It comes
# from [Luong et al., 2015](https://arxiv.org/abs/1410.8206), who trained
# a model to point at the source word with the help of a separate word
# aligner, and [Jean et al., 2015](https://arxiv.org/abs/1412.2007), who
# used the attention weights, as we do.
#
# Which attention? The last layer alone, whose output becomes the word,
# is the obvious choice. In the model on record ($N=3$), it is a worse
# aligner than each of the two earlier layers and than the mean over all
# layers. Multi30k has no gold word
# alignments (alignments drawn by people), so "worse" is measured with a
# proxy. A model writes `<unk>` for a rare English word, and a rare
# English word usually translates a rare German word, so a good aligner
# mostly copies a German word that is itself outside the German
# vocabulary.
#
# On the validation set (436 `<unk>` in greedy translations), the copied
# word of that same 10-epoch `cpu` model was out of the German vocabulary
# 47% of the time with the last layer, 61% and 65% with the first and
# the second, and 66% with the weights averaged over every head of every
# layer. We use the average.
#
# The greedy decoders keep no weights: they take the fused attention
# path, both Part 3's `batch_greedy_decode` and the one that
# `translate_batch` uses, a faster, cached decoder (Part 5). So
# `source_alignment` runs the decoder once more over the finished
# output, inside `record_attention`. The section
# "Can we trust these pictures?" showed, for `attention_maps`, that such
# a pass gives the weights greedy decoding used; the check below ties
# `source_alignment` to `attention_maps`. Row $t$ reads decoder input
# $t$ and wrote output token $t+1$. The argmax runs over the source's
# words only, never over `<s>`, `</s>` or padding.
#
# The code below shifts indices by one in several places. Here they are
# for a three-word example: the German "Ein Hund rennt", translated as
# `out` = `<s> A <unk> runs </s>`.
#
# | row $k$ | reads `ys[k]` = `out[k]` | wrote `out[k + 1]` |
# |---|---|---|
# | 0 | `<s>` | A |
# | 1 | A | `<unk>` |
# | 2 | `<unk>` | runs |
# | 3 | runs | `</s>` |
#
# `replace_unknowns` gets `ids`, the output after `<s>` (here A,
# `<unk>`, runs), so `ids[k]` is `out[k + 1]`, the token row $k$ wrote.
# On the source side, `src_words` are the German words without `<s>` and
# `</s>`:
#
# | source column $j$ | 0 | 1 | 2 | 3 | 4 |
# |---|---|---|---|---|---|
# | token | `<s>` | Ein | Hund | rennt | `</s>` |
# | `src_words[j - 1]` | – | Ein | Hund | rennt | – |
# | column in `mean[k, 1:-1]` (`replace_and_check`) | – | 0 | 1 | 2 | – |
#
# So the `<unk>` is `ids[1]`, written by row 1. If row 1 reads column 2
# most, the word copied is `src_words[1]`, "Hund"; in the slice without
# `<s>` and `</s>`, that column is 1, and again `src_words[1]`. To keep
# the argmax off `<s>`, `</s>` and padding, `source_alignment` fills
# those columns with −1: every attention weight is at least 0, so a
# filled column can never be the largest while the row has a word.


# %%
#| export
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


# %% [markdown]
# `replace_unknowns` then puts the German word in place of each `<unk>`.
# It takes the word from spaCy's tokens of the German text, not from the
# ids: a German word outside the German vocabulary is itself an `<unk>`
# there, and it is exactly the word we want to copy.


# %%
#| export
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


# %% [markdown]
# **See, two code paths pick the same German word.** There are two
# because `translate_batch` needs a batched version and the charts need
# one sentence. `source_alignment` is the batched one, for many
# sentences at once, with the causal mask; `attention_maps`, behind the
# charts, reads one sentence with training's masks. They must pick the
# same German word for each `<unk>`.
#
# We run `source_alignment` on the validation references, teacher-forced.
# Their words outside the English vocabulary are `<unk>` too, and there we
# know the English word behind each one. The cells below print three such
# sentences, each copied German word beside the English word it stands
# for, to judge by eye.
#
# `replace_and_check` asserts that each copied word is also the top
# German word in the maps of `attention_maps`, averaged over every layer
# and head. Those maps come from a separate forward pass, so the check
# catches a row or a position read one place off. It says nothing about
# whether the model aligns well.


# %%
def replace_and_check(german_words, english):
    """A reference's ids and its tokens with German words for each <unk>."""
    ids = vocab_tgt(english)
    german = torch.tensor([[BOS, *vocab_src(german_words), EOS]])  # (1, S)
    german_mask = (german != PAD).unsqueeze(-2)  # (1, 1, S)
    out = torch.tensor([[BOS, *ids, EOS]])  # (1, L): the English tokens
    aligned = source_alignment(model, german, german_mask, out)[0].tolist()
    tokens = replace_unknowns(ids, aligned, german_words, vocab_tgt)
    maps_here = attention_maps(model, german, out)  # its own forward pass
    mean = maps_here.decoder_src.mean((0, 1))  # (T, S): layers, heads
    for k, token_id in enumerate(ids):
        if token_id == UNK:
            # words only: with the first column (<s>) and the last
            # (</s>) cut, position `most` is german_words[most]
            most = int(mean[k, 1:-1].argmax())
            assert tokens[k] == german_words[most], (k, most)
    return ids, tokens


# %% [markdown]
# The first three validation sentences whose reference has an `<unk>`,
# each checked by `replace_and_check`. With the stand-in, the copied
# German words are often the wrong ones (its attention has learned little);
# the check still holds, since it tests the copying, not the choice.

# %%
examples = 0
for de, en in val:
    german_words = tokenize(de, spacy_de)
    english = tokenize(en, spacy_en)
    if UNK not in vocab_tgt(english):
        continue
    ids, tokens = replace_and_check(german_words, english)
    copied = [
        f"{english[k]} -> {tokens[k]}" for k, i in enumerate(ids) if i == UNK
    ]
    print(f"German:    {de}")
    print(f"reference: {en}")
    print(f"with unk:  {' '.join(vocab_tgt.lookup_tokens(ids))}")
    print(f"replaced:  {' '.join(tokens)}")
    print(f"copied:    {', '.join(copied)}\n")
    examples += 1
    if examples == 3:
        break
assert examples == 3

# %% [markdown]
# Copying can only help where the German word is also the English one, as
# with a name or a number. On Multi30k most unknown words are rare German
# compounds and verbs instead, which stay German when copied: of the 386
# words copied into the greedy test2016 translations of the 10-epoch `cpu`
# model on record, 11 appear in the English reference.
#
# BLEU does rise, from 37.10 with `<unk>` kept to 37.97 with it replaced,
# but deleting every `<unk>` gives 38.05. So the gain comes from removing
# `<unk>`, which sacreBLEU splits into three tokens (`<`, `unk`, `>`) that
# never match, not from the copied words (`results/unk_replacement.md`,
# not recomputed here). `translate_batch` and the command line (appendix)
# still replace unknown words by default: a reader gets the German word,
# now and then a name that is right as it is, rather than a gap, for 0.08
# BLEU less than deleting. Part 5 shows another way out: a subword
# vocabulary, which has almost no `<unk>` (none on test2016).
