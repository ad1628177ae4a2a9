"""Tests of the attention maps (notebooks/04_attention.py), against
PyTorch's own multi-head attention, hand-written softmaxes and closed
forms."""

import json
import math

import pytest
import torch
from torch import nn

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

N, H, D = 2, 4, 32
SRC_WORDS = ["ein", "hund", "rennt", "dem", "schwarzen", "hinterher", "."]
TGT_WORDS = ["a", "dog", "runs", "after", "the", "black", "."]
# Ids below count the four specials: <s>=0, </s>=1, <blank>=2, <unk>=3.
SRC = [tat.BOS, 4, 5, 6, 5, 7, tat.EOS, tat.PAD, tat.PAD]  # S = 9, 2 pads
TGT = [
    tat.BOS,
    4,
    5,
    6,
    tat.EOS,
    tat.PAD,
    tat.PAD,
]  # decoder input: T = 6, 1 pad


@pytest.fixture
def vocabs():
    return (
        tat.Vocab([*tat.SPECIALS, *SRC_WORDS]),
        tat.Vocab([*tat.SPECIALS, *TGT_WORDS]),
    )


@pytest.fixture
def model(vocabs):
    """A random small model, left in train mode with dropout on."""
    torch.manual_seed(0)
    return tat.make_model(
        len(vocabs[0]), len(vocabs[1]), N=N, d_model=D, d_ff=64, h=H
    )


@pytest.fixture
def maps(model, vocabs):
    return tat.attention_maps(model, SRC, TGT, *vocabs)


def attention_layers(model):
    return [
        m for m in model.modules() if isinstance(m, tat.MultiHeadedAttention)
    ]


def torch_mha(attn):
    """torch.nn.MultiheadAttention holding the weights of our layer."""
    qkv = [attn.w_q, attn.w_k, attn.w_v]
    ref = nn.MultiheadAttention(D, attn.h, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([m.weight for m in qkv]))
        ref.in_proj_bias.copy_(torch.cat([m.bias for m in qkv]))
        ref.out_proj.weight.copy_(attn.w_o.weight)
        ref.out_proj.bias.copy_(attn.w_o.bias)
    return ref.eval()


def torch_weights(attn, query, memory, src_mask):
    """Per-head attention weights that torch computes with our weights."""
    _, weights = torch_mha(attn)(
        query,
        memory,
        memory,
        key_padding_mask=~src_mask[:, 0],
        average_attn_weights=False,
    )
    return weights[0]  # (h, T, S)


def inputs():
    """Batched ids and masks for SRC and TGT, as training builds them."""
    src, tgt = torch.tensor([SRC]), torch.tensor([TGT[:-1]])  # (1, S), (1, T)
    return (
        src,
        tgt,
        (src != tat.PAD).unsqueeze(-2),
        tat.Batch.make_std_mask(tgt, tat.PAD),
    )


# ------------------------------------------------------------- structure
def test_shapes_and_labels(maps, vocabs):
    S, T = len(SRC), len(TGT) - 1
    assert maps.encoder_self.shape == (N, H, S, S)
    assert maps.decoder_self.shape == (N, H, T, T)
    assert maps.decoder_src.shape == (N, H, T, S)
    assert maps.src_tokens == vocabs[0].lookup_tokens(SRC)
    assert maps.tgt_tokens == vocabs[1].lookup_tokens(TGT[:-1])
    assert maps.next_tokens == vocabs[1].lookup_tokens(TGT[1:])
    assert maps.src_tokens[2] == maps.src_tokens[4] == "hund"


def test_labels_without_vocabularies_are_ids(model):
    maps = tat.attention_maps(model, SRC, TGT)
    assert maps.src_tokens == [str(i) for i in SRC]


@pytest.mark.parametrize("kind", list(tat.ATTENTION_KINDS))
def test_rows_are_distributions_and_masked_cells_are_zero(maps, kind):
    v = maps.view(kind)
    torch.testing.assert_close(
        v.weights.sum(-1), torch.ones(v.weights.shape[:-1])
    )
    assert v.weights.max() <= 1.0
    assert (v.weights[..., ~v.allowed] == 0).all()
    assert (v.weights[..., v.allowed] > 0).all()


def test_pad_keys_and_future_positions_are_exactly_zero(maps):
    assert (maps.encoder_self[..., 7:] == 0).all()
    assert (maps.decoder_src[..., 7:] == 0).all()
    assert (maps.decoder_self[..., 5] == 0).all()  # the pad input
    future = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    assert (maps.decoder_self[..., future] == 0).all()
    assert (maps.decoder_self[..., ~future][..., :-1] > 0).all()


def test_eval_mode_is_used_and_the_mode_restored(model):
    assert model.training  # dropout 0.1 is active in train mode
    maps = tat.attention_maps(model, SRC, TGT)
    assert model.training
    assert all(m.training for m in model.modules())
    again = tat.attention_maps(model, SRC, TGT)
    torch.testing.assert_close(maps.encoder_self, again.encoder_self)


# ----------------------------------------------------------- the opt-in
def test_default_stores_no_weights(model):
    src, tgt, src_mask, tgt_mask = inputs()
    for mode in (True, False):
        model.train(mode)
        model(src, tgt, src_mask, tgt_mask)
        layers = attention_layers(model)
        assert len(layers) == 3 * N
        assert all(m.attn is None and not m.store_attention for m in layers)
    tat.attention_maps(model, SRC, TGT)
    assert all(m.attn is None for m in attention_layers(model))
    assert not any(m.store_attention for m in attention_layers(model))


def test_record_attention_stores_then_restores(model):
    src, tgt, src_mask, tgt_mask = inputs()
    layers = attention_layers(model)
    layers[0].store_attention = True  # restored as it was, not to False
    before = [m.store_attention for m in layers]
    with torch.no_grad(), tat.record_attention(model.eval()) as recorded:
        assert recorded == layers
        assert all(m.store_attention for m in layers)
        model(src, tgt, src_mask, tgt_mask)
        assert all(m.attn is not None for m in layers)
    assert [m.store_attention for m in layers] == before
    assert all(m.attn is None for m in layers)


def test_record_attention_restores_on_exception(model):
    layers = attention_layers(model)
    layers[-1].store_attention = True
    before = [m.store_attention for m in layers]
    with pytest.raises(RuntimeError, match="boom"):
        with tat.record_attention(model):
            model.encode(*inputs()[::2])
            raise RuntimeError("boom")
    assert [m.store_attention for m in layers] == before
    assert all(m.attn is None for m in layers)


def test_recording_does_not_change_the_output(model):
    model.eval()
    with torch.no_grad():
        fused = model(*inputs())
        with tat.record_attention(model):
            explicit = model(*inputs())
    torch.testing.assert_close(explicit, fused, atol=1e-5, rtol=1e-5)


# ------------------------------------------ independent recomputations
def test_encoder_layer_matches_torch_multihead_attention(model, maps):
    src, _, src_mask, _ = inputs()
    model.eval()
    with torch.no_grad():
        x = model.src_embed(src)  # (1, S, D)
        for n, layer in enumerate(model.encoder.layers):
            xn = layer.self_attn_block.norm(x)
            ref = torch_weights(layer.self_attn, xn, xn, src_mask)
            torch.testing.assert_close(maps.encoder_self[n], ref)
            x = layer(x, src_mask)


def test_decoder_source_layer_matches_torch_multihead_attention(model, maps):
    src, tgt, src_mask, tgt_mask = inputs()
    model.eval()
    with torch.no_grad():
        memory = model.encode(src, src_mask)  # (1, S, D)
        x = model.tgt_embed(tgt)  # (1, T, D)
        x = model.decoder.layers[0](x, memory, src_mask, tgt_mask)
        layer = model.decoder.layers[1]
        x = layer.self_attn_block(
            x, lambda y: layer.self_attn(y, y, y, tgt_mask)
        )
        query = layer.src_attn_block.norm(x)
        ref = torch_weights(layer.src_attn, query, memory, src_mask)
    torch.testing.assert_close(maps.decoder_src[1], ref)


def test_decoder_self_layer_matches_a_softmax_by_hand(model, maps):
    _, tgt, _, tgt_mask = inputs()
    model.eval()
    attn = model.decoder.layers[0].self_attn
    T, d_k = tgt.size(1), D // H
    with torch.no_grad():
        block = model.decoder.layers[0].self_attn_block
        x = block.norm(model.tgt_embed(tgt))
        q = attn.w_q(x)[0].view(T, H, d_k).transpose(0, 1)
        k = attn.w_k(x)[0].view(T, H, d_k).transpose(0, 1)
        scores = q @ k.transpose(1, 2) / math.sqrt(d_k)  # (h, T, T)
        scores = scores.masked_fill(~tgt_mask, float("-inf"))
        ref = torch.softmax(scores, dim=-1)
    torch.testing.assert_close(maps.decoder_self[0], ref)


def test_without_a_target_the_maps_follow_greedy_decoding(model):
    model.eval()
    src = torch.tensor([SRC[:7]])  # no padding
    src_mask = (src != tat.PAD).unsqueeze(-2)  # (1, 1, S)
    decoded = tat.batch_greedy_decode(model, src, src_mask, 9)[0]
    maps = tat.attention_maps(model, SRC[:7], max_extra=2)
    torch.testing.assert_close(maps.tgt_ids, decoded[:-1])
    forced = tat.attention_maps(model, SRC[:7], decoded)
    torch.testing.assert_close(maps.decoder_src, forced.decoder_src)


# --------------------------------------------------- closed forms
def handmade_maps(S=5, T=4):
    """Uniform encoder and source attention; decoder looks one back."""
    prev = torch.zeros(T, T)
    prev[0, 0] = 1.0
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    return tat.AttentionMaps(
        encoder_self=torch.full((1, 1, S, S), 1 / S),
        decoder_self=prev.expand(1, 1, T, T),
        decoder_src=torch.full((1, 1, T, S), 1 / S),
        src_ids=torch.tensor([tat.BOS, *range(4, 4 + S - 2), tat.EOS]),
        tgt_ids=torch.tensor([tat.BOS, *range(4, 4 + T - 1)]),
        src_tokens=[f"s{i}" for i in range(S)],
        tgt_tokens=[f"t{i}" for i in range(T)],
        next_tokens=[f"t{i + 1}" for i in range(T)],
    )


def test_statistics_match_closed_forms():
    S, T = 5, 4
    maps = handmade_maps(S, T)
    stats = {r["kind"]: r for r in tat.attention_statistics(maps)}
    enc, dec, cross = (stats[k] for k in tat.ATTENTION_KINDS)
    assert enc["entropy"] == pytest.approx(1.0)
    # E|i - j| for i, j independent and uniform on 0 .. S-1.
    assert enc["distance"] == pytest.approx((S * S - 1) / (3 * S))
    assert enc["specials"] == pytest.approx(2 / S)
    assert dec["entropy"] == pytest.approx(0.0, abs=1e-12)
    assert dec["previous"] == pytest.approx((T - 1) / T)
    assert dec["same"] == pytest.approx(1 / T)
    assert dec["next"] == 0.0
    assert dec["distance"] == pytest.approx((T - 1) / T)
    assert cross["entropy"] == pytest.approx(1.0)
    assert all(r["layer"] == r["head"] == 1 for r in stats.values())


def test_source_distance_follows_the_rescaled_diagonal():
    """Decoder-source rows are set on a diagonal stretched to the source's
    length, i (S-1)/(T-1): computed here with plain loops."""
    S, T = 5, 4
    stats = {r["kind"]: r for r in tat.attention_statistics(handmade_maps())}
    rescaled = [i * (S - 1) / (T - 1) for i in range(T)]
    expected = sum(abs(j - d) for d in rescaled for j in range(S)) / (S * T)
    unscaled = sum(abs(j - i) for i in range(T) for j in range(S)) / (S * T)
    assert stats["decoder source"]["distance"] == pytest.approx(expected)
    assert expected != pytest.approx(unscaled)  # the check can tell


def causal_uniform(T):
    """(T, T): row i spreads its weight evenly over keys 0 .. i."""
    rows = torch.tril(torch.ones(T, T))
    return rows / rows.sum(-1, keepdim=True)


def test_entropy_is_measured_against_the_keys_a_row_may_see():
    """A causal row that spreads evenly over the keys it may see has the
    most entropy it can: 1, not log(i + 1) / log T."""
    T = 4
    maps = handmade_maps(T=T)
    maps.decoder_self = causal_uniform(T).expand(1, 1, T, T)
    dec = tat.attention_statistics(maps)[1]
    assert dec["kind"] == "decoder self"
    assert dec["entropy"] == pytest.approx(1.0)


def test_padding_is_neither_a_key_nor_a_row():
    """A padded source: the padding column is masked, its row not
    counted, whatever weights it holds."""
    real = 4  # <s>, two words, </s>; then one padding position
    maps = handmade_maps(S=real + 1)
    maps.src_ids = torch.tensor([tat.BOS, 4, 5, tat.EOS, tat.PAD])
    weights = torch.zeros(real + 1, real + 1)
    weights[:real, :real] = 1 / real  # real rows: even over real keys
    weights[real, 0] = 1.0  # the padding row: one-hot, entropy 0
    maps.encoder_self = weights.expand(1, 1, real + 1, real + 1)
    enc = tat.attention_statistics(maps)[0]
    assert enc["kind"] == "encoder self"
    assert enc["entropy"] == pytest.approx(1.0)  # the padding row left out
    assert enc["specials"] == pytest.approx(2 / real)  # <s>, </s> of 4


def test_each_layer_and_head_gets_its_own_row():
    """Only layer 2, head 1 looks one back; every other head is even."""
    T, layers, heads = 4, 2, 3
    maps = handmade_maps(T=T)
    self_maps = causal_uniform(T).repeat(layers, heads, 1, 1)
    self_maps[1, 0] = handmade_maps(T=T).decoder_self[0, 0]
    maps.decoder_self = self_maps
    maps.encoder_self = maps.encoder_self.expand(layers, heads, -1, -1)
    maps.decoder_src = maps.decoder_src.expand(layers, heads, -1, -1)
    rows = [r for r in tat.attention_statistics(maps)]
    decoder = [r for r in rows if r["kind"] == "decoder self"]
    sharp = [(r["layer"], r["head"]) for r in decoder if r["entropy"] < 0.5]
    assert len(decoder) == layers * heads and sharp == [(2, 1)]


def test_summary_averages_sentences(model, vocabs):
    spacy_de, spacy_en = tat.load_tokenizers()
    pairs = [("ein hund rennt .", "a dog runs ."), ("ein hund .", "a dog .")]
    summary = tat.attention_summary(model, pairs, spacy_de, spacy_en, *vocabs)
    each = []  # the statistics of each pair alone
    for de, en in pairs:
        src = [tat.BOS, *vocabs[0](de.split()), tat.EOS]
        tgt = [tat.BOS, *vocabs[1](en.split()), tat.EOS]
        each.append(
            tat.attention_statistics(tat.attention_maps(model, src, tgt))
        )
    assert len(summary) == len(each[0]) == 3 * N * H
    for mean, a, b in zip(summary, *each, strict=True):
        assert mean.keys() == a.keys()
        for key, value in mean.items():
            if key in ("kind", "layer", "head"):
                assert value == a[key] == b[key]
            else:
                assert value == pytest.approx((a[key] + b[key]) / 2), key


# --------------------------------------------------------------- charts
def chart_values(chart):
    """Every data row a chart spec carries, inline or in its datasets."""
    spec = chart.to_dict()  # validates against the Vega-Lite schema
    rows = [r for values in spec.get("datasets", {}).values() for r in values]
    found = [spec]
    while found:
        node = found.pop()
        if isinstance(node, dict):
            if isinstance(node.get("data"), dict):
                rows += node["data"].get("values", [])
            found += node.values()
        elif isinstance(node, list):
            found += node
    return spec, rows


def no_nan(rows):
    return all(
        not (isinstance(x, float) and math.isnan(x))
        for row in rows
        for x in row.values()
    )


@pytest.mark.parametrize("kind", list(tat.ATTENTION_KINDS))
def test_attention_chart_has_every_head_and_layer_and_no_nan(maps, kind):
    frame = tools.attention_frame(maps, kind)
    assert not frame.isna().any().any()
    assert sorted(frame["head"].unique()) == list(range(1, H + 1))
    assert sorted(frame["layer"].unique()) == list(range(1, N + 1))
    assert "<blank>" not in set(frame["query"]) | set(frame["key"])
    sums = frame.groupby(["layer", "head", "row"])["weight"].sum()
    assert sums.to_numpy() == pytest.approx(1.0, abs=1e-6)
    spec, rows = chart_values(tools.attention_chart(maps, kind))
    assert rows and no_nan(rows)
    assert len(rows) == len(frame)
    assert max(r["weight"] for r in rows) <= 1.0
    param = spec["params"][0]
    assert param["bind"]["options"] == list(range(1, N + 1))
    # one colour scale for every map: white is 0 and dark blue is 1
    colour = spec["spec"]["encoding"]["color"]["scale"]
    assert colour["domain"] == [0, 1]


def test_summary_chart_has_no_nan(model, maps):
    summary = tat.attention_statistics(maps)
    _, rows = chart_values(tools.attention_summary_chart(summary))
    assert len(rows) == 3 * N * H and no_nan(rows)


def test_charts_render_offline(maps):
    vlc = pytest.importorskip("vl_convert")
    chart = tools.attention_chart(maps, "decoder source")
    svg = vlc.vegalite_to_svg(chart.to_dict())
    assert "hund" in svg and "head 4" in svg


def test_chart_title_names_the_layer_shown(maps):
    vlc = pytest.importorskip("vl_convert")
    for layer in (1, N):
        chart = tools.attention_chart(maps, "encoder self", layer=layer)
        svg = vlc.vegalite_to_svg(chart.to_dict())
        assert f"encoder self attention, layer {layer} of {N}" in svg


@pytest.mark.parametrize("kind", list(tat.ATTENTION_KINDS))
def test_decoder_rows_are_labelled_with_the_token_they_predict(maps, kind):
    """A decoder row reads one token and predicts the next: "A → brown"."""
    spec = tools.attention_chart(maps, kind).to_dict()
    axis = spec["spec"]["encoding"]["y"]["axis"]
    labels = json.loads(axis["labelExpr"].removesuffix("[datum.value]"))
    if kind == "encoder self":
        assert labels == maps.src_tokens and axis["title"] == "query"
    else:  # the decoder's inputs, each with the next target token
        target = [*maps.tgt_tokens, maps.next_tokens[-1]]  # <s> ... </s>
        expected = [f"{a} → {b}" for a, b in zip(target, target[1:])]
        assert labels == expected
