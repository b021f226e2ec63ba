"""Model drafters (EAGLE-3 heads and small draft LMs): tree growth over a
backend that runs one draft pass for a whole layer of nodes.

The engine-agnostic part lives here: turning each pass's draft distributions
into each frontier node's top-``fanout`` candidates and remembering which
candidate becomes which fed node. The backend (the engine adapter, or a test
double) owns the model, its KV cache and attention:

* ``begin(rows)``: start trees for the drafting requests (their rows in the
  engine batch); returns the trees' scratch, whose ``roots`` are the root
  distributions (from the pass over the request's newly committed tokens,
  already run);
* ``feed(scratch, live, tokens, parents)``: run the draft model on new nodes
  (``[B, F]`` each; ``parents`` are node ids, -1 for the root) of the trees
  of ``scratch``; returns the nodes' ids (-1 where not fed, e.g. out of KV
  scratch) and their draft distributions (undefined where not fed).

Distributions are :class:`kernels.draft_distribution.DraftDistribution`
summaries (top ``top_k`` tokens and probabilities, confidence, top-``top_m``
entropy), which the drafter sets on the backend at :meth:`ModelDrafter.bind`.

Decision (docs/algorithms.md section 0): candidates are the top-``fanout`` tokens
of the draft distribution at temperature 1, deterministically, so sampling
verification uses sequential elimination; ``q`` is their draft probability.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.draft_distribution import DraftDistribution
from vllm_adaptive_spec.config_schema import Param
from vllm_adaptive_spec.trees.candidates import Candidates, Growth

ROOT_HANDLE = -1


class TreeScratch(Protocol):
    roots: DraftDistribution  # [B, top_k]


class DraftBackend(Protocol):
    top_k: int
    top_m: int

    def begin(self, rows: list[int]) -> TreeScratch: ...

    def feed(
        self, scratch: TreeScratch, live: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor
    ) -> tuple[torch.Tensor, DraftDistribution]: ...


class ModelDrafter:
    """Shared by ``eagle3`` and ``draft_model`` (they differ only in the backend)."""

    PARAMS: dict[str, Param] = {}
    is_model = True
    # Depth is the policy's to limit (chain: the budget; eagle2: D).
    max_depth = 128

    def __init__(self) -> None:
        self.backend: DraftBackend | None = None
        self.fanout = 1
        self._scratch: TreeScratch | None = None  # this step's trees, as the backend grows them
        self._at_root = True  # the next expansion is the roots' (their distributions are known)
        self._tokens: torch.Tensor | None = None  # last candidates' tokens [B, F * C]
        self._parents: torch.Tensor | None = None  # their parent node ids [B, F * C]

    def bind(self, backend: DraftBackend, fanout: int, entropy_top_m: int = 0) -> None:
        """Use ``backend``; candidates are the top ``fanout`` tokens of each
        distribution, and ``entropy_top_m`` > 0 asks for the top-M entropy."""
        self.backend = backend
        self.fanout = fanout
        backend.top_k, backend.top_m = fanout, entropy_top_m

    @property
    def growth(self) -> Growth:
        """``FIXED_LAYERS`` where the backend runs every layer at fixed
        capacity, reading nothing back (``growth.grow`` then grows so too)."""
        return Growth.FIXED_LAYERS if self.backend is not None and self.backend.fixed_layers else Growth.LAYERS

    @property
    def device(self) -> torch.device:
        """Where the backend's distributions are."""
        return getattr(self.backend, "device", torch.device("cpu"))

    def prepare(self, request_ids: list[str], contexts, rows: list[int], prompt_lens=None) -> None:
        if self.backend is None:
            raise RuntimeError(f"the {self.name} drafter has no backend; the engine adapter binds one")
        self._scratch = self.backend.begin(rows)
        self._at_root = True

    def forget(self, request_id: str, finished: bool = False) -> None:
        """Model drafters keep nothing per request between steps (the KV is the engine's)."""

    def requests_held(self) -> int:
        return 0

    def frontier(
        self, handles: torch.Tensor, live: torch.Tensor, tokens: torch.Tensor | None, parents: torch.Tensor | None
    ) -> tuple[torch.Tensor, DraftDistribution, torch.Tensor]:
        """Feed the frontier ``handles`` [B, F] (indexes into the last
        candidates' ``tokens`` and ``parents`` [B, F * C]; all -1 at the root)
        to the backend: their node ids (the root's -1 at the root), their
        draft distributions, and ``live`` without the nodes not fed."""
        batch, width = handles.shape
        if self._at_root:  # known on the host: no read of ``handles``
            self._at_root = False
            roots = self._scratch.roots
            dist = DraftDistribution(*(x.unsqueeze(1).expand(batch, width, *x.shape[1:]) for x in roots))
            return torch.full((batch, width), ROOT_HANDLE, dtype=torch.long, device=live.device), dist, live
        flat = handles.clamp(min=0)
        nodes, dist = self.backend.feed(self._scratch, live, tokens.gather(1, flat), parents.gather(1, flat))
        return nodes, dist, live & (nodes >= 0)

    def expand(self, handles: torch.Tensor, live: torch.Tensor) -> Candidates:
        parents, dist, live = self.frontier(handles, live, self._tokens, self._parents)
        tokens, q = dist.tokens, dist.probs
        if tokens.shape[-1] != self.fanout:  # a backend that keeps more than the fanout
            tokens, q = tokens[..., : self.fanout], q[..., : self.fanout]
        q = torch.where(live.unsqueeze(-1), q.float(), 0.0)
        fanout = q.shape[-1]
        self._tokens = tokens.flatten(1)
        self._parents = parents.unsqueeze(-1).expand(-1, -1, fanout).flatten(1)
        entropy = torch.where(live, dist.entropy, 0.0) if self.backend.top_m else None
        return Candidates(tokens=tokens, q=q, entropy=entropy)


class Eagle3Drafter(ModelDrafter):
    """An EAGLE-3 head fed the target's auxiliary hidden states (Li et al. 2025)."""

    name = "eagle3"


class DraftModelDrafter(ModelDrafter):
    """An independent small causal LM sharing the target's tokenizer (DynaTree's drafter)."""

    name = "draft_model"
