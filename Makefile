# The two commands: `make demo` runs the demo, `make test` runs the tests.
# Each creates or reuses .venv, installs what is missing and prepares the demo model.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: demo test bench env suffix-decoding

env:
	@VENV=$(VENV) bash scripts/ensure_env.sh

demo: env
	@$(PY) -m vllm_adaptive_spec.demo

test: env
	@PY=$(PY) bash scripts/test_lanes.sh $(PYTEST_ARGS)

# vLLM's `suffix` method needs Arctic Inference's suffix tree, built (once) by this
# script; the benchmark runs it too when `suffix` is selected. Tests never need it.
# A failed build does not stop `make bench` (only `suffix` then reports an error).
suffix-decoding: env
	@VENV=$(VENV) bash scripts/build_suffix_decoding.sh >/dev/null \
		|| echo "warning: scripts/build_suffix_decoding.sh failed; the suffix method will not run" >&2

# The throughput table's plot needs matplotlib (the [bench] extra), installed here if missing.
bench: env suffix-decoding
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install --quiet --disable-pip-version-check matplotlib
	@$(VENV)/bin/vllm-adaptive-spec bench throughput $(BENCH_ARGS)
