"""The KV cache size an engine needs, computed from the run instead of taken
as a share of the machine's memory.

vLLM's CPU worker otherwise sizes the cache as ``gpu_memory_utilization``
times the memory of NUMA node 0 minus its own RSS; what node 0 reports varies
between machines and during a run, so an engine started that way may fail on
one machine and not on another. Every engine this project starts passes
:func:`kv_cache_bytes` as vLLM's ``kv_cache_memory_bytes`` instead.

The size: ``max_num_seqs`` requests, each holding ``max_model_len`` tokens plus
the speculative lookahead vLLM reserves per request (``num_speculative_tokens``,
or for ``adaptive_tree`` the tree scratch of
:meth:`~vllm_adaptive_spec.config.TreeConfig.draft_slots`), rounded up to
whole blocks, in every layer of the target and of the draft model (an EAGLE-3
head's or a draft LM's layers share the target's block table). Margin: one
more block per request, vLLM's reserved null block, then 10% on top, rounded
up to a MiB.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

MARGIN = 0.10
MIB = 1 << 20
# The share of a CUDA device an engine asks vLLM for at startup (its KV cache is sized explicitly).
DEVICE_SHARE = 0.1
# vLLM's default block size on the CPU platform; on a GPU it is 16, so this
# overestimates there (whole blocks of 128 round up more).
DEFAULT_BLOCK_SIZE = 128
# Lookahead assumed for a native method that leaves num_speculative_tokens unset.
DEFAULT_LOOKAHEAD = 64
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
DRAFT_MODEL_METHODS = frozenset({"eagle", "eagle3", "draft_model", "medusa", "mtp"})


@dataclass(frozen=True)
class KVShape:
    """The attention layers of one model: ``layers`` x ``kv_heads`` x ``head_dim``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    def token_bytes(self, dtype_bytes: int) -> int:
        """K and V of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def model_kv_shape(model: str | Path) -> KVShape:
    """Read a Hugging Face ``config.json`` (a model directory or the file)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json for model {str(model)!r}: the KV cache size needs a local model")
    config = json.loads(path.read_text(encoding="utf-8"))
    heads = config["num_attention_heads"]
    return KVShape(
        layers=config["num_hidden_layers"],
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
    )


def _lookahead_and_draft(speculative_config: dict | None) -> tuple[int, str | None]:
    """Lookahead KV slots vLLM reserves per request, and the draft model that
    gets KV layers of its own (None when there is none)."""
    if not speculative_config:
        return 0, None
    method = speculative_config.get("method")
    if method == "adaptive_tree":
        from vllm_adaptive_spec.config import DRAFTERS_NEEDING_MODEL, parse_tree_config

        tree = parse_tree_config(speculative_config)
        draft = speculative_config["model"] if tree.drafter in DRAFTERS_NEEDING_MODEL else None
        return tree.draft_slots(), draft
    lookahead = speculative_config.get("num_speculative_tokens") or DEFAULT_LOOKAHEAD
    return lookahead, speculative_config.get("model") if method in DRAFT_MODEL_METHODS else None


def kv_cache_bytes(
    model: str | Path,
    *,
    max_model_len: int,
    max_num_seqs: int,
    dtype: str = "auto",
    speculative_config: dict | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> int:
    """Bytes of KV cache for ``max_num_seqs`` requests of ``max_model_len``
    tokens (see the module docstring for what is counted and the margin)."""
    target = model_kv_shape(model)
    dtype = target.dtype if dtype == "auto" else dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    lookahead, draft = _lookahead_and_draft(speculative_config)
    token_bytes = target.token_bytes(DTYPE_BYTES[dtype])
    if draft is not None:
        token_bytes += model_kv_shape(draft).token_bytes(DTYPE_BYTES[dtype])
    blocks_per_seq = math.ceil((max_model_len + lookahead) / block_size) + 1
    blocks = max_num_seqs * blocks_per_seq + 1
    needed = blocks * block_size * token_bytes * (1 + MARGIN)
    return math.ceil(needed / MIB) * MIB


def engine_kwargs(
    model: str,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    speculative_config: dict | None = None,
    block_size: int | None = None,
    attention_backend: str | None = None,
) -> dict:
    """``LLM(...)`` settings for a small offline engine of this project, with
    the KV cache sized explicitly. On the CPU the engine runs eagerly (vLLM's
    compilation costs more than it saves there); with CUDA vLLM's default
    compilation and CUDA graphs stay on, and the engine asks vLLM for only
    ``DEVICE_SHARE`` of the device at startup. ``attention_backend``: vLLM's choice
    when None (CUDA only; the CPU platform always uses ``CPU_ATTN``)."""
    import torch

    size = kv_cache_bytes(
        model,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        dtype=dtype,
        speculative_config=speculative_config,
        block_size=block_size or DEFAULT_BLOCK_SIZE,
    )
    kwargs = dict(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=not torch.cuda.is_available(),
        kv_cache_memory_bytes=size,
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative_config,
    )
    if torch.cuda.is_available():
        # vLLM refuses to start unless this share of the device is free; with the
        # cache sized above it asks for nothing else, so several engines share a GPU.
        kwargs["gpu_memory_utilization"] = DEVICE_SHARE
    if block_size is not None:
        kwargs["block_size"] = block_size
    if attention_backend is not None:
        kwargs["attention_backend"] = attention_backend
    return kwargs


def available_memory() -> int | None:
    """Host memory available to new engines (the system's ``MemAvailable``),
    or None where engines live on a GPU or the figure is unknown."""
    import torch

    return None if torch.cuda.is_available() else _meminfo("/proc/meminfo", ("MemAvailable",))


def kv_limit() -> int | None:
    """The largest explicit KV cache vLLM's CPU worker accepts, or None where
    engines live on a GPU or the figure is unknown: the free, file-backed and
    reclaimable memory of the NUMA node of the first CPU this process may run
    on, which vLLM checks the cache against. It can be far below the system's
    figure (a machine reported a node of 9 GiB in 23), whatever the system has."""
    import torch

    if torch.cuda.is_available():
        return None
    cpu = min(os.sched_getaffinity(0))
    nodes = [name for name in _listdir(f"/sys/devices/system/cpu/cpu{cpu}") if name.startswith("node")]
    if not nodes:
        return None
    return _meminfo(f"/sys/devices/system/node/{nodes[0]}/meminfo",
                    ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _meminfo(path: str, keys: tuple[str, ...]) -> int | None:
    """The sum of ``keys`` (kB lines, ``Node N`` prefixes allowed) in a meminfo file, in bytes."""
    try:
        with open(path, encoding="utf-8") as handle:
            fields = {line.split(":")[0].split()[-1]: line.split(":")[1].split()[0] for line in handle if ":" in line}
        return sum(int(fields[key]) for key in keys) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def fitting_seqs(model: str | Path, max_model_len: int, wanted: int, dtype: str = "auto", reserve: int = 2 << 30) -> int:
    """The most requests, at most ``wanted`` and halving from it, whose KV
    cache (:func:`kv_cache_bytes`) vLLM accepts (:func:`kv_limit`) and
    leaves ``reserve`` bytes of :func:`available_memory` for the engine's
    weights and runtime; at least 1."""
    system = available_memory()
    limits = [limit for limit in (kv_limit(), None if system is None else system - reserve) if limit is not None]
    seqs = wanted
    while limits and seqs > 1 and kv_cache_bytes(model, max_model_len=max_model_len, max_num_seqs=seqs,
                                                 dtype=dtype) > min(limits):
        seqs //= 2
    return seqs
