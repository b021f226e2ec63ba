"""The tree proposer: vLLM's drafter object for ``adaptive_tree``.

vLLM builds it as the ``custom_class`` proposer (``TreeProposer(vllm_config)``);
the tree runner calls :meth:`propose_trees` with what the stock proposer call
lacks (request ids, sampling parameters). It keeps each request's last tree,
so the runner can lay out the draft tokens vLLM schedules as that tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_adaptive_spec.adapter.config_hook import tree_config_of
from vllm_adaptive_spec.budget import LoadBudget
from vllm_adaptive_spec.growth import grow
from vllm_adaptive_spec.tree import DraftTree


@dataclass
class TreeStats:
    """Counters since the engine started, and the last verification step's
    (read with ``LLM.collective_rpc("adaptive_tree_stats")``)."""

    steps: int = 0
    trees_verified: int = 0
    nodes_verified: int = 0
    tokens_accepted: int = 0
    draft_passes: int = 0
    last_step: dict[str, int] = field(default_factory=dict)

    def record_step(self, trees: int, nodes: int, accepted: int) -> None:
        self.steps += 1
        self.trees_verified += trees
        self.nodes_verified += nodes
        self.tokens_accepted += accepted
        self.last_step = {"trees": trees, "nodes": nodes, "tokens_committed": accepted + trees}

    def as_dict(self) -> dict:
        trees = max(self.trees_verified, 1)
        return {
            "steps": self.steps,
            "trees_verified": self.trees_verified,
            "nodes_verified": self.nodes_verified,
            "tokens_accepted": self.tokens_accepted,
            "draft_passes": self.draft_passes,
            "tau": 1.0 + self.tokens_accepted / trees,
            "nodes_per_tree": self.nodes_verified / trees,
            "last_step": dict(self.last_step),
        }


def can_draft(sampling_params, num_output_tokens: int) -> bool:
    """Whether a request may get a tree: its sampling must be exactly what the
    tree verifier reproduces. Requests with history-dependent processing
    (penalties, bad words, min_tokens, logit bias, min_p, structured output,
    thinking budget) are served without speculation instead."""
    sp = sampling_params
    if sp is None:
        return False
    return (
        sp.presence_penalty == 0.0
        and sp.frequency_penalty == 0.0
        and sp.repetition_penalty == 1.0
        and sp.min_p == 0.0
        and not sp.logit_bias
        and not sp.bad_words
        and sp.structured_outputs is None
        and sp.thinking_token_budget is None
        and num_output_tokens >= sp.min_tokens
    )


class TreeProposer:
    def __init__(self, vllm_config) -> None:
        self.config = tree_config_of(vllm_config)
        if self.config is None:
            raise ValueError("TreeProposer is only used with method='adaptive_tree'")
        self.drafter = self.config.make_drafter()
        self.policy = self.config.make_policy()
        self.max_model_len = vllm_config.model_config.max_model_len
        self.trees: dict[str, DraftTree] = {}
        self.drafted_budget: dict[str, int] = {}
        self.stats = TreeStats()
        self.load_budget = LoadBudget(self.config.budget) if self.config.load_budget == "adaptive" else None

    def load_model(self, *args, **kwargs) -> None:
        """Only the retrieval drafter runs as vLLM's drafter object, and it has no
        weights (model drafters' weights are loaded by vLLM's own proposer)."""

    def propose(self, *args, **kwargs):
        raise RuntimeError("TreeProposer is driven by the adaptive_tree model runner (propose_trees)")

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.trees.pop(request_id, None)
            self.drafted_budget.pop(request_id, None)
            self.drafter.forget(request_id)

    def observe(self, request_ids: list[str], trees: list[DraftTree], accepted: list[list[int]]) -> None:
        """Verified trees (possibly cut by the scheduler) and their accepted
        nodes, for the load-following budget."""
        for request_id, tree, nodes in zip(request_ids, trees, accepted):
            drafted = self.trees.get(request_id)
            whole = drafted is not None and len(drafted) == len(tree)
            informs = self.drafted_budget.get(request_id, len(tree)) if whole else len(tree)
            self.load_budget.observe_tree(tree, nodes, informs)

    def step_budget(self, drafting: int, step_tokens: int, step_seconds: float, other_tokens: int) -> tuple[int, bool]:
        """The per-request node budget for the next step, and whether one
        request drafts at the full budget to keep the estimates fresh."""
        if self.load_budget is None:
            return self.config.budget, False
        self.load_budget.observe_step(step_tokens, step_seconds)
        return self.load_budget.choose(drafting, other_tokens), self.load_budget.explores()

    def propose_trees(
        self,
        request_ids: list[str],
        sampled_token_ids: list[list[int]],
        num_tokens: np.ndarray,
        token_ids: np.ndarray,
        eligible: list[bool],
        step_budget: int,
        explore: bool = False,
    ) -> list[list[int]]:
        """One tree of at most ``step_budget`` nodes per request (empty when it
        may not draft; with ``explore``, one request, in turn, gets the full
        budget); returns each tree's tokens, breadth-first, as vLLM's draft
        token ids."""
        budgets, active, contexts = [], [], []
        explorer = self.stats.steps % max(len(request_ids), 1) if explore else -1
        for i, request_id in enumerate(request_ids):
            length = int(num_tokens[i])
            wanted = self.config.budget if i == explorer else step_budget
            budget = min(wanted, self.max_model_len - length - 1)
            if not sampled_token_ids[i] or not eligible[i] or budget <= 0:
                self.trees.pop(request_id, None)
                continue
            active.append(i)
            budgets.append(budget)
            contexts.append(token_ids[i, :length])
        drafts: list[list[int]] = [[] for _ in request_ids]
        if not active:
            return drafts
        self.drafter.prepare([request_ids[i] for i in active], contexts, active)
        trees, stats = grow(self.drafter, self.policy, torch.tensor(budgets), self.drafter.max_depth)
        if getattr(self.drafter, "is_model", False):
            self.stats.draft_passes += stats.draft_passes
        for i, budget, tree in zip(active, budgets, trees):
            self.trees[request_ids[i]] = tree
            self.drafted_budget[request_ids[i]] = budget
            drafts[i] = tree.tokens
        return drafts
