"""Which source attention finds the German word behind an English <unk>?

    python bench/unk_alignment.py                       # validation set
    python bench/unk_alignment.py --split test

Translates a Multi30k split greedily with a word model and replaces each
``<unk>`` by the German word that a choice of source attention points at:
each decoder layer alone, and the mean over all layers (the default of
``source_alignment``), always averaged over heads. There are no gold word
alignments for Multi30k, so two proxies are printed for each choice:

- how often the copied German word is itself outside the German
  vocabulary: the model writes ``<unk>`` mostly for rare words, so a good
  aligner mostly lands on a rare German word;
- how often the copied word appears in the English reference.

BLEU (cased sacreBLEU) is printed too. The layer is chosen on the
validation set; the test set only reports.
"""

import argparse
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402

plain_alignment = tools.source_alignment  # before main() swaps it


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--checkpoint", default="checkpoints/cpu/final.pt")
    parser.add_argument("--split", default="val", choices=("val", "test"))
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def alignment_from(layers):
    """A source_alignment that averages the given decoder layers."""
    return functools.partial(plain_alignment, layers=layers)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, vocab_src, vocab_tgt, _ = tools.load_trained_model(
        args.checkpoint, "cpu"
    )
    spacy_de, _ = tat.load_tokenizers()
    pairs = tat.read_multi30k(args.split)
    sources = [de for de, _ in pairs]
    reference_of = {
        tuple(tat.tokenize(de, spacy_de)): en.split() for de, en in pairs
    }
    copies = []  # (copied word, its sentence's reference words)
    plain_replace = tools.replace_unknowns

    def recording_replace(ids, aligned, src_words, vocab):
        tokens = plain_replace(ids, aligned, src_words, vocab)
        for k, token_id in enumerate(ids):
            if token_id == tat.UNK:
                copies.append((tokens[k], reference_of[tuple(src_words)]))
        return tokens

    tools.replace_unknowns = recording_replace
    n = len(model.decoder.layers)
    choices = [(f"layer {i + 1} of {n}", [i]) for i in range(n)]
    choices.append((f"mean of all {n} layers (default)", list(range(n))))
    print(f"{args.checkpoint}, {args.split}: {len(pairs)} sentences")
    print("| source attention | <unk> | copied word outside the German "
          "vocabulary | copied word in the reference | BLEU |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for name, layers in choices:
        tools.source_alignment = alignment_from(layers)
        copies.clear()
        hyps = tools.translate_batch(
            model, sources, spacy_de, vocab_src, vocab_tgt
        )
        bleu = tools.compute_bleu(hyps, [en for _, en in pairs]).score
        rare = sum(vocab_src([w])[0] == tat.UNK for w, _ in copies)
        in_ref = sum(w in ref for w, ref in copies)
        share = f"{rare} ({rare / max(len(copies), 1):.0%})"
        print(f"| {name} | {len(copies)} | {share} | {in_ref} | {bleu:.2f} |")


if __name__ == "__main__":
    main()
