"""The appendix's C++ loss kernel: each row's log-sum-exp and smoothed
loss, and the logits' gradient with its column sums, against a float64
reference written from the definition (a smoothed target distribution
and the cross-entropy to it); then GeneratorLoss with and without it."""

import contextlib

import pytest
import torch

import annotated_transformer_tools as tools
from the_annotated_transformer import PAD


@pytest.fixture(scope="module")
def kernel():
    built = tools.loss_kernel()
    assert built is not None, "this machine has g++ and ninja: it must build"
    return built


def smoothed_targets(target, V, smoothing):
    """(rows, V) float64: 1 - smoothing at the target, the rest spread
    evenly over the other words but <blank>, which gets 0."""
    p = torch.full((len(target), V), smoothing / (V - 2), dtype=torch.float64)
    p[:, PAD] = 0
    p[torch.arange(len(target)), target] = 1 - smoothing
    return p


def problem(rows, V, dtype, seed=0):
    """Logits with a spread like a trained generator's, and targets that
    include the first and last words and a word next to <blank>."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, V, generator=g) * 4).to(dtype)
    target = torch.randint(3, V, (rows,), generator=g)
    target[:3] = torch.tensor([0, V - 1, PAD + 1])
    return z, target


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [700, 6190, 17])
def test_rows_give_log_sum_exp_and_the_smoothed_cross_entropy(
    kernel, dtype, V
):
    z, target = problem(50, V, dtype)
    c, f, plogp = tools.smoothing_constants(0.1, V)
    lse, loss = kernel.smoothed_rows(z, target, PAD, c, f, plogp)
    z64 = z.double()
    expected_lse = z64.logsumexp(1)
    p = smoothed_targets(target, V, 0.1)
    logq = z64 - expected_lse[:, None]
    expected = (p * (p.clamp_min(1e-300).log() - logq)).sum(1)  # KL(p||q)
    assert lse.dtype == loss.dtype == torch.float32
    torch.testing.assert_close(
        lse.double(), expected_lse, rtol=2e-6, atol=2e-5
    )
    torch.testing.assert_close(loss.double(), expected, rtol=2e-6, atol=5e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("first", [0, 512, 6000])
def test_grad_is_g_times_softmax_minus_targets_with_its_column_sums(
    kernel, dtype, first
):
    """A block of 190 or 512 columns starting at `first`: <blank> (0) and
    some targets fall inside the first block only."""
    V = 6190
    z, target = problem(40, V, dtype, seed=1)
    c, f, plogp = tools.smoothing_constants(0.1, V)
    lse, _ = kernel.smoothed_rows(z, target, PAD, c, f, plogp)
    cols = slice(first, min(first + 512, V))
    g = 0.37
    grad, sums = kernel.smoothed_grad(
        z[:, cols].contiguous(), lse, target, first, PAD, c, f, g
    )
    z64 = z.double()
    q = (z64 - z64.logsumexp(1, keepdim=True)).exp()
    expected = (g * (q - smoothed_targets(target, V, 0.1)))[:, cols]
    assert grad.dtype == dtype and sums.dtype == torch.float32
    tol = {torch.float32: 1e-6, torch.bfloat16: 4e-3}[dtype]
    torch.testing.assert_close(
        grad.double(), expected, rtol=tol, atol=tol * 0.1
    )
    torch.testing.assert_close(
        sums.double(), expected.sum(0), rtol=1e-5, atol=2e-6
    )


def generator_problem():
    torch.manual_seed(0)
    x = torch.randn(53, 32, requires_grad=True)
    proj = torch.nn.Linear(32, 1500)
    target = torch.randint(0, 1500, (53,))
    target[::4] = PAD
    return x, proj, target


def loss_and_grads(kernel, autocast):
    x, proj, target = generator_problem()
    with autocast:
        loss = tools.GeneratorLoss.apply(
            x, proj.weight, proj.bias, target, PAD, 0.1, kernel
        )
    loss.backward()
    return [loss, x.grad, proj.weight.grad, proj.bias.grad]


@pytest.mark.parametrize(
    "autocast, tol",
    [
        (contextlib.nullcontext(), 2e-5),
        (torch.autocast("cpu", torch.bfloat16), 2e-2),
    ],
)
def test_generator_loss_with_the_kernel_matches_its_torch_code(
    kernel, autocast, tol
):
    with_kernel = loss_and_grads(kernel, autocast)
    torch_code = loss_and_grads(None, autocast)
    for a, b in zip(with_kernel, torch_code, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_bad_inputs_are_refused_in_one_line(kernel):
    z = torch.zeros(4, 10)
    with pytest.raises(RuntimeError, match="one int64 target per row"):
        kernel.smoothed_rows(
            z, torch.zeros(3, dtype=torch.long), 0, 0.9, 0.01, 0.0
        )
    with pytest.raises(RuntimeError, match="bf16 or float32 logits"):
        kernel.smoothed_rows(
            z.double(), torch.zeros(4, dtype=torch.long), 0, 0.9, 0.01, 0.0
        )


def test_off_and_failed_builds_leave_the_torch_code(monkeypatch, capsys):
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(tools, "_LOSS_KERNEL", {})
    monkeypatch.setenv("AT_CPU_KERNELS", "0")
    assert tools.loss_kernel() is None and tools._LOSS_KERNEL == {}
    monkeypatch.setenv("AT_CPU_KERNELS", "1")

    def no_ninja(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\nmore")

    monkeypatch.setattr(cpp, "load_inline", no_ninja)
    monkeypatch.setattr(tools, "_kernel_is_built", lambda name: True)
    assert tools.loss_kernel() is None
    assert capsys.readouterr().out.splitlines() == [
        "no CPU loss kernel (Ninja is required to load C++ extensions);"
        " using the torch code"
    ]


def test_a_cpu_training_run_computes_its_loss_with_the_kernel(kernel):
    config = tools.get_config("ci")
    run = tools.TrainingRun(0, 1, (20, 30), config, False, None, "cpu")
    loss_compute = tools.run_loss_compute(run)
    assert isinstance(loss_compute, tools.FusedLossCompute)
    assert loss_compute.kernel is kernel
