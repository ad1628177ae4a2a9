"""The appendix's C++ loss kernel: each row's log-sum-exp and smoothed
loss, and the logits' gradient with its column sums, against a float64
reference written from the definition (a smoothed target distribution
and the cross-entropy to it); then GeneratorLoss with and without it."""

import contextlib
import types

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat
from the_annotated_transformer import PAD


@pytest.fixture(scope="module")
def kernel():
    built = tools.loss_kernel()
    assert built is not None, "this machine has g++ and ninja: it must build"
    return built


def smoothed_targets(target, V, smoothing, pad=PAD):
    """(rows, V) float64: 1 - smoothing at the target, the rest spread
    evenly over the other words but <blank> (`pad`), which gets 0."""
    p = torch.full((len(target), V), smoothing / (V - 2), dtype=torch.float64)
    p[:, pad] = 0
    p[torch.arange(len(target)), target] = 1 - smoothing
    return p


def problem(rows, V, dtype, seed=0):
    """Logits (before the bias) with a spread like a trained generator's,
    a float32 bias, and targets that include the first and last words and
    a word next to <blank>."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, V, generator=g) * 4).to(dtype)
    bias = torch.randn(V, generator=g)
    target = torch.randint(3, V, (rows,), generator=g)
    target[:3] = torch.tensor([0, V - 1, PAD + 1])
    return z, bias, target


def logits64(z, bias):
    """The logits the kernel sees, z + bias, in float64."""
    return z.double() + bias.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [700, 6190, 17])
def test_rows_give_log_sum_exp_and_the_smoothed_cross_entropy(
    kernel, dtype, V
):
    z, bias, target = problem(50, V, dtype)
    c, f, plogp = tools.smoothing_constants(0.1, V)
    lse, loss = kernel.smoothed_rows(z, bias, target, PAD, c, f, plogp)
    z64 = logits64(z, bias)
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
@pytest.mark.parametrize("V", [700, 6190, 17])
def test_rows_grad_gives_the_loss_softmax_minus_targets_and_column_sums(
    kernel, dtype, V
):
    """The loss as smoothed_rows gives it, and the logits' gradient for
    g = 1: q - p, with p the smoothed targets."""
    z, bias, target = problem(40, V, dtype, seed=1)
    c, f, plogp = tools.smoothing_constants(0.1, V)
    args = (z, bias, target, PAD, c, f, plogp)
    lse, loss, grad, sums = kernel.smoothed_rows_grad(*args)
    expected_lse, expected_loss = kernel.smoothed_rows(*args)
    z64 = logits64(z, bias)
    q = (z64 - z64.logsumexp(1, keepdim=True)).exp()
    expected = q - smoothed_targets(target, V, 0.1)
    assert loss.dtype == sums.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(lse, expected_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-5)
    # float32: (z + b) rounds, and exp carries that (|z + b| up to 20)
    tol = {torch.float32: 3e-6, torch.bfloat16: 4e-3}[dtype]
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
            x, proj.weight, proj.bias, target, PAD, 0.1, kernel, 2**24
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
    z, bias, target = torch.zeros(4, 10), torch.zeros(10), torch.zeros(4)
    target = target.long()
    for call in (kernel.smoothed_rows, kernel.smoothed_rows_grad):
        with pytest.raises(RuntimeError, match="one int64 target per row"):
            call(z, bias, target[:3], 0, 0.9, 0.01, 0.0)
        with pytest.raises(RuntimeError, match="bf16 or float32 logits"):
            call(z.double(), bias, target, 0, 0.9, 0.01, 0.0)
        with pytest.raises(RuntimeError, match="a float32 bias of V"):
            call(z, bias[:9], target, 0, 0.9, 0.01, 0.0)
        with pytest.raises(RuntimeError, match="a float32 bias of V"):
            call(z, bias.double(), target, 0, 0.9, 0.01, 0.0)


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


@pytest.mark.parametrize("pad", [0, 15, 16, 6189])
def test_any_padding_column_and_targets_at_the_edges(kernel, pad):
    """<blank> first, last, and on either side of the kernel's first 16
    lanes; targets at both ends of the row and next to <blank>."""
    V = 6190
    z, bias, target = problem(8, V, torch.float32, seed=2)
    target[:4] = torch.tensor([0, V - 1, max(pad - 1, 1), min(pad + 1, V - 1)])
    target[target == pad] = 3
    c, f, plogp = tools.smoothing_constants(0.1, V)
    p = smoothed_targets(target, V, 0.1, pad)
    z64 = logits64(z, bias)
    logq = z64 - z64.logsumexp(1, keepdim=True)
    expected = (p * (p.clamp_min(1e-300).log() - logq)).sum(1)
    args = (z, bias, target, pad, c, f, plogp)
    _, rows_loss = kernel.smoothed_rows(*args)
    _, loss, grad, sums = kernel.smoothed_rows_grad(*args)
    for got in (rows_loss, loss):
        torch.testing.assert_close(
            got.double(), expected, rtol=2e-6, atol=5e-5
        )
    expected = logq.exp() - p
    torch.testing.assert_close(grad.double(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        sums.double(), expected.sum(0), rtol=1e-5, atol=1e-6
    )


def test_out_of_range_indices_are_refused(kernel):
    z, bias = torch.zeros(2, 10), torch.zeros(10)
    c, f, plogp = tools.smoothing_constants(0.1, 10)
    for call in (kernel.smoothed_rows, kernel.smoothed_rows_grad):
        outside = "target outside the vocabulary"
        with pytest.raises(RuntimeError, match=outside):
            call(z, bias, torch.tensor([3, 10]), 0, c, f, plogp)
        with pytest.raises(RuntimeError, match=outside):
            call(z, bias, torch.tensor([-1, 3]), 0, c, f, plogp)
        with pytest.raises(RuntimeError, match="padding index outside V"):
            call(z, bias, torch.tensor([3, 4]), 10, c, f, plogp)


@pytest.mark.parametrize("rows, padding_every", [(600, 4), (40, 1)])
def test_generator_loss_over_row_blocks_and_all_padding(
    kernel, rows, padding_every
):
    """600 rows, 450 of them real: two blocks of 225 (each at most
    256 * 300 logits); and a batch of padding alone, whose loss and
    gradients are zero."""
    torch.manual_seed(1)
    x = torch.randn(rows, 16)
    proj = torch.nn.Linear(16, 300)
    target = torch.randint(0, 300, (rows,))
    target[::padding_every] = PAD
    results = []
    for k in (kernel, None):
        xk = x.clone().requires_grad_()
        proj.zero_grad()
        loss = tools.GeneratorLoss.apply(
            xk, proj.weight, proj.bias, target, PAD, 0.1, k, 256 * 300
        )
        loss.backward()
        results.append([loss, xk.grad, proj.weight.grad, proj.bias.grad])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    if padding_every == 1:
        assert results[0][0] == 0 and not results[0][1].any()


def test_the_kernel_is_not_given_what_it_cannot_take(kernel):
    """float64 logits go to the torch code, not to a kernel error."""
    torch.manual_seed(0)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    proj = torch.nn.Linear(8, 50).double()
    target = torch.randint(3, 50, (5,))
    loss = tools.GeneratorLoss.apply(
        x, proj.weight, proj.bias, target, PAD, 0.1, kernel, 2**24
    )
    reference = tools.GeneratorLoss.apply(
        x, proj.weight, proj.bias, target, PAD, 0.1, None, 2**24
    )
    assert loss.dtype == torch.float64 and torch.equal(loss, reference)


class Spy:
    """The kernel, counting which of its two row functions is called."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def smoothed_rows(self, *args):
        self.calls.append("loss")
        return self.kernel.smoothed_rows(*args)

    def smoothed_rows_grad(self, *args):
        self.calls.append("loss and gradient")
        return self.kernel.smoothed_rows_grad(*args)


def test_validation_computes_the_loss_alone(kernel):
    """Under torch.no_grad (validation) no gradient is computed, although
    the generator's weights require one; in training it is."""
    x, proj, target = generator_problem()
    generator = types.SimpleNamespace(proj=proj)
    compute = tools.FusedLossCompute(
        generator, tat.LabelSmoothing(1500, PAD, 0.1)
    )
    compute.kernel = Spy(kernel)
    with torch.no_grad():
        validation, _ = compute(x, target, norm=1)
    assert compute.kernel.calls == ["loss"]
    training, _ = compute(x, target, norm=1)
    assert compute.kernel.calls == ["loss", "loss and gradient"]
    torch.testing.assert_close(validation, training)
