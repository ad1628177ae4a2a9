#!/usr/bin/env bash
# Build .dev/, what bench/gpu_check.sh needs on a lent GPU machine that has
# torch but none of spaCy, altair, Jupyter or nbmake, and no network:
#   .dev/site.tar.xz  those packages for its Python 3.12, the versions in
#                     .venv, unpacked there into /tmp/devsite (about 46 MB;
#                     spaCy's tests and every __pycache__ left out);
#   .dev/stub/        a stand-in for vl-convert-python (33 MB, too large to
#                     travel beside spaCy): charts render as empty files;
#   .dev/multi30k/    the data, from $MULTI30K_DIR.
# Then, with the device tool (carry: .dev data/vocab.json data/bpe.json):
#   tar -xJf .dev/site.tar.xz -C /tmp &&
#   export PYTHONPATH=/tmp/devsite:$PWD/.dev/stub:$PWD \
#          MULTI30K_DIR=$PWD/.dev/multi30k && bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MULTI30K_DIR:?set MULTI30K_DIR to the Multi30k folder}"
grep -qx "/.dev/" .git/info/exclude 2>/dev/null || echo "/.dev/" >>.git/info/exclude
PACKAGES="spacy spacy-legacy spacy-loggers thinc blis cymem preshed murmurhash
srsly wasabi catalogue weasel confection cloudpathlib smart-open pydantic
pydantic-core annotated-types typing-inspection altair jsonschema
jsonschema-specifications referencing rpds-py nbmake nbclient nbformat
fastjsonschema jupyter-client jupyter-core traitlets platformdirs ipykernel
ipython ipython-pygments-lexers comm debugpy matplotlib-inline nest-asyncio2
pyzmq tornado jedi parso prompt-toolkit wcwidth pexpect ptyprocess stack-data
asttokens executing pure-eval jupytext mdit-py-plugins"
pins=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null)
specs=()
for p in $PACKAGES; do  # the version in .venv
  specs+=("$(grep -i -m1 "^${p//-/[-_]}==" <<<"$pins")")
done
site=$(mktemp -d)/devsite
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
  manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${tag}_x86_64")
done
.venv/bin/python -m pip install -q --no-deps --target "$site" \
  --python-version 3.12 --implementation cp --only-binary=:all: \
  "${platforms[@]}" "${specs[@]}"
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -rf "$site"/{spacy,thinc,blis,srsly}/tests
mkdir -p .dev
tar -cJf .dev/site.tar.xz -C "$(dirname "$site")" devsite
[[ -d .dev/multi30k ]] && chmod -R u+w .dev/multi30k  # a read-only copy
rm -rf .dev/stub .dev/multi30k
cp -r bench/gpu_stub .dev/stub
cp -r "$MULTI30K_DIR" .dev/multi30k
chmod -R u+w .dev/multi30k
du -sh .dev
