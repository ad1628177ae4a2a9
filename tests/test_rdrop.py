"""R-Drop (the appendix): the doubled batch, the symmetric KL and the loss,
checked against torch.nn.functional's kl_div and two separate passes."""

import math
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

PAD = tat.PAD


def toy_batch(B=3, S=5, T=6, V=11, seed=0):
    """A Batch of random ids, with some padding at the ends of rows."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (B, S), generator=g)
    tgt = torch.randint(3, V, (B, T + 1), generator=g)
    src[0, -2:] = PAD
    tgt[1, -3:] = PAD
    return tools.device_batch(src, tgt, "cpu")


def test_doubled_stacks_every_tensor_and_keeps_the_token_count():
    batch = toy_batch()
    names = ("src", "src_mask", "tgt", "tgt_y", "tgt_mask")
    before = {n: getattr(batch, n) for n in names}
    copies = {n: getattr(batch, n).clone() for n in names}
    twice = tools.doubled(batch)
    B = batch.src.size(0)
    for name in names:
        stacked = getattr(twice, name)
        assert stacked.size(0) == 2 * B
        assert torch.equal(stacked[:B], copies[name])
        assert torch.equal(stacked[B:], copies[name])
        assert getattr(batch, name) is before[name]  # the batch unchanged
        assert torch.equal(before[name], copies[name])
    assert twice.ntokens == batch.ntokens == int((batch.tgt_y != PAD).sum())


def test_symmetric_kl_matches_kl_div_both_ways_over_kept_rows():
    torch.manual_seed(0)
    logp = torch.randn(4, 7, 13).log_softmax(-1)
    logq = torch.randn(4, 7, 13).log_softmax(-1)
    keep = torch.rand(4, 7) > 0.3
    expected = 0.0
    for i, j in keep.nonzero().tolist():
        p, q = logp[i, j], logq[i, j]
        forward = F.kl_div(q, p, reduction="sum", log_target=True)
        backward = F.kl_div(p, q, reduction="sum", log_target=True)
        expected += 0.5 * (forward + backward).item()
    got = tools.symmetric_kl(logp, logq, keep).item()
    assert got == pytest.approx(expected, rel=1e-5)
    assert tools.symmetric_kl(logp, logp, keep).item() == 0.0


def test_symmetric_kl_sums_bf16_inputs_in_float32():
    torch.manual_seed(1)
    logp = torch.randn(8, 50).log_softmax(-1)
    logq = torch.randn(8, 50).log_softmax(-1)
    keep = torch.ones(8, dtype=torch.bool)
    low = tools.symmetric_kl(logp.bfloat16(), logq.bfloat16(), keep)
    assert low.dtype == torch.float32
    exact = tools.symmetric_kl(logp, logq, keep)
    assert low.item() == pytest.approx(exact.item(), rel=0.02)


def small_model(dropout):
    torch.manual_seed(0)
    return tat.make_model(
        11, 11, N=1, d_model=16, d_ff=32, h=2, dropout=dropout
    )


def forward(model, batch):
    return model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)


def test_the_loss_is_both_smoothed_losses_plus_alpha_kl_over_2n():
    """Against the formula written out from the two halves decoded apart:
    the label-smoothed loss summed over both copies plus alpha times the
    symmetric KL (the authors' sum), over the doubled token count."""
    model = small_model(dropout=0.3).train()
    batch, alpha = toy_batch(), 2.5
    criterion = tat.LabelSmoothing(11, PAD, 0.1)
    compute = tools.RDropLossCompute(model.generator, criterion, alpha)
    torch.manual_seed(5)
    x = forward(model, tools.doubled(batch))
    loss_sum, loss_mean = compute(x, tools.doubled(batch).tgt_y, batch.ntokens)

    B, n = batch.src.size(0), batch.ntokens
    logp = model.generator(x).detach()
    y = batch.tgt_y
    smoothed = sum(
        tat.smoothed_kl(half.reshape(-1, 11), y.reshape(-1), PAD, 0.1)
        for half in (logp[:B], logp[B:])
    )
    real = (y != PAD).unsqueeze(-1)
    p, q = logp[:B], logp[B:]
    kl_pq = (p.exp() * (p - q) * real).sum()
    kl_qp = (q.exp() * (q - p) * real).sum()
    expected = (smoothed + alpha * (kl_pq + kl_qp) / 2) / (2 * n)
    assert loss_mean.item() == pytest.approx(expected.item(), rel=1e-5)
    assert loss_sum.item() == pytest.approx(smoothed.item() / 2, rel=1e-5)
    assert (kl_pq + kl_qp).item() > 0  # dropout made the halves differ


def test_without_dropout_the_loss_is_the_plain_loss():
    """Both halves agree, so the KL term is 0 and the mean is unchanged."""
    model = small_model(dropout=0.0)
    batch = toy_batch()
    criterion = tat.LabelSmoothing(11, PAD, 0.1)
    plain = tat.SimpleLossCompute(model.generator, criterion)
    rdrop = tools.RDropLossCompute(model.generator, criterion, alpha=5.0)
    sum_plain, mean_plain = plain(
        forward(model, batch), batch.tgt_y, batch.ntokens
    )
    twice = tools.doubled(batch)
    sum_rdrop, mean_rdrop = rdrop(
        forward(model, twice), twice.tgt_y, batch.ntokens
    )
    assert mean_rdrop.item() == pytest.approx(mean_plain.item(), rel=1e-5)
    assert sum_rdrop.item() == pytest.approx(sum_plain.item(), rel=1e-5)


def test_the_kl_term_has_the_gradient_of_finite_differences():
    torch.manual_seed(2)
    logits_p = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    logits_q = torch.randn(3, 6, dtype=torch.float64)
    keep = torch.tensor([True, False, True])

    def kl(a):
        return tools.symmetric_kl(
            a.log_softmax(-1), logits_q.log_softmax(-1), keep
        ).double()

    kl(logits_p).backward()
    eps = 1e-6
    for i in range(3):
        for j in range(6):
            bumped = logits_p.detach().clone()
            bumped[i, j] += eps
            lower = logits_p.detach().clone()
            lower[i, j] -= eps
            numeric = (kl(bumped) - kl(lower)).item() / (2 * eps)
            assert math.isclose(
                logits_p.grad[i, j].item(), numeric, abs_tol=1e-4
            )
    assert (logits_p.grad[1] == 0).all()  # the row left out


def rows_seen(run, monkeypatch):
    """A list that gets the batch size of every forward pass of the run."""
    seen = []
    model_forward = run.model.forward

    def spy(src, tgt, src_mask, tgt_mask):
        seen.append(src.size(0))
        return model_forward(src, tgt, src_mask, tgt_mask)

    monkeypatch.setattr(run.model, "forward", spy)
    return seen


def test_a_run_with_rdrop_feeds_the_model_doubled_batches(monkeypatch):
    """train_pass doubles each batch and counts its real tokens once."""
    config = tools.get_config("ci", dropout=0.1, rdrop=1.0)
    run = tools.TrainingRun(0, 1, (11, 11), config, False, None, "cpu")
    seen = rows_seen(run, monkeypatch)
    batches = [toy_batch(seed=s) for s in range(3)]
    loader = [(b.src, torch.cat([b.tgt[:, :1], b.tgt_y], 1)) for b in batches]
    compute = tools.RDropLossCompute(run.module.generator, run.criterion, 1.0)
    loss = tools.train_pass(run, loader, compute)
    assert seen == [2 * b.src.size(0) for b in batches]
    assert run.state.tokens == sum(b.ntokens for b in batches)
    assert math.isfinite(loss)


def test_train_epoch_uses_rdrop_only_when_asked(monkeypatch):
    used = []
    monkeypatch.setattr(
        tools, "train_pass", lambda run, loader, loss: used.append(loss) or 0
    )
    monkeypatch.setattr(tools, "validate", lambda run, loader, loss: 0.0)

    class Loader(list):
        class batch_sampler:  # noqa: N801
            set_epoch = staticmethod(lambda epoch: None)

    for alpha, kind in (
        (0.0, tools.FusedLossCompute),
        (3.0, tools.RDropLossCompute),
    ):
        config = tools.get_config("ci", rdrop=alpha)
        run = tools.TrainingRun(0, 1, (11, 11), config, False, None, "cpu")
        tools.train_epoch(run, 0, Loader(), Loader(), show=False)
        assert type(used[-1]) is kind
        if alpha:
            assert used[-1].alpha == alpha


def test_train_rdrop_reaches_the_config(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(tools, "download_multi30k", lambda: None)
    monkeypatch.setattr(
        tools, "train_locked", lambda args, config, ranks: seen.append(config)
    )
    argv = ["train", "--preset", "ci", "--checkpoint-dir", str(tmp_path)]
    assert tools.main([*argv, "--rdrop", "2.5"]) in (0, None)
    assert tools.main(argv) in (0, None)
    assert [c.rdrop for c in seen] == [2.5, 0.0]


@pytest.mark.parametrize("bad", ["-1", "21", "much"])
def test_a_bad_rdrop_is_one_line(bad, capsys):
    with pytest.raises(SystemExit) as stop:
        tools.build_parser().parse_args(["train", "--rdrop", bad])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--rdrop" in err


def test_train_pass_doubles_only_for_the_rdrop_loss(monkeypatch):
    """A plain loss given to a run with rdrop > 0 sees single batches."""
    config = tools.get_config("ci", dropout=0.1, rdrop=1.0)
    run = tools.TrainingRun(0, 1, (11, 11), config, False, None, "cpu")
    seen = rows_seen(run, monkeypatch)
    batch = toy_batch()
    loader = [(batch.src, torch.cat([batch.tgt[:, :1], batch.tgt_y], 1))]
    plain = tat.SimpleLossCompute(run.module.generator, run.criterion)
    tools.train_pass(run, loader, plain)
    assert seen == [batch.src.size(0)]


def test_resuming_an_older_checkpoint_with_rdrop_is_refused():
    """A checkpoint saved before R-Drop existed trained without it."""
    config = tools.get_config("ci", rdrop=3.0)
    older = {k: v for k, v in asdict(config).items() if k != "rdrop"}
    changed = tools.changed_settings(older, config)
    assert changed == ["rdrop 0.0 there, 3.0 here"]
    assert tools.changed_settings(older, replace(config, rdrop=0.0)) == []
