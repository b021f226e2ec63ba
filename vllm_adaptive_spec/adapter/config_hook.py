"""Route ``method="adaptive_tree"`` through vLLM's stock config.

``EngineArgs.create_speculative_config`` is the only place vLLM builds a
``SpeculativeConfig``; the wrapper validates the plugin's keys there, hands
vLLM a native method that loads what the drafter needs (retrieval ->
``custom_class`` with the plugin's proposer; eagle3 -> ``eagle3`` and
draft_model -> ``draft_model`` (hybrid: its ``base``), so vLLM loads the weights, captures the
auxiliary hidden states and gives the draft layers KV in the paged cache),
selects the plugin's worker and
carries the tree settings, as a plain dict, in
``VllmConfig.additional_config["adaptive_tree"]`` (it survives pickling to the
engine core and workers, where plugins load only after unpickling).

Decision (prefix caching with an EAGLE-3 head): vLLM drops the last block of
every prefix-cache hit for EAGLE methods and recomputes it, because the draft
KV at the block's last position was written with the token that followed it
then, which a new prompt may not share. For a tree drafter that costs more
than it saves: verification is exact, so that one position can only change
drafts, never output; while the load budget pauses the head it drafts nothing
at all; and the recomputed block is up to 128 prompt tokens on the CPU (16 on
CUDA) for every request with a hit (a server of repeated prompts and shared
system prompts kept a third of its hits with the drop). So the hook sets
vLLM's ``disable_eagle_block_drop`` unless the user's config sets it.
"""

from __future__ import annotations

import functools
import os

from vllm_adaptive_spec.adapter import CUDA_TREE_BACKENDS, engine_hooks, missing_hooks, sampling_controls
from vllm_adaptive_spec.config import METHOD, TreeConfig, TreeConfigError, parse_tree_config

ADDITIONAL_CONFIG_KEY = "adaptive_tree"
PROPOSER_CLASS = "vllm_adaptive_spec.adapter.proposer.TreeProposer"
SCHEDULER = "vllm_adaptive_spec.adapter.tree_scheduler.TreeScheduler"
WORKERS = {
    "cpu": "vllm_adaptive_spec.adapter.worker_cpu.TreeCPUWorker",
    "cuda": "vllm_adaptive_spec.adapter.worker_cuda.TreeGPUWorker",
}
NATIVE_METHOD = {None: "custom_class", "eagle3": "eagle3", "draft_model": "draft_model"}


def tree_config_of(vllm_config) -> TreeConfig | None:
    """The tree settings of an engine, or None when adaptive_tree is not selected."""
    data = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    return None if data is None else TreeConfig.from_dict(data)


def install() -> None:
    from vllm.engine.arg_utils import EngineArgs

    sampling_controls.install()

    original = EngineArgs.create_speculative_config
    if getattr(original, "_adaptive_tree_wrapper", False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        method = (spec or {}).get("method")
        if spec is None or method != METHOD:
            if spec is not None and "tree" in spec:
                raise TreeConfigError(
                    f"speculative_config['tree'] is only valid with method={METHOD!r}, got method={method!r}"
                )
            return original(self, target_model_config, target_parallel_config)

        tree = parse_tree_config(spec)
        platform = _platform()
        _check_engine_args(self, spec, platform)
        missing = missing_hooks(engine_hooks(platform))
        if missing:
            raise TreeConfigError(
                f"method={METHOD!r} cannot run on this vLLM: missing internals {', '.join(missing)}"
            )
        self.speculative_config = _native_spec(spec, tree)
        try:
            result = original(self, target_model_config, target_parallel_config)
        finally:
            self.speculative_config = spec
        sampling_controls.mark_tree_speculation(result)
        _select_tree_engine(self, tree, WORKERS[platform], target_parallel_config)
        return result

    create_speculative_config._adaptive_tree_wrapper = True
    EngineArgs.create_speculative_config = create_speculative_config


def _native_spec(spec: dict, tree) -> dict:
    """The speculative config vLLM builds its own proposer from: the tree's
    model kind's native method (the retrieval drafter as a custom class)."""
    native = {k: v for k, v in spec.items() if k != "tree"}
    native["method"] = NATIVE_METHOD[tree.model_kind]
    if native["method"] == "custom_class":
        native["model"] = PROPOSER_CLASS
    else:
        # vLLM reserves this many lookahead KV slots per request: the
        # drafter's scratch while growing (its tree nodes).
        native["num_speculative_tokens"] = tree.draft_slots()
    if native["method"] == "eagle3":
        native.setdefault("disable_eagle_block_drop", True)
    return native


def _select_tree_engine(engine_args, tree, worker_cls: str, target_parallel_config) -> None:
    """The engine parts a tree needs, set on the engine's arguments: the tree
    config for the workers, the tree worker and scheduler, synchronous
    scheduling and vLLM's V1 runner."""
    engine_args.additional_config = {**(engine_args.additional_config or {}), ADDITIONAL_CONFIG_KEY: tree.to_dict()}
    target_parallel_config.worker_cls = worker_cls
    # Grammar drafts and masks per tree node (``tree_scheduler``).
    engine_args.scheduler_cls = SCHEDULER
    # The runner drafts after each step's bookkeeping (vLLM's synchronous order).
    engine_args.async_scheduling = False
    # The tree hooks live in the V1 model runner; every process must agree.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def _platform() -> str:
    """"cpu" or "cuda": the platforms with a tree worker; any other is refused."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    raise TreeConfigError(
        f"method={METHOD!r} runs on vLLM's CPU and CUDA platforms, not on {current_platform.device_name!r}"
    )


def _backend_name(backend) -> str | None:
    return getattr(backend, "name", backend)


def _check_engine_args(args, spec: dict, platform: str) -> None:
    """Refuse engine settings the tree path does not support."""
    if args.pipeline_parallel_size > 1:
        raise TreeConfigError(f"method={METHOD!r} does not support pipeline parallelism (pipeline_parallel_size > 1)")
    if args.kv_transfer_config is not None:
        raise TreeConfigError(f"method={METHOD!r} does not support KV connectors (kv_transfer_config)")
    if args.worker_cls not in ("auto", *WORKERS.values()):
        raise TreeConfigError(f"method={METHOD!r} needs its own worker; remove worker_cls={args.worker_cls!r}")
    if args.scheduler_cls not in (None, SCHEDULER):
        raise TreeConfigError(f"method={METHOD!r} needs its own scheduler; remove scheduler_cls={args.scheduler_cls!r}")
    if args.async_scheduling:
        raise TreeConfigError(
            f"method={METHOD!r} does not support async_scheduling=True (it drafts after each step's bookkeeping); "
            "leave async_scheduling unset or False"
        )
    if platform == "cuda":
        requested = {
            "attention_backend": _backend_name(args.attention_backend),
            "attention_config.backend": _backend_name(getattr(args.attention_config, "backend", None)),
            "speculative_config['attention_backend']": _backend_name(spec.get("attention_backend")),
        }
        for key, name in requested.items():
            if name is not None and str(name).upper() not in (*CUDA_TREE_BACKENDS, "AUTO"):
                raise TreeConfigError(
                    f"method={METHOD!r} on CUDA needs an attention backend with a tree path: {key} must be one of "
                    f"{', '.join(repr(b) for b in CUDA_TREE_BACKENDS)}, got {name!r}"
                )
