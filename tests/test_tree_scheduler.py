"""The scheduler's grammar walk over a tree (``adapter/tree_scheduler``), with
a stand-in grammar (plain logic, no engine): the nodes it keeps are exactly
those whose path the grammar accepts, the kept tree keeps its shape, and
the matcher ends where it began; the tokens a grammar forces are its only
choices, read from its bitmask."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_adaptive_spec.adapter.tree_scheduler import (
    forced_tokens,
    grammar_kept,
    jump_forward_tokens,
    only_token,
    tree_rows,
    without_removed,
)
from vllm_adaptive_spec.trees.tree import DraftTree

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


class MaskedWordGrammar(WordGrammar):
    """``WordGrammar`` that also fills a bitmask row (vocabulary ``VOCAB``)."""

    VOCAB = 70  # three int32 words, the last partly used

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        bits = [0] * bitmask.shape[1]
        for token in range(self.VOCAB):
            if self.validate_tokens([token]) == [token]:
                bits[token // 32] |= 1 << (token % 32)
        bitmask[idx] = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32)


@pytest.mark.parametrize("token", [0, 5, 31, 32, 63, 69])
def test_only_token_reads_a_single_allowed_bit_and_nothing_else(token):
    row = torch.zeros(3, dtype=torch.int32)
    assert only_token(row) is None
    word = 1 << (token % 32)
    row[token // 32] = word - (1 << 32) if word >= 1 << 31 else word
    assert only_token(row) == token
    other = (token + 1) % 70
    row[other // 32] |= torch.tensor(1 << (other % 32), dtype=torch.int64).to(torch.int32)
    assert only_token(row) is None


@pytest.mark.parametrize(("start", "limit", "expected"), [
    ([], 5, []),              # 1, 2 or 3 may start a word: nothing forced
    ([3], 5, [1, 1, 2]),      # only "3 1 1 2" starts with 3: forced to its end
    ([3], 2, [1, 1]),         # at most ``limit``
    ([1], 5, [2]),            # then 3 or 4: a choice
    ([1, 2, 4], 5, [5]),
    ([2, 3], 5, []),          # ended
])
def test_forced_tokens_are_the_grammars_only_choices_and_the_matcher_ends_where_it_began(start, limit, expected):
    grammar = MaskedWordGrammar(start)
    scratch = torch.zeros(1, 3, dtype=torch.int32)
    assert forced_tokens(grammar, "r", scratch, limit) == expected
    assert grammar.accepted == start


class JumpForwardGrammar(WordGrammar):
    """``WordGrammar`` whose matcher reports a jump-forward string: the
    characters every word extending the accepted prefix continues with."""

    def __init__(self, start: list[int]) -> None:
        super().__init__(start)
        self.matcher = self

    def find_jump_forward_string(self) -> str:
        # xgrammar's matcher aborts once its stop token is accepted (``ignore_eos`` decodes on).
        assert not self.is_terminated(), "Check failed: (!IsStopTokenAccepted())"
        words = [word[len(self.accepted):] for word in WORDS if word[: len(self.accepted)] == self.accepted]
        common = []
        for column in zip(*words) if words else ():
            if len(set(column)) > 1:
                break
            common.append(column[0])
        return "".join(str(token) for token in common)


@pytest.mark.parametrize(("start", "limit", "expected"), [
    ([], 5, []), ([3], 5, [1, 1]), ([3], 1, [1]), ([1], 5, []), ([1, 2, 4], 5, []), ([2, 3], 5, []),
])
def test_jump_forward_tokens_spell_the_forced_string_but_its_last_token(start, limit, expected):
    grammar = JumpForwardGrammar(start)
    assert jump_forward_tokens(grammar, lambda text: [int(c) for c in text], limit) == expected
    assert grammar.accepted == start
    # A tokenizer that spells the string otherwise: what the grammar accepts of it
    assert jump_forward_tokens(grammar, lambda text: [9] * len(text), limit) == []


def test_a_terminated_grammar_forces_nothing_and_is_not_asked():
    """A grammar that has ended (a request with ``ignore_eos`` decodes past
    it, as vLLM lets it) forces no tokens, and its matcher is not asked for
    a jump-forward string (xgrammar's check aborts the engine)."""
    grammar = JumpForwardGrammar([1, 2, 3])
    assert grammar.is_terminated()
    assert jump_forward_tokens(grammar, lambda text: [int(c) for c in text], 5) == []


def test_a_walk_that_raises_leaves_the_matcher_where_it_began():
    """A failure inside the grammar's walk (a cut, a bitmask row) costs the
    request its tree for the step (``failures.Failures``); the matcher
    must still be where it was, or the request's later steps would read a
    grammar state its output never reached."""
    grammar = WordGrammar([])
    tree = DraftTree([1, 2, 3], [-1, 0, 1], [1.0] * 3)

    def fail_deep(node: int) -> None:
        if node == 2:
            raise RuntimeError("injected")

    with pytest.raises(RuntimeError):
        tree_rows(grammar, "r", tree.tokens, tree.parents, fail_deep, lambda row: None, -1)
    assert grammar.accepted == []
