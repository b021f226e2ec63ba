"""What the GPU kernel benchmarks share: the CUDA check, the timer and the
copy-bandwidth yardstick measured in the same run."""

from __future__ import annotations

import sys

import torch


def require_cuda(script: str) -> None:
    """Exit with a clear message where no CUDA GPU is visible."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} times CUDA kernels: no CUDA GPU is visible here")


def bench(fn, rep_ms: int = 200) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (after warm-up)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB bf16 device-to-device copy, read plus written."""
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    seconds = bench(lambda: y.copy_(x)) / 1e3
    del x, y
    return 2 * (1 << 30) * 2 / seconds


def graph_bench(fn, rep_ms: int = 200) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph: the GPU's time
    without the host's launch cost, as vLLM runs its decode steps."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, rep_ms)
