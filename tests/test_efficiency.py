"""bench/efficiency.py: its FLOP count against torch's own FLOP counter,
and a fair peer (the same matmuls as ours)."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "efficiency", ROOT / "bench" / "efficiency.py"
)
efficiency = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(efficiency)

SIZES = dict(N=2, d_model=32, d_ff=64, vocab=50)


def contestant_args(compile=False, only=None, code_at_issue_18=None):
    """The options contestants_for reads, as parse_args gives them."""
    return SimpleNamespace(
        compile=compile, only=only, code_at_issue_18=code_at_issue_18
    )


def counted_training_flops(model, batch):
    """FLOPs that torch counts for one forward and backward pass."""
    with FlopCounterMode(display=False) as counter:
        out = model.generator(model(batch))
        out.sum().backward()
    return counter.get_total_flops()


def small_batch(B=3, S=7, T=5, V=50):
    torch.manual_seed(0)
    src = torch.randint(4, V, (B, S))
    tgt = torch.randint(4, V, (B, T + 1))
    return tat.Batch(src, tgt, pad=tat.PAD)


@pytest.mark.parametrize("B, S, T", [(3, 7, 5), (1, 12, 2), (4, 3, 9)])
def test_flop_formula_matches_torch_flop_counter(B, S, T):
    V = SIZES["vocab"]
    ours = efficiency.Ours(V, V, 2, 32, 64, 4, 0.0)
    # The explicit attention path runs its scores through matmuls, which
    # the counter sees; the fused kernel is invisible to it.
    for module in ours.modules():
        if isinstance(module, tat.MultiHeadedAttention):
            module.store_attention = True
    counted = counted_training_flops(ours, small_batch(B, S, T, V))
    assert counted == efficiency.training_flops(B, S, T, **SIZES)


def test_peer_does_the_same_matmuls_as_ours():
    V = SIZES["vocab"]
    batch = small_batch()
    peer = efficiency.TorchPeer(V, V, 2, 32, 64, 4, 0.0)
    ours = efficiency.Ours(V, V, 2, 32, 64, 4, 0.0)
    # With fused attention neither count includes the attention scores.
    assert counted_training_flops(peer, batch) == counted_training_flops(
        ours, batch
    )
    B, S, T = 3, 7, 5
    scores = 3 * 2 * (4 * B * S * S * 32 + 4 * B * T * T * 32)
    scores += 3 * 2 * 4 * B * T * S * 32
    assert counted_training_flops(peer, batch) == (
        efficiency.training_flops(B, S, T, **SIZES) - scores
    )


def test_real_token_flops_ignore_padding():
    config = tools.get_config("cpu")
    data = [([1] * 5, [1] * 4), ([1] * 9, [1] * 7)]
    total = efficiency.real_token_flops(data, config, 100)
    sizes = (config.N, config.d_model, config.d_ff, 100)
    one = efficiency.training_flops(1, 5, 3, *sizes)
    two = efficiency.training_flops(1, 9, 6, *sizes)
    assert total == one + two


def loss_and_grads(model_cls, batch, V=50):
    """Summed training loss and every gradient, dropout off."""
    torch.manual_seed(0)
    model = model_cls(V, V, 2, 32, 64, 4, 0.0)
    criterion = model_cls.criterion_cls(
        V, tat.PAD, 0.1, keep_targets=model_cls.keep_targets
    )
    compute = model_cls.loss_compute_cls(model.generator, criterion)
    loss, loss_mean = compute(model(batch), batch.tgt_y, norm=1)
    loss_mean.backward()
    return loss, [p.grad for p in model.parameters()]


def test_fast_paths_train_like_the_explained_ones():
    batch = small_batch()
    before = efficiency.OursBefore
    assert before.keep_targets and not efficiency.Ours.keep_targets
    norms = [m for m in before(50, 50, 2, 32, 64, 4, 0.0).modules()]
    assert any(
        m.forward.__func__ is efficiency.layer_norm_by_hand
        for m in norms
        if isinstance(m, tat.LayerNorm)
    )
    loss_fast, grads_fast = loss_and_grads(efficiency.Ours, batch)
    loss_slow, grads_slow = loss_and_grads(before, batch)
    torch.testing.assert_close(loss_fast, loss_slow)
    for fast, slow in zip(grads_fast, grads_slow, strict=True):
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)


def test_ours_trains_with_the_dropout_kernel_and_its_pairs_without():
    """ "ours" is the model as TrainingRun trains it on the CPU, with the
    C++ dropout kernel; "ours, random_ mask" and "ours, nn.Dropout"
    differ from it in the dropout mask alone."""
    labels = efficiency.contestants_for(contestant_args())
    assert labels["ours, nn.Dropout"] == (efficiency.OursTorchDropout, False)
    assert labels["ours, random_ mask"] == (efficiency.OursRandomMask, False)

    def dropout_types(cls):
        model = cls(50, 50, 2, 32, 64, 4, 0.1)
        return {type(m) for m in model.modules() if isinstance(m, nn.Dropout)}

    assert tools.dropout_kernel() is not None  # g++ and ninja are here
    assert dropout_types(efficiency.Ours) == {tools.KernelDropout}
    assert dropout_types(efficiency.OursRandomMask) == {tools.FastDropout}
    assert dropout_types(efficiency.OursTorchDropout) == {nn.Dropout}
    assert dropout_types(efficiency.OursBefore) == {nn.Dropout}


def test_ours_normalizes_with_the_layer_norm_kernel_and_its_pair_without():
    labels = efficiency.contestants_for(contestant_args())
    pair = labels["ours, torch LayerNorm"]
    assert pair == (efficiency.OursTorchLayerNorm, False)

    def norm_types(cls):
        model = cls(50, 50, 2, 32, 64, 4, 0.1)
        return {
            type(m) for m in model.modules() if isinstance(m, tat.LayerNorm)
        }

    assert tools.layer_norm_kernel() is not None  # g++ and ninja are here
    assert norm_types(efficiency.Ours) == {tools.KernelLayerNorm}
    assert norm_types(efficiency.OursTorchLayerNorm) == {tat.LayerNorm}
    assert norm_types(efficiency.OursBefore) == {tat.LayerNorm}
    assert norm_types(efficiency.OursAtIssue18) == {tat.LayerNorm}


def test_the_fused_attention_pair_differs_in_the_attention_path(monkeypatch):
    calls = []
    fused = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(tat.F, "scaled_dot_product_attention", counted)
    labels = efficiency.contestants_for(contestant_args())
    batch = small_batch()
    for cls, expected in (
        (efficiency.Ours, 0),
        (labels["ours, fused attention"][0], 6),  # 2 layers: 1 + 2 each
    ):
        calls.clear()
        model = cls(50, 50, 2, 32, 64, 4, 0.1).train()
        model(batch)
        assert len(calls) == expected


def test_ours_trains_with_the_fused_loss_and_its_pairs_with_the_old_ones():
    """ "ours" computes the loss as training on the CPU does
    (FusedLossCompute), and so does the peer; "ours, log-softmax loss"
    differs from ours in the loss alone, and "ours, autograd loss" from
    that one in the loss's backward pass alone."""
    labels = efficiency.contestants_for(contestant_args())
    log_softmax = labels["ours, log-softmax loss"][0]
    autograd = labels["ours, autograd loss"][0]
    assert efficiency.Ours.loss_compute_cls is tools.FusedLossCompute
    assert log_softmax.loss_compute_cls is tat.SimpleLossCompute
    assert log_softmax.criterion_cls is tools.FastLabelSmoothing
    assert autograd.loss_compute_cls is tat.SimpleLossCompute
    assert autograd.criterion_cls is tat.LabelSmoothing
    for pair in (log_softmax, autograd):
        assert pair.fast_dropout and not pair.keep_targets
    seen = []

    def recording(base):
        class Recording(base):
            def __call__(self, x, y, norm):
                seen.append(base)
                return super().__call__(x, y, norm)

        return Recording

    calls = {}
    original = efficiency.Ours.loss_compute_cls
    log_softmax_original = log_softmax.loss_compute_cls
    efficiency.Ours.loss_compute_cls = recording(original)
    log_softmax.loss_compute_cls = recording(log_softmax_original)
    try:
        for cls in (efficiency.Ours, efficiency.TorchPeer, log_softmax):
            seen.clear()
            efficiency.train_pass(
                cls, tiny_batches(1), (50, 50), tools.get_config("ci"), 0
            )
            calls[cls.__name__] = seen.copy()
    finally:
        efficiency.Ours.loss_compute_cls = original
        log_softmax.loss_compute_cls = log_softmax_original
    # one untimed step and one timed: the peer too, with ours' loss
    fused, simple = tools.FusedLossCompute, tat.SimpleLossCompute
    assert calls == {
        "Ours": [fused, fused],
        "TorchPeer": [fused, fused],
        "OursLogSoftmaxLoss": [simple, simple],
    }


def test_which_contestants_keep_the_stream_in_bf16():
    """Ours and the peer carry the bf16 residual stream, as training on
    the CPU does; "ours, float32 stream", and the contestants standing
    for earlier code, do not. Seen in the decoder's output dtype under
    bf16 autocast: bf16 with the stream, float32 (LayerNorm's) without."""
    labels = efficiency.contestants_for(contestant_args())
    expected = {
        "ours": torch.bfloat16,
        "nn.Transformer": torch.bfloat16,
        "ours, float32 stream": torch.float32,
        "ours, as at issue 18": torch.float32,
        "ours, before": torch.float32,
        "code at issue 18": torch.float32,
    }
    for label, dtype in expected.items():
        if label not in labels:  # code at issue 18 needs git history
            assert label == "code at issue 18"
            continue
        torch.manual_seed(0)
        model = labels[label][0](50, 50, 2, 32, 64, 4, 0.1).train()
        with torch.autocast("cpu", torch.bfloat16):
            assert model(small_batch()).dtype == dtype, label


def test_the_fused_and_log_softmax_losses_train_alike():
    """One training step of ours and of "ours, log-softmax loss" from the
    same seed: the same loss and gradients, to rounding (float32)."""
    batch = small_batch()
    labels = efficiency.contestants_for(contestant_args())
    loss_fused, grads_fused = loss_and_grads(efficiency.Ours, batch)
    loss_old, grads_old = loss_and_grads(
        labels["ours, log-softmax loss"][0], batch
    )
    torch.testing.assert_close(loss_fused, loss_old)
    for fused, old in zip(grads_fused, grads_old, strict=True):
        torch.testing.assert_close(fused, old, atol=1e-5, rtol=1e-4)


def test_help():
    proc = subprocess.run(
        [sys.executable, "bench/efficiency.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "MFU" in proc.stdout


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--presets", "nope"], "invalid choice: 'nope'"),
        (["--runs", "0"], "--runs"),
        (["--threads", "-1"], "--threads"),
        (["--sentences", "1"], "--sentences"),
    ],
)
def test_bad_arguments_are_one_line_before_any_work(argv, words, capsys):
    with pytest.raises(SystemExit) as stop:
        efficiency.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_auto_precision_is_what_training_picks(monkeypatch):
    for native, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(tools, "cpu_has_native_bf16", lambda n=native: n)
        assert efficiency.training_dtype("auto") is expected
        assert tools.choose_precision("cpu").dtype is expected
    assert efficiency.training_dtype("fp32") is None
    assert efficiency.training_dtype("bf16") is torch.bfloat16


def recording(model_cls, seen):
    """model_cls whose nn.Linear layers note their output dtypes in seen."""

    class Recording(model_cls):
        def __init__(self, *args):
            super().__init__(*args)
            for module in self.modules():
                if isinstance(module, torch.nn.Linear):
                    module.register_forward_hook(
                        lambda m, i, out: seen.add(out.dtype)
                    )

    return Recording


def tiny_batches(count=2):
    torch.manual_seed(0)
    return [small_batch(B=2, S=6, T=5, V=50) for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
@pytest.mark.parametrize("model_cls", [efficiency.Ours, efficiency.TorchPeer])
def test_train_pass_runs_both_models_in_the_chosen_precision(dtype, model_cls):
    config = tools.get_config("ci")
    seen = set()
    tokens, seconds, first = efficiency.train_pass(
        recording(model_cls, seen),
        tiny_batches(),
        (50, 50),
        config,
        0,
        dtype=dtype,
    )
    assert seen == {dtype or torch.float32}
    assert tokens == sum(b.ntokens for b in tiny_batches())


def test_forced_bf16_without_native_support_is_refused(monkeypatch):
    monkeypatch.setattr(tools, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(SystemExit) as stop:
        efficiency.main(["--precision", "bf16"])
    assert "no native bf16" in str(stop.value)


def test_main_measures_the_peak_in_the_training_precision(monkeypatch, capsys):
    monkeypatch.setattr(tools, "cpu_has_native_bf16", lambda: True)
    asked = []

    def fake_peak(dtype=torch.float32, sizes=(64,), repeats=1):
        asked.append(dtype)
        return {64: 1e9}

    monkeypatch.setattr(efficiency, "matmul_peak", fake_peak)
    monkeypatch.setattr(efficiency, "measure_preset", lambda *a: None)
    monkeypatch.setattr(
        efficiency, "load_sentences", lambda n, s: ([], (50, 50))
    )
    efficiency.main(["--sentences", "4"])
    assert asked == [torch.bfloat16]
    assert "bfloat16 autocast matmul peak" in capsys.readouterr().out


def test_compiled_contestants_compile_the_model_and_its_generator(
    monkeypatch,
):

    import torch.fx.experimental._config as shapes

    labels = efficiency.contestants_for(contestant_args(compile=True))
    assert labels["ours, compiled"] == (efficiency.Ours, True)
    assert labels["ours, compiled, nn.Dropout"] == (
        efficiency.OursTorchDropout,
        True,
    )
    eager = efficiency.contestants_for(contestant_args())
    assert not [label for label in eager if "compiled" in label]
    calls = []

    def fake_compile(call, **options):  # runs eagerly; notes the call
        calls.append((type(call.__self__), options, shapes.use_duck_shape))
        return call

    monkeypatch.setattr(torch, "compile", fake_compile)
    config = tools.get_config("ci")
    efficiency.train_pass(
        efficiency.Ours, tiny_batches(), (50, 50), config, 0, compile=True
    )
    # nn.Module.compile hands torch.compile each module's bound call
    assert calls == [
        (tat.EncoderDecoder, {"dynamic": True}, False),
        (tat.Generator, {"dynamic": True}, False),
    ]
    assert shapes.use_duck_shape is True  # restored afterwards


def optimizer_built_for(cls, monkeypatch):
    """The optimizer train_pass steps for a contestant."""
    built = []
    original = efficiency.adam_for

    def recording(model, fused):
        built.append(original(model, fused))
        return built[-1]

    monkeypatch.setattr(efficiency, "adam_for", recording)
    efficiency.train_pass(
        cls, tiny_batches(1), (50, 50), tools.get_config("ci"), 0
    )
    return built[0]


@pytest.mark.parametrize("cls", [efficiency.Ours, efficiency.TorchPeer])
def test_contestants_step_adam_as_training_does(cls, monkeypatch):
    """Training's make_optimizer is the reference: fused Adam on the CPU.
    The benchmark once stepped foreach Adam, 6x slower on the cpu model."""
    model = tat.make_model(50, 50, 1, 32, 64, 4)
    training, _ = tat.make_optimizer(model, 32)
    bench = optimizer_built_for(cls, monkeypatch)
    assert training.defaults["fused"] is True
    assert bench.defaults["fused"] is training.defaults["fused"]
    assert bench.defaults["betas"] == training.defaults["betas"]
    assert bench.defaults["eps"] == training.defaults["eps"]


def test_the_foreach_adam_pair_differs_in_the_optimizer_alone(monkeypatch):
    labels = efficiency.contestants_for(contestant_args())
    pair = labels["ours, foreach Adam"][0]
    assert not optimizer_built_for(pair, monkeypatch).defaults["fused"]
    for name in ("fast_dropout", "keep_targets", "criterion_cls"):
        assert getattr(pair, name) == getattr(efficiency.Ours, name)


def test_ours_as_at_issue_18_undoes_the_three_changes(monkeypatch):
    """Its mask, attention path and loss are those of the pairs that undo
    one change each; its optimizer is training's, then as now."""
    labels = efficiency.contestants_for(contestant_args())
    then = labels["ours, as at issue 18"][0]
    model = then(50, 50, 2, 32, 64, 4, 0.1).train()
    dropouts = {type(m) for m in model.modules() if isinstance(m, nn.Dropout)}
    assert dropouts == {nn.Dropout}
    attention = [
        m for m in model.modules() if isinstance(m, tat.MultiHeadedAttention)
    ]
    q = torch.zeros(1, 4, 3, 8)  # on the CPU, training, with dropout
    assert all(m.use_fused(q) for m in attention)
    assert not any(
        m.use_fused(q)
        for m in efficiency.Ours(50, 50, 2, 32, 64, 4, 0.1).train().modules()
        if isinstance(m, tat.MultiHeadedAttention)
    )
    assert then.criterion_cls is tat.LabelSmoothing and not then.keep_targets
    assert optimizer_built_for(then, monkeypatch).defaults["fused"]


def has_commit(commit):
    """Is `commit` in this checkout's git history (and git here)?"""
    try:
        found = subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
            capture_output=True,
        )
    except OSError:  # no git program
        return False
    return found.returncode == 0


needs_issue_18_history = pytest.mark.skipif(
    not has_commit(efficiency.ISSUE_18_COMMIT),
    reason="no git history of the issue-18 commit (archive or shallow clone)",
)


@needs_issue_18_history
def test_the_code_at_issue_18_is_that_commits_not_todays():
    """Two facts of that commit: attention had no use_fused (the CPU's
    dropout ran inside scaled_dot_product_attention), and the closed-form
    loss summed bf16 log-probabilities in bf16 (today's sums in float32).
    The architecture is the same: so is the parameter count."""
    old = efficiency.module_at_commit(efficiency.ISSUE_18_COMMIT)
    assert old.__name__.endswith(efficiency.ISSUE_18_COMMIT)
    assert not hasattr(old.MultiHeadedAttention, "use_fused")
    assert hasattr(tat.MultiHeadedAttention, "use_fused")
    x = torch.randn(4, 50).log_softmax(-1).bfloat16()
    target = torch.tensor([5, 6, tat.PAD, 7])
    assert old.smoothed_kl(x, target, tat.PAD, 0.1).dtype == torch.bfloat16
    assert tat.smoothed_kl(x, target, tat.PAD, 0.1).dtype == torch.float32
    assert old.PAD == tat.PAD

    def count(model):
        return sum(p.numel() for p in model.parameters())

    assert count(old.make_model(50, 60, 2, 32, 64, 4)) == count(
        tat.make_model(50, 60, 2, 32, 64, 4)
    )


@needs_issue_18_history
def test_the_code_at_issue_18_trains_with_its_own_model_and_loss(monkeypatch):
    labels = efficiency.contestants_for(contestant_args())
    old_cls = labels["code at issue 18"][0]
    old = old_cls.source_module
    model = old_cls(50, 50, 2, 32, 64, 4, 0.1)
    assert type(model.model) is old.EncoderDecoder
    assert type(model.model) is not tat.EncoderDecoder
    assert old_cls.criterion_cls is old.LabelSmoothing
    dropouts = {type(m) for m in model.modules() if isinstance(m, nn.Dropout)}
    assert dropouts == {nn.Dropout}
    assert optimizer_built_for(old_cls, monkeypatch).defaults["fused"]
    tokens, seconds, _ = efficiency.train_pass(
        old_cls, tiny_batches(), (50, 50), tools.get_config("ci"), 0
    )
    assert tokens == sum(b.ntokens for b in tiny_batches())
    assert seconds > 0


def left_out_line(capsys):
    """contestants_for's labels, and the line it printed."""
    labels = efficiency.contestants_for(contestant_args())
    return labels, capsys.readouterr().out


def test_outside_a_git_checkout_the_contestant_is_left_out_saying_why(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.setattr(efficiency, "REPO", tmp_path)  # not a git checkout
    labels, out = left_out_line(capsys)
    assert "code at issue 18" not in labels
    assert "ours" in labels
    assert "code at issue 18: left out, git show failed:" in out


def test_without_git_the_contestant_is_left_out_saying_why(
    monkeypatch, capsys
):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(efficiency.subprocess, "run", no_git)
    labels, out = left_out_line(capsys)
    assert "code at issue 18" not in labels
    assert "left out, git could not run" in out


def test_old_code_that_fails_to_run_is_left_out_and_forgotten(
    monkeypatch, capsys
):
    broken = SimpleNamespace(returncode=0, stdout="import no_such_module\n")
    monkeypatch.setattr(efficiency.subprocess, "run", lambda *a, **k: broken)
    labels, out = left_out_line(capsys)
    assert "code at issue 18" not in labels
    assert "its code failed to run: ModuleNotFoundError" in out
    name = f"the_annotated_transformer_at_{efficiency.ISSUE_18_COMMIT}"
    assert name not in sys.modules


@needs_issue_18_history
def test_the_code_at_issue_18_from_a_file_is_checked_against_gits_id(
    tmp_path, capsys
):
    """For a copy without git history (a lent machine): the file is used
    only if git's id of it is that commit's, one changed byte refused."""
    shown = subprocess.run(
        [
            "git",
            "-C",
            str(ROOT),
            "show",
            f"{efficiency.ISSUE_18_COMMIT}:the_annotated_transformer.py",
        ],
        capture_output=True,
        check=True,
    ).stdout
    good = tmp_path / "then.py"
    good.write_bytes(shown)
    labels = efficiency.contestants_for(contestant_args(code_at_issue_18=good))
    old = labels["code at issue 18"][0].source_module
    assert not hasattr(old.MultiHeadedAttention, "use_fused")
    changed = tmp_path / "changed.py"
    changed.write_bytes(shown.replace(b"PAD", b"PAD ", 1))
    labels = efficiency.contestants_for(
        contestant_args(code_at_issue_18=changed)
    )
    assert "code at issue 18" not in labels
    assert "changed.py is not that commit's file" in capsys.readouterr().out


def test_a_missing_file_for_the_code_at_issue_18_is_left_out(tmp_path, capsys):
    missing = tmp_path / "absent.py"
    labels = efficiency.contestants_for(
        contestant_args(code_at_issue_18=missing)
    )
    assert "code at issue 18" not in labels
    assert "absent.py could not be read" in capsys.readouterr().out


def test_git_blob_id_is_what_git_hash_object_gives(tmp_path):
    path = tmp_path / "some.py"
    path.write_bytes(b"x = 1\n\xc3\xa9\n")
    try:
        hashed = subprocess.run(
            ["git", "hash-object", str(path)], capture_output=True, text=True
        )
    except OSError:
        pytest.skip("no git program")
    assert efficiency.git_blob_id(path.read_bytes()) == hashed.stdout.strip()


def test_only_times_ours_and_the_contestants_named(monkeypatch):
    monkeypatch.setattr(efficiency, "code_at_commit", lambda *a: "old")
    labels = efficiency.contestants_for(
        contestant_args(only=["code at issue 18", "nn.Transformer"])
    )
    assert list(labels) == ["ours", "code at issue 18", "nn.Transformer"]
    assert labels["code at issue 18"] == ("old", False)
    everyone = efficiency.contestants_for(contestant_args())
    bound = "ours, wholly bf16"  # timed only when named
    assert list(everyone) == [c for c in efficiency.CONTESTANTS if c != bound]


def test_only_takes_the_printed_labels(capsys):
    args = efficiency.parse_args(["--only", "nn.Transformer", "ours, before"])
    assert args.only == ["nn.Transformer", "ours, before"]
    with pytest.raises(SystemExit):
        efficiency.parse_args(["--only", "peer"])
    assert "invalid choice: 'peer'" in capsys.readouterr().err


def test_the_wholly_bf16_bound_is_timed_only_when_named(monkeypatch):
    monkeypatch.setattr(efficiency, "code_at_commit", lambda *a: "old")
    assert "ours, wholly bf16" not in efficiency.contestants_for(
        contestant_args()
    )
    named = efficiency.contestants_for(
        contestant_args(only=["ours, wholly bf16"])
    )
    assert list(named) == ["ours", "ours, wholly bf16"]


def test_the_wholly_bf16_bound_trains_bf16_weights_without_autocast(
    monkeypatch,
):
    seen = {}
    real_adam, real_autocast = efficiency.adam_for, tools.autocast_for

    def spy(model, fused):
        seen["dtypes"] = {p.dtype for p in model.parameters()}
        return real_adam(model, fused)

    def no_autocast(device, dtype):
        seen["autocast"] = dtype
        return real_autocast(device, dtype)

    monkeypatch.setattr(efficiency, "adam_for", spy)
    monkeypatch.setattr(efficiency.tools, "autocast_for", no_autocast)
    cls = efficiency.OursWhollyBf16
    tokens, seconds, _ = efficiency.train_pass(
        cls,
        tiny_batches(),
        (50, 50),
        tools.get_config("ci"),
        0,
        0,
        torch.bfloat16,
    )
    assert seen == {"dtypes": {torch.bfloat16}, "autocast": None}
    assert tokens == sum(b.ntokens for b in tiny_batches())
    with pytest.raises(SystemExit, match="only with --precision bf16"):
        efficiency.train_pass(
            cls, tiny_batches(), (50, 50), tools.get_config("ci"), 0
        )


def test_ratios_are_printed_for_the_contestants_timed(capsys):
    medians = {"ours": (300.0, 1.0), "nn.Transformer": (250.0, 1.0)}
    efficiency.print_ratios(medians)
    assert capsys.readouterr().out == "  ours / nn.Transformer (tok/s): 1.20\n"


def test_the_goal_line_without_the_contestant(capsys):
    efficiency.print_issue_18_goal({"ours": (100.0, 1.0)}, torch.bfloat16)
    assert "code at issue 18: not measured" in capsys.readouterr().out


def test_the_issue_18_ratio_is_ours_over_that_code(capsys):
    medians = {"ours": (300.0, 1.0), "code at issue 18": (200.0, 1.0)}
    efficiency.print_issue_18_goal(medians, torch.bfloat16)
    out = capsys.readouterr().out
    assert "the code at issue 18, c0b4240 (tok/s): 1.50" in out
    assert "(issue 18 asks for 2)" in out
    efficiency.print_issue_18_goal(medians, None)  # float32
    assert "asks for 2" not in capsys.readouterr().out
