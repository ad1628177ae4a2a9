"""FastLabelSmoothing: the appendix's label-smoothed loss with a
hand-written gradient, checked against Part 2's LabelSmoothing (autograd
through the closed form, and the definition through its target matrix) and
against torch's numerical gradient check."""

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

PAD = tat.PAD


def log_probs_and_targets(rows, vocab, dtype=torch.float32, seed=0):
    """(rows, vocab) log-probabilities and targets, every 5th one padding."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[::5] = PAD
    target[1] = 3  # at least one real row, even with rows=2
    return logits.log_softmax(-1).to(dtype), target


def loss_and_grad(criterion, x, target, upstream=1.0):
    x = x.clone().requires_grad_()
    loss = criterion(x, target)
    (loss * upstream).backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.4])
@pytest.mark.parametrize("rows", [2, 255, 256, 700])  # 700: three blocks
def test_loss_and_gradient_match_autograd_through_the_closed_form(
    smoothing, rows
):
    x, target = log_probs_and_targets(rows, 37)
    V = x.size(1)
    fast = loss_and_grad(
        tools.FastLabelSmoothing(V, PAD, smoothing), x, target
    )
    slow = loss_and_grad(tat.LabelSmoothing(V, PAD, smoothing), x, target)
    assert fast[0] == pytest.approx(slow[0].item(), rel=1e-6)
    assert torch.allclose(fast[1], slow[1], atol=1e-7)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_gradient_matches_the_definition_through_the_target_matrix(
    smoothing,
):
    x, target = log_probs_and_targets(50, 11)
    fast = loss_and_grad(
        tools.FastLabelSmoothing(11, PAD, smoothing), x, target
    )
    defined = tat.LabelSmoothing(11, PAD, smoothing, keep_targets=True)
    slow = loss_and_grad(defined, x, target)
    assert fast[0] == pytest.approx(slow[0].item(), rel=1e-6)
    assert torch.allclose(fast[1], slow[1], atol=1e-7)


def test_gradcheck_in_float64():
    """Against finite differences, with no reference code at all."""
    x, target = log_probs_and_targets(9, 6, torch.float64)
    x.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: tools.SmoothedKL.apply(x, target, PAD, 0.2, 4), (x,)
    )


def test_the_upstream_gradient_scales_the_result():
    x, target = log_probs_and_targets(20, 9)
    criterion = tools.FastLabelSmoothing(9, PAD, 0.1)
    _, once = loss_and_grad(criterion, x, target)
    _, scaled = loss_and_grad(criterion, x, target, upstream=-3.0)
    assert torch.allclose(scaled, -3.0 * once)


def test_padding_rows_and_the_padding_column_get_no_gradient():
    x, target = log_probs_and_targets(30, 8)
    _, grad = loss_and_grad(tools.FastLabelSmoothing(8, PAD, 0.1), x, target)
    assert not grad[target == PAD].any()
    assert not grad[:, PAD].any()
    assert grad[target != PAD].sum(1).tolist() == pytest.approx(
        [-1.0] * int((target != PAD).sum())
    )  # minus a distribution: each real row sums to -1


def test_bfloat16_log_probs_keep_their_dtype_and_a_float32_loss():
    """Under the CPU's bf16 autocast the log-probabilities are bf16: the
    gradient must be bf16 too, and the loss summed in float32."""
    x32, target = log_probs_and_targets(600, 40)
    x16 = x32.to(torch.bfloat16)
    fast = loss_and_grad(tools.FastLabelSmoothing(40, PAD, 0.1), x16, target)
    slow = loss_and_grad(tat.LabelSmoothing(40, PAD, 0.1), x16, target)
    assert fast[0].dtype == torch.float32
    assert fast[1].dtype == torch.bfloat16
    assert fast[0] == pytest.approx(slow[0].item(), rel=1e-6)
    # The exact gradient, -p, rounded once to bf16. Autograd's adds three
    # bf16 branches, so it may differ in the last bit at the targets.
    exact = -tat.LabelSmoothing(40, PAD, 0.1).smoothed_targets(target)
    assert torch.equal(fast[1], exact.to(torch.bfloat16))
    assert torch.allclose(fast[1].float(), slow[1].float(), atol=2**-8)


def test_it_keeps_labelsmoothings_targets_and_slow_path():
    x, target = log_probs_and_targets(12, 7)
    fast = tools.FastLabelSmoothing(7, PAD, 0.1)
    fast(x, target)
    slow = tat.LabelSmoothing(7, PAD, 0.1)
    slow(x, target)
    assert torch.equal(fast.true_dist, slow.true_dist)
    keep = tools.FastLabelSmoothing(7, PAD, 0.1, keep_targets=True)
    assert keep(x, target).item() == pytest.approx(fast(x, target).item())


def test_a_wrong_vocabulary_size_is_refused():
    x, target = log_probs_and_targets(4, 7)
    with pytest.raises(AssertionError):
        tools.FastLabelSmoothing(8, PAD, 0.1)(x, target)


def test_training_runs_use_it():
    config = tools.get_config("ci")
    run = tools.TrainingRun(0, 1, (30, 40), config, False, device="cpu")
    assert type(run.criterion) is tools.FastLabelSmoothing
    assert run.criterion.smoothing == config.label_smoothing


def test_no_rows_give_a_zero_loss_and_an_empty_gradient():
    x = torch.empty(0, 9, requires_grad=True)
    loss = tools.FastLabelSmoothing(9, PAD, 0.1)(x, torch.empty(0).long())
    assert torch.is_tensor(loss) and loss.item() == 0.0
    loss.backward()
    assert x.grad.shape == (0, 9)


def test_on_another_device_everything_stays_there():
    """A meta tensor stands in for a GPU's: the gradient and the indices
    built in the backward pass must be made on the input's device."""
    x = torch.randn(600, 9, device="meta", requires_grad=True)
    target = torch.randint(0, 9, (600,), device="meta")
    loss = tools.FastLabelSmoothing(9, PAD, 0.1)(x, target)
    loss.backward()
    assert loss.device.type == x.grad.device.type == "meta"
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype


def test_its_gradient_is_the_hand_written_one():
    x, target = log_probs_and_targets(6, 7)
    x.requires_grad_()
    fast = tools.FastLabelSmoothing(7, PAD, 0.1)(x, target)
    slow = tat.LabelSmoothing(7, PAD, 0.1)(x, target)
    assert type(fast.grad_fn).__name__ == "SmoothedKLBackward"
    assert type(slow.grad_fn).__name__ != "SmoothedKLBackward"
