"""Tests of unknown-word replacement (Part 4, "Putting attention to work:
unknown words"; used by the appendix's `translate_batch`)."""

from dataclasses import asdict

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

BOS, EOS, PAD, UNK = tat.BOS, tat.EOS, tat.PAD, tat.UNK
SENTENCES = ["Zwei Hunde spielen im Schnee .", "Ein Mann läuft ."]
SRC = tat.Vocab([*tat.SPECIALS, "Ein", "Mann"])  # most German is <unk>
TGT = tat.Vocab([*tat.SPECIALS, "a", "man"])
A = TGT(["a"])[0]


class ForcedSourceAttention(tat.MultiHeadedAttention):
    """Source attention with hand-set weights; passes its queries through.

    Row r (the decoder input r, which writes output token r + 1) weighs
    source positions r + 1 and r + 2 as 0.6 / 0.4 in head 0 and 0 / 0.5
    in head 1: the mean over heads prefers r + 2, head 0 alone r + 1.
    `<s>`, `</s>` and padding get larger weights than any word, so an
    alignment that does not exclude them picks them.
    """

    def forward(self, query, key, value, mask=None):
        B, T, S = query.size(0), query.size(1), key.size(1)
        p = torch.zeros(B, self.h, T, S)  # (B, h, T, S)
        for r in range(T):
            if r + 2 < S:
                p[:, 0, r, r + 1], p[:, 0, r, r + 2] = 0.6, 0.4
                p[:, 1, r, r + 2] = 0.5
        keep = mask[:, 0, :]  # (B, S): False at padding
        n = keep.sum(-1)  # (B,): <s> + words + </s>
        p[:, :, :, 0] = 0.7  # <s>
        p[torch.arange(B), :, :, n - 1] = 0.7  # </s>
        p.masked_fill_(~keep[:, None, None, :], 0.9)  # padding
        if self.store_attention:
            self.attn = p
        return query


def forced_model():
    """A small model whose source attention is hand-set in every layer."""
    torch.manual_seed(0)
    model = tat.make_model(len(SRC), len(TGT), N=2, d_model=16, d_ff=32, h=2)
    for layer in model.decoder.layers:
        layer.src_attn = ForcedSourceAttention(2, 16)
    return model.eval()


def writes(*rows):
    """A decode_fn that writes the given output ids for every sentence."""

    def decode(model, src, src_mask, max_len):
        assert src.size(0) == len(rows)
        return torch.tensor(rows)  # (B, L)

    return decode


@pytest.fixture(scope="module")
def spacy_de():
    return tat.load_tokenizers()[0]


def test_each_unk_gets_the_word_that_the_mean_attention_points_at(spacy_de):
    # Sentence 1 is shorter, so it is padded in the batch (and sorted
    # first: rows are in length order).
    row = [BOS, UNK, A, UNK, EOS]
    out = tools.translate_batch(
        forced_model(), SENTENCES, spacy_de, SRC, TGT,
        decode_fn=writes(row, row),
    )  # fmt: skip
    # Output token t was written by row t - 1, which points at source
    # position t + 1, that is German word t (after <s>).
    for sentence, hyp in zip(SENTENCES, out, strict=True):
        words = tat.tokenize(sentence, spacy_de)
        assert hyp == tools.detokenize([words[1], "a", words[3]]), hyp
    assert "<unk>" not in " ".join(out)
    # Words unknown to the source vocabulary ("Hunde", "im") come back:
    # the copy is taken from the German text, not from the ids.
    assert out[0] == "Hunde a im"


def test_replace_unk_false_keeps_unk(spacy_de):
    row = [BOS, UNK, A, UNK, EOS]
    out = tools.translate_batch(
        forced_model(), SENTENCES, spacy_de, SRC, TGT,
        decode_fn=writes(row, row), replace_unk=False,
    )  # fmt: skip
    assert out == ["<unk> a <unk>"] * 2


def test_output_without_unk_is_unchanged(spacy_de, monkeypatch):
    rows = [[BOS, A, TGT(["man"])[0], EOS], [BOS, A, EOS, PAD]]
    calls = []
    real = tools.source_alignment
    monkeypatch.setattr(
        tools, "source_alignment", lambda *a: calls.append(1) or real(*a)
    )
    model, fn = forced_model(), writes(*rows)
    on = tools.translate_batch(
        model, SENTENCES, spacy_de, SRC, TGT, decode_fn=fn
    )
    off = tools.translate_batch(
        model, SENTENCES, spacy_de, SRC, TGT, decode_fn=fn, replace_unk=False
    )
    # rows come back in input order: the longer sentence 0 was second
    assert on == off == ["a", "a man"]
    assert not calls, "no <unk>, so no extra decoder pass"


def test_subword_vocabularies_are_left_alone(spacy_de, monkeypatch):
    class Pieces:
        """A stand-in for a BPE vocabulary: it reads and writes text."""

        def encode(self, text):
            return [4] * len(text.split())

        def decode(self, ids):
            return " ".join(f"piece{i}" for i in ids)

    def never(*args):
        raise AssertionError("no <unk> replacement for subwords")

    monkeypatch.setattr(tools, "source_alignment", never)
    torch.manual_seed(0)
    model = tat.make_model(8, 8, N=1, d_model=16, d_ff=32, h=2)
    out = tools.translate_batch(
        model, SENTENCES[:1], spacy_de, Pieces(), Pieces(),
        decode_fn=writes([BOS, UNK, 5, EOS]),
    )  # fmt: skip
    assert out == ["piece3 piece5"]


def test_alignment_matches_part4_maps_of_each_sentence_alone():
    """Batched and padded, against attention_maps on one unpadded pair."""
    torch.manual_seed(1)
    model = tat.make_model(20, 20, N=2, d_model=32, d_ff=64, h=4).eval()
    lengths = [9, 4, 6]  # words per sentence
    rows = [[BOS, *torch.randint(4, 20, (n,)).tolist(), EOS] for n in lengths]
    src, _ = tat.collate_batch([(r, []) for r in rows])  # (B, S), padded
    mask = (src != PAD).unsqueeze(-2)  # (B, 1, S)
    out = tat.cached_greedy_decode(model, src, mask, 8)  # (B, L)
    aligned = tools.source_alignment(model, src, mask, out)  # (B, L - 1)
    assert aligned.shape == (3, out.size(1) - 1)
    for b, (ids, n) in enumerate(zip(rows, lengths, strict=True)):
        # only words: never <s> (0), </s> (n + 1) or padding (> n + 1)
        assert ((aligned[b] >= 1) & (aligned[b] <= n)).all()
        tgt = tat.strip_specials(out[b].tolist())
        maps = tat.attention_maps(model, ids, [BOS, *tgt, EOS])
        # (N, h, T, S) -> (T, n): mean over layers and heads, words only
        mean = maps.decoder_src.mean(dim=(0, 1))[:, 1 : n + 1]
        expected = (mean.argmax(-1) + 1).tolist()  # source positions
        m = min(len(expected), aligned.size(1))  # rows up to </s>
        assert aligned[b, :m].tolist() == expected[:m]


def unk_writer(path):
    """A tiny checkpoint whose model writes nothing but <unk>."""
    torch.manual_seed(0)
    cfg = tools.get_config("ci", N=1, d_model=16, d_ff=32, h=2)
    model = tat.model_from_config(cfg, len(SRC), len(TGT))
    with torch.no_grad():
        model.generator.proj.bias.fill_(-30.0)
        model.generator.proj.bias[UNK] = 30.0
    tools.save_checkpoint(
        path,
        model=model.state_dict(),
        config=asdict(cfg),
        vocab_src=SRC.get_itos(),
        vocab_tgt=TGT.get_itos(),
    )
    return str(path)


def test_cli_replaces_unk_unless_told_not_to(tmp_path, spacy_de, capsys):
    ckpt = unk_writer(tmp_path / "unk.pt")
    sentence = "Ein Quuxblorf schläft ."
    words = set(tat.tokenize(sentence, spacy_de))
    assert tools.main(["translate", "--checkpoint", ckpt, sentence]) == 0
    out = capsys.readouterr().out.replace(".", " ").split()
    assert out and set(out) <= words, out  # only German words, copied
    argv = ["translate", "--checkpoint", ckpt, "--no-replace-unk", sentence]
    assert tools.main(argv) == 0
    assert set(capsys.readouterr().out.split()) == {"<unk>"}
    # evaluate, with and without, on a pair of files
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("\n".join(SENTENCES) + "\n")
    ref.write_text("Two dogs play in the snow.\nA man runs.\n")
    hyps = {}
    for flag in ([], ["--no-replace-unk"]):
        out = tmp_path / f"hyp{len(flag)}.en"
        argv = ["evaluate", "--checkpoint", ckpt, "--src", str(src)]
        argv += ["--ref", str(ref), "--out", str(out), *flag]
        assert tools.main(argv) == 0
        assert capsys.readouterr().out.startswith("BLEU = ")
        hyps[bool(flag)] = out.read_text()
    assert set(hyps[True].split()) == {"<unk>"}
    lines = hyps[False].replace(".", " ").splitlines()
    for sentence, line in zip(SENTENCES, lines, strict=True):
        words = set(tat.tokenize(sentence, spacy_de))
        assert line.split() and set(line.split()) <= words, line


def test_bench_default_row_is_the_real_source_alignment():
    """bench/unk_alignment.py's "mean of all layers" is the default."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench/unk_alignment.py"
    spec = importlib.util.spec_from_file_location("unk_alignment", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.manual_seed(2)
    model = tat.make_model(20, 20, N=3, d_model=32, d_ff=64, h=4).eval()
    src = torch.randint(4, 20, (3, 9))
    src[:, 0], src[:, -1] = BOS, EOS
    mask = (src != PAD).unsqueeze(-2)
    out = tat.cached_greedy_decode(model, src, mask, 8)
    default = tools.source_alignment(model, src, mask, out)
    assert torch.equal(bench.alignment_from([0, 1, 2])(model, src, mask, out),
                       default)  # fmt: skip
    last = bench.alignment_from([2])(model, src, mask, out)
    assert not torch.equal(last, default)  # a real choice, for this seed
