# Two commands for a fresh machine: `make demo` (set up + CPU demo) and `make test` (set up + tests).
# Both create .venv; torch is installed first from `torch==2.13.0` when the venv has none, so pip
# never pulls a CUDA build by accident (install your own CUDA torch into .venv first on a GPU box).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
RUN_DIR ?= runs

.PHONY: setup setup-vllm setup-slurm test test-fast lint demo bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,ray]"
	@touch $@

# Optional: a real vLLM server on CPU for the vLLM integration tests (3.4 GB, own venv).
setup-vllm:
	bash .ci/setup_vllm.sh

# Optional: a single-node Slurm cluster (Debian slurm-wlm + munge, needs root) for the Slurm
# launcher test (skipped with a reason when Slurm is not running).
setup-slurm:
	bash .ci/setup_slurm.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Everything CI runs: lint, unit tests and integration tests (real servers, torchrun ranks).
test: setup lint
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=25 tests

# Unit tests only (seconds).
test-fast: setup
	$(VENV)/bin/pytest -q -m "not integration" tests

demo: setup
	bash examples/run_arith_demo.sh $(RUN_DIR)

bench: setup
	$(PY) bench/rollout_throughput.py
	$(PY) bench/train_throughput.py
	$(PY) bench/train_step_vs_plain.py --profile
	$(PY) bench/grpo_vs_sync_hf.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
