# Two commands for a fresh machine: `make demo` (set up + CPU demo) and `make test` (set up + tests).
# Both create .venv; torch is installed first (by pip) from `torch==2.13.0` when the venv has none,
# so no installer ever pulls a CUDA build by accident (install your own CUDA torch into .venv first
# on a GPU box). Then uv (pip-installed into the venv when missing: it resolves and installs
# several times faster than pip) installs the project; where uv cannot be had, pip does.
# `make demo` installs the project alone; `make setup` (make test, lint, bench) adds the dev and
# ray extras the tests need.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
UV := $(VENV)/bin/uv
RUN_DIR ?= runs
DEMO_DEPS := -e .
TEST_DEPS := -e ".[dev,ray]"
# Install $(1) with uv, or with pip when uv is missing or fails (say, a pip-only package mirror).
# The venv's torch is pinned: a dependency that wants another torch fails the install instead of
# replacing a CPU (or your CUDA) build with the registry's. Bytecode is compiled at install, as
# pip does: where PYTHONDONTWRITEBYTECODE is set, every process would compile its imports anew.
TORCH_PIN := $(VENV)/torch-pin.txt
install = $(PY) -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
	> $(TORCH_PIN) && \
	if [ -x $(UV) ] && $(UV) pip install -q --compile-bytecode --python $(PY) -c $(TORCH_PIN) $(1); \
	then :; else $(PIP) install -q -c $(TORCH_PIN) $(1); fi

.PHONY: setup setup-demo setup-vllm setup-slurm test test-fast lint demo demo-long bench clean

setup: $(VENV)/.installed
setup-demo: $(VENV)/.installed-demo

# The venv, torch (pip, `torch==2.13.0`, only when there is none) and uv.
$(VENV)/.base:
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	@[ -x $(UV) ] || $(PIP) install -q uv || echo "uv unavailable: installing with pip"
	@touch $@

$(VENV)/.installed-demo: pyproject.toml $(VENV)/.base
	$(call install,$(DEMO_DEPS))
	@touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.base
	$(call install,$(TEST_DEPS))
	@touch $@ $(VENV)/.installed-demo

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
# Two pytest-xdist workers, a test file each at a time (module fixtures are not built twice),
# the longest files first (tests/conftest.py): 1.39x on 2 cores, since the integration tests
# wait on process starts and servers much of the time. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: setup lint
	$(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

# Unit tests only (seconds).
test-fast: setup
	$(VENV)/bin/pytest -q -m "not integration" tests

demo: setup-demo
	bash examples/run_arith_demo.sh $(RUN_DIR)

# The second demo: long, long-tailed worked sums (the regime asynchronous RL exists for).
demo-long: setup-demo
	DEMO_TASK=long_sums bash examples/run_arith_demo.sh $(RUN_DIR)

bench: setup
	$(PY) bench/rollout_throughput.py
	$(PY) bench/train_throughput.py
	$(PY) bench/train_step_vs_plain.py --profile
	$(PY) bench/grpo_vs_sync_hf.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
