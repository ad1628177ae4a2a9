"""Sequence-level knowledge distillation: teach one model an ensemble's output.

Several trained models, decoding together with beam search
(`ensemble.py`), translate every German sentence of the training split.
Their English becomes the training target of a new model, the student,
of the same size as each of them (Kim & Rush, 2016, "Sequence-Level
Knowledge Distillation"). The student learns from output that is more
regular than human references. Here it gained on validation, not on
test2016 (docs/results.md, "One model taught by four").

    python bench/distill.py --run runs/recipe_sweep/a:3 --run runs/b:3 \\
        --beam 4 --alpha 1.0 --out data/distilled
    python annotated_transformer_tools.py train --data data/distilled

OUT is a Multi30k folder: `train.de.gz` holds the original German,
`train.en.gz` the ensemble's English (in `--mix-out`'s folder, the
original pairs follow the distilled ones), and the validation and test
files are copied unchanged, so a student is chosen and scored on the
human references.
Only the training split is translated: the test set is never read.
OUT/distill.json records the command, the members, the hardware and the
time. The student keeps the teachers' vocabularies: `train --data`
reads the word vocabularies cached in data/vocab.json, built from the
original training split, and this script refuses to run if they differ
from the teachers'.
"""

import argparse
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ensemble import (  # noqa: E402
    add_run_option,
    ensemble_decoder,
    load_members,
    member_name,
)

import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402

CHUNK = 512  # sentences translated between two updates of the progress bar


def parse_args(argv=None):
    parser = tools.OneLineParser(
        prog="distill.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_option(parser, "a teacher: a word-level run")
    parser.add_argument("--beam", type=tools.count(most=1000), default=4)
    parser.add_argument(
        "--alpha", type=tools.number_from(0.0, 10.0), default=1.0
    )
    parser.add_argument(
        "--mix-out",
        type=Path,
        metavar="FOLDER",
        help="also write this folder, whose training pairs are the distilled"
        " ones followed by the original ones (twice the pairs an epoch)",
    )
    parser.add_argument(
        "--n", type=tools.count(least=0), default=0, help="first N (0: all)"
    )
    parser.add_argument("--threads", type=tools.count(most=1024))
    parser.add_argument("--out", default="data/distilled", help="a folder")
    args = parser.parse_args(argv)
    args.out = Path(args.out)
    for option, folder in (("--out", args.out), ("--mix-out", args.mix_out)):
        if folder is not None and folder.exists() and not folder.is_dir():
            parser.error(f"{option} {folder} is not a folder")
    if args.mix_out and args.mix_out.resolve() == args.out.resolve():
        parser.error("--mix-out must be another folder than --out")
    return args


def teachers(runs):
    """(models, vocab_src, vocab_tgt) of word-level runs."""
    models, vocab_src, vocab_tgt = load_members(runs)
    if tools.is_subword(vocab_src):
        raise tools.UserError("distill.py takes word-level runs, not BPE")
    return models, vocab_src, vocab_tgt


def check_student_vocab(vocab_src, vocab_tgt, spacy_de, spacy_en):
    """Refuse teachers whose vocabularies `train` would not give a student."""
    cached = tools.load_vocab(spacy_de, spacy_en)  # the original train split
    if cached != (vocab_src, vocab_tgt):
        raise tools.UserError(
            "the teachers' vocabularies are not data/vocab.json's, which a"
            " student would train with"
        )


def translate(models, vocabs, sentences, beam, alpha, spacy_de):
    """The ensemble's English for each German sentence, with progress."""
    from tqdm import tqdm

    decode = ensemble_decoder(models, beam, alpha)
    english = []
    with tqdm(total=len(sentences), unit="sent", desc="distilling") as bar:
        for start in range(0, len(sentences), CHUNK):
            chunk = sentences[start : start + CHUNK]
            english += tools.translate_batch(
                models[0],
                chunk,
                spacy_de,
                *vocabs,
                decode_fn=decode,
            )
            bar.update(len(chunk))
    return english


def write_lines(path, lines):
    """One sentence a line, gzipped, written whole or not at all."""
    text = "".join(f"{line}\n" for line in lines)
    with tools.atomic_write(path, "wb") as f:
        f.write(gzip.compress(text.encode("utf-8"), mtime=0))


def write_folder(out, source, pairs, english, mix):
    """OUT as a Multi30k folder whose training English is `english`, the
    validation and test files copied from `source`; returns its pairs."""
    german = [de for de, _ in pairs]
    if mix:  # the distilled pairs, then the original ones
        german, english = german * 2, english + [en for _, en in pairs]
    write_lines(Path(out, "train.de.gz"), german)
    write_lines(Path(out, "train.en.gz"), english)
    for split in ("val", "test"):
        for lang in ("de", "en"):
            path = tat.split_file(source, split, lang)
            shutil.copyfile(path, Path(out, path.name))
    return len(german)


def check_folders(source, *folders):
    """Refuse to write over Multi30k itself or over an earlier training
    set (a distillation takes long to redo)."""
    originals = {source.resolve(), (tools.data_dir() / "multi30k").resolve()}
    for folder in filter(None, folders):
        if Path(folder).resolve() in originals:
            raise tools.UserError(
                f"{folder} holds the original Multi30k: write elsewhere"
            )
        if list(Path(folder).glob("train.*.gz")):
            raise tools.UserError(
                f"{folder} holds a training set already: remove it, or"
                " choose another folder"
            )


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        source = Path(tools.download_multi30k())  # Multi30k, checked
        check_folders(source, args.out, args.mix_out)
        began = time.perf_counter()
        models, vocab_src, vocab_tgt = teachers(args.run)
        spacy_de, spacy_en = tat.load_tokenizers()
        check_student_vocab(vocab_src, vocab_tgt, spacy_de, spacy_en)
        pairs = tat.read_multi30k("train", root=source)[: args.n or None]
        english = translate(
            models,
            (vocab_src, vocab_tgt),
            [de for de, _ in pairs],
            args.beam,
            args.alpha,
            spacy_de,
        )
        written = {
            args.out: write_folder(args.out, source, pairs, english, mix=False)
        }
        if args.mix_out:
            written[args.mix_out] = write_folder(
                args.mix_out, source, pairs, english, mix=True
            )
    except (tools.UserError, tat.DatasetError) as err:
        raise SystemExit(f"distill.py: error: {err}") from None
    record = {
        "command": "python bench/distill.py " + " ".join(sys.argv[1:]),
        "teachers": [member_name(folder, k) for folder, k in args.run],
        "runs": [f"{folder}:{k}" for folder, k in args.run],
        "beam": args.beam,
        "alpha": args.alpha,
        "sentences_translated": len(pairs),
        "hardware": tools.hardware_summary(),
        "seconds": round(time.perf_counter() - began, 1),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
    for folder, n_pairs in written.items():
        record |= {"folder": str(folder), "pairs": n_pairs}
        with tools.atomic_write(folder / "distill.json", "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")
        print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
