"""The scheduler's grammar walk over a tree (``adapter/tree_scheduler``), with
a stand-in grammar (plain logic, no engine): the nodes it keeps are exactly
those whose path the grammar accepts, the kept tree keeps its shape, and
the matcher ends where it began."""

from __future__ import annotations

import random

import pytest

from vllm_adaptive_spec.adapter.tree_scheduler import grammar_kept, without_removed
from vllm_adaptive_spec.tree import DraftTree

WORDS = [[1, 2, 3], [1, 2, 4, 5], [2, 3], [3, 1, 1, 2]]  # the strings the grammar accepts (then it ends)


class WordGrammar:
    """Accepts one of ``WORDS``: a token is valid where it continues the
    accepted prefix of one of them; the grammar ends on a whole word that
    no other word extends."""

    def __init__(self, start: list[int]) -> None:
        self.accepted = list(start)

    def _prefix(self, tokens: list[int]) -> bool:
        return any(word[: len(tokens)] == tokens for word in WORDS)

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens if self._prefix(self.accepted + tokens) else []

    def accept_tokens(self, request_id: str, tokens: list[int]) -> None:
        assert self._prefix(self.accepted + tokens)
        self.accepted += tokens

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n:]

    def is_terminated(self) -> bool:
        done = self.accepted
        return done in WORDS and not any(len(word) > len(done) and word[: len(done)] == done for word in WORDS)


def random_tree(rng: random.Random, size: int) -> DraftTree:
    """Parents come first; tokens from a small vocabulary (the grammar's walk needs nothing more)."""
    parents = [rng.randrange(-1, node) for node in range(size)]
    return DraftTree([rng.randint(1, 5) for _ in range(size)], parents, [1.0] * size)


def path(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(tree.tokens[node])
        node = tree.parents[node]
    return out[::-1]


@pytest.mark.parametrize("seed", range(30))
def test_the_kept_nodes_are_those_whose_path_the_grammar_accepts(seed):
    rng = random.Random(seed)
    tree = random_tree(rng, rng.randint(1, 12))
    start = rng.choice([[], [1], [1, 2]])
    grammar = WordGrammar(start)
    kept = grammar_kept(grammar, "r", tree.tokens, tree.parents)
    assert grammar.accepted == start  # rolled back to where it began
    assert kept == [node for node in range(len(tree)) if WordGrammar(start)._prefix(start + path(tree, node))]
    tokens, parents = without_removed(tree.tokens, tree.parents, kept, pad=False)
    assert DraftTree(tokens, parents, [1.0] * len(kept)) == tree.subset(kept)
    padded, _ = without_removed(tree.tokens + [-1, -1], tree.parents, kept, pad=True)
    assert padded == tokens + [-1] * (len(tree) + 2 - len(kept))


def test_a_forbidden_node_takes_its_subtree_and_an_ended_grammar_keeps_nothing_below():
    # 1 -> 2 -> {3, 4 -> 5}, 2 -> 9 (forbidden, its child 5 too), 4 (forbidden at the root)
    tree = DraftTree([1, 4, 2, 3, 4, 9, 5, 5], [-1, -1, 0, 2, 2, 2, 4, 5], [1.0] * 8)
    assert grammar_kept(WordGrammar([]), "r", tree.tokens, tree.parents) == [0, 2, 3, 4, 6]
    ended = DraftTree([3, 4], [-1, 0], [1.0, 1.0])  # after [2]: 3 ends the word [2, 3]
    assert grammar_kept(WordGrammar([2]), "r", ended.tokens, ended.parents) == [0]
    assert grammar_kept(WordGrammar([]), "r", [1, -1], [-1, 0]) == [0]  # padding is never kept
