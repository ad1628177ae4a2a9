# The Annotated Transformer, done right.
#   make notebook  - set up, then execute every notebook (the main job)
#   make check     - set up, then run every test (what .ci/run runs)
SHELL := /bin/bash
PY := .venv/bin/python
# The Python that makes .venv: python3 when it is 3.10 or later, else the
# first such python3.X on the PATH (a Mac's python3 is often Apple's 3.9,
# for which there is no torch 2.13). Override with `make PYTHON=...`.
NEW_ENOUGH := -c 'import sys; sys.exit(sys.version_info < (3, 10))'
PYTHON ?= $(shell for p in python3 python3.12 python3.11 python3.13 \
  python3.10; do $$p $(NEW_ENOUGH) 2>/dev/null && { echo $$p; break; }; \
  done)
PIP := .venv/bin/python -m pip
# torch is installed first and pinned, so that a CPU-only machine with a local
# wheel installs in seconds and a GPU machine gets the matching CUDA build.
# Override with `make setup TORCH_SPEC="torch>=2.4"`. On Linux, PyPI's torch
# is the CUDA build (several GB): without an NVIDIA GPU, and unless pip has
# package sources of its own configured, tools/torch_index.py picks the CPU
# build's index instead. `make setup TORCH_INDEX=URL` names an index, and
# `TORCH_INDEX=` (empty) keeps pip's own.
TORCH_SPEC ?= torch==2.13.0
ifeq ($(origin TORCH_INDEX),undefined)
TORCH_INDEX_CHOICE = $$($(PY) tools/torch_index.py)
else
TORCH_INDEX_CHOICE = $(TORCH_INDEX)
endif
# Notebook size: "ci" runs every notebook in minutes, "full" does real runs.
AT_SIZE ?= full
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.py))

.PHONY: all setup notebook export check-sync test notebook-test lint format \
        html site-test site browser bench train check clean help

all: check

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' Makefile | sed 's/:.*## /\t/'

setup: .venv/.installed  ## create .venv with every dependency

.venv/.installed: requirements.txt
	@{ test -n "$(PYTHON)" && $(PYTHON) $(NEW_ENOUGH); } 2>/dev/null || { \
	  echo "make: no Python 3.10 or later on the PATH (python3 is" \
	  "$$(python3 --version 2>&1)): install one, from python.org or" \
	  "Homebrew (python@3.12), or name one with PYTHON=, then run make" \
	  "again" >&2; exit 2; }
	@test ! -x $(PY) || $(PY) $(NEW_ENOUGH) || { echo "make: .venv has" \
	  "$$($(PY) --version 2>&1), older than 3.10: remove it (rm -rf" \
	  ".venv) and run your make command again" >&2; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv .venv
	index="$(TORCH_INDEX_CHOICE)" && \
	  $(PIP) install --quiet $${index:+--index-url "$$index"} "$(TORCH_SPEC)"
	$(PIP) install --quiet -r requirements.txt
	touch $@

# The .ipynb twins carry the diagrams; they run in notebooks/, as in Jupyter.
# Jupyter's own messages (a kernel's warnings, what processes that a
# notebook starts print) go to runs/notebooks/NAME.log, shown on failure.
# Notebook 03 trains the translator, printing only into the notebook: a
# watcher (tools/watch_epochs.py) prints a line as each epoch is saved.
notebook: setup  ## execute every notebook into runs/notebooks/, full size (AT_SIZE=ci: minutes)
	@mkdir -p runs/notebooks
	@echo "running the notebooks into runs/notebooks/ (AT_SIZE=$(AT_SIZE))"
	@for nb in $(NOTEBOOKS:.py=.ipynb); do \
	  start=$$(date +%s); watcher=; \
	  echo "$$nb: running..."; \
	  case "$$nb:$(AT_SIZE)" in *03_multi30k.ipynb:full) \
	    if ! test -f checkpoints/quick/final.pt; then \
	      echo "  it trains the translator: 7 to 22 minutes on the" \
	        "2-core CPUs measured, less on a GPU"; \
	      $(PY) tools/watch_epochs.py checkpoints/quick \
	        --while-running $$$$ & watcher=$$!; \
	    fi;; \
	  esac; \
	  log=runs/notebooks/$$(basename $$nb .ipynb).log; \
	  AT_SIZE=$(AT_SIZE) $(PY) -m jupytext -q --to ipynb --execute \
	    --run-path notebooks --output runs/notebooks/$$(basename $$nb) \
	    $$nb 2> $$log; status=$$?; \
	  test -z "$$watcher" || { kill $$watcher; wait $$watcher; } 2>/dev/null; \
	  if [ $$status -ne 0 ]; then cat $$log; \
	    echo "$$nb failed (log: $$log)"; exit 1; fi; \
	  echo "$$nb: $$(( $$(date +%s) - start )) s"; \
	done

export: setup  ## regenerate both modules and the .ipynb pairs
	$(PY) tools/export.py

check-sync: setup  ## fail when a module or an .ipynb drifted from its .py
	$(PY) tools/export.py --check

test: setup  ## the unit tests alone (the sync check among them)
	$(PY) -m pytest -q tests --ignore=tests/test_site.py

notebook-test: setup  ## run every notebook with nbmake, CI-sized
	AT_SIZE=ci $(PY) -m pytest -q --nbmake --nbmake-timeout=1500 \
	  $(NOTEBOOKS:.py=.ipynb)

lint: setup  ## ruff check and format check (the modules included)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup  ## format the .py sources, then regenerate
	$(PY) -m ruff format notebooks tools tests bench
	$(PY) tools/export.py

bench: setup  ## speed benchmarks (prints medians and ratios)
	$(PY) bench/copy_task.py
	$(PY) bench/batching.py
	$(PY) bench/decoding.py
	$(PY) bench/efficiency.py

train: setup  ## train the cpu and cpu-bpe presets; summaries and test BLEU into runs/
	$(PY) annotated_transformer_tools.py train --preset cpu \
	  --results runs/multi30k_cpu.json
	$(PY) annotated_transformer_tools.py train --preset cpu-bpe \
	  --results runs/multi30k_cpu-bpe.json

# Debian's chromium, for the site test (root, or sudo, for apt-get).
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo)

browser:  ## install Debian's chromium when /usr/bin/chromium is missing
	@test -x /usr/bin/chromium || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
	    chromium >/dev/null; }

html: setup  ## execute every notebook CI-sized, once, and render site/
	$(PY) tools/build_site.py --size ci

site-test: setup  ## open every page of site/ in headless Chromium
	$(PY) -m pytest -q tests/test_site.py

site: setup  ## full-size site in site-full/, from the checkpoints of `make train`
	$(PY) tools/build_site.py --size full --out site-full --runs runs/site-full
	AT_SITE=site-full $(PY) -m pytest -q tests/test_site.py
	# the README's picture of the trained model, when there is one
	test ! -f checkpoints/cpu/final.pt || \
	  cp figures/04_decoder_source.png docs/trained_attention.png

# `html` is the notebook test of `check`: it executes every notebook once and
# stops on the first failing cell, naming the notebook and the cell.
# `notebook-test` runs the same notebooks under nbmake, for use on its own.
check: test html site-test  ## everything CI runs

clean:  ## remove runs/ (make train's results too), the sites and test output; keeps .venv, data, checkpoints
	rm -rf runs site site-full test-output .pytest_cache
