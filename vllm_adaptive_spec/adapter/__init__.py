"""The one adapter that touches vLLM internals.

Every import of a vLLM internal and every patch of a vLLM object lives under
this package. :func:`compatibility_problem` checks, at load time, the installed
vLLM version and that every hook the adapter uses exists; when either check
fails the plugin refuses with one clear line and registers nothing.
"""

from __future__ import annotations

import importlib

from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = "0.32.0"
# vLLM's CUDA attention backends with a tree path (``attention_cuda``).
CUDA_TREE_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")

# "module:attribute.path" of the vLLM internals the adapter relies on. The
# config hooks are checked when the plugin loads, in every vLLM process; the
# engine hooks (heavier modules) when adaptive_tree is selected: those every
# platform shares, then the platform's own (its worker, runner and attention).
CONFIG_HOOKS: tuple[str, ...] = (
    "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
    "vllm.config.speculative:SpeculativeConfig",
    "vllm.plugins:load_general_plugins",
    "vllm.sampling_params:SamplingParams._validate_spec_decode",
)
ENGINE_HOOKS: tuple[str, ...] = (
    "vllm.v1.attention.backends.registry:register_backend",
    "vllm.v1.attention.selector:_cached_get_attn_backend",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
    "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.dispatch",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._determine_batch_execution_and_padding",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._get_slot_mapping",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._set_positions",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._get_positions",
    "vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p",
    "vllm.v1.sample.logits_processor:BUILTIN_LOGITS_PROCESSORS",
    "vllm.v1.sample.logits_processor:LogitsProcessors",
    "vllm.utils.torch_utils:PIN_MEMORY",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.take_draft_token_ids",
    "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
    "vllm.v1.core.sched.scheduler:Scheduler.get_grammar_bitmask",
    "vllm.v1.structured_output:StructuredOutputManager._fill_bitmasks",
    "vllm.v1.structured_output:StructuredOutputManager._get_constraint_bounds",
    "vllm.v1.core.sched.output:GrammarOutput",
    "vllm.v1.outputs:DraftTokenIds",
)
PLATFORM_HOOKS: dict[str, tuple[str, ...]] = {
    "cpu": (
        "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_impl_cls",
        "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_builder_cls",
        "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner.initialize_kv_cache",
        "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder._set_isa_to_layers",
        "vllm.v1.worker.cpu_worker:CPUWorker.init_device",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
    ),
    "cuda": (
        "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend.get_impl_cls",
        "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward",
        "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend.get_impl_cls",
        "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl.forward",
        "vllm.v1.worker.gpu_worker:Worker._make_model_runner",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._warmup_and_capture",
        "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.initialize_cudagraph_keys",
        "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher._create_padded_batch_descriptor",
        "vllm.forward_context:BatchDescriptor",
    ),
}


def engine_hooks(platform: str) -> tuple[str, ...]:
    """Every engine hook the adapter needs on ``platform`` ("cpu" or "cuda")."""
    return ENGINE_HOOKS + PLATFORM_HOOKS[platform]


def installed_vllm_version() -> str:
    from vllm import __version__

    return __version__


def compatibility_problem(version: str | None = None) -> str | None:
    """Why the plugin cannot run on the installed vLLM, or None if it can."""
    found = installed_vllm_version() if version is None else version
    try:
        release = Version(found).release[:3]
    except InvalidVersion:
        release = None
    if release != Version(SUPPORTED_VLLM).release:
        return (
            f"vllm-adaptive-spec needs vLLM {SUPPORTED_VLLM} but found vLLM {found}; "
            "the adaptive_tree method is not registered"
        )
    missing = missing_hooks(CONFIG_HOOKS)
    if missing:
        return (
            f"vllm-adaptive-spec cannot find the vLLM {found} internals it hooks "
            f"({', '.join(missing)}); the adaptive_tree method is not registered"
        )
    return None


def missing_hooks(hooks: tuple[str, ...]) -> list[str]:
    return [hook for hook in hooks if not _hook_exists(hook)]


def _hook_exists(hook: str) -> bool:
    module_name, _, path = hook.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError:
        return False
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True
