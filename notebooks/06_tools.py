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
# # Appendix: the machinery
#
# The lessons teach the model, its training and its decoding. Around
# them sits code that a working program needs but a reader need not
# study. In order: the lessons' charts; the copy-task runs of
# `bench/copy_task.py`; files written whole, so that a crash never
# leaves half a file; downloading and verifying Multi30k; the training
# presets; vocabularies; the hardware and its precision; checkpoint
# files; training runs on several devices and processes, and two faster
# CPU paths (the dropout masks, the loss's gradient); translating for
# users; reading text files; the command line; and, for Parts 4 and 5,
# which model a checkpoint holds, and finding one or training a small
# one. It lives here, after the lessons, and is exported into a second
# module, `annotated_transformer_tools.py`, which the
# `annotated-transformer` command runs. Code in this appendix may use
# anything the lessons defined (the tools module imports it from
# `the_annotated_transformer.py`); no lesson's exported code uses the
# appendix.

# %% [markdown]
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/annotated-transformer/done-right/blob/main/notebooks/06_tools.ipynb)

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

# %%
#| export
import argparse
import contextlib
import copy
import ctypes
import difflib
import functools
import hashlib
import http.client
import io
import itertools
import json
import math
import multiprocessing
import os
import pickle
import platform
import re
import shlex
import signal
import socket
import ssl
import sys
import threading
import time
import unicodedata
import urllib.error
import urllib.request
import warnings
import zipfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

# %% [markdown]
# The appendix calls functions of every lesson. Here they come from the
# lessons' module; `tools/export.py` writes the same import into the tools
# module, generated from the names that the exported code uses. (Names
# that only this notebook's checks use are imported where they are used.)
# %%
from the_annotated_transformer import (
    ATTENTION_KINDS,
    BOS,
    BPE_VOCAB_SIZE,
    COPY_PAD,
    EOS,
    MODULE_DIR,
    MULTI30K_ENV,
    PAD,
    UNK,
    Batch,
    BpeVocab,
    DatasetError,
    LabelSmoothing,
    LayerNorm,
    MultiHeadedAttention,
    PositionwiseFeedForward,
    SimpleLossCompute,
    SublayerConnection,
    TrainConfig,
    TrainState,
    Vocab,
    attention_view,
    beam_search,
    build_vocabulary,
    cached_greedy_decode,
    collate_batch,
    copy_accuracy,
    create_dataloaders,
    data_dir,
    data_gen,
    encode_pairs,
    encode_text,
    heads_mask,
    label_smoothing_penalty_rows,
    load_tokenizers,
    make_model,
    make_optimizer,
    make_run_optimizer,
    model_from_config,
    multi30k_folder,
    pick_device,
    rate,
    read_multi30k,
    replace_unknowns,
    run_epoch,
    smoothed_kl,
    source_alignment,
    strip_specials,
    tokenize,
    train_bpe,
    warmup_linear_decay,
    why_missing,
)

# %% [markdown]
# ## Charts
#
# The lessons draw their charts with altair, which shows them in the
# notebook and, through vl-convert, writes them as static SVG and PNG
# files. Building a chart is plumbing, so it lives here. altair and
# pandas are imported inside the functions that use them: importing the
# module still needs only torch.
#
# `save_chart` writes a chart into `figures/` and returns it, so that a
# cell that ends with it shows the chart; `line_chart` draws a list of
# dicts as one line per group.


# %%
#| export
def save_chart(chart, name, folder="figures"):
    """Write a chart as static SVG and PNG files; returns the chart."""
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


# %% [markdown]
# ### For Part 1: positional encodings and masks
#
# A mask as a grid of allowed (blue) and hidden (grey) (query, key)
# pairs, and a few dimensions of a positional-encoding table as lines
# over the positions. Both draw the tensor they are given, so a lesson
# passes in what its own code computed.


# %%
#| export
def mask_chart(mask, title="subsequent mask"):
    """Altair heat map of a (T, T) boolean mask: True is allowed."""
    import altair as alt
    import pandas as pd

    size = mask.shape[0]
    rows = [
        {"query (row)": i, "key (column)": j, "allowed": bool(mask[i, j])}
        for i in range(size)
        for j in range(mask.shape[1])
    ]
    colors = alt.Scale(domain=[False, True], range=["#f2f2f2", "#3b6ea8"])
    return (
        alt.Chart(pd.DataFrame(rows))
        .mark_rect()
        .encode(
            x="key (column):O",
            y="query (row):O",
            color=alt.Color("allowed:N", scale=colors),
            tooltip=["query (row)", "key (column)", "allowed"],
        )
        .properties(title=title, width=260, height=260)
    )


def positional_chart(table, dims=(4, 5, 6, 7)):
    """Line chart of a few columns of a (positions, d_model) table."""
    rows = [
        {"position": p, "value": float(table[p, d]), "dimension": f"dim {d}"}
        for d in dims
        for p in range(table.shape[0])
    ]
    title = f"Positional encoding, d_model = {table.shape[1]}"
    return line_chart(rows, "position", "value", "dimension", title)


# %% [markdown]
# ### For Part 2: losses and learning rates
#
# The loss of one prediction against its margin, with and without label
# smoothing, and the learning-rate schedule for a few settings. (Part 3
# draws its BLEU curve with `line_chart` directly.)


# %%
#| export
def label_smoothing_penalty_chart(rows=None, smoothing=0.1):
    """Line chart of `rows` from label_smoothing_penalty_rows (computed
    here, with `smoothing`, when not given)."""
    if rows is None:
        rows = label_smoothing_penalty_rows(smoothing=smoothing)
    title = "Loss against the margin"
    return line_chart(
        rows, "margin", "loss", color="smoothing", title=title, point=True
    )


def learning_rate_chart(
    settings=((512, 4000), (512, 8000), (256, 4000)),
    steps=20000,
    schedule=rate,
):
    """Altair line chart of `schedule(step, d_model, factor, warmup)`
    (the library's `rate` unless given) for (d_model, warmup) pairs,
    factor 1."""
    rows = []
    for d_model, warmup in settings:
        name = f"d_model={d_model}, warmup={warmup}"
        for step in range(1, steps + 1, 20):
            lr = schedule(step, d_model, 1.0, warmup)
            rows.append(dict(step=step, lr=lr, setting=name))
    return line_chart(
        rows,
        x="step",
        y="lr",
        color="setting",
        title="Learning-rate schedule",
    )


# %% [markdown]
# ### For Part 4: attention heat maps
#
# `maps` is an `AttentionMaps` from Part 4 (the library's class or the
# notebook's own copy of it: only its fields are read), and a
# *kind* is one of the keys of `ATTENTION_KINDS`: "encoder self",
# "decoder self" or "decoder source". `attention_frame` flattens one
# kind into a table with one row per (layer, head, query, key), leaving
# out padding. Layers and heads are numbered from 1 in the table and the
# charts (layer 1 is the one nearest the embeddings); the tensors index
# them from 0. A token that occurs twice gets two rows: rows and columns
# are positions, labelled with their tokens.


# %%
#| export
def attention_frame(maps, kind):
    """One kind of attention as a long pandas table, padding left out."""
    import pandas as pd

    view = attention_view(maps, kind)  # the kind's weights, labels, masks
    rows = view.row_keep.nonzero()[:, 0].tolist()  # real tokens' positions
    cols = view.col_keep.nonzero()[:, 0].tolist()
    w = view.weights[:, :, rows][:, :, :, cols]  # (N, h, rows, cols)
    layers = range(1, w.shape[0] + 1)
    heads = range(1, w.shape[1] + 1)
    names = ["layer", "head", "row", "col"]
    grid = pd.MultiIndex.from_product([layers, heads, rows, cols], names=names)
    frame = grid.to_frame(index=False)  # a row per weight, in w's order
    frame["weight"] = w.flatten().double().numpy()
    frame["query"] = [view.rows[r] for r in frame["row"]]
    frame["key"] = [view.cols[c] for c in frame["col"]]
    if kind != "encoder self":
        frame["next"] = [maps.next_tokens[r] for r in frame["row"]]
    return frame


# %% [markdown]
# `attention_chart` draws such a table with altair as one heat map per
# head, side by side, with a menu to pick the layer. It is built from
# three small pieces. First, the layer menu: a parameter bound to a
# drop-down list, which filters the table to one layer in the browser, so
# that switching layers needs no Python.


# %%
#| export
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


# %% [markdown]
# Second, the token labels. Every cell of the chart carries only numbers
# (layer, head, row, column, weight); the tokens travel once, as a list,
# and an expression looks them up by position, for the axes and for the
# tooltips. This keeps the saved page small: a 6-layer, 8-head model has
# 6 × 8 × 13 × 13 = 8,112 cells per kind for a 13-token sentence. A
# decoder's rows are labelled "A → brown": what the position reads, then
# the token it predicts, so that Part 4's reader need not shift each row
# by one in their head.


# %%
#| export
def _token_axis(labels, title, angle=0):
    """An axis over positions that shows the token at each position."""
    import altair as alt

    return alt.Axis(
        title=title,
        labelAngle=angle,
        labelExpr=f"{json.dumps(labels)}[datum.value]",
    )


def _row_axis(kind, rows, next_tokens):
    """The query axis; a decoder's rows read "A -> brown": what the
    position reads, then the token it predicts."""
    if kind == "encoder self":
        return _token_axis(rows, "query")
    labels = [f"{q} → {n}" for q, n in zip(rows, next_tokens)]
    return _token_axis(labels, "query → the token it predicts")


def _token_lookups(maps, view, kind):
    """Vega expressions that turn a cell's row or column into its token."""
    fields = {"query": (view.rows, "row"), "key": (view.cols, "col")}
    if kind != "encoder self":  # a decoder's row predicts a next token
        fields["next"] = (maps.next_tokens, "row")
    return {
        f: f"{json.dumps(labels)}[datum.{index}]"
        for f, (labels, index) in fields.items()
    }


# %% [markdown]
# Third, the heat map of one head: white for weight 0, dark blue for
# weight 1 (one scale for every head and model), one square of `cell`
# pixels per (query, key) pair, and a tooltip that names the query, the
# key, the next token and the weight. `attention_chart` then repeats it
# for every head, in rows of `columns`.


# %%
#| export
def _heat_map(frame, view, lookups, pick, cell, row_axis):
    """One head's weights as coloured squares, filtered to the picked layer."""
    import altair as alt

    numbers = frame[["layer", "head", "row", "col", "weight"]]
    tooltip = [alt.Tooltip(f"{f}:N") for f in lookups]  # tokens
    tooltip += [alt.Tooltip("weight:Q", format=".3f"), "layer:O", "head:O"]
    scale = alt.Scale(
        domain=[0, 1], range=["#ffffff", "#08306b"], interpolate="lab"
    )
    return (
        alt.Chart(alt.Data(values=numbers.to_dict("records")))
        .transform_filter(alt.datum.layer == pick)
        .transform_calculate(**lookups)
        .mark_rect()
        .encode(
            x=alt.X("col:O", axis=_token_axis(view.cols, "key", -60)),
            y=alt.Y("row:O", axis=row_axis),
            color=alt.Color("weight:Q", scale=scale),
            tooltip=tooltip,
        )
        .properties(
            width=cell * frame["col"].nunique(),
            height=cell * frame["row"].nunique(),
        )
    )


# %% [markdown]
# `attention_chart` puts the pieces together: the long table of one kind,
# its weights rounded to five decimals to keep the page small, one heat
# map per head, and the layer menu attached to the whole grid of heads.


# %%
#| export
def attention_chart(maps, kind, layer=None, columns=4, cell=18):
    """Heat maps of one kind, one per head, with a menu to pick the layer."""
    import altair as alt

    frame = attention_frame(maps, kind).round({"weight": 5})
    view = attention_view(maps, kind)  # the kind's weights, labels, masks
    N, h = view.weights.shape[:2]
    pick = _layer_picker(kind, N, layer)
    lookups = _token_lookups(maps, view, kind)
    row_axis = _row_axis(kind, view.rows, maps.next_tokens)
    heat = _heat_map(frame, view, lookups, pick, cell, row_axis)
    title = f"'{kind} attention, layer ' + {pick.name} + ' of {N} ({h} heads)'"
    return heat.add_params(pick).facet(
        facet=alt.Facet(
            "head:O",
            header=alt.Header(labelExpr="'head ' + datum.value", title=None),
        ),
        columns=min(columns, h),
        title=alt.TitleParams(alt.expr(title)),  # follows the layer menu
    )


# %% [markdown]
# ### For Part 4: attention heads by layer
#
# `attention_summary_chart` plots Part 4's `attention_summary`, which
# gives two numbers per head: the entropy of its weights and their
# distance from the diagonal. For each number and each kind of attention
# it draws a dot per head above its layer, and a line through the mean
# of the heads, so that a trend from layer to layer shows as a slope.
#
# The chart stacks the two numbers, entropy on top and distance from
# the diagonal below, with one column per kind: the whole picture of a
# model on one page.


# %%
#| export
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


# %%
#| export
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


# %% [markdown]
# ## Copy-task runs
#
# Part 2 trains the copy task for a fixed budget and then checks it.
# `bench/copy_task.py` asks a different question: how soon does the
# model copy? For that, training stops as soon as the model copies
# sequences it has never seen, and deciding when costs almost nothing.
# Every batch that `data_gen` yields is new random data, and `run_epoch`
# computes the loss *before* the optimizer learns from the batch, so each
# training batch is also a fair test.

# %% [markdown]
# A sequence is predicted exactly when the most probable next token is
# right at every position, given the right prefix (one teacher-forced
# forward pass). That is exactly when greedy decoding copies it: greedy
# decoding then never leaves the right prefix.
# `copy_accuracy_teacher_forced` measures Part 2's `copy_accuracy` that
# way, and `CopyLossCompute` counts, as training goes, the run (`streak`)
# of exactly predicted sequences up to the latest batch.


# %%
#| export
def copy_accuracy_teacher_forced(model, n, V=11, seq_len=10, generator=None):
    """copy_accuracy's fraction from one teacher-forced forward pass."""
    was_training = model.training
    model.eval()
    b = next(data_gen(V, n, nbatches=1, seq_len=seq_len, generator=generator))
    with torch.no_grad():
        out = model(b.src, b.tgt, b.src_mask, b.tgt_mask)  # (n, T, d_model)
        pred = model.generator(out).argmax(dim=-1)  # (n, T)
    model.train(was_training)
    return (pred == b.tgt_y).all(dim=1).float().mean().item()


class CopyLossCompute(SimpleLossCompute):
    """SimpleLossCompute that also counts exactly predicted sequences."""

    def __init__(self, generator, criterion, pad=COPY_PAD):
        super().__init__(generator, criterion)
        self.pad = pad
        self.streak = 0  # exact sequences in a row, up to the latest
        self.sequences = 0  # sequences seen
        self.exact = 0  # sequences predicted exactly

    def __call__(self, x, y, norm):
        result = super().__call__(x, y, norm)
        with torch.no_grad():
            right = self.generator(x.detach()).argmax(dim=-1) == y
            exact = (right | (y == self.pad)).all(dim=1)  # (B,)
        for copied in exact.tolist():  # a miss starts the streak again
            self.streak = self.streak + 1 if copied else 0
        self.sequences += len(exact)
        self.exact += int(exact.sum())
        return result


# %% [markdown]
# Once the streak reaches `check_size`, `greedy_check` confirms with real
# greedy decoding of `check_size` more fresh sequences. Training stops
# only if all of them come back unchanged; otherwise the streak starts
# again from zero.


# %%
#| export
def greedy_check(model, streak, check_size, V, generator):
    """The greedy-copy accuracy on `check_size` fresh sequences once the
    streak is that long, else None."""
    if streak < check_size:
        return None
    return copy_accuracy(model, check_size, V, generator=generator)


# %% [markdown]
# `CopyTaskConfig` holds Part 2's recipe, and `for_size("ci")` its
# CI-sized model. Part 2's fixed budget of 20 epochs becomes a limit,
# `max_epochs` (100), which a run that copies stops well before.


# %%
#| export
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
    check_size: int = 200
    seed: int = 0

    @classmethod
    def for_size(cls, size="full", **changes):
        """The "full" preset, or the seconds-long "ci" one, with changes."""
        if size == "full":
            preset = {}
        elif size == "ci":
            preset = dict(N=1, d_model=64, d_ff=256, h=4, lr=3e-3)
        else:
            raise ValueError(f'size is "full" or "ci", not {size!r}')
        return cls(**{**preset, **changes})


# %% [markdown]
# `copy_task_setup` builds what Part 2 builds: the model, the loss (here
# counting exact sequences) and the optimizer with its schedule.
# `train_copy_task` is Part 2's copy-task run, through `run_epoch` (Part
# 2, "Under the hood: `run_epoch`"), with the stopping rule: after each
# epoch it records the share of training sequences predicted exactly,
# runs the greedy check when the streak allows, and stops once that check
# passes. `epoch_summary` formats an epoch's log line.


# %%
#| export
def epoch_summary(record):
    """One log line for an epoch record of train_copy_task."""
    line = (
        f"epoch {record['epoch']:2d} | step {record['steps']:4d} | "
        f"loss {record['train_loss']:.4f} | "
        f"exact while training {record['train_exact']:6.1%}"
    )
    if record["exact_copy"] is not None:
        line += f" | greedy check {record['exact_copy']:6.1%}"
    return line + f" | {record['seconds']:5.1f} s"


def copy_task_setup(cfg):
    """(model, loss_compute, optimizer, scheduler) of the copy task."""
    torch.manual_seed(cfg.seed)
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

    def schedule(step):
        return warmup_linear_decay(step, cfg.lr, cfg.warmup, cfg.decay_steps)

    optimizer, scheduler = make_optimizer(
        model, cfg.d_model, betas=(0.9, cfg.beta2), schedule=schedule
    )
    return model, loss_compute, optimizer, scheduler


def train_copy_task(cfg=None, log=print):
    """Train until exact copy; returns (model, list of epoch records)."""
    if cfg is None:
        cfg = CopyTaskConfig()
    model, loss_compute, optimizer, scheduler = copy_task_setup(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    state = TrainState()
    history = []
    start = time.time()
    for epoch in range(cfg.max_epochs):
        model.train()
        seen_before = loss_compute.sequences
        exact_before = loss_compute.exact
        data = data_gen(cfg.V, cfg.batch_size, cfg.nbatches, generator=gen)
        loss, state = run_epoch(
            data,
            model,
            loss_compute,
            optimizer,
            scheduler,
            train_state=state,
        )
        new = loss_compute.sequences - seen_before
        checked = greedy_check(
            model, loss_compute.streak, cfg.check_size, cfg.V, gen
        )
        if checked is not None and checked < 1.0:
            loss_compute.streak = 0  # earn another streak first
        history.append(
            {
                "epoch": epoch,
                "steps": state.accum_step,
                "samples": state.samples,
                "train_loss": loss,
                "train_exact": (loss_compute.exact - exact_before) / new,
                "exact_copy": checked,
                "seconds": time.time() - start,
            }
        )
        log(epoch_summary(history[-1]))
        if checked == 1.0:
            break
    return model, history


# %% [markdown]
# A run of the `ci` size, in seconds (this cell always uses it). It
# stops before its limit, and on 500 sequences it has never seen, the
# teacher-forced check gives exactly the greedy fraction:

# %%
copy_cfg = CopyTaskConfig.for_size("ci")
copy_model, copy_history = train_copy_task(copy_cfg)
assert copy_history[-1]["exact_copy"] == 1.0
assert len(copy_history) < copy_cfg.max_epochs
greedy = copy_accuracy(
    copy_model, 500, generator=torch.Generator().manual_seed(7)
)
forced = copy_accuracy_teacher_forced(
    copy_model, 500, generator=torch.Generator().manual_seed(7)
)
print(f"greedy {greedy:.1%}, teacher-forced {forced:.1%}")
assert forced == greedy

# %% [markdown]
# ## Files written whole
#
# Every file the program writes (downloads, vocabularies, checkpoints,
# translations, summaries) goes through `atomic_write`. It writes a
# temporary file `.NAME.PID.part` in the same folder, flushes it to the
# disk, and only then renames it to `NAME`. A rename within a folder is
# atomic: a reader sees the old file or the new one, never half of
# either, and a full disk, a crash or Ctrl-C in the middle of a write
# leaves the old file as it was.
#
# A failed write of the temporary file (a full disk, a permission, a
# folder in the way) is reported with `NAME`, the file the reader asked
# for, not the hidden `.part` file; other errors raised while the caller
# writes, such as a download's reset connection, pass unchanged.
#
# A process killed outright (SIGKILL, a power cut) cannot remove its
# `.part` file. The process id in the name says whose it is, so
# `atomic_write` first removes, from the folder it writes to, the `.part`
# files of processes that no longer run. It can only ask about processes
# on this machine: in a folder shared between machines (a network
# drive), another machine's unfinished `.part` file would look
# abandoned.


# %%
#| export
def process_alive(pid):
    """True if a process with this id runs on this machine."""
    try:
        os.kill(pid, 0)  # POSIX's signal 0: is there such a process?
    except ProcessLookupError:
        return False
    except PermissionError:  # there is, and it is someone else's
        return True
    except OverflowError:  # too large to be a pid: leave its file alone
        return True
    return True


def clean_partial_files(folder):
    """Remove the `.part` files that dead processes left in `folder`."""
    for part in Path(folder).glob(".*.part"):
        pid = part.name.split(".")[-2]  # .NAME.PID.part
        if pid.isdigit() and int(pid) != os.getpid():
            if not process_alive(int(pid)):
                part.unlink(missing_ok=True)


def failed_to_write(err, part):
    """Is `err` a failed write of the `.part` file? It names that file
    (os.replace, a permission), or names none and is a plain OSError (a
    full disk). Other errors in the caller's `with` body, such as a reset
    connection (a ConnectionError), are not about the file."""
    if err.errno is None:
        return False
    if err.filename is None:
        return type(err) is OSError
    return str(err.filename) == str(part)


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
    except OSError as err:
        if not failed_to_write(err, part):  # a network error, say
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err
    finally:
        part.unlink(missing_ok=True)  # gone already, unless it failed


# %% [markdown]
# Check: a write that fails halfway leaves the old file and no `.part`
# file, and a `.part` file of a process that has ended is removed by the
# next write to its folder.

# %%
import subprocess
import tempfile

with tempfile.TemporaryDirectory() as tmp:
    kept = Path(tmp, "kept.txt")
    kept.write_text("old")
    try:
        with atomic_write(kept, "w") as f:
            f.write("half of the new")
            raise KeyboardInterrupt  # as if Ctrl-C came in the middle
    except KeyboardInterrupt:
        pass
    assert kept.read_text() == "old" and len(os.listdir(tmp)) == 1
    ended = subprocess.Popen(["true"])  # a process that ends at once
    ended.wait()
    Path(tmp, f".kept.txt.{ended.pid}.part").write_text("left behind")
    with atomic_write(Path(tmp, "other.txt"), "w") as f:
        f.write("new")
    assert sorted(os.listdir(tmp)) == ["kept.txt", "other.txt"]

# %% [markdown]
# ## Downloading Multi30k
#
# Part 3 reads Multi30k from six gzip files: `train`, `val` and
# `test_2016_flickr`, each in German and English. They come from the
# `data/task1/raw/` folder of the multi30k/dataset repository on GitHub.
# Each file's SHA-256 sum is pinned here, so a changed or truncated file is
# never used.

# %%
#| export
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


# %% [markdown]
# Three helpers: the SHA-256 sum of a file, a copy loop that computes it
# while showing progress, and the advice every download error ends with.


# %%
#| export
def sha256_of(path):
    """Hex SHA-256 digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):  # a megabyte at a time
            digest.update(chunk)
    return digest.hexdigest()


def _stream(response, out, name):
    """Copy a download into `out` with a progress bar; its SHA-256."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    length = int(response.headers.get("Content-Length") or 0)
    size = length if length > 0 else None  # None: tqdm shows no total
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


# %% [markdown]
# A download goes through `atomic_write`, with a progress bar, and is
# renamed only once its sum matches: an interrupted or corrupted download
# never leaves a file that looks valid. Every failure is a `DatasetError`
# whose message says what to do.


# %%
#| export
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
        # URLError wraps the real error in .reason; its subclass
        # HTTPError (a 404, say) is itself the error: its reason is text.
        url_error = type(error) is urllib.error.URLError
        reason = error.reason if url_error else error
        certificates = ""
        if isinstance(reason, ssl.SSLCertVerificationError):
            certificates = (
                "This Python cannot check HTTPS certificates: with a Python"
                " from python.org on a Mac, run its Install"
                " Certificates.command once.\n"
            )
        raise DatasetError(
            f"Could not download {url} ({reason}).\n"
            + certificates
            + _offline_hint(path.parent)
        ) from error


# %% [markdown]
# `download_multi30k` returns the folder that holds the verified files.
# With `root`, the files are cached there. Otherwise, when `MULTI30K_DIR`
# is set (a machine without internet access, or CI), that folder is only
# checked, never written to; a relative path counts from the working
# directory, and an error names the absolute path it tried. Otherwise the
# files are cached in `data/multi30k/`. A cached file is fetched only
# when missing or wrong (`_fetch_unless_cached`). When a cached file is
# damaged and no fresh copy can be fetched, the error names the damaged
# file. A first download that fails removes the folders it made
# (`missing_folders`, `remove_if_empty`), so that it leaves nothing
# behind.


# %%
#| export
def _why_not_a_file(path):
    """Why `path` is not a file to read: missing, or something else (a
    folder, a pipe); None if it is a file."""
    if path.is_file():
        return None
    return "is not a file" if path.exists() else "is missing"


def _folder_problems(folder, sums):
    """What is wrong with `folder`'s files, by name; [] if nothing."""
    problems = []
    for name, expected in sorted(sums.items()):
        path = folder / name
        why = _why_not_a_file(path)
        if why:
            problems.append(f"{name} {why}")
        elif sha256_of(path) != expected:
            problems.append(f"{name} has the wrong SHA-256")
    return problems


def _check_folder(folder, sums):
    """`folder` if it holds every file with the right SHA-256."""
    problems = _folder_problems(folder, sums)
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
    new_folders = missing_folders(folder)
    try:
        for name, expected in sums.items():
            _fetch_unless_cached(folder / name, expected, base_url, timeout)
    except DatasetError:
        remove_if_empty(new_folders)  # a failed first try leaves nothing
        raise
    return folder


def _fetch_unless_cached(path, expected, base_url, timeout):
    """Download `path`'s file unless the cache holds the right bytes."""
    if path.is_file() and sha256_of(path) == expected:
        return
    damaged = path.is_file()  # in the cache, but not the right bytes
    try:
        _fetch(base_url.rstrip("/") + "/" + path.name, path, expected, timeout)
    except DatasetError as error:
        if not damaged:
            raise
        raise DatasetError(
            f"{path} in the data cache is damaged (wrong SHA-256), and "
            f"a fresh copy could not be fetched: {error}"
        ) from error


def missing_folders(folder):
    """`folder` and those above it that do not exist yet, deepest first."""
    missing = []
    for f in (folder, *folder.absolute().parents):
        if f.exists():
            break
        missing.append(f)
    return missing


def remove_if_empty(folders):
    """Remove `folders`, deepest first, as long as they are empty."""
    for f in folders:
        try:
            f.rmdir()
        except OSError:  # not empty, or already gone
            return


# %% [markdown]
# Check: every pinned sum matches the file the lessons read.

# %%
folder = download_multi30k()
assert read_multi30k("val", folder) == read_multi30k("val")
assert all(sha256_of(folder / n) == s for n, s in MULTI30K_SHA256.items())
print(f"{len(MULTI30K_SHA256)} files verified in {folder}")

# %% [markdown]
# ## Presets
#
# A preset is a `TrainConfig` (Part 3) with a name. `quick` is the
# default of `train` and of Part 3, on GPUs too. `cpu` and `ci` have a
# BPE twin (Part 5), with one subword vocabulary and tied embeddings.
#
# The times in the table are measured runs, not all in the same
# conditions: `quick` and `long` with 2 threads in float32
# (`results/recipe_quick.json`, `results/recipe_long.json`), `cpu` with 1
# thread in bf16 on a machine shared with other jobs
# (`results/multi30k_cpu.json`). So `cpu`'s 83 minutes and `long`'s 42
# do not say which recipe is faster per epoch.
#
# | preset | model and recipe | time on a 2-core CPU |
# |---|---|---|
# | `quick` | `cpu` model, 5 epochs, linear to zero, no dropout | 14 min |
# | `cpu` | 18 epochs, dropout 0.1, Part 2's schedule | 83 min |
# | `long` | `quick`'s schedule over 12 epochs, dropout 0.1 | 42 min |
# | `paper` | the paper's base model, for a GPU | never trained to the end |
# | `ci` | tiny: 1,000 sentence pairs, two epochs | seconds |
#
# `cpu` is the dataclass's defaults. `ci` serves the tests and the
# CI-sized notebooks.
#
# Every preset but `ci` asks for `precision="auto"`, "the fastest
# precision this machine does well" ("Which precision", below): bfloat16
# or float16 autocast where the hardware has it, float32 elsewhere. `ci`
# asks for float32 everywhere, so that its tests give the same numbers
# on every machine. (Runs before the name `auto` was chosen saved it as
# `"bf16"`, which is still read as `"auto"`.)
#
# `paper` has the paper's base model, but 8,000-token batches (the
# paper's held about 25,000), 40 epochs and `cpu`'s warm-up of 800 steps
# (not 4,000), since Multi30k is small and an epoch is short. It has no
# BLEU score here.

# %%
#| export
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
    "quick": TrainConfig(
        preset="quick",
        epochs=5,
        schedule="linear",
        warmup=300,
        factor=0.61,  # a peak learning rate of 2.2e-3, as `cpu` reaches
        dropout=0.0,
        checkpoint_dir="checkpoints/quick",
    ),
    "long": TrainConfig(
        preset="long",
        epochs=12,
        schedule="linear",
        warmup=300,
        factor=0.61,
        checkpoint_dir="checkpoints/long",
    ),
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

# %% [markdown]
# The BPE twins, and `get_config`, which returns a preset with some fields
# replaced (the command line's `--epochs`, for instance).

# %%
#| export
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


def get_config(preset="quick", **overrides):
    """A preset's TrainConfig with some fields replaced; AT_PRECISION=fp32
    in the environment makes float32 the default precision."""
    if preset not in PRESETS:
        raise ValueError(
            f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}"
        )
    forced = os.environ.get("AT_PRECISION")
    if forced and forced != "fp32":
        raise ValueError(
            f"AT_PRECISION={forced!r}: only fp32 (float32, no 16-bit"
            " arithmetic) can be set this way"
        )
    if forced:  # a precision the caller names still wins
        overrides = {"precision": "fp32", **overrides}
    return replace(PRESETS[preset], **overrides)


# %% [markdown]
# ## Vocabularies
#
# Building the word vocabularies (Part 3) takes a few seconds, so
# `load_vocab` caches them in `data/vocab.json`, keyed by `min_freq` and the
# spaCy version, and writes the file with `atomic_write` so that processes
# starting together never read half of it.
#
# Part 5's subword vocabulary (BPE) reads and writes raw text itself
# (`encode`, `decode`), where a word vocabulary needs spaCy's tokens;
# `is_subword` tells the two apart wherever that matters.
#
# Tokenizing the training set again at every run takes about 1.7 s on a
# 2-core CPU, a few percent of a short run. `encode_pairs_cached` keeps
# the ids that Part 3's `encode_pairs` makes in `data/encoded/`, one
# JSON file per set of pairs, named by a hash of the pairs, both
# vocabularies and the spaCy version, so that any change to them makes
# a new file; the command line's training passes it to
# `create_dataloaders`. Where the folder cannot be written, it encodes
# as before.


# %%
#| export
def is_subword(vocab):
    """True for Part 5's BPE vocabulary, which encodes raw text itself."""
    return hasattr(vocab, "encode")


# %%
#| export
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
    with atomic_write(path, "w") as f:  # processes never read half a file
        f.write(json.dumps(saved, ensure_ascii=False))
    return vocab_src, vocab_tgt


# %% [markdown]
# Part 5's BPE vocabulary is cached too, in `data/bpe.json`, and trained
# again when the file holds a vocabulary of another size. Its key is only
# that size: a new version of `tokenizers` reuses the file. It is trained
# on the training split's German and English sentences, in a few seconds.
# Like `vocab.json`, it stays in the repository's `data/` when
# `MULTI30K_DIR` moves the Multi30k files elsewhere.


# %%
#| export
def load_bpe(path=None, vocab_size=BPE_VOCAB_SIZE):
    """Joint German+English BPE of the train split, cached as JSON."""
    path = Path(path) if path is not None else data_dir() / "bpe.json"
    if path.is_file():
        bpe = BpeVocab.from_str(path.read_text(encoding="utf-8"))
        if len(bpe) == vocab_size:
            return bpe
    train = read_multi30k("train")  # never val or test
    bpe = train_bpe((s for pair in train for s in pair), vocab_size)
    with atomic_write(path, "w") as f:
        f.write(bpe.to_str())
    return bpe


# %% [markdown]
# A preset names its tokenization, and `load_vocabularies` turns that name
# into vocabularies for training: word vocabularies (Part 3), or one BPE
# vocabulary (Part 5) for both languages.


# %%
#| export
def encode_pairs_cached(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en):
    """encode_pairs(...), read from data/encoded/ when an earlier run
    wrote it for the same pairs, vocabularies and spaCy."""
    if is_subword(vocab_src):  # BPE encodes fast: nothing to keep
        return encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en)
    import spacy

    itos = (vocab_src.get_itos(), vocab_tgt.get_itos())
    key = json.dumps([spacy.__version__, *itos, pairs], ensure_ascii=False)
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = data_dir() / "encoded" / f"{name}.json"
    try:
        return [tuple(pair) for pair in json.loads(path.read_text())]
    except (OSError, ValueError):  # none yet, or unreadable: encode
        pass
    data = encode_pairs(pairs, vocab_src, vocab_tgt, spacy_de, spacy_en)
    with contextlib.suppress(OSError):  # a folder we cannot write to
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "w") as f:
            f.write(json.dumps(data))
    return data


# %%
#| export
def load_vocabularies(config, spacy_de, spacy_en):
    """(vocab_src, vocab_tgt) for a config: words, or one BPE for both."""
    if config.tokenization == "bpe":
        bpe = load_bpe()
        return bpe, bpe
    return load_vocab(spacy_de, spacy_en)


# %% [markdown]
# Check: the cache gives back the vocabularies that Part 3 builds. The
# first call writes the cache if there is none yet; the second reads it.

# %%
tokenizers = load_tokenizers()
load_vocab(*tokenizers)
assert (data_dir() / "vocab.json").is_file()
vocabs = load_vocab(*tokenizers)  # read from data/vocab.json
assert vocabs == build_vocabulary(*tokenizers)


# %% [markdown]
# ## Hardware
#
# Every result file records where it was measured: the CPU model, the
# number of threads torch uses, the torch version and any GPUs.


# %%
#| export
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
    elif torch.backends.mps.is_available():  # a Mac's GPU
        info["mps"] = True
    return info


# %%
summary = hardware_summary()
assert json.loads(json.dumps(summary)) == summary  # results store JSON
print(summary)

# %% [markdown]
# ### Which precision
#
# Part 3's `pick_device` chooses a CUDA GPU, then Apple's MPS, then the
# CPU. How to compute there is decided by one function, `choose_precision`,
# from what the hardware does natively:
#
# * **bfloat16 autocast** where bf16 matrix products are native: CUDA GPUs
#   of compute capability 8.0 or more (A100, L4, H100, RTX 30xx and later)
#   and CPUs with AVX512-BF16 or AMX. bf16 has the range of float32, so no
#   loss scaling is needed.
# * **float16 autocast with a `GradScaler`** on CUDA GPUs of compute
#   capability 7.x (tensor cores without bf16: Colab's T4, V100, RTX
#   20xx) and 6.0 (P100, whose float16 runs at twice its float32).
#   `torch.cuda.is_bf16_supported()` answers yes on a T4, but it counts
#   emulation, which is slower than float32. float16 is native on a T4,
#   but its range is small: the scaler multiplies the loss before the
#   backward pass so that small gradients do not round to zero, divides
#   the gradients again before the step, and skips a step whose gradients
#   overflowed.
# * **float32** everywhere else: on other CUDA GPUs (the GTX 10xx series,
#   capability 6.1, computes float16 at a small fraction of its float32
#   speed), on CPUs without native bf16, and on MPS,
#   where this project never measured or tested 16-bit training (no Mac
#   was at hand), so it takes the safe default.
#
# A config's `precision="fp32"` turns autocast off everywhere. The
# environment variable `AT_PRECISION=fp32` makes that the default of
# every config that `get_config` returns (the models that Parts 4 and 5
# train too), say when float16 gives `nan` on an older GPU. The CPU's
# flags come from `/proc/cpuinfo` (Linux): torch's public
# `torch.backends.cpu.get_cpu_capability()` names the vector width
# ("AVX512") but not bf16 support.


# %%
#| export
class Precision(NamedTuple):
    """How to compute: the autocast dtype (None: float32), and scaling."""

    dtype: torch.dtype | None
    scaler: bool


def cpu_has_native_bf16(cpuinfo="/proc/cpuinfo"):
    """True when the CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:  # not Linux: assume not
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def choose_precision(device, precision="auto"):
    """The Precision for training on `device` ("fp32": no autocast)."""
    # "auto": the best 16-bit format this device computes natively
    # (bfloat16, or float16 on older GPUs); "bf16" is its older name.
    # Other values are refused, so that a typo such as "fp16" cannot
    # quietly pick a branch.
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(
            f'precision is "auto" (the fastest this machine does well) or'
            f' "fp32", not {precision!r}'
        )
    device = torch.device(device)
    if precision == "fp32":
        return Precision(None, False)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= (8, 0):  # Ampere and later: native bf16
            return Precision(torch.bfloat16, False)
        if capability >= (7, 0) or capability == (6, 0):  # T4, V100, P100
            return Precision(torch.float16, True)
        return Precision(None, False)  # e.g. GTX 10xx: slow float16
    if device.type == "cpu" and cpu_has_native_bf16():
        return Precision(torch.bfloat16, False)
    return Precision(None, False)  # MPS, and CPUs without native bf16


def autocast_for(device, dtype):
    """A function returning a fresh autocast context (or a null one).

    A function, not a context: `run_epoch` enters a new one per batch."""
    if dtype is None:
        return contextlib.nullcontext
    device_type = torch.device(device).type
    return lambda: torch.autocast(device_type, dtype)


def describe_device(device, precision):
    """One line: the device, its name, and how it computes."""
    device = torch.device(device)
    name = "CPU"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = "Apple GPU"
    dtype = precision.dtype
    how = "float32"
    if dtype is not None:
        how = str(dtype).removeprefix("torch.") + " autocast"
    if precision.scaler:
        how += " with a GradScaler"
    return f"device: {device} ({name}), {how}"


# %% [markdown]
# Check, on this machine: the decision matches what the CPU's flags say,
# `fp32` always means no autocast, and the line names the device. The
# decisions for GPUs and Macs are tested in `tests/test_devices.py` on
# simulated machines.

# %%
here = pick_device()
decided = choose_precision(here)
print(describe_device(here, decided))
if here.type == "cpu":
    native = cpu_has_native_bf16()
    assert decided.dtype == (torch.bfloat16 if native else None)
assert choose_precision(here, "fp32") == Precision(None, False)

# %% [markdown]
# ## Checkpoint files
#
# A checkpoint holds only tensors and plain Python types, so it loads with
# `torch.load(..., weights_only=True)`, which refuses to run code hidden
# in a file. It is written with `atomic_write`, so a crash, a full disk
# or Ctrl-C mid-write never leaves half a checkpoint. torch reports a
# failed write as a `RuntimeError` about stream positions; `save_checkpoint`
# hands the file a small wrapper that keeps the operating system's own
# error (such as "No space left on device") and raises that instead.


# %%
#| export
class CheckpointError(ValueError):
    """A file that is not a checkpoint this code can use."""


class _KeepsWriteError:
    """A file wrapper that remembers the first OSError of a write."""

    def __init__(self, f):
        self.f = f
        self.error = None

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


# %% [markdown]
# `load_checkpoint` says what is true about a file it cannot use: a missing
# file (or a folder, or a link to nothing) is a `FileNotFoundError`, and
# each way a file can be unusable (empty,
# not a checkpoint at all, damaged or cut short, or holding a pickle that
# would build other objects) is a `CheckpointError` with its own one-line
# message. `checkpoint_head` checks the path (a folder, a pipe, a broken
# link, no file, no permission to read) and then the file's first two
# bytes, before torch reads it, and `check_zip` checks the
# CRC-32 that the archive records for each entry: `torch.load` does not,
# so a byte changed inside the weights would load as other weights. A
# failed check gets the same "damaged or cut short" message. A file in
# `torch.save`'s older pickle format that no longer unpickles, and a
# pickle that `torch.save` did not write, cannot be told apart; both are
# "damaged, or not written by torch.save". (`one_line` puts torch's own
# message on one line, and `shortened` cuts it to 200 characters.)


# %%
#| export
def one_line(err):
    """An exception's message on one line."""
    return " ".join(str(err).split()) or type(err).__name__


def shortened(text, limit=200):
    """`text`, cut at a word before `limit` characters when longer."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def checkpoint_head(path):
    """The first two bytes of a file that could be a checkpoint, checked."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(
            f"{path} is a folder; give a checkpoint file such as"
            f" {path / 'final.pt'}"
        )
    if path.exists() and not path.is_file():  # a pipe, a device
        raise CheckpointError(f"{path} is not a file, so not a checkpoint")
    if path.is_symlink() and not path.exists():
        raise FileNotFoundError(f"{path} is a link to nothing")
    if not path.is_file():
        where = "" if path.is_absolute() else f" (under {Path.cwd()})"
        raise FileNotFoundError(
            f"no checkpoint at {path}{where}; train one first (`make"
            " notebook`, or `train`)"
        )
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except PermissionError:  # the user's to fix, not the machine's
        raise CheckpointError(f"{path}: no permission to read it") from None
    if not head:
        raise CheckpointError(f"{path} is empty (0 bytes), not a checkpoint")
    if head != b"PK" and head[:1] != b"\x80":  # neither zip nor pickle
        raise CheckpointError(
            f"{path} is not a checkpoint: torch.save writes a zip archive"
            " (older versions a pickle), and this file is neither"
        )
    return head


def check_zip(path, message):
    """Refuse a zip checkpoint cut short, or with a byte changed: torch
    reads one without checking the CRC-32 that each entry records.
    `message` starts the error's text."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{message}: not a whole zip archive")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every entry, checks its CRC
    except Exception as err:  # a damaged directory: many kinds of error
        raise CheckpointError(
            f"{message}: {shortened(one_line(err))}"
        ) from err
    if bad is not None:
        raise CheckpointError(f"{message}: {bad} fails its checksum")


def load_checkpoint(path, device="cpu"):
    """Read a checkpoint safely (weights_only) onto `device`, checking a
    zip checkpoint's CRCs first."""
    head = checkpoint_head(path)  # b"PK": torch's zip, b"\x80": a pickle
    damaged = f"{path} is not a readable checkpoint (damaged or cut short)"
    if head == b"PK":
        check_zip(path, damaged)
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:
        # It would build other objects, or call a function: torch says
        # "Unsupported global" or "unsupported GLOBAL", by torch version.
        if "unsupported global" in str(err).lower():
            why = "holds more than tensors, so it is not loaded, for safety"
            raise CheckpointError(f"{path} {why}") from err
        if head == b"PK":
            raise CheckpointError(f"{damaged}: its pickle is broken") from err
        # torch.save's old pickle format, damaged, or another pickle
        raise CheckpointError(
            f"{path} is not a readable checkpoint (damaged, or not"
            " written by torch.save)"
        ) from err
    except Exception as err:  # cut short, damaged: many kinds of error
        raise CheckpointError(
            f"{damaged}: {shortened(one_line(err))}"
        ) from err
    if not isinstance(ckpt, dict):
        raise CheckpointError(
            f"{path} holds a {type(ckpt).__name__}, not a checkpoint"
        )
    return ckpt


# %% [markdown]
# A run saves one checkpoint per epoch, `epoch_000.pt`, `epoch_001.pt`
# and so on (`save_epoch`, in "Saving and resuming a run"). `epoch_of`
# reads the number back from a name, and `epoch_checkpoints` lists a
# folder's epoch files in order: Part 5 averages the last few.


# %%
#| export
EPOCH_FILE = re.compile(r"epoch_(\d{3,})\.pt")  # what save_epoch writes


def epoch_of(path):
    """The epoch in an epoch file's name: 7 for epoch_007.pt."""
    return int(EPOCH_FILE.fullmatch(Path(path).name)[1])


def epoch_checkpoints(folder):
    """The epoch checkpoints in a folder, oldest first: files named as
    save_epoch names them, in the order of their numbers (epoch_1000.pt
    comes after epoch_999.pt), and no other file."""
    found = Path(folder).glob("epoch_*.pt")
    return sorted(
        (p for p in found if EPOCH_FILE.fullmatch(p.name)), key=epoch_of
    )


# %% [markdown]
# A checkpoint stores its config as a dict, and vocabularies as plain
# data: the token lists of both vocabularies and, for a BPE vocabulary
# (Part 5), also its JSON text, which holds the merges.
# `checkpoint_config` rebuilds the config. `config_fields_now` reads an
# older run's config by today's names: two fields had other names, the
# old `amp="none"` meant what `precision="fp32"` means now, and
# `precision="bf16"` what `"auto"` means. `checkpoint_vocabularies` picks
# the vocabularies by the config's `tokenization`.


# %%
#| export
LEGACY_CONFIG_NAMES = {"num_epochs": "epochs", "amp": "precision"}


def config_fields_now(saved):
    """A saved config's fields, by the names and values used now."""
    fields = {LEGACY_CONFIG_NAMES.get(k, k): v for k, v in saved.items()}
    precision = fields.get("precision")
    if precision == "none":  # the old amp="none"
        fields["precision"] = "fp32"
    elif precision == "bf16":  # "auto" before it had that name
        fields["precision"] = "auto"
    return fields


def checkpoint_config(ckpt, path="checkpoint"):
    """The TrainConfig a checkpoint was trained with."""
    try:
        saved = ckpt["config"]
        if not isinstance(saved, dict):
            raise TypeError(f"its config is a {type(saved).__name__}")
        config = TrainConfig(**config_fields_now(saved))
    except (KeyError, TypeError, AttributeError) as err:
        why = f"no {err}" if isinstance(err, KeyError) else err
        raise CheckpointError(
            f"{path} does not match this code's Multi30k model: {why}"
        ) from err
    problems = model_size_problems(config)
    if problems:
        raise CheckpointError(
            f"{path} does not match this code's Multi30k model: "
            + "; ".join(problems)
        )
    return config


def model_size_problems(config):
    """What in a config no model can be built from (a damaged file)."""
    sizes = {k: getattr(config, k) for k in ("N", "d_model", "d_ff", "h")}
    problems = [
        f"{name}={value!r} is not a whole number above 0"
        for name, value in sizes.items()
        if type(value) is not int or value < 1
    ]
    if not problems and config.d_model % config.h:
        problems.append(
            f"d_model={config.d_model} is not divisible by h={config.h}"
        )
    dropout = config.dropout
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        problems.append(f"dropout={dropout!r} is not in [0, 1)")
    return problems


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


# %% [markdown]
# `load_weights` compares every tensor's size before it loads, so a file
# of another model is named with the first size that differs, in one
# short line rather than PyTorch's list of every difference. It also
# renames the weights of checkpoints that older versions of this project
# wrote (`rename_old_keys`, in the next section), and refuses weights
# that hold `nan` or `inf` (`refuse_non_finite`): a run that blew up
# would otherwise load and translate into nonsense.


# %%
#| export
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
    for name, tensor in expected.items():
        if saved[name].shape != tensor.shape:
            return (
                f"{name} is {size_words(saved[name])} in the file but "
                f"{size_words(tensor)} here"
            )
    return ""


def size_words(tensor):
    """A tensor's size as "2×3", or "a scalar"."""
    return "×".join(map(str, tensor.shape)) or "a scalar"


def load_weights(model, ckpt, path="checkpoint"):
    """Load a checkpoint's weights into `model`, or say how they differ."""
    state = ckpt.get("model")
    if isinstance(state, dict):
        state = rename_old_keys(state)  # older versions' names
        problem = size_mismatch(model.state_dict(), state)
    else:
        problem = "it holds no weights"
    if problem:
        raise CheckpointError(
            f"{path} does not match this code's Multi30k model: {problem}"
        )
    refuse_non_finite(state, path)
    model.load_state_dict(state)


def refuse_non_finite(state, path):
    """Refuse weights that hold nan or inf: a model whose training blew up
    (in float16 on a T4, say) would otherwise translate into nonsense."""
    for name, weight in state.items():
        if weight.is_floating_point() and not weight.isfinite().all():
            raise CheckpointError(
                f"{path}: its weight {name} holds nan or inf, so its training"
                " went wrong; train it again (in float32, if it trained in"
                " float16: docs/gpu.md)"
            )


# %% [markdown]
# ### Checkpoints from older versions
#
# Part 1 names every weight for what it is: an attention layer's four
# projections are `w_q`, `w_k`, `w_v` and `w_o`, and a layer's residual
# blocks are `self_attn_block`, `src_attn_block` and `ff_block`. Earlier
# versions of this project kept the 2022 names: a list `linears` of four
# projections, in that order, and a list `sublayer` of residual blocks,
# in the order the layer applies them. `rename_old_keys` maps a state dict
# with the old names to the new ones; keys already new pass unchanged, in
# their order. (2022 checkpoint files themselves cannot be used: their
# vocabularies are pickled torchtext objects.)


# %%
#| export
OLD_PROJECTIONS = {"0": "w_q", "1": "w_k", "2": "w_v", "3": "w_o"}
OLD_BLOCKS = {
    "encoder": {"0": "self_attn_block", "1": "ff_block"},
    "decoder": {
        "0": "self_attn_block",
        "1": "src_attn_block",
        "2": "ff_block",
    },
}


def rename_old_key(key):
    """One state-dict key with the old list names replaced by new names."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        following = parts[i + 1]
        if part == "linears" and following in OLD_PROJECTIONS:
            parts[i : i + 2] = [OLD_PROJECTIONS[following]]
            break
        if part == "sublayer" and parts[0] in OLD_BLOCKS:
            blocks = OLD_BLOCKS[parts[0]]  # encoder or decoder layer
            if following in blocks:
                parts[i : i + 2] = [blocks[following]]
                break
    return ".".join(parts)


def rename_old_keys(state_dict):
    """A state dict (old or new names) with the names Part 1 uses now."""
    return {rename_old_key(key): value for key, value in state_dict.items()}


# %% [markdown]
# **See, it matches.** Old keys from each kind of place land on keys that
# a new model has. (`tests/test_model.py` loads a whole model saved with
# the old names and checks that it computes the same outputs.)

# %%
model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
old_keys = [
    "encoder.layers.0.self_attn.linears.0.weight",
    "encoder.layers.0.sublayer.1.norm.a_2",
    "decoder.layers.0.src_attn.linears.3.bias",
    "decoder.layers.0.sublayer.1.norm.b_2",
]
for key in old_keys:
    print(f"{key:45s} -> {rename_old_key(key)}")
    assert rename_old_key(key) in model.state_dict()


# %% [markdown]
# Check: a checkpoint round-trips; random bytes and an empty file are
# each refused with their own message; and `size_mismatch` names the first
# size that differs in weights of another model.

# %%
with tempfile.TemporaryDirectory() as tmp:
    weights = {"w": torch.arange(6.0).view(2, 3)}
    save_checkpoint(f"{tmp}/a.pt", model=weights, config={})
    assert torch.equal(
        load_checkpoint(f"{tmp}/a.pt")["model"]["w"], weights["w"]
    )
    Path(tmp, "noise.pt").write_bytes(bytes(range(7, 250)))
    Path(tmp, "empty.pt").write_bytes(b"")
    for name, message in [("noise", "not a checkpoint"), ("empty", "0 bytes")]:
        try:
            load_checkpoint(f"{tmp}/{name}.pt")
            raise AssertionError(f"{name}.pt was loaded")
        except CheckpointError as err:
            assert message in str(err), err
    other = {"w": torch.zeros(3, 3)}
    assert size_mismatch(weights, other) == "w is 3×3 in the file but 2×3 here"


# %% [markdown]
# `load_trained_model` puts these together to read a `final.pt` back: it
# rebuilds the vocabularies and the model from the checkpoint alone and
# refuses a file that does not match this code with a short message. It
# loads onto `pick_device()`'s device unless given one; Parts 4 and 5 ask
# for the CPU, where they look inside the model.


# %%
#| export
def load_trained_model(path, device="auto"):
    """(model in eval mode, vocab_src, vocab_tgt, config) from a checkpoint."""
    ckpt = load_checkpoint(path)  # onto the CPU; the model moves at the end
    return trained_model_from(ckpt, path, device)


def trained_model_from(ckpt, path, device="auto"):
    """load_trained_model's work on a checkpoint already read from `path`."""
    device = pick_device() if device in (None, "auto") else device
    config = checkpoint_config(ckpt, path)
    vocab_src, vocab_tgt = checkpoint_vocabularies(ckpt, path)
    sizes = (len(vocab_src), len(vocab_tgt))
    model = model_from_config(config, *sizes, dropout=0.0)
    load_weights(model, ckpt, path)
    return model.to(device).eval(), vocab_src, vocab_tgt, config


# %% [markdown]
# Part 5's checkpoint averaging, from files: `average_checkpoints` reads
# one checkpoint at a time and sums in float64 on the CPU (Apple's GPU has
# no float64), then moves the model to the device asked for. Each file's
# weights are checked as `load_weights` checks them, and renamed if an
# older version wrote them (`weights_to_average`). Given a run's
# `history` (the list of epoch losses saved in its checkpoints, as in
# its `last.pt`), it also checks that each file is that run's epoch file
# (`check_run_file`): the paragraph on `--average`, after
# `load_translator`, says why.


# %%
#| export
def average_checkpoints(paths, device="cpu", history=None):
    """(model, vocab_src, vocab_tgt, config) with the mean of the weights.
    With `history` (a run's losses), each file must be of that run."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("no checkpoints to average")
    model, vocab_src, vocab_tgt, config = load_trained_model(paths[0], "cpu")
    params = dict(model.named_parameters())
    sums = {
        n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()
    }
    for path in paths:
        weights = weights_to_average(path, model, paths[0], history)
        for name in sums:
            sums[name] += weights[name].double()
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(sums[name] / len(paths))
    return model.to(device).eval(), vocab_src, vocab_tgt, config


def weights_to_average(path, model, first_path, history=None):
    """The weights in the checkpoint at `path`, by Part 1's names, if they
    fit `model` (read from the file `first_path`): the same sizes, the same
    buffers, all finite. With `history`, the file must be its run's."""
    ckpt = load_checkpoint(path, "cpu")  # MPS has no float64
    if history is not None:
        check_run_file(path, ckpt, history)
    state = ckpt.get("model")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no model weights")
    state = rename_old_keys(state)  # older versions' names, as on load
    problem = size_mismatch(model.state_dict(), state)
    if problem:
        raise CheckpointError(
            f"{path} is not the same model as {first_path}: {problem}"
        )
    for name, buffer in model.named_buffers():  # the positional encoding
        if not torch.equal(state[name], buffer):
            raise CheckpointError(f"{path}: buffer {name} differs")
    refuse_non_finite(state, path)
    return state


def check_run_file(path, ckpt, history):
    """Refuse an epoch file that is not its run's file of the epoch its
    name says: a copied or renamed file, or another run's."""
    if not EPOCH_FILE.fullmatch(Path(path).name):
        raise ValueError(f"{path} is not named as an epoch file, epoch_NNN.pt")
    named = epoch_of(path)
    if ckpt.get("epoch") != named:
        raise ValueError(
            f"{path} holds epoch {ckpt.get('epoch')!r}, not {named}: a"
            " copied or renamed file"
        )
    if not same_run(ckpt.get("history"), history):
        raise ValueError(
            f"{path} is from another training run (its losses differ "
            "from the checkpoint's): the folder holds two runs' files"
        )


def same_run(epoch_history, history):
    """Is a file's history of losses the start of a run's `history`?
    Compared as text, so that a diverged run's NaN matches itself."""
    if epoch_history is None:  # a file from before histories were saved
        return True
    start = list(history)[: len(epoch_history)]
    return repr(list(epoch_history)) == repr(start)


# %% [markdown]
# ## Training runs: devices and processes
#
# Part 3's `train_one_process` is the whole training loop in one process.
# `train_worker` runs the same loop with faster pieces on the CPU
# (`FastDropout`, `FastLabelSmoothing`, `FusedLossCompute`, the bf16
# residual stream and the C++ dropout kernel, below), and adds what a
# long run needs:
#
# * **Checkpoint files**, written after every epoch (see "Checkpoint
#   files"), and resuming from them.
# * **Lower precision** where the hardware computes it natively, as
#   `choose_precision` (see "Which precision") decides.
# * **Several processes.** With $n$ processes, `DistributedDataParallel`
#   (DDP) keeps a copy of the model in each. Every process computes
#   gradients on its own share of the batches, and DDP averages them
#   across processes before each optimizer step, so the copies stay equal.
#   The processes talk through `torch.distributed`: the NCCL backend
#   between GPUs, gloo between CPU processes.
# * **The CPU waits for the GPU only at the end of an epoch.** Batches
#   are copied from pinned memory (page-locked host memory, which the GPU
#   can read while it computes), so the copy overlaps the computation,
#   and their masks are made on the GPU. The loss stays on the GPU until
#   the end of the epoch (Part 2's `run_epoch`). Even a float16 step does
#   not wait: a float16 step must be skipped when its gradients overflow,
#   and fused Adam reads that flag (set by the `GradScaler`, which scales
#   float16 losses) on the GPU, without asking the CPU.
#
# `tests/test_devices.py` checks that `train_worker` and
# `train_one_process` end with the same weights and losses, to rounding,
# on the dropout-free `ci` preset, when the worker computes the loss as
# the lesson does; with `FusedLossCompute`, with the same losses.
#
# `train_worker` calls the library's copies of Part 3's cells, in
# `the_annotated_transformer.py`, which `make export` writes from
# `notebooks/03_multi30k.py`. So an edit to a cell of Part 3 reaches its
# own loop, `train_one_process`, at once, but reaches `train_worker`
# only once it is exported and the notebook restarted.
#
# The calls, from the command line down (each function has its own
# section below, in roughly the opposite order):
#
# ```
# command_train                    the `train` sub-command: checks, lock
#   train_locked                   the vocabularies, then
#     train_model                  one process, or several:
#       train_worker               one process: its whole run
#       train_distributed_model    several: spawns them, and each runs
#         _spawned_worker            -> train_worker
#     train_worker                 under torchrun: this process's share
#
# train_worker
#   TrainingRun                    model, optimizer, schedule, precision
#   train_epoch                    one epoch: train_pass, then validate
#   save_epoch                     epoch_NNN.pt and last.pt
# ```
#
# The sections in between build the pieces: batches for several
# processes, one device per process, a cheaper dropout and label
# smoothing, R-Drop, and the run itself.
#
# ### Batches for several processes
#
# With data-parallel training over `n` processes, each process trains on
# every `n`-th batch of Part 3's `TokenBatchSampler`. `ShardedBatchSampler`
# wraps that sampler: `num_replicas=n`, and `rank`, the process's number
# from 0 to `n - 1`. All processes build the same batches, since the
# shuffling seed `(seed, epoch)` is the same in each. They must also run
# the same number of steps: DDP averages the gradients of all processes
# at every step, so a process with one batch more would wait forever for
# the others. `split_evenly` therefore halves the largest batches until
# their count divides by `n`. `shard_loader` rebuilds one of Part 3's
# `DataLoader`s around the wrapped sampler, with pinned memory for a GPU;
# with one process it changes nothing but the pinning.


# %%
#| export
def split_evenly(batches, n):
    """Halve the largest batches until their number divides by n."""
    while len(batches) % n:
        k = max(range(len(batches)), key=lambda b: len(batches[b]))
        if len(batches[k]) < 2:
            raise ValueError("too few examples to give every rank a batch")
        half = len(batches[k]) // 2
        batches[k : k + 1] = [batches[k][:half], batches[k][half:]]
    return batches


class ShardedBatchSampler(torch.utils.data.Sampler):
    """One process's share of a TokenBatchSampler: every n-th batch."""

    def __init__(self, sampler, num_replicas, rank):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        self.sampler = sampler
        self.num_replicas = num_replicas
        self.rank = rank

    def set_epoch(self, epoch):
        """Reshuffle for `epoch` (the same on every rank)."""
        self.sampler.set_epoch(epoch)

    def epoch_batches(self):
        """The batches of every rank for the current epoch."""
        batches = self.sampler.epoch_batches()
        return split_evenly(batches, self.num_replicas)

    def __iter__(self):
        yield from self.epoch_batches()[self.rank :: self.num_replicas]

    def __len__(self):
        return len(self.epoch_batches()) // self.num_replicas


def shard_loader(loader, num_replicas, rank, pin_memory=False):
    """A DataLoader of Part 3 that hands this rank its share of batches."""
    return torch.utils.data.DataLoader(
        loader.dataset,
        batch_sampler=ShardedBatchSampler(
            loader.batch_sampler, num_replicas, rank
        ),
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=pin_memory,
    )


# %% [markdown]
# Check, on made-up sentence lengths: two ranks get as many batches each,
# and disjoint pairs that together cover every pair the sampler kept.

# %%
from the_annotated_transformer import TokenBatchSampler

rng = torch.Generator().manual_seed(0)
made_up = torch.randint(3, 60, (1001, 2), generator=rng).tolist()
sampler = TokenBatchSampler(made_up, max_tokens=400, max_len=50)
ranks = [ShardedBatchSampler(sampler, 2, rank) for rank in (0, 1)]
seen = [{i for batch in shard for i in batch} for shard in ranks]
assert len(ranks[0]) == len(ranks[1])
assert not seen[0] & seen[1]
assert len(seen[0] | seen[1]) == len(made_up) - len(sampler.dropped) > 0

# %% [markdown]
# ### One device per process
#
# `process_device` gives each process its device. A process alone gets
# `pick_device`'s choice: the device that `AT_DEVICE` names, else the
# GPU, Apple's GPU or the CPU.
#
# With several processes and CUDA, each process gets a GPU of its own,
# numbered by its *local* rank, its rank among the processes of this
# machine (`torchrun` sets `LOCAL_RANK`; the global `RANK` counts the
# processes of every machine). NCCL refuses two processes on one GPU, so
# with fewer GPUs than processes there are two honest answers: an error
# that says so, or, when the caller allows it, all processes on the CPU
# with gloo. Without CUDA, or where `AT_DEVICE` names the CPU or Apple's
# GPU, several processes use the CPU: gloo cannot send MPS tensors.


# %%
#| export
def cuda_count():
    """How many CUDA GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def process_device(local_rank=0, local_world_size=1, cpu_fallback=False):
    """The device of one process: pick_device's if it is alone, else its
    own GPU, or the CPU."""
    if local_world_size == 1:
        device = pick_device()
        if device == torch.device("cuda"):  # the first GPU: say which
            device = torch.device("cuda", local_rank)
        return device
    if pick_device().type != "cuda":  # no GPU, a Mac, or AT_DEVICE=cpu
        return torch.device("cpu")  # gloo: it cannot send MPS tensors
    gpus = cuda_count()
    if gpus >= local_world_size:
        return torch.device("cuda", local_rank)
    if gpus and not cpu_fallback:
        processes = "process" if gpus == 1 else "processes"
        raise ValueError(
            f"{local_world_size} processes need a GPU each, and this "
            f"machine has {gpus}; use at most {gpus} {processes}, or train"
            " them on the CPU (AT_DEVICE=cpu)"
        )
    return torch.device("cpu")


def backend_for(device):
    """The torch.distributed backend for processes on this device type."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# %% [markdown]
# ### A cheaper dropout mask
#
# `nn.Dropout` builds its mask with `Tensor.bernoulli_`, which asks the
# random number generator for one number per element. Profiled on two
# machines whose CPUs have native bf16 (an Intel Xeon with AMX and an AMD
# EPYC), that mask was about a quarter of a bf16 training step of the
# `cpu` model (25.6% and 24.8%, `bench/RESULTS_efficiency.md`).
#
# The idea: ask for one 64-bit random number per *four* elements
# instead, and read it as four 16-bit random integers, one per element.
# (`random_(-(2**63), None)` fills an int64 with 64 uniform random bits;
# viewed as int16, each lane is uniform over its 65,536 values, from
# -32,768 to 32,767.)
#
# The exact probability: an element is dropped when its integer is among
# the `dropped = round(p * 65536)` smallest, that is, below
# `dropped - 32768`. So it is kept with probability
# `(65536 - dropped) / 65536`, within 1/131,072 of $1 - p$ (`dropped` is
# capped at 65,535, so the keep probability is never 0).
#
# The scale: kept elements are multiplied by one over that exact
# probability, at $p = 0.2$ by 1.2499952 rather than `nn.Dropout`'s 1.25.
# Either way the *expected* value of every element is unchanged, up to
# the rounding of the scale in the input's dtype (bf16 rounds 1.2499952
# to 1.25: a bias of 4 in a million). That all four 16-bit lanes of a
# random number are uniform is tested (`tests/test_fast_dropout.py`),
# since `random_`'s documentation does not promise it.
#
# `FastDropout` is an `nn.Dropout` with that mask. In `eval()` mode it
# returns its input unchanged, as `nn.Dropout` does (the last assert
# below). On devices other than the CPU it calls `F.dropout`, as
# `nn.Dropout` does: CUDA's dropout is one fused kernel already.
# `use_fast_dropout` swaps it in for every `nn.Dropout` of a model, in
# place; dropout has no weights, so checkpoints do not change.
# `TrainingRun`, below, makes the swap. The lessons' loop,
# `train_one_process`, keeps `nn.Dropout`, so, with dropout on, the two
# draw different masks from the same seed; the test that they end with
# the same weights uses the `ci` preset, which has no dropout.
#
# Attention's weights get the cheap mask too. PyTorch's fused attention
# kernel for the CPU takes no dropout, so with dropout
# `scaled_dot_product_attention` on the CPU falls back to its own
# unfused formula, which draws its own mask. So on the CPU, training
# with dropout, Part 1's `use_fused` sends attention through Part 1's
# `attention` instead: the same work, but its dropout is an ordinary
# module, `self.dropout`, that the swap replaces.
#
# Timings, from one run of `bench/efficiency.py` on a 2-core EPYC with
# native bf16 (`avx512_bf16`; not the CPU of Part 3's recorded run), on
# the `cpu` model (`bench/RESULTS_efficiency.md`): the cheap masks,
# attention's included, made a bf16 training step 1.18 times as fast,
# and an fp32 step 1.12 times. Of that, attention's dropout gave 1.03
# times in bf16 (3880.8 against 3752.7 tok/s), and nothing in fp32.
#
# One more detail, found later on a Xeon with AMX: the mask is a `bool`
# tensor, and torch casts `bool` to bf16 one element at a time, while the
# same bytes read as `uint8` cast about 6 times as fast. So the code
# views the mask as `uint8` before the cast.


# %%
#| export
def cheap_keep_mask(shape, p):
    """(mask, keep probability): a CPU bool tensor of `shape`, each
    element True (kept) with probability within 1/131,072 of 1 - p."""
    n = math.prod(shape)
    dropped = min(round(p * 65536), 65535)  # of the 65,536 int16 values
    bits = torch.empty((n + 3) // 4, dtype=torch.int64)
    bits.random_(-(2**63), None)  # all 64 bits uniform
    int16s = bits.view(torch.int16)[:n].view(shape)
    return int16s >= dropped - 32768, (65536 - dropped) / 65536


class FastDropout(torch.nn.Dropout):
    """nn.Dropout whose CPU mask draws one random number per 4 elements."""

    def forward(self, x):
        if not self.training or not 0 < self.p < 1 or x.device.type != "cpu":
            return super().forward(x)  # F.dropout, or x itself
        keep, keep_prob = cheap_keep_mask(x.shape, self.p)
        # Read as uint8 first: torch converts bool to bf16 one element at
        # a time, and uint8 (the same bytes) about 6 times as fast.
        scaled = keep.view(torch.uint8).to(x.dtype).mul_(1 / keep_prob)
        return x.mul_(scaled) if self.inplace else x * scaled


def use_fast_dropout(model):
    """Swap every nn.Dropout in `model` for FastDropout; return `model`."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is torch.nn.Dropout:
                fast = FastDropout(child.p, child.inplace)
                fast.train(child.training)  # as the one replaced
                setattr(module, name, fast)
    return model


# %%
torch.manual_seed(0)
ones = torch.ones(400, 1000)
for label, dropout in (
    ("nn.Dropout", torch.nn.Dropout(0.2)),
    ("FastDropout", FastDropout(0.2)),
):
    out = dropout(ones)
    dropped = (out == 0).float().mean().item()
    print(
        f"{label:11s} dropped {dropped:.4f}, mean {out.mean():.4f}, "
        f"kept values {out[out > 0].unique().tolist()}"
    )
    # 400,000 draws: the fraction's standard deviation is 0.0006
    assert abs(dropped - 0.2) < 0.003 and abs(out.mean() - 1) < 0.005
kept = FastDropout(0.2)(ones)
kept = kept[kept > 0]  # one over the exact keep probability
assert torch.allclose(kept, torch.tensor(65536 / 52429))
assert FastDropout(0.2).eval()(ones) is ones


# %% [markdown]
# ### The loss's gradient, written by hand
#
# Part 2's `smoothed_kl` computes the label-smoothed loss without its
# $N \times V$ target matrix ($N$ target tokens, $V$ words), but autograd's
# backward pass still builds three $N \times V$ gradients, one for each way
# the loss reads the log-probabilities (the gathered target, the row sums,
# the padding column), and adds them up. In bf16 the row sums also cast the
# whole matrix to float32 first: with a `cpu` batch of about 3,000 target
# tokens and Part 3's English vocabulary of 6,190 words, each of these
# passes reads or writes 18.6 million numbers.
#
# The gradient needs none of it. Write $x_j = \log q_j$ for the inputs, and
# treat each as a free number, as autograd does (the log-softmax before the
# loss takes care of the constraint that the $q_j$ sum to 1). A row's loss
# is $\sum_j p_j \log p_j - \sum_j p_j x_j$, and $p$ depends on the target
# alone, so
#
# $$\frac{\partial\,\mathrm{loss}}{\partial x_j} = -p_j :$$
#
# $-c$ at the target, $-f$ at the $V - 2$ other words, 0 in the padding
# column, and 0 in padding rows, whose $p$ is all zeros. That is minus
# Part 2's `true_dist`. The loss sums its rows, so the whole gradient is
# $-g$ times `true_dist`, where $g$ is the number that backpropagation
# brings to the loss (in training, 1 over the batch's token count, since
# we backpropagate the mean). The log-softmax's own backward pass then
# turns $-p$ into $q - p$, the familiar "prediction minus target".
#
# `SmoothedKL` is an `autograd.Function` that says so. Its forward pass is
# `smoothed_kl` itself, called on blocks of 256 rows, so that a bf16
# block's float32 copy is 6 MB, not the whole matrix's 74. Its
# backward pass writes the one $N \times V$ matrix: $-f g$ in every real row
# (0 in padding rows), then $-c g$ at each target, and 0 in the padding
# column. `FastLabelSmoothing` is `LabelSmoothing` with that function as
# its `closed_form` (`keep_targets=True` still builds the matrix). It
# gives the same loss and gradient, to rounding (`tests/test_fast_loss.py`
# compares both with autograd's, and with finite differences).
# `TrainingRun` uses it; the lessons keep `LabelSmoothing`. On the 2-core
# EPYC with native bf16 it made a whole bf16 training step of the `cpu`
# model 1.08 times as fast, and a float32 step 1.04 times
# (`bench/RESULTS_efficiency.md`).


# %%
#| export
class SmoothedKL(torch.autograd.Function):
    """smoothed_kl, with its gradient written by hand: minus the smoothed
    target distribution."""

    @staticmethod
    def forward(ctx, x, target, padding_idx, smoothing, rows=256):
        ctx.save_for_backward(target)
        ctx.settings = (x.shape, x.dtype, padding_idx, smoothing)
        acc = torch.promote_types(x.dtype, torch.float32)
        total = x.new_zeros((), dtype=acc)  # also the loss of no rows
        for i in range(0, len(x), rows):  # a bf16 block's float32 copy
            block = slice(i, i + rows)
            total += smoothed_kl(
                x[block], target[block], padding_idx, smoothing
            )
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        (target,) = ctx.saved_tensors
        shape, dtype, padding_idx, smoothing = ctx.settings
        c, f = 1.0 - smoothing, smoothing / (shape[1] - 2)
        real = target != padding_idx  # (N,): padding rows get 0
        other = torch.where(real, -f * grad_loss, 0.0).to(dtype)  # (N,)
        grad = torch.empty(shape, dtype=dtype, device=target.device)
        grad.copy_(other.unsqueeze(1))  # -f g everywhere in a real row
        at_target = torch.where(real, -c * grad_loss, 0.0).to(dtype)
        rows = torch.arange(len(target), device=target.device)
        grad[rows, target] = at_target  # -c g at each target
        grad[:, padding_idx] = 0
        return grad, None, None, None, None


class FastLabelSmoothing(LabelSmoothing):
    """LabelSmoothing whose closed form has a hand-written gradient."""

    def closed_form(self, x, target):
        return SmoothedKL.apply(x, target, self.padding_idx, self.smoothing)


# %% [markdown]
# The check: both losses, and both gradients, with an upstream $g = 3$,
# against $-3$ times the smoothed targets.

# %%
torch.manual_seed(0)
logp = torch.randn(600, 50).log_softmax(-1)  # 600 rows: three blocks
target = torch.randint(0, 50, (600,))
target[::7] = PAD
slow = LabelSmoothing(size=50, padding_idx=PAD, smoothing=0.1)
fast = FastLabelSmoothing(size=50, padding_idx=PAD, smoothing=0.1)
losses, grads = [], []
for criterion in (slow, fast):
    x = logp.clone().requires_grad_()
    loss = criterion(x, target)
    (3 * loss).backward()
    losses.append(loss.detach())
    grads.append(x.grad)
    print(f"{type(criterion).__name__:18s} loss {loss.item():.4f}")
assert torch.isclose(losses[0], losses[1])
assert torch.allclose(grads[0], grads[1], atol=1e-7)
assert torch.allclose(grads[1], -3 * fast.true_dist, atol=1e-7)


# %% [markdown]
# ### The generator and the loss in one, a block at a time
#
# With the cheaper dropout mask and the hand-written loss gradient above,
# the vocabulary is still the largest cost of a CPU training step outside
# the matrix products. With a batch of the `cpu` preset (about 3,000
# target tokens, `d_model` 256) and 6,190 English words, the generator
# writes an 18.6-million-number matrix of logits, log-softmax writes
# another, the loss reads it, and the backward pass writes two more: the
# loss's gradient and the log-softmax's. Log-softmax and the loss do
# only a few operations per number, so their time goes into reading and
# writing these matrices, not into arithmetic.
#
# Only the logits and, in training, their gradient need exist, a block
# of rows at a time; the log-probabilities and the separate gradients of
# the loss and of log-softmax need never be written. Write $h$ for one
# row of the decoder's output (the code's `x`), $z = W h + b$ for its
# logits, and $\ell = \log \sum_j e^{z_j}$ (the "log-sum-exp"), so that
# the log-probabilities are $z_j - \ell$. With the smoothed targets of the
# previous section ($c$ at the target $y$, $f$ at each of the $V - 2$
# other words, 0 at the padding word), the row's loss is
#
# $$\sum_j p_j \log p_j - \sum_j p_j (z_j - \ell)
#   = \sum_j p_j \log p_j - c\,z_y - f\,(S - z_y - z_{\text{pad}}) + \ell,$$
#
# where $S = \sum_j z_j$, and $\ell$ keeps its whole weight because the
# $p_j$ sum to 1. (Rows whose target is padding have no loss: they are
# dropped before anything else.) Four numbers per row: $\ell$, $S$, $z_y$
# and $z_{\text{pad}}$. So the forward pass computes the logits a block
# of rows at a time and takes those four numbers before it moves on to
# the next block.
#
# The gradient: since $\partial \ell / \partial z_k = e^{z_k - \ell} = q_k$,
# the model's probability of word $k$, differentiating the loss above
# gives $q_k - p_k$, the familiar "prediction minus target", times $g$, the
# number backpropagation brings to the loss. (At the padding column $p$ is
# 0, so that logit gets $g\,q_{\text{pad}}$; in the previous section it
# was 0, because there the gradient was taken with respect to the
# log-probabilities.) It needs only $\ell$, which the block's rows have
# just given. And `GeneratorLoss` returns one number, the summed loss,
# so $g$ is one number, and the gradient for any $g$ is $g$ times the
# gradient for $g = 1$: the forward pass can compute it before $g$ is
# known. So the forward pass, while it still holds a block, also turns
# the block's logits into $G = q - p$, one row per token, and that into
# the three gradients: $G W$ is the block's own rows of $h$'s gradient;
# $G^\top h$ (the block's rows of $h$) is added into $W$'s, and $G$'s
# column sums into $b$'s. The backward pass only multiplies the three by
# $g$ and puts zeros back in the padding rows. No $N \times V$ matrix
# outlives its block, each logit is computed once, and where no gradient
# is wanted (validation, under `torch.no_grad`) the forward pass stops
# at the loss (`FusedLossCompute` hands it tensors that require no
# gradient there). A block holds at most $2^{24}$ logits (`block_logits`),
# the rows split evenly: a batch of the `cpu` preset is one or two
# blocks. In bf16 that block of logits is 32 MiB, the largest block that
# glibc keeps for reuse under `keep_freed_memory` (below); float32
# blocks, and the torch code's float32 copy of a bf16 block, are 64 MiB
# and are mapped afresh each time.
#
# `GeneratorLoss` is that `autograd.Function`, and `FusedLossCompute` is
# Part 2's `SimpleLossCompute` calling it with the generator's weights,
# in place of `generator(x)` followed by the criterion. It gives the same
# loss and gradients as `Generator` followed by `LabelSmoothing`, to
# rounding (`tests/test_generator_loss.py`, in float64 and under bf16
# autocast; the check below, in float64). It relies on the generator
# being Part 1's `Generator`, a linear layer then log-softmax, which every
# model here has. On the CPU, `train_epoch` (below) uses it for
# validation always, and for the training batches unless R-Drop (below)
# is on, since R-Drop needs the log-probabilities themselves. On
# a GPU (CUDA, or a Mac's), where log-softmax is one fast kernel,
# training and validation keep `SimpleLossCompute`.
#
# A first version of this section kept only $\ell$ in the forward pass,
# and its backward pass computed the logits again, a block of words at a
# time: the generator's product twice (about 9 GFLOP more for a batch of
# 3,000 target tokens) and every exponential twice. Measured with
# `bench/efficiency.py` on a 2-core Xeon with AMX, beside the log-softmax
# path in the same runs (`bench/RESULTS_efficiency.md`), that version
# made a bf16 training step of the `cpu` model 1.06 times as fast at 2
# threads and 1.04 times at 1, and a float32 step 1.02 times. Taking the
# gradient in the forward pass, as above (with the C++ kernel below,
# which takes each exponential once, and adds the bias; the first
# version already had an older form of that kernel), made the
# generator and the loss, forward and backward together, 1.27 to 1.38
# times as fast on batches of the `cpu` model's shape, in bf16 at 2
# threads, and three epochs of `train --preset cpu` 1.03 and 1.04
# times as fast (two pairs of runs, in the same hour; the section "The
# loss's gradient in the forward pass" of `bench/RESULTS_efficiency.md`).


# %%
#| export
def compute_dtype(x):
    """The dtype in which a matrix product of `x` computes: autocast's
    when autocast is on for x's device (float64 stays float64), else
    x's own."""
    if x.dtype != torch.float64 and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def smoothing_constants(smoothing, vocab):
    """(c, f, sum of p log p over a real row's smoothed targets)."""
    c, f = 1.0 - smoothing, smoothing / (vocab - 2)
    plogp = c * math.log(c) if c > 0 else 0.0  # 0 log 0 counts as 0
    if smoothing > 0:
        plogp += smoothing * math.log(f)
    return c, f, plogp


def rows_per_block(rows, width, most):
    """Rows per block, for `rows` rows of `width` numbers in blocks of at
    most `most` numbers (but at least one row), the rows split evenly."""
    most_rows = max(1, most // width)
    blocks = max(1, math.ceil(rows / most_rows))
    return max(1, math.ceil(rows / blocks))  # at most most_rows


class GeneratorLoss(torch.autograd.Function):
    """Generator, log-softmax and label-smoothed loss (summed) in one, a
    block of rows at a time; each block's logits are turned into their
    gradient at once, so the backward pass only scales."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, target, padding_idx, smoothing, kernel, most
    ):
        """x: (N, d_model); weight: (V, d_model); bias: (V,); target: (N,);
        kernel: None, or the C++ loss kernel ("A loss kernel in C++");
        most: the most logits a block may hold."""
        dtype = compute_dtype(x)  # bf16 under bf16 autocast
        acc = torch.promote_types(dtype, torch.float32)  # for the sums
        c, f, plogp = smoothing_constants(smoothing, len(weight))
        cpu = x.device.type == "cpu"
        if kernel is not None and not (cpu and dtype in KERNEL_DTYPES):
            kernel = None  # it takes bf16 and float32 CPU tensors only
        real = target != padding_idx  # padding rows have no loss
        xr, tr = x[real].to(dtype), target[real]  # (M, d_model), (M,)
        w, b = weight.to(dtype), bias.to(dtype)
        wants_grads = any(ctx.needs_input_grad[:3])  # (see the caller)
        total = torch.zeros((), dtype=acc, device=x.device)
        grad_xr = grad_w = grad_b = None  # the gradients for g = 1
        if wants_grads:
            grad_xr = torch.empty_like(xr)
            grad_w = torch.zeros(w.shape, dtype=acc, device=x.device)
            grad_b = torch.zeros(b.shape, dtype=acc, device=x.device)
        rows = rows_per_block(len(xr), len(w), most)
        for i in range(0, len(xr), rows):
            block = slice(i, i + rows)
            if kernel is not None:  # the same, in C++, which adds b
                z = xr[block] @ w.t()  # (rows, V), without b
                rows_of = kernel.smoothed_rows
                if wants_grads:  # (lse, loss, gradient, column sums)
                    rows_of = kernel.smoothed_rows_grad
                _, row_losses, *grads = rows_of(
                    z, bias.float(), tr[block], padding_idx, c, f, plogp
                )
                total += row_losses.sum()
                if wants_grads:
                    grad_z, column_sums = grads
            else:
                z = torch.addmm(b, xr[block], w.t())  # (rows, V)
                z = z.to(acc)
                lse = z.logsumexp(1)
                z_y = z.gather(1, tr[block, None]).squeeze(1)
                rest = z.sum(1) - z_y - z[:, padding_idx]  # f's words
                total += (plogp - c * z_y - f * rest + lse).sum()
                if wants_grads:  # q - p: q - f, then two columns fixed
                    q_minus_p = z.sub_(lse[:, None]).exp_().sub_(f)
                    at = torch.arange(len(q_minus_p), device=x.device)
                    q_minus_p[at, tr[block]] -= c - f
                    q_minus_p[:, padding_idx] += f  # p is 0 there
                    column_sums = q_minus_p.sum(0)
                    grad_z = q_minus_p.to(dtype)  # bf16 under bf16 autocast
            if wants_grads:  # the block's share of the three gradients
                grad_xr[block] = grad_z @ w
                grad_w += grad_z.t() @ xr[block]
                grad_b += column_sums
        ctx.save_for_backward(grad_xr, grad_w, grad_b, real)
        ctx.settings = (x.shape, x.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        grad_xr, grad_w, grad_b, real = ctx.saved_tensors
        x_shape, x_dtype, w_dtype = ctx.settings
        grad_x = torch.zeros(x_shape, dtype=x_dtype, device=real.device)
        grad_x[real] = (grad_xr * grad_loss).to(x_dtype)  # padding rows: 0
        grad_w = (grad_w * grad_loss).to(w_dtype)
        grad_b = (grad_b * grad_loss).to(w_dtype)
        # no gradient for target, padding_idx, smoothing, kernel, most
        return grad_x, grad_w, grad_b, None, None, None, None, None


class FusedLossCompute(SimpleLossCompute):
    """SimpleLossCompute through GeneratorLoss: the same loss and
    gradients, for Part 1's Generator. The criterion gives its padding_idx
    and smoothing only; it is not called (so its true_dist is not kept).
    `kernel`, when set, is the C++ loss kernel ("A loss kernel in C++");
    `block_logits` bounds a block of logits (2**24: 32 MiB in bf16)."""

    kernel = None
    block_logits = 2**24

    def __call__(self, x, y, norm):
        proj = self.generator.proj  # Part 1's Generator: proj, log-softmax
        weight, bias = proj.weight, proj.bias
        if not torch.is_grad_enabled():  # validation: the loss alone
            # GeneratorLoss sees whether its inputs require gradients,
            # not whether autograd is on, so it is handed none that do.
            x, weight, bias = x.detach(), weight.detach(), bias.detach()
        loss_sum = GeneratorLoss.apply(
            x.reshape(-1, x.size(-1)),  # (B * T, d_model)
            weight,
            bias,
            y.reshape(-1),
            self.criterion.padding_idx,
            self.criterion.smoothing,
            self.kernel,
            self.block_logits,
        )
        return loss_sum.detach(), loss_sum / norm


# %% [markdown]
# The check, in float64: the loss and the three gradients, against
# Part 1's `Generator` followed by Part 2's `LabelSmoothing` through its
# full target matrix (`keep_targets=True`: the definition), differentiated
# by autograd. Of the 600 rows, 514 are real. Blocks of at most 256 rows
# of 1,100 words, here, make three blocks of them (172, 172 and 170
# rows), whose shares of the gradients must add up. (The tests check
# bf16 autocast too.)

# %%
from the_annotated_transformer import Generator

torch.manual_seed(0)
generator = Generator(32, 1100).double()
x = torch.randn(600, 32, dtype=torch.float64)
target = torch.randint(0, 1100, (600,))
target[::7] = PAD
assert (target != PAD).sum() == 514
definition = LabelSmoothing(1100, PAD, 0.1, keep_targets=True)
slow = SimpleLossCompute(generator, definition)
fast = FusedLossCompute(generator, LabelSmoothing(1100, PAD, 0.1))
fast.block_logits = 256 * 1100  # small blocks: the default takes all 514
results = []
for compute in (slow, fast):
    x_in = x.clone().requires_grad_()
    generator.zero_grad()
    loss_sum, loss_mean = compute(x_in, target, norm=500)  # so g = 1/500
    loss_mean.backward()
    grads = [x_in.grad, generator.proj.weight.grad, generator.proj.bias.grad]
    results.append((loss_sum, grads))
    print(f"{type(compute).__name__:17s} loss {loss_sum.item():.6f}")
(loss_slow, grads_slow), (loss_fast, grads_fast) = results
assert torch.allclose(loss_slow, loss_fast, rtol=1e-12)
for a, b in zip(grads_slow, grads_fast):
    assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


# %% [markdown]
# ### A bf16 residual stream, on the CPU
#
# On the CPU, bf16 autocast runs the matrix products (linear layers,
# `matmul`) in bf16, forces a few operations, mostly losses, to float32,
# and leaves the rest in their inputs' dtype. The residual stream, the
# vectors that Part 1's `x + dropout(sublayer(norm(x)))` carries from
# layer to layer, starts as float32 at the embeddings and stays float32
# throughout. So every linear layer that reads it casts its float32
# input to bf16, every residual addition casts the sublayer's bf16 output
# back to float32, and the backward pass casts their gradients the other
# way; and LayerNorm and the additions, working in float32, move twice
# the bytes they would in bf16. On a CPU each cast is one more pass over
# memory.
#
# `use_bf16_stream` casts the embeddings' output to autocast's dtype,
# with a forward hook on `src_embed` and on `tgt_embed`. Each of those is
# Part 1's `nn.Sequential(Embeddings, PositionalEncoding)`, so the cast
# comes after the positional encoding and its dropout. From there the
# stream is bf16: LayerNorm takes bf16 and gives bf16 (it computes its
# mean and variance in float32 inside), and so do the linear layers,
# dropout and the residual additions. What is still cast: the weights,
# once per batch (autocast keeps its casts of them until the batch's
# autocast ends), their gradients back to float32, and the gradient that
# reaches the embeddings. `GeneratorLoss`, above, keeps its sums in
# float32 as before. The parameters stay float32, so Adam, the
# checkpoints and their averaging do not change. The hooks are not saved
# in a checkpoint: a model loaded from one has autocast's float32 stream
# again. Outside autocast the hook does nothing, so a model evaluated in
# float32 stays float32.
#
# The price is precision: each residual addition rounds to bf16's 8
# significant bits, where it kept float32's 24. The test
# (`tests/test_bf16_stream.py`) compares one training step with the
# same step in float64: the gradients' error is about 2%, as with
# autocast's float32 stream, because most of it comes from the bf16
# matrix products either way. Trained with it, the `quick` preset (Part
# 3's reference run) reached validation losses 0.008 to 0.025 lower
# than with the float32 stream after each of its five epochs, but a
# final validation BLEU 0.5 lower (36.57 against 37.07), on a 2-core
# Xeon with AMX. These are single runs, so both differences are within
# what a rerun could change (`bench/RESULTS_efficiency.md`).
#
# Speed, from `bench/efficiency.py` on that Xeon, with the `cpu` model,
# timed beside the float32 stream in the same runs: a bf16 training
# step was 1.04 to 1.07 times as fast at 2 threads and 1.09 to 1.13
# times at 1 thread (two runs of 5, medians). In real training, one
# epoch of the `cpu` preset, the gain was within the run-to-run noise at
# 2 threads and a few percent at 1.
#
# `TrainingRun` turns it on where training runs in bf16 on the CPU.
# GPUs keep the float32 stream: the bf16 stream was neither timed nor
# validated on one.


# %%
#| export
def _stream_to_autocast_dtype(module, inputs, output):
    """Forward hook: `output` in autocast's dtype when autocast is on
    (compute_dtype, above); outside autocast, `output` itself."""
    return output.to(compute_dtype(output))


def use_bf16_stream(model):
    """Make the residual stream of Part 1's EncoderDecoder bf16 under
    bf16 autocast (its embeddings' output is cast); return `model`."""
    for embed in (model.src_embed, model.tgt_embed):
        embed.register_forward_hook(_stream_to_autocast_dtype)
    return model


def wants_bf16_stream(device, precision):
    """True where training uses a bf16 residual stream: bf16 on the CPU."""
    cpu = torch.device(device).type == "cpu"
    return cpu and precision.dtype == torch.bfloat16


# %% [markdown]
# The check: a small model, one forward pass under bf16 autocast on the
# CPU, recording the dtypes that reach its linear layers and its
# LayerNorms. Without the hook, the LayerNorms read the float32 stream,
# and the linear layers read both (float32 from the stream, bf16 from
# one another); with it, everything reads bf16; outside autocast,
# everything reads float32, as before.

# %%
from the_annotated_transformer import LayerNorm, make_model


def input_dtypes(model, batch, context):
    """{"Linear": dtypes, "LayerNorm": dtypes} that reach model's layers
    in one forward pass inside `context`."""
    seen = {"Linear": set(), "LayerNorm": set()}

    def record(module, inputs, output):
        seen[type(module).__name__].add(inputs[0].dtype)

    hooks = [
        module.register_forward_hook(record)
        for module in model.modules()
        if isinstance(module, (torch.nn.Linear, LayerNorm))
    ]
    with context:
        model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    for hook in hooks:
        hook.remove()
    return seen


F32, BF16 = torch.float32, torch.bfloat16
torch.manual_seed(0)
toy_model = make_model(50, 50, N=2, d_model=32, d_ff=64, h=4)
toy_batch = Batch(
    torch.randint(3, 50, (4, 9)), torch.randint(3, 50, (4, 8)), PAD
)
in_bf16 = torch.autocast("cpu", BF16)
dtypes = input_dtypes(toy_model, toy_batch, in_bf16)
assert dtypes == {"Linear": {F32, BF16}, "LayerNorm": {F32}}
use_bf16_stream(toy_model)
dtypes = input_dtypes(toy_model, toy_batch, in_bf16)
assert dtypes == {"Linear": {BF16}, "LayerNorm": {BF16}}
dtypes = input_dtypes(toy_model, toy_batch, contextlib.nullcontext())
assert dtypes == {"Linear": {F32}, "LayerNorm": {F32}}
print("with the bf16 stream, every linear layer and LayerNorm reads bf16")


# %% [markdown]
# ### A dropout kernel in C++, on the CPU
#
# After the changes above, dropout was still the largest cost of a bf16
# training step of the `cpu` model on a 2-core Xeon with AMX: without
# any dropout the step ran 1.26 to 1.36 times as fast
# (`bench/RESULTS_efficiency.md`, "What dropout costs, taken apart").
# `FastDropout`'s mask takes six passes over memory: `random_` writes the
# random bits (on one thread: torch's generator is sequential), a
# comparison turns them into a mask, a cast and a scale turn that into
# bf16, the forward pass multiplies, and the backward pass multiplies the
# gradient by the stored mask, read back from memory. Each eager fix
# measured there (fewer passes, bits drawn ahead on another thread,
# `torch.compile`) gained nothing.
#
# The kernel below draws and applies the mask in one pass each way, and
# stores nothing:
#
# - **A counter-based generator**: one whose $n$-th number is a function
#   of the seed and $n$ alone, not of the numbers drawn before it. The
#   random bits of the group of four elements $w = \lfloor i / 4
#   \rfloor$ are SplitMix64's $(w + 1)$-th number from `seed`: a 64-bit
#   hash of `seed + (w + 1) * 0x9E3779B97F4A7C15`. Like `FastDropout`, it
#   reads them as four 16-bit *lanes*, one per element, the low 16 bits
#   first. So any thread can compute any element's bits, in any order:
#   the mask is the same at 1 thread or 16.
#   SplitMix64 is the standard seeding generator of the xoshiro family
#   (Steele, Lea and Flood, 2014, "Fast splittable pseudorandom number
#   generators").
# - **The same mask rule.** An element is kept when its lane is at least
#   `dropped = round(p * 65536)`, so it is kept with `FastDropout`'s
#   probability, `(65536 - dropped) / 65536`, and scaled by one over it.
#   The multiplication is by 0 or by the scale, as `nn.Dropout`'s is, so
#   a dropped `nan` stays `nan`.
# - **The mask drawn again.** The backward pass calls the same function
#   on the gradient, with the same seed: the same elements are dropped,
#   and no mask is kept in memory between the passes.
# - **A seed per call**, drawn from torch's generator, so
#   `torch.manual_seed` makes a run repeat.
# - **Its neighbours in the same pass.** Part 1 adds a sublayer's
#   dropped-out output to the residual stream, `x + dropout(y)`, and
#   drops out the ReLU's output in the feed-forward network. The kernel
#   does each of those in its one pass (`KernelSublayerConnection`,
#   `KernelFeedForward`). ReLU-and-dropout's backward pass needs no mask:
#   for a finite input, its output is positive exactly where both let the
#   element through. In
#   float32 the results equal Part 1's to the bit (the kernel is compiled
#   without fused multiply-adds, so it rounds where torch does); in bf16
#   the residual addition rounds once instead of twice.
# - **Attention's softmax, with its dropout.** Part 1's `attention`
#   divides the scores by $\sqrt{d_k}$, fills the mask's closed places,
#   takes the softmax and drops out weights: four passes over the (B, h,
#   T, S) scores, and four more backward. `softmax_masked_scale` does them
#   in one pass over each row of scores. It writes the weights (the
#   backward pass needs them) and the dropped-out weights, whose mask is
#   the one `masked_scale` would draw for the weights. Its backward pass,
#   `softmax_masked_scale_grad`, draws that mask again and returns
#   $p \odot (g' - \sum_j g'_j p_j) / \sqrt{d_k}$ (0 where the mask is
#   closed), where $g'$ is the gradient with the mask applied. A row is
#   only as long as a sentence (about 20 words), so its loops run over
#   whole vectors of 16 numbers rather than ending in a remainder taken
#   one number at a time, which cost more than the rest: they read a
#   little past the row, and write a little into the next rows of the
#   same block of 32 rows, which the same thread then writes over (its
#   random lanes are drawn a block at a time too). It multiplies the
#   scores by $1/\sqrt{d_k}$ instead of dividing, and its exponential
#   is `exp_of` (in `CPP_PRELUDE`), not torch's, so in float32 the
#   weights agree with Part 1's to about $10^{-7}$, not to the bit.
#   `KernelMultiHeadedAttention` uses it while it trains on the CPU; in
#   evaluation, and where Part 4 keeps the weights, Part 1's code runs.
#
# Only bf16 and float32 CPU tensors take the kernel; anything else goes
# to `FastDropout`. The compiler vectorizes the hash and the conversion of
# bf16 (a bit shift one way; rounding to nearest even, by an addition,
# the other).
#
# `dropout_kernel` builds it the first time it is asked, with
# `torch.utils.cpp_extension.load_inline`: a C++ compiler (`g++` on
# Linux, Xcode's command-line tools on a Mac) and the `ninja` package
# (in `requirements.txt`). The build takes about 20 seconds on a 2-core
# CPU; torch keeps it on disk (in `~/.cache/torch_extensions`), so later
# runs load it in a second. On Linux on x86 it is compiled for this
# machine's own CPU (`-march=native`), so the name of the build includes
# the CPU's model and flags, and a home folder shared by different
# machines keeps one build per kind of CPU. If the build fails (no
# compiler, for one), `dropout_kernel` says why in one line and returns
# `None`, and training keeps `FastDropout`. Setting the environment
# variable `AT_CPU_KERNELS=0` turns it off (and the other two, below).
# The kernels are used on Linux only: elsewhere (a Mac's clang has no
# OpenMP) they would run on one thread, and torch's own code on all of
# them. A build stopped halfway (the process killed) can leave a `lock`
# file in its folder under `~/.cache/torch_extensions`, and the next
# build then waits for it forever; deleting that folder fixes it.
#
# Speed, from `bench/efficiency.py` on a 2-core Xeon with AMX, the `cpu`
# model in bf16 (medians of 5, `bench/RESULTS_efficiency.md`, "Dropout
# and the loss in C++"): a training step with the kernel ran 1.26 times
# as fast as with `FastDropout`'s mask at 2 threads, and 1.19 times at 1
# thread.
#
# `use_dropout_kernel` swaps the kernel's modules into a model: a
# `KernelDropout` for each dropout, and for Part 1's residual connections,
# feed-forward networks and attention only their class, so the weights
# and their names in a checkpoint stay as they were. `TrainingRun` uses
# it wherever it trains with dropout on the CPU. GPUs keep `F.dropout`,
# which is one fused kernel there already.

# %%
#| export
CPP_PRELUDE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// bf16 is the top half of a float32: shift up; round to nearest even down.
static inline float load(const float* p, int64_t i) { return p[i]; }
static inline float load(const uint16_t* p, int64_t i) {
  uint32_t u = (uint32_t)p[i] << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline void store(float* p, int64_t i, float v) { p[i] = v; }
static inline void store(uint16_t* p, int64_t i, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  p[i] = (v != v) ? (uint16_t)0x7FC0 : (uint16_t)rounded;  // nan stays nan
}

// Cephes' expf: x = k ln 2 + r, e^r by a polynomial, 2^k in the exponent.
static inline float exp_of(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  float k = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)k + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, 4);
  return p * two_k;
}
"""  # what every kernel (this one, the loss's, LayerNorm's) starts with
DROPOUT_KERNEL_SOURCE = (
    CPP_PRELUDE
    + r"""
// 64 random bits for group w of four elements (SplitMix64).
static inline uint64_t splitmix64(uint64_t seed, int64_t w) {
  uint64_t z = seed + (uint64_t)w * 0x9E3779B97F4A7C15ULL;
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

constexpr int64_t BLOCK = 1024;  // elements per block: 256 hashes

// What an element becomes. SCALE: x times the mask's factor (0 or scale);
// ADD: that plus a residual r; RELU: relu(x) times the factor; POSITIVE
// (ReLU-and-dropout's backward pass): g times scale where the forward
// output o was positive, else 0. Each rounds once, at the store.
enum Mode { SCALE, ADD, RELU, POSITIVE };

template <typename T, int MODE>
static void block(const uint16_t* __restrict lanes, const T* __restrict x,
                  const T* __restrict other, T* __restrict out,
                  int64_t count, uint32_t dropped, float scale) {
  for (int64_t i = 0; i < count; ++i) {
    float v = load(x, i);
    if (MODE == POSITIVE) {
      store(out, i, load(other, i) > 0.0f ? v * scale : 0.0f);
      continue;
    }
    if (MODE == RELU) v = v < 0.0f ? 0.0f : v;  // nan stays nan
    float y = v * (lanes[i] >= dropped ? scale : 0.0f);
    if (MODE == ADD) y += load(other, i);
    store(out, i, y);
  }
}

template <typename T, int MODE>
static void apply(const T* x, const T* other, T* out, int64_t n,
                  uint64_t seed, uint32_t dropped, float scale) {
  int64_t blocks = (n + BLOCK - 1) / BLOCK;
  at::parallel_for(0, blocks, 16, [=](int64_t begin, int64_t end) {
    alignas(64) uint16_t lanes[BLOCK];
    for (int64_t b = begin; b < end; ++b) {
      if (MODE != POSITIVE)  // the only mode without a mask
        for (int64_t w = 0; w < BLOCK / 4; ++w) {
          uint64_t bits = splitmix64(seed, b * (BLOCK / 4) + w);
          for (int k = 0; k < 4; ++k)  // the low 16 bits first
            lanes[4 * w + k] = (uint16_t)(bits >> (16 * k));
        }
      int64_t first = b * BLOCK;
      block<T, MODE>(lanes, x + first,
                     other ? other + first : nullptr, out + first,
                     std::min(BLOCK, n - first), dropped, scale);
    }
  });
}

template <int MODE>
static torch::Tensor run(torch::Tensor x, torch::Tensor other, int64_t seed,
                         int64_t dropped, double scale) {
  TORCH_CHECK(x.device().is_cpu(), "dropout kernel: CPU tensors, please");
  auto input = x.contiguous();
  auto second = other.defined() ? other.contiguous() : other;
  bool alike = !second.defined() || (second.sizes() == input.sizes() &&
                                     second.dtype() == input.dtype());
  TORCH_CHECK(alike, "dropout kernel: one shape and dtype, please");
  auto out = torch::empty_like(input);
  int64_t n = input.numel();
  if (input.scalar_type() == at::kBFloat16) {
    auto bits = [](const torch::Tensor& t) {
      return t.defined() ? reinterpret_cast<uint16_t*>(t.data_ptr()) : nullptr;
    };
    apply<uint16_t, MODE>(bits(input), bits(second), bits(out), n,
                          (uint64_t)seed, (uint32_t)dropped, (float)scale);
  } else {
    TORCH_CHECK(input.scalar_type() == at::kFloat,
                "dropout kernel: bf16 or float32, please");
    auto floats = [](const torch::Tensor& t) {
      return t.defined() ? t.data_ptr<float>() : nullptr;
    };
    apply<float, MODE>(floats(input), floats(second), floats(out), n,
                       (uint64_t)seed, (uint32_t)dropped, (float)scale);
  }
  return out;
}

torch::Tensor masked_scale(torch::Tensor x, int64_t seed, int64_t dropped,
                           double scale) {
  return run<SCALE>(x, torch::Tensor(), seed, dropped, scale);
}

torch::Tensor add_masked_scale(torch::Tensor residual, torch::Tensor x,
                               int64_t seed, int64_t dropped, double scale) {
  return run<ADD>(x, residual, seed, dropped, scale);
}

torch::Tensor relu_masked_scale(torch::Tensor x, int64_t seed,
                                int64_t dropped, double scale) {
  return run<RELU>(x, torch::Tensor(), seed, dropped, scale);
}

torch::Tensor where_positive(torch::Tensor grad, torch::Tensor out,
                             double scale) {
  return run<POSITIVE>(grad, out, 0, 0, scale);
}

// ---- Attention: dropout(softmax(scores / div)) where the mask allows ----
// A row is one query's S scores. Loops run over whole vectors of LANES
// columns, Sp = S rounded up, so that none ends in a one-at-a-time
// remainder: with S near 20, that remainder cost more than the rest.
// They may read past S (the next row's scores, never used) and, where
// `past` says this thread writes the next rows afterwards, write there.
constexpr int64_t LANES = 16;
constexpr int64_t ROWS = 32;  // rows per block of random lanes

template <typename T>
static void softmax_row(const T* __restrict x, const float* __restrict open,
                        float sc, const uint16_t* __restrict lanes,
                        T* __restrict p, T* __restrict d, float* __restrict v,
                        int64_t S, int64_t Sp, uint32_t dropped, float scale,
                        bool past) {
  float most = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : most)
  for (int64_t s = 0; s < Sp; ++s) {
    float y = sc != 0.0f ? load(x, s) * sc : 0.0f;  // 0: uniform
    y = open[s] != 0.0f ? y : -INFINITY;
    v[s] = y;
    most = std::max(most, y);
  }
#pragma omp simd reduction(+ : sum)
  for (int64_t s = 0; s < Sp; ++s) {
    float e = v[s] == -INFINITY ? 0.0f : exp_of(v[s] - most);
    v[s] = e;
    sum += e;
  }
  float inv = 1.0f / sum;
  auto put = [&](int64_t s) {  // p, rounded, then dropout of that p
    T weight;
    store(&weight, 0, v[s] * inv);
    p[s] = weight;
    store(d, s, load(&weight, 0) * (lanes[s] >= dropped ? scale : 0.0f));
  };
  int64_t width = past ? Sp : S;
#pragma omp simd
  for (int64_t s = 0; s < width; ++s) put(s);
}

// The gradient of the scores from g, that of the dropped weights:
// g' = dropout(g) with the same mask; p (g' - sum(g' p)) / div; 0 where
// the mask is closed.
template <typename T>
static void softmax_grad_row(const T* __restrict g, const T* __restrict p,
                             const float* __restrict open, float sc,
                             const uint16_t* __restrict lanes,
                             T* __restrict out, float* __restrict v,
                             int64_t S, int64_t Sp, uint32_t dropped,
                             float scale, bool past) {
  float dots[LANES];
  for (int k = 0; k < LANES; ++k) dots[k] = 0.0f;
  for (int64_t j = 0; j < Sp; j += LANES)
    for (int k = 0; k < LANES; ++k) {
      float kept = lanes[j + k] >= dropped ? scale : 0.0f;
      float gk = j + k < S ? load(g, j + k) * kept : 0.0f;
      v[j + k] = gk;
      dots[k] += j + k < S ? gk * load(p, j + k) : 0.0f;
    }
  for (int w = LANES / 2; w > 0; w /= 2)  // a tree: 4 steps, not 15
    for (int k = 0; k < w; ++k) dots[k] += dots[k + w];
  auto put = [&](int64_t s) {
    float grad = load(p, s) * (v[s] - dots[0]) * sc;
    store(out, s, open[s] != 0.0f ? grad : 0.0f);
  };
  if (past)
    for (int64_t j = 0; j < Sp; j += LANES)
      for (int k = 0; k < LANES; ++k) put(j + k);
  else
    for (int64_t s = 0; s < S; ++s) put(s);
}

// Rows of (B, h, T, S) scores x (forward) or gradients (backward, with the
// weights p), and a (B, 1, Tm, S) mask, Tm = 1 or T.
template <typename T, bool GRAD>
static void softmax_rows(const T* x, const T* p, const bool* mask, T* out,
                         T* dropped_out, int64_t B, int64_t H, int64_t Tq,
                         int64_t Tm, int64_t S, float div, uint64_t seed,
                         uint32_t dropped, float scale) {
  int64_t rows = B * H * Tq, n = rows * S;
  int64_t Sp = (S + LANES - 1) / LANES * LANES;
  // Per mask row: 1 where open, else 0, to Sp; and the factor of the
  // scores: 1 / div, or 0 where the mask is all closed, which gives
  // uniform weights, as torch's softmax of equal scores does.
  std::vector<float> opens(B * Tm * Sp, 0.0f), factors(B * Tm);
  for (int64_t i = 0; i < B * Tm; ++i) {
    bool any = false;
    for (int64_t s = 0; s < S; ++s) any = any || mask[i * S + s];
    for (int64_t s = 0; s < S; ++s)
      opens[i * Sp + s] = mask[i * S + s] || !any ? 1.0f : 0.0f;
    factors[i] = any ? 1.0f / div : 0.0f;
  }
  const float* open = opens.data();
  const float* factor = factors.data();
  int64_t blocks = (rows + ROWS - 1) / ROWS;
  at::parallel_for(0, blocks, 1, [=](int64_t begin, int64_t end) {
    std::vector<float> v(Sp);
    std::vector<T> tail(Sp);  // a row near the end, copied and padded
    std::vector<uint16_t> lanes(ROWS * S + Sp + 8, 0);
    for (int64_t block = begin; block < end; ++block) {
      int64_t r0 = block * ROWS, r1 = std::min(rows, r0 + ROWS);
      int64_t w0 = r0 * S / 4, w1 = (r1 * S + 3) / 4;
      for (int64_t w = w0; w < w1; ++w) {
        uint64_t bits = splitmix64(seed, w);
        for (int k = 0; k < 4; ++k)
          lanes[4 * (w - w0) + k] = (uint16_t)(bits >> (16 * k));
      }
      int64_t t = r0 % Tq, b = r0 / (H * Tq), bt = r0 % (H * Tq);
      for (int64_t r = r0; r < r1; ++r) {  // r is row t of head h of b
        int64_t i = b * Tm + (Tm == 1 ? 0 : t);  // the mask's row
        const T* xr = x + r * S;
        const T* pr = GRAD ? p + r * S : nullptr;
        // Reading Sp would pass the tensor's end: softmax_row reads whole
        // vectors of x. (softmax_grad_row reads past S only where `past`,
        // which is false here, so its p needs no copy.)
        if (r * S + Sp > n) {
          std::copy(xr, xr + S, tail.data());
          xr = tail.data();
        }
        const uint16_t* lane = lanes.data() + (r * S - 4 * w0);
        bool past = r * S + Sp <= r1 * S;  // the rows there: this block's
        if (GRAD)
          softmax_grad_row(xr, pr, open + i * Sp, factor[i], lane,
                           out + r * S, v.data(), S, Sp, dropped, scale,
                           past);
        else
          softmax_row(xr, open + i * Sp, factor[i], lane, out + r * S,
                      dropped_out + r * S, v.data(), S, Sp, dropped, scale,
                      past);
        t = t + 1 == Tq ? 0 : t + 1;  // counted: no division per row
        if (++bt == H * Tq) {  // the next sentence
          bt = 0;
          ++b;
        }
      }
    }
  });
}

template <bool GRAD>
static std::vector<torch::Tensor> softmax_run(
    torch::Tensor x, torch::Tensor p, torch::Tensor mask, double div,
    int64_t seed, int64_t dropped, double scale) {
  TORCH_CHECK(x.device().is_cpu() && mask.device().is_cpu(),
              "softmax kernel: CPU tensors, please");
  TORCH_CHECK(x.dim() == 4 && mask.dim() == 4,
              "softmax kernel: (B, h, T, S) scores, (B, 1, 1 or T, S) mask");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "softmax kernel: a bool mask");
  auto in = x.contiguous();
  auto m = mask.contiguous();
  int64_t B = in.size(0), H = in.size(1), Tq = in.size(2), S = in.size(3);
  int64_t Tm = m.size(2);
  TORCH_CHECK(m.size(0) == B && m.size(1) == 1 && (Tm == 1 || Tm == Tq) &&
                  m.size(3) == S,
              "softmax kernel: a mask of shape (B, 1, 1 or T, S)");
  auto weights = GRAD ? p.contiguous() : in;
  TORCH_CHECK(weights.sizes() == in.sizes() &&
                  weights.scalar_type() == in.scalar_type(),
              "softmax kernel: weights and gradient of one shape and dtype");
  auto out = torch::empty_like(in);
  auto dropped_out = GRAD ? out : torch::empty_like(in);
  if (in.numel() > 0 && in.scalar_type() == at::kBFloat16) {
    auto u = [](const torch::Tensor& t) {
      return reinterpret_cast<uint16_t*>(t.data_ptr());
    };
    softmax_rows<uint16_t, GRAD>(u(in), u(weights), m.data_ptr<bool>(),
                                 u(out), u(dropped_out), B, H, Tq, Tm, S,
                                 (float)div, (uint64_t)seed,
                                 (uint32_t)dropped, (float)scale);
  } else if (in.numel() > 0) {
    TORCH_CHECK(in.scalar_type() == at::kFloat,
                "softmax kernel: bf16 or float32, please");
    softmax_rows<float, GRAD>(in.data_ptr<float>(), weights.data_ptr<float>(),
                              m.data_ptr<bool>(), out.data_ptr<float>(),
                              dropped_out.data_ptr<float>(), B, H, Tq, Tm, S,
                              (float)div, (uint64_t)seed, (uint32_t)dropped,
                              (float)scale);
  }
  return {out, dropped_out};
}

// (weights, dropout(weights)) of (B, h, T, S) scores.
std::vector<torch::Tensor> softmax_masked_scale(torch::Tensor scores,
                                                torch::Tensor mask,
                                                double div, int64_t seed,
                                                int64_t dropped,
                                                double scale) {
  return softmax_run<false>(scores, scores, mask, div, seed, dropped, scale);
}

// The scores' gradient, from that of dropout(weights).
torch::Tensor softmax_masked_scale_grad(torch::Tensor grad,
                                        torch::Tensor weights,
                                        torch::Tensor mask, double div,
                                        int64_t seed, int64_t dropped,
                                        double scale) {
  return softmax_run<true>(grad, weights, mask, div, seed, dropped,
                           scale)[0];
}
"""
)
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
KERNEL_FUNCTIONS = [
    "masked_scale",
    "add_masked_scale",
    "relu_masked_scale",
    "where_positive",
    "softmax_masked_scale",
    "softmax_masked_scale_grad",
]
_DROPOUT_KERNEL = {}  # "module": the built extension, or None


def _cpu_identity():
    """The CPU's model and flags on Linux, else what platform knows."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [
                line
                for line in info
                if line.startswith(("model name", "flags"))
            ]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def _kernel_flags():
    """Compiler flags: this CPU's vector units and OpenMP on x86 Linux
    (as torch's own CPU build has), plain -O3 elsewhere; never fused
    multiply-adds, so that x * f + r rounds as torch's two steps do; and
    no floating-point traps (none is used), without which the compiler
    will not vectorize the loss kernel's exponential."""
    common = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]
    if sys.platform == "linux" and platform.machine() == "x86_64":
        vectors = ["-march=native", "-mprefer-vector-width=512"]
        return [*common, *vectors, "-fopenmp"]
    if sys.platform == "linux":  # gcc on ARM, say: OpenMP, generic code
        return [*common, "-fopenmp"]
    return common


def _kernel_is_built(name):
    """Whether torch's cache holds a build of extension `name` (asked of
    a private torch function; False if that fails)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = _get_build_directory(name, verbose=False)
        return os.path.isfile(os.path.join(folder, f"{name}.so"))
    except Exception:  # a torch without it: say "building" to be safe
        return False


def build_kernel(kind, source, functions, instead):
    """The extension `at_<kind>_...` built from C++ `source` (or loaded
    from torch's cache); None, with one line saying why, where it cannot
    be built. `instead` says what runs then."""
    from torch.utils.cpp_extension import load_inline

    flags = _kernel_flags()
    key = source + " ".join(flags) + _cpu_identity() + torch.__version__
    name = f"at_{kind}_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    if not _kernel_is_built(name):
        print(f"building the CPU {kind} kernel (once; about 20 s)", flush=True)
    try:
        return load_inline(
            name,
            cpp_sources=[source],
            functions=functions,
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
        )
    except Exception as error:  # no compiler, no ninja, a compile error
        print(f"no CPU {kind} kernel ({_why(error)}); using {instead}")
        return None


def _why(error):
    """One line of a failed build: the compiler's first line that names
    an error, else the message's first line."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    named = [line for line in lines[1:] if "error" in line.lower()]
    return (named or lines)[0].strip()[:200]


def _build_dropout_kernel():
    return build_kernel(
        "dropout", DROPOUT_KERNEL_SOURCE, KERNEL_FUNCTIONS, "FastDropout"
    )


def kernels_allowed():
    """True on Linux, unless AT_CPU_KERNELS=0 turns the kernels off.
    Elsewhere they would be built without OpenMP, on one thread."""
    on = os.environ.get("AT_CPU_KERNELS", "1") != "0"
    return on and sys.platform == "linux"


def kernel_once(store, build):
    """build()'s extension, built on the first call and kept in the dict
    `store`; None where it cannot be built or AT_CPU_KERNELS=0 turns the
    kernels off."""
    if not kernels_allowed():
        return None
    if "module" not in store:
        store["module"] = build()
    return store["module"]


def dropout_kernel():
    """The C++ dropout kernel (kernel_once)."""
    return kernel_once(_DROPOUT_KERNEL, _build_dropout_kernel)


def dropout_rule(p):
    """(dropped, scale): an element is kept when its 16-bit lane is at
    least `dropped`; kept elements are multiplied by `scale`."""
    dropped = min(round(p * 65536), 65535)
    return dropped, 65536 / (65536 - dropped)


def kernel_call(p):
    """(seed, dropped, scale) for one call of the kernel: a fresh seed from
    torch's generator, so torch.manual_seed repeats a run."""
    seed = torch.empty((), dtype=torch.int64).random_(-(2**63), None)
    return (seed.item(), *dropout_rule(p))


class KernelDropoutFunction(torch.autograd.Function):
    """Dropout by the kernel; the backward pass draws the mask again."""

    @staticmethod
    def forward(ctx, x, p, kernel):
        ctx.kernel, ctx.rule = kernel, kernel_call(p)
        return kernel.masked_scale(x, *ctx.rule)

    @staticmethod
    def backward(ctx, grad):
        return ctx.kernel.masked_scale(grad, *ctx.rule), None, None


class KernelAddDropoutFunction(torch.autograd.Function):
    """residual + dropout(x) by the kernel, in one pass."""

    @staticmethod
    def forward(ctx, residual, x, p, kernel):
        ctx.kernel, ctx.rule = kernel, kernel_call(p)
        return kernel.add_masked_scale(residual, x, *ctx.rule)

    @staticmethod
    def backward(ctx, grad):
        x_grad = ctx.kernel.masked_scale(grad, *ctx.rule)
        return grad, x_grad, None, None


class KernelReluDropoutFunction(torch.autograd.Function):
    """dropout(relu(x)) by the kernel, in one pass. Its backward pass
    needs no mask: the output is positive exactly where both let x
    through."""

    @staticmethod
    def forward(ctx, x, p, kernel):
        seed, dropped, scale = kernel_call(p)
        out = kernel.relu_masked_scale(x, seed, dropped, scale)
        ctx.save_for_backward(out)  # w_2 keeps it too: no extra memory
        ctx.kernel, ctx.scale = kernel, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return ctx.kernel.where_positive(grad, out, ctx.scale), None, None


class KernelSoftmaxDropoutFunction(torch.autograd.Function):
    """dropout(softmax(scores / div)) where `mask` allows, by the kernel,
    in one pass; the backward pass draws the mask again."""

    @staticmethod
    def forward(ctx, scores, mask, div, p, kernel):
        ctx.kernel, ctx.rule, ctx.div = kernel, kernel_call(p), div
        call = kernel.softmax_masked_scale
        weights, dropped = call(scores, mask, div, *ctx.rule)
        ctx.save_for_backward(weights, mask)
        return dropped

    @staticmethod
    def backward(ctx, grad):
        weights, mask = ctx.saved_tensors
        call = ctx.kernel.softmax_masked_scale_grad
        scores_grad = call(grad, weights, mask, ctx.div, *ctx.rule)
        return scores_grad, None, None, None, None


class KernelDropout(FastDropout):
    """FastDropout that uses the C++ kernel on bf16 and float32 CPU
    tensors, where it is built; FastDropout's own mask elsewhere."""

    def _kernel_for(self, *tensors):
        """The kernel, if it takes these tensors (one shape and dtype)."""
        first = tensors[0]
        usable = self.training and 0 < self.p < 1 and not self.inplace
        usable = usable and first.dtype in KERNEL_DTYPES
        for t in tensors:
            usable = usable and t.device.type == "cpu"
            usable = usable and t.dtype == first.dtype
            usable = usable and t.shape == first.shape
        return dropout_kernel() if usable else None

    def forward(self, x):
        kernel = self._kernel_for(x)
        if kernel is None:
            return super().forward(x)
        return KernelDropoutFunction.apply(x, self.p, kernel)

    def add_to(self, residual, x):
        """residual + self(x): in one pass where the kernel takes them."""
        kernel = self._kernel_for(residual, x)
        if kernel is None:
            return residual + self(x)
        return KernelAddDropoutFunction.apply(residual, x, self.p, kernel)

    def of_relu(self, x):
        """self(x.relu()): in one pass where the kernel takes x."""
        kernel = self._kernel_for(x)
        if kernel is None:
            return self(x.relu())
        return KernelReluDropoutFunction.apply(x, self.p, kernel)

    def of_softmax(self, scores, mask, div):
        """self(softmax(scores / div)) where the bool `mask` allows, as
        Part 1's `attention` computes it: in one pass where the kernel
        takes the scores."""
        kernel = self._kernel_for(scores)
        if kernel is None:
            lowest = torch.finfo(scores.dtype).min
            weights = (scores / div).masked_fill(~mask, lowest).softmax(-1)
            return self(weights)
        # The kernel takes a mask per sentence: a mask made for all of
        # them at once, (1, 1, T, S), is repeated (as broadcasting would)
        mask = mask.expand(len(scores), 1, *mask.shape[2:])
        apply = KernelSoftmaxDropoutFunction.apply
        return apply(scores, mask, div, self.p, kernel)


class KernelSublayerConnection(SublayerConnection):
    """Part 1's residual connection, its dropout and its addition in one
    pass of the kernel."""

    def forward(self, x, sublayer):
        return self.dropout.add_to(x, sublayer(self.norm(x)))


class KernelFeedForward(PositionwiseFeedForward):
    """Part 1's feed-forward network, its ReLU and its dropout in one
    pass of the kernel."""

    def forward(self, x):
        return self.w_2(self.dropout.of_relu(self.w_1(x)))


class KernelMultiHeadedAttention(MultiHeadedAttention):
    """Part 1's multi-head attention, with the scale, mask, softmax and
    dropout of its weights in one pass of the kernel while it trains on
    the CPU; Part 1's own code otherwise."""

    def forward(self, query, key, value, mask=None):
        if mask is None or self.store_attention or self.use_fused(query):
            return super().forward(query, key, value, mask)
        q = self.split_heads(query, self.w_q)  # (B, h, T, d_k)
        k = self.split_heads(key, self.w_k)  # (B, h, S, d_k)
        v = self.split_heads(value, self.w_v)  # (B, h, S, d_k)
        scores = q @ k.transpose(-2, -1)  # (B, h, T, S), not yet scaled
        div = math.sqrt(self.d_k)
        weights = self.dropout.of_softmax(scores, heads_mask(mask), div)
        x = (weights @ v).transpose(1, 2)  # (B, T, h, d_k)
        x = x.reshape(query.size(0), -1, self.h * self.d_k)
        return self.w_o(x)  # (B, T, d_model)


def use_dropout_kernel(model):
    """Swap every nn.Dropout and FastDropout of `model` for KernelDropout,
    and Part 1's residual connections, feed-forward networks and
    attention for the kernel's; return `model`."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) in (torch.nn.Dropout, FastDropout):
                kernel_dropout = KernelDropout(child.p, child.inplace)
                kernel_dropout.train(child.training)  # as the one replaced
                setattr(module, name, kernel_dropout)
    fused = {
        SublayerConnection: KernelSublayerConnection,
        PositionwiseFeedForward: KernelFeedForward,
        MultiHeadedAttention: KernelMultiHeadedAttention,
    }
    for module in model.modules():
        if type(module) in fused:
            # Only the class changes: the same weights, under the same
            # names in the state dict.
            module.__class__ = fused[type(module)]
    return model


def wants_dropout_kernel(device, dropout):
    """True where training asks for the kernel: dropout on the CPU."""
    return torch.device(device).type == "cpu" and dropout > 0


# %% [markdown]
# The check, on a tensor small enough to follow by hand: the mask is
# computed again here in Python, with Python's own integers (SplitMix64
# in five lines), and the kernel must drop exactly the elements it
# drops, in bf16 and in float32, and scale the rest as `FastDropout`
# does; the gradient must be dropped at the same places. Where no
# compiler is found, the check says so and stops there.


# %%
def splitmix64_lanes(seed, n):
    """The kernel's n 16-bit lanes for `seed`, by Python integers."""
    mask64, gamma = 2**64 - 1, 0x9E3779B97F4A7C15
    lanes = []
    for w in range((n + 3) // 4):
        z = (seed + w * gamma + gamma) & mask64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask64
        z ^= z >> 31
        lanes += [(z >> (16 * k)) & 0xFFFF for k in range(4)]
    return torch.tensor(lanes[:n])


kernel = dropout_kernel()
if kernel is None:
    print("no kernel on this machine: training uses FastDropout")
else:
    x = torch.randn(3, 7)  # 21 elements: five groups of four, and one
    seed, p = 12345, 0.2
    dropped, scale = dropout_rule(p)
    keep = splitmix64_lanes(seed, x.numel()).view(3, 7) >= dropped
    for dtype in KERNEL_DTYPES:
        out = kernel.masked_scale(x.to(dtype), seed, dropped, scale)
        expected = (x.to(dtype).float() * keep * scale).to(dtype)
        assert torch.equal(out, expected), dtype
    torch.manual_seed(0)
    x = torch.randn(500, 1000, requires_grad=True)
    out = KernelDropout(p)(x)
    out.backward(torch.ones_like(out))
    kept = out != 0
    assert torch.equal(x.grad != 0, kept)  # the same mask, drawn again
    share = 1 - kept.float().mean()
    print(f"the kernel drops what Python's mask drops; {share:.4f} at p = {p}")
    assert abs(share - p) < 0.003  # 500,000 draws: sd 0.0006
    scores = torch.randn(2, 4, 3, 5)  # (B, h, T, S)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]).bool()
    mask = mask.view(2, 1, 1, 5)  # the first sentence: 3 words, 2 pads
    call = kernel.softmax_masked_scale
    weights, out = call(scores, mask, 8.0, seed, dropped, scale)
    expected = (scores / 8).masked_fill(~mask, -math.inf).softmax(-1)
    assert torch.allclose(weights, expected, atol=1e-6)
    assert torch.equal(out, kernel.masked_scale(weights, seed, dropped, scale))
    # backward: autograd through Part 1's formula, with the same mask
    grad = torch.randn(2, 4, 3, 5)
    call = kernel.softmax_masked_scale_grad
    mine = call(grad, weights, mask, 8.0, seed, dropped, scale)
    scores.requires_grad_()
    expected = (scores / 8).masked_fill(~mask, -math.inf).softmax(-1)
    expected.backward(kernel.masked_scale(grad, seed, dropped, scale))
    assert torch.allclose(mine, scores.grad, atol=1e-6)
    print("its softmax is Part 1's masked softmax, dropped out by that mask,")
    print("and its gradient is autograd's")


# %% [markdown]
# ### A loss kernel in C++, on the CPU
#
# With dropout in one pass, the generator and the loss came next in a
# profile of the bf16 step at 1 thread. `GeneratorLoss`'s torch code,
# above, turns each block of logits into float32 (a copy), then takes
# its maximum, its exponentials, their sum and the sum of the logits,
# one pass each; for the gradient it subtracts, exponentiates,
# subtracts, sums and casts, again one pass each. The matrix products
# around them stay as they are.
#
# The kernel below takes a block a row at a time, reading the logits in
# their own dtype, with no float32 copy, and computing in float32: it
# brings each row from memory once and reads it twice while
# it is in the cache (a row of 6,190 bf16 logits is 12 KiB), for the
# maximum, then for the rest. It is given the product $h W^\top$ and
# the bias apart, and adds the bias as it reads each logit: that saves
# the product a pass, since `addmm` first copies the bias into every row
# of its output. (So under bf16 autocast the kernel adds a float32 bias,
# where the torch code's `addmm` adds it in bf16: the logits differ by
# bf16's rounding.)
#
# - `smoothed_rows` gives each row's log-sum-exp and its label-smoothed
#   loss, `plogp - c * z_y - f * (sum of z - z_y - z_pad) + lse`, as the
#   torch code above computes them;
# - `smoothed_rows_grad` gives those two, then the logits' gradient for
#   $g = 1$, `exp(z - lse) - f`, with `c` in place of `f` at the target
#   and nothing subtracted at the padding column (`<blank>`), in the
#   logits' dtype, and its column sums (the bias's gradient) in float32.
#   It takes each exponential once: it keeps a row's `exp(z - max)`
#   while it sums them, and scales them by one over the sum afterwards.
#   (`GeneratorLoss` uses the loss, the gradient and the column sums;
#   the log-sum-exp is returned for the tests.)
#
# Its exponential is Cephes' single-precision `expf` (Moshier, 1989):
# $x = k \ln 2 + r$, $e^r$ by a polynomial, $2^k$ written into the
# exponent bits. It is within a few units in the last place of float32
# (inputs below -87 give about 1e-38 rather than 0, which changes none of
# these sums), and, unlike the C library's `expf`, the compiler
# vectorizes it.
# Sums run over sixteen lanes at a time, so they vectorize too, and are
# added up at the end of each row, in float32 as before, but in another
# order: the loss agrees with the torch code to float32 rounding, not
# to the bit (the check below, and `tests/test_loss_kernel.py`).
#
# Measured when the kernel was written, while the gradient was still
# taken in the backward pass by a function of its own (blocks were then
# 256 rows for the loss and 512 words for the gradient): on one block of
# 256 rows of bf16 logits, at 1 thread, the rows took 1.3 ms against the
# torch code's 4.2, and a block of the gradient 0.8 against 1.9. In a
# whole training step that was 1.02 to 1.06 times as fast
# (`bench/RESULTS_efficiency.md`, "Dropout and the loss in C++"), the
# difference between runs being about as large as the gain.
#
# It is built as the dropout kernel is, by `build_kernel`, on the first
# call of `loss_kernel`; `TrainingRun` asks for it wherever it trains on
# the CPU, and `FusedLossCompute` passes it to `GeneratorLoss`. Off
# Linux, where it cannot be built, or with `AT_CPU_KERNELS=0`, the torch
# code above runs.

# %%
#| export
LOSS_KERNEL_SOURCE = (
    CPP_PRELUDE
    + r"""
// (CPP_PRELUDE, above, brings the headers, bf16's load and store, and
// exp_of, an exponential that vectorizes.)

constexpr int64_t LANES = 16;  // partial sums, so that sums vectorize

// One row of logits z (the bias b added as they are read): its
// log-sum-exp and its loss, plogp - c z_y - f (sum of z - z_y - z_pad)
// + lse. With `grad`, also its gradient for g = 1, q - p with
// q = exp(z - lse): f subtracted everywhere, c instead at the target,
// nothing at the padding column; added into the column sums `sums`.
// One exponential per logit: e = exp(z - max) is kept in `e` while it
// is summed, and q = e / (its sum).
template <typename T>
static void one_row(const T* row, const float* b, int64_t y, int64_t V,
                    int64_t pad, float c, float f, float plogp, float* e,
                    float* lse, float* loss, T* grad, float* sums) {
  int64_t full = V / LANES * LANES;
  float most[LANES], sum_e[LANES], sum_z[LANES];
  for (int k = 0; k < LANES; ++k) most[k] = -INFINITY;
  for (int64_t j = 0; j < full; j += LANES)
    for (int k = 0; k < LANES; ++k)
      most[k] = std::max(most[k], load(row, j + k) + b[j + k]);
  float m = -INFINITY;
  for (int k = 0; k < LANES; ++k) m = std::max(m, most[k]);
  for (int64_t j = full; j < V; ++j) m = std::max(m, load(row, j) + b[j]);
  for (int k = 0; k < LANES; ++k) sum_e[k] = sum_z[k] = 0.0f;
  for (int64_t j = 0; j < full; j += LANES)
    for (int k = 0; k < LANES; ++k) {
      float v = load(row, j + k) + b[j + k];
      e[j + k] = exp_of(v - m);
      sum_e[k] += e[j + k];
      sum_z[k] += v;
    }
  float se = 0.0f, sz = 0.0f;
  for (int k = 0; k < LANES; ++k) {
    se += sum_e[k];
    sz += sum_z[k];
  }
  for (int64_t j = full; j < V; ++j) {
    float v = load(row, j) + b[j];
    e[j] = exp_of(v - m);
    se += e[j];
    sz += v;
  }
  float z_y = load(row, y) + b[y];
  float rest = sz - z_y - (load(row, pad) + b[pad]);  // f's words
  *lse = m + std::log(se);
  *loss = plogp - c * z_y - f * rest + *lse;
  if (grad == nullptr) return;
  float inv = 1.0f / se;
  for (int64_t j = 0; j < V; ++j) {
    float v = e[j] * inv - f;
    store(grad, j, v);
    sums[j] += v;
  }
  store(grad, y, e[y] * inv - c);  // c, not f, at the target
  sums[y] += f - c;
  if (pad != y) {  // nothing at <blank>: p is 0 there
    store(grad, pad, e[pad] * inv);
    sums[pad] += f;
  }
}

// Every row, in `chunks` chunks of rows (one per thread), each with its
// own column sums in `partial` when `out` (the gradient) is wanted.
template <typename T>
static void all_rows(const T* z, const float* b, const int64_t* target,
                     int64_t rows, int64_t V, int64_t pad, float c, float f,
                     float plogp, float* lse, float* loss, T* out,
                     float* partial, int64_t chunks) {
  at::parallel_for(0, chunks, 1, [=](int64_t begin, int64_t end) {
    std::vector<float> e(V);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      float* sums = out ? partial + chunk * V : nullptr;
      if (sums) std::fill(sums, sums + V, 0.0f);
      int64_t r0 = rows * chunk / chunks, r1 = rows * (chunk + 1) / chunks;
      for (int64_t r = r0; r < r1; ++r)
        one_row(z + r * V, b, target[r], V, pad, c, f, plogp, e.data(),
                lse + r, loss + r, out ? out + r * V : nullptr, sums);
    }
  });
}

// The (lse, loss) of every row; with `grad`, also the gradient and its
// column sums: {lse, loss, gradient, column sums}.
static std::vector<torch::Tensor> run_rows(torch::Tensor z, torch::Tensor bias,
                                           torch::Tensor target, int64_t pad,
                                           double c, double f, double plogp,
                                           bool grad) {
  TORCH_CHECK(z.device().is_cpu() && bias.device().is_cpu(),
              "loss kernel: CPU tensors, please");
  TORCH_CHECK(z.dim() == 2, "loss kernel: logits of shape (rows, V)");
  TORCH_CHECK(z.scalar_type() == at::kBFloat16 ||
                  z.scalar_type() == at::kFloat,
              "loss kernel: bf16 or float32 logits");
  auto logits = z.contiguous();
  auto t = target.contiguous();
  auto b = bias.contiguous();
  int64_t rows = logits.size(0), V = logits.size(1);
  TORCH_CHECK(t.scalar_type() == at::kLong && t.numel() == rows,
              "loss kernel: one int64 target per row");
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 1 && b.numel() == V,
              "loss kernel: a float32 bias of V numbers");
  TORCH_CHECK(0 <= pad && pad < V, "loss kernel: padding index outside V");
  TORCH_CHECK(rows == 0 || (t.min().item<int64_t>() >= 0 &&
                            t.max().item<int64_t>() < V),
              "loss kernel: a target outside the vocabulary");
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(
                                            at::get_num_threads(), rows));
  auto opts = logits.options().dtype(at::kFloat);
  auto lse = torch::empty({rows}, opts), loss = torch::empty({rows}, opts);
  auto out = grad ? torch::empty_like(logits) : torch::Tensor();
  auto partial = torch::empty({grad ? chunks : 0, V}, opts);
  if (logits.scalar_type() == at::kBFloat16) {
    auto bits = [](const torch::Tensor& x) {
      return x.defined() ? reinterpret_cast<uint16_t*>(x.data_ptr()) : nullptr;
    };
    all_rows<uint16_t>(bits(logits), b.data_ptr<float>(),
                       t.data_ptr<int64_t>(), rows, V, pad, (float)c,
                       (float)f, (float)plogp, lse.data_ptr<float>(),
                       loss.data_ptr<float>(), bits(out),
                       partial.data_ptr<float>(), chunks);
  } else {
    all_rows<float>(logits.data_ptr<float>(), b.data_ptr<float>(),
                    t.data_ptr<int64_t>(), rows, V, pad, (float)c, (float)f,
                    (float)plogp, lse.data_ptr<float>(),
                    loss.data_ptr<float>(),
                    out.defined() ? out.data_ptr<float>() : nullptr,
                    partial.data_ptr<float>(), chunks);
  }
  if (!grad) return {lse, loss};
  return {lse, loss, out, partial.sum(0)};
}

// Each row's log-sum-exp and loss, of logits z + bias.
std::vector<torch::Tensor> smoothed_rows(torch::Tensor z, torch::Tensor bias,
                                         torch::Tensor target, int64_t pad,
                                         double c, double f, double plogp) {
  return run_rows(z, bias, target, pad, c, f, plogp, false);
}

// smoothed_rows's two, then the logits' gradient for g = 1 and its
// column sums.
std::vector<torch::Tensor> smoothed_rows_grad(torch::Tensor z,
                                              torch::Tensor bias,
                                              torch::Tensor target,
                                              int64_t pad, double c,
                                              double f, double plogp) {
  return run_rows(z, bias, target, pad, c, f, plogp, true);
}
"""
)
_LOSS_KERNEL = {}  # "module": the built extension, or None


def loss_kernel():
    """The C++ loss kernel (kernel_once)."""
    functions = ["smoothed_rows", "smoothed_rows_grad"]
    source, instead = LOSS_KERNEL_SOURCE, "the torch code"
    build = functools.partial(build_kernel, "loss", source, functions, instead)
    return kernel_once(_LOSS_KERNEL, build)


# %% [markdown]
# The check: one small generator and batch, the loss and its gradients
# with the kernel and with the torch code above, in float32 and under
# bf16 autocast. Float32 must agree to its rounding; in bf16 both
# round the logits' gradient to bf16 before the matrix products, so the
# gradients agree to bf16's rounding.


# %%
def loss_and_grads(kernel, autocast):
    """GeneratorLoss's loss and gradients on a fixed small problem."""
    torch.manual_seed(0)
    x = torch.randn(37, 16, requires_grad=True)
    proj = torch.nn.Linear(16, 700)
    target = torch.randint(0, 700, (37,))
    target[::5] = PAD  # some padding rows
    with autocast:
        loss = GeneratorLoss.apply(
            x, proj.weight, proj.bias, target, PAD, 0.1, kernel, 2**24
        )
    loss.backward()
    return [loss, x.grad, proj.weight.grad, proj.bias.grad]


kernel = loss_kernel()
if kernel is None:
    print("no loss kernel on this machine: training uses the torch code")
else:
    tolerances = {"float32": 1e-5, "bf16": 1e-2}
    for name, autocast in (
        ("float32", contextlib.nullcontext()),
        ("bf16", torch.autocast("cpu", torch.bfloat16)),
    ):
        mine = loss_and_grads(kernel, autocast)
        torch_code = loss_and_grads(None, autocast)
        for a, b in zip(mine, torch_code):
            tol = tolerances[name]
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        ours, theirs = mine[0].item(), torch_code[0].item()
        print(f"{name}: the kernel's loss {ours:.4f}, torch's {theirs:.4f}")


# %% [markdown]
# ### A LayerNorm kernel in C++, on the CPU
#
# With dropout, attention's softmax and the loss in C++, the next cost in
# a profile of the bf16 step at 1 thread was Part 1's `LayerNorm`: 17 of
# them a step in the `cpu` model, about 5% of its time (8 ms forward and
# 14 ms backward of a 413 ms step), two thirds of it in the backward
# pass. The kernel below normalizes each row in float32 and writes the
# result in the input's type. It keeps each row's mean $\mu$ and
# $1/\sigma$, where $\sigma = \sqrt{\mathrm{var} + \epsilon}$ and the
# variance divides by the row's length, for the backward pass, which
# reads the row and its gradient once more and returns
#
# $$\frac{\partial L}{\partial x} = \frac{1}{\sigma}\Big(g -
# \overline{g} - \hat{x}\,\overline{g\hat{x}}\Big), \qquad g = a_2
# \odot \frac{\partial L}{\partial y}, \quad \hat{x} = \frac{x -
# \mu}{\sigma},$$
#
# the bars being means over the row; the weights' gradients are the
# column sums of $\frac{\partial L}{\partial y} \odot \hat{x}$ and of
# $\frac{\partial L}{\partial y}$, summed per thread and then over
# threads. Its sums use OpenMP's `simd` reductions, which may add in any
# order; so a float32 result agrees with torch's to float32's rounding,
# not to the bit. In bf16 its forward pass takes about as long as
# torch's and its backward pass about half as long: both passes over
# 3,000 rows of 256 took 0.9 ms, torch's 1.3 ms, at 1 thread. And it is more
# exact: the check below finds torch's CPU `LayerNorm`, given bf16, off
# by several percent in the weights' gradients, the kernel by almost
# nothing.
#
# One more pass goes. In Part 1's residual connection, `x + dropout(
# sublayer(norm(x)))`, x is used twice, so its gradient has two parts,
# one through the addition and one through the norm, and autograd adds
# them in a pass of its own over the (B, T, d_model) gradient: about 4%
# of the step at 1 thread, 15 times a step. `with_residual` returns x
# with the norm's output from one autograd function, so that both parts
# arrive in its backward pass, and the kernel adds the first while it
# writes the second (`layer_norm_grad`'s last argument).
#
# `KernelLayerNorm` uses the kernel while a model trains on bf16 or
# float32 CPU tensors; `use_layer_norm_kernel` swaps it in for Part 1's
# `LayerNorm`, and `KernelNormSublayerConnection` for the dropout
# kernel's residual connections (the classes only, as above: the weights
# keep their names), so after `use_dropout_kernel`: without dropout (the
# `quick` preset) there are none, and the norm's kernel alone runs.
# `TrainingRun` does so wherever it trains on the CPU. It is built as the
# other two are, on the first call of `layer_norm_kernel`, and
# `AT_CPU_KERNELS=0` turns it off too.

# %%
#| export
LAYER_NORM_KERNEL_SOURCE = (
    CPP_PRELUDE
    + r"""
// y = (x - mean) / sqrt(var + eps) * a + b over each row of D numbers,
// var dividing by D; mean and 1 / sqrt(var + eps) kept per row.
template <typename T>
static void norm_rows(const T* x, const float* a, const float* b, T* y,
                      float* mean, float* rstd, int64_t rows, int64_t D,
                      float eps) {
  at::parallel_for(0, rows, 16, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      float sum = 0.0f, squares = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < D; ++d) sum += load(xr, d);
      float m = sum / D;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < D; ++d) {
        float centred = load(xr, d) - m;
        squares += centred * centred;
      }
      float rs = 1.0f / std::sqrt(squares / D + eps);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d)
        store(y + r * D, d, (load(xr, d) - m) * rs * a[d] + b[d]);
      mean[r] = m;
      rstd[r] = rs;
    }
  });
}

// dx per row, plus `plus` (x's gradient from elsewhere) where given; the
// column sums of dy * x_hat and of dy per chunk of rows (a chunk per
// thread) in partial: (chunks, 2, D).
template <typename T>
static void norm_grad_rows(const T* dy, const T* x, const float* mean,
                           const float* rstd, const float* a, const T* plus,
                           T* dx, float* partial, int64_t rows, int64_t D,
                           int64_t chunks) {
  at::parallel_for(0, chunks, 1, [=](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      float* a_grad = partial + chunk * 2 * D;
      float* b_grad = a_grad + D;
      for (int64_t d = 0; d < 2 * D; ++d) a_grad[d] = 0.0f;
      int64_t r0 = rows * chunk / chunks, r1 = rows * (chunk + 1) / chunks;
      for (int64_t r = r0; r < r1; ++r) {
        const T* gr = dy + r * D;
        const T* xr = x + r * D;
        float m = mean[r], rs = rstd[r], g_mean = 0.0f, gx_mean = 0.0f;
#pragma omp simd reduction(+ : g_mean, gx_mean)
        for (int64_t d = 0; d < D; ++d) {
          float g = load(gr, d), x_hat = (load(xr, d) - m) * rs;
          a_grad[d] += g * x_hat;
          b_grad[d] += g;
          g_mean += g * a[d];
          gx_mean += g * a[d] * x_hat;
        }
        g_mean /= D;
        gx_mean /= D;
        const T* pr = plus ? plus + r * D : nullptr;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          float g = load(gr, d) * a[d], x_hat = (load(xr, d) - m) * rs;
          float grad = rs * (g - g_mean - x_hat * gx_mean);
          store(dx + r * D, d, pr ? grad + load(pr, d) : grad);
        }
      }
    }
  });
}

static void check_norm(const torch::Tensor& x, const torch::Tensor& a,
                       const torch::Tensor& b) {
  TORCH_CHECK(x.device().is_cpu() && a.device().is_cpu() &&
                  b.device().is_cpu(),
              "layer norm kernel: CPU tensors, please");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kFloat,
              "layer norm kernel: bf16 or float32 input");
  TORCH_CHECK(x.dim() >= 1 && a.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat && a.dim() == 1 &&
                  a.sizes() == b.sizes() && a.size(0) == x.size(-1),
              "layer norm kernel: float32 weights of the input's last dim");
}

// (y, mean, rstd) of x over its last dim.
std::vector<torch::Tensor> layer_norm(torch::Tensor x, torch::Tensor a,
                                      torch::Tensor b, double eps) {
  check_norm(x, a, b);
  auto in = x.contiguous();
  auto weight = a.contiguous(), bias = b.contiguous();
  int64_t D = in.size(-1), rows = D ? in.numel() / D : 0;
  auto y = torch::empty_like(in);
  auto stats = in.options().dtype(at::kFloat);
  auto mean = torch::empty({rows}, stats), rstd = torch::empty({rows}, stats);
  if (in.scalar_type() == at::kBFloat16)
    norm_rows(reinterpret_cast<const uint16_t*>(in.data_ptr()),
              weight.data_ptr<float>(), bias.data_ptr<float>(),
              reinterpret_cast<uint16_t*>(y.data_ptr()),
              mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, D,
              (float)eps);
  else
    norm_rows(in.data_ptr<float>(), weight.data_ptr<float>(),
              bias.data_ptr<float>(), y.data_ptr<float>(),
              mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, D,
              (float)eps);
  return {y, mean, rstd};
}

// (dx, da, db) from dy and what layer_norm kept; dx plus `plus`, x's
// gradient from elsewhere, where given.
std::vector<torch::Tensor> layer_norm_grad(torch::Tensor dy, torch::Tensor x,
                                           torch::Tensor a,
                                           torch::Tensor mean,
                                           torch::Tensor rstd,
                                           std::optional<torch::Tensor> plus) {
  check_norm(x, a, a);
  auto g = dy.contiguous(), in = x.contiguous(), weight = a.contiguous();
  TORCH_CHECK(g.sizes() == in.sizes() && g.scalar_type() == in.scalar_type(),
              "layer norm kernel: a gradient of the input's shape and dtype");
  auto other = plus ? plus->contiguous() : torch::Tensor();
  TORCH_CHECK(!plus || (other.sizes() == in.sizes() &&
                        other.scalar_type() == in.scalar_type()),
              "layer norm kernel: a gradient of the input's shape and dtype");
  int64_t D = in.size(-1), rows = D ? in.numel() / D : 0;
  TORCH_CHECK(mean.numel() == rows && rstd.numel() == rows,
              "layer norm kernel: one mean and rstd per row");
  int64_t chunks = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), rows));
  auto dx = torch::empty_like(in);
  auto partial = torch::empty({chunks, 2, D}, weight.options());
  if (in.scalar_type() == at::kBFloat16)
    norm_grad_rows(reinterpret_cast<const uint16_t*>(g.data_ptr()),
                   reinterpret_cast<const uint16_t*>(in.data_ptr()),
                   mean.data_ptr<float>(), rstd.data_ptr<float>(),
                   weight.data_ptr<float>(),
                   plus ? reinterpret_cast<const uint16_t*>(other.data_ptr())
                        : nullptr,
                   reinterpret_cast<uint16_t*>(dx.data_ptr()),
                   partial.data_ptr<float>(), rows, D, chunks);
  else
    norm_grad_rows(g.data_ptr<float>(), in.data_ptr<float>(),
                   mean.data_ptr<float>(), rstd.data_ptr<float>(),
                   weight.data_ptr<float>(),
                   plus ? other.data_ptr<float>() : nullptr,
                   dx.data_ptr<float>(),
                   partial.data_ptr<float>(), rows, D, chunks);
  auto sums = partial.sum(0);  // (2, D)
  return {dx, sums[0], sums[1]};
}
"""
)
_LAYER_NORM_KERNEL = {}  # "module": the built extension, or None


def layer_norm_kernel():
    """The C++ LayerNorm kernel (kernel_once)."""
    functions = ["layer_norm", "layer_norm_grad"]
    source, instead = LAYER_NORM_KERNEL_SOURCE, "F.layer_norm"
    build = functools.partial(
        build_kernel, "layernorm", source, functions, instead
    )
    return kernel_once(_LAYER_NORM_KERNEL, build)


class KernelLayerNormFunction(torch.autograd.Function):
    """Part 1's LayerNorm by the kernel: one pass forward, one back."""

    @staticmethod
    def forward(ctx, x, a_2, b_2, eps, kernel):
        y, mean, rstd = kernel.layer_norm(x, a_2, b_2, eps)
        ctx.save_for_backward(x, a_2, mean, rstd)
        ctx.kernel = kernel
        return y

    @staticmethod
    def backward(ctx, grad):
        x, a_2, mean, rstd = ctx.saved_tensors
        call = ctx.kernel.layer_norm_grad
        x_grad, a_grad, b_grad = call(grad, x, a_2, mean, rstd, None)
        return x_grad, a_grad, b_grad, None, None


class KernelResidualLayerNormFunction(torch.autograd.Function):
    """(x, LayerNorm(x)) by the kernel. x goes on to the residual
    connection as the first output, so its two gradients (through the
    residual connection and through the norm) meet here, and the kernel
    adds them in its backward pass: autograd would add them in a pass of
    its own."""

    @staticmethod
    def forward(ctx, x, a_2, b_2, eps, kernel):
        y, mean, rstd = kernel.layer_norm(x, a_2, b_2, eps)
        ctx.save_for_backward(x, a_2, mean, rstd)
        ctx.kernel = kernel
        # x as a new view: the residual connection must not change it in
        # place (autograd would refuse); add_to makes a new tensor
        return x.view_as(x), y

    @staticmethod
    def backward(ctx, residual_grad, grad):
        x, a_2, mean, rstd = ctx.saved_tensors
        call = ctx.kernel.layer_norm_grad
        x_grad, a_grad, b_grad = call(grad, x, a_2, mean, rstd, residual_grad)
        return x_grad, a_grad, b_grad, None, None


class KernelLayerNorm(LayerNorm):
    """Part 1's LayerNorm, by the kernel while it trains on bf16 or
    float32 CPU tensors with float32 weights; F.layer_norm otherwise."""

    def _kernel_for(self, x):
        usable = self.training and x.device.type == "cpu"
        usable = usable and x.dtype in KERNEL_DTYPES
        usable = usable and self.a_2.dtype == torch.float32
        return layer_norm_kernel() if usable else None

    def forward(self, x):
        kernel = self._kernel_for(x)
        if kernel is None:
            return super().forward(x)
        apply = KernelLayerNormFunction.apply
        return apply(x, self.a_2, self.b_2, self.eps, kernel)

    def with_residual(self, x):
        """(x, self(x)), with x's two gradients added by the kernel."""
        kernel = self._kernel_for(x)
        if kernel is None:
            return x, self(x)
        apply = KernelResidualLayerNormFunction.apply
        return apply(x, self.a_2, self.b_2, self.eps, kernel)


class KernelNormSublayerConnection(KernelSublayerConnection):
    """KernelSublayerConnection whose LayerNorm also hands x on to the
    residual connection (`with_residual`)."""

    def forward(self, x, sublayer):
        residual, normed = self.norm.with_residual(x)
        return self.dropout.add_to(residual, sublayer(normed))


def use_layer_norm_kernel(model):
    """Make every Part 1 LayerNorm of `model` a KernelLayerNorm, and the
    dropout kernel's residual connections KernelNormSublayerConnection
    (the classes only: the weights keep their names); return `model`."""
    for module in model.modules():
        if type(module) is LayerNorm:
            module.__class__ = KernelLayerNorm
    for module in model.modules():
        if type(module) is KernelSublayerConnection:
            module.__class__ = KernelNormSublayerConnection
    return model


# %% [markdown]
# The check: a batch of rows through `KernelLayerNorm` and through Part
# 1's `LayerNorm`, in float32 and in bf16 (under autocast, as training
# runs), each against Part 1's in float64. In bf16 the two agree on the
# output and the input's gradient, but torch's CPU `LayerNorm` sums the
# weights' gradients much less exactly than the kernel does.


# %%
def norm_and_grads(cls, dtype):
    """Output and gradients of a LayerNorm of 64 features run as `cls`
    on a fixed batch in `dtype` (float64: weights in float64 too)."""
    torch.manual_seed(0)
    norm = LayerNorm(64)
    with torch.no_grad():
        norm.a_2.uniform_(0.5, 1.5)
        norm.b_2.uniform_(-0.5, 0.5)
    norm.__class__ = cls
    x = (torch.randn(5, 7, 64) * 3 + 1).to(torch.bfloat16)
    out_grad = torch.linspace(-1, 1, x.numel()).view(x.shape)
    out_grad = out_grad.to(torch.bfloat16).to(dtype)
    x = x.to(dtype).requires_grad_()  # the same numbers in each dtype
    norm.to(torch.float64 if dtype == torch.float64 else torch.float32)
    bf16 = dtype == torch.bfloat16
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        y = norm(x)
    y.backward(out_grad)
    return [y.detach(), x.grad, norm.a_2.grad, norm.b_2.grad]


if layer_norm_kernel() is None:
    print("no LayerNorm kernel on this machine: training uses F.layer_norm")
else:
    exact = norm_and_grads(LayerNorm, torch.float64)
    names = ("y", "x's gradient", "a_2's gradient", "b_2's gradient")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        mine = norm_and_grads(KernelLayerNorm, dtype)
        part_1 = norm_and_grads(LayerNorm, dtype)
        for name, m, p, e in zip(names, mine, part_1, exact, strict=True):
            scale = e.abs().max().item()
            error_m = (m.double() - e).abs().max().item() / scale
            error_p = (p.double() - e).abs().max().item() / scale
            weights = name.startswith(("a", "b"))  # float32 sums: tight
            assert error_m < (1e-5 if weights else tol), (dtype, name)
            if dtype == torch.bfloat16 and weights:
                print(
                    f"bf16 {name}, off float64 by: kernel {error_m:.1e}, "
                    f"Part 1's {error_p:.1e} (of its largest value)"
                )
    print("the kernel's LayerNorm agrees with Part 1's in float64")
    # with_residual: x's gradient is the residual's plus the norm's
    norm, ramp = KernelLayerNorm(64), torch.arange(64.0)
    x = torch.randn(5, 64, requires_grad=True)
    residual, y = norm.with_residual(x)
    (residual.sum() + (y * ramp).sum()).backward()
    grad_x, x.grad = x.grad, None
    (x.sum() + (LayerNorm.forward(norm, x) * ramp).sum()).backward()
    assert torch.allclose(grad_x, x.grad, atol=1e-5)
    print("with_residual adds x's two gradients as autograd would")


# %% [markdown]
# ### R-Drop: two dropout passes that must agree
#
# Dropout makes every training step use a different sub-network. R-Drop
# (Liang et al., 2021, "R-Drop: Regularized Dropout for Neural Networks")
# adds a loss that asks two such sub-networks to predict the same
# distribution. Each batch is seen twice, with two independent dropout
# masks. The loss is the label-smoothed loss of both passes plus $\alpha$
# times the symmetric KL divergence between their predicted
# distributions $p$ and $q$ (here the two passes', not Part 2's target
# and model), at every real target token:
#
# $$\tfrac12\big(\mathrm{KL}(p\,\|\,q) + \mathrm{KL}(q\,\|\,p)\big)
#   = \tfrac12 \sum_j (p_j - q_j)(\log p_j - \log q_j).$$
#
# In code the two passes are a single forward pass over the batch stacked
# on itself (`doubled`): row $i$ and row $B + i$ are the same sentence
# pair. Each dropout layer draws one mask over all $2B$ rows, with fresh
# random numbers for every element, so the two copies of a pair get
# independent masks, as two separate passes would.
#
# `doubled` leaves `ntokens` at $N$, the real target tokens of one copy,
# so that counts of tokens seen count each pair once. `RDropLossCompute`
# adds the label-smoothed losses of both copies and $\alpha$ times the
# KL sum, as the authors' code does, so $\alpha$ weighs the KL against
# the label-smoothed loss as it does there. It divides by $2N$, the
# doubled batch's token count, which keeps the plain loss's scale: per
# token of the original batch, the loss is the mean of the two passes'
# label-smoothed losses plus $\alpha/2$ times their symmetric KL. (A
# constant factor on the whole loss changes little under Adam, which
# divides it out of each step.) The training loss in the epoch's summary
# is that mean of the label-smoothed losses alone, so that it compares
# with runs without R-Drop.
#
# `TrainConfig.rdrop` is $\alpha$ (`train --rdrop`); 0, the default,
# trains as before. When it is above 0, `train_epoch` (below, "A run, in
# pieces") uses `RDropLossCompute`, and `train_pass` feeds the model
# `doubled` batches. Validation is unchanged: one pass, dropout off, the
# plain loss. A step costs about twice the time and the activation
# memory. No preset turns R-Drop on; `bench/recipe_sweep.py` tried it on
# a distilled student (a model trained on a trained "teacher" model's
# translations of the training sentences, `bench/distill.py`), and
# [results](../docs/results.md) says what it gave.


# %%
#| export
def doubled(batch):
    """The batch stacked on itself: rows i and B + i are the same pair.

    `ntokens` stays one copy's real target tokens, so token counts do not
    double (`TrainState.samples`, which counts rows, does). The loss
    (`RDropLossCompute`) knows the batch is doubled.
    """
    twice = copy.copy(batch)
    for name, value in vars(batch).items():  # every tensor, as Batch.to
        if torch.is_tensor(value):
            setattr(twice, name, torch.cat([value, value]))
    return twice


def symmetric_kl(logp, logq, keep):
    """(KL(p||q) + KL(q||p)) / 2 of each row, summed where `keep` is True.

    logp, logq: (..., V) log-probabilities; keep: (...) booleans.
    """
    acc = torch.promote_types(logp.dtype, torch.float32)  # bf16: float32
    logp, logq = logp.to(acc), logq.to(acc)
    per_row = 0.5 * ((logp.exp() - logq.exp()) * (logp - logq)).sum(-1)
    return per_row.masked_fill(~keep, 0).sum()


class RDropLossCompute(SimpleLossCompute):
    """SimpleLossCompute for a `doubled` batch, plus R-Drop's KL term."""

    def __init__(self, generator, criterion, alpha):
        super().__init__(generator, criterion)
        self.alpha = alpha

    def __call__(self, x, y, norm):
        """x: (2B, T, d_model); y: (2B, T); norm: the B pairs' tokens."""
        logp = self.generator(x)  # (2B, T, vocab)
        flat = logp.reshape(-1, logp.size(-1))
        smoothed = self.criterion(flat, y.reshape(-1))  # both copies
        first, second = logp.chunk(2)
        keep = y.chunk(2)[0] != self.criterion.padding_idx
        kl = symmetric_kl(first, second, keep)
        loss_mean = (smoothed + self.alpha * kl) / (2 * norm)
        return smoothed.detach() / 2, loss_mean


# %% [markdown]
# The checks: the KL term is zero when both passes agree (dropout off),
# and it matches `torch.nn.functional.kl_div` computed each way. Then
# the scale: on a doubled batch whose two copies agree, the loss trained
# on and the loss reported are the plain loss of one copy.

# %%
torch.manual_seed(0)
logp = torch.randn(2, 5, 9).log_softmax(-1)
logq = torch.randn(2, 5, 9).log_softmax(-1)
keep = torch.ones(2, 5, dtype=torch.bool)
kl_div = torch.nn.functional.kl_div  # kl_div(log q, p): KL(p || q)
both = kl_div(logq, logp.exp(), reduction="sum") + kl_div(
    logp, logq.exp(), reduction="sum"
)
assert torch.allclose(symmetric_kl(logp, logq, keep), both / 2, atol=1e-6)
assert symmetric_kl(logp, logp, keep) == 0

# %%
from the_annotated_transformer import Generator

torch.manual_seed(0)
generator = Generator(d_model=16, vocab=9)
criterion = LabelSmoothing(size=9, padding_idx=PAD, smoothing=0.1)
x = torch.randn(3, 5, 16)  # one copy's decoder output, (B, T, d_model)
y = torch.randint(PAD + 1, 9, (3, 5))  # (B, T)
ntokens = y.numel()
plain_sum, plain_mean = SimpleLossCompute(generator, criterion)(x, y, ntokens)
rdrop = RDropLossCompute(generator, criterion, alpha=2.5)
both = (torch.cat([x, x]), torch.cat([y, y]))  # the copies agree: KL = 0
reported, trained_on = rdrop(*both, ntokens)
assert torch.isclose(reported, plain_sum)
assert torch.isclose(trained_on, plain_mean)


# %% [markdown]
# ### A run, in pieces
#
# A training run is one process per GPU, or several processes that
# share the CPU. The processes are numbered from 0, and a
# process's number is its *rank*; rank 0 is the one that prints and
# saves. `train_worker`, further on, is what each process runs, and we
# build it from a few pieces.
#
# `place_process` settles the process's device. On a GPU it makes that
# GPU the current one (`torch.cuda.set_device`), so that NCCL and new
# tensors use it. Processes that share the CPU each get an equal part of
# the cores this process may use (`usable_cores`: in a container, often
# fewer than the machine has).
#
# `join_group` connects the processes of a distributed run. The
# processes that `train_distributed_model` (below) spawns share one
# machine, so a process's rank is also the index of its GPU; under
# `torchrun` the command line passes each process its device instead.


# %%
#| export
def usable_cores():
    """The CPU cores this process may run on: in a container or under
    `taskset`, fewer than the machine has (os.cpu_count())."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def place_process(rank, world_size, distributed, device=None):
    """This process's device, made the current GPU on CUDA."""
    if device is None:
        device = process_device(rank, world_size if distributed else 1)
    device = torch.device(device)
    if distributed and device.type == "mps":
        raise ValueError(
            "several processes train on the CPU on a Mac (gloo cannot send"
            " MPS tensors): pass device='cpu'"
        )
    if device.type == "cuda":
        if device.index is None:  # plain "cuda": the current GPU
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # needs the GPU's number
    elif world_size > 1:  # this machine's processes share its cores
        on_this_machine = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(max(1, usable_cores() // on_this_machine))
    return device


def join_group(device, rank, world_size, port=None):
    """Join the process group: env:// under torchrun, else a local port."""
    url = None if port is None else f"tcp://127.0.0.1:{port}"
    torch.distributed.init_process_group(
        backend_for(device),
        init_method=url,
        rank=rank,
        world_size=world_size,
    )


# %% [markdown]
# `TrainingRun` sets up one process's run. It joins the group when there
# are several processes, seeds the random number generators, and builds
# the model with `FastDropout` (above), or on the CPU with the C++
# dropout kernel where it builds ("A dropout kernel in C++, on the CPU",
# below).
#
# The criterion is `FastLabelSmoothing`, the appendix's faster loss;
# `train_epoch`, below, wraps it in a loss computation. The optimizer and
# schedule are Part 3's, the schedule sized from the epoch's length
# (`batches_per_epoch`) or, if given, a total number of steps. Last, it
# picks the precision, with a `GradScaler` where the precision needs one.
#
# A run holds its model under two names: `module` is the bare model,
# whose weights checkpoints store, and `model` is what we call, the same
# model wrapped in DDP when there are several processes.
# `params_in_sync` checks at the end of a run that every process holds
# the same weights.


# %%
#| export
class TrainingRun:
    """One process's model, loss, optimizer, schedule and history."""

    def __init__(
        self,
        rank,
        world_size,
        sizes,
        config,
        distributed,
        port=None,
        device=None,
        batches_per_epoch=None,
        total=None,
    ):
        c = self.config = config
        self.rank = rank
        self.device = place_process(rank, world_size, distributed, device)
        if distributed:
            join_group(self.device, rank, world_size, port)
        torch.manual_seed(c.seed)
        model = use_fast_dropout(model_from_config(c, *sizes))
        if wants_dropout_kernel(self.device, c.dropout) and dropout_kernel():
            use_dropout_kernel(model)  # C++ on the CPU, where it builds
        on_cpu = self.device.type == "cpu"
        if on_cpu and layer_norm_kernel():
            use_layer_norm_kernel(model)  # C++ too
        self.loss_kernel = loss_kernel() if on_cpu else None  # or None
        self.model = self.module = model.to(self.device)
        if distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            DDP = torch.nn.parallel.DistributedDataParallel
            self.model = DDP(self.module, device_ids=ids)
        self.criterion = FastLabelSmoothing(sizes[1], PAD, c.label_smoothing)
        self.optimizer, self.scheduler = make_run_optimizer(
            self.module, c, batches_per_epoch, total
        )
        self.precision = choose_precision(self.device, c.precision)
        self.autocast = autocast_for(self.device, self.precision.dtype)
        if wants_bf16_stream(self.device, self.precision):
            use_bf16_stream(self.module)
        self.scaler = None
        if self.precision.scaler:
            self.scaler = torch.amp.GradScaler(self.device.type)
        self.state, self.history = TrainState(), []


def params_in_sync(module):
    """True when every process holds exactly the same parameters."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


# %% [markdown]
# Part 2's `micro_step` takes three arguments that only bigger runs use:
# `hold_sync`, `autocast` and `scaler`. `run_epoch` passes all three:
# `hold_sync` it sets itself, the others come from its own arguments.
#
# * **`hold_sync`: gradient accumulation under DDP.** Every backward pass
#   of a DDP-wrapped model averages gradients across processes;
#   micro-batches that do not end in an optimizer step (`hold_sync=True`)
#   skip that inside `model.no_sync()`.
# * **`autocast`** is a function returning a context, entered
#   afresh around each micro-batch's forward pass and loss. One region
#   around a whole epoch would be a silent bug: autocast caches its
#   low-precision weight copies until the region ends, so later steps
#   would compute with stale weights.
# * **`scaler`**: with float16, the `GradScaler` ("Which precision").
#
# `device_batch` builds a `Batch` with its masks made on the device: it
# copies the two id tensors (asynchronously, from pinned memory) and
# counts the target tokens on the CPU first, because counting them on
# the GPU would make the CPU wait for it. `CountedBatches` passes
# batches through and counts their target tokens as they are consumed.
# `all_reduce_loss` turns each process's mean loss into the mean over
# all processes' tokens, so that the validation loss covers the whole
# validation set.


# %%
#| export
def device_batch(src, tgt, device, pad=PAD):
    """Batch(src, tgt, pad) on `device`, its masks made there."""
    ntokens = int(tgt[:, 1:].ne(pad).sum())  # on the CPU: no GPU sync
    # Asynchronous copies on CUDA only, as Batch.to (Part 2) makes them:
    # on Apple's MPS they can be wrong.
    asynchronous = torch.device(device).type == "cuda"
    src = src.to(device, non_blocking=asynchronous)  # (B, S)
    tgt = tgt.to(device, non_blocking=asynchronous)  # (B, T + 1)
    batch = Batch(src, None, pad)  # the source mask, made on `device`
    # The target side by hand: Batch(src, tgt) would count ntokens on the
    # GPU, and reading that count back would make the CPU wait for it.
    batch.tgt, batch.tgt_y = tgt[:, :-1], tgt[:, 1:]  # (B, T) each
    batch.tgt_mask = Batch.make_std_mask(batch.tgt, pad)  # (B, T, T)
    batch.ntokens = ntokens
    return batch


class CountedBatches:
    """The batches, passed through as they are consumed; `tokens` counts
    the target tokens of those passed so far."""

    def __init__(self, batches):
        self.batches = batches
        self.tokens = 0

    def __iter__(self):
        for batch in self.batches:
            self.tokens += batch.ntokens
            yield batch


def all_reduce_loss(loss, tokens, device):
    """The loss per token over every process (this one's alone if one)."""
    if not torch.distributed.is_initialized():
        return loss
    totals = torch.tensor([loss * tokens, tokens], device=device)
    torch.distributed.all_reduce(totals)  # sums over processes
    return (totals[0] / totals[1].clamp(min=1)).item()


# %% [markdown]
# `train_epoch` runs one epoch: `train_pass`, then `validate`, both
# through Part 2's `run_epoch`, and it records both losses, each
# averaged over all processes. Before the pass,
# `train_loader.batch_sampler.set_epoch(epoch)` reshuffles the batches
# for this epoch, from the seed and the epoch's number, so that every
# process draws the same order and takes its own share of it. Only rank
# 0 prints: a tqdm bar over the batches, once an epoch has taken more
# than three seconds, then both losses, with the peak GPU memory from
# `torch.cuda`'s own statistics.


# %%
#| export
def train_pass(run, train_loader, loss_compute):
    """One pass over the training batches; the loss over all processes."""
    batches = (device_batch(s, t, run.device) for s, t in train_loader)
    if isinstance(loss_compute, RDropLossCompute):  # each batch twice
        batches = map(doubled, batches)
    batches = CountedBatches(batches)
    run.model.train()
    train_loss, run.state = run_epoch(
        batches,
        run.model,
        loss_compute,
        run.optimizer,
        run.scheduler,
        accum_iter=run.config.accum_iter,
        train_state=run.state,
        autocast=run.autocast,
        scaler=run.scaler,
    )
    return all_reduce_loss(train_loss, batches.tokens, run.device)


def validate(run, valid_loader, loss_compute):
    """The validation loss, without dropout, over all processes."""
    batches = (device_batch(s, t, run.device) for s, t in valid_loader)
    batches = CountedBatches(batches)
    run.model.eval()
    val_loss, _ = run_epoch(
        batches,
        run.model,
        loss_compute,
        mode="eval",
        autocast=run.autocast,
    )
    return all_reduce_loss(val_loss, batches.tokens, run.device)


LOG_REDRAW_SECONDS = 60  # a bar drawn into a file: once a minute


@contextlib.contextmanager
def progress_bar(iterable, desc, show=True, **options):
    """`iterable`, behind a bar on stderr once it has run for 3 s (when
    `show`); the bar is closed on the way out, Ctrl-C included, so that
    what is printed next starts on a line of its own."""
    if not show:
        yield iterable
        return
    from tqdm.auto import tqdm  # here: the module needs only torch

    if drawn_into_a_file():  # a log, e.g. `nohup ... > log 2>&1`
        options.setdefault("mininterval", LOG_REDRAW_SECONDS)
        options.setdefault("maxinterval", LOG_REDRAW_SECONDS)
    options.setdefault("delay", 3)  # no bar for work done in 3 s
    bar = tqdm(iterable, desc, **options)
    try:
        yield bar
    finally:
        bar.close()


def drawn_into_a_file():
    """Whether a bar drawn on stderr lands in something other than a
    terminal or a notebook. Those redraw the bar in place; a file keeps
    every redraw, up to one per batch, unless the bar is told to draw
    less often."""
    in_jupyter = "ipykernel" in sys.modules
    return not in_jupyter and not sys.stderr.isatty()


def run_loss_compute(run):
    """The run's loss: FusedLossCompute (see 'The generator and the loss
    in one') on the CPU, with the C++ loss kernel where it builds;
    SimpleLossCompute elsewhere."""
    if run.device.type != "cpu":
        return SimpleLossCompute(run.module.generator, run.criterion)
    loss_compute = FusedLossCompute(run.module.generator, run.criterion)
    loss_compute.kernel = run.loss_kernel
    return loss_compute


def train_epoch(run, epoch, train_loader, valid_loader, show=True):
    """Train for one epoch, then validate; returns the history entry."""
    loss_compute = run_loss_compute(run)
    train_compute = loss_compute  # R-Drop's (above) when rdrop is on
    if run.config.rdrop > 0:
        train_compute = RDropLossCompute(
            run.module.generator, run.criterion, alpha=run.config.rdrop
        )
    train_loader.batch_sampler.set_epoch(epoch)
    show_bar = show and run.rank == 0
    with progress_bar(train_loader, f"epoch {epoch}", show_bar) as batches:
        train_loss = train_pass(run, batches, train_compute)
    val_loss = validate(run, valid_loader, loss_compute)
    entry = {
        "epoch": epoch,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "steps": run.state.accum_step,
    }
    run.history.append(entry)
    if show and run.rank == 0:
        report = f"epoch {epoch}: train {train_loss:.3f}, val {val_loss:.3f}"
        if run.device.type == "cuda":
            gib = torch.cuda.max_memory_allocated(run.device) / 2**30
            report += f" (GPU memory {gib:.1f} GiB)"
        print(report)
    return entry


# %% [markdown]
# ### Saving and resuming a run
#
# `save_run` writes a run's weights, config, vocabularies and losses into
# one checkpoint file. After every epoch, rank 0 calls `save_epoch`, which
# writes two: a lean `epoch_NNN.pt` with the weights that Part 5 averages
# (keeping the newest `keep_last`), then `last.pt`, which adds the
# optimizer (Adam keeps two averages per weight: three numbers per weight
# where the lean file has one), the schedule, the counters and the random
# states. A crash between the two writes only repeats the epoch.
#
# The random states are the CPU's and what the run's device needs to go
# on as if never stopped (`device_states`): the random state of this
# process's GPU, which dropout draws from there (of this GPU alone, so
# that a run saved on two GPUs resumes on one), and the `GradScaler`'s
# scale on a GPU that trains in float16.


# %%
#| export
def save_run(run, name, vocab_src, vocab_tgt, **extra):
    """Write the weights, config, vocabularies and losses, and `extra`."""
    fields = {
        "model": run.module.state_dict(),
        "config": asdict(run.config),
        "vocab_src": vocab_src.get_itos(),
        "vocab_tgt": vocab_tgt.get_itos(),
        "history": run.history,
    }
    if is_subword(vocab_tgt):  # its merges, as JSON
        fields["bpe"] = vocab_tgt.to_str()
    save_checkpoint(Path(run.config.checkpoint_dir, name), **fields, **extra)


def device_states(run):
    """What a resumed run needs besides the CPU's random state: the random
    state of the run's GPU, which dropout draws from there, and the
    GradScaler's scale, where the precision has one."""
    states = {}
    if run.device.type == "cuda":  # this process's GPU only
        states["cuda_rng_state"] = torch.cuda.get_rng_state(run.device)
    if run.device.type == "mps":
        states["mps_rng_state"] = torch.mps.get_rng_state()
    if run.scaler is not None:
        states["scaler"] = run.scaler.state_dict()
    return states


def restore_device_states(run, ckpt):
    """Put back what device_states saved, where this run can use it."""
    device = run.device
    if device.type == "cuda":
        state = ckpt.get("cuda_rng_state")
        every = ckpt.get("cuda_rng_states", [])  # older runs: every GPU's
        if state is None and (device.index or 0) < len(every):
            state = every[device.index or 0]
        if state is not None:
            torch.cuda.set_rng_state(state, device)
    if device.type == "mps" and "mps_rng_state" in ckpt:
        torch.mps.set_rng_state(ckpt["mps_rng_state"])
    if run.scaler is not None and "scaler" in ckpt:
        run.scaler.load_state_dict(ckpt["scaler"])


def save_epoch(run, epoch, vocab_src, vocab_tgt):
    """Write a lean epoch_NNN.pt, then last.pt; keep `keep_last` epochs."""
    save_run(run, f"epoch_{epoch:03d}.pt", vocab_src, vocab_tgt, epoch=epoch)
    resume = {
        "epoch": epoch,
        "train_state": asdict(run.state),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "rng_state": torch.get_rng_state(),
        **device_states(run),
    }
    save_run(run, "last.pt", vocab_src, vocab_tgt, **resume)
    keep = run.config.keep_last
    if keep > 0:  # 0 keeps every epoch file
        for old in epoch_checkpoints(run.config.checkpoint_dir)[:-keep]:
            old.unlink()


# %% [markdown]
# A run that starts afresh in a folder that holds an earlier run says so
# on stderr as it starts (`note_earlier_run`), then removes that run's
# epoch files, `last.pt` and `final.pt` (`clear_earlier_run`) just before
# it saves its own first epoch. Otherwise the earlier run's
# higher-numbered epoch files would count as the newest: `keep_last`
# would keep them and delete the new run's own; and a run stopped later
# would leave the earlier run's `final.pt`, which `translate` reads,
# beside its own epochs. Stopped during its first epoch, the new run
# leaves the earlier one whole.


# %%
#| export
def earlier_run_files(folder):
    """The epoch files, last.pt and final.pt of an earlier run in
    `folder`."""
    ends = [Path(folder, name) for name in ("last.pt", "final.pt")]
    return [*epoch_checkpoints(folder), *(p for p in ends if p.is_file())]


def note_earlier_run(folder):
    """Say on stderr, as a run starts afresh, what it will replace."""
    files = earlier_run_files(folder)
    if not files:
        return
    names = [
        "epoch files" if EPOCH_FILE.fullmatch(p.name) else p.name
        for p in files
    ]
    names = list(dict.fromkeys(names))  # "epoch files" once, in order
    resumable = Path(folder, "last.pt").is_file()  # its training state
    print(
        f"note: {folder} holds an earlier run, which training afresh"
        f" replaces: saving the first epoch removes its {', '.join(names)}"
        + (
            "; to train that run further instead, stop now and train with"
            " --resume (and a larger --epochs if it finished)"
            if resumable
            else ""
        ),
        file=sys.stderr,
    )


def clear_earlier_run(folder):
    """Remove an earlier run's epoch files, last.pt and final.pt from
    `folder`; return their names. Left there, the earlier run's
    higher-numbered files would count as the newest (keep_last would
    delete the new run's files instead, and --average could mix the two
    runs), and its final.pt would be the model of a folder that trains
    another."""
    files = earlier_run_files(folder)
    for path in files:
        path.unlink()
    return [path.name for path in files]


# %% [markdown]
# `resume_checkpoint` returns the file to resume from, `last.pt`, and
# its contents (`resume_point` gives the file alone). (For a run made by
# an older version of this code, without `last.pt`, it takes the newest
# epoch file, which then held the optimizer too.) It loads the file onto
# the CPU whatever the run's device: `torch.set_rng_state` takes only a
# CPU tensor, and `load_state_dict` moves weights and optimizer state to
# where the model lives. `resume_run` restores from it exactly as an
# uninterrupted run would continue, except how Adam computes: a run
# saved where Adam was fused (one kernel for all weights, on a CPU or a
# CUDA GPU) and resumed where it is not keeps this machine's choice
# (`load_optimizer_state`).


# %%
#| export
def resume_checkpoint(folder):
    """The checkpoint a run in `folder` resumes from, loaded onto the CPU
    (where random states must be): (path, contents), or (None, None)."""
    paths = [Path(folder, "last.pt"), *epoch_checkpoints(folder)[-1:]]
    for path in paths:
        if path.is_file():
            ckpt = load_checkpoint(path, "cpu")
            if "optimizer" in ckpt:
                return path, ckpt
    return None, None


def resume_point(folder):
    """The file a run in `folder` resumes from, or None."""
    path, _ = resume_checkpoint(folder)
    return path


def load_optimizer_state(optimizer, state):
    """Load an optimizer's saved state, keeping how this machine's
    optimizer computes (`fused`, `foreach`): load_state_dict copies the
    saved choices too, and fused Adam saved on a CPU or a CUDA GPU would
    then step on Apple's GPU, where Part 2 does not ask for it. The
    choices go into the saved groups before loading, since torch places
    each weight's step counter by them."""
    groups = []
    pairs = zip(state["param_groups"], optimizer.param_groups, strict=True)
    for saved, own in pairs:
        mine = {k: own[k] for k in ("fused", "foreach") if k in own}
        groups.append({**saved, **mine})
    optimizer.load_state_dict({**state, "param_groups": groups})


def resume_run(run):
    """Restore the newest training state; returns the next epoch."""
    path, ckpt = resume_checkpoint(run.config.checkpoint_dir)
    if path is None:  # nothing to resume from: start afresh
        return 0
    load_weights(run.module, ckpt, path)
    load_optimizer_state(run.optimizer, ckpt["optimizer"])
    run.scheduler.load_state_dict(ckpt["scheduler"])
    run.state, run.history = TrainState(**ckpt["train_state"]), ckpt["history"]
    torch.set_rng_state(ckpt["rng_state"])
    restore_device_states(run, ckpt)
    return ckpt["epoch"] + 1


# %% [markdown]
# Before a run starts, `check_resume` makes sure that `--resume` means
# what it says. It refuses a folder that holds epoch files or a
# `final.pt` but no training state to resume from (`--resume` must not
# quietly start afresh); a checkpoint of another model, naming the first
# size that differs (it builds the run's model on the `meta` device,
# which has shapes but no memory); other training settings, since a
# resumed run with another dropout, schedule or batch size would be
# neither the old run nor a new one; and an `--epochs` smaller than the
# number of epochs already trained. Only the number of epochs, the
# folder, the epoch files kept, the data workers and the preset's name
# may change. It returns the file to resume from and the number of
# epochs it has trained, or (None, 0) for a folder with no checkpoints,
# where the run starts afresh. `check_resume_and_say` then says so, and
# says when every epoch asked for is trained already.


# %%
#| export
RESUMABLE_CHANGES = {"epochs", "checkpoint_dir", "keep_last", "num_workers"}
# Fields newer than some checkpoints, and the training those had without
# them: a checkpoint that lacks one is compared with this value.
OLDER_DEFAULTS = {"rdrop": 0.0, "data": ""}


def changed_settings(saved, config):
    """What differs between a checkpoint's saved config and `config`."""
    now = config_fields_now(asdict(config))  # "bf16" is "auto" on both sides
    saved = OLDER_DEFAULTS | config_fields_now(saved)  # older ones lack some
    same_either_way = RESUMABLE_CHANGES | {"preset"}  # a name, not a setting
    return [
        f"{key} {saved[key]!r} there, {value!r} here"
        for key, value in now.items()
        if key in saved and key not in same_either_way and saved[key] != value
    ]


def plural(n, word):
    """ "1 epoch", "2 epochs": `n` and `word`, plural unless n is 1."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def check_resume(config, vocab_src, vocab_tgt):
    """(the checkpoint a run would resume from, the epochs it has
    trained), checked; (None, 0) when there is none."""
    folder = config.checkpoint_dir
    try:
        path, ckpt = resume_checkpoint(folder)
    except CheckpointError as err:  # a damaged last.pt: say what is left
        raise CheckpointError(
            f"{err}; it cannot be resumed: train without --resume to start"
            " afresh (which replaces the run), or choose another"
            " --checkpoint-dir"
        ) from err
    final = Path(folder, "final.pt")
    if path is None and (epoch_checkpoints(folder) or final.is_file()):
        raise CheckpointError(
            f"nothing to resume in {folder}: its checkpoints lack the "
            "training state (no last.pt); train without --resume to start"
            " afresh, which replaces them, or choose another"
            " --checkpoint-dir"
        )
    if path is not None:
        with torch.device("meta"):  # shapes only, no memory
            model = model_from_config(config, len(vocab_src), len(vocab_tgt))
        problem = size_mismatch(model.state_dict(), ckpt["model"])
        if problem:
            raise CheckpointError(
                f"cannot resume from {path}, another model: {problem}"
            )
        changed = changed_settings(ckpt.get("config", {}), config)
        if changed:
            raise CheckpointError(
                f"cannot resume from {path} with other training settings: "
                + "; ".join(changed)
                + "; train with the same ones, or in another folder"
            )
        done = ckpt.get("epoch", -1) + 1
        if config.epochs < done:
            asked = plural(config.epochs, "epoch")
            raise CheckpointError(
                f"cannot resume from {path} for {asked} in all: it has"
                f" trained {plural(done, 'epoch')} already; ask for {done}"
                " or more (--epochs)"
            )
        return path, done
    return None, 0


def check_resume_and_say(config, vocab_src, vocab_tgt):
    """check_resume, with a note on stderr when the run starts afresh or
    has nothing left to train."""
    path, done = check_resume(config, vocab_src, vocab_tgt)
    if path is None:
        print(
            f"note: nothing to resume in {config.checkpoint_dir} (no "
            "checkpoints there); training from the first epoch",
            file=sys.stderr,
        )
    elif done == config.epochs:
        epochs = "its 1 epoch" if done == 1 else f"all {done} epochs"
        print(
            f"note: {path} has trained {epochs}; nothing left to train"
            " (ask for more with --epochs)",
            file=sys.stderr,
        )


# %% [markdown]
# Two runs that write into the same folder would overwrite each other's
# files, so a run holds `folder_lock` on its checkpoint folder while it
# trains. The lock is `fcntl.flock` on a file `.lock` in the folder,
# which holds the process id of the run that has it. The kernel releases
# a `flock` when its process ends, however it ends, so the lock of a
# killed run is never stale: its `.lock` file stays, but the next run
# takes it over. `fcntl` is in the standard library (the `filelock`
# package takes the same `flock` but does not record the holder). It
# exists on Linux and macOS, not on Windows, and `flock` is not reliable
# on some network file systems. A folder that the lock made, and that
# holds nothing but the lock when the run ends (stopped or failed before
# its first epoch), is removed again.


# %%
#| export
class FolderInUseError(RuntimeError):
    """Another process trains into the same checkpoint folder."""


@contextlib.contextmanager
def folder_lock(folder):
    """Hold the lock on a checkpoint folder while the block runs."""
    import fcntl  # Unix only

    folder = Path(folder)
    made = missing_folders(folder)  # removed at the end if nothing was saved
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
        try:
            write_holder(f)
            yield folder
        finally:
            f.truncate(0)
            if made and [p.name for p in folder.iterdir()] == [".lock"]:
                remove_lock_and_folders(made)  # before saving epoch 0
            fcntl.flock(f, fcntl.LOCK_UN)


def write_holder(f):
    """Write this process's id into the lock file `f`, for the message of
    a second run. Unbuffered, so that a full disk fails here, named."""
    f.seek(0)
    f.truncate()
    try:
        os.write(f.fileno(), f"{os.getpid()}\n".encode())
    except OSError as err:
        raise OSError(err.errno, err.strerror, f.name) from err


def remove_lock_and_folders(made):
    """Remove the lock file and the folders made for it (`made`, deepest
    first) while this process still holds the lock, so that no other run
    slips in between."""
    with contextlib.suppress(OSError):  # another run wrote a file: keep
        (made[0] / ".lock").unlink()
        remove_if_empty(made)


# %% [markdown]
# Check: a second lock on a held folder names the process that holds it.

# %%
with tempfile.TemporaryDirectory() as tmp:
    with folder_lock(tmp):
        try:
            with folder_lock(tmp):
                raise AssertionError("a held folder was locked twice")
        except FolderInUseError as err:
            assert f"process {os.getpid()}" in str(err)


# %% [markdown]
# ### One process's whole run: `train_worker`
#
# `train_worker` puts the pieces above together (the device, the data
# loaders, a `TrainingRun`, its epochs) with the checkpoint files. Rank 0
# says in one line where it trains, writes the files after every epoch,
# and writes `final.pt` after the last; with several processes, it
# records there whether all ranks ended with the same weights
# (`ranks_in_sync`). A resumed run with every epoch trained returns at
# once when its `final.pt` is there (stopped before writing it, it writes
# it). Whatever happens, a process leaves its process group on the way
# out (`finally`).
#
# One more check comes first. `train --data FOLDER` (the command line,
# below) trains on other pairs, such as a trained model's translations
# of the training sentences (sequence-level distillation: that model is
# the "teacher", the one trained on them the "student"), and
# stores their digest, a SHA-256, in `config.data`. A config whose `data`
# is set is refused unless the folder being read (`$MULTI30K_DIR`, which
# `multi30k_from(FOLDER)` sets while training, as `train --data` does)
# holds the pairs of that digest.


# %%
#| export
def check_training_pairs(config):
    """Refuse a config whose `data` digest is not the pairs read here."""
    folder = multi30k_folder()
    if not config.data:
        return
    found = pairs_digest(folder)
    if found != config.data:
        raise ValueError(
            f"config.data is {short_digest(config.data)}, but the training"
            f" pairs in {folder} are {short_digest(found)}: read the folder"
            " that holds them with multi30k_from(folder), as `train --data`"
            " does"
        )


def final_is_this_runs(run):
    """Does the run's folder hold a final.pt written at the end of this
    run (the same losses, every epoch)?"""
    final = Path(run.config.checkpoint_dir, "final.pt")
    if not final.is_file():
        return False
    history = load_checkpoint(final).get("history")
    return repr(history) == repr(run.history)  # repr: a NaN != itself


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
    device=None,
):
    """Train on Multi30k in one process; returns the history of losses."""
    sizes = (len(vocab_src), len(vocab_tgt))
    try:
        check_training_pairs(config)
        device = place_process(rank, world_size, is_distributed, device)
        loaders = create_dataloaders(
            vocab_src,
            vocab_tgt,
            spacy_de,
            spacy_en,
            max_tokens=config.max_tokens,
            max_len=config.max_len,
            seed=config.seed,
            num_workers=config.num_workers,
            max_train_pairs=config.max_train_pairs,
            encode=encode_pairs_cached,
        )
        pinned = device.type == "cuda"  # copies overlap the GPU's work
        loaders = [shard_loader(x, world_size, rank, pinned) for x in loaders]
        run = TrainingRun(
            rank,
            world_size,
            sizes,
            config,
            distributed=is_distributed,
            port=port,
            device=device,  # placed already: placing again changes nothing
            batches_per_epoch=len(loaders[0]),
        )
        if show_progress and rank == 0:
            print(describe_device(run.device, run.precision))
        first_epoch = resume_run(run) if resume else 0
        if first_epoch == config.epochs and final_is_this_runs(run):
            return run.history  # a finished run: nothing to train or save
        if first_epoch == 0 and rank == 0:
            note_earlier_run(config.checkpoint_dir)
        for epoch in range(first_epoch, config.epochs):
            train_epoch(run, epoch, *loaders, show=show_progress)
            if rank == 0:
                if epoch == 0:  # only a run started afresh saves epoch 0
                    clear_earlier_run(config.checkpoint_dir)
                save_epoch(run, epoch, vocab_src, vocab_tgt)
        in_sync = params_in_sync(run.module) if is_distributed else True
        if rank == 0:
            last = {"epoch": config.epochs - 1, "ranks_in_sync": in_sync}
            save_run(run, "final.pt", vocab_src, vocab_tgt, **last)
        return run.history
    finally:
        if is_distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# %% [markdown]
# ### Starting processes
#
# `train_worker` trains in one process. To use several, the processes must
# first find each other (a *rendezvous*): `free_port` asks the operating system
# for a TCP port nobody listens on, and `train_distributed_model` starts one
# process per GPU (or `world_size` CPU processes) with
# `torch.multiprocessing.spawn`. With no GPU it runs every process on the
# CPU. With some GPUs, but fewer than processes, it stops with a
# `ValueError` that says so, before starting anything, unless
# `cpu_fallback=True`, which runs every process on the CPU and says so.
#
# Under `torchrun`, PyTorch's launcher for several processes, none of this is
# needed: it starts the processes and sets the rendezvous address itself.


# %%
#| export
def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vocabulary_as_data(vocab):
    """A vocabulary as plain data that a new process can receive: its
    tokenizer's JSON for BPE, else its list of words."""
    return vocab.to_str() if is_subword(vocab) else vocab.get_itos()


def train_distributed_model(
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    config,
    world_size=None,
    resume=False,
    cpu_fallback=False,
):
    """Train with one process per GPU (or world_size CPU processes)."""
    import torch.multiprocessing as mp

    world_size = world_size or max(cuda_count(), 1)
    on_gpus = process_device(0, world_size, cpu_fallback).type == "cuda"
    if on_gpus:
        device, how = "cuda", "one per GPU, with nccl"
    else:  # several processes on a Mac use the CPU: gloo cannot send MPS
        device, how = "cpu", "on the CPU, with gloo"
        if cuda_count() and pick_device().type == "cuda":  # too few GPUs
            how += f" (NCCL needs a GPU per process; {cuda_count()} here)"
    print(f"{world_size} processes {how}")
    vocabs = [vocabulary_as_data(vocab_src), vocabulary_as_data(vocab_tgt)]
    # main's choice, read back: command_line_warnings, which main calls,
    # sets warning_line as the way to show warnings.
    one_line_warnings = warnings.showwarning is warning_line
    # What each worker receives, in _spawned_worker's order after its rank.
    args = (
        world_size,
        vocabs,
        (spacy_de, spacy_en),
        asdict(config),
        free_port(),
        resume,
        device,
        one_line_warnings,
    )
    earlier = set(multiprocessing.active_children())  # not ours to stop
    try:
        with stop_signals_kept(), new_processes_ignore_ctrl_c():
            workers = mp.spawn(
                _spawned_worker, args, nprocs=world_size, join=False
            )
        while not workers.join():  # True once every worker has ended
            pass
    except mp.ProcessRaisedException as err:
        if worker_out_of_memory(err):  # main says it in one line
            raise MemoryError(f"a training process: {err}") from None
        user_error = user_error_of_worker(err)
        if user_error is None:  # a fault, not a mistake: its traceback
            raise
        raise user_error from None
    except BaseException:  # Ctrl-C, SIGTERM under main, a failed start
        stop_processes(started_since(earlier))
        raise


def started_since(earlier):
    """This process's children still running that are not in `earlier`:
    those started since, whether or not mp.spawn returned."""
    return [p for p in multiprocessing.active_children() if p not in earlier]


# %% [markdown]
# A spawned process imports the module, not the notebook that started it.
# So the vocabularies travel as plain data (token lists, or BPE JSON text)
# and the config as a dict; `_spawned_worker` rebuilds them before it
# calls `train_worker`. The spaCy tokenizers travel pickled. A worker's
# error reaches the parent as text; one that would be the user's mistake
# in one process (a `DatasetError`, say) becomes a `UserError` with its
# message (`user_error_of_worker`), so the command line says it in one
# line; any other keeps its traceback.


# %%
#| export
def _spawned_worker(
    rank,
    world_size,
    vocabs,
    tokenizers,
    config,
    port,
    resume,
    device,
    one_line_warnings=False,
):
    """train_worker in a new process, from plain data. A new process
    prints warnings Python's way; `one_line_warnings` (the command line's
    choice, in the parent) gives it the command line's warnings."""
    if one_line_warnings:
        command_line_warnings()
    # torch asks Linux to send SIGINT to a worker whose parent dies, but
    # the workers ignore SIGINT (`new_processes_ignore_ctrl_c`), so we ask
    # for SIGTERM instead.
    import torch.multiprocessing as mp

    set_death_signal = getattr(mp, "_prctl_pr_set_pdeathsig", None)
    if set_death_signal is not None:
        set_death_signal(signal.SIGTERM)
    vocabs = [
        BpeVocab.from_str(v) if isinstance(v, str) else Vocab(v)
        for v in vocabs
    ]
    config = TrainConfig(**config)
    if device == "cuda":  # one GPU per process, by rank
        device = f"cuda:{rank}"
    train_worker(
        rank,
        world_size,
        *vocabs,
        *tokenizers,
        config,
        is_distributed=True,
        port=port,
        resume=resume,
        device=device,
    )


def worker_out_of_memory(err):
    """Whether a worker's error, which reaches us as its traceback's text,
    was memory running out (its last line: "Class: message")."""
    last = str(err).strip().splitlines()[-1]
    return last.startswith("MemoryError") or says_out_of_memory(last)


def user_error_of_worker(err):
    """A UserError with the message of a worker's error that would be a
    user's mistake in one process (a DatasetError, say), else None. The
    worker's traceback reaches us as text, ending "Class: message"."""
    last = str(err).strip().splitlines()[-1]
    name, _, message = last.partition(": ")
    user_errors = {cls.__name__ for cls in USER_ERRORS}
    if name.rsplit(".", 1)[-1] in user_errors and message:
        return UserError(f"a training process stopped: {message}")
    return None


# %% [markdown]
# The rest of this section is about Ctrl-C and stopping signals, so that
# a stopped run ends with one report and no stray processes; a first
# read can skip it.
#
# Ctrl-C reaches every process of the terminal's group, workers
# included. We want the parent alone to handle it: it stops the workers
# it started (`stop_processes` on `started_since`'s list; any other
# process the notebook or program started keeps running) and reports
# once, where each worker would die halfway with a traceback of its
# own.
#
# `new_processes_ignore_ctrl_c` does this with one rule of the operating
# system: a new process starts with SIGINT ignored if its parent ignored
# it at that moment. So the parent ignores SIGINT during each start (the
# system call in multiprocessing's `util.spawnv_passfds`, which it
# wraps). A Ctrl-C in that instant, or while the workers load torch (a
# few seconds), is kept by `stop_signals_kept`, as is SIGTERM, and raised
# once `mp.spawn` has started every worker, so that no worker is left
# reading half of what it was sent.
#
# A worker whose parent is killed outright (`kill -9`) gets SIGTERM from
# Linux, which `_spawned_worker` asks for (the SIGINT that torch asks for
# would be ignored).


# %%
#| export
def in_main_thread():
    """Whether this is the main thread, the only one that sets handlers."""
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def new_processes_ignore_ctrl_c():
    """Processes that multiprocessing starts inside ignore Ctrl-C for
    life: this one ignores it during each start (the system call, not
    the new process's loading), and the new process inherits that. A
    Ctrl-C in that instant is held back meanwhile and handled after (on
    Linux, when no other thread of this process takes it). Elsewhere
    than in the main thread of a POSIX system, no change."""
    from multiprocessing import util

    start = getattr(util, "spawnv_passfds", None)  # POSIX's spawn
    if start is None or not in_main_thread():
        yield
        return

    def start_ignoring(*args, **kwargs):
        if not in_main_thread():
            return start(*args, **kwargs)
        # Held back, a Ctrl-C waits for the handler, not for SIG_IGN.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return start(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    util.spawnv_passfds = start_ignoring
    try:
        yield
    finally:
        util.spawnv_passfds = start


@contextlib.contextmanager
def stop_signals_kept():
    """A Ctrl-C or SIGTERM inside is kept, and raised as
    KeyboardInterrupt on leaving. Outside the main thread, no change."""
    if not in_main_thread():
        yield
        return
    kept = []

    def keep(signum, frame):  # the handler: note the signal, go on
        kept.append(signum)

    stops = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, keep) for s in stops}
    try:
        yield
    finally:
        for s in stops:  # None: a handler set outside Python
            signal.signal(s, before[s] or signal.SIG_DFL)
    if kept:
        raise KeyboardInterrupt


def stop_processes(processes, wait=10.0):
    """Terminate the processes still running, then wait for them."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(wait)


# %% [markdown]
# `train_model` chooses between one process and several.


# %%
#| export
def train_model(
    vocab_src,
    vocab_tgt,
    spacy_de,
    spacy_en,
    config,
    distributed=False,
    world_size=None,
    resume=False,
    device=None,
):
    """Train in this process (on `device`), or in several if `distributed`."""
    if resume:  # the same run, or a one-line error (see check_resume)
        check_resume_and_say(config, vocab_src, vocab_tgt)
    args = (vocab_src, vocab_tgt, spacy_de, spacy_en, config)
    if distributed:
        return train_distributed_model(
            *args, world_size=world_size, resume=resume
        )
    # Rank 0 of a world of 1: this process alone.
    return train_worker(0, 1, *args, resume=resume, device=device)


# %% [markdown]
# Check: a port from `free_port` can be bound right away.

# %%
with socket.socket() as s:
    s.bind(("127.0.0.1", free_port()))

# %% [markdown]
# Check: the tiny `ci` preset, for one epoch, in two processes started by
# `train_distributed_model`, with the vocabularies and tokenizers made in
# "Vocabularies" above. On a machine with two GPUs or more each process
# gets one; elsewhere both run on the CPU with gloo (`cpu_fallback=True`),
# and the first line printed says which. Each process sees half of the
# batches. Both ranks must end with identical weights. A spawned process
# imports the module, not this notebook, so the cell calls the module's
# `train_distributed_model`.
#
# From a terminal, `torchrun --nproc_per_node=2
# annotated_transformer_tools.py train --preset ci --epochs 1` does the
# same on a machine with no GPU or with two or more. On a machine with one
# GPU it refuses, since the command line has no CPU fallback.

# %%
import annotated_transformer_tools as tools

with tempfile.TemporaryDirectory() as tmp:
    two_process_run = get_config("ci", epochs=1, checkpoint_dir=tmp)
    tools.train_distributed_model(
        *vocabs, *tokenizers, two_process_run, world_size=2, cpu_fallback=True
    )
    assert load_checkpoint(f"{tmp}/final.pt")["ranks_in_sync"]


# %% [markdown]
# ## Translating for users
#
# Everything a user calls (`translate_batch`, `translate` and the command
# line) decodes with Part 5's `cached_greedy_decode`, which gives the same
# outputs as Part 3's `batch_greedy_decode`, much faster, with a key/value
# cache; `--beam K` switches to beam search.
#
# The model writes spaCy tokens, while BLEU is computed by sacreBLEU on
# plain text against untouched references, so the tokens are joined back
# into a sentence. `detokenize` undoes what spaCy's English tokenizer
# splits off: punctuation, clitics such as `'s` and `n't`, and hyphens
# inside words. A vocabulary with its own `decode` (Part 5) needs none of
# this.


# %%
#| export
_NO_SPACE_BEFORE = set(
    ". , ! ? ; : ) ] } % 's 're 've 'll 'm 'd n't '".split()
)
_NO_SPACE_AFTER = ("(", "[", "{", "$", "#")
_NOT_WORDS = (",", ".", "-")  # "-" after these: the next word stays apart


def detokenize(tokens):
    """Join English spaCy tokens into a plain sentence.

    It 's a well - known dog .   ->  It's a well-known dog.
    He said " hi " .             ->  He said "hi".
    ( Two ) dogs do n't run .    ->  (Two) dogs don't run.
    """
    out, quote_open = "", False
    for i, tok in enumerate(tokens):
        # A hyphen is always joined to what comes before it. The word
        # after a hyphen is joined to it too ("well-known"), when a word
        # came before the hyphen: not a comma, a full stop or another
        # hyphen. The tokens cannot tell a spaced dash from a hyphen: "a
        # man - a tall one" comes out as "man-a" (checked below).
        after_hyphen = i > 1 and tokens[i - 1] == "-"
        hyphen_after_word = after_hyphen and tokens[i - 2] not in _NOT_WORDS
        no_space = (
            i == 0
            or tok.lower() in _NO_SPACE_BEFORE
            or out.endswith(_NO_SPACE_AFTER)
            or tok == "-"
            or hyphen_after_word
        )
        if tok == '"':
            no_space = i == 0 or quote_open
            quote_open = not quote_open
        elif out.endswith('"') and quote_open:
            no_space = True
        out += tok if no_space else " " + tok
    return out


def decode_text(ids, vocab):
    """Plain text of output ids, given without `<s>` and `</s>`
    (`strip_specials` removes them)."""
    if is_subword(vocab):  # it writes text itself
        return vocab.decode(ids)
    return detokenize(vocab.lookup_tokens(ids))


# %% [markdown]
# Check: the docstring's three examples, and the spaced dash that
# becomes a hyphen, which 6 of the 29,000 English training sentences of
# Multi30k hold.

# %%
detokenized = {
    "It 's a well - known dog .": "It's a well-known dog.",
    'He said " hi " .': 'He said "hi".',
    "( Two ) dogs do n't run .": "(Two) dogs don't run.",
    "a man - a tall one": "a man-a tall one",
}
for spaced, joined in detokenized.items():
    assert detokenize(spaced.split()) == joined, detokenize(spaced.split())
training_english = [en for _, en in read_multi30k("train")]
assert len(training_english) == 29_000
assert sum(" - " in en for en in training_english) == 6


# %% [markdown]
# `translate_batch` translates a list of sentences in three steps.
# `encode_sources` turns each sentence into ids, keeping its German
# words when unknown words are to be replaced (an `<unk>` id has lost
# its word). `decode_by_length` sorts the sentences by length, so that a
# batch wastes little on padding, and hands each batch to
# `decode_together`, which decodes it up to the source length +
# `MAX_EXTRA` (50) tokens, the paper's limit, and, where an output holds
# `<unk>`, finds the source position each output token attended to most
# (Part 4). `finish_text` puts the German word in place of each `<unk>`
# and joins the tokens into a sentence. `decode_fn` can be any decoder
# with the signature of the greedy ones; `replace_unk=False` leaves
# every `<unk>` as it is.


# %%
#| export
MAX_EXTRA = 50  # output tokens past the source's length: the paper's limit


def encode_sources(sentences, spacy_de, vocab_src, keep_words=False):
    """Each sentence as `<s> ids </s>`, and its German words if kept."""
    if not keep_words:
        encoded = [encode_text(s, spacy_de, vocab_src) for s in sentences]
        return [[BOS, *ids, EOS] for ids in encoded], None
    words = [tokenize(s, spacy_de) for s in sentences]
    return [[BOS, *vocab_src(w), EOS] for w in words], words


def decode_together(model, encoded, decode_fn, device, max_extra, align):
    """(output ids, alignment or None) of each encoded sentence (a list of
    ids), decoded together as one padded batch."""
    src, _ = collate_batch([(ids, []) for ids in encoded])
    src = src.to(device)  # (B, S)
    mask = (src != PAD).unsqueeze(-2)  # (B, 1, S)
    out = decode_fn(model, src, mask, src.size(1) + max_extra)  # (B, L)
    aligned = [None] * len(encoded)
    if align and (out == UNK).any():  # one more decoder pass
        aligned = source_alignment(model, src, mask, out).tolist()
    rows = zip(encoded, out.tolist(), aligned, strict=True)
    # Each stops at its own limit, whatever its batch-mates.
    return [
        (strip_specials(row[: len(ids) + max_extra]), at)
        for ids, row, at in rows
    ]


def decode_by_length(
    model,
    encoded,
    decode_fn,
    device,
    *,
    batch_size,
    max_extra,
    align,
    progress=False,
):
    """(output ids, alignment or None) per sentence, in input order;
    `progress`: a bar on stderr, once decoding takes over 3 s."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    results = [None] * len(encoded)
    starts = range(0, len(order), batch_size)
    with progress_bar(starts, "decoding", progress, unit="batch") as starts:
        for k in starts:
            idx = order[k : k + batch_size]
            batch = [encoded[i] for i in idx]
            decoded = decode_together(
                model, batch, decode_fn, device, max_extra, align
            )
            for i, result in zip(idx, decoded, strict=True):
                results[i] = result
    return results


def finish_text(ids, aligned, words, vocab_tgt):
    """Plain text of output ids, each `<unk>` replaced when aligned."""
    if aligned is None:
        return decode_text(ids, vocab_tgt)
    return detokenize(replace_unknowns(ids, aligned, words, vocab_tgt))


def translate_batch(
    model,
    sentences,
    spacy_de,
    vocab_src,
    vocab_tgt,
    device=None,
    batch_size=128,
    max_extra=MAX_EXTRA,
    decode_fn=cached_greedy_decode,
    replace_unk=True,
    progress=False,
):
    """German sentences (a list) to detokenized English, in input order."""
    if isinstance(sentences, str):  # would be read as one letter a line
        raise TypeError("give a list of sentences, not one string")
    decode_fn = decode_fn or cached_greedy_decode  # None also means greedy
    if device is None:  # wherever the model is
        device = next(model.parameters()).device
    model.eval()
    if is_subword(vocab_src) or is_subword(vocab_tgt):
        replace_unk = False  # BPE: no <unk> to replace
    encoded, words = encode_sources(
        sentences, spacy_de, vocab_src, keep_words=replace_unk
    )
    decoded = decode_by_length(
        model,
        encoded,
        decode_fn,
        device,
        batch_size=batch_size,
        max_extra=max_extra,
        align=replace_unk,
        progress=progress,
    )
    words = words or [None] * len(encoded)
    return [
        finish_text(ids, at, w, vocab_tgt)
        for (ids, at), w in zip(decoded, words, strict=True)
    ]


# %% [markdown]
# Translations are scored as plain text against plain references:
# `compute_bleu` is sacreBLEU's corpus BLEU, cased, with its standard 13a
# tokenization, the score that papers on Multi30k report.


# %%
#| export
def compute_bleu(hypotheses, references):
    """Cased corpus BLEU (sacreBLEU, 13a tokenization) of plain text."""
    import sacrebleu

    return sacrebleu.corpus_bleu(hypotheses, [references])


# %% [markdown]
# `load_translator` gathers the decoding options of the command line's
# `evaluate` and `translate`: a checkpoint, a beam size (1 means greedy,
# with the cache), a number of epoch checkpoints to average, and beam
# search's length penalty $\alpha$ (Part 5: the paper's 0.6 by default).
# On the validation split, 1.0 scored above 0.6 for a model trained alone
# (`results/recipe_long_val_alpha.md`), and 2.5 scored best for the best
# recipe's distilled model, trained on other models' translations
# (`results/recipe_cpu-d02-lin18-wd02-tie-kdmix-e12_val_alphas.md`).
# An $\alpha$ given with greedy decoding would be ignored, so it is
# refused, before the checkpoint is read. So is a device the machine
# lacks (`"cuda"` without CUDA, `"mps"` off a Mac): `checked_device`
# says so in one line, for the command line's `--device` too.


# %%
#| export
DEFAULT_ALPHA = 0.6  # beam search's length penalty: the paper's


def checked_device(name):
    """The torch device `name` if this machine has it ("auto" or None:
    pick_device's choice); a one-line ValueError if not."""
    if name is None or name == "auto":
        return pick_device()  # which checks a device AT_DEVICE names
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{name!r} is not a device; try cpu, cuda or cuda:1"
        ) from None
    why = why_missing(device)  # Part 3's plumbing, as for AT_DEVICE
    if why:
        raise ValueError(f"no {name} here: {why}")
    return device


def load_translator(
    checkpoint, device="cpu", beam=1, average_last=0, alpha=None
):
    """(model, vocab_src, vocab_tgt, decode_fn) for greedy or beam search;
    `alpha`, the length penalty, only with a beam of 2 or more
    (DEFAULT_ALPHA if None).
    """
    if alpha is not None and beam < 2:
        raise ValueError(
            f"alpha {alpha:g} is beam search's length penalty, and greedy"
            " decoding (beam 1) has none; use a beam of 2 or more"
        )
    if alpha is None:
        alpha = DEFAULT_ALPHA
    device = checked_device(device)
    if average_last:
        paths, history = own_epoch_files(checkpoint, average_last)
        model, vocab_src, vocab_tgt, _ = average_checkpoints(
            paths, device, history
        )
    else:
        model, vocab_src, vocab_tgt, _ = load_trained_model(checkpoint, device)
    decode_fn = cached_greedy_decode
    if beam > 1:
        decode_fn = functools.partial(beam_search, beam_size=beam, alpha=alpha)
    return model, vocab_src, vocab_tgt, decode_fn


# %% [markdown]
# `--average K` averages the checkpoint's own last K epochs: the epoch
# files next to it that end at its epoch. For a `final.pt` after 18
# epochs (numbered 0 to 17) and K = 5, those are `epoch_013.pt` to
# `epoch_017.pt`. The checkpoint is read for its epoch and its losses;
# the weights averaged are the epoch files'. A `final.pt` is not among
# them (its weights are the last epoch file's anyway); an epoch file named
# as the checkpoint is one of the K.
#
# Each file must be its run's file of the epoch its name says. A file of
# that run recorded the losses of every epoch up to its own, so its
# history is the start of the checkpoint's, and its recorded epoch is
# the one in its name. `check_run_file` (in "Checkpoint files", beside
# `average_checkpoints`, which calls it) checks both as each file is
# read. That refuses a copied or renamed file, and another run's: a
# `final.pt` copied from another folder, say, beside epoch files of a
# run of its own. (A second run with the same seed and settings may
# pass, if it reproduces the losses exactly; it is then in effect the
# same run.)


# %%
#| export
def own_epoch_files(checkpoint, count):
    """Returns (paths, history): the `count` epoch files of `checkpoint`'s
    run that end at its epoch, oldest first, and its history of losses."""
    ckpt = load_checkpoint(checkpoint)
    last = ckpt.get("epoch")
    history = ckpt.get("history")
    if type(last) is not int or last < 0 or not isinstance(history, list):
        raise ValueError(
            f"{checkpoint} does not record its epoch and losses as training"
            " does, so --average cannot tell which epoch files are its own"
        )
    if count > last + 1:
        raise ValueError(
            f"--average {count} needs {count} epochs; {checkpoint} was "
            f"trained for {plural(last + 1, 'epoch')}"
        )
    folder = Path(checkpoint).resolve().parent  # a link: its run's folder
    epochs = range(last - count + 1, last + 1)
    paths = [folder / f"epoch_{epoch:03d}.pt" for epoch in epochs]
    missing = [path.name for path in paths if not path.is_file()]
    if missing:
        raise ValueError(
            f"--average {count} needs these files next to {checkpoint},"
            f" which are not there: {', '.join(missing)} (training keeps"
            " only the newest --keep-last epoch files, and a run started"
            " afresh in the folder removes an earlier run's)"
        )
    return paths, history


# %% [markdown]
# `translate` is the shortest way to use a trained model. Without a
# checkpoint named, it uses the model that `default_checkpoint` finds:
# the `cpu` run that `make train` writes, if there is one, else the
# `quick` run of Part 3 (and of `make notebook`). It looks in the
# working directory, then in the repository that `data_dir` finds: the
# checkout above the working directory, else the one the library itself
# lives in, when that folder is a checkout (so `python
# ~/done-right/annotated_transformer_tools.py` works from any folder; a
# pip-installed copy is not looked in). With neither, the error names
# the quick one, the one to train first.


# %%
#| export
TRAINED_MODELS = ("checkpoints/cpu/final.pt", "checkpoints/quick/final.pt")


def default_checkpoint():
    """The longer-trained model that exists, else the `quick` one's path:
    looked for in the working directory, then in the repository."""
    repository = data_dir().parent  # as for the downloads
    for folder in (Path("."), repository):
        for path in TRAINED_MODELS:
            if (folder / path).is_file():
                return str(folder / path)
    return TRAINED_MODELS[-1]


def translate(
    sentences,
    checkpoint=None,
    beam=1,
    average=0,
    replace_unk=True,
    device="auto",
    alpha=None,
):
    """English translations of German sentences, with a trained model;
    `alpha`, beam search's length penalty, only with `beam` above 1.

    `sentences` is a list, translated into a list; one string gives one
    translation. It loads the model at each call: to translate often,
    load it once with `load_translator` and call `translate_batch`."""
    one = isinstance(sentences, str)
    if one:
        sentences = [sentences]
    checkpoint = checkpoint or default_checkpoint()
    model, vocab_src, vocab_tgt, decode_fn = load_translator(
        checkpoint, device, beam=beam, average_last=average, alpha=alpha
    )
    spacy_de, _ = load_tokenizers()
    translations = translate_batch(
        model,
        sentences,
        spacy_de,
        vocab_src,
        vocab_tgt,
        decode_fn=decode_fn,
        replace_unk=replace_unk,
    )
    return translations[0] if one else translations


# %% [markdown]
# `check_outputs` and `run_model_example` keep the original tutorial's
# names for printing a few validation translations.


# %%
#| export
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


def run_model_example(checkpoint=None, n_examples=5):
    """Load a trained model and show some validation translations."""
    checkpoint = checkpoint or default_checkpoint()
    model, vocab_src, vocab_tgt, _ = load_trained_model(checkpoint)
    spacy_de, _ = load_tokenizers()
    pairs = read_multi30k("val")
    return check_outputs(
        model, pairs, spacy_de, vocab_src, vocab_tgt, n_examples
    )


# %% [markdown]
# ## Reading text files
#
# `iter_lines` reads the text to translate or score one line at a time:
# a plain file, a gzipped one, or standard input for `-`. It drops a
# UTF-8 byte-order mark at the start, takes `\n`, `\r\n` and `\r` as
# line ends, and drops control characters other than tab, which the
# tokenizers would read as words. It decodes each line by itself, so a
# file that is not UTF-8 is refused with the number of its first bad
# line. Its errors are a `TextFileError`, which the command line prints
# as one line. `read_lines` reads a whole file.


# %%
#| export
class TextFileError(ValueError):
    """A text file that cannot be read line by line as UTF-8."""


def clean_line(text):
    """A line without control characters other than tab."""
    return "".join(
        c for c in text if c == "\t" or unicodedata.category(c) != "Cc"
    )


def _split_lines(f):
    """Byte lines of a binary file, ended by \n, \r\n or a lone \r."""
    for line in f:  # ends at \n; a lone \r ends a line, too
        pieces = line.rstrip(b"\n").split(b"\r")
        if len(pieces) > 1 and pieces[-1] == b"":  # \r\n: one line end
            pieces.pop()
        yield from pieces


def shown_path(path):
    """How messages name a text file: "-" is standard input."""
    return "standard input" if str(path) == "-" else Path(path)


def iter_lines(path):
    """Lines of a UTF-8 text file (plain, .gz, or "-": stdin), lazily."""
    import gzip

    stdin = str(path) == "-"
    name = shown_path(path)
    number = 0  # lines read so far, for the error messages
    gzipped = False  # compressed data in a file not named .gz
    try:
        if stdin and sys.stdin is None:  # started with `<&-`
            raise TextFileError("standard input is closed")
        if stdin:
            opened = contextlib.nullcontext(sys.stdin.buffer)
        elif name.is_dir():
            raise TextFileError(f"{name} is a folder, not a file")
        elif name.suffix == ".gz":
            opened = gzip.open(name, "rb")
        else:
            opened = open(name, "rb")
        with opened as f:
            for line in _split_lines(f):
                number += 1
                if number == 1:
                    line = line.removeprefix(b"\xef\xbb\xbf")  # the BOM
                    gzipped = line.startswith(b"\x1f\x8b")  # gzip's magic
                yield clean_line(line.decode("utf-8"))
    except FileNotFoundError:
        raise TextFileError(f"no such file: {name}") from None
    except UnicodeDecodeError:
        hint = ""
        if gzipped and (stdin or not name.is_file()):  # a pipe: no name
            hint = ", but gzip-compressed: decompress it first (zcat)"
        elif gzipped:
            hint = ", but gzip-compressed: name it *.gz"
        raise TextFileError(
            f"{name} is not UTF-8 text (line {number}){hint}"
        ) from None
    except (OSError, EOFError) as err:  # not gzip, truncated, unreadable
        reason = getattr(err, "strerror", None) or err  # no "[Errno 13]"
        raise TextFileError(f"cannot read {name}: {reason}") from None


def read_lines(path):
    """Lines of a plain or gzipped UTF-8 text file, without newlines."""
    return list(iter_lines(path))


# %% [markdown]
# `read_parallel` reads a pair of line-by-line translations and refuses
# files of different lengths, or empty ones, with a message, not a
# traceback.


# %%
#| export
def read_parallel(src_path, ref_path):
    """(sources, references): two files of line-by-line translations."""
    sources, references = read_lines(src_path), read_lines(ref_path)
    src_name, ref_name = shown_path(src_path), shown_path(ref_path)
    if len(sources) != len(references):
        raise TextFileError(
            f"{src_name} has {len(sources)} lines but {ref_name} has "
            f"{len(references)}; they must be line-by-line translations"
        )
    if not sources:
        raise TextFileError(f"{src_name} is empty")
    return sources, references


# %% [markdown]
# ## The command line
#
# The exported module doubles as a program with four sub-commands. After
# `pip install ".[cli]"` the same program is also on the path as
# `annotated-transformer`.
#
# ```
# python annotated_transformer_tools.py download
# python annotated_transformer_tools.py train --preset cpu --epochs 18
# torchrun --nproc_per_node=2 annotated_transformer_tools.py train
# python annotated_transformer_tools.py evaluate --beam 4 --average 5
# python annotated_transformer_tools.py translate "Ein Hund." "Zwei Katzen."
# python annotated_transformer_tools.py translate < sentences.de > out.en
# ```
#
# Each mistake gets one line that says what is wrong, never a traceback:
# the sub-commands raise exceptions, and `main`, at the end of this
# section, turns them into those lines and the program's exit status.
#
# ### Arguments
#
# Mistakes in the arguments are argparse's to catch. Its `type` functions
# refuse a count outside its range (every count has a sensible maximum,
# so that a number of twenty digits is refused rather than reaching the
# code) and a device this machine does not have, and `OneLineParser`
# shortens argparse's own complaint (the usage, then the error) to a
# single line. `UserError` is the command line's own exception; `say`
# prints results on standard output, and `path_text` keeps a file name
# as the user typed it.


# %%
#| export
class UserError(Exception):
    """A problem with the user's input, reported without a traceback."""


def say(*lines):
    """Print lines to stdout now; an error there names standard output."""
    try:
        print(*lines, sep="\n", flush=True)
    except OSError as err:  # a full disk, a broken pipe, ...
        raise OSError(err.errno, err.strerror, "standard output") from err


def whole_number(text, least=1, most=10**6):
    """A whole number from `least` (1) to `most`, or argparse's error.

    Plain digits 0 to 9 only: Python's int() would also take " 3",
    "1_000" and other scripts' digits, which are more likely typos.
    """
    plain = re.fullmatch(r"[0-9]+", text) is not None
    number = int(text) if plain else None
    if number is None or not least <= number <= most:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from {least} to {most:,d},"
            f" not {text or 'nothing'}"
        )
    return number


def path_text(text):
    """The argparse `type` of a path: any text but the empty one, which
    would otherwise mean the working directory."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, not nothing")
    return text


def count(least=1, most=10**6):
    """The argparse `type` for a count: whole_number with these bounds."""
    check = functools.partial(whole_number, least=least, most=most)
    check.__name__ = "count"  # argparse names the type in its messages
    return check


def number_from(least, most):
    """The argparse `type` for a real number from `least` to `most`."""

    def check(text):
        # Plain decimals (1e-4 too) only: float() would also take " 0.5",
        # "1_0" (10) and other scripts' digits, more likely typos.
        decimal = r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"
        plain = re.fullmatch(decimal, text)
        number = float(text) if plain else None
        if number is None or not least <= number <= most:
            raise argparse.ArgumentTypeError(
                f"expected a number from {least} to {most},"
                f" not {text or 'nothing'}"
            )
        return number

    check.__name__ = "number"  # argparse names the type in its messages
    return check


def existing_device(name):
    """argparse type: a torch device that this machine has, or "auto"."""
    try:
        return str(checked_device(name))
    except ValueError as err:
        # argparse passes a default given as text through `type` too, so
        # "auto" arrives here without --device; its failure is AT_DEVICE's
        # (pick_device reads it), not the option's. argparse lets a
        # UserError through, and main says it in one line.
        if name == "auto":
            raise UserError(str(err)) from None
        raise argparse.ArgumentTypeError(str(err)) from None


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors take one line of stderr, and which
    takes options only as written in full (`--be 2` is not `--beam 2`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        """Print `prog: error: message` on one line; exit with status 2."""
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# %% [markdown]
# ### The sub-commands and their options
#
# Each sub-command has its own parser, built by one function:
# `add_train_parser`, `add_evaluate_parser` and `add_translate_parser`
# (the last two share `add_decoding_options`). `train --help` ends with
# what each preset sets (`presets_epilog`), printed as written
# (`EpilogAsWritten`), since the options that say "default: the
# preset's" take their defaults from there.


# %%
#| export
def presets_epilog():
    """`train --help`'s last lines: what each preset sets, which is what
    the options that say "default: the preset's" default to."""
    lines = ["what each preset sets (layers x d_model, then the options):"]
    for name in sorted(PRESETS):
        c = PRESETS[name]
        tied = "yes" if c.tie_embeddings else "no"
        lines.append(
            f"  {name:8s} {c.N}x{c.d_model:<4d} epochs={c.epochs}"
            f" max-tokens={c.max_tokens} dropout={c.dropout:g}"
            f" schedule={c.schedule} tied={tied}"
        )
    return "\n".join(lines)


class EpilogAsWritten(argparse.HelpFormatter):
    """argparse's help, but text with line breaks (the epilog) keeps
    them; the rest is wrapped as usual."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(True))
        return super()._fill_text(text, width, indent)


def add_train_parser(sub):
    """`train`: its options."""
    train = sub.add_parser(
        "train",
        help="train a model on Multi30k",
        description="Train a model on Multi30k German→English, saving each"
        " epoch into --checkpoint-dir. Multi30k is read from data/multi30k/"
        f" (downloaded on first use) or from the folder ${MULTI30K_ENV}"
        " names.",
        epilog=presets_epilog(),
        formatter_class=EpilogAsWritten,
    )
    train.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="quick",
        help="quick (default; 14 minutes on a 2-core CPU, as recorded in"
        " results/recipe_quick.json); cpu: the same model for 18 epochs,"
        " over an hour; long, the -bpe twins, paper and ci: see the"
        " appendix's presets",
    )
    train.add_argument(
        "--epochs",
        type=count(most=10_000),
        help="epochs to train (default: the preset's)",
    )
    train.add_argument(
        "--max-tokens",
        type=count(most=10**7),
        help="tokens in a batch (default: the preset's)",
    )
    train.add_argument(
        "--dropout",
        type=number_from(0.0, 0.9),
        help="dropout rate (default: the preset's)",
    )
    train.add_argument(
        "--weight-decay",
        type=number_from(0.0, 1.0),
        help="AdamW's weight decay (default 0: Adam)",
    )
    train.add_argument(
        "--rdrop",
        type=number_from(0.0, 20.0),
        metavar="ALPHA",
        help="R-Drop's weight: each batch runs twice and the two"
        " predictions must agree; a step costs about twice as much"
        " (default 0: off)",
    )
    train.add_argument(
        "--tie-embeddings",
        action="store_true",
        default=None,
        help="the generator reuses the target embedding (word vocabularies;"
        " with BPE both embeddings share it too, as the -bpe presets do;"
        " default: off, but on in the -bpe presets)",
    )
    train.add_argument(
        "--seed",
        type=count(least=0, most=2**31 - 1),
        help="the random seed of the weights, dropout and batch order"
        " (default: the preset's, 0)",
    )
    train.add_argument(
        "--schedule",
        choices=["noam", "linear"],
        help="the learning rate after the warm-up: noam, the paper's"
        " (falls as 1/sqrt(step)), or linear (to zero at the last step);"
        " default: the preset's",
    )
    train.add_argument(
        "--precision",
        choices=["auto", "fp32"],
        help="auto: the fastest 16-bit arithmetic this machine computes"
        " natively (bfloat16, float16 on a T4, none on others); fp32: none,"
        " say if training gives nan (default: fp32 if AT_PRECISION=fp32 is"
        " in the environment, else the preset's: auto, fp32 for ci)",
    )
    train.add_argument(
        "--device",
        type=existing_device,
        help="the device of a one-process run: auto (default: AT_DEVICE"
        " if set, else CUDA, else mps, else cpu), cpu, cuda:1, mps",
    )
    train.add_argument(
        "--checkpoint-dir",
        type=path_text,
        help="where checkpoints go (default: checkpoints/PRESET)",
    )
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
        help="processes to spawn (default 1; torchrun sets its own)",
    )
    train.add_argument(
        "--results",
        type=path_text,
        help="write a JSON summary here, including test BLEU",
    )
    train.add_argument(
        "--data",
        type=path_text,
        metavar="FOLDER",
        help="train on this folder's train.de.gz and train.en.gz instead"
        " (e.g. bench/distill.py's); its validation and test files must be"
        " Multi30k's own, and the vocabularies stay those of Multi30k"
        " (default: Multi30k's training pairs)",
    )
    train.add_argument(
        "--threads",
        type=count(most=4096),
        help="CPU threads of a one-process run (default: torch's, one per"
        " core; several processes on the CPU split its cores evenly)",
    )


# %% [markdown]
# `evaluate` and `translate` decode alike: the same checkpoint, beam,
# length penalty, averaging, device, batch size and `<unk>` options.


# %%
#| export
def add_decoding_options(parser):
    """Options shared by `evaluate` and `translate`."""
    parser.add_argument(
        "--checkpoint",
        type=path_text,
        help="default: checkpoints/cpu/final.pt if it exists, else"
        " checkpoints/quick/final.pt, in the working directory or else in"
        " the repository",
    )
    parser.add_argument(
        "--batch-size",
        type=count(most=100_000),
        default=128,
        help="sentences decoded together (default 128)",
    )
    parser.add_argument(
        "--device",
        type=existing_device,
        default="auto",
        help="auto (default: AT_DEVICE if set, else CUDA, else mps, else"
        " cpu), cpu, cuda:0, mps",
    )
    parser.add_argument(
        "--beam",
        type=count(most=1000),
        default=1,
        metavar="K",
        help="beam size (default 1: greedy)",
    )
    parser.add_argument(
        "--alpha",
        type=number_from(0.0, 10.0),
        help="beam search's length penalty, with --beam 2 or more (default"
        f" {DEFAULT_ALPHA}, the paper's; on validation, 1.0 did better for a"
        " model trained alone, 2.5 for the best recipe's distilled model:"
        " see docs/results.md)",
    )
    parser.add_argument(
        "--average",
        type=count(most=10_000),
        metavar="K",
        help="average the checkpoint's last K epochs: the epoch files of"
        " its run next to it, ending at its epoch (default: no averaging)",
    )
    parser.add_argument(
        "--no-replace-unk",
        dest="replace_unk",
        action="store_false",
        help="keep <unk> in the output (default: copy the attended source "
        "word; word vocabularies only)",
    )


# %% [markdown]
# Then the two decoding sub-commands, and `build_parser`, which puts the
# four together and answers `--version` (`version_line`: this package's
# version and torch's).


# %%
#| export
def add_evaluate_parser(sub):
    """`evaluate`: its options."""
    evaluate = sub.add_parser(
        "evaluate",
        help="BLEU on Multi30k test2016 (or a pair of files)",
        description="Translate Multi30k's test2016 (or --src) with a trained"
        " model and print sacreBLEU's score against its references (or"
        " --ref).",
    )
    add_decoding_options(evaluate)
    evaluate.add_argument(
        "--src",
        type=path_text,
        help="German sources, one per line (.gz is fine; -: standard"
        " input; default: Multi30k test2016)",
    )
    evaluate.add_argument(
        "--ref",
        type=path_text,
        help="English references, one per line (.gz is fine; -: standard"
        " input; needed with --src; default: Multi30k test2016's)",
    )
    evaluate.add_argument(
        "--out", type=path_text, help="also write the translations here"
    )


def add_translate_parser(sub):
    """`translate`: its options."""
    translate = sub.add_parser(
        "translate",
        help="translate German text",
        description="Translate German sentences into English with a"
        " trained model: from the arguments, or line by line from --input"
        " or standard input, one English line each.",
    )
    add_decoding_options(translate)
    translate.add_argument(
        "sentence",
        nargs="*",
        help="German sentences, one per argument (none, or -: read "
        "standard input, one sentence per line)",
    )
    translate.add_argument(
        "--input",
        type=path_text,
        metavar="FILE",
        help="translate FILE line by line (.gz is fine; -: standard input)",
    )


def package_version():
    """The installed package's version, else its checkout's pyproject's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("the-annotated-transformer")
    except PackageNotFoundError:  # a checkout, run without installing it
        pass
    pyproject = Path(MODULE_DIR or ".", "pyproject.toml")
    text = pyproject.read_text() if pyproject.is_file() else ""
    found = re.search(r'^version = "([^"]+)"', text, re.MULTILINE)
    return found.group(1) if found else "(version unknown)"


def version_line():
    """What --version prints: this package's version and torch's."""
    return f"%(prog)s {package_version()}, torch {torch.__version__}"


def build_parser():
    """The argparse parser of the command line."""
    prog = os.path.basename(sys.argv[0] or "")
    # The installed console script keeps its name; run as a file (by
    # python or torchrun), the program is named after the module's file.
    if prog != "annotated-transformer":
        prog = "annotated_transformer_tools.py"
    parser = OneLineParser(
        prog=prog,
        description="Train, evaluate and use the Annotated Transformer on "
        "Multi30k German→English.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "download",
        help="download and verify Multi30k",
        description="Download Multi30k's six files into data/multi30k/,"
        f" or check those in the folder that ${MULTI30K_ENV} names, and"
        " print the folder. Train and evaluate do this themselves.",
    )
    add_train_parser(sub)
    add_evaluate_parser(sub)
    add_translate_parser(sub)
    parser.commands = sub.choices  # name -> the sub-command's parser
    return parser


# %% [markdown]
# ### `download`
#
# `download` (`command_download`) fetches and checks Multi30k as
# "Downloading Multi30k" does, and prints the folder that holds it.


# %%
#| export
def command_download(args):
    """`download`: fetch and verify Multi30k, print where it is."""
    say(download_multi30k())
    return 0


# %% [markdown]
# ### `train`
#
# `train` (`command_train`) runs these steps, in this order:
#
# 1. `config_from_args`: the preset's config with the fields that the
#    flags set;
# 2. `refuse_one_process_options` refuses `--device` and `--threads`
#    with several processes (spawned, or started by `torchrun`), and
#    `warn_slow_settings` warns of settings that only waste time; the
#    device that `AT_DEVICE` names must be here; with `--world-size`,
#    `process_device` checks now that there are GPUs enough, rather
#    than NCCL later;
# 3. `check_checkpoint_folder` and `check_results_option`: the folder
#    and the file it will write can be written (a bad path is refused
#    now, not after hours of training);
# 4. `download_multi30k`, if needed; with `--data`, `checked_data_folder`
#    (below); then `check_results_file`: `--results` must not be a file
#    that training reads either (which files it reads is known only
#    after the download);
# 5. `folder_lock` takes the lock on the checkpoint folder, so that a
#    second run into it stops at once;
# 6. `train_locked` makes the vocabularies, checks what `--resume` would
#    resume, and trains: in this process, in `--world-size` spawned
#    ones, or as one of the processes that `torchrun` started.
#
# Before all that, on Linux, `keep_freed_memory` asks the C library's
# `malloc` to keep the memory that a batch's tensors give back, for the
# next batch's. By default glibc returns large blocks to the system,
# and the next batch takes them back a 4 KiB page at a time, with a
# page fault for each: in one epoch of `--preset cpu` at 1 thread,
# about a million faults, against 600,000 with it
# (`bench/RESULTS_efficiency.md`). PyTorch's CPU performance
# guide suggests another allocator (jemalloc, tcmalloc) for the same
# reason; these two settings of glibc's own need no install. It
# changes only this process, which exists to train. Lesson 03 asks for
# it too, in the cell that trains the reference run: the notebook's
# process is there to run the lesson. Blocks larger than 32 MiB are
# still mapped afresh, which is why `GeneratorLoss`'s blocks stop at
# $2^{24}$ bf16 logits.
#
# Then `keep_built_kernels` lets oneDNN, the library behind PyTorch's
# bf16 matrix products on the CPU, keep more of the kernels it builds.
# oneDNN builds ("creates") a kernel for each new shape of a product
# and keeps the last 1,024 it built. A batch's token count changes from
# batch to batch, so one epoch of `--preset cpu` built about 1,500 of
# them, and the next epoch, with only 1,024 kept, built 931 again (2.6 s
# of an epoch of about 65 s at 2 threads, by oneDNN's own count). With
# 8,192 kept it built 205, the shapes it had not met before (0.4 s).
# Peak memory did not grow: 2.77 GB by default and 2.70 GB with 8,192
# kept, over three epochs (`bench/RESULTS_efficiency.md`). The function
# sets `ONEDNN_PRIMITIVE_CACHE_CAPACITY`, which oneDNN reads when it
# builds its first kernel, so it must run before any bf16 product; a
# value already in the environment wins. Processes that `--world-size`
# spawns inherit it.


# %%
#| export
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt options


def keep_freed_memory(libc=None, system=None):
    """On Linux with glibc: keep freed memory in the process for reuse,
    up to 1 GiB, and serve blocks of up to 32 MiB (glibc's largest
    setting) from it, rather than mapping each anew. True if both were
    set; False elsewhere (another system, or a C library without
    mallopt, such as musl), where nothing changes."""
    if (system or platform.system()) != "Linux":
        return False
    try:
        mallopt = (libc or ctypes.CDLL("libc.so.6")).mallopt
    except (OSError, AttributeError):
        return False
    mapped = mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
    return bool(mapped) and bool(mallopt(M_TRIM_THRESHOLD, 2**30))


ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"  # kernels oneDNN keeps


def keep_built_kernels(capacity=8192, environ=None):
    """Ask oneDNN to keep `capacity` built kernels (its default: 1,024),
    unless the environment already names a number; return the number in
    effect, as text. Must run before the process's first bf16 product."""
    environ = os.environ if environ is None else environ
    return environ.setdefault(ONEDNN_CACHE, str(capacity))


# %%
#| export
def command_train(args):
    """`train`: run training, then optionally score and summarize."""
    started = time.time()
    keep_freed_memory()  # fewer page faults in every batch (above)
    keep_built_kernels()  # fewer kernel builds after the first epoch
    config = config_from_args(args)
    ranks = torchrun_ranks()
    refuse_one_process_options(args, ranks)
    warn_slow_settings(args, config)
    if args.device is None:
        try:  # a device that AT_DEVICE names must be here
            pick_device()
        except ValueError as err:
            raise UserError(str(err)) from None
    if args.world_size > 1 and ranks is None:  # fail now, not in NCCL
        try:
            process_device(0, args.world_size)
        except ValueError as err:
            message = f"--world-size {args.world_size}: {err}"
            raise UserError(message) from None
    folder = Path(config.checkpoint_dir)
    check_checkpoint_folder(folder)
    if args.results:  # fail now, not after hours of training
        check_results_option(args.results, folder)
    download_multi30k()  # before the lock makes the checkpoint folder
    data_folder = None  # Multi30k's own pairs
    if args.data:
        data_folder, config = checked_data_folder(args.data, config)
    if args.results:
        check_results_file(args.results, data_folder)
    rank = ranks.rank if ranks else 0
    if rank == 0:  # one process locks the folder for all
        lock = folder_lock(config.checkpoint_dir)
    else:
        lock = contextlib.nullcontext()
    try:
        with lock, multi30k_from(data_folder):
            return train_locked(args, config, ranks)
    except KeyboardInterrupt:
        if rank != 0:  # rank 0 reports for all
            raise
        message = interrupted_message(
            config.checkpoint_dir, started, resumed=args.resume
        )
        print(message, file=sys.stderr)
        return EXIT_INTERRUPTED


def config_from_args(args):
    """The preset's TrainConfig with the fields `train`'s options set."""
    options = {
        "epochs": args.epochs,
        "max_tokens": args.max_tokens,
        "dropout": args.dropout,
        "weight_decay": args.weight_decay,
        "rdrop": args.rdrop,
        "tie_embeddings": args.tie_embeddings,
        "seed": args.seed,
        "schedule": args.schedule,
        "precision": args.precision,
        "checkpoint_dir": args.checkpoint_dir,
        "keep_last": args.keep_last,
    }
    given = {field: v for field, v in options.items() if v is not None}
    try:
        config = get_config(args.preset, **given)
    except ValueError as err:  # AT_PRECISION's value
        raise UserError(str(err)) from None
    if config.max_tokens < config.max_len:  # a batch must hold a sentence
        raise UserError(
            f"--max-tokens {config.max_tokens} is below the longest"
            f" sentence a batch must hold, {config.max_len} tokens"
        )
    return config


def refuse_one_process_options(args, ranks):
    """--device and --threads are for one process; refuse them with
    several (--world-size, or torchrun's `ranks`)."""
    several = args.world_size > 1 or (ranks and ranks.world > 1)
    if args.device and several:
        raise UserError(
            "--device chooses the device of a one-process run; with several"
            " processes each takes a GPU of its own, or the CPU"
        )
    if args.threads and several:
        raise UserError(
            "--threads sets the threads of a one-process run; several"
            " processes on the CPU share its cores evenly"
        )


def warn_slow_settings(args, config):
    """Warn, on stderr, of settings that run but waste time."""
    cores = usable_cores()
    if args.threads and args.threads > cores:
        print(
            f"warning: --threads {args.threads} on {cores} CPU cores: the"
            " threads take turns on them, which is slower than fewer threads",
            file=sys.stderr,
        )
    if config.rdrop and not config.dropout:
        print(
            f"warning: --rdrop {config.rdrop:g} with dropout 0: the two"
            " passes are the same, so R-Drop only doubles each step's cost"
            " (give --dropout too)",
            file=sys.stderr,
        )
    if args.world_size > cores and not cuda_count():
        print(
            f"warning: --world-size {args.world_size} on {cores} CPU"
            " cores: the processes take turns on them, which is slower than"
            " fewer processes",
            file=sys.stderr,
        )


# %% [markdown]
# The files a run writes: `check_checkpoint_folder` refuses a folder
# that training could not write into, and `check_results_option` a
# `--results` file that it could not write or that training writes
# itself. `training_writes` says whether a path is one that training
# writes into its folder; `check_results_file` keeps `--results` from
# replacing a file that training reads, or a checkpoint
# (`refuse_a_checkpoint`, which other commands' output files use too).
# After Ctrl-C, `interrupted_message` says which file holds what was
# saved.


# %%
#| export
def check_checkpoint_folder(folder):
    """Refuse a --checkpoint-dir that training could not write into: a
    file, a file on its path, or a folder named as a file it writes
    (which would fail that write, hours on)."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--checkpoint-dir {folder} is a file, not a folder")
    blocker = file_in_the_way(folder)
    if blocker:
        raise UserError(
            f"--checkpoint-dir {folder}: {blocker} is a file, not a folder"
        )
    if not folder.is_dir():
        return
    in_the_way = [
        entry.name
        for entry in folder.iterdir()
        if entry.is_dir() and training_writes(entry, folder)
    ]
    if in_the_way:
        raise UserError(
            f"--checkpoint-dir {folder}: {min(in_the_way)} is a folder, and"
            " training writes a file of that name; move it away"
        )


def check_results_option(results, folder):
    """Refuse a --results file that training writes itself, or that could
    not be written."""
    if results == "-":  # standard output holds the progress
        raise UserError("--results - : name a file")
    if training_writes(results, folder):
        raise UserError(
            f"--results {results} is a file that training writes"
            f" into {folder}; name another file"
        )
    if in_folder(results, folder) and not folder.exists():
        return  # the lock makes the folder, before training
    check_out(results, option="--results")


def in_folder(path, folder):
    """Is `path` in the folder `folder`?"""
    return Path(path).absolute().parent.resolve() == Path(folder).resolve()


def training_writes(path, folder):
    """Is `path` a file that training into `folder` writes?"""
    if not in_folder(path, folder):
        return False
    names = ("final.pt", "last.pt", ".lock")
    name = Path(path).name
    return name in names or bool(EPOCH_FILE.fullmatch(name))


def check_results_file(path, data=None):
    """Refuse a --results file that is one of the files training reads
    (Multi30k's, --data's, the vocabulary caches) or a checkpoint that
    exists (`training_writes` refuses those this run will write)."""
    folders = [Path(multi30k_folder())]
    if data:
        folders.append(Path(data))
    reads = [p for f in folders if f.is_dir() for p in f.iterdir()]
    caches = [data_dir() / "vocab.json", data_dir() / "bpe.json"]
    check_not_input(path, *reads, *caches, option="--results")
    refuse_a_checkpoint(path, "--results")


def refuse_a_checkpoint(path, option):
    """Refuse an output file that is a checkpoint, of any run, or the
    lock that keeps a second run out of a checkpoint folder."""
    if Path(path).name == ".lock":
        raise UserError(
            f"{option} {path} is named as a checkpoint folder's lock, which"
            " it would replace; name another file"
        )
    if Path(path).suffix == ".pt" and Path(path).exists():
        raise UserError(
            f"{option} {path} is a checkpoint, which it would overwrite;"
            " name another file"
        )


def interrupted_message(folder, started=0.0, resumed=False):
    """What Ctrl-C in `train` leaves in `folder`, in one line. Unless the
    run resumed, files older than `started` (its start, in seconds) are
    an earlier run's."""
    last = Path(folder, "last.pt")
    final = Path(folder, "final.pt")
    newest = max(
        (p for p in (last, final) if p.is_file()),
        key=lambda p: p.stat().st_mtime,
        default=None,
    )
    earlier = newest is not None and newest.stat().st_mtime < started
    if earlier and not resumed:
        return (
            "interrupted before this run saved an epoch; the files in"
            f" {folder} are as they were"
        )
    if newest == final:  # training had ended (while --results scored)
        return f"interrupted; {final} holds the trained model"
    if newest == last:  # this run's last epoch
        return (
            f"interrupted; {last} holds the last epoch saved: train with"
            " --resume to go on from it"
        )
    return "interrupted"


# %% [markdown]
# With `--data FOLDER`, for instance a folder that `bench/distill.py`
# wrote, training reads its pairs from that folder instead.
# `checked_data_folder` first checks that the folder's validation and
# test files are Multi30k's own, so the run is still judged on the human
# references, and that its training files are well formed (gzip, UTF-8,
# the same number of lines in both, at least one pair with text on both
# sides), so that a bad file is refused in one line before the
# checkpoint folder is made. It caches the vocabularies of the original
# training split, so that a student (Part 5: a model trained on a
# teacher model's translations) keeps its teachers' vocabularies. It
# records the SHA-256 of the folder's training pairs in the config, so
# that `--resume` on other pairs is refused. `multi30k_from` then points
# `MULTI30K_DIR` at the folder for the length of the run only.


# %%
#| export
def checked_data_folder(folder, config):
    """Check `--data`'s folder and return (the folder, absolute; `config`
    with `data` set to its pairs_digest). Checks: its validation and test
    files are Multi30k's, its training files are well formed; then the
    vocabularies of the original training split are cached (a student
    keeps them). The digest in the checkpoints refuses a --resume on other
    pairs."""
    folder = Path(folder).absolute()
    if not folder.is_dir():
        what = "a file, not a folder" if folder.exists() else "no such folder"
        raise UserError(f"--data {folder}: {what}")
    held_out = {
        name: digest
        for name, digest in MULTI30K_SHA256.items()
        if not name.startswith("train.")
    }
    problems = _folder_problems(folder, held_out)
    for name in ("train.de.gz", "train.en.gz"):
        why = _why_not_a_file(folder / name)
        if why:
            problems.append(f"{name} {why}")
    if problems:
        raise UserError(f"--data {folder}: " + "; ".join(problems))
    try:  # readable, UTF-8, as many lines on each side, not empty
        sources, targets = read_parallel(
            folder / "train.de.gz", folder / "train.en.gz"
        )
    except TextFileError as err:
        raise UserError(f"--data {folder}: {err}") from None
    pairs = zip(sources, targets)
    if not any(de.strip() and en.strip() for de, en in pairs):
        raise UserError(
            f"--data {folder}: no training pair has text on both sides"
        )
    load_vocabularies(config, *load_tokenizers())  # from the original
    return folder, replace(config, data=pairs_digest(folder))


def short_digest(digest):
    """A pairs_digest cut to its first 12 hex digits, for messages."""
    return digest[: len("sha256:") + 12]


def pairs_digest(folder):
    """One SHA-256 of the SHA-256s of a folder's two training files (their
    .gz bytes): what `--data` trains on, the same wherever the folder is
    moved."""
    files = [sha256_of(Path(folder, f"train.{x}.gz")) for x in ("de", "en")]
    return "sha256:" + hashlib.sha256(" ".join(files).encode()).hexdigest()


@contextlib.contextmanager
def multi30k_from(folder):
    """Read Multi30k from `folder` (None: as before) within the block;
    processes spawned meanwhile inherit it."""
    old = os.environ.get(MULTI30K_ENV)
    if folder is not None:
        os.environ[MULTI30K_ENV] = str(folder)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(MULTI30K_ENV, None)
        else:
            os.environ[MULTI30K_ENV] = old


# %% [markdown]
# Under `torchrun`, each process learns where it stands from the
# environment: `torchrun_ranks` reads the `RANK`, `WORLD_SIZE` and
# `LOCAL_RANK` that torchrun sets, and rank 0 takes the lock for all of
# them. `torchrun_device` gives each its device: its own GPU, else the
# CPU, even on Macs started one per machine (gloo, the backend without
# GPUs, cannot send Apple's MPS tensors). A single process that torchrun
# started takes the device `--device` names, if it names one.
# `train_locked` is the rest of `train`, once the folder is locked, in
# every process.


# %%
#| export
class TorchrunRanks(NamedTuple):
    """Where a process that torchrun started stands among the others."""

    rank: int  # among all processes
    world: int  # how many processes, on every machine
    local_rank: int  # among this machine's processes
    local_world: int  # how many on this machine


def torchrun_ranks():
    """This process's TorchrunRanks, or None if torchrun did not start it."""
    if "LOCAL_RANK" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return TorchrunRanks(
        rank=int(os.environ["RANK"]),
        world=world,
        local_rank=int(os.environ["LOCAL_RANK"]),
        local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
    )


def torchrun_device(world, local_rank, local_world):
    """The device of a process that torchrun started: its own GPU, or,
    with several processes, the CPU (even one per Mac: gloo cannot send
    MPS tensors)."""
    device = process_device(local_rank, local_world)
    if world > 1 and device.type == "mps":
        return torch.device("cpu")
    return device


def train_locked(args, config, ranks=None):
    """`train`, with the folder locked by rank 0; `ranks` from torchrun."""
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizers = load_tokenizers()
    vocabs = load_vocabularies(config, *tokenizers)
    data = (*vocabs, *tokenizers, config)
    start = time.time()
    if ranks:  # started by torchrun
        rank, world, local_rank, local_world = ranks
        if args.resume and rank == 0:  # the notes once, not once a rank
            check_resume_and_say(config, *vocabs)
        elif args.resume:  # train_model checks this in the other branch
            check_resume(config, *vocabs)  # raises if it cannot resume
        try:  # --device only with one process (refuse_one_process_options)
            device = args.device or torchrun_device(
                world, local_rank, local_world
            )
        except ValueError as err:
            raise UserError(f"torchrun: {err}") from None
        train_worker(
            rank,
            world,
            *data,
            is_distributed=world > 1,
            resume=args.resume,
            device=device,
        )
        if rank != 0:
            return 0
    else:
        train_model(
            *data,
            distributed=args.world_size > 1,
            world_size=args.world_size,
            resume=args.resume,
            device=args.device,
        )
    final = Path(config.checkpoint_dir) / "final.pt"
    if final.is_file() and final.stat().st_mtime < start:  # resumed done
        say(f"nothing trained; model in {final}")
    else:
        say(f"trained in {time.time() - start:.0f} s; model in {final}")
    if args.results:
        write_results(args.results, final, time.time() - start)
    return 0


# %% [markdown]
# With `--results FILE`, `train` also scores the finished model on
# test2016 with greedy decoding, with and without `<unk>` replacement, and
# writes the scores, the config, the machine and the run's history to one
# JSON file. Both scores come from one greedy decoding: replacing `<unk>`
# changes the text, not the tokens decoded.
#
# The file also records the command that ran, as a line a shell takes
# back (`run_command`): `python` before the module's file, the installed
# command's path as it was started, and under `torchrun` its number of
# processes per machine, `--nnodes` when there are several machines, and
# `--no-python` before the installed command (other torchrun options are
# not known to the process).


# %%
#| export
def greedy_with_and_without_unk(
    model,
    sentences,
    spacy_de,
    vocab_src,
    vocab_tgt,
    batch_size=128,
    progress=False,
):
    """translate_batch's greedy output with `<unk>` replaced, and kept."""
    if is_subword(vocab_src) or is_subword(vocab_tgt):  # no <unk> to replace
        hyps = translate_batch(
            model,
            sentences,
            spacy_de,
            vocab_src,
            vocab_tgt,
            batch_size=batch_size,
            progress=progress,
        )
        return hyps, hyps
    model.eval()
    device = next(model.parameters()).device
    encoded, words = encode_sources(
        sentences, spacy_de, vocab_src, keep_words=True
    )
    decoded = decode_by_length(
        model,
        encoded,
        cached_greedy_decode,
        device,
        batch_size=batch_size,
        max_extra=MAX_EXTRA,
        align=True,
        progress=progress,
    )
    replaced = [
        finish_text(ids, at, w, vocab_tgt)
        for (ids, at), w in zip(decoded, words, strict=True)
    ]
    kept = [finish_text(ids, None, None, vocab_tgt) for ids, _ in decoded]
    return replaced, kept


def run_command(argv, ranks=None):
    """The command line that started this run, quoted for a shell:
    `argv` (sys.argv) after `python` when argv[0] is a .py file, after
    `torchrun --nproc_per_node=N` when `ranks` says torchrun started it."""
    script = argv[0].endswith(".py")
    launcher = ["python"] if script else []
    if ranks is not None:
        launcher = ["torchrun", f"--nproc_per_node={ranks.local_world}"]
        if ranks.world != ranks.local_world:
            machines = ranks.world // ranks.local_world
            launcher.append(f"--nnodes={machines}")
        if not script:  # torchrun runs a program that is not Python's
            launcher.append("--no-python")
    return shlex.join([*launcher, *argv])


def write_results(path, checkpoint, wall_time):
    """Score test2016 and write a JSON summary of the training run."""
    sources, references = zip(*read_multi30k("test"), strict=True)
    ckpt = load_checkpoint(checkpoint)  # also for its config and history
    model, vocab_src, vocab_tgt, _ = trained_model_from(ckpt, checkpoint)
    spacy_de, _ = load_tokenizers()
    replaced, kept = greedy_with_and_without_unk(
        model, sources, spacy_de, vocab_src, vocab_tgt, progress=True
    )
    bleu = compute_bleu(replaced, references)
    kept_bleu = compute_bleu(kept, references)  # <unk> left in the output
    summary = {
        "command": run_command(sys.argv, torchrun_ranks()),
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


# %% [markdown]
# ### `evaluate` and `translate`: loading a model
#
# `evaluate` and `translate` read and check their input before they load
# anything, so that a mistake there costs no waiting; `evaluate` also
# checks `--out` first: it must not name an input (with `--average`, the
# epoch files next to the checkpoint count as inputs), which it would
# overwrite, and its folder must exist and be writable. Then
# `load_for_decoding` loads the model through `load_translator` (cached
# greedy decoding, or beam search with `--beam`; `--alpha` without a beam
# is refused there, since greedy decoding has no length penalty), turns
# the library's complaints into `UserError`s, and refuses
# a beam wider than the target vocabulary, which could never fill it.


# %%
#| export
def check_not_input(out, *inputs, option="--out"):
    """Refuse an output file that is one of the inputs."""
    out = Path(out).absolute()
    for given in inputs:
        given = Path(given).absolute()
        same = out.exists() and given.exists() and out.samefile(given)
        if same or out.resolve() == given.resolve():
            raise UserError(
                f"{option} {out} is also an input, which it would overwrite"
            )


def file_in_the_way(path):
    """The nearest folder above `path` that exists, when it is not a
    folder but a file; None otherwise."""
    for above in Path(path).absolute().parents:
        if above.exists():
            return None if above.is_dir() else above
    return None


def check_out(out, *inputs, option="--out"):
    """Refuse an output file that is an input or cannot be written;
    `option` names it in the message."""
    check_not_input(out, *inputs, option=option)
    if str(out).endswith(("/", os.sep)):  # Path() would drop the slash
        raise UserError(f"{option} {out} names a folder; name a file")
    if option == "--out" and str(out).endswith(".gz"):
        raise UserError(
            f"{option} {out}: the translations are written as plain text;"
            " name a file without .gz"
        )
    out = Path(out).absolute()
    if out.is_dir():
        raise UserError(f"{option} {out} is a folder")
    if out.is_symlink() or (out.exists() and not out.is_file()):
        # Writing replaces the file whole, so a link, a device or a pipe
        # would be replaced by an ordinary file, not written through.
        raise UserError(
            f"{option} {out} is a link, device or pipe; name a new or"
            " ordinary file"
        )
    blocker = file_in_the_way(out)
    if blocker:
        raise UserError(f"{option} {out}: {blocker} is a file, not a folder")
    if not out.parent.is_dir():
        raise UserError(f"{option} {out}: there is no folder {out.parent}")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise UserError(f"{option} {out}: cannot write in {out.parent}")


def load_for_decoding(args):
    """`load_translator` for the command line, refusing a too-wide beam
    (and, in load_translator, a length penalty without a beam)."""
    try:
        model, vocab_src, vocab_tgt, decode_fn = load_translator(
            args.checkpoint,
            args.device,
            beam=args.beam,
            average_last=args.average,
            alpha=args.alpha,
        )
    except (FileNotFoundError, ValueError) as err:  # CheckpointError, ...
        raise UserError(str(err)) from err
    if args.beam > len(vocab_tgt):
        raise UserError(
            f"--beam {args.beam} is wider than the {len(vocab_tgt)} tokens "
            f"of the target vocabulary of {args.checkpoint}"
        )
    if not args.replace_unk and is_subword(vocab_tgt):
        print(
            "warning: --no-replace-unk changes nothing here: a subword"
            " (BPE) model writes no <unk>",
            file=sys.stderr,
        )
    return model, vocab_src, vocab_tgt, decode_fn


# %% [markdown]
# ### Lines too long for the model
#
# A line can be longer than the model can read: the positional encoding
# (Part 1) has 5,000 positions, and decoding may run 50 tokens past the
# source's length. `fit_to_model` cuts such a line to the tokens that fit
# and says so on stderr, once per line, with its number: the line is
# still translated, from its beginning, and every other line keeps its
# place in the output: one stray line does not cost the others their
# translations.


# %%
#| export
def position_limit(model, max_extra=MAX_EXTRA):
    """How many source tokens (without <s>, </s>) a model can translate."""
    positional_encodings = model.src_embed[1], model.tgt_embed[1]
    positions = min(pe.pe.size(1) for pe in positional_encodings)
    return positions - max_extra - 2


def fit_to_model(line, number, spacy_de, vocab_src, limit, what="line"):
    """`line`, cut to its first `limit` tokens, with a warning if cut."""
    if is_subword(vocab_src):  # its own tokens and offsets
        starts = [a for a, _ in vocab_src.tokenizer.encode(line).offsets]
    else:
        tokens = spacy_de.tokenizer(line)
        starts = [tok.idx for tok in tokens if not tok.is_space]
    if len(starts) <= limit:
        return line
    print(
        f"warning: {what} {number} has {len(starts):,d} tokens; the model "
        f"reads {limit:,d}, so only the first {limit:,d} were translated",
        file=sys.stderr,
    )
    return line[: starts[limit]]


# %% [markdown]
# ### `evaluate`: BLEU of a checkpoint
#
# `command_evaluate` is `evaluate`: it reads the source and reference
# files (test2016 by default; `evaluate_reads` lists what `--out` must
# not replace), translates them, a blank line into a blank translation
# as `translate` does, and prints the BLEU score. Before it decodes, it
# says on stderr what it scores (`evaluation_line`: the checkpoint, the
# decoding and the data), since the default model and test set are
# otherwise picked without a word; stdout keeps the score alone.
#
# `args.checkpoint` is always set when it runs: without `--checkpoint`,
# `run_command_line` (at the end of this section) fills in
# `default_checkpoint()` before calling any sub-command.


# %%
#| export
def evaluate_reads(args):
    """The files `evaluate` reads, which --out must not replace: the
    checkpoint (and, with --average, the epoch files beside it), --src
    and --ref, and Multi30k's files, whose test set is the default."""
    reads = [args.checkpoint]
    reads += [path for path in (args.src, args.ref) if path]
    if args.average:
        reads += epoch_checkpoints(Path(args.checkpoint).resolve().parent)
    multi30k = Path(multi30k_folder())
    return reads + [multi30k / name for name in MULTI30K_SHA256]


def evaluation_line(args, scored, lines):
    """What `evaluate` scores, for stderr: the model, the decoding, the
    data (the default model and test set are otherwise chosen silently)."""
    decoding = "greedy" if args.beam == 1 else f"beam {args.beam}"
    if args.alpha is not None:
        decoding += f", alpha {args.alpha}"
    if args.average:
        decoding += f", the last {plural(args.average, 'epoch')} averaged"
    return f"scoring {args.checkpoint} ({decoding}) on {scored}: " + plural(
        lines, "line"
    )


def command_evaluate(args):
    """`evaluate`: BLEU of a checkpoint on a pair of files."""
    if (args.src is None) != (args.ref is None):
        raise UserError("give both --src and --ref, or neither")
    if args.src == args.ref == "-":
        raise UserError("--src and --ref cannot both read standard input")
    if args.out == "-":  # standard output holds the BLEU line
        raise UserError("--out - : name a file; the score goes to stdout")
    if args.out:
        check_out(args.out, *evaluate_reads(args))
        refuse_a_checkpoint(args.out, "--out")
    scored = shown_path(args.src) if args.src else "test2016"
    if args.src is None:
        folder = download_multi30k()
        args.src = folder / "test_2016_flickr.de.gz"
        args.ref = folder / "test_2016_flickr.en.gz"
    sources, references = read_parallel(args.src, args.ref)
    if not any(line.strip() for line in sources):
        raise UserError(
            f"nothing to translate: {shown_path(args.src)} holds only"
            " blank lines"
        )
    model, vocab_src, vocab_tgt, decode_fn = load_for_decoding(args)
    print(evaluation_line(args, scored, len(sources)), file=sys.stderr)
    spacy_de, _ = load_tokenizers()
    limit = position_limit(model)
    sources = [
        fit_to_model(s, n, spacy_de, vocab_src, limit)
        for n, s in enumerate(sources, 1)
    ]

    def translate_fn(batch):
        return translate_batch(
            model,
            batch,
            spacy_de,
            vocab_src,
            vocab_tgt,
            device=args.device,
            batch_size=args.batch_size,
            decode_fn=decode_fn,
            replace_unk=args.replace_unk,
            progress=True,
        )

    # One chunk of all lines; as in `translate`, a blank line gets "".
    (hyps,) = translate_lines(sources, translate_fn, chunk=len(sources))
    if args.out:
        with atomic_write(args.out, "w") as f:
            f.write("\n".join(hyps) + "\n")
    say(compute_bleu(hyps, references))
    return 0


# %% [markdown]
# ### `translate`: sentences in, lines out
#
# `translate` prints one line for each sentence it is given, in order.
# Given no sentence, or `-`, it reads standard input, one sentence per
# line, and with `--input FILE` a file, as Unix filters and sacreBLEU do.
# `translate_lines` streams such input: it reads `chunk` lines (eight
# batches' worth), decodes them together in length-sorted batches, prints
# their translations and reads on, so a long file never waits in memory
# and never goes through the model one sentence at a time. An empty line
# gets an empty line back, so that line $n$ of the output always
# translates line $n$ of the input. Only a person typing at a terminal
# gets each line translated as soon as it is typed. `translate_source`
# says where the sentences come from, and `sentences_to_translate` reads
# them from there, checked.


# %%
#| export
def translate_lines(lines, translate_fn, chunk=1024):
    """Translations of `lines`, one list per `chunk` lines read; a blank
    line gives a blank translation, in its place."""
    lines = iter(lines)
    while True:
        batch = list(itertools.islice(lines, chunk))
        if not batch:
            return
        todo = [line for line in batch if line.strip()]
        hyps = iter(translate_fn(todo) if todo else [])  # in order
        yield [next(hyps) if line.strip() else "" for line in batch]


def translate_source(args):
    """Where `translate` reads: a file's name, "-" (standard input), or
    None (its sentence arguments)."""
    if args.input is not None and args.sentence:
        raise UserError("give sentences or --input FILE, not both")
    if args.input is None and args.sentence in ([], ["-"]):
        return "-"
    return args.input


def sentences_to_translate(args, source):
    """The lines of `source` (a file or "-"), or, if None, the sentence
    arguments, checked."""
    if source is not None:
        return iter_lines(source)
    for number, sentence in enumerate(args.sentence, 1):
        if sentence == "-":
            raise UserError("- (standard input) cannot mix with sentences")
        if not clean_line(sentence).strip():
            raise UserError(f"sentence {number} is empty: no German to read")
        try:  # an argument's undecodable bytes arrive as lone surrogates
            sentence.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"sentence {number} is not UTF-8 text") from None
    return iter(map(clean_line, args.sentence))


# %% [markdown]
# For sentences given as arguments, `translate` also names, on stderr, the
# German words that a word vocabulary does not know and reads as `<unk>`.
# It does not for a file or a stream, where such notes would pile up.


# %%
#| export
def warn_unknown_words(sentences, spacy_de, vocab_src):
    """Name, on stderr, the words a word vocabulary reads as `<unk>`."""
    if not is_subword(vocab_src):  # BPE can spell any known letters
        words = [tokenize(s, spacy_de) for s in sentences]
        unknown = dict.fromkeys(  # each word once, in order
            w for ws in words for w in ws if w not in vocab_src
        )
        if unknown:
            print(
                "note: not in the vocabulary, read as <unk>: "
                + ", ".join(unknown),
                file=sys.stderr,
            )


def blank_lines_then_a_sentence(lines, source):
    """The lines up to and including the first that is not blank; a
    UserError if every line is blank."""
    read = []
    for line in lines:
        read.append(line)
        if line.strip():
            return read
    raise UserError(
        f"nothing to translate: {shown_path(source)} holds only blank lines"
    )


def command_translate(args):
    """`translate`: one line of English per German sentence, in order."""
    source = translate_source(args)
    lines = sentences_to_translate(args, source)
    typing = source == "-" and sys.stdin and sys.stdin.isatty()
    chunk = 1 if typing else 8 * args.batch_size
    first = list(itertools.islice(lines, chunk))  # input errors come first
    if not first:
        raise UserError(f"nothing to translate: {shown_path(source)} is empty")
    if not any(line.strip() for line in first):  # read on to a sentence
        first += blank_lines_then_a_sentence(lines, source)
    model, vocab_src, vocab_tgt, decode_fn = load_for_decoding(args)
    spacy_de, _ = load_tokenizers()
    if source is None:
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
    what = "sentence" if source is None else "line"
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


# %% [markdown]
# ### `main`: one line per error, and the exit status
#
# A program for people should answer every mistake with one line that
# says what is wrong, and exit status 2, never with a traceback: a bad
# number or device, a missing, damaged or unsafe checkpoint, a file that
# is not UTF-8.
#
# The library raises ordinary exceptions: `CheckpointError` and
# `TextFileError` (both `ValueError`s), `FileNotFoundError`, Part 3's
# `DatasetError`, and `FolderInUseError`. The command line's own checks
# raise `UserError`, also where they turn another `ValueError` that an
# argument can cause into a message. Only `main` turns these into lines:
# `USER_ERRORS` lists them. Any other exception is a bug, and keeps its
# traceback.
#
# `main` runs a sub-command and ends each failure with an exit status that
# says whose it is; an error is one line, `error: ...`. Ctrl-C and the
# machine's own errors (a full disk, a closed pipe) get statuses of their
# own; `docs/guarantees.md` lists every case:
#
# | status | when |
# |---|---|
# | 2 | an error the user can fix: a bad argument, checkpoint or file |
# | 74 | the machine's: a full disk, a closed standard output, memory |
# | 130 | Ctrl-C, as the shell reports SIGINT; `kill`'s SIGTERM too |
# | 141 | a reader that left early (`translate ... \| head -1`): quietly |
#
# `out_of_memory` tells running out of memory from other errors, so
# that its line can say what to make smaller; `warning_line` puts a
# warning on one line, as `one_line` (from "Checkpoint files") does an
# error's message.


# %%
#| export
EXIT_USAGE = 2  # the user can fix it
EXIT_IO = 74  # the machine's: disk, output, memory (sysexits' EX_IOERR)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as the shell reports Ctrl-C
EXIT_PIPE = 141  # 128 + SIGPIPE: the reader left early
USER_ERRORS = (
    UserError,
    CheckpointError,
    TextFileError,
    DatasetError,
    FolderInUseError,
    FileNotFoundError,
)


SMALLER = {  # what to make smaller when memory runs out
    "train": "a smaller --max-tokens",
    "evaluate": "a smaller --batch-size or --beam",
    "translate": "a smaller --batch-size or --beam",
}


def says_out_of_memory(text):
    """Whether an error's text is the CPU's allocator's, a GPU's or MPS's
    report of memory running out."""
    return "can't allocate memory" in text or "out of memory" in text


def out_of_memory(err):
    """Whether `err` is the CPU or a GPU running out of memory."""
    if isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(err, RuntimeError) and says_out_of_memory(str(err))


def stdout_fault():
    """Flush stdout. If that fails, point stdout at /dev/null (so that
    Python's own flush at exit cannot fail again) and return the error;
    else None."""
    try:
        sys.stdout.flush()
    except OSError as err:  # full, closed or a broken pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return err
    return None


def warning_line(message, *args, **kwargs):
    """A warning on the command line: one line on stderr, no source."""
    print("warning: " + one_line(message), file=sys.stderr)


def command_line_warnings():
    """The command line's warnings, until the caller's catch_warnings
    ends: one line each, and none for torch's note on an old pickle."""
    warnings.filterwarnings("ignore", "Detected pickle protocol")
    warnings.showwarning = warning_line


# %% [markdown]
# A mistyped option is reported by its sub-command (`... translate:
# error: unrecognized arguments: --bogus`), so that its `--help` is the
# one that lists the options; an option put before the sub-command is
# named as the mistake, and an option close to a real one gets a "did
# you mean". Options must be written in full: argparse would
# otherwise take `--be 4` for `--beam 4`, and an option added later could
# silently change what an old command means.


# %%
#| export
COMMAND_NAMES = ("download", "train", "evaluate", "translate")


def command_after_options(argv):
    """The sub-command of `argv` when an option comes before it, as in
    `--beam 4 translate ...`, which argparse would misread; else None."""
    first = argv[0] if argv else ""
    if not first.startswith("-") or first in ("-h", "--help", "--version"):
        return None
    return next((word for word in argv if word in COMMAND_NAMES), None)


def parsed_or_refused(argv):
    """argparse's parse_args, but an unknown option is reported by the
    sub-command's parser, whose --help lists the options it has."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = parser.commands[args.command]
        message = f"unrecognized arguments: {' '.join(unknown)}"
        command.error(message + did_you_mean(unknown[0], command))
    return args


def did_you_mean(word, parser):
    """ "; did you mean --beam?" for `--bema`, when one option is close."""
    name = word.split("=")[0]
    options = [o for a in parser._actions for o in a.option_strings]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def parse_arguments(argv):
    """(the parsed arguments, None), or (None, the exit status) when
    argparse has already answered: `--help`, `--version`, a mistake."""
    argv = sys.argv[1:] if argv is None else list(argv)
    late = command_after_options(argv)
    if late:
        prog = build_parser().prog
        print(
            f"{prog}: error: options go after the sub-command, as in"
            f" `{prog} {late} {argv[0]} ...` (see --help)",
            file=sys.stderr,
        )
        return None, EXIT_USAGE
    said = io.StringIO()  # what argparse prints on stdout: help, version
    try:
        with contextlib.redirect_stdout(said):
            args, status = parsed_or_refused(argv), None
    except SystemExit as answered:
        args, status = None, answered.code
    # Written here, not by argparse, which ignores a failed write: then
    # `--help > /dev/full` is an error, as for every other command.
    try:
        sys.stdout.write(said.getvalue())
        sys.stdout.flush()
    except OSError as err:  # named, for main's one line
        raise OSError(err.errno, err.strerror, "standard output") from err
    return args, status


# %% [markdown]
# `main` sets the signal handlers: Ctrl-C raises `KeyboardInterrupt`,
# as it does in Python by default, and so does SIGTERM
# (`stop_as_for_ctrl_c`), except under `torchrun`, which stops its
# processes itself. Both end with status 130 and the same report.
# `run_command_line` runs the sub-command and turns each failure into
# its line and exit status, as the table at the start of this section
# says; `docs/guarantees.md` lists every case. (While torch loads,
# before `main` runs, a few lines that `tools/export.py` writes at the
# top of the generated module handle Ctrl-C the same way.)


# %%
#| export
def stop_as_for_ctrl_c(signum, frame):
    """SIGTERM (`kill`, `timeout`, a job scheduler): the same clean-up and
    the same report as Ctrl-C."""
    raise KeyboardInterrupt


def main(argv=None):
    """Command-line entry point; returns the exit status. While it runs,
    Ctrl-C and SIGTERM raise KeyboardInterrupt (status 130); afterwards
    the handlers from before return."""
    if not in_main_thread():  # only the main thread sets handlers
        return run_command_line(argv)
    stops = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.getsignal(s) for s in stops}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun stops ranks
        signal.signal(signal.SIGTERM, stop_as_for_ctrl_c)
    try:
        return run_command_line(argv)
    finally:
        for s in stops:  # None: a handler set outside Python
            signal.signal(s, before[s] or signal.SIG_DFL)


def run_command_line(argv):
    """`main`'s work: the sub-command, and one line for each failure."""
    if sys.stdout is None:  # started with stdout closed: `>&-`
        print("error: standard output is closed", file=sys.stderr)
        return EXIT_IO
    args = None
    try:
        args, status = parse_arguments(argv)
        if args is None:  # --help, --version or a mistake: already said
            return status
        decodes = args.command in ("evaluate", "translate")
        if decodes and args.checkpoint is None:
            args.checkpoint = default_checkpoint()
        commands = {
            "download": command_download,
            "train": command_train,
            "evaluate": command_evaluate,
            "translate": command_translate,
        }
        with warnings.catch_warnings():  # both restored on leaving
            command_line_warnings()
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
    except (MemoryError, RuntimeError) as err:
        if not out_of_memory(err):
            raise  # a bug: its traceback says where
        advice = SMALLER.get(args.command if args else None, "smaller work")
        print(f"error: out of memory; try {advice}", file=sys.stderr)
        return EXIT_IO
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


# %% [markdown]
# ## For Parts 4 and 5
#
# Two helpers that the lessons, not the command line, use: a one-line
# name for a checkpoint, and a trained model to look at, found or
# trained there and then.
#
# ### Which model is this?
#
# A translation, an attention map or a BLEU score means little without
# the model behind it. `describe_checkpoint` names a checkpoint in one
# line: its file, its preset and sizes, its vocabulary, how many epochs it
# trained on which pairs, and its last validation loss, e.g.
# `quick/final.pt, preset quick (N=3, d_model=256, h=4, word vocabulary),
# 5 epochs on all training pairs, validation loss 1.47`. The
# notebooks print it as `model: ...` whenever they load one, and the
# website puts those lines at the top of each page.


# %%
#| export
def describe_checkpoint(path):
    """One line: a checkpoint's file, preset, sizes and training."""
    ckpt = load_checkpoint(path)
    c, history = ckpt["config"], ckpt.get("history") or []
    pairs = c.get("max_train_pairs") or 0
    data = f"{pairs:,d} training pairs" if pairs else "all training pairs"
    if c.get("data"):  # `train --data`: other pairs, named by their digest
        first = f", the first {pairs:,d}" if pairs else ""
        data = f"the --data pairs {short_digest(c['data'])}{first}"
    trained = f"{plural(len(history), 'epoch')} on {data}"
    if history:
        trained += f", validation loss {history[-1]['val_loss']:.2f}"
    name = f"{Path(path).parent.name}/{Path(path).name}"
    return (
        f"{name}, preset {c.get('preset', '?')} (N={c['N']}, "
        f"d_model={c['d_model']}, h={c['h']}, "
        f"{c.get('tokenization', 'word')} vocabulary), {trained}"
    )


# %% [markdown]
# ### A trained model, or a small one trained now
#
# Parts 4 and 5 show a trained model's attention and translations.
# `find_or_train` looks under `root` for the `final.pt` of each preset it
# is given, in order, and returns the first it finds: Parts 4 and 5 ask
# for `cpu`, which `make train` writes, then `quick`, which Part 3 writes.
# When there is none, or in a CI-sized run, it trains a model there and
# then; `model_to_train_here` says which. The caller passes `stand_in`, a
# small config to train when nothing else will do (Part 4's: `ci` with
# two layers and four heads, in `checkpoints/ci-attention`):
#
# - on a CUDA GPU, when `quick` is among the presets asked for, the
#   `quick` recipe itself, into `root`'s `checkpoints/quick/`: under two
#   minutes on an H100 (all of notebook 03 took 88 s, `docs/gpu.md`;
#   2.6 minutes with six other trials sharing the GPU,
#   `results/gpu_explore.md`); on Colab's T4, not measured. This is for
#   Colab, where each notebook opened from its badge gets a runtime of
#   its own and never sees the model that Part 3 trained in another;
# - everywhere else, and always in a CI-sized run, the small `stand_in`,
#   in seconds, into the stand-in's own `checkpoint_dir`, replacing any
#   stand-in trained there before, without warning. So each notebook
#   gives its stand-in a folder of its own (one would clear the other's),
#   as an absolute path (the working directory need not be `root`). On a
#   CPU, `quick` would take a quarter of an hour: run Part 3 first (or
#   `make notebook`).
#
# So every notebook runs on a fresh clone, and CI checks the training code
# rather than a leftover file.
#
# Where each machine gets what (for running the notebooks on Colab or a
# Mac; a first read can skip it):
#
# - **Colab**: pick a GPU runtime first (Runtime → Change runtime type),
#   or Colab gives you a CPU and Parts 4 and 5 get the stand-in. Colab's T4
#   trains in float16, and no real T4 has run this project: see "If it
#   fails on a T4 or a Mac" in
#   [docs/gpu.md](../docs/gpu.md#if-it-fails-on-a-t4-or-a-mac).
# - **An Apple-silicon Mac**: the stand-in trains on MPS. If an operation
#   is missing there, set `PYTORCH_ENABLE_MPS_FALLBACK=1` before starting
#   Jupyter: PyTorch then runs that operation on the CPU.
# - **CI** (`AT_SIZE=ci`): always the stand-in.


# %%
#| export
def model_to_train_here(presets, stand_in, root=".", size="full"):
    """The config find_or_train trains when it finds no model: `quick`
    on a CUDA GPU (if asked for, and AT_DEVICE names no other device),
    else the stand-in."""
    on_cuda = pick_device().type == "cuda"
    if size != "ci" and "quick" in presets and on_cuda:
        folder = Path(root, get_config("quick").checkpoint_dir)
        return get_config("quick", checkpoint_dir=str(folder))
    return stand_in


def find_or_train(
    presets, stand_in, vocabs, tokenizers, root=".", size="full"
):
    """final.pt of the first trained preset, else train a model now."""
    if size != "ci":  # a CI-sized run always trains its stand-in
        for preset in presets:
            final = Path(root, get_config(preset).checkpoint_dir, "final.pt")
            if final.is_file():
                return str(final)
    config = model_to_train_here(presets, stand_in, root, size)
    is_stand_in = config is stand_in  # seconds, not minutes: no progress
    if is_stand_in:  # retrained every call: cleared first, without a note
        clear_earlier_run(config.checkpoint_dir)
    else:
        print(f"no trained model found: training {config.preset} here")
    train_worker(
        0, 1, *vocabs, *tokenizers, config, show_progress=not is_stand_in
    )
    return str(Path(config.checkpoint_dir, "final.pt"))


# %% [markdown]
# Check: the first call trains (there is nothing to find), the second
# finds that model and leaves it untouched, and a CI-sized call trains
# again. Here the stand-in is written where the preset `ci` is looked
# for, so the second call finds it; a stand-in in a folder of its own
# would be retrained. The file's time is first set back to 1970, so that
# a file written again shows a new time even where the file system keeps
# times to the second only.

# %%
with tempfile.TemporaryDirectory() as tmp:
    folder = f"{tmp}/{get_config('ci').checkpoint_dir}"
    small = get_config(
        "ci", epochs=1, max_train_pairs=200, checkpoint_dir=folder
    )
    found = find_or_train(["ci"], small, vocabs, tokenizers, root=tmp)
    os.utime(found, (0, 0))  # 1970
    assert find_or_train(["ci"], small, vocabs, tokenizers, tmp) == found
    assert os.stat(found).st_mtime == 0  # found, not written again
    find_or_train(["ci"], small, vocabs, tokenizers, tmp, size="ci")
    assert os.stat(found).st_mtime > 0  # trained and written again
