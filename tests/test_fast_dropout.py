"""FastDropout: the appendix's cheaper CPU dropout mask, checked against
nn.Dropout's definition (keep with probability 1 - p, scale by 1 / keep
probability) and against nn.Dropout itself."""

import math

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

P = 0.2
N = 400_000


def sigma(p, n):
    """Standard deviation of the fraction dropped out of n elements."""
    return math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("p", [0.05, 0.2, 0.5, 0.9])
def test_the_dropped_fraction_matches_p_and_nn_dropout(p):
    torch.manual_seed(0)
    ones = torch.ones(N)
    fast = tools.FastDropout(p)(ones)
    slow = torch.nn.Dropout(p)(ones)
    for out in (fast, slow):
        assert abs((out == 0).float().mean().item() - p) < 5 * sigma(p, N)
    # one value for every kept element: 1 / keep probability, as torch's
    # (ours rounds p to a multiple of 1 / 65,536)
    scale = pytest.approx([1 / (1 - p)], rel=1e-4)
    assert fast[fast != 0].unique().tolist() == scale
    assert slow[slow != 0].unique().tolist() == pytest.approx([1 / (1 - p)])


def test_the_keep_probability_is_exact_so_the_mean_is_unbiased():
    """Each of the 65,536 int16 values is equally likely, so the scale
    that makes the mean exact is 65,536 / the number of kept values."""
    keep, keep_prob = tools.cheap_keep_mask((10,), P)
    assert keep_prob == (65536 - 13107) / 65536  # round(0.2 * 65536)
    torch.manual_seed(1)
    means = [tools.FastDropout(P)(torch.ones(N)).mean() for _ in range(8)]
    mean = torch.stack(means).mean().item()
    assert abs(mean - 1) < 5 * math.sqrt(P / (1 - P) / (8 * N))


def test_all_four_16_bit_lanes_of_a_random_number_are_used_evenly():
    """Element i reads 16-bit lane i % 4 of a 64-bit number. If the top
    lane never had its sign bit set (random_ without the full range), the
    lane would keep everything."""
    torch.manual_seed(2)
    keep, _ = tools.cheap_keep_mask((N,), P)
    for lane in range(4):
        dropped = (~keep[lane::4]).float().mean().item()
        assert abs(dropped - P) < 5 * sigma(P, N // 4)


def test_neighbouring_elements_are_dropped_independently():
    torch.manual_seed(3)
    keep, _ = tools.cheap_keep_mask((N,), 0.5)
    both = (~keep[:-1] & ~keep[1:]).float().mean().item()
    assert abs(both - 0.25) < 5 * sigma(0.25, N)


def test_the_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(4)
    x = torch.randn(64, 32, requires_grad=True)
    g = torch.randn(64, 32)
    out = tools.FastDropout(P)(x)
    out.backward(g)
    kept = out != 0
    scale = 65536 / (65536 - 13107)
    torch.testing.assert_close(out, torch.where(kept, x * scale, 0))
    torch.testing.assert_close(x.grad, torch.where(kept, g * scale, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_output_keeps_the_input_dtype_and_shape(dtype):
    x = torch.randn(3, 5, 7, dtype=dtype)
    out = tools.FastDropout(P)(x)
    assert out.dtype == dtype and out.shape == x.shape


def test_the_seed_fixes_the_mask_and_two_calls_differ():
    ones = torch.ones(1000)
    torch.manual_seed(5)
    first, second = tools.FastDropout(P)(ones), tools.FastDropout(P)(ones)
    torch.manual_seed(5)
    again = tools.FastDropout(P)(ones)
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_eval_mode_p_zero_and_p_one_behave_as_nn_dropout():
    x = torch.randn(50, 20)
    assert tools.FastDropout(P).eval()(x) is x
    assert torch.equal(tools.FastDropout(0.0)(x), x)
    assert torch.equal(tools.FastDropout(1.0)(x), torch.zeros_like(x))


def test_other_devices_use_torchs_dropout(monkeypatch):
    """A GPU's tensors go to F.dropout (one fused kernel on CUDA); a meta
    tensor stands in for one here."""
    calls = []

    def spy(x, p, training, inplace):
        calls.append((x.device.type, p, training))
        return x

    monkeypatch.setattr(torch.nn.functional, "dropout", spy)
    x = torch.empty(4, 8, device="meta")
    assert tools.FastDropout(P)(x) is x
    assert calls == [("meta", P, True)]
    tools.FastDropout(P)(torch.ones(4, 8))  # the CPU: the cheap mask
    assert len(calls) == 1


def test_use_fast_dropout_swaps_every_dropout_and_keeps_the_weights():
    torch.manual_seed(6)
    model = tat.make_model(11, 13, N=2, d_model=16, d_ff=32, h=2, dropout=0.3)
    before = model.state_dict()
    n_dropouts = sum(type(m) is torch.nn.Dropout for m in model.modules())
    assert tools.use_fast_dropout(model) is model
    swapped = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(swapped) == n_dropouts > 0
    assert all(type(m) is tools.FastDropout for m in swapped)
    assert all(m.p == 0.3 for m in swapped)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_inplace_is_kept_and_honoured_as_nn_dropout_does():
    """nn.Dropout(inplace=True) writes into its input; so must the swap."""
    model = torch.nn.Sequential(torch.nn.Dropout(0.5, inplace=True))
    tools.use_fast_dropout(model)
    assert type(model[0]) is tools.FastDropout and model[0].inplace
    x = torch.ones(1000)
    out = model(x)
    assert out is x and (x == 0).any()
    y = torch.ones(1000)
    out = tools.FastDropout(0.5)(y)  # not in place: the input is kept
    assert out is not y and (y == 1).all() and (out == 0).any()


@pytest.mark.parametrize(
    "switch, kind", [("1", "KernelDropout"), ("0", "FastDropout")]
)
def test_a_cpu_training_run_trains_with_the_kernel_or_fast_dropout(
    switch, kind, monkeypatch
):
    """The C++ kernel where it builds (here it does), FastDropout where
    AT_CPU_KERNELS=0 turns it off."""
    monkeypatch.setenv("AT_CPU_KERNELS", switch)
    config = tools.get_config("ci", dropout=0.1)
    run = tools.TrainingRun(0, 1, (20, 30), config, False, None, "cpu")
    dropouts = [
        m for m in run.module.modules() if isinstance(m, torch.nn.Dropout)
    ]
    wanted = getattr(tools, kind)
    assert dropouts and all(type(m) is wanted for m in dropouts)
