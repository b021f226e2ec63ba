"""What a tree row's history does to its logits: presence,
frequency and repetition penalties, bad words, and ``min_tokens`` (by its
length, ``tree_logits_processors``).

A tree row's distribution is the target's after its path: a node's row
follows the request's output so far and then the tokens from the root's
child down to that node, so its penalties count those tokens as already
emitted, exactly as vLLM's sampler would count them had the path been
generated (and as vLLM counts a chain's drafts). The root's row counts the
output alone. Penalties count tokens, not their order, so a node's path is
its ancestor-or-self set: the tree's tokens under its ancestor mask, one
tensor operation for all rows (no Python per node). The penalties then run
through vLLM's own ``apply_penalties`` on the rows, each with its request's
prompt and penalty values, so the processed logits are the ones vLLM's
sampler computes for that history.

Bad words read the history in order (a bad word's last token is banned
where the history ends with the rest of it): for the rows of requests with
bad words, each row's output and path as a list, through vLLM's own
``apply_bad_words``. Decision: Python per node there, for those requests
only (a bad-word list is Python per request in vLLM too).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.v1.sample.ops.bad_words import apply_bad_words

from vllm_adaptive_spec.adapter.tree_logits_processors import apply_row_min_tokens, has_min_tokens
from vllm_adaptive_spec.step.transfer import to_device
from vllm_adaptive_spec.trees.packed_ranges import packed_ranges
from vllm_adaptive_spec.trees.tree import DraftTree


class RowHistories(NamedTuple):
    """The tree rows' histories, as the processors that read them need them:
    ``tokens`` [R, L + W] for the penalties (None: the batch has none),
    ``texts`` per row the output then the path, in order, for the rows of
    requests with bad words (None for the others; None: no such request),
    ``depths`` each row's path length where a request has ``min_tokens``
    still to reach (None: none has)."""

    tokens: torch.Tensor | None
    texts: list[list[int] | None] | None
    depths: list[int] | None = None

    @staticmethod
    def of(step, requests: list[int], counts: list[int], sampling_metadata, vocab_size: int) -> "RowHistories | None":
        """The histories of a step's tree rows (``requests``, ``counts`` as
        ``verifier.tree_row_targets`` lays them out), or None where no
        processor reads one."""
        bad = sampling_metadata.bad_words_token_ids
        outputs = sampling_metadata.output_token_ids
        tokens = None if sampling_metadata.no_penalties else row_histories(step, requests, counts, outputs, vocab_size)
        texts = depths = None
        if bad and any(request in bad for request in requests):
            texts = [row for k, request in enumerate(requests)
                     for row in _texts(step.trees[k], counts[k], outputs[request] if request in bad else None)]
        if has_min_tokens(sampling_metadata, requests):
            depths = [depth for k, tree in enumerate(step.trees)
                      for depth in [0, *tree.depths(), *[0] * (counts[k] - 1 - len(tree))]]
        if tokens is None and texts is None and depths is None:
            return None
        return RowHistories(tokens, texts, depths)

    def rows(self, begin: int, end: int) -> "RowHistories":
        return RowHistories(*(None if part is None else part[begin:end] for part in self))

    def ban_bad_words(self, logits: torch.Tensor, owners: list[int], sampling_metadata) -> None:
        """vLLM's bad words on rows ``logits`` (in place; ``owners``: each row's batch index)."""
        if self.texts is not None:
            bad = sampling_metadata.bad_words_token_ids
            apply_bad_words(logits, {row: bad[owner] for row, owner in enumerate(owners)
                                     if self.texts[row] is not None}, self.texts)

    def mask_min_tokens(self, logits: torch.Tensor, owners: list[int], sampling_metadata) -> None:
        """vLLM's ``min_tokens`` on rows ``logits`` (in place), by each row's output and path length."""
        if self.depths is not None:
            apply_row_min_tokens(logits, owners, self.depths, sampling_metadata)

    def penalise(self, logits: torch.Tensor, request_of_row: torch.Tensor, sampling_metadata) -> None:
        """vLLM's penalties on rows ``logits`` (in place)."""
        if self.tokens is not None:
            apply_row_penalties(logits, request_of_row, self.tokens, sampling_metadata)


def _texts(tree: DraftTree, count: int, output: list[int] | None) -> list[list[int] | None]:
    """``count`` rows of a tree (root, nodes, padding): each one's output
    and path in order, or None (the request has no bad words)."""
    if output is None:
        return [None] * count
    paths: list[list[int]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return [output + path for path in ([], *paths)] + [output] * (count - 1 - len(tree))


def row_histories(step, requests: list[int], counts: list[int], output_token_ids: list[list[int]],
                  vocab_size: int) -> torch.Tensor:
    """``[R, L + W]`` every tree row's history, request after request
    (``counts[k]`` rows of request ``requests[k]``: root, nodes, padding):
    the request's output tokens, then the row's path; ``vocab_size`` pads
    (vLLM's convention: a token no vocabulary has)."""
    tree_batch = step.tree_batch
    device = tree_batch.tokens.device
    paths = torch.where(step.ancestors, tree_batch.tokens.unsqueeze(1), vocab_size)
    paths = torch.nn.functional.pad(paths, (0, 0, 1, 0), value=vocab_size)  # the root's row: no path
    owner = np.repeat(np.arange(len(counts)), counts)
    local = packed_ranges(np.zeros(len(counts)), counts)
    owner_t, local_t = to_device(owner, torch.long, device), to_device(local, torch.long, device)
    width = paths.shape[1] - 1
    path = paths[owner_t, local_t.clamp(max=width)]
    path = torch.where((local_t <= tree_batch.num_nodes[owner_t]).unsqueeze(1), path, vocab_size)
    outputs = [output_token_ids[request] for request in requests]
    longest = max((len(o) for o in outputs), default=0)
    padded = np.full((len(outputs), max(longest, 1)), vocab_size, dtype=np.int64)
    for k, output in enumerate(outputs):
        padded[k, : len(output)] = output
    padded[padded < 0] = vocab_size  # async scheduling's -1 placeholders, as vLLM masks them
    return torch.cat([to_device(padded, torch.long, device)[owner_t], path], dim=1)


def apply_row_penalties(logits: torch.Tensor, request_of_row: torch.Tensor, histories: torch.Tensor,
                        sampling_metadata) -> torch.Tensor:
    """vLLM's penalties on rows ``logits`` [R, V] (in place), row ``r``
    penalised as request ``request_of_row[r]`` after ``histories[r]``."""
    return apply_penalties(
        logits,
        sampling_metadata.prompt_token_ids[request_of_row],
        histories,
        sampling_metadata.presence_penalties[request_of_row],
        sampling_metadata.frequency_penalties[request_of_row],
        sampling_metadata.repetition_penalties[request_of_row],
    )
