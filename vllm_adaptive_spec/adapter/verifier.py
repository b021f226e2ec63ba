"""The tree verifier: a drop-in for vLLM's ``RejectionSampler``.

Same call and same output layout (``[num_reqs, max_spec_len + 1]``: the
accepted path, the bonus token, then -1), so vLLM's bookkeeping and scheduler
stay untouched. Each request has ``1 + n`` logits rows (root, then its nodes).

* Requests without a tree keep vLLM's own sampler (penalties, bad words and
  every other processor apply exactly as without speculation); so do
  requests with vLLM's placeholder drafts, sampled from their first row.
* Tree rows are processed as vLLM's sampler processes a row (allowed-token
  mask, bad words, ``min_tokens`` and presence, frequency and repetition
  penalties after the row's path (``tree_history``), logit bias,
  temperature, ``min_p``
  (``tree_logits_processors``), then top-k and top-p through vLLM's own
  ``apply_top_k_top_p``), then each row draws its target token
  (argmax, or one exponential-race sample with the request's generator when
  seeded) and ``verify.accept`` walks the tree (docs/algorithms.md section 1).
  Decision: the argmax is vLLM's ``Sampler.greedy_sample`` (on the CPU
  vLLM's vectorised kernel, 2-3x faster than ``torch.argmax`` over the
  vocabulary), so a tree row's greedy token is the one vLLM would pick. A
  greedy batch takes it over all the step's rows in place, since copying the
  tree rows out cost more than the argmax; sampled rows are gathered and
  drawn in chunks of whole requests (``MAX_CHUNK_ROWS``), so the step's
  scratch memory does not grow with the batch or the trees.
* Logprobs of a committed token come from its parent's row.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.sampler import Sampler
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from kernels.tree_acceptance_cpu import native_accept
from vllm_adaptive_spec.adapter.tree_history import RowHistories
from vllm_adaptive_spec.adapter.tree_logits_processors import apply_row_logit_bias, apply_row_min_p, has_logit_bias
from vllm_adaptive_spec.step import tree_step
from vllm_adaptive_spec.step.failures import Failures
from vllm_adaptive_spec.step.transfer import to_device
from vllm_adaptive_spec.trees.tree import TreeBatch
from vllm_adaptive_spec.trees.verify import PAD, Acceptance, accept, sample_with_noise


_GREEDY_BELOW = 1e-5  # vLLM's sampler treats smaller temperatures as greedy


MAX_CHUNK_ROWS = 64
"""Tree rows whose targets are sampled at once. Sampling holds about six
float32 copies of its rows' logits (the gathered rows, the processed rows,
top-k / top-p's sort, the probabilities, the race's noise), so a step's
scratch is bounded by this many rows whatever the batch and the trees: 64 rows
x 49,152 tokens x 4 B = 12.6 MB a copy for the demo model, where 32 requests
x 17 rows at once held 0.67 GB (memory vLLM's profiling run never sees, and
an allocator keeps)."""


def row_chunks(counts: list[int], max_rows: int) -> list[range]:
    """Consecutive requests (``counts``: each one's rows) grouped into chunks
    of at most ``max_rows`` rows, as ranges of their positions. A request is
    never split, so a seeded request draws all its noise in one call; one with
    more rows than ``max_rows`` is a chunk of its own."""
    chunks, begin, rows = [], 0, 0
    for position, count in enumerate(counts):
        if rows and rows + count > max_rows:
            chunks.append(range(begin, position))
            begin, rows = position, 0
        rows += count
    if counts:
        chunks.append(range(begin, len(counts)))
    return chunks


def tree_row_targets(
    logits: torch.Tensor,
    starts: list[int],
    requests: list[int],
    counts: list[int],
    sampling_metadata,
    histories: RowHistories | None = None,
    max_rows: int = MAX_CHUNK_ROWS,
) -> torch.Tensor:
    """The target token of every row of ``requests`` (batch positions; each
    owns ``counts[k]`` consecutive logits rows from ``starts[request]``),
    request after request; ``histories``: the rows' histories, for penalties
    and bad words (None: no request reads one). A greedy batch without them
    takes one argmax over all the step's rows and
    keeps the tree rows' (no copy of them: on the CPU copying a large step's
    rows cost 5x the argmax, and the rows of requests without trees are one
    each); otherwise the rows are gathered and processed chunk by chunk
    (``row_chunks``)."""
    device = logits.device

    def rows_of(positions) -> list[int]:
        return [starts[requests[k]] + j for k in positions for j in range(counts[k])]

    plain_rows = sampling_metadata.allowed_token_ids_mask is None and histories is None
    if sampling_metadata.all_greedy and plain_rows and not has_logit_bias(sampling_metadata, requests):
        every_row = Sampler.greedy_sample(logits.to(torch.float32))  # vLLM's CPU argmax takes float32 only
        return every_row[to_device(rows_of(range(len(requests))), torch.long, device)]
    pieces, first_row = [], 0
    for chunk in row_chunks(counts, max_rows):
        owners = [requests[k] for k in chunk for _ in range(counts[k])]
        rows = to_device(rows_of(chunk), torch.long, device)
        chunk_histories = None if histories is None else histories.rows(first_row, first_row + len(owners))
        pieces.append(row_target_tokens(logits[rows], owners, sampling_metadata, chunk_histories))
        first_row += len(owners)
    return torch.cat(pieces)


def row_target_tokens(logits: torch.Tensor, owners: list[int], sampling_metadata,
                      histories: RowHistories | None = None) -> torch.Tensor:
    """One target token per logits row ``[R, V]`` (``owners``: each row's
    request in the batch, on the host, so that a seeded request's rows are
    found without a look at the device; ``histories``: as
    ``tree_row_targets``): vLLM's greedy argmax of the processed row for
    greedy requests, a sample from the processed distribution otherwise."""
    request_of_row = to_device(owners, torch.long, logits.device)
    mask = sampling_metadata.allowed_token_ids_mask
    processed = logits.to(torch.float32, copy=True)
    if mask is not None:
        processed.masked_fill_(mask[request_of_row], float("-inf"))
    if histories is not None:
        histories.ban_bad_words(processed, owners, sampling_metadata)
        histories.mask_min_tokens(processed, owners, sampling_metadata)
    apply_row_logit_bias(processed, owners, sampling_metadata)
    if histories is not None:
        histories.penalise(processed, request_of_row, sampling_metadata)
    if sampling_metadata.all_greedy:
        return Sampler.greedy_sample(processed)
    # Before temperature and top-k / top-p change the rows; a random batch needs none.
    greedy = None if sampling_metadata.all_random else Sampler.greedy_sample(processed)
    temperature = sampling_metadata.temperature[request_of_row]
    processed.div_(torch.where(temperature < _GREEDY_BELOW, 1.0, temperature).unsqueeze(1))
    apply_row_min_p(processed, request_of_row, sampling_metadata)
    top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
    processed = apply_top_k_top_p(
        processed,
        None if top_k is None else top_k[request_of_row],
        None if top_p is None else top_p[request_of_row],
    )
    probs = processed.softmax(dim=-1, dtype=torch.float32)
    noise = torch.empty_like(probs).exponential_()
    for request, generator in sampling_metadata.generators.items():
        rows = [row for row, owner in enumerate(owners) if owner == request]
        if rows:
            # A request's rows are consecutive (``row_chunks`` never splits one).
            noise[rows[0]: rows[-1] + 1] = torch.empty(len(rows), probs.shape[1], device=probs.device).exponential_(
                generator=generator
            )
    sampled = sample_with_noise(probs, noise)
    if greedy is None:
        return sampled
    is_greedy = temperature < _GREEDY_BELOW
    return torch.where(is_greedy, greedy, sampled)


def specific_token_logprobs(sampler, values: torch.Tensor, tokens: torch.Tensor, token_ids: dict[int, list[int]],
                            request_of_row: list[int]) -> LogprobsTensors:
    """Rows' logprobs of their emitted token and of their request's
    ``logprob_token_ids`` (``token_ids``: batch index -> ids), through vLLM's
    sampler, in its layout: ``1 + max ids`` columns over the whole batch
    (token id 0 and -inf beyond a request's own ids; only the emitted token
    for requests without ids). vLLM's sampler uses this layout for every
    request of a step in which any request has ids, so those steps' other
    requests get no top logprobs there, with or without the plugin."""
    width = max(len(ids) for ids in token_ids.values())
    rows = {k: token_ids[request] for k, request in enumerate(request_of_row) if request in token_ids}
    gathered = sampler.gather_specific_token_logprobs(values, rows or {0: []}, tokens)
    missing = width + 1 - gathered.logprob_token_ids.shape[1]
    if missing == 0:
        return gathered
    pad = (0, missing)
    return LogprobsTensors(torch.nn.functional.pad(gathered.logprob_token_ids, pad),
                           torch.nn.functional.pad(gathered.logprobs, pad, value=float("-inf")),
                           gathered.selected_token_ranks)


def acceptance_for(device) -> Callable[[TreeBatch, torch.Tensor, torch.Tensor], Acceptance]:
    """How a step's trees are accepted on ``device``: :func:`accept`, or on
    the CPU the native op where it is built (``kernels/tree_acceptance_cpu``:
    the same result, one call instead of accept's torch operations)."""
    op = native_accept() if torch.device(device).type == "cpu" else None
    if op is None:
        return accept
    return lambda tree, row_tokens, ancestors: Acceptance(*op(tree.tokens, tree.parents, tree.num_nodes, row_tokens))


def first_rows(metadata) -> torch.Tensor:
    """Each request's first logits row, on the device without a host list:
    request ``i`` owns ``1 + drafts`` rows, so it starts at the drafts of the
    requests before it plus ``i`` (vLLM's ``cu_num_draft_tokens``, already there)."""
    cu_drafts = metadata.cu_num_draft_tokens.to(torch.long)
    before = torch.nn.functional.pad(cu_drafts[:-1], (1, 0))
    return before + torch.arange(cu_drafts.shape[0], device=cu_drafts.device)


def rejected(first_tokens: torch.Tensor, width: int) -> Acceptance:
    """Trees none of whose nodes is accepted: each request emits
    ``first_tokens`` (its first row's token) alone."""
    batch = first_tokens.shape[0]
    path = torch.full((batch, width), PAD, dtype=torch.long, device=first_tokens.device)
    output = torch.cat([first_tokens.to(torch.long).unsqueeze(1), path], dim=1)
    return Acceptance(torch.zeros(batch, dtype=torch.long, device=first_tokens.device), path, output)


class TreeVerifier(torch.nn.Module):
    """``on_accept(step, acceptance)`` runs right after acceptance (KV
    compaction and statistics), in the same engine step;
    ``request_ids(batch indices)`` names requests for the log; ``device``:
    where the step runs, which picks how trees are accepted (:func:`acceptance_for`). A failure in
    the tree rows' work costs the step's trees, not the engine (``failures``,
    ``request_options``): each tree request then emits the token vLLM's
    sampler drew from its first row, as if it had drafted nothing."""

    def __init__(self, sampler, logprobs_mode: str, on_accept: Callable[[tree_step.TreeStep, Acceptance], None],
                 request_ids: Callable[[list[int]], list[str]], device="cpu"):
        super().__init__()
        self.sampler = sampler
        self.accept = acceptance_for(device)
        self.logprobs_mode = logprobs_mode
        self.on_accept = on_accept
        self.request_ids = request_ids
        self.failures = Failures()

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        device = logits.device
        batch, width = len(metadata.num_draft_tokens), max(metadata.num_draft_tokens) + 1
        starts = first_rows(metadata)
        step = tree_step.current()
        drafted = [i for i, n in enumerate(metadata.num_draft_tokens) if n]
        # vLLM's sampler on each request's one row: its bonus row, or for a request with drafts
        # (a tree or vLLM's placeholders) its first row, a copy (the sampler processes the rows
        # it is given in place; logprobs are read from ``logits`` after it). A tree's token is its
        # tree's acceptance; this one stands where the tree's rows fail (``_accepted_trees``).
        plain = self.sampler(
            logits=logits[self._plain_rows(metadata, starts)],
            sampling_metadata=self._without_drafts(sampling_metadata, drafted),
            predict_bonus_token=True,
        )
        output = torch.full((batch, width), PAD, dtype=torch.int32, device=device)
        output[:, 0] = plain.sampled_token_ids[:, 0].to(torch.int32)
        acceptance = None
        if step is not None and step.trees:
            acceptance = self.failures.run(
                "verifying tree rows", self.request_ids(step.host_batch_indices),
                lambda: self._accepted_trees(metadata, logits, sampling_metadata, step),
                lambda: rejected(output.index_select(0, step.batch_indices)[:, 0], step.tree_batch.width))
            # A step's widest drafts may be a placeholder request's, wider than every tree;
            # scattered, so that the same operations run whatever the step's shapes.
            offsets = torch.arange(step.tree_batch.width + 1, device=device)
            rows = output.index_select(0, step.batch_indices).scatter_(
                1, offsets.expand(step.batch_indices.shape[0], -1), acceptance.output_tokens.to(torch.int32))
            output.index_copy_(0, step.batch_indices, rows)
            self.on_accept(step, acceptance)

        logprobs = None
        if sampling_metadata.max_num_logprobs is not None or sampling_metadata.logprob_token_ids:
            logprobs = self._logprobs(logits, starts, output, step, acceptance, sampling_metadata)
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs)

    def _accepted_trees(self, metadata, logits, sampling_metadata, step) -> Acceptance:
        """Each tree's accepted path: every tree row's target (processed as
        vLLM's sampler processes a row, ``tree_row_targets``) walked by ``accept``."""
        device = logits.device
        tree_batch = step.tree_batch
        # The tree requests' own rows, request after request.
        host_counts = [metadata.num_draft_tokens[i] + 1 for i in step.host_batch_indices]
        host_starts = list(itertools.accumulate((n + 1 for n in metadata.num_draft_tokens), initial=0))
        histories = RowHistories.of(step, step.host_batch_indices, host_counts, sampling_metadata, logits.shape[1])
        targets = tree_row_targets(logits, host_starts, step.host_batch_indices, host_counts, sampling_metadata,
                                   histories)
        first = to_device(list(itertools.accumulate(host_counts, initial=0))[:-1], torch.long, device)
        # [trees, width + 1] for acceptance: root and nodes (a uniform step's padding rows
        # follow them); a tree's empty slots repeat its last node's target.
        offsets = torch.arange(tree_batch.width + 1, device=device)
        local = torch.minimum(offsets.unsqueeze(0), tree_batch.num_nodes.unsqueeze(1))
        return self.accept(tree_batch, targets[first.unsqueeze(1) + local], step.ancestors)

    @staticmethod
    def _plain_rows(metadata, starts) -> torch.Tensor:
        """The row vLLM's sampler samples for each request: the bonus row,
        except for a request with drafts, whose token comes from its first
        row (the rows after it were fed its drafts); on the device, the same
        operations whatever the step's drafts."""
        bonus = metadata.bonus_logits_indices
        return torch.where(bonus > starts, starts.to(bonus.dtype), bonus)

    @staticmethod
    def _without_drafts(sampling_metadata, drafted: list[int]):
        """``sampling_metadata`` with no spec tokens for requests with
        drafts: vLLM's sampler appends a request's spec tokens to its output
        history for penalties and bad words, and a request whose token comes
        from its first row has no history after it."""
        spec = sampling_metadata.spec_token_ids
        if not drafted or not spec:
            return sampling_metadata
        cleared = set(drafted)
        return replace(sampling_metadata, spec_token_ids=[[] if i in cleared else s for i, s in enumerate(spec)])

    def _logprobs(self, logits, starts, output, step, acceptance, sampling_metadata):
        """Logprobs of every output slot, from the row that emitted it: slot 0
        from the root row, slot ``j`` from the row of the ``j``-th path node;
        in the layout vLLM's sampler gives the step: the top
        ``max_num_logprobs``, or, where any request asks for
        ``logprob_token_ids``, those ids for every request (vLLM's precedence
        for the whole batch, see :func:`specific_token_logprobs`).

        Decision: only emitted slots are computed (vLLM drops the rest, a
        placeholder's), ``MAX_CHUNK_ROWS`` at a time; the others stay zero.
        Each row takes two float32 copies of the vocabulary (the row, its
        log-softmax) and a compare mask of it: every slot of 32 requests x 17
        at once raised a server's resident memory by 0.2 GB in one step, which
        its allocator kept."""
        batch, width = output.shape
        rows = starts.unsqueeze(1).expand(batch, width).clone()
        if acceptance is not None:
            path_rows = torch.where(acceptance.path >= 0, acceptance.path + 1, 0)
            emitted = torch.cat([torch.zeros_like(path_rows[:, :1]), path_rows], dim=1)[:, :width]
            rows[step.batch_indices, : emitted.shape[1]] += emitted
        tokens = output.flatten().to(torch.int64)
        slots = (tokens != PAD).nonzero().squeeze(1)
        rows = rows.flatten()[slots]
        specific = sampling_metadata.logprob_token_ids
        requests = (slots // width).tolist() if specific else None
        pieces = []
        for begin in range(0, slots.numel(), MAX_CHUNK_ROWS):
            selected = logits[rows[begin: begin + MAX_CHUNK_ROWS]].to(torch.float32)
            values = selected if self.logprobs_mode == "raw_logits" else self.sampler.compute_logprobs(selected)
            chunk_tokens = tokens[slots[begin: begin + MAX_CHUNK_ROWS]]
            if specific:
                pieces.append(specific_token_logprobs(self.sampler, values, chunk_tokens, specific,
                                                      requests[begin: begin + MAX_CHUNK_ROWS]))
            else:
                pieces.append(self.sampler.gather_logprobs(values, sampling_metadata.max_num_logprobs, chunk_tokens))
        return LogprobsTensors(*(
            torch.zeros((batch * width, *part[0].shape[1:]), dtype=part[0].dtype, device=part[0].device)
            .index_copy_(0, slots, torch.cat(part))
            for part in zip(*(piece[:3] for piece in pieces))
        ))
