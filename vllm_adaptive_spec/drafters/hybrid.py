"""The hybrid drafter (docs/algorithms.md section 7, Talon, seed 001): a model
drafter's tree and the retrieval trie merged from the root by shared
prefixes, under one node limit ``N``.

Every frontier node carries two positions: its node in the draft model's
tree (the model is fed every chosen node, retrieval-only ones included, so
their children get model candidates too) and its node in the request's
retrieval trie (none once the path leaves the trie). Its candidates are the
model's top-``fanout`` tokens and the trie node's children; a token offered
by both is one candidate (so a shared prefix is one node and divergent
continuations become siblings).

Decision (one scale): the two ``q`` are both estimates of the chance that the
target accepts the token given its parent: the model's draft probability,
and the retrieval drafter's calibrated acceptance chance (its ``q`` is fitted
to replayed acceptances, see ``drafters.retrieval_trie``). A token offered by both
takes the larger. Decision (budget split): none is fixed; the policy ranks
all candidates by path probability under the one limit ``N``, so retrieval nodes
take the budget where the evidence behind them beats the model and none
where it does not. Candidates stay deterministic, so verification (greedy or
sampled) is unchanged and lossless.

Decision (under the load budget): while the budget pauses drafting (the
model's passes do not pay), the retrieval trie is still drafted, alone, as
the ``retrieval`` drafter drafts it (its own policy, ``min_p`` 0.05): it runs
no model pass, so pausing the model need not give up the retrieval side's
tokens. It has a load budget of its own (its cost is measured, and it
pauses where its trees do not pay, as the ``retrieval`` drafter does). The
model's draft state is kept as for any paused model drafter.

Decision (the fill): on such a step, a request whose trie has no match (or
whose trie tree the trie's budget drops) would verify nothing, so the model
drafts its tree alone for it (:meth:`fill_part`), sized by a load budget of
its own that judges those trees against no drafting. The model's budget
judges the merged trees against the trie alone, so a head that adds little
where the trie matches is paused there and still drafts where nothing else
does.
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.config_schema import Param
from vllm_adaptive_spec.drafters.model import ROOT_HANDLE, DraftBackend, DraftModelDrafter, Eagle3Drafter
from vllm_adaptive_spec.drafters.retrieval_tensors import make_retrieval
from vllm_adaptive_spec.drafters.retrieval_trie import RetrievalDrafter
from vllm_adaptive_spec.policies.retrieval import RetrievalPolicy
from vllm_adaptive_spec.trees.candidates import Candidates, Growth

NO_TRIE_NODE = -2  # the trie's root is node -1, as the retrieval drafter's handles
BASES = {"eagle3": Eagle3Drafter, "draft_model": DraftModelDrafter}
# The retrieval settings a hybrid tree takes; ``max_depth`` is renamed so it cannot
# collide with a policy's ``max_depth`` (TALON's) under ``tree``.
RETRIEVAL_PARAMS = ("l_max", "l_min", "max_matches", "evidence_prior", "datastore", "datastore_tokens", "corpus",
                    "matcher")


class HybridDrafter:
    name = "hybrid"
    is_model = True
    max_depth = Eagle3Drafter.max_depth
    PARAMS = {
        "base": Param(str, "eagle3", "one of 'draft_model', 'eagle3'", lambda v: v in BASES),
        "retrieval_depth": Param(int, 16, "an integer >= 1", lambda v: v >= 1),
        **{name: RetrievalDrafter.PARAMS[name] for name in RETRIEVAL_PARAMS},
    }

    def __init__(self, base: str = "eagle3", retrieval_depth: int = 16, device_type: str = "cpu", **retrieval) -> None:
        self.model = BASES[base]()
        self.retrieval = make_retrieval(device_type, max_depth=retrieval_depth, **retrieval)
        self.base = base
        self.corpus_path = self.retrieval.corpus_path
        self._tokens: torch.Tensor | None = None  # [B, F * C] the last candidates' tokens
        self._model_parents: torch.Tensor | None = None  # their parents' model node ids
        self._trie_nodes: torch.Tensor | None = None  # their trie nodes (NO_TRIE_NODE: none)

    @property
    def fanout(self) -> int:
        return self.model.fanout

    @property
    def growth(self) -> Growth:
        """``FIXED_LAYERS`` where the model's layers run so and the trie's
        children come from the tensor matcher (the trie matcher reads each
        frontier back)."""
        fixed = self.model.growth is Growth.FIXED_LAYERS and self.retrieval.growth is Growth.WHOLE_TENSORS
        return Growth.FIXED_LAYERS if fixed else Growth.LAYERS

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def shared(self):
        return self.retrieval.shared

    def paused_part(self) -> tuple[RetrievalDrafter, RetrievalPolicy]:
        """What drafts while the model is paused: the retrieval trie and its policy."""
        return self.retrieval, RetrievalPolicy()

    def fill_part(self) -> Eagle3Drafter | DraftModelDrafter:
        """What drafts, while the model is paused, the requests the trie
        left without a tree: the model drafter alone (see "the fill")."""
        return self.model

    def bind(self, backend: DraftBackend, fanout: int, entropy_top_m: int = 0) -> None:
        self.model.bind(backend, fanout, entropy_top_m)

    def load_corpus(self, tokenize) -> None:
        self.retrieval.load_corpus(tokenize)

    def clear_shared(self) -> int:
        return self.retrieval.clear_shared()

    def prepare(self, request_ids: list[str], contexts, rows: list[int], prompt_lens=None) -> None:
        self.model.prepare(request_ids, contexts, rows, prompt_lens)
        self.retrieval.prepare(request_ids, contexts, rows, prompt_lens)
        self._tokens = self._model_parents = self._trie_nodes = None

    def forget(self, request_id: str, finished: bool = False) -> None:
        self.model.forget(request_id, finished)
        self.retrieval.forget(request_id, finished)

    def requests_held(self) -> int:
        return self.model.requests_held() + self.retrieval.requests_held()

    def expand(self, handles: torch.Tensor, live: torch.Tensor) -> Candidates:
        batch, width = handles.shape
        model_nodes, dist, live = self.model.frontier(handles, live, self._tokens, self._model_parents)
        if self._trie_nodes is None:  # the first expansion since ``prepare``: the roots (known on the host)
            trie_nodes = torch.full((batch, width), ROOT_HANDLE, dtype=torch.long, device=live.device)
        else:
            trie_nodes = self._trie_nodes.gather(1, handles.clamp(min=0))
        kids = self.retrieval.expand(trie_nodes, live & (trie_nodes >= ROOT_HANDLE))
        tokens, q = dist.tokens[..., : self.fanout].long(), dist.probs[..., : self.fanout].float()
        tokens, q, trie_children = merged(tokens, torch.where(live.unsqueeze(-1), q, 0.0), kids)
        q, order = q.sort(dim=-1, descending=True, stable=True)
        tokens, trie_children = tokens.gather(-1, order), trie_children.gather(-1, order)
        fanout = q.shape[-1]
        self._tokens = tokens.flatten(1)
        self._model_parents = model_nodes.unsqueeze(-1).expand(-1, -1, fanout).flatten(1)
        self._trie_nodes = trie_children.flatten(1)
        entropy = torch.where(live, dist.entropy, 0.0) if self.model.backend.top_m else None
        return Candidates(tokens=tokens, q=q, entropy=entropy)


def merged(tokens: torch.Tensor, q: torch.Tensor, kids: Candidates) -> tuple[torch.Tensor, ...]:
    """The model's candidates ``tokens``/``q`` [B, F, C] (``q`` 0: none)
    merged with the trie's children ``kids`` [B, F, R] by token, as tensor
    operations: a token both offer is the model's slot with the larger ``q``
    and the trie child; the trie's other children follow in slots ``C + r``
    (``q`` 0 where a child was merged or is none). Returns tokens, ``q`` and
    each slot's trie child (``NO_TRIE_NODE``: none), [B, F, C + R]."""
    exists = kids.q > 0
    same = (tokens.unsqueeze(-1) == kids.tokens.unsqueeze(-2)) & (q > 0).unsqueeze(-1) & exists.unsqueeze(-2)
    shared_q = torch.where(same, kids.q.unsqueeze(-2), 0.0).amax(-1)
    shared_child = torch.where(same, kids.handles.unsqueeze(-2), NO_TRIE_NODE).amax(-1)
    new = exists & ~same.any(-2)
    return (torch.cat([tokens, torch.where(new, kids.tokens, 0)], -1),
            torch.cat([torch.maximum(q, shared_q), torch.where(new, kids.q, 0.0)], -1),
            torch.cat([shared_child, torch.where(new, kids.handles, NO_TRIE_NODE)], -1))
