"""The appendix's C++ dropout kernel (KernelDropout): its mask against an
independent SplitMix64 in Python integers, its values against torch's
arithmetic, its backward pass, its statistics, and the fallbacks."""

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

MASK64 = 2**64 - 1
GAMMA = 0x9E3779B97F4A7C15


def reference_lanes(seed, n):
    """n 16-bit lanes: SplitMix64 of seed + (w + 1) * GAMMA for each group
    w of four elements, low lane first (Steele, Lea and Flood, 2014)."""
    lanes = []
    for w in range((n + 3) // 4):
        z = (seed + (w + 1) * GAMMA) & MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
        lanes.extend((z >> (16 * k)) & 0xFFFF for k in range(4))
    return torch.tensor(lanes[:n], dtype=torch.int64)


def reference_dropout(x, seed, p):
    """What the kernel must return: torch's own x * (0 or scale), with
    the mask from reference_lanes."""
    dropped, scale = tools.dropout_rule(p)
    keep = reference_lanes(seed, x.numel()).view(x.shape) >= dropped
    factor = torch.where(keep, scale, 0.0)  # float32, as the kernel's
    return (x.float() * factor).to(x.dtype), keep


@pytest.fixture(scope="module")
def kernel():
    built = tools.dropout_kernel()
    assert built is not None, "this machine has g++ and ninja: it must build"
    return built


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 1025), (5, 300, 7)])
@pytest.mark.parametrize("seed", [0, 12345, -(2**63), 2**63 - 1])
def test_the_kernel_drops_what_splitmix64_drops(kernel, dtype, shape, seed):
    """Shapes that end inside a group of four and inside a block of
    1,024; seeds at both ends of int64."""
    torch.manual_seed(1)
    x = torch.randn(shape).to(dtype)
    dropped, scale = tools.dropout_rule(0.3)
    out = kernel.masked_scale(x, seed, dropped, scale)
    expected, keep = reference_dropout(x, seed, 0.3)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, expected)
    assert torch.equal(out != 0, keep & (x != 0))


def test_nan_and_inf_are_multiplied_as_nn_dropout_multiplies(kernel):
    """A dropped nan stays nan and a dropped inf becomes nan (inf * 0),
    as in nn.Dropout's x * mask; kept ones are scaled."""
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    x = special.repeat(2000)
    for dtype in (torch.bfloat16, torch.float32):
        out = kernel.masked_scale(x.to(dtype), 7, *tools.dropout_rule(0.5))
        expected, keep = reference_dropout(x.to(dtype), 7, 0.5)
        assert 0 < keep.sum() < len(keep)
        torch.testing.assert_close(
            out, expected, equal_nan=True, rtol=0, atol=0
        )


def test_bf16_rounds_to_nearest_even_as_torch(kernel):
    """Values whose scaled product lands on and around bf16's ties."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = x.view(torch.bfloat16)  # every bf16 bit pattern
    x = x[torch.isfinite(x)]
    dropped, scale = tools.dropout_rule(0.1)
    out = kernel.masked_scale(x, 99, dropped, scale)
    expected, _ = reference_dropout(x, 99, 0.1)
    assert torch.equal(out, expected)


def test_a_non_contiguous_input_is_read_in_its_logical_order(kernel):
    x = torch.randn(40, 30).t()  # (30, 40), not contiguous
    out = kernel.masked_scale(x, 5, *tools.dropout_rule(0.2))
    expected, _ = reference_dropout(x.contiguous(), 5, 0.2)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_backward_pass_drops_the_same_elements(kernel, dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 33).to(dtype).requires_grad_()
    weights = torch.randn(64, 33).to(dtype)
    out = tools.KernelDropout(0.25)(x)
    (out.float() * weights.float()).sum().backward()
    keep = out != 0
    _, scale = tools.dropout_rule(0.25)
    expected = (weights.float() * torch.where(keep, scale, 0.0)).to(dtype)
    assert torch.equal(x.grad, expected)
    assert 0.15 < 1 - keep.float().mean() < 0.35


def test_the_mask_does_not_depend_on_the_thread_count(kernel):
    x = torch.randn(300, 1000)
    outs = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            outs.append(kernel.masked_scale(x, 3, *tools.dropout_rule(0.1)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_manual_seed_repeats_a_run_and_each_call_draws_anew(kernel):
    x = torch.ones(1000)
    dropout = tools.KernelDropout(0.5)
    torch.manual_seed(4)
    first, second = dropout(x), dropout(x)
    torch.manual_seed(4)
    again = dropout(x)
    assert torch.equal(first, again) and not torch.equal(first, second)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_the_share_dropped_is_p_in_every_lane_and_neighbours_are_independent(
    kernel, p
):
    """1,000,000 elements: each of the four 16-bit lanes of a hash drops
    its share p, within 4.5 standard deviations, and two neighbours in
    different groups, or in the same one, are both dropped with p**2."""
    torch.manual_seed(0)
    out = tools.KernelDropout(p)(torch.ones(250_000, 4))
    dropped = out == 0
    n = dropped.shape[0]
    sd = (p * (1 - p) / n) ** 0.5
    for lane in range(4):
        assert abs(dropped[:, lane].float().mean() - p) < 4.5 * sd
    both_sd = (p * p * (1 - p * p) / n) ** 0.5
    same_group = (dropped[:, 1] & dropped[:, 2]).float().mean()
    next_group = (dropped[:-1, 3] & dropped[1:, 0]).float().mean()
    for share in (same_group, next_group):
        assert abs(share - p * p) < 4.5 * both_sd


def test_what_the_kernel_does_not_take_goes_to_fast_dropout(kernel):
    """float64, in place, eval mode, p of 0 and 1: as FastDropout."""
    x = torch.ones(100, 100, dtype=torch.float64)
    for p in (0.0, 1.0):
        assert torch.equal(tools.KernelDropout(p)(x), tools.FastDropout(p)(x))
    assert tools.KernelDropout(0.3).eval()(x) is x
    for make in (
        lambda: x.clone(),  # float64
        lambda: torch.ones(100, 100, dtype=torch.float16),
    ):
        torch.manual_seed(2)
        mine = tools.KernelDropout(0.3)(make())
        torch.manual_seed(2)
        assert torch.equal(mine, tools.FastDropout(0.3)(make()))
    y = torch.ones(100, 100)
    torch.manual_seed(2)
    mine = tools.KernelDropout(0.3, inplace=True)(y)
    assert mine is y  # FastDropout's in-place path
    torch.manual_seed(2)
    assert torch.equal(mine, tools.FastDropout(0.3)(torch.ones(100, 100)))


def test_use_dropout_kernel_swaps_every_dropout_and_keeps_p():
    model = tools.use_fast_dropout(tat.make_model(30, 30, N=1, dropout=0.2))
    tools.use_dropout_kernel(model)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and {type(m) for m in dropouts} == {tools.KernelDropout}
    assert {m.p for m in dropouts} == {0.2}


def forget_the_kernel(monkeypatch):
    """An empty in-process cache, restored after the test."""
    monkeypatch.setattr(tools, "_DROPOUT_KERNEL", {})


def test_a_failed_build_says_why_in_one_line_and_training_goes_on(
    monkeypatch, capsys
):
    import torch.utils.cpp_extension as cpp

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: g++ not found\nmore")

    forget_the_kernel(monkeypatch)
    monkeypatch.setattr(cpp, "load_inline", no_compiler)
    monkeypatch.setattr(tools, "_kernel_is_built", lambda name: False)
    assert tools.dropout_kernel() is None
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0] == "building the CPU dropout kernel (once; about 20 s)"
    assert lines[1:] == [
        "no CPU dropout kernel (Error building extension: g++ not found);"
        " using FastDropout"
    ]
    dropped = tools.KernelDropout(0.5)(torch.ones(10_000)) == 0  # FastDropout
    assert 0.45 < dropped.float().mean() < 0.55
    assert tools.dropout_kernel() is None and capsys.readouterr().out == ""


def test_at_dropout_kernel_0_turns_it_off(monkeypatch):
    forget_the_kernel(monkeypatch)
    monkeypatch.setenv("AT_CPU_KERNELS", "0")
    assert tools.dropout_kernel() is None
    assert tools._DROPOUT_KERNEL == {}  # nothing built


def test_each_kind_of_cpu_gets_its_own_build(monkeypatch, capsys):
    """-march=native builds for this CPU: the build's name carries the
    CPU's model and flags, so another CPU never loads it."""
    import torch.utils.cpp_extension as cpp

    names = []
    monkeypatch.setattr(
        cpp, "load_inline", lambda name, **kwargs: names.append(name)
    )
    monkeypatch.setattr(tools, "_kernel_is_built", lambda name: True)
    for identity in ("flags: avx2", "flags: avx2 avx512f", "flags: avx2"):
        monkeypatch.setattr(tools, "_cpu_identity", lambda i=identity: i)
        tools._build_dropout_kernel()
    assert names[0] != names[1] and names[0] == names[2]
    assert all(name.startswith("at_dropout_") for name in names)


@pytest.mark.parametrize(
    "platform_name, machine, native, openmp",
    [
        ("linux", "x86_64", True, True),
        ("linux", "aarch64", False, True),
        ("darwin", "arm64", False, False),
    ],
)
def test_native_flags_on_x86_linux_and_openmp_on_linux(
    monkeypatch, platform_name, machine, native, openmp
):
    monkeypatch.setattr(tools.sys, "platform", platform_name)
    monkeypatch.setattr(tools.platform, "machine", lambda: machine)
    flags = tools._kernel_flags()
    assert flags[:3] == ["-O3", "-ffp-contract=off", "-fno-trapping-math"]
    assert ("-march=native" in flags) == native
    assert ("-fopenmp" in flags) == openmp


@pytest.mark.parametrize(
    "device, dropout, wanted",
    [
        ("cpu", 0.1, True),
        ("cpu", 0.0, False),
        ("cuda", 0.1, False),
        ("mps", 0.1, False),
    ],
)
def test_training_wants_the_kernel_on_the_cpu_with_dropout(
    device, dropout, wanted
):
    assert tools.wants_dropout_kernel(device, dropout) == wanted


def test_the_boundary_lane_is_kept_and_the_one_below_dropped(kernel):
    """p chosen so that `dropped` equals lane 5's value exactly: element
    5 is kept (lane >= dropped), and with dropped one higher it is not."""
    lanes = reference_lanes(77, 8)
    lane = int(lanes[5])
    x = torch.ones(8)
    kept = kernel.masked_scale(x, 77, lane, 2.0)
    gone = kernel.masked_scale(x, 77, lane + 1, 2.0)
    assert kept[5] == 2.0 and gone[5] == 0.0
    assert torch.equal(kept != 0, lanes >= lane)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_modes_against_torch(kernel, dtype):
    """add_masked_scale, relu_masked_scale and where_positive, each
    against torch's arithmetic in float32, rounded once, with the
    reference mask; nan included."""
    torch.manual_seed(3)
    x = torch.randn(7, 301)
    x[0, :8] = float("nan")
    residual = torch.randn(7, 301).to(dtype)
    x = x.to(dtype)
    seed, (dropped, scale) = 11, tools.dropout_rule(0.3)
    keep = reference_lanes(seed, x.numel()).view(x.shape) >= dropped
    factor = torch.where(keep, scale, 0.0)
    added = kernel.add_masked_scale(residual, x, seed, dropped, scale)
    expected = (x.float() * factor + residual.float()).to(dtype)
    torch.testing.assert_close(added, expected, rtol=0, atol=0, equal_nan=True)
    relu = kernel.relu_masked_scale(x, seed, dropped, scale)
    expected = (x.float().relu() * factor).to(dtype)
    torch.testing.assert_close(relu, expected, rtol=0, atol=0, equal_nan=True)
    grad = torch.randn(7, 301).to(dtype)
    back = kernel.where_positive(grad, relu, scale)
    expected = torch.where(relu.float() > 0, grad.float() * scale, 0.0)
    assert torch.equal(back, expected.to(dtype))


def test_two_tensors_must_match(kernel):
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        kernel.add_masked_scale(torch.ones(3), torch.ones(4), 0, 1, 1.0)
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        kernel.masked_scale(torch.ones(3, dtype=torch.float64), 0, 1, 1.0)


def fused_and_plain(module, run):
    """run(module) with the kernel's class, then with Part 1's, from the
    same seed, in float32: (outputs, gradients) of each."""
    results = []
    for cls in (type(module), type(module).__mro__[1]):
        module.__class__ = cls
        module.zero_grad()
        torch.manual_seed(8)
        x = torch.randn(6, 11, 16, requires_grad=True)
        out = run(module, x)
        (
            out * torch.linspace(-1, 1, out.numel()).view(out.shape)
        ).sum().backward()
        grads = [x.grad] + [p.grad for p in module.parameters()]
        results.append((out.detach(), grads))
    return results


def test_the_fused_residual_connection_computes_part_1s(kernel):
    """The same seed gives the same mask: KernelSublayerConnection and
    Part 1's x + dropout(sublayer(norm(x))) agree exactly in float32,
    forward and backward."""
    model = tools.use_dropout_kernel(
        tat.make_model(20, 20, N=1, d_model=16, d_ff=32, h=2)
    )
    block = model.encoder.layers[0].ff_block
    assert type(block) is tools.KernelSublayerConnection
    linear = torch.nn.Linear(16, 16)
    fused, plain = fused_and_plain(block, lambda m, x: m(x, linear))
    assert torch.equal(fused[0], plain[0])
    torch.manual_seed(8)
    x = torch.randn(6, 11, 16)  # the same x, with dropout off
    assert not torch.equal(fused[0], block.eval()(x, linear).detach())
    for a, b in zip(fused[1], plain[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_fused_feed_forward_computes_part_1s(kernel):
    model = tools.use_dropout_kernel(
        tat.make_model(20, 20, N=1, d_model=16, d_ff=32, h=2)
    )
    ff = model.encoder.layers[0].feed_forward
    assert type(ff) is tools.KernelFeedForward
    fused, plain = fused_and_plain(ff, lambda m, x: m(x))
    assert torch.equal(fused[0], plain[0])
    for a, b in zip(fused[1], plain[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_swap_keeps_the_weights_and_their_names():
    torch.manual_seed(0)
    model = tat.make_model(20, 20, N=2, d_model=16, d_ff=32, h=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tools.use_dropout_kernel(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    kinds = {type(m) for m in model.modules()}
    assert tat.SublayerConnection not in kinds
    assert tat.PositionwiseFeedForward not in kinds


def test_in_eval_mode_the_fused_modules_add_and_relu_only(kernel):
    model = tat.make_model(20, 20, N=1, d_model=16, d_ff=32, h=2).eval()
    src = torch.randint(3, 20, (2, 5))
    tgt = torch.randint(3, 20, (2, 4))
    masks = (torch.ones(2, 1, 5, dtype=torch.bool), tat.subsequent_mask(4))
    before = model(src, tgt, *masks)
    tools.use_dropout_kernel(model)
    assert torch.equal(model(src, tgt, *masks), before)


def test_the_swaps_keep_a_model_in_eval_mode():
    model = tat.make_model(20, 20, N=1, d_model=16, d_ff=32, h=2).eval()
    tools.use_fast_dropout(model)
    assert not any(m.training for m in model.modules())
    tools.use_dropout_kernel(model)
    assert not any(m.training for m in model.modules())


def test_building_is_announced_only_when_torch_has_no_build(
    kernel, monkeypatch, capsys
):
    """This session built the kernel (the fixture), so loading it again
    says nothing; under a fresh extensions folder it says it builds."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "load_inline", lambda name, **kwargs: name)
    tools._build_dropout_kernel()
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/nonexistent/extensions")
    monkeypatch.setattr(tools.os, "makedirs", lambda *a, **k: None)
    tools._build_dropout_kernel()
    assert "building the CPU dropout kernel" in capsys.readouterr().out


def test_an_empty_tensor_gives_an_empty_tensor(kernel):
    empty = torch.ones(0, 7, dtype=torch.bfloat16)
    out = kernel.masked_scale(empty, 1, *tools.dropout_rule(0.1))
    assert out.shape == (0, 7) and out.dtype == torch.bfloat16


def seeded_like_the_kernel(seed):
    """The seed the next kernel call will draw after manual_seed(seed)."""
    torch.manual_seed(seed)
    drawn = torch.empty((), dtype=torch.int64).random_(-(2**63), None)
    torch.manual_seed(seed)
    return drawn.item()


def test_the_fused_functions_backward_in_bf16(kernel):
    """The gradients of residual + dropout(x) and dropout(relu(x)) in
    bf16, against the reference mask, rounded once."""
    torch.manual_seed(0)
    x = torch.randn(9, 130).bfloat16().requires_grad_()
    residual = torch.randn(9, 130).bfloat16().requires_grad_()
    grad = torch.randn(9, 130).bfloat16()
    dropped, scale = tools.dropout_rule(0.2)
    seed = seeded_like_the_kernel(5)
    out = tools.KernelAddDropoutFunction.apply(residual, x, 0.2, kernel)
    out.backward(grad)
    keep = reference_lanes(seed, x.numel()).view(x.shape) >= dropped
    factor = torch.where(keep, scale, 0.0)
    assert torch.equal(residual.grad, grad)
    assert torch.equal(x.grad, (grad.float() * factor).bfloat16())
    x.grad = None
    seed = seeded_like_the_kernel(6)
    out = tools.KernelReluDropoutFunction.apply(x, 0.2, kernel)
    out.backward(grad)
    keep = reference_lanes(seed, x.numel()).view(x.shape) >= dropped
    through = keep & (x.float() > 0)
    expected = torch.where(through, grad.float() * scale, 0.0).bfloat16()
    assert torch.equal(x.grad, expected)


def test_a_real_compiler_error_is_named_in_the_line(monkeypatch, capsys):
    """torch's message starts with the command line; the line said is
    the compiler's error."""
    import torch.utils.cpp_extension as cpp

    message = (
        "Error building extension 'at_dropout_x': [1/2] c++ -MMD -MF x.o.d\n"
        "FAILED: x.o\n"
        "x.cpp:1:10: fatal error: torch/extension.h: No such file\n"
        "compilation terminated."
    )

    def fails(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(tools, "_DROPOUT_KERNEL", {})
    monkeypatch.setattr(cpp, "load_inline", fails)
    monkeypatch.setattr(tools, "_kernel_is_built", lambda name: True)
    assert tools.dropout_kernel() is None
    assert capsys.readouterr().out == (
        "no CPU dropout kernel (x.cpp:1:10: fatal error: torch/extension.h:"
        " No such file); using FastDropout\n"
    )


@pytest.mark.parametrize("platform_name", ["darwin", "win32"])
def test_the_kernels_are_used_on_linux_only(monkeypatch, platform_name):
    """Elsewhere they would run on one thread (no OpenMP)."""
    monkeypatch.setattr(tools, "_DROPOUT_KERNEL", {})
    monkeypatch.setattr(tools.sys, "platform", platform_name)
    assert not tools.kernels_allowed()
    assert tools.dropout_kernel() is None and tools.loss_kernel() is None
    assert tools.layer_norm_kernel() is None
