# The two commands: `make demo` runs the demo, `make test` runs the tests.
# Each creates or reuses .venv, installs what is missing and prepares the demo model.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test bench env

env:
	@VENV=$(VENV) bash scripts/ensure_env.sh

demo: env
	@$(PY) -m vllm_adaptive_spec.demo

test: env
	@$(PY) -m pytest $(PYTEST_ARGS)

bench: env
	@$(PY) benchmarks/throughput.py
