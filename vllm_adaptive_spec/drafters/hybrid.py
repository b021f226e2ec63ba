"""The hybrid drafter (docs/algorithms.md section 7, Talon, seed 001): a model
drafter's tree and the retrieval trie merged from the root by shared
prefixes, under one node budget.

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
to replayed acceptances, see ``drafters.retrieval``). A token offered by both
takes the larger. Decision (budget split): none is fixed; the policy ranks
all candidates by path probability under the one budget, so retrieval nodes
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
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.drafters.model import ROOT_HANDLE, DraftBackend, DraftModelDrafter, Eagle3Drafter
from vllm_adaptive_spec.drafters.retrieval import RetrievalDrafter
from vllm_adaptive_spec.growth import Candidates
from vllm_adaptive_spec.policies import Param
from vllm_adaptive_spec.policies.retrieval import RetrievalPolicy

NO_TRIE_NODE = -2  # the trie's root is node -1, as the retrieval drafter's handles
BASES = {"eagle3": Eagle3Drafter, "draft_model": DraftModelDrafter}
# The retrieval settings a hybrid tree takes; ``max_depth`` is renamed so it cannot
# collide with a policy's ``max_depth`` (TALON's) under ``tree``.
RETRIEVAL_PARAMS = ("l_max", "l_min", "max_matches", "evidence_prior", "datastore", "datastore_tokens", "corpus")


class HybridDrafter:
    name = "hybrid"
    is_model = True
    max_depth = Eagle3Drafter.max_depth
    PARAMS = {
        "base": Param(str, "eagle3", "one of 'draft_model', 'eagle3'", lambda v: v in BASES),
        "retrieval_depth": Param(int, 16, "an integer >= 1", lambda v: v >= 1),
        **{name: RetrievalDrafter.PARAMS[name] for name in RETRIEVAL_PARAMS},
    }

    def __init__(self, base: str = "eagle3", retrieval_depth: int = 16, **retrieval) -> None:
        self.model = BASES[base]()
        self.retrieval = RetrievalDrafter(max_depth=retrieval_depth, **retrieval)
        self.base = base
        self.corpus_path = self.retrieval.corpus_path
        self._tokens: torch.Tensor | None = None  # [B, F * C] the last candidates' tokens
        self._model_parents: torch.Tensor | None = None  # their parents' model node ids
        self._trie_nodes: torch.Tensor | None = None  # their trie nodes (NO_TRIE_NODE: none)

    @property
    def fanout(self) -> int:
        return self.model.fanout

    @property
    def shared(self):
        return self.retrieval.shared

    def paused_part(self) -> tuple[RetrievalDrafter, RetrievalPolicy]:
        """What drafts while the model is paused: the retrieval trie and its policy."""
        return self.retrieval, RetrievalPolicy()

    def bind(self, backend: DraftBackend, fanout: int, entropy_top_m: int = 0) -> None:
        self.model.bind(backend, fanout, entropy_top_m)

    def load_corpus(self, tokenize) -> None:
        self.retrieval.load_corpus(tokenize)

    def clear_shared(self) -> int:
        return self.retrieval.clear_shared()

    def prepare(self, request_ids: list[str], contexts, rows: list[int], prompt_lens=None) -> None:
        self.model.prepare(request_ids, contexts, rows, prompt_lens)
        self.retrieval.prepare(request_ids, contexts, rows, prompt_lens)

    def forget(self, request_id: str, finished: bool = False) -> None:
        self.model.forget(request_id, finished)
        self.retrieval.forget(request_id, finished)

    def requests_held(self) -> int:
        return self.model.requests_held() + self.retrieval.requests_held()

    def expand(self, handles: torch.Tensor, live: torch.Tensor) -> Candidates:
        batch, width = handles.shape
        model_nodes, dist, live = self.model.frontier(handles, live, self._tokens, self._model_parents)
        at_root = bool((handles == ROOT_HANDLE).all())
        trie_nodes = handles.new_full((batch, width), -1) if at_root else self._trie_nodes.gather(1, handles.clamp(min=0))
        tokens, q = dist.tokens[..., : self.fanout].long(), dist.probs[..., : self.fanout].float()
        tokens, q, trie_children = self._merge(tokens, torch.where(live.unsqueeze(-1), q, 0.0), trie_nodes, live)
        q, order = q.sort(dim=-1, descending=True, stable=True)
        tokens, trie_children = tokens.gather(-1, order), trie_children.gather(-1, order)
        fanout = q.shape[-1]
        self._tokens = tokens.flatten(1)
        self._model_parents = model_nodes.unsqueeze(-1).expand(-1, -1, fanout).flatten(1)
        self._trie_nodes = trie_children.flatten(1)
        out_handles = torch.arange(width * fanout).view(1, width, fanout).expand(batch, -1, -1).clone()
        entropy = dist.entropy if self.model.backend.top_m else None
        return Candidates(tokens=tokens, q=q, handles=out_handles, entropy=entropy)

    def _merge(self, tokens, q, trie_nodes, live):
        """The model's candidates [B, F, C] and the live trie nodes' children:
        a shared token takes the larger ``q`` and the trie child; the others
        are appended. Returns tokens, q and trie children [B, F, C + R]."""
        batch, width, fanout = tokens.shape
        kids = {}
        for b, f in (trie_nodes >= -1).logical_and(live).nonzero().tolist():
            children = self.retrieval.children(b, int(trie_nodes[b, f]))
            if children:
                kids[b, f] = children
        extra = max((len(c) for c in kids.values()), default=0)
        tokens = torch.cat([tokens, torch.zeros(batch, width, extra, dtype=torch.long)], -1)
        q = torch.cat([q, torch.zeros(batch, width, extra)], -1)
        trie_children = torch.full((batch, width, fanout + extra), NO_TRIE_NODE, dtype=torch.long)
        for (b, f), children in kids.items():
            offered = tokens[b, f, :fanout].tolist()
            free = fanout
            for token, chance, child in children:
                where = offered.index(token) if token in offered else -1
                if where < 0 or q[b, f, where] == 0:
                    where, free = free, free + 1
                    tokens[b, f, where] = token
                q[b, f, where] = max(float(q[b, f, where]), chance)
                trie_children[b, f, where] = child
        return tokens, q, trie_children
