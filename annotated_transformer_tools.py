# =============================================================================
# GENERATED FILE: edit the notebooks, not this file.
# Source: notebooks/06_tools.py (cells starting with "#| export").
# Regenerate with `make export`; `make check-sync` fails on drift.
# =============================================================================
"""The machinery around the lessons: the appendix's code as a module.

Downloads, presets, process launch, translation for users and the command
line. It imports the lesson module, ``the_annotated_transformer``; the
lesson module never imports it. Run
``python annotated_transformer_tools.py --help`` for the command line.
"""

# Ctrl-C or SIGTERM while torch loads: one line, no traceback; when run as
# a script or as the installed `annotated-transformer` command, never on
# import.
if __name__ == "__main__" or __import__("sys").argv[0].endswith(
    "annotated-transformer"
):
    import os
    import signal

    def _interrupted(signum, frame):
        os.write(2, b"interrupted\n")
        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)

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

# =============================================================================
# Appendix: the machinery
# notebooks/06_tools.py
# =============================================================================


# -----------------------------------------------------------------------------
# Charts
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
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


# -----------------------------------------------------------------------------
# Copy-task runs
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
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


def greedy_check(model, streak, check_size, V, generator):
    """The greedy-copy accuracy on `check_size` fresh sequences once the
    streak is that long, else None."""
    if streak < check_size:
        return None
    return copy_accuracy(model, check_size, V, generator=generator)


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


# -----------------------------------------------------------------------------
# Files written whole
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
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


# -----------------------------------------------------------------------------
# Vocabularies
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
def is_subword(vocab):
    """True for Part 5's BPE vocabulary, which encodes raw text itself."""
    return hasattr(vocab, "encode")


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
    elif torch.backends.mps.is_available():  # a Mac's GPU
        info["mps"] = True
    return info


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


# -----------------------------------------------------------------------------
# Checkpoint files
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
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


# -----------------------------------------------------------------------------
# Training runs: devices and processes
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
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


# -----------------------------------------------------------------------------
# Translating for users
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
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


def compute_bleu(hypotheses, references):
    """Cased corpus BLEU (sacreBLEU, 13a tokenization) of plain text."""
    import sacrebleu

    return sacrebleu.corpus_bleu(hypotheses, [references])


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


# -----------------------------------------------------------------------------
# Reading text files
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
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


def command_download(args):
    """`download`: fetch and verify Multi30k, print where it is."""
    say(download_multi30k())
    return 0


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


# -----------------------------------------------------------------------------
# For Parts 4 and 5
# Explained in notebooks/06_tools.py, same heading.
# -----------------------------------------------------------------------------
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


# The public names, for `from ... import *` and the docs.
__all__ = [
    "save_chart",
    "line_chart",
    "mask_chart",
    "positional_chart",
    "label_smoothing_penalty_chart",
    "learning_rate_chart",
    "attention_frame",
    "attention_chart",
    "attention_summary_chart",
    "copy_accuracy_teacher_forced",
    "CopyLossCompute",
    "greedy_check",
    "CopyTaskConfig",
    "epoch_summary",
    "copy_task_setup",
    "train_copy_task",
    "process_alive",
    "clean_partial_files",
    "failed_to_write",
    "atomic_write",
    "MULTI30K_BASE_URL",
    "MULTI30K_SHA256",
    "sha256_of",
    "download_multi30k",
    "missing_folders",
    "remove_if_empty",
    "PRESETS",
    "get_config",
    "is_subword",
    "load_vocab",
    "load_bpe",
    "encode_pairs_cached",
    "load_vocabularies",
    "hardware_summary",
    "Precision",
    "cpu_has_native_bf16",
    "choose_precision",
    "autocast_for",
    "describe_device",
    "CheckpointError",
    "save_checkpoint",
    "one_line",
    "shortened",
    "checkpoint_head",
    "check_zip",
    "load_checkpoint",
    "EPOCH_FILE",
    "epoch_of",
    "epoch_checkpoints",
    "LEGACY_CONFIG_NAMES",
    "config_fields_now",
    "checkpoint_config",
    "model_size_problems",
    "checkpoint_vocabularies",
    "size_mismatch",
    "size_words",
    "load_weights",
    "refuse_non_finite",
    "OLD_PROJECTIONS",
    "OLD_BLOCKS",
    "rename_old_key",
    "rename_old_keys",
    "load_trained_model",
    "trained_model_from",
    "average_checkpoints",
    "weights_to_average",
    "check_run_file",
    "same_run",
    "split_evenly",
    "ShardedBatchSampler",
    "shard_loader",
    "cuda_count",
    "process_device",
    "backend_for",
    "cheap_keep_mask",
    "FastDropout",
    "use_fast_dropout",
    "SmoothedKL",
    "FastLabelSmoothing",
    "compute_dtype",
    "smoothing_constants",
    "rows_per_block",
    "GeneratorLoss",
    "FusedLossCompute",
    "use_bf16_stream",
    "wants_bf16_stream",
    "CPP_PRELUDE",
    "DROPOUT_KERNEL_SOURCE",
    "KERNEL_DTYPES",
    "KERNEL_FUNCTIONS",
    "build_kernel",
    "kernels_allowed",
    "kernel_once",
    "dropout_kernel",
    "dropout_rule",
    "kernel_call",
    "KernelDropoutFunction",
    "KernelAddDropoutFunction",
    "KernelReluDropoutFunction",
    "KernelSoftmaxDropoutFunction",
    "KernelDropout",
    "KernelSublayerConnection",
    "KernelFeedForward",
    "KernelMultiHeadedAttention",
    "use_dropout_kernel",
    "wants_dropout_kernel",
    "LOSS_KERNEL_SOURCE",
    "loss_kernel",
    "LAYER_NORM_KERNEL_SOURCE",
    "layer_norm_kernel",
    "KernelLayerNormFunction",
    "KernelResidualLayerNormFunction",
    "KernelLayerNorm",
    "KernelNormSublayerConnection",
    "use_layer_norm_kernel",
    "doubled",
    "symmetric_kl",
    "RDropLossCompute",
    "usable_cores",
    "place_process",
    "join_group",
    "TrainingRun",
    "params_in_sync",
    "device_batch",
    "CountedBatches",
    "all_reduce_loss",
    "train_pass",
    "validate",
    "LOG_REDRAW_SECONDS",
    "progress_bar",
    "drawn_into_a_file",
    "run_loss_compute",
    "train_epoch",
    "save_run",
    "device_states",
    "restore_device_states",
    "save_epoch",
    "earlier_run_files",
    "note_earlier_run",
    "clear_earlier_run",
    "resume_checkpoint",
    "resume_point",
    "load_optimizer_state",
    "resume_run",
    "RESUMABLE_CHANGES",
    "OLDER_DEFAULTS",
    "changed_settings",
    "plural",
    "check_resume",
    "check_resume_and_say",
    "FolderInUseError",
    "folder_lock",
    "write_holder",
    "remove_lock_and_folders",
    "check_training_pairs",
    "final_is_this_runs",
    "train_worker",
    "free_port",
    "vocabulary_as_data",
    "train_distributed_model",
    "started_since",
    "worker_out_of_memory",
    "user_error_of_worker",
    "in_main_thread",
    "new_processes_ignore_ctrl_c",
    "stop_signals_kept",
    "stop_processes",
    "train_model",
    "detokenize",
    "decode_text",
    "MAX_EXTRA",
    "encode_sources",
    "decode_together",
    "decode_by_length",
    "finish_text",
    "translate_batch",
    "compute_bleu",
    "DEFAULT_ALPHA",
    "checked_device",
    "load_translator",
    "own_epoch_files",
    "TRAINED_MODELS",
    "default_checkpoint",
    "translate",
    "check_outputs",
    "run_model_example",
    "TextFileError",
    "clean_line",
    "shown_path",
    "iter_lines",
    "read_lines",
    "read_parallel",
    "UserError",
    "say",
    "whole_number",
    "path_text",
    "count",
    "number_from",
    "existing_device",
    "OneLineParser",
    "presets_epilog",
    "EpilogAsWritten",
    "add_train_parser",
    "add_decoding_options",
    "add_evaluate_parser",
    "add_translate_parser",
    "package_version",
    "version_line",
    "build_parser",
    "command_download",
    "M_TRIM_THRESHOLD",
    "M_MMAP_THRESHOLD",
    "keep_freed_memory",
    "ONEDNN_CACHE",
    "keep_built_kernels",
    "command_train",
    "config_from_args",
    "refuse_one_process_options",
    "warn_slow_settings",
    "check_checkpoint_folder",
    "check_results_option",
    "in_folder",
    "training_writes",
    "check_results_file",
    "refuse_a_checkpoint",
    "interrupted_message",
    "checked_data_folder",
    "short_digest",
    "pairs_digest",
    "multi30k_from",
    "TorchrunRanks",
    "torchrun_ranks",
    "torchrun_device",
    "train_locked",
    "greedy_with_and_without_unk",
    "run_command",
    "write_results",
    "check_not_input",
    "file_in_the_way",
    "check_out",
    "load_for_decoding",
    "position_limit",
    "fit_to_model",
    "evaluate_reads",
    "evaluation_line",
    "command_evaluate",
    "translate_lines",
    "translate_source",
    "sentences_to_translate",
    "warn_unknown_words",
    "blank_lines_then_a_sentence",
    "command_translate",
    "EXIT_USAGE",
    "EXIT_IO",
    "EXIT_INTERRUPTED",
    "EXIT_PIPE",
    "USER_ERRORS",
    "SMALLER",
    "says_out_of_memory",
    "out_of_memory",
    "stdout_fault",
    "warning_line",
    "command_line_warnings",
    "COMMAND_NAMES",
    "command_after_options",
    "parsed_or_refused",
    "did_you_mean",
    "parse_arguments",
    "stop_as_for_ctrl_c",
    "run_command_line",
    "describe_checkpoint",
    "model_to_train_here",
    "find_or_train",
]


if __name__ == "__main__":
    raise SystemExit(main())
