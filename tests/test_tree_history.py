"""A tree row's history: every tree row's logits are what vLLM's
own penalties and bad words give that row's request after its output and
the row's path (node and ancestors), the root's row after the output alone."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
from test_tree import random_bfs_tree
from vllm.v1.sample.ops.bad_words import apply_bad_words
from vllm.v1.sample.ops.penalties import apply_all_penalties

from vllm_adaptive_spec.adapter.tree_history import RowHistories, apply_row_penalties, row_histories
from vllm_adaptive_spec.trees.tree import DraftTree, TreeBatch

VOCAB = 12


def path(tree, node: int) -> list[int]:
    tokens = []
    while node >= 0:
        tokens.append(tree.tokens[node])
        node = tree.parents[node]
    return tokens[::-1]


def test_every_row_is_penalised_after_its_own_path():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    batch = 4
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))] for _ in range(batch)]
    outputs[3].append(-1)  # async scheduling's placeholder
    prompts = torch.full((batch, 6), VOCAB)
    for b in range(batch):
        prompts[b, : 2 + b] = torch.randint(0, VOCAB, (2 + b,), generator=gen)
    metadata = SimpleNamespace(
        prompt_token_ids=prompts, output_token_ids=outputs,
        presence_penalties=torch.tensor([0.5, 0.0, 1.0, 0.3]), frequency_penalties=torch.tensor([0.2, 0.7, 0.0, 0.4]),
        repetition_penalties=torch.tensor([1.3, 1.0, 1.1, 2.0]),
    )
    requests = [2, 0, 3]  # the tree requests, in batch order of their rows
    trees = [random_bfs_tree(rng, n, vocab=VOCAB) for n in (5, 0, 7)]
    batch_of_trees = TreeBatch.from_trees(trees)
    step = SimpleNamespace(tree_batch=batch_of_trees, ancestors=batch_of_trees.ancestor_mask())
    counts = [1 + len(trees[0]) + 2, 1, 1 + len(trees[2])]  # the first has two padding rows (a uniform step)
    histories = row_histories(step, requests, counts, outputs, VOCAB)
    owners = [requests[k] for k, count in enumerate(counts) for _ in range(count)]
    logits = torch.randn(len(owners), VOCAB, generator=gen)
    got = apply_row_penalties(logits.clone(), torch.tensor(owners), histories, metadata)
    row = 0
    for k, count in enumerate(counts):
        request = requests[k]
        for local in range(count):
            node_path = path(trees[k], local - 1) if 1 <= local <= len(trees[k]) else []
            want = apply_all_penalties(
                logits[row: row + 1].clone(), prompts[request: request + 1],
                metadata.presence_penalties[request: request + 1], metadata.frequency_penalties[request: request + 1],
                metadata.repetition_penalties[request: request + 1], [outputs[request] + node_path])
            assert torch.equal(got[row], want[0]), (k, local)
            row += 1
    assert not torch.equal(got, logits)


def test_bad_words_are_banned_after_each_rows_own_path():
    """Two-token bad words whose first token sits on some paths and not on
    others: only the rows whose path (or output) ends with it lose the word's
    last token; a request without bad words is left alone."""
    tree = DraftTree(tokens=[1, 2, 3, 1], parents=[-1, -1, 0, 1], q=[0.5] * 4)
    other = DraftTree.chain([1, 2])
    trees = TreeBatch.from_trees([tree, other])
    step = SimpleNamespace(trees=[tree, other], tree_batch=trees, ancestors=trees.ancestor_mask())
    metadata = SimpleNamespace(no_penalties=True, logitsprocs=None, output_token_ids=[[5, 1], [4], [7]],
                               bad_words_token_ids={0: [[1, 9], [3, 8], [6]]})
    requests, counts = [0, 2], [1 + 4 + 1, 3]  # request 0's tree has a padding row
    histories = RowHistories.of(step, requests, counts, metadata, VOCAB)
    assert histories.tokens is None and histories.texts[6:] == [None] * 3
    owners = [0] * 6 + [2] * 3
    logits = torch.zeros(len(owners), VOCAB)
    histories.ban_bad_words(logits, owners, metadata)
    banned = [sorted(torch.nonzero(row == float("-inf")).flatten().tolist()) for row in logits]
    # Root: output ends with 1. Node 0 (path 1), node 1 (path 2), node 2 (1, 3), node 3 (2, 1), padding.
    assert banned[:6] == [[6, 9], [6, 9], [6], [6, 8], [6, 9], [6, 9]]
    assert banned[6:] == [[], [], []]
    want = logits.new_zeros(6, VOCAB)
    texts = [[5, 1], [5, 1, 1], [5, 1, 2], [5, 1, 1, 3], [5, 1, 2, 1], [5, 1]]
    apply_bad_words(want, {row: metadata.bad_words_token_ids[0] for row in range(6)}, texts)
    assert torch.equal(logits[:6], want)
