#!/usr/bin/env bash
# The project's GPU tests on one CUDA GPU, as parallel groups within a time budget.
#
#   bash scripts/gpu_tests.sh LOG_DIR [SECONDS]     # default 900
#
# One after another the GPU engine tests take about a quarter of an hour: each
# of their 14 engines imports vLLM, compiles the model and captures CUDA graphs
# (about 50-90 s on an H200). Here they run side by side in 8 processes, which
# one GPU holds easily (each engine asks vLLM for a tenth of the device; its KV
# cache is sized explicitly): per attention backend three groups of two drafter
# configurations (each group starts its own reference engine), the sampling
# test, and the kernel tests (tests/kernels, tests/test_cuda_attention.py). The
# demo model and the draft LM are built once first. Each group has its own vLLM
# compile cache and stops at the budget. LOG_DIR gets each group's log and JUnit
# XML and summary.txt; the exit status is 0 when every group passed.
set -u
LOG=${1:?usage: gpu_tests.sh LOG_DIR [SECONDS]}
END=$(( $(date +%s) + ${2:-900} ))
mkdir -p "$LOG"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# vLLM's samplers import FlashInfer on CUDA unless told not to; its CUDA wheel
# depends on FlashInfer, a carried vLLM (the kit) has none.
if ! python3 -c "import flashinfer" 2>/dev/null; then
    echo "no FlashInfer here: VLLM_USE_FLASHINFER_SAMPLER=0"
    export VLLM_USE_FLASHINFER_SAMPLER=0
fi

python3 -c "
from vllm_adaptive_spec.demo_model import ensure_demo_model
from vllm_adaptive_spec.training.train_draft_lm import ensure_draft_lm
ensure_demo_model(); ensure_draft_lm(layers=4, minutes=0)" > "$LOG/prepare.log" 2>&1 \
    || { echo "preparing the demo model failed:"; tail -20 "$LOG/prepare.log"; exit 1; }

group() {
    local name=$1; shift
    VLLM_CACHE_ROOT="$LOG/vllm-cache-$name" timeout $(( END - $(date +%s) )) \
        python3 -m pytest -q -rfE -p no:cacheprovider --junitxml="$LOG/$name.xml" "$@" > "$LOG/$name.log" 2>&1
    echo "$name: exit $? ($(tail -n 1 "$LOG/$name.log"))" >> "$LOG/summary.txt"
}
: > "$LOG/summary.txt"
greedy=tests/test_gpu_engine.py::test_greedy_equals_no_speculation_on_gpu
for backend in TRITON_ATTN FLASH_ATTN; do
    group "$backend-retrieval-hybrid" "$greedy[$backend-retrieval]" "$greedy[$backend-hybrid]" &
    group "$backend-eagle2-talon" "$greedy[$backend-eagle3-eagle2]" "$greedy[$backend-eagle3-talon]" &
    group "$backend-c2t-draft_model" "$greedy[$backend-eagle3-c2t]" "$greedy[$backend-draft_model]" &
done
group sampling tests/test_gpu_engine.py::test_sampling_distribution_unchanged_on_gpu &
group kernels tests/kernels tests/test_cuda_attention.py &
wait
rm -rf "$LOG"/vllm-cache-*
cat "$LOG/summary.txt"
! grep -qv ": exit 0 " "$LOG/summary.txt"
