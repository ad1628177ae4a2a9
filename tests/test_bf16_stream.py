"""use_bf16_stream: the residual stream in bf16 under CPU bf16 autocast
(the appendix's "A bf16 residual stream, on the CPU")."""

import contextlib
import copy

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

BF16 = torch.bfloat16
VOCAB = 60


def small_model(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return tat.make_model(
        VOCAB, VOCAB, N=2, d_model=64, d_ff=128, h=4, dropout=dropout
    )


def small_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, VOCAB, (16, 12), generator=generator)
    tgt = torch.randint(3, VOCAB, (16, 11), generator=generator)
    src[:4, -3:] = tat.PAD  # some padding on both sides
    tgt[:4, -2:] = tat.PAD
    return tat.Batch(src, tgt, tat.PAD)


def in_bf16():
    return torch.autocast("cpu", BF16)


def layer_input_dtypes(model, batch, autocast):
    """{module type name: set of dtypes its first input had}."""
    seen = {}

    def record(module, inputs, output):
        seen.setdefault(type(module).__name__, set()).add(inputs[0].dtype)

    kinds = (torch.nn.Linear, tat.LayerNorm, tat.Generator)
    hooks = [
        m.register_forward_hook(record)
        for m in model.modules()
        if isinstance(m, kinds)
    ]
    with autocast:
        out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        model.generator(out)
    for hook in hooks:
        hook.remove()
    return seen, out


def test_under_bf16_autocast_every_layer_reads_bf16():
    model, batch = small_model(), small_batch()
    seen, out = layer_input_dtypes(model, batch, in_bf16())
    assert seen["LayerNorm"] == {torch.float32}  # autocast alone: the stream
    assert seen["Linear"] == {torch.float32, BF16}  # is float32
    assert out.dtype == torch.float32
    tools.use_bf16_stream(model)
    seen, out = layer_input_dtypes(model, batch, in_bf16())
    assert seen == {"Linear": {BF16}, "LayerNorm": {BF16}, "Generator": {BF16}}
    assert out.dtype == BF16


def test_outside_autocast_the_hook_changes_nothing():
    model, batch = small_model(dropout=0.1).eval(), small_batch()
    expected = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    tools.use_bf16_stream(model)
    seen, out = layer_input_dtypes(model, batch, contextlib.nullcontext())
    assert set().union(*seen.values()) == {torch.float32}
    assert torch.equal(out, expected)


def test_weights_and_checkpoints_are_unchanged():
    model = small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert tools.use_bf16_stream(model) is model
    after = model.state_dict()
    assert list(after) == list(before)  # no new modules, no new keys
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def loss_and_grads(model, batch, autocast, dtype=None):
    """One training step's loss and gradients, in float64 for comparing."""
    model = copy.deepcopy(model)
    if dtype is not None:
        model.to(dtype)
    criterion = tools.FastLabelSmoothing(VOCAB, tat.PAD, 0.1)
    compute = tools.FusedLossCompute(model.generator, criterion)
    with autocast:
        out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        _, loss = compute(out, batch.tgt_y, batch.ntokens)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return loss.double(), grads.double()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_bf16_stream_is_about_as_accurate_as_autocast_alone(seed):
    """Against the same step in float64: the loss within 2e-3 and the
    gradients within twice the error of autocast's float32 stream (both
    about 2% on a Xeon with AMX, mostly the bf16 matrix products'; the margin
    is for CPUs whose bf16 kernels round differently)."""
    model, batch = small_model(seed), small_batch(seed)
    no_autocast = contextlib.nullcontext()
    ref_loss, ref_grads = loss_and_grads(
        model, batch, no_autocast, torch.float64
    )
    loss32, grads32 = loss_and_grads(model, batch, in_bf16())
    streamed = tools.use_bf16_stream(copy.deepcopy(model))
    loss16, grads16 = loss_and_grads(streamed, batch, in_bf16())

    def error(grads):
        return ((grads - ref_grads).norm() / ref_grads.norm()).item()

    assert abs(loss16 - ref_loss) < 2e-3 and abs(loss32 - ref_loss) < 2e-3
    assert error(grads16) < 2 * error(grads32) < 0.06
    assert not torch.equal(grads16, grads32)  # the stream changed the step


@pytest.mark.parametrize(
    "device, precision, expected",
    [
        ("cpu", tools.Precision(BF16, False), True),
        ("cpu", tools.Precision(None, False), False),
        ("cuda", tools.Precision(BF16, False), False),
        ("cuda:1", tools.Precision(torch.float16, True), False),
        ("mps", tools.Precision(None, False), False),
    ],
)
def test_which_runs_use_the_bf16_stream(device, precision, expected):
    assert tools.wants_bf16_stream(device, precision) is expected
