"""Tree verification (docs/algorithms.md section 1): the acceptance walk, and the
lossless sampling rule checked statistically."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from test_tree import random_bfs_tree

from vllm_adaptive_spec.trees.tree import ROOT, DraftTree, TreeBatch
from vllm_adaptive_spec.trees.verify import accept, path_moves, sample_with_noise

ALPHA = 1e-3  # false-alarm rate of every chi-square test below


def naive_accept(tree: DraftTree, rows: list[int], width: int) -> tuple[list[int], list[int]]:
    """The spec's walk: returns (path, output tokens padded to ``width + 1``)."""
    node, path = ROOT, []
    while True:
        y = rows[node + 1]
        child = [i for i in range(len(tree)) if tree.parents[i] == node and tree.tokens[i] == y]
        if not child:
            break
        node = child[0]
        path.append(node)
    output = [tree.tokens[i] for i in path] + [rows[node + 1]]
    return path, output + [-1] * (width + 1 - len(output))


def check_against_naive(trees: list[DraftTree], rows: torch.Tensor) -> torch.Tensor:
    batch = TreeBatch.from_trees(trees)
    result = accept(batch, rows)
    for b, tree in enumerate(trees):
        path, output = naive_accept(tree, rows[b].tolist(), batch.width)
        assert result.num_accepted[b].item() == len(path)
        assert result.path[b].tolist() == path + [-1] * (batch.width - len(path))
        assert result.output_tokens[b].tolist() == output
    return result.num_accepted


def test_accept_on_a_batch_of_empty_trees():
    result = accept(TreeBatch.from_trees([DraftTree(), DraftTree()]), torch.tensor([[5], [7]]))
    assert result.num_accepted.tolist() == [0, 0]
    assert result.output_tokens.tolist() == [[5], [7]]


def test_accept_examples():
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 1, 2], [0.6, 0.4, 1.0, 1.0])  # 5 | 6 -> 7 -> 8
    chain = DraftTree.chain([1, 2, 3])
    trees = [tree, DraftTree(), chain, tree, chain]
    rows = torch.tensor(
        [
            [6, 0, 7, 8, 9],  # deepest path, fully accepted: 6 7 8 + bonus 9
            [4, -1, -1, -1, -1],  # empty tree: bonus only
            [1, 2, 9, 3, 0],  # chain broken at depth 3: 1 2 + bonus 9
            [5, 3, 0, 0, 0],  # leaf child accepted: 5 + bonus from its row
            [8, 2, 3, 4, 0],  # nothing accepted
        ]
    )
    result = accept(TreeBatch.from_trees(trees), rows)
    assert result.num_accepted.tolist() == [3, 0, 2, 1, 0]
    assert result.path.tolist() == [[1, 2, 3, -1], [-1] * 4, [0, 1, -1, -1], [0, -1, -1, -1], [-1] * 4]
    assert result.output_tokens.tolist() == [
        [6, 7, 8, 9, -1],
        [4, -1, -1, -1, -1],
        [1, 2, 9, -1, -1],
        [5, 3, -1, -1, -1],
        [8, -1, -1, -1, -1],
    ]


def test_path_moves_stay_inside_each_trees_rows():
    """KV compaction's moves for a step whose last tree is shallower than the
    batch's widest and ends on the step's last row (12 rows: a decode row,
    then a 4-node tree's root and nodes at rows 1-5, a prompt chunk, then a
    2-node tree's root and nodes at rows 9-11)."""
    deep = DraftTree([5, 6, 7, 8], [-1, -1, 1, 2], [0.6, 0.4, 1.0, 1.0])  # 5 | 6 -> 7 -> 8
    wide = DraftTree([9, 10], [-1, -1], [0.5, 0.5])
    rows = torch.tensor([[6, 0, 7, 8, 9], [10, 0, 3, -1, -1]])
    result = accept(TreeBatch.from_trees([deep, wide]), rows)
    src, dst = path_moves(result, torch.tensor([2, 10]))
    assert src.tolist() == [[3, 4, 5, -1], [11, -1, -1, -1]]
    assert dst.tolist() == [[2, 3, 4, -1], [10, -1, -1, -1]]
    in_place = accept(TreeBatch.from_trees([deep]), torch.tensor([[5, 1, 0, 0, 0]]))  # node 0 is at depth 0
    assert path_moves(in_place, torch.tensor([2]))[0].tolist() == [[-1, -1, -1, -1]]


def test_full_acceptance_of_a_deep_chain():
    tokens = list(range(10, 30))
    rows = torch.tensor([tokens + [99]])
    result = accept(TreeBatch.from_trees([DraftTree.chain(tokens)]), rows)
    assert result.num_accepted.tolist() == [20]
    assert result.output_tokens.tolist() == [tokens + [99]]


def test_accept_matches_naive_walk():
    """Random padded batches (an empty tree in each); row tokens are one of the
    row's children's tokens with probability 0.85, so paths often go deep."""
    rng = random.Random(0)
    accepted = []
    for _ in range(50):
        trees = [DraftTree()] + [random_bfs_tree(rng, rng.randint(0, 20)) for _ in range(7)]
        width = max(len(t) for t in trees)
        rows = []
        for tree in trees:
            row = []
            for node in range(ROOT, width):  # row 0 is the root; padding rows too
                kids = [tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == node]
                row.append(rng.choice(kids) if kids and rng.random() < 0.85 else rng.randrange(32))
            rows.append(row)
        accepted += check_against_naive(trees, torch.tensor(rows)).tolist()
    assert min(accepted) == 0 and max(accepted) >= 6


# --- Lossless sampling -----------------------------------------------------

V = 6
# Root children 0, 1, 2 (nodes 0-2); node 0 has children 1, 3 (nodes 3, 4); node 1 has child 4 (node 5).
TREE = DraftTree([0, 1, 2, 1, 3, 4], [-1, -1, -1, 0, 0, 1], [0.5, 0.3, 0.2, 0.7, 0.3, 1.0])
ROW_OF_ROOT_CHILD = {0: 1, 1: 2, 2: 3}  # first token -> its verification row
CHILDREN = {0: [(0, 1), (1, 2), (2, 3)], 1: [(1, 4), (3, 5)], 2: [(4, 6)]}  # row -> (token, row), by descending q


def distributions(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Target law per verification row P [7, V], and after off-tree first tokens Q [V, V]."""
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.ones(V), size=1 + len(TREE)), rng.dirichlet(np.ones(V), size=V)


def exact_joint(P: np.ndarray, Q: np.ndarray) -> np.ndarray:
    """The target's own law of the first two committed tokens (x1, x2)."""
    return np.stack([P[0, x1] * (P[ROW_OF_ROOT_CHILD[x1]] if x1 in ROW_OF_ROOT_CHILD else Q[x1]) for x1 in range(V)])


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit; cells with expected count < 5 are pooled (and the pool
    joins the smallest other cell if it is still under 5)."""
    counts, expected = counts.ravel().astype(float), probs.ravel() * counts.sum()
    small = expected < 5
    obs, exp = list(counts[~small]), list(expected[~small])
    if small.any():
        pool_obs, pool_exp = counts[small].sum(), expected[small].sum()
        if pool_exp < 5:
            k = int(np.argmin(exp))
            obs[k], exp[k] = obs[k] + pool_obs, exp[k] + pool_exp
        else:
            obs.append(pool_obs), exp.append(pool_exp)
    return chisquare(obs, exp).pvalue


def joint_counts(pairs) -> np.ndarray:
    counts = np.zeros((V, V))
    for x1, x2 in pairs:
        counts[x1, x2] += 1
    return counts


def committed_pair_counts(tree: DraftTree, rows_law: np.ndarray, Q: np.ndarray, trials: int,
                          gen: torch.Generator) -> np.ndarray:
    """Verify ``trials`` copies of ``tree`` with each row's target token drawn
    as ``sample_with_noise(rows_law[row], Exp(1))``; counts [V * V] of the first
    two committed tokens (x2 drawn from ``Q[x1]`` when x1 left the tree, as the
    next step would)."""
    vocab = rows_law.shape[1]
    target = torch.tensor(rows_law, dtype=torch.float32).expand(trials, -1, -1)
    noise = torch.empty(trials, rows_law.shape[0], vocab).exponential_(generator=gen)
    row_tokens = sample_with_noise(target, noise)
    one = TreeBatch.from_trees([tree])
    batch = TreeBatch(one.tokens.expand(trials, -1), one.parents.expand(trials, -1), one.num_nodes.expand(trials))
    result = accept(batch, row_tokens)
    x1 = result.output_tokens[:, 0]
    off_tree = torch.multinomial(torch.tensor(Q, dtype=torch.float32)[x1], 1, generator=gen).squeeze(1)
    x2 = torch.where(result.num_accepted >= 1, result.output_tokens[:, 1], off_tree)
    return torch.bincount(x1 * vocab + x2, minlength=vocab * vocab).numpy()


@pytest.mark.parametrize("seed, wrong_rows", [(0, False), (1, False), (0, True)])
def test_accept_with_sampled_row_tokens_is_lossless(seed, wrong_rows):
    """200k trials in one batch of identical trees: every row's target token is
    ``sample_with_noise(P_row, Exp(1))``; x1, x2 are the first two committed
    tokens (x2 drawn from Q[x1] when x1 left the tree, as the next step would).
    Their joint law must be the target's: chi-square at alpha = 1e-3. Power
    check: sampling every row from the root's distribution must be rejected."""
    P, Q = distributions(seed)
    rows = 1 + len(TREE)
    gen = torch.Generator().manual_seed(seed)
    counts = committed_pair_counts(TREE, P[[0] * rows] if wrong_rows else P, Q, 200_000, gen)
    pvalue = chi_square_pvalue(counts, exact_joint(P, Q))
    assert (pvalue < ALPHA) == wrong_rows, pvalue


def sequential_elimination(rng: random.Random, P: np.ndarray, rule: str) -> list[int]:
    """Committed tokens of one step. ``exact`` is the spec's rule verbatim:
    visit children by descending q, accept c w.p. P(c), else zero it and
    renormalise; with none left sample the bonus from the rest. ``no_renorm``
    forgets to zero and renormalise; ``top_q`` always accepts the top child."""
    row, committed = 0, []
    while True:
        p = list(P[row])
        for token, child_row in CHILDREN.get(row, []):
            if rule == "top_q" or rng.random() < p[token]:
                committed.append(token)
                row = child_row
                break
            if rule == "exact":
                p[token] = 0.0
                total = sum(p)
                p = [x / total for x in p]
        else:
            committed.append(rng.choices(range(V), weights=p)[0])
            return committed


@pytest.mark.parametrize("rule", ["exact", "no_renorm", "top_q"])
def test_sequential_elimination_reference(rule):
    """The spec's literal rule passes the chi-square test of the joint law
    (30k trials, alpha = 1e-3); two deliberately wrong verifiers fail it."""
    P, Q = distributions(2)
    rng = random.Random(2)
    pairs = []
    for _ in range(30_000):
        committed = sequential_elimination(rng, P, rule)
        x1 = committed[0]
        pairs.append((x1, committed[1] if len(committed) > 1 else rng.choices(range(V), weights=Q[x1])[0]))
    pvalue = chi_square_pvalue(joint_counts(pairs), exact_joint(P, Q))
    assert (pvalue >= ALPHA) == (rule == "exact"), pvalue
