"""bench/ensemble.py: several models decoding together."""

import pytest
import torch
from test_time_to_bleu import bench_script

import the_annotated_transformer as tat

ensemble = bench_script("ensemble")


def random_model(seed, V=12):
    """An untrained model whose sentences end at different steps."""
    torch.manual_seed(seed)
    model = tat.make_model(V, V, N=1, d_model=32, d_ff=64, h=4).eval()
    with torch.no_grad():
        model.generator.proj.bias[tat.EOS] += 2.0
    return model


@pytest.fixture
def batch():
    torch.manual_seed(0)
    src = torch.randint(4, 12, (6, 7))
    src[:, 0], src[3:, 5:] = tat.BOS, tat.PAD  # three padded rows
    return src, (src != tat.PAD).unsqueeze(-2)


def test_one_model_is_beam_search(batch):
    model = random_model(1)
    alone = tat.beam_search(model, *batch, 12, beam_size=3, alpha=0.6)
    together = ensemble.ensemble_beam_search([model], *batch, 12, 3, 0.6)
    assert torch.equal(alone, together)


def test_a_model_twice_decodes_as_the_model(batch):
    model = random_model(2)
    alone = tat.beam_search(model, *batch, 12, beam_size=4, alpha=1.0)
    twice = ensemble.ensemble_beam_search([model, model], *batch, 12, 4, 1.0)
    assert torch.equal(alone, twice)


def test_two_models_pick_the_most_probable_token_on_average(batch):
    """Beam 1, first token: the argmax of the two models' mean
    probability, computed here from each model's own full decoder. The
    biases make the mean of log-probabilities pick another token, so an
    ensemble that averaged those instead would fail."""
    a, b = random_model(3), random_model(4)
    biases = {a: {5: 8.0, 7: 6.0}, b: {5: -10.0, 6: 6.5, 7: 6.0}}
    with torch.no_grad():
        for model, bias in biases.items():
            model.generator.proj.weight.zero_()  # the bias alone decides
            model.generator.proj.bias.zero_()
            for token, value in bias.items():
                model.generator.proj.bias[token] = value
    src, mask = batch
    start = torch.full((src.size(0), 1), tat.BOS)
    logps = []
    for model in (a, b):
        out = model.decode(model.encode(src, mask), mask, start, None)
        logps.append(model.generator(out[:, -1]))  # (B, V)
    expected = ((logps[0].exp() + logps[1].exp()) / 2).argmax(-1)
    by_log_probs = ((logps[0] + logps[1]) / 2).argmax(-1)
    assert (expected == 5).all() and (by_log_probs == 7).all()
    together = ensemble.ensemble_beam_search([a, b], src, mask, 2, 1, 0.6)
    assert torch.equal(together[:, 1], expected)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--run", "nowhere"], "expected FOLDER:K"),
        (["--run", "nowhere:3"], "no nowhere/final.pt"),
        ([], "--run"),
    ],
)
def test_bad_runs_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as stop:
        ensemble.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_bad_numbers_and_outputs_are_one_line(tmp_path, capsys):
    """Refused while parsing, before any model is read."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("final.pt", "epoch_000.pt", "epoch_001.pt"):
        (run / name).write_bytes(b"")  # the parser only looks at names
    good = ["--run", f"{run}:2", "--out", str(tmp_path / "e")]
    assert ensemble.parse_args(good).run == [(run, 2)]
    for argv, words in (
        (["--run", f"{run}:3"], "has 2 epoch files, not 3"),
        ([*good, "--threads", "-1"], "--threads"),
        ([*good, "--beam", "0"], "--beam"),
        ([*good, "--alpha", "nan"], "--alpha"),
        ([*good, "--out", str(tmp_path / "no" / "e")], "there is no folder"),
    ):
        with pytest.raises(SystemExit) as stop:
            ensemble.parse_args(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


def test_members_are_named_by_what_they_decode_with(tmp_path):
    run = tmp_path / "cpu-d02-lin18"
    assert ensemble.member_name(run, 3) == "cpu-d02-lin18 (last 3)"
    assert ensemble.member_name(run, 0) == "cpu-d02-lin18 (final.pt)"
