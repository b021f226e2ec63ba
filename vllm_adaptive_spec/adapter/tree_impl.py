"""What the tree-aware attention impls of every platform share.

:class:`TreeImplMixin` goes before a vLLM attention impl (``CPU_ATTN``,
``FLASH_ATTN``, ``TRITON_ATTN``). vLLM's kernels take no per-request mask, so
in a pass that carries branching trees (:mod:`~vllm_adaptive_spec.step.tree_step`)
the stock kernel computes every row as usual, then the rows of those
requests are recomputed by the platform's tree path (:meth:`tree_forward`)
and overwritten. When every row of the pass belongs to such a tree, only the
tree path runs; so does it where the platform's tree path computes a whole
pass at the stock kernel's cost (:meth:`pass_forward`: the CPU's native op,
its causal rows as masks). Otherwise rows without a tree, causal rows and
chains (exact under a causal kernel, since a chain's depth positions are
sequential) never leave the stock kernel.

A uniform tree step that CUDA graphs replay (``UniformRows`` published) is
different: every row of the pass takes the platform's graph-safe tree launch
(:meth:`uniform_forward`), and the stock kernel does not run (its KV writes
are vLLM's separate cache update on these backends).
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.selector import _cached_get_attn_backend

from vllm_adaptive_spec.step import tree_step

NO_WINDOW = (None, -1, (-1, -1))


class TreeImplMixin:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        unsupported = {
            "sliding window": self.sliding_window not in NO_WINDOW,
            "ALiBi": self.alibi_slopes is not None,
            "logits soft-cap": bool(self.logits_soft_cap),
            "attention sinks": getattr(self, "sinks", None) is not None,
            "quantized KV cache": is_quantized_kv_cache(self.kv_cache_dtype),
        }
        found = [name for name, present in unsupported.items() if present]
        if found and self.attn_type == AttentionType.DECODER:
            raise ValueError(f"adaptive_tree tree attention does not support {', '.join(found)} yet")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        step = tree_step.current()
        if step is None:  # nothing published (no tree this step): the stock kernel, without the checks below
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        uniform = tree_step.uniform_rows(step)
        if uniform is not None and attn_metadata is not None and self.attn_type == AttentionType.DECODER:
            if output_scale is not None:
                raise NotImplementedError("adaptive_tree's uniform steps do not support quantized attention output")
            result = self.uniform_forward(query, kv_cache, attn_metadata, uniform)
            output.view(query.shape[0], self.num_heads, -1).copy_(result)
            return output
        rows = step if isinstance(step, tree_step.DraftStep) else getattr(step, "attention", None)
        if attn_metadata is None or self.attn_type != AttentionType.DECODER:
            rows = None
        if rows is not None and output_scale is None:
            whole = self.pass_forward(query, kv_cache, attn_metadata, rows)
            if whole is not None:
                num_rows = attn_metadata.num_actual_tokens
                output[:num_rows].view(num_rows, self.num_heads, -1).copy_(whole)
                return output
        rows_only = (
            rows is not None
            and rows.query_rows.shape[0] == attn_metadata.num_actual_tokens
            and output_scale is None
        )
        if not rows_only:
            output = super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if rows is None:
            return output
        result = self.tree_forward(query[rows.query_rows], kv_cache, attn_metadata, rows)
        output.view(query.shape[0], self.num_heads, -1)[rows.query_rows] = result.to(output.dtype)
        return output

    def uniform_forward(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata, rows) -> torch.Tensor:
        """``[T, Hq, D]`` attention of every row of a uniform tree step
        (:class:`~vllm_adaptive_spec.step.tree_step.UniformRows`), with a
        launch a CUDA graph can replay; platforms without graphs never see one."""
        raise NotImplementedError

    def pass_forward(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata, rows) -> torch.Tensor | None:
        """``[T, Hq, D]`` attention of every row of a pass carrying tree rows
        ``rows``, its other rows causal, where the platform's tree path
        computes them all at the stock kernel's cost (else None: the stock
        kernel runs, then :meth:`tree_forward` recomputes the tree rows)."""
        return None

    def tree_forward(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata, rows) -> torch.Tensor:
        """``[T, Hq, D]`` attention of the tree rows ``query`` (rows
        :class:`~vllm_adaptive_spec.step.tree_step.AttentionRows` or a
        :class:`~vllm_adaptive_spec.step.tree_step.DraftStep`) over the layer's cache."""
        raise NotImplementedError


def check_tree_backends(vllm_config, supported: tuple[str, ...]) -> None:
    """Refuse a model any of whose attention layers (target or draft) vLLM
    gave a backend without a tree path, naming the backends that have one."""
    others = set()
    for name, layer in vllm_config.compilation_config.static_forward_context.items():
        impl = getattr(layer, "impl", None)
        if impl is not None and not isinstance(impl, TreeImplMixin):
            backend = getattr(layer, "attn_backend", None)
            others.add(backend.get_name() if backend is not None else type(impl).__name__)
    if others:
        raise ValueError(
            f"adaptive_tree: vLLM chose the attention backend(s) {', '.join(sorted(others))}, which have no tree "
            f"path; supported here: {', '.join(supported)} (set attention_backend to one of them)"
        )


def register_tree_backend(name: str, backend_path: str) -> None:
    """Point vLLM's attention backend ``name`` at the tree-aware
    ``backend_path`` in this process, and forget vLLM's cached backend
    choices: an engine without speculation opened earlier in the same
    process (the demo, lockstep benchmarks) left the stock class cached,
    which this engine would otherwise get, and be refused."""
    register_backend(AttentionBackendEnum[name], backend_path)
    _cached_get_attn_backend.cache_clear()
