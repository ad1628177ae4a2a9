"""The whole model against PyTorch's own Transformer, with copied weights.

Our layers and torch.nn's are written independently; both are pre-norm
(norm_first=True), normalize with the biased variance and eps=1e-6 inside
the square root, and use ReLU. With the same weights, dropout off and the
same masks (translated to torch's "True means blocked" convention), the
outputs must agree to float64 round-off. Our LayerNorm computes exactly
torch's formula (tests/test_model.py checks it against F.layer_norm), so
no normalization had to be substituted in the reference.
"""

import math

import pytest
import torch
from torch import nn

import the_annotated_transformer as tat

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # nn.Transformer says it cannot use nested tensors when norm_first.
    pytest.mark.filterwarnings("ignore:enable_nested_tensor:UserWarning"),
]
D_MODEL, H, D_FF, N = 32, 4, 64, 2
TIGHT = dict(rtol=1e-10, atol=1e-12)  # float64: round-off only


# ------------------------------------------------------ copying the weights
def copy_attention(ours, ref):
    """MultiHeadedAttention's four projections into nn.MultiheadAttention."""
    q, k, v, out = ours.w_q, ours.w_k, ours.w_v, ours.w_o
    ref.in_proj_weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
    ref.in_proj_bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
    ref.out_proj.weight.copy_(out.weight)
    ref.out_proj.bias.copy_(out.bias)


def copy_norm(ours, ref):
    """Our LayerNorm's gain a_2 and bias b_2 into nn.LayerNorm."""
    assert ref.eps == ours.eps
    ref.weight.copy_(ours.a_2)
    ref.bias.copy_(ours.b_2)


def copy_feed_forward(ours, ref_layer):
    """PositionwiseFeedForward's w_1, w_2 into linear1, linear2."""
    for mine, theirs in [
        (ours.w_1, ref_layer.linear1),
        (ours.w_2, ref_layer.linear2),
    ]:
        theirs.weight.copy_(mine.weight)
        theirs.bias.copy_(mine.bias)


@torch.no_grad()
def copy_encoder_layer(ours, ref):
    """EncoderLayer into nn.TransformerEncoderLayer (norm1, norm2)."""
    copy_attention(ours.self_attn, ref.self_attn)
    copy_feed_forward(ours.feed_forward, ref)
    copy_norm(ours.self_attn_block.norm, ref.norm1)
    copy_norm(ours.ff_block.norm, ref.norm2)


@torch.no_grad()
def copy_decoder_layer(ours, ref):
    """DecoderLayer into nn.TransformerDecoderLayer (norm1..norm3)."""
    copy_attention(ours.self_attn, ref.self_attn)
    copy_attention(ours.src_attn, ref.multihead_attn)
    copy_feed_forward(ours.feed_forward, ref)
    copy_norm(ours.self_attn_block.norm, ref.norm1)
    copy_norm(ours.src_attn_block.norm, ref.norm2)
    copy_norm(ours.ff_block.norm, ref.norm3)


@torch.no_grad()
def copy_transformer(ours, ref):
    """make_model's two stacks and final norms into nn.Transformer."""
    for mine, theirs in zip(ours.encoder.layers, ref.encoder.layers):
        copy_encoder_layer(mine, theirs)
    for mine, theirs in zip(ours.decoder.layers, ref.decoder.layers):
        copy_decoder_layer(mine, theirs)
    copy_norm(ours.encoder.norm, ref.encoder.norm)
    copy_norm(ours.decoder.norm, ref.decoder.norm)


# ------------------------------------------------------------ the references
def torch_kwargs(norm_first=True):
    """The settings under which torch.nn computes what our model does."""
    return dict(
        d_model=D_MODEL,
        nhead=H,
        dim_feedforward=D_FF,
        dropout=0.0,
        activation="relu",
        layer_norm_eps=1e-6,
        batch_first=True,
        norm_first=norm_first,
        dtype=torch.float64,
    )


def randomize(module, seed):
    """Random weights everywhere, so that copying a norm's gain matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return module


def padded(lengths, T):
    """(B, T) bool, True on real tokens, False on the padding at the end."""
    return torch.arange(T) < torch.tensor(lengths)[:, None]


def causal_block(T):
    """(T, T) bool for torch: True above the diagonal, the blocked keys."""
    return torch.ones(T, T, dtype=torch.bool).triu(1)


def reference_positions(T, d):
    """The paper's sinusoids in a double loop, (T, d) float64."""
    pe = torch.empty(T, d, dtype=torch.float64)
    for pos in range(T):
        for i in range(0, d, 2):
            angle = pos / 10000 ** (i / d)
            pe[pos, i], pe[pos, i + 1] = math.sin(angle), math.cos(angle)
    return pe


# ---------------------------------------------------------------- the tests
@pytest.fixture(autouse=True)
def float64():
    """Build everything in float64, so the tolerance is round-off only."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def our_layers():
    """One fresh EncoderLayer and DecoderLayer, eval mode, random weights."""
    attn = lambda: tat.MultiHeadedAttention(H, D_MODEL, dropout=0.0)  # noqa
    ff = lambda: tat.PositionwiseFeedForward(D_MODEL, D_FF, 0.0)  # noqa
    enc = tat.EncoderLayer(D_MODEL, attn(), ff(), 0.0)
    dec = tat.DecoderLayer(D_MODEL, attn(), attn(), ff(), 0.0)
    return randomize(enc, 1).eval(), randomize(dec, 2).eval()


@pytest.mark.parametrize("store_attention", [False, True])
def test_encoder_layer_matches_torch(store_attention):
    enc, _ = our_layers()
    enc.self_attn.store_attention = store_attention  # explicit or fused
    ref = nn.TransformerEncoderLayer(**torch_kwargs()).eval()
    copy_encoder_layer(enc, ref)
    torch.manual_seed(3)
    x = torch.randn(3, 7, D_MODEL)
    keep = padded([7, 5, 2], 7)  # (B, S)
    ours = enc(x, keep[:, None, :])  # our mask: (B, 1, S), True = attend
    theirs = ref(x, src_key_padding_mask=~keep)
    torch.testing.assert_close(ours, theirs, **TIGHT)


@pytest.mark.parametrize("store_attention", [False, True])
def test_decoder_layer_matches_torch(store_attention):
    _, dec = our_layers()
    dec.self_attn.store_attention = store_attention
    dec.src_attn.store_attention = store_attention
    ref = nn.TransformerDecoderLayer(**torch_kwargs()).eval()
    copy_decoder_layer(dec, ref)
    torch.manual_seed(4)
    x = torch.randn(3, 6, D_MODEL)
    memory = torch.randn(3, 7, D_MODEL)
    keep = padded([7, 4, 1], 7)
    ours = dec(x, memory, keep[:, None, :], tat.subsequent_mask(6))
    theirs = ref(
        x,
        memory,
        tgt_mask=causal_block(6),
        memory_key_padding_mask=~keep,
    )
    torch.testing.assert_close(ours, theirs, **TIGHT)


def model_and_reference(V=13):
    """make_model with random weights and nn.Transformer holding copies."""
    torch.manual_seed(0)
    model = tat.make_model(V, V, N=N, d_model=D_MODEL, d_ff=D_FF, h=H)
    model = randomize(model, 5).eval()
    ref = nn.Transformer(
        num_encoder_layers=N, num_decoder_layers=N, **torch_kwargs()
    ).eval()
    copy_transformer(model, ref)
    return model, ref


def test_whole_model_matches_torch_transformer():
    V, pad = 13, 2
    model, ref = model_and_reference(V)
    src = torch.tensor([[5, 6, 7, 8, 9, 10], [4, 11, 12, pad, pad, pad]])
    tgt = torch.tensor([[0, 5, 6, 7, 8], [0, 4, 9, pad, pad]])
    batch = tat.Batch(src, tgt, pad=pad)  # our masks, from the tokens
    log_probs = model.generator(
        model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    )  # (B, T, V)

    # The reference: embeddings by hand, torch's stacks, masks by hand.
    # The sinusoids are rounded to the dtype the model stores its buffer
    # in (float32 keeps the checkpoint format), then added in float64.
    pe_dtype = model.src_embed[1].pe.dtype

    def embed(ids, table):
        scaled = table.weight[ids] * math.sqrt(D_MODEL)
        positions = reference_positions(ids.size(1), D_MODEL)
        return scaled + positions.to(pe_dtype).double()

    src_keep, tgt_in = src != pad, tgt[:, :-1]
    hidden = ref(
        embed(src, model.src_embed[0].lut),
        embed(tgt_in, model.tgt_embed[0].lut),
        tgt_mask=causal_block(tgt_in.size(1)),
        src_key_padding_mask=~src_keep,
        tgt_key_padding_mask=tgt_in == pad,
        memory_key_padding_mask=~src_keep,
    )
    proj = model.generator.proj
    expected = torch.log_softmax(hidden @ proj.weight.T + proj.bias, dim=-1)
    torch.testing.assert_close(log_probs, expected, rtol=1e-9, atol=1e-10)


def test_encode_and_decode_match_torch_stacks():
    model, ref = model_and_reference()
    torch.manual_seed(6)
    x, y = torch.randn(2, 8, D_MODEL), torch.randn(2, 5, D_MODEL)
    keep = padded([8, 3], 8)
    memory = model.encoder(x, keep[:, None, :])
    ref_memory = ref.encoder(x, src_key_padding_mask=~keep)
    torch.testing.assert_close(memory, ref_memory, **TIGHT)
    out = model.decoder(y, memory, keep[:, None, :], tat.subsequent_mask(5))
    ref_out = ref.decoder(
        y,
        ref_memory,
        tgt_mask=causal_block(5),
        memory_key_padding_mask=~keep,
    )
    torch.testing.assert_close(out, ref_out, **TIGHT)


def test_float32_model_matches_within_float32_round_off():
    model, ref = model_and_reference()
    model, ref = model.float(), ref.float()
    torch.manual_seed(7)
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float32)
    keep = padded([6, 2], 6)
    torch.testing.assert_close(
        model.encoder(x, keep[:, None, :]),
        ref.encoder(x, src_key_padding_mask=~keep),
    )  # default float32 tolerances: rtol 1.3e-6, atol 1e-5


def test_post_norm_reference_does_not_match():
    # A check on the check: the comparison notices a different layout.
    enc, _ = our_layers()
    ref = nn.TransformerEncoderLayer(**torch_kwargs(norm_first=False))
    copy_encoder_layer(enc, ref.eval())
    x = torch.randn(2, 5, D_MODEL)
    mask = torch.ones(2, 1, 5, dtype=torch.bool)
    gap = (enc(x, mask) - ref(x)).abs().max()
    assert gap > 0.1
