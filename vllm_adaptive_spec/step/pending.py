"""A verified step's acceptance on its way to the host.

The proposer learns from every accepted path (acceptance statistics, the
policies' and the budget's observations), but reading the path right after
verification would make the host wait for the whole forward in the middle of
vLLM's step. Instead the accepted lengths and paths leave the
device in one pinned, non-blocking copy right after acceptance, and are read
after vLLM's own per-step synchronisation (its bookkeeping reads the sampled
tokens), when the copy has long finished.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_adaptive_spec.step import tree_step
from vllm_adaptive_spec.trees.verify import Acceptance


@dataclass(frozen=True)
class PendingAcceptance:
    """``step``: the verified step; ``request_ids``: its tree requests in
    ``step.trees`` order; ``host``: ``[num_accepted | path]`` per request, on
    the host once ``copied`` (a CUDA event; None on the CPU) has completed."""

    step: tree_step.TreeStep
    request_ids: list[str]
    host: torch.Tensor
    copied: torch.cuda.Event | None

    @staticmethod
    def send(step: tree_step.TreeStep, request_ids: list[str], acceptance: Acceptance) -> "PendingAcceptance":
        packed = torch.cat([acceptance.num_accepted.unsqueeze(1), acceptance.path], dim=1)
        if not packed.is_cuda:
            return PendingAcceptance(step, request_ids, packed, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return PendingAcceptance(step, request_ids, host, copied)

    def receive(self) -> tuple[list[list[int]], list[int]]:
        """``(paths, counts)`` as lists (waits for the copy, which vLLM's own
        synchronisation has normally completed already)."""
        if self.copied is not None:
            self.copied.synchronize()
        rows = self.host.tolist()
        return [row[1:] for row in rows], [row[0] for row in rows]
