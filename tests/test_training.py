"""Tests of training (notebooks/02_training.py): schedule, label smoothing,
batches, the training loop and the copy task."""

import copy
import math

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------ learning-rate rate
@pytest.mark.parametrize(
    "d_model, factor, warmup", [(512, 1.0, 4000), (256, 2.0, 400)]
)
def test_rate_peaks_at_warmup_with_closed_form_value(d_model, factor, warmup):
    steps = range(1, 3 * warmup)
    lrs = [tat.rate(s, d_model, factor, warmup) for s in steps]
    peak = max(range(len(lrs)), key=lrs.__getitem__)
    assert steps[peak] == warmup
    expected = factor * d_model**-0.5 * warmup**-0.5
    assert lrs[peak] == pytest.approx(expected, rel=1e-12)
    before, after = lrs[: peak + 1], lrs[peak:]
    assert all(a < b for a, b in zip(before, before[1:]))
    assert all(a > b for a, b in zip(after, after[1:]))
    assert tat.rate(0, d_model, factor, warmup) == tat.rate(
        1, d_model, factor, warmup
    )


def test_make_optimizer_follows_the_schedule():
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    opt, sched = tat.make_optimizer(model, 16, factor=2.0, warmup=5)
    assert opt.param_groups[0]["betas"] == (0.9, 0.98)
    for step in range(1, 12):
        expected = 2.0 * 16**-0.5 * min(step**-0.5, step * 5**-1.5)
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(expected)
    opt, _ = tat.make_optimizer(model, 16, betas=(0.9, 0.999))
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)


def test_make_optimizer_needs_d_model_or_a_schedule():
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="d_model"):
        tat.make_optimizer(model)
    opt, sched = tat.make_optimizer(model, schedule=lambda step: 0.5)
    assert opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize(
    "log_every, batches, logged",
    [(40, 50, [1, 41]), (1, 3, [0, 1, 2]), (2, 6, [1, 3, 5])],
)
def test_train_and_log_prints_batch_1_then_every_log_every(
    log_every, batches, logged, capsys
):
    """The 2022 tutorial's rhythm (batch 1, 41, 81, ... for 40), and a
    line for every batch when log_every is 1."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    criterion = tat.LabelSmoothing(11, padding_idx=0)
    loss = tat.SimpleLossCompute(model.generator, criterion)
    optimizer, scheduler = tat.make_optimizer(model, 16, warmup=5)
    data = tat.data_gen(11, 2, batches, generator=torch.Generator())
    tat.run_epoch(
        data,
        model,
        loss,
        optimizer,
        scheduler,
        "train+log",
        log_every=log_every,
    )
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split()[1]) for line in lines] == logged


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_is_fused_on_the_cpu_and_plain_elsewhere(weight_decay):
    """make_optimizer asks for fused Adam on CPU and CUDA tensors only;
    on any other device (Apple's MPS on a Mac; the meta device stands in
    for it here, since this machine has no MPS) Adam runs its default
    way."""
    on_cpu = torch.nn.Linear(4, 3)
    opt, _ = tat.make_optimizer(on_cpu, 16, weight_decay=weight_decay)
    assert opt.defaults["fused"] is True
    elsewhere = torch.nn.Linear(4, 3, device="meta")
    opt, _ = tat.make_optimizer(elsewhere, 16, weight_decay=weight_decay)
    assert not opt.defaults["fused"]


def test_weight_decay_makes_it_adamw_and_shrinks_weights_apart():
    """AdamW's decoupled decay: with a zero gradient Adam's own step is
    zero, so one step multiplies each weight by 1 - lr * weight_decay."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    plain, _ = tat.make_optimizer(model, 16, warmup=5)
    assert type(plain) is torch.optim.Adam
    assert plain.param_groups[0]["weight_decay"] == 0
    opt, sched = tat.make_optimizer(model, 16, warmup=5, weight_decay=0.1)
    assert type(opt) is torch.optim.AdamW
    before = [p.detach().clone() for p in model.parameters()]
    lr = opt.param_groups[0]["lr"]
    assert lr == pytest.approx(tat.rate(1, 16, 1.0, 5))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for old, new in zip(before, model.parameters(), strict=True):
        torch.testing.assert_close(new.detach(), old * (1 - lr * 0.1))


def test_a_run_config_with_weight_decay_builds_adamw():
    for schedule in ("noam", "linear"):
        config = tools.get_config("ci", schedule=schedule, weight_decay=0.05)
        model = torch.nn.Linear(2, 2)
        opt, _ = tat.make_run_optimizer(model, config, 5)
        assert type(opt) is torch.optim.AdamW
        assert opt.param_groups[0]["weight_decay"] == 0.05
    opt, _ = tat.make_run_optimizer(model, tools.get_config("ci"), 5)
    assert type(opt) is torch.optim.Adam


# --------------------------------------------------------- label smoothing
def test_label_smoothing_targets():
    V, pad, eps = 7, 0, 0.3
    crit = tat.LabelSmoothing(V, padding_idx=pad, smoothing=eps)
    target = torch.tensor([3, 1, 0, 6, 0, 2])
    dist = crit.smoothed_targets(target)
    real = target != pad
    torch.testing.assert_close(dist[real].sum(1), torch.ones(int(real.sum())))
    assert (dist[:, pad] == 0).all()
    assert (dist[~real] == 0).all()
    for row, t in zip(dist[real], target[real]):
        assert row[t] == pytest.approx(1 - eps)
        others = [row[j] for j in range(V) if j not in (pad, int(t))]
        assert all(o == pytest.approx(eps / (V - 2)) for o in others)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.4])
def test_label_smoothing_loss_equals_independent_kl(eps):
    torch.manual_seed(0)
    V, pad = 6, 0
    crit = tat.LabelSmoothing(V, padding_idx=pad, smoothing=eps)
    x = torch.randn(5, V).log_softmax(-1)
    target = torch.tensor([2, 0, 5, 1, 3])
    loss = crit(x, target)
    ref = 0.0
    for i, t in enumerate(target.tolist()):
        if t == pad:
            continue
        for j in range(V):
            if j == pad:
                continue
            p = 1 - eps if j == t else eps / (V - 2)
            if p > 0:
                ref += p * (math.log(p) - float(x[i, j]))
    assert float(loss) == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.4])
@pytest.mark.parametrize("keep_targets", [False, True])
def test_both_label_smoothing_paths_equal_independent_kl(eps, keep_targets):
    # The closed form (default) and the target matrix against PyTorch's
    # own kl_div on a hand-built distribution, values and gradients.
    torch.manual_seed(1)
    V, pad = 9, 2
    x = torch.randn(7, V, dtype=torch.float64).log_softmax(-1)
    x.requires_grad_(True)
    target = torch.tensor([3, 2, 8, 0, 2, 5, 1])
    dist = torch.full((7, V), eps / (V - 2), dtype=torch.float64)
    dist[torch.arange(7), target] = 1 - eps
    dist[:, pad] = 0
    dist[target == pad] = 0
    ref = torch.nn.functional.kl_div(x, dist, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, x)
    crit = tat.LabelSmoothing(V, pad, eps, keep_targets=keep_targets)
    loss = crit(x, target)
    (grad,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    # As in 2022, the smoothed targets are there after a call, either way.
    torch.testing.assert_close(crit.true_dist, dist)


def test_true_dist_after_a_call_as_in_2022():
    # The 2022 tutorial's example: LabelSmoothing(5, 0, 0.4) on five rows.
    crit = tat.LabelSmoothing(5, 0, 0.4)
    assert crit.true_dist is None  # no call yet
    predict = torch.tensor([[0, 0.2, 0.7, 0.1, 0]] * 5)
    crit(predict.log(), torch.tensor([2, 1, 0, 3, 3]))
    # What the 2022 code computed, step by step.
    expected = predict.clone().fill_(0.4 / (5 - 2))
    expected.scatter_(1, torch.tensor([[2], [1], [0], [3], [3]]), 0.6)
    expected[:, 0] = 0
    expected.index_fill_(0, torch.tensor([2]), 0.0)
    torch.testing.assert_close(crit.true_dist, expected)


def test_bfloat16_log_probs_give_a_float32_loss():
    """CPU autocast hands the loss bf16 log-probs; its sums keep 3 digits.

    Multi30k's size: a 3,000-token batch over 6,190 English words. Summed
    in bfloat16 the loss was off by about 1 part in 1,000.
    """
    torch.manual_seed(0)
    logp = (torch.randn(3000, 6190) * 3).log_softmax(-1).bfloat16()
    target = torch.randint(3, 6190, (3000,))
    target[:300] = tat.PAD  # padding rows count for nothing
    crit = tat.LabelSmoothing(6190, tat.PAD, 0.1)
    loss = crit(logp, target)
    exact = crit(logp.double(), target)  # the same bf16 values, in float64
    assert loss.dtype == torch.float32
    assert abs(loss.item() / exact.item() - 1) < 1e-6


def test_label_smoothing_penalty_rows_are_finite_with_the_right_shape():
    rows = tat.label_smoothing_penalty_rows(smoothing=0.1)
    assert all(math.isfinite(r["loss"]) for r in rows)
    curves = {}
    for r in rows:
        curves.setdefault(r["smoothing"], []).append(r["loss"])
    plain, smooth = curves[0.0], curves[0.1]
    assert all(b <= a for a, b in zip(plain, plain[1:]))
    assert plain[-1] < plain[0]
    best = min(range(len(smooth)), key=smooth.__getitem__)
    assert 0 < best < len(smooth) - 1
    assert smooth[-1] > smooth[best] + 0.1


# ------------------------------------------------------------------ charts
@pytest.mark.parametrize(
    "make_chart",
    [
        tools.learning_rate_chart,
        tools.label_smoothing_penalty_chart,
        lambda: tools.mask_chart(tat.subsequent_mask(6)[0]),
        lambda: tools.positional_chart(torch.randn(30, 8), dims=(0, 3)),
    ],
)
def test_charts_render_to_png_and_svg(make_chart, tmp_path):
    pytest.importorskip("altair")
    pytest.importorskip("vl_convert")
    chart = make_chart()
    chart.to_dict()  # validates against the installed altair's schema
    tools.save_chart(chart, "chart", tmp_path)
    png = (tmp_path / "chart.png").read_bytes()
    svg = (tmp_path / "chart.svg").read_text()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    assert "<svg" in svg and len(svg) > 1000


def chart_rows(chart):
    """The data rows an altair chart draws."""
    spec = chart.to_dict()
    return next(iter(spec["datasets"].values()))


def test_mask_chart_draws_the_mask_it_is_given():
    pytest.importorskip("altair")
    mask = torch.rand(5, 5) > 0.5  # not a subsequent mask
    rows = chart_rows(tools.mask_chart(mask, title="random"))
    drawn = {(r["query (row)"], r["key (column)"]): r["allowed"] for r in rows}
    expected = {(i, j): bool(mask[i, j]) for i in range(5) for j in range(5)}
    assert drawn == expected


def test_positional_chart_draws_the_columns_it_is_given():
    pytest.importorskip("altair")
    table = torch.randn(12, 6)
    rows = chart_rows(tools.positional_chart(table, dims=(1, 4)))
    for d in (1, 4):
        line = [r for r in rows if r["dimension"] == f"dim {d}"]
        values = [
            r["value"] for r in sorted(line, key=lambda r: r["position"])
        ]
        assert values == pytest.approx(table[:, d].tolist())
    assert len(rows) == 2 * 12


def test_learning_rate_chart_draws_the_schedule_it_is_given():
    pytest.importorskip("altair")

    def flat(step, d_model, factor, warmup):
        return d_model + warmup + step * 0  # a schedule rate() is not

    rows = chart_rows(
        tools.learning_rate_chart(((4, 10),), steps=100, schedule=flat)
    )
    assert {r["lr"] for r in rows} == {14}
    library = chart_rows(tools.learning_rate_chart(((512, 4000),), 100))
    assert library[1]["lr"] == pytest.approx(tat.rate(21, 512, 1.0, 4000))


# ------------------------------------------------------------------- Batch
def test_batch_masks_match_hand_built_ones():
    pad = 0
    src = torch.tensor([[1, 5, 6, 0], [1, 7, 0, 0]])
    tgt = torch.tensor([[1, 4, 4, 9, 0], [1, 8, 0, 0, 0]])
    b = tat.Batch(src, tgt, pad=pad)
    assert torch.equal(
        b.src_mask,
        torch.tensor(
            [[[True, True, True, False]], [[True, True, False, False]]]
        ),
    )
    assert torch.equal(b.tgt, tgt[:, :-1])
    assert torch.equal(b.tgt_y, tgt[:, 1:])
    T = 4
    expected = torch.zeros(2, T, T, dtype=torch.bool)
    lengths = [4, 2]  # non-pad decoder inputs per row
    for n in range(2):
        for i in range(T):
            for j in range(T):
                expected[n, i, j] = j <= i and j < lengths[n]
    assert torch.equal(b.tgt_mask, expected)
    assert b.ntokens == 4  # [4, 4, 9] and [8]
    assert type(b.ntokens) is int


# -------------------------------------------------------------- run_epoch
V = 9


def tiny_model(seed=0):
    """A float64 model small enough to train in milliseconds."""
    torch.manual_seed(seed)
    return tat.make_model(
        V, V, N=1, d_model=16, d_ff=32, h=2, dropout=0.0
    ).double()


def batches(n, batch_size=4, seq_len=6, seed=0):
    """n copy-task batches without padding (equal token counts)."""
    g = torch.Generator().manual_seed(seed)
    return list(tat.data_gen(V, batch_size, n, seq_len, generator=g))


def concat(parts):
    """One big Batch holding all the rows of the given batches."""
    src = torch.cat([b.src for b in parts])
    return tat.Batch(src, src.clone(), pad=tat.COPY_PAD)


def loss_for(model):
    return tat.SimpleLossCompute(
        model.generator, tat.LabelSmoothing(V, tat.COPY_PAD, 0.1)
    )


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.5),
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
    ],
    ids=["sgd", "adam"],
)
def test_accumulation_equals_one_large_batch(make_opt):
    k = 3
    micro = batches(k)
    model_a = tiny_model()
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = (
        make_opt(model_a.parameters()),
        make_opt(model_b.parameters()),
    )
    tat.run_epoch(micro, model_a, loss_for(model_a), opt_a, accum_iter=k)
    tat.run_epoch([concat(micro)], model_b, loss_for(model_b), opt_b)
    moved = False
    for (name, pa), pb, p0 in zip(
        model_a.named_parameters(),
        model_b.parameters(),
        tiny_model().parameters(),
    ):
        torch.testing.assert_close(pa, pb, atol=1e-10, rtol=1e-8, msg=name)
        moved = moved or not torch.equal(pa, p0)
    assert moved


def test_partial_final_window_is_a_mean_over_its_batches():
    # 4 micro-batches with accum_iter=3: a step on 3, then a step on 1.
    micro = batches(4)
    model_a = tiny_model()
    model_b = copy.deepcopy(model_a)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.5)
    _, state = tat.run_epoch(
        micro, model_a, loss_for(model_a), opt_a, accum_iter=3
    )
    tat.run_epoch(
        [concat(micro[:3]), micro[3]], model_b, loss_for(model_b), opt_b
    )
    assert state.accum_step == 2 and state.step == 4
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-10, rtol=1e-8)
        assert pa.grad is None or (pa.grad == 0).all()


def test_scheduler_counts_optimizer_steps():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    _, state = tat.run_epoch(
        batches(6), model, loss_for(model), opt, sched, accum_iter=3
    )
    assert sched.last_epoch == 2
    assert state.accum_step == 2
    assert state.step == 6
    assert state.samples == 6 * 4
    assert state.tokens == 6 * 4 * 5


def test_partial_window_steps_and_leaves_no_gradients():
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    _, state = tat.run_epoch(
        batches(5), model, loss_for(model), opt, sched, accum_iter=3
    )
    assert state.accum_step == 2 and sched.last_epoch == 2
    assert all(
        p.grad is None or (p.grad == 0).all() for p in model.parameters()
    )
    assert any(
        not torch.equal(p, b) for p, b in zip(model.parameters(), before)
    )


def test_train_state_is_not_shared_between_calls():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, s1 = tat.run_epoch(batches(2), model, loss_for(model), opt)
    _, s2 = tat.run_epoch(batches(3), model, loss_for(model), opt)
    assert s1 is not s2
    assert (s1.step, s2.step) == (2, 3)
    _, s3 = tat.run_epoch(
        batches(2), model, loss_for(model), opt, train_state=s2
    )
    assert s3 is s2 and s2.step == 5


class RecordingLoss:
    """Wraps a loss compute and records whether autograd was on."""

    def __init__(self, inner):
        self.inner, self.grad_enabled = inner, []

    def __call__(self, x, y, norm):
        self.grad_enabled.append(torch.is_grad_enabled())
        return self.inner(x, y, norm)


def test_eval_runs_without_autograd_and_returns_floats():
    model = tiny_model().eval()
    rec = RecordingLoss(loss_for(model))
    loss, _ = tat.run_epoch(batches(3), model, rec, mode="eval")
    assert rec.grad_enabled == [False] * 3
    assert type(loss) is float and loss > 0
    assert all(p.grad is None for p in model.parameters())
    model.train()
    rec = RecordingLoss(loss_for(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss, _ = tat.run_epoch(batches(2), model, rec, opt)
    assert rec.grad_enabled == [True] * 2
    assert type(loss) is float


@pytest.mark.parametrize("mode", ["Train", "evaluate", ""])
def test_an_unknown_mode_is_refused_before_the_first_batch(mode):
    """ "Train" once evaluated in silence (mode.startswith("train"))."""
    model = tiny_model()
    rec = RecordingLoss(loss_for(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="train, train\\+log or eval"):
        tat.run_epoch(batches(2), model, rec, opt, mode=mode)
    assert rec.grad_enabled == []  # no batch was run


@pytest.mark.parametrize("mode", ["train", "train+log"])
def test_training_without_an_optimizer_is_refused_at_once(mode):
    model = tiny_model()
    rec = RecordingLoss(loss_for(model))
    with pytest.raises(ValueError, match="needs an optimizer"):
        tat.run_epoch(batches(2), model, rec, mode=mode)
    assert rec.grad_enabled == []
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------- copy task
def test_data_gen_starts_with_copy_start():
    g = torch.Generator().manual_seed(0)
    bs = list(tat.data_gen(11, 8, 3, seq_len=10, generator=g))
    assert len(bs) == 3
    assert tat.COPY_START != tat.COPY_PAD
    for b in bs:
        assert (b.src[:, 0] == tat.COPY_START).all()
        assert ((b.src[:, 1:] >= 2) & (b.src[:, 1:] < 11)).all()
        assert torch.equal(b.src, torch.cat([b.tgt[:, :1], b.tgt_y], 1))
        assert b.src_mask.all()


def test_copy_accuracy_decodes_from_copy_start(monkeypatch):
    calls = []
    real = tat.greedy_decode

    def spy(model, src, src_mask, max_len, start_symbol):
        calls.append(start_symbol)
        out = real(model, src, src_mask, max_len, start_symbol)
        assert (out[:, 0] == start_symbol).all()
        return out

    monkeypatch.setattr(tat, "greedy_decode", spy)
    model = tiny_model().float()
    tat.copy_accuracy(model, 4, V=V, generator=torch.Generator())
    assert calls == [tat.COPY_START]


class RiggedCopier(torch.nn.Module):
    """A stand-in model that copies, except that it writes 2 after a 5."""

    def __init__(self):
        super().__init__()
        self.generator = torch.nn.Identity()

    def encode(self, src, src_mask):
        return src  # the "memory" is the source itself

    def decode(self, memory, src_mask, tgt, tgt_mask):
        nxt = memory[:, 1 : tgt.size(1) + 1]  # the right next tokens
        nxt = torch.where(tgt == 5, torch.full_like(nxt, 2), nxt)
        return torch.nn.functional.one_hot(nxt, V).float()  # (B, T, V)

    def forward(self, src, tgt, src_mask, tgt_mask):
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)


def test_teacher_forced_check_equals_greedy_check():
    # Greedy decoding copies a sequence exactly iff every teacher-forced
    # argmax is right: both checks must give the fraction of sequences in
    # which every 5 (before the last position) is followed by a 2.
    n = 200
    src = next(
        tat.data_gen(V, n, 1, generator=torch.Generator().manual_seed(5))
    ).src
    expected = (
        sum(
            all(row[t + 1] == 2 for t in range(9) if row[t] == 5)
            for row in src.tolist()
        )
        / n
    )
    assert 0.1 < expected < 0.9
    for check in (tools.copy_accuracy_teacher_forced, tat.copy_accuracy):
        g = torch.Generator().manual_seed(5)
        assert check(RiggedCopier(), n, V, generator=g) == pytest.approx(
            expected
        )


def test_copy_loss_compute_counts_runs_of_exact_sequences():
    # RiggedCopier gets a sequence right iff no 5 (before the last
    # position) is followed by something other than 2. Count the run of
    # exact sequences by hand, one sequence at a time, and compare.
    model = RiggedCopier()
    criterion = tat.LabelSmoothing(V, padding_idx=tat.COPY_PAD, smoothing=0.0)
    counter = tools.CopyLossCompute(model.generator, criterion)
    g = torch.Generator().manual_seed(3)
    streak = seen = exact = 0
    longest = 0
    for batch in tat.data_gen(V, 2, 100, generator=g):
        out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        loss, _ = counter(out.log_softmax(-1), batch.tgt_y, batch.ntokens)
        for row in batch.src.tolist():
            ok = all(row[t + 1] == 2 for t in range(9) if row[t] == 5)
            streak = streak + 1 if ok else 0
            exact += ok
            seen += 1
            longest = max(longest, streak)
        assert counter.streak == streak
        assert loss.dim() == 0 and not loss.requires_grad  # no sync
    assert (counter.sequences, counter.exact) == (seen, exact)
    assert 0 < exact < seen and longest > 2  # runs crossed batch borders


def test_copy_loss_compute_ignores_padding():
    criterion = tat.LabelSmoothing(4, padding_idx=0, smoothing=0.0)
    counter = tools.CopyLossCompute(torch.nn.Identity(), criterion, pad=0)
    y = torch.tensor([[2, 3, 0], [2, 3, 1]])  # row 0 ends in padding
    logits = torch.nn.functional.one_hot(torch.tensor([[2, 3, 1]] * 2), 4)
    counter(logits.float().log_softmax(-1), y, 5)
    assert (counter.exact, counter.streak) == (2, 2)


@pytest.mark.parametrize("peak, warmup, total", [(3e-4, 20, 300), (1.0, 5, 8)])
def test_warmup_linear_decay_closed_form(peak, warmup, total):
    lrs = [
        tat.warmup_linear_decay(s, peak, warmup, total)
        for s in range(total + 50)
    ]
    top = max(range(len(lrs)), key=lrs.__getitem__)
    assert lrs[top] == pytest.approx(peak * min(1, 1 - top / total))
    assert lrs[0] == pytest.approx(peak / warmup)
    for s in (warmup + 1, (warmup + total) // 2):
        assert lrs[s] == pytest.approx(peak * (1 - s / total))
    assert lrs[total:] == [pytest.approx(0.02 * peak)] * 50
    assert all(a >= b for a, b in zip(lrs[top:], lrs[top + 1 :]))


def test_make_optimizer_takes_another_schedule():
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    schedule = lambda step: tat.warmup_linear_decay(step, 1e-3, 4, 10)
    opt, sched = tat.make_optimizer(model, 16, schedule=schedule)
    for step in range(15):
        assert opt.param_groups[0]["lr"] == pytest.approx(schedule(step))
        opt.step()
        sched.step()


def test_copy_task_learns_exact_copy_on_fresh_sequences():
    cfg = tools.CopyTaskConfig.for_size("ci")
    model, history = tools.train_copy_task(cfg, log=lambda msg: None)
    assert history[-1]["exact_copy"] == 1.0
    assert history[-1]["steps"] < cfg.max_epochs * cfg.nbatches
    fresh = torch.Generator().manual_seed(cfg.seed + 12345)
    assert tat.copy_accuracy(model, 500, cfg.V, generator=fresh) >= 0.98


def test_copy_task_config_presets():
    assert tools.CopyTaskConfig.for_size("full") == tools.CopyTaskConfig()
    ci = tools.CopyTaskConfig.for_size("ci", seed=3)
    assert (ci.N, ci.d_model, ci.d_ff, ci.h, ci.lr) == (1, 64, 256, 4, 3e-3)
    assert ci.seed == 3
    assert ci.batch_size == tools.CopyTaskConfig().batch_size
    with pytest.raises(ValueError, match="full"):
        tools.CopyTaskConfig.for_size("huge")


@pytest.mark.parametrize("training", [True, False])
def test_copy_checks_decode_without_dropout_and_restore_the_mode(training):
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2, dropout=0.5)
    model.train(training)
    seen = []
    model.generator.register_forward_hook(
        lambda module, args, out: seen.append(module.training)
    )
    for check in (tools.copy_accuracy_teacher_forced, tat.copy_accuracy):
        check(model, 3, generator=torch.Generator().manual_seed(1))
        assert model.training is training
        assert all(m.training is training for m in model.modules())
    assert seen and not any(seen)  # every forward pass ran in eval mode


def test_the_penalty_chart_draws_the_rows_it_is_given():
    pytest.importorskip("altair")
    rows = tat.label_smoothing_penalty_rows(margins=range(3), smoothing=0.2)
    drawn = tools.label_smoothing_penalty_chart(rows).to_dict()
    values = next(iter(drawn["datasets"].values()))
    assert [v["loss"] for v in values] == [r["loss"] for r in rows]
