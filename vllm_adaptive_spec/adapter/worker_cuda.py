"""The CUDA worker that hosts the tree model runner (selected through
``ParallelConfig.worker_cls`` by the config hook): vLLM's GPU ``Worker``
building the V1 ``GPUModelRunner`` with the tree hooks (the config hook
turns the V2 runner off in every process) and FULL CUDA graphs for
draft-free decode steps and uniform tree steps (``cudagraphs``). ``FLASH_ATTN`` and ``TRITON_ATTN``
are re-registered to their tree-aware subclasses before any attention layer
exists in this process.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_adaptive_spec.adapter import CUDA_TREE_BACKENDS
from vllm_adaptive_spec.adapter.attention_cuda import cache_views, register_tree_backends
from vllm_adaptive_spec.adapter.cudagraphs import DecodeGraphsMixin
from vllm_adaptive_spec.adapter.runner import TreeRunnerMixin
from vllm_adaptive_spec.adapter.worker import TreeWorkerMixin


class TreeGPUModelRunner(DecodeGraphsMixin, TreeRunnerMixin, GPUModelRunner):
    kv_views = staticmethod(cache_views)
    tree_backends = CUDA_TREE_BACKENDS


class TreeGPUWorker(TreeWorkerMixin, Worker):
    def __init__(self, *args, **kwargs) -> None:
        register_tree_backends()
        super().__init__(*args, **kwargs)

    def _make_model_runner(self) -> TreeGPUModelRunner:
        return TreeGPUModelRunner(self.vllm_config, self.device)
