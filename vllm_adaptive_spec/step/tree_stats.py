"""The tree proposer's counters, read by the benchmarks and the tests
(``LLM.collective_rpc("adaptive_tree_stats")``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TreeStats:
    """Counters since the engine started, and the last verification step's
    (read with ``LLM.collective_rpc("adaptive_tree_stats")``)."""

    steps: int = 0
    trees_verified: int = 0
    nodes_verified: int = 0
    tokens_accepted: int = 0
    draft_passes: int = 0
    proposals: int = 0  # steps that asked for trees
    paused: int = 0  # of them, steps the load budget did not draft
    controls: int = 0  # of those, control steps (nothing drafted, so the step-cost fit sees tree-less steps)
    probes: int = 0  # of the others, steps that drafted to look after a pause (for a few requests)
    leaf_paths: int = 0  # verified trees whose accepted path reached a leaf
    paused_trees: int = 0  # trees drafted while paused (by a drafter's paused part)
    fill_trees: int = 0  # of the requests the paused part left without a tree, those the fill drafted (the hybrid's head)
    newcomer_probes: int = 0  # trees drafted while paused for requests that never had one verified
    trust_cuts: int = 0  # steps whose nodes the load budget's trust region cut
    grammar_cut_nodes: int = 0  # drafted nodes a structured request's grammar removed before verification
    forced_nodes: int = 0  # tokens a structured request's grammar forced, verified as chains (``tree_scheduler``)
    forced_accepted: int = 0  # of them, accepted
    last_step: dict[str, int] = field(default_factory=dict)

    def record_step(self, trees: int, nodes: int, accepted: int) -> None:
        self.steps += 1
        self.trees_verified += trees
        self.nodes_verified += nodes
        self.tokens_accepted += accepted
        self.last_step = {"trees": trees, "nodes": nodes, "tokens_committed": accepted + trees}

    def record_forced(self, nodes: int, accepted: int) -> None:
        """A step's chains of grammar-forced tokens (not the drafter's trees)."""
        self.forced_nodes += nodes
        self.forced_accepted += accepted

    def as_dict(self) -> dict:
        trees = max(self.trees_verified, 1)
        return {
            "steps": self.steps,
            "trees_verified": self.trees_verified,
            "nodes_verified": self.nodes_verified,
            "tokens_accepted": self.tokens_accepted,
            "draft_passes": self.draft_passes,
            "proposals": self.proposals,
            "paused": self.paused,
            "controls": self.controls,
            "probes": self.probes,
            "leaf_paths": self.leaf_paths,
            "paused_trees": self.paused_trees,
            "fill_trees": self.fill_trees,
            "newcomer_probes": self.newcomer_probes,
            "trust_cuts": self.trust_cuts,
            "grammar_cut_nodes": self.grammar_cut_nodes,
            "forced_nodes": self.forced_nodes,
            "forced_accepted": self.forced_accepted,
            "drafting_share": 1.0 - self.paused / max(self.proposals, 1),
            "tau": 1.0 + self.tokens_accepted / trees,
            "nodes_per_tree": self.nodes_verified / trees,
            "last_step": dict(self.last_step),
        }
