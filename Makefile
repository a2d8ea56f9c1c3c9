# fate_lab task runner. Every target is idempotent and fast on a second run.
# CPU machines get torch==2.13.0; on a GPU machine run `make setup TORCH=` after installing
# your CUDA torch into .venv (see README).
PY      ?= python3
VENV    ?= .venv
TORCH   ?= torch==2.13.0
BIN      = $(VENV)/bin
STAMP    = $(VENV)/.fate_lab-installed

.PHONY: setup main test lab trace clean-notebooks check-notebooks

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH)" ]; then $(BIN)/python -m pip install -q "$(TORCH)"; fi
	$(BIN)/python -m pip install -q -e ".[notebooks,test]"
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install fate_lab with notebook + test extras

main: setup  ## the main job on the embedded model: reproduce the figures and tables into results/
	$(BIN)/python -m fate_lab main --out results

test: setup  ## the whole test suite (notebooks run in FAST mode)
	$(BIN)/python -m pytest -q

lab: setup  ## open JupyterLab on the numbered notebooks
	$(BIN)/jupyter lab notebooks/

check-notebooks: setup  ## fail if a committed notebook keeps outputs or widget state
	$(BIN)/python -m fate_lab check-notebooks notebooks
