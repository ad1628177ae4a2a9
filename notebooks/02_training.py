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
# # Part 2: Training, and a first task: copying
#
# Part 1 built the model. This part builds what training needs, in the
# order a training step uses it: batches with their masks, a loss with
# label smoothing, the loop itself, and the paper's optimizer and
# learning-rate schedule. Then it teaches a model to copy its input, a
# task small enough to learn on a laptop CPU and simple enough that any
# bug shows. A last section builds the library's training loop,
# `run_epoch`, which Part 3 uses. The training cell prints how long it
# took; in our recorded runs on a 2-core CPU the whole lesson took one to
# three minutes (`results/make_notebook.md`). Everything here runs on
# the CPU, even on a GPU runtime: nothing in this part moves a tensor to
# a GPU. The GPU paths are in Part 3 and the appendix.
#
# Some library code here is also written to run fast on a GPU; comments
# that mention a GPU can be skipped for now.

# %% [markdown]
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/annotated-transformer/done-right/blob/main/notebooks/02_training.ipynb)

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
# AT_SIZE=ci: the project's automated tests (CI) train a smaller copy
# model here (see "Training" below); readers can ignore it.
AT_SIZE = os.environ.get("AT_SIZE", "full")

# %%
#| export
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

# %%
import torch
import torch.nn.functional as F
from torch import nn

from the_annotated_transformer import make_model, subsequent_mask

# Chart helpers from the appendix (06_tools, "Charts"): save_chart writes a
# chart as SVG and PNG into figures/ and returns it, so a cell that ends
# with it shows the chart. Outside Colab they need `make setup` (or
# `pip install -e '.[notebooks]'`).
from annotated_transformer_tools import (
    label_smoothing_penalty_chart,
    learning_rate_chart,
    save_chart,
)

FIGURES = Path(ROOT, "figures")

# %% [markdown]
# ## Batches and masks
#
# The model reads a batch of B source sequences of length S (the longest
# in the batch; shorter ones are padded), and B target sequences. A
# `Batch` holds both, as token ids, and the masks that go with them.
#
# Every target begins with a *start symbol*, a token that only means
# "begin here", so that the decoder has something to read before it has
# produced anything. The decoder is trained to predict the next token: it
# reads the target without its last token, and must predict the target
# without its first. After `b = Batch(src, tgt)`, `b.tgt` is what the
# decoder reads and `b.tgt_y` what it must predict; both have length T,
# one less than the `tgt` passed in. This is *teacher forcing*: the
# decoder reads the true previous tokens, not its own guesses. Two masks
# keep the model honest:
#
# * the **source mask** `(B, 1, S)` hides padding in the source; its
#   middle 1 broadcasts over the query positions, as in Part 1, so every
#   position reads the same source tokens;
# * the **target mask** `(B, T, T)` hides padding *and* future positions,
#   the AND of a padding mask and `subsequent_mask`.
#
# `b.ntokens` is the number of real (non-padding) tokens to predict, a
# plain Python `int`; the loss is divided by it. (`b.to(device)` moves a
# batch to a GPU; this part does not use it.)
#
# **The padding id.** `pad` defaults to 2, the id of `<blank>` in Part
# 3's vocabularies, as in the 2022 tutorial. Other data must pass its
# own: `Batch` cannot tell padding from data, and with the wrong id it
# would mask real tokens. In this part's copy task 2 is an ordinary data
# token and padding is 0, so every `Batch` here is built with `pad=0`.


# %%
#| export
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


# %% [markdown]
# Take the target `[1, 7, 8, 0, 0]`, with 1 the start symbol and 0
# padding (the copy task's ids, below). The decoder reads `[1, 7, 8, 0]`
# and must predict `[7, 8, 0, 0]`, of which 7 and 8 are real. Row $t$ of
# the mask lets position $t$ see positions $0 \dots t$, except padding
# columns. The padded position's own row is not blanked: it still sees
# the real tokens, but the loss ignores what it predicts.

# %%
src = torch.tensor([[1, 5, 6]])
tgt = torch.tensor([[1, 7, 8, 0, 0]])
b = Batch(src, tgt, pad=0)
print(b.tgt_mask[0].int())  # row t: what position t may see (1 = yes)
causal = torch.ones(4, 4).tril().bool()  # position t sees 0 to t
# (T,): a column of its own for each key; it broadcasts over the rows,
# so no row may look at the padding column.
not_padding = torch.tensor([True, True, True, False])
assert torch.equal(b.tgt_mask[0], causal & not_padding)
assert b.ntokens == 2
assert torch.equal(b.tgt, torch.tensor([[1, 7, 8, 0]]))  # it reads
assert torch.equal(b.tgt_y, torch.tensor([[7, 8, 0, 0]]))  # it predicts

# %% [markdown]
# Throughout this part the data comes from the **copy task**: random sequences
# that the model must reproduce. Sequences have length 10 over a vocabulary of
# 11 tokens: token 0 is padding, token 1 is the start symbol at position 0, and
# tokens 2–10 fill the rest. Source and target are the same sequence.
# No sequence is padded, but `Batch` still needs a padding id: 0,
# `COPY_PAD` (see "The padding id" above).
# `data_gen`'s `generator` argument is a `torch.Generator`, a seeded source of
# random numbers (not the model's output layer, `model.generator`): the same
# seed draws the same batches again.

# %%
#| export
COPY_PAD = 0
COPY_START = 1


def data_gen(V, batch_size, nbatches, seq_len=10, generator=None):
    """Yield `nbatches` random copy-task batches over V tokens."""
    for _ in range(nbatches):
        data = torch.randint(2, V, (batch_size, seq_len), generator=generator)
        data[:, 0] = COPY_START
        # Not Batch's default pad, 2: here 2 is a data token.
        yield Batch(data, data.clone(), pad=COPY_PAD)


# %% [markdown]
# One batch of two sequences. The decoder reads each sequence without its
# last token (`tgt`) and must predict it without its first (`tgt_y`):
# each token, one position later.

# %%
seeded = torch.Generator().manual_seed(0)
example = next(data_gen(11, batch_size=2, nbatches=1, generator=seeded))
print("src:  ", example.src.tolist())
print("tgt:  ", example.tgt.tolist())
print("tgt_y:", example.tgt_y.tolist())
assert (example.src[:, 0] == COPY_START).all()
assert ((2 <= example.src[:, 1:]) & (example.src[:, 1:] <= 10)).all()
assert torch.equal(example.tgt_y, example.src[:, 1:])


# %% [markdown]
# ## The loss: label smoothing
#
# Instead of training towards a one-hot target (all probability on the
# correct token), the paper uses "label smoothing of value $\epsilon_{ls}
# = 0.1$": a small mass moves off the correct token. The paper does not
# say where the mass goes. Like the 2022 tutorial, we spread it evenly
# over every token except the correct one and padding, which should never
# be predicted. Each target token thus gets a smoothed distribution $p$:
# one row of a matrix with a row per target token. A row whose target is
# padding is all zeros and adds nothing to the loss.
#
# The loss compares each row $p$ with the model's distribution $q$ by the
# KL divergence $\sum_j p_j \log(p_j / q_j)$, and sums over the rows. The
# KL divergence is 0 only when $p$ and $q$ match, and for a one-hot $p$ it
# is the familiar cross-entropy, $-\log q_y$.
#
# The paper (section 5.4) reports a trade: perplexity (how surprised the
# model is by the right token) gets worse, as the model keeps some
# probability off its best guess, and BLEU (the translation score, Part 3)
# gets better.
#
# `LabelSmoothing` computes this loss. It receives `x`, the model's
# log-probabilities $\log q$, one row per target token, and the target
# ids. In its shape comments, N counts the target tokens, one row each
# (not Part 1's N, the number of layers), and `size` is the vocabulary
# size. Its `forward` has two ways to the same number:
#
# * **the definition**, taken with `keep_targets=True`: build every row
#   $p$ and sum the KL divergences,
#
#   ```python
#   p = self.smoothed_targets(target, x.dtype)  # (N, size): each row a p
#   return self.criterion(x, p)  # KL divergence against x = log q, summed
#   ```
#
# * **the default**, `keep_targets=False`: `forward` calls its method
#   `closed_form`, which calls the function `smoothed_kl`, a formula that
#   gives the same sum without building the rows. The formula comes in
#   "A shortcut: the same loss without the matrix", below; until then,
#   read the default as "the same number as the definition".


# %%
#| export
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


# %% [markdown]
# Here are the smoothed targets of five examples over a vocabulary of
# five tokens, built by `smoothed_targets` from the target ids, with
# smoothing 0.4 so that the spread is visible. Token 0 is padding: its
# column is empty, and so is the last row, whose target is padding.
# Every other row keeps 0.6 on its target and shares 0.4 among the three
# remaining tokens, $0.4 / 3$ each. The assert compares the matrix with
# these numbers, written out by hand.

# %%
crit = LabelSmoothing(5, padding_idx=0, smoothing=0.4)
dist = crit.smoothed_targets(torch.tensor([2, 1, 3, 3, 0]))  # (5, vocab)
print(dist.numpy().round(3))
share = 0.4 / 3  # each non-target, non-padding token gets this
expected = torch.tensor(
    [
        [0, share, 0.6, share, share],
        [0, 0.6, share, share, share],
        [0, share, share, 0.6, share],
        [0, share, share, 0.6, share],
        [0, 0, 0, 0, 0],  # the target is padding
    ]
)
assert torch.allclose(dist, expected)

# %% [markdown]
# ### A shortcut: the same loss without the matrix
#
# This subsection changes how the loss is computed, not its value; on a
# first read you can skip to the check that the two ways agree, below.
#
# The smoothed targets form a matrix as large as the model's output, one
# row per target token and one column per vocabulary entry. For Part
# 3's data, the 6,190 English tokens of Multi30k's vocabulary and a
# batch of up to 3,000 target tokens, that is 74 MB of float32 (3,000 ×
# 6,190 × 4 bytes). Each row holds only three distinct values, so a
# formula, a *closed form*, gives the same loss without building that
# matrix: it reduces each row of log-probabilities to a few numbers (a
# sum, the target's entry, the padding entry) and combines them.
#
# That saving is in the forward pass only. The gradient of the loss with
# respect to the log-probabilities has their shape, so the backward pass
# writes a full matrix of that size either way (a check below shows it).
# The appendix (06_tools, "The loss's gradient, written by hand") writes
# that gradient without autograd's intermediate steps.
#
# The formula. Some symbols first: $V$ is the vocabulary size, $\epsilon$
# is $\epsilon_{ls}$; for one row, $y$ is the target token,
# $p$ the smoothed target distribution and $q$ the model's probabilities. The
# loss receives $\log q$, as `x`, an $N \times V$ tensor ($N$ target
# tokens, as above). The three values of
# a row are: $c = 1 - \epsilon$ at $y$, $f = \epsilon / (V - 2)$ at each of the
# $V - 2$ other non-padding tokens (together $\epsilon$), and 0 at padding.
# A row's KL divergence, $\sum_j p_j \log (p_j / q_j)$, splits into
# $\sum_j p_j \log p_j - \sum_j p_j \log q_j$. The first sum has $c \log c$
# at $y$ and $f \log f$ at each of the $V - 2$ others, together $c \log c +
# \epsilon \log f$ (since $(V - 2) f = \epsilon$). The second sum has $c
# \log q_y$ at $y$ and $f \log q_j$ everywhere else but padding. So the row's
# loss is
#
# $$c \log c + \epsilon \log f - c \log q_y - f \sum_{j \ne y,\,
# \mathrm{pad}} \log q_j .$$
#
# `smoothed_kl` below computes it, one number per row.


# %%
#| export
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


# %% [markdown]
# Without smoothing, the KL divergence to a one-hot target is the negative
# log-likelihood of the correct token, so it must match PyTorch's
# `nll_loss` with the padding ignored. With smoothing, the closed form must
# match the definition:

# %%
torch.manual_seed(0)
logp = torch.randn(6, 7).log_softmax(-1)  # (N, vocab)
target = torch.tensor([3, 1, 0, 6, 0, 2])  # two rows are padding
loss = LabelSmoothing(7, padding_idx=0, smoothing=0.0)(logp, target)
expected = F.nll_loss(logp, target, ignore_index=0, reduction="sum")
print(f"smoothing 0.0: ours {loss:.6f}, nll_loss {expected:.6f}")
assert torch.allclose(loss, expected)
for eps in (0.1, 0.4):  # closed form = definition
    fast = LabelSmoothing(7, padding_idx=0, smoothing=eps)(logp, target)
    slow = LabelSmoothing(7, padding_idx=0, smoothing=eps, keep_targets=True)(
        logp, target
    )
    print(f"smoothing {eps}: closed form {fast:.6f}, definition {slow:.6f}")
    assert torch.allclose(fast, slow)

# %% [markdown]
# The backward pass, as said above, is not spared. Both ways give the same
# gradient with respect to `x`, a full $N \times V$ matrix: minus the
# smoothed targets, since the loss is $\sum_j p_j \log p_j - \sum_j p_j
# x_j$ per row and $p$ does not depend on `x`. `true_dist` rebuilds those
# targets from the latest call.

# %%
gradients = []
for keep in (False, True):  # the closed form, then the definition
    crit = LabelSmoothing(7, 0, 0.1, keep_targets=keep)
    x = logp.clone().requires_grad_()
    crit(x, target).backward()
    gradients.append(x.grad)  # (N, vocab), like x
    assert torch.allclose(x.grad, -crit.true_dist)
print(gradients[0].shape, "gradient, the same both ways")
assert torch.allclose(gradients[0], gradients[1])

# %% [markdown]
# PyTorch has label smoothing built in:
# `F.cross_entropy(logits, target, label_smoothing=ε, ignore_index=pad)`.
# It smooths differently: it mixes the one-hot target with a uniform
# distribution over all $V$ classes, padding and the target included, so
# the target gets $1 - \epsilon + \epsilon / V$ and padding
# $\epsilon / V$ in every row; `ignore_index` only drops the rows whose
# target is padding. And it computes a cross-entropy,
# $-\sum_j p_j \log q_j$, not a KL divergence: it lacks our constant
# $\sum_j p_j \log p_j$. The cell builds PyTorch's targets by hand and
# checks both statements: the hand-built targets give
# `F.cross_entropy`'s number, and ours, with our constant taken out,
# give a different one.
#
# So the two also train differently: PyTorch's targets give padding
# $\epsilon / V$, so the model learns to give it some probability.

# %%
eps = 0.1
real = target != 0  # rows whose target is not padding
vocab = logp.size(1)  # 7
uniform = torch.full_like(logp, eps / vocab)  # (N, vocab): padding too
torch_p = uniform + (1 - eps) * F.one_hot(target, vocab)  # (N, vocab)
by_hand = -(torch_p * logp)[real].sum()
# cross_entropy takes logits; exp(logp) already sums to 1 in each row,
# so its log_softmax leaves logp unchanged.
builtin = F.cross_entropy(
    logp, target, ignore_index=0, label_smoothing=eps, reduction="sum"
)
ours = LabelSmoothing(7, 0, eps)
our_p = ours.smoothed_targets(target)  # (N, vocab): 0 in padding column
our_cross_entropy = -(our_p * logp).sum()  # our KL minus its constant
print(f"F.cross_entropy {builtin:.6f}, built by hand {by_hand:.6f}")
print(f"ours, as a cross-entropy: {our_cross_entropy:.6f}")
assert torch.allclose(builtin, by_hand)
assert not torch.allclose(builtin, our_cross_entropy, atol=1e-3)

# %% [markdown]
# ### Why smoothing discourages over-confidence
#
# A *logit* is a raw score before the softmax; a score $m$ higher makes
# a token $e^m$ times more probable. Take a vocabulary of six tokens:
# padding, the correct token and four rivals. Padding gets probability
# 0, each rival a logit of 0, and the correct token a logit of $m$, its
# *margin* over the rivals. With smoothing 0.1, each rival's smoothed
# target is $0.1 / 4 = 0.025$.
#
# The model gives the correct token $q_y = e^m / (e^m + 4)$ and each
# rival $1 / (e^m + 4)$. Without smoothing, the loss is $-\log q_y =
# \log(1 + 4 e^{-m})$, which keeps falling as $m$ grows. With smoothing
# 0.1, the row's loss (the formula above) becomes $\log(e^m + 4) -
# 0.9\,m - 0.464$, where $-0.464 = 0.9 \ln 0.9 + 0.1 \ln 0.025$ (the
# $\sum_j p_j \log p_j$ of the smoothed target).
#
# The smoothed loss is lowest, and 0, where the model gives the correct
# token the smoothed target's 0.9: $e^m / (e^m + 4) = 0.9$, at $m = \ln
# 36 \approx 3.6$. Beyond that, more confidence costs loss. (At the
# whole-number margins the rows below use, the lowest is at $m = 4$,
# just above 0.)
#
# `label_smoothing_penalty_rows` computes both losses for the
# whole-number margins 0 to 24.


# %%
#| export
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


# %% [markdown]
# The asserts check the claims above: without smoothing the loss only
# falls, towards 0; with smoothing it is lowest at $m = 4$, the
# whole-number margin nearest the minimum at $\ln 36$, where the loss is
# 0. The chart draws the same rows.

# %%
rows = label_smoothing_penalty_rows()
unsmoothed = [r["loss"] for r in rows if r["smoothing"] == 0]
smooth = [r["loss"] for r in rows if r["smoothing"] > 0]
# falls (in float32 it reaches exactly 0 at large margins, hence >=)
assert all(a >= b for a, b in zip(unsmoothed, unsmoothed[1:]))
assert unsmoothed[-1] < 1e-3
lowest = smooth.index(min(smooth))  # margins start at 0: the index is m
print(f"without smoothing: {unsmoothed[0]:.3f} at m = 0")
print(f"with smoothing: lowest, {min(smooth):.4f}, at m = {lowest}")
print(f"ln 36 = {math.log(36):.2f}")
assert lowest == 4
at_ln_36 = label_smoothing_penalty_rows(margins=[math.log(36)])
smoothed_at_ln_36 = [r["loss"] for r in at_ln_36 if r["smoothing"] > 0]
assert abs(smoothed_at_ln_36[0]) < 1e-4  # 0, to float32's rounding
ls_chart = label_smoothing_penalty_chart(rows)
save_chart(ls_chart, "02_label_smoothing_penalty", FIGURES)

# %% [markdown]
# The loss computation puts the pieces together: the generator turns
# hidden states into log-probabilities, the criterion compares them with
# the targets, and the sum is divided by the number of real tokens. That
# division keeps the gradient's size the same whatever number of tokens
# a batch holds, so one learning rate suits every batch. It returns the
# loss twice:
#
# * `loss_sum`, the sum over tokens, for the epoch's mean loss only, so
#   it is cut off from autograd (`detach`). It stays a one-number
#   tensor: the loops add the sums up and turn the total into a Python
#   float once, at the end of the epoch. (On a GPU, each such turn makes
#   the CPU wait for the GPU's queued work, a *sync*.)
# * `loss_mean`, the mean per token: the training loops call
#   `.backward()` on it, and `run_epoch`'s log line prints it.


# %%
#| export
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


# %% [markdown]
# ## The training loop
#
# At its core, training is five lines per batch: run the model, compute
# the loss, back-propagate, let the optimizer update the weights, and
# clear the gradients for the next batch (PyTorch adds each backward
# pass's gradients into `.grad` rather than replacing them; gradient
# accumulation, at the end of this part, uses exactly that).
# `plain_epoch` runs them over one epoch's batches. It also steps the
# learning-rate schedule (the section after this one builds it) after
# each optimizer step, and adds up the loss so that it can return the
# epoch's mean loss per token.


# %%
def plain_epoch(batches, model, loss_compute, optimizer, scheduler=None):
    """The bare training loop: forward, loss, backward, step.
    Returns the epoch's mean loss per target token."""
    model.train()
    total_loss = 0.0
    total_tokens = 0
    for b in batches:
        out = model(b.src, b.tgt, b.src_mask, b.tgt_mask)  # (B, T, d_model)
        loss_sum, loss_mean = loss_compute(out, b.tgt_y, b.ntokens)
        loss_mean.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()  # the learning rate of the next step
        total_loss += loss_sum
        total_tokens += b.ntokens
    return float(total_loss) / total_tokens


# %% [markdown]
# This is all the copy task below needs. Longer runs need more: gradient
# accumulation (adding up the gradients of several batches before one
# step, to train on batches too large for memory), counters kept across
# epochs, and a log line now and then. The library's `run_epoch` adds
# them to these five lines; Part 3 trains with it. The last section of
# this part, "Under the hood: `run_epoch`", builds it one concern at a
# time and checks it against `plain_epoch`.

# %% [markdown]
# ## Optimizer and learning-rate schedule
#
# The paper trains with Adam ($\beta_1 = 0.9$, $\beta_2 = 0.98$, $\epsilon
# = 10^{-9}$). Adam keeps, for each weight, a running average of its
# gradient (decaying by $\beta_1$ per step) and of its squared gradient
# (decaying by $\beta_2$), and moves the weight by the learning rate
# times the first, divided by the square root of the second; a larger
# $\beta_2$ averages over more steps. This $\epsilon$ (not label
# smoothing's) only keeps the division away from zero. The learning rate
# rises linearly for `warmup` steps and then decays with the inverse
# square root of the step:
#
# $$lrate = d_{\text{model}}^{-0.5} \cdot \min\left(step^{-0.5},\; step
# \cdot warmup^{-1.5}\right).$$
#
# The two terms are equal at $step = warmup$, so the peak is $d_{\text{
# model}}^{-0.5} \cdot warmup^{-0.5}$. Wider models get smaller steps.
# `factor` multiplies the whole curve; it is 1 in the paper, and Part 3's
# recipes set their own.
#
# Why warm up at all? Adam's running averages start from a few
# gradients, so its first steps are its noisiest, and a warm-up keeps
# them small. That is why we keep one. Part 1's pre-norm blocks need
# less of it (Xiong et al., 2020, cited there), so our recipes' warm-ups
# are shorter than the paper's.
#
# In code, a schedule is a function of the optimizer step, handed to
# PyTorch's `torch.optim.lr_scheduler.LambdaLR`. `LambdaLR` sets the
# learning rate to the optimizer's `lr` times the function's value, so an
# optimizer created with `lr=1.0` runs at exactly the function's value.
# `LambdaLR` numbers the optimizer steps from 0: it calls the function
# with 0 when it is created, and that rate serves the first step. The
# formula has no value at step 0 ($0^{-0.5}$), so `rate` treats step 0 as
# step 1.
#
# `make_optimizer` builds the pair. Given `d_model`, and otherwise with
# its defaults, it comes down to these two statements:
#
# ```python
# optimizer = torch.optim.Adam(
#     model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9
# )
# scheduler = LambdaLR(
#     optimizer, lambda step: rate(step, d_model, factor, warmup)
# )
# ```
#
# Its other arguments change one piece each:
#
# * `betas`, Adam's $\beta_1$ and $\beta_2$; the copy task below passes
#   its own;
# * `schedule`, a function of the step that replaces `rate`; the copy
#   task passes a shorter schedule, and Part 3 its run's schedule;
# * `weight_decay`: above 0, AdamW instead of Adam, which also shrinks
#   every weight a little at each step (its docstring says how). This
#   part leaves it at 0; Part 3's recipes can set it.
#
# It also asks for `fused=True`, the same update computed in one pass
# over the parameters, where every parameter is on a CPU or a CUDA GPU.


# %%
#| export
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


# %% [markdown]
# The chart below draws `rate` for three settings. Each curve peaks at its
# warm-up step, where the rate is the peak formula above. Doubling the
# warm-up divides the peak by $\sqrt 2$, and halving $d_{\text{model}}$
# multiplies every value by $\sqrt 2$. The asserts check all four
# statements.

# %%
SETTINGS = ((512, 4000), (512, 8000), (256, 4000))  # (d_model, warmup)
for d_model, warmup in SETTINGS:
    lrs = [rate(step, d_model, 1.0, warmup) for step in range(1, 3 * warmup)]
    peak_step = lrs.index(max(lrs)) + 1  # lrs[0] is step 1
    assert peak_step == warmup
    assert math.isclose(lrs[peak_step - 1], d_model**-0.5 * warmup**-0.5)
peak_4000 = rate(4000, 512, 1.0, 4000)
peak_8000 = rate(8000, 512, 1.0, 8000)
assert math.isclose(peak_8000 * math.sqrt(2), peak_4000)
for step in range(1, 20000, 100):
    half_width = rate(step, 256, 1.0, 4000)
    assert math.isclose(half_width, math.sqrt(2) * rate(step, 512, 1.0, 4000))
lr_chart = learning_rate_chart(SETTINGS, schedule=rate)
save_chart(lr_chart, "02_learning_rate", FIGURES)

# %% [markdown]
# ## A first example: the copy task
#
# Everything is in place to train a model on the copy task: the batches
# from `data_gen`, the loss, `plain_epoch`, and the optimizer. The plan is a
# fixed budget of 400 optimizer steps, then a check on sequences the model
# has never seen. The check needs a way to get output from the model, so
# decoding comes first.
#
# ### Greedy decoding
#
# To copy (or translate), encode the source once and then grow the output
# one token at a time, always taking the most probable next token. This
# is the simplest version: it re-runs the decoder over the whole prefix at
# every step and always returns `max_len` tokens, for a whole batch at
# once: the start symbol it is given, then `max_len - 1` predicted ones.
# Part 3 adds a version that stops at the end-of-sentence token and
# Part 5 one that caches past keys and values.


# %%
#| export
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


# %% [markdown]
# ### Does it copy?
#
# A model copies a sequence when greedy decoding gives it back unchanged,
# all ten tokens: the start symbol, which it is given, and the nine it
# predicts. `copy_accuracy` draws `n` fresh random sequences from
# `data_gen` and returns the fraction that come back exactly. It decodes
# in evaluation mode (dropout off) and then puts the model back in the
# mode it found it in.


# %%
#| export
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


# %% [markdown]
# ### The recipe
#
# The copy model has the size of the 2022 tutorial's copy example: $N=2$
# layers with $d_{\text{model}}=512$, $d_{ff}=2048$ and $h=8$. Its
# training differs from the paper's in five ways, because the task is tiny
# and every batch is new random data:
#
# * **A short schedule.** The paper's schedule is built for 100,000 steps;
#   this task needs a few hundred. `warmup_linear_decay` takes the lower
#   of two straight lines: one rising to a peak of $3 \cdot 10^{-4}$ over
#   `warmup` = 20 steps, one falling from that peak at step 0 towards 0
#   at `total` = 300 steps. The rate never goes below a floor of 2% of
#   the peak, which it reaches at step 294 (the next cell shows where).
#   The remaining 106 steps of the 400-step budget, at the floor, are a
#   margin.
#
#   The rising line uses `step + 1`: `LambdaLR` calls the first optimizer
#   step step 0, and a plain `step` would give it a learning rate of 0,
#   a wasted step. In our sweeps this schedule learned to copy in well
#   under half the steps of `rate`, the paper's formula (with a factor of
#   0.1 and a 10-step warm-up).
# * **Small batches** of 16 sequences: what this task needs is many
#   optimizer steps more than many sequences, so small batches buy more
#   steps for the same sequences. In our sweep, batches of 32 (at a
#   peak of $4 \cdot 10^{-4}$) needed 231 steps against 255 for 16 (at
#   $3 \cdot 10^{-4}$), but each cost almost twice as much: about 49 s
#   against 28 s. Batches of 8 needed 463 steps.
# * **No dropout**: with fresh data in every batch, the model cannot
#   memorize its training set.
# * **No label smoothing**: the right next token is certain.
# * **Adam's $\beta_2$ is 0.999** (PyTorch's default), not the paper's
#   0.98: it averages the squared gradients over more steps, and in a
#   sweep (of a smaller model, on the paper's schedule) it cut the steps
#   to an exact copy by about 40%.
#
# The budget is fixed: 20 epochs of 20 optimizer steps, 400 steps and 6,400
# sequences in all. (With fresh random data there is no data set to pass over:
# an epoch here is just 20 batches, a unit for reporting.)
#
# The sweeps behind these choices, with their step counts and times for
# each seed and setting, are in [bench/RESULTS.md, "How the defaults were
# chosen"](../bench/RESULTS.md#how-the-defaults-were-chosen). They ran
# on one thread, in bfloat16 (a 16-bit float format), and stopped as
# soon as the model copied 200 sequences in a row exactly, so they show
# which way each choice helps, not its exact gain in this lesson's fixed
# budget.


# %%
#| export
def warmup_linear_decay(step, peak, warmup, total, floor=0.02):
    """Linear warm-up to `peak`, then linear decay to `floor * peak`."""
    ramp = (step + 1) / warmup
    decay = max(floor, 1 - step / total)
    return peak * min(ramp, decay)


# %% [markdown]
# The schedule as described. Because the falling line is already falling
# during the warm-up, the two cross just below the nominal peak: the
# highest rate used is 94% of it, at step 18. The rate then falls at every
# step until it reaches the floor, 2% of the peak, at step 294, and stays
# there. (Steps count from 0, as `LambdaLR` counts them, so step 18 is
# the 19th.)

# %%
lrs = [warmup_linear_decay(step, 3e-4, 20, 300) for step in range(400)]
top = lrs.index(max(lrs))
print(f"highest rate: {lrs[top] / 3e-4:.0%} of the peak, at step {top}")
floor_lr = 0.02 * 3e-4
at_floor = [i for i, lr in enumerate(lrs) if math.isclose(lr, floor_lr)]
first, last = at_floor[0], at_floor[-1]
print(f"at the floor (2% of the peak) from step {first} to step {last}")
above = lrs[first - 1] / 3e-4  # the last step above the floor
end = lrs[-1] / 3e-4
print(f"step {first - 1}: {above:.1%} of the peak; step 399: {end:.1%}")
assert top == 18
assert math.isclose(lrs[top], 0.94 * 3e-4)
assert all(a > b for a, b in zip(lrs[top:294], lrs[top + 1 : 295]))
assert at_floor == list(range(294, 400))  # from step 294 to the end

# %% [markdown]
# ### Training
#
# Everything the run needs is now defined: the model (Part 1's
# `make_model`), the loss (`LabelSmoothing` with a smoothing of 0), Adam
# with the short schedule, and the data (`data_gen`). Adam and its
# `LambdaLR` come from `make_optimizer`, with Adam's $\beta_2$ at 0.999 and
# the short schedule, `copy_schedule`, in place of the paper's. Since
# Adam's `lr` is 1.0, the learning rate for optimizer step $s$ is
# exactly `copy_schedule(s)`: the cell checks it for the first step, and
# the cell after training for the step after the last.

# %%
V = 11  # 0 is padding, 1 the start symbol, 2 to 10 the data
sizes = dict(N=2, d_model=512, d_ff=2048, h=8)
peak_lr = 3e-4
if AT_SIZE == "ci":  # the tests' smaller model; you can skip these lines
    # Its peak was chosen so that it learns within the tests' budget.
    sizes = dict(N=1, d_model=64, d_ff=256, h=4)
    peak_lr = 3e-3


def copy_schedule(step):
    """The copy task's learning rate at an optimizer step."""
    return warmup_linear_decay(step, peak_lr, warmup=20, total=300)


torch.manual_seed(0)
copy_model = make_model(V, V, dropout=0.0, **sizes)
criterion = LabelSmoothing(V, padding_idx=COPY_PAD, smoothing=0.0)
loss_compute = SimpleLossCompute(copy_model.generator, criterion)
optimizer, scheduler = make_optimizer(
    copy_model, betas=(0.9, 0.999), schedule=copy_schedule
)
assert optimizer.param_groups[0]["lr"] == copy_schedule(0)  # step 0's

# %% [markdown]
# Before training, the check must fail. The held-out sequences come from
# their own generator, `held_out()`, with a fixed seed, so calling it
# again after training draws the same 1,000 sequences: before and after
# are measured on the same test. Its seed, 12345, differs from the
# training data's (0, in the training cell below); a cell below checks
# that no held-out sequence was trained on.


# %%
def held_out():
    """A generator that draws the same held-out sequences every time."""
    return torch.Generator().manual_seed(12345)


before = copy_accuracy(copy_model, 1000, V, generator=held_out())
print(f"untrained: {before:.1%} of 1,000 held-out sequences copied")
assert before < 0.01

# %% [markdown]
# The loop is `plain_epoch` over 20 fresh batches per epoch, with one
# line of log per epoch: the optimizer steps so far (`LambdaLR` counts
# them in `scheduler.last_epoch`, which despite its name counts steps
# here), the epoch's mean loss per token, and the time so far. Each
# batch's loss is computed before the optimizer learns from that batch, so
# the printed loss is measured on data the model had not yet seen.

# %%
EPOCHS = 20
STEPS_PER_EPOCH = 20
BATCH_SIZE = 16

training_data = torch.Generator().manual_seed(0)
losses = []
start = time.time()
for epoch in range(EPOCHS):
    batches = data_gen(V, BATCH_SIZE, STEPS_PER_EPOCH, generator=training_data)
    loss = plain_epoch(batches, copy_model, loss_compute, optimizer, scheduler)
    losses.append(loss)
    seconds = time.time() - start
    steps = scheduler.last_epoch  # optimizer steps so far
    print(
        f"epoch {epoch:2d} | optimizer steps {steps:3d} | "
        f"loss {loss:.4f} | {seconds:5.1f} s"
    )

# %% [markdown]
# The run took the 400 steps it was given. Is its final loss low? The
# loss is in nats per token (natural logarithms). With a smoothing of 0
# it is the cross-entropy, so a model that is always right and sure
# scores 0. For a scale, take a model that has learned only that the
# answer is one of the 9 data tokens and guesses among them evenly: it
# scores $\ln 9$. The cell computes that guess with the run's own
# criterion, and prints it next to the first and last epochs' losses.
# The last must be under 1/100 of the guess.

# %%
print(f"{steps} optimizer steps in {seconds:.1f} s")
assert steps == EPOCHS * STEPS_PER_EPOCH
assert optimizer.param_groups[0]["lr"] == copy_schedule(steps)  # next
data_tokens = V - 2  # all but padding and the start symbol
guess = torch.zeros(1, V)  # equal logits: equal probabilities
guess[0, :2] = -1e4  # padding and the start symbol get probability 0
target_token = torch.tensor([2])  # any data token gives the same loss
guess_loss = criterion(guess.log_softmax(-1), target_token).item()
print(f"an even guess among {data_tokens} data tokens: {guess_loss:.3f}")
print(f"ln {data_tokens} = {math.log(data_tokens):.3f}")
print(f"the run: {losses[0]:.4f} in epoch 0, {losses[-1]:.4f} in the last")
assert math.isclose(guess_loss, math.log(data_tokens), rel_tol=1e-5)
assert losses[-1] < guess_loss / 100

# %% [markdown]
# ### The check: does it copy now?
#
# First one sequence, the tokens 2 to 10 in order, with its mask from a
# source-only `Batch` (no padding, so it hides nothing). It comes back
# unchanged:

# %%
src = torch.tensor([[COPY_START, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
src_mask = Batch(src, pad=COPY_PAD).src_mask  # (1, 1, 10): all True
copy_model.eval()
with torch.no_grad():
    out = greedy_decode(copy_model, src, src_mask, 10, COPY_START)
print(out)
assert torch.equal(out, src)

# %% [markdown]
# Then the same 1,000 held-out sequences as before training, of which at
# least 99% must come back exactly:

# %%
accuracy = copy_accuracy(copy_model, 1000, V, generator=held_out())
print(f"trained: {accuracy:.1%} of 1,000 held-out sequences copied")
assert accuracy >= 0.99

# %% [markdown]
# No held-out sequence was a training sequence. The next cell replays the
# training data to check it, which would catch a seeding bug, such as
# drawing the held-out sequences from the training data's generator.
# (By chance, an overlap is unlikely: there are $9^9$, about 387 million,
# possible sequences.)

# %%
trained_on = set()
replay = torch.Generator().manual_seed(0)  # the training data, again
n_batches = EPOCHS * STEPS_PER_EPOCH
for batch in data_gen(V, BATCH_SIZE, n_batches, generator=replay):
    trained_on.update(tuple(row) for row in batch.src.tolist())
test_batch = next(data_gen(V, 1000, 1, generator=held_out()))
tested = {tuple(row) for row in test_batch.src.tolist()}
overlap = trained_on & tested
print(f"{len(trained_on):,} distinct training sequences")
print(f"held-out sequences among them: {len(overlap)} of {len(tested):,}")
assert not overlap

# %% [markdown]
# The copy task can also be trained until it copies, rather than for a
# fixed budget: the appendix (notebook 06_tools, "Copy-task runs") stops as
# soon as the model copies sequences it has never seen, and
# `bench/copy_task.py` times that.
#
# Part 3 (notebook 03_multi30k) trains the same architecture on real
# German and English sentences, with the library's `run_epoch`. The last
# section of this part builds it; you can read it now or when Part 3
# calls it.


# %% [markdown]
# ## Under the hood: `run_epoch`
#
# The library's `run_epoch` runs `plain_epoch`'s five lines, plus what
# longer runs need, and returns the average loss per token (with the
# counters below). One difference: it does not call `model.train()`,
# because it also evaluates; its caller sets the mode. The next cells
# add one concern at a time: gradient accumulation, counters and
# logging. Part 3's translation runs need them.
#
# ### Gradient accumulation
#
# Gradient accumulation trains as if on a batch too large for memory. It
# splits that batch into $k$ *micro-batches* (`accum_iter = k`), which
# run one after the other. Each micro-batch's loss is divided by $k$
# before its backward pass, PyTorch adds the $k$ gradients up in
# `.grad`, and then the optimizer and the schedule step once.
#
# The result is exactly the large batch's gradient when every
# micro-batch has the same number of real tokens, as in the copy task.
# Otherwise it is not, because each micro-batch's loss is a mean over
# its own tokens. Take micro-batch A with 2 real tokens and a summed
# loss of 2 (a mean of 1.0), and B with 8 tokens and a sum of 4 (a mean
# of 0.5). Accumulation averages the two means, $(1.0 + 0.5) / 2 =
# 0.75$; the large batch would give $6 / 10 = 0.6$. Each of A's tokens
# counts four times as much as each of B's ($1/2$ against $1/8$ of its
# micro-batch's mean).
#
# `run_epoch` keeps this behaviour and does not correct for it: an exact
# mean would divide every micro-batch's summed loss by the whole group's
# token count, known only once the group's last micro-batch has been
# read. The only effect is on how much each token weighs in a step's
# gradient; the loss still falls. Part 3 trains with `accum_iter = 1`
# unless a run sets it: one micro-batch per step, where the question
# does not arise.
#
# When the number of batches is not a multiple of $k$, the last group has
# fewer micro-batches. `run_epoch` still steps on it, with its gradients
# rescaled to a mean over the group. If it did not step, those gradients
# would stay in `.grad` and be added to the next epoch's first step.
#
# ### Counters
#
# `TrainState` keeps four counters across epochs, under the names they had
# in the 2022 Harvard Annotated Transformer, the tutorial this project
# rewrites: `step` counts micro-batches, `accum_step` optimizer steps,
# `samples` sequences and `tokens` target tokens. Careful: everywhere else
# in this part, "step" means an optimizer step, which is `accum_step` here.
#
# `scheduler` is the learning-rate schedule of "Optimizer and
# learning-rate schedule" above. It keeps its own count of optimizer
# steps (`scheduler.last_epoch`), which over a run matches `accum_step`;
# the last check of this part asserts it.


# %%
#| export
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


# %% [markdown]
# To step on a short last group, `run_epoch` must know which batch is the
# last. `with_last_flag` yields each batch with a flag, true only for the
# last one, by looking one batch ahead.


# %%
#| export
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


# %% [markdown]
# `optimizer_step` ends a group: it multiplies the gradients by `scale`
# (more than 1 after a short group, as `run_epoch` below explains), steps
# the optimizer, clears the gradients and steps the schedule. `scaler`, a
# float16 GPU run's `GradScaler`, steps the optimizer in its stead (the
# appendix explains it); in this part it is `None`, so only the first
# branch of the `if scaler` runs.


# %%
#| export
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


# %% [markdown]
# ### One micro-batch
#
# `micro_step` is the plain loop's forward, loss and backward, with the
# loss divided by `accum_iter`. It returns `SimpleLossCompute`'s two
# losses: `loss_sum`, for the epoch's total, and `loss_mean`, the mean
# per token, which it calls `.backward()` on (divided by `accum_iter`)
# and which `run_epoch`'s log prints. In this part `autocast` does
# nothing, `scaler` is `None` and there is one process, so it comes down
# to three lines:
#
# ```python
# out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
# loss_sum, loss_mean = loss_compute(out, batch.tgt_y, batch.ntokens)
# (loss_mean / accum_iter).backward()
# ```
#
# When autograd is off (`mode="eval"` below), `micro_step` skips the
# backward pass. The rest serves the appendix's GPU and multi-process
# runs, which this part never makes, so a first read can skip it:
# `autocast` computes in 16 bits, `scaler` guards float16 gradients, and
# `hold_sync` asks DDP (several processes, each training a copy of the
# model) to delay the exchange of gradients until the last micro-batch
# of a group. The appendix (notebook 06_tools, "A run, in pieces")
# explains them.


# %%
#| export
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


# %% [markdown]
# ### `run_epoch`
#
# With these pieces the epoch stays short. It has three modes: `"train"`
# (the default), `"train+log"` (train and print) and `"eval"` (no
# gradients, no steps). `mode="eval"` turns autograd off
# (`torch.set_grad_enabled(False)`, the same as `torch.no_grad()`) and
# never steps; `mode="train+log"` prints progress every `log_every`
# micro-batches, one line from `print_progress`: the batch's index in
# this epoch, the optimizer steps so far, the batch's loss per token,
# tokens per second and the learning rate that the next optimizer step
# will use. Any other mode, or training without an optimizer, is refused
# before the first batch.


# %%
#| export
def print_progress(i, state, loss_mean, speed, optimizer):
    """One log line of run_epoch's "train+log" mode."""
    lr = optimizer.param_groups[0]["lr"]
    print(
        f"batch {i:5d} | optimizer steps {state.accum_step:5d} | loss "
        f"{loss_mean.item():6.3f} | {speed:7.1f} tok/s | lr {lr:6.1e}"
    )


# %% [markdown]
# The epoch itself. `window` counts the micro-batches since the last
# optimizer step; a step is due when the window is full, or at the last
# batch. Each loss was divided by `accum_iter`, so a short window of $w$
# batches holds only $w / k$ of a mean gradient ($k$ = `accum_iter`);
# multiplying by $k / w$ restores it. The loss total stays a tensor until
# the end of the epoch (no sync).
#
# Whether a step is due, `steps_now`, is decided *before* the
# micro-batch runs, not after, because `micro_step` needs it during its
# backward pass: with several processes, every micro-batch but a group's
# last keeps its gradients local (`hold_sync`). In this part's runs
# (one process, 32-bit floats), `hold_sync`, `autocast` and `scaler`
# change nothing.
#
# It logs when `(i - 1) % log_every == 0`, counting batches from 0:
# batch 1 (the second), then 41, 81, ... with the default 40, as the
# 2022 tutorial did, so that logs compare line for line with it; and
# every batch when `log_every` is 1.


# %%
#| export
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


# %% [markdown]
# Three checks against the plain loop follow, on tiny float64 models.
# Accumulation adds gradients in another order than one large batch
# does; in float32 that changes the last digits, in float64 the
# difference stays near $10^{-15}$. The loops should agree to within that
# rounding (the asserts allow $10^{-12}$), since every copy-task batch has
# the same number of real tokens (no padding).
#
# `trained_weights` trains a fresh tiny model for one epoch with a given
# loop and returns its weights, flattened, so that two loops can be
# compared; `largest_difference` measures how far apart two such weight
# vectors are. It uses plain SGD, which moves each weight by the learning
# rate times its gradient, so a gradient twice too large gives a step
# twice too large and shows in the weights. (Adam divides each gradient
# by its own running size, which would hide such a bug.) It uses no
# dropout, so that both runs are deterministic.


# %%
def trained_weights(epoch_fn, batches):
    """Flat weights of a fresh tiny float64 model after one epoch_fn."""
    torch.manual_seed(0)
    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2, dropout=0.0)
    model = model.double()
    # Smoothing 0.1, as Part 3 trains: the loss Part 3 will accumulate.
    crit = LabelSmoothing(11, COPY_PAD, smoothing=0.1)
    loss_compute = SimpleLossCompute(model.generator, crit)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # run_epoch can stand in for plain_epoch: its first four arguments are
    # the same, and a fresh model is already in training mode, so the
    # model.train() that run_epoch leaves out changes nothing.
    epoch_fn(batches, model, loss_compute, optimizer)
    return torch.cat([p.flatten() for p in model.parameters()])


def largest_difference(a, b):
    """The largest absolute difference between two weight vectors."""
    return (a - b).abs().max().item()


# %% [markdown]
# The data: four micro-batches of 4 copy-task sequences, and the same 16
# sequences paired up into two batches of 8.

# %%
rng = torch.Generator().manual_seed(0)
micro = list(data_gen(V=11, batch_size=4, nbatches=4, generator=rng))
# Micro-batches 0 and 1 make the first pair, 2 and 3 the second.
pairs = [
    torch.cat([micro[0].src, micro[1].src]),  # (8, 10)
    torch.cat([micro[2].src, micro[3].src]),  # (8, 10)
]
doubled = [Batch(src, src.clone(), pad=COPY_PAD) for src in pairs]

# %% [markdown]
# First check: with `accum_iter=1`, `run_epoch` must train exactly like
# `plain_epoch`.

# %%
plain_weights = trained_weights(plain_epoch, micro)
run_weights = trained_weights(run_epoch, micro)
gap = largest_difference(run_weights, plain_weights)
print(f"run_epoch vs plain_epoch: largest difference {gap:.1e}")
assert gap < 1e-12

# %% [markdown]
# Second: with `accum_iter=2`, the four micro-batches must give the same
# weights as the plain loop on the two double batches. `partial` fixes
# `accum_iter=2`, so that `trained_weights` can call the result as it
# calls `plain_epoch`. The last assert checks that the two double batches
# give other weights than the four micro-batches trained one by one;
# otherwise the first assert would prove nothing.

# %%
from functools import partial

accumulate = partial(run_epoch, accum_iter=2)
accumulated = trained_weights(accumulate, micro)
doubled_weights = trained_weights(plain_epoch, doubled)
same = largest_difference(accumulated, doubled_weights)
print(f"accumulated vs double batches: largest difference {same:.1e}")
other = largest_difference(plain_weights, doubled_weights)
print(f"one by one vs double batches: largest difference {other:.1e}")
assert same < 1e-12
assert other > 1e-6  # far above rounding: the pairing changes training

# %% [markdown]
# Third: with `accum_iter=2`, three micro-batches make one full group
# (`micro[0]` and `micro[1]`) and a group of one (`micro[2]`). The result
# must equal the plain loop on `doubled[0]`, then `micro[2]` alone. The
# last assert checks that `micro[2]` changed the weights.

# %%
short_last = trained_weights(plain_epoch, [doubled[0], micro[2]])
accumulated = trained_weights(accumulate, micro[:3])
first_only = trained_weights(plain_epoch, doubled[:1])
same = largest_difference(accumulated, short_last)
print(f"accumulated vs plain loop: largest difference {same:.1e}")
other = largest_difference(short_last, first_only)
print(f"with vs without micro[2]: largest difference {other:.1e}")
assert same < 1e-12
assert other > 1e-6  # the third batch counts

# %% [markdown]
# Last, the counters and the log. With `accum_iter=2`, the four
# micro-batches of 4 sequences make two optimizer steps, so `step` ends
# at 4, `accum_step` at 2, `samples` at 16, and `tokens` at 144: each
# sequence has 9 tokens to predict, none of them padding. `"train+log"`
# with `log_every=1` prints a line for every micro-batch. A second epoch
# given the returned state continues its counts; `"eval"` changes none.
# A schedule that keeps the rate at 0.5 (a factor of 1) only counts the
# optimizer steps, which must match `accum_step`.

# %%
torch.manual_seed(0)
tiny = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2, dropout=0.0)
tiny_criterion = LabelSmoothing(11, COPY_PAD, smoothing=0.1)
tiny_loss = SimpleLossCompute(tiny.generator, tiny_criterion)
sgd = torch.optim.SGD(tiny.parameters(), lr=0.5)
counting = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)
_, state = run_epoch(
    micro,
    tiny,
    tiny_loss,
    sgd,
    counting,
    mode="train+log",
    accum_iter=2,
    log_every=1,
)
print(state)
assert (state.step, state.accum_step, state.samples) == (4, 2, 16)
assert state.tokens == 16 * 9
_, state = run_epoch(
    micro,
    tiny,
    tiny_loss,
    sgd,
    counting,
    accum_iter=2,
    train_state=state,
)
assert (state.step, state.accum_step, state.tokens) == (8, 4, 32 * 9)
assert counting.last_epoch == state.accum_step  # the schedule's count
tiny.eval()
_, state = run_epoch(micro, tiny, tiny_loss, mode="eval", train_state=state)
assert (state.step, state.accum_step, state.tokens) == (8, 4, 32 * 9)
