# fate_lab task runner. Every target is idempotent and fast on a second run; `make` lists them.
# CPU machines get torch==2.13.0; on a GPU machine run `make setup TORCH=` after installing
# your CUDA torch into .venv (see README). Elsewhere, `make setup TORCH_INDEX=<url>` takes torch
# from that index, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU-only build.
# constraints.txt pins the versions CI tested (CONSTRAINTS= installs the newest pyproject.toml allows).
# (To reinstall with other TORCH/TORCH_INDEX/CONSTRAINTS values, delete .venv/.fate_lab-installed first.)
PY          ?= python3
VENV        ?= .venv
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
CONSTRAINTS ?= constraints.txt
BIN          = $(VENV)/bin
STAMP        = $(VENV)/.fate_lab-installed

.DEFAULT_GOAL := help
.PHONY: help setup main test lab check-notebooks

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
