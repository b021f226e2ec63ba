#!/usr/bin/env bash
# benchmarks/throughput.py on a lent GPU machine, inside a fixed time, with
# what it finished kept in OUT_DIR even when the time runs out.
#
#   bash scripts/gpu_throughput.sh OUT_DIR SECONDS [throughput.py options]
#
# Run after gpu_stage.py's env.sh (which sources the kit's) is sourced (docs/benchmarking.md,
# "On a GPU"). Every method's engine starts at once (--start-together) and their
# passes alternate (--engine-per interleaved, engines in-process, bf16, the
# held-out prompts, 256-token answers). OUT_DIR gets the driver's log
# (throughput.log), the GPU's name (gpu.txt) and, every 20 s and at the end,
# throughput.tgz: the table, the JSON and every worker's log and finished passes.
set -u
OUT_DIR=${1:?usage: gpu_throughput.sh OUT_DIR SECONDS [options]}
SECONDS_LEFT=${2:?usage: gpu_throughput.sh OUT_DIR SECONDS [options]}
shift 2
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT_DIR/gpu.txt" 2>&1
pack() { tar czf "$OUT_DIR/throughput.tgz.part" -C "$WORK" . 2>/dev/null && mv "$OUT_DIR/throughput.tgz.part" "$OUT_DIR/throughput.tgz"; }
( while sleep 20; do pack; done ) &
PACKER=$!
timeout --kill-after=10 "$SECONDS_LEFT" python3 benchmarks/throughput.py --dtype bfloat16 --max-tokens 256 \
    --prompts benchmarks/data/heldout_prompts.jsonl --engine-layout in-process --engine-per interleaved \
    --start-together --out "$WORK/out" "$@" > "$OUT_DIR/throughput.log" 2>&1
echo "throughput.py: exit $?" >> "$OUT_DIR/throughput.log"
kill "$PACKER" 2>/dev/null
pkill -f "throughput.py --worker" 2>/dev/null
pack
