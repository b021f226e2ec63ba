"""A bad adaptive_tree config fails at startup, naming the key and the choices."""

from __future__ import annotations


import pytest

from conftest import HEAD
from vllm_adaptive_spec.config import TreeConfigError

GOOD_TREE = {"drafter": "retrieval", "policy": "retrieval"}


def build_config(demo_model, speculative_config):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=demo_model, max_model_len=1024, speculative_config=speculative_config)
    return args, args.create_engine_config()


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"num_speculative_tokens": 8, "tree": {"drafter": "eagle9"}}, r"\['tree'\]\['drafter'\] must be one of 'draft_model', 'eagle3', 'hybrid', 'retrieval', got 'eagle9'"),
        (
            {"num_speculative_tokens": 8, "tree": {"drafter": "retrieval", "policy": "talon"}},
            r"\['tree'\]\['policy'\] must be one of 'chain', 'retrieval' with drafter 'retrieval', got 'talon'",
        ),
        (
            {"num_speculative_tokens": 8, "tree": {**GOOD_TREE, "depth": 3}},
            r"unknown key\(s\) \['depth'\].*'drafter', 'evidence_prior', 'grammar_forcing', 'l_max', 'l_min', 'load_budget', 'matcher', 'max_depth', 'max_matches', 'min_p', 'policy'",
        ),
        ({"num_speculative_tokens": 8, "tree": {**GOOD_TREE, "l_max": 0}}, r"\['tree'\]\['l_max'\] must be an integer >= 1, got 0"),
        ({"num_speculative_tokens": 8, "tree": {**GOOD_TREE, "datastore": "global"}}, r"\['tree'\]\['datastore'\] must be one of 'off', 'shared', got 'global'"),
        (
            {"num_speculative_tokens": 8, "tree": {**GOOD_TREE, "corpus": "/nonexistent/corpus.txt"}},
            r"\['tree'\]\['corpus'\] must be the path of a readable text file, or '' for none, got '/nonexistent/corpus.txt'",
        ),
        ({"num_speculative_tokens": 0, "tree": GOOD_TREE}, r"\['num_speculative_tokens'\] must be an integer from 1 to 128"),
        ({"num_speculative_tokens": 8}, r"\['tree'\] must be a dict"),
        ({"num_speculative_tokens": 8, "model": "x", "tree": GOOD_TREE}, r"\['model'\] is not used by tree drafter 'retrieval'"),
        ({"num_speculative_tokens": 8, "tree": {**GOOD_TREE, "step_shape": "padded"}},
         r"\['tree'\]\['step_shape'\] must be one of 'auto', 'ragged', 'uniform', got 'padded'"),
        ({"num_speculative_tokens": 8, "tree": {**GOOD_TREE, "draft_loop": "padded"}},
         r"\['tree'\]\['draft_loop'\] must be one of 'auto', 'fixed', 'ragged', got 'padded' \(it is replaced by 'step_shape'\)"),
        ({"num_speculative_tokens": 8, "tree": {**GOOD_TREE, "step_shape": "ragged", "uniform_steps": "on"}},
         r"gives 'step_shape' and \['uniform_steps'\], which it replaces; give 'step_shape' only"),
        ({"num_speculative_tokens": 8, "tree": {**GOOD_TREE, "uniform_steps": "on", "draft_loop": "ragged"}},
         r"\['uniform_steps', 'draft_loop'\] disagree \(\['ragged', 'uniform'\]\); give 'step_shape' only"),
    ],
)
def test_bad_config_is_refused_before_the_engine_starts(demo_model, spec, message):
    with pytest.raises(TreeConfigError, match=message):
        build_config(demo_model, {"method": "adaptive_tree", **spec})


def test_tree_key_needs_adaptive_tree(demo_model):
    with pytest.raises(TreeConfigError, match=r"\['tree'\] is only valid with method='adaptive_tree', got method='ngram'"):
        build_config(demo_model, {"method": "ngram", "num_speculative_tokens": 4, "tree": GOOD_TREE})


def test_good_config_reaches_vllm_as_a_stock_config(demo_model):
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 8, "tree": dict(GOOD_TREE)}
    args, config = build_config(demo_model, spec)
    assert config.speculative_config.method == "custom_class"
    assert config.speculative_config.num_speculative_tokens == 8
    assert config.parallel_config.worker_cls == "vllm_adaptive_spec.adapter.worker_cpu.TreeCPUWorker"
    assert config.additional_config["adaptive_tree"]["drafter"] == "retrieval"
    assert config.additional_config["adaptive_tree"]["drafter_params"]["l_max"] == 8
    assert args.speculative_config == spec, "the user's dict was changed"


@pytest.mark.parametrize("drafter", ["eagle3", "hybrid"])
def test_an_eagle3_head_keeps_the_last_prefix_cache_block(demo_model, drafter):
    """vLLM drops and recomputes the last block of an EAGLE prefix-cache hit;
    the plugin keeps it (see ``config_hook``), unless the user says otherwise."""
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 8, "model": HEAD, "tree": {"drafter": drafter}}
    _, config = build_config(demo_model, spec)
    assert config.speculative_config.method == "eagle3"
    assert config.speculative_config.use_eagle_block_drop() is False
    _, config = build_config(demo_model, {**spec, "disable_eagle_block_drop": False})
    assert config.speculative_config.use_eagle_block_drop() is True


def test_llm_startup_fails_with_the_message(demo_model, monkeypatch):
    """The same error through ``LLM(...)``, before any engine starts (an
    engine core that starts fails the test)."""
    from vllm import LLM
    from vllm.v1.engine import core

    def started(*args, **kwargs):
        raise AssertionError("the engine started before the config was checked")

    monkeypatch.setattr(core.EngineCore, "__init__", started)
    with pytest.raises(TreeConfigError, match=r"speculative_config\['tree'\]\['policy'\] must be one of 'chain', 'retrieval'"):
        LLM(model=demo_model, speculative_config={"method": "adaptive_tree", "num_speculative_tokens": 8,
                                                  "tree": {"drafter": "retrieval", "policy": "bogus"}})


def test_async_scheduling_is_refused(demo_model):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=demo_model, max_model_len=1024, async_scheduling=True,
                      speculative_config={"method": "adaptive_tree", "num_speculative_tokens": 8, "tree": GOOD_TREE})
    with pytest.raises(TreeConfigError, match=r"does not support async_scheduling=True"):
        args.create_engine_config()


@pytest.fixture
def on_cuda(monkeypatch):
    """The config hook as it runs on vLLM's CUDA platform (the rest of the
    config is still built for this machine's CPU platform)."""
    from vllm_adaptive_spec.adapter import config_hook

    monkeypatch.setattr(config_hook, "_platform", lambda: "cuda")


def test_cuda_selects_the_gpu_worker(demo_model, on_cuda):
    _, config = build_config(demo_model, {"method": "adaptive_tree", "num_speculative_tokens": 8, "tree": GOOD_TREE})
    assert config.parallel_config.worker_cls == "vllm_adaptive_spec.adapter.worker_cuda.TreeGPUWorker"
    assert config.scheduler_config.async_scheduling is False


@pytest.mark.parametrize("where", ["attention_backend", "speculative_config"])
def test_cuda_refuses_a_backend_without_a_tree_path(demo_model, on_cuda, where):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "adaptive_tree", "num_speculative_tokens": 8, "tree": GOOD_TREE}
    if where == "speculative_config":
        spec["attention_backend"] = "FLEX_ATTENTION"
        args = EngineArgs(model=demo_model, max_model_len=1024, speculative_config=spec)
    else:
        args = EngineArgs(model=demo_model, max_model_len=1024, speculative_config=spec, attention_backend="FLASHINFER")
    with pytest.raises(TreeConfigError, match=r"must be one of 'FLASH_ATTN', 'TRITON_ATTN', got '(FLASHINFER|FLEX_ATTENTION)'"):
        args.create_engine_config()


def test_another_platform_is_refused(demo_model, monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(TreeConfigError, match=r"runs on vLLM's CPU and CUDA platforms"):
        build_config(demo_model, {"method": "adaptive_tree", "num_speculative_tokens": 8, "tree": GOOD_TREE})
