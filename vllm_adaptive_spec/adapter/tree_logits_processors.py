"""vLLM's ``logit_bias``, ``min_p`` and ``min_tokens`` on tree rows.

The bias and ``min_p`` do not depend on a request's history, so a tree row
takes its request's as vLLM's sampler gives them to the request's one row
without speculation:
the bias added to its tokens' logits before the penalties (vLLM's
``LogitBiasLogitsProcessor``, a logits processor that can change the
argmax), ``min_p`` after the temperature, before top-k and top-p (vLLM's
``MinPLogitsProcessor``, which only random sampling sees). Both read the
state of vLLM's own processors in the input batch (``sampling_controls``
builds them), keyed by the request's batch index, and repeat their
arithmetic on the rows, so each row's logits are the same floats.

``min_tokens`` depends on the row's place only: vLLM masks a request's stop
tokens while its output is shorter than ``min_tokens``, and a tree row
comes after the output and its path, so the row of a node at depth ``d`` is
masked while the output plus ``d`` is shorter (the root's: ``d = 0``).
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

from vllm_adaptive_spec.step.transfer import to_device


def _processor(processors, kind):
    return next((p for p in processors if isinstance(p, kind)), None)


def _per_request(sampling_metadata, kind, attribute: str) -> dict:
    """The per-request state ``attribute`` (batch index -> its setting) of
    vLLM's processor ``kind`` among those that can change the argmax; empty
    without one."""
    logitsprocs = sampling_metadata.logitsprocs
    processor = None if logitsprocs is None else _processor(logitsprocs.non_argmax_invariant, kind)
    return {} if processor is None else getattr(processor, attribute)


def _biases(sampling_metadata) -> dict[int, dict[int, float]]:
    return _per_request(sampling_metadata, LogitBiasLogitsProcessor, "biases")


def _min_tokens(sampling_metadata) -> dict:
    return _per_request(sampling_metadata, MinTokensLogitsProcessor, "min_toks")


def has_logit_bias(sampling_metadata, requests: list[int]) -> bool:
    """Whether any of ``requests`` (batch indices) has a logit bias."""
    return not _biases(sampling_metadata).keys().isdisjoint(requests)


def apply_row_logit_bias(logits: torch.Tensor, owners: list[int], sampling_metadata) -> None:
    """Each row's request's bias added to the row (``owners``: each row's
    batch index, on the host), in place."""
    biases = _biases(sampling_metadata)
    rows, tokens, values = [], [], []
    for row, owner in enumerate(owners):
        bias = biases.get(owner)
        if bias:
            rows.extend([row] * len(bias))
            tokens.extend(bias.keys())
            values.extend(bias.values())
    if rows:
        device = logits.device
        index = (to_device(rows, torch.long, device), to_device(tokens, torch.long, device))
        logits[index] += to_device(values, torch.float32, device)


def apply_row_min_p(logits: torch.Tensor, request_of_row: torch.Tensor, sampling_metadata) -> None:
    """``min_p`` on tempered rows, in place: tokens whose probability is below
    ``min_p`` times the row's largest are masked."""
    logitsprocs = sampling_metadata.logitsprocs
    processor = None if logitsprocs is None else _processor(logitsprocs.argmax_invariant, MinPLogitsProcessor)
    if processor is None or not processor.min_p_count:
        return
    probabilities = torch.nn.functional.softmax(logits, dim=-1)
    threshold = torch.amax(probabilities, dim=-1, keepdim=True).mul_(processor.min_p[request_of_row])
    logits.masked_fill_(probabilities < threshold, -float("inf"))


def has_min_tokens(sampling_metadata, requests: list[int]) -> bool:
    """Whether any of ``requests`` (batch indices) has ``min_tokens`` still to reach."""
    return not _min_tokens(sampling_metadata).keys().isdisjoint(requests)


def apply_row_min_tokens(logits: torch.Tensor, owners: list[int], depths: list[int], sampling_metadata) -> None:
    """The stop tokens masked on the rows (``depths``: each row's path
    length, on the host) whose request's output plus path is still shorter
    than its ``min_tokens``, in place. As vLLM does for a structured
    request (``MinTokensLogitsProcessor``), a row whose grammar allows
    nothing but a stop token keeps that token: masking it would leave the
    row all ``-inf`` and draw token 0."""
    pending = _min_tokens(sampling_metadata)
    rows, tokens, structured = [], [], []
    for row, (owner, depth) in enumerate(zip(owners, depths)):
        entry = pending.get(owner)
        if entry is not None and len(entry[1]) + depth < entry[0]:
            rows.extend([row] * len(entry[2]))
            tokens.extend(entry[2])
            structured.extend([entry[3]] * len(entry[2]))
    if not rows:
        return
    device = logits.device
    index = (to_device(rows, torch.long, device), to_device(tokens, torch.long, device))
    stop_logits = logits[index]
    logits[index] = -float("inf")
    if any(structured):
        emptied = torch.isneginf(logits[index[0]]).all(dim=-1)
        restore = emptied & torch.isfinite(stop_logits) & to_device(structured, torch.bool, device)
        logits[index[0][restore], index[1][restore]] = stop_logits[restore]
