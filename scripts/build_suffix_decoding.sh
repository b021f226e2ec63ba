#!/usr/bin/env bash
# Build the suffix-tree part of Arctic Inference, which vLLM's `suffix`
# speculative method (Suffix Decoding) imports as `arctic_inference.suffix_decoding`.
#
# Why not `pip install arctic-inference`: PyPI has 0.3.0 only as a source
# archive whose full build targets vLLM 0.26 / CUDA and which registers its own
# vLLM plugin. Only its small nanobind extension (csrc/suffix_decoding) is
# needed, so this script downloads the source archive, builds that extension
# with cmake + ninja against the repo venv's Python, and lays out
#
#   $DEST/arctic_inference/__init__.py                 (empty)
#   $DEST/arctic_inference/suffix_decoding/*.py        (from the source archive)
#   $DEST/arctic_inference/suffix_decoding/_C*.so      (built here)
#
# with DEST=${VLLM_ADAPTIVE_SPEC_CACHE:-$HOME/.cache/vllm-adaptive-spec}/suffix_decoding.
# Put DEST on PYTHONPATH to use it. Idempotent: returns at once when DEST
# already imports. Prints DEST on success (the only line on stdout).
#
# Environment: VENV (default: the repo's .venv) picks the Python to build for.
set -euo pipefail

VERSION=0.3.0
SDIST_SHA256=7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36
NANOBIND=2.9.2

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$repo/.venv}
python=$venv/bin/python
cache=${VLLM_ADAPTIVE_SPEC_CACHE:-$HOME/.cache/vllm-adaptive-spec}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
dest=$cache/suffix_decoding

log() { echo "[build_suffix_decoding] $*" >&2; }

[ -x "$python" ] || { log "no Python at $python (set VENV)"; exit 1; }

imports() {  # does $1 provide a working arctic_inference.suffix_decoding?
    PYTHONPATH="$1" "$python" -c '
import sys
import arctic_inference.suffix_decoding as m
assert m.__file__.startswith(sys.argv[1]), m.__file__
m.SuffixDecodingCache(max_tree_depth=4, max_cached_requests=1)
' "$1" >/dev/null 2>&1
}

if imports "$dest"; then
    echo "$dest"
    exit 0
fi

# One build at a time; a second caller waits, then finds the result.
exec 9>"$cache/.suffix_decoding.lock"
flock 9
if imports "$dest"; then
    echo "$dest"
    exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/suffix_decoding.XXXXXX")
stage=
cleanup() { rm -rf "$work" ${stage:+"$stage"}; }
trap cleanup EXIT

pip=("$python" -m pip --disable-pip-version-check --quiet)
log "downloading the arctic-inference==$VERSION source archive"
# pip prepares the archive's metadata; with the venv's own setuptools and torch
# (--no-build-isolation) that takes seconds instead of installing torch again.
"${pip[@]}" download --no-deps --no-build-isolation "arctic-inference==$VERSION" -d "$work/dl" >&2 2>/dev/null \
    || "${pip[@]}" download --no-deps "arctic-inference==$VERSION" -d "$work/dl" >&2
sdist=$work/dl/arctic_inference-$VERSION.tar.gz
[ -f "$sdist" ] || { log "pip did not save $sdist"; exit 1; }
echo "$SDIST_SHA256  $sdist" | sha256sum --check --status \
    || { log "sha256 of $sdist differs from $SDIST_SHA256"; exit 1; }
tar -xzf "$sdist" -C "$work"
src=$work/arctic_inference-$VERSION

log "installing nanobind==$NANOBIND into the work dir"
"${pip[@]}" install --target "$work/nanobind" "nanobind==$NANOBIND" >&2
nanobind_dir=$(PYTHONPATH="$work/nanobind" "$python" -m nanobind --cmake_dir)

# ninja: the system's, else pip's in the venv.
PATH=$PATH:$venv/bin
command -v cmake >/dev/null || { log "cmake not found"; exit 1; }
command -v ninja >/dev/null || { log "ninja not found (apt install ninja-build, or pip install ninja into $venv)"; exit 1; }

log "building $src/csrc/suffix_decoding"
PYTHONPATH="$work/nanobind" cmake -S "$src/csrc/suffix_decoding" -B "$work/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$python" -Dnanobind_DIR="$nanobind_dir" >&2
ninja -C "$work/build" >&2
built=$(find "$work/build" -maxdepth 1 -name '_C*.so' | head -n 1)
[ -n "$built" ] || { log "the build produced no _C*.so"; exit 1; }

# Assemble beside DEST, check it imports, then swap it in.
stage=$(mktemp -d "$cache/suffix_decoding.new.XXXXXX")
package=$stage/arctic_inference/suffix_decoding
mkdir -p "$package"
: > "$stage/arctic_inference/__init__.py"
cp "$src"/arctic_inference/suffix_decoding/{__init__,cache,simulator}.py "$built" "$package/"
cp "$src/LICENSE" "$stage/arctic_inference/LICENSE"
imports "$stage" || { log "the built module does not import"; exit 1; }
rm -rf "$dest"
mv "$stage" "$dest"
stage=
imports "$dest" || { log "$dest does not import after the move"; exit 1; }
log "built in $dest"
echo "$dest"
