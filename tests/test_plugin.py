"""The entry point: registers in the engine, changes nothing unselected,
and refuses an unsupported vLLM with one clear line."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import pytest

from conftest import chat_token_ids, run_engine_job
from vllm_adaptive_spec import adapter, plugin
from vllm_adaptive_spec.adapter import config_hook
from vllm_adaptive_spec.prompts import load_prompts, one_per_category


def test_entry_point_is_declared():
    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "adaptive_spec"]
    assert [ep.value for ep in found] == ["vllm_adaptive_spec.plugin:register"]
    assert found[0].load() is plugin.register


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "not-a-version"])
def test_unsupported_version_is_refused(version):
    problem = adapter.compatibility_problem(version)
    assert problem == (
        f"vllm-adaptive-spec needs vLLM {adapter.SUPPORTED_VLLM} but found vLLM {version}; "
        "the adaptive_tree method is not registered"
    )


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.0.post1"])
def test_supported_version_is_accepted(version):
    assert adapter.compatibility_problem(version) is None


def test_missing_hook_is_refused(monkeypatch):
    monkeypatch.setattr(adapter, "CONFIG_HOOKS", adapter.CONFIG_HOOKS + ("vllm.config:NoSuchHook",))
    problem = adapter.compatibility_problem("0.32.0")
    assert "vllm.config:NoSuchHook" in problem and "not registered" in problem


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_engine_hooks_exist(platform):
    """vLLM's Python source is the same in its CPU and CUDA builds, so both
    platforms' hooks are checked here."""
    assert adapter.missing_hooks(adapter.engine_hooks(platform)) == []
    assert adapter.missing_hooks(("vllm.config:NoSuchHook", "no.such.module:x")) == [
        "vllm.config:NoSuchHook",
        "no.such.module:x",
    ]


ADAPTER_MODULES = ("attention_cpu", "attention_cuda", "cudagraphs", "worker_cpu", "worker_cuda")


def overridden_vllm_methods() -> dict[str, str]:
    """Every vLLM attribute a class of the adapter overrides, as the hook
    string of the vLLM class that defines it -> the plugin class that
    overrides it (dunders, constructors included, and ABC bookkeeping aside:
    they always exist)."""
    import importlib
    import inspect

    found = {}
    for module_name in ADAPTER_MODULES:
        module = importlib.import_module(f"vllm_adaptive_spec.adapter.{module_name}")
        for cls in vars(module).values():
            if not inspect.isclass(cls) or not cls.__module__.startswith("vllm_adaptive_spec"):
                continue
            ours = [c for c in cls.__mro__ if c.__module__.startswith("vllm_adaptive_spec")]
            theirs = [c for c in cls.__mro__ if c.__module__.startswith("vllm.")]
            for attribute in {a for c in ours for a in vars(c) if not a.startswith("__")} - {"_abc_impl"}:
                owner = next((c for c in theirs if attribute in vars(c)), None)
                if owner is not None:
                    found[f"{owner.__module__}:{owner.__qualname__}.{attribute}"] = cls.__qualname__
    return found


def test_every_overridden_vllm_method_is_a_checked_hook():
    hooks = set(adapter.CONFIG_HOOKS + adapter.ENGINE_HOOKS).union(*adapter.PLATFORM_HOOKS.values())
    overridden = overridden_vllm_methods()
    assert "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs" in overridden
    assert {hook: cls for hook, cls in overridden.items() if hook not in hooks} == {}


def test_register_on_unsupported_vllm_logs_one_line_and_installs_nothing(monkeypatch, caplog):
    installed = []
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(adapter, "installed_vllm_version", lambda: "0.31.0")
    monkeypatch.setattr(config_hook, "install", lambda: installed.append(True))
    with caplog.at_level(logging.INFO, logger="vllm.adaptive_spec"):
        assert plugin.register() is False
    assert installed == []
    assert [r.getMessage() for r in caplog.records] == [adapter.compatibility_problem("0.31.0")]
    assert caplog.records[0].levelno == logging.WARNING


def test_register_never_raises(monkeypatch, caplog):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(config_hook, "install", broken)
    with caplog.at_level(logging.ERROR, logger="vllm.adaptive_spec"):
        assert plugin.register() is False
    assert "failed to register" in caplog.text and "boom" in caplog.text


@pytest.mark.engine
def test_changes_nothing_unselected(demo_model, demo_tokenizer, tmp_path):
    """An engine without a speculative config answers the same with the
    plugin loaded as without it. (That it loads in vLLM's own processes is
    shown where they run: the EngineCore of ``vllm serve`` in
    ``test_serve_load``, tensor-parallel worker processes in
    ``test_engine_tp``.)"""
    prompts = one_per_category(load_prompts())[:4]
    job = {
        "model": demo_model,
        "dtype": "float32",
        "prompt_token_ids": [chat_token_ids(demo_tokenizer, p.messages) for p in prompts],
        "max_tokens": 32,
    }
    with_plugin = run_engine_job(tmp_path / "with", job)
    without_plugin = run_engine_job(tmp_path / "without", job, env={"VLLM_PLUGINS": "none-but-stock"})
    assert with_plugin.plugin_registered and not without_plugin.plugin_registered
    assert with_plugin.token_ids == without_plugin.token_ids
