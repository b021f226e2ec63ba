"""Host-to-device copies that never make the host wait.

A copy from pageable host memory to a CUDA device blocks the host until the
device has run everything queued before it, which inside a step means the
whole forward so far (about 13 such copies a step, before this module). A step's host
tensors go instead into one pinned buffer that travels in one non-blocking
copy; PyTorch's pinned allocator keeps the buffer alive until the copy ran.
Off CUDA the host tensors already are where the step needs them: nothing is
packed or copied.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Pinned host memory where CUDA is (what a non-blocking copy needs); a host
# without CUDA never copies (``_is_cuda``).
PIN_MEMORY = torch.cuda.is_available()


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One host list or tensor on ``device``, copied without a wait."""
    host = torch.as_tensor(values, dtype=dtype)
    if not _is_cuda(device):
        return host
    return (host.pin_memory() if PIN_MEMORY else host).to(device, non_blocking=PIN_MEMORY)


def packed_to_device(parts: list, device: torch.device) -> list[torch.Tensor]:
    """Host tensors or numpy arrays on ``device`` in one pinned, non-blocking
    copy: packed as int64 into one buffer (by numpy, a copy each), split
    there and reshaped (on CUDA bool parts come back as int64 0 / 1; the
    caller casts). Off CUDA: the parts as tensors sharing their memory."""
    if not _is_cuda(device):
        return [torch.as_tensor(part) for part in parts]
    flat = torch.from_numpy(np.concatenate([np.asarray(part, dtype=np.int64).reshape(-1) for part in parts]
                                           if parts else [np.empty(0, dtype=np.int64)]))
    if PIN_MEMORY:
        flat = flat.pin_memory()
    moved = flat.to(device, non_blocking=PIN_MEMORY)
    sizes = [math.prod(part.shape) for part in parts]
    return [piece.view(tuple(part.shape)) for piece, part in zip(moved.split(sizes), parts)]


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"
