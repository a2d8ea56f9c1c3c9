# fate_lab task runner. Every target is idempotent and fast on a second run; `make` lists them.
# CPU machines get torch==2.13.0; on a GPU machine run `make setup TORCH=` after installing
# your CUDA torch into .venv (see README). Elsewhere, `make setup TORCH_INDEX=<url>` takes torch
# from that index, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU-only build.
# constraints.txt pins the versions CI tested (CONSTRAINTS= installs the newest pyproject.toml allows);
# `make check-newest` tries the newest transformers in a venv of its own (.venv-newest) and reports what it broke.
# (To reinstall with other TORCH/TORCH_INDEX/CONSTRAINTS values, delete .venv/.fate_lab-installed first.)
PY          ?= python3
VENV        ?= .venv
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
CONSTRAINTS ?= constraints.txt
BIN          = $(VENV)/bin
STAMP        = $(VENV)/.fate_lab-installed
NEWEST      ?= .venv-newest
# the transformers requirement of pyproject.toml, e.g. transformers>=5.20,<6
TRANSFORMERS = $(shell sed -n 's/^ *"\(transformers[^"]*\)".*/\1/p' pyproject.toml)

.DEFAULT_GOAL := help
.PHONY: help setup main test lab check-notebooks check-newest

help:  ## list the targets (this text)
	@echo "usage: make <target> [PY=python3] [TORCH=torch==2.13.0] [TORCH_INDEX=<pip index url>] [CONSTRAINTS=constraints.txt]"
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH)" ]; then $(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH)"; fi
	$(BIN)/python -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[notebooks,test]"
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install fate_lab with notebook + test extras

main: setup  ## the main job on both embedded models: every notebook into results/<model>/, tables side by side
	$(BIN)/python -m fate_lab main --out results

test: setup  ## the whole test suite (notebooks run in FAST mode)
	$(BIN)/python -m pytest -q

lab: setup  ## open JupyterLab on the numbered notebooks
	$(BIN)/jupyter lab notebooks/

check-notebooks: setup  ## fail if a committed notebook keeps outputs or widget state
	$(BIN)/python -m fate_lab check-notebooks notebooks

check-newest:  ## family table + exactness tests on the newest transformers pyproject.toml allows (own venv); exit 1 if a family broke
	test -x $(NEWEST)/bin/python || $(PY) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH)" ]; then $(NEWEST)/bin/python -m pip install -q $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH)"; fi
	$(NEWEST)/bin/python -m pip install -q -e ".[notebooks,test]"
	$(NEWEST)/bin/python -m pip install -q --upgrade "$(TRANSFORMERS)" huggingface_hub
	@$(NEWEST)/bin/python -c "import transformers; print('check-newest: transformers', transformers.__version__, '(constraints.txt pins', open('constraints.txt').read().split('transformers==')[1].split()[0] + ')')"
	@rc=0; \
	OMP_NUM_THREADS=1 $(NEWEST)/bin/python -m scripts.family_table --out $(NEWEST)/families.md --compare docs/families.md || rc=1; \
	$(NEWEST)/bin/python -m pytest -q -p no:cacheprovider tests/offloading/test_families_runtime.py tests/model/test_families.py || rc=1; \
	echo "check-newest: full table in $(NEWEST)/families.md; $$( [ $$rc = 0 ] && echo 'nothing broke' || echo 'see BROKEN lines and test failures above')"; \
	exit $$rc
