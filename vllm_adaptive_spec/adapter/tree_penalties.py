"""Presence, frequency and repetition penalties along tree paths (issue 54).

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
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.model_executor.layers.utils import apply_penalties

from vllm_adaptive_spec.adapter.transfer import to_device


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
    local = np.arange(len(owner)) - np.repeat(np.cumsum([0, *counts[:-1]]), counts)
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
