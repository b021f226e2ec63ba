#!/usr/bin/env bash
# Every open GPU check in one device call of at most 9 minutes, with whatever finished packed
# into OUT_DIR/checks.tgz every 20 s, so that a call cut short still brings its evidence back
# (a call returns at most 8 files). Every tool writes its table and JSON as it goes (after each
# batch size, pass, method or measurement), so a stage cut off by its time keeps what it measured.
#
#   bash scripts/gpu_checks.sh OUT_DIR [SECONDS]             # on the GPU; SECONDS default 500
#   bash scripts/gpu_checks.sh --dry-run OUT_DIR [SECONDS]   # the same stages on the CPU, tiny
#   bash scripts/gpu_checks.sh --list [--dry-run]            # [stage, outputs, command...] a line
#   bash scripts/gpu_checks.sh --check-args                  # parse every stage's arguments here
#   GPU_CHECKS_ONLY=sync-b8,throughput bash scripts/gpu_checks.sh OUT_DIR 500   # some stages only
#
# On the lent machine, after the staging (docs/benchmarking.md, "On a GPU"), as the last call:
#
#   python3 scripts/gpu_stage.py unpack .gpu/part4 /tmp/gpu-stage && . /tmp/gpu-stage/env.sh \
#       && bash scripts/gpu_checks.sh $OUT 500                                # carry: [".gpu/part4"]
#
# Stages, in order of what matters most. imports and prepare run first, one after the other;
# then two waves, each wave's stages side by side (each engine asks vLLM for a tenth of the
# device). Wave 1 is meant to answer, within about four minutes of the call's start:
#   imports   (1) does it run at all: torch, triton, vLLM, the plugin and its vLLM entry point;
#   prepare   the demo model converted from the staged GGUF, the draft LM built (minutes=0);
#   smoke     (1) one engine starts: the demo (python3 -m vllm_adaptive_spec.demo), vLLM
#             without speculation and with adaptive_tree, the answers and whether they are equal;
#   greedy-retrieval-triton, greedy-retrieval-flash
#             (2) greedy output equal to no speculation (the gpu test, retrieval trees, on each
#             attention backend in its own process, so neither waits for the other);
#   profile-b8
#             (3) the graphs column of benchmarks/step_profile.py in lockstep at batch 8: FULL
#             for every draft-free step (tree-0) and every uniform tree step (tree-16), and
#             (4) their step times against none (vLLM's default) and none-v1-sync (vLLM on the
#             plugin's V1 runner with synchronous scheduling);
#   retrieval (5) benchmarks/throughput.py, bf16, held-out prompts, 256 tokens: tree-retrieval
#             against ngram and none at batch 1 and 8.
# Wave 2, the rest, with what wave 1 left of the time:
#   kernels   the kernel tests on CUDA tensors (tree attention's graph-safe launch, the uniform
#             step through both backends' impls, the step's device part, the graph keys, the
#             tensor retrieval matcher's chosen trees against the trie's);
#   sync-b8, sync-b64
#             benchmarks/sync_check.py: synchronising calls per step of the plugin (draft-free
#             and tree steps) against none-v1-sync (the plugin must add none); at batch 8 also an
#             EAGLE-3 tree (its draft loop at fixed capacity) beside vLLM's eagle3 chain;
#   drafthost benchmarks/draft_host_time.py at batch 8 and 64: a drafting step's host time
#             outside torch operations, tensor retrieval matcher and EAGLE-3 trees;
#   profile   the step profile at batch 64 then 8, with tree-adaptive-16 and eagle3-16 (its
#             draft graphs column: the head's passes replaying vLLM's PIECEWISE graphs);
#   throughput
#             the throughput table at batch 1, 8, 32, 64: none, none-v1-sync, ngram, eagle3
#             (vLLM's chain), tree-retrieval (the trie), tree-retrieval-tensors, tree-eagle3,
#             tree-hybrid-tensors;
#   greedy-models
#             the greedy test for an EAGLE-3 tree and a draft LM on FLASH_ATTN (their passes
#             replayed from graphs: tau above 1.2 says the replays read this step's inputs).
# OUT_DIR/summary.txt gets one line per stage as it ends ("NAME: ok|FAILED exit N, S s, ...");
# a stage fails on a non-zero exit (124: its time ran out), a missing output file, or an
# "error" in its JSON report. The exit status is 1 when any stage failed.
#
# A second call (GPU_CHECKS_ONLY picks stages; imports and prepare always run). On a machine still
# warm (30 s after the last call) it needs no carry: ". /tmp/gpu-stage/env.sh && GPU_CHECKS_ONLY=...
# bash scripts/gpu_checks.sh $OUT 500"; on a fresh one, the staging's four calls come first.
#   * cut short in wave 2 (summary lines with exit 124, or stages missing): run those stages
#     alone, e.g. GPU_CHECKS_ONLY=kernels,sync-b8,sync-b64,drafthost,profile,throughput,greedy-models:
#     wave 1 is then empty and they get the whole budget (about twice what the first call left);
#   * imports or prepare failed: nothing was measured, and the cause is in the staging (a
#     package, a path, the kit's env.sh): reproduce it with the dry run here, fix, and rerun
#     everything, since no later stage's result means anything without them;
#   * a greedy stage failed: GPU_CHECKS_ONLY=greedy-retrieval-triton,greedy-retrieval-flash,kernels,greedy-models
#     (the kernel tests on CUDA tell a kernel's fault from the engine path's; the model
#     drafters tell whether it is the retrieval drafter's), and leave timing for later:
#     throughput of a wrong answer means nothing;
#   * profile-b8 shows no FULL graphs for tree-0 or tree-16: GPU_CHECKS_ONLY=profile-b8,kernels,sync-b8
#     with the logs read first (the step guard says why a step left its graph); step times
#     without graphs measure the fallback, not the design, so the throughput stages wait;
#   * a stage failed at once with a Python error: fix it here (the dry run should then
#     fail the same way, see below) and rerun that stage alone.
#
# --dry-run runs every stage on the CPU, two at a time (GPU_CHECKS_LANES; each wave in its order),
# with the same tools, the same flags and the same outputs, summary and archive, only smaller:
# batch 1-2, 2-4 tokens, two short prompts (scripts/data/dry_run_prompts.jsonl), one round or
# pass, fewer methods per tool (an engine costs 5-10 s of CPU here; --check-args still checks
# every method name of the GPU run with the tools' own tables), float32 (bf16 is emulated on this
# CPU) and one OpenMP thread per process. What the CPU cannot run is exercised as far as it goes:
# the pytest stages (CUDA kernels, and the gpu-marked engine tests, which skip without CUDA)
# collect their exact node ids with their options (--collect-only), and nvidia-smi, absent here,
# is reported as such. A stage that fails here would fail on the GPU too; one that passes here
# can still fail there only on what needs CUDA. tests/test_gpu_script.py runs the dry run
# (engine; about 3-4 minutes on 2 idle cores, several GiB of memory at its peak: not beside
# another engine benchmark) and --check-args (fast).
set -u
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
DRY=0 LIST=0 STOP=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --list) LIST=1; shift ;;
        --check-args) shift; cd "$(dirname "$SELF")/.." && exec python3 scripts/check_gpu_args.py --script "$SELF" "$@" ;;
        *) break ;;
    esac
done
cd "$(dirname "$SELF")/.."
if [ $LIST = 1 ]; then
    OUT=/OUT WORK=/WORK BUDGET=500
else
    OUT=${1:?usage: gpu_checks.sh [--dry-run] OUT_DIR [SECONDS]}
    BUDGET=${2:-$([ $DRY = 1 ] && echo 600 || echo 500)}
    mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
    WORK=${GPU_CHECKS_WORK:-$(mktemp -d)}
    mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd)
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # vLLM's samplers import FlashInfer on CUDA unless told not to; the kit carries none.
    python3 -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
    # A dry run's two lanes, one thread each: OpenMP threads that outnumber the cores spin-wait for
    # each other (measured: seven times the CPU time of an engine step on a loaded 2-core machine).
    [ $DRY = 0 ] || export OMP_NUM_THREADS=1
fi
END=$(( $(date +%s) + BUDGET ))

sz() { if [ $DRY = 1 ]; then echo "$2"; else echo "$1"; fi; }  # sz GPU_VALUE DRY_VALUE
left() { echo $(( END - $(date +%s) )); }
cpu_now() {  # cpu_now FILE: CPU_NOW, the CPU seconds this shell's waited-for children used so far
    times > "$1"  # bash's times, here: in a pipe or $(...) it would count a subshell's children
    CPU_NOW=$(tail -n 1 "$1" | sed 's/[ms]/ /g' | awk '{printf "%d\n", $1 * 60 + $2 + $3 * 60 + $4}')
}
selected() {  # imports and prepare always run, unless imports failed
    [ $STOP = 0 ] || return 1
    case "$1" in imports|prepare) return 0 ;; esac
    [ -z "${GPU_CHECKS_ONLY:-}" ] || [[ ",$GPU_CHECKS_ONLY," == *",$1,"* ]]
}
errors_in() {  # errors_in FILE...: how many "error" entries the JSON reports hold, and the first
    python3 - "$@" <<'EOF'
import json, sys
found = []
def walk(value):
    if isinstance(value, dict):
        if value.get("error"):
            found.append(str(value["error"]))
        for item in value.values():
            walk(item)
    elif isinstance(value, list):
        for item in value:
            walk(item)
for path in sys.argv[1:]:
    try:
        walk(json.load(open(path)))
    except (OSError, ValueError) as exc:
        found.append(f"{path}: {exc}")
print(len(found), found[0][:160] if found else "")
EOF
}
part() {  # part NAME SECONDS EXPECT COMMAND...: one stage, its log WORK/NAME.log, its verdict in the summary
    local name=$1 seconds=$2 expect=$3 rc started missing="" pattern file count first note=""
    shift 3
    selected "$name" || return 0
    if [ $LIST = 1 ]; then
        python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$name" "$expect" "$@"  # one JSON list a stage
        return 0
    fi
    [ "$seconds" -ge 10 ] || seconds=10
    started=$(date +%s)
    cpu_now "$WORK/.times-$name"
    local cpu=$CPU_NOW
    timeout --kill-after=10 "$seconds" "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    cpu_now "$WORK/.times-$name"
    cpu=$(( CPU_NOW - cpu ))
    rm -f "$WORK/.times-$name"
    # Engine workers run in sessions of their own (benchmarks/engines.py): a timeout leaves them.
    pkill -KILL -f -- "--worker $WORK/$name/" 2>/dev/null
    local reports=()
    for pattern in ${expect//,/ }; do
        # shellcheck disable=SC2086  # the pattern is a glob
        set -- $WORK/$pattern
        if [ -e "$1" ]; then
            for file in "$@"; do [[ $file == *.json ]] && reports+=("$file"); done
        else
            missing="$missing $pattern"
        fi
    done
    if [ ${#reports[@]} -gt 0 ]; then
        read -r count first <<< "$(errors_in "${reports[@]}")"
        [ "${count:-0}" = 0 ] || note=", $count errors in its report ($first)"
    fi
    [ -z "$missing" ] || note="$note, missing:$missing"
    case $rc in 124|137) note=", its $seconds s ran out$note" ;; esac
    local verdict=ok
    [ $rc = 0 ] && [ -z "$note" ] || verdict=FAILED
    printf '%s: %s exit %s, %s s (CPU %s s)%s | %s\n' "$name" "$verdict" "$rc" $(( $(date +%s) - started )) "$cpu" "$note" \
        "$(tail -n 1 "$WORK/$name.log" | cut -c1-200)" >> "$OUT/summary.txt"
}
WAVE=""
running() { local pid n=0; for pid in $WAVE; do kill -0 "$pid" 2> /dev/null && n=$(( n + 1 )); done; echo $n; }
launch() {  # a stage of the current wave: all side by side on the GPU, two at a time in a dry run
    if [ $LIST = 1 ]; then
        part "$1" 0 "${@:2}"
    elif [ $DRY = 1 ]; then  # an engine here runs on one core (one OpenMP thread): a lane per core
        while [ "$(running)" -ge "${GPU_CHECKS_LANES:-2}" ]; do sleep 1; done
        part "$1" "$(( $(left) - 5 ))" "${@:2}" &
        WAVE="$WAVE $!"
    else
        part "$1" "$WAVE_SECONDS" "${@:2}" &
        WAVE="$WAVE $!"
    fi
}
end_wave() { [ -z "$WAVE" ] || wait $WAVE; WAVE=""; }  # the wave's stages, not the packer
pack() {  # pack SUFFIX; tar exits 1 when a file changed while read: the archive is still whole
    tar czf "$OUT/checks.tgz.$1" -C "$WORK" --warning=no-file-changed . 2>/dev/null
    [ $? -le 1 ] && mv "$OUT/checks.tgz.$1" "$OUT/checks.tgz"
}

if [ $LIST = 0 ]; then
    : > "$OUT/summary.txt"
    {   echo "mode: $([ $DRY = 1 ] && echo "dry run on the CPU" || echo GPU), budget $BUDGET s, $(date -u +%FT%TZ)"
        if command -v nvidia-smi > /dev/null; then
            nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
        else
            echo "nvidia-smi: not found (no NVIDIA driver on this machine)"
        fi
    } > "$WORK/gpu.txt"
    if git rev-parse --git-dir > /dev/null 2>&1; then
        { git log -1 --format='%H %s'; git status --porcelain --untracked-files=no | sed 's/^/changed: /'; } > "$WORK/commit.txt"
    elif [ -f "${GPU_STAGE_DIR:-/tmp/gpu-stage}/COMMIT" ]; then
        # A device call's copy of the checkout has no .git: gpu_stage.py recorded the commit when it staged.
        echo "$(cat "${GPU_STAGE_DIR:-/tmp/gpu-stage}/COMMIT") [as staged: this copy has no git repository]" > "$WORK/commit.txt"
    else
        echo "unknown: no git repository here and no ${GPU_STAGE_DIR:-/tmp/gpu-stage}/COMMIT" > "$WORK/commit.txt"
    fi
    ( while sleep 20; do pack packing; done ) &
    PACKER=$!
fi

# The device's: bf16 on the GPU, float32 here (this CPU emulates bf16: an engine's prefill takes twice as
# long); the prompts: two short ones here (a prefill is most of what a tiny engine run costs on the CPU).
DTYPE=$(sz bfloat16 float32)
PROMPTS=$(sz vllm_adaptive_spec/data/prompts.jsonl scripts/data/dry_run_prompts.jsonl)
HELDOUT=$(sz benchmarks/data/heldout_prompts.jsonl scripts/data/dry_run_prompts.jsonl)
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rfE)
[ $DRY = 1 ] && PYTEST+=(--collect-only)  # CUDA only: collect the exact node ids, options and imports
GREEDY=tests/test_gpu_engine.py::test_greedy_equals_no_speculation_on_gpu
# Throughput as scripts/gpu_throughput.sh runs it: every engine up at once, passes alternating.
THROUGHPUT=(python3 benchmarks/throughput.py --dtype "$DTYPE" --max-tokens "$(sz 256 4)" --prompts "$HELDOUT"
            --engine-layout in-process --engine-per interleaved --start-together --rounds 1
            --num-prompts "$(sz auto 1)" --warmup-prompts "$(sz 2 1)")
PROFILE=(python3 benchmarks/step_profile.py --dtype "$DTYPE" --engine-layout lockstep --passes 1
         --max-tokens "$(sz 64 2)" --min-prompts "$(sz 4 1)" --prompts "$PROMPTS")
SYNC=(python3 benchmarks/sync_check.py --dtype "$DTYPE" --steps "$(sz 50 2)" --prompts "$PROMPTS")

part imports 120 imports.log python3 -c '
import importlib.metadata as metadata
import torch, triton, vllm
import vllm_adaptive_spec.plugin, kernels, benchmarks.bench
plugins = [e.value for e in metadata.entry_points(group="vllm.general_plugins")]
assert "vllm_adaptive_spec.plugin:register" in plugins, f"the plugin is not a vLLM plugin here: {plugins}"
cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
print(f"torch {torch.__version__} ({cuda}), triton {triton.__version__}, vllm {vllm.__version__}, plugins {plugins}")'
if [ $LIST = 0 ] && ! grep -q "^imports: ok" "$OUT/summary.txt"; then
    echo "imports failed: nothing else can run (see imports.log)" >> "$OUT/summary.txt"
    STOP=1
fi
part prepare 300 prepare.log python3 -c '
from vllm_adaptive_spec.demo_model import ensure_demo_model
from vllm_adaptive_spec.training.train_draft_lm import ensure_draft_lm
print(ensure_demo_model(), ensure_draft_lm(layers=4, minutes=0))'

# Wave 1: what matters most, in about four minutes (60% of what is left when wave 2 runs: the
# step profile opens its four engines one after another, each compiling and capturing graphs).
WAVE_SECONDS=$(( $(left) - 15 ))
for stage in kernels sync-b8 sync-b64 drafthost profile throughput greedy-models; do
    selected $stage && WAVE_SECONDS=$(( $(left) * 60 / 100 )) && break
done
launch smoke smoke.log python3 -m vllm_adaptive_spec.demo --dtype "$DTYPE" --max-tokens "$(sz 64 2)" --prompts "$PROMPTS"
launch greedy-retrieval-triton greedy-retrieval-triton.xml "${PYTEST[@]}" \
    --junitxml="$WORK/greedy-retrieval-triton.xml" "$GREEDY[TRITON_ATTN-retrieval]"
launch greedy-retrieval-flash greedy-retrieval-flash.xml "${PYTEST[@]}" \
    --junitxml="$WORK/greedy-retrieval-flash.xml" "$GREEDY[FLASH_ATTN-retrieval]"
launch profile-b8 profile-b8/step_profile.json,profile-b8/step_profile.md "${PROFILE[@]}" \
    --methods "$(sz none-v1-sync,none,tree-0,tree-16 none-v1-sync,tree-0)" --batch-sizes "$(sz 8 1)" \
    --out "$WORK/profile-b8"
launch retrieval retrieval/throughput.json,retrieval/throughput.md "${THROUGHPUT[@]}" \
    --methods "$(sz none,ngram,tree-retrieval tree-retrieval)" --batch-sizes "$(sz 1,8 1,2)" \
    --out "$WORK/retrieval"
end_wave

# Wave 2: the rest.
WAVE_SECONDS=$(( $(left) - 15 ))
launch kernels kernels.xml "${PYTEST[@]}" --junitxml="$WORK/kernels.xml" tests/kernels \
    tests/test_cuda_attention.py tests/test_tree_tensors.py tests/test_cudagraphs.py tests/test_retrieval_tensors.py
launch sync-b8 'sync-b8/sync_check_b*.json,sync-b8/sync_check_b*.md' "${SYNC[@]}" --batch-size "$(sz 8 1)" \
    --methods "$(sz none-v1-sync,tree-0,tree-16,eagle3-16,vllm-eagle3-4 eagle3-16)" --out "$WORK/sync-b8"
launch sync-b64 'sync-b64/sync_check_b*.json,sync-b64/sync_check_b*.md' "${SYNC[@]}" --batch-size "$(sz 64 2)" \
    --methods "$(sz none-v1-sync,tree-0,tree-16 tree-0)" --out "$WORK/sync-b64"
launch drafthost drafthost/draft_host_time.json,drafthost/draft_host_time.md python3 benchmarks/draft_host_time.py \
    --drafters "$(sz retrieval-tensors,eagle3,eagle3-fixed,hybrid-fixed hybrid-fixed)" --batch-sizes "$(sz 8,64 1)" \
    --dtype "$DTYPE" --max-tokens "$(sz 48 4)" --warmup "$(sz 8 1)" --steps "$(sz 12 1)" --prompts "$PROMPTS" \
    --out "$WORK/drafthost"
launch profile profile/step_profile.json,profile/step_profile.md "${PROFILE[@]}" \
    --methods "$(sz none-v1-sync,none,tree-0,tree-16,tree-adaptive-16,eagle3-16 eagle3-16)" \
    --batch-sizes "$(sz 64,8 2,1)" --out "$WORK/profile"
launch throughput throughput/throughput.json,throughput/throughput.md "${THROUGHPUT[@]}" \
    --methods "$(sz none,none-v1-sync,ngram,eagle3,tree-retrieval,tree-retrieval-tensors,tree-eagle3,tree-hybrid-tensors \
                   tree-hybrid-tensors)" \
    --batch-sizes "$(sz 1,8,32,64 1,2)" --out "$WORK/throughput"
launch greedy-models greedy-models.xml "${PYTEST[@]}" --junitxml="$WORK/greedy-models.xml" \
    "$GREEDY[FLASH_ATTN-eagle3-eagle2]" "$GREEDY[FLASH_ATTN-draft_model]"
end_wave
[ $LIST = 1 ] && exit 0

kill $(pgrep -P "$PACKER") "$PACKER" 2> /dev/null  # the packer and its tar or sleep
wait "$PACKER" 2> /dev/null
rm -f "$OUT/checks.tgz.packing"
cp "$OUT/summary.txt" "$WORK/summary.txt"
pack final
cat "$OUT/summary.txt"
! grep -q -e "^[a-z0-9-]*: FAILED" -e "^imports failed" "$OUT/summary.txt"
