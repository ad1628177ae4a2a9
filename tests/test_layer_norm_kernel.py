"""The appendix's C++ LayerNorm kernel (KernelLayerNorm): its output and
gradients against float64 torch, and the module against Part 1's."""

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

EPS = 1e-6  # Part 1's


@pytest.fixture(scope="module")
def kernel():
    built = tools.layer_norm_kernel()
    assert built is not None, "this machine has g++ and ninja: it must build"
    return built


def inputs(shape, dtype, seed=0):
    """x of `shape` (not centred, not of unit scale) and float32 weights."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3 + 2).to(dtype)
    D = shape[-1]
    a = torch.rand(D, generator=gen) + 0.5
    b = torch.rand(D, generator=gen) - 0.5
    return x, a, b


def reference(x, a, b):
    """Part 1's formula in float64: the variance divides by D."""
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)
    return a.double() * (x - mean) / torch.sqrt(var + EPS) + b.double()


SHAPES = [(3, 256), (2, 5, 17), (4, 1), (1, 3, 7, 64), (40, 1024)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_output_is_part_1s_formula(kernel, dtype, shape):
    x, a, b = inputs(shape, dtype)
    y, mean, rstd = kernel.layer_norm(x, a, b, EPS)
    assert y.dtype == dtype and y.shape == x.shape
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: 8 bits
    torch.testing.assert_close(
        y.double(), reference(x, a, b), rtol=tolerance, atol=tolerance
    )
    rows = x.double().reshape(-1, shape[-1])
    torch.testing.assert_close(mean.double(), rows.mean(-1), rtol=1e-6, atol=0)
    expected_rstd = (rows.var(-1, unbiased=False) + EPS).rsqrt()
    torch.testing.assert_close(rstd.double(), expected_rstd, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_gradients_are_float64_autograds(kernel, dtype, shape):
    x, a, b = inputs(shape, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    grad = torch.randn(shape, generator=gen).to(dtype)
    _, mean, rstd = kernel.layer_norm(x, a, b, EPS)
    got = kernel.layer_norm_grad(grad, x, a, mean, rstd, None)
    x64, a64, b64 = (t.double().requires_grad_() for t in (x, a, b))
    reference(x64, a64, b64).backward(grad.double())
    expected = (x64.grad, a64.grad, b64.grad)
    for mine, theirs, dtype_wanted in zip(
        got, expected, (dtype, torch.float32, torch.float32), strict=True
    ):
        assert mine.dtype == dtype_wanted
        scale = theirs.abs().max().item() + 1e-12
        tolerance = (1e-5 if dtype == torch.float32 else 2e-2) * scale
        torch.testing.assert_close(
            mine.double(), theirs, rtol=0, atol=tolerance
        )


def test_a_constant_row_gives_the_bias_as_in_torch(kernel):
    x = torch.full((2, 8), 3.5)
    a, b = torch.rand(8) + 0.5, torch.randn(8)
    y, _, _ = kernel.layer_norm(x, a, b, EPS)
    torch.testing.assert_close(y, b.expand(2, 8))
    expected = torch.nn.functional.layer_norm(x, (8,), a, b, EPS)
    torch.testing.assert_close(y, expected)


def test_threads_change_only_the_order_of_the_weights_sums(kernel):
    """Rows are each one thread's: y and dx are the same at 1 and 2
    threads; the weights' gradients are summed per thread, then over
    threads, so they agree to float32's rounding."""
    x, a, b = inputs((300, 256), torch.bfloat16, seed=3)
    grad = torch.randn(300, 256).bfloat16()
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y, mean, rstd = kernel.layer_norm(x, a, b, EPS)
            grads = kernel.layer_norm_grad(grad, x, a, mean, rstd, None)
            results.append((y, *grads))
    finally:
        torch.set_num_threads(threads)
    one, two = results
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    for mine, theirs in zip(one[2:], two[2:], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-4)


def test_an_empty_input_gives_an_empty_output(kernel):
    x, a, b = inputs((0, 16), torch.float32)
    y, mean, rstd = kernel.layer_norm(x, a, b, EPS)
    assert y.shape == (0, 16) and mean.shape == rstd.shape == (0,)
    grads = kernel.layer_norm_grad(x, x, a, mean, rstd, None)
    assert grads[0].shape == (0, 16) and not grads[1].any()


@pytest.mark.parametrize(
    ("x", "a", "message"),
    [
        (torch.randn(3, 4, dtype=torch.float64), torch.ones(4), "bf16"),
        (torch.randn(3, 4), torch.ones(5), "last dim"),
        (torch.randn(3, 4), torch.ones(4).bfloat16(), "float32 weights"),
    ],
)
def test_what_it_cannot_take_is_refused_in_one_line(kernel, x, a, message):
    with pytest.raises(RuntimeError) as error:
        kernel.layer_norm(x, a, a, EPS)
    first = str(error.value).splitlines()[0]
    assert first.startswith("layer norm kernel:") and message in first


def run_norm(norm, cls, dtype, exact=False):
    """Output and gradients of `norm` run as `cls` on a fixed batch in
    `dtype`; exact: the same numbers in float64, weights included."""
    norm.__class__ = cls
    norm.zero_grad()
    torch.manual_seed(8)
    x = (torch.randn(6, 11, 32) * 2 + 1).to(dtype)
    weights = torch.linspace(-1, 1, x.numel()).view(x.shape).to(dtype)
    if exact:
        norm, x, weights = norm.double(), x.double(), weights.double()
    x.requires_grad_()
    # Part 1's takes a bf16 input with float32 weights under autocast only
    with torch.autocast("cpu", torch.bfloat16, enabled=x.dtype == BF16):
        out = norm(x)
    out.backward(weights)
    grads = [t.clone() for t in (out, x.grad, norm.a_2.grad, norm.b_2.grad)]
    norm.float()
    return grads


BF16 = torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_module_computes_part_1s_layer_norm(kernel, dtype):
    """Against Part 1's LayerNorm and float64. In bf16, torch's own CPU
    LayerNorm sums the weights' gradients far less exactly (0.28 off a
    bias gradient of 0.97 here): those two are held to float64 only."""
    torch.manual_seed(0)
    norm = tat.LayerNorm(32)
    with torch.no_grad():
        norm.a_2.uniform_(0.5, 1.5)
        norm.b_2.uniform_(-1, 1)
    mine = run_norm(norm, tools.KernelLayerNorm, dtype)
    part_1 = run_norm(norm, tat.LayerNorm, dtype)
    exact = run_norm(norm, tat.LayerNorm, dtype, exact=True)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: 8 bits
    for i, (a, b, c) in enumerate(zip(mine, part_1, exact, strict=True)):
        assert a.dtype == b.dtype
        scale = c.abs().max().item()  # the weights' sums: to their size
        atol = tolerance * scale
        torch.testing.assert_close(a.double(), c, rtol=0, atol=atol)
        if dtype == torch.float32 or i < 2:  # y and dx
            torch.testing.assert_close(a, b, rtol=0, atol=atol)


def test_eval_and_float64_take_part_1s_code(kernel, monkeypatch):
    """Outside training, and for what the kernel does not take, the
    kernel is not even asked for."""
    asked = []
    monkeypatch.setattr(
        tools, "layer_norm_kernel", lambda: asked.append(1) or kernel
    )
    norm = tools.use_layer_norm_kernel(torch.nn.Sequential(tat.LayerNorm(8)))
    x = torch.randn(3, 8)
    norm.eval()(x)
    norm.double().train()(x.double())  # float64 weights and input
    assert asked == []
    norm.float()(x)
    assert asked == [1]


def test_the_swap_keeps_the_weights_and_their_names():
    torch.manual_seed(0)
    model = tat.make_model(20, 20, N=2, d_model=16, d_ff=32, h=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert tools.use_layer_norm_kernel(model) is model
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    kinds = {type(m) for m in model.modules()}
    assert tools.KernelLayerNorm in kinds and tat.LayerNorm not in kinds


def test_at_cpu_kernels_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("AT_CPU_KERNELS", "0")
    monkeypatch.setattr(tools, "_LAYER_NORM_KERNEL", {})
    assert tools.layer_norm_kernel() is None


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_gradient_from_elsewhere_is_added_to_dx(kernel, dtype):
    """x's gradient through the residual connection, added in the same
    pass: dx + plus, rounded once."""
    x, a, b = inputs((9, 48), dtype, seed=5)
    grad, plus = (torch.randn(9, 48).to(dtype) for _ in range(2))
    _, mean, rstd = kernel.layer_norm(x, a, b, EPS)
    alone = kernel.layer_norm_grad(grad, x, a, mean, rstd, None)
    added = kernel.layer_norm_grad(grad, x, a, mean, rstd, plus)
    expected = alone[0].double() + plus.double()
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    scale = expected.abs().max().item()
    torch.testing.assert_close(
        added[0].double(), expected, rtol=0, atol=tolerance * scale
    )
    for mine, theirs in zip(added[1:], alone[1:], strict=True):
        assert torch.equal(mine, theirs)
    with pytest.raises(RuntimeError, match="^layer norm kernel: a gradient"):
        kernel.layer_norm_grad(grad, x, a, mean, rstd, plus[:3])


def residual_block_results(cls, dtype):
    """Output and gradients of a residual block (a LayerNorm, a linear
    map, dropout 0.3) run as `cls`, from one seed."""
    torch.manual_seed(0)
    model = tat.make_model(20, 20, N=1, d_model=16, d_ff=32, h=2, dropout=0.3)
    tools.use_dropout_kernel(model)
    tools.use_layer_norm_kernel(model)
    block = model.encoder.layers[0].ff_block
    assert type(block) is tools.KernelNormSublayerConnection
    block.__class__ = cls
    linear = torch.nn.Linear(16, 16)
    torch.manual_seed(8)
    x = torch.randn(6, 11, 16).to(dtype).requires_grad_()
    with torch.autocast("cpu", BF16, enabled=dtype == BF16):
        out = block(x, linear)
    weights = torch.linspace(-1, 1, out.numel()).view(out.shape)
    out.backward(weights.to(out.dtype))
    params = [*block.parameters(), *linear.parameters()]
    return [out.detach(), x.grad] + [p.grad for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_residual_block_adds_x_s_two_gradients_in_the_kernel(
    kernel, dtype
):
    """KernelNormSublayerConnection computes what the dropout kernel's
    KernelSublayerConnection does: the same mask, the same numbers, x's
    gradients added in the LayerNorm kernel instead of by autograd."""
    fused = residual_block_results(tools.KernelNormSublayerConnection, dtype)
    plain = residual_block_results(tools.KernelSublayerConnection, dtype)
    assert torch.equal(fused[0], plain[0])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in zip(fused[1:], plain[1:], strict=True):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance * scale)
