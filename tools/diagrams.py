"""Draw the architecture diagrams of Part 1 as small, hand-laid-out SVG.

    python tools/diagrams.py           # write notebooks/diagrams/*.svg
    python tools/diagrams.py --check   # exit 1 when a file is out of date

Why plain SVG from a small function rather than Graphviz or Vega: the
pictures are fixed stacks of boxes whose order *is* the lesson, so
explicit coordinates say exactly what we mean; there is no layout engine
to install (Graphviz needs a Debian package) and the output is byte-stable,
so a test can regenerate and compare it. Every box names the class or
function that implements it (``data-code``) and the shape it outputs; a
test checks each name against the module. ``tools/export.py`` embeds the
files into the notebooks as markdown attachments, which Jupyter, Colab,
GitHub and the site all display.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "notebooks" / "diagrams"

FONT = "font-family='DejaVu Sans Mono, Menlo, Consolas, monospace'"
COLORS = {
    "embed": "#fde2c8",
    "attn": "#fbd3d3",
    "ffn": "#d6ecfa",
    "norm": "#e8f3d6",
    "io": "#f2f2f2",
    "op": "#ece6f6",
}


@dataclass
class Box:
    """One labelled box: code name on top, output shape below."""

    x: float
    y: float
    w: float
    code: str
    shape: str = ""
    kind: str = "io"
    note: str = ""
    h: float = 40
    ref: bool | None = None  # names code of ours (default: by kind)

    @property
    def top(self):
        return (self.x + self.w / 2, self.y)

    @property
    def bottom(self):
        return (self.x + self.w / 2, self.y + self.h)

    @property
    def left(self):
        return (self.x, self.y + self.h / 2)

    @property
    def right(self):
        return (self.x + self.w, self.y + self.h / 2)

    def svg(self) -> str:
        """The rectangle and its two lines of text."""
        cx = self.x + self.w / 2
        ours = self.ref
        if ours is None:
            ours = self.kind != "io" and not self.code.startswith("nn.")
        tag = f" data-code='{escape(self.code)}'" if ours else ""
        lines = [
            f"<g{tag}>",
            f"<rect x='{self.x}' y='{self.y}' width='{self.w}' "
            f"height='{self.h}' rx='6' fill='{COLORS[self.kind]}' "
            "stroke='#555'/>",
        ]
        label = self.code + (f"  {self.note}" if self.note else "")
        ty = self.y + (16 if self.shape else self.h / 2 + 4)
        lines.append(
            f"<text x='{cx}' y='{ty}' text-anchor='middle' "
            f"font-size='12' font-weight='bold'>{escape(label)}</text>"
        )
        if self.shape:
            lines.append(
                f"<text x='{cx}' y='{self.y + 32}' text-anchor='middle' "
                f"font-size='11' fill='#444'>{escape(self.shape)}</text>"
            )
        return "\n".join(lines + ["</g>"])


def arrow(a, b, via=None) -> str:
    """A line with an arrow head from point a to point b."""
    points = [a, *(via or []), b]
    path = " ".join(f"{x},{y}" for x, y in points)
    return (
        f"<polyline points='{path}' fill='none' stroke='#333' "
        "stroke-width='1.4' marker-end='url(#head)'/>"
    )


def frame(x, y, w, h, label, code) -> str:
    """A dashed frame around a repeated layer, with its repeat count."""
    return (
        f"<g data-code='{code}'>"
        f"<rect x='{x}' y='{y}' width='{w}' height='{h}' rx='10' "
        "fill='none' stroke='#888' stroke-dasharray='5,4'/>\n"
        f"<text x='{x + 8}' y='{y + h - 8}' text-anchor='start' "
        f"font-size='12' fill='#555'>{escape(label)}</text></g>"
    )


def residual(box: Box) -> str:
    """A bypass around a sublayer box, joining at a (+) just above it."""
    cx, side = box.x + box.w / 2, box.x + box.w + 8
    low, high = box.y + box.h + 10, box.y - 12
    path = f"{cx},{low} {side},{low} {side},{high} {cx + 7},{high}"
    return (
        "<g data-code='SublayerConnection'>"
        f"<polyline points='{path}' fill='none' stroke='#333' "
        "stroke-width='1.2'/>\n"
        f"<circle cx='{cx}' cy='{high}' r='7' fill='white' stroke='#333'/>\n"
        f"<text x='{cx}' y='{high + 4}' text-anchor='middle' "
        "font-size='12'>+</text></g>"
    )


def text(x, y, words, size=12, anchor="middle", color="#222") -> str:
    return (
        f"<text x='{x}' y='{y}' text-anchor='{anchor}' font-size='{size}' "
        f"fill='{color}'>{escape(words)}</text>"
    )


def heading(x, width, title, note) -> list[str]:
    """A title line and a grey note under it, centred over `width`."""
    return [
        text(x + width / 2, 40, title, 13),
        text(x + width / 2, 60, note, 10, color="#666"),
    ]


def document(width, height, title, parts) -> str:
    """Wrap drawing parts into a standalone SVG document."""
    head = (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' "
        f"height='{height}' viewBox='0 0 {width} {height}' {FONT}>\n"
        f"<title>{escape(title)}</title>\n"
        "<defs><marker id='head' viewBox='0 0 10 10' refX='9' refY='5' "
        "markerWidth='7' markerHeight='7' orient='auto-start-reverse'>"
        "<path d='M0,0 L10,5 L0,10 z' fill='#333'/></marker></defs>\n"
        f"<rect width='{width}' height='{height}' fill='white'/>\n"
    )
    return head + "\n".join(parts) + "\n</svg>\n"


def transformer_svg() -> str:
    """The encoder-decoder stack, read from the bottom up."""
    W, col = 250, {"enc": 30, "dec": 330}
    enc, dec = col["enc"], col["dec"]
    src = Box(enc, 670, W, "src", "(B, S) token ids")
    src_emb = Box(enc, 605, W, "Embeddings", "(B, S, d_model)", "embed")
    src_pos = Box(enc, 545, W, "PositionalEncoding", "+ sin/cos", "embed")
    enc_attn = Box(
        enc, 420, W, "MultiHeadedAttention", "self: q=k=v=x", "attn"
    )
    enc_ffn = Box(enc, 320, W, "PositionwiseFeedForward", "", "ffn")
    enc_norm = Box(enc, 235, W, "LayerNorm", "final norm", "norm")
    memory = Box(enc, 170, W, "memory", "(B, S, d_model)", "io")

    tgt = Box(dec, 670, W, "tgt", "(B, T) shifted right", "io")
    tgt_emb = Box(dec, 605, W, "Embeddings", "(B, T, d_model)", "embed")
    tgt_pos = Box(dec, 545, W, "PositionalEncoding", "+ sin/cos", "embed")
    self_attn = Box(dec, 440, W, "MultiHeadedAttention", "masked self", "attn")
    src_attn = Box(
        dec, 360, W, "MultiHeadedAttention", "q=x, k=v=memory", "attn"
    )
    dec_ffn = Box(dec, 280, W, "PositionwiseFeedForward", "", "ffn")
    dec_norm = Box(dec, 205, W, "LayerNorm", "final norm", "norm")
    gen = Box(dec, 120, W, "Generator", "(B, T, vocab) log-probs", "op")
    out = Box(dec, 50, W, "next-token scores", "", "io", h=30)
    mask = Box(dec + 40, 730, W - 80, "subsequent_mask", "(1, T, T)", "op")

    boxes = [
        src,
        src_emb,
        src_pos,
        enc_attn,
        enc_ffn,
        enc_norm,
        memory,
        tgt,
        tgt_emb,
        tgt_pos,
        self_attn,
        src_attn,
        dec_ffn,
        dec_norm,
        gen,
        out,
        mask,
    ]
    parts = [
        frame(
            enc - 15,
            300,
            W + 30,
            225,
            "Encoder: N x EncoderLayer",
            "EncoderLayer",
        ),
        frame(
            dec - 15,
            260,
            W + 30,
            265,
            "Decoder: N x DecoderLayer",
            "DecoderLayer",
        ),
        text(enc + W / 2, 30, "EncoderDecoder.encode", 14),
        text(dec + W / 2, 30, "EncoderDecoder.decode", 14),
    ]
    parts += [b.svg() for b in boxes]
    chain = [
        (src, src_emb),
        (src_emb, src_pos),
        (src_pos, enc_attn),
        (enc_attn, enc_ffn),
        (enc_ffn, enc_norm),
        (enc_norm, memory),
        (tgt, tgt_emb),
        (tgt_emb, tgt_pos),
        (tgt_pos, self_attn),
        (self_attn, src_attn),
        (src_attn, dec_ffn),
        (dec_ffn, dec_norm),
        (dec_norm, gen),
        (gen, out),
    ]
    parts += [arrow(a.top, b.bottom) for a, b in chain]
    parts.append(arrow(memory.right, src_attn.left, [(300, 190), (300, 380)]))
    parts.append(arrow(mask.left, self_attn.left, [(318, 750), (318, 460)]))
    for box in (enc_attn, enc_ffn, self_attn, src_attn, dec_ffn):
        parts.append(residual(box))
    parts.append(
        text(
            enc,
            778,
            "(+) SublayerConnection: x + dropout(f(LayerNorm(x)))",
            10,
            "start",
            "#555",
        )
    )
    return document(
        610, 795, "The Transformer, as make_model builds it", parts
    )


def attention_svg() -> str:
    """Scaled dot-product attention, one step per box, bottom up."""
    W, x = 240, 40
    q = Box(x - 20, 470, 95, "Q", "(.., T, d_k)", h=36)
    k = Box(x + 85, 470, 95, "K", "(.., S, d_k)", h=36)
    v = Box(x + 205, 470, 95, "V", "(.., S, d_k)", h=36)
    scores = Box(
        x, 390, W, "attention", "Q K^T : (.., T, S)", "op", note="step 1"
    )
    scale = Box(x, 320, W, "attention", "/ sqrt(d_k)", "op", note="step 2")
    masked = Box(x, 250, W, "attention", "mask: fill min", "op", note="step 3")
    soft = Box(x, 180, W, "attention", "softmax over S", "op", note="step 4")
    out = Box(
        x,
        90,
        W,
        "attention",
        "weights @ V : (.., T, d_k)",
        "op",
        note="step 5",
    )
    parts = [b.svg() for b in (q, k, v, scores, scale, masked, soft, out)]
    parts += [
        arrow(q.top, (x + 80, scores.y + 40)),
        arrow(k.top, (x + 160, scores.y + 40)),
        arrow(scores.top, scale.bottom),
        arrow(scale.top, masked.bottom),
        arrow(masked.top, soft.bottom),
        arrow(soft.top, (x + 80, out.y + 40)),
        arrow(v.top, out.right, [(v.top[0], out.right[1])]),
    ]
    parts += heading(
        x,
        W,
        "attention(query, key, value, mask)",
        "'..' = (B, h) batch and head axes",
    )
    return document(350, 530, "Scaled dot-product attention", parts)


def multihead_svg() -> str:
    """Multi-head attention: project, split, attend per head, merge."""
    x, W = 30, 360
    inputs = [
        Box(x + i * 125, 470, 110, name, "(B, T|S, d)", h=36)
        for i, name in enumerate(("query", "key", "value"))
    ]
    proj = [
        Box(b.x, 400, 110, "nn.Linear", name, "ffn", h=36)
        for name, b in zip(("w_q", "w_k", "w_v"), inputs)
    ]
    split = Box(
        x, 320, W, "MultiHeadedAttention", "split: (B, h, T|S, d_k)", "attn"
    )
    attend = Box(
        x, 240, W, "attention", "every head at once: (B, h, T, d_k)", "op"
    )
    merge = Box(
        x, 160, W, "MultiHeadedAttention", "concat: (B, T, h*d_k)", "attn"
    )
    out = Box(x, 80, W, "nn.Linear", "w_o: (B, T, d_model)", "ffn")
    parts = [b.svg() for b in (*inputs, *proj, split, attend, merge, out)]
    parts += [arrow(a.top, b.bottom) for a, b in zip(inputs, proj)]
    parts += [arrow(p.top, (p.top[0], split.y + 40)) for p in proj]
    parts += [
        arrow(split.top, attend.bottom),
        arrow(attend.top, merge.bottom),
        arrow(merge.top, out.bottom),
    ]
    parts += heading(
        x,
        W,
        "MultiHeadedAttention(h, d_model)",
        "d_k = d_model / h; h heads in one batched call",
    )
    return document(420, 530, "Multi-head attention", parts)


def residual_svg() -> str:
    """Pre-norm (ours) next to post-norm (the paper) residual blocks."""
    layers = {
        "LayerNorm": "norm",
        "sublayer": "attn",
        "nn.Dropout": "op",
        "+": "io",
    }
    columns = (
        (30, "pre-norm (this tutorial)", ("LayerNorm", "sublayer",
                                          "nn.Dropout", "+")),
        (280, "post-norm (the paper)", ("sublayer", "nn.Dropout", "+",
                                        "LayerNorm")),
    )  # fmt: skip
    parts = []
    for x, title, order in columns:
        W = 200
        stack = [Box(x, 380, W, "x", "(B, T, d_model)", h=36)]
        for i, name in enumerate(order):
            narrow = name == "+"
            stack.append(
                Box(
                    x + (W / 2 - 20 if narrow else 0),
                    320 - 62 * i,
                    40 if narrow else W,
                    name,
                    kind=layers[name],
                    h=32,
                    ref=name == "LayerNorm",
                )
            )
        parts += [b.svg() for b in stack]
        parts += [arrow(a.top, b.bottom) for a, b in zip(stack, stack[1:])]
        add = stack[order.index("+") + 1]
        bypass = [(x - 12, stack[0].left[1]), (x - 12, add.left[1])]
        parts.append(arrow(stack[0].left, add.left, bypass))
        parts.append(arrow(stack[-1].top, (stack[-1].top[0], 45)))
        parts.append(text(x + W / 2, 30, title, 13))
    parts.append(
        text(255, 450, "SublayerConnection implements the left one", 11,
             color="#555")
    )  # fmt: skip
    return document(510, 470, "Residual blocks, pre-norm and post-norm", parts)


DIAGRAMS = {
    "transformer.svg": transformer_svg,
    "attention.svg": attention_svg,
    "multihead.svg": multihead_svg,
    "residual.svg": residual_svg,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a file is out of date",
    )
    args = parser.parse_args(argv)
    FOLDER.mkdir(parents=True, exist_ok=True)
    stale = []
    for name, draw in DIAGRAMS.items():
        path, svg = FOLDER / name, draw()
        if path.exists() and path.read_text() == svg:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(svg)
    if args.check and stale:
        print(
            "diagrams out of date (run tools/diagrams.py): " + ", ".join(stale)
        )
        return 1
    print(f"updated: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
