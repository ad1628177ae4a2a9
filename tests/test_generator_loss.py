"""GeneratorLoss and FusedLossCompute: the appendix's generator and
label-smoothed loss in one, a block at a time, checked against Part 1's
Generator followed by Part 2's LabelSmoothing through its target matrix
(the definition), through autograd, and against torch's numerical
gradient check."""

import types

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

PAD = tat.PAD


def inputs(rows, d_model, vocab, dtype=torch.float64, seed=0):
    """A generator, decoder states and targets, every 5th one padding."""
    torch.manual_seed(seed)
    generator = tat.Generator(d_model, vocab).to(dtype)
    x = torch.randn(rows, d_model, dtype=dtype)
    target = torch.randint(0, vocab, (rows,))
    target[::5] = PAD
    if rows > 1:
        target[1] = vocab - 1  # a real row, in the last block of words
    return generator, x, target


def loss_and_grads(compute_cls, generator, x, target, smoothing, **kwargs):
    """compute_cls's summed loss, and the gradients of x, W and b after
    backpropagating 3 times the mean over 7 tokens."""
    criterion = tat.LabelSmoothing(
        generator.proj.out_features, PAD, smoothing, **kwargs
    )
    compute = compute_cls(generator, criterion)
    x = x.clone().requires_grad_()
    generator.zero_grad()
    loss_sum, loss_mean = compute(x, target, norm=7)
    (3 * loss_mean).backward()
    proj = generator.proj
    return loss_sum, [x.grad, proj.weight.grad, proj.bias.grad]


def by_definition(generator, x, target, smoothing):
    """The reference: log-softmax, then KLDivLoss against the full
    (N, V) smoothed targets, differentiated by autograd."""
    return loss_and_grads(
        tat.SimpleLossCompute,
        generator,
        x,
        target,
        smoothing,
        keep_targets=True,
    )


class SmallBlocks(tools.FusedLossCompute):
    """FusedLossCompute with blocks of at most 256 rows of 1,100 words
    (the default blocks would take every row here at once)."""

    block_logits = 256 * 1100


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.4])
@pytest.mark.parametrize(
    "rows, vocab",
    [
        (1, 7),  # one padding row: no loss at all
        (255, 7),  # padding in the only block
        (700, 1100),  # 560 real rows: three blocks of 187, 187 and 186
    ],
)
def test_loss_and_gradients_match_the_definition(smoothing, rows, vocab):
    generator, x, target = inputs(rows, 16, vocab)
    want_loss, want_grads = by_definition(generator, x, target, smoothing)
    loss, grads = loss_and_grads(SmallBlocks, generator, x, target, smoothing)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_gradcheck_in_float64():
    generator, x, target = inputs(12, 5, 9)
    proj = generator.proj
    weight = proj.weight.detach().clone().requires_grad_()
    bias = proj.bias.detach().clone().requires_grad_()
    x.requires_grad_()

    def loss(x, weight, bias):
        return tools.GeneratorLoss.apply(
            x, weight, bias, target, PAD, 0.1, None, 2**24
        )

    assert torch.autograd.gradcheck(loss, (x, weight, bias))


def test_padding_rows_get_no_gradient_and_all_padding_no_loss():
    generator, x, target = inputs(40, 8, 30)
    _, (grad_x, _, _) = loss_and_grads(
        tools.FusedLossCompute, generator, x, target, 0.1
    )
    assert (grad_x[target == PAD] == 0).all()
    assert (grad_x[target != PAD] != 0).any(dim=1).all()
    padding = torch.full((40,), PAD)
    loss, grads = loss_and_grads(
        tools.FusedLossCompute, generator, x, padding, 0.1
    )
    assert loss.item() == 0.0
    assert all((g == 0).all() for g in grads)


def test_bf16_autocast_is_as_close_to_float64_as_the_log_softmax_path():
    """Under bf16 autocast both paths round; the fused one must land as
    near the float64 truth as Generator then LabelSmoothing does, and
    return each gradient in its tensor's dtype."""
    generator, x, target = inputs(600, 64, 1100, dtype=torch.float32)
    truth_loss, truth = by_definition(
        generator.double(), x.double(), target, 0.1
    )
    generator.float()
    errors = {}
    for cls in (tat.SimpleLossCompute, tools.FusedLossCompute):
        with torch.autocast("cpu", torch.bfloat16):
            loss, grads = loss_and_grads(cls, generator, x, target, 0.1)
        assert loss.dtype == torch.float32
        assert [g.dtype for g in grads] == [torch.float32] * 3
        errors[cls] = [
            float((g.double() - t).abs().max() / t.abs().max())
            for g, t in zip(grads, truth, strict=True)
        ] + [abs(loss.item() - truth_loss.item()) / truth_loss.item()]
    fused, log_softmax = (
        errors[tools.FusedLossCompute],
        errors[tat.SimpleLossCompute],
    )
    for got, old in zip(fused, log_softmax, strict=True):
        assert got <= 1.5 * old + 1e-4, (fused, log_softmax)
    assert max(fused) < 0.02


def test_float64_stays_float64_under_bf16_autocast():
    """Autocast leaves float64 alone, so GeneratorLoss must too: under bf16
    autocast, float64 inputs give the float64 definition's numbers."""
    generator, x, target = inputs(300, 16, 50)
    want_loss, want_grads = by_definition(generator, x, target, 0.1)
    with torch.autocast("cpu", torch.bfloat16):
        assert tools.compute_dtype(x) == torch.float64
        assert tools.compute_dtype(x.float()) == torch.bfloat16
        loss, grads = loss_and_grads(
            tools.FusedLossCompute, generator, x, target, 0.1
        )
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_no_grad_gives_the_same_loss_as_validation_did():
    generator, x, target = inputs(300, 16, 50, dtype=torch.float32)
    criterion = tat.LabelSmoothing(50, PAD, 0.1)
    with torch.no_grad():
        old = tat.SimpleLossCompute(generator, criterion)(x, target, 10)
        new = tools.FusedLossCompute(generator, criterion)(x, target, 10)
    for a, b in zip(old, new, strict=True):
        torch.testing.assert_close(a, b)
        assert not b.requires_grad


def test_tied_embeddings_get_both_gradients():
    """With the generator's weight shared with the target embeddings (Part
    5's tie_embeddings), the shared weight's gradient is the sum of both
    uses, as through Generator then LabelSmoothing."""
    torch.manual_seed(0)
    model = tat.make_model(30, 30, N=1, d_model=16, d_ff=32, h=2, dropout=0.0)
    model = tat.tie_embeddings(model).double()
    src = torch.randint(3, 30, (4, 6))
    tgt = torch.randint(3, 30, (4, 7))
    batch = tat.Batch(src, tgt, pad=PAD)
    results = []
    for cls in (tat.SimpleLossCompute, tools.FusedLossCompute):
        model.zero_grad()
        out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        criterion = tat.LabelSmoothing(30, PAD, 0.1)
        _, loss_mean = cls(model.generator, criterion)(
            out, batch.tgt_y, batch.ntokens
        )
        loss_mean.backward()
        results.append([p.grad.clone() for p in model.parameters()])
    for old, new in zip(*results, strict=True):
        torch.testing.assert_close(new, old, rtol=1e-9, atol=1e-12)


def test_runs_on_the_cpu_use_it_and_others_do_not():
    config = tools.get_config("ci")
    run = tools.TrainingRun(0, 1, (30, 40), config, False, device="cpu")
    compute = tools.run_loss_compute(run)
    assert type(compute) is tools.FusedLossCompute
    assert compute.generator is run.module.generator
    assert compute.criterion is run.criterion
    for device in (torch.device("cuda", 0), torch.device("mps")):
        elsewhere = types.SimpleNamespace(
            device=device, module=run.module, criterion=run.criterion
        )
        compute = tools.run_loss_compute(elsewhere)
        assert type(compute) is tat.SimpleLossCompute, device


@pytest.mark.parametrize("rows", [0, 1, 255, 256, 257, 514, 3000, 8131])
@pytest.mark.parametrize("width, most", [(1100, 256 * 1100), (6190, 2**24)])
def test_blocks_hold_at_most_most_and_split_evenly(rows, width, most):
    per_block = tools.rows_per_block(rows, width, most)
    blocks = -(-rows // per_block)  # rounded up
    assert per_block * width <= most
    assert blocks == -(-rows // (most // width))  # no more than needed
    sizes = [min(per_block, rows - i) for i in range(0, rows, per_block)]
    assert sum(sizes) == rows and (not sizes or sizes[0] - sizes[-1] < blocks)


def test_a_row_wider_than_a_block_is_a_block_of_its_own():
    assert tools.rows_per_block(3, 100, 10) == 1
