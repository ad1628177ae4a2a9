#!/usr/bin/env bash
# Build .dev/, what bench/gpu_check.sh needs on a lent GPU machine that has
# torch but none of spaCy, altair, Jupyter or nbmake, and no network:
#   .dev/site.tar.xz  those packages for its Python 3.12, the versions in
#                     .venv, unpacked there into /tmp/devsite (about 46 MB;
#                     spaCy's tests and every __pycache__ left out). ruff
#                     and nbconvert stay behind: the device tool carries 64
#                     MB at most, so the tests that need them fail there;
#   .dev/multi30k/    the data, from $MULTI30K_DIR.
# vl-convert-python (33 MB) does not fit either: bench/gpu_stub/ stands in
# for it and renders every chart as an empty file. Then, with the device
# tool (carry: .dev data/vocab.json data/bpe.json):
#   tar -xJf .dev/site.tar.xz -C /tmp &&
#   export PYTHONPATH=/tmp/devsite:$PWD/bench/gpu_stub:$PWD \
#          MULTI30K_DIR=$PWD/.dev/multi30k && bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MULTI30K_DIR:?set MULTI30K_DIR to the Multi30k folder}"
[[ -x .venv/bin/python ]] || { echo "no .venv: run make setup" >&2; exit 1; }
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx "/.dev/" "$exclude" 2>/dev/null || echo "/.dev/" >>"$exclude"
PACKAGES="spacy spacy-legacy spacy-loggers thinc blis cymem preshed murmurhash
srsly wasabi catalogue weasel confection cloudpathlib smart-open pydantic
pydantic-core annotated-types typing-inspection altair jsonschema
jsonschema-specifications referencing rpds-py nbmake nbclient nbformat
fastjsonschema jupyter-client jupyter-core traitlets platformdirs ipykernel
ipython ipython-pygments-lexers comm debugpy matplotlib-inline nest-asyncio2
pyzmq tornado jedi parso prompt-toolkit wcwidth pexpect ptyprocess stack-data
asttokens executing pure-eval jupytext mdit-py-plugins"
pins=$(.venv/bin/python -m pip list --format=freeze)
specs=()
for p in $PACKAGES; do # the version in .venv
  spec=$(grep -i -m1 "^${p//-/[-_]}==" <<<"$pins") ||
    { echo "$p is not in .venv" >&2; exit 1; }
  specs+=("$spec")
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
  manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${tag}_x86_64")
done
.venv/bin/python -m pip install -q --no-deps --target "$work/devsite" \
  --python-version 3.12 --implementation cp --only-binary=:all: \
  "${platforms[@]}" "${specs[@]}"
find "$work/devsite" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -rf "$work"/devsite/{spacy,thinc,blis,srsly}/tests
mkdir -p .dev
tar -cJf .dev/site.tar.xz -C "$work" devsite
[[ -d .dev/multi30k ]] && chmod -R u+w .dev/multi30k # a read-only copy
rm -rf .dev/multi30k
cp -r "$MULTI30K_DIR" .dev/multi30k
chmod -R u+w .dev/multi30k
du -sh .dev
