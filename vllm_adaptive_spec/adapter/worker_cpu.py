"""The CPU worker that hosts the tree model runner (selected through
``ParallelConfig.worker_cls`` by the config hook).

The CPU worker builds its model runner inline in ``init_device``; the
override lets it build, then swaps in the tree runner (weights load later, so
only buffers are built twice). The ``CPU_ATTN`` name is re-registered to the
tree-aware backend before any attention layer exists in this process.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_adaptive_spec.adapter.cpu_cache_layout import cache_views
from vllm_adaptive_spec.adapter.runner import TreeRunnerMixin
from vllm_adaptive_spec.adapter.tree_impl import register_tree_backend
from vllm_adaptive_spec.adapter.worker import TreeWorkerMixin


class TreeCPUModelRunner(TreeRunnerMixin, CPUModelRunner):
    kv_views = staticmethod(cache_views)
    tree_backends = ("CPU_ATTN",)


class TreeCPUWorker(TreeWorkerMixin, CPUWorker):
    def __init__(self, *args, **kwargs) -> None:
        register_tree_backend("CPU_ATTN", "vllm_adaptive_spec.adapter.attention_cpu.TreeCPUAttentionBackend")
        super().__init__(*args, **kwargs)

    def init_device(self) -> None:
        super().init_device()
        self.model_runner = TreeCPUModelRunner(self.vllm_config, torch.device("cpu"))
