"""Tree verification (docs/algorithms.md section 1), batched over requests.

Every verification row ``r`` (row 0 = root, row ``i + 1`` = node ``i``) gets
one *target token* ``y_r``: the target's argmax (greedy), or one sample from
the target's processed distribution ``P_r`` (sampling). A node is accepted
when its token equals its parent row's target token and its parent is
accepted; the committed tokens are the accepted path plus the target token of
the deepest accepted row (the bonus).

Sampling decision: the spec's sequential elimination (visit the children in
descending ``q``, accept child ``c`` with probability ``P(c)``, else zero it and
renormalise; with no child left sample from the rest) accepts child ``c`` with
probability exactly ``P(c)`` and otherwise yields ``P`` conditioned on "not a
child". Drawing one ``y ~ P`` and accepting the child that carries ``y`` (or
committing ``y`` as the bonus) has the same law, so both rules are one rule,
and every committed token is distributed as the target's whatever the tree.
``tests/test_verify.py`` checks this against the sequential form statistically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_adaptive_spec.trees.tree import TreeBatch

PAD = -1


@dataclass
class Acceptance:
    """``num_accepted`` [B]; ``path`` [B, W]: accepted node indices, shallowest
    first, ``-1`` after ``num_accepted``; ``output_tokens`` [B, W + 1]: the path's
    tokens, then the bonus token, then ``-1`` (vLLM's sampler-output layout)."""

    num_accepted: torch.Tensor
    path: torch.Tensor
    output_tokens: torch.Tensor


def accept(tree: TreeBatch, row_tokens: torch.Tensor, ancestors: torch.Tensor | None = None) -> Acceptance:
    """Accept paths given each row's target token ``row_tokens`` [B, 1 + W]."""
    batch, width = tree.tokens.shape
    device = tree.tokens.device
    if width == 0:
        output = torch.cat([row_tokens[:, :1], row_tokens.new_full((batch, 0), PAD)], dim=1)
        empty = torch.zeros(batch, dtype=torch.long, device=device)
        return Acceptance(empty, torch.empty(batch, 0, dtype=torch.long, device=device), output)
    ancestors = tree.ancestor_mask() if ancestors is None else ancestors
    valid = tree.valid()
    expected = row_tokens.gather(1, tree.parents + 1)
    matched = valid & (tree.tokens == expected)
    # Accepted: every node on the way from the root (itself included) matched.
    accepted = valid & ~(ancestors & ~matched.unsqueeze(1)).any(-1)
    num_accepted = accepted.sum(1)

    # Breadth-first order puts the accepted nodes (one per depth) shallowest first.
    slots = torch.arange(width, device=device).expand(batch, width)
    path = torch.sort(torch.where(accepted, slots, width), dim=1).values
    in_path = slots < num_accepted.unsqueeze(1)
    path = torch.where(in_path, path, PAD)

    deepest_row = path.gather(1, (num_accepted - 1).clamp(min=0).unsqueeze(1)).squeeze(1) + 1
    deepest_row = torch.where(num_accepted > 0, deepest_row, 0)
    bonus = row_tokens.gather(1, deepest_row.unsqueeze(1))

    output = torch.full((batch, width + 1), PAD, dtype=row_tokens.dtype, device=device)
    output[:, :width] = torch.where(in_path, tree.tokens.gather(1, path.clamp(min=0)), PAD)
    output.scatter_(1, num_accepted.unsqueeze(1), bonus)
    return Acceptance(num_accepted, path, output)


def path_moves(acceptance: Acceptance, first_node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV compaction's moves: the accepted node at depth ``d`` of tree ``k``
    moves from query row ``first_node[k] + path[k, d]`` to row ``first_node[k]
    + d``, right after the root. Returns ``(src, dst)`` rows [B, W], ``-1``
    where nothing moves (no node there, or it is already in place). Decision:
    a row is formed only for a move, never for the empty depths of a tree
    shallower than the batch's widest: those would point past the tree's own
    rows, and past the step's last row when the tree is the step's last."""
    path = acceptance.path
    depth = torch.arange(path.shape[1], device=path.device).unsqueeze(0)
    live = (path >= 0) & (path != depth)
    first = first_node.unsqueeze(1)
    return torch.where(live, first + path, PAD), torch.where(live, first + depth, PAD)


def sample_with_noise(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One sample per row of ``probs`` [R, V] from i.i.d. Exp(1) ``noise`` [R, V]:
    ``argmax(p / e)`` (the exponential race; the smallest ``e / p`` wins with
    probability ``p``)."""
    return (probs / noise).argmax(dim=-1)
