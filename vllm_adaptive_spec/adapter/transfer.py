"""Host-to-device copies that never make the host wait.

A copy from pageable host memory to a CUDA device blocks the host until the
device has run everything queued before it, which inside a step means the
whole forward so far (issue 52: about 13 such copies a step). A step's host
tensors go instead into one pinned buffer that travels in one non-blocking
copy; PyTorch's pinned allocator keeps the buffer alive until the copy ran.
On the CPU the same code is one plain copy.
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import PIN_MEMORY


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One host list or tensor on ``device``, copied without a wait."""
    return packed_to_device([torch.as_tensor(values, dtype=dtype)], device)[0].to(dtype)


def copy_to_device(dest: torch.Tensor, host: torch.Tensor) -> None:
    """``host`` into the device tensor ``dest`` (a persistent buffer), pinned and non-blocking."""
    if PIN_MEMORY and dest.is_cuda:
        host = host.pin_memory()
    dest.copy_(host, non_blocking=dest.is_cuda)


def packed_to_device(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on ``device`` in one pinned, non-blocking copy: packed as
    int64 into one buffer, split there and reshaped (bool parts come back as
    int64 0 / 1; the caller casts)."""
    pinned = PIN_MEMORY and torch.device(device).type == "cuda"
    flat = torch.cat([part.reshape(-1).to(torch.int64) for part in parts]) if parts else torch.empty(0, dtype=torch.int64)
    if pinned:
        flat = flat.pin_memory()
    moved = flat.to(device, non_blocking=pinned)
    sizes = [part.numel() for part in parts]
    return [piece.view(part.shape) for piece, part in zip(moved.split(sizes), parts)]
