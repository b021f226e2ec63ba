"""The torch operations a call dispatches, counted by name: what the tests
of the step's device parts compare across batch sizes and widths (the same
count means no loop over requests or nodes), and where they look for value
reads (``aten._local_scalar_dense`` is what ``item``/``bool``/``int`` dispatch)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

READS = ("aten.item", "_local_scalar_dense", "nonzero")  # ``item``: a read under inference mode


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def dispatched(call, *args, **kwargs) -> Counter:
    """The operations ``call(*args, **kwargs)`` dispatches."""
    with OpCounter() as counter:
        call(*args, **kwargs)
    return counter.ops


def reads(ops: Counter) -> list[str]:
    """The operations among ``ops`` that read a value back to the host."""
    return [op for op in ops if any(read in op for read in READS)]
