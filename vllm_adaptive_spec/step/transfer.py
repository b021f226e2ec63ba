"""Host-to-device copies that never make the host wait.

A copy from pageable host memory to a CUDA device blocks the host until the
device has run everything queued before it, which inside a step means the
whole forward so far (about 13 such copies a step, before this module). A step's host
tensors go instead into one pinned buffer that travels in one non-blocking
copy; PyTorch's pinned allocator keeps the buffer alive until the copy ran.
Off CUDA the host tensors already are where the step needs them: nothing is
copied.
"""

from __future__ import annotations

import array
import functools
import itertools

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One host list or tensor on ``device``, copied without a wait."""
    host = torch.as_tensor(values, dtype=dtype)
    return _moved(host, device) if _is_cuda(device) else host


def packed_to_device(parts: list[list[int]], shapes: list[tuple[int, ...]], device: torch.device) -> list[torch.Tensor]:
    """Flat lists of ints on ``device`` as int64 tensors of ``shapes``: one
    host tensor made from them all (one conversion, whatever the step's
    size), in one pinned, non-blocking copy on CUDA, then split and
    reshaped (bool parts come back as 0 / 1; the caller casts). The ints
    go through an ``array`` (filled in C, shared without a copy), which
    converts a step's thousand ints in about half ``torch.tensor``'s time."""
    host = torch.frombuffer(array.array("q", itertools.chain.from_iterable(parts)), dtype=torch.int64)
    moved = _moved(host, device) if _is_cuda(device) else host
    return [piece.view(shape) for piece, shape in zip(moved.split([len(part) for part in parts]), shapes)]


def _moved(host: torch.Tensor, device) -> torch.Tensor:
    """``host`` on the CUDA ``device``: pinned and non-blocking where the
    host can pin, else a plain (waiting) copy."""
    pin = _can_pin()
    return (host.pin_memory() if pin else host).to(device, non_blocking=pin)


@functools.cache
def _can_pin() -> bool:
    """Whether this host pins memory, tried once: not every CUDA host does
    (WSL, by driver), so it is asked of the host, not assumed."""
    try:
        torch.empty(1).pin_memory()
    except RuntimeError:
        return False
    return True


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"
