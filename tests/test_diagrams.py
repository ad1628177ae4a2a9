"""The architecture diagrams: up to date, well-formed, naming real code,
and carried inside the notebooks that show them."""

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import the_annotated_transformer as tat

ROOT = Path(__file__).resolve().parent.parent
DIAGRAMS = ROOT / "notebooks" / "diagrams"
CORE = {
    "Embeddings",
    "PositionalEncoding",
    "EncoderLayer",
    "DecoderLayer",
    "SublayerConnection",
    "MultiHeadedAttention",
    "PositionwiseFeedForward",
    "LayerNorm",
    "Generator",
    "subsequent_mask",
}


def code_names(svg_text):
    """Every ``data-code`` name in a drawing."""
    root = ET.fromstring(svg_text)
    return {el.get("data-code") for el in root.iter() if el.get("data-code")}


def missing_from_module(names):
    return sorted(n for n in names if not hasattr(tat, n))


def svg_files():
    files = sorted(DIAGRAMS.glob("*.svg"))
    assert len(files) >= 3
    return files


def test_diagrams_are_up_to_date():
    proc = subprocess.run(
        [sys.executable, "tools/diagrams.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", svg_files(), ids=lambda p: p.name)
def test_every_named_box_is_real_code(path):
    names = code_names(path.read_text())
    assert names, f"{path.name} names no code"
    assert missing_from_module(names) == []


def test_the_check_catches_a_renamed_class():
    drawing = (
        "<svg xmlns='http://www.w3.org/2000/svg'><g data-code='Old'/></svg>"
    )
    assert missing_from_module(code_names(drawing)) == ["Old"]


def test_the_stack_diagram_shows_every_part_of_the_model():
    names = code_names((DIAGRAMS / "transformer.svg").read_text())
    assert CORE <= names, CORE - names
    # ... and every part of the model is a module the stack really builds.
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    built = {type(m).__name__ for m in model.modules()}
    classes = {n for n in CORE if n[0].isupper()}
    assert classes <= built, classes - built


def test_notebooks_carry_the_diagrams_they_show():
    shown = 0
    for ipynb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(ipynb.read_text())["cells"]
        for cell in cells:
            if cell["cell_type"] != "markdown":
                continue
            text = "".join(cell["source"])
            for name in re.findall(r"\(attachment:([\w.-]+\.svg)\)", text):
                shown += 1
                data = cell["attachments"][name]["image/svg+xml"]
                assert data, name
    assert shown >= 3


@pytest.mark.parametrize("path", svg_files(), ids=lambda p: p.name)
def test_no_label_says_a_word_twice_in_a_row(path):
    root = ET.fromstring(path.read_text())
    labels = [el.text or "" for el in root.iter() if el.tag.endswith("text")]
    assert labels
    doubled = [t for t in labels if re.search(r"\b(\w+) \1\b", t)]
    assert doubled == [], doubled
