"""Tests of the model (notebooks/01_model.py), each against a reference
that does not share its code: PyTorch built-ins, closed forms, or the
2022 tutorial's parameter names written out by hand (which this project's
older checkpoints used, and which load through a key map)."""

import math

import pytest
import torch
import torch.nn.functional as F

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

pytestmark = pytest.mark.usefixtures("one_thread")


def qkv(B=2, h=4, T=5, S=7, d_k=8, dtype=torch.float32, seed=0):
    """Random query (B, h, T, d_k) and key/value (B, h, S, d_k)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, T, d_k, generator=g).to(dtype)
    k = torch.randn(B, h, S, d_k, generator=g).to(dtype)
    v = torch.randn(B, h, S, d_k, generator=g).to(dtype)
    return q, k, v


def padding_mask(lengths, S):
    """(B, 1, 1, S) bool mask, True on the first `length` keys."""
    return (torch.arange(S) < torch.tensor(lengths)[:, None])[:, None, None]


# --------------------------------------------------------------- attention
def test_attention_without_mask_matches_sdpa():
    q, k, v = qkv()
    out, p = tat.attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 4, 5))


def test_attention_padding_mask_matches_sdpa():
    q, k, v = qkv()
    mask = padding_mask([7, 4], 7)  # (B, 1, 1, S)
    out, p = tat.attention(q, k, v, mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref)
    assert (p[1, :, :, 4:] == 0).all()
    assert (p[0] > 0).all()


def test_attention_causal_mask_matches_sdpa_is_causal():
    q, k, v = qkv(T=6, S=6)
    out, p = tat.attention(q, k, v, mask=tat.subsequent_mask(6)[None])
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref)
    assert (p.triu(1) == 0).all()


def test_attention_mask_broadcast_over_heads_matches_sdpa():
    # A (B, 1, T, S) mask: padding and causal together, shared by all heads.
    q, k, v = qkv(T=6, S=6)
    pad = torch.arange(6) < torch.tensor([6, 3])[:, None]  # (B, S)
    mask = (pad[:, None, :] & torch.ones(6, 6).tril().bool())[:, None]
    assert mask.shape == (2, 1, 6, 6)
    out, p = tat.attention(q, k, v, mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref)
    assert (p.masked_select(~mask.expand_as(p)) == 0).all()


def test_multi_head_sdpa_path_equals_explicit_path_in_eval():
    torch.manual_seed(0)
    mha = tat.MultiHeadedAttention(h=4, d_model=32, dropout=0.1).eval()
    x = torch.randn(2, 6, 32)
    mem = torch.randn(2, 5, 32)
    src_mask = torch.tensor([[[1, 1, 1, 1, 1]], [[1, 1, 1, 0, 0]]]).bool()
    tgt_mask = tat.subsequent_mask(6)
    for query, kv, mask in [(x, mem, src_mask), (x, x, tgt_mask)]:
        mha.store_attention = False
        fused = mha(query, kv, kv, mask)
        assert mha.attn is None
        mha.store_attention = True
        explicit = mha(query, kv, kv, mask)
        assert mha.attn.shape == (2, 4, 6, kv.size(1))
        torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
        mha.attn = None


@pytest.mark.parametrize("store", [False, True])  # fused, then explicit
def test_a_float_mask_of_ones_and_zeros_hides_what_the_bool_mask_hides(
    store,
):
    """The 2022 tutorial's masks may be float (its examples pass
    torch.ones(1, 1, 10)); the fused routine would add them to the scores
    and hide nothing. Reference: the same model with the bool mask, and
    an output that does not move when the hidden keys change."""
    torch.manual_seed(0)
    mha = tat.MultiHeadedAttention(h=4, d_model=32, dropout=0.0).eval()
    mha.store_attention = store
    x = torch.randn(2, 6, 32)
    mem = torch.randn(2, 5, 32)
    src_mask = torch.tensor([[[1, 1, 1, 1, 1]], [[1, 1, 1, 0, 0]]]).bool()
    tgt_mask = tat.subsequent_mask(6)
    for kv, mask in [(mem, src_mask), (x, tgt_mask)]:
        expected = mha(x, kv, kv, mask)
        for dtype in (torch.float32, torch.long):
            got = mha(x, kv, kv, mask.to(dtype))
            torch.testing.assert_close(got, expected)
    other = mem.clone()
    other[1, 3:] = torch.randn(2, 32)  # the second sentence's two pads
    torch.testing.assert_close(
        mha(x, other, other, src_mask.float()),
        mha(x, mem, mem, src_mask.float()),
    )


def test_attention_reads_a_float_mask_as_2022_did():
    q, k, v = qkv()
    mask = padding_mask([7, 4], 7)
    out, p = tat.attention(q, k, v, mask=mask.float())
    ref, p_ref = tat.attention(q, k, v, mask=mask)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(p, p_ref)


@pytest.mark.parametrize(
    "mask",
    [
        torch.tensor([[[0.0, 0.0, float("-inf")]]]),  # PyTorch's additive
        torch.tensor([[[1, 1, 2]]]),
    ],
    ids=["additive", "a 2"],
)
def test_a_mask_of_other_values_than_0_and_1_is_refused(mask):
    """An additive mask (0 keeps, -inf hides) means the opposite of a
    0/1 mask: read as one, it would hide the keys it keeps."""
    mha = tat.MultiHeadedAttention(h=2, d_model=8, dropout=0.0).eval()
    x = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="0s and 1s"):
        mha(x, x, x, mask)


@pytest.mark.parametrize("B", [2, 4])  # 4 = h: broadcasting would not fail
def test_a_mask_without_its_middle_axis_is_refused(B):
    mha = tat.MultiHeadedAttention(h=4, d_model=16, dropout=0.0).eval()
    x = torch.randn(B, 3, 16)
    flat = torch.ones(B, 3, dtype=torch.bool)  # (B, S), not (B, 1, S)
    with pytest.raises(ValueError, match=r"\(B, 1, S\) or \(B, T, S\)"):
        mha(x, x, x, flat)


def test_decoding_with_a_float_source_mask_equals_the_bool_mask():
    """Greedy decoding, plain and with the cache of Part 5, reads a float
    padding mask of 0s and 1s as it reads the bool one."""
    torch.manual_seed(0)
    model = tat.make_model(9, 9, N=2, d_model=16, d_ff=32, h=2).eval()
    src = torch.tensor([[3, 4, 5, 6, 2, 2], [5, 6, 7, 8, 3, 4]])
    bool_mask = (src != 2).unsqueeze(-2)  # (B, 1, S); 2 pads row 0
    with torch.no_grad():
        for decode in (tat.batch_greedy_decode, tat.cached_greedy_decode):
            expected = decode(model, src, bool_mask, 7)
            got = decode(model, src, bool_mask.float(), 7)
            assert torch.equal(got, expected), decode.__name__
        # Their continuous outputs: the encoder's, and the cached step's.
        memory = model.encode(src, bool_mask)
        torch.testing.assert_close(
            model.encode(src, bool_mask.float()), memory
        )
        first = torch.full((2, 1), tat.BOS)
        steps = [
            tat.decode_step(model, first, tat.DecoderCache(model, memory, m))
            for m in (bool_mask, bool_mask.float())
        ]
        torch.testing.assert_close(steps[1], steps[0])


def sdpa_calls(monkeypatch):
    """A list that grows by one each time the fused kernel is called."""
    calls, fused = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs.get("dropout_p"))
        return fused(*args, **kwargs)

    monkeypatch.setattr(tat.F, "scaled_dot_product_attention", recording)
    return calls


@pytest.mark.parametrize(
    "training, p, store, device, fused",
    [
        (True, 0.1, False, "cpu", False),  # no fused CPU kernel for dropout
        (True, 0.0, False, "cpu", True),  # no dropout: fused
        (False, 0.1, False, "cpu", True),  # eval: fused, dropout 0
        (True, 0.1, False, "meta", True),  # a GPU's kernel has dropout
        (False, 0.1, True, "cpu", False),  # weights wanted
    ],
)
def test_which_attention_path_runs(
    monkeypatch, training, p, store, device, fused
):
    calls = sdpa_calls(monkeypatch)
    mha = tat.MultiHeadedAttention(h=2, d_model=8, dropout=p).to(device)
    mha.train(training)
    mha.store_attention = store
    x = torch.randn(3, 4, 8, device=device)
    mha(x, x, x, tat.subsequent_mask(4).to(device))
    assert calls == ([p if training else 0.0] if fused else [])
    assert (mha.attn is not None) == store


def test_cpu_training_with_dropout_drops_attention_weights_with_the_module():
    """The explicit path calls self.dropout, so FastDropout's swap reaches
    attention too, and the attention weights are not kept."""
    torch.manual_seed(0)
    mha = tat.MultiHeadedAttention(h=2, d_model=8, dropout=0.5).train()
    seen = []
    mha.dropout.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    x = torch.randn(3, 4, 8)
    mha(x, x, x, tat.subsequent_mask(4))
    assert seen == [(3, 2, 4, 4)]  # (B, h, T, S): the attention weights
    assert mha.attn is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_masking_in_half_precision(dtype):
    # Large scores make a -1e9 style fill overflow; ours must stay finite.
    q, k, v = qkv(T=6, S=6, dtype=dtype)
    q = q * 8
    pad = torch.arange(6) < torch.tensor([6, 2])[:, None]
    mask = (pad[:, None, :] & torch.ones(6, 6).tril().bool())[:, None]
    try:
        out, p = tat.attention(q, k, v, mask=mask)
    except RuntimeError as err:  # an op without a CPU kernel for dtype
        pytest.skip(f"{dtype} attention not supported on CPU: {err}")
    assert out.dtype == dtype and p.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(p).all()
    assert (p.masked_select(~mask.expand_as(p)) == 0).all()
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask
    )
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_multi_head_attention_masked_in_half_precision(dtype):
    torch.manual_seed(0)
    mha = tat.MultiHeadedAttention(h=2, d_model=16, dropout=0.0).eval()
    mha = mha.to(dtype)
    mha.store_attention = True
    x = torch.randn(2, 4, 16).to(dtype)
    mask = torch.tensor([[[1, 1, 1, 1]], [[1, 1, 0, 0]]]).bool()
    try:
        with torch.no_grad():
            out = mha(x, x, x, mask)
    except RuntimeError as err:
        pytest.skip(f"{dtype} linear/matmul not supported on CPU: {err}")
    assert torch.isfinite(out).all()
    assert (mha.attn[1, :, :, 2:] == 0).all()


def test_subsequent_mask_equals_tril():
    for size in (1, 2, 7):
        ref = torch.tril(torch.ones(size, size)).bool()[None]
        m = tat.subsequent_mask(size)
        assert m.dtype == torch.bool and m.shape == (1, size, size)
        assert torch.equal(m, ref)


# ------------------------------------------------------ positional encoding
def test_positional_encoding_matches_closed_form():
    d_model, max_len = 6, 40
    pe = tat.PositionalEncoding(d_model, dropout=0.0, max_len=max_len)
    ref = torch.empty(max_len, d_model, dtype=torch.float64)
    for pos in range(max_len):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            ref[pos, 2 * i] = math.sin(angle)
            ref[pos, 2 * i + 1] = math.cos(angle)
    assert pe.pe.shape == (1, max_len, d_model)
    torch.testing.assert_close(pe.pe[0].double(), ref, atol=1e-5, rtol=0)
    x = torch.randn(3, 11, d_model)
    torch.testing.assert_close(
        pe.eval()(x), x + ref[:11].float(), atol=1e-5, rtol=0
    )


# -------------------------------------------------------------- layer norm
def layer_norm_by_hand(x, gain, bias, eps):
    """The formula in float64: gain * (x - mean) / sqrt(var + eps) + bias."""
    x, gain, bias = x.double(), gain.double(), bias.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance
    return gain * (x - mean) / torch.sqrt(var + eps) + bias


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_layer_norm_matches_the_formula_with_gradients(eps):
    torch.manual_seed(0)
    d = 24
    ln = tat.LayerNorm(d, eps=eps)
    with torch.no_grad():
        ln.a_2.copy_(torch.randn(d))
        ln.b_2.copy_(torch.randn(d))
    # Small inputs make the eps inside the square root visible.
    x = (torch.randn(4, 5, d) * 0.1 + 1).requires_grad_()
    grad = torch.randn(4, 5, d)
    ours = ln(x)
    ours.backward(grad)
    got = [x.grad, ln.a_2.grad, ln.b_2.grad]
    for t in (x, ln.a_2, ln.b_2):
        t.grad = None
    ref = layer_norm_by_hand(x, ln.a_2, ln.b_2, eps)
    ref.backward(grad.double())
    torch.testing.assert_close(ours, ref.float(), atol=1e-5, rtol=1e-5)
    for g, t in zip(got, (x, ln.a_2, ln.b_2)):
        torch.testing.assert_close(g, t.grad, atol=1e-4, rtol=1e-4)


# -------------------------------------------------------- parameter counts
def params_by_name(module):
    """Parameter count by summing over named parameters."""
    return sum(p.numel() for _, p in module.named_parameters())


@pytest.mark.parametrize("d", [16, 64, 512])
def test_block_parameter_counts_match_closed_forms(d):
    with torch.device("meta"):
        mha = tat.MultiHeadedAttention(8, d)
        ff = tat.PositionwiseFeedForward(d, 4 * d)
        ln = tat.LayerNorm(d)
    for module, expected in [
        (mha, 4 * (d * d + d)),
        (ff, 8 * d * d + 5 * d),
        (ln, 2 * d),
    ]:
        assert tat.count_parameters(module) == expected
        assert params_by_name(module) == expected


def test_tied_model_parameter_count():
    d, V = 512, 10000
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = tat.tie_embeddings(tat.make_model(V, V, d_model=d))
    expected = 168 * d * d + 196 * d + V * d + V
    assert expected == 44_140_544 + 513 * V
    assert tat.count_parameters(model) == expected
    assert params_by_name(model) == expected
    # Counting every use of the shared matrix adds it twice more.
    every_use = sum(
        p.numel() for _, p in model.named_parameters(remove_duplicate=False)
    )
    assert every_use == expected + 2 * V * d


@pytest.mark.parametrize("d, N", [(512, 6), (64, 2)])
def test_untied_model_parameter_count(d, N):
    V_src, V_tgt = 8000, 6000
    with torch.device("meta"):
        model = tat.make_model(V_src, V_tgt, N=N, d_model=d, d_ff=4 * d)
    stacks = N * (12 * d * d + 13 * d) + N * (16 * d * d + 19 * d) + 4 * d
    if N == 6:
        assert stacks == 168 * d * d + 196 * d
    expected = stacks + V_src * d + 2 * V_tgt * d + V_tgt
    assert tat.count_parameters(model) == expected
    assert params_by_name(model) == expected


# ------------------------------------------------------------ weight tying
def test_tied_model_shares_one_matrix():
    model = tat.tie_embeddings(
        tat.make_model(13, 13, N=1, d_model=16, d_ff=32, h=2)
    )
    mats = [
        model.src_embed[0].lut.weight,
        model.tgt_embed[0].lut.weight,
        model.generator.proj.weight,
    ]
    assert len({m.data_ptr() for m in mats}) == 1
    assert mats[0] is mats[1] is mats[2]
    untied = tat.make_model(13, 13, N=1, d_model=16, d_ff=32, h=2)
    ptrs = {
        untied.src_embed[0].lut.weight.data_ptr(),
        untied.tgt_embed[0].lut.weight.data_ptr(),
        untied.generator.proj.weight.data_ptr(),
    }
    assert len(ptrs) == 3


def test_tie_embeddings_needs_one_vocabulary():
    model = tat.make_model(11, 12, N=1, d_model=16, d_ff=32, h=2)
    with pytest.raises(ValueError, match="one shared vocabulary"):
        tat.tie_embeddings(model)


# ------------------------------------------------- older checkpoint layout
# make_model(11, 11, N=1).state_dict().keys() as the 2022 code (harvardnlp
# annotated-transformer, AnnotatedTransformer.ipynb) produced them, in order,
# and as this project's checkpoints had them before Part 1 named its parts.
KEYS_2022_N1 = [
    "encoder.layers.0.self_attn.linears.0.weight",
    "encoder.layers.0.self_attn.linears.0.bias",
    "encoder.layers.0.self_attn.linears.1.weight",
    "encoder.layers.0.self_attn.linears.1.bias",
    "encoder.layers.0.self_attn.linears.2.weight",
    "encoder.layers.0.self_attn.linears.2.bias",
    "encoder.layers.0.self_attn.linears.3.weight",
    "encoder.layers.0.self_attn.linears.3.bias",
    "encoder.layers.0.feed_forward.w_1.weight",
    "encoder.layers.0.feed_forward.w_1.bias",
    "encoder.layers.0.feed_forward.w_2.weight",
    "encoder.layers.0.feed_forward.w_2.bias",
    "encoder.layers.0.sublayer.0.norm.a_2",
    "encoder.layers.0.sublayer.0.norm.b_2",
    "encoder.layers.0.sublayer.1.norm.a_2",
    "encoder.layers.0.sublayer.1.norm.b_2",
    "encoder.norm.a_2",
    "encoder.norm.b_2",
    "decoder.layers.0.self_attn.linears.0.weight",
    "decoder.layers.0.self_attn.linears.0.bias",
    "decoder.layers.0.self_attn.linears.1.weight",
    "decoder.layers.0.self_attn.linears.1.bias",
    "decoder.layers.0.self_attn.linears.2.weight",
    "decoder.layers.0.self_attn.linears.2.bias",
    "decoder.layers.0.self_attn.linears.3.weight",
    "decoder.layers.0.self_attn.linears.3.bias",
    "decoder.layers.0.src_attn.linears.0.weight",
    "decoder.layers.0.src_attn.linears.0.bias",
    "decoder.layers.0.src_attn.linears.1.weight",
    "decoder.layers.0.src_attn.linears.1.bias",
    "decoder.layers.0.src_attn.linears.2.weight",
    "decoder.layers.0.src_attn.linears.2.bias",
    "decoder.layers.0.src_attn.linears.3.weight",
    "decoder.layers.0.src_attn.linears.3.bias",
    "decoder.layers.0.feed_forward.w_1.weight",
    "decoder.layers.0.feed_forward.w_1.bias",
    "decoder.layers.0.feed_forward.w_2.weight",
    "decoder.layers.0.feed_forward.w_2.bias",
    "decoder.layers.0.sublayer.0.norm.a_2",
    "decoder.layers.0.sublayer.0.norm.b_2",
    "decoder.layers.0.sublayer.1.norm.a_2",
    "decoder.layers.0.sublayer.1.norm.b_2",
    "decoder.layers.0.sublayer.2.norm.a_2",
    "decoder.layers.0.sublayer.2.norm.b_2",
    "decoder.norm.a_2",
    "decoder.norm.b_2",
    "src_embed.0.lut.weight",
    "src_embed.1.pe",
    "tgt_embed.0.lut.weight",
    "tgt_embed.1.pe",
    "generator.proj.weight",
    "generator.proj.bias",
]


def test_parts_have_their_own_names_not_list_positions():
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    keys = list(model.state_dict())
    assert not [k for k in keys if ".linears." in k or ".sublayer." in k]
    layer = model.decoder.layers[0]
    for name in ("w_q", "w_k", "w_v", "w_o"):
        assert isinstance(layer.src_attn._modules[name], torch.nn.Linear)
    for name in ("self_attn_block", "src_attn_block", "ff_block"):
        block = layer._modules[name]
        assert isinstance(block, tat.SublayerConnection)
    # Same parameters as the 2022 layout, in the same order.
    assert len(keys) == len(KEYS_2022_N1)
    assert [k.rsplit(".", 1)[-1] for k in keys] == [
        k.rsplit(".", 1)[-1] for k in KEYS_2022_N1
    ]


def test_old_keys_map_onto_the_new_ones_in_order():
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    renamed = tools.rename_old_keys(dict.fromkeys(KEYS_2022_N1))
    assert list(renamed) == list(model.state_dict())
    new = dict.fromkeys(model.state_dict())
    assert list(tools.rename_old_keys(new)) == list(new)  # new pass as is


def test_an_old_style_state_dict_loads_and_gives_identical_outputs():
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=32, d_ff=64, h=4).eval()
    # The same tensors under the old names, matched by position: the
    # hand-written list above is in the order the old model saved them.
    old_style = dict(zip(KEYS_2022_N1, model.state_dict().values()))
    torch.manual_seed(1)
    fresh = tat.make_model(11, 11, N=1, d_model=32, d_ff=64, h=4).eval()
    src = torch.randint(1, 11, (3, 9))
    tgt = torch.randint(1, 11, (3, 6))
    src_mask = torch.ones(3, 1, 9, dtype=torch.bool)
    tgt_mask = tat.subsequent_mask(6)
    with torch.no_grad():
        before = model(src, tgt, src_mask, tgt_mask)
        assert not torch.allclose(fresh(src, tgt, src_mask, tgt_mask), before)
        with pytest.raises(RuntimeError, match="linears"):
            fresh.load_state_dict(old_style)  # refused without the map
        fresh.load_state_dict(tools.rename_old_keys(old_style))
        after = fresh(src, tgt, src_mask, tgt_mask)
    assert torch.equal(before, after)


def test_state_dict_round_trip_gives_identical_outputs():
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=32, d_ff=64, h=4).eval()
    torch.manual_seed(1)  # a fresh model with different weights
    fresh = tat.make_model(11, 11, N=1, d_model=32, d_ff=64, h=4).eval()
    src = torch.randint(1, 11, (3, 9))
    tgt = torch.randint(1, 11, (3, 6))
    src_mask = torch.ones(3, 1, 9, dtype=torch.bool)
    tgt_mask = tat.subsequent_mask(6)
    with torch.no_grad():
        before = model(src, tgt, src_mask, tgt_mask)
        assert not torch.allclose(fresh(src, tgt, src_mask, tgt_mask), before)
        result = fresh.load_state_dict(model.state_dict(), strict=True)
        after = fresh(src, tgt, src_mask, tgt_mask)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(before, after)


def test_an_older_checkpoint_file_loads_through_the_key_map(tmp_path):
    """load_trained_model renames an older version's keys on the way in."""
    sizes = (len(tat.SPECIALS) + 3, len(tat.SPECIALS) + 4)
    vocabs = [tat.Vocab([*tat.SPECIALS, *"abcd"[: n - 4]]) for n in sizes]
    config = tools.get_config("ci", checkpoint_dir=str(tmp_path))
    torch.manual_seed(0)
    run = tools.TrainingRun(0, 1, sizes, config, False, device="cpu")
    tools.save_run(run, "final.pt", *vocabs)
    ckpt = torch.load(tmp_path / "final.pt", weights_only=True)
    inverse = {tools.rename_old_key(k): k for k in KEYS_2022_N1}
    assert set(inverse) == set(ckpt["model"])  # the ci preset has N=1
    ckpt["model"] = {inverse[k]: v for k, v in ckpt["model"].items()}
    torch.save(ckpt, tmp_path / "old.pt")
    new, *_ = tools.load_trained_model(tmp_path / "final.pt", "cpu")
    old, *_ = tools.load_trained_model(tmp_path / "old.pt", "cpu")
    for (name, a), b in zip(
        new.state_dict().items(), old.state_dict().values()
    ):
        assert torch.equal(a, b), name


def test_the_key_bias_gets_no_gradient():
    """Adding b_k to every key adds q . b_k to a query's every score,
    which softmax ignores: only rounding reaches b_k's gradient."""
    torch.manual_seed(0)
    attn = tat.MultiHeadedAttention(2, 8, dropout=0.0).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    attn(x, x, x, mask=None).square().sum().backward()
    assert attn.w_k.bias.grad.abs().max() < 1e-12
    assert attn.w_q.bias.grad.abs().max() > 1e-3  # the others do get one
