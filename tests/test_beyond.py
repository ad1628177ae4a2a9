"""Tests of Part 5: KV-cache decoding, beam search, BPE with tied
embeddings, checkpoint averaging, and their scripts."""

import functools
import itertools
import math
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from test_time_to_bleu import bench_script

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("local_multi30k")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return tools.load_bpe(tmp_path_factory.mktemp("bpe") / "bpe.json")


def source_batch(sentences, tokenizer, vocab):
    """Padded (B, S) ids and their (B, 1, S) mask."""
    ids = [
        torch.tensor([tat.BOS, *tat.encode_text(s, tokenizer, vocab), tat.EOS])
        for s in sentences
    ]
    src = torch.nn.utils.rnn.pad_sequence(
        ids, batch_first=True, padding_value=tat.PAD
    )
    return src, (src != tat.PAD).unsqueeze(-2)


@pytest.fixture(scope="module")
def val_batch(tokenizers, vocabs):
    """24 validation sentences of mixed lengths, padded."""
    sentences = [de for de, _ in tat.read_multi30k("val")[:24]]
    src, mask = source_batch(sentences, tokenizers[0], vocabs[0])
    assert len(set(mask.sum(-1).flatten().tolist())) > 5  # mixed lengths
    return src, mask


@pytest.fixture(scope="module")
def random_model(vocabs):
    """An untrained model with 12 output tokens and a bias towards </s>,
    so that decoded sentences end at many different steps."""
    torch.manual_seed(0)
    model = tat.make_model(len(vocabs[0]), 12, N=2, d_model=32, d_ff=64, h=4)
    with torch.no_grad():
        model.generator.proj.bias[tat.EOS] += 2.0
    return model.eval()


def train_ci(folder, vocab_src, vocab_tgt, tokenizers, preset="ci"):
    cfg = tools.get_config(
        preset, checkpoint_dir=str(folder), max_train_pairs=200
    )
    tools.train_worker(
        0, 1, vocab_src, vocab_tgt, *tokenizers, cfg, show_progress=False
    )
    return Path(folder)


@pytest.fixture(scope="module")
def word_run(tmp_path_factory, vocabs, tokenizers):
    """A ci run (2 epochs, 200 pairs) with word vocabularies."""
    return train_ci(tmp_path_factory.mktemp("word"), *vocabs, tokenizers)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, bpe, tokenizers):
    """A ci-bpe run: one BPE vocabulary, tied embeddings."""
    folder = tmp_path_factory.mktemp("bpe_run")
    return train_ci(folder, bpe, bpe, tokenizers, preset="ci-bpe")


# --- 1. incremental decoding ---------------------------------------------


@torch.no_grad()
def test_cached_step_logits_match_full_recompute(random_model, val_batch):
    model, (src, mask) = random_model.eval(), val_batch
    prefix = tat.batch_greedy_decode(model, src, mask, 20)  # (B, L)
    memory = model.encode(src, mask)
    cache = tat.DecoderCache(model, memory, mask)
    for t in range(1, prefix.size(1)):
        full = model.generator(
            model.decode(memory, mask, prefix[:, :t], tat.subsequent_mask(t))
        )[:, -1]  # the decoder re-run over the whole prefix
        step = tat.decode_step(model, prefix[:, t - 1 : t], cache)
        torch.testing.assert_close(step, full, atol=1e-5, rtol=0)
    assert cache.length == prefix.size(1) - 1


@torch.no_grad()
def test_cached_greedy_matches_the_tutorial_one_sentence_at_a_time(
    random_model, val_batch
):
    model, (src, mask) = random_model.eval(), val_batch
    max_len = 15
    cached = tat.cached_greedy_decode(model, src, mask, max_len)
    lengths = set()
    for i in range(src.size(0)):
        n = int(mask[i].sum())
        alone = tat.greedy_decode(
            model, src[i : i + 1, :n], mask[i : i + 1, :, :n], max_len, tat.BOS
        )
        expected = tat.strip_specials(alone[0].tolist())
        assert tat.strip_specials(cached[i].tolist()) == expected, i
        lengths.add(len(expected))
    assert len(lengths) >= 4, lengths  # sentences stopped at many steps
    # same (B, L) layout as batch_greedy_decode: <blank> after </s>
    assert torch.equal(cached, tat.batch_greedy_decode(model, src, mask, 15))


def test_cached_greedy_on_a_trained_model(word_run, tokenizers):
    model, vsrc, _, _ = tools.load_trained_model(word_run / "final.pt", "cpu")
    sentences = [de for de, _ in tat.read_multi30k("val")[100:120]]
    src, mask = source_batch(sentences, tokenizers[0], vsrc)
    cached = tat.cached_greedy_decode(model, src, mask, src.size(1) + 10)
    reference = tat.batch_greedy_decode(model, src, mask, src.size(1) + 10)
    assert torch.equal(cached, reference)


# --- 2. beam search -------------------------------------------------------


class TableModel:
    """A fake decoder: next-token log-probs depend on the sentence and
    the previous token only, table[b, previous, next]."""

    def __init__(self, table, beam_size):
        self.table = table  # (B, V, V)
        self.sentence = torch.arange(table.size(0)).repeat_interleave(
            beam_size
        )  # which sentence each row belongs to

    def step(self, ys_last):
        return self.table[self.sentence, ys_last[:, 0]]  # (R, V)

    def select(self, rows):
        self.sentence = self.sentence[rows]


def gnmt_score(logp, length, alpha=0.6):
    return logp / ((5 + length) / 6) ** alpha


def sequence_score(table, seq, alpha=0.6):
    """Score of generated tokens `seq` (after <s>) under `table`."""
    prev, total = tat.BOS, 0.0
    for w in seq:
        total += table[prev, w].item()
        prev = w
    return gnmt_score(total, len(seq), alpha)


def exhaustive_best(table, max_len, alpha=0.6):
    """Best score over every output: ending at its first </s>, or running
    to max_len - 1 tokens."""
    V = table.size(-1)
    best = -math.inf
    for n in range(1, max_len):
        for seq in itertools.product(range(V), repeat=n):
            if tat.EOS in seq[:-1] or (seq[-1] != tat.EOS and n < max_len - 1):
                continue
            best = max(best, sequence_score(table, seq, alpha))
    return best


def generated(row):
    """Tokens after <s>, up to and including the first </s>."""
    row = row[1:]
    return row[: row.index(tat.EOS) + 1] if tat.EOS in row else row


def run_table(table, max_len, beam_size, alpha=0.6):
    fake = TableModel(table, beam_size)
    out = tat.beam_search_steps(
        fake.step, fake.select, table.size(0), max_len, beam_size, alpha
    )
    return [generated(row) for row in out.tolist()]


@pytest.mark.parametrize("seed", range(6))
def test_wide_beam_finds_the_exhaustive_optimum(seed):
    # With a beam wider than the number of partial outputs (5 + 25 + 125
    # for 3 tokens over 5 symbols), nothing is pruned: the search is exact.
    gen = torch.Generator().manual_seed(seed)
    B, V, max_len = 3, 5, 5
    table = (torch.randn(B, V, V, generator=gen) * 2).log_softmax(-1)
    outputs = run_table(table, max_len, beam_size=160)
    for b, seq in enumerate(outputs):
        best = exhaustive_best(table[b], max_len)
        assert sequence_score(table[b], seq) == pytest.approx(best, abs=1e-6)


def toy_table(rows):
    """(1, 5, 5) log-prob table from {previous: {next: probability}}."""
    table = torch.full((1, 5, 5), 1e-9)
    for prev, nexts in rows.items():
        for nxt, p in nexts.items():
            table[0, prev, nxt] = p
    return table.log()


A, B_ = 3, 4  # the two ordinary tokens of the toy vocabulary


def test_beam_beats_greedy_when_the_first_choice_is_a_trap():
    table = toy_table(
        {
            tat.BOS: {A: 0.5, B_: 0.4, tat.EOS: 0.1},
            A: {tat.EOS: 0.4, A: 0.3, B_: 0.3},
            B_: {tat.EOS: 0.9, A: 0.05, B_: 0.05},
        }
    )
    greedy = run_table(table, 5, beam_size=1)[0]
    beam = run_table(table, 5, beam_size=2)[0]
    assert greedy == [A, tat.EOS]  # probability 0.20
    assert beam == [B_, tat.EOS]  # probability 0.36
    assert sequence_score(table[0], beam) > sequence_score(table[0], greedy)


def test_a_finished_hypothesis_pushed_out_of_the_beam_is_not_lost():
    # With a strong length bonus (alpha=2), the two continuations of `a`
    # outscore the finished "</s>" at step 2 and push it out of a beam of
    # two; they then decay, and "</s>" alone stays the best output.
    table = toy_table(
        {
            tat.BOS: {A: 0.6, tat.EOS: 0.4},
            A: {A: 0.5, B_: 0.5},
            B_: {tat.EOS: 0.01, A: 0.495, B_: 0.495},
        }
    )
    out = run_table(table, 4, beam_size=2, alpha=2.0)[0]
    assert out == [tat.EOS]
    assert sequence_score(table[0], out, 2.0) == pytest.approx(
        exhaustive_best(table[0], 4, 2.0)
    )


def test_finished_beams_stop_growing_and_pad_follows():
    table = toy_table({tat.BOS: {tat.EOS: 0.6, A: 0.4}, A: {A: 1.0}})
    fake = TableModel(table, 2)
    out = tat.beam_search_steps(fake.step, fake.select, 1, 6, beam_size=2)
    # "a a a a a" never ends; "</s>" wins, and the row is <blank>-padded
    assert out[0].tolist()[:2] == [tat.BOS, tat.EOS]
    assert set(out[0].tolist()[2:]) <= {tat.PAD}


@torch.no_grad()
def test_beam_size_one_is_greedy(
    random_model, val_batch, word_run, tokenizers
):
    model, (src, mask) = random_model.eval(), val_batch
    greedy = tat.cached_greedy_decode(model, src, mask, 15)
    assert torch.equal(tat.beam_search(model, src, mask, 15, 1), greedy)
    trained, vsrc, _, _ = tools.load_trained_model(
        word_run / "final.pt", "cpu"
    )
    sentences = [de for de, _ in tat.read_multi30k("val")[:16]]
    src, mask = source_batch(sentences, tokenizers[0], vsrc)
    greedy = tat.batch_greedy_decode(trained, src, mask, src.size(1) + 10)
    beam = tat.beam_search(trained, src, mask, src.size(1) + 10, 1)
    assert torch.equal(beam, greedy)


@torch.no_grad()
def test_beam_search_scores_no_worse_than_greedy_on_its_own_rule(
    random_model, val_batch
):
    # Score each returned sequence with the full (uncached) model.
    model, (src, mask) = random_model.eval(), val_batch

    def scores(out):
        memory = model.encode(src, mask)
        logp = model.generator(
            model.decode(
                memory, mask, out[:, :-1], tat.subsequent_mask(out.size(1) - 1)
            )
        )  # (B, L-1, V)
        tok = logp.gather(-1, out[:, 1:].unsqueeze(-1)).squeeze(-1)
        real = torch.ones_like(tok, dtype=torch.bool)
        for i, row in enumerate(out.tolist()):
            real[i, len(generated(row)) :] = False
        total = (tok * real).sum(-1)
        return total / ((5 + real.sum(-1)) / 6) ** 0.6

    greedy = tat.cached_greedy_decode(model, src, mask, 15)
    beam = tat.beam_search(model, src, mask, 15, beam_size=4)
    assert (scores(beam) >= scores(greedy) - 1e-5).float().mean() > 0.9
    fn = functools.partial(tat.beam_search, beam_size=4)
    assert fn(model, src, mask, 15).shape[0] == src.size(0)


# --- 3. BPE and tied embeddings -------------------------------------------


def test_bpe_specials_have_ids_0_to_3(bpe):
    assert bpe.lookup_tokens(range(4)) == list(tat.SPECIALS)
    assert (tat.BOS, tat.EOS, tat.PAD, tat.UNK) == (0, 1, 2, 3)
    assert len(bpe) == tat.BPE_VOCAB_SIZE


def test_bpe_round_trips_validation_sentences(bpe):
    sentences = [s for pair in tat.read_multi30k("val") for s in pair]
    exact = sum(bpe.decode(bpe.encode(s)) == s for s in sentences)
    assert exact / len(sentences) > 0.99
    ids = [i for s in sentences for i in bpe.encode(s)]
    assert tat.UNK not in ids and all(i > tat.UNK for i in ids)


def test_bpe_is_learned_from_the_train_split_only(tmp_path, monkeypatch):
    read = tat.read_multi30k
    asked = []

    def spy(split, root=None):
        asked.append(split)
        return read(split, root)

    monkeypatch.setattr(tat, "read_multi30k", spy)
    monkeypatch.setattr(tools, "read_multi30k", spy)
    path = tmp_path / "bpe.json"
    small = tools.load_bpe(path, vocab_size=600)
    assert asked == ["train"] and path.is_file() and len(small) == 600
    assert tools.load_bpe(path, vocab_size=600).to_str() == small.to_str()
    assert asked == ["train"]  # the second call read the cached JSON


def test_tied_paper_model_has_the_closed_form_size(bpe):
    cfg = tools.get_config("paper")
    V = len(bpe)
    model = tat.make_model(
        V, V, N=cfg.N, d_model=cfg.d_model, d_ff=cfg.d_ff, h=cfg.h
    )
    model = tat.tie_embeddings(model)
    assert tat.count_parameters(model) == 44_140_544 + 513 * V


def tied_pointers(model):
    return {
        model.src_embed[0].lut.weight.data_ptr(),
        model.tgt_embed[0].lut.weight.data_ptr(),
        model.generator.proj.weight.data_ptr(),
    }


def test_bpe_checkpoint_records_tokenization_and_ties(bpe_run):
    ckpt = tools.load_checkpoint(bpe_run / "final.pt")
    assert ckpt["config"]["tokenization"] == "bpe"
    assert ckpt["config"]["tie_embeddings"] is True
    model, vsrc, vtgt, cfg = tools.load_trained_model(
        bpe_run / "final.pt", "cpu"
    )
    assert isinstance(vsrc, tat.BpeVocab) and vsrc is vtgt
    assert len(tied_pointers(model)) == 1
    assert vsrc.to_str() == ckpt["bpe"]


def test_word_level_tie_shares_the_target_embedding_alone():
    """Two word vocabularies differ, so a word-level config ties only the
    English side: the generator reuses the target embedding."""
    config = tools.get_config("ci", tie_embeddings=True)
    assert config.tokenization == "word"
    untied = tat.model_from_config(
        replace(config, tie_embeddings=False), 30, 20
    )
    model = tat.model_from_config(config, 30, 20)
    assert model.generator.proj.weight is model.tgt_embed[0].lut.weight
    assert model.src_embed[0].lut.weight is not model.tgt_embed[0].lut.weight
    d = config.d_model
    assert tat.count_parameters(untied) - tat.count_parameters(model) == 20 * d
    batch = tat.Batch(
        torch.randint(4, 30, (2, 5)), torch.randint(4, 20, (2, 6))
    )
    out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    model.generator(out).sum().backward()
    embedding_only = tat.model_from_config(
        replace(config, tie_embeddings=False), 30, 20
    )
    embedding_only.load_state_dict(model.state_dict())
    out = embedding_only(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    embedding_only.generator(out).sum().backward()
    both_uses = (
        embedding_only.tgt_embed[0].lut.weight.grad
        + embedding_only.generator.proj.weight.grad
    )  # the shared matrix's gradient sums its two uses
    torch.testing.assert_close(model.tgt_embed[0].lut.weight.grad, both_uses)


def test_bpe_tie_still_shares_one_matrix_three_ways():
    config = tools.get_config("ci-bpe")
    model = tat.model_from_config(config, 40, 40)
    assert len(tied_pointers(model)) == 1


def test_bpe_model_translates_through_the_usual_api(
    bpe_run, tokenizers, capsys
):
    model, vsrc, vtgt, _ = tools.load_trained_model(
        bpe_run / "final.pt", "cpu"
    )
    sentences = [de for de, _ in tat.read_multi30k("val")[:4]]
    for decode_fn in (None, functools.partial(tat.beam_search, beam_size=2)):
        out = tools.translate_batch(
            model, sentences, tokenizers[0], vsrc, vtgt, decode_fn=decode_fn
        )
        assert len(out) == 4 and all(isinstance(s, str) for s in out)
        assert not any("▁" in s for s in out)  # decoded, not raw pieces
    status = tools.main(
        [
            "translate",
            "--checkpoint",
            str(bpe_run / "final.pt"),
            "--beam",
            "2",
            "Ein Hund rennt.",
        ]
    )
    # The command line prints what the library call above gives.
    expected = tools.translate_batch(
        model,
        ["Ein Hund rennt."],
        None,
        vsrc,
        vtgt,
        decode_fn=functools.partial(tat.beam_search, beam_size=2),
    )[0]
    assert status == 0 and capsys.readouterr().out == expected + "\n"


# --- 4. checkpoint averaging ----------------------------------------------


def tiny(seed, tie=False):
    """A small word-level model; with `tie`, its generator reuses the
    target embedding, as model_from_config ties a word-level config."""
    torch.manual_seed(seed)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    if tie:
        model.generator.proj.weight = model.tgt_embed[0].lut.weight
    return model


def test_average_is_the_mean_of_the_parameters():
    a, b, target = tiny(1), tiny(2), tiny(3)
    pe = target.src_embed[1].pe.clone()
    tat.average(target, [a, b])
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for name, p in target.named_parameters():
        torch.testing.assert_close(p, (pa[name] + pb[name]) / 2)
    assert torch.equal(target.src_embed[1].pe, pe)  # buffers untouched
    # a mean, not the 2022 sum: averaging a model with itself changes nothing
    before = {n: p.clone() for n, p in a.named_parameters()}
    tat.average(a, [a, a])
    for name, p in a.named_parameters():
        assert torch.equal(p, before[name])


def save_tiny(path, model, tie=False):
    cfg = tools.get_config(
        "ci", N=1, d_model=16, d_ff=32, h=2, tie_embeddings=tie
    )
    itos = [*tat.SPECIALS, *"abcdefg"]
    tools.save_checkpoint(
        path,
        model=model.state_dict(),
        config=asdict(cfg),
        vocab_src=itos,
        vocab_tgt=itos,
    )
    return path


@pytest.mark.parametrize("tie", [False, True])
def test_average_checkpoints_matches_a_hand_computed_mean(tmp_path, tie):
    a, b = tiny(1, tie), tiny(2, tie)
    paths = [
        save_tiny(tmp_path / f"epoch_00{i}.pt", m, tie)
        for i, m in enumerate((a, b))
    ]
    model, vsrc, _, _ = tools.average_checkpoints(paths)
    sa, sb, avg = a.state_dict(), b.state_dict(), model.state_dict()
    for name in sa:
        if name.endswith(".pe"):
            assert torch.equal(avg[name], sa[name])  # a buffer: copied
        else:
            torch.testing.assert_close(
                avg[name], (sa[name] + sb[name]) / 2, atol=1e-7, rtol=0
            )
    assert len(vsrc) == 11
    assert len(tied_pointers(model)) == (2 if tie else 3)
    shared = model.generator.proj.weight is model.tgt_embed[0].lut.weight
    assert shared == tie


OLD_PROJECTIONS = {"w_q": "0", "w_k": "1", "w_v": "2", "w_o": "3"}
OLD_BLOCKS = {  # the order in which a layer applies its blocks
    "encoder": ["self_attn_block", "ff_block"],
    "decoder": ["self_attn_block", "src_attn_block", "ff_block"],
}


def old_key(key):
    """A key as earlier versions of this project (and 2022) named it."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part in OLD_PROJECTIONS:
            parts[i] = f"linears.{OLD_PROJECTIONS[part]}"
        elif parts[0] in OLD_BLOCKS and part in OLD_BLOCKS[parts[0]]:
            parts[i] = f"sublayer.{OLD_BLOCKS[parts[0]].index(part)}"
    return ".".join(parts)


def test_average_checkpoints_reads_old_names(tmp_path):
    """An epoch file with the old names loaded alone but was refused as
    "not the same model" when averaged."""
    a, b = tiny(1), tiny(2)
    paths = [
        save_tiny(tmp_path / f"epoch_00{i}.pt", m) for i, m in [(1, a), (2, b)]
    ]
    old = torch.load(paths[1], weights_only=True)
    old["model"] = {old_key(k): v for k, v in old["model"].items()}
    assert "encoder.layers.0.sublayer.1.norm.a_2" in old["model"]
    assert "decoder.layers.0.src_attn.linears.3.bias" in old["model"]
    torch.save(old, paths[1])
    model, *_ = tools.average_checkpoints(paths)
    mean = (a.generator.proj.weight + b.generator.proj.weight) / 2
    torch.testing.assert_close(model.generator.proj.weight, mean)
    w_o = "decoder.layers.0.src_attn.w_o.weight"
    torch.testing.assert_close(
        model.state_dict()[w_o],
        (a.state_dict()[w_o] + b.state_dict()[w_o]) / 2,
    )


def test_average_checkpoints_refuses_weights_with_nan(tmp_path):
    a, b = tiny(1), tiny(2)
    with torch.no_grad():
        b.generator.proj.weight[0, 0] = float("nan")
    paths = [save_tiny(tmp_path / "a.pt", a), save_tiny(tmp_path / "b.pt", b)]
    with pytest.raises(tools.CheckpointError, match="b.pt: its weight"):
        tools.average_checkpoints(paths)


def test_average_checkpoints_refuses_different_buffers(tmp_path):
    a, b = tiny(1), tiny(2)
    with torch.no_grad():
        b.src_embed[1].pe += 1
    paths = [save_tiny(tmp_path / "a.pt", a), save_tiny(tmp_path / "b.pt", b)]
    with pytest.raises(ValueError, match="buffer"):
        tools.average_checkpoints(paths)


def test_average_checkpoints_refuses_another_model(tmp_path):
    a, wider = tiny(1), tat.make_model(11, 11, N=1, d_model=16, d_ff=64, h=2)
    paths = [save_tiny(tmp_path / "a.pt", a)]
    bad = tmp_path / "wider.pt"
    tools.save_checkpoint(
        bad, **{**torch.load(paths[0]), "model": wider.state_dict()}
    )
    with pytest.raises(ValueError, match="not the same model"):
        tools.average_checkpoints([*paths, bad])


def test_cli_evaluate_with_beam_and_average(
    word_run, tokenizers, tmp_path, capsys
):
    pairs = tat.read_multi30k("val")[:6]
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("\n".join(de for de, _ in pairs) + "\n")
    ref.write_text("\n".join(en for _, en in pairs) + "\n")
    args = [
        "evaluate",
        "--checkpoint",
        str(word_run / "final.pt"),
        "--src",
        str(src),
        "--ref",
        str(ref),
    ]
    assert tools.main([*args, "--beam", "3", "--average", "2"]) == 0
    printed = capsys.readouterr().out
    # The reference: the last two epochs' weights averaged by hand, beam 3
    # through the library call, scored by sacreBLEU directly.
    import sacrebleu

    model, vsrc, vtgt, _ = tools.load_trained_model(
        word_run / "final.pt", "cpu"
    )
    states = [
        torch.load(path, weights_only=True)["model"]
        for path in tools.epoch_checkpoints(word_run)[-2:]
    ]
    model.load_state_dict(
        {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}
    )
    hyps = tools.translate_batch(
        model,
        [de for de, _ in pairs],
        tokenizers[0],
        vsrc,
        vtgt,
        decode_fn=functools.partial(tat.beam_search, beam_size=3),
    )
    expected = sacrebleu.corpus_bleu(hyps, [[en for _, en in pairs]])
    assert printed.startswith(f"BLEU = {expected.score:.2f} "), printed
    assert tools.main([*args, "--average", "9"]) == 2
    assert "--average 9" in capsys.readouterr().err


# --- the scripts -----------------------------------------------------------


load_script = bench_script  # bench/NAME.py as a module


def test_bleu_table_can_decode_averaged_models_greedily(word_run):
    bleu_table = load_script("bleu_table")
    argv = ["--word", str(word_run), "--bpe", "/nonexistent", "--beam", "4"]
    plain = bleu_table.setups(bleu_table.parse_args([*argv, "--average", "2"]))
    args = bleu_table.parse_args([*argv, "--average", "2", "--greedy-average"])
    rows = bleu_table.setups(args)
    extra = [row for row in rows if row not in plain]
    assert [r[0] for r in extra] == ["word, greedy + average of last 2"]
    assert extra[0][2:4] == (1, 2)  # beam 1 on the average of 2


def test_bleu_table_with_nothing_to_score_writes_nothing(tmp_path, capsys):
    """It once wrote empty tables over the record, and exited 0."""
    bleu_table = load_script("bleu_table")
    out = tmp_path / "beyond"
    argv = ["--word", "/nonexistent", "--bpe", "/nonexistent", "--out", out]
    assert bleu_table.main(list(map(str, argv))) == 2
    assert "nothing to score" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "md.md").mkdir()
    for bad, words in (
        (["--threads", "-1"], "--threads"),
        (["--average", "-2"], "--average"),
        (["--out", str(tmp_path / "no" / "b")], "there is no folder"),
        (
            ["--out", str(tmp_path / "md")],
            f"--out {tmp_path}/md.md is a folder",
        ),
    ):
        with pytest.raises(SystemExit) as stop:
            bleu_table.parse_args(list(map(str, argv)) + bad)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


def test_bleu_table_keeps_a_dot_inside_the_out_name(tmp_path):
    """--out results/x_alpha1.8_val once wrote x_alpha1.json and .md."""
    bleu_table = load_script("bleu_table")
    out = tmp_path / "ensemble_alpha1.8_val"
    summary = {"rows": [], "command": "python bench/ensemble.py"}
    bleu_table.write_summary(summary, str(out), lambda s: "# table\n")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ensemble_alpha1.8_val.json", "ensemble_alpha1.8_val.md"]
    for given in ("x.json", "x.md", "x"):  # NAME.json or .md means NAME
        paths = bleu_table.summary_paths(tmp_path / given)
        assert [p.name for p in paths] == ["x.json", "x.md"]


def test_bleu_table_on_ci_checkpoints(word_run, bpe_run, tmp_path):
    import json

    out = tmp_path / "beyond"
    status = load_script("bleu_table").main(
        [
            "--word",
            str(word_run),
            "--bpe",
            str(bpe_run),
            "--n",
            "4",
            "--beam",
            "2",
            "--average",
            "2",
            "--out",
            str(out),
        ]
    )
    assert status == 0
    summary = json.loads(out.with_suffix(".json").read_text())
    setups = [row["setup"] for row in summary["rows"]]
    assert setups == [
        "word, greedy",
        "word, beam 2",
        "word, beam 2 + average of last 2",
        "BPE + tied, greedy",
        "BPE + tied, beam 2",
        "BPE + tied, beam 2 + average of last 2",
    ]
    assert all(0 <= row["bleu"] <= 100 for row in summary["rows"])
    assert "cpu" in summary["hardware"] and summary["command"]
    table = out.with_suffix(".md").read_text()
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + len(setups)  # header, rule, one per row


def test_decoding_benchmark_runs_and_agrees(word_run, tmp_path):
    result = tmp_path / "speed.md"
    status = load_script("decoding").main(
        [
            "--checkpoint",
            str(word_run / "final.pt"),
            "--n",
            "4",
            "--runs",
            "1",
            "--beam",
            "2",
            "--out",
            str(result),
        ]
    )
    assert status == 0  # 0 means the tutorial and the cache agree
    assert "sentences/s" in result.read_text()


def test_scripts_find_the_module_from_anywhere(tmp_path):
    # Started from another folder with no PYTHONPATH, each script must
    # still import the module (it puts the repository on sys.path itself).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for script in sorted((ROOT / "bench").glob("*.py")):
        proc = subprocess.run(
            [sys.executable, str(script), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"usage: {script.name}")


def test_copy_benchmark_settings_are_typed_and_checked():
    import argparse

    bench = load_script("copy_task")
    assert bench.parse_setting("lr=2e-4") == ("lr", 2e-4)
    assert bench.parse_setting("batch_size=32") == ("batch_size", 32)
    assert bench.parse_setting("decay_steps=400") == ("decay_steps", 400)
    for bad in ("lr", "nope=1", "seed=3", "batch_size=1.5", "lr=fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_setting(bad)


def test_bleu_table_scores_the_validation_split_when_asked(word_run, tmp_path):
    import json

    import sacrebleu

    out = tmp_path / "val"
    argv = ["--word", str(word_run), "--bpe", str(tmp_path / "none")]
    argv += ["--n", "6", "--beam", "2", "--average", "0", "--out", str(out)]
    assert load_script("bleu_table").main([*argv, "--split", "val"]) == 0
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["split"] == "validation"
    assert "validation" in out.with_suffix(".md").read_text().splitlines()[0]
    # Independently: the command line's greedy translation of the first
    # six validation sentences, scored against their references.
    pairs = tat.read_multi30k("val")[:6]
    hyps = tools.translate([de for de, _ in pairs], word_run / "final.pt")
    refs = [en for _, en in pairs]
    greedy = summary["rows"][0]
    assert greedy["setup"] == "word, greedy" and greedy["example"] == hyps[0]
    expected = sacrebleu.corpus_bleu(hyps, [refs]).score
    assert greedy["bleu"] == pytest.approx(expected, abs=0.01)


def assert_row_is_direct_beam(row, run, **beam_options):
    """A bleu_table row on 6 validation sentences against beam_search."""
    import functools

    import sacrebleu

    pairs = tat.read_multi30k("val")[:6]
    model, vsrc, vtgt, _ = tools.load_trained_model(run / "final.pt", "cpu")
    hyps = tools.translate_batch(
        model,
        [de for de, _ in pairs],
        tat.load_tokenizers()[0],
        vsrc,
        vtgt,
        decode_fn=functools.partial(tat.beam_search, **beam_options),
    )
    expected = sacrebleu.corpus_bleu(hyps, [[en for _, en in pairs]]).score
    assert row["bleu"] == pytest.approx(expected, abs=0.01)
    assert row["example"] == hyps[0]


def test_bleu_table_scores_each_length_penalty_and_average(word_run, tmp_path):
    import json

    out = tmp_path / "alphas"
    argv = ["--word", str(word_run), "--bpe", str(tmp_path / "none")]
    argv += ["--n", "6", "--beam", "3", "--split", "val", "--out", str(out)]
    argv += ["--average", "1", "2", "--alpha", "0.6", "5.0"]
    assert load_script("bleu_table").main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [row["setup"] for row in rows] == [
        "word, greedy",
        "word, beam 3",
        "word, beam 3 (alpha 5.0)",
        "word, beam 3 + average of last 1",
        "word, beam 3 (alpha 5.0) + average of last 1",
        "word, beam 3 + average of last 2",
        "word, beam 3 (alpha 5.0) + average of last 2",
    ]
    assert [row["alpha"] for row in rows] == [None] + [0.6, 5.0] * 3
    # Independently: beam search with alpha 5.0 called directly.
    assert_row_is_direct_beam(rows[2], word_run, beam_size=3, alpha=5.0)


def test_bleu_table_scores_each_beam_size(word_run, tmp_path):
    import json

    out = tmp_path / "beams"
    argv = ["--word", str(word_run), "--bpe", str(tmp_path / "none")]
    argv += ["--n", "6", "--beam", "2", "3", "--average", "0"]
    argv += ["--split", "val", "--out", str(out)]
    assert load_script("bleu_table").main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [row["setup"] for row in rows] == [
        "word, greedy",
        "word, beam 2",
        "word, beam 3",
    ]
    assert [row["beam"] for row in rows] == [1, 2, 3]
    # Independently: beam search of size 3 called directly.
    assert_row_is_direct_beam(rows[2], word_run, beam_size=3)
