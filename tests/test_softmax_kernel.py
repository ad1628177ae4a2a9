"""The appendix's attention kernel: dropout(softmax(scores / div)) where a
mask allows, in one pass (KernelMultiHeadedAttention). Its weights and
gradients against float64 torch, its dropout against an independent
SplitMix64, and the module against Part 1's attention."""

import math

import pytest
import torch
from test_dropout_kernel import reference_lanes

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

DIV = 8.0  # sqrt(d_k) for d_k = 64


@pytest.fixture(scope="module")
def kernel():
    built = tools.dropout_kernel()
    assert built is not None, "this machine has g++ and ninja: it must build"
    return built


def scores_and_mask(shape, mask_rows, dtype, seed=0):
    """Scores of `shape` (B, h, T, S) and a bool (B, 1, mask_rows, S) mask
    with about a third closed, the first column always open."""
    gen = torch.Generator().manual_seed(seed)
    B, _, _, S = shape
    x = (torch.randn(shape, generator=gen) * 6).to(dtype)
    mask = torch.rand(B, 1, mask_rows, S, generator=gen) > 0.3
    mask[..., 0] = True
    return x, mask


def reference_weights(x, mask, div=DIV):
    """Part 1's masked softmax of x / div, in float64."""
    scores = (x.double() / div).masked_fill(~mask, -math.inf)
    return scores.softmax(-1)


SHAPES = [  # (B, h, T, S), mask rows: S below, at and past 16; a row
    ((3, 4, 7, 9), 7),  # per query (decoder) or one per sentence
    ((2, 2, 5, 1), 1),
    ((3, 2, 4, 16), 1),
    ((2, 3, 6, 17), 6),
    ((1, 1, 37, 3), 37),  # rows past a block of 32; S < 16: the tail
    ((2, 8, 30, 40), 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "mask_rows"), SHAPES)
def test_the_weights_are_the_masked_softmax(kernel, dtype, shape, mask_rows):
    x, mask = scores_and_mask(shape, mask_rows, dtype)
    seed, dropped, scale = 12345, *tools.dropout_rule(0.1)
    weights, _ = kernel.softmax_masked_scale(
        x, mask, DIV, seed, dropped, scale
    )
    assert weights.dtype == dtype and weights.shape == x.shape
    tolerance = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: 8 bits
    expected = reference_weights(x, mask)
    torch.testing.assert_close(
        weights.double(), expected, rtol=0, atol=tolerance
    )
    assert not weights.masked_select(~mask.expand_as(x)).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "mask_rows"), SHAPES)
def test_the_dropout_is_splitmix64s_mask_of_the_weights(
    kernel, dtype, shape, mask_rows
):
    x, mask = scores_and_mask(shape, mask_rows, dtype, seed=1)
    seed, p = -(2**62) + 7, 0.3
    dropped, scale = tools.dropout_rule(p)
    weights, out = kernel.softmax_masked_scale(
        x, mask, DIV, seed, dropped, scale
    )
    keep = reference_lanes(seed, x.numel()).view(x.shape) >= dropped
    factor = torch.where(keep, scale, 0.0)
    assert torch.equal(out, (weights.float() * factor).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "mask_rows"), SHAPES)
def test_the_gradient_is_float64_autograds(kernel, dtype, shape, mask_rows):
    x, mask = scores_and_mask(shape, mask_rows, dtype, seed=2)
    seed, p = 99, 0.2
    dropped, scale = tools.dropout_rule(p)
    weights, _ = kernel.softmax_masked_scale(
        x, mask, DIV, seed, dropped, scale
    )
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    grad = grad.to(dtype)
    got = kernel.softmax_masked_scale_grad(
        grad, weights, mask, DIV, seed, dropped, scale
    )
    x64 = x.double().requires_grad_()
    keep = reference_lanes(seed, x.numel()).view(x.shape) >= dropped
    out = reference_weights(x64, mask) * torch.where(keep, scale, 0.0)
    out.backward(grad.double())
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2 * scale
    torch.testing.assert_close(got.double(), x64.grad, rtol=0, atol=tolerance)


def test_a_row_with_every_column_closed_is_uniform_as_in_torch(kernel):
    """Part 1 fills closed columns with the lowest float: a row closed
    everywhere then has equal scores, hence uniform weights, and no
    gradient (masked_fill passes none back)."""
    x = torch.randn(2, 3, 4, 5) * 4
    x[1, :, 2, 1] = math.nan  # even a closed nan is ignored
    mask = torch.ones(2, 1, 4, 5, dtype=torch.bool)
    mask[1, 0, 2] = False
    weights, _ = kernel.softmax_masked_scale(x, mask, DIV, 0, 0, 1.0)
    lowest = torch.finfo(x.dtype).min
    expected = (x / DIV).masked_fill(~mask, lowest).softmax(-1)
    torch.testing.assert_close(weights, expected)
    assert torch.equal(weights[1, :, 2], torch.full((3, 5), 0.2))
    grad = kernel.softmax_masked_scale_grad(
        torch.randn(2, 3, 4, 5), weights, mask, DIV, 0, 0, 1.0
    )
    assert not grad[1, :, 2].any()
    assert grad[0].any()


def test_nan_where_open_spreads_over_its_row_as_in_torch(kernel):
    x = torch.randn(1, 1, 3, 6)
    x[0, 0, 1, 2] = math.nan
    mask = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    weights, _ = kernel.softmax_masked_scale(x, mask, DIV, 0, 0, 1.0)
    assert weights[0, 0, 1].isnan().all()
    assert not weights[0, 0, [0, 2]].isnan().any()


def test_the_thread_count_changes_nothing(kernel):
    x, mask = scores_and_mask((4, 8, 50, 23), 50, torch.bfloat16, seed=4)
    grad = torch.randn(x.shape).bfloat16()
    rule = (777, *tools.dropout_rule(0.1))
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            weights, out = kernel.softmax_masked_scale(x, mask, DIV, *rule)
            back = kernel.softmax_masked_scale_grad(
                grad, weights, mask, DIV, *rule
            )
            results.append((weights, out, back))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_an_empty_tensor_gives_an_empty_tensor(kernel):
    x = torch.randn(2, 4, 0, 5)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    weights, out = kernel.softmax_masked_scale(x, mask, DIV, 0, 0, 1.0)
    assert weights.shape == out.shape == x.shape


@pytest.mark.parametrize(
    ("scores", "mask", "message"),
    [
        (torch.randn(2, 3, 4), torch.ones(2, 1, 4).bool(), "(B, h, T, S)"),
        (torch.randn(2, 3, 4, 5), torch.ones(2, 1, 1, 5), "a bool mask"),
        (
            torch.randn(2, 3, 4, 5),
            torch.ones(2, 1, 3, 5).bool(),
            "(B, 1, 1 or T, S)",
        ),
        (
            torch.randn(2, 3, 4, 5, dtype=torch.float64),
            torch.ones(2, 1, 1, 5).bool(),
            "bf16 or float32",
        ),
    ],
)
def test_what_it_cannot_take_is_refused_in_one_line(
    kernel, scores, mask, message
):
    with pytest.raises(RuntimeError) as error:
        kernel.softmax_masked_scale(scores, mask, DIV, 0, 0, 1.0)
    first = str(error.value).splitlines()[0]
    assert first.startswith("softmax kernel:") and message in first


def attention_pair(kind):
    """A KernelMultiHeadedAttention of d_model 16 and its inputs: decoder
    self-attention (a (B, T, T) mask) or encoder-style (a (B, 1, S) one)."""
    torch.manual_seed(0)
    model = tools.use_dropout_kernel(
        tat.make_model(20, 20, N=1, d_model=16, d_ff=32, h=2, dropout=0.3)
    )
    if kind == "decoder":
        module = model.decoder.layers[0].self_attn
        mask = tat.subsequent_mask(11).expand(6, 11, 11)
    else:
        module = model.encoder.layers[0].self_attn
        mask = torch.ones(6, 1, 11, dtype=torch.bool)
        mask[2:, :, 7:] = False  # padding
    assert type(module) is tools.KernelMultiHeadedAttention
    return module, mask


def run_attention(module, cls, mask, inputs="self"):
    """Output and gradients of `module` run as `cls`, from one seed.
    `inputs`: "self" attends x to itself, "memory" x to a memory m (the
    decoder's second attention), "three" three different tensors."""
    module.__class__ = cls
    module.zero_grad()
    torch.manual_seed(8)
    x, m, y = (torch.randn(6, 11, 16, requires_grad=True) for _ in range(3))
    query, key, value = {
        "self": (x, x, x),
        "memory": (x, m, m),
        "three": (x, m, y),
    }[inputs]
    out = module(query, key, value, mask)
    weights = torch.linspace(-1, 1, out.numel()).view(out.shape)
    (out * weights).sum().backward()
    grads = [t.grad for t in (x, m, y)]
    return out.detach(), grads + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("inputs", ["self", "memory", "three"])
@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_the_module_computes_part_1s_attention(kernel, kind, inputs):
    """The same seed draws the same mask: the kernel's attention and Part
    1's (whose KernelDropout drops the weights) agree in float32 to the
    last bits (their exponentials differ), forward and backward, with
    dropout on, in self-attention, attention to a memory, and attention
    with three different inputs."""
    module, mask = attention_pair(kind)
    cls = tools.KernelMultiHeadedAttention
    fused = run_attention(module, cls, mask, inputs)
    plain = run_attention(module, tat.MultiHeadedAttention, mask, inputs)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(fused[1], plain[1], strict=True):
        if a is None or b is None:  # an input this case does not use
            assert a is None and b is None
            continue
        # W^K's bias has a gradient of 0 in exact arithmetic (a softmax
        # ignores a constant added to a row), so no relative tolerance
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    module.eval()
    with torch.no_grad():
        x = torch.randn(6, 11, 16)
        assert not torch.allclose(module(x, x, x, mask), fused[0])


def test_a_mask_for_every_sentence_at_once_is_broadcast(kernel):
    """Part 1's attention broadcasts a (1, T, T) mask, subsequent_mask's
    own, over the batch; so does the kernel's."""
    module, _ = attention_pair("decoder")
    mask = tat.subsequent_mask(11)  # (1, 11, 11)
    fused = run_attention(module, tools.KernelMultiHeadedAttention, mask)
    plain = run_attention(module, tat.MultiHeadedAttention, mask)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(fused[1], plain[1], strict=True):
        if a is None or b is None:  # m and y: unused in self-attention
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_eval_and_stored_weights_take_part_1s_code(kernel):
    module, mask = attention_pair("decoder")
    x = torch.randn(6, 11, 16)
    with torch.no_grad():
        kernel_eval = module.eval()(x, x, x, mask)
        module.__class__ = tat.MultiHeadedAttention
        assert torch.equal(module(x, x, x, mask), kernel_eval)
        module.__class__ = tools.KernelMultiHeadedAttention
        module.train()
        module.store_attention = True  # Part 4 reads the weights
        module(x, x, x, mask)
    assert module.attn is not None and module.attn.shape == (6, 2, 11, 11)


def test_without_the_kernel_of_softmax_is_part_1s_formula(monkeypatch):
    """float64 scores (or no kernel) take torch's code: Part 1's masked
    softmax, then FastDropout."""
    dropout = tools.KernelDropout(0.25)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    mask = torch.rand(2, 1, 4, 5) > 0.3
    mask[..., 0] = True
    torch.manual_seed(5)
    got = dropout.of_softmax(x, mask, DIV)
    lowest = torch.finfo(x.dtype).min
    torch.manual_seed(5)
    weights = (x / DIV).masked_fill(~mask, lowest).softmax(-1)
    assert torch.equal(got, tools.FastDropout(0.25)(weights))
