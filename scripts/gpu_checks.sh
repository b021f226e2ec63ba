#!/usr/bin/env bash
# Every open GPU check (issues 52 and 53) in one device call of at most 9 minutes,
# with whatever finished packed into OUT_DIR/checks.tgz every 20 s, so that a call
# cut short still brings its evidence back (a call returns at most 8 files).
#
#   bash scripts/gpu_checks.sh OUT_DIR [SECONDS]      # default 500
#
# Run after the kit's and gpu_stage.py's env.sh are sourced (docs/benchmarking.md,
# "On a GPU"); as the staging's last call:
#
#   python3 scripts/gpu_stage.py unpack .gpu/part3 /tmp/gpu-stage && . /tmp/vllm-kit/env.sh \
#       && . /tmp/gpu-stage/env.sh && bash scripts/gpu_checks.sh $OUT 500     # carry: [".gpu/part3"]
#
# Two waves on one GPU (each engine asks vLLM for a tenth of the device):
#   1. kernels: the kernel tests on CUDA tensors (tree attention's graph-safe launch, the uniform
#            step through both backends' impls, the step's device part, the graph keys, the
#            tensor retrieval matcher's chosen trees against the trie's);
#      sync: benchmarks/sync_check.py at batch 8 and 64: synchronising calls per step of the
#            plugin (draft-free and tree steps) against vLLM without speculation on the same
#            V1 runner with synchronous scheduling (the plugin must add none); at batch 8 also an
#            EAGLE-3 tree (its draft loop at fixed capacity) beside vLLM's eagle3 chain;
#      profile: benchmarks/step_profile.py in lockstep at batch 8 and 64: the graphs column
#            (FULL for every draft-free and every uniform tree step) and the step times of none
#            (vLLM's default), none-v1-sync, tree-0 (draft-free) and tree-16 / tree-adaptive-16;
#            eagle3-16's draft graphs column (its first passes and tree layers replaying the
#            PIECEWISE graphs vLLM captured for the head, issue 53);
#      drafthost: benchmarks/draft_host_time.py at batch 8 and 64: a drafting step's host time outside
#            torch operations for the tensor retrieval matcher and an EAGLE-3 tree (issue 53).
#   2. throughput: benchmarks/throughput.py, bf16, held-out prompts, batch 1, 8, 32, 64: none,
#            none-v1-sync, ngram, eagle3 (vLLM's chain), tree-retrieval (the trie) and
#            tree-retrieval-tensors (issue 53's tensor matcher, which auto would pick if faster);
#      greedy: the gpu tests' greedy equality for retrieval on both attention backends, and for
#            an EAGLE-3 tree and a draft LM on FLASH_ATTN (their passes replayed from graphs: tau
#            above 1.2 says the replays read this step's inputs).
# OUT_DIR/checks.tgz holds every log, table and JSON; OUT_DIR/summary.txt each part's exit.
set -u
OUT=${1:?usage: gpu_checks.sh OUT_DIR [SECONDS]}
BUDGET=${2:-500}
END=$(( $(date +%s) + BUDGET ))
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
WORK=$(mktemp -d)
mkdir -p "$OUT"
: > "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$WORK/gpu.txt" 2>&1
git log -1 --format='%H %s' > "$WORK/commit.txt" 2>/dev/null
pack() { tar czf "$OUT/checks.tgz.part" -C "$WORK" . 2>/dev/null && mv "$OUT/checks.tgz.part" "$OUT/checks.tgz"; }
( while sleep 20; do pack; done ) &
PACKER=$!

left() { echo $(( END - $(date +%s) )); }
part() {  # part NAME SECONDS COMMAND...: one check, its log under WORK, its exit in the summary
    local name=$1 seconds=$2; shift 2
    timeout --kill-after=10 "$seconds" "$@" > "$WORK/$name.log" 2>&1
    echo "$name: exit $? ($(tail -n 1 "$WORK/$name.log"))" >> "$OUT/summary.txt"
}

python3 -c "from vllm_adaptive_spec.demo_model import ensure_demo_model; ensure_demo_model()" \
    > "$WORK/prepare.log" 2>&1 || { echo "preparing the demo model failed"; tail -5 "$WORK/prepare.log"; }

WAVE1=$(( $(left) * 45 / 100 ))
part kernels "$WAVE1" python3 -m pytest -q -p no:cacheprovider tests/kernels tests/test_cuda_attention.py \
    tests/test_tree_tensors.py tests/test_cudagraphs.py tests/test_retrieval_tensors.py &
PARTS=$!
part sync "$WAVE1" bash -c "python3 benchmarks/sync_check.py --batch-size 8 --methods none-v1-sync,tree-0,tree-16,eagle3-16,vllm-eagle3-4 \
    --out $WORK/sync && python3 benchmarks/sync_check.py --batch-size 64 --methods none-v1-sync,tree-0,tree-16 \
    --out $WORK/sync" &
PARTS="$PARTS $!"
part drafthost "$WAVE1" python3 benchmarks/draft_host_time.py --drafters retrieval-tensors,eagle3,eagle3-fixed,hybrid-fixed --batch-sizes 8,64 \
    --dtype bfloat16 --out "$WORK/drafthost" &
PARTS="$PARTS $!"
part profile "$WAVE1" python3 benchmarks/step_profile.py --dtype bfloat16 --engine-layout lockstep --passes 1 \
    --methods none,none-v1-sync,tree-0,tree-16,tree-adaptive-16,eagle3-16 --batch-sizes 8,64 --max-tokens 64 --out "$WORK/profile" &
PARTS="$PARTS $!"
wait $PARTS  # not the packer, which runs until the end

WAVE2=$(( $(left) - 15 ))
part throughput "$WAVE2" bash scripts/gpu_throughput.sh "$WORK/throughput" $(( WAVE2 - 10 )) \
    --batch-sizes 1,8,32,64 --rounds 1 --methods none,none-v1-sync,ngram,eagle3,tree-retrieval,tree-retrieval-tensors,tree-eagle3,tree-hybrid-tensors &
PARTS=$!
part greedy "$WAVE2" python3 -m pytest -q -p no:cacheprovider -rfE \
    "tests/test_gpu_engine.py::test_greedy_equals_no_speculation_on_gpu[TRITON_ATTN-retrieval]" \
    "tests/test_gpu_engine.py::test_greedy_equals_no_speculation_on_gpu[FLASH_ATTN-retrieval]" \
    "tests/test_gpu_engine.py::test_greedy_equals_no_speculation_on_gpu[FLASH_ATTN-eagle3-eagle2]" \
    "tests/test_gpu_engine.py::test_greedy_equals_no_speculation_on_gpu[FLASH_ATTN-draft_model]" &
wait $PARTS $!

kill "$PACKER" 2>/dev/null
cp "$OUT/summary.txt" "$WORK/summary.txt"
pack
cat "$OUT/summary.txt"
