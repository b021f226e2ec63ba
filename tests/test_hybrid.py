"""The hybrid drafter over the model drafter's fake backend: the model's tree
and the retrieval trie merged from the root by shared prefixes (plain logic,
no engine)."""

from __future__ import annotations

import pytest
import torch

from dispatched_ops import dispatched, reads
from test_model_drafter import TableBackend, make, paths

from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.drafters.hybrid import NO_TRIE_NODE, HybridDrafter, merged
from vllm_adaptive_spec.drafters.model import Eagle3Drafter
from vllm_adaptive_spec.policies import ChainPolicy, DynaTreePolicy, Eagle2Policy, TalonPolicy
from vllm_adaptive_spec.trees.candidates import Candidates
from vllm_adaptive_spec.step.growth import grow, grow_fixed


def grow_hybrid(backend, policy, budget, contexts, **retrieval):
    batch = len(contexts)
    drafter = HybridDrafter(evidence_prior=0, **retrieval)
    drafter.bind(backend, policy.fanout, policy.entropy_top_m)
    drafter.prepare([f"r{b}" for b in range(batch)], Contexts.of(contexts), list(range(batch)))
    return grow(drafter, policy, torch.full((batch,), budget), drafter.max_depth)[0]


def grow_model(backend, policy, budget, batch):
    drafter = Eagle3Drafter()
    drafter.bind(backend, policy.fanout, policy.entropy_top_m)
    drafter.prepare([f"r{b}" for b in range(batch)], [None] * batch, list(range(batch)))
    return grow(drafter, policy, torch.full((batch,), budget), drafter.max_depth)[0]


@pytest.mark.parametrize("policy", [Eagle2Policy(top_k=3, depth=3), ChainPolicy()], ids=["eagle2", "chain"])
def test_without_retrieval_evidence_it_is_the_model_tree(policy):
    roots, table = make(seed=1)
    no_repeats = [[0, 1, 2, 3], [4, 5, 6]]
    hybrid = grow_hybrid(TableBackend(roots, table), policy, 8, no_repeats)
    assert hybrid == grow_model(TableBackend(roots, table), policy, 8, batch=2)


def test_a_retrieval_path_joins_the_tree_and_is_fed_to_the_model():
    roots, table = make(seed=2)
    # Request 0's context ends with [5, 6], which was followed by 4, 4, 4: a
    # certain continuation (q = 1) the model may not offer.
    contexts = [[5, 6, 4, 4, 4, 0, 5, 6], [1, 2, 3]]
    backend = TableBackend(roots, table)
    tree = grow_hybrid(backend, Eagle2Policy(top_k=2, depth=4), 12, contexts, l_max=2)[0]
    tree.validate()
    assert (4, 4, 4) in paths(tree)
    path_q = {path: q for path, q in zip(paths(tree), tree.q)}
    assert path_q[(4,)] == 1.0 and path_q[(4, 4)] == 1.0 and path_q[(4, 4, 4)] == 1.0
    fed = [token for layer in backend.fed_tokens for token in layer]
    assert fed.count(4) >= 3  # the retrieval-only nodes were run through the model
    # Model candidates fill the rest of each layer (eagle2: 2 per layer, 4 layers).
    assert len(tree) == 8 and any(path[0] != 4 for path in paths(tree))


def test_a_token_offered_by_both_is_one_node_with_the_larger_q():
    roots, table = make(seed=3)
    top = int(roots[0].argmax())
    a, b = [t for t in range(7) if t != top][:2]  # two other tokens
    contexts = [[a, top, b, a], [a]]  # request 0: [a] was followed by `top` (count 1, prior 0: q = 1)
    tree = grow_hybrid(TableBackend(roots, table), Eagle2Policy(top_k=3, depth=1), 3, contexts, l_max=1)[0]
    root_children = [t for t, parent in zip(tree.tokens, tree.parents) if parent == -1]
    assert root_children.count(top) == 1
    assert tree.q[tree.tokens.index(top)] == 1.0 > float(roots[0, top])


def test_unfed_nodes_get_no_children_from_either_side():
    roots, table = make(seed=4)
    contexts = [[5, 6, 4, 4, 4, 0, 5, 6], [5, 6, 4, 4, 4, 0, 5, 6]]
    tree = grow_hybrid(TableBackend(roots, table, capacity=1), ChainPolicy(), 6, contexts, l_max=2)
    assert all(len(t) <= 2 for t in tree)  # the root's child, and one fed node's child at most


def test_while_the_budget_pauses_the_model_the_retrieval_trie_still_drafts():
    """Paused steps (the model's passes do not pay) draft the retrieval trie
    alone: no model pass, no drafting cost, and they neither pause nor resume
    the model; their trees do not feed the hybrid policy's history."""
    import numpy as np

    from test_policies import proposer_for
    from vllm_adaptive_spec.budget.pause_control import StepDecision
    from vllm_adaptive_spec.config import TreeConfig

    # No backend bound: a model pass would fail.
    proposer = proposer_for(TreeConfig("hybrid", "dynatree", 8, {"l_max": 2, "evidence_prior": 0.0}, {"window": 1}))
    budget = proposer.load_budget
    budget.pauses._paused, budget.pauses._window_steps = 3, 2
    assert not proposer.begin_step().drafts
    tokens = np.array([[5, 6, 4, 4, 4, 0, 5, 6], [1, 2, 3, 7, 8, 9, 0, 11]])
    drafts = proposer.propose_trees(["a", "b"], [[6], [11]], np.array([8, 8]), tokens, [True, True], StepDecision(drafts=False))
    assert drafts[0][:3] == [4, 4, 4] and drafts[1] == []  # a's context repeats, b's does not
    assert (budget.pauses._paused, budget.pauses._window_steps, budget.drafted_requests) == (2, 2, 0.0)
    proposer.observe(["a"], [proposer.trees["a"]], [[0, 1, 2]])
    assert "a" not in proposer.policy._history
    assert proposer.stats.as_dict()["draft_passes"] == 0


def test_the_retrieval_trie_has_a_budget_of_its_own():
    """The trie's drafting while the model is paused is timed into its own
    budget, its trees calibrate that budget only, and when that budget
    pauses the trie drafts only newcomers' probes (requests never verified:
    b, whose context has nothing to draft from)."""
    import numpy as np

    from test_policies import proposer_for
    from vllm_adaptive_spec.budget.pause_control import StepDecision
    from vllm_adaptive_spec.config import TreeConfig

    proposer = proposer_for(TreeConfig("hybrid", "dynatree", 8, {"l_max": 2, "evidence_prior": 0.0}, {"window": 1}))
    model, trie = proposer.load_budget, proposer.paused_budget
    assert trie is not None and trie is not model
    assert model.pauses.realized and not trie.pauses.realized  # the model's windows on committed tokens, the trie's on expected
    proposer.observe_step(10, 0.05, 0)  # one step, one fit: both budgets read the same step costs
    assert model.fit is trie.fit and model.fit.steps_seen == 1
    model.pauses._paused = 3
    tokens = np.array([[5, 6, 4, 4, 4, 0, 5, 6], [1, 2, 3, 7, 8, 9, 0, 11]])
    assert not proposer.begin_step().drafts
    drafts = proposer.propose_trees(["a", "b"], [[6], [11]], np.array([8, 8]), tokens, [True, True], StepDecision(drafts=False))
    assert drafts[0][:3] == [4, 4, 4]
    assert trie.drafted_requests == 2.0 and model.drafted_requests == 0.0
    proposer.observe(["a"], [proposer.trees["a"]], [[0, 1, 2]])
    assert "a" in trie.calibrated._requests and "a" not in model.calibrated._requests
    trie.pauses._paused = 2
    assert not proposer.begin_step().drafts
    drafts = proposer.propose_trees(["a", "b"], [[6], [11]], np.array([8, 8]), tokens, [True, True], StepDecision(drafts=False))
    assert drafts == [[], []] and trie.pauses._paused == 1


def test_with_every_node_verified_a_paused_step_drafts_the_trie():
    """``load_budget: fixed`` has no budgets; a step paused from outside
    (the engine tests' pause patterns) still drafts the retrieval trie."""
    import numpy as np

    from test_policies import proposer_for
    from vllm_adaptive_spec.budget.pause_control import StepDecision
    from vllm_adaptive_spec.config import TreeConfig

    proposer = proposer_for(TreeConfig("hybrid", "dynatree", 8, {"l_max": 2, "evidence_prior": 0.0}, {"window": 1},
                                       load_budget="fixed"))
    assert proposer.load_budget is None and proposer.paused_budget is None
    tokens = np.array([[5, 6, 4, 4, 4, 0, 5, 6]])
    drafts = proposer.propose_trees(["a"], [[6]], np.array([8]), tokens, [True], StepDecision(drafts=False))
    assert drafts[0][:3] == [4, 4, 4] and proposer.stats.paused_trees == 1


def test_uniform_steps_give_both_budgets_the_width_choice_over_one_cost_model():
    """With uniform steps on, the model's and the trie's budgets choose
    widths over one cost model (decode-only steps of one row count feed its
    table of measured step shapes), sharing its step-cost fit."""
    from test_policies import proposer_for
    from vllm_adaptive_spec.budget.cost_models import ShapeCost
    from vllm_adaptive_spec.config import TreeConfig

    proposer = proposer_for(TreeConfig("hybrid", "dynatree", 8, {"l_max": 2, "evidence_prior": 0.0}, {"window": 1},
                                       step_shape="uniform"))
    model, trie = proposer.load_budget, proposer.paused_budget
    assert proposer.mode.uniform and proposer.mode.widths == (2, 4, 8)
    assert isinstance(proposer.cost, ShapeCost) and model.cost is trie.cost is proposer.cost
    assert model.fit is trie.fit is proposer.cost.fit
    assert model.pauses.realized and not trie.pauses.realized
    proposer.observe_step(3 * 5, 0.02, 0, uniform_rows=5)  # 3 requests of 5 rows
    proposer.observe_step(20, 0.03, 12)  # prompt chunks: not a step shape of the table
    assert proposer.cost.table.measured(3, 5) == 0.02 and model.fit.steps_seen == 2


class FixedTableBackend(TableBackend):
    """The table backend as a fixed draft loop runs (``draft_layers.FixedLayers``): nothing read back."""

    fixed_layers, device = True, torch.device("cpu")

    def feed(self, scratch, live, tokens, parents):
        ids = scratch.count.unsqueeze(1) + live.long().cumsum(1) - 1
        fed = live & (ids < self.capacity)
        scratch.count += fed.sum(1)
        dist = self.summary(self.table[tokens.clamp(min=0)])
        return torch.where(fed, ids, -1), dist._replace(probs=torch.where(fed.unsqueeze(-1), dist.probs, 0.0))


HYBRID_POLICIES = {
    "eagle2": lambda: Eagle2Policy(top_k=3, depth=4),
    "talon": lambda: TalonPolicy(top_k=3, k_c=3, max_depth=6),
    "dynatree": lambda: DynaTreePolicy(),
}


def hybrid_trees(backend, policy, budget: int, contexts, width: int | None = None, **retrieval):
    """The hybrid's trees: grown by ``grow`` (``width`` None), or at fixed capacity."""
    drafter = HybridDrafter(evidence_prior=2.0, l_max=3, max_matches=6, **retrieval)
    drafter.bind(backend, policy.fanout, policy.entropy_top_m)
    ids = [f"r{b}" for b in range(len(contexts))]
    drafter.prepare(ids, Contexts.of(contexts), list(range(len(contexts))))
    policy.begin(ids)
    budgets = torch.full((len(contexts),), budget)
    if width is None:
        return grow(drafter, policy, budgets, drafter.max_depth)[0]
    return grow_fixed(drafter, policy, budgets, policy.depth_limit(budget), width).to_trees()


def repetitive_contexts(seed: int, batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4, (int(n),), generator=gen).tolist() for n in torch.randint(2, 40, (batch,), generator=gen)]


@pytest.mark.parametrize("name", list(HYBRID_POLICIES))
def test_the_tensor_matcher_and_the_fixed_loop_give_the_trie_matchers_trees(name):
    """The merge by token is tensor operations over either matcher's
    children: the tensor matcher's hybrid trees equal the trie's, ragged and
    at fixed capacity (the policy's layer width), on repetitive contexts."""
    merged_any = 0
    for seed in range(3):
        roots, table = make(seed=seed, batch=5)
        contexts = repetitive_contexts(seed, 5)
        trie = hybrid_trees(TableBackend(roots, table), HYBRID_POLICIES[name](), 10, contexts)
        tensors = hybrid_trees(TableBackend(roots, table), HYBRID_POLICIES[name](), 10, contexts, matcher="tensors")
        assert tensors == trie
        policy = HYBRID_POLICIES[name]()
        fixed = hybrid_trees(FixedTableBackend(roots, table), policy, 10, contexts, policy.layer_width(10),
                             matcher="tensors")
        assert fixed == trie
        model = grow_model(TableBackend(roots, table), HYBRID_POLICIES[name](), 10, batch=5)
        merged_any += sum(a != b for a, b in zip(trie, model))
    assert merged_any > 3  # the trie changed the model's trees


def test_at_fixed_capacity_nothing_is_read_back_and_the_operations_do_not_grow():
    """The hybrid over the tensor matcher and a fixed draft loop: the same
    operations at batch 8 and 64 and at budgets 6 and 12, none a read."""
    counts = []
    for batch, budget in ((8, 6), (64, 6), (8, 12), (64, 12)):
        roots, table = make(seed=batch, batch=batch)
        contexts = repetitive_contexts(budget, batch)

        def trees():
            policy = Eagle2Policy(top_k=3, depth=4)
            drafter = HybridDrafter(l_max=3, max_matches=6, matcher="tensors")
            drafter.bind(FixedTableBackend(roots, table), policy.fanout, policy.entropy_top_m)
            drafter.prepare([f"r{b}" for b in range(batch)], Contexts.of(contexts), list(range(batch)))
            return grow_fixed(drafter, policy, torch.full((batch,), budget), 4, policy.layer_width(budget))

        counts.append(dispatched(trees))
    assert all(count == counts[0] for count in counts)
    assert not reads(counts[0])


def merged_reference(tokens, q, kids):
    """The merge one element at a time: each trie child (in order) joins the
    model's slot with its token (if that slot exists) taking the larger
    ``q``, or takes the next free slot after the model's."""
    batch, width, fanout = tokens.shape
    extra = kids.q.shape[-1]
    out_tokens = torch.cat([tokens, torch.zeros(batch, width, extra, dtype=torch.long)], -1)
    out_q = torch.cat([q, torch.zeros(batch, width, extra)], -1)
    children = torch.full((batch, width, fanout + extra), NO_TRIE_NODE, dtype=torch.long)
    for b in range(batch):
        for f in range(width):
            offered, free = tokens[b, f].tolist(), fanout
            for token, chance, child in zip(*(x[b, f].tolist() for x in (kids.tokens, kids.q, kids.handles))):
                if chance == 0:
                    continue
                where = offered.index(token) if token in offered else -1
                if where < 0 or q[b, f, where] == 0:
                    where, free = free, free + 1
                    out_tokens[b, f, where] = token
                out_q[b, f, where] = max(float(out_q[b, f, where]), chance)
                children[b, f, where] = child
    return out_tokens, out_q, children


@pytest.mark.parametrize("seed", range(6))
def test_the_merge_by_token_equals_its_reference(seed):
    """Tokens both sides offer (a small vocabulary), model slots with ``q``
    0, trie children of every count: once sorted by ``q`` as the drafter
    sorts them, the same candidates (token, ``q``, trie child)."""
    gen = torch.Generator().manual_seed(seed)
    batch, width, fanout, extra = 3, 4, 3, 5
    tokens = torch.stack([torch.randperm(8, generator=gen)[:fanout] for _ in range(batch * width)]).view(batch, width, -1)
    q = torch.rand(batch, width, fanout, generator=gen) * (torch.rand(batch, width, fanout, generator=gen) > 0.2)
    kid_tokens = torch.stack([torch.randperm(8, generator=gen)[:extra] for _ in range(batch * width)])
    kid_q = torch.rand(batch * width, extra, generator=gen) * (torch.arange(extra) < torch.randint(0, extra + 1, (batch * width, 1), generator=gen))
    kids = Candidates(kid_tokens.view(batch, width, -1), kid_q.view(batch, width, -1),
                      torch.randint(0, 50, (batch, width, extra), generator=gen))
    want = merged_reference(tokens, q, kids)
    (g_tokens, g_q, g_child), (w_tokens, w_q, w_child) = sorted_by_q(*merged(tokens, q, kids)), sorted_by_q(*want)
    assert torch.equal(g_q, w_q) and torch.equal(g_child, w_child)
    assert torch.equal(torch.where(g_q > 0, g_tokens, -1), torch.where(w_q > 0, w_tokens, -1))
    assert (want[2][..., :fanout] >= 0).any() and (want[2][..., fanout:] >= 0).any()  # both kinds of join happened


def sorted_by_q(tokens, q, children):
    q, order = q.sort(dim=-1, descending=True, stable=True)
    return tokens.gather(-1, order), q, children.gather(-1, order)


def _paused_hybrid():
    """A hybrid proposer (EAGLE-2 on the fake backend) whose model's budget pauses."""
    from test_policies import proposer_for
    from vllm_adaptive_spec.config import TreeConfig

    proposer = proposer_for(TreeConfig("hybrid", "eagle2", 8, {"l_max": 2, "evidence_prior": 0.0},
                                       {"top_k": 2, "depth": 3}))
    roots, table = make(seed=3)
    proposer.drafter.bind(TableBackend(roots, table), proposer.policy.fanout, proposer.policy.entropy_top_m)
    proposer.load_budget.pauses._paused = 3
    return proposer


def _paused_step(proposer, fill_pass, decision=None):
    import numpy as np

    from vllm_adaptive_spec.budget.pause_control import StepDecision

    tokens = np.array([[5, 6, 4, 4, 4, 0, 5, 6], [1, 2, 3, 7, 8, 9, 0, 11]])
    decision = decision or proposer.begin_step()
    assert not decision.drafts
    return proposer.propose_trees(["a", "b"], [[6], [11]], np.array([8, 8]), tokens, [True, True], decision,
                                  fill_pass=fill_pass)


def test_the_head_fills_the_requests_the_trie_leaves_without_a_tree():
    """A paused step: a (whose context repeats) gets the trie's tree; b, with
    no match, the head's tree alone, its first pass run for b's row only,
    timed and calibrated into the fill's own budget, its tree the policy's."""
    from vllm_adaptive_spec.step.propose import FirstPass

    proposer = _paused_hybrid()
    asked = []

    def fill_pass(rows):
        asked.append(rows)
        return FirstPass(rows, 0.002)

    drafts = _paused_step(proposer, fill_pass)
    assert asked == [{1}] and drafts[0][:3] == [4, 4, 4] and drafts[1]
    fill, model, trie = proposer.fill_budget, proposer.load_budget, proposer.paused_budget
    assert fill.drafted_requests == 1.0 and model.drafted_requests == 0.0 and trie.drafted_requests == 2.0
    stats = proposer.stats.as_dict()
    assert stats["fill_trees"] == 1 and stats["paused_trees"] == 1 and stats["draft_passes"] >= 1
    proposer.observe(["a", "b"], [proposer.trees["a"], proposer.trees["b"]], [[0], [0]])
    assert "b" in fill.calibrated._requests and "b" not in model.calibrated._requests
    assert "a" in trie.calibrated._requests
    proposer.forget(["a", "b"], finished=["a", "b"])
    assert set(proposer.requests_held().values()) == {0}


def test_no_fill_where_its_budget_pauses_on_a_control_step_or_without_the_engines_pass():
    from vllm_adaptive_spec.budget.pause_control import StepDecision
    from vllm_adaptive_spec.step.propose import FirstPass

    def refused(rows):
        raise AssertionError("no fill was due")

    proposer = _paused_hybrid()
    proposer.fill_budget.pauses._paused = 2
    assert _paused_step(proposer, refused)[1] == []
    assert _paused_step(_paused_hybrid(), refused, StepDecision(drafts=False, control=True)) == [[], []]
    assert _paused_step(_paused_hybrid(), None)[1] == []
    limited = _paused_hybrid()
    limited.fill_budget.pauses._proven = False  # slow start: at most probe_requests rows (here one is wanted)
    assert _paused_step(limited, lambda rows: FirstPass(set(), 0.0))[1] == []  # the engine fed none of them


def test_a_control_step_of_the_fills_budget_is_draft_free_for_every_part():
    """While the model is paused its budget asks for no control step; the
    fill's budget does, and then neither the trie nor the head drafts, so
    the step-cost fit (and a uniform step's shape table) sees steps without trees."""
    from vllm_adaptive_spec.budget.pause_control import StepDecision

    def refused(rows):
        raise AssertionError("no fill was due")

    proposer = _paused_hybrid()
    proposer.fill_budget.begin_step = lambda: StepDecision(drafts=False, control=True)
    assert _paused_step(proposer, refused) == [[], []]
    assert proposer.stats.controls == 1 and proposer.stats.paused_trees == 0
