"""The native CPU library: the plugin's C++ ops for vLLM's CPU platform,
one library per instruction set, built on first use and cached.

It holds the tree attention (``tree_attention_cpu.cpp``), the tree
acceptance (``tree_acceptance_cpu.cpp``), the KV compaction
(``kv_compaction_cpu.cpp``) and the retrieval drafter's index and tries
(``retrieval_trie_cpu.cpp``), each beside its reference and module
(:mod:`kernels.tree_attention_cpu`, :mod:`kernels.tree_acceptance_cpu`,
:mod:`kernels.kv_compaction`, :mod:`kernels.retrieval_trie_cpu`), so that
one build, one warning and one setting serve them all.

The sources compile as one unit (``cpu_library.cpp``): torch's
headers and its registration templates are most of each source's compile
time, so together they cost about what one does.

Decision: compiled on first use with ``torch.utils.cpp_extension.load``
(ATen and ``torch/library.h`` only, no pybind: about 12 s with g++ 12 for them all) into
torch's extension cache, rather than at install: a ``setup.py`` build would
run in pip's isolated environment against another torch, and on the machine
that builds rather than the one that runs. One library per instruction set
(AVX-512, AVX2, the baseline), its vectors sized to it: a 64-byte vector
compiled without AVX-512 runs many times slower.

``VLLM_ADAPTIVE_SPEC_CPU_ATTENTION`` picks the path: ``auto`` (the default:
the native ops, or the torch paths with one warning where they cannot be
built, say without a compiler), ``native`` (an error where they cannot be
built) or ``torch``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

SETTING = "VLLM_ADAPTIVE_SPEC_CPU_ATTENTION"
# The native sources, compiled as one unit (``cpu_library.cpp`` includes them).
SOURCES = tuple(Path(__file__).with_name(name) for name in ("tree_attention_cpu.cpp", "tree_acceptance_cpu.cpp",
                                                              "kv_compaction_cpu.cpp", "retrieval_trie_cpu.cpp"))
UNIT = Path(__file__).with_name("cpu_library.cpp")
logger = logging.getLogger(__name__)


class Build(NamedTuple):
    """One instruction set's library: compiler flags, floats a vector, and
    the register tile of its matrix products (rows, vectors)."""

    flags: tuple[str, ...]
    vector: int
    tile_rows: int
    tile_vectors: int


BUILDS = {
    "avx512": Build(("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"), 16, 6, 4),
    "avx2": Build(("-mavx2", "-mfma"), 8, 4, 2),
    "baseline": Build((), 4, 4, 2),
}


@functools.cache
def machine_isa() -> str:
    """The widest of :data:`BUILDS` this machine runs (torch's own reading of the CPU)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "baseline")


def setting() -> str:
    """The path asked for: ``auto``, ``native`` or ``torch``."""
    value = os.environ.get(SETTING, "auto").strip().lower() or "auto"
    if value not in ("auto", "native", "torch"):
        raise ValueError(f"{SETTING}={value!r}: expected auto, native or torch")
    return value


@functools.cache
def module(isa: str):
    """Compile (or find cached) the library for ``isa`` and import it: a
    Python module (the retrieval tries' type) whose ops torch registers as it loads."""
    from torch.utils import cpp_extension

    spec = BUILDS[isa]
    # torch rebuilds when the unit or the flags change; the digest makes a change to an included source one.
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES)).hexdigest()[:16]
    defines = [f"-DTREE_VEC={spec.vector}", f"-DTREE_MR={spec.tile_rows}", f"-DTREE_NV={spec.tile_vectors}",
               f"-DTREE_NS={namespace(isa)}", f"-DTREE_SOURCES={digest}"]
    quiet = io.StringIO()  # the compiler's and torch's chatter: a failure is reported in one line below
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), _environment_tools_first():
        return cpp_extension.load(name=f"adaptive_tree_cpu_{isa}", sources=[str(UNIT)],
                                  extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", *spec.flags, *defines],
                                  extra_ldflags=["-fopenmp"], is_python_module=True, verbose=False)


def namespace(isa: str) -> str:
    """The torch ops namespace of ``isa``'s library."""
    return f"adaptive_tree_{isa}"


def library(isa: str):
    """The ops of ``isa``'s library (built and loaded by :func:`module`)."""
    module(isa)
    return getattr(torch.ops, namespace(isa))


@contextlib.contextmanager
def _environment_tools_first():
    """``PATH`` with this interpreter's own ``bin`` first, while torch builds.

    Decision: ninja records a hash of each command it ran, and two ninja
    versions (a virtual environment's from PyPI, the system's) do not read
    each other's records: a process that found the other one on ``PATH``
    (an activated environment, or not) rebuilt the cached library, about
    9 s of a core each time the two alternated. With the environment's tools
    first, every process of one environment builds with the same ninja."""
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


def native_module():
    """This process's library as a Python module, or None where it uses the torch paths
    (:func:`native_library`)."""
    return None if native_library() is None else module(machine_isa())


@functools.cache
def native_library():
    """The library this process uses, or None for the torch paths (by
    :func:`setting`; ``auto`` warns once where the build fails)."""
    chosen = setting()
    if chosen == "torch":
        return None
    try:
        return library(machine_isa())
    except Exception as error:  # no compiler, no ninja, a failed build: all leave the torch path
        if chosen == "native":
            raise RuntimeError(f"{SETTING}=native, but the native CPU library did not build: "
                               f"{_first_line(error)}") from error
        logger.warning("adaptive_tree: native CPU library unavailable (%s); using the torch paths and the "
                       "Python trie (set %s=torch to skip the build)", _first_line(error), SETTING)
        return None


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
